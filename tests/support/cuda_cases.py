"""Random MhaProblems and the naive same-dtype baseline for the cuda backend's and the fused kernel's GPU tests
(a helper, not a test module).

``Case`` names a configuration in the layout legend of mha_ep/spec.py; ``make_problem`` draws fresh random inputs
(never zeros) rounded to the call's dtype, with a real padding pattern for every mask kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mha_ep.engine.reference import softmax_lastaxis, to_BNSH
from mha_ep.engine.problem import FLOAT32_LOWEST, MhaProblem, build_problem


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in ``dtype`` (round to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return rounded.view(np.float32)
    return x


def to_device(cupy, array: np.ndarray, dtype: str):
    """A device copy of float32 values in ``dtype`` (bfloat16 travels as its upper 16 bits)."""
    array = np.ascontiguousarray(array, np.float32)
    if dtype == "float16":
        return cupy.asarray(array.astype(np.float16))
    if dtype == "bfloat16":
        return cupy.asarray((round_to_dtype(array, "bfloat16").view(np.uint32) >> 16).astype(np.uint16))
    return cupy.asarray(array)


def from_device(cupy, array) -> np.ndarray:
    """float32 values of a device array as to_device makes them (uint16: bfloat16 bits)."""
    host = cupy.asnumpy(array)
    if host.dtype == np.uint16:
        return (host.astype(np.uint32) << 16).view(np.float32)
    return host.astype(np.float32)


@dataclass
class Case:
    b: int = 2
    s: int = 5
    l: int = 7  # noqa: E741 - the legend's L
    p: Optional[int] = None  # past length; None = no past inputs
    n: int = 2
    h: int = 64
    hv: Optional[int] = None
    layout: str = "BSNH"
    bias: bool = True
    bias_scale: float = 0.5  # standard deviation of the projection biases
    mask: Optional[str] = None  # "lengths" | "lengths_3b2" | "BT" | "BT_prefix" | "BST"
    attention_bias: Optional[tuple] = None  # (d0 is B, d1 is N) flags
    causal: bool = False
    presents: bool = False
    mask_filter_value: Optional[float] = None
    full_padding: bool = False  # batch 0 has every key padded
    seed: int = 0
    attrs: dict = field(default_factory=dict)


def make_problem(case: Case, dtype: str, presents: Optional[bool] = None) -> MhaProblem:
    """A problem of fresh random inputs rounded to ``dtype``; ``presents`` overrides ``case.presents``."""
    rng = np.random.default_rng(case.seed)
    hv = case.hv or case.h
    b, s, l, n = case.b, case.s, case.l, case.n
    p = case.p or 0
    t = p + l

    def rand(*shape, scale=1.0):
        return round_to_dtype(rng.standard_normal(shape).astype(np.float32) * scale, dtype)

    query = rand(b, s, n * case.h)
    if case.layout == "BSNH":
        key, value = rand(b, l, n * case.h), rand(b, l, n * hv)
    else:
        key, value = rand(b, n, l, case.h), rand(b, n, l, hv)
    bias = rand(2 * n * case.h + n * hv, scale=case.bias_scale) if case.bias else None
    mask = None
    if case.mask is not None:
        lengths = rng.integers(1, t + 1, size=b).astype(np.int32)
        lengths[-1] = max(1, t // 2)  # at least one batch really padded
        if case.full_padding:
            lengths[0] = 0
        if case.mask == "lengths":
            mask = lengths
        elif case.mask == "lengths_3b2":
            mask = np.concatenate([lengths, rng.integers(0, t, size=2 * b + 2)]).astype(np.int32)
        elif case.mask == "BT_prefix":  # (B, T) flags shaped like key lengths: whole key tiles kept or padded
            mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
        elif case.mask == "BT":
            mask = (rng.random((b, t)) > 0.3).astype(np.int32) * rng.integers(1, 3, size=(b, t)).astype(np.int32)
            mask[:, 0] = 1
            if case.full_padding:
                mask[0] = -rng.integers(0, 2, size=t)  # 0 and negative both mean padded
        elif case.mask == "BST":
            mask = (rng.random((b, s, t)) > 0.3).astype(np.int32)
            mask[:, :, 0] = 1
            if case.full_padding:
                mask[0] = 0
    attention_bias = None
    if case.attention_bias is not None:
        full_b, full_n = case.attention_bias
        attention_bias = rand(b if full_b else 1, n if full_n else 1, s, t, scale=2.0)
    past_key = past_value = None
    if case.p is not None:
        past_key, past_value = rand(b, n, p, case.h), rand(b, n, p, hv)
    attrs = {"num_heads": n, "unidirectional": int(case.causal), **case.attrs}
    if case.mask_filter_value is not None:
        attrs["mask_filter_value"] = case.mask_filter_value
    arrays = [query, key, value, bias, mask, attention_bias, past_key, past_value]
    want = case.presents if presents is None else presents
    outputs = (True, want, want, False)
    return build_problem(attrs, arrays, dtype, outputs)


def dense_operands(problem: MhaProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q_BNSH, k_BNTH, v_BNTH as the layout mover builds them: bias added in float32, one rounding to the dtype."""
    g, dt = problem.geometry, problem.dtype
    n = g.num_heads

    def biased(x, bias):
        return round_to_dtype(x if bias is None else x + bias, dt)

    q = to_BNSH(biased(problem.query_BSD, problem.bias_q), n)
    if problem.kv_layout == "BSNH":
        k = to_BNSH(biased(problem.key, problem.bias_k), n)
        v = to_BNSH(biased(problem.value, problem.bias_v), n)
    else:
        k, v = problem.key, problem.value
    if problem.past_key_BNPH is not None:
        k = np.concatenate([problem.past_key_BNPH, k], axis=2)
        v = np.concatenate([problem.past_value_BNPH, v], axis=2)
    return (np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k, np.float32),
            np.ascontiguousarray(v, np.float32))  # fmt: skip


def naive_low_precision(problem: MhaProblem) -> list:
    """[output (+ present_key, present_value when wanted)] with every intermediate stored in the call's dtype (float32 arithmetic inside each step): the naive baseline."""
    g, dt = problem.geometry, problem.dtype
    r = lambda x: round_to_dtype(np.asarray(x, np.float32), dt)  # noqa: E731
    q, k, v = dense_operands(problem)
    scores = r(np.matmul(q, k.transpose(0, 1, 3, 2)) * np.float32(problem.scale))
    if problem.attention_bias is not None:
        scores = r(scores + problem.attention_bias)
    if problem.padding_mask is not None:
        keep = problem.padding_mask.keep_BST(g.q_seq, g.total_seq)[:, None]
        scores = r(np.where(keep, scores, scores + np.float32(problem.mask_filter_value)))
    if problem.causal:
        rows, cols = np.arange(g.q_seq)[:, None], np.arange(g.total_seq)[None, :]
        scores = np.where((cols > g.past_seq + rows) & (rows < g.q_seq - 1), np.float32(FLOAT32_LOWEST), scores)
    probs = r(softmax_lastaxis(scores.astype(np.float32)))
    out = r(np.matmul(probs, v)).transpose(0, 2, 1, 3).reshape(g.batch, g.q_seq, g.v_hidden)
    return [out, k, v] if problem.want_present_key else [out]
