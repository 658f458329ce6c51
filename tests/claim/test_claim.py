"""The claim gate, unit level: the original's claim tests ported, and one declined case per rule.

Shapes are written as tuples; None inside a tuple is a symbolic dim, and an input given as ``U`` has unknown rank.
"""

from __future__ import annotations

import pytest

from mha_ep import limits
from mha_ep.claim import Decision, TensorInfo, decide, rules
from mha_ep.launch import LAUNCH_BLOCK

U = TensorInfo()  # supplied, nothing known


def f32(*shape):
    return TensorInfo("float32", tuple(shape))


def typed(dtype, *shape):
    return TensorInfo(dtype, tuple(shape) if shape else None)


def shapes(*dims):
    """Like the original's ``shapes(&[...])``: dtype unknown; ``()`` = absent slot."""
    return [TensorInfo(None, tuple(d)) if d else None for d in dims]


def gate(inputs, num_heads=2, outputs=(True, False, False, False), **attrs) -> Decision:
    return decide({"num_heads": num_heads, **attrs}, inputs, outputs, node_name="n")


# ----------------------------------------------------------------------- the original's `mod tests`, ported
def test_claim_requires_positive_num_heads():
    assert not decide({}, [U, U, U]).claimed
    assert "missing required `num_heads`" in decide({}, [U, U, U]).reason
    zero = decide({"num_heads": 0}, [U, U, U])
    assert not zero.claimed and "num_heads must be > 0, got 0" in zero.reason
    assert decide({"num_heads": 2}, [U, U, U]).claimed


def test_claim_takes_packed_qkv_and_declines_it_beside_a_key():
    """Packed QKV (B, S, N, 3, H): claimed alone (stock ORT's CPU refuses it, mha_ep computes it), declined with a
    key or value beside it (the packed query holds them)."""
    assert gate(shapes((1, 2, 2, 3, 4))).claimed
    d = gate(shapes((1, 2, 2, 3, 4), (1, 2, 8), (1, 2, 8)))
    assert not d.claimed and "a packed QKV query (1, 2, 2, 3, 4) holds the keys and values" in d.reason
    assert d.subject == "key"


def test_claim_takes_packed_kv_and_declines_it_beside_a_value():
    assert gate([f32(1, 2, 8), f32(1, 2, 2, 2, 4)]).claimed  # value absent: the packed-KV signature
    d = gate([f32(1, 2, 8), f32(1, 2, 2, 2, 4), f32(1, 2, 8)])
    assert not d.claimed and "a packed KV key (1, 2, 2, 2, 4) holds the values" in d.reason and d.subject == "value"


def test_claim_declines_packed_forms_of_the_wrong_shape():
    assert "for packed qkv: got (1, 2, 3, 3, 4) with num_heads 2" in gate(shapes((1, 2, 3, 3, 4))).reason
    assert "for packed kv: got (1, 2, 2, 3, 4) with num_heads 2" in gate([f32(1, 2, 8), f32(1, 2, 2, 3, 4)]).reason
    assert "packed KV key head_size 5 must equal query head_size 4" in gate([f32(1, 2, 8), f32(1, 2, 2, 2, 5)]).reason


@pytest.mark.parametrize(
    "inputs",
    [
        [f32(1, 2, 8), f32(1, 2, 8), f32(1, 2, 8)],
        [f32(1, 2, 8), f32(1, 2, 2, 4), f32(1, 2, 2, 4)],
        [f32(1, 2, 8), typed("float32"), typed("float32")],  # symbolic: accepted, re-validated at execute time
    ],
    ids=["bsnh", "bnsh", "unknown-rank"],
)
def test_claim_accepts_supported_key_value_ranks(inputs):
    d = gate(inputs)
    assert d.claimed, d.reason


def test_claim_accepts_mismatched_v_head_size_without_past():
    # Beyond the original (which declined it): stock ORT supports v_head_size != head_size without past.
    # q hidden 8 -> head_size 4; value hidden 12 -> v_head_size 6.
    d = gate(shapes((1, 2, 8), (1, 2, 8), (1, 2, 12)))
    assert d.claimed, d.reason


def test_claim_declines_mismatched_v_head_size_with_past():
    inputs = shapes((1, 2, 8), (1, 2, 8), (1, 2, 12), (), (), (), (1, 2, 3, 4), (1, 2, 3, 4))
    d = gate(inputs)
    assert not d.claimed
    assert "v_head_size 6 must equal qk_head_size 4" in d.reason


def test_claim_declines_non_float_query():
    d = gate([typed("int32"), typed("int32"), typed("int32")])
    assert not d.claimed and "query dtype int32 not supported" in d.reason


def test_claim_declines_dtype_mismatch_between_qkv():
    d = gate([typed("float16"), typed("float32"), typed("float16")])
    assert not d.claimed and "key dtype float32 must match query dtype float16" in d.reason


def test_claim_accepts_plain_self_attention():
    assert gate([f32(1, 4, 8), f32(1, 4, 8), f32(1, 4, 8)]).claimed


def test_checked_geometry_rejects_byte_overflow():
    with pytest.raises(rules.Refusal, match="mask byte size"):
        rules.checked_bytes(2**63, 2, "mask")


def test_host_geometry_allows_products_above_i32_when_offsets_fit():
    batch = sequence = 65_536
    assert rules.checked_i32(batch, "batch") == batch
    elements = batch * sequence * 2 * 4
    assert elements == 34_359_738_368 > limits.I32_MAX
    assert rules.checked_bytes(elements, 4, "large MHA") == 137_438_953_472


def test_checked_cuda_conversions_reject_i32_and_u32_overflow():
    with pytest.raises(rules.Refusal, match="past sequence length=2147483648"):
        rules.checked_i32(limits.I32_MAX + 1, "past sequence length")
    too_many_blocks = (limits.U32_MAX + 1) * LAUNCH_BLOCK
    with pytest.raises(rules.Refusal, match="mask launch grid blocks"):
        rules.checked_grid(too_many_blocks, "mask launch")


def test_claim_rejects_statically_known_zero_and_cuda_i32_geometry():
    zero = decide({"num_heads": 1}, shapes((1, 0, 4), (1, 1, 4), (1, 1, 4)))
    assert "query dim 1 must be > 0" in zero.reason
    big = limits.I32_MAX + 1
    oversized = decide({"num_heads": 1}, shapes((1, 1, big), (1, 1, big), (1, 1, big)))
    assert "query dim 2=2147483648" in oversized.reason


def test_claim_rejects_rank_one_qkv():
    assert "Input 'query' is expected to have 3 or 5 dimensions, got 1" in gate(shapes((8,))).reason
    assert "key must be rank 3" in gate(shapes((1, 2, 8), (8,), (1, 2, 8))).reason


def test_claim_rejects_statically_known_batch_past_and_mask_mismatches():
    d = gate(shapes((2, 1, 8), (1, 1, 8), (2, 1, 8)))
    assert "key batch 1 must equal query batch 2" in d.reason
    d = gate(shapes((2, 1, 8), (2, 1, 8), (2, 1, 8), (), (2, 9)))
    assert "key_padding_mask shape (2, 9) is incompatible with B=2, S=1, T=1" in d.reason
    d = gate(shapes((2, 1, 8), (2, 1, 8), (2, 1, 8), (), (), (), (2, 2, 4, 4), (2, 2, 5, 4)))
    assert "past_key seq 4 != past_value seq 5" in d.reason


def test_claim_allows_empty_past():
    # mha_ep extension: a past of length 0 (first decoding step of a merged decoder) is a real input.
    d = gate(shapes((2, 1, 8), (2, 1, 8), (2, 1, 8), (), (), (), (2, 2, 0, 4), (2, 2, 0, 4)))
    assert d.claimed, d.reason


# ------------------------------------------------------------------------------- one declined case per rule
Q, K, V = f32(2, 3, 8), f32(2, 5, 8), f32(2, 5, 8)
CACHE = f32(2, 2, 8, 4)  # a shared buffer of M = 8
NOT_CLAIMED = {
    "attributes": (dict(inputs=[Q, K, V], num_heads=-1), "num_heads must be > 0, got -1"),
    "attributes_unknown": (dict(inputs=[Q, K, V], mha_ep_node="x"), "unknown attribute 'mha_ep_node'"),
    "rule_slot_counts": (dict(inputs=[Q, K, V] + [None] * 8), "the node has 11 inputs; MultiHeadAttention's schema has at most 10"),
    "rule_slot_counts_outputs": (
        dict(inputs=[Q, K, V], outputs=(True, False, False, False, True)),
        "the node has 5 outputs; MultiHeadAttention's schema has at most 4",
    ),
    "rule_static_shapes": (dict(inputs=[f32(2, 3, 8), f32(2, 0, 8), f32(2, 5, 8)]), "key dim 1 must be > 0, got 0"),
    "rule_query_dtype": (dict(inputs=[typed("float64", 2, 3, 8), K, V]), "query dtype float64 not supported"),
    "rule_float_dtypes_match": (
        dict(inputs=[Q, K, V, typed("float16", 24)]),
        "bias dtype float16 must match query dtype float32",
    ),
    "rule_mask_dtype": (dict(inputs=[Q, K, V, None, typed("float32", 2)]), "key_padding_mask dtype float32"),
    "rule_decoder_masked_dtypes": (
        dict(inputs=[Q, K, V, None, None, None, None, None, typed("int64", 1)]),
        "past_sequence_length dtype int64 must be int32",
    ),
    "rule_shared_buffer": (
        dict(inputs=[Q, K, V, None, None, None, CACHE, CACHE, typed("int32", 1)], outputs=(True, True, False, False)),
        "Shared past/present buffer requires both present_key and present_value outputs.",
    ),
    "rule_cache_indirection": (
        dict(inputs=[Q, K, V, None, None, None, CACHE, CACHE, typed("int32", 1), typed("int32", 2, 8)],
             outputs=(True, True, True, False)),
        "Input 'cache_indirection' is expected to have 3 dimensions, got 2",
    ),
    "rule_query_rank": (dict(inputs=[f32(2, 3, 2, 4), K, V]), "expected to have 3 or 5 dimensions, got 4"),
    "rule_key_and_value_supplied": (dict(inputs=[Q]), "key is required with a rank-3 query"),
    "rule_key_value_ranks": (dict(inputs=[Q, K, f32(2, 2, 5, 4)]), "key and value must both be rank 3"),
    "rule_query_hidden_divisible": (dict(inputs=[f32(2, 3, 9), K, V]), "query hidden 9 not divisible by num_heads 2"),
    "rule_key_value_heads": (dict(inputs=[Q, f32(2, 3, 5, 4), f32(2, 3, 5, 4)]), "rank-4 key dim 1 (3)"),
    "rule_head_sizes": (dict(inputs=[Q, f32(2, 5, 12), V]), "key hidden 12 must equal query hidden 8"),
    "rule_key_value_lengths": (dict(inputs=[Q, K, f32(2, 6, 8)]), "key seq 5 != value seq 6"),
    "rule_batches": (dict(inputs=[Q, K, f32(3, 5, 8)]), "value batch 3 must equal query batch 2"),
    "rule_past": (
        dict(inputs=[Q, K, V, None, None, None, f32(2, 2, 4, 4)]),
        "past_key and past_value must be provided together",
    ),
    "rule_total_length": (
        dict(inputs=[Q, f32(2, limits.I32_MAX, 8), f32(2, None, 8), None, None, None, f32(2, 2, 1, 4), f32(2, 2, 1, 4)]),
        "total sequence length=2147483648 exceeds CUDA i32 limits",
    ),
    "rule_bias": (dict(inputs=[Q, K, V, f32(23)]), "bias length 23 must equal 2*hidden + v_hidden = 24"),
    "rule_attention_bias": (
        dict(inputs=[Q, K, V, None, None, f32(2, 3, 3, 5)]),
        "attention_bias shape (2, 3, 3, 5) is incompatible with B=2, N=2, S=3, T=5",
    ),
    "rule_key_padding_mask": (
        dict(inputs=[Q, K, V, None, typed("int32", 2, 3)]),
        "key_padding_mask shape (2, 3) is incompatible with B=2, S=3, T=5",
    ),
}


@pytest.mark.parametrize("rule", sorted(NOT_CLAIMED))
def test_rule_not_claimed(rule):
    kwargs, fragment = NOT_CLAIMED[rule]
    d = gate(**kwargs)
    assert not d.claimed, f"{rule}: claimed, expected a refusal containing {fragment!r}"
    assert fragment in d.reason, f"{rule}: reason {d.reason!r} lacks {fragment!r}"
    assert d.reason.startswith(rules.PREFIX)
    assert d.subject, f"{rule}: the refusal names no subject"


def test_every_rule_has_a_not_claimed_case():
    names = {rule.__name__ for rule in rules.RULES}
    missing = names - set(NOT_CLAIMED)
    assert not missing, f"rules without a *_not_claimed case: {sorted(missing)}"


def test_the_rules_docstring_lists_every_rule_by_name_in_order():
    """claim/rules.py's docstring names each rule by its function, in the order the gate asks them (the order
    decides which refusal a node gets): attributes_from_mapping, then ``RULES``, then graph_rules'
    qk_output_refusal. A renamed or reordered rule fails here until the list follows."""
    import re

    from mha_ep.claim import graph_rules

    listed = re.findall(r"^  (\w+)  ", rules.__doc__, re.MULTILINE)
    expected = [rules.attributes_from_mapping.__name__, *(rule.__name__ for rule in rules.RULES),
                graph_rules.qk_output_refusal.__name__]
    assert listed == expected
    assert not re.search(r"\bRule\s+\d", rules.__doc__), "a rule is named by its function, not a number"


def test_rules_accept_symbolic_dims_and_revalidate_nothing_they_cannot_see():
    symbolic = [f32(None, None, 8), f32(None, None, 8), f32(None, None, 8), f32(24), typed("int32", None, None)]
    assert gate(symbolic).claimed


# ------------------------------------------------------------------- the shared buffer and cache_indirection
PRESENTS = (True, True, True, False)
STEP = [f32(4, 1, 8), f32(4, 1, 8), f32(4, 1, 8)]  # one new token of 4 rows (2 batch entries x 2 beams)
STEP_CACHE = f32(4, 2, 16, 4)
PSL = typed("int32", 1)


@pytest.mark.parametrize(
    "inputs",
    [
        STEP + [None, None, None, STEP_CACHE, STEP_CACHE, PSL],
        STEP + [f32(24), None, None, STEP_CACHE, STEP_CACHE, PSL, typed("int32", 2, 2, 16)],
        STEP + [None, typed("int32", 4, None), f32(1, 2, 1, None), STEP_CACHE, STEP_CACHE, PSL, typed("int32", 2, 2, 16)],
        [f32(4, 3, 8), f32(4, 3, 8), f32(4, 3, 8), None, None, None, STEP_CACHE, STEP_CACHE, PSL, typed("int32", 4, 1, 16)],
        STEP + [None, None, None, None, None, PSL],  # past_sequence_length without a past: ORT ignores it
        [f32(4, 1, 8), f32(4, 2, 5, 4), f32(4, 2, 5, 4), None, None, None, None, None, PSL, typed("int32", 2, 2, 7)],
    ],
    ids=["shared", "beams", "beams-mask-bias", "prompt-with-beams", "psl-without-past", "cross-with-beams"],
)
def test_claim_accepts_shared_buffers_and_beams(inputs):
    """A static KV cache's nodes (docs/SEMANTICS.md §3.9-3.10): claimed, the length only the run knows."""
    d = gate(inputs, outputs=PRESENTS if inputs[6] is not None else (True, False, False, False))
    assert d.claimed, d.reason


PACKED_STEP = f32(4, 1, 2, 3, 4)  # packed QKV (B, L, N, 3, H): one new token of 4 rows
PAST_ONLY = "shall be empty for packed"  # rule_past's refusal of a packed call with a past or a present


@pytest.mark.parametrize("inputs", [
    [PACKED_STEP, None, None, None, None, None, STEP_CACHE, STEP_CACHE, PSL],
    [PACKED_STEP, None, None, f32(24), typed("int32", 4, None), f32(1, 2, 1, None), STEP_CACHE, STEP_CACHE, PSL,
     typed("int32", 2, 2, 16)],
    [f32(4, 3, 2, 3, 4), None, None, f32(24), None, None, STEP_CACHE, STEP_CACHE, PSL],  # a prompt of 3 tokens
], ids=["packed-shared", "packed-shared-beams-bias-mask", "packed-shared-prompt"])  # fmt: skip
def test_claim_takes_packed_qkv_over_a_shared_buffer(inputs):
    """mha_ep's packed form with a past (docs/SEMANTICS.md, "Packed QKV / KV: ours"): packed QKV, no key or value,
    past_key / past_value (B, N, M, H) with past_sequence_length, both presents; with what the unpacked shared-buffer
    node takes beside it (a 3D bias, a mask, attention_bias, cache_indirection)."""
    d = gate(inputs, outputs=PRESENTS)
    assert d.claimed, d.reason


@pytest.mark.parametrize("inputs, outputs, fragment, subject", [
    ([PACKED_STEP, None, None, None, None, None, f32(4, 2, 5, 4), f32(4, 2, 5, 4)], PRESENTS,
     f"{PAST_ONLY} QKV format", "past_key"),  # a growing past (no past_sequence_length)
    ([PACKED_STEP], PRESENTS, f"{PAST_ONLY} QKV format", "present_key"),  # presents without a past
    ([f32(4, 1, 8), f32(4, 1, 2, 2, 4), None, None, None, None, STEP_CACHE, STEP_CACHE, PSL], PRESENTS,
     f"{PAST_ONLY} KV format", "past_key"),  # packed KV over a shared buffer: not ours
    ([f32(4, 1, 8), f32(4, 1, 2, 2, 4), None, None, None, None, f32(4, 2, 5, 4), f32(4, 2, 5, 4)], PRESENTS,
     f"{PAST_ONLY} KV format", "past_key"),
    ([PACKED_STEP, None, None, None, None, None, STEP_CACHE, STEP_CACHE, PSL], (True, False, False, False),
     "Shared past/present buffer requires both present_key and present_value outputs.", "present_key"),
], ids=["qkv-growing-past", "qkv-presents-only", "kv-shared", "kv-growing-past", "qkv-shared-no-presents"])  # fmt: skip
def test_claim_declines_every_other_packed_call_with_a_past(inputs, outputs, fragment, subject):
    """Packed KV with any past and packed QKV with a growing one keep stock ORT CUDA's refusal, word for word; a
    packed shared-buffer node without its presents gets the shared buffer's own."""
    d = gate(inputs, outputs=outputs)
    assert not d.claimed and fragment in d.reason and d.subject == subject, d


def test_shared_buffer_rules_read_the_length_where_they_know_it():
    """With the value of past_sequence_length, a (B, T) mask and attention_bias's T are checked against P + L."""
    attrs = rules.attributes_from_mapping({"num_heads": 2})
    inputs = STEP + [None, typed("int32", 4, 6), None, STEP_CACHE, STEP_CACHE, PSL]
    assert rules.check(rules.Call(attrs, tuple(inputs), PRESENTS, past_length=5)) is None
    refusal = rules.check(rules.Call(attrs, tuple(inputs), PRESENTS, past_length=6))
    assert "key_padding_mask shape (4, 6) is incompatible with B=4, S=1, T=7" in refusal.reason
    refusal = rules.check(rules.Call(attrs, tuple(inputs), PRESENTS, past_length=16))
    assert "past_sequence_length must be non-negative and less than max_sequence_length (16), got 16" in refusal.reason
