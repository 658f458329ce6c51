"""Element types (and the simplest shapes) carried forward through a graph, for tensors shape inference left
untyped.

    propagate_types(graph, infos) -> StaticInfos   # infos completed; why_unknown(name) for what is still unknown

ORT's symbolic shape inference stops at the first node it cannot finish (a com.microsoft::MultiHeadAttention
with a ``qk`` output, a custom-domain op) and ONNX's knows no com.microsoft op, so every tensor after such a node
would be untyped, and the gate would decline every later MultiHeadAttention for a reason that is not its own.
This pass walks the graph's nodes in order (repeated until nothing changes, so an unsorted graph converges too)
and gives each output of an op in ``TYPE_RULES`` the element type its rule derives from the node's inputs or
attributes. A tensor that already has an element type (from shape inference or the graph's declarations) keeps
it; a shape is filled only where the rule says it is the input's (``shape="same"``) or follows from its rank.

The rules are data: one ``TypeRule`` per (domain, op type). An op not in the table gives no types; a tensor left
untyped gets a sentence saying why (``StaticInfos.why_unknown``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import onnx

from mha_ep import spec
from mha_ep.claim.names import node_name
from mha_ep.claim.tensor_info import TensorInfo
from mha_ep.dtypes import dtype_name

ONNX, MS = "", "com.microsoft"


@dataclass(frozen=True)
class TypeRule:
    """How one op's outputs get their element type: from ``attribute`` when the node has it (an element type, as
    Cast's ``to``, or a tensor, as ConstantOfShape's ``value``), else ``fixed``, else the type of the first of
    ``inputs`` whose type is known (None: any input). ``outputs``: the output slots the rule types (None: all).
    ``shape``: "same" (the shape of the first of ``inputs``), "rank" (a 1-D tensor of the input's rank, Shape's),
    "scalar", or None (not derived)."""

    inputs: Optional[Tuple[int, ...]] = (0,)
    outputs: Optional[Tuple[int, ...]] = (0,)
    fixed: Optional[str] = None
    attribute: Optional[str] = None
    shape: Optional[str] = None


SAME_SHAPE = TypeRule(shape="same")  # element-wise on one tensor: type and shape of input 0
FIRST = TypeRule()  # type of input 0, shape not derived
ANY = TypeRule(inputs=None)  # inputs that share one type (broadcasting ops, Concat, Max, ...)
BOOLEAN = TypeRule(inputs=(), fixed="bool")
INDICES = TypeRule(inputs=(), fixed="int64")

TYPE_RULES: Mapping[Tuple[str, str], TypeRule] = {
    **{(ONNX, op): SAME_SHAPE for op in (
        "Identity", "Neg", "Abs", "Sqrt", "Exp", "Log", "Tanh", "Sigmoid", "Relu", "Erf", "Reciprocal", "Softmax",
        "LogSoftmax", "Dropout", "LayerNormalization", "Trilu", "CumSum", "Gelu",
    )},
    **{(ONNX, op): FIRST for op in (
        "Pow", "Gather", "GatherElements", "GatherND", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Transpose",
        "Expand", "Tile", "Pad", "Flatten", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ScatterND",
    )},
    **{(ONNX, op): ANY for op in (
        "Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Concat", "MatMul", "Gemm", "Range",
    )},
    **{(ONNX, op): BOOLEAN for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or")},
    **{(ONNX, op): INDICES for op in ("ArgMax", "ArgMin", "NonZero")},
    (ONNX, "Split"): TypeRule(outputs=None),
    (ONNX, "Where"): TypeRule(inputs=(1, 2)),
    (ONNX, "Cast"): TypeRule(inputs=(), attribute="to", shape="same"),
    (ONNX, "CastLike"): TypeRule(inputs=(1,)),
    (ONNX, "Shape"): TypeRule(inputs=(), fixed="int64", shape="rank"),
    (ONNX, "Size"): TypeRule(inputs=(), fixed="int64", shape="scalar"),
    (ONNX, "ConstantOfShape"): TypeRule(inputs=(), attribute="value", fixed="float32"),
    **{(MS, op): SAME_SHAPE for op in ("BiasGelu", "FastGelu", "Gelu", "QuickGelu", "RotaryEmbedding",
                                       "SimplifiedLayerNormalization")},  # fmt: skip
    # output 0 the normalised sum, output 3 the sum itself (outputs 1-2, mean and inverse std, are float32)
    (MS, "SkipLayerNormalization"): TypeRule(outputs=(0, 3), shape="same"),
    (MS, "SkipSimplifiedLayerNormalization"): TypeRule(outputs=(0, 3), shape="same"),
    # output, present_key, present_value and qk all in query's type (a declared qk type is kept: never overridden)
    (MS, "MultiHeadAttention"): TypeRule(outputs=None),
    (MS, "Attention"): TypeRule(outputs=(0, 1)),
    (MS, "GroupQueryAttention"): TypeRule(outputs=(0, 1, 2)),
    (MS, "DecoderMaskedMultiHeadAttention"): TypeRule(outputs=(0, 1, 2)),
    # mha_ep's own weight product (static-cache --decode-matmul writes it, and declares its outputs too)
    (spec.PLUGIN_DOMAIN, spec.MATMUL_OP_TYPE): FIRST,
}


def rule_of(node: onnx.NodeProto) -> Optional[TypeRule]:
    return TYPE_RULES.get((ONNX if node.domain == "ai.onnx" else node.domain, node.op_type))


def op_label(node: onnx.NodeProto) -> str:
    """``Add 'name'``, ``com.microsoft::Foo 'name'``: how a sentence names a node."""
    op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
    return f"{op} '{node_name(node)}'" if node_name(node) else f"an unnamed {op}"


def _attribute_type(node: onnx.NodeProto, name: str) -> Optional[str]:
    for attr in node.attribute:
        if attr.name == name:
            if attr.type == onnx.AttributeProto.INT:
                return dtype_name(attr.i)
            if attr.type == onnx.AttributeProto.TENSOR:
                return dtype_name(attr.t.data_type)
    return None


def _sources(node: onnx.NodeProto, rule: TypeRule):
    slots = range(len(node.input)) if rule.inputs is None else rule.inputs
    return [node.input[slot] for slot in slots if slot < len(node.input) and node.input[slot]]


def _derive(node: onnx.NodeProto, rule: TypeRule, infos: Mapping[str, TensorInfo]) -> Optional[TensorInfo]:
    """The TensorInfo ``rule`` gives an output of ``node``, or None when the types it needs are unknown."""
    dtype = (_attribute_type(node, rule.attribute) if rule.attribute else None) or rule.fixed
    known = [infos[name] for name in _sources(node, rule) if name in infos and infos[name].dtype is not None]
    if dtype is None and known:
        dtype = known[0].dtype
    if dtype is None:
        return None
    first = infos.get(node.input[0]) if node.input and node.input[0] else None
    shape = None
    if rule.shape == "same" and first is not None:
        shape = first.shape
    elif rule.shape == "rank" and first is not None and first.rank is not None:
        shape = (first.rank,)
    elif rule.shape == "scalar":
        shape = ()
    return TensorInfo(dtype, shape)


class StaticInfos(dict):
    """TensorInfo by tensor name (a dict, as before), plus how to say why a tensor's element type is unknown:
    the graph's producers and the enclosing scope's StaticInfos (a subgraph reads outer-scope names)."""

    def __init__(self, infos: Mapping[str, TensorInfo], graph: Optional[onnx.GraphProto] = None, outer=None):
        super().__init__(infos)
        self.producers: Dict[str, Tuple[onnx.NodeProto, int]] = {}
        self.inputs = set()
        if graph is not None:
            self.inputs = {v.name for v in graph.input}
            for node in graph.node:
                for slot, output in enumerate(node.output):
                    if output:
                        self.producers[output] = (node, slot)
        self.outer = outer

    def why_unknown(self, name: str) -> str:
        """A sentence on why ``name``'s element type is unknown, tracing it back through typed ops to its origin."""
        hops = []
        seen = set()
        while name in self.producers and name not in seen:
            seen.add(name)
            node, slot = self.producers[name]
            rule = rule_of(node)
            untyped = [s for s in _sources(node, rule) if self.get(s, TensorInfo()).dtype is None] if rule else []
            if rule is None or not untyped:
                origin = (
                    f"'{name}' is output {slot} of {op_label(node)}, whose output types neither shape inference nor "
                    "the graph's declarations give"
                )  # fmt: skip
                return _through(hops, origin)
            hops.append((name, node))
            name = untyped[0]
        if name in self.inputs:
            return _through(hops, f"'{name}' is an input of its graph declared without an element type")
        if self.outer is not None and name not in self.producers:
            return _through(hops, self.outer.why_unknown(name))
        return _through(hops, f"'{name}' is neither produced in its graph nor declared with a type")


def _through(hops, origin: str) -> str:
    if not hops:
        return origin
    first_name, first_node = hops[0]
    more = f" and {len(hops) - 1} more node(s)" if len(hops) > 1 else ""
    return f"'{first_name}' takes its type through {op_label(first_node)}{more}, and {origin}"


def propagate_types(graph: onnx.GraphProto, infos: Mapping[str, TensorInfo], outer=None) -> StaticInfos:
    """``infos`` completed by ``TYPE_RULES`` over ``graph``'s nodes; a known element type is never replaced."""
    result = StaticInfos(infos, graph, outer)
    changed = True
    while changed:  # one pass for a sorted graph, and one more to see nothing changes
        changed = False
        for node in graph.node:
            rule = rule_of(node)
            if rule is None:
                continue
            for slot, output in enumerate(node.output):
                if not output or (rule.outputs is not None and slot not in rule.outputs):
                    continue
                have = result.get(output)
                if have is not None and have.dtype is not None:
                    continue
                derived = _derive(node, rule, result)
                if derived is None:
                    continue
                shape = have.shape if have is not None and have.shape is not None else derived.shape
                result[output] = TensorInfo(derived.dtype, shape)
                changed = True
    return result
