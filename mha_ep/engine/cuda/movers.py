"""The layout movers' arguments (kernels/layout.cu ``build_dense_rows``): which sources, destinations and score
offsets each of a call's three movers (Q, K, V) has, as values (``layout_movers``), and their by-value form for
the kernel (``mover_struct``). Every route launches them through pipeline.py (``mover_launch``). This module must not import CuPy (its rules are tested on CPU machines).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from mha_ep.engine.cuda import dispatch
from mha_ep.engine.cuda.geometry import LaunchPlan
from mha_ep.engine.cuda.steps import Struct


class Mover(NamedTuple):
    """One layout mover's work (layout.cu ``Mover``): device addresses (ints or steps.Buffer; None: not given)
    and sizes."""

    cur: object
    cur_is_bnsh: bool
    past: object
    bias: object
    bias_in_operand: bool
    dst: object
    present: object  # the float32 present (bridge) or the call-dtype present apart from dst (native)
    cur_seq: int
    past_seq: int
    dim: int
    offset_weight: object = None  # step 5 of the kernel: the scores' offsets of the rows it stores
    offset_adds_bias: bool = False
    offset_guard: bool = False
    offset_out: object = None
    cur_slots: int = 1  # BSNH rows of a packed input hold this many slots a head (3: QKV, 2: KV), read in place


# layout.cu's struct Mover, field for field (tests/engine/cuda/test_kernel_sources.py compares the two): the kernels take
# it by value, built here as a NumPy structured scalar with C alignment.
MOVER_FIELDS = (
    ("cur", np.uint64), ("past_BNPH", np.uint64), ("bias_NH", np.uint64), ("dst_BNTH", np.uint64),
    ("dst_f32_BNTH", np.uint64), ("dst_present_BNTH", np.uint64), ("offset_weight_NH", np.uint64),
    ("offset_BNR", np.uint64), ("cur_is_bnsh", np.int32), ("bias_in_operand", np.int32),
    ("offset_adds_bias", np.int32), ("offset_guard", np.int32), ("offset_scale", np.float32), ("cur_seq", np.int32),
    ("past_seq", np.int32), ("dim", np.int32), ("cur_slots", np.int32),
)  # fmt: skip
MOVER_DTYPE = np.dtype(list(MOVER_FIELDS), align=True)


def mover_struct(m: Mover, scale: float, two_byte_present: bool) -> Struct:
    """``m`` as layout.cu's struct Mover, passed by value (steps.Struct: its pointer fields hold addresses, ints
    or steps.Buffer names). ``present`` goes to dst_present_BNTH when ``two_byte_present`` (sources and presents
    in the call's dtype), else to dst_f32_BNTH."""
    present = m.present
    return Struct(MOVER_DTYPE, (
        m.cur, m.past, m.bias, m.dst, None if two_byte_present else present,
        present if two_byte_present else None, m.offset_weight, m.offset_out, np.int32(m.cur_is_bnsh),
        np.int32(m.bias_in_operand), np.int32(m.offset_adds_bias), np.int32(m.offset_guard), np.float32(scale),
        np.int32(m.cur_seq), np.int32(m.past_seq), np.int32(m.dim), np.int32(m.cur_slots),
    ))  # fmt: skip


def layout_movers(plan: LaunchPlan, terms: dispatch.ScoreTerms, kv_bnsh: bool, sources: dict, dst: dict,
                  presents: dict, offsets: dict, slots: Optional[dict] = None) -> tuple[Mover, Mover, Mover]:  # fmt: skip
    """The Q, K and V movers of a call: ``slots`` query / key / value -> the slots of a packed input the source is
    one of (absent: 1; packed.source_slots), ``sources`` name -> address for query, key, value, past_key,
    past_value, bias_q, bias_k, bias_v (absent or None: not given); ``dst`` q_BNSH / k_BNTH / v_BNTH operand
    addresses; ``presents`` present_key / present_value written beside the operand (None: none); ``offsets``
    key_offset_BNT / query_offset_BNS buffers, given where ``terms`` wants them. ``terms`` says which projection
    biases the operands hold (the presents always do) and which become the scores' float32 offsets, which the
    movers compute in the same pass (dispatch.score_terms): the key mover K_j . b_q (and the NaN guard of a key
    bias whose query offsets are left out), the query mover (q_i + b_q) . b_k."""
    get = sources.get
    slot = (slots or {}).get
    bias_q, bias_k = get("bias_q"), get("bias_k")
    key_offset, query_offset = offsets.get("key_offset_BNT"), offsets.get("query_offset_BNS")
    query_step5 = (
        dict(offset_weight=bias_k, offset_adds_bias=True, offset_out=query_offset) if terms.query_offset else {}
    )  # fmt: skip
    key_step5 = (
        dict(offset_weight=bias_q, offset_guard=bias_k is not None and not terms.query_offset, offset_out=key_offset)
        if terms.key_offset else {}
    )  # fmt: skip
    return (
        Mover(get("query"), False, None, bias_q, terms.query_bias_in_operand, dst["q_BNSH"], None, plan.q_seq, 0,
              plan.head_size, **query_step5, cur_slots=slot("query", 1)),
        Mover(get("key"), kv_bnsh, get("past_key"), bias_k, terms.key_bias_in_operand, dst["k_BNTH"],
              presents.get("present_key"), plan.kv_seq, plan.past_seq, plan.head_size, **key_step5,
              cur_slots=slot("key", 1)),
        Mover(get("value"), kv_bnsh, get("past_value"), get("bias_v"), True, dst["v_BNTH"],
              presents.get("present_value"), plan.kv_seq, plan.past_seq, plan.v_head_size,
              cur_slots=slot("value", 1)),
    )  # fmt: skip
