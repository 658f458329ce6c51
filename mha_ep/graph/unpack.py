"""Stock ORT's twin of a model with packed MultiHeadAttention nodes: each packed node fed its slots apart.

Stock ORT 1.31.1's CPU kernel refuses every packed call ("Packed QKV of shape (B, L, N, 3, H) not implemented for
CPU", "Packed KV not implemented for CPU"), and its CUDA kernel runs only some. A packed node means the node with its
inputs unpacked (docs/SEMANTICS.md, "Packed QKV / KV: ours"), so that node on stock ORT CPU is the oracle for ours:
`mha-ep compare` runs stock ORT on this twin (mha_ep/comparison/runner.py), the tests do the same by hand.

    query (B, L, N, 3, H) --Gather(axis 3, s)--> (B, L, N, H) --Reshape(0, 0, -1)--> (B, L, N*H)   s = 0, 1, 2:
                                                                                    query, key, value
    key   (B, L, N, 2, H) --Gather(axis 3, s)--> (B, L, N, H) --Reshape(0, 0, -1)--> (B, L, N*H)   s = 0, 1: key, value

Legend: B batch, L the rows of the packed input, N heads, H head size. Every other input, attribute and output of
the node stays as it is (a bias, masks, a shared past and present buffer, cache_indirection). Only the main graph is
rewritten: a packed node inside an If / Loop / Scan body stays packed (``unpack_packed_attention`` names it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_ep.claim.names import node_name
from mha_ep.claim.shapes import infer_static_infos
from mha_ep.graph.graph_facts import fresh_name, taken_names
from mha_ep.graph.partition import is_ort_mha

PACKED_SLOTS = {"qkv": (0, ("query", "key", "value")), "kv": (1, ("key", "value"))}  # form -> (input, its slots)


@dataclass
class Unpacked:
    """What ``unpack_packed_attention`` did: the nodes unpacked (name, form) and the packed ones it left, with why."""

    nodes: List[Tuple[str, str]] = field(default_factory=list)
    left: List[Tuple[str, str]] = field(default_factory=list)

    def note(self) -> str:
        """One line for a report, "" when nothing was packed."""
        parts = []
        if self.nodes:
            names = ", ".join(f"{name} ({form.upper()})" for name, form in self.nodes)
            parts.append(f"{len(self.nodes)} packed MultiHeadAttention node(s) given to stock ORT with their inputs "
                         f"unpacked, the node they mean (stock ORT's CPU kernel refuses packed inputs): {names}")
        parts += [f"{name} stays packed for stock ORT: {why}" for name, why in self.left]
        return "; ".join(parts)


def packed_form(node: onnx.NodeProto, rank) -> str | None:
    """"qkv" / "kv" when ``node`` (a MultiHeadAttention) has a packed input (claim/rules.py packing), else None;
    ``rank(name)``: a tensor's rank or None."""
    inputs = list(node.input) + [""] * 3
    if inputs[0] and rank(inputs[0]) == 5 and not inputs[1] and not inputs[2]:
        return "qkv"
    if inputs[1] and rank(inputs[1]) == 5 and not inputs[2]:
        return "kv"
    return None


def may_be_packed(node: onnx.NodeProto) -> bool:
    """A MultiHeadAttention without its key or value: packed QKV or packed KV, whatever the ranks (a packed form
    always leaves value out)."""
    return is_ort_mha(node) and len([i for i in node.input[:3] if i]) < 3


def unpack_packed_attention(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, Unpacked]:
    """A copy of ``model`` whose packed MultiHeadAttention nodes (main graph) read their slots as separate inputs
    (module docstring), and what was done; ``model`` itself is left as it is. A model with no packed node comes
    back as the same object."""
    done = Unpacked()
    for graph_node in model.graph.node:
        for attribute in graph_node.attribute:
            for body in list(attribute.g.node if attribute.HasField("g") else []) + [
                    n for g in attribute.graphs for n in g.node]:  # fmt: skip
                if may_be_packed(body):
                    done.left.append((node_name(body), f"inside the subgraph of {node_name(graph_node)!r}, which "
                                                       "this pass does not follow (it may be packed)"))
    if not any(may_be_packed(n) for n in model.graph.node):
        return model, done  # no shape inference (compare's partition ran one already) for the common model
    infos = infer_static_infos(model)

    def rank(name: str):
        info = infos.get(name)
        return None if info is None else info.rank

    if not any(is_ort_mha(n) and packed_form(n, rank) for n in model.graph.node):
        return model, done
    twin = copy.deepcopy(model)
    graph = twin.graph
    taken = taken_names(graph)

    def fresh(stem: str) -> str:
        return fresh_name(stem, taken)

    flat = fresh("mha_ep_unpack/shape_0_0_-1")
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), flat))
    indices = {}
    nodes = []
    for node in graph.node:
        form = packed_form(node, rank) if is_ort_mha(node) else None
        if form is None:
            nodes.append(node)
            continue
        source_at, slots = PACKED_SLOTS[form]
        source = node.input[source_at]
        inputs = list(node.input) + [""] * (3 - len(node.input))
        for index, slot in enumerate(slots):
            if index not in indices:
                indices[index] = fresh(f"mha_ep_unpack/slot_{index}")
                graph.initializer.append(numpy_helper.from_array(np.array(index, np.int64), indices[index]))
            stem = f"{node_name(node)}/unpacked_{slot}"
            taken_slot, flat_slot = fresh(f"{stem}_BLNH"), fresh(f"{stem}_BLD")
            nodes.append(helper.make_node("Gather", [source, indices[index]], [taken_slot],
                                          name=fresh(f"{stem}/Gather"), axis=3))
            nodes.append(helper.make_node("Reshape", [taken_slot, flat], [flat_slot], name=fresh(f"{stem}/Reshape")))
            inputs[source_at + index] = flat_slot
        del node.input[:]
        node.input.extend(inputs)
        nodes.append(node)
        done.nodes.append((node_name(node), form))
    del graph.node[:]
    graph.node.extend(nodes)
    return twin, done
