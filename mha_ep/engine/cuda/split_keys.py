"""A decode step's attention (S <= dispatch.SPLIT_MAX_ROWS query rows) with a row's keys cut across blocks
(kernels/split_keys.cu), in one of two ways (``chosen_split_kernel``):
  * "stream" (the default): one launch of ``split_key_stream`` (dispatch.key_stream); each block streams its span
    of keys through shared memory a tile at a time, writes its partial output and (max, sum), and the last block
    of each (b, h) to finish merges them into the output; a Fill before it zeroes the blocks' arrival counters;
  * "pair" (the earlier kernels, kept for A/B timing): ``split_key_attention`` (dispatch.key_split), whose blocks
    load their whole chunk before computing, then ``combine_key_splits``, which merges the partials.
Either writes the node's own float16 / bfloat16 tensor when the call passes ``out_narrow`` (no narrowing launch
after), else float32. fused.fused_steps chooses them and passes the flash kernels' arguments (fused._arguments);
this module holds the launches. CuPy is not imported here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from mha_ep.engine.cuda import dispatch
from mha_ep.engine.cuda.steps import Address, Fill, Launch, Pointer
from mha_ep.engine.problem import MhaProblem
from mha_ep.launch import ELEMENT_BYTES, ELEMENT_TYPES

if TYPE_CHECKING:
    from mha_ep.engine.cuda.fused import DeviceFacts

log = logging.getLogger("mha_ep")
SPLIT_THREADS = dispatch.SPLIT_THREADS  # kernels/split_keys.cu SPLIT_THREADS
SPLIT_KERNELS = ("stream", "pair")  # the default first
TILE_COMBINE_WARPS = 4  # kernels/split_keys.cu TILE_COMBINE_WARPS: combine_tile_splits' rows a block, one a warp
SPLIT_KERNEL_ENV = "MHA_EP_SPLIT_KERNEL"  # "pair": the earlier pair of launches, for A/B timing of whole models


def chosen_split_kernel() -> str:
    """The split-key kernels a decode step runs: "stream" unless MHA_EP_SPLIT_KERNEL names "pair" (read when a call
    is planned: a native plan keeps its choice for the process)."""
    return dispatch.kernel_from_environment(SPLIT_KERNEL_ENV, SPLIT_KERNELS)


def takes_split_keys(problem: MhaProblem, facts: "DeviceFacts", operand_dtype: str) -> bool:
    """Whether fused_steps (no tile named) runs the split-key kernels rather than one flash kernel."""
    return dispatch.key_split(problem, facts.sms, ELEMENT_BYTES[operand_dtype]) is not None


def stream_shared_bytes(problem: MhaProblem, cut: dispatch.KeyStream, operand_dtype: str) -> int:
    """split_key_stream's dynamic shared memory (dispatch.stream_shared_bytes)."""
    return dispatch.stream_shared_bytes(problem.geometry, cut, ELEMENT_BYTES[operand_dtype])


def split_stream_steps(problem: MhaProblem, cut: dispatch.KeyStream, take, arguments: tuple, operand_dtype: str,
                       round_query: bool = True, qk: Address = None, programmatic: bool = False) -> list:  # fmt: skip
    """split_key_stream's launch (fused_steps) with flash's ``arguments`` (_arguments: the last block of each
    (b, h) writes the output at their out_BSD, or out_narrow when given), over three scratch buffers: the partial
    outputs, their (max, sum), and with more than one split the pairs' arrival counters, which a Fill zeroes right
    before the launch (a call's scratch holds whatever was there: the kernel counts from 0). ``round_query`` and
    ``qk`` as split_key_steps'. ``programmatic`` (dispatch.programmatic_launches, for a raw query): the counters are zeroed by
    zero_after_prior_grids instead, and both launches are programmatic, so that the blocks load their first K and
    V tiles while the kernels before them still run."""
    g = problem.geometry
    pairs = g.batch * g.num_heads
    rows = pairs * cut.splits * g.q_seq
    partial_O = take("split_O", 4 * rows * g.v_head_size)
    partial_ML = take("split_ML", 8 * rows)
    steps = []
    arrivals = None
    if cut.splits > 1:
        arrivals = take("split_arrivals", 4 * pairs)
        if programmatic:
            steps.append(Launch("zero_after_prior_grids<unsigned>", (1, 1, 1), (SPLIT_THREADS, 1, 1), 0,
                                (Pointer(arrivals), np.int32(pairs)), fused=True, programmatic=True))  # fmt: skip
        else:
            steps.append(Fill(arrivals, 0, 4 * pairs))
    elem, src = ELEMENT_TYPES[problem.dtype], ELEMENT_TYPES[operand_dtype]
    i32 = np.int32
    log.debug("mha_ep: fused path: split keys streamed, %d x %d blocks of %d keys, tiles of %d", pairs, cut.splits,
              cut.span, cut.tile)  # fmt: skip
    steps.append(Launch(
        f"split_key_stream<{elem}, {src}>", (pairs, cut.splits, 1), (SPLIT_THREADS, 1, 1),
        stream_shared_bytes(problem, cut, operand_dtype),
        arguments + (i32(cut.span), i32(cut.tile), Pointer(partial_O), Pointer(partial_ML), Pointer(arrivals),
                     i32(int(round_query)), Pointer(qk)),
        fused=True, programmatic=programmatic,
    ))  # fmt: skip
    return steps


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


def tail_combine_step(problem: MhaProblem, tail: dispatch.WsTail, block_m: int, partial_O: Address,
                      partial_ML: Address, out_BSD: Address, out_narrow: Address) -> Launch:
    """combine_tile_splits' launch after flash_attention_ws's tail split (``tail``, of tiles of ``block_m`` rows;
    fused.fused_steps): each tail tile's splits merged into its rows of the output, ``out_narrow`` (the call's
    dtype) when given, else float32 ``out_BSD``."""
    g = problem.geometry
    rows = tail.tail_tiles * block_m
    i32 = np.int32
    return Launch(
        f"combine_tile_splits<{ELEMENT_TYPES[problem.dtype]}>", (-(-rows // TILE_COMBINE_WARPS), 1, 1),
        (TILE_COMBINE_WARPS * 32, 1, 1), 0,
        (Pointer(partial_O), Pointer(partial_ML), np.int64(tail.full_tiles), i32(tail.tail_tiles), i32(tail.splits),
         i32(block_m), i32(-(-g.q_seq // block_m)), i32(g.num_heads), i32(g.q_seq), i32(g.v_head_size),
         Pointer(out_BSD), Pointer(out_narrow)),
        fused=True,
    )  # fmt: skip
