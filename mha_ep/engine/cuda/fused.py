"""Launching the fused attention kernels (kernels/flash_attention*.cu) in place of the three phases (scores GEMM ->
masked softmax -> P.V GEMM) wherever dispatch.py's rules say they compute the same function.

    step = fused_step(problem, q=..., k=..., v=..., operand_dtype=..., attention_bias=..., mask=...,
                      out_BSD=..., facts=DeviceFacts.of(device_id), key_offset=..., query_offset=...)
    steps = fused_steps(problem, take=take, ...)   # the same, or for a decode step the split-key launches
    runner.run_fused(device_id, problem, stream=..., q=..., ...)   # the same, launched now (runner.py)

Layout legend (mha_ep/spec.py): B batch, S query length, L new key length, P past length, T = P + L, N heads,
H head size, Hv value head size, D = N*H. An ``Operand`` is one of Q, K, V as a device address plus its layout:
  "BSNH"  (B, seq, N*dim): the staged query / key / value as the op received them;
  "BNSH"  (B, N, seq, dim): BNSH key/value, or the dense q_BNSH / k_BNTH / v_BNTH the layout mover builds;
  "BSN3H" / "BSN2H"  one slot of a packed QKV (B, S, N, 3, H) / packed KV (B, L, N, 2, H) input, read in place:
          the address is the slot's first element, rows and heads stride over all 3 (2) slots (PACKED_LAYOUTS).
Its elements are ``operand_dtype``: float32 (the staged transport arrays; an f16/bf16 call rounds them to its
dtype on load) or the call's dtype (the layout mover's buffers). A bias ((N*dim,), in the operand's dtype) is added
on load.

This module holds what a launch needs beside the dispatch rules: the kernels' shared-memory carving and launch
bounds (each constant names its twin in the .cu files; tests/engine/cuda/test_kernel_constants.py checks them), the
instantiation names, and the arguments, as a steps.Launch (every route runs it: steps.py). Kernels are compiled
and memoised by kernels.py (one cache for every kernel; the sm_90a ones also on disk). CuPy is imported only when
a kernel is launched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mha_ep.launch import ELEMENT_BYTES, ELEMENT_TYPES, MaskKind
from mha_ep.engine.cuda import dispatch, kernels, tma
from mha_ep.engine.cuda.dispatch import (
    Tile, WgmmaTile, WsTile, choose_tile, default_tile, head_dim_tile, kernel_head_tile, mma_features, query_tiles,
    wgmma_unsupported_reason, ws_tile_unsupported_reason, ws_unsupported_reason,
)
from mha_ep.engine.cuda.split_keys import (
    SPLIT_KERNELS, chosen_split_kernel, split_key_steps, split_stream_steps, tail_combine_step,
)
from mha_ep.engine.cuda.steps import Address, Launch, Pointer, TensorMap, alignment_of
from mha_ep.engine.problem import MhaProblem, problem_signature

log = logging.getLogger("mha_ep")
MMA_SMEM_PAD = 8  # kernels/flash_common.cuh SMEM_PAD
FP32_BLOCK_M = 64  # kernels/flash_attention.cu F32_BLOCK_M / F32_BLOCK_N / F32_LDT / F32Tiles / F32Shape
FP32_BLOCK_N = 64
FP32_LDT = FP32_BLOCK_M + 4
FP32_ROWS = 4  # query rows per thread (ROWS) ...
FP32_ROW_THREADS = 8  # ... and threads sharing a row (TX): a 4 x 8 score tile per thread (fp32_pipeline)
FP32_THREADS = (FP32_BLOCK_M // FP32_ROWS) * FP32_ROW_THREADS  # 128
FP32_MAX_BLOCKS = 4  # 4 blocks of 128 threads leave 128 registers a thread; 5 would leave 102
BIAS_TILE_PAD = 8  # kernels/flash_attention.cu LDB = BLOCK_N + 8 (floats)
DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel needs its dynamic shared-memory limit raised
VECTOR_ALIGNMENT = 16  # bytes: every operand, row and head start must allow 16-byte loads
SHARED_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_90 (sharedMemPerBlockOptin)
SM_SHARED_BYTES = 228 * 1024  # shared memory of one sm_90 SM; each resident block also reserves 1 KiB
WGMMA_SMEM_ALIGN = 1024  # kernels/flash_attention_wgmma.cu: tiles start 1024-byte aligned (128-byte swizzle)
WS_STAGES = 2  # kernels/flash_attention_ws.cu WS_STAGES
WS_BARRIER_BYTES = 8 * (2 + 4 * WS_STAGES)  # q_full, q_empty, full/empty x K/V x stages


def blocks_per_sm_by_shared_memory(shared: int) -> int:
    """How many blocks of ``shared`` dynamic bytes fit one SM's shared memory (the 1 KiB reserve included)."""
    return SM_SHARED_BYTES // (shared + 1024)


def block_m(problem: MhaProblem, tile: Optional[Tile] = None) -> int:
    return FP32_BLOCK_M if problem.dtype == "float32" else (tile or default_tile(problem)).block_m

# ------------------------------------------------------------------------------------------------ operands
PACKED_LAYOUTS = {"BSN3H": 3, "BSN2H": 2}  # a packed input's slot layout -> the slots each (b, s, h) row holds


def packed_layout(slots: int) -> str:
    """The Operand layout of one slot of a packed input of ``slots`` slots (3: QKV, 2: KV); 1: plain "BSNH"."""
    return "BSNH" if slots == 1 else f"BSN{slots}H"


@dataclass(frozen=True)
class Operand:
    """One of Q, K, V on the device: ``address`` of element (0, 0, 0, 0), its layout and its sizes."""

    address: int
    layout: str  # "BSNH" (B, seq, N*dim) | "BNSH" (B, N, seq, dim)
    seq: int  # rows along the sequence axis (S for Q; T, or L for raw key/value)
    dim: int  # head size of this operand (H, or Hv for V)
    bias: Optional[int] = None  # device address of an (N*dim,) bias in the operand's dtype to add on load, or None

    def strides(self, num_heads: int) -> tuple[int, int, int]:
        """(stride_b, stride_h, stride_s) in elements; the head dimension is contiguous."""
        if self.layout == "BNSH":
            return num_heads * self.seq * self.dim, self.seq * self.dim, self.dim
        slots = 1 if self.layout == "BSNH" else PACKED_LAYOUTS.get(self.layout)
        if slots is None:
            raise ValueError(f"operand layout must be 'BSNH', 'BNSH' or one of {tuple(PACKED_LAYOUTS)}, got "
                             f"{self.layout!r}")  # fmt: skip
        row = num_heads * slots * self.dim  # one (b, s) row of the input: every head's slots
        return self.seq * row, slots * self.dim, row


def ws_tensor_maps(problem: MhaProblem, operand_dtype: str, tile: WsTile, operands: dict) -> list:
    """flash_attention_ws's three extra parameters: the TMA maps (steps.TensorMap, encoded at launch) of q, k and v, boxes of
    tile.block_m query rows and of tile.block_n key rows."""
    g = problem.geometry
    maps = []
    for name, op in operands.items():
        spec = tma.TileMap.for_operand(name, op.address, operand_dtype, dim=op.dim, seq=op.seq, heads=g.num_heads,
                                       batch=g.batch, strides=op.strides(g.num_heads),
                                       box_rows=tile.block_m if name == "q" else tile.block_n)  # fmt: skip
        maps.append(TensorMap(spec))
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
    count: the fastest of the (stages, blocks) pairs tried at every head tile (BENCH.md)."""
    blocks, stages = max(
        (min(FP32_MAX_BLOCKS, blocks_per_sm_by_shared_memory(fp32_shared_bytes(head_dim, stages))), stages)
        for stages in (1, 2)
    )
    return Fp32Pipeline(stages, blocks)




def shared_bytes(problem: MhaProblem, tile: Optional[Tile] = None) -> int:
    """Dynamic shared memory of the launch (mirrors the kernels' carving of smem_raw)."""
    g = problem.geometry
    if problem.dtype == "float32":
        head_dim = head_dim_tile(g.head_size, g.v_head_size)
        return fp32_shared_bytes(head_dim, fp32_pipeline(head_dim).stages)
    tile = tile or default_tile(problem)
    head_dim = kernel_head_tile(g.head_size, g.v_head_size, tile)
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


def kernel_name(problem: MhaProblem, operand_dtype: str, tile: Optional[Tile] = None,
                key_offset: bool = False) -> str:  # fmt: skip
    """The NVRTC name expression of the instantiation this call launches (tile None: the mma default tile;
    ``key_offset``: the call passes a per-key offset, FLASH_WITH_KEY_OFFSET)."""
    g = problem.geometry
    elem, src = ELEMENT_TYPES[problem.dtype], ELEMENT_TYPES[operand_dtype]
    if problem.dtype == "float32":
        head_dim = head_dim_tile(g.head_size, g.v_head_size)
        pipeline = fp32_pipeline(head_dim)
        return (f"flash_attention_fp32<{elem}, {src}, {head_dim}, {FP32_ROWS}, {FP32_ROW_THREADS}, {pipeline.stages}, "
                f"{pipeline.blocks}>")  # fmt: skip
    tile = tile or default_tile(problem)
    head_dim = kernel_head_tile(g.head_size, g.v_head_size, tile)
    if isinstance(tile, WsTile):
        return (f"flash_attention_ws<{elem}, {head_dim}, {tile.block_n}, {tile.consumers}, "
                f"{str(problem.causal).lower()}>")  # fmt: skip
    if isinstance(tile, WgmmaTile):
        features = mma_features(problem, key_offset)
        return (f"flash_attention_wgmma<{elem}, {head_dim}, {tile.block_m}, {tile.block_n}, {features}, "
                f"{str(tile.overlap).lower()}>")  # fmt: skip
    features = mma_features(problem, key_offset)
    return f"flash_attention_mma<{elem}, {src}, {head_dim}, {tile.block_m}, {tile.block_n}, {features}>"


# ----------------------------------------------------------------------------------------------- the launch
_capabilities: dict = {}
_sm_counts: dict = {}


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel choice reads of a device: its compute capability as CuPy spells it ("90" for 9.0) and its
    streaming multiprocessors (the persistent kernel's grid). ``of(device_id)`` asks the device once; tests and
    the native route's CPU checks build one by hand."""

    capability: str
    sms: int

    @classmethod
    def of(cls, device_id: int) -> "DeviceFacts":
        return cls(device_capability(device_id), device_sm_count(device_id))


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


def raise_shared_limit(kernel, shared: int) -> None:
    """Let ``kernel`` launch with ``shared`` dynamic bytes (above 48 KiB a kernel must opt in)."""
    if shared > DEFAULT_SHARED_LIMIT and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared


def get_fused_kernel(device_id: int, name: str, shared: int):
    """The compiled instantiation ``name`` on ``device_id`` (kernels.get_function: compiled once per process) with
    its dynamic shared-memory limit raised to ``shared`` bytes when needed (call with that device current). The
    one lookup of every fused launch (runner.run_steps and the native route's planner): bench/fused_timing.py swaps
    it to time other kernel sources."""
    kernel = kernels.get_function(device_id, name)
    raise_shared_limit(kernel, shared)
    return kernel


def _check_aligned(name: str, address: Address, element_bytes: int, strides=()) -> None:
    if address is not None and alignment_of(address) < VECTOR_ALIGNMENT:
        raise ValueError(f"fused attention: {name} address {address!r} is not {VECTOR_ALIGNMENT}-byte aligned")
    for stride in strides:
        if (stride * element_bytes) % VECTOR_ALIGNMENT:
            raise ValueError(f"fused attention: {name} stride {stride} is not a multiple of {VECTOR_ALIGNMENT} bytes")


def fused_step(
    problem: MhaProblem,
    *,
    q: Operand,
    k: Operand,
    v: Operand,
    operand_dtype: str,
    attention_bias: Address,
    mask: Address,
    out_BSD: Address,
    facts: DeviceFacts,
    tile: Optional[Tile] = None,
    key_offset: Address = None,
    query_offset: Address = None,
    out_narrow: Address = None,
) -> Launch:
    """The fused kernel's launch for ``problem`` (its dispatch rule must have said None), as a steps.Launch.

    q:  (B, S, N, H) as an Operand (BSNH or BNSH), + bias_q on load when ``q.bias`` is set (float32 operands, or
        a float32 call, only: check_operand_bias);
    k:  (B, T, N, H) or (B, N, T, H): all T keys (a past must already be concatenated: the layout mover's k_BNTH);
    v:  the same with Hv;
    operand_dtype: element type of q, k and v ("float32", or the call's dtype);
    attention_bias: device float32 (B|1, N|1, S, T), or None;
    mask: device padding mask of ``problem.padding_mask.kind``: int32 (B,) key lengths, uint8 (B, T) or (B, S, T)
          keep flags; None when the call has none;
    out_BSD: device float32 (B, S, N*Hv), every element written (rounded to the call's dtype first);
    out_narrow: f16/bf16 calls only (the tensor-core kernels, and fused_steps' split-key kernels): device
          (B, S, N*Hv) in the call's dtype, written instead of out_BSD (which may then be None): the node's own
          output, with no narrowing pass after;
    facts: the device's capability and SM count (DeviceFacts.of);
    tile: f16/bf16 only: the kernel and its tile, an MmaTile, WgmmaTile or WsTile (default: choose_tile for this
          device; the timing script and the tests name others; a WgmmaTile must pass wgmma_unsupported_reason,
          a WsTile ws_unsupported_reason);
    key_offset: f16/bf16 only: device float32 (B, N, T) added to every score after the scale, or None;
    query_offset: f16/bf16 only: device float32 (B, N, S) added to the scores of the new keys j >= P, or None
          (dispatch.py score_terms: the backend passes them with operands built without the projection biases).
    Addresses are ints or steps.Buffer names (the native route binds those at every call). Raises ValueError
    for operands the kernel cannot take.
    """
    launch = _decided(problem, q, k, v, operand_dtype, attention_bias, mask, facts, tile, key_offset, query_offset)
    if out_narrow is not None and problem.dtype == "float32":
        raise ValueError("fused attention: out_narrow is for float16 / bfloat16 calls (flash_attention_fp32 writes "
                         "float32 only)")  # fmt: skip
    args = _arguments(launch, q, k, v, attention_bias, mask, key_offset, query_offset, out_BSD, out_narrow)
    if isinstance(launch.tile, WsTile):  # the TMA maps, then a whole-tile walk: every tile full, no tail slots
        args += tuple(ws_tensor_maps(problem, operand_dtype, launch.tile, {"q": q, "k": k, "v": v}))
        args += (np.int64(query_tiles(problem, launch.tile.block_m)), np.int32(1), Pointer(None), Pointer(None))
    return Launch(launch.name, (launch.blocks, 1, 1), (launch.threads, 1, 1), launch.shared, args, fused=True)


def ws_tail_steps(problem: MhaProblem, step: Launch, tile: WsTile, tail: dispatch.WsTail, take, facts: DeviceFacts,
                  out_BSD: Address, out_narrow: Address) -> list:  # fmt: skip
    """flash_attention_ws's whole-tile ``step`` (fused_step) as a tail split (dispatch.ws_tail): the launch over
    tail.units units with its tail slots in two scratch buffers from ``take`` (unnormalised O and (max, sum) of
    tile.block_m rows a slot), then split_keys.tail_combine_step, which writes the output."""
    g = problem.geometry
    partial_O = take("tail_O", 4 * tail.slots * tile.block_m * g.v_head_size)
    partial_ML = take("tail_ML", 8 * tail.slots * tile.block_m)
    args = step.args[:-4] + (np.int64(tail.full_tiles), np.int32(tail.splits), Pointer(partial_O), Pointer(partial_ML))
    log.debug("mha_ep: fused path: %s, tail split: %d whole tiles, %d tiles in %d key ranges each", step.function,
              tail.full_tiles, tail.tail_tiles, tail.splits)  # fmt: skip
    launch = Launch(step.function, (min(tail.units, facts.sms), 1, 1), step.block, step.shared, args, fused=True)
    return [launch, tail_combine_step(problem, tail, tile.block_m, partial_O, partial_ML, out_BSD, out_narrow)]


def fused_steps(problem: MhaProblem, *, take, facts: DeviceFacts, tile: Optional[Tile] = None,
                raw_query: bool = False, qk: Address = None, split_kernel: Optional[str] = None,
                **operands) -> list:  # fmt: skip
    """The fused path's launches for ``problem``: fused_step's one kernel, or for a decode step that
    dispatch.key_split cuts (and no ``tile`` named) the split-key kernels (kernels/split_keys.cu), over scratch
    buffers from ``take(name, nbytes)``: ``split_kernel`` "stream", split_key_stream after a Fill of its arrival
    counters (split_keys.split_stream_steps), or "pair", split_key_attention then combine_key_splits
    (split_keys.split_key_steps); None: split_keys.chosen_split_kernel(). The arguments are fused_step's, with its
    checks.

    ``raw_query`` (split-key calls only): q is the float16 / bfloat16 query as the node received it, with the node's
    own ``q.bias`` (in the query's dtype) that the kernel adds on load and keeps in float32 (ORT's sum), k and v the
    node's own BNSH key and value (which carry no bias): the native route's cross attention, with no layout mover
    (pipeline.py).

    ``qk`` (split-key calls only): a float32 (B, N, S, T) buffer the split-key kernel writes the masked scores into
    (output 3; dispatch.fused_unsupported_reason sends any other qk call to the three phases).

    flash_attention_ws calls whose last round would leave most SMs idle (dispatch.ws_tail) take ws_tail_steps: the
    kernel with those tiles cut into key ranges, over two scratch buffers from ``take``, then their combine."""
    in_bytes = ELEMENT_BYTES[operands["operand_dtype"]]
    split = None if tile is not None else dispatch.key_split(problem, facts.sms, in_bytes)
    if split is None:
        if raw_query:
            raise ValueError("fused attention: raw_query is for calls dispatch.key_split cuts")
        if qk is not None:
            raise ValueError("fused attention: the qk output is for calls dispatch.key_split cuts")
        step = fused_step(problem, facts=facts, tile=tile, **operands)
        chosen = _chosen_tile(problem, facts, tile, operands)
        tail = dispatch.ws_tail(problem, chosen, facts.sms) if isinstance(chosen, WsTile) else None
        if tail is None:
            return [step]
        return ws_tail_steps(problem, step, chosen, tail, take, facts, operands["out_BSD"], operands.get("out_narrow"))
    out_narrow = operands.get("out_narrow")
    if out_narrow is not None and problem.dtype == "float32":
        raise ValueError("fused attention: out_narrow is for float16 / bfloat16 calls (a float32 call's split-key "
                         "kernels write float32 out_BSD)")  # fmt: skip
    q, k, v, out_BSD = operands["q"], operands["k"], operands["v"], operands["out_BSD"]
    attention_bias, mask = operands["attention_bias"], operands["mask"]
    key_offset, query_offset = operands.get("key_offset"), operands.get("query_offset")
    if raw_query and (k.bias is not None or v.bias is not None or key_offset is not None or query_offset is not None):
        raise ValueError("fused attention: a raw query's call has no key / value bias and no score offsets")
    launch = _decided(problem, q, k, v, operands["operand_dtype"], attention_bias, mask, facts, None, key_offset,
                      query_offset, check_bias=not raw_query)  # fmt: skip
    arguments = _arguments(launch, q, k, v, attention_bias, mask, key_offset, query_offset, out_BSD, out_narrow)
    kernel = split_kernel or chosen_split_kernel()
    if kernel not in SPLIT_KERNELS:
        raise ValueError(f"fused attention: split_kernel {kernel!r} is not one of {SPLIT_KERNELS}")
    cut = dispatch.key_stream(problem, facts.sms, in_bytes) if kernel == "stream" else None
    if cut is not None:  # (key_stream takes every call key_split does)
        programmatic = raw_query and dispatch.programmatic_launches(facts.capability)
        return split_stream_steps(problem, cut, take, arguments, operands["operand_dtype"], round_query=not raw_query,
                                  qk=qk, programmatic=programmatic)  # fmt: skip
    return split_key_steps(problem, split, take, arguments, operands["operand_dtype"], out_BSD,
                           round_query=not raw_query, qk=qk, out_narrow=out_narrow)  # fmt: skip


def _chosen_tile(problem: MhaProblem, facts: DeviceFacts, tile: Optional[Tile], operands: dict) -> Optional[Tile]:
    """The tile fused_step took for these ``operands`` (its remembered decision)."""
    return _decided(problem, operands["q"], operands["k"], operands["v"], operands["operand_dtype"],
                    operands["attention_bias"], operands["mask"], facts, tile, operands.get("key_offset"),
                    operands.get("query_offset")).tile  # fmt: skip


def _decided(problem: MhaProblem, q: Operand, k: Operand, v: Operand, operand_dtype: str, attention_bias: Address,
             mask: Address, facts: DeviceFacts, tile: Optional[Tile], key_offset: Address,
             query_offset: Address, check_bias: bool = True) -> "FusedLaunch":  # fmt: skip
    """fused_launch's decision for this call signature, remembered, and the operands' alignment checked."""
    key = (facts, problem_signature(problem), operand_dtype, tile, attention_bias is None, mask is None,
           q.layout, q.seq, q.dim, q.bias is None, k.layout, k.seq, k.dim, k.bias is None,
           v.layout, v.seq, v.dim, v.bias is None, key_offset is None, query_offset is None, check_bias)  # fmt: skip
    launch = _launches.get(key)
    if launch is None:
        launch = fused_launch(problem, q=q, k=k, v=v, operand_dtype=operand_dtype, attention_bias=attention_bias,
                              mask=mask, tile=tile, facts=facts,
                              key_offset=key_offset is not None or query_offset is not None,
                              check_bias=check_bias)  # fmt: skip
        if len(_launches) >= MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = launch
    for name, op in (("q", q), ("k", k), ("v", v)):
        _check_aligned(name, op.address, launch.in_bytes)
    return launch


def _arguments(launch: "FusedLaunch", q: Operand, k: Operand, v: Operand, attention_bias: Address, mask: Address,
               key_offset: Address, query_offset: Address, out_BSD: Address,
               out_narrow: Address = None) -> tuple:  # fmt: skip
    """The arguments every fused kernel takes, up to out_narrow_BSD (flash_common.cuh FLASH_KERNEL_PARAMETERS)."""
    sq, sk, sv = launch.strides
    mask_kind = launch.mask_kind
    return (
        Pointer(q.address), *sq, Pointer(q.bias),
        Pointer(k.address), *sk, Pointer(k.bias),
        Pointer(v.address), *sv, Pointer(v.bias),
        Pointer(attention_bias), *launch.bias_dims, np.int32(int(mask_kind)),
        Pointer(mask if mask_kind == MaskKind.KEY_LENGTHS else None),
        Pointer(mask if mask_kind in (MaskKind.KEYS_BT, MaskKind.KEYS_BST) else None),
        Pointer(key_offset), Pointer(query_offset), *launch.scalars, Pointer(out_BSD), Pointer(out_narrow),
    )  # fmt: skip


MAX_LAUNCHES = 1024  # remembered launch decisions (forgotten all at once beyond)
_launches: dict = {}


@dataclass(frozen=True)
class FusedLaunch:
    """What fused_step decides once per call signature: the instantiation, its grid, block and shared memory, and
    the arguments that do not depend on where the operands lie."""

    name: str
    blocks: int
    threads: int
    shared: int
    tile: Optional[Tile]
    in_bytes: int  # operand element size
    strides: tuple  # ((sb, sh, ss) of q, k, v as np.int64)
    mask_kind: MaskKind
    bias_dims: tuple  # (d0, d1) of attention_bias as np.int32
    scalars: tuple  # mask_filter_value, causal, skip_causal_tiles, scale, B, N, S, T, P, H, Hv


def fused_launch(problem: MhaProblem, *, q: Operand, k: Operand, v: Operand, operand_dtype: str,
                 attention_bias: Address, mask: Address, tile: Optional[Tile], facts: DeviceFacts,
                 key_offset: bool = False, check_bias: bool = True) -> FusedLaunch:  # fmt: skip
    """fused_step's checks and decisions for ``problem`` (raises ValueError like fused_step; addresses are read
    only for whether they are given; ``key_offset``: the call passes a key or query offset,
    FLASH_WITH_KEY_OFFSET; ``check_bias`` False: the split-key kernel adds a low-precision operand's float32 bias,
    fused_steps' raw_query). Compiles nothing."""
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
    if check_bias:
        check_operand_bias(problem, operand_dtype, {"q": q, "k": k, "v": v})
    if key_offset and problem.dtype == "float32":
        raise ValueError("fused attention: key / query offsets are for float16 / bfloat16 calls "
                         "(flash_attention_fp32 adds every bias in float32 and takes none)")  # fmt: skip
    mask_kind = MaskKind.of(None if problem.padding_mask is None else problem.padding_mask.kind)
    bias = problem.attention_bias
    d0, d1 = (1, 1) if bias is None else (bias.shape[0], bias.shape[1])

    if problem.dtype != "float32":
        if tile is None:
            tile = choose_tile(problem, operand_dtype, facts.capability, facts.sms, key_offset)
        elif isinstance(tile, (WgmmaTile, WsTile)):
            reason = ws_tile_unsupported_reason(problem, tile) if isinstance(tile, WsTile) else None
            if reason is not None:
                raise ValueError(f"fused attention: tile {tile.label}: {reason}")
            if isinstance(tile, WsTile):
                reason = ws_unsupported_reason(problem, operand_dtype, facts.capability, key_offset)
            else:
                reason = wgmma_unsupported_reason(problem, operand_dtype, facts.capability)
            if reason is not None:
                kernel = "warp-specialized" if isinstance(tile, WsTile) else "wgmma"
                raise ValueError(f"fused attention: tile {tile.label} needs the {kernel} kernel, which cannot run "
                                 f"this call: {reason}")  # fmt: skip
    name = kernel_name(problem, operand_dtype, tile, key_offset)
    shared = shared_bytes(problem, tile)
    if shared > SHARED_LIMIT:
        raise ValueError(f"fused attention: tile {tile.label} needs {shared} bytes of shared "
                         f"memory for this call, more than the {SHARED_LIMIT} a block can have")  # fmt: skip
    threads = FP32_THREADS if problem.dtype == "float32" else tile.threads
    blocks = query_tiles(problem, block_m(problem, tile))
    if isinstance(tile, WsTile):  # persistent: one block per SM walks the query tiles
        blocks = min(blocks, facts.sms)

    log.debug("mha_ep: fused path: %s, %d blocks x %d threads, %d bytes of shared memory", name, blocks, threads,
              shared)  # (the three-phase path says why it was taken: pipeline.py)

    i64, i32 = np.int64, np.int32
    return FusedLaunch(
        name=name, blocks=blocks, threads=threads, shared=shared, tile=tile, in_bytes=in_bytes,
        strides=tuple(tuple(i64(s) for s in strides[name]) for name in ("q", "k", "v")),
        mask_kind=mask_kind, bias_dims=(i32(d0), i32(d1)),
        scalars=(
            np.float32(problem.mask_filter_value), i32(int(problem.causal)),
            i32(int(bias is None)),  # skip_causal_tiles: exact only when no attention_bias can lift future logits
            np.float32(problem.scale),
            i32(g.batch), i32(n), i32(g.q_seq), i32(g.total_seq), i32(g.past_seq), i32(g.head_size),
            i32(g.v_head_size),
        ),
    )  # fmt: skip
