"""Models with MultiHeadAttention inside subgraphs: ORT's generation ops (GreedySearch, BeamSearch) over a tiny
GPT-2-form decoder, and If / Loop bodies. Not a test module: the test files import it.

The GPT-2 form is the one onnxruntime.transformers.convert_generation writes (model_type 0): the decoder subgraph
takes input_ids, position_ids, attention_mask (B, S) int32, (B, S) int32, (B, T) int32 and one past_0
(2, B, N, P, H), and returns logits (B, S, V) and present_0 (2, B, N, T, H). Here the decoder is one layer: token
plus position embeddings, three projections, one com.microsoft::MultiHeadAttention with past (key/value halves of
past_0), and a projection to the vocabulary. Weights are random normal (seeded), never zeros.

Legend: B batch, S new tokens, P past length, T = P + S, N heads, H head size, D = N * H, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
NUM_HEADS, HEAD_SIZE, VOCAB, POSITIONS = 2, 4, 23, 32
HIDDEN = NUM_HEADS * HEAD_SIZE


def decoder_graph(seed: int = 0, mha_name: str = "Attention_0", elem=TP.FLOAT) -> onnx.GraphProto:
    """The GPT-2-form decoder subgraph with one MultiHeadAttention node (named ``mha_name``); ``elem`` is the
    float type of its past, present and logits (float16: the weights are float16 too)."""
    rng = np.random.default_rng(seed)
    dtype = helper.tensor_dtype_to_np_dtype(elem)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(dtype), name)

    initializers = [
        weight("wte", VOCAB, HIDDEN), weight("wpe", POSITIONS, HIDDEN), weight("w_q", HIDDEN, HIDDEN),
        weight("w_k", HIDDEN, HIDDEN), weight("w_v", HIDDEN, HIDDEN), weight("w_out", HIDDEN, VOCAB),
        numpy_helper.from_array(np.array(0, np.int64), "half_key"),
        numpy_helper.from_array(np.array(1, np.int64), "half_value"),
        numpy_helper.from_array(np.array([0], np.int64), "axis_0"),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Gather", ["wte", "input_ids"], ["tokens"], name="embed_tokens"),
        helper.make_node("Gather", ["wpe", "position_ids"], ["positions"], name="embed_positions"),
        helper.make_node("Add", ["tokens", "positions"], ["hidden"], name="embed_add"),
        helper.make_node("MatMul", ["hidden", "w_q"], ["query"], name="proj_q"),
        helper.make_node("MatMul", ["hidden", "w_k"], ["key"], name="proj_k"),
        helper.make_node("MatMul", ["hidden", "w_v"], ["value"], name="proj_v"),
        helper.make_node("Gather", ["past_0", "half_key"], ["past_key"], name="past_key_half", axis=0),
        helper.make_node("Gather", ["past_0", "half_value"], ["past_value"], name="past_value_half", axis=0),
        helper.make_node(
            "MultiHeadAttention",
            ["query", "key", "value", "", "attention_mask", "", "past_key", "past_value"],
            ["attended", "present_key", "present_value"],
            domain="com.microsoft", num_heads=NUM_HEADS, unidirectional=1, name=mha_name,
        ),  # fmt: skip
        helper.make_node("Unsqueeze", ["present_key", "axis_0"], ["present_key_1"], name="stack_key"),
        helper.make_node("Unsqueeze", ["present_value", "axis_0"], ["present_value_1"], name="stack_value"),
        helper.make_node("Concat", ["present_key_1", "present_value_1"], ["present_0"], axis=0, name="stack"),
        helper.make_node("MatMul", ["attended", "w_out"], ["logits"], name="lm_head"),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TP.INT32, ["batch", "seq"]),
        helper.make_tensor_value_info("position_ids", TP.INT32, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TP.INT32, ["batch", "total"]),
        helper.make_tensor_value_info("past_0", elem, [2, "batch", NUM_HEADS, "past", HEAD_SIZE]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", elem, ["batch", "seq", VOCAB]),
        helper.make_tensor_value_info("present_0", elem, [2, "batch", NUM_HEADS, "total", HEAD_SIZE]),
    ]
    return helper.make_graph(nodes, "decoder", inputs, outputs, initializer=initializers)


def generation_model(op: str = "GreedySearch", seed: int = 0, node_name: str = None, elem=TP.FLOAT) -> onnx.ModelProto:
    """``op`` (GreedySearch or BeamSearch) over the decoder subgraph, in convert_generation's GPT-2 form:
    inputs input_ids (B, S) int32, max_length, min_length (1,) int32, [num_beams, num_return_sequences (1,) int32,
    length_penalty (1,) float,] repetition_penalty (1,) float; output sequences."""
    beam = op == "BeamSearch"
    names = ["input_ids", "max_length", "min_length"] + (["num_beams", "num_return_sequences", "length_penalty"]
                                                         if beam else []) + ["repetition_penalty"]  # fmt: skip
    kinds = {"input_ids": (TP.INT32, ["batch", "prompt"]), "length_penalty": (TP.FLOAT, [1]),
             "repetition_penalty": (TP.FLOAT, [1])}  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, *kinds.get(n, (TP.INT32, [1]))) for n in names]
    outputs = [helper.make_tensor_value_info("sequences", TP.INT32, ["batch", "beams", "length"] if beam else ["batch", "length"])]
    if beam:
        outputs.append(helper.make_tensor_value_info("sequences_scores", TP.FLOAT, ["batch", "beams"]))
    node = helper.make_node(
        op, names, [o.name for o in outputs], domain="com.microsoft", name=node_name or f"{op}_0",
        decoder=decoder_graph(seed, elem=elem), eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1, model_type=0,
        no_repeat_ngram_size=0, **({"early_stopping": 0} if beam else {}),
    )  # fmt: skip
    graph = helper.make_graph([node], f"{op}_model", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def generation_feeds(op: str, rng: np.random.Generator, batch: int = 2, prompt: int = 3, max_length: int = 9) -> dict:
    feeds = {
        "input_ids": rng.integers(0, VOCAB - 1, (batch, prompt)).astype(np.int32),
        "max_length": np.array([max_length], np.int32),
        "min_length": np.array([1], np.int32),
        "repetition_penalty": np.array([1.0], np.float32),
    }
    if op == "BeamSearch":
        feeds.update(num_beams=np.array([2], np.int32), num_return_sequences=np.array([1], np.int32),
                     length_penalty=np.array([1.0], np.float32))  # fmt: skip
    return feeds


def if_model(elem=TP.FLOAT, then_heads: int = 2) -> onnx.ModelProto:
    """If(cond) over two branches that each hold one MultiHeadAttention reading q, k, v from the outer scope
    (the then branch: ``then_heads`` heads; the else branch: 4 heads and a Loop of one trip whose body holds a
    third MHA node over the else branch's result). A main-graph MHA 'outer_mha' makes q from x, so the main graph
    has placeholders of its own."""
    shape = ["batch", "seq", HIDDEN]

    def mha(inputs, output, heads, name):
        return helper.make_node("MultiHeadAttention", inputs, [output], domain="com.microsoft", num_heads=heads, name=name)

    then_branch = helper.make_graph(
        [mha(["q", "k", "v"], "then_out", then_heads, "then_mha")], "then", [], [helper.make_tensor_value_info("then_out", elem, shape)]
    )  # fmt: skip
    body = helper.make_graph(
        [mha(["carried", "k", "v"], "body_mha_out", 2, "body_mha"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("trip", TP.INT64, []), helper.make_tensor_value_info("cond_in", TP.BOOL, []),
         helper.make_tensor_value_info("carried", elem, shape)],
        [helper.make_tensor_value_info("cond_out", TP.BOOL, []), helper.make_tensor_value_info("body_mha_out", elem, shape)],
    )  # fmt: skip
    else_branch = helper.make_graph(
        [mha(["q", "k", "v"], "else_mid", 4, "else_mha"),
         helper.make_node("Loop", ["trips", "", "else_mid"], ["else_out"], body=body, name="loop")],
        "else", [], [helper.make_tensor_value_info("else_out", elem, shape)],
        initializer=[numpy_helper.from_array(np.array(1, np.int64), "trips")],
    )  # fmt: skip
    graph = helper.make_graph(
        [mha(["x", "k", "v"], "q", 2, "outer_mha"),
         helper.make_node("If", ["cond"], ["out"], then_branch=then_branch, else_branch=else_branch, name="branch")],
        "if_model",
        [helper.make_tensor_value_info("cond", TP.BOOL, [])]
        + [helper.make_tensor_value_info(n, elem, shape) for n in "xkv"],
        [helper.make_tensor_value_info("out", elem, shape)],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)
