"""Property tests: random MultiHeadAttention configurations, the plugin vs stock ORT CPU (float32, float16) and vs a
float64 oracle (bfloat16, which stock ORT cannot run).

What the strategies draw (``configs``): S != L (independent lengths 1..9), odd head sizes (1, 3, 40, 59 besides 8),
v_head_size != head_size (BSNH without a past only: ORT requires both pasts to end in head_size and BNSH key and
value to have one shape), every mask format
(1d (B), 3b2 (3B+2), 2d (B, T), 3d (B, S, T); int32 and int64, with "any" mask values such as 2 and -1), fully
padded rows, attention_bias broadcasts, causal with and without a past (including L != S, where ORT CPU aligns
top-left and leaves the last row unmasked), BSNH and BNSH (cross) key/value with and without a past, past of
length 0, mask_filter_value default / -10000 / -inf (NaN rows must be NaN on both sides: NaN-aware compare), an
explicit scale, static and symbolic input shapes.

Tolerances, relative to max(1, |expected|): float32 1e-5 and float16 4e-3 (tests/conftest.PARITY_TOLERANCE);
bfloat16 vs the float64 oracle: 2 x the error of a naive bf16 implementation + BF16_TOLERANCE (below).

Explicit ``scale`` values are factor/sqrt(H) with all their digits: the onnxruntime-extensions bridge passes float
attributes as text with 6 significant digits, which mha_ep works around (``test_float_attributes_reach_the_op_exactly``
keeps it that way).

``CORNER_CASES`` are fixed examples of every quirk above, so each one is covered on every run whatever hypothesis
draws. Hypothesis keeps ``max_examples`` moderate (runtime: about a minute for the file on 2 cores).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.engine.problem import build_problem
from mha_ep.spec import FLOAT_INPUTS, INPUTS

from conftest import PARITY_TOLERANCE
from mha_models import (
    BROADCASTS,
    MASK_FORMATS,
    MhaConfig,
    assert_outputs_match,
    build_model,
    naive_same_dtype,
    oracle_float64,
    packed_feeds,
    packed_model,
    plugin_session,
    random_feeds,
    stock_outputs,
    with_,
)
from small_models import model_of

# bfloat16 vs float64 (flash-attention's rule for its bf16 tests): error <= 2 x the error of a naive bf16 implementation
# (mha_models.naive_same_dtype: every stage rounded to bf16) + a floor. The floor is what the most exact plugin
# still has: computing in float32 from bf16 values and rounding each output once costs at most half a bf16 ulp,
# 2**-8 relative to |x| (hence to max(1, |x|)), plus float32 noise. The reference backend stays under the floor
# alone; the cuda backend rounds Q/K/V and the probabilities to bf16 and lands between the two.
BF16_TOLERANCE = 2.0**-8 + 1e-5
HEAD_SIZES = (1, 3, 8, 40, 59)
V_HEAD_SIZES = (None, 1, 5, 16)
# explicit scale = factor / sqrt(H), all digits (see the module docstring); the factor keeps the scores O(1), so
# that 1e-5 measures the kernel and not float32 noise amplified by a very peaked softmax (with a scale of 1.5 at
# H = 40, stock ORT itself is 8e-6 away from float64)
SCALE_FACTORS = (None, 0.5, 0.75, 1.5)
MASK_FILTER_VALUES = (None, -10000.0, float("-inf"))
RANDOM_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def scale_for(head_size: int, factor):
    return None if factor is None else factor / math.sqrt(head_size)


@st.composite
def configs(draw, dtype: str = "float32"):
    has_past = draw(st.booleans())
    mask = draw(st.sampled_from(MASK_FORMATS))
    kv_layout = draw(st.sampled_from(("BSNH", "BNSH")))
    # ORT: BNSH key and value must have identical shapes, and a past ends in head_size: Hv != H only for BSNH
    # without a past
    free_hv = kv_layout == "BSNH" and not has_past
    head_size = draw(st.sampled_from(HEAD_SIZES))
    return MhaConfig(
        batch=draw(st.integers(1, 3)),
        q_seq=draw(st.integers(1, 9)),
        kv_seq=draw(st.integers(1, 9)),
        num_heads=draw(st.integers(1, 4)),
        head_size=head_size,
        v_head_size=draw(st.sampled_from(V_HEAD_SIZES)) if free_hv else None,
        has_past=has_past,
        past_seq=draw(st.integers(0, 6)) if has_past else 0,
        # ORT CPU computes wrong results for a past without both presents (docs/SEMANTICS.md §3.9): always ask for them
        presents=True if has_past else draw(st.booleans()),
        dtype=dtype,
        kv_layout=kv_layout,
        bias=draw(st.booleans()),
        mask=mask,
        mask_dtype=draw(st.sampled_from(("int32", "int64"))),
        fully_padded=mask != "none" and draw(st.booleans()),
        attention_bias=draw(st.sampled_from(list(BROADCASTS))),
        causal=draw(st.booleans()),
        mask_filter_value=draw(st.sampled_from(MASK_FILTER_VALUES)),
        scale=scale_for(head_size, draw(st.sampled_from(SCALE_FACTORS))),
        shapes=draw(st.sampled_from(("static", "symbolic"))),
        qk=draw(st.booleans()),
    )


def run_plugin(config: MhaConfig, feeds, backend: str, names, form: Optional[str] = None) -> dict:
    """The plugin's outputs ``names`` for ``config`` on ``feeds`` (the unpacked node's); ``form`` "qkv" / "kv" runs
    the packed node instead, on the same values packed (mha_models.packed_model, packed_feeds)."""
    model = build_model(config) if form is None else packed_model(config, form)
    decisions = mha_ep.partition(model).decisions
    assert [d.claimed for d in decisions] == [True], f"{config.short()}: not claimed: {decisions}"
    session = plugin_session(model, backend)
    return dict(zip(names, session.run(list(names), feeds if form is None else packed_feeds(config, feeds, form))))


def padded_rows(config: MhaConfig, feeds) -> np.ndarray:
    """(B, S) True where a query row attends to padded keys only (every key its causal rule allows is padded)."""
    b, s, t = config.batch, config.q_seq, config.total_seq
    if "key_padding_mask" not in feeds:
        return np.zeros((b, s), bool)
    arrays = [np.asarray(feeds[n], np.float32) if n in feeds and n in FLOAT_INPUTS else feeds.get(n) for n in INPUTS]
    problem = build_problem({"num_heads": config.num_heads}, arrays, "float32", (True, config.presents,
                                                                                 config.presents, False))
    keep = np.asarray(problem.padding_mask.keep_BST(s, t))
    if config.causal and s > 1:
        rows, cols = np.arange(s)[:, None], np.arange(t)[None, :]
        future = (cols > config.past_seq * config.has_past + rows) & (rows < s - 1)
        keep = keep & ~future[None]
    return ~keep.any(axis=-1)


def padded_row_tolerance(config: MhaConfig, feeds, rows: np.ndarray) -> float:
    """Extra tolerance for query rows that attend to padded keys only, under a finite mask_filter_value.

    ORT computes such a row as softmax(scores + mask_filter_value) in float32: every score is quantized to the float32
    spacing at |mask_filter_value| (2**-10 at 10000), so a 1-ulp difference in a score between two correct GEMMs
    (MLAS vs BLAS summation order) can move it by a whole step, changing that probability by a factor e**step and
    the output by up to step * max|v|. Seen: 6e-4 on a float32 config whose other rows matched to 2e-7 (a fully
    padded batch, and a random 3D mask that padded every allowed key of one row). Allowing 4 steps * max(1, max|v|)
    there still fails zeroed, NaN or uniform rows (errors of order |v|); every other row and the presents keep the
    dtype's tolerance.
    """
    value = config.mask_filter_value if config.mask_filter_value is not None else -10000.0
    if not rows.any() or not np.isfinite(value):
        return 0.0
    v_max = max(float(np.abs(feeds[n]).max()) for n in ("value", "past_value", "bias") if n in feeds and feeds[n].size)
    return 4.0 * float(np.spacing(np.float32(abs(value)))) * max(1.0, 2.0 * v_max)


def compare(config: MhaConfig, feeds, actual: dict, expected: dict, tolerance: float, context: str) -> None:
    rows = padded_rows(config, feeds)
    extra = padded_row_tolerance(config, feeds, rows)
    if extra:
        assert_outputs_match(
            {"output": actual["output"][rows]},
            {"output": expected["output"][rows]},
            tolerance + extra,
            f"{context} ({int(rows.sum())} row(s) attending to padded keys only; float32 spacing at "
            f"|mask_filter_value| allowed: +{extra:.3g})",
        )
        actual = {**actual, "output": np.where(rows[:, :, None], 0.0, actual["output"])}
        expected = {**expected, "output": np.where(rows[:, :, None], 0.0, expected["output"])}
    assert_outputs_match(actual, expected, tolerance, context)


def check_vs_stock(config: MhaConfig, backend: str, seed: int, form: Optional[str] = None) -> None:
    """The plugin on ``config`` (``form``: its packed node, run_plugin) against stock ORT CPU on the unpacked node."""
    rng = np.random.default_rng(seed)
    feeds = random_feeds(config, rng, any_mask_values=bool(seed % 2))
    expected = stock_outputs(config, feeds)
    actual = run_plugin(config, feeds, backend, list(expected), form)
    context = f"[{backend}] seed={seed} {config.short()}{f' packed {form}' if form else ''}"
    compare(config, feeds, actual, expected, PARITY_TOLERANCE[config.dtype], context)


def check_vs_oracle(config: MhaConfig, backend: str, seed: int, form: Optional[str] = None) -> None:
    """bfloat16 vs float64: error <= 2 x the error of a naive bf16 implementation + BF16_TOLERANCE (the floor);
    ``form``: the packed node (run_plugin)."""
    from conftest import max_rel_error

    rng = np.random.default_rng(seed)
    feeds = random_feeds(config, rng, any_mask_values=bool(seed % 2))
    expected = oracle_float64(config, feeds)
    naive = naive_same_dtype(config, feeds)
    naive_error = max(max_rel_error(naive[name], expected[name]) for name in expected)
    tolerance = 2.0 * naive_error + BF16_TOLERANCE
    actual = run_plugin(config, feeds, backend, list(expected), form)
    context = (f"[{backend}] seed={seed} {config.short()}{f' packed {form}' if form else ''} vs float64 (naive bf16 "
               f"error {naive_error:.3g})")  # fmt: skip
    compare(config, feeds, actual, expected, tolerance, context)


# -------------------------------------------------------------------------------------------- property tests
@settings(max_examples=150, **RANDOM_SETTINGS)
@given(config=configs("float32"), seed=st.integers(0, 2**31 - 1))
def test_random_float32_matches_stock_ort(run_backend, config, seed):
    check_vs_stock(config, run_backend, seed)


@settings(max_examples=75, **RANDOM_SETTINGS)
@given(config=configs("float16"), seed=st.integers(0, 2**31 - 1))
def test_random_float16_matches_stock_ort(run_backend, config, seed):
    check_vs_stock(config, run_backend, seed)


@settings(max_examples=75, **RANDOM_SETTINGS)
@given(config=configs("bfloat16"), seed=st.integers(0, 2**31 - 1))
def test_random_bfloat16_matches_float64_oracle(backend, config, seed):
    check_vs_oracle(config, backend, seed)


# ---------------------------------------------------------------------------------------------- fixed corners
BASE = MhaConfig(batch=2, q_seq=4, kv_seq=6, num_heads=2, head_size=8)
CORNER_CASES = {
    # S != L, odd head sizes, Hv != H
    "S1-L7-H1": with_(BASE, q_seq=1, kv_seq=7, head_size=1),
    "S5-L2-H3": with_(BASE, q_seq=5, kv_seq=2, head_size=3, num_heads=3),
    "H40-Hv16": with_(BASE, head_size=40, v_head_size=16, bias=True),
    "H59-Hv1": with_(BASE, head_size=59, v_head_size=1, mask="3d"),
    "H59-BNSH": with_(BASE, head_size=59, kv_layout="BNSH"),
    # every mask format and dtype, values other than 0/1 (any_mask_values on odd seeds)
    **{
        f"mask-{m}-{d}": with_(BASE, mask=m, mask_dtype=d, bias=True)
        for m in ("1d", "3b2", "2d", "3d")
        for d in ("int32", "int64")
    },
    # fully padded rows: -10000 (softmax of the raw scores) and -inf (NaN rows on both sides)
    **{
        f"fully-padded-{m}-{'inf' if v else 'default'}": with_(
            BASE, mask=m, fully_padded=True, mask_filter_value=v
        )
        for m in ("1d", "3b2", "2d", "3d")
        for v in (None, float("-inf"))
    },
    "fully-padded-causal-inf": with_(
        BASE, q_seq=5, kv_seq=5, mask="2d", fully_padded=True, causal=True, mask_filter_value=float("-inf")
    ),
    # attention_bias broadcasts
    **{f"attn-bias-{b}": with_(BASE, attention_bias=b, mask="2d") for b in ("BN", "1N", "B1", "11")},
    # causal: L != S without a past (top-left, last row unmasked on CPU), with a past and S > 1, with S == 1
    "causal-S4-L6": with_(BASE, causal=True),
    "causal-S6-L3": with_(BASE, q_seq=6, kv_seq=3, causal=True),
    "causal-past-S3": with_(BASE, q_seq=3, kv_seq=3, has_past=True, past_seq=4, presents=True, causal=True),
    "causal-past-S1": with_(BASE, q_seq=1, kv_seq=1, has_past=True, past_seq=5, presents=True, causal=True),
    "past-0": with_(BASE, has_past=True, past_seq=0, presents=True, bias=True),
    # BNSH cross: the K/V bias is ignored; with and without a past
    "BNSH-bias": with_(BASE, kv_layout="BNSH", bias=True, presents=True),
    "BNSH-past": with_(BASE, kv_layout="BNSH", bias=True, has_past=True, past_seq=3, presents=True, mask="2d"),
    # a decoder's cross attention, one or a few query rows over many keys (the split-key kernels; on the native
    # route's float16 / bfloat16 path with no layout mover: pipeline.reads_kv_in_place)
    "BNSH-decode-S1": with_(BASE, q_seq=1, kv_seq=300, kv_layout="BNSH", bias=True, mask="1d"),
    "BNSH-decode-S3-bias": with_(BASE, q_seq=3, kv_seq=200, kv_layout="BNSH", bias=True, mask="2d",
                                 attention_bias="BN"),  # fmt: skip
    # output 3, qk: the scores before the softmax, with bias, mask, causal fill, a past and -inf filled rows
    "qk": with_(BASE, qk=True),
    "qk-bias-2d-attn-bias": with_(BASE, qk=True, bias=True, mask="2d", attention_bias="1N"),
    "qk-causal-past": with_(BASE, qk=True, q_seq=3, kv_seq=3, has_past=True, past_seq=4, presents=True, causal=True),
    "qk-fully-padded-inf": with_(BASE, qk=True, mask="3d", fully_padded=True, mask_filter_value=float("-inf")),
    "qk-BNSH-decode-S1": with_(BASE, qk=True, q_seq=1, kv_seq=300, kv_layout="BNSH", bias=True, mask="1d"),
    # explicit scale, symbolic and unranked shapes
    "scale-0.5": with_(BASE, scale=0.5, mask="1d"),
    "symbolic": with_(BASE, shapes="symbolic", bias=True, mask="3d", attention_bias="1N", causal=True),
    "unranked": with_(BASE, shapes="unranked", bias=True, mask="2d", has_past=True, past_seq=2, presents=True),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CORNER_CASES))
def test_corner_case_matches_stock_ort(name, dtype, run_backend, rng):
    seed = int(rng.integers(0, 2**30))
    for parity in (0, 1):  # an even seed draws 0/1 mask values, an odd one "any" values (2, -1, ...)
        check_vs_stock(with_(CORNER_CASES[name], dtype=dtype), run_backend, 2 * seed + parity)


@pytest.mark.parametrize("name", list(CORNER_CASES))
def test_corner_case_bfloat16_matches_float64_oracle(name, backend, rng):
    check_vs_oracle(with_(CORNER_CASES[name], dtype="bfloat16"), backend, int(rng.integers(0, 2**31 - 1)))


# Projection biases at a sharp scale with wide heads: where rounding the biased Q and K to float16 moved the cuda
# backend's outputs by up to 6e-3 against ORT CPU (issue 14; dispatch.score_terms keeps those scores exact).
# Head 96 and 128 on the fused kernels, 132 on the three-phase path; with a past (the key bias then reaches only
# the new keys), a padding mask and presents.
WIDE_BIASED = MhaConfig(batch=2, q_seq=70, kv_seq=150, num_heads=2, head_size=128, bias=True, scale=0.3)
WIDE_BIASED_CASES = {
    "H128": WIDE_BIASED,
    "H96-2d-presents": with_(WIDE_BIASED, head_size=96, mask="2d", presents=True),
    "H132-three-phase": with_(WIDE_BIASED, head_size=132, mask="1d"),
    "H128-past": with_(WIDE_BIASED, q_seq=9, kv_seq=9, has_past=True, past_seq=140, presents=True),
    "H64-past-S1-causal": with_(WIDE_BIASED, q_seq=1, kv_seq=1, head_size=64, has_past=True, past_seq=200,
                                presents=True, causal=True, mask="2d"),
    "H64-BNSH-S1-cross": with_(WIDE_BIASED, q_seq=1, kv_seq=1500, head_size=64, kv_layout="BNSH"),
    "H64-BNSH-S1-cross-qk": with_(WIDE_BIASED, q_seq=1, kv_seq=1500, head_size=64, kv_layout="BNSH", qk=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(WIDE_BIASED_CASES))
def test_biased_wide_heads_float16_match_stock_ort(name, run_backend, rng):
    for _ in range(2):
        check_vs_stock(with_(WIDE_BIASED_CASES[name], dtype="float16"), run_backend, int(rng.integers(0, 2**30)))


@pytest.mark.parametrize("name", list(WIDE_BIASED_CASES))
def test_biased_wide_heads_bfloat16_match_float64_oracle(name, backend, rng):
    check_vs_oracle(with_(WIDE_BIASED_CASES[name], dtype="bfloat16"), backend, int(rng.integers(0, 2**30)))


def test_fully_padded_rows_are_nan_with_minus_inf_and_finite_with_default(run_backend, rng):
    """The NaN-aware compare must see real NaN rows: -inf + a fully padded batch gives NaN on both sides, the
    default -10000 gives finite values (ORT: softmax of the raw scores)."""
    for value, expect_nan in ((float("-inf"), True), (None, False)):
        config = with_(BASE, mask="2d", fully_padded=True, mask_filter_value=value)
        feeds = random_feeds(config, rng)
        expected = stock_outputs(config, feeds)["output"]
        actual = run_plugin(config, feeds, run_backend, ["output"])["output"]
        assert np.isnan(expected[0]).all() == expect_nan, f"{config.short()}: stock batch 0 NaN={expect_nan}?"
        assert np.isnan(actual[0]).all() == expect_nan, f"{config.short()}: plugin batch 0 {actual[0]}"
        assert np.isfinite(actual[1]).all() and np.isfinite(expected[1]).all(), config.short()


# ------------------------------------------------------------------------------------------------ regressions
def test_float_attributes_reach_the_op_exactly():
    """Through the bridge, the reference backend must compute exactly what ``run_reference`` computes on the node's
    own attributes (same NumPy code, same inputs: agreement to 1e-7). scale = 0.10000049 arrives as 0.1 (relative
    error 4.9e-6), which moves the output by a few 1e-6: half of the 1e-5 float32 budget against stock ORT, which
    is how it showed up (test_mha.py grid config B3 S256 N3 H80 with scale=1/sqrt(80) written out: 1.09e-5).
    Fixed in 1c6ddbf (the floats also travel as float.hex text); this test keeps it fixed."""
    from mha_ep.engine.reference import run_reference
    from mha_ep.engine.problem import build_problem

    from mha_models import attributes, slot_arrays

    config = MhaConfig(batch=2, q_seq=4, kv_seq=16, num_heads=2, head_size=16, scale=0.10000049)
    feeds = random_feeds(config, np.random.default_rng(20261129), std=1.5)
    exact = run_reference(build_problem(attributes(config), slot_arrays(feeds))).output_BSDv
    actual = run_plugin(config, feeds, "reference", ["output"])
    assert_outputs_match(actual, {"output": exact}, 1e-7, f"[reference via bridge vs run_reference] {config.short()}")


@pytest.mark.parametrize("kv_layout", ["BSNH", "BNSH"])
def test_past_without_presents_gets_the_right_answer(kv_layout, run_backend, rng):
    """Stock ORT CPU computes wrong outputs for a past without both present outputs (docs/SEMANTICS.md §3.9); the plugin
    computes the right answer, which is stock ORT's output for the same call with the presents requested."""
    config = with_(BASE, kv_layout=kv_layout, bias=True, mask="2d", causal=True, has_past=True, past_seq=3)
    feeds = random_feeds(config, rng)
    right = stock_outputs(with_(config, presents=True), feeds)["output"]
    actual = run_plugin(config, feeds, run_backend, ["output"])
    assert_outputs_match(actual, {"output": right}, PARITY_TOLERANCE["float32"], f"[{run_backend}] {config.short()}")


def test_causal_lowest_is_added_to_a_huge_negative_attention_bias(run_backend, rng):
    """ORT adds its causal mask (lowest at future keys) to score + attention_bias; with a Hugging Face style
    combined mask as attention_bias (float32 min at padded and future keys), rows that see only padding are
    decided by score + bias + lowest. Every backend (and on the GPU both cuda paths) must give stock ORT's rows."""
    b, s, n, h = 2, 5, 2, 8
    lowest = np.finfo(np.float32).min
    bias = np.where(np.triu(np.ones((s, s), bool), 1), lowest, 0.0).astype(np.float32)[None, None].repeat(b, 0)
    bias[0, :, :, :2] = lowest  # left padding of batch 0
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "attention_bias"], ["out"],
                            domain="com.microsoft", name="mha", num_heads=n, unidirectional=1)  # fmt: skip
    inputs = [helper.make_tensor_value_info(x, TP.FLOAT, [b, s, n * h]) for x in "qkv"]
    inputs.append(helper.make_tensor_value_info("attention_bias", TP.FLOAT, [b, 1, s, s]))
    model = model_of([node], inputs, [helper.make_tensor_value_info("out", TP.FLOAT, [b, s, n * h])])
    feeds = {x: rng.standard_normal((b, s, n * h)).astype(np.float32) for x in "qkv"}
    feeds["attention_bias"] = bias
    import onnxruntime

    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = plugin_session(model, run_backend).run(None, feeds)[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
