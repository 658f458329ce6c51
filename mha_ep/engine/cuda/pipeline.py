"""The cuda backend's device-side interface: one call's device work, on device addresses, as a list of steps.

    steps = attention_steps(problem, facts, call, temporaries)

``call`` (a DeviceCall) says where the inputs lie and in which form, and where the outputs go; ``temporaries``
hands out device memory for the scratch buffers a path needs (``take(name, nbytes) -> address``). The result is a
list of steps.py values (kernel launches, cuBLAS GEMMs, copies), queued in that order on one stream. Every route
drives this one function:
  * the bridge (backend.py): inputs staged as float32 (the mask resolved on the host), outputs float32;
  * the native route (mha_ep/native): ORT's own buffers, named by steps.Buffer and bound by its C library at every
    call; the mask as ORT hands it over (int32 / int64, any of its four shapes).

A shared past/present buffer (problem.shared: a static KV cache's decode step) takes its own steps,
shared_buffer.py's, which read P on the device. Every other call takes the pipeline, in order (legend in
mha_ep/spec.py):
  1. prepare: a raw key_padding_mask becomes the kernels' form (int32 (B,) key lengths clamped to [0, T], or uint8
     keep flags: ``> 0``); an attention_bias not in float32 is widened to it; a source the kernels would read with
     vector loads from an address not 16-byte aligned is copied to an aligned buffer;
  2. float16 / bfloat16 sources on the fused path (``native``): build_dense_BNTH_native moves Q, K and V into the
     kernel's operands in one launch (which for a wanted present *are* the present outputs), and the fused
     kernel (a flash kernel, or the split-key kernels' combine) writes the node's output in its dtype (out_narrow:
     no float32 scratch, no narrowing launch). Two kinds of call skip the movers: a decoder's cross
     attention (``reads_kv_in_place``: the split-key kernels read its BNSH key and value and its query as they
     are), and a call with no projection bias, past or present (``reads_sources_in_place``: an encoder's, a
     diffusion model's, every packed call's), whose kernel reads query, key and value where ORT holds them;
  3. every other call runs the float32 pipeline, widening its sources to float32 first when they are not:
       a. fused float32 calls without past or presents: one fused kernel on the sources themselves
          (dispatch.reads_staged_inputs);
       b. layout movers (build_dense_BNTH: q_BNSH, k_BNTH, v_BNTH in the compute dtype; a wanted present written
          in the same pass; the float16 scores' offsets: dispatch.score_terms), then the fused kernel, or when
          dispatch.fused_unsupported_reason says why not, the three phases: cuBLAS scores, masked softmax, cuBLAS
          P.V and context_to_BSD;
     and outputs wanted in the node's dtype are narrowed from float32 buffers.
"The fused kernel" is fused.fused_steps': one flash kernel, or for a decode step (S <= 4) the split-key kernels,
whose blocks share a row's keys (dispatch.key_stream, kernels/split_keys.cu).
This module must not import CuPy: its decisions are tested on CPU machines, and the native route plans on them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

import numpy as np

from mha_ep.launch import ELEMENT_BYTES, LAUNCH_BLOCK, SOFTMAX_THREADS, MaskKind
from mha_ep.engine.cuda import dispatch, gemm
from mha_ep.engine.cuda.fused import DeviceFacts, Operand, fused_steps, packed_layout
from mha_ep.engine.cuda.geometry import LaunchPlan, cached_plan, checked_grid
from mha_ep.engine.cuda.kernels import name_expression
from mha_ep.engine.cuda.movers import Mover, layout_movers, mover_struct
from mha_ep.engine.cuda.packed import PACKED_SLOTS, packed_rows, packed_slot_sources, slot_sources, source_slots
from mha_ep.engine.cuda.shared_buffer import shared_buffer_steps
from mha_ep.engine.cuda.split_keys import takes_split_keys
from mha_ep.engine.cuda.steps import Address, Copy, Fill, Launch, Pointer, Step, alignment_of
from mha_ep.errors import MESSAGE_PREFIX, MhaInputError
from mha_ep.engine.problem import MhaProblem

log = logging.getLogger("mha_ep")
FLOAT_SOURCES = ("query", "key", "value", "bias_q", "bias_k", "bias_v", "past_key", "past_value")
SOURCE_ALIGNMENT = 16  # bytes: the kernels' vector loads (fused operands, movers, softmax bias tiles)
POISON_BYTE = 0xFF  # 0xFFFF / 0xFFFFFFFF are NaN in float16, bfloat16 and float32
MASK_FORMS = ("resolved", "int32", "int64")  # the kernels' form already, or ORT's raw key_padding_mask
RAW_MASK_TYPES = {"int32": "int32", "int64": "int64"}  # kernels.MASK_TYPES names


class Temporaries(Protocol):
    """Device memory for one call's scratch buffers: ``take`` returns an address (int or steps.Buffer) of at
    least ``nbytes`` bytes, 256-byte aligned, valid until the call's steps have run."""

    def take(self, name: str, nbytes: int) -> Address: ...


@dataclass(frozen=True)
class DeviceCall:
    """Where one call's tensors lie.

    sources: input name -> address, for query, key, value, bias_q, bias_k, bias_v (the slices of the bias input;
             bias_k / bias_v only where the problem has them), past_key, past_value, attention_bias and mask; a
             name the call does not have is absent or None;
    source_dtype: "float32" (the bridge's transport arrays) or the node's dtype (ORT's or CuPy's own tensors);
    mask_form: "resolved" (int32 (B,) key lengths or uint8 keep flags, as PaddingMask.kind says) or the element
             type of ORT's raw key_padding_mask ("int32", "int64");
    attention_bias_dtype: the element type of the attention_bias source ("float32", or the node's dtype);
    outputs: "output", "present_key", "present_value" -> address (a present not wanted: absent or None);
    output_dtype: "float32" (the bridge's transport outputs) or the node's dtype;
    error_flag, error_site: where a shared buffer's kernels leave their sticky reports (launch.STATUS_WORDS int32
             the host reads without a copy: the native route's Buffer("sticky"), which its library binds while
             ORT captures a graph, mha_ep/native/plan.py; None: nowhere) and the number the reports carry as site;
    packed_sources: the call's packed input (problem.packing) is at sources["query"] (packed QKV) or
             sources["key"] (packed KV) as the node has it, (B, S|L, N, 3|2, H) (the native route), and every step
             reads its slots in place (source_slots); False: the sources are the unpacked slots (the bridge stages
             problem.query_BSD / key / value).
    A shared-buffer call's sources also name past_sequence_length (int32, one element) and, on the beam path,
    cache_indirection (int32 (B/W, W, M)).
    """

    sources: dict
    source_dtype: str
    outputs: dict
    output_dtype: str
    mask_form: str = "resolved"
    attention_bias_dtype: str = "float32"
    error_flag: Address = None
    error_site: int = 0
    packed_sources: bool = False


@dataclass
class _Builder:
    """The steps of one call as they are made, and its temporaries (poisoned first when asked)."""

    temporaries: Temporaries
    poison: bool
    steps: list = field(default_factory=list)

    def take(self, name: str, nbytes: int) -> Address:
        address = self.temporaries.take(name, int(nbytes))
        if self.poison and nbytes:
            self.steps.append(Fill(address, POISON_BYTE, int(nbytes)))
        return address

    def add(self, step: Step) -> None:
        self.steps.append(step)

    def extend(self, steps: list) -> None:
        self.steps.extend(steps)


def attention_steps(problem: MhaProblem, facts: DeviceFacts, call: DeviceCall, temporaries: Temporaries, *,
                    fused_path: bool = True, poison: bool = False) -> list:  # fmt: skip
    """The steps of ``problem`` on ``call``'s buffers (module docstring). ``fused_path=False`` keeps the call on
    the three phases; ``poison`` fills every temporary with NaN before any kernel runs (tests: an element a kernel
    forgets to write shows). Raises MhaInputError (geometry.plan_launch) for sizes the kernels cannot take."""
    if call.mask_form not in MASK_FORMS:
        raise ValueError(f"DeviceCall.mask_form must be one of {MASK_FORMS}, got {call.mask_form!r}")
    build = _Builder(temporaries, poison)
    slots = source_slots(problem, call)
    if slots:  # the shared-buffer kernel reads its sources element by element: any base will do, never a copy
        alignment = 1 if problem.shared is not None else SOURCE_ALIGNMENT
        sources = packed_slot_sources(problem, call.sources, call.source_dtype, build, alignment)
        call = replace(call, sources=sources)
    if problem.shared is not None:
        if problem.want_qk:
            raise MhaInputError(
                f"{MESSAGE_PREFIX}the qk output with a shared past/present buffer (past_sequence_length given) is not "
                "computed on the GPU yet: its length P + L is the value of past_sequence_length, which the GPU "
                "kernels read on the device; run this node on the CPU (route python-op, backend reference) or drop qk"
            )
        programmatic = dispatch.programmatic_launches(facts.capability)
        return build.steps + shared_buffer_steps(problem, call, build.take, programmatic=programmatic)
    plan = cached_plan(problem.geometry, problem.dtype)
    sources = _prepared_sources(problem, plan, call, build, slots)
    fused_unsupported = dispatch.fused_unsupported_reason(problem) if fused_path else "the three-phase path was asked for"
    native = call.source_dtype != "float32"
    if native and call.source_dtype != problem.dtype:
        raise ValueError(f"DeviceCall.source_dtype {call.source_dtype!r} must be 'float32' or the call's dtype "
                         f"{problem.dtype!r}")  # fmt: skip
    if native and fused_unsupported is None and call.output_dtype == problem.dtype:
        _native_fused(problem, plan, facts, sources, call.outputs, build, slots)
        return build.steps
    if native:
        sources = _widened_sources(problem, plan, sources, build, slots)
    outputs = call.outputs
    narrowed = {}
    if call.output_dtype != "float32":
        outputs = {}
        for name, shape in output_shapes(problem).items():
            if call.outputs.get(name) is not None:
                outputs[name] = build.take(f"{name}_f32", 4 * int(np.prod(shape)))
                narrowed[name] = (outputs[name], call.outputs[name], int(np.prod(shape)))
    _float32_pipeline(problem, plan, facts, sources, outputs, build, fused_unsupported, slots)
    for src, dst, count in narrowed.values():
        build.add(_narrow(problem.dtype, src, dst, count))
    return build.steps


def output_shapes(problem: MhaProblem) -> dict:
    """Shape of each output the call makes (presents only when wanted)."""
    g = problem.geometry
    rows = g.total_seq if problem.shared is None else problem.shared.max_seq  # a shared buffer's presents: M rows
    shapes = {"output": (g.batch, g.q_seq, g.v_hidden)}
    if problem.want_present_key:
        shapes["present_key"] = (g.batch, g.num_heads, rows, g.head_size)
    if problem.want_present_value:
        shapes["present_value"] = (g.batch, g.num_heads, rows, g.v_head_size)
    if problem.want_qk:
        shapes["qk"] = (g.batch, g.num_heads, g.q_seq, g.total_seq)
    return shapes


def source_shapes(problem: MhaProblem) -> dict:
    """Shape of each float source the call has (FLOAT_SOURCES, attention_bias)."""
    fields = {"query": problem.query_BSD, "key": problem.key, "value": problem.value, "bias_q": problem.bias_q,
              "bias_k": problem.bias_k, "bias_v": problem.bias_v, "past_key": problem.past_key_BNPH,
              "past_value": problem.past_value_BNPH, "attention_bias": problem.attention_bias}  # fmt: skip
    return {name: tuple(array.shape) for name, array in fields.items() if array is not None}


# ------------------------------------------------------------------------------------------------ 1. prepare
def _elementwise_grid(count: int, vec: int, name: str) -> tuple:
    return (checked_grid(-(-count // vec), name), 1, 1)


def _prepared_sources(problem: MhaProblem, plan: LaunchPlan, call: DeviceCall, build: _Builder,
                      slots: dict) -> dict:  # fmt: skip
    """Step 1 (module docstring). The slots of a packed input (``slots``: source_slots) are not copied: their base
    is aligned (packed.packed_slot_sources) and a slot's offset, H elements, is what the kernels' vector loads need
    wherever they are taken (fused: H % 8; movers' VEC 4: H % 4)."""
    sources = {name: address for name, address in call.sources.items() if address is not None}
    mask = problem.padding_mask
    if mask is not None and call.mask_form != "resolved":
        sources["mask"] = _resolved_mask(problem, plan, sources["mask"], call.mask_form, build)
    shapes = source_shapes(problem)
    if problem.attention_bias is not None and call.attention_bias_dtype != "float32":
        count = int(np.prod(shapes["attention_bias"]))
        sources["attention_bias"] = _widen(call.attention_bias_dtype, sources["attention_bias"], count,
                                           "attention_bias", build)  # fmt: skip
    element = ELEMENT_BYTES[call.source_dtype]
    for name in (*FLOAT_SOURCES, "attention_bias"):
        address = sources.get(name)
        if address is None or name in slots or alignment_of(address) >= SOURCE_ALIGNMENT:
            continue
        nbytes = int(np.prod(shapes[name])) * (4 if name == "attention_bias" else element)
        aligned = build.take(f"{name}_aligned", nbytes)
        build.add(Copy(aligned, address, nbytes))
        sources[name] = aligned
    return sources


def _resolved_mask(problem: MhaProblem, plan: LaunchPlan, raw: Address, form: str, build: _Builder) -> Address:
    """ORT's raw key_padding_mask -> the kernels' form, as resolve_padding_mask reads it (problem.py): the first B
    entries of a (B,) or (3B+2,) mask as key lengths clamped to [0, T]; a (B, T) or (B, S, T) mask as keep flags
    (value > 0)."""
    kind = problem.padding_mask.kind
    if kind == "key_lengths":
        lengths = build.take("key_lengths_B", 4 * plan.batch)
        build.add(Launch(name_expression("resolve_key_lengths", RAW_MASK_TYPES[form]),
                         _elementwise_grid(plan.batch, 1, "resolve_key_lengths"), (LAUNCH_BLOCK, 1, 1), 0,
                         (Pointer(raw), Pointer(lengths), np.int32(plan.batch), np.int32(plan.total_seq))))  # fmt: skip
        return lengths
    count = int(np.prod(problem.padding_mask.data.shape))
    keep = build.take("keep", count)
    build.add(Launch(name_expression("resolve_keep_flags", RAW_MASK_TYPES[form]),
                     _elementwise_grid(count, 1, "resolve_keep_flags"), (LAUNCH_BLOCK, 1, 1), 0,
                     (Pointer(raw), Pointer(keep), np.int64(count))))  # fmt: skip
    return keep


def _vec(count: int, *addresses: Address, element: int) -> int:
    """4 elements per thread when ``count`` allows it and every address is aligned for 4-element accesses."""
    return 4 if count % 4 == 0 and all(alignment_of(a) >= 4 * element for a in addresses) else 1


def _widen(dtype: str, src: Address, count: int, name: str, build: _Builder) -> Address:
    """A float32 copy of ``count`` ``dtype`` values at ``src`` (exact)."""
    dst = build.take(f"{name}_f32", 4 * count)
    vec = _vec(count, src, element=ELEMENT_BYTES[dtype])
    build.add(Launch(name_expression("widen_to_float", dtype, vec), _elementwise_grid(count, vec, "widen_to_float"),
                     (LAUNCH_BLOCK, 1, 1), 0, (Pointer(src), Pointer(dst), np.int64(count))))  # fmt: skip
    return dst


def _narrow(dtype: str, src: Address, dst: Address, count: int) -> Launch:
    """``count`` float32 values at ``src``, already rounded to ``dtype``, into ``dtype`` at ``dst`` (exact)."""
    vec = _vec(count, src, dst, element=ELEMENT_BYTES[dtype])
    return Launch(name_expression("narrow_output", dtype, vec), _elementwise_grid(count, vec, "narrow_output"),
                  (LAUNCH_BLOCK, 1, 1), 0, (Pointer(src), Pointer(dst), np.int64(count)))  # fmt: skip


def _widened_sources(problem: MhaProblem, plan: LaunchPlan, sources: dict, build: _Builder,
                     slots: dict) -> dict:  # fmt: skip
    """The float sources in float32 (attention_bias and the mask are already in the kernels' form); a packed
    input (``slots``) widened whole, its slots then in the float32 copy."""
    shapes = source_shapes(problem)
    widened = dict(sources)
    for name in FLOAT_SOURCES:
        if sources.get(name) is not None and name not in slots:
            widened[name] = _widen(problem.dtype, sources[name], int(np.prod(shapes[name])), name, build)
    if slots:
        first = PACKED_SLOTS[problem.packing][0]
        count = packed_rows(problem) * len(slots) * problem.geometry.head_size
        widened = slot_sources(problem, widened, _widen(problem.dtype, sources[first], count, "packed", build), 4)
    return widened


# ---------------------------------------------------------------------------------------- shared launches
def mover_launch(plan: LaunchPlan, kernel: str, movers: tuple[Mover, Mover, Mover], scale: float) -> Launch:
    """The Q, K and V ``movers`` in one launch of layout.cu's ``kernel`` (build_dense_BNTH: float32 sources and
    presents; build_dense_BNTH_native: sources and presents in the call's dtype); ``scale`` the scores' scale,
    which the offsets carry."""
    native = kernel == "build_dense_BNTH_native"
    structs = tuple(mover_struct(m, scale, native) for m in movers)
    return Launch(name_expression(kernel, plan.dtype, plan.vec_movers), (plan.grids["layout movers"], 3, 1),
                  (LAUNCH_BLOCK, 1, 1), 0, (*structs, np.int32(plan.batch), np.int32(plan.heads)))  # fmt: skip


def offset_buffers(plan: LaunchPlan, terms: dispatch.ScoreTerms, take: Callable[[str, int], Address]) -> dict:
    """key_offset_BNT / query_offset_BNS -> address, for the score offsets ``terms`` asks for (the movers write
    them)."""
    return {
        name: take(name, plan.nbytes[name])
        for name, wanted in (("key_offset_BNT", terms.key_offset), ("query_offset_BNS", terms.query_offset))
        if wanted
    }


# ------------------------------------------------------------------------------------ 2. native fused path
def reads_kv_in_place(problem: MhaProblem, facts: DeviceFacts) -> bool:
    """Whether a float16 / bfloat16 call on the native route skips the layout movers: a decode step the split-key
    kernels take (dispatch.key_split) with BNSH key and value, no past and no present wanted (a decoder's cross
    attention). Its key and value are already (B, N, T, H) in the call's dtype, and ORT ignores their bias
    (docs/SEMANTICS.md §3.3): the kernel reads them, and the raw query with b_q added on load in float32, where
    the movers would copy the whole cross-attention cache every step."""
    return (problem.kv_layout == "BNSH" and problem.past_key_BNPH is None and problem.past_value_BNPH is None
            and not problem.want_present_key and not problem.want_present_value and problem.bias_k is None
            and problem.bias_v is None and dispatch.key_split(problem, facts.sms) is not None)  # fmt: skip


def _native_in_place(problem: MhaProblem, plan: LaunchPlan, facts: DeviceFacts, sources: dict, outputs: dict,
                     build: _Builder) -> None:  # fmt: skip
    """reads_kv_in_place's launches: the split-key kernels on the sources, b_q read from the node's bias where it
    is, in its dtype (_native_attention)."""
    _native_attention(
        problem, facts, outputs, build,
        q=Operand(sources["query"], "BSNH", plan.q_seq, plan.head_size, sources.get("bias_q")),
        k=Operand(sources["key"], "BNSH", plan.total_seq, plan.head_size),
        v=Operand(sources["value"], "BNSH", plan.total_seq, plan.v_head_size),
        attention_bias=sources.get("attention_bias"), mask=sources.get("mask"), raw_query=True,
    )  # fmt: skip


def reads_sources_in_place(problem: MhaProblem) -> bool:
    """Whether a float16 / bfloat16 call on the native route's fused path skips the layout movers altogether: no
    projection bias, no past and no present wanted (an encoder's or a diffusion model's attention, a packed
    input's always: claim/rules.py rule_past). The movers would copy each operand unchanged; the fused kernel reads
    query, key and value where ORT holds them instead, through their strides (source_operands)."""
    return (problem.bias_q is None and problem.bias_k is None and problem.bias_v is None
            and problem.past_key_BNPH is None and problem.past_value_BNPH is None
            and not problem.want_present_key and not problem.want_present_value)  # fmt: skip


def source_operands(problem: MhaProblem, plan: LaunchPlan, sources: dict, slots: dict,
                    with_bias: bool = False) -> dict:  # fmt: skip
    """q, k, v as the fused kernels' Operands on the call's own sources: a rank-3 source BSNH (or a slot of a
    packed input: BSN3H / BSN2H), a rank-4 key / value BNSH; ``with_bias``: float32 sources with bias_q/k/v added
    on load (step 3a)."""
    bias = sources.get if with_bias else (lambda name: None)
    kv_layout = problem.kv_layout if problem.kv_layout == "BNSH" else packed_layout(slots.get("key", 1))
    return {
        "q": Operand(sources["query"], packed_layout(slots.get("query", 1)), plan.q_seq, plan.head_size,
                     bias("bias_q")),
        "k": Operand(sources["key"], kv_layout, plan.kv_seq, plan.head_size, bias("bias_k")),
        "v": Operand(sources["value"], kv_layout, plan.kv_seq, plan.v_head_size, bias("bias_v")),
    }  # fmt: skip


def _native_fused(problem: MhaProblem, plan: LaunchPlan, facts: DeviceFacts, sources: dict, outputs: dict,
                  build: _Builder, slots: dict) -> None:  # fmt: skip
    """The fused path on float16 / bfloat16 tensors as they are (module docstring, step 2)."""
    if reads_kv_in_place(problem, facts):
        _native_in_place(problem, plan, facts, sources, outputs, build)
        return
    if reads_sources_in_place(problem):
        _native_attention(problem, facts, outputs, build, **source_operands(problem, plan, sources, slots),
                          attention_bias=sources.get("attention_bias"), mask=sources.get("mask"))  # fmt: skip
        return
    terms = dispatch.score_terms(problem)
    key_apart = problem.bias_k is not None and not terms.key_bias_in_operand  # present holds a bias K leaves out
    present_key, present_value = outputs.get("present_key"), outputs.get("present_value")
    k_BNTH = present_key if present_key is not None and not key_apart else build.take("k_BNTH", plan.nbytes["k_BNTH"])
    v_BNTH = present_value if present_value is not None else build.take("v_BNTH", plan.nbytes["v_BNTH"])
    q_BNSH = build.take("q_BNSH", plan.nbytes["q_BNSH"])
    offsets = offset_buffers(plan, terms, build.take)
    movers = layout_movers(
        plan, terms, problem.kv_layout == "BNSH", sources=sources,
        dst={"q_BNSH": q_BNSH, "k_BNTH": k_BNTH, "v_BNTH": v_BNTH},
        presents={"present_key": present_key if key_apart else None}, offsets=offsets, slots=slots,
    )  # fmt: skip
    build.add(mover_launch(plan, "build_dense_BNTH_native", movers, problem.scale))
    _native_attention(
        problem, facts, outputs, build,
        q=Operand(q_BNSH, "BNSH", plan.q_seq, plan.head_size),
        k=Operand(k_BNTH, "BNSH", plan.total_seq, plan.head_size),
        v=Operand(v_BNTH, "BNSH", plan.total_seq, plan.v_head_size),
        attention_bias=sources.get("attention_bias"), mask=sources.get("mask"),
        key_offset=offsets.get("key_offset_BNT"), query_offset=offsets.get("query_offset_BNS"),
    )  # fmt: skip


def _native_attention(problem: MhaProblem, facts: DeviceFacts, outputs: dict, build: _Builder, **operands) -> None:
    """The fused kernel on float16 / bfloat16 operands into the node's outputs: one flash kernel, or the split-key
    kernels' combine, writes the output in the call's dtype itself (out_narrow: no float32 scratch, no narrowing
    launch); a split-key call that wants qk writes its scores in float32, which one narrowing rounds into qk (only
    split-key calls write qk: dispatch.fused_unsupported_reason)."""
    qk_f32 = _qk_scratch(problem, build) if takes_split_keys(problem, facts, problem.dtype) else None
    build.extend(fused_steps(problem, operand_dtype=problem.dtype, out_BSD=None, out_narrow=outputs["output"],
                             facts=facts, take=build.take, qk=qk_f32, **operands))  # fmt: skip
    _narrow_qk(problem, qk_f32, outputs, build)


def _qk_scratch(problem: MhaProblem, build: _Builder) -> Optional[Address]:
    """A float32 buffer for the split-key kernel's scores when the call wants qk (the native fused path writes
    its outputs in the node's dtype: _narrow_qk rounds the scores into qk), else None."""
    if not problem.want_qk:
        return None
    g = problem.geometry
    return build.take("qk_f32", 4 * g.batch * g.num_heads * g.q_seq * g.total_seq)


def _narrow_qk(problem: MhaProblem, qk_f32: Optional[Address], outputs: dict, build: _Builder) -> None:
    if qk_f32 is not None and outputs.get("qk") is not None:
        g = problem.geometry
        build.add(_narrow(problem.dtype, qk_f32, outputs["qk"], g.batch * g.num_heads * g.q_seq * g.total_seq))


# ------------------------------------------------------------------------------------- 3. float32 pipeline
def _float32_pipeline(problem: MhaProblem, plan: LaunchPlan, facts: DeviceFacts, sources: dict, outputs: dict,
                      build: _Builder, fused_unsupported: Optional[str], slots: dict) -> None:  # fmt: skip
    """Module docstring, step 3 (float32 sources and outputs, values rounded to the compute dtype)."""
    if fused_unsupported is None and dispatch.reads_staged_inputs(problem):  # 3a: bias added on load
        build.extend(fused_steps(
            problem, **source_operands(problem, plan, sources, slots, with_bias=True), operand_dtype="float32",
            attention_bias=sources.get("attention_bias"), mask=sources.get("mask"),
            out_BSD=outputs["output"], facts=facts, take=build.take, qk=outputs.get("qk"),
        ))  # fmt: skip
        return
    # 3b: operands. A float32 call's K/V operands are the present outputs themselves; otherwise they are scratch
    # and the present (when wanted) is their exact float32 image, written in the same pass.
    f32_call = plan.dtype == "float32"
    ops = {"q_BNSH": build.take("q_BNSH", plan.nbytes["q_BNSH"])}
    presents = {}
    for operand, present in (("k_BNTH", "present_key"), ("v_BNTH", "present_value")):
        if f32_call and outputs.get(present) is not None:
            ops[operand], presents[present] = outputs[present], None
        else:
            ops[operand], presents[present] = build.take(operand, plan.nbytes[operand]), outputs.get(present)
    if fused_unsupported is not None:
        for name in ("scores_BNST", "probs_BNST", "context_BNSH"):
            ops[name] = build.take(name, plan.nbytes[name])
    terms = dispatch.score_terms(problem)
    offsets = offset_buffers(plan, terms, build.take)
    movers = layout_movers(plan, terms, problem.kv_layout == "BNSH", sources=sources,
                           dst={name: ops[name] for name in ("q_BNSH", "k_BNTH", "v_BNTH")}, presents=presents,
                           offsets=offsets, slots=slots)  # fmt: skip
    build.add(mover_launch(plan, "build_dense_BNTH", movers, problem.scale))
    if fused_unsupported is None:  # steps 3-5 in one flash-attention kernel (fused.py)
        build.extend(fused_steps(
            problem,
            q=Operand(ops["q_BNSH"], "BNSH", plan.q_seq, plan.head_size),
            k=Operand(ops["k_BNTH"], "BNSH", plan.total_seq, plan.head_size),
            v=Operand(ops["v_BNTH"], "BNSH", plan.total_seq, plan.v_head_size),
            operand_dtype=plan.dtype, attention_bias=sources.get("attention_bias"), mask=sources.get("mask"),
            out_BSD=outputs["output"], facts=facts, key_offset=offsets.get("key_offset_BNT"),
            query_offset=offsets.get("query_offset_BNS"), take=build.take, qk=outputs.get("qk"),
        ))  # fmt: skip
        return
    log.debug("mha_ep: fused path not used: %s; three-phase path", fused_unsupported)
    build.add(gemm.scores_gemm(plan, problem.scale, ops["q_BNSH"], ops["k_BNTH"], ops["scores_BNST"]))
    build.add(softmax_launch(problem, plan, sources, ops, offsets, outputs.get("qk")))
    build.add(gemm.context_gemm(plan, ops["probs_BNST"], ops["v_BNTH"], ops["context_BNSH"]))
    i32 = np.int32
    build.add(Launch(name_expression("context_to_BSD", plan.dtype, plan.vec_v), (plan.grids["context_to_BSD"], 1, 1),
                     (LAUNCH_BLOCK, 1, 1), 0,
                     (Pointer(ops["context_BNSH"]), Pointer(outputs["output"]), i32(plan.batch), i32(plan.heads),
                      i32(plan.q_seq), i32(plan.v_head_size))))  # fmt: skip


def softmax_launch(problem: MhaProblem, plan: LaunchPlan, sources: dict, ops: dict, offsets: dict,
                   qk: Optional[Address] = None) -> Launch:  # fmt: skip
    """Step 4 of the three phases: masked_softmax_warp (rows of at most 1024 keys: a warp per row, the row in
    registers) or masked_softmax (a block per row, the row cached in shared memory when it fits). ``qk``: a float32
    (B, N, S, T) buffer that receives the masked scores before the softmax (output 3), or None."""
    bias = problem.attention_bias
    d0, d1 = (1, 1) if bias is None else (bias.shape[0], bias.shape[1])
    mask = problem.padding_mask
    kind = MaskKind.of(None if mask is None else mask.kind)
    lengths = sources.get("mask") if kind == MaskKind.KEY_LENGTHS else None
    keep = sources.get("mask") if kind in (MaskKind.KEYS_BT, MaskKind.KEYS_BST) else None
    i32 = np.int32
    args = (
        Pointer(ops["scores_BNST"]), Pointer(ops["probs_BNST"]), Pointer(sources.get("attention_bias")), i32(d0),
        i32(d1), i32(int(kind)), Pointer(lengths), Pointer(keep), Pointer(offsets.get("key_offset_BNT")),
        Pointer(offsets.get("query_offset_BNS")), np.float32(problem.mask_filter_value), i32(int(problem.causal)),
        i32(plan.batch), i32(plan.heads), i32(plan.q_seq), i32(plan.total_seq), i32(plan.past_seq), Pointer(qk),
    )  # fmt: skip
    grid, block = (plan.grids["masked_softmax"], 1, 1), (SOFTMAX_THREADS, 1, 1)
    if plan.softmax_cols_per_lane:
        return Launch(name_expression("masked_softmax_warp", plan.dtype, plan.softmax_cols_per_lane), grid, block, 0,
                      args)  # fmt: skip
    return Launch(name_expression("masked_softmax", plan.dtype), grid, block, plan.softmax_shared_bytes,
                  args + (i32(int(plan.row_cache)),))  # fmt: skip
