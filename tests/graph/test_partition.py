"""The partition pass: what a claimed node becomes, what a declined node keeps, and the transport conventions."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep import spec

from small_models import one_mha

ELEM = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}


def two_node_model(dtype="float32", qk_output_on_second=False, mask="1d"):
    """attn0 (claimable, with bias and a key-length mask) feeding attn1, which with ``qk_output_on_second`` asks for
    a qk output declared (1, 2, 3), not the (B, N, S, T) it writes, and is declined for it."""
    elem = ELEM[dtype]
    mask_input = helper.make_tensor_value_info(
        "lengths", TP.INT32, ["batch"] if mask == "1d" else ["batch", "kv"]
    )
    nodes = [
        helper.make_node(
            "MultiHeadAttention", ["q", "k", "v", "bias", "lengths"], ["a"], domain="com.microsoft",
            num_heads=2, name="attn0", doc_string="first",
        ),
        helper.make_node(
            "MultiHeadAttention", ["a", "k", "v"], ["o", "", "", "qk"] if qk_output_on_second else ["o"],
            domain="com.microsoft", num_heads=2, scale=0.5, name="attn1",
        ),
        helper.make_node("Identity", ["o"], ["y"], name="relu"),
    ]
    inputs = [helper.make_tensor_value_info(n, elem, ["batch", "seq" if n == "q" else "kv", 8]) for n in "qkv"]
    graph = helper.make_graph(
        nodes,
        "two_node",
        inputs + [mask_input],
        [helper.make_tensor_value_info("y", elem, ["batch", "seq", 8])]
        + ([helper.make_tensor_value_info("qk", TP.FLOAT, [1, 2, 3])] if qk_output_on_second else []),
        initializer=[
            onnx.numpy_helper.from_array(np.linspace(-1, 1, 24).astype(np.float32), "bias_f32")
        ],
    )
    # bias in the node's dtype
    graph.node.insert(0, helper.make_node("Cast", ["bias_f32"], ["bias"], to=elem, name="bias_cast"))
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def plugin_nodes(model):
    return [n for n in model.graph.node if n.domain == spec.PLUGIN_DOMAIN]


def test_claimed_node_keeps_name_attributes_and_tensor_names():
    result = mha_ep.partition(two_node_model())
    (node0, node1) = plugin_nodes(result.model)
    assert (node0.name, node1.name) == ("attn0", "attn1")
    assert list(node0.input) == ["q", "k", "v", "bias", "lengths", spec.ABSENT_FLOAT, spec.ABSENT_FLOAT, spec.ABSENT_FLOAT,
                                 spec.ABSENT_INT32, spec.ABSENT_INT32]
    assert node0.output[0] == "a" and node0.output[1].endswith("/present_key")
    attrs = {a.name: helper.get_attribute_value(a) for a in node1.attribute}
    assert attrs["num_heads"] == 2 and attrs["scale"] == pytest.approx(0.5)
    assert attrs["mask_filter_value"] == pytest.approx(-10000.0) and attrs["unidirectional"] == 0
    assert attrs[spec.ATTR_INPUTS] == b"query,key,value" and attrs[spec.ATTR_OUTPUTS] == b"output"
    assert attrs[spec.ATTR_DTYPE] == b"float32" and attrs[spec.ATTR_NODE] == b"attn1"
    assert node0.doc_string == "first"
    onnx.checker.check_model(result.model)


def test_declined_node_and_other_nodes_stay_byte_identical():
    model = two_node_model(qk_output_on_second=True)
    result = mha_ep.partition(model)
    assert [d.claimed for d in result.decisions] == [True, False]
    assert "output 3 (qk) 'qk' is declared with shape (1, 2, 3)" in result.decisions[1].reason
    assert result.decisions[1].subject == "qk"
    before = {n.name: n.SerializeToString() for n in model.graph.node}
    after = {n.name: n.SerializeToString() for n in result.model.graph.node}
    for name in ("attn1", "relu", "bias_cast"):
        assert after[name] == before[name], name
    assert "declined  attn1: mha_ep MultiHeadAttention: output 3 (qk) 'qk' is declared" in result.report()


def test_partition_does_not_modify_its_input_and_is_idempotent():
    model = two_node_model()
    original = model.SerializeToString()
    once = mha_ep.partition(model)
    assert model.SerializeToString() == original
    twice = mha_ep.partition(once.model)
    assert twice.model.SerializeToString() == once.model.SerializeToString()
    assert [d.claimed for d in twice.decisions] == [True, True]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision_travels_through_exact_casts(dtype):
    result = mha_ep.partition(two_node_model(dtype))
    casts = [n for n in result.model.graph.node if n.op_type == "Cast" and n.name != "bias_cast"]
    into = {n.input[0] for n in casts if helper.get_attribute_value(n.attribute[0]) == TP.FLOAT}
    # one Cast per tensor, shared: k and v feed both nodes but are cast once
    assert sorted(into) == ["a", "bias", "k", "q", "v"]
    back = [n for n in casts if helper.get_attribute_value(n.attribute[0]) == ELEM[dtype]]
    assert sorted(n.output[0] for n in back) == ["a", "o"]
    for node in plugin_nodes(result.model):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs[spec.ATTR_DTYPE] == dtype.encode()
        assert node.input[0].endswith(spec.TRANSPORT_IN)
    onnx.checker.check_model(result.model)


def test_unregistered_load_says_to_register():
    result = mha_ep.partition(two_node_model())
    with pytest.raises(Exception, match="call_mha_ep_register_on_the_SessionOptions_first"):
        ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_registered_plain_session_runs_the_partitioned_model(rng):
    model = two_node_model()
    result = mha_ep.partition(model)
    options = mha_ep.register(ort.SessionOptions(), backend="reference")
    plugin = ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "q": rng.standard_normal((2, 3, 8)).astype(np.float32),
        "k": rng.standard_normal((2, 5, 8)).astype(np.float32),
        "v": rng.standard_normal((2, 5, 8)).astype(np.float32),
        "lengths": np.array([2, 5], np.int32),
    }
    (ours,), (theirs,) = plugin.run(None, feeds), stock.run(None, feeds)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["python-op", "native"])
def test_a_model_partitioned_for_the_eight_input_op_is_brought_up_to_date(route, rng):
    """Partition rule ALREADY_CLAIMED: a claimed node written before the op took past_sequence_length and
    cache_indirection (eight inputs, and a fallback function of eight) gets the two placeholder slots and the new
    function when the model is partitioned again, and then runs."""
    model = two_node_model()
    result = mha_ep.partition(model, route=route)
    old = result.model
    for node in plugin_nodes(old):
        del node.input[len(spec.LEGACY_PLUGIN_INPUTS):]
    function = next(f for f in old.functions if f.domain == spec.PLUGIN_DOMAIN)
    del function.input[len(spec.LEGACY_PLUGIN_INPUTS):]
    again = mha_ep.partition(old, route=route)
    assert [len(n.input) for n in plugin_nodes(again.model)] == [len(spec.PLUGIN_INPUTS)] * 2
    assert [n.input[-2:] for n in plugin_nodes(again.model)] == [[spec.ABSENT_INT32] * 2] * 2
    assert list(next(f for f in again.model.functions if f.domain == spec.PLUGIN_DOMAIN).input) == list(spec.PLUGIN_INPUTS)
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route=route)
    session = ort.InferenceSession(again.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"q": rng.standard_normal((2, 3, 8)).astype(np.float32), "k": rng.standard_normal((2, 5, 8)).astype(np.float32),
             "v": rng.standard_normal((2, 5, 8)).astype(np.float32), "lengths": np.array([2, 5], np.int32)}  # fmt: skip
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, feeds)[0], stock.run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_int64_mask_uses_the_int64_variant(rng):
    model = two_node_model(mask="2d")
    model.graph.input[3].type.tensor_type.elem_type = TP.INT64
    result = mha_ep.partition(model)
    assert result.decisions[0].claimed, result.decisions[0].reason
    session = mha_ep.InferenceSession(model, backend="reference")
    keep = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.int64)
    feeds = {n: rng.standard_normal((2, 3 if n == "q" else 5, 8)).astype(np.float32) for n in "qkv"}
    feeds["lengths"] = keep
    ours = session.run(None, feeds)[0]
    stock_model = two_node_model(mask="2d")  # stock ORT's schema takes an int32 mask
    stock = ort.InferenceSession(stock_model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = stock.run(None, {**feeds, "lengths": keep.astype(np.int32)})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_report_and_json_list_every_decision():
    result = mha_ep.partition(two_node_model(qk_output_on_second=True))
    text = result.report()
    assert "2 MultiHeadAttention node(s), 1 claimed, 1 declined" in text
    data = __import__("json").loads(result.to_json())
    assert [d["node_name"] for d in data["decisions"]] == ["attn0", "attn1"]
    assert data["claimed"] == 1 and data["declined"] == 1


def test_unknown_query_dtype_is_declined_with_a_reason():
    model = two_node_model()
    graph = model.graph
    # q comes out of an op with no type information for the gate
    graph.input[0].type.tensor_type.elem_type = TP.UNDEFINED
    result = mha_ep.partition(model)
    assert not result.decisions[0].claimed
    assert "element type of query is unknown" in result.decisions[0].reason


def test_float16_model_matches_stock_through_the_transport(rng):
    model = two_node_model("float16")
    feeds = {n: rng.standard_normal((2, 3 if n == "q" else 5, 8)).astype(np.float16) for n in "qkv"}
    feeds["lengths"] = np.array([4, 5], np.int32)
    ours = mha_ep.InferenceSession(model, backend="reference").run(None, feeds)[0]
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert ours.dtype == np.float16
    # same float32 math on the same values; a 1e-7 difference may still flip one float16 rounding
    np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), rtol=4e-3, atol=4e-3)


def test_bfloat16_model_runs_where_stock_ort_cannot(rng):
    model = two_node_model("bfloat16")
    # ORT 1.31: no bfloat16 kernel; ORT <= 1.23 (the newest for Python 3.10): bfloat16 not in the schema
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED|Could not find an implementation|tensor\(bfloat16\)"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # feed float32 values through a bf16 model whose inputs we widen to float32 + Cast, so NumPy can carry them
    session = mha_ep.InferenceSession(model, backend="reference")
    assert all(d.claimed for d in session.decisions)


# ---------------------------------------------------------------------------------------------------- partition
def test_partition_declines_attributes_of_the_wrong_type():
    """attributes_from_mapping converts with int()/float() without checking the ONNX attribute type, so a node
    with num_heads given as a FLOAT attribute (2.0) is claimed. The plugin node copies the FLOAT attribute, and
    creating the session then fails: "Unable to find attribute 'num_heads' due to 'Attribute name and type don't
    match'" (other wrong types - INTS, non-numeric STRING - make partition() itself raise TypeError/ValueError).
    Expected: the node is declined with a reason naming num_heads (ORT also rejects it, with its own message)."""
    model = one_mha(attrs={"num_heads": 2.0})
    (decision,) = mha_ep.partition(model).decisions
    assert not decision.claimed and decision.subject == "num_heads"


def test_partition_declines_a_node_without_query_instead_of_crashing():
    """decide_node: when the query slot is "" the rules see query absent and pass (every query rule needs a
    shape), and then `inputs[0].dtype` dereferences None: partition() raises AttributeError instead of giving
    the node a Decision. Expected: declined, with a reason about the query."""
    model = one_mha(node_inputs=("", "k", "v"))
    (decision,) = mha_ep.partition(model).decisions
    assert not decision.claimed and decision.subject == "query"


@pytest.mark.parametrize("declared, words", [
    (helper.make_tensor_value_info("qk", TP.INT32, None), "output 3 (qk) 'qk' is declared int32; ORT's QK type"),
    (helper.make_tensor_value_info("qk", TP.FLOAT, [1, 2, 3]),
     "output 3 (qk) 'qk' is declared with shape (1, 2, 3), but the node writes (B, N, S, T) = (?, 2, ?, ?)"),
])  # fmt: skip
def test_a_qk_output_declared_unlike_what_the_node_writes_is_declined_naming_it(declared, words):
    model = two_node_model(qk_output_on_second=True)
    for index, output in enumerate(model.graph.output):
        if output.name == "qk":
            model.graph.output[index].CopyFrom(declared)
    decision = mha_ep.partition(model).decisions[1]
    assert not decision.claimed and words in decision.reason and decision.subject == "qk", decision


@pytest.mark.parametrize("qk_type, route, casts", [
    (TP.FLOAT, "python-op", 0), (TP.FLOAT16, "python-op", 1), (TP.FLOAT, "native", 0), (TP.FLOAT16, "native", 1),
])  # fmt: skip
def test_a_qk_output_of_another_type_than_the_op_writes_gets_a_cast(qk_type, route, casts):
    """ORT's QK type constraint is independent of T: the op writes qk in the type it computes in, and a Cast
    after it gives the declared type (partition rule TRANSPORT)."""
    model = two_node_model(qk_output_on_second=True)
    for index, output in enumerate(model.graph.output):
        if output.name == "qk":
            model.graph.output[index].CopyFrom(helper.make_tensor_value_info("qk", qk_type, None))
    result = mha_ep.partition(model, route=route)
    assert result.claimed == 2, result.report()
    made = [n for n in result.model.graph.node if n.op_type == "Cast" and "qk" in n.output]
    assert len(made) == casts and all(n.attribute[0].i == qk_type for n in made)
