"""A decode step's attention (S <= dispatch.SPLIT_MAX_ROWS query rows) as the split-key pair of launches
(kernels/split_keys.cu): ``split_key_attention`` cuts a row's keys across blocks (dispatch.key_split), each block
writes its partial output and (max, sum), and ``combine_key_splits`` merges them into the output: the node's own
float16 / bfloat16 tensor when the call passes ``out_narrow`` (no narrowing launch after), else float32.
fused.fused_steps chooses this pair and passes the flash kernels' arguments (fused._arguments); this module holds
the launches. CuPy is not imported here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from mha_ep.engine.cuda import dispatch
from mha_ep.engine.cuda.steps import Address, Launch, Pointer
from mha_ep.engine.problem import MhaProblem
from mha_ep.launch import ELEMENT_BYTES, ELEMENT_TYPES

if TYPE_CHECKING:
    from mha_ep.engine.cuda.fused import DeviceFacts

log = logging.getLogger("mha_ep")
SPLIT_THREADS = dispatch.SPLIT_THREADS  # kernels/split_keys.cu SPLIT_THREADS


def takes_split_keys(problem: MhaProblem, facts: "DeviceFacts", operand_dtype: str) -> bool:
    """Whether fused_steps (no tile named) runs the split-key pair rather than one flash kernel."""
    return dispatch.key_split(problem, facts.sms, ELEMENT_BYTES[operand_dtype]) is not None


def split_shared_bytes(problem: MhaProblem, chunk: int, operand_dtype: str) -> int:
    """split_key_attention's dynamic shared memory (dispatch.split_shared_bytes)."""
    return dispatch.split_shared_bytes(problem.geometry, chunk, ELEMENT_BYTES[operand_dtype])


def split_key_steps(problem: MhaProblem, split: dispatch.KeySplit, take, arguments: tuple, operand_dtype: str,
                    out_BSD: Address, round_query: bool = True, qk: Address = None,
                    out_narrow: Address = None) -> list:  # fmt: skip
    """The split-key pair of launches (fused_steps) with flash's ``arguments`` (_arguments); ``round_query``
    False keeps the biased query in float32 (fused_steps' raw_query); ``qk`` receives the masked scores;
    ``out_narrow`` (float16 / bfloat16 calls): the output in the call's dtype, written by combine_key_splits in
    place of the float32 ``out_BSD`` (which may then be None)."""
    g = problem.geometry
    pairs = g.batch * g.num_heads
    rows = pairs * split.splits * g.q_seq
    partial_O = take("split_O", 4 * rows * g.v_head_size)
    partial_ML = take("split_ML", 8 * rows)
    elem, src = ELEMENT_TYPES[problem.dtype], ELEMENT_TYPES[operand_dtype]
    i32 = np.int32
    log.debug("mha_ep: fused path: split keys, %d x %d blocks of %d keys", pairs, split.splits, split.chunk)
    return [
        Launch(f"split_key_attention<{elem}, {src}>", (pairs, split.splits, 1), (SPLIT_THREADS, 1, 1),
               split_shared_bytes(problem, split.chunk, operand_dtype),
               arguments + (i32(split.chunk), Pointer(partial_O), Pointer(partial_ML), i32(int(round_query)),
                            Pointer(qk)),
               fused=True),
        Launch(f"combine_key_splits<{elem}>", (pairs * g.q_seq, 1, 1), (SPLIT_THREADS, 1, 1), 4 * split.splits,
               (Pointer(partial_O), Pointer(partial_ML), i32(split.splits), i32(g.num_heads), i32(g.q_seq),
                i32(g.v_head_size), Pointer(out_BSD), Pointer(out_narrow)), fused=True),
    ]  # fmt: skip
