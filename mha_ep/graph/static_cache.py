"""Static KV cache: rewrite a decoder-with-past so that one graph of fixed shapes serves every generation step.

    result = static_cache("decoder.onnx", max_length=448, batch=1)   # mha-ep static-cache DECODER -o OUT ...
    print(result.report())                                           # what was pinned, kept and added
    result.save("decoder_static.onnx")

A decoder-with-past as ORT's transformers optimizer leaves Whisper's (``--model_type bart
--use_multi_head_attention``) grows its self-attention cache by one row a step: ``past_key_self_i`` (B, N, P, H) in,
``present_key_self_i`` (B, N, P+1, H) out; its positions come from ``Shape(past_key_self_0)[2]`` through a Shape ->
Gather -> Add(Range) -> Unsqueeze -> Tile chain that ORT runs on its CPU provider. Every step is a new shape, so no
CUDA graph can replay it. ORT's MultiHeadAttention has a shared-buffer form (ORT 1.31.1, its CPU provider):
``past_key``/``past_value`` (B, N, M, H) of a fixed maximum length M plus input 8 ``past_sequence_length`` (int32,
(1,), value P) write the step's L new rows at [P, P+L) of ``present_key``/``present_value`` (B, N, M, H), keep the
other rows as the past's, and attend over the P+L filled rows. With past and present bound to one buffer, one graph
of fixed shapes serves every step. This pass writes that form, and turns the shape arithmetic on the past's length
into constants and device computations from ``past_sequence_length``.

Layout legend: B batch, N heads, H head size, P rows filled before the step, L the step's rows, M max_length.

Rules of the pass, each by its name: a heading here, or the class or method that is the whole rule. The code, the
tests and the docs cite a rule as ``rule NAME``, never by a number (tests/graph/test_rule_names.py holds them to it):
  SELF_NODES: every com.microsoft::MultiHeadAttention node with a past is a self-attention node. Each one reads past_key
    and past_value from graph inputs that only it and Shape nodes read (no node with a subgraph: the rewrite does not
    follow If/Loop/Scan bodies), writes both presents to graph outputs that no node reads, asks for no qk output, and
    its pasts have static heads N and head size H. Its inputs 8 and 9 are absent on every self node, or each the same
    graph input on every one: ``past_sequence_length`` int32 (1,) or scalar, ``cache_indirection`` int32 of rank 3, as
    ORT's Whisper export with ``--use_decoder_masked_mha`` wires them; then the pasts are buffers of M rows already.
    Nodes without a past (cross-attention over BNSH key/value inputs, with inputs 8/9 or a qk output or not: ORT ignores
    inputs 8/9 there, docs/SEMANTICS.md §3.9/§3.10) stay as they are. A model without a self node, or max_length < 1, is
    refused.
  SHARED_BUFFER: every self node reads P at input 8: the graph input it reads there already, else a graph input
    ``past_sequence_length`` that (cross-attention) MultiHeadAttention nodes read at input 8, else the new input
    ``past_sequence_length`` (int32, (1,)); a kept input keeps its name. Its pasts and presents are declared (B, N,
    max_length, H), B the batch or the pasts' own dim 0. With ``beams`` W, or a cache_indirection the self nodes read
    already, input 9 is ``cache_indirection`` (int32, (B / W, W, max_length)), found or made the same way: beam search's
    map of which beam's cache row each row reads (docs/SEMANTICS.md §3.10).
  OTHER_INPUTS: with ``batch``, a dim 0 that is not static becomes the batch. The step length L is the dim 1 the self
    nodes' queries get (input_ids' dim 1): a symbolic one is pinned to ``step_length`` (1 when not given) in every input
    that carries its symbol; a static one must equal ``step_length`` when that is given. Nothing else changes
    (cross-attention K/V stay as the first decoder step computed them). An input that carries the pasts' length dim is
    refused: its shape would still change every step (when the pasts are buffers already, rule SELF_NODES, that dim is
    M, and such an input gets max_length).
  AFFINE_EVALUATION: with the inputs of rules SHARED_BUFFER and OTHER_INPUTS and shape inference (ORT's symbolic one,
    which knows the com.microsoft ops; ONNX's when it fails), every integer tensor of the shape arithmetic is evaluated
    at build time as ``const + P * coeff`` (``Affine``). ``Shape`` of a self past is [B, N, 0, H] + P * [0, 0, 1, 0]
    ([B, N, max_length, H] when the pasts are buffers already), a kept ``past_sequence_length`` input is 0 + P * 1,
    ``Shape`` of any other tensor its static dims; elements set by a dim that stays symbolic (the batch, when it is not
    given) are marked unknown. The ops are ``EVALUATORS``; any other default-domain node whose inputs are all integer
    constants is folded by onnx's reference evaluator (both in graph/affine.py).
  MATERIALIZATION: a constant that a remaining node reads becomes an initializer of its own name; an affine value
    becomes ``Add(const, Mul(P, coeff))`` in int64 under its own name (P: ``past_sequence_length`` cast to an int64
    scalar, once); a value with unknown elements keeps its node. Nodes and initializers that nothing reads any more are
    removed.
  HostReads: no remaining node reads on the host (``HOST_INPUTS``: the inputs ORT's CUDA kernels take in CPU memory) a
    value that depends on P, no Shape node reads a self past, and no remaining node with a subgraph (If, Loop, Scan)
    reads a value that depends on P: the rewrite does not follow a subgraph. With ``batch`` given, no Shape node remains
    and every such input is constant. Each break is a StaticCacheError naming the node, and, where symbolic input dims
    feed the value, each such input, dim and symbol with the flag that pins it (``--batch``, ``--step-length``) or the
    word that none does (graph/static_cache_checks.py).
  PACKED_PROJECTIONS: with ``packed_qkv`` (the default), a self node whose query, key and value are each a
    ``MatMul(X, W)`` of the same X by a constant initializer W (E, N*H), read by nothing else, gets them as one
    ``MatMul(X, W_qkv)``, W_qkv (E, N*3*H) their columns interleaved per head (n, slot, h), and a ``Reshape`` to
    (0, 0, N, 3, H): the node's query becomes that packed QKV input and its key and value are empty; its bias stays
    (docs/SEMANTICS.md, "Packed QKV / KV: ours"; graph/packed_projections.py). One GEMM reads the three weights of a
    decode step instead of three. Stock ORT refuses packed QKV with a past: the rewritten model then runs only with
    its attention nodes claimed by mha_ep (what every loop over it does); ``packed_qkv=False`` (``--no-packed-qkv``)
    keeps the three MatMuls. A node that does not match keeps them, and the report says why.
  SHARED_CROSS_KV: with ``beams`` W and ``shared_cross_kv`` (``--shared-cross-kv``), a cross-attention node (no past)
    whose key and value are BNSH graph inputs that only cross-attention nodes read, with no key_padding_mask,
    attention_bias or qk output, reads them with one row per batch entry, (B / W, N, T, H), instead of one per beam:
    its query (B, L, D) is reshaped to (B / W, W * L, D), the W beams' rows of an entry becoming W * L query rows over
    the entry's keys, and its output back to (B, L, Dv). The same attention (no row of a cross node sees another's
    scores), and each K and V row is read once an entry instead of W times. The loop binds the encoder's keys and
    values unrepeated (the rewrite's metadata names the inputs: StaticDecoder sizes them by entries). A node that does
    not match keeps its inputs, and the report says why. Stock ORT runs the rewritten nodes as they are.
  DECODE_MATMUL: with ``decode_matmul`` (``--decode-matmul``), a MatMul by a constant float16 / bfloat16 weight W
    (K, N) whose input has at most GEMV_MAX_M (8) static rows (the batch given) becomes mha_ep::DecodeMatMul(X, W^T),
    W^T (N, K) a new initializer: the native library's product for a few rows, which reads the weight once at HBM's
    rate where cuBLAS's GEMMs do not (engine/cuda/gemv.py). The model then runs only with mha_ep registered (its
    op), as every loop here does. A MatMul that does not match stays, and the report counts them.
  declare_outputs: the presents as rule SHARED_BUFFER; every other output gets the dims shape inference found static.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_ep import spec
from mha_ep.claim.names import node_name
from mha_ep.graph.affine import (
    DEFAULT_DOMAINS, EVALUATORS, INTEGER_TYPES, MAX_ELEMENTS, Affine, Evaluated, bounded, fold,
)
from mha_ep.graph.graph_facts import (
    Dim, ancestor_inputs, dims_of, fresh_name, infer_shapes, inferred_dims, names_read, set_dims, taken_names,
)
from mha_ep.graph.model_io import load_model
from mha_ep.graph.packed_projections import Projections, match_projections, packed_shape, packed_weight, readers_of
from mha_ep.graph.static_cache_checks import (
    CACHE_INDIRECTION, P_SYMBOL, PAST_KEY, PAST_SEQUENCE_LENGTH, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, QK,
    SHARED_SLOTS, HostReads, StaticCacheError, check_arguments, check_buffer_lengths, check_readers,
    check_self_node, check_shared_input, is_self, refuse_the_pasts_length, shared_input_name, slots_of, where,
)
from mha_ep.graph.static_cache_result import StaticCacheResult

# The public names: the pass, what it returns and raises, and the names of the inputs it adds.
__all__ = ["static_cache", "StaticCacheResult", "StaticCacheError", "PAST_SEQUENCE_LENGTH", "CACHE_INDIRECTION"]


def _the_step(steps: Sequence[Dim]) -> Dim:
    """The step length from the self queries' dim 1 (None where inference found none): the one value they agree on,
    else None. Inference may stop short of the later layers (at a node it does not know), so the unknown ones do
    not count."""
    known = set(steps) - {None}
    return next(iter(known)) if len(known) == 1 else None


def _carriers(inputs: Sequence[onnx.ValueInfoProto], symbol: str, skip: Set[str]) -> List[Tuple[str, int]]:
    """Every (input, dim index) whose dim is ``symbol``, the inputs in ``skip`` left out."""
    return [(v.name, i) for v in inputs if v.name not in skip for i, d in enumerate(dims_of(v) or ()) if d == symbol]


def static_cache(model, max_length: int, batch: Optional[int] = None, beams: int = 0,
                 step_length: Optional[int] = None, packed_qkv: bool = True,
                 shared_cross_kv: bool = False, decode_matmul: bool = False) -> StaticCacheResult:  # fmt: skip
    """Rewrite a decoder-with-past (an onnx.ModelProto or a path; not modified) into the static-cache form of the
    module docstring: self pasts and presents (B, N, max_length, H) sharing one buffer, an input
    ``past_sequence_length`` (int32, (1,)), no shape arithmetic on the host. ``batch``: B (rows: batch entries x
    beams) fixed in every input's dim 0, or None to keep it symbolic. ``beams`` > 0: a cache_indirection input for
    beam search (rule SHARED_BUFFER). ``step_length``: the step length L a symbolic one is pinned to (None: 1), or
    that a static one must be (rule OTHER_INPUTS). Raises StaticCacheError naming the node or input for a model it
    cannot rewrite. ``packed_qkv``: each self node's Q, K and V projections as one MatMul and a packed QKV query
    (rule PACKED_PROJECTIONS; the model then runs only with mha_ep claiming its attention nodes); False keeps them
    apart. ``shared_cross_kv`` (with ``beams``): the cross-attention keys and values one row per batch entry, not
    per beam (rule SHARED_CROSS_KV). ``decode_matmul``: the weight products of a few rows as mha_ep::DecodeMatMul
    (rule DECODE_MATMUL)."""
    check_arguments(max_length, batch, beams, step_length)  # rule SELF_NODES
    if shared_cross_kv and not beams:
        raise StaticCacheError("shared_cross_kv (--shared-cross-kv) shares the cross-attention keys and values among "
                               "a batch entry's beams: give beams (--beams W) too")  # fmt: skip
    return StaticCachePass(load_model(model), int(max_length), None if batch is None else int(batch), int(beams),
                           None if step_length is None else int(step_length), bool(packed_qkv),
                           bool(shared_cross_kv), bool(decode_matmul)).run()  # fmt: skip


class StaticCachePass:
    """One run of the rules over a private copy of a model. The state they share is kept on the instance: the self
    nodes and their pasts, the P and cache_indirection inputs, the step length, the inferred dims, the evaluated
    values, the tainted names, the new nodes and initializers, what stays and what was removed."""

    def __init__(self, model: onnx.ModelProto, max_length: int, batch: Optional[int], beams: int = 0,
                 step_length: Optional[int] = None, packed_qkv: bool = True,
                 shared_cross_kv: bool = False, decode_matmul: bool = False):  # fmt: skip
        self.model = model
        self.graph = model.graph
        self.max_length = max_length
        self.batch = batch
        self.beams = beams
        self.step_length = step_length
        self.graph_inputs = {v.name: v for v in self.graph.input}
        self.graph_outputs = {v.name: v for v in self.graph.output}
        self.self_nodes: List[onnx.NodeProto] = []
        self.pasts: Set[str] = set()
        self.presents: Set[str] = set()
        self.buffers_already = False  # rule SELF_NODES: the self nodes read P already, pasts of M rows
        self.p_input = PAST_SEQUENCE_LENGTH  # rule SHARED_BUFFER: the graph input P is read from
        self.ci_input: Optional[str] = None  # rule SHARED_BUFFER: cache_indirection's input, if any
        self.kept_inputs: List[str] = []  # rule SHARED_BUFFER: which of the two the model had already
        self.step: Optional[int] = None  # rule OTHER_INPUTS: the step length, when known
        self.step_symbol: Optional[str] = None  # rule OTHER_INPUTS: its symbol, when the model had one
        self.pinned: List[Tuple[str, int, str, int]] = []  # rule OTHER_INPUTS: (input, dim, symbol, value)
        self.symbol_values: Dict[str, int] = {}  # rule OTHER_INPUTS: the symbols pinned, for rule ``declare_outputs``
        self.dims: Dict[str, Tuple[Dim, ...]] = {}  # rule AFFINE_EVALUATION's inferred dims, P as P_SYMBOL
        self.free: Set[str] = set()  # dim_params that stay symbolic and are not the pasts' length
        self.known = Evaluated()  # rule AFFINE_EVALUATION's values, constants and tainted names
        self.new_nodes: List[onnx.NodeProto] = []
        self.new_initializers: List[onnx.TensorProto] = []
        self.p_scalar: Optional[str] = None
        self.kept_shapes: List[str] = []
        self.removed = 0
        self.packed_qkv = packed_qkv
        self.packing: List[Tuple[str, str]] = []  # rule PACKED_PROJECTIONS: (self node, "" packed or why not)
        self.shared_cross_kv = shared_cross_kv
        self.sharing: List[Tuple[str, str]] = []  # rule SHARED_CROSS_KV: (cross node, "" shared or why not)
        self.entry_inputs: List[str] = []  # rule SHARED_CROSS_KV: the inputs of one row per batch entry
        self.decode_matmul = decode_matmul
        self.matmuls: List[Tuple[str, str]] = []  # rule DECODE_MATMUL: (MatMul, "" rewritten or why not)
        self.taken = taken_names(self.graph)

    def run(self) -> StaticCacheResult:
        """Every rule in order; the rewritten model and what was done."""
        self.find_self_nodes()
        self.find_shared_inputs()
        check_readers(self.graph, self.pasts, self.presents)
        self.declare_inputs()
        self.evaluate()
        kept = self.materialize_and_prune()
        for node in kept:
            if is_self(node, self.presents):
                self.share_buffer(node)
        if self.packed_qkv:
            kept = self.pack_projections(kept)
        if self.shared_cross_kv:
            kept = self.share_cross_kv(kept)
        if self.decode_matmul:
            kept = self.decode_matmuls(kept)
        del self.graph.node[:]
        self.graph.node.extend(self.new_nodes + kept)
        self.graph.initializer.extend(self.new_initializers)
        if self.p_input not in self.graph_inputs:
            self.graph.input.append(helper.make_tensor_value_info(self.p_input, onnx.TensorProto.INT32, [1]))
        if self.ci_input is not None and self.ci_input not in self.graph_inputs:
            entries = "batch_entries" if self.batch is None else self.batch // self.beams
            self.graph.input.append(helper.make_tensor_value_info(self.ci_input, onnx.TensorProto.INT32,
                                                                  [entries, self.beams, self.max_length]))  # fmt: skip
        self.declare_outputs()
        self.declare_entry_inputs()
        self.drop_unused()
        result = StaticCacheResult(self.model, self.layers(), self.max_length, self.batch, self.removed,
                                   self.notes(), self.beams, self.step, tuple(self.pinned), self.p_input,
                                   self.ci_input, tuple(self.kept_inputs),
                                   tuple(self.packing) if self.packed_qkv else None,
                                   tuple(self.sharing) if self.shared_cross_kv else None,
                                   tuple(self.entry_inputs),
                                   tuple(self.matmuls) if self.decode_matmul else None)  # fmt: skip
        result.stamp()
        return result

    # rule SELF_NODES
    def find_self_nodes(self) -> None:
        """The MultiHeadAttention nodes with a past, each checked; StaticCacheError when there is none."""
        mha = [n for n in self.graph.node if n.op_type == spec.OP_TYPE and n.domain == spec.ORT_DOMAIN]
        for node in mha:
            slots = slots_of(node)
            if not (slots[PAST_KEY] or slots[PAST_VALUE]):
                continue
            check_self_node(node, slots, self.graph_inputs, self.graph_outputs, self.batch)
            self.self_nodes.append(node)
            self.pasts.update((slots[PAST_KEY], slots[PAST_VALUE]))
            self.presents.update((node.output[PRESENT_KEY], node.output[PRESENT_VALUE]))
        if not self.self_nodes:
            found = "; ".join(f"{where(n)} has no past_key/past_value" for n in mha)
            raise StaticCacheError(
                "no self-attention com.microsoft::MultiHeadAttention node with a past (past_key/past_value graph "
                f"inputs, present_key/present_value graph outputs): {found or 'the model has no such node at all'}; "
                "give the decoder-with-past, not the first decoder step or an encoder"
            )

    # rules SELF_NODES and SHARED_BUFFER
    def find_shared_inputs(self) -> None:
        """The graph inputs of P and cache_indirection: the ones the self nodes read at inputs 8/9 already (the same
        on every self node, or none on any), else ones of those names that (cross-attention) MultiHeadAttention
        nodes read there, else new ones (cache_indirection only with beams)."""
        wired = []
        for slot in SHARED_SLOTS:
            name = shared_input_name(self.self_nodes, slot)
            if name:
                check_shared_input(self.self_nodes[0], slot, name, self.graph, self.graph_inputs, self.beams)
            wired.append(name)
        self.buffers_already = bool(wired[0])
        self.p_input = wired[0] or self.reusable(spec.SLOT[PAST_SEQUENCE_LENGTH], PAST_SEQUENCE_LENGTH)
        if wired[1] or self.beams:
            self.ci_input = wired[1] or self.reusable(spec.SLOT[CACHE_INDIRECTION], CACHE_INDIRECTION)
        self.kept_inputs = [n for n in (self.p_input, self.ci_input) if n in self.graph_inputs]

    def reusable(self, slot: int, name: str) -> str:
        """``name`` for input ``slot`` of the self nodes: a graph input of that name that MultiHeadAttention nodes
        read at ``slot`` (cross-attention nodes, which ignore it there) and nowhere else is kept, checked; else the
        name must be free."""
        readers = self.readers_at(name, slot)
        if name in self.graph_inputs and readers:
            check_shared_input(readers[0], slot, name, self.graph, self.graph_inputs, self.beams)
            return name
        if name in self.taken:
            raise StaticCacheError(f"the model already has a tensor named {name!r}, an input the rewrite adds, and it "
                                   f"is not a graph input that MultiHeadAttention nodes read at input {slot}; "
                                   "rename it first")  # fmt: skip
        return name

    def readers_at(self, name: str, slot: int) -> List[onnx.NodeProto]:
        """The MultiHeadAttention nodes that read ``name`` at input ``slot``; none when one reads it elsewhere."""
        mha = [n for n in self.graph.node if n.op_type == spec.OP_TYPE and n.domain == spec.ORT_DOMAIN]
        at = {id(node): [i for i, n in enumerate(node.input) if n == name] for node in mha}
        if any(set(found) - {slot} for found in at.values()):
            return []
        return [node for node in mha if at[id(node)]]

    # rules SHARED_BUFFER and OTHER_INPUTS
    def declare_inputs(self) -> None:
        """The inputs' dims: the batch (rule OTHER_INPUTS), the pasts' length as P_SYMBOL until rule
        ``declare_outputs`` (rule AFFINE_EVALUATION infers with it), or max_length where the pasts are buffers
        already, and the P and cache_indirection inputs (rule SHARED_BUFFER)."""
        lengths = {dims_of(self.graph_inputs[p])[2] for p in self.pasts} - {None}
        if self.buffers_already:
            check_buffer_lengths(self.pasts, self.graph_inputs, self.p_input, self.max_length)
            if self.ci_input in self.graph_inputs:
                lengths.add(dims_of(self.graph_inputs[self.ci_input])[2])
        for value in self.graph.input:
            dims = list(dims_of(value) or ())
            if value.name == self.ci_input:
                dims = self.cache_indirection_dims(dims)
            elif value.name == self.p_input:
                continue
            elif self.batch is not None and dims and not isinstance(dims[0], int):
                if dims[0]:
                    self.symbol_values[dims[0]] = self.batch
                dims[0] = self.batch
            if value.name in self.pasts:
                dims[2] = self.max_length if self.buffers_already else P_SYMBOL
            elif self.buffers_already:
                dims = [self.max_length if isinstance(d, str) and d in lengths else d for d in dims]
            else:
                refuse_the_pasts_length(value.name, dims, lengths)
            if dims:
                set_dims(value, dims)

    def cache_indirection_dims(self, dims: List[Dim]) -> List[Dim]:
        """Rule SHARED_BUFFER for a cache_indirection the model has: (B / W, W, max_length), W the beams or its own
        dim 1."""
        beams = self.beams or dims[1]
        entries = self.batch // beams if self.batch is not None and isinstance(beams, int) and beams else dims[0]
        if isinstance(dims[0], int) and isinstance(entries, int) and dims[0] != entries:
            raise StaticCacheError(f"input {self.ci_input!r} (cache_indirection) has the static dim 0 {dims[0]}, not "
                                   f"--batch {self.batch} / {beams} beams = {entries}")  # fmt: skip
        return [entries, beams, self.max_length]

    # rule AFFINE_EVALUATION
    def evaluate(self) -> None:
        """Every node in graph order: its values as Affine when it is evaluable, else its outputs tainted when it
        reads a value that depends on P. The step length is found and pinned first (rule OTHER_INPUTS)."""
        self.dims = self.infer()
        if self.pin_step_length():
            self.dims = self.infer()
        self.free = {d for v in self.graph.input for d in dims_of(v) or () if isinstance(d, str)} - {P_SYMBOL}
        for init in self.graph.initializer:
            if init.name in self.graph_inputs:
                continue
            if init.data_type in INTEGER_TYPES and bounded(init.dims):
                self.known.values[init.name] = Affine.of(numpy_helper.to_array(init))
            else:
                self.known.constants.add(init.name)
        if self.p_input in self.graph_inputs:  # a kept past_sequence_length input: P itself
            shape = dims_of(self.graph_inputs[self.p_input])
            self.known.values[self.p_input] = Affine.of(np.zeros(shape, np.int32), np.ones(shape, np.int64))
        opsets = list(self.model.opset_import)
        for node in self.graph.node:
            results = self.evaluate_node(node, opsets)
            if results is not None:
                self.known.values.update((name, value) for name, value in zip(node.output, results) if name)
            elif node.op_type == "Constant":
                self.known.constants.update(node.output)
            elif any(self.known.depends_on_p(name) for name in self.data_read(node)):
                self.known.tainted.update(node.output)

    def data_read(self, node: onnx.NodeProto) -> List[str]:
        """The tensors whose values ``node``'s outputs depend on: all it reads, but P and cache_indirection at an
        attention node's inputs 8/9 (P is the buffer's fill there, not a value its outputs are shaped by)."""
        if node.op_type == spec.OP_TYPE and node.domain == spec.ORT_DOMAIN:
            return [name for i, name in enumerate(node.input) if name and i not in SHARED_SLOTS]
        return names_read(self.graph, node)

    def infer(self) -> Dict[str, Tuple[Dim, ...]]:
        """The dims shape inference finds for every tensor, the pasts' as declared."""
        dims = inferred_dims(infer_shapes(self.model_for_inference()))
        dims.update((past, dims_of(self.graph_inputs[past])) for past in self.pasts)  # P_SYMBOL, as declared
        return dims

    # rule OTHER_INPUTS
    def pin_step_length(self) -> bool:
        """The step length: the dim 1 of the self nodes' queries. A symbol of the inputs is pinned to step_length
        (1 when not given) in every input that carries it; a static one is checked against step_length. Whether
        inputs were pinned."""
        steps = [(self.dims.get(node.input[0]) or (None, None))[1] for node in self.self_nodes]
        step = _the_step(steps)
        carriers = _carriers(self.graph.input, step, self.pasts) if isinstance(step, str) else []
        if isinstance(step, int):
            self.step = step
            if self.step_length is not None and self.step_length != step:
                raise StaticCacheError(f"the step length is static in the model: {self.static_step_source(step)} is "
                                       f"{step}, not --step-length {self.step_length}; give --step-length {step} or "
                                       "leave it out")  # fmt: skip
            return False
        if not carriers:
            if self.step_length is not None:
                queries = ", ".join(f"{node.input[0]!r}" for node in self.self_nodes)
                raise StaticCacheError(
                    f"--step-length {self.step_length}: the self-attention queries ({queries}) have dim 1 "
                    f"{[s if s is not None else 'unknown' for s in steps]}, not one symbol of the inputs, so the "
                    "rewrite cannot tell which input dim to pin: declare input_ids' dim 1 in the model"
                )
            return False
        self.step, self.step_symbol = self.step_length or 1, step
        self.symbol_values[step] = self.step
        for name, index in carriers:
            dims = list(dims_of(self.graph_inputs[name]))
            dims[index] = self.step
            set_dims(self.graph_inputs[name], dims)
            self.pinned.append((name, index, step, self.step))
        return True

    def static_step_source(self, step: int) -> str:
        """For a message: the inputs the self queries come from whose dim 1 is ``step`` (input_ids'), else the
        queries themselves."""
        skip = self.pasts | {self.p_input, self.ci_input}
        found = [name for name in ancestor_inputs(self.graph, [n.input[0] for n in self.self_nodes])
                 if name not in skip and len(dims_of(self.graph_inputs[name]) or ()) >= 2
                 and dims_of(self.graph_inputs[name])[1] == step]  # fmt: skip
        if found:
            return " and ".join(f"input {name!r} dim 1" for name in found)
        return f"the self-attention query {self.self_nodes[0].input[0]!r} dim 1"

    def model_for_inference(self) -> onnx.ModelProto:
        """The model to infer shapes on: its outputs' shapes left to inference, and its large float weights as
        inputs of their dims (inference reads only their dims; the probe copies no weights, so a model over 2 GiB
        still fits one protobuf)."""
        graph = self.graph
        light, inputs = [], list(graph.input)
        for init in graph.initializer:
            if init.data_type in INTEGER_TYPES or bounded(init.dims):
                light.append(init)
            elif init.name not in self.graph_inputs:
                inputs.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        outputs = [helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, None) for v in graph.output]
        probe = helper.make_model(
            helper.make_graph(graph.node, graph.name, inputs, outputs, light, value_info=graph.value_info),
            opset_imports=self.model.opset_import, ir_version=self.model.ir_version,
        )
        probe.functions.extend(self.model.functions)
        return probe

    def evaluate_node(self, node: onnx.NodeProto, opsets) -> Optional[List[Affine]]:
        """The values of ``node``'s outputs (rule AFFINE_EVALUATION), or None when it is not evaluable at build time."""
        if node.domain not in DEFAULT_DOMAINS:
            return None
        if node.op_type == "Shape":
            value = self.shape_value(node)
            return None if value is None else [value]
        args = [self.known.values.get(name) if name else None for name in node.input]
        if any(name and value is None for name, value in zip(node.input, args)):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        evaluator = EVALUATORS.get(node.op_type)
        try:
            value = evaluator(args, attrs) if evaluator is not None else None
        except (IndexError, ValueError) as error:  # numpy's word on indices or shapes that do not fit
            raise StaticCacheError(f"{where(node)}: its inputs do not fit it ({error}); check the model with "
                                   "onnx.checker and stock ORT first") from None  # fmt: skip
        if value is not None and value.const.size <= MAX_ELEMENTS:
            return [value]
        return fold(node, args, opsets)

    def shape_value(self, node: onnx.NodeProto) -> Optional[Affine]:
        """``Shape`` from the inferred dims: the pasts' length is P, a free dim an unknown element; None (and the
        node tainted) when a dim is anything else (an expression in P, or not known at all)."""
        dims = self.dims.get(node.input[0])
        if dims is None or not all(isinstance(d, int) or d == P_SYMBOL or d in self.free for d in dims):
            self.known.tainted.update(node.output)
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        part = slice(attrs.get("start", 0), attrs.get("end", len(dims)))  # Python's clamping is ONNX's
        return Affine.of(
            [d if isinstance(d, int) else 0 for d in dims][part],
            [int(d == P_SYMBOL) for d in dims][part],
            [isinstance(d, str) and d != P_SYMBOL for d in dims][part],
        )

    # rules MATERIALIZATION and ``HostReads``
    def materialize_and_prune(self) -> List[onnx.NodeProto]:
        """Walk the graph backwards from its outputs: a node nothing reads goes; an evaluated node whose values are
        known goes, its values materialized; any other node stays, checked (rule ``HostReads``). The nodes that
        stay, in order."""
        host_reads = HostReads(self.graph, self.graph_inputs, self.known, self.pasts, self.dims, self.batch,
                               self.step_symbol)  # fmt: skip
        needed = set(self.graph_outputs)
        kept = []
        for node in reversed(self.graph.node):
            wanted = [name for name in node.output if name in needed]
            values = [self.known.values.get(name) for name in wanted]
            if not wanted or all(v is not None and v.known for v in values):
                for name, value in zip(wanted, values):
                    self.materialize(name, value)
                self.removed += 1
                continue
            host_reads.check(node)
            if node.op_type == "Shape" and node.domain in DEFAULT_DOMAINS:  # a Shape node that stays reads the batch
                self.kept_shapes.append(node_name(node))
            kept.append(node)
            needed.update(names_read(self.graph, node))
        return kept[::-1]

    def materialize(self, name: str, value: Affine) -> None:
        """Rule MATERIALIZATION: a constant as an initializer named ``name``; an affine value as
        Add(const, Mul(P, coeff))."""
        if value.constant:
            self.new_initializers.append(numpy_helper.from_array(value.const, name))
            return
        coeff = self.initializer(f"{name}/static_cache.coeff", value.coeff)
        const = self.initializer(f"{name}/static_cache.const", value.const.astype(np.int64))
        scaled = self.new_name(f"{name}/static_cache.scaled")
        wide = name if value.const.dtype == np.int64 else self.new_name(f"{name}/static_cache.int64")
        self.new_nodes += [
            helper.make_node("Mul", [self.p(), coeff], [scaled], name=scaled),
            helper.make_node("Add", [const, scaled], [wide], name=self.new_name(f"{name}/static_cache.add")),
        ]
        if wide != name:
            cast = self.new_name(f"{name}/static_cache.cast")
            to = helper.np_dtype_to_tensor_dtype(value.const.dtype)
            self.new_nodes.append(helper.make_node("Cast", [wide], [name], name=cast, to=to))

    def p(self) -> str:
        """P as an int64 scalar on the device: Reshape(Cast(past_sequence_length, int64), []), made once."""
        if self.p_scalar is None:
            wide = self.new_name("static_cache/past_sequence_length_int64")
            self.p_scalar = self.new_name("static_cache/P")
            scalar = self.initializer("static_cache/scalar_shape", np.zeros(0, np.int64))
            self.new_nodes[:0] = [
                helper.make_node("Cast", [self.p_input], [wide], name=wide, to=onnx.TensorProto.INT64),
                helper.make_node("Reshape", [wide, scalar], [self.p_scalar], name=self.p_scalar),
            ]
        return self.p_scalar

    # rule SHARED_BUFFER
    def share_buffer(self, node: onnx.NodeProto) -> None:
        """A self node's inputs padded to eight, then input 8 P's input (and input 9 cache_indirection's, if any);
        a node that reads them already keeps them, as they are the same names."""
        inputs = list(node.input)[: SHARED_SLOTS[0]]
        del node.input[:]
        node.input.extend(inputs + [""] * (SHARED_SLOTS[0] - len(inputs)) + [self.p_input]
                          + ([self.ci_input] if self.ci_input else []))  # fmt: skip

    # rule PACKED_PROJECTIONS
    def pack_projections(self, kept: List[onnx.NodeProto]) -> List[onnx.NodeProto]:
        """Each self node's three projection MatMuls as one MatMul and a Reshape, in the place of the first of them
        (graph/packed_projections.py), or left as they are with the reason; the nodes that stay, in order."""
        producers = {name: node for node in kept for name in node.output if name}
        readers = readers_of(kept, lambda node: names_read(self.graph, node))
        constants = {t.name: t for t in self.graph.initializer if t.name not in self.graph_inputs}
        replaced: Dict[int, List[onnx.NodeProto]] = {}  # id(a projection MatMul) -> what stands in its place
        for node in kept:
            if not is_self(node, self.presents):
                continue
            _, heads, _, head_size = dims_of(self.graph_inputs[node.input[PAST_KEY]])  # N, H static: rule SELF_NODES
            found = match_projections(node, producers, readers, constants, self.graph_outputs, heads, head_size)
            if isinstance(found, str):
                self.packing.append((node_name(node), found))
                continue
            first = min(found.matmuls, key=kept.index)
            replaced.update((id(m), []) for m in found.matmuls)
            replaced[id(first)] = self.packed_query(node, found, heads, head_size)
            self.packing.append((node_name(node), ""))
        return [new for node in kept for new in replaced.get(id(node), [node])]

    def packed_query(self, node: onnx.NodeProto, found: Projections, heads: int, head_size: int) -> list:
        """Rule PACKED_PROJECTIONS for one self node: MatMul(X, W_qkv) and its Reshape to (B, L, N, 3, H), which
        becomes the node's query; its key and value inputs become empty."""
        name = node_name(node) or node.output[0]
        weight = self.initializer(f"{name}/packed_qkv.weight", packed_weight(found.weights, heads, head_size))
        shape = self.initializer(f"{name}/packed_qkv.shape", packed_shape(heads, head_size))
        product, packed = self.new_name(f"{name}/packed_qkv.matmul"), self.new_name(f"{name}/packed_qkv")
        node.input[0], node.input[1], node.input[2] = packed, "", ""
        return [helper.make_node("MatMul", [found.source, weight], [product], name=product),
                helper.make_node("Reshape", [product, shape], [packed], name=packed)]

    # rule SHARED_CROSS_KV
    def share_cross_kv(self, kept: List[onnx.NodeProto]) -> List[onnx.NodeProto]:
        """Each cross node that matches, between a Reshape of its query to (B / W, W * L, D) and one of its output
        back to (B, L, Dv); the others as they are, with the reason. The nodes that stay, in order."""
        readers = readers_of(kept, lambda node: names_read(self.graph, node))
        placed: Dict[int, List[onnx.NodeProto]] = {}
        shared: List[str] = []
        for node in kept:
            if node.op_type != spec.OP_TYPE or node.domain != spec.ORT_DOMAIN or is_self(node, self.presents):
                continue
            found = self.cross_kv_refusal(node, readers)
            self.sharing.append((node_name(node), found if isinstance(found, str) else ""))
            if isinstance(found, str):
                continue
            model_dim, value_dim = found
            name = node_name(node) or node.output[0]
            rows = self.initializer(f"{name}/entry_rows.shape", np.array([-1, self.beams * self.step, model_dim]))
            back = self.initializer(f"{name}/beam_rows.shape", np.array([-1, self.step, value_dim]))
            query, context = self.new_name(f"{name}/entry_rows"), self.new_name(f"{name}/entry_context")
            output = node.output[0]
            before = helper.make_node("Reshape", [node.input[0], rows], [query], name=query)
            after = helper.make_node("Reshape", [context, back], [output], name=output + "/beam_rows")
            node.input[0], node.output[0] = query, context
            placed[id(node)] = [before, node, after]
            shared += [node.input[1], node.input[2]]
        self.entry_inputs = sorted(set(shared))
        return [new for node in kept for new in placed.get(id(node), [node])]

    def cross_kv_refusal(self, node: onnx.NodeProto, readers: Dict[str, List[onnx.NodeProto]]):
        """Rule SHARED_CROSS_KV's match for one cross node: (D, Dv), the query's and the output's last dims, or why
        it keeps one K / V row per beam."""
        slots = slots_of(node)
        key, value = slots[spec.SLOT["key"]], slots[spec.SLOT["value"]]
        if not (key in self.graph_inputs and value in self.graph_inputs):
            return "its key and value are not both graph inputs"
        if key == value:
            return "its key and value are one input (packed KV)"
        kv_dims = [dims_of(self.graph_inputs[name]) or () for name in (key, value)]
        if any(len(d) != 4 or not isinstance(d[1], int) or not isinstance(d[3], int) for d in kv_dims):
            return f"its key and value are not BNSH with static N and H: {kv_dims[0]}, {kv_dims[1]}"
        for name in (key, value):
            others = [n for n in readers.get(name, []) if n.op_type != spec.OP_TYPE or n.domain != spec.ORT_DOMAIN
                      or is_self(n, self.presents)]  # fmt: skip
            if others:
                return f"input {name!r} is read by {where(others[0])} too"
        for slot in ("key_padding_mask", "attention_bias"):
            if slots[spec.SLOT[slot]]:
                return f"it has a {slot} (one row per beam)"
        if len(node.output) > QK and node.output[QK]:
            return "it writes the qk output (one row per beam)"
        if not isinstance(self.step, int):
            return "the step length is not known (--step-length)"
        heads, head_size, value_head = kv_dims[0][1], kv_dims[0][3], kv_dims[1][3]
        query_dims = self.dims.get(node.input[0])  # (B, L, N*H) by the op's rules; None where inference stopped
        if query_dims is not None and (len(query_dims) != 3 or query_dims[2] not in (None, heads * head_size)):
            return f"its query is not (B, L, N*H) = (B, L, {heads * head_size}): {tuple(query_dims)}"
        return heads * head_size, heads * value_head

    # rule DECODE_MATMUL
    def decode_matmuls(self, kept: List[onnx.NodeProto]) -> List[onnx.NodeProto]:
        """Each MatMul that matches as mha_ep::DecodeMatMul over its weight transposed; the others as they are."""
        constants = {t.name: t for t in list(self.graph.initializer) + self.new_initializers
                     if t.name not in self.graph_inputs}  # fmt: skip
        out = []
        for node in kept:
            if node.op_type != "MatMul" or node.domain not in DEFAULT_DOMAINS:
                out.append(node)
                continue
            name = node_name(node) or node.output[0]
            why = self.decode_matmul_refusal(node, constants)
            self.matmuls.append((name, why or ""))
            if why:
                out.append(node)
                continue
            weight = constants[node.input[1]]
            dtype = "float16" if weight.data_type == onnx.TensorProto.FLOAT16 else "bfloat16"
            transposed = self.initializer(f"{name}/weight_nk", np.ascontiguousarray(numpy_helper.to_array(weight).T))
            out.append(helper.make_node(spec.MATMUL_OP_TYPE, [node.input[0], transposed], [node.output[0]],
                                        name=name, domain=spec.PLUGIN_DOMAIN,
                                        **{spec.ATTR_NODE: name, spec.ATTR_DTYPE: dtype}))  # fmt: skip
            self.declare_product(node.output[0], node.input[0], weight)
        if any(not why for _, why in self.matmuls):
            domains = {o.domain for o in self.model.opset_import}
            if spec.PLUGIN_DOMAIN not in domains:
                self.model.opset_import.append(helper.make_opsetid(spec.PLUGIN_DOMAIN, spec.PLUGIN_OPSET))
        return out

    def declare_product(self, output: str, x: str, weight: onnx.TensorProto) -> None:
        """The DecodeMatMul output's type and shape ((x's rows..., N), static) in the graph's value_info, where ONNX
        shape inference cannot reach (a plugin op): the partition pass reads a MultiHeadAttention's query type
        through it, and declines the node without it. A graph output is declared as one already."""
        if output in self.graph_outputs:
            return
        dims = list(self.dims[x][:-1]) + [int(weight.dims[1])]  # (decode_matmul_refusal: x's dims are static)
        for value in self.graph.value_info:
            if value.name == output:
                self.graph.value_info.remove(value)
                break
        self.graph.value_info.append(helper.make_tensor_value_info(output, weight.data_type, dims))

    def decode_matmul_refusal(self, node: onnx.NodeProto, constants: Dict[str, onnx.TensorProto]) -> Optional[str]:
        """Rule DECODE_MATMUL's match for one MatMul: None, or why it stays."""
        weight = constants.get(node.input[1])
        if weight is None:
            return "its weight is not a constant initializer"
        if len(weight.dims) != 2:
            return f"its weight has shape {tuple(weight.dims)}, not (K, N)"
        if weight.data_type not in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            return f"its weight is {onnx.TensorProto.DataType.Name(weight.data_type)}, not float16 or bfloat16"
        dims = self.dims.get(node.input[0])
        if not dims or not all(isinstance(d, int) for d in dims):
            return f"its input's dims are not all static ({tuple(dims or ())}; --batch)"
        rows = int(np.prod(dims[:-1], dtype=np.int64))
        if rows > spec.MATMUL_MAX_ROWS or dims[-1] != weight.dims[0]:
            return (f"its input is {tuple(dims)}: more than {spec.MATMUL_MAX_ROWS} rows, or not K = {weight.dims[0]} "
                    "wide")
        return None

    def declare_entry_inputs(self) -> None:
        """Rule SHARED_CROSS_KV: the shared inputs' dim 0 is the batch entries (B / W, or ``batch_entries``)."""
        if not self.entry_inputs:
            return
        entries = "batch_entries" if self.batch is None else self.batch // self.beams
        for value in self.graph.input:
            if value.name in self.entry_inputs:
                set_dims(value, [entries] + list(dims_of(value))[1:])

    # rules SHARED_BUFFER and ``declare_outputs``
    def declare_outputs(self) -> None:
        """The pasts and presents (B, N, max_length, H); every other output's dims where inference found them
        static (or a free dim), and a symbol pinned in the inputs (the batch, the step length) as its value."""
        buffers = {}
        for node in self.self_nodes:
            for past, present in ((node.input[PAST_KEY], node.output[PRESENT_KEY]),
                                  (node.input[PAST_VALUE], node.output[PRESENT_VALUE])):  # fmt: skip
                dims = list(dims_of(self.graph_inputs[past]))
                dims[2] = self.max_length
                buffers[past] = buffers[present] = dims
        for value in list(self.graph.input) + list(self.graph.output):
            if value.name in buffers:
                set_dims(value, buffers[value.name])
            if value.name in buffers or value.name not in self.graph_outputs:
                continue
            dims = list(dims_of(value) or ())
            found = self.dims.get(value.name)
            if found is not None and len(dims or found) == len(found):
                keep = dims or [None] * len(found)
                dims = [f if isinstance(f, int) or f in self.free else d for f, d in zip(found, keep)]
            if dims:
                set_dims(value, [self.symbol_values.get(d, d) if isinstance(d, str) else d for d in dims])

    # rule MATERIALIZATION
    def drop_unused(self) -> None:
        """Initializers nothing reads, and value_info of tensors no node makes any more."""
        graph = self.graph
        read = {name for node in graph.node for name in names_read(graph, node)} | set(self.graph_outputs)
        keep = [init for init in graph.initializer if init.name in read or init.name in self.graph_inputs]
        del graph.initializer[:]
        graph.initializer.extend(keep)
        produced = {name for node in graph.node for name in node.output}
        infos = [v for v in graph.value_info if v.name in produced]
        del graph.value_info[:]
        graph.value_info.extend(infos)

    def initializer(self, wanted: str, array: np.ndarray) -> str:
        """A new initializer holding ``array`` (any shape), under a name not yet taken; its name."""
        name = self.new_name(wanted)
        self.new_initializers.append(numpy_helper.from_array(array, name))
        return name

    def new_name(self, wanted: str) -> str:
        return fresh_name(wanted, self.taken)

    def layers(self) -> Tuple[Tuple[str, str, str, str], ...]:
        return tuple(
            (n.input[PAST_KEY], n.input[PAST_VALUE], n.output[PRESENT_KEY], n.output[PRESENT_VALUE])
            for n in self.self_nodes
        )

    def notes(self) -> List[str]:
        """The kept Shape nodes (a symbolic batch) and, with a batch, the inputs and outputs not fully static."""
        notes = []
        if self.kept_shapes:
            notes.append(
                f"{len(self.kept_shapes)} Shape node(s) read the symbolic batch at run time "
                f"({', '.join(self.kept_shapes)}): ORT's CUDA graph needs batch given"
            )
        symbolic = [f"{v.name} {list(dims_of(v) or ['unknown rank'])}"
                    for v in list(self.graph.input) + list(self.graph.output)
                    if any(not isinstance(d, int) for d in dims_of(v) or [None])]  # fmt: skip
        if symbolic and self.batch is not None:
            notes.append(f"not fully static: {'; '.join(symbolic)}")
        return notes
