"""Host-side launch geometry of the cuda backend: every size a kernel or cuBLAS receives, checked before launch.

The kernels take ``int`` geometry and index with ``long long`` (kernels/*.cu); cuBLAS takes ``int`` m, n, k,
leading dimensions and batch count, and ``long long`` strides. This module proves, for one call, that each int
argument fits a CUDA int, each launch grid fits a u32 block count, and each buffer's byte size fits isize, using
the checked arithmetic the claim gate uses too (mha_ep/limits.py). A violation raises ``MhaInputError`` naming the
quantity.

Legend: B batch, S query length, L new key length, P past length, T = P + L, N heads, H head size, Hv value head
size. This module must not import CuPy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from mha_ep import limits
from mha_ep.errors import MESSAGE_PREFIX, MhaInputError
from mha_ep.launch import ELEMENT_BYTES, SOFTMAX_THREADS, WARP
from mha_ep.engine.problem import Geometry

PREFIX = MESSAGE_PREFIX + "cuda backend: "
FLOAT32_BYTES = 4
WARP_SOFTMAX_COLS_PER_LANE = (1, 2, 4, 8, 16, 32)  # instantiated masked_softmax_warp variants: T <= 1024
VEC_WIDTH = 4  # layout kernels move 4 consecutive floats per thread when the head size allows it
ROW_CACHE_MAX_BYTES = 32 * 1024  # shared-memory row cache of the softmax (under the 48 KiB default limit)
MAX_GRID_BLOCKS = 2**31 - 1  # gridDim.x limit; grid-stride loops cover anything beyond the launched grid


def _checked(check, *args) -> int:
    """Run one of mha_ep.limits' checks; its LimitError is this backend's input error."""
    try:
        return check(*args)
    except limits.LimitError as error:
        raise MhaInputError(PREFIX + error.reason) from None


def checked_i32(value: int, name: str) -> int:
    if value < 0:
        raise MhaInputError(f"{PREFIX}{name}={value} must be >= 0")
    return _checked(limits.checked_i32, value, name)


def checked_bytes(elements: int, element_size: int, name: str) -> int:
    return _checked(limits.checked_bytes, elements, element_size, name)


def row_team(groups: int) -> int:
    """Threads that move one row of ``groups`` VEC-wide groups in layout.cu's build_dense_rows (its row_team):
    the least power of two >= groups, at most a warp."""
    team = 1
    while team < groups and team < WARP:
        team *= 2
    return team


def checked_grid(count: int, name: str) -> int:
    """Blocks of LAUNCH_BLOCK threads for ``count`` elements (u32-checked), capped at the launchable grid."""
    return min(max(_checked(limits.checked_grid, count, name), 1), MAX_GRID_BLOCKS)


@dataclass(frozen=True)
class LaunchPlan:
    """Checked sizes of one call. Counts are elements, ``nbytes`` are bytes per device buffer."""

    dtype: str
    element_bytes: int
    batch: int
    heads: int
    q_seq: int
    kv_seq: int
    past_seq: int
    total_seq: int
    head_size: int
    v_head_size: int
    batch_heads: int  # B*N: the GEMMs' batch count
    rows: int  # B*N*S: the softmax's rows (one block each)
    row_cache: bool  # the block softmax keeps a row of logits in shared memory
    softmax_cols_per_lane: int  # masked_softmax_warp variant; 0 = rows too long, use the block kernel
    vec_qk: int  # head_size % 4 == 0 -> 4, else 1
    vec_v: int  # VEC of context_to_BSD and narrow_output (v_head_size % 4 == 0 -> 4)
    vec_movers: int  # VEC of the layout movers' one launch: 4 when both head sizes allow it
    grids: dict = field(default_factory=dict)  # kernel launch name -> blocks
    nbytes: dict = field(default_factory=dict)  # device buffer name -> bytes

    @property
    def softmax_shared_bytes(self) -> int:
        return self.total_seq * FLOAT32_BYTES if self.row_cache else 0


def plan_launch(geometry: Geometry, dtype: str) -> LaunchPlan:
    """Check every int argument, grid and buffer size of one call (raises MhaInputError)."""
    if dtype not in ELEMENT_BYTES:
        raise MhaInputError(f"{PREFIX}dtype {dtype!r} is not one of {tuple(ELEMENT_BYTES)}")
    g = geometry
    elem = ELEMENT_BYTES[dtype]
    b = checked_i32(g.batch, "batch")
    n = checked_i32(g.num_heads, "num_heads")
    s = checked_i32(g.q_seq, "query sequence length")
    length = checked_i32(g.kv_seq, "key sequence length")
    p = checked_i32(g.past_seq, "past sequence length")
    t = checked_i32(g.total_seq, "total sequence length")
    h = checked_i32(g.head_size, "head_size")
    hv = checked_i32(g.v_head_size, "v_head_size")
    batch_heads = checked_i32(b * n, "GEMM batch count B*N")
    rows = b * n * s  # 64-bit in the softmax kernel's row loop; the grid is capped and strides over the rest

    counts = {
        "q_BNSH": b * n * s * h,
        "k_BNTH": b * n * t * h,
        "v_BNTH": b * n * t * hv,
        "scores_BNST": b * n * s * t,
        "context_BNSH": b * n * s * hv,
        "key_offset_BNT": b * n * t,
        "query_offset_BNS": b * n * s,
    }
    vec_qk = VEC_WIDTH if h % VEC_WIDTH == 0 else 1
    vec_v = VEC_WIDTH if hv % VEC_WIDTH == 0 else 1
    vec_movers = min(vec_qk, vec_v)  # one launch moves Q, K and V
    cols_per_lane = next((c for c in WARP_SOFTMAX_COLS_PER_LANE if WARP * c >= t), 0)
    rows_per_block = SOFTMAX_THREADS // WARP if cols_per_lane else 1
    grids = {
        # the three layout movers in one launch (x blocks each): a team of threads per destination row (row_team)
        "layout movers": max(
            checked_grid(b * n * s * row_team(h // vec_movers), "q_BNSH build"),
            checked_grid(b * n * t * row_team(h // vec_movers), "k_BNTH build"),
            checked_grid(b * n * t * row_team(hv // vec_movers), "v_BNTH build"),
        ),
        "context_to_BSD": checked_grid(counts["context_BNSH"] // vec_v, "context_to_BSD"),
        "masked_softmax": min(-(-rows // rows_per_block), MAX_GRID_BLOCKS),
    }
    nbytes = {
        "q_BNSH": checked_bytes(counts["q_BNSH"], elem, "q_BNSH scratch"),
        "k_BNTH": checked_bytes(counts["k_BNTH"], elem, "k_BNTH scratch"),
        "v_BNTH": checked_bytes(counts["v_BNTH"], elem, "v_BNTH scratch"),
        "scores_BNST": checked_bytes(counts["scores_BNST"], FLOAT32_BYTES, "scores_BNST scratch"),
        "probs_BNST": checked_bytes(counts["scores_BNST"], elem, "probs_BNST scratch"),
        "context_BNSH": checked_bytes(counts["context_BNSH"], FLOAT32_BYTES, "context_BNSH scratch"),
        "key_offset_BNT": checked_bytes(counts["key_offset_BNT"], FLOAT32_BYTES, "key_offset_BNT scratch"),
        "query_offset_BNS": checked_bytes(counts["query_offset_BNS"], FLOAT32_BYTES, "query_offset_BNS scratch"),
    }
    # cuBLAS m, n, k and leading dimensions are int: T, S, H, Hv are checked above.
    return LaunchPlan(
        dtype=dtype,
        element_bytes=elem,
        batch=b,
        heads=n,
        q_seq=s,
        kv_seq=length,
        past_seq=p,
        total_seq=t,
        head_size=h,
        v_head_size=hv,
        batch_heads=batch_heads,
        rows=rows,
        row_cache=cols_per_lane == 0 and t * FLOAT32_BYTES <= ROW_CACHE_MAX_BYTES,
        softmax_cols_per_lane=cols_per_lane,
        vec_qk=vec_qk,
        vec_v=vec_v,
        vec_movers=vec_movers,
        grids=grids,
        nbytes=nbytes,
    )


@functools.lru_cache(maxsize=256)
def cached_plan(geometry: Geometry, dtype: str) -> LaunchPlan:
    """plan_launch memoised on (Geometry, dtype): repeated shapes skip the checks' Python cost."""
    return plan_launch(geometry, dtype)
