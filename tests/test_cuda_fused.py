"""The fused attention kernels (kernels/flash_attention*.cu; cuda/dispatch.py chooses, cuda/fused.py launches) against
the reference semantics.

CPU tests: the dispatch rule's reasons and the kernel choice (flash_attention_wgmma on compute capability 9.0,
flash_attention_mma elsewhere), a 64-bit index audit of the fused kernels' sources, and an nvcc compile of a few
instantiations (skipped without nvcc). On an H200, dense f16/bf16 operands run flash_attention_wgmma by default;
the mma kernel is run there by naming its tile. GPU tests (marked gpu; skipped cleanly without CuPy or a GPU) launch
``run_fused`` directly on device copies of a problem's inputs, in two operand forms:
  "staged": the float32 arrays as the op received them (BSNH, or BNSH key/value), bias added on load, rounded to
            the call's dtype in the kernel (what the backend stages);
  "dense":  q_BNSH / k_BNTH / v_BNTH in the call's dtype with bias and past applied (what the layout mover builds);
  "dense_BSNH": the same values in BSNH (the strided reads of flash_attention_ws's 4D TMA maps).
Every output is poisoned with NaN first. Tolerances:
  float32   vs run_reference:          |fused - ref| <= 1e-5 * max(1, |ref|)
  float16   vs run_reference:          |fused - ref| <= 4e-3 * max(1, |ref|)
  bfloat16  vs run_reference(float64): err(fused) <= 2 * err(naive bf16 implementation) + 1e-4
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import cuda_cases
from cuda_cases import Case, dense_operands, naive_low_precision, to_device
from mha_ep.launch import ELEMENT_TYPES
from mha_ep.ops.backends.cuda import dispatch, fused
from mha_ep.ops.backends.reference import run_reference, to_BNSH
from mha_ep.ops.problem import FLOAT32_LOWEST, MhaProblem, build_problem

KERNEL_DIR = Path(fused.__file__).parent / "kernels"
FUSED_FILES = ("flash_attention.cu", "flash_common.cuh", "wgmma_common.cuh", "flash_attention_wgmma.cu",
               "flash_attention_ws.cu")  # the fused kernels' code
SOURCE = "\n".join((KERNEL_DIR / name).read_text() for name in FUSED_FILES)
REPO = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "float16", "bfloat16")
RELATIVE_TOLERANCE = {"float32": 1e-5, "float16": 4e-3}
BF16_NOISE_FLOOR = 1e-4


# ----------------------------------------------------------------------------------------------- problems
def make_problem(case: Case, dtype: str) -> MhaProblem:
    """Presents are wanted exactly when there is a past (ORT needs both presents with a past, docs/SEMANTICS.md §3.9)."""
    return cuda_cases.make_problem(case, dtype, presents=case.p is not None)


# ------------------------------------------------------------------------------------------------ GPU harness
def run_fused_on_gpu(cupy, problem: MhaProblem, form: str, tile=None) -> np.ndarray:
    """Output (B, S, Dv) float32 of the fused kernel on device copies of ``problem`` in operand ``form``."""
    g = problem.geometry
    keep = []  # device arrays stay alive until the kernel is done

    def dev(array, dtype="float32"):
        if array is None:
            return None
        device_array = to_device(cupy, array, dtype)
        keep.append(device_array)
        return device_array.data.ptr

    offset_args = {}
    if form == "staged":
        assert problem.past_key_BNPH is None, "a past needs the dense form"
        kv_seq = g.kv_seq
        q = fused.Operand(dev(problem.query_BSD), "BSNH", g.q_seq, g.head_size, dev(problem.bias_q))
        k = fused.Operand(dev(problem.key), problem.kv_layout, kv_seq, g.head_size, dev(problem.bias_k))
        v = fused.Operand(dev(problem.value), problem.kv_layout, kv_seq, g.v_head_size, dev(problem.bias_v))
        operand_dtype = "float32"
    elif form == "dense":
        q_BNSH, k_BNTH, v_BNTH = dense_operands(problem)
        q = fused.Operand(dev(q_BNSH, problem.dtype), "BNSH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BNTH, problem.dtype), "BNSH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BNTH, problem.dtype), "BNSH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
    elif form == "offsets":  # what the backend launches for f16/bf16 (dispatch.score_terms): unbiased Q and K
        terms = dispatch.score_terms(problem)
        assert not (terms.query_bias_in_operand or terms.key_bias_in_operand), problem.dtype
        unbiased = replace(problem, bias_q=None, bias_k=None)
        q_BNSH, k_BNTH, _ = dense_operands(unbiased)
        v_BNTH = dense_operands(problem)[2]
        q = fused.Operand(dev(q_BNSH, problem.dtype), "BNSH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BNTH, problem.dtype), "BNSH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BNTH, problem.dtype), "BNSH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
        offsets = host_score_offsets(problem, q_BNSH, k_BNTH)
        offset_args = {name: dev(value) for name, value in offsets.items()}
    else:
        assert form == "dense_BSNH", form
        q_BSNH, k_BTNH, v_BTNH = (x.transpose(0, 2, 1, 3) for x in dense_operands(problem))
        q = fused.Operand(dev(q_BSNH, problem.dtype), "BSNH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BTNH, problem.dtype), "BSNH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BTNH, problem.dtype), "BSNH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
    mask = None
    if problem.padding_mask is not None:
        staged = np.int32 if problem.padding_mask.kind == "key_lengths" else np.uint8
        mask_device = cupy.asarray(np.ascontiguousarray(problem.padding_mask.data, staged))
        keep.append(mask_device)
        mask = mask_device.data.ptr
    out = cupy.full((g.batch, g.q_seq, g.v_hidden), np.nan, dtype=cupy.float32)  # poison
    stream = cupy.cuda.Stream(non_blocking=True)
    fused.run_fused(0, problem, q=q, k=k, v=v, operand_dtype=operand_dtype,
                    attention_bias=dev(problem.attention_bias), mask=mask, out_BSD=out.data.ptr,
                    stream=stream, tile=tile, **offset_args)  # fmt: skip
    stream.synchronize()
    return cupy.asnumpy(out)


def host_score_offsets(problem: MhaProblem, q_BNSH: np.ndarray, k_BNTH: np.ndarray) -> dict:
    """run_fused's key_offset / query_offset as the layout movers compute them (float32), on the host."""
    n, scale = problem.geometry.num_heads, np.float32(problem.scale)
    terms = dispatch.score_terms(problem)
    out = {}
    if terms.key_offset:
        b_q = np.zeros(problem.geometry.head_size * n, np.float32) if problem.bias_q is None else problem.bias_q
        out["key_offset"] = scale * np.einsum("bnjd,nd->bnj", k_BNTH, b_q.reshape(n, -1)).astype(np.float32)
    if terms.query_offset:
        b_q = 0.0 if problem.bias_q is None else problem.bias_q.reshape(n, 1, -1)
        b_k = problem.bias_k.reshape(n, -1)
        out["query_offset"] = scale * np.einsum("bnid,nd->bni", q_BNSH + b_q, b_k).astype(np.float32)
    return out


def assert_matches_reference(problem: MhaProblem, got: np.ndarray) -> None:
    g = problem.geometry
    assert got.shape == (g.batch, g.q_seq, g.v_hidden)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} unwritten/NaN output elements"
    if problem.dtype in RELATIVE_TOLERANCE:
        want = run_reference(problem).output_BSDv
        tolerance = RELATIVE_TOLERANCE[problem.dtype]
        excess = np.abs(got - want) / np.maximum(1.0, np.abs(want))
        assert excess.max() <= tolerance, f"max relative error {excess.max():.3g} > {tolerance}"
        return
    oracle = run_reference(problem, np.float64).output_BSDv
    err_fused = float(np.abs(got - oracle).max())
    err_naive = float(np.abs(naive_low_precision(problem)[0] - oracle).max())
    assert err_fused <= 2 * err_naive + BF16_NOISE_FLOOR, (
        f"bf16 error vs float64 oracle {err_fused:.3g} > 2 x naive bf16 error {err_naive:.3g} + {BF16_NOISE_FLOOR}"
    )


# -------------------------------------------------------------------------------------------------- cases
CASES = {
    "S1_T203_H64_lengths": Case(b=2, s=1, l=203, n=3, h=64, mask="lengths"),
    "S113_T203_H40_keysBT_bias_BN": Case(b=2, s=113, l=203, n=2, h=40, mask="BT", attention_bias=(True, True)),
    "S113_T1_H80": Case(b=2, s=113, l=1, n=2, h=80),
    "S1023_T1024_H64_plain": Case(b=1, s=1023, l=1024, n=2, h=64),
    "S1023_T1024_H128_causal_past1": Case(b=1, s=1023, l=1023, p=1, n=2, h=128, causal=True, bias=False),
    "S1023_T1024_H96_keysBST_bias_1N": Case(b=1, s=1023, l=1024, n=2, h=96, mask="BST", attention_bias=(False, True)),
    "H80_lengths_3b2_bias_B1": Case(b=3, s=37, l=203, n=2, h=80, mask="lengths_3b2", attention_bias=(True, False)),
    "vhead24_ne_head40_bias_11": Case(b=2, s=17, l=29, n=4, h=40, hv=24, attention_bias=(False, False)),
    "bnsh_cross_keysBT": Case(b=2, s=11, l=203, n=4, h=64, layout="BNSH", mask="BT"),
    "causal_with_past_lengths": Case(b=2, s=9, l=9, p=7, n=2, h=64, causal=True, mask="lengths"),
    "causal_L_ne_S_top_left_last_row_free": Case(b=1, s=200, l=300, n=2, h=64, causal=True),
    "causal_with_attention_bias": Case(b=2, s=150, l=150, n=2, h=64, causal=True, attention_bias=(True, True)),
    "causal_over_padding_scale_attr": Case(b=2, s=130, l=130, n=2, h=32, causal=True, mask="BT",
                                           attrs={"scale": 0.3}),  # fmt: skip
    "minus_inf_filter_partial_padding": Case(b=2, s=70, l=90, n=2, h=32, mask="lengths", mask_filter_value=-np.inf),
    # whole key tiles padded after the kept ones: the tensor-core kernel's underflow skip (mask_filter_value -10000)
    # and the per-tile classification of key lengths and (B, T) flags; -2 keeps padded keys visible in the sum
    "lengths_whole_padded_tiles": Case(b=3, s=65, l=700, n=2, h=64, mask="lengths"),
    "keysBT_prefix_whole_padded_tiles": Case(b=3, s=65, l=700, n=2, h=64, mask="BT_prefix"),
    "keysBT_prefix_small_filter": Case(b=3, s=65, l=700, n=2, h=64, mask="BT_prefix", mask_filter_value=-2.0),
    "H128_bias_T260_vector_copies": Case(b=1, s=130, l=260, n=2, h=128, attention_bias=(True, True)),
    "causal_lowest_filter_fully_padded": Case(b=2, s=200, l=200, n=1, h=64, causal=True, mask="lengths",
                                              full_padding=True, mask_filter_value=float(FLOAT32_LOWEST)),  # fmt: skip
}
FORMS = ("staged", "dense")


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", list(CASES))
def test_fused_matches_reference(cupy_module, case_name, dtype, form):
    case = CASES[case_name]
    if form == "staged" and case.p is not None:
        pytest.skip("a past is read from the dense (layout mover's) K/V cache only")
    if dtype == "bfloat16" and case.mask_filter_value == FLOAT32_LOWEST:
        pytest.skip("the naive bf16 baseline rounds float32 lowest to -inf (NaN rows): no 2x-naive bound exists")
    problem = make_problem(case, dtype)
    assert dispatch.fused_unsupported_reason(problem) is None
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, form))


TILE_CASES = ("S113_T203_H40_keysBT_bias_BN", "S1023_T1024_H128_causal_past1", "causal_over_padding_scale_attr",
              "causal_L_ne_S_top_left_last_row_free", "vhead24_ne_head40_bias_11")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 64), (64, 128), (128, 128)], ids=lambda t: dispatch.MmaTile(*t).label)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", TILE_CASES)
def test_other_mma_tiles_match_reference(cupy_module, case_name, dtype, tile):
    """The tiles the timing script compares compute the same function as the default one."""
    problem = make_problem(CASES[case_name], dtype)
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, "dense", dispatch.MmaTile(*tile)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_mma_kernel_matches_reference_on_dense_operands(cupy_module, case_name, dtype):
    """flash_attention_mma named by its default tile, where a Hopper device would otherwise run the wgmma kernel."""
    case = CASES[case_name]
    if dtype == "bfloat16" and case.mask_filter_value == FLOAT32_LOWEST:
        pytest.skip("the naive bf16 baseline rounds float32 lowest to -inf (NaN rows): no 2x-naive bound exists")
    problem = make_problem(case, dtype)
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, "dense", dispatch.default_tile(problem)))


WGMMA_CASES = [name for name, case in CASES.items() if dispatch.head_dim_tile(case.h, case.hv or case.h) in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [dispatch.WgmmaTile(n, m, overlap) for m in (64, 128) for n in (64, 128)
                                  for overlap in (True, False)], ids=lambda t: t.label)  # fmt: skip
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", WGMMA_CASES)
def test_wgmma_tiles_match_reference(cupy_module, case_name, dtype, tile):
    """Every tile of flash_attention_wgmma (one or two warpgroups, 64 or 128 keys per step, steps overlapped or
    not), every mask."""
    if fused.device_capability(0) != dispatch.HOPPER_CAPABILITY:
        pytest.skip("flash_attention_wgmma runs on compute capability 9.0 only")
    case = CASES[case_name]
    if dtype == "bfloat16" and case.mask_filter_value == FLOAT32_LOWEST:
        pytest.skip("the naive bf16 baseline rounds float32 lowest to -inf (NaN rows): no 2x-naive bound exists")
    problem = make_problem(case, dtype)
    if fused.shared_bytes(problem, tile) > fused.SHARED_LIMIT:
        pytest.skip(f"tile {tile.label} needs more shared memory than a block has for this call")
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, "dense", tile))


WS_CASES = {  # no padding mask or attention_bias: flash_attention_ws has no code for them
    "S1023_T1024_H64_plain": CASES["S1023_T1024_H64_plain"],
    # 144 query tiles of 128 rows: more than one per block on a 132-SM GPU (the persistent loop, the Q buffer's
    # release and refill); 8 key tiles, the last one partial (104 keys)
    "S300_T1000_H64_more_tiles_than_sms": Case(b=4, s=300, l=1000, n=12, h=64),
    "S1_T7_H48_one_partial_key_tile": Case(b=2, s=1, l=7, n=3, h=48),
    "S130_T128_H128_hv64_one_full_key_tile": Case(b=2, s=130, l=128, n=2, h=128, hv=64),
    "S200_T300_H128_bnsh_scale_attr": Case(b=1, s=200, l=300, n=2, h=128, layout="BNSH", attrs={"scale": 0.05}),
    # causal (float16 only): frontier tiles, the diagonal masked per key, work-sorted snake order over the blocks
    "causal_S1023_T1024_H64_past1": Case(b=1, s=1023, l=1023, p=1, n=3, h=64, causal=True, bias=False),
    "causal_S700_T700_H64_more_tiles_than_sms": Case(b=4, s=700, l=700, n=12, h=64, causal=True),
    "causal_L_ne_S_last_row_free": Case(b=1, s=200, l=300, n=2, h=64, causal=True),
    "causal_S130_T130_H128_past_presents": Case(b=2, s=130, l=130, p=70, n=2, h=128, causal=True),
    "unidirectional_S1_past8_no_causal_mask": Case(b=2, s=1, l=1, p=8, n=2, h=64, causal=True),
}


# float16 / bfloat16 calls with projection biases at a sharp scale and wide heads: rounding the biased Q and K to
# float16 moved outputs by up to 6e-3 against ORT CPU there (issue 14); score_terms' offsets keep them exact.
OFFSET_CASES = {
    "H128_S70_T150_scale0.3": Case(b=2, s=70, l=150, n=2, h=128, bias_scale=1.0, attrs={"scale": 0.3}),
    "H96_S70_T150_scale0.3_mma": Case(b=2, s=70, l=150, n=2, h=96, bias_scale=1.0, attrs={"scale": 0.3}),
    "H64_lengths_padded_tiles": Case(b=3, s=90, l=300, n=2, h=64, bias_scale=1.0, mask="lengths",
                                     attrs={"scale": 0.3}),
    "H128_BT_mask_attention_bias": Case(b=2, s=40, l=200, n=2, h=128, bias_scale=1.0, mask="BT",
                                        attention_bias=(True, False), attrs={"scale": 0.3}),
    "H128_past_S9": Case(b=2, s=9, l=9, p=140, n=2, h=128, bias_scale=1.0, attrs={"scale": 0.3}),
    "H64_past_S1_causal": Case(b=2, s=1, l=1, p=200, n=3, h=64, bias_scale=1.0, causal=True, attrs={"scale": 0.3}),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["default", "mma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", list(OFFSET_CASES))
def test_score_offsets_keep_biased_calls_exact(cupy_module, case_name, dtype, kernel):
    """Unbiased Q and K plus the float32 key / query offsets (dispatch.score_terms) on the tensor-core kernels:
    within 4e-3 of the reference for float16, where the biased operands were not."""
    problem = make_problem(OFFSET_CASES[case_name], dtype)
    tile = None if kernel == "default" else dispatch.default_tile(problem)
    got = run_fused_on_gpu(cupy_module, problem, "offsets", tile)
    assert_matches_reference(problem, got)


def test_score_terms_keep_the_biases_out_of_low_precision_operands():
    """float32 adds every bias in the operands (exact); float16 / bfloat16 build Q and K unbiased and take the
    biases' shares as offsets, the key offset for a query bias, the query offset for a key bias."""
    case = Case(b=1, s=3, l=4, n=2, h=8)
    assert dispatch.score_terms(cuda_cases.make_problem(case, "float32")) == dispatch.ScoreTerms()
    for dtype in ("float16", "bfloat16"):
        # no past: the key bias's share is the same for every key of a row (cancelled), no query offsets
        terms = dispatch.score_terms(cuda_cases.make_problem(case, dtype))
        assert terms == dispatch.ScoreTerms(False, False, key_offset=True, query_offset=False) and terms.offsets
        past = dispatch.score_terms(cuda_cases.make_problem(replace(case, p=3), dtype, presents=True))
        assert past == dispatch.ScoreTerms(False, False, key_offset=True, query_offset=True)
        plain = dispatch.score_terms(cuda_cases.make_problem(replace(case, bias=False), dtype))
        assert not plain.offsets
        cross = dispatch.score_terms(cuda_cases.make_problem(replace(case, layout="BNSH", p=3), dtype, presents=True))
        assert cross.key_offset and not cross.query_offset  # ORT ignores a BNSH key's bias


def test_score_terms_identity_holds_with_and_without_a_past(rng):
    """The decomposition score_terms states, in float64 on float16 values: scale * (q + b_q) . (K + [j >= P] b_k)
    = scale * q . K + key offset + [j >= P] query offset, exactly (no term dropped, with a past too)."""
    h, p, length, s = 16, 5, 7, 4
    f16 = lambda *shape: rng.standard_normal(shape).astype(np.float16).astype(np.float64)  # noqa: E731
    q, keys, b_q, b_k, scale = f16(s, h), f16(p + length, h), f16(h), f16(h), 0.3
    new = np.arange(p + length) >= p
    exact = scale * (q + b_q) @ (keys + new[:, None] * b_k).T
    key_offset = scale * keys @ b_q
    query_offset = scale * (q + b_q) @ b_k
    ours = scale * q @ keys.T + key_offset[None, :] + new[None, :] * query_offset[:, None]
    np.testing.assert_allclose(ours, exact, rtol=0, atol=1e-12)


def test_score_offsets_keep_calls_off_the_warp_specialized_kernel():
    problem = cuda_cases.make_problem(Case(b=8, s=2048, l=2048, n=16, h=128), "float16")
    capability = dispatch.HOPPER_CAPABILITY
    assert isinstance(dispatch.choose_tile(problem, "float16", capability), dispatch.WsTile)
    assert dispatch.ws_unsupported_reason(problem, "float16", capability, key_offset=True).startswith(
        "the call's scores take a per-key offset")
    assert isinstance(dispatch.choose_tile(problem, "float16", capability, key_offset=True), dispatch.WgmmaTile)
    assert fused.kernel_name(problem, "float16", dispatch.WgmmaTile(64, 128, False), key_offset=True).endswith(
        ", 4, false>")  # FLASH_WITH_KEY_OFFSET


def ws_tiles() -> list:
    return [dispatch.WsTile(), dispatch.WsTile(64), dispatch.WsTile(consumers=3), dispatch.WsTile(64, consumers=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["dense", "dense_BSNH"])
@pytest.mark.parametrize("tile", ws_tiles(), ids=lambda t: t.label)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", list(WS_CASES))
def test_warp_specialized_kernel_matches_reference(cupy_module, case_name, dtype, tile, form):
    """flash_attention_ws (TMA producer, two ping-ponging consumers, persistent blocks) on plain calls, its
    operands in BNSH and in BSNH (the TMA maps follow the strides)."""
    if fused.device_capability(0) != dispatch.HOPPER_CAPABILITY:
        pytest.skip("flash_attention_ws runs on compute capability 9.0 only")
    problem = make_problem(WS_CASES[case_name], dtype)
    if problem.causal and dtype == "bfloat16":
        assert dispatch.ws_unsupported_reason(problem, dtype, dispatch.HOPPER_CAPABILITY).startswith("a causal bfloat16")
        pytest.skip("causal bfloat16 calls keep flash_attention_wgmma (dispatch.ws_causal_unsupported_reason)")
    assert dispatch.ws_unsupported_reason(problem, dtype, dispatch.HOPPER_CAPABILITY) is None
    reason = dispatch.ws_tile_unsupported_reason(problem, tile)
    if reason is not None:
        with pytest.raises(ValueError, match=re.escape(reason)):
            run_fused_on_gpu(cupy_module, problem, form, tile)
        return
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, form, tile))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [dispatch.WgmmaTile(128), dispatch.WsTile(), dispatch.WsTile(consumers=3)],
                         ids=lambda t: t.label)
def test_huge_bf16_logits_do_not_fold_the_scale(cupy_module, tile):
    """Logits near 1e33 (bf16 Q and K scaled by 2^56, exactly): folding the scale into the exponent's FMA would
    lose the row max's difference (exp2 of +-1e26: inf or 0); the kernels fall back to (x - max) for such rows.
    The answer is each row's value at its largest logit (every other p underflows to 0)."""
    if fused.device_capability(0) != dispatch.HOPPER_CAPABILITY:
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    base = make_problem(Case(b=1, s=70, l=203, n=2, h=64, bias=False, seed=3), "bfloat16")
    problem = replace(base, query_BSD=base.query_BSD * 2.0**56, key=base.key * 2.0**56)
    got = run_fused_on_gpu(cupy_module, problem, "dense", tile)
    n = problem.geometry.num_heads
    logits = np.einsum("bnsh,bnth->bnst", to_BNSH(problem.query_BSD, n).astype(np.float64),
                       to_BNSH(problem.key, n).astype(np.float64))  # fmt: skip
    assert np.abs(logits).max() * problem.scale > 1e30
    top = logits.argmax(axis=-1)  # (B, N, S)
    want = np.take_along_axis(to_BNSH(problem.value, n), top[..., None], axis=2)  # (B, N, S, Hv)
    np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3).reshape(got.shape))


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["lengths", "BT", "BST"])
def test_fully_padded_rows_are_softmax_of_raw_scores(cupy_module, dtype, mask, form):
    """mask_filter_value is added in float32: a fully padded row is softmax of the raw scores, never uniform."""
    case = Case(b=2, s=70, l=130, n=2, h=64, bias=False, mask=mask, full_padding=True, seed=3)
    problem = make_problem(case, dtype)
    got = run_fused_on_gpu(cupy_module, problem, form)
    raw = replace(problem, padding_mask=None)
    want = run_reference(raw, np.float64).output_BSDv[0]  # batch 0: every key padded
    value_BNLH = to_BNSH(problem.value, case.n)
    uniform = np.broadcast_to(value_BNLH[0].mean(axis=1)[None], (case.s, case.n, case.h)).reshape(case.s, -1)
    tolerance = {"float32": 1e-3, "float16": 4e-3, "bfloat16": 2e-2}[dtype]  # 1e-3: float32 spacing at 10000
    err_raw, err_uniform = np.abs(got[0] - want).max(), np.abs(got[0] - uniform).max()
    assert err_raw <= tolerance, f"fully padded row differs from softmax(raw scores) by {err_raw:.3g}"
    assert err_uniform > 20 * tolerance, f"fully padded row collapsed to uniform (distance {err_uniform:.3g})"
    if dtype == "float16":
        assert_matches_reference(problem, got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_fully_padded_row_is_nan_like_ort(cupy_module, dtype):
    problem = make_problem(Case(b=2, s=3, l=75, n=1, h=32, mask="lengths", full_padding=True,
                                mask_filter_value=-np.inf), dtype)  # fmt: skip
    got = run_fused_on_gpu(cupy_module, problem, "staged")
    assert np.isnan(got[0]).all()
    want = run_reference(problem).output_BSDv[1]
    tolerance = RELATIVE_TOLERANCE.get(dtype, 2e-2)
    assert np.abs(got[1] - want).max() <= tolerance


@pytest.mark.gpu
def test_causal_tiles_are_skipped_only_when_exact(cupy_module):
    """Lowest filter + causal + fully padded batch: every logit of batch 0's rows is ~lowest, so the causal
    future tiles hold equal logits and ORT's row is uniform over all T keys; skipping them would be wrong."""
    problem = make_problem(CASES["causal_lowest_filter_fully_padded"], "float32")
    got = run_fused_on_gpu(cupy_module, problem, "staged")
    value_mean = to_BNSH(problem.value + problem.bias_v, 1)[0, 0].mean(axis=0)
    np.testing.assert_allclose(got[0, 0], value_mean, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_operand_checks(cupy_module):
    problem = make_problem(Case(), "float16")
    g = problem.geometry
    op = fused.Operand(256, "BSNH", g.q_seq, g.head_size)
    kv = fused.Operand(256, "BSNH", g.total_seq, g.head_size)
    with pytest.raises(ValueError, match="operand_dtype 'bfloat16'"):
        fused.run_fused(0, problem, q=op, k=kv, v=kv, operand_dtype="bfloat16", attention_bias=None, mask=None,
                        out_BSD=0)  # fmt: skip
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        fused.run_fused(0, problem, q=replace(op, address=258), k=kv, v=kv, operand_dtype="float16",
                        attention_bias=None, mask=None, out_BSD=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"tile wg64x128 needs the wgmma kernel, which cannot run this call: "
                                         r"operands are float32 \(rounded to float16 on load"):  # fmt: skip
        fused.run_fused(0, problem, q=op, k=kv, v=kv, operand_dtype="float32", attention_bias=None, mask=None,
                        out_BSD=0, tile=dispatch.WgmmaTile(128))  # fmt: skip
    biased = make_problem(Case(h=128, attention_bias=(True, True)), "float16")
    q128 = fused.Operand(256, "BSNH", g.q_seq, 128)
    kv128 = fused.Operand(256, "BSNH", g.total_seq, 128)
    with pytest.raises(ValueError, match=r"tile 128x128 needs 243712 bytes of shared memory for this call, more than "
                                         r"the 232448 a block can have"):  # fmt: skip
        fused.run_fused(0, biased, q=q128, k=kv128, v=kv128, operand_dtype="float16", attention_bias=256, mask=None,
                        out_BSD=0, tile=dispatch.MmaTile(128, 128))  # fmt: skip


# ------------------------------------------------------------------------------------- dispatch rule (CPU)
def problem_with(h=64, hv=None, n=2, dtype="float16", causal=False, mask_filter_value=None, l=7):  # noqa: E741
    hv = hv or h
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 5, n * h)).astype(np.float32),
              rng.standard_normal((1, l, n * h)).astype(np.float32),
              rng.standard_normal((1, l, n * hv)).astype(np.float32)]  # fmt: skip
    attrs = {"num_heads": n, "unidirectional": int(causal)}
    if mask_filter_value is not None:
        attrs["mask_filter_value"] = mask_filter_value
    return build_problem(attrs, arrays, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [8, 40, 64, 80, 96, 128])
def test_fused_applies_to_supported_calls(dtype, h):
    assert dispatch.fused_unsupported_reason(problem_with(h=h, dtype=dtype)) is None
    assert dispatch.fused_unsupported_reason(problem_with(h=h, dtype=dtype, causal=True)) is None


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(h=59, n=1), "head_size 59 is not a multiple of 8"),
        (dict(h=64, hv=20), "v_head_size 20 is not a multiple of 8"),
        (dict(h=160, n=1), r"head sizes \(H=160, Hv=160\) exceed 128, the largest head tile of the fused kernel"),
        (dict(h=64, hv=136), r"head sizes \(H=64, Hv=136\) exceed 128, the largest head tile of the fused kernel"),
        (dict(causal=True, mask_filter_value=-np.inf),
         r"causal with mask_filter_value = -inf \(ORT's result depends on the exact causal fill values\)"),
    ],
)
def test_fused_not_used_reasons(kwargs, reason):
    got = dispatch.fused_unsupported_reason(problem_with(**kwargs))
    assert got is not None and re.fullmatch(reason, got), got


def test_mask_operands_must_match_the_call():
    plain = problem_with()
    biased = make_problem(Case(attention_bias=(True, True)), "float16")
    padded = make_problem(Case(mask="lengths"), "float16")
    fused.check_mask_operands(plain, None, None)
    fused.check_mask_operands(biased, 256, None)
    fused.check_mask_operands(padded, None, 256)
    with pytest.raises(ValueError, match="a device attention_bias must be given exactly when the call has one"):
        fused.check_mask_operands(plain, 256, None)
    with pytest.raises(ValueError, match="a device attention_bias must be given exactly when the call has one"):
        fused.check_mask_operands(biased, None, None)
    with pytest.raises(ValueError, match="a device mask must be given exactly when the call has a padding mask"):
        fused.check_mask_operands(padded, None, None)
    with pytest.raises(ValueError, match="a device mask must be given exactly when the call has a padding mask"):
        fused.check_mask_operands(plain, None, 256)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [Case(h=64), Case(h=64, attention_bias=(True, False)), Case(h=64, mask="BT"),
                                  Case(h=64, mask="BT", attention_bias=(True, True)), Case(h=32)])  # fmt: skip
def test_head_64_tiles_leave_room_for_three_blocks_per_sm(case, dtype):
    """The measured reason for the one attention_bias buffer (BENCH.md): with two, two blocks fitted an SM."""
    problem = make_problem(case, dtype)
    assert dispatch.default_tile(problem) == dispatch.MmaTile(64, 64)
    shared = fused.shared_bytes(problem)
    assert fused.blocks_per_sm_by_shared_memory(shared) >= dispatch.BLOCKS_PER_SM_GOAL, shared


@pytest.mark.parametrize(
    "kwargs, operand_dtype, capability, reason",
    [
        (dict(h=64), "float16", "90", None),
        (dict(h=40, dtype="bfloat16"), "bfloat16", "90", None),  # zero-padded up to the 64 tile
        (dict(h=128, hv=120), "float16", "90", None),
        (dict(h=64, dtype="float32"), "float32", "90", "dtype 'float32' is not a tensor-core dtype"),
        (dict(h=64), "float32", "90", r"operands are float32 \(rounded to float16 on load: the mma kernel's load path\)"),
        (dict(h=64), "float16", "89", r"compute capability 8.9 is not 9.0 \(wgmma is sm_90a code\)"),
        (dict(h=64), "float16", "100", r"compute capability 10.0 is not 9.0 \(wgmma is sm_90a code\)"),
        (dict(h=32), "float16", "90", r"head tile 32 is not one of \(64, 128\)"),
        (dict(h=96), "float16", "90", r"head tile 96 is not one of \(64, 128\)"),
    ],
)
def test_wgmma_kernel_choice(kwargs, operand_dtype, capability, reason):
    problem = problem_with(**kwargs)
    got = dispatch.wgmma_unsupported_reason(problem, operand_dtype, capability)
    assert (got is None) if reason is None else (got is not None and re.fullmatch(reason, got)), got
    tile = dispatch.choose_tile(problem, operand_dtype, capability)
    if reason is None:  # (head tile 128 plain calls take the warp-specialized kernel: test_warp_specialized_choice)
        assert tile == (dispatch.WsTile() if dispatch.head_dim_tile(problem.geometry.head_size, problem.geometry.v_head_size)
                        == 128 else dispatch.default_wgmma_tile(problem))  # fmt: skip
    else:
        assert tile == dispatch.default_tile(problem)
        assert dispatch.ws_unsupported_reason(problem, operand_dtype, capability) == got


def large_query_problem(s: int, n: int, **case) -> MhaProblem:
    """A head-64 call with ceil(s / 128) * n query tiles of 128 rows (B = 1, 8 keys: small arrays)."""
    return make_problem(Case(b=1, s=s, l=8, n=n, h=64, **case), "float16")


@pytest.mark.parametrize(
    "problem_of, expected",
    [
        (lambda: problem_with(h=128), dispatch.WsTile()),
        (lambda: problem_with(h=120, hv=128), dispatch.WsTile()),
        (lambda: problem_with(h=64), dispatch.WgmmaTile(128)),  # 1 query tile: the wgmma kernel's 64-row blocks
        # three consumers where their rounds x 192 rows x WS3_ROW_COST are under two consumers' rounds x 128:
        (lambda: large_query_problem(4096, 16), dispatch.WsTile(consumers=3)),  # 352 tiles (3 rounds) against 512 (4)
        (lambda: large_query_problem(4096, 12), dispatch.WsTile(consumers=3)),  # 264 tiles (2 rounds) against 384 (3)
        (lambda: large_query_problem(1500, 24), dispatch.WsTile(consumers=3)),  # the Whisper encoder row's 192 tiles
        # else two consumers from WS_HEAD64_TILES_PER_SM x 132 128-row tiles on, the wgmma kernel below that:
        (lambda: large_query_problem(512, 192), dispatch.WsTile()),  # 768 tiles (6 rounds) against 576 x 192 rows (5)
        (lambda: large_query_problem(512, 99), dispatch.WsTile()),  # 396 tiles: 3 per SM
        (lambda: large_query_problem(512, 96), dispatch.WgmmaTile(128)),  # 384 tiles (the 8,512,512,12 anchor's)
        (lambda: large_query_problem(2048, 16), dispatch.WgmmaTile(128)),  # 256 tiles; three: 176 (2 rounds, 384 rows)
        # causal: float16 calls take the warp-specialized kernel by the same rules, bfloat16 ones keep wgmma
        (lambda: make_problem(Case(s=300, l=300, h=128, causal=True), "float16"), dispatch.WsTile()),
        (lambda: make_problem(Case(s=300, l=300, h=128, causal=True), "bfloat16"), dispatch.WgmmaTile(64, 128, False)),
        (lambda: large_query_problem(4096, 16, causal=True), dispatch.WsTile(consumers=3)),
        (lambda: large_query_problem(4096, 12, causal=True, attrs={"scale": 1e26}), dispatch.WgmmaTile(128)),
        (lambda: make_problem(Case(h=128, mask="BT"), "float16"), dispatch.WgmmaTile(64, 128, False)),
        (lambda: large_query_problem(4096, 16, mask="lengths"), dispatch.WgmmaTile(64)),
    ],
)  # fmt: skip
def test_warp_specialized_choice(problem_of, expected):
    """flash_attention_ws takes Hopper calls without mask or attention_bias (causal too for float16) of head tile 128,
    and of head tile 64 with enough query tiles (three consumers where their tiles pay)."""
    problem = problem_of()
    assert dispatch.choose_tile(problem, problem.dtype, dispatch.HOPPER_CAPABILITY) == expected
    assert dispatch.choose_tile(problem, problem.dtype, "89") == dispatch.default_tile(problem)


def test_the_warp_specialized_choice_counts_the_devices_sms():
    """On a 114-SM H100 PCIe the S=T=4096 x 16 heads row takes two consumers: 352 192-row tiles are 4 rounds
    (x 192 x 0.85 = 653 rows) against 512 128-row tiles' 5 (640 rows); 132 SMs make it 3 rounds against 4."""
    problem = large_query_problem(4096, 16)
    assert dispatch.choose_tile(problem, "float16", dispatch.HOPPER_CAPABILITY, 132) == dispatch.WsTile(consumers=3)
    assert dispatch.choose_tile(problem, "float16", dispatch.HOPPER_CAPABILITY, 114) == dispatch.WsTile()
    assert dispatch.persistent_rounds(problem, 192, 114) == 4 and dispatch.persistent_rounds(problem, 128, 114) == 5
    fewer = large_query_problem(256, 180)  # 360 tiles of either size: at least 3 per SM of 114, not of 132
    assert dispatch.choose_tile(fewer, "float16", dispatch.HOPPER_CAPABILITY, 114) == dispatch.WsTile()
    assert dispatch.choose_tile(fewer, "float16", dispatch.HOPPER_CAPABILITY, 132) == dispatch.WgmmaTile(128)


@pytest.mark.parametrize(
    "problem_of, reason",
    [
        (lambda: make_problem(Case(h=64, mask="lengths"), "float16"), "the call has a padding mask"),
        (lambda: make_problem(Case(h=64, attention_bias=(True, True)), "bfloat16"), "the call has an attention_bias"),
        (lambda: make_problem(Case(s=9, l=9, h=128, causal=True), "bfloat16"),
         r"a causal bfloat16 call \(logits may reach float32 lowest; only float16 bounds them\)"),
        (lambda: make_problem(Case(s=9, l=9, h=64, causal=True, attrs={"scale": 1e26}), "float16"),
         r"a causal call whose logits may reach 2.75e\+37 \(scale 1e\+26\): only below 1e\+37 is -inf for "
         r"future keys exact"),
        (lambda: make_problem(Case(h=128, attrs={"scale": -0.5}), "float16"),
         r"scale -0.5 is not positive \(the kernel takes max\(scale \* s\) as scale \* max\(s\)\)"),
        (lambda: problem_with(h=96), r"head tile 96 is not one of \(64, 128\)"),
    ],
)  # fmt: skip
def test_warp_specialized_reasons(problem_of, reason):
    problem = problem_of()
    got = dispatch.ws_unsupported_reason(problem, problem.dtype, dispatch.HOPPER_CAPABILITY)
    assert got is not None and re.fullmatch(reason, got), got


@pytest.mark.parametrize(
    "case, tile, reason",
    [
        (Case(h=64), dispatch.WsTile(consumers=3), None),
        (Case(h=40), dispatch.WsTile(64, consumers=3), None),  # head tile 64
        (Case(h=128), dispatch.WsTile(), None),
        (Case(h=128), dispatch.WsTile(consumers=3),
         r"three consumer warpgroups need head tile 64 \(their 160 registers\), this call's is 128"),
        (Case(h=64, hv=120), dispatch.WsTile(consumers=3), r"three consumer warpgroups need head tile 64 .* is 128"),
        (Case(h=64), dispatch.WsTile(consumers=4), "4 consumer warpgroups: flash_attention_ws has two or three"),
        (Case(h=64), dispatch.WsTile(192), "192 keys per step: flash_attention_ws takes 64 or 128"),
    ],
)  # fmt: skip
def test_warp_specialized_tile_reasons(case, tile, reason):
    """Which WsTiles flash_attention_ws has an instantiation for (run_fused raises with the reason)."""
    got = dispatch.ws_tile_unsupported_reason(make_problem(case, "float16"), tile)
    assert (got is None) if reason is None else (got is not None and re.fullmatch(reason, got)), got


def test_warp_specialized_launch_choices():
    plain, wide = problem_with(h=64), make_problem(Case(h=128, hv=64), "bfloat16")
    three = dispatch.WsTile(consumers=3)
    causal = make_problem(Case(s=9, l=9, h=64, causal=True), "float16")
    assert fused.kernel_name(plain, "float16", dispatch.WsTile()) == "flash_attention_ws<__half, 64, 128, 2, false>"
    assert (fused.kernel_name(wide, "bfloat16", dispatch.WsTile(64))
            == "flash_attention_ws<__nv_bfloat16, 128, 64, 2, false>")  # fmt: skip
    assert fused.kernel_name(plain, "float16", three) == "flash_attention_ws<__half, 64, 128, 3, false>"
    assert fused.kernel_name(causal, "float16", three) == "flash_attention_ws<__half, 64, 128, 3, true>"
    # 1 KiB alignment slack, Q (128 or 192 rows), 2 stages x (K, V), 10 mbarriers of 8 bytes
    assert fused.shared_bytes(wide, dispatch.WsTile()) == 1024 + (128 + 2 * 2 * 128) * 128 * 2 + 80
    assert fused.shared_bytes(plain, dispatch.WsTile(64)) == 1024 + (128 + 2 * 2 * 64) * 64 * 2 + 80
    assert fused.shared_bytes(plain, three) == 1024 + (192 + 2 * 2 * 128) * 64 * 2 + 80
    assert fused.shared_bytes(wide, dispatch.WsTile()) <= fused.SHARED_LIMIT
    assert (dispatch.WsTile().threads, dispatch.WsTile().block_m, dispatch.WsTile(64).label) == (384, 128, "ws128x64")
    assert (three.threads, three.block_m, three.label) == (512, 192, "ws192x128")
    assert dispatch.query_tiles(wide, 128) == 2 * 2 and dispatch.query_tiles(wide, 64) == 2 * 2


def test_wgmma_launch_choices():
    plain = problem_with(h=64)
    assert fused.kernel_name(plain, "float16", dispatch.WgmmaTile(128)) == (
        "flash_attention_wgmma<__half, 64, 64, 128, 0, true>"
    )
    padded_biased = make_problem(Case(h=128, mask="BT", attention_bias=(True, True)), "bfloat16")
    assert fused.kernel_name(padded_biased, "bfloat16", dispatch.WgmmaTile(64)) == (
        "flash_attention_wgmma<__nv_bfloat16, 128, 64, 64, 3, true>"
    )
    assert fused.kernel_name(plain, "float16", dispatch.WgmmaTile(64, 128, False)) == (
        "flash_attention_wgmma<__half, 64, 128, 64, 0, false>"
    )
    assert fused.shared_bytes(plain, dispatch.WgmmaTile(64, 128)) == 1024 + (128 + 4 * 64) * 64 * 2
    # Q + 2 K + 2 V unpadded rows, 1 KiB of alignment slack, and the float32 bias tile as the mma kernel's
    assert fused.shared_bytes(plain, dispatch.WgmmaTile(128)) == 1024 + (64 + 4 * 128) * 64 * 2
    assert fused.shared_bytes(padded_biased, dispatch.WgmmaTile(64)) == 1024 + (64 + 4 * 64) * 128 * 2 + 64 * 72 * 4
    assert (dispatch.WgmmaTile().threads, dispatch.WgmmaTile().block_m, dispatch.WgmmaTile(64).label) == (128, 64, "wg64x64")
    assert (dispatch.WgmmaTile(64, 128, False).threads, dispatch.WgmmaTile(64, 128, False).label) == (256, "wg128x64s")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "case, tile, blocks",
    [(Case(h=64), dispatch.WgmmaTile(128), 3), (Case(h=64, mask="BST"), dispatch.WgmmaTile(64), 3),
     (Case(h=64, attention_bias=(True, True)), dispatch.WgmmaTile(64), 3),
     (Case(s=9, l=9, h=128, causal=True), dispatch.WgmmaTile(64, 128, False), 2),
     (Case(h=128, mask="BT", attention_bias=(True, False)), dispatch.WgmmaTile(64, 128, False), 1)],
)  # fmt: skip
def test_wgmma_default_tiles_and_their_blocks_per_sm(case, tile, blocks, dtype):
    """The measured defaults (dispatch.default_wgmma_tile) and the blocks per SM their registers are cut for."""
    problem = make_problem(case, dtype)
    assert dispatch.default_wgmma_tile(problem) == tile
    assert fused.wgmma_min_blocks(problem, tile) == blocks
    assert fused.blocks_per_sm_by_shared_memory(fused.shared_bytes(problem, tile)) >= blocks


def test_operands_in_the_call_dtype_carry_no_projection_bias():
    half, single = problem_with(), problem_with(dtype="float32")
    plain = fused.Operand(256, "BNSH", 5, 64)
    biased = fused.Operand(256, "BSNH", 7, 64, bias=512)
    fused.check_operand_bias(half, "float32", {"q": biased, "k": biased})  # rounded on load: bias added there
    fused.check_operand_bias(single, "float32", {"q": biased})  # the float32 kernel adds it on load
    fused.check_operand_bias(half, "float16", {"q": plain, "k": plain, "v": plain})
    with pytest.raises(ValueError, match=r"operands k, v are float16 and carry a projection bias"):
        fused.check_operand_bias(half, "float16", {"q": plain, "k": biased, "v": biased})


@pytest.mark.parametrize(
    "case, dtype, staged",
    [(Case(), "float32", True), (Case(layout="BNSH", mask="BT", attention_bias=(True, True)), "float32", True),
     (Case(p=3), "float32", False), (Case(presents=True), "float32", False), (Case(), "float16", False),
     (Case(), "bfloat16", False)],
)  # fmt: skip
def test_float32_calls_without_past_read_the_staged_inputs(case, dtype, staged):
    """The backend skips the layout movers exactly there (a past needs concatenating, a present writing, and the
    tensor-core kernels read operands in the call's dtype)."""
    problem = cuda_cases.make_problem(case, dtype)
    assert dispatch.reads_staged_inputs(problem) == staged


def test_fp32_pipeline_takes_the_most_blocks_then_two_stages():
    """The (stages, blocks) pairs measured fastest on the H200 at each head tile (fp32_pipeline's docstring)."""
    chosen = {hd: fused.fp32_pipeline(hd) for hd in dispatch.HEAD_DIM_TILES}
    assert chosen == {32: fused.Fp32Pipeline(1, 4), 64: fused.Fp32Pipeline(1, 3), 96: fused.Fp32Pipeline(1, 2),
                      128: fused.Fp32Pipeline(2, 1)}  # fmt: skip
    for hd, pipeline in chosen.items():  # the blocks the kernel's registers are cut for do fit the shared memory
        shared = fused.fp32_shared_bytes(hd, pipeline.stages)
        assert shared <= fused.SHARED_LIMIT
        assert fused.blocks_per_sm_by_shared_memory(shared) >= pipeline.blocks
    assert fused.FP32_THREADS == 128


def test_minus_inf_filter_without_causal_stays_fused():
    assert dispatch.fused_unsupported_reason(problem_with(mask_filter_value=-np.inf)) is None


def test_launch_choices():
    small, large = problem_with(h=40), make_problem(Case(s=300, l=10, h=96), "bfloat16")
    assert fused.kernel_name(small, "float16") == "flash_attention_mma<__half, __half, 64, 64, 64, 0>"
    assert fused.kernel_name(large, "float32") == "flash_attention_mma<__nv_bfloat16, float, 96, 64, 64, 0>"
    wide = dispatch.MmaTile(128, 128)
    assert fused.kernel_name(large, "float32", wide) == "flash_attention_mma<__nv_bfloat16, float, 96, 128, 128, 0>"
    assert (wide.threads, dispatch.DEFAULT_MMA_TILE.threads) == (256, 128)
    assert fused.shared_bytes(large, wide) == (128 + 4 * 128) * (96 + 8) * 2
    assert fused.kernel_name(problem_with(h=128, dtype="float32"), "float32") == (
        "flash_attention_fp32<float, float, 128, 4, 8, 2, 1>"
    )
    assert fused.kernel_name(problem_with(h=128), "float16") == "flash_attention_mma<__half, __half, 128, 128, 128, 0>"
    assert fused.kernel_name(problem_with(h=120), "float16") == "flash_attention_mma<__half, __half, 128, 128, 128, 0>"
    assert fused.shared_bytes(large) == (64 + 4 * 64) * (96 + 8) * 2
    # an attention_bias adds a float32 tile; head 128 then takes the 64 x 64 tile (128 x 128 would not fit)
    biased = make_problem(Case(s=300, l=10, h=128, attention_bias=(True, True)), "float16")
    assert dispatch.default_tile(biased) == dispatch.MmaTile(64, 64)
    assert fused.kernel_name(biased, "float16") == "flash_attention_mma<__half, __half, 128, 64, 64, 2>"
    padded = make_problem(Case(s=300, l=10, h=64, mask="BT"), "bfloat16")
    assert fused.kernel_name(padded, "bfloat16") == "flash_attention_mma<__nv_bfloat16, __nv_bfloat16, 64, 64, 64, 1>"
    assert fused.shared_bytes(biased) == (64 + 4 * 64) * (128 + 8) * 2 + 1 * 64 * (64 + 8) * 4
    assert fused.shared_bytes(biased, wide) > fused.SHARED_LIMIT
    # float32: Q + K and V (single buffered for head 64 and 96, double for 128: fp32_pipeline) + P transposed
    assert fused.shared_bytes(problem_with(h=64, dtype="float32")) == 4 * (64 * 68 + (64 * 68 + 64 * 64) + 64 * 68)
    assert fused.shared_bytes(problem_with(h=96, dtype="float32")) == 4 * (64 * 100 + (64 * 100 + 64 * 96) + 64 * 68)
    assert fused.shared_bytes(problem_with(h=128, dtype="float32")) == 4 * (
        64 * 132 + 2 * (64 * 132 + 64 * 128) + 64 * 68
    )
    assert all(fused.shared_bytes(problem_with(h=h, dtype="float32")) <= fused.SHARED_LIMIT // 2 for h in (32, 64))
    assert fused.Operand(0, "BSNH", 7, 40).strides(3) == (7 * 3 * 40, 40, 3 * 40)
    assert fused.Operand(0, "BNSH", 7, 40).strides(3) == (3 * 7 * 40, 7 * 40, 40)


# ------------------------------------------------------------------------------------- source audit (CPU)
def code_only(text: str) -> str:
    return "\n".join(line.split("//")[0] for line in text.splitlines())


CODE = code_only(SOURCE)


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


def test_wgmma_wrappers_are_generated():
    """kernels/wgmma_ops.cuh is what scripts/gen_wgmma_ops.py writes (edit the script, not the header)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_wgmma_ops.py"), "--check"], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_kernel_sources_inline_every_local_header():
    """What NVRTC compiles is one self-contained text: no local #include is left, each header once."""
    from mha_ep.ops.backends.cuda.kernels import kernel_source

    from mha_ep.ops.backends.cuda.kernels import INSTANTIATED

    for name in sorted({file for file, _ in INSTANTIATED.values()}):
        text = kernel_source(name)
        assert not re.search(r'^#include "', text, re.MULTILINE), name
        assert text.count("struct MaskParams {") == 1
        assert text.count("__device__ __forceinline__ T from_float(float x);") == 1


def kernel_parameters(operand_type: str, name: str = "") -> str:
    """The parameter list every fused kernel shares (flash_attention_mma / _fp32 / _wgmma / _ws), for explicit
    instantiations: Q, K, V as (pointer, three strides, bias) in ``operand_type``, then masks, the score offsets,
    scalars, output; flash_attention_ws (``name``) adds its three TMA tensor maps."""
    operand = [f"const {operand_type}*", "long long", "long long", "long long", "const float*"]
    rest = ["const float*", "int", "int", "int", "const int*", "const unsigned char*", "const float*", "const float*",
            "float", "int", "int", "float"]  # fmt: skip
    maps = ["const __grid_constant__ TensorMap"] * 3 if name.startswith("flash_attention_ws<") else []
    return ", ".join(operand * 3 + rest + ["int"] * 7 + ["float*"] + maps)


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


WGMMA_DEFAULT_CASES = {  # one call per default tile and feature set the H200 runs
    "head64_plain": Case(h=64),
    "head64_mask": Case(h=64, mask="BT"),
    "head64_bias_mask": Case(h=64, mask="lengths", attention_bias=(True, True)),
    "head128_causal": Case(s=9, l=9, h=128, causal=True),
    "head128_plain": Case(h=128),  # flash_attention_ws
    "head128_bias": Case(h=128, attention_bias=(True, False)),
}


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
