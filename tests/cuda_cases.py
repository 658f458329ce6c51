"""Random MhaProblems for the cuda backend's and the fused kernel's GPU tests (a helper, not a test module).

``Case`` names a configuration in the layout legend of mha_ep/spec.py; ``make_problem`` draws fresh random inputs
(never zeros) rounded to the call's dtype, with a real padding pattern for every mask kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mha_ep.ops.problem import MhaProblem, build_problem


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
    mask: Optional[str] = None  # "lengths" | "lengths_3b2" | "BT" | "BST"
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
    bias = rand(2 * n * case.h + n * hv, scale=0.5) if case.bias else None
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
