"""The layout movers (kernels/layout.cu build_dense_BNTH[_native]; movers.layout_movers says what each writes)
against the host: operands, presents and the scores' offsets of float16 / bfloat16 calls (dispatch.score_terms).

CPU tests: which mover computes which offset, and the by-value struct the kernels take. GPU tests (marked gpu):
all three movers in their one launch. Each case's head size picks a different thread team per row (layout.cu
row_team): teams of 2 and 8, a team of 16 and of 32 with idle lanes, a team of 32 striding twice over a row, and
row counts that leave a warp partly outside the grid-stride loop. Every destination is poisoned with NaN first.
Operands and presents must be exact (one rounding of the float32 value); offsets are float32 dot products, held
to the worst-case bound of float32 arithmetic: (H + 3) * 2^-24 * scale * sum |x| |w| (expected_offsets).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mha_ep.engine.cuda import dispatch
from mha_ep.engine.cuda.geometry import plan_launch
from mha_ep.engine.cuda.movers import MOVER_DTYPE, Mover, layout_movers, mover_struct
from mha_ep.engine.problem import MhaProblem

from cuda_cases import Case, dense_operands, from_device, make_problem, to_device

MOVER_CASES = {
    "H8_team2_partial_warp": Case(b=1, s=3, l=7, p=2, n=3, h=8),
    "H6_vec1_team8": Case(b=2, s=5, l=3, p=4, n=2, h=6),
    "H40_team16_idle_lanes": Case(b=2, s=9, l=11, p=5, n=3, h=40),
    "H59_vec1_team32_two_trips": Case(b=1, s=4, l=5, p=3, n=2, h=59),
    "H40_hv10_no_past": Case(b=2, s=5, l=9, n=3, h=40, hv=10),  # V: ten 1-wide groups, a team of 16
    "H96_team32_idle_lanes": Case(b=2, s=7, l=6, p=9, n=2, h=96),
    "H256_team32_two_trips": Case(b=1, s=3, l=4, p=2, n=2, h=256),
    "H64_no_past_guard_only": Case(b=2, s=5, l=9, n=2, h=64),
    "H64_bnsh_cross_no_key_bias": Case(b=2, s=5, l=9, p=3, n=2, h=64, layout="BNSH"),
    "H64_no_bias_negative_zeros": Case(b=2, s=5, l=9, p=3, n=2, h=64, bias=False),
}
KERNELS = [("build_dense_BNTH", "float16"), ("build_dense_BNTH", "bfloat16"), ("build_dense_BNTH_native", "float16")]
ELEMENT = {"float16": "float16", "bfloat16": "uint16"}  # bfloat16 travels as its upper 16 bits


# layout_movers' source names -> the MhaProblem fields that hold them (the pipeline takes the addresses from its
# DeviceCall; these tests drive the movers straight from a problem)
SOURCE_FIELDS = {
    "query": "query_BSD", "key": "key", "value": "value", "past_key": "past_key_BNPH",
    "past_value": "past_value_BNPH", "bias_q": "bias_q", "bias_k": "bias_k", "bias_v": "bias_v",
}  # fmt: skip


def problem_sources(problem) -> dict:
    """layout_movers' source name -> the array of ``problem`` (an MhaProblem) that holds it, or None."""
    return {name: getattr(problem, field) for name, field in SOURCE_FIELDS.items()}


def run_movers(cupy, problem: MhaProblem, kernel: str) -> dict:
    """Every array the three movers write for ``problem`` with ``kernel``, as host float32."""
    from mha_ep.engine.cuda.pipeline import mover_launch
    from mha_ep.engine.cuda.runner import run_steps

    g, dtype = problem.geometry, problem.dtype
    plan = plan_launch(g, dtype)
    terms = dispatch.score_terms(problem)
    source_dtype = "float32" if kernel == "build_dense_BNTH" else dtype
    present_dtype = "float32" if kernel == "build_dense_BNTH" else ELEMENT[dtype]
    keep = []

    def dev(array):
        if array is None:
            return None
        keep.append(to_device(cupy, array, source_dtype))
        return keep[-1].data.ptr

    def poisoned(shape, element):
        array = cupy.empty(shape, element)
        array.view(cupy.uint8).fill(0xFF)  # NaN in float16, bfloat16 and float32
        return array

    kv_shape = (g.batch, g.num_heads, g.total_seq)
    out = {
        "q_BNSH": poisoned((g.batch, g.num_heads, g.q_seq, g.head_size), ELEMENT[dtype]),
        "k_BNTH": poisoned(kv_shape + (g.head_size,), ELEMENT[dtype]),
        "v_BNTH": poisoned(kv_shape + (g.v_head_size,), ELEMENT[dtype]),
        "present_key": poisoned(kv_shape + (g.head_size,), present_dtype),
        "present_value": poisoned(kv_shape + (g.v_head_size,), present_dtype),
    }
    if terms.key_offset:
        out["key_offset_BNT"] = poisoned(kv_shape, "float32")
    if terms.query_offset:
        out["query_offset_BNS"] = poisoned((g.batch, g.num_heads, g.q_seq), "float32")
    ptr = {name: array.data.ptr for name, array in out.items()}
    movers = layout_movers(
        plan, terms, problem.kv_layout == "BNSH",
        sources={name: dev(array) for name, array in problem_sources(problem).items()},
        dst={name: ptr[name] for name in ("q_BNSH", "k_BNTH", "v_BNTH")},
        presents={name: ptr[name] for name in ("present_key", "present_value")},
        offsets={name: ptr[name] for name in ("key_offset_BNT", "query_offset_BNS") if name in ptr},
    )  # fmt: skip
    run_steps(0, [mover_launch(plan, kernel, movers, problem.scale)], cupy.cuda.get_current_stream())
    cupy.cuda.runtime.deviceSynchronize()
    return {name: from_device(cupy, array) for name, array in out.items()}


def expected_offsets(problem: MhaProblem, q_BNSH: np.ndarray, k_BNTH: np.ndarray) -> dict:
    """name -> (float64 value, float32 error bound) of the offsets score_terms asks for. The bound: H products
    summed, the float32 add of q + b_q and the scale's product, each a rounding of at most 2^-24 relative."""
    g, scale = problem.geometry, float(problem.scale)
    unit = (g.head_size + 3) * 2.0**-24
    terms = dispatch.score_terms(problem)
    n = g.num_heads

    def per_head(bias):
        return np.zeros((n, g.head_size)) if bias is None else np.asarray(bias, np.float64).reshape(n, -1)

    b_q, b_k = per_head(problem.bias_q), per_head(problem.bias_k)
    want = {}
    if terms.key_offset:
        k = k_BNTH.astype(np.float64)
        value = scale * np.einsum("bnjd,nd->bnj", k, b_q)
        if problem.bias_k is not None and not terms.query_offset:  # the NaN guard: 0 * sum(b_k)
            with np.errstate(invalid="ignore"):  # 0 * inf is the NaN wanted
                value = value + (0.0 * b_k.sum(axis=1))[None, :, None]
        want["key_offset_BNT"] = (value, unit * scale * np.einsum("bnjd,nd->bnj", abs(k), abs(b_q)))
    if terms.query_offset:
        x = q_BNSH.astype(np.float64) + b_q[None, :, None, :]
        value = scale * np.einsum("bnid,nd->bni", x, b_k)
        want["query_offset_BNS"] = (value, unit * scale * np.einsum("bnid,nd->bni", abs(x), abs(b_k)))
    return want


def assert_movers_match(problem: MhaProblem, got: dict) -> None:
    terms = dispatch.score_terms(problem)
    assert not (terms.query_bias_in_operand or terms.key_bias_in_operand), "float16 / bfloat16 operands are unbiased"
    q_exact, k_exact, _ = dense_operands(replace(problem, bias_q=None, bias_k=None))
    _, present_key, present_value = dense_operands(problem)
    exact = {"q_BNSH": q_exact, "k_BNTH": k_exact, "v_BNTH": present_value,  # V keeps its bias (score_terms)
             "present_key": present_key, "present_value": present_value}  # fmt: skip
    for name, want in exact.items():  # bit for bit: the sign of a zero too
        np.testing.assert_array_equal(got[name].view(np.uint32), want.view(np.uint32), err_msg=name)
    want = expected_offsets(problem, q_exact, k_exact)
    assert set(want) == {name for name in got if name.endswith(("_BNT", "_BNS"))}
    for name, (value, bound) in want.items():
        error = np.abs(got[name] - value)
        assert np.array_equal(np.isnan(got[name]), np.isnan(value)), f"{name}: NaN where the host has none"
        finite = ~np.isnan(value)
        assert (error[finite] <= bound[finite] + 1e-30).all(), f"{name}: error {error[finite].max():.3g} over bound"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dtype", KERNELS)
@pytest.mark.parametrize("case_name", list(MOVER_CASES))
def test_movers_write_exact_operands_presents_and_offsets(cupy_module, case_name, kernel, dtype):
    problem = make_problem(replace(MOVER_CASES[case_name], bias_scale=1.0, attrs={"scale": 0.3}), dtype,
                           presents=True)  # fmt: skip
    if "negative_zeros" in case_name:  # without a bias, a -0 is copied as it is (ORT copies the tensors)
        for array in (problem.query_BSD, problem.key, problem.value, problem.past_key_BNPH):
            array.reshape(-1)[::7] = -0.0
        assert np.signbit(problem.key[problem.key == 0]).any()
    assert_movers_match(problem, run_movers(cupy_module, problem, kernel))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dtype", KERNELS)
def test_a_non_finite_key_bias_makes_that_heads_key_offsets_nan(cupy_module, kernel, dtype):
    """Without a past the key bias has no offset of its own (the softmax cancels it); the key offsets carry
    0 * sum(b_k), so a NaN / inf in b_k still makes that head's scores NaN, as in ORT."""
    problem = make_problem(Case(b=2, s=5, l=9, n=3, h=40), dtype, presents=True)
    bias_k = problem.bias_k.copy()
    bias_k[1 * 40 + 7] = np.inf  # head 1
    problem = replace(problem, bias_k=bias_k)
    got = run_movers(cupy_module, problem, kernel)
    assert np.isnan(got["key_offset_BNT"][:, 1]).all()
    assert np.isfinite(got["key_offset_BNT"][:, [0, 2]]).all()
    assert_movers_match(problem, got)


# ------------------------------------------------------------------------------------------------- CPU rules
def test_the_key_mover_computes_key_offsets_and_the_query_mover_query_offsets():
    plan = plan_launch(make_problem(Case(b=1, s=3, l=4, p=2, n=2, h=8), "float16", presents=True).geometry,
                       "float16")  # fmt: skip
    sources = {"query": 1, "key": 2, "value": 3, "past_key": 4, "past_value": 5, "bias_q": 6, "bias_k": 7,
               "bias_v": 8}  # fmt: skip
    dst = {"q_BNSH": 10, "k_BNTH": 11, "v_BNTH": 12}
    offsets = {"key_offset_BNT": 20, "query_offset_BNS": 21}
    with_past = dispatch.ScoreTerms(False, False, key_offset=True, query_offset=True)
    q, k, v = layout_movers(plan, with_past, False, sources, dst, {"present_key": 13}, offsets)
    assert (q.offset_weight, q.offset_adds_bias, q.offset_guard, q.offset_out) == (7, True, False, 21)
    assert (k.offset_weight, k.offset_adds_bias, k.offset_guard, k.offset_out) == (6, False, False, 20)
    assert v.offset_out is None and v.bias_in_operand and (k.present, v.present) == (13, None)
    assert (q.past, k.past, v.past, q.cur_seq, k.cur_seq, k.past_seq) == (None, 4, 5, 3, 4, 2)
    no_past = dispatch.ScoreTerms(False, False, key_offset=True, query_offset=False)
    q, k, _ = layout_movers(plan, no_past, False, sources, dst, {}, {"key_offset_BNT": 20})
    assert q.offset_out is None and (k.offset_weight, k.offset_guard, k.offset_out) == (6, True, 20)
    float32 = layout_movers(plan, dispatch.ScoreTerms(), False, sources, dst, {}, {})
    assert all(m.offset_out is None and m.bias_in_operand for m in float32)


def test_the_mover_struct_puts_the_present_where_the_kernel_reads_it():
    mover = Mover(cur=1, cur_is_bnsh=True, past=None, bias=3, bias_in_operand=False, dst=4, present=5, cur_seq=6,
                  past_seq=7, dim=8, offset_weight=9, offset_adds_bias=True, offset_guard=True, offset_out=10)
    from mha_ep.engine.cuda.runner import struct_array

    bridge, native = struct_array(mover_struct(mover, 0.25, False)), struct_array(mover_struct(mover, 0.25, True))
    assert bridge.dtype == MOVER_DTYPE and bridge.shape == (1,)
    assert (bridge["dst_f32_BNTH"][0], bridge["dst_present_BNTH"][0]) == (5, 0)
    assert (native["dst_f32_BNTH"][0], native["dst_present_BNTH"][0]) == (0, 5)
    assert bridge["past_BNPH"][0] == 0 and bridge["offset_scale"][0] == np.float32(0.25)
    assert [int(bridge[name][0]) for name in ("cur", "bias_NH", "dst_BNTH", "offset_weight_NH", "offset_BNR")] == [
        1, 3, 4, 9, 10]
    assert [int(bridge[name][0]) for name in ("cur_is_bnsh", "bias_in_operand", "offset_adds_bias", "offset_guard",
                                               "cur_seq", "past_seq", "dim")] == [1, 0, 1, 1, 6, 7, 8]  # fmt: skip
