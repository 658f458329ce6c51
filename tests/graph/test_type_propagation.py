"""Types where shape inference stops (claim/type_propagation.py): no declined or unknown node declines another.

ORT's symbolic shape inference stops at a com.microsoft::MultiHeadAttention with a qk output (ORT 1.31.1 logs
"Stopping at incomplete shape inference at MultiHeadAttention") and knows no custom-domain op; every later node
must still be decided on its own merits, and a node whose query type truly cannot be known says which tensor and
why.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.claim.shapes import collect_graph_infos, inferred_model
from mha_ep.claim.tensor_info import TensorInfo
from mha_ep.claim.type_propagation import TYPE_RULES, propagate_types

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
ELEM = {"float32": TP.FLOAT, "float16": TP.FLOAT16}


def mha(inputs, outputs, name, heads=2, **attrs):
    return helper.make_node("MultiHeadAttention", inputs, outputs, domain="com.microsoft", num_heads=heads, name=name, **attrs)


def after_qk_model(dtype="float32"):
    """cross (asks for qk: symbolic inference stops there) -> Add -> Transpose twice -> good (nothing wrong) and
    bad (num_heads 3 does not divide the hidden size 12), then Softmax -> late (nothing wrong)."""
    elem = ELEM[dtype]
    nodes = [
        mha(["q", "k", "v"], ["a", "", "", "qk"], "cross"),
        helper.make_node("Add", ["a", "q"], ["b"], name="add"),
        helper.make_node("Transpose", ["b"], ["bt"], perm=[1, 0, 2], name="there"),
        helper.make_node("Transpose", ["bt"], ["c"], perm=[1, 0, 2], name="back"),
        mha(["c", "k", "v"], ["good_out"], "good"),
        mha(["c", "k", "v"], ["bad_out"], "bad", heads=5),
        helper.make_node("Softmax", ["good_out"], ["s"], name="softmax"),
        mha(["s", "k", "v"], ["late_out"], "late", scale=0.25),
    ]
    inputs = [helper.make_tensor_value_info(n, elem, ["batch", "seq" if n == "q" else "kv", 12]) for n in "qkv"]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in ("late_out", "bad_out", "qk")]
    model = helper.make_model(helper.make_graph(nodes, "after_qk", inputs, outputs), ir_version=10, opset_imports=OPSETS)
    return model


def test_symbolic_inference_really_stops_at_the_qk_node():
    """The premise: without propagation, 'b' (after the qk node) has no type from shape inference."""
    inferred = collect_graph_infos(inferred_model(after_qk_model()).graph)
    assert inferred["a"].dtype == "float32"
    assert inferred.get("b", TensorInfo()).dtype is None


def test_every_node_after_the_qk_node_is_decided_on_its_own_merits():
    decisions = {d.node_name: d for d in mha_ep.partition(after_qk_model()).decisions}
    assert decisions["good"].claimed, decisions["good"].reason
    assert decisions["late"].claimed, decisions["late"].reason
    bad = decisions["bad"]
    assert not bad.claimed and "not divisible by num_heads 5" in bad.reason, bad.reason
    assert "unknown" not in bad.reason


@pytest.mark.parametrize("route", ["python-op", "native"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_partitioned_model_runs_as_stock_ort_does(route, dtype, rng):
    model = after_qk_model(dtype)
    del model.graph.node[5]  # bad: stock ORT refuses it too
    del model.graph.output[1]
    result = mha_ep.partition(model, route=route)
    assert sum(d.claimed for d in result.decisions if d.node_name in ("good", "late")) == 2
    if dtype == "float16" and route == "python-op":
        casts = [n.input[0] for n in result.model.graph.node if n.op_type == "Cast"]
        assert "c" in casts and "s" in casts  # the float32 transport, chosen from the propagated type
    np_type = np.dtype(dtype)
    feeds = {n: rng.standard_normal((2, 3 if n == "q" else 5, 12)).astype(np_type) for n in "qkv"}
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route=route)
    ours = ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    tolerance = 1e-5 if dtype == "float32" else 4e-3
    for got, expected in zip(ours.run(None, feeds), stock.run(None, feeds)):
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=tolerance, atol=tolerance)


def custom_op_model(declare=False):
    """x -> custom.domain::Scramble (types no inference knows) -> y -> Relu -> z -> MHA 'after_custom'."""
    nodes = [
        helper.make_node("Scramble", ["x"], ["y"], domain="custom.domain", name="scramble"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
        mha(["z", "k", "v"], ["out"], "after_custom"),
    ]
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, [2, 3, 8]) for n in "xkv"]
    graph = helper.make_graph(nodes, "custom", inputs, [helper.make_tensor_value_info("out", TP.FLOAT, [2, 3, 8])])
    if declare:
        graph.value_info.append(helper.make_tensor_value_info("y", TP.FLOAT, [2, 3, 8]))
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS + [helper.make_opsetid("custom.domain", 1)])


def test_a_query_type_nothing_gives_is_declined_naming_the_tensor_and_why():
    (decision,) = mha_ep.partition(custom_op_model()).decisions
    assert not decision.claimed and decision.subject == "query"
    assert "element type of query is unknown" in decision.reason
    assert (
        "('z' takes its type through Relu 'relu', and 'y' is output 0 of custom.domain::Scramble 'scramble', whose "
        "output types neither shape inference nor the graph's declarations give)"
    ) in decision.reason, decision.reason


def test_a_declaration_of_the_unknown_tensor_is_enough():
    (decision,) = mha_ep.partition(custom_op_model(declare=True)).decisions
    assert decision.claimed, decision.reason


def test_an_untyped_graph_input_is_named_as_such():
    model = custom_op_model(declare=True)
    model.graph.node[2].input[0] = "x"
    model.graph.input[0].type.tensor_type.elem_type = TP.UNDEFINED
    (decision,) = mha_ep.partition(model).decisions
    assert "'x' is an input of its graph declared without an element type" in decision.reason, decision.reason


def graph_of(nodes, inputs, value_info=()):
    return helper.make_graph(nodes, "g", inputs, [], value_info=list(value_info))


def test_propagation_follows_its_table_and_keeps_what_was_declared():
    x = helper.make_tensor_value_info("x", TP.FLOAT16, [2, 3])
    graph = graph_of(
        [
            helper.make_node("Cast", ["x"], ["wide"], to=TP.FLOAT),
            helper.make_node("Shape", ["wide"], ["dims"]),
            helper.make_node("Where", ["cond", "wide", "wide"], ["picked"]),
            helper.make_node("Relu", ["picked"], ["declared"]),
            mha(["x", "x", "x"], ["o", "", "", "scores"], "m"),
        ],
        [x, helper.make_tensor_value_info("cond", TP.BOOL, [2, 3])],
        [helper.make_tensor_value_info("declared", TP.DOUBLE, None), helper.make_tensor_value_info("scores", TP.FLOAT, None)],
    )
    infos = propagate_types(graph, collect_graph_infos(graph))
    assert infos["wide"] == TensorInfo("float32", (2, 3))
    assert infos["dims"] == TensorInfo("int64", (2,))
    assert infos["picked"].dtype == "float32"
    assert infos["declared"].dtype == "float64"  # declared: never overridden
    assert infos["o"].dtype == "float16" and infos["scores"].dtype == "float32"  # qk: its declared type


def test_an_unsorted_graph_converges():
    graph = graph_of(
        [helper.make_node("Identity", ["a"], ["b"]), helper.make_node("Neg", ["x"], ["a"])],
        [helper.make_tensor_value_info("x", TP.FLOAT, [4])],
    )
    assert propagate_types(graph, collect_graph_infos(graph))["b"] == TensorInfo("float32", (4,))


def test_the_table_names_the_ops_of_the_brief():
    for op in ("Add", "Sub", "Mul", "Div", "Identity", "Reshape", "Transpose", "Softmax", "LayerNormalization",
               "MatMul", "Gemm", "Gather", "Concat", "Slice", "Squeeze", "Unsqueeze", "Where", "Cast", "Shape"):  # fmt: skip
        assert ("", op) in TYPE_RULES, op
    for op in ("SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu", "MultiHeadAttention"):
        assert ("com.microsoft", op) in TYPE_RULES, op


def test_an_attention_node_after_the_plugin_s_weight_product_is_claimed_without_declarations():
    """A query made by mha_ep::DecodeMatMul (which no shape inference knows) with no value_info for it: the
    product's rule gives it x's type, so the node after it is claimed (static-cache --decode-matmul declares the
    products as well: tests/graph/test_static_cache.py)."""
    from mha_ep import spec

    weight = helper.make_tensor("w_nk", TP.FLOAT16, [12, 12], np.ones(144, np.float16).tobytes(), raw=True)
    nodes = [
        helper.make_node(spec.MATMUL_OP_TYPE, ["x", "w_nk"], ["q"], domain=spec.PLUGIN_DOMAIN, name="proj",
                         **{spec.ATTR_NODE: "proj", spec.ATTR_DTYPE: "float16"}),
        mha(["q", "k", "v"], ["out"], "after_product"),
    ]
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT16, [1, 3 if n == "x" else 5, 12]) for n in "xkv"]
    graph = helper.make_graph(nodes, "after_product", inputs, [helper.make_tensor_value_info("out", TP.FLOAT16, None)],
                              [weight])  # fmt: skip
    model = helper.make_model(graph, ir_version=10,
                              opset_imports=OPSETS + [helper.make_opsetid(spec.PLUGIN_DOMAIN, spec.PLUGIN_OPSET)])
    assert propagate_types(graph, collect_graph_infos(graph))["q"].dtype == "float16"
    decision = mha_ep.partition(model).decisions[0]
    assert decision.node_name == "after_product" and decision.claimed, decision.reason
