"""The partition pass: claimed MultiHeadAttention nodes move to the plugin domain; declined ones stay for ORT.

    result = partition(model, lift_attention=False, route="python-op")   # mha_ep.partition: this function

Rules of the pass, each by its name: a heading here, or the function that is the whole rule. The code, the tests
and the docs cite a rule as ``rule NAME``, never by a number (tests/graph/test_rule_names.py holds them to it):
  ONE_DECISION: every ``com.microsoft::MultiHeadAttention`` node, in the main graph and at any depth of subgraphs (rule
    SUBGRAPHS), gets one Decision from the claim gate (claim/graph_rules.py ``decide_node``: the graph rules, then
    claim/rules.py), made on the static dtypes and shapes that shape inference finds, completed by type propagation
    where it stops (claim/shapes.py ``graph_infos``, claim/type_propagation.py).
  UNTOUCHED: a declined node, and every node that is not MHA, stays byte for byte.
  PLUGIN_NODE: a claimed node becomes ``mha_ep::MultiHeadAttention`` with the same name and attributes (ORT's defaults
    written out, since the bridge requires every declared attribute) and, for float32 nodes, the same tensor names
    (float16/bfloat16 nodes: rule TRANSPORT), plus the ``mha_ep_*`` attributes of mha_ep/spec.py. It has all four
    outputs, qk (the pre-softmax scores, docs/SEMANTICS.md §3.8) included.
  PLACEHOLDERS: absent optional inputs are fed from zero-size placeholder initializers of the node's own graph; unused
    outputs get placeholder names.
  TRANSPORT: float16/bfloat16 nodes on the Python-op route (``route="python-op"``, the default): float inputs pass
    through Cast(to=float32) and outputs come back through Cast(to=the node's dtype), exact both ways. One Cast per
    tensor, shared by every claimed node that reads it. On the native route (``route="native"``: mha_ep/native, whose
    kernels take every float type) nodes keep their tensors and their type, and the placeholders of absent float inputs
    have the node's type. A requested qk output whose declared type (ORT's QK constraint, independent of T) is not the
    type the op writes it in gets a Cast to that type.
  add_plugin_domain: a model-local function named like the plugin op makes an unregistered load fail with an error that
    says to call mha_ep.register. It and the opset imports are the model's: written once, whatever the nodes' depth.
  ALREADY_CLAIMED: nodes already in the plugin domain are left as they are and reported as claimed: partitioning a
    partitioned model changes nothing. They are checked first (claim/graph_rules.py ``check_plugin_node``): a crafted
    one could abort the process at run time (a string attribute that is not UTF-8 kills the bridge before mha_ep's code
    runs), so a node whose slots or attributes are not what this pass writes raises MhaModelError. A node written before
    the op had its ten inputs (spec.LEGACY_PLUGIN_INPUTS: eight) gets the two new placeholder slots, and one written
    before the qk output (spec.LEGACY_PLUGIN_OUTPUTS: three outputs) an unused fourth.
  SUBGRAPHS: every graph attribute of every node (If / Loop / Scan bodies, and the ``encoder``, ``decoder``,
    ``init_decoder`` of com.microsoft's BeamSearch, WhisperBeamSearch, GreedySearch and Sampling; ORT 1.31.1's CPU
    provider runs GreedySearch and BeamSearch with the plugin op inside on both routes, measured in
    tests/graph/test_subgraphs.py) goes through the other rules after its own graph is rewritten, with a pass of its
    own: its own Casts and placeholders, names new to it and to every enclosing scope (a placeholder name an enclosing
    scope already defines is renamed: generation ops run their subgraphs apart, so each graph carries its own). Its
    types are its declarations, its twin in the inferred model where shape inference descended, and the enclosing
    scopes' (a subgraph may read their names), then type propagation. Decisions come in that order (a graph's own, then
    its subgraphs'), each with the path of its graph (``BeamSearch_0/decoder``; an unnamed owner is ``<op>_<index>``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import onnx
from onnx import helper

from mha_ep import spec
from mha_ep.claim import Decision
from mha_ep.claim.graph_rules import check_plugin_node, decide_node
from mha_ep.claim.names import node_name
from mha_ep.claim.shapes import graph_infos, inferred_model
from mha_ep.dtypes import elem_type
from mha_ep.errors import require_onnxruntime
from mha_ep.graph.model_io import load_model
from mha_ep.graph.partition_result import PartitionResult

log = logging.getLogger("mha_ep")

MHA_OPSET_MIN_IR = 8  # model-local functions need IR version 8

ONNX_TO_ELEM = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


def qk_dtype_of(node: onnx.NodeProto, infos: dict):
    """The declared element type of the node's qk output (rule TRANSPORT), or None when it has none or it is
    unknown."""
    qk = spec.OUT_SLOT["qk"]
    if len(node.output) <= qk or not node.output[qk]:
        return None
    info = infos.get(node.output[qk])
    return info.dtype if info is not None and info.dtype in spec.FLOAT_DTYPES else None

def is_ort_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.ORT_DOMAIN

def is_plugin_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.PLUGIN_DOMAIN

ROUTES = ("python-op", "native")


def partition(model, lift_attention: bool = False, route: str = "python-op") -> PartitionResult:
    """Partition ``model`` (an onnx.ModelProto or a path); the input model is not modified. ``route``: the form
    of the claimed nodes (rule TRANSPORT): "python-op" runs on both routes; "native" only where mha_ep.register took the
    native route, without the float32 Casts of float16 / bfloat16 nodes."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    require_onnxruntime()  # without ORT's symbolic shape inference every decision would rest on missing shapes
    model = load_model(model)
    notes: List[str] = []
    lifted = 0
    lift_decisions: list = []
    if lift_attention:
        from mha_ep.graph.lift import lift_attention as lift
        from mha_ep.graph.lift import plan_lift

        lift_decisions = plan_lift(model)
        model, lifted = lift(model, in_place=True)  # model is this call's private copy (load_model)
    inferred = inferred_model(model)
    decisions, modified = partition_graph(model.graph, inferred.graph, route)
    if modified:
        add_plugin_domain(model)  # once per model, whatever the depth of the claimed nodes
    graph = model.graph
    if any(n.op_type == "Attention" and n.domain == spec.ORT_DOMAIN for n in graph.node):
        count = sum(n.op_type == "Attention" and n.domain == spec.ORT_DOMAIN for n in graph.node)
        notes.append(
            f"{count} com.microsoft::Attention node(s) stay with ORT"
            + ("" if lift_attention else "; partition(..., lift_attention=True) rewrites them into MatMuls + MHA")
        )
    return PartitionResult(model, decisions, lifted, notes, lift_requested=lift_attention, lift_decisions=lift_decisions,
                           route=route)  # fmt: skip


def partition_graph(
    graph: onnx.GraphProto, inferred: Optional[onnx.GraphProto], route: str, outer=None, outer_names=frozenset(),
    path: str = "",
) -> Tuple[List[Decision], bool]:
    """The rules over ``graph``'s own nodes (all but rule ``add_plugin_domain``, the model's, which ``partition``
    applies), then rule SUBGRAPHS over its subgraphs; ``graph`` is rewritten in place. ``inferred``: its twin in the
    shape-inferred model (None where inference did not descend); ``outer`` and ``outer_names``: the enclosing scopes'
    infos and names; ``path``: where ``graph`` sits, for the report. Returns the decisions and whether anything
    changed."""
    infos = graph_infos(graph, inferred, outer)
    decisions: List[Decision] = []
    new_nodes: List[onnx.NodeProto] = []
    work = PartitionPass(graph, route, outer_names)
    modified = False
    owners = []  # the path label of each node with a subgraph, by its index before Casts shift the indices
    for index, node in enumerate(graph.node):
        if has_subgraph(node):
            owners.append(node_name(node) or f"{node.op_type}_{index}")
        if is_plugin_mha(node):  # rule ALREADY_CLAIMED
            if len(node.input) == len(spec.LEGACY_PLUGIN_INPUTS) or len(node.output) == len(spec.LEGACY_PLUGIN_OUTPUTS):
                node = work.upgrade(node, index)
                modified = True
            check_plugin_node(node)
            decisions.append(Decision(node_name(node), True, path=path))
            new_nodes.append(node)
            continue
        if not is_ort_mha(node):  # rule UNTOUCHED
            new_nodes.append(node)
            continue
        decision = replace(decide_node(node, infos), path=path)  # rule ONE_DECISION
        decisions.append(decision)
        if not decision.claimed:
            new_nodes.append(node)
            continue
        new_nodes.extend(work.claim(node, index, infos[node.input[0]].dtype, qk_dtype_of(node, infos)))
        modified = True
    if modified:
        work.finish(graph, new_nodes)
    # rule SUBGRAPHS: each subgraph after its graph is final, so it sees every name this scope now uses
    visible = set(outer_names) | set(graph_names(graph, nested=False))
    twins = subgraph_twins(inferred)
    for owner, node in zip(owners, [n for n in graph.node if has_subgraph(n)]):  # rule UNTOUCHED kept them, in order
        for attr in node.attribute:
            many = attr.type == onnx.AttributeProto.GRAPHS
            for position, sub in enumerate(attr.graphs if many else [attr.g] if attr.HasField("g") else []):
                where = f"{path}{'/' if path else ''}{owner}/{attr.name}"
                twin = twins.get((first_output(node), attr.name, position))
                found, changed = partition_graph(sub, twin, route, infos, visible,
                                                 f"{where}[{position}]" if many else where)  # fmt: skip
                decisions.extend(found)
                modified |= changed
    return decisions, modified


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.HasField("g") or len(attr.graphs) for attr in node.attribute)


def first_output(node: onnx.NodeProto) -> str:
    """A node's first named output: what identifies it across the original and the shape-inferred graph (symbolic
    inference may reorder nodes, and names may be empty)."""
    return next((output for output in node.output if output), "")


def subgraph_twins(graph: Optional[onnx.GraphProto]) -> Dict[Tuple[str, str, int], onnx.GraphProto]:
    """The subgraphs of ``graph``'s nodes by (the node's first output, attribute name, position in the list)."""
    twins: Dict[Tuple[str, str, int], onnx.GraphProto] = {}
    for node in graph.node if graph is not None else ():
        for attr in node.attribute:
            many = attr.type == onnx.AttributeProto.GRAPHS
            for position, sub in enumerate(attr.graphs if many else [attr.g] if attr.HasField("g") else []):
                twins[(first_output(node), attr.name, position)] = sub
    return twins


def graph_names(graph: onnx.GraphProto, nested: bool = True):
    """Every name ``graph`` uses (nodes, tensors), its subgraphs' included unless ``nested`` is False."""
    yield from (node_name(n) for n in graph.node)
    for values in (graph.input, graph.output, graph.value_info, graph.initializer):
        yield from (v.name for v in values)
    for node in graph.node:
        yield from node.input
        yield from node.output
        for attr in node.attribute if nested else ():
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from graph_names(sub)


class PartitionPass:
    """One run of rules PLUGIN_NODE, PLACEHOLDERS and TRANSPORT over a graph, and of rule ALREADY_CLAIMED's upgrade:
    the state its claimed nodes share, kept on the instance (the float32 Casts made so far, the placeholders used, the
    outputs' value infos, the names taken)."""

    def __init__(self, graph: onnx.GraphProto, route: str, outer_names=frozenset()):
        self.transport = route == "python-op"  # rule TRANSPORT's float32 Casts
        self.casts: dict = {}  # tensor -> the output of its Cast to float32, shared by every node that reads it
        self.placeholders: set = set()  # rule PLACEHOLDERS' initializers used
        self.value_infos: List[onnx.ValueInfoProto] = []
        self.outer_names = outer_names  # the enclosing scopes' names (a subgraph's pass): never defined again here
        self.names = NameSet(graph, outer_names)

    def claim(self, node: onnx.NodeProto, index: int, dtype: str, qk_dtype: str = None) -> List[onnx.NodeProto]:
        """Rules PLUGIN_NODE, PLACEHOLDERS and TRANSPORT: the plugin node, preceded by its input Casts and followed
        by its output Casts. ``qk_dtype``: the declared element type of a requested qk output (None: the node's
        dtype)."""
        before: List[onnx.NodeProto] = []
        after: List[onnx.NodeProto] = []
        reduced = dtype in ONNX_TO_ELEM and self.transport
        float_type = "float32" if self.transport or dtype not in ONNX_TO_ELEM else dtype
        supplied = []
        inputs = []
        for slot, name in enumerate(spec.PLUGIN_INPUTS):
            tensor = node.input[slot] if slot < len(node.input) else ""
            if not tensor:
                integer = name == "key_padding_mask" or name in spec.INT32_INPUTS
                placeholder = spec.ABSENT_INT32 if integer else spec.absent_float(float_type)
                self.placeholders.add(placeholder)
                inputs.append(placeholder)
                continue
            supplied.append(name)
            if reduced and name in spec.FLOAT_INPUTS:
                cast_name = tensor + spec.TRANSPORT_IN
                if tensor not in self.casts:
                    self.casts[tensor] = cast_name = self.names.new(tensor + spec.TRANSPORT_IN)
                    before.append(
                        helper.make_node("Cast", [tensor], [cast_name], to=onnx.TensorProto.FLOAT, name=cast_name)
                    )
                tensor = self.casts[tensor]
            inputs.append(tensor)
        wanted = []
        outputs = []
        name_text = node_name(node)
        stem = name_text or f"{spec.OP_TYPE}_{index}"
        for slot, name in enumerate(spec.PLUGIN_OUTPUTS):
            tensor = node.output[slot] if slot < len(node.output) else ""
            if not tensor:
                outputs.append(self.names.new(f"{stem}{spec.UNUSED_OUTPUT_SUFFIX}/{name}"))
                continue
            wanted.append(name)
            # the op writes every output in float_type; the graph wants the node's dtype, or for qk its own QK type
            target = (qk_dtype or dtype) if name == "qk" else dtype
            if target != float_type:
                cast_input = self.names.new(tensor + spec.TRANSPORT_OUT)
                after.append(helper.make_node("Cast", [cast_input], [tensor], to=elem_type(target), name=cast_input))
                tensor = cast_input
            outputs.append(tensor)
        elem = ONNX_TO_ELEM.get(float_type, onnx.TensorProto.FLOAT)
        for tensor in outputs:  # typed: ORT's checks of an unregistered load reach rule ``add_plugin_domain``'s message
            self.value_infos.append(helper.make_tensor_value_info(tensor, elem, None))
        plugin = onnx.NodeProto()
        plugin.CopyFrom(node)  # the name as its bytes, even when they are not UTF-8 (reading node.name would raise)
        del plugin.input[:], plugin.output[:]
        plugin.input.extend(inputs)
        plugin.output.extend(outputs)
        plugin.domain = spec.PLUGIN_DOMAIN
        present = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        for attr in spec.ORT_ATTRIBUTES:
            if attr.name not in present:
                plugin.attribute.append(helper.make_attribute(attr.name, attr.default))
        floats = {a.name: present.get(a.name, a.default) for a in spec.ORT_ATTRIBUTES if a.kind == "float"}
        plugin.attribute.extend(
            [
                helper.make_attribute(spec.ATTR_INPUTS, ",".join(supplied)),
                helper.make_attribute(spec.ATTR_OUTPUTS, ",".join(wanted)),
                helper.make_attribute(spec.ATTR_DTYPE, dtype),
                helper.make_attribute(spec.ATTR_NODE, name_text),
                helper.make_attribute(spec.ATTR_FLOATS, spec.encode_floats(floats)),
            ]
        )
        return before + [plugin] + after

    def upgrade(self, node: onnx.NodeProto, index: int) -> onnx.NodeProto:
        """Rule ALREADY_CLAIMED: a plugin node of eight inputs gets the two int32 placeholder slots, one of three
        outputs an unused qk output."""
        upgraded = onnx.NodeProto()
        upgraded.CopyFrom(node)
        if len(upgraded.input) == len(spec.LEGACY_PLUGIN_INPUTS):
            missing = len(spec.PLUGIN_INPUTS) - len(spec.LEGACY_PLUGIN_INPUTS)
            upgraded.input.extend([spec.ABSENT_INT32] * missing)
            self.placeholders.add(spec.ABSENT_INT32)
        if len(upgraded.output) == len(spec.LEGACY_PLUGIN_OUTPUTS):
            stem = node_name(node) or f"{spec.OP_TYPE}_{index}"
            upgraded.output.append(self.names.new(f"{stem}{spec.UNUSED_OUTPUT_SUFFIX}/qk"))
        return upgraded

    def finish(self, graph: onnx.GraphProto, new_nodes: list) -> None:
        """The graph's new node list, its own placeholders (rule PLACEHOLDERS; renamed where an enclosing scope has
        the name, rule SUBGRAPHS) and the typed outputs. The plugin domain is the model's: rule
        ``add_plugin_domain``."""
        rename = {name: self.names.new(name) for name in sorted(self.placeholders) if name in self.outer_names}
        for node in new_nodes:
            for slot, tensor in enumerate(node.input):
                if tensor in rename:
                    node.input[slot] = rename[tensor]
        del graph.node[:]
        graph.node.extend(new_nodes)
        existing = {init.name for init in graph.initializer}
        types = {spec.ABSENT_INT32: onnx.TensorProto.INT32, spec.absent_float("float32"): onnx.TensorProto.FLOAT,
                 **{spec.absent_float(dtype): elem for dtype, elem in ONNX_TO_ELEM.items()}}  # fmt: skip
        for name in sorted(self.placeholders):
            if rename.get(name, name) not in existing:
                graph.initializer.append(helper.make_tensor(rename.get(name, name), types[name], [0], []))
        known = {v.name for v in graph.value_info} | {v.name for v in graph.output}
        graph.value_info.extend(v for v in self.value_infos if v.name not in known)


class NameSet:
    """The names a graph already uses (nodes and tensors, its subgraphs' and its enclosing scopes' included);
    ``new`` returns a name not among them and takes it."""

    def __init__(self, graph: onnx.GraphProto, outer_names=frozenset()):
        # the enclosing scopes' names and the subgraphs' too: a name defined twice on one scope chain is an error
        self.taken = set(outer_names) | set(graph_names(graph))

    def new(self, wanted: str) -> str:
        name, suffix = wanted, 0
        while name in self.taken:
            suffix += 1
            name = f"{wanted}.{suffix}"
        self.taken.add(name)
        return name

def add_plugin_domain(model: onnx.ModelProto) -> None:
    """Rule ``add_plugin_domain``: the plugin and fallback-function opset imports, and the model-local function that
    makes an unregistered load fail with an error that says to call mha_ep.register."""
    domains = {o.domain for o in model.opset_import}
    for domain in (spec.PLUGIN_DOMAIN, spec.UNREGISTERED_DOMAIN):
        if domain not in domains:
            model.opset_import.append(helper.make_opsetid(domain, spec.PLUGIN_OPSET))
    current = unregistered_function()
    for index, function in enumerate(model.functions):
        if function.domain == spec.PLUGIN_DOMAIN and function.name == spec.OP_TYPE:
            # rule ALREADY_CLAIMED: the function of a model partitioned before the op's current slots is replaced
            if list(function.input) != list(current.input) or list(function.output) != list(current.output):
                model.functions[index].CopyFrom(current)
            break
    else:
        model.functions.append(current)
    if model.ir_version < MHA_OPSET_MIN_IR:
        model.ir_version = MHA_OPSET_MIN_IR

def unregistered_function() -> onnx.FunctionProto:
    return helper.make_function(
        spec.PLUGIN_DOMAIN,
        spec.OP_TYPE,
        list(spec.PLUGIN_INPUTS),
        list(spec.PLUGIN_OUTPUTS),
        [
            helper.make_node(
                spec.UNREGISTERED_OP, list(spec.PLUGIN_INPUTS), list(spec.PLUGIN_OUTPUTS), domain=spec.UNREGISTERED_DOMAIN
            )
        ],
        opset_imports=[helper.make_opsetid(spec.UNREGISTERED_DOMAIN, spec.PLUGIN_OPSET)],
        attributes=[a.name for a in spec.PLUGIN_ATTRIBUTES],
        doc_string="mha_ep::MultiHeadAttention runs only where mha_ep.register(session_options) was called.",
    )
