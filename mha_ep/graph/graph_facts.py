"""What an ONNX graph says about its tensors, read for the static-cache rewrite (mha_ep/graph/static_cache.py): the
dims a value declares or shape inference finds, the tensors a node reads (its subgraphs' outer-scope reads included),
and the graph inputs a tensor is computed from."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import onnx

from mha_ep.claim.names import node_name
from mha_ep.claim.shapes import symbolic_shape_inference

Dim = Union[int, str, None]  # a static dim, a dim_param, or None (unknown)


def dims_of(value: onnx.ValueInfoProto) -> Optional[Tuple[Dim, ...]]:
    """A value's declared dims (int, dim_param text or None); None when its rank is not known."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)


def set_dims(value: onnx.ValueInfoProto, dims: Sequence[Dim]) -> None:
    shape = value.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        if isinstance(d, int):
            shape.dim.add().dim_value = d
        elif d:
            shape.dim.add().dim_param = d
        else:
            shape.dim.add()


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's symbolic shape inference (it knows the com.microsoft ops, so shapes carry through attention to the
    logits), ONNX's own when that fails."""
    try:
        return symbolic_shape_inference(model)
    except Exception:  # noqa: BLE001 - any failure: the next method
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)


def inferred_dims(model: onnx.ModelProto) -> Dict[str, Tuple[Dim, ...]]:
    """Dims of every tensor the inferred ``model`` knows the rank of, initializers included."""
    graph = model.graph
    found = {v.name: dims_of(v) for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    found.update({init.name: tuple(int(d) for d in init.dims) for init in graph.initializer})
    return {name: dims for name, dims in found.items() if dims is not None}


def names_read(graph: onnx.GraphProto, node: onnx.NodeProto) -> List[str]:
    """The tensors ``node`` reads: its inputs, and the outer-scope names its subgraphs read."""
    read = [name for name in node.input if name]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            inner = {name for n in sub.node for name in n.output} | {v.name for v in sub.input}
            inner |= {i.name for i in sub.initializer}
            read += [name for n in sub.node for name in names_read(sub, n) if name not in inner]
    return read


def taken_names(graph: onnx.GraphProto) -> set:
    """Every name a new tensor or node of ``graph`` must avoid: its inputs, initializers, node names and the nodes'
    inputs and outputs (fresh_name's ``taken``)."""
    taken = {v.name for v in list(graph.input) + list(graph.initializer)}
    return taken | {name for n in graph.node for name in [node_name(n), *n.input, *n.output]}


def fresh_name(wanted: str, taken: set) -> str:
    """``wanted``, or ``wanted.1``, ``wanted.2``, ... the first not in ``taken``; added to it."""
    name, suffix = wanted, 0
    while name in taken:
        suffix += 1
        name = f"{wanted}.{suffix}"
    taken.add(name)
    return name


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def ancestor_inputs(graph: onnx.GraphProto, names: Sequence[str]) -> List[str]:
    """The graph inputs that ``names`` are computed from, through any node (its subgraphs' outer reads included),
    in the graph's input order."""
    producers = {out: node for node in graph.node for out in node.output if out}
    inputs = {v.name for v in graph.input}
    seen, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producers:
            stack.extend(names_read(graph, producers[name]))
    return [v.name for v in graph.input if v.name in seen and v.name in inputs]
