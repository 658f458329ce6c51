"""The fused kernels' sources, read as text and compiled offline: 64-bit index promotion, the semantics spelled out
in the header, generated wrappers, inlined headers, and nvcc builds without spills (skipped without nvcc)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from mha_ep.launch import ELEMENT_TYPES
from mha_ep.engine.cuda import dispatch, fused

from cuda_cases import make_problem
from fused_cases import Case, CODE, KERNEL_DIR, SOURCE, WGMMA_DEFAULT_CASES, kernel_parameters
from harness import REPO


@pytest.mark.parametrize(
    "required",
    [
        "(long long)b * stride_qb + (long long)h * stride_qh + (long long)m0 * stride_qs",
        "(long long)b * stride_kb + (long long)h * stride_kh",
        "(long long)b * stride_vb + (long long)h * stride_vh",
        "(long long)n0 * stride_vs",
        "(long long)n0 * stride_ks",
        "(long long)row0 * stride + col",
        "(long long)first * stride_s",
        "(long long)r * stride_s + d0",
        "(((long long)b * q_seq + rows[r]) * heads + h) * v_head_size",
        "(((long long)b * q_seq + row) * heads + h) * v_head_size",
        "(((long long)bb * bias_d1 + bn) * q_seq + m0) * total_seq",
        "bias_rows + (long long)r * total_seq + n0 + col",
        "(((long long)bb * p.bias_d1 + bn) * p.q_seq + i) * p.total_seq",
        "p.keep + (long long)b * p.total_seq",
        "p.keep + ((long long)b * p.q_seq + i) * p.total_seq",
        "(long long)h * head_size",
        "(long long)h * v_head_size",
        "(long long)blockIdx.x / q_tiles",
    ],
)
def test_flash_attention_promotes_before_every_global_product(required):
    assert required in CODE, f"flash_attention.cu must promote before multiplying: {required}"


def test_flash_attention_strides_are_64_bit_parameters():
    strides = re.findall(r"(\w+(?:\s+\w+)?)\s+(stride_[qkv][bhs])\b", CODE)
    declared = {(kind, name) for kind, name in strides if kind in ("long long", "int", "unsigned")}
    assert declared and all(kind == "long long" for kind, _ in declared), declared
    for line in CODE.splitlines():  # every product with a stride starts from a 64-bit factor
        if re.search(r"\*\s*stride_", line):
            assert "(long long)" in line, f"int product with a stride: {line.strip()}"


def test_flash_attention_never_casts_an_int_product():
    pattern = re.compile(r"\(\s*(?:long long|int64_t|size_t)\s*\)\s*\([^()]*\*")
    assert not pattern.findall(CODE)


def test_flash_attention_subscripts_with_products_are_64_bit():
    """Every subscript with a product indexes in 64 bits, except those of register arrays (fixed small sizes)."""
    long_long_names = set(re.findall(r"long long\s+(\w+)", CODE))
    register_arrays = set(re.findall(r"\b(?:float|unsigned)\s+(\w+)\[", CODE))
    offenders = [
        (array, sub)
        for array, sub in re.findall(r"(\w+)\[([^\[\]]*\*[^\[\]]*)\]", CODE)
        if array not in register_arrays
        and "(long long)" not in sub
        and not any(re.search(rf"\b{var}\b", sub) for var in long_long_names)
    ]
    assert not offenders, offenders


def test_flash_attention_semantics_are_spelled_out():
    """Named constants and the ORT-specific rules are in the kernel (guards against a silent simplification)."""
    assert "#define LOG2E 1.4426950408889634f" in CODE
    assert "x += FLOAT32_LOWEST;" in CODE  # causal: lowest in the additive mask, replacing padding
    assert "x += p.mask_filter_value;" in CODE  # padding: added, never substituted
    assert "i < p.q_seq - 1 && j > p.past_seq + i" in CODE  # ORT CPU's causal rows and offset
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in CODE
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in CODE
    assert CODE.count("masked_logit_per_key(x, mp, masks[r], rows[r], j)") == 2  # both tensor-core kernels
    assert "fence.proxy.async.shared::cta" in CODE  # cp.async writes made visible to wgmma's async proxy


def test_the_fused_kernels_share_one_parameter_list_and_one_copy_of_the_tile_steps():
    """flash_common.cuh's FLASH_KERNEL_PARAMETERS is every fused kernel's parameter list, and the tile steps of
    flash_tile.cuh / wgmma_common.cuh are not written out again in a kernel (scripts/ptx_identity.py showed the
    move changed no PTX)."""
    assert SOURCE.count("long long stride_qb") == 1, "one parameter list: FLASH_KERNEL_PARAMETERS"
    kernels = {"flash_attention_mma": "IN", "flash_attention_fp32": "IN", "flash_attention_wgmma": "ELEM",
               "flash_attention_ws": "ELEM", "split_key_attention": "IN", "split_key_stream": "IN"}  # fmt: skip
    for kernel, operand in kernels.items():
        assert f"{kernel}(FLASH_KERNEL_PARAMETERS({operand})" in SOURCE, kernel
    steps = ("__syncthreads_and(row_max[0] > CAUSAL_SKIP_MAX_FLOOR", "tm.padding == TILE_PAD_ALL",
             "tile_max[r] = padded_logit(", "part_max[0][i % 4] = fmaxf(",
             "p[kt][3] = zero ? 0u : Ops<ELEM, BLOCK_N>::pack(",
             # split_keys.cu: both split kernels' steps (split_key_attention's and split_key_stream's blocks)
             "const float logit = masked_logit_per_key(x, sc.mp, m, i, j);", "const float p = exp2f((x_row[jj]",
             "o[i][e] = fmaf(p[i], vr, o[i][e]);", "static_cast<ELEM*>(out_narrow_BSD)[out_row + d] =",
             # combine_tile_splits' (flash_attention_ws's tail split)
             "static_cast<ELEM*>(out_narrow_BSD)[at] = from_float<ELEM>(x);")  # fmt: skip
    for step in steps:
        assert SOURCE.count(step) == 1, step


def test_wgmma_wrappers_are_generated():
    """kernels/wgmma_ops.cuh is what scripts/gen_wgmma_ops.py writes (edit the script, not the header)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_wgmma_ops.py"), "--check"], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_kernel_sources_inline_every_local_header():
    """What NVRTC compiles is one self-contained text: no local #include is left, each header once."""
    from mha_ep.engine.cuda.kernels import INSTANTIATED, kernel_source

    for name in sorted({file for file, _ in INSTANTIATED.values()}):
        text = kernel_source(name)
        assert not re.search(r'^#include "', text, re.MULTILINE), name
        assert text.count("struct MaskParams {") == (0 if name == "gemv.cu" else 1)  # flash_common.cuh, once
        assert text.count("__device__ __forceinline__ T from_float(float x);") == 1  # common.cuh, once


def ptxas_report(tmp_path, lines: list, arch: str = "sm_90a") -> subprocess.CompletedProcess:
    """``lines`` as one translation unit compiled for ``arch`` with ptxas's per-kernel report (-Xptxas -v, on
    stderr); asserts that it compiled."""
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        ["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", f"-I{KERNEL_DIR}", str(unit), "-o",
         str(tmp_path / "a.cubin")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def assert_no_spills(report: str, kernels: int) -> None:
    """ptxas's report names ``kernels`` kernels, none of which spills a register."""
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == kernels and all(int(count) == 0 for count in spills), report


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])  # the H100 / H200, and the oldest GPU the kernels take
def test_split_key_and_decode_loop_kernels_compile_without_spills(tmp_path, arch):
    """Every instantiation of split_keys.cu (fused.fused_steps: both split kernels) and of the decode loop's
    decode.cu (static_decode.py) that Python launches, for sm_90a and sm_80: no error, no register spill."""
    from mha_ep.decode.static_decode import DECODE_EXPRESSIONS, KERNEL_FILE

    elements = ("float", "__half", "__nv_bfloat16")
    names = [f"{kernel}<{e}, {s}>" for kernel in ("split_key_stream", "split_key_attention") for e in elements
             for s in sorted({"float", e})]  # fmt: skip
    names += [f"combine_key_splits<{e}>" for e in elements] + ["zero_after_prior_grids<unsigned>"]
    names += [f"combine_tile_splits<{e}>" for e in elements]  # flash_attention_ws's tail (fused.ws_tail_steps)
    names += list(DECODE_EXPRESSIONS)
    lines = ['#include "split_keys.cu"', f'#include "{KERNEL_FILE}"', "void* instances[] = {"]
    lines += [f"  (void*){name}," for name in names] + ["};"]
    done = ptxas_report(tmp_path, lines, arch)
    compiled = re.findall(r"Compiling entry function '(\w+)'", done.stderr)
    assert len(compiled) == len(names), compiled
    assert_no_spills(done.stderr, len(names))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_decode_matmul_kernel_compiles_without_spills(tmp_path, arch):
    """Every gemv_rows instantiation gemv.py launches (float16 / bfloat16, 1..GEMV_MAX_M rows of x)."""
    from mha_ep.engine.cuda.gemv import GEMV_DTYPES, GEMV_MAX_M
    from mha_ep.launch import ELEMENT_TYPES

    names = [f"gemv_rows<{ELEMENT_TYPES[d]}, {m}>" for d in GEMV_DTYPES for m in range(1, GEMV_MAX_M + 1)]
    lines = ['#include "gemv.cu"', "void* instances[] = {"] + [f"  (void*){name}," for name in names] + ["};"]
    done = ptxas_report(tmp_path, lines, arch)
    assert len(re.findall(r"Compiling entry function '(\w+)'", done.stderr)) == len(names)
    assert_no_spills(done.stderr, len(names))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_flash_attention_compiles_with_nvcc(tmp_path):
    """A few of the instantiations fused.py asks NVRTC for, compiled for sm_90a (offline check)."""
    names = [
        "flash_attention_mma<__half, __half, 64, 128, 64, 0>",
        "flash_attention_mma<__half, __half, 64, 64, 64, 3>",
        "flash_attention_mma<__half, __half, 128, 64, 64, 5>",  # key / query offsets (dispatch.score_terms)
        "flash_attention_mma<__nv_bfloat16, float, 96, 64, 64, 0>",
        "flash_attention_fp32<float, float, 64, 4, 8, 1, 3>",
        "flash_attention_fp32<float, float, 128, 4, 8, 2, 1>",
        "flash_attention_wgmma<__half, 64, 64, 128, 0, true>",
        "flash_attention_wgmma<__nv_bfloat16, 128, 128, 64, 3, false>",
        "flash_attention_wgmma<__half, 64, 64, 64, 5, true>",
        "flash_attention_wgmma<__nv_bfloat16, 128, 64, 128, 7, false>",
        "flash_attention_ws<__half, 128, 128, 2, false>",
        "flash_attention_ws<__nv_bfloat16, 64, 64, 2, false>",
        "flash_attention_ws<__half, 64, 128, 3, true>",
    ]
    lines = ['#include "flash_attention.cu"', '#include "flash_attention_wgmma.cu"', '#include "flash_attention_ws.cu"']
    for name in names:
        source_type = "float" if ", float, " in name or name.startswith("flash_attention_fp32") else name.split("<")[1].split(",")[0]
        if name.startswith(("flash_attention_wgmma", "flash_attention_ws")):  # (operands in the call's dtype)
            source_type = name.split("<")[1].split(",")[0]
        lines.append(f"template __global__ void {name}({kernel_parameters(source_type, name)});")
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", f"-I{KERNEL_DIR}", str(unit), "-o", str(tmp_path / "a.cubin")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_head_160_instantiations_compile_without_spills(tmp_path):
    """Stable Diffusion 1.5's widest head (H 160, dispatch.HEAD_DIM_TILES): the instantiations fused.kernel_name
    asks for at float16, bfloat16 and float32, with and without a padding mask, for sm_90a: no spilled register."""
    from mha_ep.engine.cuda.dispatch import MmaTile

    cases = [(make_problem(Case(h=160, mask=mask), dtype), dtype) for dtype in ("float16", "bfloat16", "float32")
             for mask in (None, "lengths")]  # fmt: skip
    names = sorted({fused.kernel_name(problem, dtype, None if dtype == "float32" else MmaTile())
                    for problem, dtype in cases})  # fmt: skip
    assert all(", 160, " in name for name in names), names
    lines = ['#include "flash_attention.cu"']
    for name in names:
        source_type = name.split("<")[1].split(",")[1].strip()
        lines.append(f"template __global__ void {name}({kernel_parameters(source_type, name)});")
    assert_no_spills(ptxas_report(tmp_path, lines).stderr, len(names))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_defaults_compile_without_spills_or_serialized_wgmma(tmp_path, dtype):
    """ptxas's verdict on the instantiations choose_tile picks on an H200: no spilled registers, and none of the
    'Potential Performance Loss' advisories (C7510-C7520) that mean every wgmma of the kernel is serialized
    (a wgmma on a divergent path, too few registers: each cost the 4096 row tens of percent when it happened)."""
    names = sorted({fused.kernel_name(problem, dtype, dispatch.choose_tile(problem, dtype, dispatch.HOPPER_CAPABILITY))
                    for problem in (make_problem(case, dtype) for case in WGMMA_DEFAULT_CASES.values())})  # fmt: skip
    elem = ELEMENT_TYPES[dtype]
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(['#include "flash_attention_wgmma.cu"', '#include "flash_attention_ws.cu"'] +
                              [f"template __global__ void {name}({kernel_parameters(elem, name)});"
                               for name in names]) + "\n")  # fmt: skip
    done = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", f"-I{KERNEL_DIR}", str(unit), "-o",
         str(tmp_path / "a.cubin")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = done.stdout + done.stderr
    assert "Performance Loss" not in report, report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(names) and all(s == ("0", "0") for s in spills), (names, spills)
