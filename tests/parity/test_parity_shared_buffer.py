"""The shared past/present buffer and cache_indirection (docs/SEMANTICS.md §3.9-3.10): the plugin vs stock ORT CPU.

A static KV cache's node: past_key / past_value (B, N, M, H) with their first P rows filled and
past_sequence_length = [P]; the L new rows land at [P, P+L) of presents of the same shape, whose other rows are the
past's; attention runs over the P + L filled rows (causal within the new rows when asked). With cache_indirection
(B/W, W, M) and one query token (the beam path), past row j of batch row b*W + w comes from row
b*W + cache_indirection[b, w, j]. What the strategies draw: P from 0 (the first step) to M - L, M with room to
spare, S = L from 1 to 4 (a prompt of a few tokens into the cache), beams 1 to 3 (the beam path at S = 1, and
cache_indirection that ORT ignores at S > 1, at P = 0, or with a (B,) mask), every mask format over T = P + L, with
"any" values (the beam path keeps every nonzero value, the math path every positive one), attention_bias (dim 0 of
1 on the beam path: claim/rules.py rule_cache_indirection), causal, projection biases, float32 and float16 at stock
ORT's tolerances, bfloat16 against the float64 oracle. The past's rows beyond P + L are random too: a present that
does not carry them over, or a write past row P + L, shows.

``test_present_bound_to_its_past`` runs the static decoder's binding: one OrtValue as past and present, through
IOBinding, where only rows [P, P+L) may change.

The corners and the binding also run as packed QKV nodes (``FORMS``: query (B, L, N, 3, H), no key or value, over
the same shared buffer; mha_ep's form, which stock ORT refuses), against stock ORT CPU on the unpacked node.
"""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PARITY_TOLERANCE
from mha_models import (
    MhaConfig, build_model, packed_feeds, packed_model, plugin_session, random_feeds, stock_outputs, with_,
)
from test_parity_random import RANDOM_SETTINGS, check_vs_oracle, check_vs_stock


@st.composite
def shared_configs(draw, dtype: str = "float32"):
    beams = draw(st.sampled_from((0, 1, 2, 3)))
    batch = draw(st.integers(1, 2)) * max(beams, 1)
    q_seq = draw(st.sampled_from((1, 1, 1, 2, 4)))  # mostly decode steps
    past = draw(st.integers(0, 6))
    max_seq = past + q_seq + draw(st.integers(0, 4))
    mask = draw(st.sampled_from(("none", "none", "1d", "3b2", "2d", "3d")))
    beam_path = beams and q_seq == 1 and mask in ("none", "2d")
    attention_bias = draw(st.sampled_from((None, "1N", "11") if beam_path else (None, "BN", "1N", "B1", "11")))
    head_size = draw(st.sampled_from((4, 8, 16, 40)))
    return MhaConfig(
        batch=batch, q_seq=q_seq, kv_seq=q_seq, num_heads=draw(st.integers(1, 3)), head_size=head_size,
        has_past=True, past_seq=past, presents=True, dtype=dtype, bias=draw(st.booleans()), mask=mask,
        mask_dtype=draw(st.sampled_from(("int32", "int64"))), attention_bias=attention_bias,
        causal=draw(st.booleans()), mask_filter_value=draw(st.sampled_from((None, -10000.0))),
        shapes=draw(st.sampled_from(("static", "symbolic"))), max_seq=max_seq, beams=beams,
    )  # fmt: skip


@settings(max_examples=100, **RANDOM_SETTINGS)
@given(config=shared_configs("float32"), seed=st.integers(0, 2**31 - 1))
def test_random_shared_buffer_float32_matches_stock_ort(run_backend, config, seed):
    check_vs_stock(config, run_backend, seed)


@settings(max_examples=50, **RANDOM_SETTINGS)
@given(config=shared_configs("float16"), seed=st.integers(0, 2**31 - 1))
def test_random_shared_buffer_float16_matches_stock_ort(run_backend, config, seed):
    check_vs_stock(config, run_backend, seed)


@settings(max_examples=40, **RANDOM_SETTINGS)
@given(config=shared_configs("bfloat16"), seed=st.integers(0, 2**31 - 1))
def test_random_shared_buffer_bfloat16_matches_float64_oracle(backend, config, seed):
    check_vs_oracle(config, backend, seed)


# ---------------------------------------------------------------------------------------------- fixed corners
STEP = MhaConfig(batch=2, q_seq=1, kv_seq=1, num_heads=2, head_size=8, has_past=True, past_seq=5, presents=True,
                 max_seq=9, bias=True)  # fmt: skip
SHARED_CORNERS = {
    "first-step-P0": with_(STEP, past_seq=0),
    "last-row-P8": with_(STEP, past_seq=8),
    "prompt-S4-causal": with_(STEP, q_seq=4, kv_seq=4, past_seq=3, causal=True),
    "prompt-S4-causal-P0": with_(STEP, q_seq=4, kv_seq=4, past_seq=0, causal=True, max_seq=4),
    "mask-2d-any-values": with_(STEP, mask="2d"),
    "mask-1d": with_(STEP, mask="1d", mask_dtype="int64"),
    "attention-bias-BN": with_(STEP, attention_bias="BN"),
    "beams-3": with_(STEP, batch=6, beams=3),
    "beams-3-mask-2d": with_(STEP, batch=6, beams=3, mask="2d"),  # the beam path keeps -1 (mask != 0)
    "beams-3-bias-1N": with_(STEP, batch=6, beams=3, attention_bias="1N"),
    "beams-2-P0": with_(STEP, batch=4, beams=2, past_seq=0),  # no past row to redirect
    "beams-2-mask-1d": with_(STEP, batch=4, beams=2, mask="1d"),  # ORT ignores cache_indirection here
    "beams-2-prompt-S3": with_(STEP, batch=4, beams=2, q_seq=3, kv_seq=3, causal=True),  # ... and here
    "H64-M448-P300": with_(STEP, head_size=64, num_heads=3, max_seq=448, past_seq=300),
    # the kernel stages the past in tiles of 8 KiB (shared_buffer.TILE_BYTES): several tiles, read in 16-byte
    # pieces (H 64), element by element (float16 H 20: rows of 40 bytes), and through the beams' indirection
    "H20-M300-P250": with_(STEP, head_size=20, max_seq=300, past_seq=250),
    "beams-2-H64-M256-P200": with_(STEP, batch=4, beams=2, head_size=64, max_seq=256, past_seq=200),
}


# "qkv": the corner's node with its query, key and value packed into one (B, L, N, 3, H) query (docs/SEMANTICS.md,
# "Packed QKV / KV: ours"), against stock ORT CPU on the unpacked node
FORMS = [pytest.param(None, id="unpacked"), pytest.param("qkv", id="packed-qkv")]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(SHARED_CORNERS))
def test_shared_buffer_corner_matches_stock_ort(name, dtype, form, run_backend, rng):
    seed = int(rng.integers(0, 2**30))
    for parity in (0, 1):  # an even seed draws 0/1 mask values, an odd one "any" values (2, -1, ...)
        check_vs_stock(with_(SHARED_CORNERS[name], dtype=dtype), run_backend, 2 * seed + parity, form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["beams-3", "prompt-S4-causal", "H64-M448-P300"])
def test_shared_buffer_corner_bfloat16_matches_float64_oracle(name, form, backend, rng):
    check_vs_oracle(with_(SHARED_CORNERS[name], dtype="bfloat16"), backend, int(rng.integers(0, 2**31 - 1)), form)


# -------------------------------------------------------------------------------------- the static binding
def bind_step(session, feeds: dict, cache: dict):
    """An IOBinding of ``feeds`` (NumPy, on the CPU) with the past and the present bound to one OrtValue each."""
    binding = session.io_binding()
    for name, array in feeds.items():
        if name not in cache:
            binding.bind_cpu_input(name, array)
    binding.bind_output("output")  # first: copy_outputs_to_cpu()[0]
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        binding.bind_ortvalue_input(past, cache[past])
        binding.bind_ortvalue_output(present, cache[past])
    return binding


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("beams", [0, 2])
def test_present_bound_to_its_past(run_backend, beams, form, rng):
    """The static decoder's binding: the present is the past's own OrtValue, and four steps run in a row. Each
    step gives stock ORT's output (stock fed a copy of the cache, the node unpacked), rows [P, P+1) take the new
    keys and values, and no other row of the buffer changes."""
    if run_backend.startswith("cuda"):
        pytest.skip("the CUDA routes' binding is tested with device buffers in tests/native/test_native_cuda.py")
    config = with_(STEP, batch=4 if beams else 2, beams=beams, past_seq=2)
    session = plugin_session(build_model(config) if form is None else packed_model(config, form), run_backend)
    feeds = random_feeds(config, rng)
    cache = {name: onnxruntime.OrtValue.ortvalue_from_numpy(feeds[name].copy()) for name in ("past_key", "past_value")}
    for step in range(4):
        feeds = {**random_feeds(with_(config, past_seq=2 + step), rng), "past_key": cache["past_key"].numpy(),
                 "past_value": cache["past_value"].numpy()}  # fmt: skip
        before = {name: value.numpy().copy() for name, value in cache.items()}
        expected = stock_outputs(with_(config, past_seq=2 + step), feeds)
        binding = bind_step(session, feeds if form is None else packed_feeds(config, feeds, form), cache)
        session.run_with_iobinding(binding)
        output = binding.copy_outputs_to_cpu()[0]
        context = f"[{run_backend}] step {step} {config.short()}"
        np.testing.assert_allclose(output, expected["output"], rtol=0, atol=PARITY_TOLERANCE["float32"], err_msg=context)
        p = 2 + step
        for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
            after = cache[past].numpy()
            np.testing.assert_array_equal(np.delete(after, p, axis=2), np.delete(before[past], p, axis=2), context)
            np.testing.assert_allclose(after[:, :, p], expected[present][:, :, p], rtol=0, atol=1e-6, err_msg=context)


def test_a_packed_node_refuses_a_bad_past_length_and_then_runs(run_backend, rng):
    """The shared buffer's run-time checks hold for the packed node too: P = M fails the run with stock ORT's
    sentence naming the node, and the session then runs a good step, matching stock ORT CPU on the unpacked node."""
    config = with_(STEP, past_seq=3)
    session = plugin_session(packed_model(config, "qkv"), run_backend)
    feeds = random_feeds(config, rng)
    packed = packed_feeds(config, feeds, "qkv")
    with pytest.raises(Exception, match=r"node 'mha'.*past_sequence_length must be non-negative and less than "
                                        r"max_sequence_length \(9\), got 9"):  # fmt: skip
        session.run(None, {**packed, "past_sequence_length": np.array([config.max_seq], np.int32)})
    (output,) = session.run(["output"], packed)
    np.testing.assert_allclose(output, stock_outputs(config, feeds)["output"], rtol=0,
                               atol=PARITY_TOLERANCE["float32"])  # fmt: skip
