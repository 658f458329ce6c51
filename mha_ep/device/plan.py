"""The device plan: a partitioned model cut at its claimed MultiHeadAttention nodes.

``plan_device(partitioned_model)`` turns the partition pass's output into an ordered list of steps:

  * ``PieceStep``: a standalone ONNX model over unclaimed nodes, run by ORT's own provider (an ORT CUDA session
    in device mode), reading and writing tensors by name;
  * ``AttentionStep``: one claimed node, run by our backend on the tensors it names, in the node's own dtype.

Rules of the cut (the code refers to them by number):
  1. The claims are the partition's: every ``mha_ep::MultiHeadAttention`` node of the main graph is one
     AttentionStep. Its float32 transport (spec.TRANSPORT_IN/OUT Casts, placeholders) is undone: the step reads
     and writes the original tensors in their own dtype, and the transport Casts are dropped.
  2. Every other node goes to the earliest piece its inputs allow: level(node) is the largest level of what it
     reads, where a graph input, an initializer or a piece's output counts as that piece's level and an
     attention step's output as its level + 1. So pieces = 1 + the longest chain of attention steps, never one
     piece per node, and nodes that do not depend on an attention step run before it.
  3. The steps run in the order piece 0, the attention steps of level 0, piece 1, ... A piece with no nodes is
     left out.
  4. A piece reads what its nodes (and their control-flow bodies) read from outside it, and writes what a later
     step or the graph's outputs read. Initializers travel with the piece that reads them; an initializer that an
     attention step or the graph's outputs read directly is a ``constant`` the runner uploads once.
  5. Each tensor that crosses a cut must have a known element type (the pieces' inputs and outputs are typed);
     otherwise the plan is refused with the tensor's name.

Nothing here imports onnxruntime or CuPy: the plan is data, checked on the CPU (tests/device/test_device_plan.py runs it
with ORT CPU pieces and the reference backend against stock ORT).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_ep import spec
from mha_ep.claim.shapes import infer_static_infos
from mha_ep.dtypes import elem_type


class DevicePlanError(ValueError):
    """The model cannot be cut into device steps; the message says which tensor or node and why."""


@dataclass(frozen=True)
class PieceStep:
    """Unclaimed nodes that run as one ORT session. ``inputs``/``outputs`` are tensor names of the model."""

    level: int
    model: onnx.ModelProto = field(repr=False)
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    node_count: int

    @property
    def kind(self) -> str:
        return "piece"

    def describe(self) -> str:
        return f"ORT piece {self.level}: {self.node_count} node(s), {len(self.inputs)} in, {len(self.outputs)} out"


@dataclass(frozen=True)
class AttentionStep:
    """One claimed node: the tensors of its input slots (spec.PLUGIN_INPUTS; None = absent) and of its outputs
    (output, present_key, present_value; None = not wanted), its ORT attributes (exact floats) and dtype."""

    level: int
    node_name: str
    inputs: Tuple[Optional[str], ...]
    outputs: Tuple[Optional[str], ...]
    attributes: Dict[str, object] = field(repr=False)
    dtype: str = "float32"

    @property
    def kind(self) -> str:
        return "attention"

    @property
    def wanted(self) -> Tuple[bool, ...]:
        """Which of spec.OUTPUTS the graph uses (the ``outputs`` argument of build_problem)."""
        return tuple(name is not None for name in self.outputs) + (False,) * (len(spec.OUTPUTS) - len(self.outputs))

    def describe(self) -> str:
        return f"attention {self.node_name!r} ({self.dtype})"


@dataclass
class DevicePlan:
    steps: List[object]  # PieceStep | AttentionStep, in run order
    inputs: Tuple[str, ...]  # the graph's inputs (feeds)
    outputs: Tuple[str, ...]  # the graph's outputs
    constants: Dict[str, np.ndarray]  # initializers read by attention steps or graph outputs directly (rule 4)
    dtypes: Dict[str, str]  # element type of every tensor that crosses a cut, graph inputs and outputs

    @property
    def pieces(self) -> List[PieceStep]:
        return [s for s in self.steps if isinstance(s, PieceStep)]

    @property
    def attention_steps(self) -> List[AttentionStep]:
        return [s for s in self.steps if isinstance(s, AttentionStep)]

    @functools.cached_property
    def drops(self) -> List[List[str]]:
        """For each step, the tensors whose last reader it is: the runner lets go of them after that step (graph
        outputs are kept)."""
        last: Dict[str, int] = {}
        for index, step in enumerate(self.steps):
            for name in step.inputs:
                if name is not None:
                    last[name] = index
        drops: List[List[str]] = [[] for _ in self.steps]
        for name, index in last.items():
            if name not in self.outputs and name not in self.constants:
                drops[index].append(name)
        return drops

    def reads_before(self, start: int) -> Tuple[str, ...]:
        """The tensors that ``steps[start:]`` and the graph outputs take from before step ``start`` (feeds,
        constants, earlier steps' outputs), in first-read order: what a call split at ``start`` hands across."""
        produced = set()
        wanted: Dict[str, None] = {}
        for step in self.steps[start:]:
            for name in step.inputs:
                if name is not None and name not in produced:
                    wanted.setdefault(name)
            produced.update(name for name in step.outputs if name is not None)
        for name in self.outputs:
            if name not in produced:
                wanted.setdefault(name)
        return tuple(wanted)

    def describe(self) -> str:
        head = (f"device plan: {len(self.pieces)} ORT piece(s), {len(self.attention_steps)} attention step(s)")
        return "\n".join([head] + [f"  {step.describe()}" for step in self.steps])


# ------------------------------------------------------------------------------------------------- the cut
def plan_device(model: onnx.ModelProto) -> DevicePlan:
    """The device plan of ``model``, a partition pass's output (mha_ep.partition(...).model). Raises
    DevicePlanError when a tensor that crosses a cut has no known element type."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    graph_inputs = [v.name for v in graph.input if v.name and v.name not in initializers]
    feeds = set(graph_inputs)
    producer = {out: node for node in graph.node for out in node.output if out}

    # Rule 1: the attention steps and the transport Casts they make redundant.
    transport = set()  # ids of the transport Cast nodes
    attention_nodes = {}
    for node in graph.node:
        if node.op_type == spec.OP_TYPE and node.domain == spec.PLUGIN_DOMAIN:
            attention_nodes[id(node)] = _attention_fields(node, producer, transport)
    for node in graph.node:
        if node.op_type == "Cast" and any(o.endswith(spec.TRANSPORT_OUT) for o in node.input):
            transport.add(id(node))
    nodes = [n for n in graph.node if id(n) not in transport]

    # Rule 2: levels.
    available: Dict[str, int] = {name: 0 for name in feeds}
    available.update({name: 0 for name in initializers})
    levels: Dict[int, int] = {}
    for node in nodes:
        reads = _reads(node) if id(node) not in attention_nodes else [t for t in attention_nodes[id(node)][0] if t]
        level = max((available.get(name, 0) for name in reads), default=0)
        levels[id(node)] = level
        if id(node) in attention_nodes:
            for name in attention_nodes[id(node)][1]:
                if name:
                    available[name] = level + 1
        else:
            for name in node.output:
                if name:
                    available[name] = level

    # Who reads what, per level (rule 4).
    graph_outputs = tuple(v.name for v in graph.output)
    infos = infer_static_infos(_unpartitioned(model, nodes, attention_nodes))
    consumers_after: Dict[str, int] = {}  # tensor -> the largest level of a step that reads it (attention: level+1)
    for node in nodes:
        if id(node) in attention_nodes:
            reads, step_level = [t for t in attention_nodes[id(node)][0] if t], levels[id(node)] + 0.5
        else:
            reads, step_level = _reads(node), levels[id(node)]
        for name in reads:
            consumers_after[name] = max(consumers_after.get(name, -1), step_level)

    max_level = max(levels.values(), default=0)
    steps: List[object] = []
    constants: Dict[str, np.ndarray] = {}
    dtypes: Dict[str, str] = {}

    def dtype_of(name: str, why: str) -> str:
        info = infos.get(name)
        if info is None or info.dtype is None:
            raise DevicePlanError(
                f"device plan: the element type of tensor {name!r} ({why}) is unknown after shape inference; "
                f"give the model typed value_info for it"
            )
        dtypes[name] = info.dtype
        return info.dtype

    for name in graph_inputs:
        dtype_of(name, "a graph input")
    for level in range(max_level + 1):
        piece_nodes = [n for n in nodes if levels[id(n)] == level and id(n) not in attention_nodes]
        if piece_nodes:  # Rule 3
            steps.append(_piece(level, piece_nodes, model, initializers, feeds, consumers_after, graph_outputs,
                                infos, dtype_of))  # fmt: skip
        for node in nodes:
            if levels[id(node)] == level and id(node) in attention_nodes:
                reads, writes, attributes, dtype, name = attention_nodes[id(node)]
                for tensor in reads:
                    if tensor and tensor in initializers and tensor not in feeds:
                        constants[tensor] = numpy_helper.to_array(initializers[tensor])
                for tensor in writes:
                    if tensor:
                        dtypes[tensor] = dtype
                steps.append(AttentionStep(level, name, reads, writes, attributes, dtype))
    for name in graph_outputs:
        if name in initializers and name not in feeds:
            constants[name] = numpy_helper.to_array(initializers[name])
        if name not in dtypes:
            dtype_of(name, "a graph output")
    return DevicePlan(steps, tuple(graph_inputs), graph_outputs, constants, dtypes)


def _unpartitioned(model: onnx.ModelProto, nodes: list, attention_nodes: dict) -> onnx.ModelProto:
    """``model`` as it was before the partition (claimed nodes back in com.microsoft, no transport): the model
    shape inference knows every op of (it cannot see through the plugin op)."""
    restored = []
    for node in nodes:
        fields = attention_nodes.get(id(node))
        if fields is None:
            restored.append(node)
            continue
        reads, writes, attributes, _, name = fields
        restored.append(helper.make_node(
            spec.OP_TYPE, [t or "" for t in reads], [t or "" for t in writes], name=name, domain=spec.ORT_DOMAIN,
            **attributes,
        ))  # fmt: skip
    graph = helper.make_graph(restored, model.graph.name, list(model.graph.input), list(model.graph.output),
                              initializer=list(model.graph.initializer), value_info=list(model.graph.value_info))
    opsets = [o for o in model.opset_import if o.domain not in (spec.PLUGIN_DOMAIN, spec.UNREGISTERED_DOMAIN)]
    if not any(o.domain == spec.ORT_DOMAIN for o in opsets):
        opsets.append(helper.make_opsetid(spec.ORT_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)


def _attention_fields(node: onnx.NodeProto, producer: dict, transport: set) -> tuple:
    """(input tensors by slot, output tensors, ORT attributes, dtype, node name) of a plugin node, with the
    float32 transport undone (rule 1); the transport-in Casts it reads through are added to ``transport``."""
    attributes = {a.name: _text(helper.get_attribute_value(a)) if a.type == onnx.AttributeProto.STRING
                  else helper.get_attribute_value(a) for a in node.attribute}  # fmt: skip
    supplied, wanted, ort_attributes, dtype = spec.node_config(tuple(sorted(attributes.items())))
    name = attributes.get(spec.ATTR_NODE) or node.name
    reads = []
    for slot, tensor in zip(spec.PLUGIN_INPUTS, list(node.input) + [""] * len(spec.PLUGIN_INPUTS)):
        if slot not in supplied or not tensor:
            reads.append(None)
            continue
        if tensor.endswith(spec.TRANSPORT_IN):
            cast = producer.get(tensor)
            if cast is not None and cast.op_type == "Cast":
                transport.add(id(cast))
                tensor = cast.input[0]
        reads.append(tensor)
    writes = []
    for slot, tensor in zip(spec.PLUGIN_OUTPUTS, list(node.output) + [""] * len(spec.PLUGIN_OUTPUTS)):
        if not wanted[spec.OUT_SLOT[slot]] or not tensor:
            writes.append(None)
            continue
        writes.append(tensor[: -len(spec.TRANSPORT_OUT)] if tensor.endswith(spec.TRANSPORT_OUT) else tensor)
    return tuple(reads), tuple(writes), dict(ort_attributes), dtype, name


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _reads(node: onnx.NodeProto) -> List[str]:
    """Every tensor ``node`` reads: its inputs and what its control-flow bodies read from outer scopes."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            names.extend(_outer_reads(sub))
    return names


def _outer_reads(graph: onnx.GraphProto) -> List[str]:
    """Names a subgraph reads that it does not define itself (its outer-scope references)."""
    defined = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    reads = []
    for node in graph.node:
        for name in _reads(node):
            if name not in defined:
                reads.append(name)
        defined.update(o for o in node.output if o)
    return reads


def _value_info(name: str, infos: dict, dtype: str) -> onnx.ValueInfoProto:
    info = infos.get(name)
    shape = None if info is None or info.shape is None else list(info.shape)  # None dims: unknown extents
    return helper.make_tensor_value_info(name, elem_type(dtype), shape)


def _piece(level, piece_nodes, model, initializers, feeds, consumers_after, graph_outputs, infos, dtype_of):
    """Rule 4: the standalone model of one piece."""
    produced = {out for node in piece_nodes for out in node.output if out}
    reads = []
    for node in piece_nodes:
        reads.extend(_reads(node))
    inputs, used_initializers, seen = [], [], set()
    for name in reads:
        if name in seen or name in produced:
            continue
        seen.add(name)
        if name in initializers and name not in feeds:
            used_initializers.append(initializers[name])
        else:
            inputs.append(name)
    outputs = [
        name for node in piece_nodes for name in node.output
        if name and (consumers_after.get(name, -1) > level or name in graph_outputs)
    ]  # fmt: skip
    graph = helper.make_graph(
        list(piece_nodes),
        f"{model.graph.name or 'graph'}_piece{level}",
        [_value_info(name, infos, dtype_of(name, f"read by piece {level}")) for name in inputs],
        [_value_info(name, infos, dtype_of(name, f"written by piece {level}")) for name in outputs],
        initializer=used_initializers,
    )
    known = set(inputs) | set(outputs)
    graph.value_info.extend(v for v in model.graph.value_info if v.name in produced and v.name not in known)
    piece = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    piece.functions.extend(f for f in model.functions if f.domain != spec.PLUGIN_DOMAIN)
    return PieceStep(level, piece, tuple(inputs), tuple(outputs), len(piece_nodes))
