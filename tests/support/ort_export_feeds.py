"""Valid random feeds for the models in tests/fixtures/ort_exports/ (written by ORT's own export scripts).

Only numpy and onnx: the project's CI has no torch. `feeds_for(path)` reads the model's declared inputs and
fills each one with seeded random values of a shape that the model accepts:

- decoders (Whisper decoder with past, init decoder): batch 2, 1 new token after 4 past tokens (with past) or 4
  tokens (init); token ids below the vocabulary size read off the `logits` output; the cross-attention length
  is the model's static 1500 (Whisper's encoder always sees 3000 mel frames).
- WhisperBeamSearch / BeamSearch: the search parameters (max_length, min_length, num_beams, ...) as small
  valid scalars in shape [1]; `input_features` of batch 1 with the mel count and frame count that the encoder
  subgraph declares; `input_ids` with token ids below the vocabulary size.
- BeamSearch of a text encoder-decoder (T5): `input_ids` int32 (1, 8), ids below the vocabulary size (the
  decoder's `logits` width) other than the node's pad_token_id and eos_token_id (the search reads a pad id in
  the input as padding).

    import onnxruntime as ort
    from ort_export_feeds import feeds_for, FIXTURES
    path = FIXTURES / "whisper_decoder.onnx"
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds_for(path))
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import onnx

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ort_exports"

# Symbolic dimensions of the shipped models and the size each gets in the feeds.
DIMS = {
    "batch_size": 2,
    "batch": 2,
    "sequence_length": 1,  # decoder with past: one new token
    "decode_sequence_length": 1,
    "past_sequence_length": 4,
    "past_decode_sequence_length": 4,
    "encode_sequence_length": 8,
    "num_layer_head": 2,
    "initial_sequence_length": 1,
}

# Beam search parameters, each fed as a [1] tensor of the declared type.
SEARCH = {
    "max_length": 12,
    "min_length": 1,
    "num_beams": 2,
    "num_return_sequences": 1,
    "length_penalty": 1.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "logits_processor": 0,
}

_NP = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64,
}

_SEARCH_OPS = ("BeamSearch", "WhisperBeamSearch", "GreedySearch", "Sampling")


def _vocab_size(graph: onnx.GraphProto) -> int | None:
    for out in graph.output:
        if out.name == "logits":
            last = out.type.tensor_type.shape.dim[-1]
            if last.HasField("dim_value"):
                return last.dim_value
    return None


def _search_node(model: onnx.ModelProto) -> onnx.NodeProto | None:
    for node in model.graph.node:
        if node.op_type in _SEARCH_OPS:
            return node
    return None


def _int_attr(node: onnx.NodeProto, name: str) -> int | None:
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.INT:
            return attr.i
    return None


def _subgraph(node: onnx.NodeProto, name: str) -> onnx.GraphProto | None:
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.GRAPH:
            return attr.g
    return None


def _shape(value_info: onnx.ValueInfoProto, dims: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.dim_param in dims:
            shape.append(dims[d.dim_param])
        else:
            raise ValueError(f"{value_info.name}: no size for dimension {d.dim_param!r}")
    return tuple(shape)


def feeds_for_model(model: onnx.ModelProto, name: str = "", seed: int | None = None) -> dict[str, np.ndarray]:
    """Valid random feeds for an ORT-exported model already loaded with onnx (weights not needed)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) if seed is None else seed)
    graph = model.graph
    dims = dict(DIMS)
    vocab = _vocab_size(graph)
    search = _search_node(model)
    avoid: set[int] = set()
    if search is not None:
        dims["batch_size"] = dims["batch"] = 1
        decoder = _subgraph(search, "decoder")
        vocab = _vocab_size(decoder) if decoder is not None else vocab
        encoder = _subgraph(search, "encoder")
        if encoder is not None and encoder.input:
            enc_in = encoder.input[0].type.tensor_type.shape.dim
            if len(enc_in) == 3:  # Whisper: [batch, mels, frames]
                dims["feature_size"] = enc_in[1].dim_value
                dims["sequence_length"] = enc_in[2].dim_value
            else:  # text encoder: [batch, tokens]
                dims["sequence_length"] = 8
                avoid = {i for i in (_int_attr(search, "pad_token_id"), _int_attr(search, "eos_token_id"))
                         if i is not None}
    elif any(i.name == "encoder_hidden_states" for i in graph.input) or not any(
        i.name.startswith("past_key_self") for i in graph.input
    ):
        dims["sequence_length"] = 4  # a first decoder step reads several tokens
    initializers = {t.name for t in graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for inp in graph.input:
        if inp.name in initializers:
            continue
        dtype = _NP[inp.type.tensor_type.elem_type]
        if search is not None and inp.name in SEARCH:
            feeds[inp.name] = np.array([SEARCH[inp.name]], dtype=dtype)
            continue
        if inp.name == "vocab_mask":
            feeds[inp.name] = np.ones(_shape(inp, dims), dtype=dtype)
            continue
        shape = _shape(inp, dims)
        if np.issubdtype(dtype, np.integer):
            if "mask" in inp.name:
                feeds[inp.name] = np.ones(shape, dtype=dtype)
            elif avoid and inp.name == "input_ids":
                allowed = np.array([i for i in range(vocab) if i not in avoid])
                feeds[inp.name] = allowed[rng.integers(0, len(allowed), size=shape)].astype(dtype)
            else:
                high = vocab if vocab else 2
                feeds[inp.name] = rng.integers(0, high, size=shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def feeds_for(path: str | Path) -> dict[str, np.ndarray]:
    """Seeded valid random feeds for the fixture at `path` (the same arrays on every call)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    return feeds_for_model(model, path.name)
