"""Random feeds from a model's input signature, valid for the model (token ids inside the vocabulary, masks 0/1).

Symbolic dims take a value from ``dims`` (by dim_param name) or a default; integer inputs get values that the
model can consume: ids below the vocabulary size of the Gather that reads them, attention masks as right padding
with at least one kept position, key-length indices in [1, T], and a shared buffer's past_sequence_length P in
[0, M - L] (M the buffer's rows, L the node's new rows: docs/SEMANTICS.md §3.9).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np
import onnx

from mha_ep.dtypes import dtype_name

DEFAULT_BATCH = 2
DEFAULT_SEQUENCE = 8
DEFAULT_PAST = 4
FALLBACK_DIM = 4
FEED_BYTES_LIMIT = 4 << 30  # one random input larger than this is a mistake in the dims, not a test


def default_dim(param: str) -> int:
    """A value for a symbolic dim nobody named: batch 2, sequence 8, past 4, anything else 4.

    ``total*`` dims are not decided here: resolve_dims makes them past + sequence (ORT's decoder convention).
    """
    lowered = param.lower()
    if "batch" in lowered:
        return DEFAULT_BATCH
    if lowered.startswith("past"):
        return DEFAULT_PAST
    if "seq" in lowered or "len" in lowered:
        return DEFAULT_SEQUENCE
    return FALLBACK_DIM


def resolve_dims(model: onnx.ModelProto, dims: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """A value for every dim_param of the model's inputs: the caller's, else a default; a ``total*`` dim is the
    matching ``past*`` dim + the sequence dim, so masks of length T = P + L fit (e.g. total_sequence_length =
    past_sequence_length + sequence_length)."""
    values = dict(dims or {})
    params = [
        d.dim_param
        for value in model.graph.input
        for d in value.type.tensor_type.shape.dim
        if not d.HasField("dim_value") and d.dim_param
    ]
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise ValueError(
            f"unknown dim(s) {unknown}: the model's symbolic input dims are {sorted(set(params)) or 'none'}"
        )
    for param in params:
        if param not in values and not param.lower().startswith("total"):
            values[param] = default_dim(param)
    for param in params:
        if param in values:
            continue
        suffix = param[len("total"):]  # "_sequence_length", "_decode_len", ...
        past = next((v for k, v in values.items() if k.lower().startswith("past") and k.endswith(suffix)), DEFAULT_PAST)
        current = next(
            (v for k, v in values.items() if not k.lower().startswith("past") and suffix.endswith(k.lstrip("_"))),
            DEFAULT_SEQUENCE,
        )
        values[param] = past + current
    return values


def vocabulary_sizes(model: onnx.ModelProto) -> Dict[str, int]:
    """Graph input -> rows of the embedding table it indexes (through Cast/Identity chains): a Gather on an
    initializer, or EmbedLayerNormalization's word (input 0) and segment (input 1) ids."""
    initializers = {init.name: init for init in model.graph.initializer}
    source = {v.name: v.name for v in model.graph.input}
    for node in model.graph.node:  # graph order is topological, so one pass follows every chain
        if node.op_type in ("Cast", "Identity") and node.input and node.input[0] in source:
            source[node.output[0]] = source[node.input[0]]
    sizes: Dict[str, int] = {}

    def note(tensor: str, table: str) -> None:
        if tensor in source and table in initializers:
            sizes[source[tensor]] = int(initializers[table].dims[0])

    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1:
            note(node.input[1], node.input[0])
        if node.op_type == "EmbedLayerNormalization" and len(node.input) > 4:
            note(node.input[0], node.input[2])  # word embedding
            note(node.input[1], node.input[4])  # segment embedding
    return sizes


def past_length_limits(model: onnx.ModelProto, dims: Mapping[str, int]) -> Dict[str, int]:
    """Graph input -> the largest P it may hold: a past_sequence_length that a shared-buffer MultiHeadAttention
    node reads at input 8 (past_key at input 6 with M rows), M - L, L the node's query rows (1 where shape
    inference does not know them); the least over the nodes that read it."""
    inputs = {v.name: v for v in model.graph.input}
    readers = [n for n in model.graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"
               and len(n.input) > 8 and n.input[8] in inputs and n.input[6]]  # fmt: skip
    if not readers:
        return {}
    inferred: list = []  # shape inference's infos: run once, and only for a tensor that is not a graph input

    def dim(name: str, axis: int) -> Optional[int]:
        if name in inputs:
            shape = inputs[name].type.tensor_type.shape.dim
            if len(shape) > axis:
                d = shape[axis]
                return int(d.dim_value) if d.HasField("dim_value") else dims.get(d.dim_param)
        if not inferred:
            from mha_ep.claim.shapes import infer_static_infos

            inferred.append(infer_static_infos(model))
        info = inferred[0].get(name)
        return None if info is None else info.dim(axis)

    limits: Dict[str, int] = {}
    for node in readers:
        rows = dim(node.input[6], 2)
        if rows is None:
            continue
        limit = max(rows - (dim(node.input[0], 1) or 1), 0)
        limits[node.input[8]] = min(limits.get(node.input[8], limit), limit)
    return limits


def random_feeds(
    model: onnx.ModelProto, seed: int = 0, dims: Optional[Mapping[str, int]] = None
) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dims = resolve_dims(model, dims)
    initializer_names = {init.name for init in model.graph.initializer}
    vocab = vocabulary_sizes(model)
    past_limits = past_length_limits(model, dims)
    feeds: Dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in initializer_names:
            continue
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise ValueError(f"input {value.name!r} is not a tensor; random feeds cannot be made for it, pass feeds")
        if not tensor.HasField("shape"):
            raise ValueError(
                f"input {value.name!r} has no recorded shape (not even its rank), so random feeds cannot be made "
                f"for it; pass feeds (--feeds x.npz) or give the input a shape in the model"
            )
        shape = tuple(int(d.dim_value) if d.HasField("dim_value") else dims.get(d.dim_param, FALLBACK_DIM)
                      for d in tensor.shape.dim)  # fmt: skip
        dtype = dtype_name(tensor.elem_type)
        size = int(np.prod(shape, dtype=object)) * _itemsize(dtype)
        if size > FEED_BYTES_LIMIT:
            raise ValueError(
                f"input {value.name!r} of shape {shape} would take {size / 2**30:.1f} GiB of random feeds (limit "
                f"{FEED_BYTES_LIMIT / 2**30:.0f} GiB); check the dims ({dims})"
            )
        if value.name in past_limits:
            feeds[value.name] = rng.integers(0, past_limits[value.name] + 1, size=shape).astype(dtype)
            continue
        feeds[value.name] = np.asarray(_random_tensor(rng, value.name, shape, dtype, vocab.get(value.name)))
    return feeds


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # bfloat16, string, ...: an estimate is enough for the size check
        return 8


def _random_tensor(rng, name: str, shape, dtype: str, vocab: Optional[int]) -> np.ndarray:
    lowered = name.lower()
    if dtype in ("float32", "float16", "float64"):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == "bfloat16":
        raise ValueError(f"input {name!r} is bfloat16; NumPy feeds cannot carry it, pass feeds yourself")
    if dtype == "bool":
        return rng.random(shape) < 0.8
    if "mask" in lowered and len(shape) == 2:  # right padding, at least one kept position per row
        lengths = rng.integers(1, shape[1] + 1, size=shape[0])
        return (np.arange(shape[1])[None, :] < lengths[:, None]).astype(dtype)
    if "mask" in lowered and len(shape) == 1:
        return rng.integers(1, 9, size=shape).astype(dtype)
    high = vocab if vocab else 100
    return rng.integers(0, high, size=shape).astype(dtype)
