"""How requests from several callers share one run of a model: the batch plan (read off the model once, a decision
with its reason), each request's fit (its rows and length, or why it runs alone), the runs a queue of requests
makes, and the feeds and answers of one shared run. NumPy and onnx only: no Ray, no onnxruntime.

The plan's rules, in order, each named by the function that is the whole rule (cited as ``rule NAME``); the first
that fails decides, and its sentence is the plan's reason:
  batch_dim_of (batching): every graph input and every output has the same symbolic dim first (the model's batch
    dim, B). Otherwise every request runs alone.
  key_padding_mask (padding: requests of different lengths in one run): a graph input of shape (B, S), S symbolic,
    reaches the key_padding_mask of every MultiHeadAttention node, through Cast and Identity or as
    EmbedLayerNormalization's mask_index: the key-padding mask, and S is the sequence dim.
  sequence_axis_problem: every input and output that carries S carries it once, at axis 1: padding and cutting back
    work on one axis.
  node_problem: every node acts on each position by itself (PER_POSITION_OPS; MatMul by a weight; Gather from a
    table; LayerNormalization over the last axis), or is a MultiHeadAttention node that reads the mask and no
    attention_bias, past or cache.
  Without padding, requests share a run only when every dim but the batch's is equal.

A padded run (assemble) pads each request's inputs along S with zeros: the mask's 0 marks a padded key, and ids
or values of 0 are valid inputs whose positions are cut off the answer (split). Why an answer is unchanged: a
padded key's score gets mask_filter_value added, as the request's own padded keys do, so its softmax weight
underflows to 0 in float32; padded query positions are computed and cut off; every other node works per position
(rule ``node_problem``). What padding can move is rounding: the softmax's sums and the attention GEMMs group their
terms by the padded length, so the last bits of an answer can differ from the request's own run (tests/serve holds
batched answers to a tight tolerance for this reason, and unbatched ones to bit equality). A request with a mask row
that keeps no key is never padded: ORT's softmax then runs over every key's raw score, padded keys included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from mha_ep.spec import OP_TYPE, SLOT

# Nodes that compute each position from that position alone: elementwise ops, and the fused ops ORT's optimizer
# leaves in a BERT-style encoder, which normalize or embed one position at a time.
PER_POSITION_OPS = frozenset({
    "Abs", "Add", "BiasAdd", "BiasGelu", "Cast", "Constant", "Div", "EmbedLayerNormalization", "Erf", "Exp",
    "FastGelu", "Gelu", "Identity", "Log", "Mul", "Neg", "Pow", "QuickGelu", "Relu", "Sigmoid",
    "SimplifiedLayerNormalization", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "Sqrt", "Sub",
    "Tanh", "Where",
})  # fmt: skip
MASK_CARRIERS = ("Cast", "Identity")  # ops that pass the mask on unchanged in meaning
EMBED_MASK_SLOT = 7  # EmbedLayerNormalization's mask input; its output 1 is the mask_index it makes of it
UNPADDABLE_MHA_SLOTS = ("attention_bias", "past_key", "past_value", "past_sequence_length", "cache_indirection")


@dataclass(frozen=True)
class BatchPlan:
    """How requests share a run of one model (module docstring). ``batch_dim`` None: every request runs alone;
    ``sequence_dim`` None: requests share a run only when their lengths are equal. The reasons are sentences."""

    inputs: tuple  # the model's feeds, graph order
    outputs: tuple
    batch_dim: Optional[str]
    batch_reason: str
    sequence_dim: Optional[str] = None
    mask: Optional[str] = None
    pad_reason: str = ""
    padded_inputs: tuple = ()  # inputs carrying the sequence dim (at axis 1): padded
    cut_outputs: tuple = ()  # outputs carrying it (at axis 1): cut back to each request's length

    @property
    def can_batch(self) -> bool:
        return self.batch_dim is not None

    @property
    def can_pad(self) -> bool:
        return self.sequence_dim is not None

    def describe(self) -> str:
        return f"{self.batch_reason}; {self.pad_reason}" if self.can_batch else self.batch_reason

    def to_dict(self) -> dict:
        return {"batch_dim": self.batch_dim, "sequence_dim": self.sequence_dim, "mask": self.mask,
                "batch_reason": self.batch_reason, "pad_reason": self.pad_reason}  # fmt: skip


def symbolic_shape(value) -> Optional[list]:
    """An ONNX ValueInfo's dims: the dim_param's name, the fixed size, or None; None for no shape at all."""
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in tensor.shape.dim]


def plan_batching(model) -> BatchPlan:
    """The plan of ``model`` (an onnx.ModelProto, before partitioning), by the module docstring's rules."""
    graph = model.graph
    weights = {init.name for init in graph.initializer}
    feeds = [v for v in graph.input if v.name not in weights]
    shapes = {v.name: symbolic_shape(v) for v in [*feeds, *graph.output]}
    names = (tuple(v.name for v in feeds), tuple(v.name for v in graph.output))
    batch_dim, batch_reason = batch_dim_of(shapes)
    if batch_dim is None:
        return BatchPlan(*names, None, batch_reason)
    mask, sequence, reason = key_padding_mask(graph, shapes, batch_dim, names[0])
    if mask is not None:
        reason = sequence_axis_problem(shapes, sequence) or node_problem(graph, weights, mask_sources(graph, mask))
    if mask is None or reason:
        return BatchPlan(*names, batch_dim, batch_reason, pad_reason=f"{reason}: requests share a run only when "
                                                                     f"their lengths are equal")  # fmt: skip
    carrying = [name for name, shape in shapes.items() if shape and sequence in shape]
    return BatchPlan(
        *names, batch_dim, batch_reason, sequence, mask,
        f"{mask!r} is the key-padding mask of every MultiHeadAttention node and every node works per position: "
        f"requests of different {sequence!r} are padded to the longest with zeros (mask 0) and cut back",
        tuple(n for n in names[0] if n in carrying), tuple(n for n in names[1] if n in carrying),
    )  # fmt: skip


def batch_dim_of(shapes: Mapping[str, Optional[list]]) -> tuple:
    """(the batch dim's name, why) when every input and output has the same symbolic dim first, else (None, why
    each request runs alone)."""
    firsts = {}
    for name, shape in shapes.items():
        if not shape:
            return None, f"{name!r} has no batch axis (its shape is {shape!r}): each request runs alone"
        if not isinstance(shape[0], str):
            return None, f"{name!r} has {shape[0]!r} first, not a symbolic batch dim: each request runs alone"
        firsts[name] = shape[0]
    if len(set(firsts.values())) > 1:
        return None, f"the inputs and outputs start with different dims ({firsts}): each request runs alone"
    dim = next(iter(firsts.values()))
    return dim, f"every input and output starts with {dim!r}: requests share a run along it"


def mask_sources(graph, mask: str) -> set:
    """The tensors that carry ``mask``'s meaning: itself, through Cast/Identity, and EmbedLayerNormalization's
    mask_index made from it."""
    sources = {mask}
    for node in graph.node:  # graph order is topological: one pass follows every chain
        if node.op_type in MASK_CARRIERS and node.input and node.input[0] in sources:
            sources.add(node.output[0])
        if (node.op_type == "EmbedLayerNormalization" and len(node.input) > EMBED_MASK_SLOT
                and node.input[EMBED_MASK_SLOT] in sources and len(node.output) > 1):  # fmt: skip
            sources.add(node.output[1])
    return sources


def key_padding_mask(graph, shapes: Mapping, batch_dim: str, feeds: Sequence[str]) -> tuple:
    """Rule ``key_padding_mask``: (mask input, sequence dim, "") when it holds, else (None, None, why not)."""
    attention = [node for node in graph.node if node.op_type == OP_TYPE]
    if not attention:
        return None, None, "the model has no MultiHeadAttention node"
    slot = SLOT["key_padding_mask"]
    for name in feeds:
        shape = shapes[name]
        if not (shape and len(shape) == 2 and shape[0] == batch_dim and isinstance(shape[1], str)):
            continue
        sources = mask_sources(graph, name)
        if all(len(node.input) > slot and node.input[slot] in sources for node in attention):
            return name, shape[1], ""
    return None, None, (f"no input of shape ({batch_dim!r}, S) is the key_padding_mask of every MultiHeadAttention "
                        f"node")  # fmt: skip


def sequence_axis_problem(shapes: Mapping, sequence: str) -> str:
    """Rule ``sequence_axis_problem``: "" when every tensor carrying ``sequence`` carries it once at axis 1, else
    the first that does not."""
    for name, shape in shapes.items():
        if shape and sequence in shape and (shape.count(sequence) > 1 or shape.index(sequence) != 1):
            return f"{name!r} of shape {shape} does not carry {sequence!r} once at axis 1"
    return ""


def node_problem(graph, weights: set, mask: set) -> str:
    """Rule ``node_problem``: "" when every node works per position (or is attention reading the mask), else the
    first that does not, named."""
    for node in graph.node:
        reason = position_mixing(node, weights, mask)
        if reason:
            return f"node {node.name or node.output[0]!r} ({node.op_type}) {reason}"
    return ""


def position_mixing(node, weights: set, mask: set) -> str:
    """"" when ``node`` computes each position from that position alone (or is attention that reads the
    key-padding mask ``mask``), else how it may mix positions."""
    op = node.op_type
    if op == OP_TYPE:
        slot = SLOT["key_padding_mask"]
        if len(node.input) <= slot or node.input[slot] not in mask:
            return "does not read the key-padding mask"
        used = [name for name in UNPADDABLE_MHA_SLOTS if len(node.input) > SLOT[name] and node.input[SLOT[name]]]
        return f"reads {used[0]}, which padding would change" if used else ""
    if op in PER_POSITION_OPS:
        return ""
    if op == "MatMul":
        return "" if len(node.input) > 1 and node.input[1] in weights else "multiplies two activations"
    if op == "Gather":
        return "" if node.input and node.input[0] in weights else "gathers from an activation"
    if op == "LayerNormalization":
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        return "" if axis == -1 else f"normalizes from axis {axis}, not the last one"
    return "may mix positions"


@dataclass(frozen=True)
class Fit:
    """How one request can join a run: ``rows`` along the batch dim, ``length`` along the sequence dim (None when
    the plan does not pad), ``key`` (every other dim of every input: requests with equal keys can share a run),
    ``paddable`` (False: it shares a run only at its own length), ``alone`` (why it runs by itself, or "")."""

    rows: int
    length: Optional[int] = None
    key: tuple = ()
    paddable: bool = True
    alone: str = ""


def fit(plan: BatchPlan, feeds: Mapping[str, np.ndarray]) -> Fit:
    """The Fit of a request that onnxruntime's own checks passed (call_error: names, types, ranks, fixed dims).
    A request whose inputs disagree with each other runs alone, so onnxruntime answers it as it would."""
    if not plan.can_batch:
        return Fit(0, alone=plan.batch_reason)
    shapes = {name: tuple(np.shape(feeds[name])) for name in plan.inputs if name in feeds}
    if len(shapes) != len(plan.inputs) or any(not shape for shape in shapes.values()):
        return Fit(0, alone="some input is missing or has no batch axis")
    rows = {shape[0] for shape in shapes.values()}
    if len(rows) > 1:
        return Fit(0, alone=f"its inputs disagree on {plan.batch_dim!r}: {shapes}")
    count = rows.pop()
    if count == 0:
        return Fit(0, alone=f"it has no rows ({plan.batch_dim!r} is 0)")
    length = None
    if plan.can_pad:
        lengths = {shapes[name][1] for name in plan.padded_inputs}
        if len(lengths) > 1:
            return Fit(count, alone=f"its inputs disagree on {plan.sequence_dim!r}: {shapes}")
        length = lengths.pop()
    key = tuple((name, shape[2:] if name in plan.padded_inputs else shape[1:]) for name, shape in shapes.items())
    paddable = not plan.can_pad or bool(np.all(np.any(np.asarray(feeds[plan.mask]) != 0, axis=1)))
    return Fit(count, length, key, paddable)


def runs(fits: Sequence[Fit], max_rows: int) -> List[List[int]]:
    """The runs a queue's requests make, as lists of their indices (queue order kept within each): requests that
    fit together (equal keys; and equal lengths unless both may be padded) share a run of at most ``max_rows``
    rows; a request that runs alone, or has ``max_rows`` rows or more, is a run of its own."""
    groups: Dict[tuple, List[int]] = {}
    for index, item in enumerate(fits):
        if item.alone or item.rows >= max_rows:
            groups[("alone", index)] = [index]
        else:
            groups.setdefault((item.key, None if item.paddable else item.length), []).append(index)
    result = []
    for members in groups.values():
        current, rows = [], 0
        for index in members:
            if current and rows + fits[index].rows > max_rows:
                result.append(current)
                current, rows = [], 0
            current.append(index)
            rows += fits[index].rows
        result.append(current)
    return result


def pad_to(array: np.ndarray, length: int) -> np.ndarray:
    """``array`` (B, S, ...) with zeros appended along axis 1 up to ``length``."""
    missing = length - array.shape[1]
    if missing == 0:
        return array
    return np.pad(array, [(0, 0), (0, missing)] + [(0, 0)] * (array.ndim - 2))


def assemble(plan: BatchPlan, feeds: Sequence[Mapping[str, np.ndarray]], fits: Sequence[Fit]) -> tuple:
    """(the run's feeds, its length): each input's requests stacked along the batch dim in order, those carrying
    the sequence dim padded to the longest (None when the plan does not pad)."""
    length = max(item.length for item in fits) if plan.can_pad else None
    stacked = {}
    for name in plan.inputs:
        arrays = [np.asarray(request[name]) for request in feeds]
        if length is not None and name in plan.padded_inputs:
            arrays = [pad_to(array, length) for array in arrays]
        stacked[name] = np.concatenate(arrays, axis=0)
    return stacked, length


def split(plan: BatchPlan, names: Sequence[str], outputs: Sequence[np.ndarray], fits: Sequence[Fit]) -> list:
    """Each request's outputs ({name: array}) out of a run's, in the fits' order: its rows, and along the sequence
    dim its own length. Copies: an answer owns its arrays."""
    answers, start = [], 0
    for item in fits:
        own = {}
        for name, array in zip(names, outputs):
            part = array[start:start + item.rows]
            if item.length is not None and name in plan.cut_outputs:
                part = part[:, :item.length]
            own[name] = np.array(part, copy=True)
        answers.append(own)
        start += item.rows
    return answers
