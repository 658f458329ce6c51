"""Packed QKV (query (B, S, N, 3, H), no key or value) and packed KV (key (B, L, N, 2, H), no value), the forms ORT's
Stable Diffusion optimization writes (docs/SEMANTICS.md §2.1). Stock ORT's CPU provider refuses both, so the oracle
is stock ORT CPU on the same node with its inputs unpacked (float32, float16), and the float64 reference on the
unpacked inputs for bfloat16; the plugin runs the packed node. Every route (``run_backend``), with what stock ORT
allows beside a packed input and what mha_ep adds: a key padding mask, attention_bias, causal (packed QKV), a bias
(packed KV: stock ORT refuses one; it applies to the query and to the key and value slots as for separate
inputs), qk. Odd sizes: S = 1, 5, 77 (Stable Diffusion's text length), head sizes 8, 59 and SD 1.5's 40, 80 and 160
at lengths the flash kernels take (a partial last tile of queries and keys)."""

from __future__ import annotations

import numpy as np
import pytest

import mha_ep
from conftest import PARITY_TOLERANCE, max_rel_error
from mha_models import (
    MhaConfig,
    naive_same_dtype,
    oracle_float64,
    packed_feeds,
    packed_model,
    plugin_session,
    random_feeds,
    stock_outputs,
    with_,
)

BF16_TOLERANCE = 2.0**-8 + 1e-5  # as test_parity_random: 2 x the naive bf16 error + this floor


def run_packed(config: MhaConfig, form: str, feeds: dict, backend: str) -> dict:
    model = packed_model(config, form)
    result = mha_ep.partition(model)
    assert result.claimed == 1, result.report()
    session = plugin_session(model, backend)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, packed_feeds(config, feeds, form))))


BASE = MhaConfig(batch=2, q_seq=5, kv_seq=5, num_heads=2, head_size=8)
CASES = {
    "qkv": ("qkv", BASE),
    "qkv-S1": ("qkv", with_(BASE, q_seq=1, kv_seq=1)),
    "qkv-bias-mask-2d": ("qkv", with_(BASE, bias=True, mask="2d")),
    "qkv-causal-attn-bias": ("qkv", with_(BASE, causal=True, attention_bias="1N")),
    "qkv-H40-1d-qk": ("qkv", with_(BASE, head_size=40, num_heads=3, mask="1d", qk=True)),
    "qkv-H59-3d": ("qkv", with_(BASE, head_size=59, mask="3d", bias=True)),
    "kv": ("kv", with_(BASE, q_seq=4, kv_seq=7)),
    "kv-L77-H40": ("kv", with_(BASE, q_seq=9, kv_seq=77, head_size=40)),
    "kv-bias": ("kv", with_(BASE, q_seq=3, kv_seq=6, bias=True)),  # mha_ep's: stock ORT refuses a bias here
    "kv-mask-attn-bias-qk": ("kv", with_(BASE, q_seq=2, kv_seq=6, mask="2d", attention_bias="BN", qk=True)),
    "kv-S1-decode": ("kv", with_(BASE, q_seq=1, kv_seq=77, num_heads=4, head_size=16, mask="1d")),
    # Stable Diffusion 1.5's head sizes on the flash kernels, read in place (no bias: pipeline.reads_sources_in_place)
    # and through the movers (a bias): H 40 and 80 on the wgmma kernels' 64 / 128 tiles, 160 on flash_attention_mma's.
    "qkv-H40-S200": ("qkv", with_(BASE, q_seq=200, kv_seq=200, head_size=40)),
    "qkv-H80-S130-causal": ("qkv", with_(BASE, q_seq=130, kv_seq=130, head_size=80, causal=True)),
    "qkv-H80-S70-bias-1d": ("qkv", with_(BASE, q_seq=70, kv_seq=70, head_size=80, bias=True, mask="1d")),
    "qkv-H160-S150": ("qkv", with_(BASE, q_seq=150, kv_seq=150, head_size=160)),
    "qkv-H160-S66-mask-attn-bias": ("qkv", with_(BASE, q_seq=66, kv_seq=66, head_size=160, mask="2d",
                                                 attention_bias="BN")),
    "kv-H80-S129-L77": ("kv", with_(BASE, q_seq=129, kv_seq=77, head_size=80, num_heads=3)),
    "kv-H160-S3-L77": ("kv", with_(BASE, q_seq=3, kv_seq=77, head_size=160)),
    "kv-H40-S300-L77-bias": ("kv", with_(BASE, q_seq=300, kv_seq=77, head_size=40, bias=True)),
}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_packed_node_matches_stock_ort_on_the_unpacked_node(name, dtype, run_backend, rng):
    form, config = CASES[name]
    config = with_(config, dtype=dtype)
    feeds = random_feeds(config, rng)
    expected = stock_outputs(config, feeds)
    actual = run_packed(config, form, feeds, run_backend)
    for output, want in expected.items():
        error = max_rel_error(actual[output], want)
        assert actual[output].shape == want.shape and error <= PARITY_TOLERANCE[dtype], (
            f"[{run_backend}] {name} {config.short()}: {output} max rel error {error:.3g}"
        )


@pytest.mark.parametrize("name", list(CASES))
def test_a_packed_bfloat16_node_matches_the_float64_reference(name, backend, rng):
    form, config = CASES[name]
    config = with_(config, dtype="bfloat16")
    feeds = random_feeds(config, rng)
    expected, naive = oracle_float64(config, feeds), naive_same_dtype(config, feeds)
    tolerance = 2 * max(max_rel_error(naive[n], expected[n]) for n in expected) + BF16_TOLERANCE
    actual = run_packed(config, form, feeds, backend)
    for output, want in expected.items():
        error = max_rel_error(actual[output], want)
        assert error <= tolerance, f"[{backend}] {name}: {output} max rel error {error:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("form, bad, words", [
    ("qkv", (2, 5, 2, 2, 8), "Expect 'query' shape (batch_size, sequence_length, num_heads, 3, head_size) for packed qkv"),
    ("qkv", (2, 5, 3, 3, 8), "for packed qkv: got (2, 5, 3, 3, 8) with num_heads 2"),
    ("kv", (2, 5, 2, 3, 8), "Expect 'key' shape (batch_size, kv_sequence_length, num_heads, 2, head_size) for packed kv"),
    ("kv", (2, 5, 2, 2, 4), "packed KV key head_size 4 must equal query head_size 8"),
])  # fmt: skip
def test_a_bad_packed_feed_fails_the_run_naming_the_input_and_a_good_one_runs(form, bad, words, run_backend, rng):
    """Symbolic shapes: the gate claims the node, the execute-time rules refuse the bad packed feed with stock ORT's
    words (MhaRunError, the RuntimeException stock ORT CPU raises for every packed call), and the session then runs
    a good packed feed, matching stock ORT CPU on the unpacked node."""
    config = with_(BASE, shapes="symbolic")
    model = packed_model(config, form)
    assert mha_ep.partition(model).claimed == 1
    session = plugin_session(model, run_backend)
    feeds = random_feeds(config, rng)
    good = packed_feeds(config, feeds, form)
    slot = "query" if form == "qkv" else "key"
    with pytest.raises(mha_ep.MhaRunError) as caught:
        session.run(None, {**good, slot: rng.standard_normal(bad).astype(np.float32)})
    assert words in str(caught.value) and slot in str(caught.value), str(caught.value)
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    assert isinstance(caught.value, RuntimeException), type(caught.value).__mro__  # stock ORT CPU's type
    expected = stock_outputs(config, feeds)
    (output,) = session.run(["output"], good)
    assert max_rel_error(output, expected["output"]) <= PARITY_TOLERANCE["float32"]
