"""The claim gate's rules about a node in its graph, before any rule about its inputs (claim/rules.py ``RULES``):

    GRAPH_RULES, in order: name_refusal, attribute_type_refusal -> the first Decision refusing the node, or None
    decide_node(node, infos): GRAPH_RULES, then the gate (claim.decide) on the node's static infos
                              (claim/shapes.py; an unknown query type declined with why_unknown's sentence),
                              then qk_output_refusal for a claimed node that asks for qk
    check_plugin_node(node): a node already in the plugin domain must look like one the pass wrote
                             (MhaModelError otherwise: a crafted one could abort the process at run time)

Each refusal is a Decision with a sentence and the subject it is about, like the gate's own.
"""

from __future__ import annotations

from typing import Optional

import onnx
from onnx import helper

from mha_ep import spec
from mha_ep.claim import Decision, decide
from mha_ep.claim.names import _raw_name, node_name
from mha_ep.claim.rules import Call, Refusal, attributes_from_mapping, total_seq
from mha_ep.claim.tensor_info import TensorInfo, format_shape
from mha_ep.errors import MhaModelError


PLUGIN_ATTRIBUTE_TYPE = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT, "string": onnx.AttributeProto.STRING}

def check_plugin_node(node: onnx.NodeProto) -> None:
    """The partition pass's rule ALREADY_CLAIMED: a node already in the plugin domain must look like one the pass
    wrote; MhaModelError if not."""
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


GRAPH_RULES = (name_refusal, attribute_type_refusal)


QK = spec.OUT_SLOT["qk"]


def qk_output_refusal(node: onnx.NodeProto, attributes: dict, inputs: list, infos: dict) -> Optional[Decision]:
    """The claim rule that reads the graph (listed last in claim/rules.py's docstring, asked after ``RULES``): a
    requested qk output must be declared as what the op writes, (B, N, S, T) in a float type (ORT's QK
    constraint), where the graph declares it at all. A disagreeing declaration would make ORT's own type checks or
    the caller's reading of the output fail later, so the node stays with ORT, and the sentence names the output,
    what it is declared as and what it would be."""
    tensor = node.output[QK]
    declared = infos.get(tensor)
    if declared is None:
        return None
    if declared.dtype is not None and declared.dtype not in spec.FLOAT_DTYPES:
        return Decision(
            node_name(node), False,
            f"mha_ep MultiHeadAttention: output 3 (qk) {tensor!r} is declared {declared.dtype}; ORT's QK type "
            f"constraint takes float32, float16 or bfloat16 (fix the output's declared type)",
            "qk",
        )  # fmt: skip
    if declared.shape is None:
        return None
    call = Call(attributes_from_mapping(attributes), tuple(inputs), (True, False, False, True))
    expected = (call.dim("query", 0), call.attrs.num_heads, call.dim("query", 1), total_seq(call))
    if call.rank("query") != 3:
        expected = (None, call.attrs.num_heads, None, total_seq(call))
    wrong = len(declared.shape) != 4 or any(
        want is not None and got is not None and want != got for want, got in zip(expected, declared.shape)
    )
    if wrong:
        return Decision(
            node_name(node), False,
            f"mha_ep MultiHeadAttention: output 3 (qk) {tensor!r} is declared with shape "
            f"{format_shape(declared.shape)}, but the node writes (B, N, S, T) = {format_shape(expected)} "
            "(fix the output's declared shape, or drop it from the graph's value_info)",
            "qk",
        )  # fmt: skip
    return None


def decide_node(node: onnx.NodeProto, infos: dict) -> Decision:
    for rule in GRAPH_RULES:
        refusal = rule(node)
        if refusal is not None:
            return refusal
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [(infos.get(name) or TensorInfo()) if name else None for name in node.input]
    outputs = [bool(name) for name in node.output] + [False] * (len(spec.OUTPUTS) - len(node.output))
    decision = decide(attributes, inputs, outputs, node_name(node))
    if decision.claimed and outputs[QK]:
        decision = qk_output_refusal(node, attributes, inputs, infos) or decision
    if decision.claimed and inputs[0].dtype is None:
        # The rules accept an unknown dtype, but the transport (the partition pass's rule TRANSPORT) must know it.
        why = infos.why_unknown(node.input[0]) if hasattr(infos, "why_unknown") else "no declaration gives it"
        return Decision(
            node_name(node),
            False,
            f"mha_ep MultiHeadAttention: the element type of query is unknown after shape inference and type "
            f"propagation ({why}), so the float32 transport cannot be chosen; declare that tensor's type in the "
            "graph's value_info",
            "query",
        )
    return decision
