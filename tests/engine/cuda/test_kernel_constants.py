"""The facts the CUDA sources and the Python code both hold agree (CPU only: the sources are parsed, not compiled).

Each enum and ``#define`` shared with Python is read from kernels/*.cu, *.cuh and compared with its Python copy;
and no kernel file defines a concept another one already does (one mask-kind enum, one FLOAT32_LOWEST).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from mha_ep import launch, limits
from mha_ep.engine import problem
from mha_ep.engine.cuda import dispatch, fused, gemv, shared_buffer, split_keys
from mha_ep.engine.cuda.kernels import INSTANTIATED, KERNEL_DIR, KERNELS

SOURCES = sorted(KERNEL_DIR.glob("*.cu")) + sorted(KERNEL_DIR.glob("*.cuh"))
DEFINE = re.compile(r"^#define (\w+) (.+?)\s*(?://.*)?$", re.MULTILINE)
ENUM = re.compile(r"^enum (\w+) \{([^}]*)\};", re.MULTILINE)


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def defines() -> dict[str, tuple[str, str]]:
    """name -> (value text, file) of every #define of the kernel sources."""
    found = {}
    for path in SOURCES:
        for name, value in DEFINE.findall(path.read_text()):
            found.setdefault(name, (value.strip(), path.name))
    return found


def enums() -> dict[str, dict[str, int]]:
    found = {}
    for path in SOURCES:
        for name, body in ENUM.findall(_strip_comments(path.read_text())):
            members = [m.split("=") for m in body.replace("\n", " ").split(",") if m.strip()]
            found[name] = {key.strip(): int(value) for key, value in members}
    return found


def define_value(name: str) -> float:
    """A numeric #define, its references to other defines substituted, evaluated."""
    table = defines()
    text = table[name][0]
    for other, (value, _) in table.items():
        text = re.sub(rf"\b{other}\b", f"({value})", text)
    text = re.sub(r"(?<=\d)(f|LL)\b", "", text)
    return eval(text, {"__builtins__": {}})  # noqa: S307 - digits, operators and parentheses from our sources


def test_one_definition_per_define_and_enum_across_the_kernel_files():
    seen: dict[str, list[str]] = {}
    for path in SOURCES:
        text = _strip_comments(path.read_text())
        for name in re.findall(r"^#define (\w+)", text, re.MULTILINE) + re.findall(r"^enum (\w+)", text, re.MULTILINE):
            seen.setdefault(name, []).append(path.name)
    assert {name: files for name, files in seen.items() if len(files) > 1} == {}


def test_the_mask_kind_enum_matches_python():
    assert enums()["MaskKind"] == {f"MASK_{kind.name}": kind.value for kind in launch.MaskKind}
    assert [launch.MaskKind.of(kind) for kind in (None, "key_lengths", "keys_BT", "keys_BST")] == list(launch.MaskKind)


def test_the_device_error_enum_matches_python():
    """kernels/shared_buffer.cu's reports, launch.DeviceError, and the native library's C copy (csrc/native.h)."""
    from harness import REPO

    assert enums()["DeviceError"] == {("DEVICE_OK" if e.name == "OK" else e.name): e.value for e in launch.DeviceError}
    native_source = (REPO / "mha_ep" / "native" / "csrc" / "native.h").read_text()
    for error in launch.DeviceError:
        name = "DEVICE_OK" if error.name == "OK" else error.name
        assert re.search(rf"\b{name} = {error.value}\b", native_source), name
    assert re.search(rf"#define STATUS_WORDS {launch.STATUS_WORDS}\b", native_source)


def test_the_feature_bits_match_python():
    assert enums()["FlashFeatures"] == {
        "FLASH_PLAIN": 0, "FLASH_WITH_PADDING": dispatch.FEATURE_PADDING, "FLASH_WITH_BIAS": dispatch.FEATURE_BIAS,
        "FLASH_WITH_KEY_OFFSET": dispatch.FEATURE_KEY_OFFSET,
    }  # fmt: skip


@pytest.mark.parametrize(
    "define, python",
    [
        ("SOFTMAX_THREADS", launch.SOFTMAX_THREADS),
        ("SHARED_BUFFER_THREADS", launch.SHARED_BUFFER_THREADS),
        ("STATUS_WORDS", launch.STATUS_WORDS),
        ("U32_LIMIT", limits.U32_MAX),
        ("SMEM_PAD", fused.MMA_SMEM_PAD),
        ("LOAD_CHUNK", dispatch.HEAD_SIZE_MULTIPLE),
        ("F32_BLOCK_M", fused.FP32_BLOCK_M),
        ("F32_BLOCK_N", fused.FP32_BLOCK_N),
        ("F32_LDT", fused.FP32_LDT),
        ("WS_STAGES", fused.WS_STAGES),
        ("WARPGROUP_THREADS", dispatch.WARPGROUP_THREADS),
        ("WARPGROUP_ROWS", dispatch.WARPGROUP_ROWS),
        ("SPLIT_THREADS", split_keys.SPLIT_THREADS),
        ("TILE_SPLITS_MAX", dispatch.WS_TAIL_MAX_SPLITS),
        ("TILE_COMBINE_WARPS", split_keys.TILE_COMBINE_WARPS),
        ("SPLIT_MAX_ROWS", dispatch.SPLIT_MAX_ROWS),
        ("SPLIT_MAX_DIM", dispatch.SPLIT_MAX_DIM),
        ("STREAM_STAGES", dispatch.STREAM_STAGES),
        ("STREAM_BLOCKS_PER_SM", dispatch.STREAM_BLOCKS_PER_SM),
        ("STAGE_LOADS", shared_buffer.STAGE_LOADS),
        ("GEMV_ROWS", gemv.GEMV_ROWS),
        ("GEMV_WARPS", gemv.GEMV_WARPS),
        ("GEMV_MAX_M", gemv.GEMV_MAX_M),
    ],
)
def test_integer_defines_match_python(define, python):
    assert define_value(define) == python


def test_float_defines_match_python():
    assert np.float32(define_value("FLOAT32_LOWEST")) == np.float32(problem.FLOAT32_LOWEST)  # as the kernel reads it
    assert define_value("LOG2E") == pytest.approx(math.log2(math.e), rel=1e-15)


def test_the_decode_loop_kernels_constants_match_python():
    """mha_ep/decode/decode.cu (the token choice of the static decode loop) and static_decode.py."""
    from mha_ep.decode import beam, static_decode

    text = static_decode.KERNEL_FILE.read_text()
    found = {name: int(value) for name, value in DEFINE.findall(text) if value.strip().isdigit()}
    assert found["DECODE_THREADS"] == static_decode.DECODE_THREADS
    assert found["GREEDY_THREADS"] == static_decode.GREEDY_THREADS
    assert found["MAX_CANDIDATES"] == static_decode.MAX_CANDIDATES == beam.MAX_BEAMS + 1
    for kernel in ("greedy_step", "beam_rows", "beam_select"):
        assert re.search(rf"\b{kernel}\s*\(", text), kernel


def test_every_kernel_python_launches_is_defined_in_its_source():
    for kernel, (source, _) in {**KERNELS, **INSTANTIATED}.items():
        assert re.search(rf"\b{kernel}\s*\(", (KERNEL_DIR / source).read_text()), (kernel, source)
    assert set(launch.ELEMENT_TYPES.values()) == {"float", "__half", "__nv_bfloat16"}
