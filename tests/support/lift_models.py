"""com.microsoft::Attention models and feeds of the lift tests (odd sizes on purpose), shared with the
bring-your-own-model tests."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

B, S, E, N, H = 2, 7, 24, 3, 8  # odd sizes on purpose
D = N * H


F32 = TensorProto.FLOAT


I32 = TensorProto.INT32


def attention_model(
    *,
    unidirectional=0,
    present=False,
    mask=None,  # None | ("1d", len) | ("2d",) | ("3d",) | ("4d",)
    attention_bias=False,
    past=False,
    qkv_sizes=None,
    runtime_weights=False,
    extra_attrs=None,
    opset=17,
    seed=0,
):
    """One com.microsoft::Attention node, optionally followed by a consumer of present, as a model."""
    rng = np.random.default_rng(seed)
    dq, dk, dv = qkv_sizes or (D, D, D)
    w = (rng.standard_normal((E, dq + dk + dv)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(dq + dk + dv) * 0.3).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", F32, ["batch", S, E])]
    inits = [numpy_helper.from_array(b, "qkv_bias")]
    if runtime_weights:
        inputs.append(helper.make_tensor_value_info("w", F32, [E, dq + dk + dv]))
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    node_inputs = ["x", "w", "qkv_bias", "", "", ""]
    if mask is not None:
        kind = mask[0]
        shape = {
            "1d": [mask[1] if len(mask) > 1 else "batch"],
            "2d": ["batch", S],
            "3d": ["batch", S, S],
            "4d": ["batch", 1, S, S],
        }[kind]
        inputs.append(helper.make_tensor_value_info("mask", I32, shape))
        node_inputs[3] = "mask"
    if past:
        inputs.append(helper.make_tensor_value_info("past", F32, [2, "batch", N, 3, dq // N]))
        node_inputs[4] = "past"
    if attention_bias:
        inputs.append(helper.make_tensor_value_info("attn_bias", F32, [1, N, S, S]))
        node_inputs[5] = "attn_bias"
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    attrs = dict(num_heads=N, unidirectional=unidirectional)
    if qkv_sizes:
        attrs["qkv_hidden_sizes"] = list(qkv_sizes)
    attrs.update(extra_attrs or {})
    outputs = ["y"] + (["present"] if present or past else [])
    nodes = [helper.make_node("Attention", node_inputs, outputs, "attn0", domain="com.microsoft", **attrs)]
    graph_outputs = [helper.make_tensor_value_info("y", F32, ["batch", S, dv])]
    if present or past:
        # a consumer like the Whisper first step's: Split the combined present into key and value caches
        nodes.append(helper.make_node("Identity", ["present"], ["present_out"], "present_consumer"))
        total = S + 3 if past else S
        graph_outputs.append(helper.make_tensor_value_info("present_out", F32, [2, "batch", N, total, dq // N]))
    graph = helper.make_graph(nodes, "attention", inputs, graph_outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model, w


def feeds_for(model, w, *, mask=None, seed=1):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((B, S, E)).astype(np.float32)}
    names = {i.name for i in model.graph.input}
    if "w" in names:
        feeds["w"] = w
    if "mask" in names:
        kind = mask[0]
        if kind == "1d":
            feeds["mask"] = np.array([S, 4], dtype=np.int32)
        elif kind == "2d":
            m = np.ones((B, S), np.int32)
            m[1, 4:] = 0
            feeds["mask"] = m
        elif kind == "3d":
            feeds["mask"] = (rng.random((B, S, S)) > 0.3).astype(np.int32)
            feeds["mask"][:, :, 0] = 1
    if "attn_bias" in names:
        feeds["attn_bias"] = rng.standard_normal((1, N, S, S)).astype(np.float32)
    return feeds


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def op_types(model):
    return [(n.domain, n.op_type) for n in model.graph.node]
