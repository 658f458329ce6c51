"""Bad input: every input check of stock ORT (docs/SEMANTICS.md §2.6) and every rule of mha_ep/claim/rules.py.

Each case is one malformed MultiHeadAttention call and gives up to three tests:

* ``test_<case>_not_claimed``: static shapes -> ``mha_ep.partition`` declines the node with the rule's exact
  sentence and subject, and the node stays ``com.microsoft::MultiHeadAttention`` byte for byte. The same test
  also shows that the case is bad for stock ORT too (its error text, at load or at run, contains ``ort_error``),
  or says that the rule is mha_ep's own (``ort_error=None``: qk output, DecoderMaskedMHA inputs, int64 masks,
  CUDA size limits).
* ``test_<case>_fails_at_run``: the same call with symbolic shapes (a dim_param per axis; or no shape at all when
  the defect is a rank) so that the gate cannot see the defect and claims the node; running the bad feeds
  through ``mha_ep.InferenceSession`` raises ``MhaRunError`` naming the node, the input and the expected shape,
  and the same session then runs a good feed and matches stock ORT within 1e-5.
  Cases whose defect is structural (an input or output present or absent, an attribute, a dtype) are visible to
  the gate whatever the shapes, so they have no run test; ``claim_only`` says why.

Shapes: B=2, S=3, L=5, N=2, H=4 (D=8); the past has P=4 (T=9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np
import onnxruntime
import pytest
from packaging.version import Version

import mha_ep

from mha_models import NODE_NAME, assert_outputs_match, node_model, plugin_session

PREFIX = "mha_ep MultiHeadAttention: "
B, S, L, N, H, P = 2, 3, 5, 2, 4, 4
D = N * H
T_PAST = P + L

Q = (B, S, D)
K3 = (B, L, D)
K4 = (B, N, L, H)
PAST = (B, N, P, H)
BSNH = {"query": Q, "key": K3, "value": K3}
BNSH = {"query": Q, "key": K4, "value": K4}
WITH_PAST = {**BSNH, "past_key": PAST, "past_value": PAST}
PRESENTS = ("output", "present_key", "present_value")
M = 8  # a shared buffer: past (B, N, M, H) + past_sequence_length, S = L = 1; with cache_indirection, W = 1 beam
SHARED = {"query": (B, 1, D), "key": (B, 1, D), "value": (B, 1, D), "past_key": (B, N, M, H),
          "past_value": (B, N, M, H), "past_sequence_length": ("int32", (1,))}
BEAMS = {**SHARED, "cache_indirection": ("int32", (B, 1, M))}
BEAM_GOOD = {"past_sequence_length": [4], "cache_indirection": np.zeros((B, 1, M))}


@dataclass(frozen=True)
class BadCase:
    """One malformed call. ``bad``/``good``: slot -> shape, or (dtype, shape) for a non-float32 input."""

    name: str
    bad: Dict[str, object]
    reason: str  # the rule's sentence, without PREFIX
    subject: str
    ort_error: Optional[str]  # a piece of stock ORT's error for this call; None: a rule of mha_ep's own
    good: Optional[Dict[str, object]] = None  # a good call with the same ranks (default: bad's base, see case())
    run_shapes: str = "symbolic"  # how the run test declares its inputs: "symbolic" or "unranked"
    claim_only: str = ""  # why there is no run test
    attrs: Dict[str, object] = field(default_factory=lambda: {"num_heads": N})
    outputs: Tuple[str, ...] = ("output",)
    values: Dict[str, object] = field(default_factory=dict)  # fixed feed values of the bad call, by slot
    good_values: Dict[str, object] = field(default_factory=dict)  # fixed feed values of the good call, by slot


def case(name, base, changes, reason, subject, ort_error, **options) -> BadCase:
    """``base`` with ``changes`` applied (a value of None removes the slot); the good call is ``base``."""
    bad = {**base, **changes}
    bad = {slot: shape for slot, shape in bad.items() if shape is not None}
    options.setdefault("good", dict(base))
    return BadCase(name, bad, reason, subject, ort_error, **options)


def kpm_text(b, s, t):
    return (
        f"(expected ({b},) key lengths, ({3 * b + 2},) key lengths + cu_seqlens, ({b}, {t}) or ({b}, {s}, {t}))"
    )


def ab_text(shape, t):
    return (
        f"attention_bias shape {shape} is incompatible with B={B}, N={N}, S={S}, T={t} "
        f"(expected ({B} or 1, {N} or 1, {S}, {t}))"
    )


PACKED_QKV_CPU = "Packed QKV of shape (B, L, N, 3, H) not implemented for CPU"  # stock CPU refuses every packed
PACKED_KV_CPU = "Packed KV not implemented for CPU"  # call, well-formed or not: mha_ep runs the well-formed ones
PACKED_RUN = ("stock ORT CPU runs no packed call, so the run test's good call has no oracle here: "
              "tests/parity/test_parity_packed.py runs the bad packed feeds and the good ones")
STRUCTURAL = "the defect is the presence or absence of an input, an output or an attribute, visible at claim time"
DTYPE = "element types are static in ONNX: ORT checks them at load and the gate sees them whatever the shapes"
HUGE = "a CUDA size limit: no feed of that size can be built, the gate sees the static dims"

CASES = [
    # --------------------- attributes, dtypes, structure (attributes_from_mapping to rule_key_and_value_supplied)
    case("num_heads_missing", BSNH, {}, "missing required `num_heads` attribute", "num_heads",
         "Required attribute 'num_heads' is missing", attrs={}, claim_only=STRUCTURAL),
    case("num_heads_not_positive", BSNH, {}, "num_heads must be > 0, got 0", "num_heads",
         "num_heads > 0 was false", attrs={"num_heads": 0}, claim_only=STRUCTURAL),
    case("query_dtype", BSNH, {"query": ("float64", Q), "key": ("float64", K3), "value": ("float64", K3)},
         "query dtype float64 not supported (expected float32, float16 or bfloat16)", "query",
         "tensor(double)", claim_only=DTYPE),
    case("query_dtype_int", BSNH, {"query": ("int32", Q), "key": ("int32", K3), "value": ("int32", K3)},
         "query dtype int32 not supported (expected float32, float16 or bfloat16)", "query",
         "tensor(int32)", claim_only=DTYPE),
    case("key_dtype_mismatch", BSNH, {"key": ("float16", K3)},
         "key dtype float16 must match query dtype float32", "key", "Type parameter (T) of Optype "
         "(MultiHeadAttention) bound to different types", claim_only=DTYPE),
    case("attention_bias_dtype_mismatch", {**BSNH, "attention_bias": (B, N, S, L)},
         {"attention_bias": ("float16", (B, N, S, L))},
         "attention_bias dtype float16 must match query dtype float32", "attention_bias",
         "Type parameter (T) of Optype (MultiHeadAttention) bound to different types", claim_only=DTYPE),
    case("key_padding_mask_dtype", {**BSNH, "key_padding_mask": ("int32", (B, L))},
         {"key_padding_mask": ("float32", (B, L))},
         "key_padding_mask dtype float32 must be int32 or int64", "key_padding_mask",
         "Type 'tensor(float)' of input parameter (key_padding_mask)", claim_only=DTYPE),
    # the shared buffer and cache_indirection (rule_decoder_masked_dtypes, rule_shared_buffer, rule_cache_indirection;
    # docs/SEMANTICS.md §3.9-3.10): ORT's own checks, in its words; the checks of values only a run sees are
    # VALUE_CASES below
    case("past_sequence_length_dtype", SHARED, {"past_sequence_length": ("int64", (1,))},
         "past_sequence_length dtype int64 must be int32 (ORT's type constraint M)", "past_sequence_length",
         "Type 'tensor(int64)' of input parameter (past_sequence_length)", outputs=PRESENTS, claim_only=DTYPE),
    case("cache_indirection_dtype", BEAMS, {"cache_indirection": ("int64", (B, 1, M))},
         "cache_indirection dtype int64 must be int32 (ORT's type constraint M)", "cache_indirection",
         "Type 'tensor(int64)' of input parameter (cache_indirection)", outputs=PRESENTS, claim_only=DTYPE),
    case("past_sequence_length_elements", SHARED, {"past_sequence_length": ("int32", (2,))},
         "past_sequence_length tensor must be of one element when past_present_share_buffer is set, got shape (2,)",
         "past_sequence_length", "past_sequence_length tensor must be of one element when "
         "past_present_share_buffer is set", outputs=PRESENTS, values={"past_sequence_length": [4, 4]},
         good_values={"past_sequence_length": [4]}),
    case("shared_buffer_without_presents", SHARED, {},
         "Shared past/present buffer requires both present_key and present_value outputs. (stock ORT refuses the "
         "node too)", "present_key", "Shared past/present buffer requires both present_key and present_value "
         "outputs.", values={"past_sequence_length": [4]}, claim_only=STRUCTURAL),
    case("shared_buffer_bnsh", {**SHARED, "key": (B, N, 1, H), "value": (B, N, 1, H)}, {},
         f"a shared past buffer (past_key with past_sequence_length) takes BSNH key and value (B, L, hidden); key "
         f"({B}, {N}, 1, {H}) is BNSH, for which stock ORT's CPU kernel writes presents that hold neither the past "
         "nor the new keys (docs/SEMANTICS.md §3.9)", "key", None, outputs=PRESENTS,
         values={"past_sequence_length": [4]}, claim_only="BNSH and BSNH differ in rank, which a rank-less model "
         "also shows the gate only at run time; the good call would need BSNH ranks"),
    case("shared_buffer_longer_than_cache", SHARED, {"query": (B, M + 1, D), "key": (B, M + 1, D),
                                                     "value": (B, M + 1, D)},
         f"kv_sequence_length ({M + 1}) exceeds max_sequence_length ({M}), the shared buffer's length: no "
         "past_sequence_length fits it", "past_key",
         f"past_sequence_length (0) plus kv_sequence_length ({M + 1}) must not exceed max_sequence_length ({M}).",
         outputs=PRESENTS, values={"past_sequence_length": [0]},
         claim_only="at run time the value of past_sequence_length is known, and its own check "
         "(past_sequence_length_plus_length) speaks first"),
    case("cache_indirection_rank", BEAMS, {"cache_indirection": ("int32", (B, M))},
         "Input 'cache_indirection' is expected to have 3 dimensions, got 2", "cache_indirection",
         "Input 'cache_indirection' is expected to have 3 dimensions, got 2", outputs=PRESENTS,
         values={"past_sequence_length": [4], "cache_indirection": np.zeros((B, M))}, run_shapes="unranked",
         good_values=BEAM_GOOD),
    case("cache_indirection_beams", BEAMS, {"cache_indirection": ("int32", (1, 1, M))},
         f"Input 'cache_indirection' dimension 0 (1) times dimension 1 (num_beams=1) must equal batch_beam_size "
         f"({B})", "cache_indirection", f"Input 'cache_indirection' dimension 0 (1) times dimension 1 (num_beams=1) "
         f"must equal batch_beam_size ({B})", outputs=PRESENTS,
         values={"past_sequence_length": [4], "cache_indirection": np.zeros((1, 1, M))}, good_values=BEAM_GOOD),
    case("cache_indirection_length", BEAMS, {"cache_indirection": ("int32", (B, 1, M - 1))},
         f"Input 'cache_indirection' dimension 2 should be same as (or less than) max_sequence_length, got {M - 1} "
         f"(it must equal the shared buffer's length {M})", "cache_indirection",
         f"Input 'cache_indirection' dimension 2 should be same as (or less than) max_sequence_length, got {M - 1}",
         outputs=PRESENTS, values={"past_sequence_length": [4], "cache_indirection": np.zeros((B, 1, M - 1))},
         good_values=BEAM_GOOD),
    case("cache_indirection_attention_bias", {**BEAMS, "attention_bias": (1, N, 1, 5)},
         {"attention_bias": (B, N, 1, 5)},
         f"an attention_bias of shape ({B}, {N}, 1, 5) with cache_indirection: stock ORT's beam path reads a "
         "per-row attention_bias at the row of the row's batch entry rather than its own (docs/SEMANTICS.md "
         "§3.10), which mha_ep does not copy; give attention_bias dim 0 = 1", "attention_bias", None,
         outputs=PRESENTS, values={"past_sequence_length": [4], "cache_indirection": np.zeros((B, 1, M))},
         good_values=BEAM_GOOD),
    case("query_rank", BSNH, {"query": (S, D)},
         f"Input 'query' is expected to have 3 or 5 dimensions, got 2: query must be (B, S, hidden) or packed QKV "
         f"(B, S, num_heads, 3, head_size); got shape ({S}, {D})",
         "query", "Inputs 0 (query) shall be 3 or 5 dimensions", run_shapes="unranked"),
    case("query_rank_5", BSNH, {"query": (B, S, N, 3, H)},
         f"a packed QKV query ({B}, {S}, {N}, 3, {H}) holds the keys and values: key ({B}, {L}, {D}) must be absent",
         "key", "Packed QKV of shape (B, L, N, 3, H) not implemented for CPU", run_shapes="unranked"),
    case("packed_qkv_not_three", {"query": Q}, {"query": (B, S, N, 2, H)},
         f"Expect 'query' shape (batch_size, sequence_length, num_heads, 3, head_size) for packed qkv: got ({B}, {S}, "
         f"{N}, 2, {H}) with num_heads {N}", "query", PACKED_QKV_CPU,
         claim_only=PACKED_RUN),
    case("packed_qkv_heads", {"query": Q}, {"query": (B, S, N + 1, 3, H)},
         f"Expect 'query' shape (batch_size, sequence_length, num_heads, 3, head_size) for packed qkv: got ({B}, {S}, "
         f"{N + 1}, 3, {H}) with num_heads {N}", "query", PACKED_QKV_CPU, claim_only=PACKED_RUN),
    case("packed_qkv_past", {"query": (B, S, N, 3, H), "past_key": PAST, "past_value": PAST}, {},
         "Inputs 'past_key', 'past_value', 'present_key' and 'present_value' shall be empty for packed QKV format (a "
         "packed call computes one step of attention over its own keys)", "past_key", PACKED_QKV_CPU,
         claim_only=STRUCTURAL),
    case("packed_qkv_bs3nh", {"query": Q}, {"query": (B, S, 3 * D)},
         "key is required with a rank-3 query (B, S, hidden); without key and value the query must be packed QKV "
         f"(B, S, num_heads, 3, head_size), got ({B}, {S}, {3 * D})", "key",
         "Packed qkv of 3D BS3NH format is not support by MultiHeadAttention", claim_only=STRUCTURAL),
    case("query_only", {"query": Q}, {},
         "key is required with a rank-3 query (B, S, hidden); without key and value the query must be packed QKV "
         f"(B, S, num_heads, 3, head_size), got ({B}, {S}, {D})", "key",
         "Packed qkv of 3D BS3NH format is not support by MultiHeadAttention", claim_only=STRUCTURAL),
    case("value_without_key", BSNH, {"key": None},
         "key is required with a rank-3 query (B, S, hidden); without key and value the query must be packed QKV "
         f"(B, S, num_heads, 3, head_size), got ({B}, {S}, {D})", "key",
         "Input 'value' shall absent when 'key' is absent", claim_only=STRUCTURAL),
    case("packed_kv_not_two", {"query": Q, "key": (B, L, N, 2, H)}, {"key": (B, L, N, 3, H)},
         f"Expect 'key' shape (batch_size, kv_sequence_length, num_heads, 2, head_size) for packed kv: got ({B}, {L}, "
         f"{N}, 3, {H}) with num_heads {N}", "key", PACKED_KV_CPU, claim_only=PACKED_RUN),
    case("packed_kv_head_size", {"query": Q, "key": (B, L, N, 2, H)}, {"key": (B, L, N, 2, H + 1)},
         f"packed KV key head_size {H + 1} must equal query head_size {H} (key ({B}, {L}, {N}, 2, {H + 1}), query "
         f"({B}, {S}, {D}))", "key", PACKED_KV_CPU, claim_only=PACKED_RUN),
    case("packed_kv_query_rank", {"query": Q, "key": (B, L, N, 2, H)}, {"query": (B, S, N, 3, H)},
         f"a packed QKV query ({B}, {S}, {N}, 3, {H}) holds the keys and values: key ({B}, {L}, {N}, 2, {H}) must "
         "be absent", "key", PACKED_QKV_CPU, claim_only=STRUCTURAL),
    case("key_without_value", BSNH, {"value": None},
         "value is required when key is rank 3 or 4; without value the key must be packed KV (batch_size, "
         f"kv_sequence_length, num_heads, 2, head_size), got key ({B}, {L}, {D})", "value",
         "Expect rank of key be 5 for packed kv", claim_only=STRUCTURAL),
    case("past_key_without_past_value", WITH_PAST, {"past_value": None},
         "past_key and past_value must be provided together", "past_value",
         "Input 'past_key' and 'past_value' shall be both present or both absent", outputs=PRESENTS,
         claim_only=STRUCTURAL),
    case("past_value_without_past_key", WITH_PAST, {"past_key": None},
         "past_key and past_value must be provided together", "past_value",
         "Input 'past_key' and 'past_value' shall be both present or both absent", outputs=PRESENTS,
         claim_only=STRUCTURAL),
    # -------------------------------------------------------- sizes (rule_static_shapes, rule_total_length)
    # stock ORT runs empty inputs (an empty key gives zeros); mha_ep declines them (a past of length 0 is fine)
    case("query_zero_length", BSNH, {"query": (B, 0, D)}, "query dim 1 must be > 0, got 0", "query", None),
    case("key_zero_length", BSNH, {"key": (B, 0, D), "value": (B, 0, D)}, "key dim 1 must be > 0, got 0", "key",
         None),
    case("zero_batch", BSNH, {"query": (0, S, D), "key": (0, L, D), "value": (0, L, D)},
         "query dim 0 must be > 0, got 0", "query", None),
    case("dim_exceeds_i32", BSNH, {"query": (B, 2**31, D)}, "query dim 1=2147483648 exceeds CUDA i32 limits",
         "query", None, claim_only=HUGE),
    case("elements_exceed_grid", BSNH, {"query": (1024, 1024, 2**21)},
         f"query element traversal grid blocks={2**41 // 256} for element count {2**41} exceeds CUDA u32 limits",
         "query", None, claim_only=HUGE),
    case("bytes_exceed_isize", BSNH, {"query": (2**31 - 1,) * 3},
         f"query byte size {4 * (2**31 - 1) ** 3} exceeds isize::MAX", "query", None, claim_only=HUGE),
    case("total_length_exceeds_i32", WITH_PAST, {"past_key": (B, N, 2**31 - 1, H), "past_value": (B, N, 2**31 - 1, H)},
         f"total sequence length={2**31 - 1 + L} exceeds CUDA i32 limits", "total", None, outputs=PRESENTS,
         claim_only=HUGE),
    # ------------------------------------------------------------------------ ranks (rule_key_value_ranks)
    case("key_rank", BSNH, {"key": (B, L, N, 2, H)},
         f"a packed KV key ({B}, {L}, {N}, 2, {H}) holds the values: value ({B}, {L}, {D}) must be absent (Input "
         "'value' shall be absent for packed kv)", "value", "Packed KV not implemented for CPU", run_shapes="unranked"),
    case("value_rank", BSNH, {"value": (L, D)},
         f"value must be rank 3 (B, T, hidden) or rank 4 (B, N, T, H) (a packed KV key (B, L, N, 2, H) comes without "
         f"value); rank 2 is not (shape ({L}, {D}))",
         "value", "Inputs 2 (value) shall be 3 or 4 dimensions", run_shapes="unranked"),
    case("key_value_rank_mismatch", BSNH, {"value": K4},
         f"key and value must both be rank 3 (B, L, hidden) or both rank 4 (B, N, L, head_size), got key "
         f"({B}, {L}, {D}), value ({B}, {N}, {L}, {H})", "value",
         "Expect rank of key and value be same, and either 3 or 4", run_shapes="unranked"),
    # --------------- hidden and heads (rule_query_hidden_divisible, rule_key_value_heads, rule_head_sizes)
    # ORT never checks divisibility and fails later inside Tensor::Reshape (docs/SEMANTICS.md §2.1)
    case("query_hidden_not_divisible", BSNH, {"query": (B, S, 7), "key": (B, L, 7), "value": (B, L, 7)},
         "query hidden 7 not divisible by num_heads 2", "query", "Tensor size (42) != new size (36)"),
    case("key_hidden_not_divisible", BSNH, {"key": (B, L, 7)}, "key hidden 7 not divisible by num_heads 2", "key",
         "Input 'query' and 'key' shall have same dim 2 (hidden_size)"),
    case("value_hidden_not_divisible", BSNH, {"value": (B, L, 7)}, "value hidden 7 not divisible by num_heads 2",
         "value", "Tensor size (70) != new size (60)"),
    case("bnsh_key_heads", BNSH, {"key": (B, 3, L, H)},
         f"rank-4 key dim 1 (3) must equal num_heads 2; got shape ({B}, 3, {L}, {H})", "key",
         "Input 'key' and 'value' shall have same shape"),
    case("bnsh_value_heads", BNSH, {"value": (B, 3, L, H)},
         f"rank-4 value dim 1 (3) must equal num_heads 2; got shape ({B}, 3, {L}, {H})", "value",
         "Input 'key' and 'value' shall have same shape"),
    case("key_hidden_mismatch", BSNH, {"key": (B, L, 10)},
         f"key hidden 10 must equal query hidden {D} (key ({B}, {L}, 10), query ({B}, {S}, {D}))", "key",
         "Input 'query' and 'key' shall have same dim 2 (hidden_size)"),
    case("bnsh_key_head_size", BNSH, {"key": (B, N, L, 6), "value": (B, N, L, 6)},
         f"key head_size 6 must equal query head_size {H} (rank-4 key ({B}, {N}, {L}, 6) is (B, N, L, H) with "
         f"H = query hidden / num_heads)", "key", "Input 'key' and 'value' shall have same shape"),
    case("bnsh_value_head_size", BNSH, {"value": (B, N, L, 6)},
         f"value head_size 6 must equal query head_size {H} (rank-4 value ({B}, {N}, {L}, 6) is (B, N, L, H) "
         f"with H = query hidden / num_heads)", "value", "Input 'key' and 'value' shall have same shape"),
    case("past_key_head_size", WITH_PAST, {"past_key": (B, N, P, 6)},
         f"past_key head_size 6 must equal query head_size {H} (shape ({B}, {N}, {P}, 6))", "past_key",
         "Input 'past_key' dimension 3 should be same as head_size, got 6", outputs=PRESENTS),
    case("past_value_head_size", WITH_PAST, {"past_value": (B, N, P, 6)},
         f"past_value head_size 6 must equal query head_size {H} (shape ({B}, {N}, {P}, 6))", "past_value",
         "Input 'past_value' dimension 3 should be same as head_size, got 6", outputs=PRESENTS),
    case("v_head_size_with_past", WITH_PAST, {"value": (B, L, N * 6)},
         f"v_head_size 6 must equal qk_head_size {H} when past_key/past_value are given (ORT requires both past "
         f"tensors to end in head_size)", "value", None, outputs=PRESENTS),  # ORT runs it, reading the (B, N, P, H)
    # past_value as if it were (B, N, P, Hv): its present_value rows are garbage (seen on 1.31.1)
    # ---------------------------------------------------------------------------- lengths and batches (14-16)
    case("key_value_length_mismatch", BSNH, {"value": (B, 4, D)},
         f"key seq {L} != value seq 4 (key ({B}, {L}, {D}), value ({B}, 4, {D}))", "value",
         "Input 'key' and 'value' shall have same dim 1 (kv_sequence_length)"),
    case("bnsh_key_value_length_mismatch", BNSH, {"value": (B, N, 4, H)},
         f"key seq {L} != value seq 4 (key ({B}, {N}, {L}, {H}), value ({B}, {N}, 4, {H}))", "value",
         "Input 'key' and 'value' shall have same shape"),
    case("key_batch", BSNH, {"key": (3, L, D)}, "key batch 3 must equal query batch 2", "key",
         "Input 'query', 'key' and 'value' shall have same dim 0 (batch_size)"),
    case("value_batch", BSNH, {"value": (3, L, D)}, "value batch 3 must equal query batch 2", "value",
         "Input 'query', 'key' and 'value' shall have same dim 0 (batch_size)"),
    case("past_key_batch", WITH_PAST, {"past_key": (3, N, P, H)}, "past_key batch 3 must equal query batch 2",
         "past_key", "Input 'past_key' dimension 0 should be batch_size, got 3", outputs=PRESENTS),
    case("past_value_batch", WITH_PAST, {"past_value": (3, N, P, H)},
         "past_value batch 3 must equal query batch 2", "past_value",
         "Input 'past_value' dimension 0 should be batch_size, got 3", outputs=PRESENTS),
    case("past_key_rank", WITH_PAST, {"past_key": (B, N, P)}, "past_key must be rank 4 (B, N, P, H), got rank 3",
         "past_key", "The past_key input shall be 4 dimensions", outputs=PRESENTS, run_shapes="unranked"),
    case("past_value_rank", WITH_PAST, {"past_value": (B, N, P)},
         "past_value must be rank 4 (B, N, P, H), got rank 3", "past_value",
         "Input 'past_value' is expected to have 4 dimensions, got 3", outputs=PRESENTS,
         run_shapes="unranked"),
    case("past_key_heads", WITH_PAST, {"past_key": (B, 3, P, H)}, "past_key dim 1 (3) must equal num_heads 2",
         "past_key", "Input 'past_key' dimension 1 should be same as number of heads, got 3", outputs=PRESENTS),
    case("past_value_heads", WITH_PAST, {"past_value": (B, 3, P, H)},
         "past_value dim 1 (3) must equal num_heads 2", "past_value",
         "Input 'past_value' dimension 1 should be same as number of heads, got 3", outputs=PRESENTS),
    case("past_length_mismatch", WITH_PAST, {"past_value": (B, N, 3, H)}, f"past_key seq {P} != past_value seq 3",
         "past_value", "Input 'past_key' and 'past_value' shall have same dim 2", outputs=PRESENTS),
    # ------------------------------------------------------------------------------------------ bias (18)
    case("bias_rank", {**BSNH, "bias": (3 * D,)}, {"bias": (2, 12)},
         "bias must be rank 1, got rank 2 (shape (2, 12))", "bias",
         "Input 'bias' is expected to have 1 dimension, got 2", run_shapes="unranked"),
    case("bias_length", {**BSNH, "bias": (3 * D,)}, {"bias": (20,)},
         f"bias length 20 must equal 2*hidden + v_hidden = {3 * D}", "bias",
         "Input 'bias' length is expected to be 2 * hidden_size + hidden_size_v"),
    # -------------------------------------------------------------------------------- attention_bias (19)
    case("attention_bias_rank", {**BSNH, "attention_bias": (B, N, S, L)}, {"attention_bias": (B, S, L)},
         f"attention_bias must be rank 4 (B|1, N|1, S, T), got rank 3 (shape ({B}, {S}, {L}))", "attention_bias",
         "Input 'attention_bias' is expected to have 4 dimensions, got 3", run_shapes="unranked"),
    case("attention_bias_dim0", {**BSNH, "attention_bias": (B, N, S, L)}, {"attention_bias": (3, N, S, L)},
         ab_text(f"(3, {N}, {S}, {L})", L), "attention_bias",
         "Input 'attention_bias' dimension 0 should be batch_size or 1, got 3"),
    case("attention_bias_dim1", {**BSNH, "attention_bias": (B, N, S, L)}, {"attention_bias": (B, 3, S, L)},
         ab_text(f"({B}, 3, {S}, {L})", L), "attention_bias",
         "Input 'attention_bias' dimension 1 should be same as number of heads or 1, got 3"),
    case("attention_bias_dim2", {**BSNH, "attention_bias": (B, N, S, L)}, {"attention_bias": (B, N, 4, L)},
         ab_text(f"({B}, {N}, 4, {L})", L), "attention_bias",
         "Input 'attention_bias' dimension 2 should be same as sequence_length, got 4"),
    case("attention_bias_dim3", {**BSNH, "attention_bias": (B, N, S, L)}, {"attention_bias": (B, N, S, 6)},
         ab_text(f"({B}, {N}, {S}, 6)", L), "attention_bias",
         "Input 'attention_bias' dimension 3 should be same as total_sequence_length, got 6"),
    case("attention_bias_dim3_without_past_length", {**WITH_PAST, "attention_bias": (1, 1, S, T_PAST)},
         {"attention_bias": (1, 1, S, L)}, ab_text(f"(1, 1, {S}, {L})", T_PAST), "attention_bias",
         f"Input 'attention_bias' dimension 3 should be same as total_sequence_length, got {L}", outputs=PRESENTS),
    # ------------------------------------------------------------------------------ key_padding_mask (20)
    case("key_padding_mask_1d_2b", {**BSNH, "key_padding_mask": ("int32", (B,))},
         {"key_padding_mask": ("int32", (2 * B,))},
         f"key_padding_mask shape ({2 * B},) is incompatible with B={B}, S={S}, T={L} {kpm_text(B, S, L)}",
         "key_padding_mask", "Input 'key_padding_mask' shape is not expected."),
    case("key_padding_mask_2d_batch", {**BSNH, "key_padding_mask": ("int32", (B, L))},
         {"key_padding_mask": ("int32", (3, L))},
         f"key_padding_mask shape (3, {L}) is incompatible with B={B}, S={S}, T={L} {kpm_text(B, S, L)}",
         "key_padding_mask", "Input 'key_padding_mask' shape is not expected."),
    case("key_padding_mask_2d_kv_length_with_past", {**WITH_PAST, "key_padding_mask": ("int32", (B, T_PAST))},
         {"key_padding_mask": ("int32", (B, L))},
         f"key_padding_mask shape ({B}, {L}) is incompatible with B={B}, S={S}, T={T_PAST} "
         f"{kpm_text(B, S, T_PAST)}", "key_padding_mask", "Input 'key_padding_mask' shape is not expected.",
         outputs=PRESENTS),
    case("key_padding_mask_3d_query_length", {**BSNH, "key_padding_mask": ("int32", (B, S, L))},
         {"key_padding_mask": ("int32", (B, 4, L))},
         f"key_padding_mask shape ({B}, 4, {L}) is incompatible with B={B}, S={S}, T={L} {kpm_text(B, S, L)}",
         "key_padding_mask", "Input 'key_padding_mask' shape is not expected."),
    case("key_padding_mask_rank", {**BSNH, "key_padding_mask": ("int32", (B, S, L))},
         {"key_padding_mask": ("int32", (B, 1, S, L))},
         f"key_padding_mask must be rank 1, 2, or 3, got rank 4 (shape ({B}, 1, {S}, {L}))", "key_padding_mask",
         "Input 'key_padding_mask' shape is not expected.", run_shapes="unranked"),
]
# Values only a run sees (docs/SEMANTICS.md §3.9-3.10): the node is claimed whatever its shapes, and the run fails
# with stock ORT's own sentence, as stock ORT's run does. (On the native CUDA route the device reads these values:
# an eager call reports them the same way; tests/native/test_native_cuda.py covers a captured graph.)
VALUE_CASES = [
    case("past_sequence_length_range", SHARED, {},
         f"past_sequence_length must be non-negative and less than max_sequence_length ({M}), got {M}",
         "past_sequence_length",
         f"past_sequence_length must be non-negative and less than max_sequence_length ({M}), got {M}",
         outputs=PRESENTS, values={"past_sequence_length": [M]}, good_values={"past_sequence_length": [4]},
         run_shapes="static"),
    case("past_sequence_length_negative", SHARED, {},
         f"past_sequence_length must be non-negative and less than max_sequence_length ({M}), got -1",
         "past_sequence_length",
         f"past_sequence_length must be non-negative and less than max_sequence_length ({M}), got -1",
         outputs=PRESENTS, values={"past_sequence_length": [-1]}, good_values={"past_sequence_length": [4]},
         run_shapes="static"),
    case("past_sequence_length_plus_length", {**SHARED, "query": (B, 3, D), "key": (B, 3, D), "value": (B, 3, D)},
         {}, f"past_sequence_length (6) plus kv_sequence_length (3) must not exceed max_sequence_length ({M}).",
         "past_sequence_length",
         f"past_sequence_length (6) plus kv_sequence_length (3) must not exceed max_sequence_length ({M}).",
         outputs=PRESENTS, values={"past_sequence_length": [6]}, good_values={"past_sequence_length": [5]},
         run_shapes="static"),
    case("cache_indirection_beam_index", BEAMS, {},
         "cache_indirection beam index out of range. Expected [0, 1), got 1 at flattened batch_beam index 0, "
         "sequence position 0", "cache_indirection",
         "cache_indirection beam index out of range. Expected [0, 1), got 1 at flattened batch_beam index 0, "
         "sequence position 0", outputs=PRESENTS,
         values={"past_sequence_length": [4], "cache_indirection": np.ones((B, 1, M))}, good_values=BEAM_GOOD,
         run_shapes="static"),
]
BY_NAME = {c.name: c for c in CASES + VALUE_CASES}
assert len(BY_NAME) == len(CASES) + len(VALUE_CASES), "case names must be unique"


# ------------------------------------------------------------------------------------------------- helpers
def dtype_shape(spec) -> Tuple[str, tuple]:
    if isinstance(spec, tuple) and spec and isinstance(spec[0], str):
        return spec[0], tuple(spec[1])
    return "float32", tuple(spec)


def model_of(inputs: Dict[str, object], c: BadCase, shapes: str):
    return node_model({slot: dtype_shape(s) for slot, s in inputs.items()}, c.outputs, c.attrs, shapes)


def feeds_of(inputs: Dict[str, object], rng: np.random.Generator, values=None) -> Dict[str, np.ndarray]:
    """Random feeds: N(0, 1) floats (never exactly zero), valid right-padding masks for a (B, T) / (B, S, T) shape
    and random 1/2 otherwise; ``values`` fixes the feed of some slots."""
    feeds = {}
    for slot, spec in inputs.items():
        dtype, shape = dtype_shape(spec)
        if values and slot in values:
            feeds[slot] = np.asarray(values[slot]).astype(dtype).reshape(shape)
        elif dtype.startswith("int"):
            if slot == "key_padding_mask" and len(shape) >= 2:
                lengths = rng.integers(1, shape[-1] + 1, size=shape[0])
                keep = np.arange(shape[-1]) < lengths.reshape((-1,) + (1,) * (len(shape) - 1))
                feeds[slot] = np.broadcast_to(keep, shape).astype(dtype)
            else:
                feeds[slot] = rng.integers(1, 3, size=shape).astype(dtype)
        else:
            normal = rng.normal(0.0, 1.0, size=shape)
            feeds[slot] = np.where(normal == 0.0, 0.5, normal).astype(dtype)
    return feeds


# The stock-ORT error strings asserted here are those of ORT 1.31.1 (docs/SEMANTICS.md §2.6); older ORTs (Python 3.10
# tops out at 1.23) word them differently and even crash (SIGFPE) on some of these inputs, so only 1.31+ is asked.
STOCK_ORT_IS_THE_REFERENCE = Version(onnxruntime.__version__) >= Version("1.31")


def stock_error(model, feeds) -> str:
    """Stock ORT's error for this call (load or run), or "" when it runs."""
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - any ORT failure is what we look for
        return str(error)
    return ""


def stock_exception(model, feeds) -> Optional[Exception]:
    """The exception stock ORT CPU raises running this call, or None when it runs."""
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - any ORT failure is what we look for
        return error
    return None


def huge(c: BadCase) -> bool:
    return any(np.prod(dtype_shape(s)[1], dtype=object) > 2**26 for s in c.bad.values())


# --------------------------------------------------------------------------------------------------- tests
def check_not_claimed(c: BadCase, rng: np.random.Generator) -> None:
    model = model_of(c.bad, c, "static")
    result = mha_ep.partition(model)
    assert len(result.decisions) == 1, f"{c.name}: {result.decisions}"
    decision = result.decisions[0]
    assert not decision.claimed, f"{c.name}: claimed, expected the refusal {c.reason!r}"
    assert decision.reason == PREFIX + c.reason, f"{c.name}:\n  got      {decision.reason!r}\n  expected {c.reason!r}"
    assert decision.subject == c.subject, f"{c.name}: subject {decision.subject!r} != {c.subject!r}"
    original = [n.SerializeToString() for n in model.graph.node]
    after = [n.SerializeToString() for n in result.model.graph.node]
    assert after == original, f"{c.name}: the declined node changed:\n{result.model.graph.node}"
    assert all(n.domain == "com.microsoft" for n in result.model.graph.node if n.op_type == "MultiHeadAttention")
    if huge(c) or not STOCK_ORT_IS_THE_REFERENCE:
        return
    error = stock_error(model, feeds_of(c.bad, rng, c.values))
    if c.ort_error is None:
        return
    assert error, f"{c.name}: stock ORT accepted the call that mha_ep declines as an ORT input error"
    assert c.ort_error in error, f"{c.name}: stock ORT's error lacks {c.ort_error!r}:\n{error}"


def check_fails_at_run(c: BadCase, backend: str, rng: np.random.Generator) -> None:
    model = model_of(c.bad, c, c.run_shapes)
    decisions = mha_ep.partition(model).decisions
    assert [d.claimed for d in decisions] == [True], f"{c.name} ({c.run_shapes}): not claimed: {decisions}"
    session = plugin_session(model, backend)
    names = [o.name for o in session.get_outputs()]
    bad = feeds_of(c.bad, rng, c.values)
    with pytest.raises(mha_ep.MhaRunError) as caught:
        session.run(names, bad)
    message = str(caught.value)
    if STOCK_ORT_IS_THE_REFERENCE and not huge(c):  # the type stock ORT raises for the same call, so that a
        stock = stock_exception(model, bad)  # server's `except InvalidArgument` holds on every route
        assert stock is None or isinstance(caught.value, type(stock)), \
            f"{c.name}: {type(caught.value).__name__} is no {type(stock).__name__}, stock ORT's type: {stock}"  # fmt: skip
    assert caught.value.node_name == NODE_NAME, f"{c.name}: node {caught.value.node_name!r}: {message}"
    assert f"'{NODE_NAME}'" in message, f"{c.name}: the message does not name the node: {message}"
    assert c.reason in message, f"{c.name}:\n  got      {message!r}\n  expected {c.reason!r}"
    assert c.subject in message, f"{c.name}: the message does not name {c.subject!r}: {message}"
    # the same session then runs a good call correctly
    good = feeds_of(c.good, rng, c.good_values)
    actual = dict(zip(names, session.run(names, good)))
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip(names, stock.run(names, good)))
    assert_outputs_match(actual, expected, 1e-5, f"[{backend}] {c.name}: good call after the failed one")


def _not_claimed_test(c: BadCase):
    def test(rng):
        check_not_claimed(c, rng)

    test.__doc__ = f"{c.name}: static shapes -> declined with {c.reason!r}"
    return test


def _fails_at_run_test(c: BadCase):
    def test(run_backend, rng):
        check_fails_at_run(c, run_backend, rng)

    test.__doc__ = f"{c.name}: {c.run_shapes} shapes -> claimed; the bad feed raises MhaRunError, a good one runs"
    return test


def _value_test(c: BadCase):
    def test(run_backend, rng):
        check_fails_at_run(c, run_backend, rng)
        if STOCK_ORT_IS_THE_REFERENCE:
            error = stock_error(model_of(c.bad, c, "static"), feeds_of(c.bad, rng, c.values))
            assert c.ort_error in error, f"{c.name}: stock ORT's error lacks {c.ort_error!r}:\n{error}"

    test.__doc__ = f"{c.name}: claimed with static shapes; the bad value fails the run as it fails stock ORT's"
    return test


for _case in CASES:
    globals()[f"test_{_case.name}_not_claimed"] = _not_claimed_test(_case)
    if not _case.claim_only:
        globals()[f"test_{_case.name}_fails_at_run"] = _fails_at_run_test(_case)
for _case in VALUE_CASES:
    globals()[f"test_{_case.name}_fails_at_run"] = _value_test(_case)
del _case


def test_every_case_is_tested_both_ways_or_says_why():
    """Counts, and no silent gaps: a case without a run test carries its reason."""
    runnable = [c for c in CASES if not c.claim_only]
    assert len(CASES) >= 60 and len(runnable) >= 35, (len(CASES), len(runnable))
    for c in CASES:
        assert c.claim_only or c.good is not None, c.name


def test_every_rule_has_a_case():
    """Each rule of claim/rules.py is exercised by at least one case (matched on its message's wording)."""
    from mha_ep.claim import rules

    wording = {
        "attributes_from_mapping": ("num_heads",),
        "rule_static_shapes": ("must be > 0", "exceeds CUDA i32", "exceeds CUDA u32", "exceeds isize"),
        "rule_query_dtype": ("not supported (expected float32",),
        "rule_float_dtypes_match": ("must match query dtype",),
        "rule_mask_dtype": ("must be int32 or int64",),
        "rule_decoder_masked_dtypes": ("must be int32 (ORT's type constraint M)",),
        "rule_shared_buffer": ("must be of one element", "requires both present_key", "takes BSNH key and value",
                               "must be non-negative", "must not exceed", "exceeds max_sequence_length"),
        "rule_cache_indirection": ("expected to have 3 dimensions", "times dimension 1", "dimension 2 should be same",
                                   "beam path reads a per-row attention_bias"),
        "rule_query_rank": ("expected to have 3 or 5 dimensions", "for packed qkv"),
        "rule_key_and_value_supplied": ("holds the keys and values", "key is required", "value is required",
                                        "holds the values"),
        "rule_key_value_ranks": ("or rank 4 (B, N, T, H)", "must both be rank 3", "for packed kv"),
        "rule_query_hidden_divisible": ("query hidden 7 not divisible",),
        "rule_key_value_heads": ("key hidden 7 not divisible", "rank-4 key dim 1", "rank-4 value dim 1"),
        "rule_head_sizes": ("must equal query hidden", "must equal query head_size", "v_head_size",
                            "packed KV key head_size"),
        "rule_key_value_lengths": ("!= value seq",),
        "rule_batches": ("must equal query batch",),
        "rule_past": ("provided together", "must be rank 4 (B, N, P, H)", "must equal num_heads", "!= past_value",
                      "shall be empty for packed"),
        "rule_total_length": ("total sequence length",),
        "rule_bias": ("bias must be rank 1", "bias length"),
        "rule_attention_bias": ("attention_bias must be rank 4", "attention_bias shape"),
        "rule_key_padding_mask": ("must be rank 1, 2, or 3", "key_padding_mask shape"),
    }
    # rule_slot_counts (more slots than the schema) cannot be built from slot names here; its cases, against stock
    # ORT's refusal, are in tests/claim/test_stock_divergences.py.
    names = {r.__name__ for r in rules.RULES} - {"rule_slot_counts"} | {"attributes_from_mapping"}
    assert names == set(wording), f"rules without a wording entry here: {sorted(names ^ set(wording))}"
    for rule, phrases in wording.items():
        for phrase in phrases:
            assert any(phrase in c.reason for c in CASES + VALUE_CASES), f"{rule}: no case whose reason contains {phrase!r}"


def test_execute_time_verdicts_are_memoised_per_signature_but_never_the_arrays():
    """build_problem keeps the rules' verdict per (attributes, dtypes and shapes, outputs): a refused signature
    is refused again with the same sentence, and an accepted one resolves each call's own arrays."""
    from mha_ep.errors import MhaInputError
    from mha_ep.engine.problem import build_problem, validated_call

    rng = np.random.default_rng(5)
    calls = [[rng.standard_normal(shape).astype(np.float32) for shape in (Q, K3, K3)] for _ in range(2)]
    before = validated_call.cache_info().hits
    problems = [build_problem({"num_heads": N}, arrays) for arrays in calls]
    assert validated_call.cache_info().hits >= before + 1
    for problem, arrays in zip(problems, calls):
        assert problem.query_BSD is arrays[0] and problem.key is arrays[1] and problem.value is arrays[2]
    bad = [calls[0][0], rng.standard_normal((B, L, D + 1)).astype(np.float32), calls[0][2]]
    messages = []
    for _ in range(2):
        with pytest.raises(MhaInputError) as raised:
            build_problem({"num_heads": N}, bad)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] and "key" in messages[0]
