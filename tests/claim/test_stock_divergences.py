"""Issue 16, items 9-10: the partition pass declines what stock ORT refuses, and copes with names stock accepts.

9. A MultiHeadAttention node with 11 inputs or 5 outputs, or with an attribute its schema does not have (also
   one named like ``mha_ep_*``), is refused by stock ORT at session creation: it is declined with a reason and
   left byte for byte.
10. Generated names are unique in the graph: an unnamed node beside one named ``MultiHeadAttention_0``, both with
    unused outputs, runs. A node or tensor name that is not UTF-8 (stock runs it) does not crash the pass: the
    node is declined (the onnxruntime-extensions bridge aborts the process on such a node name) and runs on ORT.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import mha_ep

from harness import describe, run_script

FEEDS = {x: np.random.default_rng(5).standard_normal((1, 3, 8)).astype(np.float32) for x in "qkv"}


def mha_model(nodes, outputs=("o",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 3, 8]) for x in "qkv"],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
    )
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def mha(inputs=("q", "k", "v"), outputs=("o",), name="mha", **attrs):
    return helper.make_node("MultiHeadAttention", list(inputs), list(outputs), domain="com.microsoft", name=name,
                            **{"num_heads": 2, **attrs})  # fmt: skip


def stock_session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------------- 9. what stock refuses
REFUSED_BY_STOCK = {
    "eleven_inputs": (mha(inputs=("q", "k", "v") + ("",) * 7 + ("q",)), "the node has 11 inputs"),
    "five_outputs": (mha(outputs=("o", "", "", "", "extra")), "the node has 5 outputs"),
    "unknown_attribute": (mha(colour=1), "unknown attribute 'colour'"),
    "mha_ep_named_attribute": (mha(mha_ep_node="x"), "unknown attribute 'mha_ep_node'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_STOCK))
def test_nodes_stock_refuses_are_declined_with_a_reason(case):
    node, reason = REFUSED_BY_STOCK[case]
    model = mha_model([node])
    with pytest.raises(Exception):
        stock_session(model)
    result = mha_ep.partition(model)
    (decision,) = result.decisions
    assert not decision.claimed and reason in decision.reason, decision
    assert decision.reason.startswith("mha_ep MultiHeadAttention: ") and decision.subject
    assert result.model.graph.node[0].SerializeToString() == node.SerializeToString()


# ------------------------------------------------------------------------------------------------- 10. names
def test_generated_names_are_unique_in_the_graph():
    nodes = [mha(name="", outputs=("o1",)), mha(name="MultiHeadAttention_0", outputs=("o",))]
    model = mha_model(nodes, outputs=("o", "o1"))
    expected = stock_session(model).run(None, FEEDS)
    session = mha_ep.InferenceSession(model, backend="reference")
    assert session.partition.claimed == 2
    for actual, want in zip(session.run(None, FEEDS), expected):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-6)


def test_node_and_tensor_names_that_are_not_utf8_are_declined_and_run_on_ort():
    result = run_script(
        """
    import os
    # onnxruntime_extensions sets this to "python" in os.environ when imported (its cvt.py), so pytest's
    # subprocesses inherit it; the pure-Python protobuf refuses to parse a non-UTF-8 name, upb hands it over.
    os.environ.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    import sys
    import numpy as np, onnx, onnxruntime as ort
    import mha_ep
    sys.path.insert(0, os.path.join(os.getcwd(), "tests", "claim"))  # this file, imported by the child
    from test_stock_divergences import FEEDS, mha, mha_model, stock_session

    from onnx import helper
    for label, nodes in (
        ("NODE", [mha(name="placeholder")]),
        ("TENSOR", [helper.make_node("Identity", ["q"], ["placeholder"]), mha(inputs=("placeholder", "k", "v"))]),
    ):
        raw = mha_model(nodes).SerializeToString()
        model = onnx.ModelProto()
        model.ParseFromString(raw.replace(b"placeholder", b"bad\\xffname\\xfe!!"))  # same length: valid wire format
        expected = stock_session(model).run(None, FEEDS)[0]
        result = mha_ep.partition(model)
        print("REPORT", result.report())
        session = mha_ep.InferenceSession(model, backend="reference")
        print(label, "ERROR", float(np.abs(session.run(None, FEEDS)[0] - expected).max()))
    print("DONE")
    """
    )
    assert result.returncode == 0 and "DONE" in result.stdout, describe(result)
    assert "declined  bad\\xffname\\xfe!!: mha_ep MultiHeadAttention: the node's name is not UTF-8 text" in result.stdout, describe(result)
    assert "tensor name 'bad\\xffname\\xfe!!' is not UTF-8 text" in result.stdout, describe(result)
    for label in ("NODE", "TENSOR"):
        assert float(result.stdout.split(f"{label} ERROR ")[1].split()[0]) == 0.0, describe(result)
