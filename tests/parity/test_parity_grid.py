"""Parity on the CPU grid of ORT's own test_mha.py: the plugin vs stock ORT CPU, float32, within 1e-5.

The grid is ``no_kv_cache_test_cases`` and ``kv_cache_test_cases`` of onnxruntime/test/python/transformers/test_mha.py
(commit df873177; docs/SEMANTICS.md §5.2) in its default (non-comprehensive) mode, CPU provider:

* 12 iterations; iteration i takes ``list[i % len(list)]`` of each list: batch [1,2,3], sequence lengths (see
  below), heads [1,3,4,16], head sizes [8,16,32,40,64,80,96,128,160,192,224,256], mask format
  [none, 1D key lengths, 2D key padding], attention bias [(none), (B,N), (1,N), (B,1), (1,1)].
* no_kv_cache: sequence lengths [1,16,127,128,255,256,383,384,512]; L = S, P = 0; each iteration x format
  {BSNH, BNSH cross} x causal {T,F} x bias {T,F} -> 12 * 2 * 2 * 2 = 96 configs.
* kv_cache: lengths [1,15,16,255,256,512]; format BSNH; x causal x has_past_input x bias -> 96 configs. With a past:
  S = L = 1, P = the listed length; without: S = L = the listed length, P = 0. Present outputs are always requested.

As in benchmark_mha's model: ``scale`` = 1/sqrt(H) written out as an attribute (all its digits must reach the op:
with 6 significant digits, 1/sqrt(80) alone cost 1.1e-5 here before 1c6ddbf), ``mask_filter_value`` = -inf, int32
mask, right padding lengths randint(1, T+1). Unlike test_mha.py nothing is zeroed before comparing (all rows, all
present entries are compared), the inputs are N(0, 1) instead of N(0, 0.1), and the oracle is stock ORT itself.

Runtime: the whole grid runs uncapped; its largest config (kv_cache B3 S=L=512 N16 H256) costs about 3 s on 2 cores
and the file about 45 s, so no per-config cap is needed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mha_ep

from mha_models import MhaConfig, assert_outputs_match, build_model, plugin_session, random_feeds, stock_outputs

BATCHES = [1, 2, 3]
HEADS = [1, 3, 4, 16]
HEAD_SIZES = [8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
MASKS = ["none", "1d", "2d"]
ATTENTION_BIAS = [None, "BN", "1N", "B1", "11"]
NO_CACHE_SEQ = [1, 16, 127, 128, 255, 256, 383, 384, 512]
KV_CACHE_SEQ = [1, 15, 16, 255, 256, 512]
ITERATIONS = max(len(BATCHES), len(NO_CACHE_SEQ), len(HEADS), len(HEAD_SIZES))  # 12, as test_mha.py
TOLERANCE = 1e-5  # float32, relative to max(1, |x|); tests/conftest.PARITY_TOLERANCE["float32"]


def _iteration(i: int, lengths):
    return dict(
        batch=BATCHES[i % len(BATCHES)],
        length=lengths[i % len(lengths)],
        num_heads=HEADS[i % len(HEADS)],
        head_size=HEAD_SIZES[i % len(HEAD_SIZES)],
        mask=MASKS[i % len(MASKS)],
        attention_bias=ATTENTION_BIAS[i % len(ATTENTION_BIAS)],
    )


def _shared_fields(it: dict) -> dict:
    """MhaConfig fields both grids take from an iteration (test_mha.py: mask_filter_value -inf, scale 1/sqrt(H))."""
    return dict(batch=it["batch"], num_heads=it["num_heads"], head_size=it["head_size"], mask=it["mask"],
                attention_bias=it["attention_bias"], mask_filter_value=float("-inf"),
                scale=1.0 / math.sqrt(it["head_size"]))  # fmt: skip


def no_kv_cache_configs():
    for i in range(ITERATIONS):
        it = _iteration(i, NO_CACHE_SEQ)
        for kv_layout in ("BSNH", "BNSH"):
            for causal in (True, False):
                for bias in (True, False):
                    yield MhaConfig(q_seq=it["length"], kv_seq=it["length"], kv_layout=kv_layout, causal=causal,
                                    bias=bias, **_shared_fields(it))


def kv_cache_configs():
    for i in range(ITERATIONS):
        it = _iteration(i, KV_CACHE_SEQ)
        for causal in (True, False):
            for has_past in (True, False):
                for bias in (True, False):
                    length = 1 if has_past else it["length"]
                    yield MhaConfig(q_seq=length, kv_seq=length, past_seq=it["length"] if has_past else 0,
                                    has_past=has_past, presents=True, causal=causal, bias=bias, **_shared_fields(it))


NO_KV_CACHE = list(no_kv_cache_configs())
KV_CACHE = list(kv_cache_configs())


def test_grid_has_the_sizes_of_test_mha():
    """The CPU grid of test_mha.py is 96 + 96 configs and covers every value of every axis."""
    assert (len(NO_KV_CACHE), len(KV_CACHE)) == (96, 96), (len(NO_KV_CACHE), len(KV_CACHE))
    for configs, lengths in ((NO_KV_CACHE, NO_CACHE_SEQ), (KV_CACHE, KV_CACHE_SEQ)):
        seen_lengths = {c.past_seq if c.has_past else c.q_seq for c in configs}
        assert seen_lengths == set(lengths), (sorted(seen_lengths), lengths)
        assert {c.num_heads for c in configs} == set(HEADS)
        assert {c.head_size for c in configs} == set(HEAD_SIZES)
        assert {c.batch for c in configs} == set(BATCHES)
        assert {c.mask for c in configs} == set(MASKS)
        assert {c.attention_bias for c in configs} == set(ATTENTION_BIAS)
        assert {(c.causal, c.bias) for c in configs} == {(a, b) for a in (True, False) for b in (True, False)}
    assert {c.kv_layout for c in NO_KV_CACHE} == {"BSNH", "BNSH"}
    assert {c.has_past for c in KV_CACHE} == {True, False}


def check_parity(config: MhaConfig, backend: str, rng: np.random.Generator) -> None:
    model = build_model(config)
    result = mha_ep.partition(model)
    assert [d.claimed for d in result.decisions] == [True], f"{config.short()}: {result.report()}"
    feeds = random_feeds(config, rng)
    expected = stock_outputs(config, feeds)
    for name, value in expected.items():  # the grid never makes a fully masked row: NaN here is a test bug
        assert np.isfinite(value).all(), f"{config.short()}: stock ORT {name} is not finite"
    session = plugin_session(model, backend)
    names = list(expected)
    actual = dict(zip(names, session.run(names, feeds)))
    assert_outputs_match(actual, expected, TOLERANCE, f"[{backend}] {config.short()}")


@pytest.mark.parametrize("config", NO_KV_CACHE, ids=lambda c: c.short().replace(" ", "-"))
def test_no_kv_cache(config, run_backend, rng):
    check_parity(config, run_backend, rng)


@pytest.mark.parametrize("config", KV_CACHE, ids=lambda c: c.short().replace(" ", "-"))
def test_kv_cache(config, run_backend, rng):
    check_parity(config, run_backend, rng)
