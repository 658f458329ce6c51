"""Models and feeds of the serving tests (tests/serve): the shipped BERT, and small graphs built here whose batch
plans or failures the tests need."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.feeds import random_feeds

BERT = "bert_random_mask2d_fp32.onnx"  # (batch, sequence) ids, mask and token types; last_hidden_state
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
# Batched answers may move in their last bits (mha_ep/serve/batching.py): held to this many float32 epsilons of
# max(1, |x|); the widest seen on the reference backend is a few (docs/BENCH.md, section 7).
BATCHED_EPSILONS = 16


def bert_path() -> str:
    return str(mha_ep.shipped_model(BERT))


def bert_model() -> onnx.ModelProto:
    return onnx.load(bert_path())


def bert_feeds(length: int, rows: int = 1, seed: int = 0) -> dict:
    return random_feeds(bert_model(), seed=seed, dims={"batch": rows, "sequence": length})


def attention_model(num_heads: int = 4) -> onnx.ModelProto:
    """One MultiHeadAttention node over query, key and value inputs (batch, sequence, hidden), all symbolic: no
    key-padding mask. A hidden size that is not a multiple of ``num_heads`` fails the node with ORT's FAIL."""
    dims = ["batch", "sequence", "hidden"]
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"], domain="com.microsoft",
                            name="attention", num_heads=num_heads)  # fmt: skip
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, TP.FLOAT, dims) for n in
                                                    ("query", "key", "value")],
                              [helper.make_tensor_value_info("output", TP.FLOAT, dims)])  # fmt: skip
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10)


def attention_feeds(hidden: int, length: int = 3, rows: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((rows, length, hidden)).astype(np.float32) for name in ("query", "key", "value")}


def pooled_bert() -> onnx.ModelProto:
    """The shipped BERT with a mean over the sequence as a second output (batch, 64): a node that mixes positions."""
    model = bert_model()
    model.graph.node.append(helper.make_node("ReduceMean", ["last_hidden_state"], ["pooled"], name="pool", axes=[1],
                                             keepdims=0))  # fmt: skip
    model.graph.output.append(helper.make_tensor_value_info("pooled", TP.FLOAT, ["batch", 64]))
    return model


def error_of(call):
    """The exception ``call()`` raises (the test fails when it raises none)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the exception is the value under test
        return error
    raise AssertionError("expected an exception, none was raised")


def max_rel_error(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    return float(np.max(np.abs(a - e) / np.maximum(1.0, np.abs(e)))) if a.size else 0.0


def batched_tolerance() -> float:
    return BATCHED_EPSILONS * float(np.finfo(np.float32).eps)
