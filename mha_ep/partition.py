"""The partition pass: claimed MultiHeadAttention nodes move to the plugin domain; declined ones stay for ORT.

Rules of the pass (the code refers to them by number):
  1. Every ``com.microsoft::MultiHeadAttention`` node of the main graph, in graph order, gets one Decision from the
     claim gate (mha_ep/claim), made on the static dtypes and shapes that shape inference finds.
  2. A declined node, and every node that is not MHA, stays byte for byte.
  3. A claimed node becomes ``mha_ep::MultiHeadAttention`` with the same name and attributes (ORT's defaults
     written out, since the bridge requires every declared attribute) and, for float32 nodes, the same tensor
     names (float16/bfloat16 nodes: rule 5), plus the ``mha_ep_*`` attributes of mha_ep/spec.py.
  4. Absent optional inputs are fed from zero-size placeholder initializers; unused outputs get placeholder names.
  5. float16/bfloat16 nodes: float inputs pass through Cast(to=float32) and outputs come back through Cast(to=the
     node's dtype), exact both ways. One Cast per tensor, shared by every claimed node that reads it.
  6. A model-local function named like the plugin op makes an unregistered load fail with an error that says to
     call mha_ep.register.
  7. Nodes already in the plugin domain are left as they are and reported as claimed: partitioning a partitioned
     model changes nothing.
"""

from __future__ import annotations

import sys
import types
import copy
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional, Union

import numpy as np
import onnx
from onnx import helper

from mha_ep import spec
from mha_ep.claim import Decision, decide
from mha_ep.claim.shapes import infer_static_infos
from mha_ep.claim.tensor_info import TensorInfo

MHA_OPSET_MIN_IR = 8  # model-local functions need IR version 8
ONNX_TO_ELEM = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


def how_to_get_mha(lift_requested: bool) -> str:
    """The note of a report with no MultiHeadAttention node: where such nodes come from."""
    lift = (
        "the onnxscript ORT fusions (onnxscript.rewriter.ort_fusions) make com.microsoft::Attention, which "
        + ("--lift-attention rewrites where it can (see the reasons above)" if lift_requested
           else "--lift-attention (partition(..., lift_attention=True)) rewrites into MultiHeadAttention")
    )  # fmt: skip
    return (
        "the model has no com.microsoft::MultiHeadAttention node, so there is nothing to claim. To get them: ORT's "
        "transformer optimizer (python -m onnxruntime.transformers.optimizer --input IN --output OUT --model_type "
        f"bert --num_heads N --hidden_size H --use_multi_head_attention), or {lift}"
    )


@dataclass
class PartitionResult:
    """What ``partition`` did: the new model, one Decision per MultiHeadAttention node in graph order, and,
    when ``lift_attention`` was asked for, one LiftDecision per com.microsoft::Attention node."""

    model: onnx.ModelProto
    decisions: List[Decision]
    lifted_attention: int = 0
    notes: List[str] = field(default_factory=list)
    lift_requested: bool = False
    lift_decisions: list = field(default_factory=list)  # mha_ep.lift.LiftDecision, graph order

    @property
    def claimed(self) -> int:
        return sum(d.claimed for d in self.decisions)

    @property
    def declined(self) -> int:
        return len(self.decisions) - self.claimed

    @property
    def not_lifted(self) -> list:
        return [d for d in self.lift_decisions if not d.lifted]

    def report(self) -> str:
        """The decisions as text: one line per MHA node (claimed, or declined with its reason), one per
        Attention node that was not lifted (with its reason), then notes."""
        lines = [
            f"mha_ep partition: {len(self.decisions)} MultiHeadAttention node(s), {self.claimed} claimed, "
            f"{self.declined} declined"
        ]
        if self.lift_requested:
            lines.append(f"  {self.lifted_attention} com.microsoft::Attention node(s) lifted into MultiHeadAttention, "
                         f"{len(self.not_lifted)} not lifted")  # fmt: skip
        width = max((len(d.node_name or "<unnamed>") + 1 for d in self.decisions), default=0)
        for d in self.decisions:  # reasons start in one column however long the node names are
            name = d.node_name or "<unnamed>"
            lines.append(f"  claimed   {name}" if d.claimed else f"  declined  {(name + ':').ljust(width)} {d.reason}")
        for d in self.not_lifted:
            lines.append(f"  not lifted  {d.node_name}: {d.reason}")
        if not self.decisions:
            lines.append(f"  note: {how_to_get_mha(self.lift_requested)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "mha_nodes": len(self.decisions),
            "claimed": self.claimed,
            "declined": self.declined,
            "lift_attention": self.lift_requested,
            "lifted_attention": self.lifted_attention,
            "decisions": [d.to_dict() for d in self.decisions],
            "not_lifted": [{"node": d.node_name, "reason": d.reason} for d in self.not_lifted],
            "notes": self.notes + ([how_to_get_mha(self.lift_requested)] if not self.decisions else []),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the partitioned model to ``path``, whole or not at all (see ``save_model``)."""
        save_model(self.model, path)


def load_model(model: Union[onnx.ModelProto, bytes, str, os.PathLike]) -> onnx.ModelProto:
    """A private copy of ``model`` (a ModelProto, serialized bytes or a path); a clear ValueError (or
    FileNotFoundError) when it is not a readable ONNX model: an empty or truncated file, or not protobuf at all."""
    if isinstance(model, onnx.ModelProto):
        return copy.deepcopy(model)
    if isinstance(model, (bytes, bytearray, memoryview)):
        where, data = "the model bytes", bytes(model)
    else:
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no ONNX model at {path!r}")
        where = repr(path)
        with open(path, "rb") as handle:
            data = handle.read()
    if not data:
        raise ValueError(f"{where} is not a readable ONNX model: it is empty (0 bytes)")
    try:
        loaded = onnx.load_from_string(data)
    except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ValueError(f"{where} is not a readable ONNX model: {type(error).__name__}: {error}") from None
    if not loaded.HasField("graph") or not loaded.ir_version:
        raise ValueError(f"{where} is not a readable ONNX model: it has no graph or no IR version (truncated?)")
    if not isinstance(model, (bytes, bytearray, memoryview)) and any(
        t.data_location == onnx.TensorProto.EXTERNAL for t in loaded.graph.initializer
    ):
        onnx.load_external_data_for_model(loaded, os.path.dirname(os.path.abspath(path)))
    return loaded


def _default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike]) -> None:
    """Write ``model`` to ``path`` whole or not at all (a temporary file beside it, then a rename)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"cannot write the model to {path!r}: it is a directory; give a file name")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write the model to {path!r}: folder {folder!r} does not exist")
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else _default_file_mode()
    handle, temporary = tempfile.mkstemp(prefix=".mha_ep_", suffix=".onnx", dir=folder)
    os.close(handle)
    try:
        if model.ByteSize() > 2**31 - 2**24:
            location = os.path.basename(path) + ".data"
            if os.path.exists(os.path.join(folder, location)):  # onnx.save appends to an existing data file
                os.unlink(os.path.join(folder, location))
            onnx.save(model, temporary, save_as_external_data=True, location=location)
        else:
            onnx.save(model, temporary)
        os.chmod(temporary, mode)  # mkstemp makes 0600; the file gets the mode a plain save would give it
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def is_ort_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.ORT_DOMAIN


def is_plugin_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.PLUGIN_DOMAIN


def partition(model, lift_attention: bool = False) -> PartitionResult:
    """Partition ``model`` (an onnx.ModelProto or a path); the input model is not modified."""
    from mha_ep.environment import require_onnxruntime

    require_onnxruntime()  # without ORT's symbolic shape inference every decision would rest on missing shapes
    model = load_model(model)
    notes: List[str] = []
    lifted = 0
    lift_decisions: list = []
    if lift_attention:
        from mha_ep.lift import lift_attention as lift
        from mha_ep.lift import plan_lift

        lift_decisions = plan_lift(model)
        model, lifted = lift(model, in_place=True)  # model is this call's private copy (load_model)
    infos = infer_static_infos(model)
    graph = model.graph
    decisions: List[Decision] = []
    new_nodes: List[onnx.NodeProto] = []
    casts_done: dict = {}
    used_placeholders: set = set()
    value_infos: List[onnx.ValueInfoProto] = []
    modified = False
    for index, node in enumerate(graph.node):
        if is_plugin_mha(node):  # Rule 7
            decisions.append(Decision(node.name, True))
            new_nodes.append(node)
            continue
        if not is_ort_mha(node):  # Rule 2
            new_nodes.append(node)
            continue
        decision = decide_node(node, infos)  # Rule 1
        decisions.append(decision)
        if not decision.claimed:
            new_nodes.append(node)
            continue
        new_nodes.extend(
            claim_node(node, index, infos[node.input[0]].dtype, casts_done, used_placeholders, value_infos)
        )
        modified = True
    if modified:
        del graph.node[:]
        graph.node.extend(new_nodes)
        add_placeholders(graph, used_placeholders)
        known = {v.name for v in graph.value_info} | {v.name for v in graph.output}
        graph.value_info.extend(v for v in value_infos if v.name not in known)
        add_plugin_domain(model)
    nested = sum(is_ort_mha(n) for n in nested_nodes(graph))
    if nested:
        notes.append(
            f"{nested} MultiHeadAttention node(s) inside control-flow subgraphs (If/Loop/Scan) are left to ORT: "
            "the pass partitions the main graph only"
        )
    if any(n.op_type == "Attention" and n.domain == spec.ORT_DOMAIN for n in graph.node):
        count = sum(n.op_type == "Attention" and n.domain == spec.ORT_DOMAIN for n in graph.node)
        notes.append(
            f"{count} com.microsoft::Attention node(s) stay with ORT"
            + ("" if lift_attention else "; partition(..., lift_attention=True) rewrites them into MatMuls + MHA")
        )
    return PartitionResult(model, decisions, lifted, notes, lift_requested=lift_attention, lift_decisions=lift_decisions)


def nested_nodes(graph: onnx.GraphProto):
    """Every node inside the subgraphs of ``graph``'s nodes, recursively (not the main graph's own nodes)."""
    for node in graph.node:
        for attr in node.attribute:
            subgraphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            for sub in subgraphs:
                yield from sub.node
                yield from nested_nodes(sub)


ONNX_ATTRIBUTE_TYPE = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT}


def attribute_type_refusal(node: onnx.NodeProto) -> Optional[Decision]:
    """ORT's attributes must have their schema's ONNX type (the plugin's bridge reads them by that type)."""
    kinds = {a.name: a.kind for a in spec.ORT_ATTRIBUTES}
    for attr in node.attribute:
        if attr.name in kinds and attr.type != ONNX_ATTRIBUTE_TYPE[kinds[attr.name]]:
            expected = onnx.AttributeProto.AttributeType.Name(ONNX_ATTRIBUTE_TYPE[kinds[attr.name]])
            got = onnx.AttributeProto.AttributeType.Name(attr.type)
            return Decision(
                node.name, False,
                f"mha_ep MultiHeadAttention: attribute {attr.name} has ONNX type {got}, expected {expected} "
                f"(ORT's schema rejects it too)",
                attr.name,
            )  # fmt: skip
    return None


def decide_node(node: onnx.NodeProto, infos: dict) -> Decision:
    refusal = attribute_type_refusal(node)
    if refusal is not None:
        return refusal
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [(infos.get(name) or TensorInfo()) if name else None for name in node.input]
    outputs = [bool(name) for name in node.output] + [False] * (len(spec.OUTPUTS) - len(node.output))
    decision = decide(attributes, inputs, outputs, node.name)
    if decision.claimed and inputs[0].dtype is None:
        # The rules accept an unknown dtype, but the transport (rule 5) must know it.
        return Decision(
            node.name,
            False,
            "mha_ep MultiHeadAttention: the element type of query is unknown after shape inference, so the "
            "float32 transport cannot be chosen; give the model's inputs typed value_info",
            "query",
        )
    return decision


def claim_node(node, index, dtype, casts_done, used_placeholders, value_infos) -> List[onnx.NodeProto]:
    """Rules 3-5: the plugin node, preceded by its input Casts and followed by its output Casts."""
    before: List[onnx.NodeProto] = []
    after: List[onnx.NodeProto] = []
    reduced = dtype in ONNX_TO_ELEM
    supplied = []
    inputs = []
    for slot, name in enumerate(spec.PLUGIN_INPUTS):
        tensor = node.input[slot] if slot < len(node.input) else ""
        if not tensor:
            placeholder = spec.ABSENT_INT32 if name == "key_padding_mask" else spec.ABSENT_FLOAT
            used_placeholders.add(placeholder)
            inputs.append(placeholder)
            continue
        supplied.append(name)
        if reduced and name in spec.FLOAT_INPUTS:
            cast_name = tensor + spec.TRANSPORT_IN
            if cast_name not in casts_done:
                casts_done[cast_name] = True
                before.append(
                    helper.make_node("Cast", [tensor], [cast_name], to=onnx.TensorProto.FLOAT, name=cast_name)
                )
            tensor = cast_name
        inputs.append(tensor)
    wanted = []
    outputs = []
    stem = node.name or f"{spec.OP_TYPE}_{index}"
    for slot, name in enumerate(spec.PLUGIN_OUTPUTS):
        tensor = node.output[slot] if slot < len(node.output) else ""
        if not tensor:
            outputs.append(f"{stem}{spec.UNUSED_OUTPUT_SUFFIX}/{name}")
            continue
        wanted.append(name)
        if reduced:
            transport = tensor + spec.TRANSPORT_OUT
            after.append(helper.make_node("Cast", [transport], [tensor], to=ONNX_TO_ELEM[dtype], name=transport))
            tensor = transport
        outputs.append(tensor)
    for tensor in outputs:  # typed, so that ORT's checks of an unregistered load reach Rule 6's message
        value_infos.append(helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    plugin = helper.make_node(spec.OP_TYPE, inputs, outputs, name=node.name, domain=spec.PLUGIN_DOMAIN)
    present = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    plugin.attribute.extend(copy.deepcopy(a) for a in node.attribute)
    for attr in spec.ORT_ATTRIBUTES:
        if attr.name not in present:
            plugin.attribute.append(helper.make_attribute(attr.name, attr.default))
    floats = {a.name: present.get(a.name, a.default) for a in spec.ORT_ATTRIBUTES if a.kind == "float"}
    plugin.attribute.extend(
        [
            helper.make_attribute(spec.ATTR_INPUTS, ",".join(supplied)),
            helper.make_attribute(spec.ATTR_OUTPUTS, ",".join(wanted)),
            helper.make_attribute(spec.ATTR_DTYPE, dtype),
            helper.make_attribute(spec.ATTR_NODE, node.name),
            helper.make_attribute(spec.ATTR_FLOATS, spec.encode_floats(floats)),
        ]
    )
    if node.doc_string:
        plugin.doc_string = node.doc_string
    return before + [plugin] + after


def add_placeholders(graph: onnx.GraphProto, used: set) -> None:
    existing = {init.name for init in graph.initializer}
    for name in sorted(used - existing):
        dtype = np.int32 if name == spec.ABSENT_INT32 else np.float32
        graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((0,), dtype), name))


def add_plugin_domain(model: onnx.ModelProto) -> None:
    """The plugin and fallback-function opset imports, and Rule 6's model-local function."""
    domains = {o.domain for o in model.opset_import}
    for domain in (spec.PLUGIN_DOMAIN, spec.UNREGISTERED_DOMAIN):
        if domain not in domains:
            model.opset_import.append(helper.make_opsetid(domain, spec.PLUGIN_OPSET))
    if not any(f.domain == spec.PLUGIN_DOMAIN and f.name == spec.OP_TYPE for f in model.functions):
        model.functions.append(unregistered_function())
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


class _CallableModule(types.ModuleType):
    """``mha_ep.partition`` is this module (``import mha_ep.partition`` names it); calling it calls ``partition()``."""

    def __call__(self, *args, **kwargs):
        return partition(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
