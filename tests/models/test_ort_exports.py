"""Models as ONNX Runtime's own export scripts write them (tests/fixtures/ort_exports/, made by
scripts/make_ort_exports.py with ORT 1.31.1's Whisper ``convert_to_onnx`` and T5 ``convert_generation``): every
MultiHeadAttention node is claimed, on both routes, at any depth, and every output matches stock ORT CPU on the
same feeds.

- whisper_qk_decoder.onnx: the decoder-with-past of ``--no_beam_search_op --output_cross_qk`` (word timestamps):
  its cross-attention nodes ask for qk (output 3), which breaks ORT's symbolic shape inference for every node
  after the first of them; the qk outputs are compared too.
- whisper_decoder.onnx, whisper_decoder_init.onnx: the same export without qk, and its first decoder step.
- whisper_beamsearch.onnx: the script's default, one com.microsoft::WhisperBeamSearch node whose graph attributes
  (encoder, decoder) hold every MultiHeadAttention node; the sequences it searches are compared token for token.
- t5_beamsearch.onnx: ORT's T5 chain (convert_generation_model), one com.microsoft::BeamSearch node (model_type 1)
  whose decoder subgraph holds the 4 MultiHeadAttention nodes (self with past/present and a relative position
  bias, cross with key_padding_mask); post-processed by the fixture script so that stock ORT CPU runs it (its
  RelativePositionBias -> standard ops, a zero bias for the encoder's Attention), MultiHeadAttention untouched.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep import spec

from conftest import max_rel_error
from ort_export_feeds import FIXTURES, feeds_for

MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())["files"]
MODELS = sorted(MANIFEST)
ROUTES = ("python-op", "native")
TOLERANCE = 1e-4  # float32 models of two decoder layers: each claimed node is within 1e-5 of stock's


def mha_nodes(graph: onnx.GraphProto, domain: str):
    """Every MultiHeadAttention node of ``domain`` in ``graph`` and, recursively, its subgraphs."""
    for node in graph.node:
        if node.op_type == spec.OP_TYPE and node.domain == domain:
            yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from mha_nodes(sub, domain)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", MODELS)
def test_every_node_is_claimed(name, route):
    path = FIXTURES / name
    model = onnx.load(path)
    expected = len(list(mha_nodes(model.graph, spec.ORT_DOMAIN)))
    result = mha_ep.partition(model, route=route)
    assert expected > 0 and result.claimed == expected and result.declined == 0, result.report()
    assert not list(mha_nodes(result.model.graph, spec.ORT_DOMAIN)), "a node was left in com.microsoft"
    assert len(list(mha_nodes(result.model.graph, spec.PLUGIN_DOMAIN))) == expected


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", MODELS)
def test_outputs_match_stock_ort_cpu(name, route):
    path = FIXTURES / name
    feeds = feeds_for(path)
    stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in stock.get_outputs()]
    expected = dict(zip(names, stock.run(names, feeds)))
    session = mha_ep.InferenceSession(str(path), backend="reference", route=route)
    assert session.partition.claimed == len(list(mha_nodes(onnx.load(path).graph, spec.ORT_DOMAIN)))
    actual = dict(zip(names, session.run(names, feeds)))
    for output, want in expected.items():
        got = actual[output]
        assert got.shape == want.shape and got.dtype == want.dtype, (output, got.shape, want.shape)
        if want.dtype.kind in "iu":  # the beam search's token sequences: identical
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {route} {output}")
        else:
            assert max_rel_error(got, want) <= TOLERANCE, (name, route, output, max_rel_error(got, want))


def test_the_qk_export_asks_for_qk_and_gets_the_scores():
    """The qk outputs are the pre-softmax scores of the cross attention, (B, N, 1, 1500), masked nowhere: their
    softmax is the attention weights, so each row sums to 1 after a softmax and is not already normalised."""
    path = FIXTURES / "whisper_qk_decoder.onnx"
    qk_names = [o.name for o in onnx.load(path).graph.output if o.name.startswith("output_cross_qk")]
    assert qk_names
    session = mha_ep.InferenceSession(str(path), backend="reference", route="native")
    for scores in session.run(qk_names, feeds_for(path)):
        assert scores.shape[1:] == (4, 1, 1500) and np.isfinite(scores).all()
        assert not np.allclose(scores.sum(axis=-1), 1.0)


def attention_nodes(graph: onnx.GraphProto) -> int:
    """com.microsoft::Attention nodes in ``graph`` and, recursively, its subgraphs."""
    count = sum(n.op_type == "Attention" and n.domain == spec.ORT_DOMAIN for n in graph.node)
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                count += attention_nodes(sub)
    return count


LIFTABLE = [name for name in MODELS if attention_nodes(onnx.load(FIXTURES / name).graph)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", LIFTABLE)
def test_lifted_attention_inside_generation_subgraphs_is_claimed_and_matches(name, route):
    """--lift-attention reaches into subgraphs: the com.microsoft::Attention nodes ORT's exports keep (Whisper's
    encoder and first decoder step, T5's encoder, inside the BeamSearch graphs too) become MultiHeadAttention,
    every node is claimed, and the outputs still match stock ORT CPU's on the original model."""
    path = FIXTURES / name
    model = onnx.load(path)
    before = len(list(mha_nodes(model.graph, spec.ORT_DOMAIN))) + attention_nodes(model.graph)
    result = mha_ep.partition(model, lift_attention=True, route=route)
    assert attention_nodes(model.graph) > 0 and attention_nodes(result.model.graph) == 0, result.report()
    assert result.claimed == before and result.declined == 0, result.report()
    feeds = feeds_for(path)
    stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in stock.get_outputs()]
    session = mha_ep.InferenceSession(str(path), backend="reference", route=route, lift_attention=True)
    for output, got, want in zip(names, session.run(names, feeds), stock.run(names, feeds)):
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {route} {output}")
        else:
            assert max_rel_error(got, want) <= TOLERANCE, (name, route, output, max_rel_error(got, want))
