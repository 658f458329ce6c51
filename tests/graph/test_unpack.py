"""graph/unpack.py: stock ORT's twin of a packed model. Stock ORT CPU refuses the packed node and runs its twin, whose
outputs are the unpacked node's to the bit (the same kernel on the same values: Gather and Reshape copy them);
`mha-ep compare` uses the twin as its oracle for packed models."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

import mha_ep
from mha_ep.comparison import compare
from mha_ep.graph.unpack import unpack_packed_attention
from mha_models import MhaConfig, build_model, packed_feeds, packed_model, random_feeds, stock_outputs, with_

BASE = MhaConfig(batch=2, q_seq=5, kv_seq=5, num_heads=2, head_size=8)
SHARED = MhaConfig(batch=2, q_seq=1, kv_seq=1, num_heads=2, head_size=8, has_past=True, past_seq=5, presents=True,
                   max_seq=9, bias=True)  # fmt: skip
CASES = {
    "qkv": ("qkv", BASE),
    "qkv-bias-mask-2d": ("qkv", with_(BASE, bias=True, mask="2d")),
    "qkv-causal-attention-bias-qk": ("qkv", with_(BASE, causal=True, attention_bias="1N", qk=True)),
    "kv": ("kv", with_(BASE, q_seq=4, kv_seq=7)),
    "kv-mask-1d": ("kv", with_(BASE, q_seq=1, kv_seq=9, mask="1d")),
    "qkv-shared-buffer": ("qkv", SHARED),  # mha_ep's form: the static rewrite's packed projections
    "qkv-shared-buffer-beams": ("qkv", with_(SHARED, batch=4, beams=2)),
}


def run_stock(model, feeds: dict) -> dict:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_stock_ort_runs_the_twin_and_gives_the_unpacked_nodes_outputs(name, dtype, rng):
    form, config = CASES[name]
    config = with_(config, dtype=dtype)
    feeds = random_feeds(config, rng)
    packed = packed_model(config, form)
    before = packed.SerializeToString()
    twin, done = unpack_packed_attention(packed)
    assert packed.SerializeToString() == before, "the caller's model is left as it is"
    assert [f for _, f in done.nodes] == [form] and not done.left
    with pytest.raises(Exception, match="not implemented for CPU|shall be empty"):
        run_stock(packed, packed_feeds(config, feeds, form))  # why the twin exists
    got = run_stock(twin, packed_feeds(config, feeds, form))
    want = stock_outputs(config, feeds)
    assert set(got) == set(want)
    for output in want:
        assert np.array_equal(got[output], want[output], equal_nan=True), f"{name}: {output}"


def test_a_model_without_packed_nodes_comes_back_as_it_is():
    model = build_model(BASE)
    twin, done = unpack_packed_attention(model)
    assert twin is model and done.note() == ""


def test_compare_checks_a_packed_model_against_stock_ort_on_its_twin(rng):
    """`mha-ep compare` on a packed model: stock ORT CPU refuses the packed node, so its side runs the twin, and the
    report says which nodes were unpacked for it."""
    config = with_(BASE, dtype="float32", bias=True, mask="2d")
    report = compare(packed_model(config, "qkv"), backend="reference", name="packed")
    assert not report.cannot_run, report.cannot_run
    assert report.verdict.name == "PASS", report.text()
    assert any("given to stock ORT with their inputs unpacked" in note and "(QKV)" in note for note in report.notes)


def test_the_static_rewrites_packed_decoder_compares_with_stock_ort():
    """The decoder `mha-ep static-cache` writes by default (packed Q/K/V projections, which stock ORT refuses)
    passes `mha-ep compare` against stock ORT on its twin."""
    from mha_ep.graph.static_cache import static_cache
    from mha_ep.shipped import shipped_model

    result = static_cache(shipped_model("whisper_random_decoder_fp32.onnx"), max_length=16, batch=1)
    assert result.packed_nodes, result.report()
    report = compare(result.model, backend="reference", name="static packed")
    assert report.verdict.name == "PASS", report.text()
    unpacked = [note for note in report.notes if "given to stock ORT with their inputs unpacked" in note]
    assert unpacked and all(node in unpacked[0] for node in result.packed_nodes)
    assert mha_ep.partition(result.model).claimed >= len(result.packed_nodes)
