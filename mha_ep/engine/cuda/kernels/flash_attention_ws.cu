// Fused attention on Hopper, warp-specialized (FlashAttention-3's scheme: TMA loads, a producer warpgroup, two or
// three ping-ponging consumers), for calls without padding mask or attention_bias, scale > 0, causal or not
// (dispatch.py ws_unsupported_reason; causal: CAUSAL, see CausalRows, ws_tile and key_tiles). Same arithmetic
// as flash_attention_wgmma's plain tiles (S and P.V on wgmma, fp32 online softmax, P rounded to ELEM for P.V,
// out = O / l rounded to ELEM), same kernel parameters (the mask ones unused) plus three TMA tensor maps, same
// shared-memory layouts (flash_attention_wgmma.cu's header states the swizzle, descriptors and accumulator
// layout; wgmma_common.cuh holds the shared pieces).
//
// Why: flash_attention_wgmma syncs the whole block before each key tile's buffers are reused, so its warpgroups
// reach their softmax together and leave the tensor cores idle together; with head 128 its registers also rule
// out overlapping the steps. This kernel keeps every warpgroup's tensor-core work in flight (the head-128 anchor
// well under stock ORT CUDA's time); the variants measured on the way (one block per tile, no ping-pong, no
// overlap, three K/V stages, 176 or 192 keys per step, cp.async in place of TMA, three consumers) and their times
// are in docs/BENCH.md ("Kernel notes"). dispatch.py prefers_three_consumers says when three consumers pay.
//
// Block = CONSUMERS + 1 warpgroups (384 or 512 threads), one SM each (shared memory: Q of BLOCK_M =
// 64 x CONSUMERS rows + 2 stages of K and V tiles):
//   warpgroup 0, producer (registers cut to 40 or 24, setmaxnreg; one thread works): loads the block's Q tile and
//     its K and V tiles of BLOCK_N keys into a ring of STAGES buffers with TMA (cp.async.bulk.tensor, one box of
//     64 columns per swizzle atom, 128-byte swizzle: the layout the wgmma descriptors read); each load completes
//     on a "full" mbarrier that expects its bytes (expect_tx); a buffer is refilled after every consumer arrived
//     on its "empty" mbarrier, the Q tile after every consumer released it;
//   warpgroups 1.., consumers (registers raised to 232 or 160): 64 query rows each. Per key tile j a consumer
//     waits for K_j and V_{j-1}, issues S_j = Q . K_j^T and O += P_{j-1} . V_{j-1} (two commit groups), waits
//     for S_j, releases K_j, runs the softmax of S_j while the P.V still runs (intra-warpgroup overlap), waits for
//     it, releases V_{j-1}, rescales O and packs P_j. The first tile has no P.V before it, the last P.V none after.
//   Ping-pong: the consumers take turns issuing their wgmma, round a ring of named barriers 1.. (256 threads: one
//     consumer's sync and the previous one's arrive), so one's softmax runs while another's products hold the
//     tensor cores.
//   Persistent: gridDim.x blocks (fused.py: the SM count, at most the unit count) walk a list of work units with
//     stride gridDim.x (work_unit): units 0 .. full_tiles - 1 are the query tiles in flash_attention_wgmma's order,
//     each with all of its keys; the producer loads the next unit's Q, K and V while the consumers finish and
//     store the previous one.
//   Tail split (dispatch.ws_tail; full_tiles = every tile and tail_splits = 1 without it): the tiles from
//     full_tiles on, which alone would leave most SMs idle in the last round, are each cut into tail_splits units
//     of contiguous key tiles. Such a unit writes its rows' unnormalised O and (running max, sum) to slot
//     (tile - full_tiles) * tail_splits + split of tail_O / tail_ML, and combine_tile_splits (split_keys.cu)
//     merges a tile's slots into the output after the launch. Never for causal calls.
// TMA writes and wgmma reads both go through the async proxy, and a "full" barrier's completion makes the bytes
// visible: no proxy fence. Tensor maps (fused.py ws_tensor_maps, encoded by the driver: tma.py): 4D over an
// operand's (dim, seq, head, batch) with its own strides, so BSNH and BNSH read alike; a box is 64 columns x
// rows x 1 x 1. Out of bounds TMA fills zeros: K and V rows past T (so P.V adds nothing; their logits are set to
// -inf), Q rows past S, and the columns past H or Hv of a head tile (so they add nothing to Q.K^T).
//
// Index rule as in layout.cu: every product that can pass 2^31 is formed in long long by casting its FIRST factor.
#include "wgmma_common.cuh"

#define WS_STAGES 2

// Per CONSUMERS (2 or 3 consumer warpgroups of WARPGROUP_ROWS query rows each): block rows, threads, and the
// registers setmaxnreg gives the producer and each consumer. Two: 40 + 2 x 232 = 504, three: 24 + 3 x 160 = 504
// of the 512 a thread slot of the SM's register file allows (x 128 threads).
template <int CONSUMERS> struct WsShape {
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
  static constexpr int BLOCK_M = CONSUMERS * WARPGROUP_ROWS;
  static constexpr int THREADS = (CONSUMERS + 1) * WARPGROUP_THREADS;
  static constexpr int PRODUCER_REGISTERS = CONSUMERS == 2 ? 40 : 24;
  static constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 232 : 160;
};

// A CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, passed by value as a __grid_constant__ parameter.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

namespace ws_detail {
using namespace wgmma_detail;

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra WS_DONE;\nbra WS_WAIT;\nWS_DONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival of this thread on the mbarrier once all of its earlier cp.async have completed.
// This thread's arrival on the mbarrier, which from now on also waits for `bytes` of asynchronous copies.
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}
// One TMA load of the box at (column, row, head, batch) of `map` into shared memory `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, int column, int row, int head, int batch,
                                         unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}],"
      " [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(column), "r"(row), "r"(head), "r"(batch), "r"(bar)
      : "memory");
}
// The ATOMS boxes (64 columns each) of a tile of `rows` rows from `row` on, atom a at dst + a * rows * ATOM_BYTES.
template <int ATOMS>
__device__ __forceinline__ void tma_load_tile(unsigned dst, int rows, const TensorMap& map, int row, int head,
                                              int batch, unsigned bar) {
#pragma unroll
  for (int a = 0; a < ATOMS; ++a) tma_load(dst + a * rows * ATOM_BYTES, map, 64 * a, row, head, batch, bar);
}
// Ping-pong turns round a ring: consumer c waits on barrier 1 + c (its 128 threads sync, the previous consumer's
// 128 arrive) and passes the turn to consumer c + 1 (mod CONSUMERS).
__device__ __forceinline__ void turn_wait(int consumer) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + consumer) : "memory");
}
template <int CONSUMERS> __device__ __forceinline__ void turn_pass(int consumer) {
  const int next = CONSUMERS == 2 ? 1 - consumer : (consumer + 1) % CONSUMERS;
  asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + next) : "memory");
}
// Consumer 0's arrival on its own barrier before its first wait: it takes the first turn. (Each consumer waits
// once per turn; consumer 0 waits once more at the end, for the last consumer's last pass.)
__device__ __forceinline__ void first_turn_to_consumer_0() { asm volatile("bar.arrive 1, 256;\n" ::: "memory"); }

template <typename ELEM, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ void issue_s(float (&s)[BLOCK_N / 2], unsigned q_rows_at, unsigned k_at) {
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    const unsigned in_atom = (ks % 4) * 32;  // 16 elements into atom ks / 4
    Ops<ELEM, BLOCK_N>::s(s, swizzled_desc(q_rows_at + (ks / 4) * BLOCK_M * ATOM_BYTES + in_atom),
                          swizzled_desc(k_at + (ks / 4) * BLOCK_N * ATOM_BYTES + in_atom), ks > 0);
  }
}
template <typename ELEM, int ATOMS, int BLOCK_N>
__device__ __forceinline__ void issue_pv(float (&o_acc)[ATOMS][32], const unsigned (&p)[BLOCK_N / 16][4],
                                         unsigned v_at) {
#pragma unroll
  for (int kt = 0; kt < BLOCK_N / 16; ++kt)
#pragma unroll
    for (int a = 0; a < ATOMS; ++a)
      Ops<ELEM, BLOCK_N>::o(o_acc[a], p[kt], swizzled_desc(v_at + a * BLOCK_N * ATOM_BYTES + kt * 16 * ATOM_BYTES));
}

// Causal masking of one consumer's rows (fused semantics, flash_common.cuh masked_logit): row i < S - 1 does not
// see key j > past + i; the last row sees every key. Here a future logit becomes -inf where the other paths add
// float32 lowest: the same probabilities (0), since every row sees key 0 and its max is a finite logit no smaller
// than -1e38 (dispatch.py ws_unsupported_reason bounds the logits of the calls it lets through).
struct CausalRows {
  int first;    // the consumer's first query row
  int rows[2];  // this thread's two rows
  int q_seq;
  int past_seq;
  // Whether some row of the consumer has a future key in [n0, n0 + block_n).
  __device__ __forceinline__ bool crosses(int n0, int block_n) const { return n0 + block_n - 1 > past_seq + first; }
  __device__ __forceinline__ bool future(int r, int j) const {
    return rows[r] < q_seq - 1 && j > past_seq + rows[r];
  }
};

// The query tile of persistent step `step` (blockIdx.x, + gridDim.x, ...). Plain calls: tile_coords' order.
// Causal calls: the tiles sorted by work, the last query tile of every (b, h) first (it sees the most keys), dealt
// to the blocks in snake order (round r of gridDim.x tiles reversed when r is odd and whole), so each SM's sum of
// tile sizes stays near the mean.
template <bool CAUSAL>
__device__ __forceinline__ TileCoords ws_tile(long long step, long long tiles, int q_tiles, int heads, int batch,
                                              int block_m) {
  if constexpr (!CAUSAL) {
    return tile_coords(step, q_tiles, heads, block_m);
  } else {
    const long long blocks = gridDim.x;
    const long long round = step / blocks;
    const long long pos = step % blocks;
    const bool reverse = (round & 1) && (round + 1) * blocks <= tiles;
    const long long order = round * blocks + (reverse ? blocks - 1 - pos : pos);
    const long long bh_count = (long long)batch * heads;
    const long long bh = order % bh_count;
    TileCoords t;
    t.m0 = (q_tiles - 1 - (int)(order / bh_count)) * block_m;
    t.b = (int)(bh / heads);
    t.h = (int)(bh % heads);
    return t;
  }
}

// Key tiles of BLOCK_N the query tile at m0 reads: all of them (`all_tiles`), or for a causal call those before its
// causal frontier (as flash_common.cuh causal_key_end: the tile holding the last row reads every key).
template <bool CAUSAL, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int key_tiles(int m0, int q_seq, int total_seq, int past_seq, int all_tiles) {
  if (!CAUSAL || m0 + BLOCK_M >= q_seq) return all_tiles;
  return (min(total_seq, past_seq + m0 + BLOCK_M) + BLOCK_N - 1) / BLOCK_N;
}

// One unit of the persistent walk (the header's "Persistent" and "Tail split"): its query tile, its key tiles
// [first, first + count), and its tail slot (-1: a whole tile, stored as the output).
struct WorkUnit {
  TileCoords tc;
  int first;
  int count;
  long long slot;
};
template <bool CAUSAL, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ WorkUnit work_unit(long long unit, long long full_tiles, int tail_splits, long long tiles,
                                              int q_tiles, int heads, int batch, int q_seq, int total_seq,
                                              int past_seq, int all_key_tiles) {
  WorkUnit w;
  if (unit < full_tiles) {
    w.tc = ws_tile<CAUSAL>(unit, tiles, q_tiles, heads, batch, BLOCK_M);
    w.first = 0;
    w.count = key_tiles<CAUSAL, BLOCK_M, BLOCK_N>(w.tc.m0, q_seq, total_seq, past_seq, all_key_tiles);
    w.slot = -1;
  } else {  // a split of a tail tile (not causal: every tile reads all_key_tiles)
    w.slot = unit - full_tiles;
    const int split = (int)(w.slot % tail_splits);
    w.tc = tile_coords(full_tiles + w.slot / tail_splits, q_tiles, heads, BLOCK_M);
    w.first = (int)((long long)split * all_key_tiles / tail_splits);
    w.count = (int)((long long)(split + 1) * all_key_tiles / tail_splits) - w.first;
  }
  return w;
}

// A tail unit's result for this thread's two rows (row_local: within the tile): O unnormalised at
// tail_O + (slot * block_m + row) * v_head_size, and (running max, sum over the quad) at tail_ML + slot * block_m +
// row, for combine_tile_splits.
template <int ATOMS>
__device__ __forceinline__ void store_partial(const float (&o_acc)[ATOMS][32], const float (&row_max)[2],
                                              float (&row_sum)[2], const int (&row_local)[2], long long slot,
                                              int block_m, int v_head_size, int tig, float* __restrict__ tail_O,
                                              float2* __restrict__ tail_ML) {
  quad_sum_rows(row_sum);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const long long at = slot * block_m + row_local[r];
    if (tig == 0) tail_ML[at] = make_float2(row_max[r], row_sum[r]);
    float* o_row = tail_O + at * v_head_size;
#pragma unroll
    for (int a = 0; a < ATOMS; ++a)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = a * 64 + i * 8 + tig * 2;
        if (d < v_head_size) {
          *reinterpret_cast<float2*>(o_row + d) = make_float2(o_acc[a][4 * i + 2 * r], o_acc[a][4 * i + 2 * r + 1]);
        }
      }
  }
}

// The online softmax of one S tile in place: s becomes p = exp(scale * s - m_new) (fp32, unnormalized); updates
// the rows' running max m and sum l (this thread's columns) and returns alpha = exp(m_old - m_new). As the plain
// tiles of flash_attention_wgmma: scale > 0, so max(scale * s) = scale * max(s); the scale is folded into the
// exponent's FMA unless a row max is so large that the fold would lose the difference. CAUSAL: a tile that
// crosses the consumer's diagonal has its future logits set to -inf first.
template <int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void softmax_tile(float (&s)[BLOCK_N / 2], int n0, int total_seq, int tig, float scale,
                                             const CausalRows& causal, float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2]) {
  constexpr int S_BLOCKS = BLOCK_N / 8;
  if constexpr (CAUSAL) {
    if (causal.crosses(n0, BLOCK_N)) {
#pragma unroll
      for (int i = 0; i < S_BLOCKS; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (causal.future(c >> 1, n0 + 8 * i + 2 * tig + (c & 1))) s[4 * i + c] = NEG_INFINITY;
    }
  }
  if (n0 + BLOCK_N > total_seq) {
#pragma unroll
    for (int i = 0; i < S_BLOCKS; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (n0 + 8 * i + 2 * tig + (c & 1) >= total_seq) s[4 * i + c] = NEG_INFINITY;
  }
  float part_max[2][4];  // four independent chains over the n8 blocks, then the quad
  partial_row_max<S_BLOCKS>(s, part_max);
  float max_used[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float tile_max = fmaxf(fmaxf(part_max[r][0], part_max[r][1]), fmaxf(part_max[r][2], part_max[r][3]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    alpha[r] = online_softmax_rescale<true>(row_max[r], tile_max * scale, max_used[r]);
  }
  float tile_sum[2] = {0.0f, 0.0f};
  if (__all_sync(0xffffffffu, fabsf(max_used[0]) < 1e30f && fabsf(max_used[1]) < 1e30f)) {
    const float scale_log2 = scale * LOG2E;
    const float neg_max_log2[2] = {-max_used[0] * LOG2E, -max_used[1] * LOG2E};
#pragma unroll
    for (int i = 0; i < S_BLOCKS * 4; ++i) {
      const int r = (i >> 1) & 1;
      const float p = fast_exp2(fmaf(s[i], scale_log2, neg_max_log2[r]));
      s[i] = p;
      tile_sum[r] += p;
    }
  } else {
#pragma unroll
    for (int i = 0; i < S_BLOCKS * 4; ++i) {
      const int r = (i >> 1) & 1;
      const float p = fast_exp2((s[i] * scale - max_used[r]) * LOG2E);
      s[i] = p;
      tile_sum[r] += p;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + tile_sum[r];
}

}  // namespace ws_detail

template <typename ELEM, int HEAD_DIM, int BLOCK_N, int CONSUMERS, bool CAUSAL>
__global__ void __launch_bounds__(WsShape<CONSUMERS>::THREADS, 1)
    flash_attention_ws(FLASH_KERNEL_PARAMETERS(ELEM),
                       const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                       const __grid_constant__ TensorMap v_map, long long full_tiles, int tail_splits,
                       float* __restrict__ tail_O, float2* __restrict__ tail_ML) {
  using namespace wgmma_detail;
  using namespace ws_detail;
  static_assert(sizeof(ELEM) == 2, "f16/bf16 operands");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head tiles of whole 64-element atoms");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "key tiles of the wgmma_ss widths");
  static_assert(CONSUMERS == 2 || HEAD_DIM == 64, "three consumers fit their 160 registers with head tile 64 only");
  using Shape = WsShape<CONSUMERS>;
  constexpr int BLOCK_M = Shape::BLOCK_M;
  constexpr int ATOMS = HEAD_DIM / 64;
  constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned smem_raw_at = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned q_tile = (smem_raw_at + 1023u) & ~1023u;  // Q_BYTES
  const unsigned k_tiles = q_tile + Q_BYTES;                // WS_STAGES x KV_BYTES
  const unsigned v_tiles = k_tiles + WS_STAGES * KV_BYTES;  // WS_STAGES x KV_BYTES
  const unsigned bars = v_tiles + WS_STAGES * KV_BYTES;     // 8-byte mbarriers (fused.py shared_bytes)
  const unsigned q_full = bars;
  const unsigned q_empty = bars + 8u;
  auto full_k = [&](int stage) { return bars + 8u * (2 + stage); };
  auto full_v = [&](int stage) { return bars + 8u * (2 + WS_STAGES + stage); };
  auto empty_k = [&](int stage) { return bars + 8u * (2 + 2 * WS_STAGES + stage); };
  auto empty_v = [&](int stage) { return bars + 8u * (2 + 3 * WS_STAGES + stage); };

  const int q_tiles = (q_seq + BLOCK_M - 1) / BLOCK_M;
  const int all_key_tiles = (total_seq + BLOCK_N - 1) / BLOCK_N;
  const long long tiles = (long long)q_tiles * batch * heads;
  const long long units = full_tiles + (tiles - full_tiles) * tail_splits;
  const int wg = threadIdx.x / WARPGROUP_THREADS;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);                       // the producer thread's expect_tx, then the bytes
    mbar_init(q_empty, CONSUMERS * WARPGROUP_THREADS);  // every consumer
    for (int stage = 0; stage < WS_STAGES; ++stage) {
      mbar_init(full_k(stage), 1);
      mbar_init(full_v(stage), 1);
      mbar_init(empty_k(stage), CONSUMERS * WARPGROUP_THREADS);
      mbar_init(empty_v(stage), CONSUMERS * WARPGROUP_THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // K/V tile number `it` over all of this block's query tiles: buffer it % WS_STAGES, its (it / WS_STAGES)-th
  // use; the barriers of that buffer complete once per use, so their phase parity is (it / WS_STAGES) & 1.
  if (wg == 0) {  // ------------------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Shape::PRODUCER_REGISTERS));
    if (threadIdx.x != 0) return;  // one thread issues every load
    prefetch_tensor_map(q_map);
    prefetch_tensor_map(k_map);
    prefetch_tensor_map(v_map);
    int it = 0;
    int done = 0;
    for (long long unit = blockIdx.x; unit < units; unit += gridDim.x, ++done) {
      const WorkUnit w = work_unit<CAUSAL, BLOCK_M, BLOCK_N>(unit, full_tiles, tail_splits, tiles, q_tiles, heads,
                                                             batch, q_seq, total_seq, past_seq, all_key_tiles);
      const TileCoords tc = w.tc;
      if (done > 0) mbar_wait(q_empty, (done - 1) & 1);
      mbar_expect_bytes(q_full, Q_BYTES);
      tma_load_tile<ATOMS>(q_tile, BLOCK_M, q_map, tc.m0, tc.h, tc.b, q_full);
      for (int j = w.first; j < w.first + w.count; ++j, ++it) {
        const int stage = it % WS_STAGES;
        const int use = it / WS_STAGES;
        if (use > 0) mbar_wait(empty_k(stage), (use - 1) & 1);
        mbar_expect_bytes(full_k(stage), KV_BYTES);
        tma_load_tile<ATOMS>(k_tiles + stage * KV_BYTES, BLOCK_N, k_map, j * BLOCK_N, tc.h, tc.b, full_k(stage));
        if (use > 0) mbar_wait(empty_v(stage), (use - 1) & 1);
        mbar_expect_bytes(full_v(stage), KV_BYTES);
        tma_load_tile<ATOMS>(v_tiles + stage * KV_BYTES, BLOCK_N, v_map, j * BLOCK_N, tc.h, tc.b, full_v(stage));
      }
    }
    return;  // (the consumers wait for every load's bytes before the block can end)
  }

  // ------------------------------------------------------------------------------------------------ consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Shape::CONSUMER_REGISTERS));
  const int c = wg - 1;                                     // rows 64 c .. 64 c + 63 of the query tile
  const int warp = (threadIdx.x - WARPGROUP_THREADS) / 32;  // rows 16 warp .. 16 warp + 15
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int tig = lane & 3;
  const unsigned q_rows_at = q_tile + c * WARPGROUP_ROWS * ATOM_BYTES;
  if (c == 0) first_turn_to_consumer_0();
  int it = 0;
  int done = 0;
  for (long long unit = blockIdx.x; unit < units; unit += gridDim.x, ++done) {
    const WorkUnit w = work_unit<CAUSAL, BLOCK_M, BLOCK_N>(unit, full_tiles, tail_splits, tiles, q_tiles, heads,
                                                           batch, q_seq, total_seq, past_seq, all_key_tiles);
    const TileCoords tc = w.tc;
    const int n_tiles = w.count;  // key tiles w.first + j, j < n_tiles
    const int b = tc.b;
    const int h = tc.h;
    const int rows[2] = {tc.m0 + warp * 16 + g, tc.m0 + warp * 16 + g + 8};
    const CausalRows causal_rows = {tc.m0 + c * WARPGROUP_ROWS, {rows[0], rows[1]}, q_seq, past_seq};
    float o_acc[ATOMS][32];
    zero_accumulators(o_acc);
    float row_max[2] = {NEG_INFINITY, NEG_INFINITY};
    float row_sum[2] = {0.0f, 0.0f};
    float alpha[2];
    float s[BLOCK_N / 2];
    unsigned p[BLOCK_N / 16][4];
    mbar_wait(q_full, done & 1);

    {  // key tile 0: S only
      const int stage = it % WS_STAGES;
      mbar_wait(full_k(stage), (it / WS_STAGES) & 1);
      turn_wait(c);
      wgmma_fence();
      issue_s<ELEM, HEAD_DIM, BLOCK_M, BLOCK_N>(s, q_rows_at, k_tiles + stage * KV_BYTES);
      wgmma_commit();
      turn_pass<CONSUMERS>(c);
      wgmma_wait_all();
      fence_operands(s);
      mbar_arrive(empty_k(stage));
      if (n_tiles == 1) mbar_arrive(q_empty);
      softmax_tile<BLOCK_N, CAUSAL>(s, w.first * BLOCK_N, total_seq, tig, scale, causal_rows, row_max, row_sum,
                                    alpha);
      pack_p<ELEM, BLOCK_N>(p, s);
    }
    for (int j = 1; j < n_tiles; ++j) {
      const int stage = (it + j) % WS_STAGES;
      const int prev = (it + j - 1) % WS_STAGES;
      mbar_wait(full_k(stage), ((it + j) / WS_STAGES) & 1);
      mbar_wait(full_v(prev), ((it + j - 1) / WS_STAGES) & 1);
      fence_accumulators(o_acc);
      fence_operands(p);
      turn_wait(c);
      wgmma_fence();
      issue_s<ELEM, HEAD_DIM, BLOCK_M, BLOCK_N>(s, q_rows_at, k_tiles + stage * KV_BYTES);
      wgmma_commit();
      issue_pv<ELEM, ATOMS, BLOCK_N>(o_acc, p, v_tiles + prev * KV_BYTES);
      wgmma_commit();
      turn_pass<CONSUMERS>(c);
      wgmma_wait_all_but_newest();  // S_j is done; the P.V may still run
      fence_operands(s);
      mbar_arrive(empty_k(stage));
      if (j == n_tiles - 1) mbar_arrive(q_empty);  // this consumer's last read of the Q tile
      softmax_tile<BLOCK_N, CAUSAL>(s, (w.first + j) * BLOCK_N, total_seq, tig, scale, causal_rows, row_max,
                                    row_sum, alpha);
      wgmma_wait_all();
      fence_accumulators(o_acc);
      fence_operands(p);
      mbar_arrive(empty_v(prev));
      rescale_rows<ATOMS>(o_acc, alpha);
      pack_p<ELEM, BLOCK_N>(p, s);
    }
    {  // the last tile's P.V
      const int prev = (it + n_tiles - 1) % WS_STAGES;
      mbar_wait(full_v(prev), ((it + n_tiles - 1) / WS_STAGES) & 1);
      fence_accumulators(o_acc);
      fence_operands(p);
      turn_wait(c);
      wgmma_fence();
      issue_pv<ELEM, ATOMS, BLOCK_N>(o_acc, p, v_tiles + prev * KV_BYTES);
      wgmma_commit();
      turn_pass<CONSUMERS>(c);
      wgmma_wait_all();
      fence_accumulators(o_acc);
      mbar_arrive(empty_v(prev));
    }
    it += n_tiles;

    if (w.slot < 0) {
      store_rows<ELEM, ATOMS>(o_acc, row_sum, rows, q_seq, b, h, heads, v_head_size, tig, out_BSD, out_narrow_BSD);
    } else {
      const int row_local[2] = {rows[0] - tc.m0, rows[1] - tc.m0};
      store_partial<ATOMS>(o_acc, row_max, row_sum, row_local, w.slot, BLOCK_M, v_head_size, tig, tail_O, tail_ML);
    }
  }
  if (c == 0) turn_wait(0);  // the last consumer's last pass
}
