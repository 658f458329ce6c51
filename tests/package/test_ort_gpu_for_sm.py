"""scripts/ort_gpu_for_sm.py on a small made-up wheel: an ELF library whose .nv_fatbin holds cubins of two
architectures. The kept architecture's bytes and every other file come back unchanged, the other architecture's
payloads are zeros at the same offsets, the pieces join to their SHA-256, and a library without the asked
architecture is refused. Of the kept architecture, a cubin (zstd-compressed as CUDA 13 writes them, or a plain
ELF) whose every kernel is a Mixture-of-Experts GEMM is zeroed too, unless --keep-moe; one with any other kernel,
or that cannot be read, stays."""

import hashlib
import importlib.util
import io
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ort_gpu_for_sm", REPO / "scripts" / "ort_gpu_for_sm.py")
ort_gpu_for_sm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ort_gpu_for_sm)

ENTRY_HEADER = 64


def fatbin(payloads) -> bytes:
    """One fatbin: its header, then an entry (kind 2: a cubin) per (sm, payload)."""
    body = b""
    for sm, payload in payloads:
        header = bytearray(ENTRY_HEADER)
        struct.pack_into("<HHII", header, 0, 2, 0x101, ENTRY_HEADER, len(payload))
        struct.pack_into("<I", header, ort_gpu_for_sm.SM_AT, sm)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", ort_gpu_for_sm.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_library(section_data: bytes) -> bytes:
    """A minimal ELF64 little-endian file: a text-ish prefix, .nv_fatbin, .shstrtab and the section headers."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    prefix = b"\x90" * 100
    fat_at = 64 + len(prefix)
    names_at = fat_at + len(section_data)
    shoff = names_at + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)

    def section_header(name, offset, size):
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 8, 0)

    sections = section_header(0, 0, 0) + section_header(1, fat_at, len(section_data)) + section_header(
        12, names_at, len(names))
    return bytes(header) + prefix + section_data + names + sections


def wheel(library: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(ort_gpu_for_sm.CUDA_LIBRARY, library)
        z.writestr("onnxruntime/__init__.py", "version = 1\n")
        z.writestr(ort_gpu_for_sm.LEFT_OUT[0], b"trt")
    return buffer.getvalue()


def test_other_architectures_are_zeroed_in_place_and_the_pieces_join_to_their_hash(tmp_path):
    rng = np.random.default_rng()
    sm80, sm90, sm90b = (rng.integers(1, 256, n, dtype=np.uint8).tobytes() for n in (4000, 3000, 1000))
    section = fatbin([(80, sm80), (90, sm90)]) + bytes(8) + fatbin([(90, sm90b), (80, sm80)])  # padding between
    library = elf_library(section)
    source = tmp_path / "ort.whl"
    source.write_bytes(wheel(library))
    out = tmp_path / "pieces"
    assert ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(out), "--piece-mb", "0.002"]) == 0
    pieces = sorted(out.glob("a*"), key=lambda p: int(p.name[1:]))
    assert len(pieces) > 1, "the piece size splits the pack"
    packed = b"".join(p.read_bytes() for p in pieces)
    assert hashlib.sha256(packed).hexdigest() == (out / "SHA256").read_text().strip()
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:xz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert set(files) == {ort_gpu_for_sm.CUDA_LIBRARY, "onnxruntime/__init__.py"}  # TensorRT's library left out
    assert files["onnxruntime/__init__.py"] == b"version = 1\n"
    cut = files[ort_gpu_for_sm.CUDA_LIBRARY]
    assert len(cut) == len(library)
    kept = [(at, size, sm) for at, size, _, sm in ort_gpu_for_sm.fatbin_entries(cut)]
    assert [sm for _, _, sm in kept] == [80, 90, 90, 80]
    for at, size, sm in kept:
        expected = {90: library[at:at + size]}.get(sm, bytes(size))
        assert cut[at:at + size] == expected, sm
    changed = [i for i in range(len(library)) if cut[i] != library[i]]
    inside_80 = [(at, at + size) for at, size, sm in kept if sm == 80]
    assert all(any(a <= i < b for a, b in inside_80) for i in changed)


def cubin(*kernels: bytes) -> bytes:
    """A stand-in cubin: an ELF magic and a .text.<name> section name per kernel, among random bytes."""
    rng = np.random.default_rng()
    body = b"".join(b"\0.text." + name + b"\0" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
                    for name in kernels)
    return b"\x7fELF" + body


def zstd(data: bytes) -> bytes:
    import zstandard

    frame = zstandard.ZstdCompressor().compress(data)
    return frame + bytes(-len(frame) % 8)  # a fatbin pads its payloads


MOE = b"_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE"
GEMV = b"_ZN11onnxruntime3llm7kernels8moe_gemv22moe_gemv_kernelINS2_13KernelDetailsEEEvv"
STUB = b"_ZN3cub38CUB_300001_SM_750_800_860_890_900_12006detail11EmptyKernelIvEEvv"
FLASH = b"_ZN11onnxruntime5flash16flash_fwd_kernelINS0_23Flash_fwd_kernel_traitsILi128ELi128ELi64ELi4EEEvv"


@pytest.mark.parametrize("keep_moe", [False, True], ids=["moe zeroed", "--keep-moe"])
def test_the_kept_architecture_s_moe_cubins_are_zeroed_and_no_other(tmp_path, keep_moe):
    rng = np.random.default_rng()
    payloads = {
        "moe zstd": zstd(cubin(MOE, STUB, GEMV)),
        "moe elf": cubin(GEMV),
        "mixed zstd": zstd(cubin(MOE, FLASH)),
        "stub only": zstd(cubin(STUB)),
        "flash elf": cubin(FLASH, STUB),
        "unreadable": rng.integers(1, 256, 512, dtype=np.uint8).tobytes(),
    }
    library = elf_library(fatbin([(90, p) for p in payloads.values()] + [(80, cubin(MOE))]))
    source = tmp_path / "ort.whl"
    source.write_bytes(wheel(library))
    out = tmp_path / "pieces"
    options = ["--keep-moe"] if keep_moe else []
    assert ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(out), *options]) == 0
    with tarfile.open(fileobj=io.BytesIO((out / "a0").read_bytes()), mode="r:xz") as tar:
        cut = tar.extractfile(ort_gpu_for_sm.CUDA_LIBRARY).read()
    entries = ort_gpu_for_sm.fatbin_entries(cut)
    zeroed = {name for name, (at, size, _, _) in zip(payloads, entries) if cut[at:at + size] == bytes(size)}
    assert zeroed == (set() if keep_moe else {"moe zstd", "moe elf"})
    for name, (at, size, _, _) in zip(payloads, entries):
        if name not in zeroed:
            assert cut[at:at + size] == library[at:at + size], name


def test_the_c_api_library_is_left_out_and_the_rest_of_the_package_kept(tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(ort_gpu_for_sm.CUDA_LIBRARY, elf_library(fatbin([(90, cubin(FLASH))])))
        z.writestr("onnxruntime/capi/libonnxruntime.so.1.31.1", b"c api")
        z.writestr("onnxruntime/capi/libonnxruntime_providers_shared.so", b"shared")
        z.writestr("onnxruntime/capi/onnxruntime_pybind11_state.cpython-312-x86_64-linux-gnu.so", b"module")
    source = tmp_path / "ort.whl"
    source.write_bytes(buffer.getvalue())
    assert ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(tmp_path / "out")]) == 0
    with tarfile.open(fileobj=io.BytesIO((tmp_path / "out" / "a0").read_bytes()), mode="r:xz") as tar:
        names = set(tar.getnames())
    assert names == {ort_gpu_for_sm.CUDA_LIBRARY, "onnxruntime/capi/libonnxruntime_providers_shared.so",
                     "onnxruntime/capi/onnxruntime_pybind11_state.cpython-312-x86_64-linux-gnu.so"}


def test_a_library_without_the_asked_architecture_is_refused(tmp_path):
    source = tmp_path / "ort.whl"
    source.write_bytes(wheel(elf_library(fatbin([(80, b"\1" * 64)]))))
    with pytest.raises(SystemExit, match="no sm_90 cubin"):
        ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
