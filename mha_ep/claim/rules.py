"""The rules of what mha_ep computes, shared by the claim gate and by execute-time validation.

One list, one order (``RULES``, the order below), one message per rule. At claim time the rules see static shapes in which any dim may be
unknown (``None``): a rule that needs an unknown dim passes, and the same rule runs again at execute time on the
concrete shapes, so the gate and the op cannot disagree. Each refusal is a sentence a person can act on and names
the input it is about (``Refusal.subject``).

The order follows the original Rust CUDA execution provider's ``unsupported_reason`` (kept outside this repository);
rules it did not have are marked "(ORT)" when they mirror a stock ORT input check (docs/SEMANTICS.md §2.6) and
"(mha_ep)" when they are ours. Code, tests and docs name a rule by its function (``rule_past``), never by its
place in the list.

  attributes_from_mapping      attributes: num_heads present and > 0 (and fits a CUDA int); each ORT attribute of its
                               ONNX kind (run before the rest; every later rule is a ``rule_*`` in ``RULES``)
  rule_slot_counts             no more inputs or outputs than the schema has (stock ORT refuses the node when the
                               session is made)
  rule_static_shapes           every static dim of inputs 0-7 is > 0 and fits a CUDA int; sizes fit bytes and a
                               launch grid (mha_ep: a past of length 0 is allowed)
  rule_query_dtype             query dtype is float32, float16 or bfloat16
  rule_float_dtypes_match      key, value, bias, attention_bias, past_key, past_value share the query dtype
  rule_mask_dtype              key_padding_mask is int32 or int64
  rule_decoder_masked_dtypes   (ORT) past_sequence_length and cache_indirection are int32
  rule_query_rank              query is supplied, rank 3, or (mha_ep, where stock ORT's CPU refuses it) packed QKV
                               (B, S, N, 3, H)
  rule_key_and_value_supplied  key and value both supplied; none with a packed QKV query; a packed KV key
                               (B, L, N, 2, H) alone
  rule_key_value_ranks         key and value are rank 3 or 4, (ORT) the same rank; a packed KV key goes with a
                               rank-3 query
  rule_query_hidden_divisible  query hidden divisible by num_heads
  rule_key_value_heads         rank-3 key/value hidden divisible by num_heads; rank-4 key/value dim 1 == num_heads
  rule_head_sizes              head sizes: (ORT) rank-3 key hidden == query hidden; rank-4 key/value head == query
                               head; past heads == query head; v_head_size != head_size only without past (ORT's
                               past check)
  rule_key_value_lengths       key and value have the same sequence length
  rule_batches                 key, value, past_key, past_value batch == query batch
  rule_past                    past_key and past_value come together, rank 4, dim 1 == num_heads, same length; (ORT)
                               a packed call has no past and no present, (mha_ep) but packed QKV over a shared buffer
  rule_shared_buffer           the shared buffer (past_key (B, N, M, H) with past_sequence_length, docs/SEMANTICS.md
                               §3.9): (ORT) one element, both presents requested, 0 <= P < M and P + L <= M where the
                               value is known (L <= M where it is not); (mha_ep) BSNH key and value
  rule_total_length            total sequence length P + L fits a CUDA int
  rule_bias                    bias is rank 1 of length 2*D + Dv
  rule_attention_bias          attention_bias is rank 4, (B|1, N|1, S, T)
  rule_key_padding_mask        key_padding_mask is (B,), (3B+2,), (B, T) or (B, S, T)
  rule_cache_indirection       cache_indirection (docs/SEMANTICS.md §3.10): (ORT) rank 3, dim 0 * dim 1 == B,
                               dim 2 == M with a shared buffer; (mha_ep) on the beam path an attention_bias
                               broadcasts over the batch

One more claim rule reads the graph's declarations, which a Call does not carry, so it lives in
claim/graph_rules.py, whose ``decide_node`` asks it after the rules above, of a node they claim:

  qk_output_refusal            (ORT) a requested qk output (output 3) is declared with a float element type and,
                               where its dims are known, as (B, N, S, T) (the op always writes qk in that shape)

With a shared buffer, P is the *value* of past_sequence_length: ``Call.past_length`` carries it where the host
knows it (execute time on the CPU routes). Where it does not (claim time; the native CUDA route, which reads it on
the device), the rules that need T = P + L pass, and the device checks them (docs/SEMANTICS.md §3.9).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from mha_ep import limits, spec
from mha_ep.claim.tensor_info import TensorInfo, format_shape
from mha_ep.errors import MESSAGE_PREFIX as PREFIX
from mha_ep.launch import ELEMENT_BYTES

DTYPE_BYTES = {**ELEMENT_BYTES, "int32": 4, "int64": 8}


# ORT status codes stock ORT 1.31.1's CPU kernel ends a run with, where a call breaks a rule at run time
# (docs/SEMANTICS.md §2.6; tests/claim/test_bad_input.py holds each case to stock ORT's exception type)
ORT_FAIL, ORT_INVALID_ARGUMENT, ORT_RUNTIME_EXCEPTION = 1, 2, 6


class Refusal(Exception):
    """A rule's verdict: ``reason`` is the whole sentence, ``subject`` the input or attribute it is about, and
    ``code`` the ORT status code stock ORT fails the same call with at run time (INVALID_ARGUMENT from its input
    checks, unless the rule says otherwise)."""

    def __init__(self, reason: str, subject: str, code: int = ORT_INVALID_ARGUMENT):
        super().__init__(PREFIX + reason)
        self.reason = PREFIX + reason
        self.subject = subject
        self.code = code


# ---------------------------------------------------------------------------------------------------- attributes
@dataclass(frozen=True)
class NodeAttributes:
    num_heads: int
    mask_filter_value: float = -10000.0
    scale: float = 0.0  # ORT: 0.0 means 1/sqrt(head_size); any other value is used as it is
    unidirectional: int = 0

    def resolved_scale(self, head_size: int) -> float:
        return 1.0 / math.sqrt(head_size) if self.scale == 0.0 else float(self.scale)

    def causal(self, q_seq: int) -> bool:
        """ORT: causal only when unidirectional and the query spans more than one token."""
        return self.unidirectional == 1 and q_seq > 1


def attributes_from_mapping(attrs: Mapping[str, object]) -> NodeAttributes:
    """The first rule, run before ``RULES``: read ORT's attributes (absent ones take ORT's defaults); each must be
    a number of its kind."""
    known = [a.name for a in spec.ORT_ATTRIBUTES]
    for name in attrs:
        if name not in known:
            raise Refusal(
                f"unknown attribute {str(name)!r}: MultiHeadAttention's schema has {', '.join(known)} (stock ORT "
                "refuses the node)",
                str(name),
            )
    num_heads = attrs.get("num_heads")
    if num_heads is None:
        raise Refusal("missing required `num_heads` attribute", "num_heads")
    for spec_attr in spec.ORT_ATTRIBUTES:
        value = attrs.get(spec_attr.name, spec_attr.default)
        kinds = (int,) if spec_attr.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise Refusal(
                f"attribute {spec_attr.name} must be {'an int' if spec_attr.kind == 'int' else 'a float'}, "
                f"got {type(value).__name__} {value!r}",
                spec_attr.name,
            )
    num_heads = int(num_heads)
    if num_heads <= 0:
        raise Refusal(f"num_heads must be > 0, got {num_heads}", "num_heads")
    checked_i32(num_heads, "num_heads")
    defaults = {a.name: a.default for a in spec.ORT_ATTRIBUTES}
    return NodeAttributes(
        num_heads=num_heads,
        mask_filter_value=float(attrs.get("mask_filter_value", defaults["mask_filter_value"])),
        scale=float(attrs.get("scale", defaults["scale"])),
        unidirectional=int(attrs.get("unidirectional", defaults["unidirectional"])),
    )


# ------------------------------------------------------------------------------------------- checked arithmetic
def _refused(check, *args) -> int:
    """One of mha_ep.limits' checks, its LimitError as this gate's Refusal."""
    try:
        return check(*args)
    except limits.LimitError as error:
        raise Refusal(error.reason, error.subject) from None


def checked_i32(value: int, name: str) -> int:
    return _refused(limits.checked_i32, value, name)


def checked_bytes(elements: int, element_size: int, name: str) -> int:
    return _refused(limits.checked_bytes, elements, element_size, name)


def checked_grid(count: int, name: str) -> int:
    return _refused(limits.checked_grid, count, name)


# ------------------------------------------------------------------------------------------------ the rule input
@dataclass(frozen=True)
class Call:
    """One node (claim time) or one call (execute time): attributes, inputs by slot, requested outputs."""

    attrs: NodeAttributes
    inputs: Sequence[Optional[TensorInfo]]  # by slot, spec.INPUTS order; None = absent
    outputs: Sequence[bool] = (True, False, False, False)  # requested outputs, spec.OUTPUTS order
    past_length: Optional[int] = None  # the value of past_sequence_length, where the host knows it

    def info(self, name: str) -> Optional[TensorInfo]:
        slot = spec.SLOT[name]
        return self.inputs[slot] if slot < len(self.inputs) else None

    def present(self, name: str) -> bool:
        return self.info(name) is not None

    def dim(self, name: str, axis: int) -> Optional[int]:
        info = self.info(name)
        return None if info is None else info.dim(axis)

    def rank(self, name: str) -> Optional[int]:
        info = self.info(name)
        return None if info is None else info.rank

    def dtype(self, name: str) -> Optional[str]:
        info = self.info(name)
        return None if info is None else info.dtype

    def shape_text(self, name: str) -> str:
        info = self.info(name)
        return "absent" if info is None else format_shape(info.shape)


# ------------------------------------------------------------------------------------ derived geometry (partial)
def packing(call: Call) -> Optional[str]:
    """"qkv" for packed QKV (query (B, S, N, 3, H), no key or value), "kv" for packed KV (key (B, L, N, 2, H), no
    value), None for separate inputs (docs/SEMANTICS.md §2.1)."""
    if call.rank("query") == 5:
        return "qkv"
    if call.rank("key") == 5:
        return "kv"
    return None


def query_hidden(call: Call) -> Optional[int]:
    """D: query dim 2, or N * H of a packed QKV query."""
    if call.rank("query") == 3:
        return call.dim("query", 2)
    head = call.dim("query", 4) if call.rank("query") == 5 else None
    return None if head is None else head * call.attrs.num_heads


def head_size(call: Call) -> Optional[int]:
    if call.rank("query") == 5:
        return call.dim("query", 4)
    hidden = call.dim("query", 2) if call.rank("query") == 3 else None
    if hidden is None or hidden % call.attrs.num_heads:
        return None
    return hidden // call.attrs.num_heads


def v_head_size(call: Call) -> Optional[int]:
    n = call.attrs.num_heads
    form = packing(call)
    if form == "qkv":
        return call.dim("query", 4)
    if form == "kv":
        return call.dim("key", 4)
    if call.rank("value") == 3:
        hidden = call.dim("value", 2)
        return None if hidden is None or hidden % n else hidden // n
    if call.rank("value") == 4:
        return call.dim("value", 3)
    return None


def kv_seq(call: Call) -> Optional[int]:
    if packing(call) == "qkv":
        return call.dim("query", 1)
    rank = call.rank("key")
    return call.dim("key", 1) if rank in (3, 5) else call.dim("key", 2) if rank == 4 else None


def shared_buffer(call: Call) -> bool:
    """ORT's ``past_present_share_buffer``: past_key together with past_sequence_length (docs/SEMANTICS.md §3.1)."""
    return call.present("past_key") and call.present("past_sequence_length")


def max_seq(call: Call) -> Optional[int]:
    """M: the length of a shared buffer (past_key dim 2)."""
    return call.dim("past_key", 2) if shared_buffer(call) else None


def past_seq(call: Call) -> Optional[int]:
    """P: the past's length, which for a shared buffer is the value of past_sequence_length (None when unknown)."""
    if shared_buffer(call):
        return call.past_length
    return call.dim("past_key", 2) if call.present("past_key") else 0


def beam_path(call: Call) -> bool:
    """Whether cache_indirection takes effect (docs/SEMANTICS.md §3.10), as far as shapes tell: a shared buffer,
    one query token and a key_padding_mask that is absent or (B, T). ORT also needs P > 0, which only the value
    says (at P = 0 there is no past row to redirect)."""
    mask_rank = call.rank("key_padding_mask")
    return (
        call.present("cache_indirection") and shared_buffer(call) and call.dim("query", 1) == 1
        and (not call.present("key_padding_mask") or mask_rank == 2)
    )  # fmt: skip


def total_seq(call: Call) -> Optional[int]:
    length, past = kv_seq(call), past_seq(call)
    return None if length is None or past is None else past + length


# ----------------------------------------------------------------------------------------------------- the rules
def rule_slot_counts(call: Call) -> None:
    """More inputs or outputs than the schema has: stock ORT refuses the node when the session is made."""
    for what, count, limit in (("inputs", len(call.inputs), len(spec.INPUTS)), ("outputs", len(call.outputs), len(spec.OUTPUTS))):
        if count > limit:
            raise Refusal(
                f"the node has {count} {what}; MultiHeadAttention's schema has at most {limit} (stock ORT refuses "
                "the node)",
                what,
            )


def rule_static_shapes(call: Call) -> None:
    """Every static dim of inputs 0-7 is > 0 (a past may have length 0) and fits a CUDA int; sizes fit bytes and
    a launch grid."""
    for name in spec.PLUGIN_INPUTS:
        info = call.info(name)
        if info is None or info.shape is None:
            continue
        known = 1
        for axis, extent in enumerate(info.shape):
            if extent is None:
                continue
            past_length = name in ("past_key", "past_value") and axis == 2
            if extent <= 0 and not (past_length and extent == 0):
                raise Refusal(f"{name} dim {axis} must be > 0, got {extent}", name)
            checked_i32(extent, f"{name} dim {axis}")
            known *= extent
        if info.is_static:
            if info.dtype in DTYPE_BYTES:
                checked_bytes(known, DTYPE_BYTES[info.dtype], name)
            checked_grid(known, f"{name} element traversal")


def rule_query_dtype(call: Call) -> None:
    """query is float32, float16 or bfloat16."""
    dtype = call.dtype("query")
    if dtype is not None and dtype not in spec.FLOAT_DTYPES:
        raise Refusal(f"query dtype {dtype} not supported (expected float32, float16 or bfloat16)", "query")


def rule_float_dtypes_match(call: Call) -> None:
    """key, value, bias, attention_bias, past_key and past_value share the query dtype."""
    q_dtype = call.dtype("query")
    if q_dtype is None:
        return
    for name in ("key", "value", "bias", "attention_bias", "past_key", "past_value"):
        dtype = call.dtype(name)
        if call.present(name) and dtype is not None and dtype != q_dtype:
            raise Refusal(f"{name} dtype {dtype} must match query dtype {q_dtype}", name)


def rule_mask_dtype(call: Call) -> None:
    """key_padding_mask is int32 or int64."""
    dtype = call.dtype("key_padding_mask")
    if call.present("key_padding_mask") and dtype is not None and dtype not in spec.MASK_DTYPES:
        raise Refusal(f"key_padding_mask dtype {dtype} must be int32 or int64", "key_padding_mask")


def rule_decoder_masked_dtypes(call: Call) -> None:
    """past_sequence_length and cache_indirection are int32 (ORT's type constraint M)."""
    for name in spec.INT32_INPUTS:
        dtype = call.dtype(name)
        if call.present(name) and dtype is not None and dtype != "int32":
            raise Refusal(f"{name} dtype {dtype} must be int32 (ORT's type constraint M)", name)


def rule_query_rank(call: Call) -> None:
    """query is (B, S, hidden), or packed QKV (B, S, N, 3, H) (mha_ep: stock ORT's CPU provider refuses the
    packed form, its CUDA provider runs it on its fused kernels only; docs/SEMANTICS.md §2.1)."""
    if not call.present("query"):
        raise Refusal("query (input 0) is required", "query")
    rank = call.rank("query")
    if rank is not None and rank not in (3, 5):
        raise Refusal(
            f"Input 'query' is expected to have 3 or 5 dimensions, got {rank}: query must be (B, S, hidden) or packed "
            f"QKV (B, S, num_heads, 3, head_size); got shape {call.shape_text('query')}",
            "query",
        )
    if rank == 5:
        heads, three = call.dim("query", 2), call.dim("query", 3)
        if (heads is not None and heads != call.attrs.num_heads) or (three is not None and three != 3):
            raise Refusal(
                f"Expect 'query' shape (batch_size, sequence_length, num_heads, 3, head_size) for packed qkv: got "
                f"{call.shape_text('query')} with num_heads {call.attrs.num_heads}",
                "query",
                ORT_RUNTIME_EXCEPTION,  # stock CPU: "Packed QKV ... not implemented for CPU", for any packed call
            )


def rule_key_and_value_supplied(call: Call) -> None:
    """Separate key and value; or neither with a packed QKV query; or a packed KV key (B, L, N, 2, H) alone."""
    if call.rank("query") == 5:
        for name in ("key", "value"):
            if call.present(name):
                raise Refusal(
                    f"a packed QKV query {call.shape_text('query')} holds the keys and values: {name} "
                    f"{call.shape_text(name)} must be absent",
                    name,
                    ORT_RUNTIME_EXCEPTION,
                )
        return
    if not call.present("key"):
        if call.rank("query") is None:
            return  # packed QKV or not: the execute-time check sees the rank
        raise Refusal(
            "key is required with a rank-3 query (B, S, hidden); without key and value the query must be packed QKV "
            f"(B, S, num_heads, 3, head_size), got {call.shape_text('query')}",
            "key",
        )
    if call.rank("key") == 5:
        if call.present("value"):
            raise Refusal(
                f"a packed KV key {call.shape_text('key')} holds the values: value {call.shape_text('value')} must "
                "be absent (Input 'value' shall be absent for packed kv)",
                "value",
                ORT_RUNTIME_EXCEPTION,  # stock CPU: "Packed KV not implemented for CPU", for any packed KV call
            )
        return
    if not call.present("value"):
        if call.rank("key") is None:
            return  # packed KV or not: the execute-time check sees the rank
        raise Refusal(
            "value is required when key is rank 3 or 4; without value the key must be packed KV (batch_size, "
            f"kv_sequence_length, num_heads, 2, head_size), got key {call.shape_text('key')}",
            "value",
        )


def rule_key_value_ranks(call: Call) -> None:
    """key and value rank 3 or 4 alike; a packed KV key (B, L, N, 2, H) with a rank-3 query."""
    if call.rank("key") == 5:
        if call.rank("query") not in (None, 3):
            raise Refusal(f"Expect rank of query be 3 for packed kv, got query {call.shape_text('query')}", "query",
                          ORT_RUNTIME_EXCEPTION)
        heads, two = call.dim("key", 2), call.dim("key", 3)
        if (heads is not None and heads != call.attrs.num_heads) or (two is not None and two != 2):
            raise Refusal(
                f"Expect 'key' shape (batch_size, kv_sequence_length, num_heads, 2, head_size) for packed kv: got "
                f"{call.shape_text('key')} with num_heads {call.attrs.num_heads}",
                "key",
                ORT_RUNTIME_EXCEPTION,
            )
        return
    for name in ("key", "value"):
        rank = call.rank(name)
        if rank is not None and rank not in (3, 4):
            raise Refusal(
                f"{name} must be rank 3 (B, T, hidden) or rank 4 (B, N, T, H) (a packed KV key (B, L, N, 2, H) comes "
                f"without value); rank {rank} is not (shape {call.shape_text(name)})",
                name,
            )
    k_rank, v_rank = call.rank("key"), call.rank("value")
    if k_rank is not None and v_rank is not None and k_rank != v_rank:
        raise Refusal(
            f"key and value must both be rank 3 (B, L, hidden) or both rank 4 (B, N, L, head_size), got key "
            f"{call.shape_text('key')}, value {call.shape_text('value')}",
            "value",
        )


def rule_query_hidden_divisible(call: Call) -> None:
    """A rank-3 query's hidden is divisible by num_heads."""
    hidden = call.dim("query", 2)
    if call.rank("query") == 3 and hidden is not None and hidden % call.attrs.num_heads:
        raise Refusal(f"query hidden {hidden} not divisible by num_heads {call.attrs.num_heads}", "query",
                      ORT_FAIL)  # stock CPU has no check: its Tensor::Reshape enforcement fails the run


def rule_key_value_heads(call: Call) -> None:
    """A rank-3 key's or value's hidden is divisible by num_heads; a rank-4 one's dim 1 is num_heads."""
    n = call.attrs.num_heads
    for name in ("key", "value"):
        if call.rank(name) == 3:
            hidden = call.dim(name, 2)
            if hidden is not None and hidden % n:  # a key's hidden differs from the query's first (an ORT check)
                raise Refusal(f"{name} hidden {hidden} not divisible by num_heads {n}", name,
                              ORT_FAIL if name == "value" else ORT_INVALID_ARGUMENT)  # value: Reshape, as query's
        if call.rank(name) == 4:
            heads = call.dim(name, 1)
            if heads is not None and heads != n:
                raise Refusal(
                    f"rank-4 {name} dim 1 ({heads}) must equal num_heads {n}; got shape {call.shape_text(name)}",
                    name,
                )


def rule_head_sizes(call: Call) -> None:
    """A rank-3 key's hidden is the query's; every head size (a packed KV key's, rank-4 key and value, the pasts) is
    the query's; v_head_size differs from it only without a past (ORT's past check)."""
    h = head_size(call)
    if h is None:
        return
    q_hidden = query_hidden(call)
    if call.rank("key") == 5:
        head = call.dim("key", 4)
        if head is not None and head != h:
            raise Refusal(
                f"packed KV key head_size {head} must equal query head_size {h} (key {call.shape_text('key')}, "
                f"query {call.shape_text('query')})",
                "key",
                ORT_RUNTIME_EXCEPTION,
            )
    if call.rank("key") == 3:
        k_hidden = call.dim("key", 2)
        if k_hidden is not None and k_hidden != q_hidden:
            raise Refusal(
                f"key hidden {k_hidden} must equal query hidden {q_hidden} (key {call.shape_text('key')}, "
                f"query {call.shape_text('query')})",
                "key",
            )
    for name in ("key", "value"):
        if call.rank(name) == 4:
            head = call.dim(name, 3)
            if head is not None and head != h:
                raise Refusal(
                    f"{name} head_size {head} must equal query head_size {h} (rank-4 {name} "
                    f"{call.shape_text(name)} is (B, N, L, H) with H = query hidden / num_heads)",
                    name,
                )
    for name in ("past_key", "past_value"):
        if call.rank(name) == 4:
            head = call.dim(name, 3)
            if head is not None and head != h:
                raise Refusal(
                    f"{name} head_size {head} must equal query head_size {h} (shape {call.shape_text(name)})", name
                )
    hv = v_head_size(call)
    if hv is not None and hv != h and call.present("past_key"):
        raise Refusal(
            f"v_head_size {hv} must equal qk_head_size {h} when past_key/past_value are given (ORT requires both "
            f"past tensors to end in head_size)",
            "value",
        )


def rule_key_value_lengths(call: Call) -> None:
    """key and value have the same sequence length."""
    k_len = kv_seq(call)
    v_rank = call.rank("value")
    v_len = call.dim("value", 1) if v_rank == 3 else call.dim("value", 2) if v_rank == 4 else None
    if k_len is not None and v_len is not None and k_len != v_len:
        raise Refusal(
            f"key seq {k_len} != value seq {v_len} (key {call.shape_text('key')}, value {call.shape_text('value')})",
            "value",
        )


def rule_batches(call: Call) -> None:
    """key, value, past_key and past_value have the query's batch."""
    q_batch = call.dim("query", 0)
    if q_batch is None:
        return
    for name in ("key", "value", "past_key", "past_value"):
        batch = call.dim(name, 0)
        if batch is not None and batch != q_batch:
            raise Refusal(f"{name} batch {batch} must equal query batch {q_batch}", name)


def rule_past(call: Call) -> None:
    """past_key and past_value come together, rank 4, dim 1 == num_heads, the same length; (ORT, its CUDA
    provider's) a packed call has no past and no present, (mha_ep) except packed QKV over a shared buffer
    (docs/SEMANTICS.md "Packed QKV / KV: ours")."""
    form = packing(call)
    presents = len(call.outputs) > 2 and (call.outputs[1] or call.outputs[2])
    packed_shared = form == "qkv" and shared_buffer(call)  # rule_shared_buffer checks the rest of its form
    pasts = call.present("past_key") or call.present("past_value")
    if form is not None and not packed_shared and (pasts or presents):
        subject = "past_key" if call.present("past_key") else "past_value" if call.present("past_value") else "present_key"
        raise Refusal(
            f"Inputs 'past_key', 'past_value', 'present_key' and 'present_value' shall be empty for packed "
            f"{form.upper()} format (a packed call computes one step of attention over its own keys)",
            subject,
            ORT_RUNTIME_EXCEPTION,
        )
    if call.present("past_key") != call.present("past_value"):
        raise Refusal("past_key and past_value must be provided together", "past_value")
    n = call.attrs.num_heads
    for name in ("past_key", "past_value"):
        rank = call.rank(name)
        if rank is not None and rank != 4:
            raise Refusal(f"{name} must be rank 4 (B, N, P, H), got rank {rank}", name)
        heads = call.dim(name, 1) if rank == 4 else None
        if heads is not None and heads != n:
            raise Refusal(f"{name} dim 1 ({heads}) must equal num_heads {n}", name)
    pk_len, pv_len = call.dim("past_key", 2), call.dim("past_value", 2)
    if pk_len is not None and pv_len is not None and pk_len != pv_len:
        raise Refusal(f"past_key seq {pk_len} != past_value seq {pv_len}", "past_value")


def rule_shared_buffer(call: Call) -> None:
    """ORT's own checks of a shared buffer, in its words; then mha_ep's: BSNH key and value."""
    if not shared_buffer(call):
        return
    psl = call.info("past_sequence_length")
    if psl.is_static and math.prod(psl.shape) != 1:
        raise Refusal(
            f"past_sequence_length tensor must be of one element when past_present_share_buffer is set, got shape "
            f"{format_shape(psl.shape)}",
            "past_sequence_length",
        )
    if len(call.outputs) < 3 or not (call.outputs[1] and call.outputs[2]):
        raise Refusal(
            "Shared past/present buffer requires both present_key and present_value outputs. (stock ORT refuses "
            "the node too)",
            "present_key",
        )
    if call.rank("key") == 4:
        raise Refusal(
            f"a shared past buffer (past_key with past_sequence_length) takes BSNH key and value (B, L, hidden); "
            f"key {call.shape_text('key')} is BNSH, for which stock ORT's CPU kernel writes presents that hold "
            "neither the past nor the new keys (docs/SEMANTICS.md §3.9)",
            "key",
        )
    m, p, length = max_seq(call), call.past_length, kv_seq(call)
    if m is None:
        return
    if p is None:
        if length is not None and length > m:
            raise Refusal(
                f"kv_sequence_length ({length}) exceeds max_sequence_length ({m}), the shared buffer's length: no "
                "past_sequence_length fits it",
                "past_key",
            )
        return
    if not 0 <= p < m:
        raise Refusal(
            f"past_sequence_length must be non-negative and less than max_sequence_length ({m}), got {p}",
            "past_sequence_length",
        )
    if length is not None and p + length > m:
        raise Refusal(
            f"past_sequence_length ({p}) plus kv_sequence_length ({length}) must not exceed max_sequence_length "
            f"({m}).",
            "past_sequence_length",
        )


def rule_total_length(call: Call) -> None:
    """The total sequence length P + L fits a CUDA int."""
    total = total_seq(call)
    if total is not None:
        checked_i32(total, "total sequence length")


def rule_bias(call: Call) -> None:
    """bias is rank 1 of length 2*D + Dv."""
    if not call.present("bias"):
        return
    rank = call.rank("bias")
    if rank is not None and rank != 1:
        raise Refusal(f"bias must be rank 1, got rank {rank} (shape {call.shape_text('bias')})", "bias")
    length, q_hidden, hv = call.dim("bias", 0), query_hidden(call), v_head_size(call)
    if length is None or q_hidden is None or hv is None:
        return
    v_hidden = hv * call.attrs.num_heads
    expected = 2 * q_hidden + v_hidden
    if length != expected:
        raise Refusal(f"bias length {length} must equal 2*hidden + v_hidden = {expected}", "bias")


def rule_attention_bias(call: Call) -> None:
    """attention_bias is rank 4, (B|1, N|1, S, T)."""
    if not call.present("attention_bias"):
        return
    rank = call.rank("attention_bias")
    if rank is not None and rank != 4:
        raise Refusal(
            f"attention_bias must be rank 4 (B|1, N|1, S, T), got rank {rank} "
            f"(shape {call.shape_text('attention_bias')})",
            "attention_bias",
        )
    q_batch, q_seq, total = call.dim("query", 0), call.dim("query", 1), total_seq(call)
    if rank != 4 or q_batch is None or q_seq is None or total is None:
        return
    n = call.attrs.num_heads
    d0, d1, d2, d3 = (call.dim("attention_bias", a) for a in range(4))
    if (
        (d0 is not None and d0 not in (1, q_batch))
        or (d1 is not None and d1 not in (1, n))
        or (d2 is not None and d2 != q_seq)
        or (d3 is not None and d3 != total)
    ):
        raise Refusal(
            f"attention_bias shape {call.shape_text('attention_bias')} is incompatible with B={q_batch}, N={n}, "
            f"S={q_seq}, T={total} (expected ({q_batch} or 1, {n} or 1, {q_seq}, {total}))",
            "attention_bias",
        )


def rule_key_padding_mask(call: Call) -> None:
    """key_padding_mask is (B,), (3B+2,), (B, T) or (B, S, T)."""
    if not call.present("key_padding_mask"):
        return
    rank = call.rank("key_padding_mask")
    if rank is not None and rank not in (1, 2, 3):
        raise Refusal(
            f"key_padding_mask must be rank 1, 2, or 3, got rank {rank} "
            f"(shape {call.shape_text('key_padding_mask')})",
            "key_padding_mask",
        )
    b, s, t = call.dim("query", 0), call.dim("query", 1), total_seq(call)
    if rank is None or b is None or s is None or t is None:
        return
    dims = [call.dim("key_padding_mask", a) for a in range(rank)]

    def fits(actual, *allowed):
        return actual is None or actual in allowed

    ok = {
        1: lambda: fits(dims[0], b, 3 * b + 2),
        2: lambda: fits(dims[0], b) and fits(dims[1], t),
        3: lambda: fits(dims[0], b) and fits(dims[1], s) and fits(dims[2], t),
    }[rank]()
    if not ok:
        raise Refusal(
            f"key_padding_mask shape {call.shape_text('key_padding_mask')} is incompatible with B={b}, S={s}, T={t} "
            f"(expected ({b},) key lengths, ({3 * b + 2},) key lengths + cu_seqlens, ({b}, {t}) or ({b}, {s}, {t}))",
            "key_padding_mask",
        )


def rule_cache_indirection(call: Call) -> None:
    """ORT's checks of cache_indirection's shape (made whether or not it takes effect), in its words; then
    mha_ep's: on the beam path an attention_bias broadcasts over the batch."""
    if not call.present("cache_indirection"):
        return
    rank = call.rank("cache_indirection")
    if rank is not None and rank != 3:
        raise Refusal(f"Input 'cache_indirection' is expected to have 3 dimensions, got {rank}", "cache_indirection")
    batches, beams, length = (call.dim("cache_indirection", a) for a in range(3))
    rows = call.dim("query", 0)
    if batches is not None and beams is not None and rows is not None and batches * beams != rows:
        raise Refusal(
            f"Input 'cache_indirection' dimension 0 ({batches}) times dimension 1 (num_beams={beams}) must equal "
            f"batch_beam_size ({rows})",
            "cache_indirection",
        )
    m = max_seq(call)
    if m is not None and length is not None and length != m:
        raise Refusal(
            f"Input 'cache_indirection' dimension 2 should be same as (or less than) max_sequence_length, got "
            f"{length} (it must equal the shared buffer's length {m})",
            "cache_indirection",
        )
    bias_batch = call.dim("attention_bias", 0)
    if beam_path(call) and bias_batch is not None and bias_batch != 1:
        raise Refusal(
            f"an attention_bias of shape {call.shape_text('attention_bias')} with cache_indirection: stock ORT's "
            "beam path reads a per-row attention_bias at the row of the row's batch entry rather than its own "
            "(docs/SEMANTICS.md §3.10), which mha_ep does not copy; give attention_bias dim 0 = 1",
            "attention_bias",
        )


RULES: tuple[Callable[[Call], None], ...] = (
    rule_slot_counts,
    rule_static_shapes,
    rule_query_dtype,
    rule_float_dtypes_match,
    rule_mask_dtype,
    rule_decoder_masked_dtypes,
    rule_query_rank,
    rule_key_and_value_supplied,
    rule_key_value_ranks,
    rule_query_hidden_divisible,
    rule_key_value_heads,
    rule_head_sizes,
    rule_key_value_lengths,
    rule_batches,
    rule_past,
    rule_shared_buffer,
    rule_total_length,
    rule_bias,
    rule_attention_bias,
    rule_key_padding_mask,
    rule_cache_indirection,
)


@functools.lru_cache(maxsize=4096)
def check(call: Call) -> Optional[Refusal]:
    """Run every rule in order; the first refusal wins. None means the call is inside what mha_ep computes.

    The rules are pure functions of the (hashable) Call, so verdicts are memoised: a model's nodes see the same
    shapes run after run, and the execute-time check then costs a dictionary lookup.
    """
    for rule in RULES:
        try:
            rule(call)
        except Refusal as refusal:
            return refusal.with_traceback(None)  # memoised: keep no frames alive
    return None
