"""When the fused attention kernel runs, and which one: the cuda backend's dispatch rules, on the CPU.

    reason = fused_unsupported_reason(problem)   # None: the fused path applies; else a sentence for a debug log
    tile = choose_tile(problem, operand_dtype, capability, sms)   # the kernel and its tile

Kernel choice (choose_tile): float32 -> ``flash_attention_fp32`` (CUDA cores, true fp32); float16 / bfloat16 ->
``flash_attention_wgmma`` (Hopper's warpgroup MMA, sm_90a code) where ``wgmma_unsupported_reason`` says None (a
compute capability 9.0 device, operands in the call's dtype, head tile 64 or 128), else ``flash_attention_mma``
(tensor cores, mma.sync m16n8k16; any sm_80+ GPU). Hopper calls without padding mask or attention_bias (float16
ones also when causal; ``ws_unsupported_reason``) take ``flash_attention_ws`` instead (a TMA producer warpgroup and
two or three ping-ponging consumers, persistent): three consumers for head tile 64 where their 192-row tiles pay
(``prefers_three_consumers``), two for head tile 128, or head tile 64 with enough query tiles to fill the GPU
(``prefers_warp_specialized``); the tiles its last persistent round would leave on few SMs are cut into key ranges
merged after it (``ws_tail``). Every kernel is templated on the head tile HEAD_DIM, the smallest of
HEAD_DIM_TILES that holds max(H, Hv). A decode step (S <= SPLIT_MAX_ROWS) takes none of them: its keys are cut
across blocks (kernels/split_keys.cu), by ``key_stream`` for ``split_key_stream`` (one launch; its blocks stream
their keys through shared memory, and each (b, h)'s last one combines), or by ``key_split`` for the earlier pair
``split_key_attention`` then ``combine_key_splits`` (kept for A/B timing: split_keys.chosen_split_kernel).
``key_split`` is None for exactly the calls neither takes.

The measurements behind each default are in docs/BENCH.md ("Dispatch defaults"); the code keeps the reasons.
This module imports no CuPy (tests/engine/cuda/test_cuda_scratch.py checks it); fused.py launches what it chooses.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Union

from mha_ep.launch import ELEMENT_TYPES
from mha_ep.limits import I32_MAX
from mha_ep.engine.problem import MhaProblem

# HEAD_DIM instantiations of flash_attention_mma / _fp32; max(H, Hv) is zero-padded up to one of these. 160 is
# Stable Diffusion 1.5's widest head (N 8 x H 160 at its 256- and 64-token levels).
HEAD_DIM_TILES = (32, 64, 96, 128, 160)
HEAD_SIZE_MULTIPLE = 8  # 16-byte vector loads of 8 elements (kernels/flash_common.cuh LOAD_CHUNK)
SMALLEST_BLOCK_M = 64  # query rows per block of every fused kernel's smallest tile
HOPPER_CAPABILITY = "90"  # wgmma.mma_async is sm_90a code, which runs on compute capability 9.0 only
HOPPER_SM_COUNT = 132  # H100 SXM / H200; choose_tile's default, run_fused passes the device's own count
# The wgmma kernels' HEAD_DIM: whole 64-element swizzle atoms. Their own rounding (wgmma_head_tile): H 65-96 (SD
# 1.5's 80) is padded to 128 with zeros (TMA's out-of-bounds fill, SwizzledTileCopy's bounds), not sent to mma.
# Timed against stock only (docs/BENCH.md §10: SD 1.5's H 80 at 0.83-0.97x stock), not against mma's 96 tile.
WGMMA_HEAD_DIMS = (64, 128)
MMA_ONLY_HEAD_DIM = 32  # heads this small keep flash_attention_mma's 32 tile, not wgmma's 64
WARPGROUP_THREADS = 128  # kernels/wgmma_common.cuh WARPGROUP_THREADS: four warps issue one wgmma
WARPGROUP_ROWS = 64  # kernels/wgmma_common.cuh WARPGROUP_ROWS: the M of every wgmma
WS_BLOCK_M = 128  # query rows of flash_attention_ws's default (two-consumer) tile: WsShape<2>::BLOCK_M
# Head 64 takes flash_attention_ws from this many 128-row query tiles per SM on: with fewer, a persistent block
# per SM leaves more of the GPU idle in the last round (a close call; BENCH.md).
WS_HEAD64_TILES_PER_SM = 3
# Time per query row and key of three consumers against two, set above the measured ratio so that three consumers
# are taken only where they clearly pay (docs/BENCH.md, "Dispatch defaults").
WS3_ROW_COST = 0.85
# flash_attention_ws's tail split (ws_tail): each split of a last-round tile reads at least this many key tiles
# (the pipeline's first and last steps are not overlapped), and a tile takes at most WS_TAIL_MAX_SPLITS splits
# (kernels/split_keys.cu TILE_SPLITS_MAX: combine_tile_splits keeps one split's (max, sum) a lane).
WS_TAIL_MIN_KEY_TILES = 4
WS_TAIL_MAX_SPLITS = 32
WS_TAIL_ENV = "MHA_EP_WS_TAIL"  # "off": no tail split (A/B timing of whole models); default "split"
WS_TAIL_CHOICES = ("split", "off")
WS_CAUSAL_LOGIT_BOUND = 1.0e37  # |scale * q.k| below this: a row's largest allowed logit dominates float32 lowest
FLOAT16_MAX = 65504.0
FEATURE_PADDING = 1  # kernels/flash_common.cuh FlashFeatures FLASH_WITH_PADDING
FEATURE_BIAS = 2  # FLASH_WITH_BIAS
FEATURE_KEY_OFFSET = 4  # FLASH_WITH_KEY_OFFSET
LOW_PRECISION_DTYPES = ("float16", "bfloat16")
SPLIT_MAX_ROWS = 4  # kernels/split_keys.cu SPLIT_MAX_ROWS: query rows of a call the split-key kernel takes
SPLIT_MAX_DIM = 128  # kernels/split_keys.cu SPLIT_MAX_DIM (the fused path's largest head tile)
SPLIT_MIN_CHUNK = 32  # keys per split-key block, at least ...
SPLIT_MAX_CHUNK = 1024  # ... and at most (the block's logits in shared memory)
SPLIT_WAVES = 8  # split-key blocks aimed for, per SM (many small blocks: more loads in flight)
SPLIT_THREADS = 128  # kernels/split_keys.cu SPLIT_THREADS
SPLIT_WARPS = SPLIT_THREADS // 32
SPLIT_SHARED_BYTES = 48 * 1024  # a split-key block's shared memory, at most: its chunk's K and V rows and logits
GRID_Y_MAX = 65535  # CUDA's limit on gridDim.y
STREAM_BLOCKS_PER_SM = 4  # kernels/split_keys.cu STREAM_BLOCKS_PER_SM: split_key_stream blocks aimed for, per SM
STREAM_STAGES = 4  # kernels/split_keys.cu STREAM_STAGES: a block's tiles of K or V rows in flight or in use
STREAM_STAGE_BYTES = 8 * 1024  # one stage: a tile of K or V rows (64 keys of a float16 head of 64)
STREAM_MAX_LOGITS = 4096  # floats of logits a split_key_stream block holds (its span x S, in shared memory)


def kernel_from_environment(variable: str, choices: tuple) -> str:
    """The kernel the environment ``variable`` names, one of ``choices`` (for A/B timing of whole models), else the
    default ``choices[0]``; read when a call is planned, so a native plan keeps its choice for the process. Any
    other name raises ValueError."""
    chosen = os.environ.get(variable) or choices[0]
    if chosen not in choices:
        raise ValueError(f"{variable}={chosen!r}: expected one of {choices}")
    return chosen


PROGRAMMATIC_ENV = "MHA_EP_PROGRAMMATIC"  # "on": the decode kernels launched programmatically
PROGRAMMATIC_CAPABILITY = 90  # programmatic dependent launch: sm_90 and later


def programmatic_launches(capability: str) -> bool:
    """Whether the native route launches a decode step's attention programmatically (steps.Launch.programmatic): on
    a device of ``capability`` ("90") sm_90 or later when MHA_EP_PROGRAMMATIC is "on" (read when a call is
    planned). Then a shared buffer's shared_buffer_decode, and a stream of split keys whose K and V are the node's
    own inputs (fused_steps' raw_query: the cross attention), follow a zero_after_prior_grids in place of a Fill,
    and may start while the kernels before them run; split_key_stream loads its first K and V tiles before it
    waits for them. Not the default: that holds where no kernel right before the node writes its key and value
    (a static decoder's cross attention, whose keys and values are bound inputs), not in every graph."""
    chosen = kernel_from_environment(PROGRAMMATIC_ENV, ("off", "on"))
    return chosen == "on" and int(capability) >= PROGRAMMATIC_CAPABILITY


def head_dim_tile(head_size: int, v_head_size: int) -> Optional[int]:
    """The HEAD_DIM instantiation of flash_attention_mma / _fp32 for these head sizes, or None when none holds them."""
    need = max(head_size, v_head_size)
    return next((tile for tile in HEAD_DIM_TILES if tile >= need), None)


def wgmma_head_tile(head_size: int, v_head_size: int) -> Optional[int]:
    """The HEAD_DIM of flash_attention_wgmma / _ws for these head sizes (WGMMA_HEAD_DIMS), or None: heads of at most
    MMA_ONLY_HEAD_DIM (whose mma tile is half the padded work) or over the widest tile."""
    need = max(head_size, v_head_size)
    if need <= MMA_ONLY_HEAD_DIM:
        return None
    return next((tile for tile in WGMMA_HEAD_DIMS if tile >= need), None)


def kernel_head_tile(head_size: int, v_head_size: int, tile: object = None) -> Optional[int]:
    """HEAD_DIM of the kernel ``tile`` names (a WgmmaTile or WsTile: wgmma_head_tile; else head_dim_tile)."""
    if isinstance(tile, (WgmmaTile, WsTile)):
        return wgmma_head_tile(head_size, v_head_size)
    return head_dim_tile(head_size, v_head_size)


# ------------------------------------------------------------------------------------------------- the tiles
@dataclass(frozen=True)
class MmaTile:
    """Tile of flash_attention_mma: BLOCK_M query rows (one warp per 16) x BLOCK_N keys per step."""

    block_m: int = 64
    block_n: int = 64

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 32

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}"


# Head 64: 64 x 64 (4 warps, three blocks per SM whose softmax and tensor-core phases interleave); head 128: 128 x
# 128, except with an attention_bias, whose float32 tile would not fit beside it (BENCH.md).
DEFAULT_MMA_TILE = MmaTile()
WIDE_HEAD_MMA_TILE = MmaTile(128, 128)
BLOCKS_PER_SM_GOAL = 3  # the head-64 tensor-core tiles are sized so that three blocks fit an SM


@dataclass(frozen=True)
class WgmmaTile:
    """Tile of flash_attention_wgmma: BLOCK_M query rows (one warpgroup of 128 threads per 64) x BLOCK_N keys per
    step; the warpgroups of a block share its K and V tiles."""

    block_n: int = 128
    block_m: int = 64
    overlap: bool = True  # the next tile's S runs beside this tile's softmax (kernel header: OVERLAP)

    @property
    def threads(self) -> int:
        return self.block_m * 2

    @property
    def label(self) -> str:
        return f"wg{self.block_m}x{self.block_n}{'' if self.overlap else 's'}"


@dataclass(frozen=True)
class WsTile:
    """Tile of flash_attention_ws: 64 query rows per consumer warpgroup (two, or three for head tile 64 only) x
    BLOCK_N keys per step, one persistent block of consumers + 1 warpgroups per SM."""

    block_n: int = 128
    consumers: int = 2

    @property
    def block_m(self) -> int:
        return WARPGROUP_ROWS * self.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (self.consumers + 1)

    @property
    def label(self) -> str:
        return f"ws{self.block_m}x{self.block_n}"


Tile = Union[MmaTile, WgmmaTile, WsTile]  # the tile names the tensor-core kernel too


def ws_tile_unsupported_reason(problem: MhaProblem, tile: WsTile) -> Optional[str]:
    """None when flash_attention_ws has an instantiation of ``tile`` for this call's head tile; else why not."""
    g = problem.geometry
    head_dim = wgmma_head_tile(g.head_size, g.v_head_size)
    if tile.consumers not in (2, 3):
        return f"{tile.consumers} consumer warpgroups: flash_attention_ws has two or three"
    if tile.consumers == 3 and head_dim != 64:
        return f"three consumer warpgroups need head tile 64 (their 160 registers), this call's is {head_dim}"
    if tile.block_n not in (64, 128):
        return f"{tile.block_n} keys per step: flash_attention_ws takes 64 or 128"
    return None


def mma_features(problem: MhaProblem, key_offset: bool = False) -> int:
    """FlashFeatures of the call (kernels/flash_common.cuh): 1 with a padding mask, + 2 with an attention_bias,
    + 4 with a per-key logit offset (``key_offset``: the caller passes one, see score_terms). Each combination is
    its own instantiation, compiled without the mask code it does not use."""
    padding = FEATURE_PADDING if problem.padding_mask is not None else 0
    offset = FEATURE_KEY_OFFSET if key_offset else 0
    return padding | (FEATURE_BIAS if problem.attention_bias is not None else 0) | offset


def default_wgmma_tile(problem: MhaProblem, key_offset: bool = False) -> WgmmaTile:
    """Head 64: 64 x 128 with overlap, or 64 x 64 with a mask, attention_bias or key offset; head 128: 128 x 64
    without overlap, two blocks per SM (the fastest of fused_timing's tile columns; BENCH.md)."""
    g = problem.geometry
    if wgmma_head_tile(g.head_size, g.v_head_size) == 128:
        return WgmmaTile(64, 128, overlap=False)
    return WgmmaTile(128 if mma_features(problem, key_offset) == 0 else 64)


def default_tile(problem: MhaProblem) -> MmaTile:
    g = problem.geometry
    wide = head_dim_tile(g.head_size, g.v_head_size) == 128 and problem.attention_bias is None
    return WIDE_HEAD_MMA_TILE if wide else DEFAULT_MMA_TILE


# --------------------------------------------------------------------------------------- exact scores
@dataclass(frozen=True)
class ScoreTerms:
    """Where a call adds its query and key projection biases (score_terms says why).

    query_bias_in_operand: the layout mover adds b_q to Q before rounding it to the operand dtype;
    key_bias_in_operand:   the same for b_k and the new keys (a wanted present always holds k + b_k);
    key_offset:            the scores get o[b, n, j] = scale * K_j . b_q (float32, layout.cu bias_dot), K the
                           key operand (0 without b_q; + 0 * sum(b_k) when the query offsets are left out);
    query_offset:          the scores of the new keys j >= P get r[b, n, i] = scale * (q_i + b_q) . b_k.
    """

    query_bias_in_operand: bool = True
    key_bias_in_operand: bool = True
    key_offset: bool = False
    query_offset: bool = False

    @property
    def offsets(self) -> bool:
        """The fused kernels' FLASH_WITH_KEY_OFFSET (either offset; the other pointer is null)."""
        return self.key_offset or self.query_offset


def score_terms(problem: MhaProblem) -> ScoreTerms:
    """How a float16 / bfloat16 call computes ORT's float32 scores without rounding its biased operands.

    ORT (CPU; float16 graphs run in float32) scores x_ij = scale * (q_i + b_q) . (K_j + [j >= P] b_k): q, k, the
    past and the biases are exact in the call's dtype, their sums are not. Rounding (q + b_q) and (k + b_k) to
    float16, the mover's old way, moved a score by about 5e-3 at scale 0.3 and head 128, and the softmax passed it
    on (issue 14: 6e-3 against ORT CPU). Expanded, with K the unbiased keys (past and new),
        x_ij = scale * q_i . K_j  +  scale * K_j . b_q  +  [j >= P] scale * (q_i + b_q) . b_k
    : the tensor-core product of exact operands (float32 accumulation), a per-key offset and a per-query offset
    of the new keys, both in float32. With P = 0 the last term is the same for every key of a row, which the
    softmax cancels: it is left out (one add per score less), and the key offsets carry 0 * sum(b_k) instead, so
    that a non-finite b_k still makes the scores NaN as in ORT; a call that writes qk keeps it (qk is the scores
    themselves, before any softmax could cancel the term). The value
    bias stays in the V operand: sum_j p_ij = 1, so its rounding moves an output by one rounding of (v + b_v),
    2^-11 relative in float16. float32 calls add every bias in float32 (nothing is rounded)."""
    if problem.dtype not in LOW_PRECISION_DTYPES:
        return ScoreTerms()
    past = problem.geometry.past_seq > 0
    return ScoreTerms(
        query_bias_in_operand=False,
        key_bias_in_operand=False,
        key_offset=problem.bias_q is not None or (problem.bias_k is not None and not past),
        query_offset=problem.bias_k is not None and (past or problem.want_qk),
    )


# ------------------------------------------------------------------------------------------- the dispatch rules
def wgmma_unsupported_reason(problem: MhaProblem, operand_dtype: str, capability: str) -> Optional[str]:
    """None when flash_attention_wgmma runs this fused call on a device of compute ``capability`` ("90" for 9.0);
    else why flash_attention_mma does. For a call fused_unsupported_reason already accepted."""
    if problem.dtype not in ("float16", "bfloat16"):
        return f"dtype {problem.dtype!r} is not a tensor-core dtype"
    if operand_dtype != problem.dtype:
        return f"operands are {operand_dtype} (rounded to {problem.dtype} on load: the mma kernel's load path)"
    if capability != HOPPER_CAPABILITY:
        return f"compute capability {capability[:-1]}.{capability[-1:]} is not 9.0 (wgmma is sm_90a code)"
    g = problem.geometry
    if wgmma_head_tile(g.head_size, g.v_head_size) is None:
        return (f"head sizes (H={g.head_size}, Hv={g.v_head_size}) are not in {MMA_ONLY_HEAD_DIM + 1}-"
                f"{WGMMA_HEAD_DIMS[-1]}, the heads its tiles {WGMMA_HEAD_DIMS} take")  # fmt: skip
    return None


def ws_unsupported_reason(problem: MhaProblem, operand_dtype: str, capability: str,
                          key_offset: bool = False) -> Optional[str]:  # fmt: skip
    """None when flash_attention_ws can run this fused call (wgmma's rule; no padding mask, attention_bias or
    key offset: the kernel has no code for them; causal only where its -inf for future keys gives ORT's answer);
    else why not. For a call fused_unsupported_reason already accepted."""
    reason = wgmma_unsupported_reason(problem, operand_dtype, capability)
    if reason is not None:
        return reason
    if problem.padding_mask is not None:
        return "the call has a padding mask"
    if problem.attention_bias is not None:
        return "the call has an attention_bias"
    if key_offset:
        return "the call's scores take a per-key offset (its projection bias: score_terms)"
    if not problem.scale > 0.0:
        return f"scale {problem.scale} is not positive (the kernel takes max(scale * s) as scale * max(s))"
    if problem.causal:
        return ws_causal_unsupported_reason(problem)
    return None


def ws_causal_unsupported_reason(problem: MhaProblem) -> Optional[str]:
    """flash_attention_ws sets a causal future logit to -inf and reads no key tile past a query tile's causal
    frontier, where ORT adds float32 lowest. Both give those keys probability 0 exactly when each row's largest
    allowed logit is far above lowest (-3.4e38), which float16 operands guarantee unless the scale is huge:
    |scale * q.k| <= scale * H * 65504^2. bfloat16 reaches 3.4e38 itself, so its causal calls stay on
    flash_attention_wgmma, which checks every row's max before it skips a tile."""
    if problem.dtype != "float16":
        return f"a causal {problem.dtype} call (logits may reach float32 lowest; only float16 bounds them)"
    bound = problem.scale * problem.geometry.head_size * FLOAT16_MAX**2
    if bound >= WS_CAUSAL_LOGIT_BOUND:
        return (f"a causal call whose logits may reach {bound:.3g} (scale {problem.scale}): only below "
                f"{WS_CAUSAL_LOGIT_BOUND:g} is -inf for future keys exact")  # fmt: skip
    return None


def query_tiles(problem: MhaProblem, rows: int) -> int:
    """Blocks of ``rows`` query rows of one (b, h) the call has: ceil(S / rows) * B * N."""
    g = problem.geometry
    return -(-g.q_seq // rows) * g.batch * g.num_heads


def persistent_rounds(problem: MhaProblem, rows: int, sms: int = HOPPER_SM_COUNT) -> int:
    """Query tiles of ``rows`` rows per SM of the busiest SM of a persistent launch: ceil(tiles / sms)."""
    return -(-query_tiles(problem, rows) // sms)


@dataclass(frozen=True)
class WsTail:
    """flash_attention_ws's tail split (kernels/flash_attention_ws.cu, "Tail split"): query tiles 0 ..
    ``full_tiles`` - 1 are whole units, each of the ``tail_tiles`` after them is cut into ``splits`` units of
    contiguous key tiles, merged after the launch by combine_tile_splits."""

    full_tiles: int
    tail_tiles: int
    splits: int

    @property
    def units(self) -> int:
        """Work units of the launch: its grid is min(units, SMs)."""
        return self.full_tiles + self.tail_tiles * self.splits

    @property
    def slots(self) -> int:
        """Partial results the tail units write (tail_tiles x splits)."""
        return self.tail_tiles * self.splits


def ws_tail(problem: MhaProblem, tile: WsTile, sms: int = HOPPER_SM_COUNT) -> Optional[WsTail]:
    """How flash_attention_ws cuts the query tiles its last round would leave on few SMs, or None for a whole-tile
    walk. The tiles past the last full round of ``sms`` (all of them when there are fewer) are each split into the
    number of key ranges, 2 to WS_TAIL_MAX_SPLITS and no fewer than WS_TAIL_MIN_KEY_TILES key tiles of tile.block_n
    each, whose units end soonest (ws_tail_time; the fewest splits of equal time); None when no split ends before a
    whole tile, for causal calls (their tiles read different numbers of keys, and their order is another), and
    where MHA_EP_WS_TAIL is "off"."""
    if problem.causal or kernel_from_environment(WS_TAIL_ENV, WS_TAIL_CHOICES) == "off":
        return None
    tiles = query_tiles(problem, tile.block_m)
    full = tiles // sms * sms
    tail = tiles - full
    key_tiles = ws_key_tiles(problem, tile)
    most = min(WS_TAIL_MAX_SPLITS, key_tiles // WS_TAIL_MIN_KEY_TILES)
    if tail == 0 or most < 2:
        return None
    splits = min(range(2, most + 1), key=lambda k: (ws_tail_time(tail, k, sms, key_tiles), k))
    return WsTail(full, tail, splits) if ws_tail_time(tail, splits, sms, key_tiles) < 1.0 else None


def ws_key_tiles(problem: MhaProblem, tile: WsTile) -> int:
    """Key tiles of tile.block_n keys a whole query tile of flash_attention_ws reads (not causal)."""
    return -(-problem.geometry.total_seq // tile.block_n)


def ws_tail_time(tail_tiles: int, splits: int, sms: int, key_tiles: int) -> float:
    """Whole-tile times the busiest SM spends on ``tail_tiles`` tiles of ``key_tiles`` key tiles each, cut into
    ``splits`` units: its units times one unit's key tiles, plus one key tile's time a unit for the pipeline's
    unoverlapped first and last steps (a whole tile: key_tiles + 1)."""
    return -(-tail_tiles * splits // sms) * (key_tiles / splits + 1) / (key_tiles + 1)


def ws_rounds(problem: MhaProblem, tile: WsTile, sms: int = HOPPER_SM_COUNT, tail_split: bool = True) -> float:
    """Whole-tile times of the busiest SM of flash_attention_ws's persistent walk: ceil(tiles / sms), or with a
    tail split (ws_tail; ``tail_split`` False: never) the full rounds plus its units' time (ws_tail_time)."""
    tail = ws_tail(problem, tile, sms) if tail_split else None
    if tail is None:
        return float(persistent_rounds(problem, tile.block_m, sms))
    return tail.full_tiles // sms + ws_tail_time(tail.tail_tiles, tail.splits, sms, ws_key_tiles(problem, tile))


def prefers_three_consumers(problem: MhaProblem, sms: int = HOPPER_SM_COUNT, tail_split: bool = True) -> bool:
    """Head tile 64 takes three consumer warpgroups (192-row tiles) when the busiest SM's estimated time, rounds x
    rows x WS3_ROW_COST, is under two consumers' (rounds x 128 rows), on ``sms`` SMs; rounds as ws_rounds counts
    them (with ``tail_split``, a tail split's units)."""
    g = problem.geometry
    if wgmma_head_tile(g.head_size, g.v_head_size) != 64:
        return False
    three = ws_rounds(problem, WsTile(consumers=3), sms, tail_split) * 3 * WARPGROUP_ROWS * WS3_ROW_COST
    return three < ws_rounds(problem, WsTile(), sms, tail_split) * WS_BLOCK_M


def prefers_warp_specialized(problem: MhaProblem, sms: int = HOPPER_SM_COUNT) -> bool:
    """Head tile 128 always; head 64 from WS_HEAD64_TILES_PER_SM x ``sms`` query tiles on (see there)."""
    g = problem.geometry
    if wgmma_head_tile(g.head_size, g.v_head_size) == 128:
        return True
    return query_tiles(problem, WS_BLOCK_M) >= WS_HEAD64_TILES_PER_SM * sms


def choose_tile(problem: MhaProblem, operand_dtype: str, capability: str, sms: int = HOPPER_SM_COUNT,
                key_offset: bool = False) -> Tile:  # fmt: skip
    """The tile, and with it the kernel, of a fused call on a device of compute ``capability`` with ``sms`` SMs
    (``key_offset``: the call passes a per-key offset): where ws_unsupported_reason says None and three consumers
    would pay over two whole-tile walks (prefers_three_consumers without a tail split) or prefers_warp_specialized,
    a WsTile of three consumers where prefers_three_consumers (with the tail splits) says so, else of two; else a
    WgmmaTile where wgmma_unsupported_reason says None, else flash_attention_mma's default tile (float32 calls
    ignore it)."""
    if ws_unsupported_reason(problem, operand_dtype, capability, key_offset) is None:
        if prefers_three_consumers(problem, sms, tail_split=False) or prefers_warp_specialized(problem, sms):
            return WsTile(consumers=3) if prefers_three_consumers(problem, sms) else WsTile()
    if wgmma_unsupported_reason(problem, operand_dtype, capability) is None:
        return default_wgmma_tile(problem, key_offset)
    return default_tile(problem)


@dataclass(frozen=True)
class KeySplit:
    """How split_key_attention (kernels/split_keys.cu) cuts the T keys: ``splits`` blocks per (b, h), each of at
    most ``chunk`` keys (the last one may hold fewer; none is empty)."""

    splits: int
    chunk: int


@dataclass(frozen=True)
class KeyStream:
    """How split_key_stream (kernels/split_keys.cu) cuts the T keys: ``splits`` blocks per (b, h), each of at most
    ``span`` keys (the last one may hold fewer; none is empty), which a block walks ``tile`` keys at a time through
    ``stages`` tiles of shared memory (STREAM_STAGES, or fewer where a span has fewer tiles of K and V)."""

    splits: int
    span: int
    tile: int
    stages: int


def stream_shared_bytes(geometry, cut: KeyStream, in_bytes: int) -> int:
    """split_key_stream's dynamic shared memory (all of its shared memory): the query rows, the span's logits, each
    warp's P.V, the combine's weights, total and verdict in float32 (rounded up to 16 bytes), then the stages of
    ``tile`` K or V rows of ``in_bytes`` elements, max(H, Hv) a row."""
    floats = geometry.q_seq * (geometry.head_size + cut.span + SPLIT_WARPS * geometry.v_head_size) + cut.splits + 2
    row = max(geometry.head_size, geometry.v_head_size) * in_bytes
    return 4 * (-(-floats // 4) * 4) + cut.stages * cut.tile * row


def key_stream(problem: MhaProblem, sms: int = HOPPER_SM_COUNT, in_bytes: int = 4, *,
               blocks_per_sm: int = STREAM_BLOCKS_PER_SM, stages: int = STREAM_STAGES,
               stage_bytes: int = STREAM_STAGE_BYTES) -> Optional[KeyStream]:  # fmt: skip
    """split_key_stream's cut of a call ``key_split`` takes (None for the others). The pair's blocks load their
    whole chunk, then compute, in two rounds of blocks at Whisper's shapes (docs/BENCH.md section 6); a stream
    block loads tile t + stages - 1 while it computes tile t, so the GPU needs only one round of longer blocks to
    keep HBM busy: about ``blocks_per_sm`` x ``sms`` blocks in all (no block waits for a second round, and a
    pair's last block combines while other pairs still stream), each span of at least SPLIT_MIN_CHUNK keys and at
    most STREAM_MAX_LOGITS / S (its logits stay in shared memory). A tile is ``stage_bytes`` of K or V rows of
    ``in_bytes`` elements (the sweep, scripts/split_key_sweep.py, names other blocks_per_sm, stages and
    stage_bytes, with the kernel's defines to match)."""
    if key_split(problem, sms, in_bytes) is None:
        return None
    g = problem.geometry
    pairs = g.batch * g.num_heads
    longest = max(SPLIT_MIN_CHUNK, STREAM_MAX_LOGITS // g.q_seq)
    wanted = max(1, blocks_per_sm * sms // pairs)
    splits = max(-(-g.total_seq // longest), min(wanted, -(-g.total_seq // SPLIT_MIN_CHUNK)))
    span = -(-g.total_seq // splits)
    splits = -(-g.total_seq // span)  # no empty split
    if splits > GRID_Y_MAX:
        return None
    tile = max(1, min(span, stage_bytes // (max(g.head_size, g.v_head_size) * in_bytes)))
    return KeyStream(splits, span, tile, min(stages, 2 * -(-span // tile)))


def split_shared_bytes(geometry, chunk: int, in_bytes: int) -> int:
    """split_key_attention's dynamic shared memory for ``chunk`` keys a block of ``in_bytes`` operands: the query
    rows, the chunk's logits and each warp's P.V in float32 (rounded up to 16 bytes), then the chunk's K and V
    rows as they are in global memory."""
    floats = geometry.q_seq * (geometry.head_size + chunk + SPLIT_WARPS * geometry.v_head_size)
    return 4 * (-(-floats // 4) * 4) + chunk * (geometry.head_size + geometry.v_head_size) * in_bytes


def key_split(problem: MhaProblem, sms: int = HOPPER_SM_COUNT, in_bytes: int = 4) -> Optional[KeySplit]:
    """The split-key kernel's cut of a fused call of at most SPLIT_MAX_ROWS query rows (a decode step), or None:
    the flash kernels take it. A flash block holds 64 query rows of one (b, h) and walks every key, so at S = 1 the
    GPU runs B*N blocks of mostly idle rows (Whisper's cross attention, B*N = 6, T = 1500: many times as long as
    its keys and values take to read; docs/BENCH.md, "Kernel notes"). Split, the blocks number about SPLIT_WAVES x
    ``sms``: each of at least SPLIT_MIN_CHUNK keys and at most as many as fit SPLIT_SHARED_BYTES (a block holds its
    chunk's K and V rows of ``in_bytes`` elements and its logits in shared memory) and SPLIT_MAX_CHUNK."""
    g = problem.geometry
    if g.q_seq > SPLIT_MAX_ROWS or max(g.head_size, g.v_head_size) > SPLIT_MAX_DIM or g.total_seq == 0:
        return None
    pairs = g.batch * g.num_heads
    per_key = 4 * g.q_seq + (g.head_size + g.v_head_size) * in_bytes
    fitting = (SPLIT_SHARED_BYTES - split_shared_bytes(g, 0, in_bytes) - 12) // per_key  # 12: the rounding up
    most = min(SPLIT_MAX_CHUNK, fitting)
    wanted = -(-SPLIT_WAVES * sms // pairs)
    splits = max(1, -(-g.total_seq // most), min(wanted, -(-g.total_seq // SPLIT_MIN_CHUNK)))
    chunk = -(-g.total_seq // splits)
    splits = -(-g.total_seq // chunk)  # no empty split
    if splits > GRID_Y_MAX or pairs > I32_MAX:
        return None
    return KeySplit(splits, chunk)


def fused_unsupported_reason(problem: MhaProblem) -> Optional[str]:
    """None when the fused kernel computes this call exactly as the three-phase path does; else why not.

    The rules, in order:
      0. not a shared past/present buffer (its decode kernel: shared_buffer.py); a qk output only where the split-key
         kernels take the call (key_split: they write each score where they compute it; a flash block never holds
         a row's scores, so any other qk call takes the three phases, whose softmax writes them: softmax.cu);
      1. the dtype has a kernel (float32, float16, bfloat16);
      2. H and Hv are multiples of 8 (16-byte vector loads) and at most the largest head tile (128);
      3. there is work and a key: B, N, S >= 1 and T >= 1 (T = 0 is ORT's all-zero output, left to the
         three-phase path);
      4. not causal with mask_filter_value = -inf: ORT's answer for a row whose allowed keys are all padded then
         depends on the causal positions' exact float32-lowest logits (uniform over the future keys);
      5. the launch grid (query tiles x B x N blocks, at the smallest tile of any kernel) fits an int block index.
    """
    g = problem.geometry
    if problem.shared is not None:  # 0
        return "a shared past/present buffer runs the decode kernel (shared_buffer.py)"
    if problem.want_qk and key_split(problem) is None:  # 0
        return ("the qk output is asked for and the split-key kernels do not take the call (S > "
                f"{SPLIT_MAX_ROWS}, or heads over {SPLIT_MAX_DIM}): the three-phase path's softmax writes the scores")
    if problem.dtype not in ELEMENT_TYPES:  # 1
        return f"dtype {problem.dtype!r} has no fused kernel"
    for name, size in (("head_size", g.head_size), ("v_head_size", g.v_head_size)):  # 2
        if size % HEAD_SIZE_MULTIPLE:
            return f"{name} {size} is not a multiple of {HEAD_SIZE_MULTIPLE}"
    if head_dim_tile(g.head_size, g.v_head_size) is None:
        return (f"head sizes (H={g.head_size}, Hv={g.v_head_size}) exceed {HEAD_DIM_TILES[-1]}, the largest head "
                f"tile of the fused kernel")  # fmt: skip
    if min(g.batch, g.num_heads, g.q_seq) == 0:  # 3
        return "the call is empty (B, N or S is 0)"
    if g.total_seq == 0:
        return "the key sequence is empty (T = 0)"
    if problem.causal and math.isinf(problem.mask_filter_value) and problem.mask_filter_value < 0:  # 4
        return "causal with mask_filter_value = -inf (ORT's result depends on the exact causal fill values)"
    blocks = -(-g.q_seq // SMALLEST_BLOCK_M) * g.batch * g.num_heads  # 5
    if blocks > I32_MAX:
        return f"the launch grid ({blocks} blocks) exceeds {I32_MAX}"
    return None


def reads_staged_inputs(problem: MhaProblem) -> bool:
    """Whether a fused call skips the layout movers: a float32 call with no past and no present wanted, whose
    kernel (flash_attention_fp32) reads the staged float32 query/key/value in their own layout and adds the
    projection bias on load, the same float32 additions the movers make. (An f16/bf16 call's tensor-core
    kernels read operands in the call's dtype, which only the movers produce here; a past needs concatenating.)"""
    return (problem.dtype == "float32" and problem.past_key_BNPH is None and problem.past_value_BNPH is None
            and not problem.want_present_key and not problem.want_present_value)  # fmt: skip
