"""MultiHeadAttention nodes inside subgraphs (the pass's rule SUBGRAPHS): If / Loop bodies and the decoder of
com.microsoft's GreedySearch and BeamSearch, claimed, reported with their graph's path, and run by ORT as the
original model ran, on both CPU routes.

Measured here, on ORT 1.31.1's CPU provider: GreedySearch and BeamSearch run a custom op inside their decoder
subgraph on both routes (the onnxruntime-extensions Python op registered by mha_ep.register, and mha_ep's native
library), so those nodes are claimed; an unregistered session fails with the plugin's "call mha_ep.register"
error, which shows the plugin node, not ORT's, is what runs there.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

import mha_ep
from mha_ep import spec

from subgraph_models import generation_feeds, generation_model, if_model

ROUTES = ["python-op", "native"]


def sessions(model, result, route):
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route=route)
    ours = ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return stock, ours


def subgraph(model, attribute):
    """The graph attribute ``attribute`` of the main graph's node that has one."""
    return next(a.g for n in model.graph.node for a in n.attribute if a.name == attribute)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("op", ["GreedySearch", "BeamSearch"])
def test_generation_decoder_node_is_claimed_and_runs_as_stock(op, route, rng):
    model = generation_model(op)
    result = mha_ep.partition(model, route=route)
    (decision,) = result.decisions
    assert decision.claimed and decision.path == f"{op}_0/decoder" and decision.node_name == "Attention_0"
    assert f"  claimed   {op}_0/decoder/Attention_0" in result.report()
    decoder = subgraph(result.model, "decoder")
    assert [n.domain for n in decoder.node if n.op_type == spec.OP_TYPE] == [spec.PLUGIN_DOMAIN]
    assert {spec.ABSENT_FLOAT, spec.ABSENT_INT32} <= {i.name for i in decoder.initializer}  # the subgraph's own
    assert not result.model.graph.initializer
    onnx.checker.check_model(result.model)
    stock, ours = sessions(model, result, route)
    for _ in range(2):  # fresh prompts each time
        feeds = generation_feeds(op, rng)
        for got, expected in zip(ours.run(None, feeds), stock.run(None, feeds)):
            if got.dtype.kind == "i":
                np.testing.assert_array_equal(got, expected)
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_an_unregistered_session_fails_inside_the_decoder():
    result = mha_ep.partition(generation_model("GreedySearch"))
    with pytest.raises(Exception, match="call_mha_ep_register_on_the_SessionOptions_first"):
        ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])


def if_feeds(rng, dtype=np.float32):
    return {n: rng.standard_normal((2, 3, 8)).astype(dtype) for n in "xkv"}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_if_and_loop_bodies_are_claimed_at_every_depth_and_run_as_stock(route, dtype, rng):
    elem = TP.FLOAT if dtype == "float32" else TP.FLOAT16
    model = if_model(elem)
    result = mha_ep.partition(model, route=route)
    assert [(d.where, d.claimed) for d in result.decisions] == [
        ("outer_mha", True),
        ("branch/else_branch/else_mha", True),
        ("branch/else_branch/loop/body/body_mha", True),
        ("branch/then_branch/then_mha", True),
    ]
    onnx.checker.check_model(result.model)
    if dtype == "float16" and route == "python-op":  # each graph casts what its own nodes read, outer names too
        then_branch = subgraph(result.model, "then_branch")
        casts = [n for n in then_branch.node if n.op_type == "Cast"]
        assert sorted(n.input[0] for n in casts if n.attribute[0].i == TP.FLOAT) == ["k", "q", "v"]
    stock, ours = sessions(model, result, route)
    tolerance = 1e-5 if dtype == "float32" else 4e-3
    for cond in (True, False):
        feeds = {**if_feeds(rng, np.dtype(dtype)), "cond": np.array(cond)}
        (got,), (expected,) = ours.run(None, feeds), stock.run(None, feeds)
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=tolerance, atol=tolerance)


def test_each_graph_has_its_own_placeholders_with_names_new_to_its_scopes():
    result = mha_ep.partition(if_model())
    main = {i.name for i in result.model.graph.initializer}
    else_branch = subgraph(result.model, "else_branch")
    body = next(n for n in else_branch.node if n.op_type == "Loop").attribute[0].g
    mine = {i.name for i in else_branch.initializer} - {"trips"}
    assert spec.ABSENT_FLOAT in main
    # the main graph defines the plain names, so the branch's are renamed, and the body's again
    assert spec.ABSENT_FLOAT not in mine and f"{spec.ABSENT_FLOAT}.1" in mine
    assert {i.name for i in body.initializer}.isdisjoint(main | mine)
    plugin = next(n for n in body.node if n.domain == spec.PLUGIN_DOMAIN)
    assert set(plugin.input) & {i.name for i in body.initializer}


def test_a_subgraph_node_reading_outer_names_is_decided_like_any_other():
    """then_mha reads q, k, v from the outer scope; 3 heads do not divide the hidden size 8: its own reason."""
    result = mha_ep.partition(if_model(then_heads=3))
    decisions = {d.where: d for d in result.decisions}
    bad = decisions["branch/then_branch/then_mha"]
    assert not bad.claimed and "not divisible by num_heads 3" in bad.reason, bad.reason
    assert all(d.claimed for where, d in decisions.items() if where != bad.where)
    line = next(l for l in result.report().splitlines() if "then_mha" in l)
    assert line.split()[:2] == ["declined", "branch/then_branch/then_mha:"] and line.endswith(bad.reason)
    then_branch = subgraph(result.model, "then_branch")
    assert [n.domain for n in then_branch.node] == ["com.microsoft"]  # byte for byte
    assert then_branch == subgraph(if_model(then_heads=3), "then_branch")


def test_an_outer_query_of_unknown_type_is_declined_with_the_outer_reason():
    model = if_model()
    model.graph.node[0].op_type = "Scramble"  # q now comes from an op nothing types
    model.graph.node[0].domain = "custom.domain"
    model.opset_import.append(onnx.helper.make_opsetid("custom.domain", 1))
    result = mha_ep.partition(model)
    decisions = {d.where: d for d in result.decisions}
    then_mha = decisions["branch/then_branch/then_mha"]
    assert not then_mha.claimed and "'q' is output 0 of custom.domain::Scramble 'outer_mha'" in then_mha.reason
    assert decisions["branch/else_branch/loop/body/body_mha"].claimed  # its query is the else branch's output


@pytest.mark.parametrize("route", ROUTES)
def test_partitioning_again_changes_nothing_at_any_depth(route):
    for model in (if_model(), generation_model("BeamSearch")):
        once = mha_ep.partition(model, route=route)
        twice = mha_ep.partition(once.model, route=route)
        assert twice.model.SerializeToString() == once.model.SerializeToString()
        assert [(d.where, d.claimed) for d in twice.decisions] == [(d.where, True) for d in once.decisions]


def test_an_unnamed_owner_is_named_by_its_op_and_index_before_the_rewrite():
    model = if_model(TP.FLOAT16)
    model.graph.node[1].name = ""  # the If; the main-graph MHA before it gains Casts on the Python-op route
    assert [d.path for d in mha_ep.partition(model).decisions][1:] == ["If_1/else_branch", "If_1/else_branch/loop/body",
                                                                     "If_1/then_branch"]  # fmt: skip


def test_json_names_the_path():
    data = mha_ep.partition(generation_model("GreedySearch", node_name="Search")).to_dict()
    assert data["decisions"] == [
        {"node_name": "Attention_0", "claimed": True, "reason": "", "subject": "", "path": "Search/decoder"}
    ]
