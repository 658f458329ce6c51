"""The fused attention path of the cuda backend: one flash-style kernel (kernels/flash_attention.cu) in place of
the three phases (scores GEMM -> masked softmax -> P.V GEMM) wherever it computes the same function.

    reason = fused_unsupported_reason(problem)   # None: the fused path applies; else a sentence for a debug log
    run_fused(device_id, problem, q=..., k=..., v=..., operand_dtype=..., attention_bias=..., mask=...,
              out_BSD=..., stream=...)          # launches only: no allocation, no synchronization

Layout legend (mha_ep/spec.py): B batch, S query length, L new key length, P past length, T = P + L, N heads,
H head size, Hv value head size, D = N*H. An ``Operand`` is one of Q, K, V as a device address plus its layout:
  "BSNH"  (B, seq, N*dim): the staged query / key / value as the op received them;
  "BNSH"  (B, N, seq, dim): BNSH key/value, or the dense q_BNSH / k_BNTH / v_BNTH the layout mover builds.
Its elements are ``operand_dtype``: float32 (the staged transport arrays; an f16/bf16 call rounds them to its
dtype on load) or the call's dtype (the layout mover's buffers). A bias (float32, (N*dim,)) is added on load.

Kernel choice (choose_tile): float32 -> ``flash_attention_fp32`` (CUDA cores, true fp32); float16 / bfloat16 ->
``flash_attention_wgmma`` (kernels/flash_attention_wgmma.cu: Hopper's warpgroup MMA, sm_90a code) where
``wgmma_unsupported_reason`` says None (a compute capability 9.0 device, operands in the call's dtype, head tile 64
or 128), else ``flash_attention_mma`` (tensor cores, mma.sync m16n8k16; any sm_80+ GPU). Hopper calls without
padding mask or attention_bias (float16 ones also when causal; ``ws_unsupported_reason``) take
``flash_attention_ws`` instead (kernels/flash_attention_ws.cu: a producer warpgroup loading with TMA, whose tensor
maps tma.py encodes, and two or three ping-ponging consumers, persistent): three consumers for head tile 64 where
their 192-row tiles pay (``prefers_three_consumers``), two for head tile 128, or head tile 64 with enough query
tiles to fill the GPU (``prefers_warp_specialized``). All accumulate in fp32,
are templated on the head tile HEAD_DIM (the smallest of HEAD_DIM_TILES that holds max(H, Hv); the rest is
zero-filled) and are compiled lazily, one NVRTC module per (device, instantiation), memoised for the life of the
process (the sm_90a ones also on disk: kernels.compile_arch_kernel).
This module imports CuPy only when a kernel is launched, so ``fused_unsupported_reason`` runs on CPU machines.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from mha_ep.limits import I32_MAX
from mha_ep.ops.backends.cuda import tma
from mha_ep.ops.problem import MhaProblem

log = logging.getLogger("mha_ep")
ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
HEAD_DIM_TILES = (32, 64, 96, 128)  # HEAD_DIM instantiations; max(H, Hv) is zero-padded up to one of these
HEAD_SIZE_MULTIPLE = 8  # 16-byte vector loads of 8 elements (kernels/flash_attention.cu LOAD_CHUNK)
MMA_BLOCK_N = 64  # keys per step of flash_attention_mma (default tile)
MMA_SMEM_PAD = 8  # kernels/flash_attention.cu SMEM_PAD
FP32_BLOCK_M = 64  # kernels/flash_attention.cu F32_BLOCK_M / F32_BLOCK_N / F32_LDT / F32Tiles / F32Shape
FP32_BLOCK_N = 64
FP32_LDT = FP32_BLOCK_M + 4
FP32_ROWS = 4  # query rows per thread (ROWS) ...
FP32_ROW_THREADS = 8  # ... and threads sharing a row (TX): a 4 x 8 score tile per thread (fp32_pipeline)
FP32_THREADS = (FP32_BLOCK_M // FP32_ROWS) * FP32_ROW_THREADS  # 128
FP32_MAX_BLOCKS = 4  # 4 blocks of 128 threads leave 128 registers a thread; 5 would leave 102
BIAS_TILE_PAD = 8  # kernels/flash_attention.cu LDB = BLOCK_N + 8 (floats)
DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel needs its dynamic shared-memory limit raised
MASK_KINDS = {None: 0, "key_lengths": 1, "keys_BT": 2, "keys_BST": 3}  # FlashMaskKind
VECTOR_ALIGNMENT = 16  # bytes: every operand, row and head start must allow 16-byte loads
SOURCE_FILE = "flash_attention.cu"
SMALLEST_BLOCK_M = 64  # query rows per block of every fused kernel's smallest tile


# ------------------------------------------------------------------------------------------- the dispatch rule
def head_dim_tile(head_size: int, v_head_size: int) -> Optional[int]:
    """The HEAD_DIM instantiation for these head sizes, or None when none holds them."""
    need = max(head_size, v_head_size)
    return next((tile for tile in HEAD_DIM_TILES if tile >= need), None)


@dataclass(frozen=True)
class MmaTile:
    """Tile of flash_attention_mma: BLOCK_M query rows (one warp per 16) x BLOCK_N keys per step."""

    block_m: int = 64
    block_n: int = MMA_BLOCK_N

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 32

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}"


# Default tiles, from fused_timing's tile comparison on the H200 (2026-11-30, K and V double buffered): 64 x 64
# (4 warps; 137 registers, so 3 independent blocks per SM whose softmax and tensor-core phases interleave) was
# fastest on every head-64 anchor but the attention_bias row (59.3 µs, 57.1 for 128 x 128) (S=T=4096: 271.5 µs against 352.5 for 128 x 64, 274.7 for
# 64 x 128, 325.6 for 128 x 128); for head 128, 128 x 128 (536.6 µs against 580.0 for 64 x 64), except with an
# attention_bias, whose shared-memory tile (128 x 136 floats) would not fit beside it.
DEFAULT_MMA_TILE = MmaTile()
WIDE_HEAD_MMA_TILE = MmaTile(128, 128)
SHARED_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_90 (sharedMemPerBlockOptin)
SM_SHARED_BYTES = 228 * 1024  # shared memory of one sm_90 SM; each resident block also reserves 1 KiB
BLOCKS_PER_SM_GOAL = 3  # the head-64 tensor-core tiles are sized so that three blocks fit an SM (see above)


# The Hopper kernel: one warpgroup of 128 threads per 64 query rows; its measured tiles are default_wgmma_tile's,
# the blocks per SM its registers are cut for wgmma_min_blocks's.
HOPPER_CAPABILITY = "90"  # wgmma.mma_async is sm_90a code, which runs on compute capability 9.0 only
HOPPER_ARCH = "sm_90a"
WGMMA_SOURCE_FILE = "flash_attention_wgmma.cu"
WGMMA_HEAD_DIMS = (64, 128)  # whole 64-element swizzle atoms
WGMMA_SMEM_ALIGN = 1024  # kernels/flash_attention_wgmma.cu: tiles start 1024-byte aligned (128-byte swizzle)
WARPGROUP_THREADS = 128  # kernels/wgmma_common.cuh: four warps issue one wgmma
WARPGROUP_ROWS = 64  # query rows of one warpgroup: the M of every wgmma


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


WS_SOURCE_FILE = "flash_attention_ws.cu"
WS_BLOCK_M = 128  # query rows of flash_attention_ws's default (two-consumer) tile: WsShape<2>::BLOCK_M
WS_STAGES = 2  # kernels/flash_attention_ws.cu WS_STAGES
WS_BARRIER_BYTES = 8 * (2 + 4 * WS_STAGES)  # q_full, q_empty, full/empty x K/V x stages
# Head 64 takes flash_attention_ws from WS_HEAD64_TILES_PER_SM 128-row query tiles per SM on (396 on a 132-SM
# H100 SXM / H200):
# fused_timing on the H200 (2026-11-30, .device experiment): S=T=4096 x 16 heads (512 tiles) 162 µs against 171
# for the wgmma default; 8 x 512 x 12 heads (384 tiles) 21.7 against 21.9; 4 x 1500 x 6 heads (288 tiles) 51.9
# against 49.3. With fewer tiles a persistent 128-row block per SM leaves more of the GPU idle in the last round.
# (A close call: on two other H200s the 4096 row took 177 with it against 172-175 for the wgmma tiles; BENCH.md.)
WS_HEAD64_TILES_PER_SM = 3
HOPPER_SM_COUNT = 132  # H100 SXM / H200; choose_tile's default, run_fused passes the device's own count
# Time per query row and key of three consumers against two (head tile 64, TMA, H200, 2026-11-30 .device
# experiment, same machine): 0.77-0.80 on six shapes once the rounds are counted (fused.prefers_three_consumers);
# 0.85 leaves a margin, so three consumers are taken only where they clearly pay.
WS3_ROW_COST = 0.85


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


def ws_tile_unsupported_reason(problem: MhaProblem, tile: WsTile) -> Optional[str]:
    """None when flash_attention_ws has an instantiation of ``tile`` for this call's head tile; else why not."""
    g = problem.geometry
    head_dim = head_dim_tile(g.head_size, g.v_head_size)
    if tile.consumers not in (2, 3):
        return f"{tile.consumers} consumer warpgroups: flash_attention_ws has two or three"
    if tile.consumers == 3 and head_dim != 64:
        return f"three consumer warpgroups need head tile 64 (their 160 registers), this call's is {head_dim}"
    if tile.block_n not in (64, 128):
        return f"{tile.block_n} keys per step: flash_attention_ws takes 64 or 128"
    return None


Tile = Union[MmaTile, WgmmaTile, WsTile]  # the tile names the tensor-core kernel too


def default_wgmma_tile(problem: MhaProblem) -> WgmmaTile:
    """From fused_timing's tile columns on the H200 (2026-11-30): head 64 takes 64 x 128 with overlap (S=T=4096:
    172.6 µs against 208.2 for 64 x 64 and 232.5 for 128 x 128), or 64 x 64 with a mask or attention_bias
    (8 x 512 with a 2D mask: 47.1 against 50.5); head 128 takes 128 x 64 without overlap, two blocks per SM
    (4 x 2048: 289.3 against 335.5 for 64 x 64 with overlap)."""
    g = problem.geometry
    if head_dim_tile(g.head_size, g.v_head_size) == 128:
        return WgmmaTile(64, 128, overlap=False)
    return WgmmaTile(128 if mma_features(problem) == 0 else 64)


def blocks_per_sm_by_shared_memory(shared: int) -> int:
    """How many blocks of ``shared`` dynamic bytes fit one SM's shared memory (the 1 KiB reserve included)."""
    return SM_SHARED_BYTES // (shared + 1024)


def default_tile(problem: MhaProblem) -> MmaTile:
    g = problem.geometry
    wide = head_dim_tile(g.head_size, g.v_head_size) == 128 and problem.attention_bias is None
    return WIDE_HEAD_MMA_TILE if wide else DEFAULT_MMA_TILE


def block_m(problem: MhaProblem, tile: Optional[Tile] = None) -> int:
    return FP32_BLOCK_M if problem.dtype == "float32" else (tile or default_tile(problem)).block_m


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
    head_dim = head_dim_tile(g.head_size, g.v_head_size)
    if head_dim not in WGMMA_HEAD_DIMS:
        return f"head tile {head_dim} is not one of {WGMMA_HEAD_DIMS}"
    return None


def ws_unsupported_reason(problem: MhaProblem, operand_dtype: str, capability: str) -> Optional[str]:
    """None when flash_attention_ws can run this fused call (wgmma's rule; no padding mask or attention_bias: the
    kernel has no code for them; causal only where its -inf for future keys gives ORT's answer); else why not.
    For a call fused_unsupported_reason already accepted."""
    reason = wgmma_unsupported_reason(problem, operand_dtype, capability)
    if reason is not None:
        return reason
    if problem.padding_mask is not None:
        return "the call has a padding mask"
    if problem.attention_bias is not None:
        return "the call has an attention_bias"
    if not problem.scale > 0.0:
        return f"scale {problem.scale} is not positive (the kernel takes max(scale * s) as scale * max(s))"
    if problem.causal:
        return ws_causal_unsupported_reason(problem)
    return None


WS_CAUSAL_LOGIT_BOUND = 1.0e37  # |scale * q.k| below this: a row's largest allowed logit dominates float32 lowest
FLOAT16_MAX = 65504.0


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


def prefers_three_consumers(problem: MhaProblem, sms: int = HOPPER_SM_COUNT) -> bool:
    """Head tile 64 takes three consumer warpgroups (192-row tiles) when the busiest SM's estimated time, rounds x
    rows x WS3_ROW_COST, is under two consumers' (rounds x 128 rows), on ``sms`` SMs. Measured (H200, same machine,
    µs, two -> three):
    S=T=4096 x 16 heads 167 -> 146, 2 x 4096 333 -> 297, S=T=8192 654 -> 578, 4 x 1500 x 6 heads 52 -> 41.5 (the
    wgmma default 49.5); and where the rule says no: 8 x 512 x 12 heads 21.8 -> 25.1 (576 rows' rounds against
    384), 16 x 512 x 12 42.0 -> 42.3, 1 x 2048 x 16 45.3 -> 52.3, 2 x 300 x 2 14.7 -> 16.0."""
    g = problem.geometry
    if head_dim_tile(g.head_size, g.v_head_size) != 64:
        return False
    three = persistent_rounds(problem, 3 * WARPGROUP_ROWS, sms) * 3 * WARPGROUP_ROWS * WS3_ROW_COST
    return three < persistent_rounds(problem, WS_BLOCK_M, sms) * WS_BLOCK_M


def prefers_warp_specialized(problem: MhaProblem, sms: int = HOPPER_SM_COUNT) -> bool:
    """Head tile 128 always (4 x 2048 x 16 heads: 237 µs against 288 for the wgmma default, H200); head 64 from
    WS_HEAD64_TILES_PER_SM x ``sms`` query tiles on (see there)."""
    g = problem.geometry
    if head_dim_tile(g.head_size, g.v_head_size) == 128:
        return True
    return query_tiles(problem, WS_BLOCK_M) >= WS_HEAD64_TILES_PER_SM * sms


def choose_tile(problem: MhaProblem, operand_dtype: str, capability: str, sms: int = HOPPER_SM_COUNT) -> Tile:
    """The tile, and with it the kernel, of a fused call on a device of compute ``capability`` with ``sms`` SMs:
    where ws_unsupported_reason says None, a three-consumer WsTile where prefers_three_consumers, a two-consumer one
    where prefers_warp_specialized; else a WgmmaTile where wgmma_unsupported_reason says None, else
    flash_attention_mma's default tile (float32 calls ignore it)."""
    if ws_unsupported_reason(problem, operand_dtype, capability) is None:
        if prefers_three_consumers(problem, sms):
            return WsTile(consumers=3)
        if prefers_warp_specialized(problem, sms):
            return WsTile()
    if wgmma_unsupported_reason(problem, operand_dtype, capability) is None:
        return default_wgmma_tile(problem)
    return default_tile(problem)


def fused_unsupported_reason(problem: MhaProblem) -> Optional[str]:
    """None when the fused kernel computes this call exactly as the three-phase path does; else why not.

    The rules, in order:
      1. the dtype has a kernel (float32, float16, bfloat16);
      2. H and Hv are multiples of 8 (16-byte vector loads) and at most the largest head tile (128);
      3. there is work and a key: B, N, S >= 1 and T >= 1 (T = 0 is ORT's all-zero output, left to the
         three-phase path);
      4. not causal with mask_filter_value = -inf: ORT's answer for a row whose allowed keys are all padded then
         depends on the causal positions' exact float32-lowest logits (uniform over the future keys);
      5. the launch grid (query tiles x B x N blocks, at the smallest tile of any kernel) fits an int block index.
    """
    g = problem.geometry
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


# ------------------------------------------------------------------------------------------------ operands
@dataclass(frozen=True)
class Operand:
    """One of Q, K, V on the device: ``address`` of element (0, 0, 0, 0), its layout and its sizes."""

    address: int
    layout: str  # "BSNH" (B, seq, N*dim) | "BNSH" (B, N, seq, dim)
    seq: int  # rows along the sequence axis (S for Q; T, or L for raw key/value)
    dim: int  # head size of this operand (H, or Hv for V)
    bias: Optional[int] = None  # device address of a float32 (N*dim,) bias to add on load, or None

    def strides(self, num_heads: int) -> tuple[int, int, int]:
        """(stride_b, stride_h, stride_s) in elements; the head dimension is contiguous."""
        if self.layout == "BSNH":
            return self.seq * num_heads * self.dim, self.dim, num_heads * self.dim
        if self.layout == "BNSH":
            return num_heads * self.seq * self.dim, self.seq * self.dim, self.dim
        raise ValueError(f"operand layout must be 'BSNH' or 'BNSH', got {self.layout!r}")


def ws_tensor_maps(problem: MhaProblem, operand_dtype: str, tile: "WsTile", operands: dict) -> list:
    """flash_attention_ws's three extra parameters: the encoded TMA maps (tma.encode) of q, k and v, boxes of
    tile.block_m query rows and of tile.block_n key rows."""
    g = problem.geometry
    maps = []
    for name, op in operands.items():
        spec = tma.TileMap.for_operand(name, op.address, operand_dtype, dim=op.dim, seq=op.seq, heads=g.num_heads,
                                       batch=g.batch, strides=op.strides(g.num_heads),
                                       box_rows=tile.block_m if name == "q" else tile.block_n)  # fmt: skip
        maps.append(tma.encode(spec))
    return maps


@dataclass(frozen=True)
class Fp32Pipeline:
    """flash_attention_fp32's STAGES (K/V buffers: 2 overlaps the next tile's loads with this one's math) and
    MIN_BLOCKS (blocks per SM its registers are cut for)."""

    stages: int
    blocks: int


def fp32_shared_bytes(head_dim: int, stages: int) -> int:
    """F32Tiles::FLOATS in bytes: Q, stages x (K, V), P transposed."""
    ld = head_dim + 4
    return 4 * (FP32_BLOCK_M * ld + stages * (FP32_BLOCK_N * ld + FP32_BLOCK_N * head_dim) + FP32_BLOCK_N * FP32_LDT)


def fp32_pipeline(head_dim: int) -> Fp32Pipeline:
    """The most blocks an SM's shared memory holds (at most FP32_MAX_BLOCKS), then two stages if they keep that
    count. Measured on the H200 (2026-11-30, .device/exp/f32/sweep.py, 4 x 8 tiles), this picks the fastest of
    the (stages, blocks) pairs tried at every head tile: 32 -> (1, 4): 145 µs on 4 x 1024^2 x 8 heads, against
    160 for (2, 3); 64 -> (1, 3): 197 µs on the 8,512 f32 anchor, against 205 for (2, 2); 96 -> (1, 2); 128 -> (2,
    1): 283 µs on 2 x 1024^2 x 8 heads, against 314 for (1, 1)."""
    blocks, stages = max(
        (min(FP32_MAX_BLOCKS, blocks_per_sm_by_shared_memory(fp32_shared_bytes(head_dim, stages))), stages)
        for stages in (1, 2)
    )
    return Fp32Pipeline(stages, blocks)


def shared_bytes(problem: MhaProblem, tile: Optional[Tile] = None) -> int:
    """Dynamic shared memory of the launch (mirrors the kernels' carving of smem_raw)."""
    g = problem.geometry
    head_dim = head_dim_tile(g.head_size, g.v_head_size)
    if problem.dtype == "float32":
        return fp32_shared_bytes(head_dim, fp32_pipeline(head_dim).stages)
    tile = tile or default_tile(problem)
    if isinstance(tile, WsTile):  # Q, WS_STAGES x (K, V), the mbarriers; no bias tile (no attention_bias)
        rows = tile.block_m + 2 * WS_STAGES * tile.block_n
        return WGMMA_SMEM_ALIGN + rows * head_dim * ELEMENT_BYTES[problem.dtype] + WS_BARRIER_BYTES
    rows = tile.block_m + 4 * tile.block_n  # Q, two K buffers, two V buffers
    if isinstance(tile, WgmmaTile):  # unpadded swizzled rows, aligned to 1024 bytes inside the allocation
        nbytes = WGMMA_SMEM_ALIGN + rows * head_dim * ELEMENT_BYTES[problem.dtype]
    else:
        nbytes = rows * (head_dim + MMA_SMEM_PAD) * ELEMENT_BYTES[problem.dtype]
    if problem.attention_bias is not None:  # one float32 bias tile
        nbytes += tile.block_m * (tile.block_n + BIAS_TILE_PAD) * 4
    return nbytes


def wgmma_min_blocks(problem: MhaProblem, tile: WgmmaTile) -> int:
    """Blocks per SM flash_attention_wgmma's registers are cut for (its __launch_bounds__; mirrors min_blocks in
    kernels/flash_attention_wgmma.cu): as many as the shared memory holds, at most 3 blocks of one warpgroup, 2
    of two, 1 of two that overlap their steps."""
    most = 3 if tile.block_m == 64 else (1 if tile.overlap else 2)
    return min(blocks_per_sm_by_shared_memory(shared_bytes(problem, tile)), most)


def mma_features(problem: MhaProblem) -> int:
    """FlashFeatures of the call (kernels/flash_attention.cu): 1 with a padding mask, + 2 with an attention_bias.
    Each combination is its own instantiation, compiled without the mask code it does not use."""
    return (1 if problem.padding_mask is not None else 0) | (2 if problem.attention_bias is not None else 0)


def check_mask_operands(problem: MhaProblem, attention_bias: Optional[int], mask: Optional[int]) -> None:
    """The device mask and attention_bias must be given exactly when the call has them: the instantiation
    (mma_features) is compiled for that combination and would ignore, or read through a null pointer, the other."""
    if (mask is None) != (problem.padding_mask is None):
        raise ValueError("fused attention: a device mask must be given exactly when the call has a padding mask")
    if (attention_bias is None) != (problem.attention_bias is None):
        raise ValueError("fused attention: a device attention_bias must be given exactly when the call has one")


def check_operand_bias(problem: MhaProblem, operand_dtype: str, operands: dict) -> None:
    """Operands already in the call's dtype come without projection bias (the layout mover added it): the
    tensor-core kernel copies them into shared memory as they are (AsyncTileCopy) and would not add one."""
    if problem.dtype == "float32" or operand_dtype != problem.dtype:
        return
    biased = [name for name, op in operands.items() if op.bias is not None]
    if biased:
        raise ValueError(f"fused attention: operands {', '.join(biased)} are {operand_dtype} and carry a projection "
                         f"bias; add it when building them (only float32 operands take bias_q/k/v on load)")  # fmt: skip


def kernel_name(problem: MhaProblem, operand_dtype: str, tile: Optional[Tile] = None) -> str:
    """The NVRTC name expression of the instantiation this call launches (tile None: the mma default tile)."""
    g = problem.geometry
    head_dim = head_dim_tile(g.head_size, g.v_head_size)
    elem, src = ELEMENT_TYPES[problem.dtype], ELEMENT_TYPES[operand_dtype]
    if problem.dtype == "float32":
        pipeline = fp32_pipeline(head_dim)
        return (f"flash_attention_fp32<{elem}, {src}, {head_dim}, {FP32_ROWS}, {FP32_ROW_THREADS}, {pipeline.stages}, "
                f"{pipeline.blocks}>")  # fmt: skip
    tile = tile or default_tile(problem)
    if isinstance(tile, WsTile):
        return (f"flash_attention_ws<{elem}, {head_dim}, {tile.block_n}, {tile.consumers}, "
                f"{str(problem.causal).lower()}>")  # fmt: skip
    if isinstance(tile, WgmmaTile):
        return (f"flash_attention_wgmma<{elem}, {head_dim}, {tile.block_m}, {tile.block_n}, {mma_features(problem)}, "
                f"{str(tile.overlap).lower()}>")  # fmt: skip
    return f"flash_attention_mma<{elem}, {src}, {head_dim}, {tile.block_m}, {tile.block_n}, {mma_features(problem)}>"


# ----------------------------------------------------------------------------------------------- the launch
_kernels: dict = {}
_capabilities: dict = {}
_sm_counts: dict = {}
_lock = threading.Lock()


def device_capability(device_id: int) -> str:
    """Compute capability of ``device_id`` as CuPy spells it ("90" for 9.0), asked once per device."""
    capability = _capabilities.get(device_id)
    if capability is None:
        import cupy

        capability = _capabilities[device_id] = cupy.cuda.Device(device_id).compute_capability
    return capability


def device_sm_count(device_id: int) -> int:
    """Streaming multiprocessors of ``device_id`` (the persistent kernel's grid), asked once per device."""
    count = _sm_counts.get(device_id)
    if count is None:
        import cupy

        count = _sm_counts[device_id] = int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])
    return count


ARCH_SOURCES = {"flash_attention_wgmma<": WGMMA_SOURCE_FILE, "flash_attention_ws<": WS_SOURCE_FILE}  # sm_90a code


def compile_fused_kernel(device_id: int, name: str, code: Optional[str] = None):
    """Compile instantiation ``name`` from ``code`` (default: the shipped file of its kernel family):
    flash_attention_wgmma and flash_attention_ws for sm_90a (kernels.compile_arch_kernel, cached on disk), the
    others through CuPy's NVRTC path. No memoisation here (get_fused_kernel's)."""
    import cupy

    from mha_ep.ops.backends.cuda.kernels import COMPILE_OPTIONS, compile_arch_kernel, kernel_source

    arch_source = next((file for prefix, file in ARCH_SOURCES.items() if name.startswith(prefix)), None)
    if arch_source is not None:
        return compile_arch_kernel(device_id, code or kernel_source(arch_source), name, HOPPER_ARCH, COMPILE_OPTIONS)
    module = cupy.RawModule(code=code or kernel_source(SOURCE_FILE), options=COMPILE_OPTIONS + ("--std=c++17",),
                            name_expressions=[name])  # fmt: skip
    return module.get_function(name)


def raise_shared_limit(kernel, shared: int) -> None:
    """Let ``kernel`` launch with ``shared`` dynamic bytes (above 48 KiB a kernel must opt in)."""
    if shared > DEFAULT_SHARED_LIMIT and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared


def get_fused_kernel(device_id: int, name: str, shared: int):
    """The compiled instantiation ``name`` on ``device_id`` (compile_fused_kernel, memoised for the process) with
    its dynamic shared-memory limit raised to ``shared`` bytes when needed (call with that device current)."""
    key = (device_id, name)
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = compile_fused_kernel(device_id, name)
        raise_shared_limit(kernel, shared)
    return kernel


def _check_aligned(name: str, address: Optional[int], element_bytes: int, strides=()) -> None:
    if address is not None and address % VECTOR_ALIGNMENT:
        raise ValueError(f"fused attention: {name} address {address:#x} is not {VECTOR_ALIGNMENT}-byte aligned")
    for stride in strides:
        if (stride * element_bytes) % VECTOR_ALIGNMENT:
            raise ValueError(f"fused attention: {name} stride {stride} is not a multiple of {VECTOR_ALIGNMENT} bytes")


def run_fused(
    device_id: int,
    problem: MhaProblem,
    *,
    q: Operand,
    k: Operand,
    v: Operand,
    operand_dtype: str,
    attention_bias: Optional[int],
    mask: Optional[int],
    out_BSD: int,
    stream=None,
    tile: Optional[Tile] = None,
) -> None:
    """Launch the fused kernel for ``problem`` (its dispatch rule must have said None).

    q:  (B, S, N, H) as an Operand (BSNH or BNSH), + bias_q on load when ``q.bias`` is set (float32 operands, or
        a float32 call, only: check_operand_bias);
    k:  (B, T, N, H) or (B, N, T, H): all T keys (a past must already be concatenated: the layout mover's k_BNTH);
    v:  the same with Hv;
    operand_dtype: element type of q, k and v ("float32", or the call's dtype);
    attention_bias: device float32 (B|1, N|1, S, T), or None;
    mask: device padding mask of ``problem.padding_mask.kind``: int32 (B,) key lengths, uint8 (B, T) or (B, S, T)
          keep flags; None when the call has none;
    out_BSD: device float32 (B, S, N*Hv), every element written (rounded to the call's dtype first);
    stream: a cupy Stream to launch on (default: the current stream);
    tile: f16/bf16 only: the kernel and its tile, an MmaTile, WgmmaTile or WsTile (default: choose_tile for this
          device; the timing script and the tests name others; a WgmmaTile must pass wgmma_unsupported_reason,
          a WsTile ws_unsupported_reason).
    """
    import cupy

    g = problem.geometry
    n = g.num_heads
    if q.seq != g.q_seq or k.seq != g.total_seq or v.seq != g.total_seq:
        raise ValueError(f"fused attention: operand lengths (q {q.seq}, k {k.seq}, v {v.seq}) must be S={g.q_seq} "
                         f"and T={g.total_seq}")  # fmt: skip
    if (q.dim, k.dim, v.dim) != (g.head_size, g.head_size, g.v_head_size):
        raise ValueError(f"fused attention: operand head sizes {(q.dim, k.dim, v.dim)} != (H, H, Hv)")
    if operand_dtype not in ("float32", problem.dtype):
        raise ValueError(f"fused attention: operand_dtype {operand_dtype!r} must be 'float32' or the call's dtype "
                         f"{problem.dtype!r}")  # fmt: skip
    in_bytes = ELEMENT_BYTES[operand_dtype]
    strides = {name: op.strides(n) for name, op in (("q", q), ("k", k), ("v", v))}
    for name, op in (("q", q), ("k", k), ("v", v)):
        _check_aligned(name, op.address, in_bytes, strides[name])
    check_mask_operands(problem, attention_bias, mask)
    check_operand_bias(problem, operand_dtype, {"q": q, "k": k, "v": v})
    mask_kind = MASK_KINDS[None if problem.padding_mask is None else problem.padding_mask.kind]
    bias = problem.attention_bias
    d0, d1 = (1, 1) if bias is None else (bias.shape[0], bias.shape[1])

    if problem.dtype != "float32":
        if tile is None:
            tile = choose_tile(problem, operand_dtype, device_capability(device_id), device_sm_count(device_id))
        elif isinstance(tile, (WgmmaTile, WsTile)):
            reason = ws_tile_unsupported_reason(problem, tile) if isinstance(tile, WsTile) else None
            if reason is not None:
                raise ValueError(f"fused attention: tile {tile.label}: {reason}")
            rule = ws_unsupported_reason if isinstance(tile, WsTile) else wgmma_unsupported_reason
            reason = rule(problem, operand_dtype, device_capability(device_id))
            if reason is not None:
                kernel = "warp-specialized" if isinstance(tile, WsTile) else "wgmma"
                raise ValueError(f"fused attention: tile {tile.label} needs the {kernel} kernel, which cannot run "
                                 f"this call: {reason}")  # fmt: skip
    name = kernel_name(problem, operand_dtype, tile)
    shared = shared_bytes(problem, tile)
    if shared > SHARED_LIMIT:
        raise ValueError(f"fused attention: tile {tile.label} needs {shared} bytes of shared "
                         f"memory for this call, more than the {SHARED_LIMIT} a block can have")  # fmt: skip
    threads = FP32_THREADS if problem.dtype == "float32" else tile.threads
    blocks = query_tiles(problem, block_m(problem, tile))
    if isinstance(tile, WsTile):  # persistent: one block per SM walks the query tiles
        blocks = min(blocks, device_sm_count(device_id))

    log.debug("mha_ep: fused path: %s, %d blocks x %d threads, %d bytes of shared memory", name, blocks, threads,
              shared)  # (the three-phase path says why it was taken: backend.py)

    def ptr(address: Optional[int]) -> np.uint64:
        return np.uint64(0 if address is None else address)

    i64, i32 = np.int64, np.int32
    args = []
    for op, (sb, sh, ss) in ((q, strides["q"]), (k, strides["k"]), (v, strides["v"])):
        args += [ptr(op.address), i64(sb), i64(sh), i64(ss), ptr(op.bias)]
    args += [
        ptr(attention_bias), i32(d0), i32(d1),
        i32(mask_kind),
        ptr(mask if mask_kind == 1 else None),
        ptr(mask if mask_kind in (2, 3) else None),
        np.float32(problem.mask_filter_value),
        i32(int(problem.causal)),
        i32(int(bias is None)),  # skip_causal_tiles: exact only when no attention_bias can lift future logits
        np.float32(problem.scale),
        i32(g.batch), i32(n), i32(g.q_seq), i32(g.total_seq), i32(g.past_seq), i32(g.head_size),
        i32(g.v_head_size),
        ptr(out_BSD),
    ]  # fmt: skip
    if isinstance(tile, WsTile):
        args += ws_tensor_maps(problem, operand_dtype, tile, {"q": q, "k": k, "v": v})
    with cupy.cuda.Device(device_id):
        kernel = get_fused_kernel(device_id, name, shared)
        if stream is None:
            kernel((blocks,), (threads,), tuple(args), shared_mem=shared)
        else:
            with stream:
                kernel((blocks,), (threads,), tuple(args), shared_mem=shared)


def flop_count(problem: MhaProblem) -> int:
    """4*B*N*S*T*H (halved for causal), the FLOP model of DESIGN.md."""
    g = problem.geometry
    flops = 4 * g.batch * g.num_heads * g.q_seq * g.total_seq * g.head_size
    return flops // 2 if problem.causal else flops
