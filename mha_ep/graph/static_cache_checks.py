"""The refusals of the static-cache rewrite (mha_ep/graph/static_cache.py): what a decoder-with-past must be for
the rewrite to take it, each break a StaticCacheError that names the node or input, what was expected and what to
do. The pass calls them at its rules' steps (static_cache.py names its rules): the arguments and the self nodes
(rule SELF_NODES), the inputs (rule OTHER_INPUTS), and, on every node that stays once the shape arithmetic is
evaluated, the reads on the host (rule ``HostReads``). The names and slots the pass works with are here too, so that
the checks and the rewrite read the same ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx

from mha_ep import spec
from mha_ep.claim.names import node_name
from mha_ep.errors import MhaModelError
from mha_ep.graph.affine import DEFAULT_DOMAINS, EVALUATORS, Evaluated
from mha_ep.graph.graph_facts import Dim, ancestor_inputs, dims_of, has_subgraph, names_read

PAST_SEQUENCE_LENGTH = "past_sequence_length"
CACHE_INDIRECTION = "cache_indirection"
PAST_KEY, PAST_VALUE = spec.SLOT["past_key"], spec.SLOT["past_value"]
SHARED_SLOTS = (spec.SLOT[PAST_SEQUENCE_LENGTH], spec.SLOT["cache_indirection"])
PRESENT_KEY, PRESENT_VALUE, QK = spec.OUT_SLOT["present_key"], spec.OUT_SLOT["present_value"], spec.OUT_SLOT["qk"]
P_SYMBOL = "mha_ep.graph.static_cache.P"  # the pasts' length dim while shapes are inferred (rule AFFINE_EVALUATION)

# Inputs that ORT's CUDA kernels read in CPU memory (``InputMemoryType(OrtMemTypeCPUInput, slot)`` in their
# registrations): a value computed on the device is copied to the host there, which a CUDA graph cannot capture.
HOST_INPUTS: Dict[str, Dict[int, str]] = {
    "Range": {0: "start", 1: "limit", 2: "delta"},
    "Reshape": {1: "shape"},
    "Expand": {1: "shape"},
    "Tile": {1: "repeats"},
    "Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"},
    "ConstantOfShape": {0: "input"},
    "Resize": {1: "roi", 2: "scales", 3: "sizes"},
    "Upsample": {1: "scales"},
    "TopK": {1: "K"},
    "Squeeze": {1: "axes"},
    "Unsqueeze": {1: "axes"},
    "Split": {1: "split"},
    "Pad": {1: "pads", 2: "constant_value", 3: "axes"},
    "OneHot": {1: "depth"},
    "Trilu": {1: "k"},
    "CumSum": {1: "axis"},
    "Clip": {1: "min", 2: "max"},
    "Dropout": {1: "ratio", 2: "training_mode"},
    **{f"Reduce{op}": {1: "axes"} for op in ("Sum", "Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum",
                                              "LogSumExp", "SumSquare")},
}  # fmt: skip


class StaticCacheError(MhaModelError):
    """A decoder the static-cache rewrite refuses; the message names the node, what was expected and what to do."""


def where(node: onnx.NodeProto) -> str:
    return f"node {node_name(node)!r} ({node.op_type})"


def slots_of(node: onnx.NodeProto) -> List[str]:
    """A MultiHeadAttention node's ten input names, "" where absent."""
    return list(node.input) + [""] * (len(spec.INPUTS) - len(node.input))


def is_self(node: onnx.NodeProto, presents: Set[str]) -> bool:
    """Whether ``node`` is a self node: the attention node that writes one of ``presents``."""
    outputs = node.output
    return node.op_type == spec.OP_TYPE and len(outputs) > PRESENT_KEY and outputs[PRESENT_KEY] in presents


def check_arguments(max_length, batch, beams, step_length) -> None:
    """Rule SELF_NODES for ``static_cache``'s arguments: max_length >= 1, batch >= 1 or None, beams >= 0 dividing batch,
    step_length from 1 to max_length or None."""
    if not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise StaticCacheError(f"max_length must be a whole number >= 1 (the buffer's rows), got {max_length!r}")
    if batch is not None and (not isinstance(batch, (int, np.integer)) or batch < 1):
        raise StaticCacheError(f"batch must be a whole number >= 1 or None (keep it symbolic), got {batch!r}")
    if not isinstance(beams, (int, np.integer)) or beams < 0 or (beams and batch is not None and batch % beams):
        raise StaticCacheError(f"beams must be a whole number >= 0 dividing batch {batch} (rows are batch entries x "
                               f"beams), got {beams!r}")  # fmt: skip
    if step_length is not None and (not isinstance(step_length, (int, np.integer)) or not 1 <= step_length
                                    <= max_length):  # fmt: skip
        raise StaticCacheError(f"step_length must be a whole number from 1 to max_length {max_length} (the rows a "
                               f"step writes), got {step_length!r}")  # fmt: skip


def check_self_node(node: onnx.NodeProto, slots: List[str], graph_inputs: Dict[str, onnx.ValueInfoProto],
                    graph_outputs: Dict[str, onnx.ValueInfoProto], batch: Optional[int]) -> None:  # fmt: skip
    """Rule SELF_NODES for one node with a past: ``slots`` are its ten input names, "" where absent."""
    outputs = list(node.output) + [""] * (len(spec.OUTPUTS) - len(node.output))
    form = "; the rewrite takes decoders as ORT's optimizer leaves them (--model_type bart)"
    for slot in (PAST_KEY, PAST_VALUE):
        if slots[slot] not in graph_inputs:
            raise StaticCacheError(f"{where(node)}: its {spec.INPUTS[slot]} {slots[slot]!r} is not a graph "
                                   f"input, so it cannot become a buffer the caller binds{form}")  # fmt: skip
    for slot in (PRESENT_KEY, PRESENT_VALUE):
        if outputs[slot] not in graph_outputs:
            raise StaticCacheError(f"{where(node)}: its {spec.OUTPUTS[slot]} {outputs[slot]!r} is not a graph "
                                   f"output; the shared buffer needs both presents as outputs{form}")  # fmt: skip
    if outputs[QK]:
        raise StaticCacheError(f"{where(node)}: it asks for the qk output {outputs[QK]!r}, (B, N, S, P+L), "
                               "whose shape would still change every step; drop that output first")  # fmt: skip
    for slot in (PAST_KEY, PAST_VALUE):
        name = slots[slot]
        dims = dims_of(graph_inputs[name])
        if dims is None or len(dims) != 4:
            raise StaticCacheError(f"{where(node)}: its {spec.INPUTS[slot]} {name!r} has dims {dims}, not "
                                   "(B, N, P, H): declare its rank-4 shape in the model")  # fmt: skip
        loose = [f"dim {i} ({dims[i]!r})" for i in (1, 3) if not (isinstance(dims[i], int) and dims[i] > 0)]
        if loose:
            raise StaticCacheError(
                f"{where(node)}: its {spec.INPUTS[slot]} {name!r} has dims {dims}, not (B, N, P, H) with static "
                f"heads N and head size H; the buffer (B, N, max_length, H) needs both: input {name!r} "
                f"{' and '.join(loose)} is not static, and no flag pins it: declare it static in the model"
            )
        if batch is not None and isinstance(dims[0], int) and dims[0] != batch:
            raise StaticCacheError(f"{where(node)}: its {spec.INPUTS[slot]} {name!r} has the static batch "
                                   f"{dims[0]} (input {name!r} dim 0), not --batch {batch}")  # fmt: skip


def shared_input_name(self_nodes: List[onnx.NodeProto], slot: int) -> str:
    """Rule SELF_NODES: the graph input every self node reads at ``slot`` (8 or 9), "" where none does; refused
    when they differ."""
    names = [slots_of(node)[slot] for node in self_nodes]
    odd = next((node for node, name in zip(self_nodes, names) if name != names[0]), None)
    if odd is not None:
        first = self_nodes[0]
        raise StaticCacheError(
            f"{where(odd)}: its {spec.INPUTS[slot]} is {slots_of(odd)[slot] or 'absent'!r}, but "
            f"{where(first)} has {names[0] or 'absent'!r} there: every self-attention node needs the same "
            f"graph input at input {slot}, or none"
        )
    return names[0]


def check_shared_input(node: onnx.NodeProto, slot: int, name: str, graph: onnx.GraphProto,
                       graph_inputs: Dict[str, onnx.ValueInfoProto], beams: int) -> None:  # fmt: skip
    """Rule SELF_NODES for an input 8/9 the model has: a graph input (not an initializer) of int32 and the shape ORT
    takes, past_sequence_length (1,) or scalar, cache_indirection (B / W, W, M) with W = beams when given."""
    role = spec.INPUTS[slot]
    value = graph_inputs.get(name)
    if value is None or name in {i.name for i in graph.initializer}:
        raise StaticCacheError(f"{where(node)}: its {role} {name!r} is not a graph input, so the caller cannot "
                               "bind it at every step")  # fmt: skip
    dtype = value.type.tensor_type.elem_type
    dims = dims_of(value)
    if dtype != onnx.TensorProto.INT32:
        raise StaticCacheError(f"input {name!r} ({role} of {where(node)}) has element type "
                               f"{onnx.TensorProto.DataType.Name(dtype)}, not int32")  # fmt: skip
    if slot == spec.SLOT[PAST_SEQUENCE_LENGTH] and dims not in ((1,), ()):
        raise StaticCacheError(f"input {name!r} ({role} of {where(node)}) has dims {dims}, not (1,) or a scalar: "
                               "it holds one number, P")  # fmt: skip
    if slot == spec.SLOT[CACHE_INDIRECTION]:
        if dims is None or len(dims) != 3:
            raise StaticCacheError(f"input {name!r} ({role} of {where(node)}) has dims {dims}, not (B / W, W, "
                                   "max_length)")  # fmt: skip
        if beams and isinstance(dims[1], int) and dims[1] != beams:
            raise StaticCacheError(f"input {name!r} ({role} of {where(node)}) has the static beam width "
                                   f"{dims[1]} (input {name!r} dim 1), not --beams {beams}")  # fmt: skip


def check_readers(graph: onnx.GraphProto, pasts: Set[str], presents: Set[str]) -> None:
    """Rule SELF_NODES: the pasts are read only by their node and Shape nodes, the presents by no node, and neither by a
    node with a subgraph."""
    for node in graph.node:
        for name in names_read(graph, node):
            if name not in presents and name not in pasts:
                continue
            if has_subgraph(node):
                raise StaticCacheError(
                    f"{where(node)}: it has a subgraph and reads {name!r}, a self-attention "
                    f"{'present' if name in presents else 'past'} that becomes the (B, N, max_length, H) "
                    "buffer; the rewrite does not follow subgraphs (If, Loop, Scan), so it cannot rewrite what "
                    "the subgraph does with it: move that computation out of the subgraph"
                )
            if name in presents:
                raise StaticCacheError(f"{where(node)}: it reads the present {name!r}, which becomes the "
                                       "(B, N, max_length, H) buffer; no node may read it")  # fmt: skip
            if node.op_type != "Shape" and not is_self(node, presents):
                raise StaticCacheError(
                    f"{where(node)}: it reads the past {name!r}, whose rows beyond past_sequence_length are "
                    "not the past once it is the shared buffer; only its attention node and Shape nodes may read it"
                )


def check_buffer_lengths(pasts: Set[str], graph_inputs: Dict[str, onnx.ValueInfoProto], p_input: str,
                         max_length: int) -> None:  # fmt: skip
    """Rule OTHER_INPUTS for pasts that are buffers already: a static dim 2 is max_length."""
    for name in sorted(pasts):
        rows = dims_of(graph_inputs[name])[2]
        if isinstance(rows, int) and rows != max_length:
            raise StaticCacheError(
                f"input {name!r} dim 2 is the static buffer length {rows} (its node reads {p_input!r} "
                f"already: the past is the shared buffer), not --max-length {max_length}"
            )


def refuse_the_pasts_length(name: str, dims: Sequence[Dim], lengths: Set[Dim]) -> None:
    """Rule OTHER_INPUTS: an input other than the pasts that carries their length (P) is refused."""
    carried = [f"dim {i} ({d!r})" for i, d in enumerate(dims) if isinstance(d, str) and d in lengths]
    if carried:
        raise StaticCacheError(
            f"input {name!r} has dims {list(dims)}: its {' and '.join(carried)} is the pasts' length "
            f"{sorted(str(d) for d in lengths)}, P, so its shape would still change every step; no flag pins it "
            "(P grows by the step length each step): compute it in the model from the pasts or past_sequence_length"
        )


@dataclass
class HostReads:
    """Rule ``HostReads`` over the nodes that stay once the shape arithmetic is evaluated (``known``): none reads on
    the host a value that depends on P, or (with ``batch``) any value that is not constant; no Shape node reads a
    self past. ``dims``: the inferred dims; ``step_symbol``: the step length's symbol, for the flag a refusal names."""

    graph: onnx.GraphProto
    graph_inputs: Dict[str, onnx.ValueInfoProto]
    known: Evaluated
    pasts: Set[str]
    dims: Dict[str, Tuple[Dim, ...]]
    batch: Optional[int]
    step_symbol: Optional[str]

    def check(self, node: onnx.NodeProto) -> None:
        """Rule ``HostReads`` for a node that stays."""
        if node.op_type == "Shape" and node.domain in DEFAULT_DOMAINS:
            self.check_shape(node)
        if has_subgraph(node):
            self.check_subgraph(node)
        slots = HOST_INPUTS.get(node.op_type, {}) if node.domain in DEFAULT_DOMAINS else {}
        read = [(role, node.input[slot]) for slot, role in slots.items() if slot < len(node.input) and node.input[slot]]
        varying = [(role, name) for role, name in read if not self.known.is_constant(name)]
        on_p = [f"{role} {name!r} {self.known.how(name)}" for role, name in varying if self.known.depends_on_p(name)]
        advice = self.advice([name for _, name in varying])
        if on_p:
            raise StaticCacheError(
                f"{where(node)}: its {' and its '.join(on_p)} {'depends' if len(on_p) == 1 else 'depend'} on "
                "past_sequence_length in a way the rewrite cannot resolve into constants, and ORT's CUDA kernel "
                f"reads {'it' if len(on_p) == 1 else 'them'} on the host: ORT's CUDA graph could not capture it. "
                f"The rewrite evaluates shape arithmetic affine in P through Shape, {', '.join(sorted(EVALUATORS))}, "
                f"with every other dim static{advice}"
            )
        if varying and self.batch is not None:
            found = " and its ".join(f"{role} {name!r} {self.known.how(name)}" for role, name in varying)
            raise StaticCacheError(
                f"{where(node)}: its {found} is not a constant, and ORT's CUDA kernel reads it on the host: ORT's "
                f"CUDA graph could not capture it{advice or '; it is computed from the data at run time'}"
            )

    def check_shape(self, node: onnx.NodeProto) -> None:
        """Rule ``HostReads`` for a Shape node that stays (only with a symbolic batch, and never on a self past)."""
        source = node.input[0]
        if source in self.pasts:
            raise StaticCacheError(
                f"{where(node)}: its value is needed at run time (a dim of {source!r} stays symbolic), but in the "
                f"shared buffer the past's shape says max_length, not past_sequence_length{self.advice([source])}"
            )
        if self.batch is not None or self.known.depends_on_p(node.output[0]):
            given = "" if self.batch is None else f" with --batch {self.batch}"
            advice = self.advice([source]) or "; make that tensor's dims static"
            raise StaticCacheError(
                f"{where(node)}: the shape of its input {source!r} is {self.dims.get(source, 'unknown')}, not static"
                f"{given}: the Shape node would stay, and ORT's CUDA graph could not capture it{advice}"
            )

    def check_subgraph(self, node: onnx.NodeProto) -> None:
        """Rule ``HostReads`` for a node with a subgraph (If, Loop, Scan) that stays: it reads nothing that depends
        on P."""
        on_p = [name for name in dict.fromkeys(names_read(self.graph, node)) if self.known.depends_on_p(name)]
        if on_p:
            raise StaticCacheError(
                f"{where(node)}: it has a subgraph and reads {', '.join(repr(n) for n in on_p)}, which "
                f"{'depends' if len(on_p) == 1 else 'depend'} on past_sequence_length "
                f"({'; '.join(f'{n} {self.known.how(n)}' for n in on_p)}); the rewrite does not follow subgraphs "
                "(If, Loop, Scan), so what the subgraph computes from it could still read the past's length on the "
                "host: move that computation out of the subgraph"
            )

    def sources(self, names: Sequence[str]) -> List[Tuple[str, int, str]]:
        """The symbolic dims (input, dim index, symbol) of the graph inputs ``names`` are computed from: the dims
        that stay symbolic, not the pasts' length."""
        found = []
        for name in ancestor_inputs(self.graph, names):
            dims = dims_of(self.graph_inputs[name]) or ()
            found += [(name, i, d) for i, d in enumerate(dims) if isinstance(d, str) and d != P_SYMBOL]
        return found

    def advice(self, names: Sequence[str]) -> str:
        """For a refusal: the symbolic input dims ``names`` come from and the flag that pins each (see
        ``pin_advice``)."""
        return pin_advice(self.sources(names), self.step_symbol)


def flag_for(index: int, symbol: str, step_symbol: Optional[str]) -> Optional[str]:
    """The static-cache flag that pins dim ``index`` of symbol ``symbol`` of an input: --step-length for the step
    length's symbol, --batch for a dim 0; None where no flag does."""
    if symbol == step_symbol:
        return "--step-length"
    return "--batch" if index == 0 else None


def pin_advice(sources: Sequence[Tuple[str, int, str]], step_symbol: Optional[str]) -> str:
    """What to pin, for a refusal: each (input, dim index, symbol) that a refused value comes from, with its flag,
    or the word that no flag pins it; "" when there is none."""
    parts = []
    for name, index, symbol in sources:
        flag = flag_for(index, symbol, step_symbol)
        how = f"pin it with {flag}" if flag else "no flag pins it: declare it static in the model"
        parts.append(f"input {name!r} dim {index} ({symbol!r}) ({how})")
    return f"; symbolic input dims feed it: {', '.join(parts)}" if parts else ""
