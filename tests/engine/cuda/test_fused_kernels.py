"""The fused attention kernels (kernels/flash_attention*.cu) on the GPU against the reference semantics: every
kernel and tile, the score offsets of biased float16/bfloat16 calls, fully padded rows, causal tile skipping, and
the operand checks (fused_cases.py: the harness and the tolerances)."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from mha_ep.engine.cuda import dispatch, fused, runner
from mha_ep.engine.cuda.split_keys import SPLIT_KERNELS
from mha_ep.engine.reference import run_reference, to_BNSH
from mha_ep.engine.problem import FLOAT32_LOWEST

from cuda_cases import Case, make_problem
from fused_cases import (
    CASES,
    DTYPES,
    FORMS,
    OFFSET_CASES,
    RELATIVE_TOLERANCE,
    SPLIT_CASES,
    TILE_CASES,
    WGMMA_CASES,
    WS_CASES,
    WS_TAIL_CASES,
    assert_matches_reference,
    run_fused_on_gpu,
    ws_tiles,
)


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


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", SPLIT_KERNELS)
@pytest.mark.parametrize("form", FORMS + ("offsets", "raw"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", list(SPLIT_CASES))
def test_split_key_kernels_match_reference(cupy_module, case_name, dtype, form, kernel):
    """A decode step's keys split across blocks (dispatch.key_stream / key_split) compute the flash kernels'
    function: both split kernels, every operand form (``raw``: the native route's cross attention,
    pipeline.reads_kv_in_place), mask, bias and dtype, scratch and output poisoned (the stream's arrival counters
    too, before their Fill)."""
    case = SPLIT_CASES[case_name]
    if form == "staged" and case.p is not None:
        pytest.skip("a past is read from the dense (layout mover's) K/V cache only")
    if form == "offsets" and (dtype == "float32" or not case.bias):
        pytest.skip("score offsets are float16 / bfloat16 calls' way with projection biases")
    if form == "raw" and (dtype == "float32" or case.layout != "BNSH" or case.p is not None):
        pytest.skip("the raw form is a float16 / bfloat16 BNSH call without a past")
    problem = make_problem(case, dtype)
    assert dispatch.fused_unsupported_reason(problem) is None and dispatch.key_split(problem) is not None
    assert_matches_reference(problem, run_fused_on_gpu(cupy_module, problem, form, split=kernel))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", SPLIT_KERNELS)
@pytest.mark.parametrize("form", ["dense", "raw"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", list(SPLIT_CASES))
def test_split_key_kernels_write_the_calls_dtype_exactly(cupy_module, case_name, dtype, form, kernel):
    """out_narrow (the native route's float16 / bfloat16 nodes): the split-key launches store the call's dtype
    themselves, the very values their float32 output holds (rounded to the dtype already), NaN rows included; the
    stream's combine, whichever block of a pair arrives last, sums the splits in one order: the same bits twice."""
    case = SPLIT_CASES[case_name]
    if form == "raw" and (case.layout != "BNSH" or case.p is not None):
        pytest.skip("the raw form is a BNSH call without a past")
    problem = make_problem(case, dtype)
    wide = run_fused_on_gpu(cupy_module, problem, form, split=kernel)
    np.testing.assert_array_equal(run_fused_on_gpu(cupy_module, problem, form, split=kernel, narrow=True), wide)
    np.testing.assert_array_equal(run_fused_on_gpu(cupy_module, problem, form, split=kernel), wide)


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
@pytest.mark.parametrize("narrow", [False, True], ids=["float32_out", "narrow_out"])
@pytest.mark.parametrize("form", ["dense", "dense_BSNH"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case_name", list(WS_TAIL_CASES))
def test_warp_specialized_tail_split_matches_reference(cupy_module, case_name, dtype, form, narrow):
    """flash_attention_ws with its last tiles cut into key ranges (dispatch.ws_tail, forced by planning for a
    device of few SMs): the partial results through poisoned scratch, merged by combine_tile_splits into either
    output, equal the reference as the whole-tile walk does."""
    if fused.device_capability(0) != dispatch.HOPPER_CAPABILITY:
        pytest.skip("flash_attention_ws runs on compute capability 9.0 only")
    case, tile, sms, want = WS_TAIL_CASES[case_name]
    problem = make_problem(case, dtype)
    assert dispatch.ws_tail(problem, tile, sms) == want
    got = run_fused_on_gpu(cupy_module, problem, form, tile, narrow=narrow, tail_sms=sms)
    assert_matches_reference(problem, got)
    whole = run_fused_on_gpu(cupy_module, problem, form, tile, narrow=narrow)
    assert np.abs(got - whole).max() <= 2 * np.abs(whole).max() * 2.0**-8  # a rounding step or two of the dtype


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
        runner.run_fused(0, problem, q=op, k=kv, v=kv, operand_dtype="bfloat16", attention_bias=None, mask=None,
                        out_BSD=0)  # fmt: skip
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        runner.run_fused(0, problem, q=replace(op, address=258), k=kv, v=kv, operand_dtype="float16",
                        attention_bias=None, mask=None, out_BSD=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"tile wg64x128 needs the wgmma kernel, which cannot run this call: "
                                         r"operands are float32 \(rounded to float16 on load"):  # fmt: skip
        runner.run_fused(0, problem, q=op, k=kv, v=kv, operand_dtype="float32", attention_bias=None, mask=None,
                        out_BSD=0, tile=dispatch.WgmmaTile(128))  # fmt: skip
    biased = make_problem(Case(h=128, attention_bias=(True, True)), "float16")
    q128 = fused.Operand(256, "BSNH", g.q_seq, 128)
    kv128 = fused.Operand(256, "BSNH", g.total_seq, 128)
    with pytest.raises(ValueError, match=r"tile 128x128 needs 243712 bytes of shared memory for this call, more than "
                                         r"the 232448 a block can have"):  # fmt: skip
        runner.run_fused(0, biased, q=q128, k=kv128, v=kv128, operand_dtype="float16", attention_bias=256, mask=None,
                        out_BSD=0, tile=dispatch.MmaTile(128, 128))  # fmt: skip
