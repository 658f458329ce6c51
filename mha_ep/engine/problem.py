"""One resolved MultiHeadAttention call: what every backend receives, and the execute-time validation that makes it.

``build_problem`` runs the shared rules (claim/rules.py) on the concrete shapes, then resolves the call into an
``MhaProblem``: geometry, resolved scale, layout, bias split per layout, the key padding mask in a compact form, and
the arrays. Backends (reference, cuda) implement ``run(problem) -> MhaResult`` and nothing else.

Layout legend: see mha_ep/spec.py. Arrays always arrive as float32 (the bridge's transport type); for float16 and
bfloat16 nodes every value is exactly representable in ``problem.dtype`` and the backend computes in that dtype
(reference: in float32 from those values, as stock ORT's CPU kernel does for float16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from mha_ep import spec
from mha_ep.claim.rules import Call, Refusal, attributes_from_mapping, beam_path, check, packing, shared_buffer
from mha_ep.claim.tensor_info import TensorInfo
from mha_ep.errors import MESSAGE_PREFIX, MhaInputError

FLOAT32_LOWEST = float(np.finfo(np.float32).min)  # ORT's causal fill (std::numeric_limits<float>::lowest())


@dataclass(frozen=True)
class Geometry:
    batch: int  # B
    q_seq: int  # S
    kv_seq: int  # L
    past_seq: int  # P
    num_heads: int  # N
    head_size: int  # H
    v_head_size: int  # Hv

    @property
    def total_seq(self) -> int:  # T = P + L
        return self.past_seq + self.kv_seq

    @property
    def hidden(self) -> int:  # D
        return self.num_heads * self.head_size

    @property
    def v_hidden(self) -> int:  # Dv
        return self.num_heads * self.v_head_size


@dataclass(frozen=True)
class PaddingMask:
    """key_padding_mask resolved as ORT's PrepareMask reads it.

    kind "key_lengths": ``data`` int32 (B,), key j of batch b is kept iff j < data[b] (already clamped to [0, T]);
        both the (B,) and the (3B+2,) forms resolve to this (ORT's CPU kernel reads only the first B entries).
    kind "keys_BT":  ``data`` bool (B, T), True = keep (raw value > 0).
    kind "keys_BST": ``data`` bool (B, S, T), True = keep.
    A masked position gets ``mask_filter_value`` added to its score (added, never substituted).
    """

    kind: str
    data: np.ndarray

    def keep_BST(self, q_seq: int, total_seq: int) -> np.ndarray:
        """Dense (B, S, T) boolean keep matrix (reference backend and tests)."""
        if self.kind == "key_lengths":
            keep_BT = np.arange(total_seq)[None, :] < self.data[:, None]
            return np.broadcast_to(keep_BT[:, None, :], (len(self.data), q_seq, total_seq))
        if self.kind == "keys_BT":
            return np.broadcast_to(self.data[:, None, :], (self.data.shape[0], q_seq, total_seq))
        return self.data


@dataclass(frozen=True)
class SharedBuffer:
    """A shared past/present buffer (docs/SEMANTICS.md §3.9): past_key / past_value are (B, N, M, H), the call's L
    new key/value rows go to rows [P, P+L) of presents of that shape, whose other rows equal the past's, and
    attention runs over rows [0, P+L).

    ``past_seq`` is P, the value of past_sequence_length, or None where only the device reads it (the native
    CUDA route plans without it). ``beams`` is W, cache_indirection's dim 1 (0 without it); ``beam_path`` says
    that cache_indirection takes effect once P > 0 (docs/SEMANTICS.md §3.10): past row j of row b*W + w is then
    read from row b*W + cache_indirection[b, w, j].
    """

    max_seq: int
    past_seq: Optional[int]
    beams: int = 0
    beam_path: bool = False

    @property
    def beams_active(self) -> bool:
        """The beam path with a known P > 0 (the reference; the device decides for itself)."""
        return self.beam_path and self.past_seq is not None and self.past_seq > 0


@dataclass
class MhaProblem:
    geometry: Geometry
    dtype: str  # element type of the node: float32 | float16 | bfloat16
    scale: float  # resolved: attribute, or 1/sqrt(H) when the attribute is 0
    mask_filter_value: float
    causal: bool  # unidirectional and S > 1; ORT CPU: rows i < S-1, keys j > P + i: the additive mask is FLOAT32_LOWEST
    query_BSD: np.ndarray  # (B, S, D)
    key: np.ndarray  # (B, L, D) when kv_layout == "BSNH"; (B, N, L, H) when "BNSH"
    value: np.ndarray  # (B, L, Dv) or (B, N, L, Hv)
    kv_layout: str  # "BSNH" | "BNSH"
    bias_q: Optional[np.ndarray] = None  # (D,)
    bias_k: Optional[np.ndarray] = None  # (D,);  None for BNSH key/value: ORT ignores the K/V bias there
    bias_v: Optional[np.ndarray] = None  # (Dv,); likewise
    padding_mask: Optional[PaddingMask] = None
    attention_bias: Optional[np.ndarray] = None  # (B|1, N|1, S, T)
    past_key_BNPH: Optional[np.ndarray] = None  # (B, N, P, H); (B, N, M, H) with a shared buffer
    past_value_BNPH: Optional[np.ndarray] = None  # (B, N, P, Hv); (B, N, M, Hv) with a shared buffer
    want_present_key: bool = False
    want_present_value: bool = False
    shared: Optional[SharedBuffer] = None  # a shared past/present buffer (past_sequence_length given with a past)
    past_sequence_length: Optional[np.ndarray] = None  # int32, one element; with ``shared`` only
    cache_indirection_BWM: Optional[np.ndarray] = None  # int32 (B/W, W, M); only where ``shared.beam_path``
    want_qk: bool = False  # output 3: the scores before softmax (docs/SEMANTICS.md §3.8)
    # "qkv": the node's query is packed QKV (B, S, N, 3, H); "kv": its key is packed KV (B, L, N, 2, H); None.
    # query_BSD / key / value are then the slots as (B, S|L, N*H) arrays (packed_slot)
    packing: Optional[str] = None


@dataclass
class MhaResult:
    output_BSDv: np.ndarray  # float32 (B, S, Dv)
    present_key_BNTH: Optional[np.ndarray] = None  # float32 (B, N, T, H) when wanted; (B, N, M, H) when shared
    present_value_BNTHv: Optional[np.ndarray] = None  # float32 (B, N, T, Hv) when wanted; (B, N, M, Hv) when shared
    qk_BNST: Optional[np.ndarray] = None  # float32 (B, N, S, T) when wanted: scale * Q.K^T + attention_bias + mask


def problem_signature(problem: MhaProblem) -> tuple:
    """Everything of a call but its values (shapes, layout, attributes, which inputs and outputs it has): what a
    backend's launch decisions may read, so a memo keyed on it holds for every call of the same signature."""

    def shape(array) -> Optional[tuple]:
        return None if array is None else tuple(array.shape)

    mask = problem.padding_mask
    return (
        problem.geometry, problem.dtype, problem.scale, problem.mask_filter_value, problem.causal, problem.kv_layout,
        shape(problem.bias_q), shape(problem.bias_k), shape(problem.bias_v),
        None if mask is None else (mask.kind, tuple(mask.data.shape)), shape(problem.attention_bias),
        shape(problem.past_key_BNPH), shape(problem.past_value_BNPH), problem.want_present_key,
        problem.want_present_value, problem.shared, shape(problem.cache_indirection_BWM), problem.want_qk,
        problem.packing,
    )  # fmt: skip


def input_slots(arrays: Sequence[Optional[np.ndarray]]) -> list:
    """``arrays`` padded with None to one entry per input slot of spec.INPUTS."""
    return list(arrays) + [None] * (len(spec.INPUTS) - len(arrays))


def array_signature(slots: Sequence[Optional[np.ndarray]]) -> tuple:
    """(dtype, shape) of each input slot (None for an absent one): all the rules see of the arrays."""
    return tuple(None if array is None else (array.dtype, array.shape) for array in slots)


def call_from_signature(attributes: Mapping[str, object], signature: tuple, dtype: str, outputs: Sequence[bool],
                        past_length: Optional[int] = None) -> Call:  # fmt: skip
    """The rule input for one call signature (array_signature) and, for a shared buffer, the value of
    past_sequence_length where it is known. Float inputs are reported with the node's dtype (they travel as f32)."""
    infos = []
    for name, entry in zip(spec.INPUTS, signature):
        if entry is None:
            infos.append(None)
            continue
        info = TensorInfo.of_dtype(*entry)
        if name in spec.FLOAT_INPUTS and info.dtype == "float32":
            info = TensorInfo(dtype, info.shape)
        infos.append(info)
    return Call(attributes_from_mapping(attributes), tuple(infos), tuple(outputs), past_length)


@functools.lru_cache(maxsize=1024)
def validated_call(attribute_items: tuple, signature: tuple, dtype: str, outputs: tuple,
                   past_length: Optional[int] = None) -> tuple:  # fmt: skip
    """The rules' verdict on one call signature: (Call, None) or (None, the Refusal: its reason and ORT status code).

    A node sends the same attributes and shapes call after call, so the op pays a dictionary lookup instead of
    building and hashing the Call again (what that saves: docs/BENCH.md, "Host-side choices").
    """
    try:
        call = call_from_signature(dict(attribute_items), signature, dtype, outputs, past_length)
    except Refusal as refusal:
        return None, refusal
    refusal = check(call)
    return (call, None) if refusal is None else (None, refusal)


def build_problem(
    attributes: Mapping[str, object],
    arrays: Sequence[Optional[np.ndarray]],
    dtype: str = "float32",
    outputs: Sequence[bool] = (True, False, False, False),
    mask_resolver=None,
) -> MhaProblem:
    """Validate one call with the shared rules and resolve it. Raises MhaInputError naming the input.

    ``mask_resolver(mask, geometry)``: resolve_padding_mask, or a caller's own (the native planner's reads
    shapes only: native/plan.py)."""
    slots = input_slots(arrays)
    signature = (tuple(attributes.items()), array_signature(slots), dtype, tuple(bool(o) for o in outputs),
                 past_length_value(slots[spec.SLOT["past_sequence_length"]]))  # fmt: skip
    try:
        call, refusal = validated_call(*signature)
    except TypeError:  # an unhashable attribute value: the rules name it, unmemoised
        call, refusal = validated_call.__wrapped__(*signature)
    if refusal is not None:
        raise MhaInputError(refusal.reason, code=refusal.code)
    by_name = dict(zip(spec.INPUTS, slots))
    query, key, value = by_name["query"], by_name["key"], by_name["value"]
    attrs = call.attrs
    n = attrs.num_heads
    form = packing(call)
    if form == "qkv":  # (B, S, N, 3, H): Q, K and V are its slots (docs/SEMANTICS.md §2.1)
        query, key, value = (packed_slot(query, i) for i in range(3))
    elif form == "kv":  # key (B, L, N, 2, H): K and V are its slots
        key, value = packed_slot(key, 0), packed_slot(key, 1)
    kv_layout = "BNSH" if key.ndim == 4 else "BSNH"
    b, s, d = query.shape
    h = d // n
    kv_len = key.shape[2] if kv_layout == "BNSH" else key.shape[1]
    hv = value.shape[3] if kv_layout == "BNSH" else value.shape[2] // n
    past_key, past_value = by_name["past_key"], by_name["past_value"]
    shared = shared_of(call, past_key)
    if shared is not None:  # P is the value (0 where only the device knows it: the shared path never reads it here)
        past_len = shared.past_seq or 0
    else:
        past_len = 0 if past_key is None else past_key.shape[2]
    geometry = Geometry(b, s, kv_len, past_len, n, h, hv)
    indirection = by_name["cache_indirection"] if shared is not None and shared.beam_path else None
    if shared is not None and shared.beams_active:
        check_beam_indices(indirection, shared)

    bias_q = bias_k = bias_v = None
    bias = by_name["bias"]
    if bias is not None:
        bias_q = bias[:d]
        if kv_layout == "BSNH":  # docs/SEMANTICS.md §3.3: the K/V bias is ignored for BNSH key/value
            bias_k, bias_v = bias[d : 2 * d], bias[2 * d :]

    mask = by_name["key_padding_mask"]
    padding_mask = None if mask is None else (mask_resolver or resolve_padding_mask)(mask, geometry)
    if shared is not None and shared.beams_active and padding_mask is not None:
        padding_mask = PaddingMask("keys_BT", mask != 0)  # the beam path keeps every nonzero value (§3.10)
    return MhaProblem(
        geometry=geometry,
        dtype=dtype,
        scale=attrs.resolved_scale(h),
        mask_filter_value=attrs.mask_filter_value,
        causal=attrs.causal(s),
        query_BSD=query,
        key=key,
        value=value,
        kv_layout=kv_layout,
        bias_q=bias_q,
        bias_k=bias_k,
        bias_v=bias_v,
        padding_mask=padding_mask,
        attention_bias=by_name["attention_bias"],
        past_key_BNPH=past_key,
        past_value_BNPH=past_value,
        want_present_key=bool(outputs[1]),
        want_present_value=bool(outputs[2]),
        shared=shared,
        past_sequence_length=by_name["past_sequence_length"] if shared is not None else None,
        cache_indirection_BWM=indirection,
        want_qk=len(outputs) > 3 and bool(outputs[3]),
        packing=form,
    )


def packed_slot(packed, index: int):
    """Slot ``index`` of a packed (B, S, N, P, H) input as a (B, S, N*H) array: a strided view of a NumPy or CuPy
    array made contiguous (host and bridge routes: the backends take BSNH arrays), or the shape alone for the
    native planner's shape-only inputs (whose steps read the packed buffer itself: pipeline.py)."""
    b, s, n, _, h = packed.shape
    if hasattr(packed, "__getitem__") and hasattr(packed, "reshape"):
        return packed[:, :, :, index, :].reshape(b, s, n * h)
    return type(packed)(packed.dtype, (b, s, n * h))


def past_length_value(psl) -> Optional[int]:
    """The value of a one-element past_sequence_length held on the host, or None (absent; another element count,
    which the rules refuse; a shape-only or device array, whose value the host does not read)."""
    if not isinstance(psl, np.ndarray) or psl.size != 1:
        return None
    return int(psl.reshape(-1)[0])


def shared_of(call: Call, past_key) -> Optional[SharedBuffer]:
    """The call's shared buffer, or None: past_sequence_length without a past is ignored, as by ORT (§3.9)."""
    if not shared_buffer(call):
        return None
    beams = call.dim("cache_indirection", 1) if call.present("cache_indirection") else 0
    return SharedBuffer(int(past_key.shape[2]), call.past_length, int(beams or 0), beam_path(call))


def check_beam_indices(indirection_BWM: np.ndarray, shared: SharedBuffer) -> None:
    """ORT's ValidateCacheIndirectionValues (docs/SEMANTICS.md §2.6): on the beam path, every beam index of the
    past positions [0, P) lies in [0, W). Raises MhaInputError with ORT's message."""
    beams, past = shared.beams, shared.past_seq
    used_BWP = np.asarray(indirection_BWM)[:, :, :past]
    bad = np.argwhere((used_BWP < 0) | (used_BWP >= beams))
    if bad.size:
        batch, beam, position = (int(i) for i in bad[0])
        raise MhaInputError(
            f"{MESSAGE_PREFIX}cache_indirection beam index out of range. Expected [0, {beams}), got "
            f"{int(used_BWP[batch, beam, position])} at flattened batch_beam index {batch * beams + beam}, sequence "
            f"position {position}"
        )


def resolve_padding_mask(mask: np.ndarray, geometry: Geometry) -> PaddingMask:
    """key_padding_mask -> PaddingMask, exactly as ORT's CPU kernel reads it (docs/SEMANTICS.md §3.4).

    Shapes were already checked by the rules; this only interprets values. Array methods only, so a CuPy mask
    is resolved on its device.
    """
    b, t = geometry.batch, geometry.total_seq
    if mask.ndim == 1:  # (B,) or (3B+2,): key lengths are the first B entries; the cu_seqlens part is unused
        lengths = mask[:b].astype(np.int64).clip(0, t).astype(np.int32)
        return PaddingMask("key_lengths", lengths)
    keep = mask > 0
    return PaddingMask("keys_BT" if mask.ndim == 2 else "keys_BST", keep)


def output_shapes(
    attributes: Mapping[str, object], arrays: Sequence[Optional[np.ndarray]], want_qk: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Best-effort shapes of (output, present_key, present_value, qk) for poisoning a failed call; () when unknown
    (qk: also when it is not wanted)."""
    try:
        n = int(attributes.get("num_heads", 0))
        query, key, value = arrays[0], arrays[1], arrays[2]
        b, s = query.shape[0], query.shape[1]
        packed = query if query.ndim == 5 else key if key is not None and key.ndim == 5 else None
        past_key = arrays[6] if len(arrays) > 6 else None
        shared = past_key is not None and len(arrays) > 8 and arrays[8] is not None
        if packed is not None:  # packed QKV / KV: Dv = D = N * H, L = the packed input's dim 1
            d, length = packed.shape[2] * packed.shape[4], packed.shape[1]
            if shared and past_key.ndim == 4:  # packed QKV over a shared buffer: presents (B, N, M, H)
                total = past_length_value(arrays[8])
                qk = (b, n, s, total + length) if want_qk and total is not None and total >= 0 else ()
                return (b, s, d), tuple(past_key.shape), tuple(past_key.shape), qk
            return (b, s, d), (), (), ((b, n, s, length) if want_qk else ())
        if value is not None and value.ndim == 4:
            dv, length, hv = value.shape[1] * value.shape[3], value.shape[2], value.shape[3]
        elif value is not None and value.ndim == 3:
            dv, length, hv = value.shape[2], value.shape[1], value.shape[2] // max(n, 1)
        else:
            return (b, s, query.shape[-1]), (), (), ()
        h = query.shape[2] // max(n, 1)
        past = past_key.shape[2] if past_key is not None and past_key.ndim == 4 else 0
        if shared:  # a shared buffer: (B, N, M, H)
            total = past_length_value(arrays[8])
            qk = (b, n, s, total + length) if want_qk and total is not None and total >= 0 else ()
            return (b, s, dv), (b, n, past, h), (b, n, past, hv), qk
        qk = (b, n, s, past + length) if want_qk else ()
        return (b, s, dv), (b, n, past + length, h), (b, n, past + length, hv), qk
    except Exception:  # noqa: BLE001 - poisoning must never fail
        return (), (), (), ()
