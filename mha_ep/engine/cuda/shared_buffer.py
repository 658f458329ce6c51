"""The steps of a shared-buffer call (docs/SEMANTICS.md §3.9-3.10): one decode step over a static KV cache.

    shared_buffer_steps(problem, call, take) -> steps

The past is (B, N, M, H), P = past_sequence_length is read on the device (kernels/shared_buffer.cu), and nothing
in the steps depends on P: one plan, or one captured CUDA graph, serves every step of a decode loop. In order:
  1. the call's status words (STATUS_WORDS int32) are zeroed (Fill; zero_after_prior_grids where
     shared_buffer_decode is launched programmatically: shared_buffer_steps);
  2. the past is copied into the present (Copy: a no-op at run time when the present is the past's own buffer,
     the static decoder's binding, mha_ep/graph/static_cache.py);
  3. one kernel writes the L new key/value rows at [P, P+L) of the presents and computes the output, a block
     per (b, n, s), over the P + L keys (the past's rows, redirected by cache_indirection on the beam path; the
     new rows in float32). It reads query, key and value as (B, S|L, N*H) rows, or as the three slots of a packed
     QKV query (B, L, N, 3, H) in place (the native route: packed.source_slots; its ``slots`` argument). Which
     kernel (shared_buffer_kernel): ``shared_buffer_decode``, whose lane groups walk the keys straight from
     global memory with an online softmax in registers, wherever a warp's 16-byte loads cover a head (max(H, Hv)
     <= decode_max_dim); else ``shared_buffer_attention``, which stages the past a tile at a time into shared
     memory and takes two softmax passes over a row of scores there (MHA_EP_SHARED_KERNEL=tiled picks it for
     A/B timing);
  5. CheckStatus: after an eager call the native library reads the status words and turns a report into ORT's
     error (a captured graph skips it; the kernels' sticky reports reach the decode loop: mha_ep/native/gpu.py).
Every tensor is read in the sources' dtype (float32 on the bridge, the node's own on the native route) and
written in it; the arithmetic is float32. The mask is read as it comes: the bridge's resolved form (int32 key
lengths, uint8 keep flags) or ORT's raw int32 / int64 key_padding_mask.
This module must not import CuPy: the native route plans on CPU machines too.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mha_ep import limits
from mha_ep.errors import MESSAGE_PREFIX, MhaInputError
from mha_ep.launch import ELEMENT_BYTES, SHARED_BUFFER_THREADS, STATUS_WORDS, MaskKind
from mha_ep.engine.cuda import dispatch
from mha_ep.engine.cuda.kernels import name_expression
from mha_ep.engine.cuda.packed import source_slots
from mha_ep.engine.cuda.steps import CheckStatus, Copy, Fill, Launch, Pointer
from mha_ep.engine.problem import MhaProblem

SHARED_MEMORY_LIMIT = 48 * 1024  # bytes of dynamic shared memory a block may take without opting in
STAGE_LOADS = 4  # kernels/shared_buffer.cu STAGE_LOADS: 16-byte loads of K and of V a thread issues at once
TILE_BYTES = SHARED_BUFFER_THREADS * STAGE_LOADS * 16  # a tile of past rows the block loads in one round
MASK_TYPES = {  # (DeviceCall.mask_form, PaddingMask.kind) -> the kernel's mask type (kernels.py KERNELS variants)
    ("resolved", "key_lengths"): "int",
    ("resolved", "keys_BT"): "unsigned char",
    ("resolved", "keys_BST"): "unsigned char",
    ("int32", "key_lengths"): "int",
    ("int32", "keys_BT"): "int",
    ("int32", "keys_BST"): "int",
    ("int64", "key_lengths"): "long long",
    ("int64", "keys_BT"): "long long",
    ("int64", "keys_BST"): "long long",
}


SHARED_KERNELS = ("decode", "tiled")  # the default first: shared_buffer_decode, shared_buffer_attention
SHARED_KERNEL_ENV = "MHA_EP_SHARED_KERNEL"  # "tiled": the tiled kernel wherever it can run, for A/B timing
WARP_LANES = 32


def decode_max_dim(element: int) -> int:
    """The widest head shared_buffer_decode takes: a warp's 16-byte loads of one row (kernels/shared_buffer.cu
    o_s, split_lanes)."""
    return WARP_LANES * (16 // element)


def decode_unsupported_reason(problem: MhaProblem, element: int) -> Optional[str]:
    """None where shared_buffer_decode takes ``problem`` with ``element``-byte sources, else why not."""
    g = problem.geometry
    widest = decode_max_dim(element)
    if max(g.head_size, g.v_head_size) > widest:
        return (f"max(H, Hv) = {max(g.head_size, g.v_head_size)} is wider than one warp's 16-byte loads cover "
                f"({widest} elements of {element} bytes): the tiled kernel runs")  # fmt: skip
    return None


def shared_buffer_kernel(problem: MhaProblem, element: int) -> str:
    """The kernel a shared-buffer call runs: "decode" (shared_buffer_decode) unless it cannot take the call or
    MHA_EP_SHARED_KERNEL names "tiled" (read when a call is planned: a native plan keeps its choice for the
    process)."""
    chosen = dispatch.kernel_from_environment(SHARED_KERNEL_ENV, SHARED_KERNELS)
    if chosen == "decode" and decode_unsupported_reason(problem, element) is None:
        return "decode"
    return "tiled"


def _round16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def shared_layout(problem: MhaProblem, element: int) -> tuple[int, int]:
    """shared_buffer_attention's (tile_keys, dynamic shared bytes) for ``element``-byte sources: a tile of
    ``tile_keys`` past key rows and one of value rows (T, each rounded up to 16 bytes; a tile of at most
    TILE_BYTES, fewer rows where the scores would not fit beside it, never more than M), then in float32 the row
    of M scores, q (H) and the partial sums (groups x Hv). The kernel reads the layout from the same numbers."""
    g = problem.geometry
    groups = max(1, SHARED_BUFFER_THREADS // g.v_head_size)
    floats = 4 * (problem.shared.max_seq + g.head_size + groups * g.v_head_size)
    row = element * max(g.head_size, g.v_head_size)
    tile_keys = max(1, min(TILE_BYTES // row, problem.shared.max_seq))

    def total(keys: int) -> int:
        return _round16(keys * g.head_size * element) + _round16(keys * g.v_head_size * element) + floats

    while tile_keys > 1 and total(tile_keys) > SHARED_MEMORY_LIMIT:
        tile_keys //= 2
    return tile_keys, total(tile_keys)


def longest_shared_buffer(problem: MhaProblem, element: int) -> int:
    """The longest max_sequence_length shared_layout fits into SHARED_MEMORY_LIMIT (a one-row tile)."""
    g = problem.geometry
    groups = max(1, SHARED_BUFFER_THREADS // g.v_head_size)
    fixed = _round16(g.head_size * element) + _round16(g.v_head_size * element) + 4 * (g.head_size + groups * g.v_head_size)
    return (SHARED_MEMORY_LIMIT - fixed) // 4


def shared_buffer_steps(problem: MhaProblem, call, take, programmatic: bool = False) -> list:
    """The steps of module docstring for ``problem`` (problem.shared set) on ``call``'s buffers (a
    pipeline.DeviceCall whose sources include past_sequence_length and, on the beam path, cache_indirection);
    ``take(name, nbytes)`` hands out scratch. Raises MhaInputError for a buffer the kernel cannot hold.
    ``programmatic`` (dispatch.programmatic_launches): shared_buffer_decode, which waits for the kernels before it
    first thing, is launched programmatically after zero_after_prior_grids zeroes the status words (a Fill cannot
    be followed programmatically)."""
    g, shared = problem.geometry, problem.shared
    dtype = call.source_dtype
    if call.output_dtype != dtype or (problem.attention_bias is not None and call.attention_bias_dtype != dtype):
        raise ValueError(f"a shared-buffer call reads and writes one dtype: sources {dtype}, outputs "
                         f"{call.output_dtype}, attention_bias {call.attention_bias_dtype}")  # fmt: skip
    element = ELEMENT_BYTES[dtype]
    kernel = shared_buffer_kernel(problem, element)
    tile_keys, shared_bytes = shared_layout(problem, element) if kernel == "tiled" else (0, 0)
    if shared_bytes > SHARED_MEMORY_LIMIT:
        raise MhaInputError(
            f"{MESSAGE_PREFIX}past_key {tuple(problem.past_key_BNPH.shape)}: a shared buffer of "
            f"max_sequence_length {shared.max_seq} needs {shared_bytes} bytes of shared memory per block, more than "
            f"the {SHARED_MEMORY_LIMIT} mha_ep's tiled decode kernel takes (heads wider than "
            f"{decode_max_dim(element)} elements take it; max_sequence_length up to "
            f"{longest_shared_buffer(problem, element)} at this head size and element type)"
        )
    slots = source_slots(problem, call)  # {} (the sources are rows of their own), or every source's slot count
    slot_count = slots.get("query", 1)
    if any(slots.get(name, 1) != slot_count for name in ("key", "value")):
        raise MhaInputError(
            f"{MESSAGE_PREFIX}a shared past/present buffer with packed {str(problem.packing).upper()} input: the "
            "decode kernel reads query, key and value with one slot count (packed QKV, or none packed); claim/rules.py "
            "rule_past refuses this call"
        )
    try:  # the kernel's int strides of a head: slots x H, slots x Hv
        limits.checked_i32(slot_count * max(g.head_size, g.v_head_size), "shared_buffer_attention's head stride")
    except limits.LimitError as error:
        raise MhaInputError(MESSAGE_PREFIX + error.reason) from None
    src, out = call.sources, call.outputs
    i32, f32 = np.int32, np.float32
    status = take("status", 4 * STATUS_WORDS)
    programmatic = programmatic and kernel == "decode"
    if programmatic:
        steps: list = [Launch("zero_after_prior_grids<unsigned>", (1, 1, 1), (SHARED_BUFFER_THREADS, 1, 1), 0,
                              (Pointer(status), i32(STATUS_WORDS)), fused=True, programmatic=True)]  # fmt: skip
    else:
        steps = [Fill(status, 0, 4 * STATUS_WORDS)]
    for present, past, width in (("present_key", "past_key", g.head_size), ("present_value", "past_value", g.v_head_size)):
        steps.append(Copy(out[present], src[past], element * g.batch * g.num_heads * shared.max_seq * width))
    site = i32(call.error_site)
    sticky = Pointer(call.error_flag)
    mask = problem.padding_mask
    kind = MaskKind.of(None if mask is None else mask.kind)
    mask_type = "int" if mask is None else MASK_TYPES[(call.mask_form, mask.kind)]
    mask_total = 0 if mask is None or mask.kind == "key_lengths" else int(mask.data.shape[-1])
    bias = problem.attention_bias
    d0, d1, bias_total = (1, 1, 0) if bias is None else (int(bias.shape[0]), int(bias.shape[1]), int(bias.shape[3]))
    beams = shared.beams if shared.beam_path else 0
    try:  # a block per output row, its index the row
        rows = limits.checked_i32(g.batch * g.num_heads * g.q_seq, "shared_buffer_attention's grid (B * N * S)")
    except limits.LimitError as error:
        raise MhaInputError(MESSAGE_PREFIX + error.reason) from None
    name = "shared_buffer_decode" if kernel == "decode" else "shared_buffer_attention"
    steps.append(Launch(name_expression(name, dtype, mask_type),
                        (rows, 1, 1), (SHARED_BUFFER_THREADS, 1, 1), shared_bytes,
                        (Pointer(src["query"]), Pointer(src["key"]), Pointer(src["value"]), i32(slot_count),
                         Pointer(src.get("bias_q")), Pointer(src.get("bias_k")), Pointer(src.get("bias_v")),
                         Pointer(src["past_key"]),
                         Pointer(src["past_value"]), Pointer(src["past_sequence_length"]),
                         Pointer(src.get("cache_indirection") if beams else None), i32(beams),
                         Pointer(src.get("mask")), i32(int(kind)), i32(mask_total), Pointer(src.get("attention_bias")),
                         i32(d0), i32(d1), i32(bias_total), Pointer(out["output"]), Pointer(out["present_key"]),
                         Pointer(out["present_value"]), f32(problem.scale),
                         f32(problem.mask_filter_value), i32(int(problem.causal)), i32(g.batch), i32(g.q_seq),
                         i32(g.kv_seq), i32(g.num_heads), i32(g.head_size), i32(g.v_head_size), i32(shared.max_seq),
                         i32(tile_keys), Pointer(status), sticky, site), programmatic=programmatic))  # fmt: skip
    steps.append(CheckStatus(status, beams))
    return steps
