"""Lift ``com.microsoft::Attention`` nodes into Q/K/V MatMuls + ``com.microsoft::MultiHeadAttention``.

ORT's transformers optimizer fuses Whisper's encoder self-attention and the first decoder step's self-attention
into the packed ``Attention`` op (one ``[hidden, D + D + Dv]`` weight, one packed bias, a combined ``present``
``(2, B, N, T, H)``), never into MHA. This pass rewrites each such node into the same computation spelled with MHA,
so that every attention of those models can be claimed by the plugin, in the main graph and in every subgraph
(ORT's Whisper chain keeps its encoder's self-attention as Attention inside WhisperBeamSearch's ``encoder`` graph):

    input_BSE ──MatMul(W[:, 0:D])──────▶ query_BSD ─┐
    input_BSE ──MatMul(W[:, D:2D])─────▶ key_BSD   ─┼─▶ MultiHeadAttention(bias = the packed bias, unchanged)
    input_BSE ──MatMul(W[:, 2D:2D+Dv])─▶ value_BSDv ┘      ├─▶ output_BSDv            (the Attention output name)
                                                            ├─▶ present_key_BNTH ─┐
                                                            └─▶ present_value_BNTH ┴─Unsqueeze(0)+Concat(0)─▶ present

Layout legend: B batch, S sequence, E input hidden, N heads, H head size, D = N*H, Dv value hidden, T total length.

Why it is exact: Attention computes ``X @ W + b`` as one GEMM and splits the result into Q, K, V; a column slice of
a product is the product with the column slice, so the three MatMuls give the same values (up to the summation
order inside the GEMM: measured max difference 3.2e-5 on Whisper tiny.en real weights). MHA adds the packed bias to
Q, K and V exactly as Attention does, and then runs the same scaled-dot-product attention with the same
``num_heads``, ``scale``, ``mask_filter_value`` and ``unidirectional`` attributes. Attention's ``present`` holds K
and V after the bias add, as MHA's ``present_key``/``present_value`` do.

Rules, each by its name (a node is lifted only when every rule passes; otherwise it stays byte for byte and the
reason is recorded). The code, the tests and the docs cite a rule as ``rule NAME``, never by a number
(tests/graph/test_rule_names.py holds them to it):
  PLAIN_ATTRIBUTES: no ``do_rotary``, no ``past_present_share_buffer``; ``num_heads`` > 0
  STATIC_WEIGHTS: ``weights`` is an initializer (sliced at build time; one that is also a graph input is read at run
    time) or its hidden sizes are known statically
  QKV_SIZES: ``qkv_hidden_sizes``, when given, has q == k (MHA needs key hidden == query hidden), all divisible by
    num_heads, and v == q when ``present`` is used (the combined present stacks K and V)
  NO_PAST: no ``past`` input (Attention's combined past, with its causal offset, is not lifted: the Whisper graphs that
    need lifting have none) and no ``past_sequence_length`` input
  MASK_INDEX_FORMS: ``mask_index``, when given, has one of the forms MHA's ``key_padding_mask`` reads the same way:
    (B, T) raw, (B, S, T) raw, or (B,) key lengths (told from the (2B,) end/start form by matching the query batch dim
    statically). The (2B,) and the Megatron (B, 1, M, M) forms are declined.
  BIAS_UNCHANGED: ``attention_bias`` passes through unchanged (same slot meaning and shape in both ops)

Only ``onnx`` and ``numpy`` are used.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

ORT_DOMAIN = "com.microsoft"
ATTENTION = "Attention"
MHA = "MultiHeadAttention"

# Attention input slots (ORT contrib op, 1.31.1)
A_INPUT, A_WEIGHTS, A_BIAS, A_MASK, A_PAST, A_ATTN_BIAS, A_PAST_SEQ_LEN = range(7)
# MultiHeadAttention input slots
M_QUERY, M_KEY, M_VALUE, M_BIAS, M_MASK, M_ATTN_BIAS = range(6)


@dataclass(frozen=True)
class LiftDecision:
    """What happened to one Attention node: ``lifted`` or not, and the reason when not."""

    node_name: str
    lifted: bool
    reason: str = ""


class _Decline(Exception):
    pass


def _input(node: onnx.NodeProto, slot: int) -> str:
    return node.input[slot] if len(node.input) > slot else ""


def _attrs(node: onnx.NodeProto) -> Dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


def _shape_map(model: onnx.ModelProto) -> Dict[str, Tuple[Optional[object], ...]]:
    """Static shapes by tensor name: each dim an int, a dim_param string, or None. From ONNX shape inference
    (which leaves com.microsoft outputs unknown) plus the graph's own value_info."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # shape inference is an aid here; a model it cannot read is still liftable
        inferred = model
    shapes: Dict[str, Tuple[Optional[object], ...]] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
            )
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _elem_type(model: onnx.ModelProto, name: str) -> Optional[int]:
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    for init in g.initializer:
        if init.name == name:
            return init.data_type
    return None


class _Plan:
    """The checked facts about one liftable node (every rule passed)."""

    def __init__(self, node, num_heads, q_hidden, k_hidden, v_hidden, weights, present_used):
        self.node = node
        self.num_heads = num_heads
        self.q_hidden, self.k_hidden, self.v_hidden = q_hidden, k_hidden, v_hidden
        self.weights = weights  # numpy array or None (runtime weights, split with a Split node)
        self.present_used = present_used


def _check(node, inits, shapes, used) -> _Plan:
    attrs = _attrs(node)
    # rule PLAIN_ATTRIBUTES
    if int(attrs.get("do_rotary", 0)) != 0:
        raise _Decline("do_rotary=1: MultiHeadAttention has no rotary embedding")
    if int(attrs.get("past_present_share_buffer", 0)) != 0:
        raise _Decline("past_present_share_buffer=1: a shared KV buffer is a DecoderMaskedMHA form")
    num_heads = int(attrs.get("num_heads", 0))
    if num_heads <= 0:
        raise _Decline(f"num_heads={num_heads} must be > 0")
    # rule NO_PAST
    if _input(node, A_PAST):
        raise _Decline(f"input 'past' ({_input(node, A_PAST)}) is given: Attention's combined past is not lifted")
    if _input(node, A_PAST_SEQ_LEN):
        raise _Decline("input 'past_sequence_length' is given: a buffer-sharing form, not lifted")
    # rule STATIC_WEIGHTS
    w_name = _input(node, A_WEIGHTS)
    weights = numpy_helper.to_array(inits[w_name]) if w_name in inits else None
    w_shape = weights.shape if weights is not None else shapes.get(w_name)
    if w_shape is None or len(w_shape) != 2 or not all(isinstance(d, int) and d > 0 for d in w_shape):
        raise _Decline(f"weights '{w_name}' shape {w_shape} is not a static 2D shape")
    total = int(w_shape[1])
    # rule QKV_SIZES
    sizes = attrs.get("qkv_hidden_sizes")
    if sizes:
        if len(sizes) != 3:
            raise _Decline(f"qkv_hidden_sizes {list(sizes)} must have 3 entries")
        q_hidden, k_hidden, v_hidden = (int(s) for s in sizes)
        if q_hidden != k_hidden:
            raise _Decline(f"qkv_hidden_sizes {list(sizes)}: MultiHeadAttention needs key hidden == query hidden")
    else:
        if total % 3:
            raise _Decline(f"weights '{w_name}' width {total} is not 3 * hidden")
        q_hidden = k_hidden = v_hidden = total // 3
    if q_hidden + k_hidden + v_hidden != total:
        raise _Decline(f"qkv_hidden_sizes {q_hidden, k_hidden, v_hidden} do not add up to weights width {total}")
    if q_hidden % num_heads or v_hidden % num_heads:
        raise _Decline(f"hidden sizes {q_hidden}/{v_hidden} are not divisible by num_heads={num_heads}")
    present = node.output[1] if len(node.output) > 1 else ""
    present_used = bool(present) and present in used
    if present_used and v_hidden != q_hidden:
        raise _Decline("present is used and value hidden != query hidden: the combined present cannot stack them")
    # rule MASK_INDEX_FORMS
    mask = _input(node, A_MASK)
    if mask:
        m_shape = shapes.get(mask)
        if m_shape is None:
            raise _Decline(f"mask_index '{mask}' has unknown rank: its form (1D/2D/3D/4D) cannot be told")
        if len(m_shape) == 1:
            batch = shapes.get(_input(node, A_INPUT), (None,))[0]
            if batch is None or m_shape[0] != batch:
                raise _Decline(
                    f"mask_index '{mask}' is 1D of length {m_shape[0]}, not statically the query batch {batch}: "
                    "the (B,) key-length and (2B,) end/start forms cannot be told apart"
                )
        elif len(m_shape) not in (2, 3):
            raise _Decline(f"mask_index '{mask}' is rank {len(m_shape)}: only (B,), (B,T) and (B,S,T) are lifted")
    return _Plan(node, num_heads, q_hidden, k_hidden, v_hidden, weights, present_used)


def plan_lift(model: onnx.ModelProto, path: str = "") -> List[LiftDecision]:
    """Decide, without changing anything, which Attention nodes ``lift_attention`` would lift, with reasons; a node
    inside a subgraph is named with its graph's path (``WhisperBeamSearch_0/encoder/Attention_1``)."""
    found = [LiftDecision(f"{path}{d.node_name}", d.lifted, d.reason) for d, _ in _decide(model)]
    for index, (owner, attribute, sub) in enumerate(_subgraphs(model.graph)):
        if _attention_anywhere(sub):
            where = f"{path}{owner.name or f'{owner.op_type}_{index}'}/{attribute}/"
            found += plan_lift(_as_model(model, sub), where)
    return found


def _decide(model: onnx.ModelProto):
    g = model.graph
    # An initializer that is also a graph input is only a default the caller may override (IR >= 4) or a
    # required input (IR 3): it is read at run time, never sliced at build time.
    graph_inputs = {i.name for i in g.input}
    inits = {i.name: i for i in g.initializer if i.name not in graph_inputs}
    shapes = _shape_map(model)
    used = _names_read(g) | {o.name for o in g.output}
    out = []
    for node in g.node:
        if node.op_type != ATTENTION or node.domain != ORT_DOMAIN:
            continue
        name = node.name or node.output[0]
        try:
            plan = _check(node, inits, shapes, used)
        except _Decline as why:
            out.append((LiftDecision(name, False, f"Attention node {name!r} not lifted: {why}"), None))
            continue
        out.append((LiftDecision(name, True), plan))
    return out


def _names_read(graph: onnx.GraphProto) -> set:
    """Every tensor name a node reads, in ``graph`` and in its subgraphs (which may read outer-scope names)."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= _names_read(sub)
    return names


def _unique(base: str, taken: set) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _rewrite(plan: _Plan, model: onnx.ModelProto, taken: set, shapes) -> Tuple[list, list, list]:
    """Nodes, initializers and value_infos replacing one Attention node."""
    node = plan.node
    base = node.name or node.output[0]
    opset = _default_opset(model)
    x = _input(node, A_INPUT)
    dq, dk, dv = plan.q_hidden, plan.k_hidden, plan.v_hidden
    nodes, inits, infos = [], [], []

    # Q/K/V weights: column slices of the packed weight.
    w_names = [_unique(f"{base}/lift/{p}_weight", taken) for p in "qkv"]
    if plan.weights is not None:
        cols = [(0, dq), (dq, dq + dk), (dq + dk, dq + dk + dv)]
        for nm, (a, b) in zip(w_names, cols):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(plan.weights[:, a:b]), nm))
    else:
        split_name = _unique(f"{base}/lift/qkv_split", taken)
        sizes = np.array([dq, dk, dv], dtype=np.int64)
        if opset >= 13:
            sizes_name = _unique(f"{base}/lift/qkv_sizes", taken)
            inits.append(numpy_helper.from_array(sizes, sizes_name))
            nodes.append(helper.make_node("Split", [_input(node, A_WEIGHTS), sizes_name], w_names, split_name, axis=1))
        else:
            nodes.append(helper.make_node("Split", [_input(node, A_WEIGHTS)], w_names, split_name, axis=1, split=list(sizes)))

    # The Q/K/V element type: the input's or output's, else the weights' (a float16 model's intermediate input
    # has no value_info); when none is known, no value_info is written (a wrong one would fail the load).
    elem = _elem_type(model, x) or _elem_type(model, node.output[0])
    if not elem and plan.weights is not None:
        elem = helper.np_dtype_to_tensor_dtype(plan.weights.dtype)
    if not elem:
        elem = _elem_type(model, _input(node, A_WEIGHTS))
    x_shape = shapes.get(x)
    qkv = []
    for p, w, hidden in zip("qkv", w_names, (dq, dk, dv)):
        out = _unique(f"{base}/lift/{p}", taken)
        nodes.append(helper.make_node("MatMul", [x, w], [out], _unique(f"{base}/lift/{p}_matmul", taken)))
        if elem and x_shape is not None and len(x_shape) == 3:
            infos.append(helper.make_tensor_value_info(out, elem, [x_shape[0], x_shape[1], hidden]))
        qkv.append(out)

    mha_inputs = qkv + [_input(node, A_BIAS), _input(node, A_MASK), _input(node, A_ATTN_BIAS)]
    while mha_inputs and not mha_inputs[-1]:
        mha_inputs.pop()
    mha_outputs = [node.output[0]]
    if plan.present_used:
        pk = _unique(f"{base}/lift/present_key", taken)
        pv = _unique(f"{base}/lift/present_value", taken)
        mha_outputs += [pk, pv]
    attrs = {k: v for k, v in _attrs(node).items() if k in ("num_heads", "unidirectional", "scale", "mask_filter_value")}
    nodes.append(helper.make_node(MHA, mha_inputs, mha_outputs, node.name, domain=ORT_DOMAIN, **attrs))

    if plan.present_used:
        # present (2, B, N, T, H) = stack(present_key, present_value)
        stacked = []
        for t in (pk, pv):
            u = _unique(f"{t}/unsqueezed", taken)
            if opset >= 13:
                axes = _unique(f"{base}/lift/axes0", taken)
                inits.append(numpy_helper.from_array(np.array([0], dtype=np.int64), axes))
                nodes.append(helper.make_node("Unsqueeze", [t, axes], [u], _unique(f"{t}/unsqueeze", taken)))
            else:
                nodes.append(helper.make_node("Unsqueeze", [t], [u], _unique(f"{t}/unsqueeze", taken), axes=[0]))
            stacked.append(u)
        nodes.append(helper.make_node("Concat", stacked, [node.output[1]], _unique(f"{base}/lift/present_concat", taken), axis=0))
    return nodes, inits, infos


def lift_attention(model: onnx.ModelProto, in_place: bool = False,
                   outer_names: frozenset = frozenset()) -> Tuple[onnx.ModelProto, int]:  # fmt: skip
    """Rewrite every liftable ``com.microsoft::Attention`` node into Q/K/V MatMuls + ``MultiHeadAttention``, in the
    main graph and in every subgraph (If / Loop / Scan bodies, the graphs of BeamSearch and WhisperBeamSearch:
    ORT's Whisper chain keeps its encoder's self-attention as Attention in one).

    Returns ``(new_model, lifted_count)``; the input model is not modified unless ``in_place`` (for a caller that
    owns its copy: deep-copying a real decoder takes a noticeable time, docs/BENCH.md, "Host-side choices"). Nodes
    that fail a rule of the module docstring stay unchanged (see ``plan_lift`` for the reasons). The MHA node keeps
    the Attention node's name and its output name, so downstream nodes and per-node reports are unaffected. Packed
    weights that are no longer used by any node are dropped. ``outer_names``: the names of the enclosing scopes
    (a subgraph's new names must not shadow them).
    """
    decisions = _decide(model)
    plans = {id_: p for id_, (_, p) in enumerate(decisions) if p is not None}
    if not plans and not any(_attention_anywhere(sub) for _, _, sub in _subgraphs(model.graph)):
        return model, 0
    new = model if in_place else copy.deepcopy(model)
    lifted = _lift_own_nodes(model, new, plans, outer_names) if plans else 0
    scope = frozenset(outer_names) | _graph_names(new.graph)
    for _, _, sub in _subgraphs(new.graph):
        if not _attention_anywhere(sub):
            continue
        wrapper = _as_model(new, sub)
        _, count = lift_attention(wrapper, in_place=True, outer_names=scope)
        if count:
            sub.CopyFrom(wrapper.graph)
            lifted += count
    if lifted and not any(imp.domain == ORT_DOMAIN for imp in new.opset_import):
        new.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return new, lifted


def _subgraphs(graph: onnx.GraphProto):
    """(owner node, attribute name, subgraph) for every graph attribute of ``graph``'s own nodes."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield node, attr.name, sub


def _attention_anywhere(graph: onnx.GraphProto) -> bool:
    return any(n.op_type == ATTENTION and n.domain == ORT_DOMAIN for n in graph.node) or any(
        _attention_anywhere(sub) for _, _, sub in _subgraphs(graph)
    )


def _graph_names(graph: onnx.GraphProto) -> frozenset:
    names = {n.name for n in graph.node} | {t for n in graph.node for t in list(n.input) + list(n.output)}
    return frozenset(names | {i.name for i in graph.initializer} | {i.name for i in graph.input})


def _as_model(model: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.ModelProto:
    """A subgraph as a model of its own (the enclosing model's opsets and IR version), for the graph-level rules."""
    wrapper = onnx.ModelProto()
    wrapper.ir_version = model.ir_version
    wrapper.opset_import.extend(model.opset_import)
    wrapper.graph.CopyFrom(graph)
    return wrapper


def _lift_own_nodes(model: onnx.ModelProto, new: onnx.ModelProto, plans: dict, outer_names) -> int:
    """The lift of ``model``'s own graph (not its subgraphs) into ``new``, its copy (or itself)."""
    g = new.graph
    shapes = _shape_map(model)
    taken = set(_graph_names(g)) | set(outer_names)
    by_name = {p.node.name or p.node.output[0]: p for p in plans.values()}
    new_nodes = []
    lifted = 0
    for node in g.node:
        name = node.name or (node.output[0] if node.output else "")
        plan = by_name.get(name) if node.op_type == ATTENTION and node.domain == ORT_DOMAIN else None
        if plan is None:
            new_nodes.append(node)
            continue
        nodes, inits, infos = _rewrite(plan, model, taken, shapes)
        new_nodes.extend(nodes)
        g.initializer.extend(inits)
        g.value_info.extend(infos)
        lifted += 1
    del g.node[:]
    g.node.extend(new_nodes)
    # Drop packed weights that nothing reads any more (subgraphs and graph inputs count as readers).
    used = _names_read(g) | {o.name for o in g.output} | {i.name for i in g.input}
    keep = [i for i in g.initializer if i.name in used]
    if len(keep) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(keep)
    return lifted
