"""The static-cache rewrite's rule PACKED_PROJECTIONS (mha_ep/graph/static_cache.py): a self-attention node's Q, K
and V projections, three MatMuls of one input by constant weights, become one MatMul whose output a Reshape makes
the node's packed QKV query (docs/SEMANTICS.md, "Packed QKV / KV: ours").

    x_BLE ──MatMul(W_q)──▶ q_BLD ─┐              x_BLE ──MatMul(W_qkv)──▶ (B, L, N*3*H)
    x_BLE ──MatMul(W_k)──▶ k_BLD ─┼─▶ MHA   =>          ──Reshape(0, 0, N, 3, H)──▶ qkv_BLN3H ──▶ MHA (no key, value)
    x_BLE ──MatMul(W_v)──▶ v_BLD ─┘

Legend: B batch, L the step's rows, E the projections' input width, N heads, H head size, D = N*H.

W_qkv (E, N*3*H) holds the three weights' columns interleaved per head, in the order (n, slot, h): its column
n*3H + slot*H + h is column n*H + h of W_q, W_k, W_v for slot 0, 1, 2. Every output element is the dot product it
was before (x's row by the same weight column), so slot 0 is query[..., n, :], slot 1 key's, slot 2 value's; a GEMM
may block the sum over E differently for a wider output, so the values agree to float rounding. The node's bias
b_q | b_k | b_v (length 3D) stays as it is: the packed node adds b_q, b_k and b_v to slots 0, 1 and 2, as the
unpacked node adds them to query, key and value.

``match_projections`` says, for one node, what it found: its three MatMuls, or the sentence why they cannot be
packed (the rewrite then leaves the node as it is and reports it). This module only reads graphs and builds arrays;
the pass writes the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Tuple, Union

import numpy as np
import onnx
from onnx import numpy_helper

from mha_ep.claim.names import node_name

SLOTS = ("query", "key", "value")  # MultiHeadAttention's inputs 0, 1, 2: the packed query's slots 0, 1, 2
ALREADY = "packed already"  # match_projections' word for a node whose query is packed QKV (no key or value)


@dataclass(frozen=True)
class Projections:
    """A self node's three projections, in SLOTS order: the MatMul nodes, the input they share, their weights
    (E, D) as arrays."""

    matmuls: Tuple[onnx.NodeProto, ...]
    source: str
    weights: Tuple[np.ndarray, ...]


def _where(node: onnx.NodeProto) -> str:
    return f"node {node_name(node)!r} ({node.op_type})"


def match_projections(node: onnx.NodeProto, producers: Mapping[str, onnx.NodeProto],
                      readers: Mapping[str, List[onnx.NodeProto]], constants: Mapping[str, onnx.TensorProto],
                      graph_outputs, heads: int, head_size: int) -> Union[Projections, str]:  # fmt: skip
    """``node``'s projections (a MultiHeadAttention self node: query, key and value its inputs 0-2), or why they
    cannot be packed (ALREADY: its query is packed QKV, no key or value). ``producers``: tensor -> the node that
    makes it; ``readers``: tensor -> the nodes that read it (each once per read); ``constants``: the initializers
    that are not graph inputs; ``graph_outputs``: the graph's output names; ``heads`` and ``head_size``: N and H,
    from the node's pasts."""
    names = (list(node.input) + [""] * 3)[:3]
    if names[0] and not names[1] and not names[2]:
        return ALREADY  # a rewritten model, rewritten again
    matmuls = []
    for slot, name in zip(SLOTS, names):
        producer = producers.get(name)
        if producer is None or producer.op_type != "MatMul" or producer.domain not in ("", "ai.onnx"):
            made = "a graph input or an initializer" if producer is None else f"made by {_where(producer)}"
            return f"its {slot} {name!r} is not the output of a MatMul ({made})"
        matmuls.append(producer)
    if len({id(m) for m in matmuls}) < 3:
        return "its query, key and value are not the outputs of three MatMuls (one MatMul makes two of them)"
    sources = [m.input[0] for m in matmuls]
    if len(set(sources)) != 1:
        return (f"its query, key and value are projections of different inputs ({', '.join(map(repr, sources))}), "
                "not of one")  # fmt: skip
    weights = []
    for slot, matmul, name in zip(SLOTS, matmuls, names):
        others = [_where(r) for r in readers.get(name, []) if r is not node]
        if others or name in graph_outputs or names.count(name) > 1:
            what = ", ".join(others) or ("a graph output" if name in graph_outputs else "this node at two inputs")
            return f"its {slot} projection's output {name!r} is read elsewhere too ({what})"
        weight = matmul.input[1]
        if weight not in constants:
            return (f"the weight {weight!r} of its {slot} projection ({_where(matmul)}) is not a constant "
                    "initializer (a graph input, or computed)")  # fmt: skip
        dims = tuple(int(d) for d in constants[weight].dims)
        if len(dims) != 2 or dims[1] != heads * head_size:
            return (f"the weight {weight!r} of its {slot} projection has dims {dims}, not (E, N * H) = (E, "
                    f"{heads * head_size}) with the pasts' N {heads} and H {head_size}")  # fmt: skip
        try:
            weights.append(numpy_helper.to_array(constants[weight]))
        except Exception as error:  # noqa: BLE001 - external data that was not loaded, a malformed tensor
            return f"the weight {weight!r} of its {slot} projection cannot be read ({type(error).__name__}: {error})"
    if len({(w.shape[0], w.dtype) for w in weights}) != 1:
        described = ", ".join(f"{slot} {w.shape} {w.dtype}" for slot, w in zip(SLOTS, weights))
        return f"its projections' weights differ in input width or element type ({described})"
    return Projections(tuple(matmuls), sources[0], tuple(weights))


def packed_weight(weights: Tuple[np.ndarray, ...], heads: int, head_size: int) -> np.ndarray:
    """W_qkv (E, N*3*H): the weights' columns interleaved in the order (n, slot, h) (module docstring)."""
    width = weights[0].shape[0]
    per_head = [w.reshape(width, heads, head_size) for w in weights]  # (E, N, H) each
    return np.ascontiguousarray(np.stack(per_head, axis=2).reshape(width, heads * len(weights) * head_size))


def packed_shape(heads: int, head_size: int) -> np.ndarray:
    """Reshape's shape for the fused MatMul's (B, L, N*3*H) output: (B, L, N, 3, H), B and L copied (0)."""
    return np.array([0, 0, heads, len(SLOTS), head_size], np.int64)


def readers_of(nodes, names_read) -> Dict[str, List[onnx.NodeProto]]:
    """tensor -> the nodes among ``nodes`` that read it, once per read (``names_read(node)``: what a node reads,
    its subgraphs' outer reads included)."""
    found: Dict[str, List[onnx.NodeProto]] = {}
    for node in nodes:
        for name in names_read(node):
            found.setdefault(name, []).append(node)
    return found
