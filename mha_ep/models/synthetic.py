"""A BERT-style encoder with random weights, written directly in ONNX (no torch), as ORT's optimizer leaves one.

Per layer, the ops of an ORT-optimized BERT with ``use_multi_head_attention=True``:

    q, k, v   = MatMul(x, W_q), MatMul(x, W_k), MatMul(x, W_v)           (B, S, D)
    context   = com.microsoft::MultiHeadAttention(q, k, v, b_qkv, mask)   mask: (B, S) int32 key padding
    x1        = com.microsoft::SkipLayerNormalization(MatMul(context, W_o), x, gamma, beta, b_o)
    x         = com.microsoft::SkipLayerNormalization(MatMul(BiasGelu(MatMul(x1, W_1), b_1), W_2), x1, ..., b_2)

Inputs: ``hidden_states`` (B, S, D) in the model's dtype and ``attention_mask`` (B, S) int32 (1 keep, 0 pad);
output ``last_hidden_state``. Used by the device-mode benchmark (BERT-base: 12 layers, hidden 768, 12 heads) and
its tests; weights are drawn N(0, 0.02) from a fixed seed, so two builds are identical.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

ELEM = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16}
MAX_POSITIONS = 448  # Whisper's decoder positions (max_target_positions)


def skip_layer_norm(weight, prefix: str, tag: str, value: str, residual: str, bias: str, out: str, hidden: int,
                    epsilon: float) -> onnx.NodeProto:  # fmt: skip
    """com.microsoft::SkipLayerNormalization(value + residual + bias) with unit gamma and zero beta; ``weight``
    makes the initializers (gamma, beta, then the drawn bias: the order the seeded weights come in)."""
    return helper.make_node(
        "SkipLayerNormalization",
        [value, residual, weight(prefix + f"{tag}.gamma", (hidden,), value=1.0),
         weight(prefix + f"{tag}.beta", (hidden,), value=0.0), weight(prefix + bias, (hidden,))],
        [out], domain="com.microsoft", name=prefix + f"skip_{tag}", epsilon=epsilon,
    )  # fmt: skip


def feed_forward(weight, prefix: str, x: str, tag: str, out: str, hidden: int, ffn: int, epsilon: float) -> list:
    """A layer's feed-forward block as ORT's fusions leave it: MatMul, BiasGelu, MatMul, then the
    SkipLayerNormalization ``tag`` that adds the residual ``x`` and writes ``out``."""
    p = prefix
    return [
        helper.make_node("MatMul", [x, weight(p + "W_1", (hidden, ffn))], [p + "h"], name=p + "matmul_1"),
        helper.make_node("BiasGelu", [p + "h", weight(p + "b_1", (ffn,))], [p + "g"], domain="com.microsoft",
                         name=p + "gelu"),  # fmt: skip
        helper.make_node("MatMul", [p + "g", weight(p + "W_2", (ffn, hidden))], [p + "h2"], name=p + "matmul_2"),
        skip_layer_norm(weight, p, tag, p + "h2", x, "b_2", out, hidden, epsilon),
    ]


def bert_encoder(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072, dtype: str = "float32",
                 seed: int = 0, mask: bool = True) -> onnx.ModelProto:  # fmt: skip
    """The encoder of the module docstring; ``mask=False`` leaves the key padding mask out (a Whisper-style
    encoder: no ``attention_mask`` input)."""
    if dtype not in ELEM:
        raise ValueError(f"dtype must be one of {sorted(ELEM)}, got {dtype!r}")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    initializers = []

    def weight(name: str, shape, std: float = 0.02, value=None) -> str:
        array = rng.normal(0.0, std, shape) if value is None else np.full(shape, value)
        initializers.append(numpy_helper.from_array(array.astype(np_dtype), name))
        return name

    nodes = []
    x = "hidden_states"
    for layer in range(layers):
        p = f"layer{layer}."
        for part in "qkv":
            nodes.append(helper.make_node("MatMul", [x, weight(p + f"W_{part}", (hidden, hidden))], [p + part],
                                          name=p + f"matmul_{part}"))  # fmt: skip
        nodes.append(helper.make_node(
            "MultiHeadAttention",
            [p + "q", p + "k", p + "v", weight(p + "b_qkv", (3 * hidden,))] + (["attention_mask"] if mask else []),
            [p + "context"], domain="com.microsoft", name=p + "attention", num_heads=heads,
        ))  # fmt: skip
        nodes.append(helper.make_node("MatMul", [p + "context", weight(p + "W_o", (hidden, hidden))], [p + "proj"],
                                      name=p + "matmul_o"))  # fmt: skip
        nodes.append(skip_layer_norm(weight, p, "ln1", p + "proj", x, "b_o", p + "x1", hidden, 1e-12))
        out = "last_hidden_state" if layer == layers - 1 else p + "out"
        nodes.extend(feed_forward(weight, p, p + "x1", "ln2", out, hidden, ffn, 1e-12))
        x = out
    graph = helper.make_graph(
        nodes, f"bert_encoder_{layers}x{hidden}_{dtype}",
        [helper.make_tensor_value_info("hidden_states", ELEM[dtype], ["batch", "sequence", hidden])]
        + ([helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT32, ["batch", "sequence"])]
           if mask else []),
        [helper.make_tensor_value_info("last_hidden_state", ELEM[dtype], ["batch", "sequence", hidden])],
        initializer=initializers,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def encoder_feeds(batch: int, sequence: int, hidden: int = 768, dtype: str = "float32", seed: int = 0) -> dict:
    """Random hidden states N(0, 1) and a right-padded key mask: batch b keeps its first S - b*S/(2B) keys."""
    rng = np.random.default_rng(seed)
    lengths = [max(1, sequence - (b * sequence) // (2 * batch)) for b in range(batch)]
    mask = (np.arange(sequence)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    states = rng.standard_normal((batch, sequence, hidden)).astype(dtype)
    return {"hidden_states": states, "attention_mask": mask}


def whisper_decoder_step(layers: int = 4, hidden: int = 384, heads: int = 6, ffn: int = 1536, dtype: str = "float32",
                         seed: int = 0, vocab: int = 0, cross_qk: bool = False) -> onnx.ModelProto:  # fmt: skip
    """One Whisper-style decoder step with random weights, as ORT's optimizer (``--model_type bart``) leaves one.

    Per layer: self-attention MultiHeadAttention over the new token with the past (B, N, P, H) prepended, its
    presents as outputs; cross-attention MultiHeadAttention over the encoder's keys and values, given as BNSH
    (B, N, T_enc, H) inputs; an FFN; residuals through SkipLayerNormalization. Inputs ``hidden_states`` (B, 1, D),
    ``past_key_self_<l>`` / ``past_value_self_<l>`` (B, N, P, H) and ``cross_key_<l>`` / ``cross_value_<l>``
    (B, N, T_enc, H); outputs ``last_hidden_state`` and ``present_key_self_<l>`` / ``present_value_self_<l>``.
    Tiny-sized by default (Whisper tiny: 4 layers, d 384, 6 heads); small: 12 layers, d 768, 12 heads, ffn 3072.

    ``vocab`` > 0 makes it a whole decoder-with-past, as a generation loop runs it: the input is ``input_ids``
    (B, 1) int64, embedded (a (vocab, D) table) plus a learned position (a (MAX_POSITIONS, D) table, indexed by the
    past's length), and the output ``logits`` (B, 1, vocab) after a final LayerNormalization and a (D, vocab)
    projection, in place of ``last_hidden_state``.

    ``cross_qk`` gives every cross-attention node output 3, the graph output ``output_cross_qk_<l>`` (B, N, 1,
    T_enc) in the node's type, as ORT's Whisper export does with ``--output_cross_qk`` (word timestamps)."""
    if dtype not in ELEM:
        raise ValueError(f"dtype must be one of {sorted(ELEM)}, got {dtype!r}")
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    head = hidden // heads
    initializers, nodes, inputs, outputs, qk_outputs = [], [], [], [], []

    def weight(name: str, shape, std: float = 0.02, value=None) -> str:
        array = rng.normal(0.0, std, shape) if value is None else np.full(shape, value)
        initializers.append(numpy_helper.from_array(array.astype(np_dtype), name))
        return name

    def tensor(name: str, shape) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, ELEM[dtype], shape)

    if vocab:
        inputs.append(helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", 1]))
        nodes += [
            helper.make_node("Gather", [weight("embed_tokens", (vocab, hidden)), "input_ids"], ["tokens"],
                             name="embed_tokens"),
            helper.make_node("Shape", ["past_key_self_0"], ["past_length"], name="past_length", start=2, end=3),
            helper.make_node("Gather", [weight("embed_positions", (MAX_POSITIONS, hidden)), "past_length"],
                             ["position"], name="embed_positions"),
            helper.make_node("Add", ["tokens", "position"], ["embedded"], name="embed_add"),
        ]  # fmt: skip
        x = "embedded"
    else:
        inputs.append(tensor("hidden_states", ["batch", 1, hidden]))
        x = "hidden_states"
    for layer in range(layers):
        p = f"layer{layer}."
        cache = ["batch", heads, "past_sequence", head]
        inputs += [tensor(f"past_key_self_{layer}", cache), tensor(f"past_value_self_{layer}", cache)]
        cross = ["batch", heads, "encoder_sequence", head]
        inputs += [tensor(f"cross_key_{layer}", cross), tensor(f"cross_value_{layer}", cross)]
        present = ["batch", heads, "total_sequence", head]
        outputs += [tensor(f"present_key_self_{layer}", present), tensor(f"present_value_self_{layer}", present)]
        for part in "qkv":
            nodes.append(helper.make_node("MatMul", [x, weight(p + f"self_W_{part}", (hidden, hidden))],
                                          [p + "self_" + part], name=p + f"self_matmul_{part}"))  # fmt: skip
        nodes.append(helper.make_node(
            "MultiHeadAttention",
            [p + "self_q", p + "self_k", p + "self_v", weight(p + "self_b_qkv", (3 * hidden,)), "", "",
             f"past_key_self_{layer}", f"past_value_self_{layer}"],
            [p + "self_context", f"present_key_self_{layer}", f"present_value_self_{layer}"],
            domain="com.microsoft", name=p + "self_attention", num_heads=heads,
        ))  # fmt: skip
        nodes.append(helper.make_node("MatMul", [p + "self_context", weight(p + "self_W_o", (hidden, hidden))],
                                      [p + "self_proj"], name=p + "self_matmul_o"))  # fmt: skip
        nodes.append(skip_layer_norm(weight, p, "ln1", p + "self_proj", x, "self_b_o", p + "x1", hidden, 1e-5))
        nodes.append(helper.make_node("MatMul", [p + "x1", weight(p + "cross_W_q", (hidden, hidden))], [p + "cross_q"],
                                      name=p + "cross_matmul_q"))  # fmt: skip
        nodes.append(helper.make_node(
            "MultiHeadAttention", [p + "cross_q", f"cross_key_{layer}", f"cross_value_{layer}"],
            [p + "cross_context"] + (["", "", f"output_cross_qk_{layer}"] if cross_qk else []),
            domain="com.microsoft", name=p + "cross_attention", num_heads=heads,
        ))  # fmt: skip
        if cross_qk:
            qk_outputs.append(tensor(f"output_cross_qk_{layer}", ["batch", heads, 1, "encoder_sequence"]))
        nodes.append(helper.make_node("MatMul", [p + "cross_context", weight(p + "cross_W_o", (hidden, hidden))],
                                      [p + "cross_proj"], name=p + "cross_matmul_o"))  # fmt: skip
        nodes.append(skip_layer_norm(weight, p, "ln2", p + "cross_proj", p + "x1", "cross_b_o", p + "x2", hidden, 1e-5))
        out = "last_hidden_state" if layer == layers - 1 else p + "out"
        nodes.extend(feed_forward(weight, p, p + "x2", "ln3", out, hidden, ffn, 1e-5))
        x = out
    if vocab:
        nodes += [
            helper.make_node("LayerNormalization", [x, weight("final_ln.gamma", (hidden,), value=1.0),
                                                    weight("final_ln.beta", (hidden,), value=0.0)],
                             ["final"], name="final_layer_norm", axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", ["final", weight("lm_head", (hidden, vocab))], ["logits"], name="lm_head"),
        ]  # fmt: skip
        outputs.insert(0, tensor("logits", ["batch", 1, vocab]))
    else:
        outputs.insert(0, tensor("last_hidden_state", ["batch", 1, hidden]))
    outputs += qk_outputs
    graph = helper.make_graph(nodes, f"whisper_decoder_step_{layers}x{hidden}_{dtype}", inputs, outputs,
                              initializer=initializers)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def whisper_cross_kv(layers: int = 4, hidden: int = 384, heads: int = 6, dtype: str = "float32",
                     seed: int = 1) -> onnx.ModelProto:  # fmt: skip
    """The cross-attention keys and values of every decoder layer from the encoder's output, as Whisper's first
    decoder step computes them once per utterance: input ``encoder_hidden_states`` (B, T, D), outputs
    ``cross_key_<l>`` / ``cross_value_<l>`` (B, N, T, H) (MatMul, Reshape, Transpose; the value's bias added)."""
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype)
    head = hidden // heads
    initializers = [numpy_helper.from_array(np.array([0, 0, heads, head], np.int64), "split_heads")]
    nodes, outputs = [], []
    for layer in range(layers):
        for part in ("key", "value"):
            name = f"cross_{part}_{layer}"
            initializers.append(numpy_helper.from_array(rng.normal(0, 0.02, (hidden, hidden)).astype(np_dtype),
                                                        f"W_{name}"))  # fmt: skip
            source = f"{name}_projected"
            nodes.append(helper.make_node("MatMul", ["encoder_hidden_states", f"W_{name}"], [source], name=f"{name}_matmul"))
            if part == "value":
                initializers.append(numpy_helper.from_array(rng.normal(0, 0.02, (hidden,)).astype(np_dtype), f"b_{name}"))
                nodes.append(helper.make_node("Add", [source, f"b_{name}"], [f"{name}_biased"], name=f"{name}_bias"))
                source = f"{name}_biased"
            nodes.append(helper.make_node("Reshape", [source, "split_heads"], [f"{name}_BSNH"], name=f"{name}_reshape"))
            nodes.append(helper.make_node("Transpose", [f"{name}_BSNH"], [name], name=f"{name}_transpose",
                                          perm=[0, 2, 1, 3]))  # fmt: skip
            outputs.append(helper.make_tensor_value_info(name, ELEM[dtype], ["batch", heads, "encoder_sequence", head]))
    inputs = [helper.make_tensor_value_info("encoder_hidden_states", ELEM[dtype], ["batch", "encoder_sequence", hidden])]
    graph = helper.make_graph(nodes, f"whisper_cross_kv_{layers}x{hidden}_{dtype}", inputs, outputs,
                              initializer=initializers)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def decoder_step_feeds(batch: int, past: int, layers: int = 4, hidden: int = 384, heads: int = 6,
                       encoder_sequence: int = 1500, dtype: str = "float32", seed: int = 0) -> dict:  # fmt: skip
    """Random feeds of whisper_decoder_step: N(0, 1) states, caches and encoder keys/values."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    feeds = {"hidden_states": rng.standard_normal((batch, 1, hidden)).astype(dtype)}
    for layer in range(layers):
        for name, length in (("past_key_self", past), ("past_value_self", past), ("cross_key", encoder_sequence),
                             ("cross_value", encoder_sequence)):  # fmt: skip
            feeds[f"{name}_{layer}"] = rng.standard_normal((batch, heads, length, head)).astype(dtype)
    return feeds
