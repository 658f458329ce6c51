"""The partition pass: claimed MultiHeadAttention nodes move to the plugin domain; declined ones stay for ORT.

Rules of the pass (the code refers to them by number):
  1. Every ``com.microsoft::MultiHeadAttention`` node of the main graph, in graph order, gets one Decision from the
     claim gate (mha_ep/claim), made on the static dtypes and shapes that shape inference finds.
  2. A declined node, and every node that is not MHA, stays byte for byte.
  3. A claimed node becomes ``mha_ep::MultiHeadAttention`` with the same name and attributes (ORT's defaults
     written out, since the bridge requires every declared attribute) and, for float32 nodes, the same tensor
     names (float16/bfloat16 nodes: rule 5), plus the ``mha_ep_*`` attributes of mha_ep/spec.py.
  4. Absent optional inputs are fed from zero-size placeholder initializers; unused outputs get placeholder names.
  5. float16/bfloat16 nodes on the Python-op route (``route="python-op"``, the default): float inputs pass through
     Cast(to=float32) and outputs come back through Cast(to=the node's dtype), exact both ways. One Cast per
     tensor, shared by every claimed node that reads it. On the native route (``route="native"``: mha_ep/native,
     whose kernels take every float type) nodes keep their tensors and their type, and the placeholders of absent
     float inputs have the node's type.
  6. A model-local function named like the plugin op makes an unregistered load fail with an error that says to
     call mha_ep.register.
  7. Nodes already in the plugin domain are left as they are and reported as claimed: partitioning a partitioned
     model changes nothing. They are checked first (``check_plugin_node``): a crafted one could abort the process
     at run time (a string attribute that is not UTF-8 kills the bridge before mha_ep's code runs), so a node
     whose slots or attributes are not what this pass writes raises MhaModelError.
"""

from __future__ import annotations

import sys
import types
import copy
import json
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional, Union

import numpy as np
import onnx
from onnx import helper

from mha_ep import spec
from mha_ep.claim import Decision, decide
from mha_ep.claim.rules import Refusal, attributes_from_mapping
from mha_ep.claim.shapes import infer_static_infos
from mha_ep.errors import MhaModelError
from mha_ep.claim.tensor_info import TensorInfo

log = logging.getLogger("mha_ep")
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
    route: str = "python-op"  # the form of the claimed nodes (the pass's Rule 5)

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
            "route": self.route,
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


# One ModelProto serialises to at most 2 GiB (protobuf's limit; above it ``ByteSize()`` itself raises). Models
# over this size are written with their tensors in an external-data file. Tests lower it to try the path cheaply.
PROTOBUF_LIMIT = 2**31 - 2**24


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes held inline by the model's tensors (initializers and tensor attributes, subgraphs included), read
    field by field: on a model over 2 GiB ``ByteSize()`` raises instead of answering."""

    def of_tensor(t: onnx.TensorProto) -> int:
        return (
            len(t.raw_data)
            + 4 * (len(t.float_data) + len(t.int32_data))
            + 8 * (len(t.int64_data) + len(t.double_data) + len(t.uint64_data))
            + sum(len(x) for x in t.string_data)
        )

    def of_graph(g: onnx.GraphProto) -> int:
        total = sum(of_tensor(t) for t in g.initializer)
        total += sum(of_tensor(t.values) + of_tensor(t.indices) for t in g.sparse_initializer)
        for node in g.node:
            for attr in node.attribute:
                total += (of_tensor(attr.t) if attr.HasField("t") else 0) + sum(of_tensor(t) for t in attr.tensors)
                total += (of_graph(attr.g) if attr.HasField("g") else 0) + sum(of_graph(x) for x in attr.graphs)
        return total

    return of_graph(model.graph) + sum(
        of_tensor(attr.t) for f in model.functions for node in f.node for attr in node.attribute if attr.HasField("t")
    )


def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when ``model`` cannot be serialised as one protobuf (decided without ``ByteSize()`` on big models)."""
    if tensor_bytes(model) > PROTOBUF_LIMIT:
        return True
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except Exception:  # noqa: BLE001 - protobuf's EncodeError above 2 GiB
        return True


def write_model(model: onnx.ModelProto, path: str) -> None:
    """``onnx.save``, with the tensors in ``<name>.data`` beside ``path`` when the model is too big for one protobuf.
    ``model`` is left as it was (onnx.save moves tensors out of the proto it is given; they are read back)."""
    if not needs_external_data(model):
        onnx.save(model, path)
        return
    location = os.path.basename(path) + ".data"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location)
    except BaseException:
        try:
            restore_inline_data(model, folder)
        except Exception as error:  # noqa: BLE001 - the write's own error is the one to raise
            log.warning("mha_ep: after a failed write, tensors of the model object could not be read back: %s", error)
        raise
    restore_inline_data(model, folder)


def restore_inline_data(model: onnx.ModelProto, folder: str) -> None:
    """Undo onnx.save's conversion to external data on ``model``: tensors still holding their bytes are only
    unmarked, the others are read back from the file just written."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

    for tensor in _get_all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if not tensor.HasField("raw_data"):
            load_external_data_for_tensor(tensor, folder)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def _default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _check_target(path: str, what: str) -> None:
    """Refuse to replace anything but a regular file: a rename would put a file in place of a symbolic link, a
    FIFO or a device (as root, ``-o /dev/null`` would destroy /dev/null)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise MhaModelError(f"cannot write {what} to {path!r}: it is a directory; give a file name")
    if stat.S_ISLNK(mode):
        raise MhaModelError(
            f"cannot write {what} to {path!r}: it is a symbolic link, which mha_ep would replace with a file rather "
            f"than write through; give the path it points to ({os.path.realpath(path)!r}) or another name"
        )
    if not stat.S_ISREG(mode):
        raise MhaModelError(
            f"cannot write {what} to {path!r}: it is not a regular file (a FIFO, a socket or a device), which mha_ep "
            "will not replace; give a file name"
        )


def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike]) -> None:
    """Write ``model`` to ``path`` whole or not at all, and only ever in place of a regular file.

    Both files (the model, and ``<path>.data`` for a model over 2 GiB) are written in a temporary folder beside
    ``path`` and renamed into place only once both are complete: the data file first, then the model. A failed
    write leaves the previous model and its data as they were.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    _check_target(path, "the model")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write the model to {path!r}: folder {folder!r} does not exist")
    name = os.path.basename(path)
    data = os.path.join(folder, name + ".data")
    external = needs_external_data(model)
    if external:
        _check_target(data, "the model's external data")
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else _default_file_mode()
    staging = tempfile.mkdtemp(prefix=".mha_ep_", dir=folder)
    try:
        write_model(model, os.path.join(staging, name))
        if external:
            os.chmod(os.path.join(staging, name + ".data"), mode)
            os.replace(os.path.join(staging, name + ".data"), data)
        os.chmod(os.path.join(staging, name), mode)  # mkstemp-like 0600 otherwise; the mode a plain save gives
        os.replace(os.path.join(staging, name), path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_ort_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.ORT_DOMAIN


def is_plugin_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == spec.OP_TYPE and node.domain == spec.PLUGIN_DOMAIN


ROUTES = ("python-op", "native")


def partition(model, lift_attention: bool = False, route: str = "python-op") -> PartitionResult:
    """Partition ``model`` (an onnx.ModelProto or a path); the input model is not modified. ``route``: the form
    of the claimed nodes (Rule 5): "python-op" runs on both routes; "native" only where mha_ep.register took the
    native route, without the float32 Casts of float16 / bfloat16 nodes."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
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
    names = NameSet(graph)
    value_infos: List[onnx.ValueInfoProto] = []
    modified = False
    for index, node in enumerate(graph.node):
        if is_plugin_mha(node):  # Rule 7
            check_plugin_node(node)
            decisions.append(Decision(node_name(node), True))
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
        new_nodes.extend(claim_node(node, index, infos[node.input[0]].dtype, casts_done, used_placeholders,
                                    value_infos, names, transport=route == "python-op"))  # fmt: skip
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
    return PartitionResult(model, decisions, lifted, notes, lift_requested=lift_attention, lift_decisions=lift_decisions,
                           route=route)  # fmt: skip


PLUGIN_ATTRIBUTE_TYPE = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT, "string": onnx.AttributeProto.STRING}


def check_plugin_node(node: onnx.NodeProto) -> None:
    """Rule 7: a node already in the plugin domain must look like one this pass wrote; MhaModelError if not."""
    name = node_name(node)

    def refuse(what: str):
        raise MhaModelError(f"mha_ep node {name!r} cannot be run safely: {what}")

    if name_refusal(node) is not None:
        refuse("its name is not UTF-8 text (the onnxruntime-extensions bridge aborts the process on it)")
    if len(node.input) != len(spec.PLUGIN_INPUTS) or len(node.output) != len(spec.PLUGIN_OUTPUTS):
        refuse(
            f"it has {len(node.input)} inputs and {len(node.output)} outputs, expected {len(spec.PLUGIN_INPUTS)} "
            f"and {len(spec.PLUGIN_OUTPUTS)}"
        )
    declared = {a.name: a for a in spec.PLUGIN_ATTRIBUTES}
    values = {}
    for attr in node.attribute:
        if attr.name not in declared:
            refuse(f"unknown attribute {attr.name!r}")
        expected = PLUGIN_ATTRIBUTE_TYPE[declared[attr.name].kind]
        if attr.type != expected:
            refuse(
                f"attribute {attr.name} has ONNX type {onnx.AttributeProto.AttributeType.Name(attr.type)}, expected "
                f"{onnx.AttributeProto.AttributeType.Name(expected)}"
            )
        if attr.type == onnx.AttributeProto.STRING:
            try:
                values[attr.name] = attr.s.decode("utf-8")
            except UnicodeDecodeError:
                refuse(f"attribute {attr.name} is not UTF-8 text ({attr.s[:40]!r})")
        else:
            values[attr.name] = helper.get_attribute_value(attr)
    missing = [a.name for a in spec.PLUGIN_ATTRIBUTES if a.name not in values]
    if missing:
        refuse(f"attribute(s) {', '.join(missing)} missing")
    try:
        attributes_from_mapping({a.name: values[a.name] for a in spec.ORT_ATTRIBUTES})
    except Refusal as refusal:
        refuse(refusal.reason.removeprefix("mha_ep MultiHeadAttention: "))
    for attr, allowed in ((spec.ATTR_INPUTS, spec.PLUGIN_INPUTS), (spec.ATTR_OUTPUTS, spec.PLUGIN_OUTPUTS)):
        unknown = [item for item in values[attr].split(",") if item and item not in allowed]
        if unknown:
            refuse(f"attribute {attr} names {', '.join(map(repr, unknown))}, not among {', '.join(allowed)}")
    if values[spec.ATTR_DTYPE] not in spec.FLOAT_DTYPES:
        refuse(f"attribute {spec.ATTR_DTYPE} is {values[spec.ATTR_DTYPE]!r}, expected one of {', '.join(spec.FLOAT_DTYPES)}")
    try:
        floats = spec.decode_floats(values[spec.ATTR_FLOATS])
    except ValueError as error:
        refuse(f"attribute {spec.ATTR_FLOATS} is not readable ({error})")
    known_floats = {a.name for a in spec.ORT_ATTRIBUTES if a.kind == "float"}
    if not set(floats) <= known_floats:
        refuse(f"attribute {spec.ATTR_FLOATS} names {', '.join(sorted(set(floats) - known_floats))}")


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
                node_name(node), False,
                f"mha_ep MultiHeadAttention: attribute {attr.name} has ONNX type {got}, expected {expected} "
                f"(ORT's schema rejects it too)",
                attr.name,
            )  # fmt: skip
    return None


def name_refusal(node: onnx.NodeProto) -> Optional[Decision]:
    """A node name that is not UTF-8 text: ORT runs the node, but the onnxruntime-extensions bridge aborts the
    process when it meets the name, so the node stays with ORT."""
    if isinstance(_raw_name(node), bytes):
        return Decision(
            node_name(node), False,
            "mha_ep MultiHeadAttention: the node's name is not UTF-8 text, which the onnxruntime-extensions bridge "
            "cannot pass to Python without aborting the process; it stays with ORT (rename it to claim it)",
            "name",
        )  # fmt: skip
    odd = [t for t in list(node.input) + list(node.output) if isinstance(t, bytes)]
    if odd:
        return Decision(
            node_name(node), False,
            f"mha_ep MultiHeadAttention: tensor name '{odd[0].decode('utf-8', 'backslashreplace')}' is not UTF-8 "
            "text, which the partition pass cannot rename around; the node stays with ORT",
            "name",
        )  # fmt: skip
    return None


def decide_node(node: onnx.NodeProto, infos: dict) -> Decision:
    refusal = name_refusal(node) or attribute_type_refusal(node)
    if refusal is not None:
        return refusal
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [(infos.get(name) or TensorInfo()) if name else None for name in node.input]
    outputs = [bool(name) for name in node.output] + [False] * (len(spec.OUTPUTS) - len(node.output))
    decision = decide(attributes, inputs, outputs, node_name(node))
    if decision.claimed and inputs[0].dtype is None:
        # The rules accept an unknown dtype, but the transport (rule 5) must know it.
        return Decision(
            node_name(node),
            False,
            "mha_ep MultiHeadAttention: the element type of query is unknown after shape inference, so the "
            "float32 transport cannot be chosen; give the model's inputs typed value_info",
            "query",
        )
    return decision


def claim_node(node, index, dtype, casts_done, used_placeholders, value_infos, names,
               transport: bool = True) -> List[onnx.NodeProto]:  # fmt: skip
    """Rules 3-5: the plugin node, preceded by its input Casts and followed by its output Casts (``transport``:
    the Python-op route's float32 Casts of a float16 / bfloat16 node)."""
    before: List[onnx.NodeProto] = []
    after: List[onnx.NodeProto] = []
    reduced = dtype in ONNX_TO_ELEM and transport
    float_type = "float32" if transport or dtype not in ONNX_TO_ELEM else dtype
    supplied = []
    inputs = []
    for slot, name in enumerate(spec.PLUGIN_INPUTS):
        tensor = node.input[slot] if slot < len(node.input) else ""
        if not tensor:
            placeholder = spec.ABSENT_INT32 if name == "key_padding_mask" else spec.absent_float(float_type)
            used_placeholders.add(placeholder)
            inputs.append(placeholder)
            continue
        supplied.append(name)
        if reduced and name in spec.FLOAT_INPUTS:
            cast_name = tensor + spec.TRANSPORT_IN
            if tensor not in casts_done:
                casts_done[tensor] = cast_name = names.new(tensor + spec.TRANSPORT_IN)
                before.append(
                    helper.make_node("Cast", [tensor], [cast_name], to=onnx.TensorProto.FLOAT, name=cast_name)
                )
            tensor = casts_done[tensor]
        inputs.append(tensor)
    wanted = []
    outputs = []
    name_text = node_name(node)
    stem = name_text or f"{spec.OP_TYPE}_{index}"
    for slot, name in enumerate(spec.PLUGIN_OUTPUTS):
        tensor = node.output[slot] if slot < len(node.output) else ""
        if not tensor:
            outputs.append(names.new(f"{stem}{spec.UNUSED_OUTPUT_SUFFIX}/{name}"))
            continue
        wanted.append(name)
        if reduced:
            transport = names.new(tensor + spec.TRANSPORT_OUT)
            after.append(helper.make_node("Cast", [transport], [tensor], to=ONNX_TO_ELEM[dtype], name=transport))
            tensor = transport
        outputs.append(tensor)
    elem = ONNX_TO_ELEM.get(float_type, onnx.TensorProto.FLOAT)
    for tensor in outputs:  # typed, so that ORT's checks of an unregistered load reach Rule 6's message
        value_infos.append(helper.make_tensor_value_info(tensor, elem, None))
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


def node_name(node: onnx.NodeProto) -> str:
    """``node.name`` as text, odd bytes as backslash escapes. Stock ORT runs nodes whose names are not UTF-8;
    protobuf hands such a name over as bytes, or raises (then the bytes are read from the wire format)."""
    raw = _raw_name(node)
    return raw if isinstance(raw, str) else raw.decode("utf-8", "backslashreplace")


def _raw_name(node: onnx.NodeProto):
    """``node.name``: a str, or bytes when they are not UTF-8 (protobuf returns the bytes, or raises)."""
    try:
        return node.name
    except UnicodeDecodeError:
        return _name_bytes(node.SerializeToString())


def _name_bytes(wire: bytes) -> bytes:
    """Field 3 (``name``) of a serialised NodeProto."""
    position = 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            byte = wire[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while position < len(wire):
        key = varint()
        field_number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            varint()
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length = varint()
            if field_number == 3:
                return wire[position : position + length]
            position += length
        else:
            break
    return b""


class NameSet:
    """The names a graph already uses (nodes and tensors); ``new`` returns a name not among them and takes it."""

    def __init__(self, graph: onnx.GraphProto):
        self.taken = {node_name(n) for n in graph.node}
        for node in graph.node:
            self.taken.update(node.input)
            self.taken.update(node.output)
        for values in (graph.input, graph.output, graph.value_info, graph.initializer):
            self.taken.update(v.name for v in values)

    def new(self, wanted: str) -> str:
        name, suffix = wanted, 0
        while name in self.taken:
            suffix += 1
            name = f"{wanted}.{suffix}"
        self.taken.add(name)
        return name


def add_placeholders(graph: onnx.GraphProto, used: set) -> None:
    existing = {init.name for init in graph.initializer}
    types = {spec.ABSENT_INT32: onnx.TensorProto.INT32, spec.absent_float("float32"): onnx.TensorProto.FLOAT,
             **{spec.absent_float(dtype): elem for dtype, elem in ONNX_TO_ELEM.items()}}  # fmt: skip
    for name in sorted(used - existing):
        graph.initializer.append(helper.make_tensor(name, types[name], [0], []))


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
