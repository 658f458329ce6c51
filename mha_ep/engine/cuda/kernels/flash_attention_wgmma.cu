// Fused attention on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): flash_attention_mma's semantics, masks
// and online softmax (flash_attention.cu's header states them; flash_common.cuh and flash_tile.cuh hold the shared
// pieces), with the two products issued for a whole warpgroup from shared memory.
//
// Why: on the H200 the mma.sync loop alone (no copies, no exponentials, no barrier) was slower than stock ORT
// CUDA's whole call on the S=T=4096 head-64 f16 row. wgmma reads K and V straight from shared memory (no
// ldmatrix), issues one instruction per 64 x N x 16 product for four warps, and runs asynchronously to the
// issuing threads (docs/BENCH.md, "Kernel notes").
//
// Scope (dispatch.py's wgmma rule): f16/bf16 operands already in the call's dtype (the layout mover's buffers; no
// projection bias to add), HEAD_DIM 64 or 128 (max(H, Hv) zero-padded up to it), every mask of the mma kernel.
//
// Block = BLOCK_M / 64 warpgroups (4 warps, 128 threads each) = BLOCK_M query rows of one (b, h), sharing key
// tiles of BLOCK_N keys. Warp w owns rows 16 w .. 16 w + 15 (thread: rows g, g + 8; g = lane / 4, tig = lane % 4)
// and belongs to warpgroup w / 4, whose wgmma covers rows 64 (w / 4) ..: the wgmma accumulator layout is the m16n8
// C layout of each warp, so S's n8 block i holds keys n0 + 8 i + 2 tig, +1 in s[4 i], s[4 i + 1] (row g) and
// s[4 i + 2], s[4 i + 3] (row g + 8), as flash_attention_mma's s_acc.
//   S (64 x BLOCK_N) = Q . K^T : HEAD_DIM / 16 x wgmma.m64nBLOCK_Nk16, Q and K from shared memory (K-major);
//   O (64 x HEAD_DIM) += P . V : per 16 keys and 64 dims one wgmma.m64n64k16, P from registers (the S
//                                accumulators packed as mma.m16n8k16's A fragments), V from shared memory read
//                                in MN-major order.
// OVERLAP (dispatch.py WgmmaTile.overlap): the P.V of key tile j-1 runs on the tensor cores while the threads do the
// softmax of tile j (see the loop); it needs the registers of one more P, so two-warpgroup blocks without it fit
// two to an SM.
// Shared memory: every tile is stored in 64-element (128-byte) column atoms, [atom][row][128 B], each row in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)); tiles start 1024-byte aligned. Q, two K and
// two V buffers (double buffered: the next tiles are copied with cp.async while a step computes), then one
// float32 attention_bias tile (BLOCK_M x (BLOCK_N + 8)), as flash_attention_mma.
// Descriptors: start >> 4 (bits 0-13), LBO >> 4 (16-29), SBO >> 4 (32-45), 128-byte swizzle (1 << 62).
//   K-major (Q, K): SBO = 1024 (8 rows x 128 B), LBO unused in this swizzle (16); k-step ks reads atom ks / 4,
//                   its start advanced by (ks % 4) x 32 bytes;
//   MN-major (V):   SBO = 1024 (8 key rows), LBO unused (one 64-wide atom per instruction); the 16 keys of
//                   slice kt start 16 rows = 2 KiB into the atom.
// Checked against CUTLASS's make_gmma_desc canonical layouts (K-major B128 ((8,n),2):((8,SBO),1) and MN-major
// B128 ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-byte units) and against flash_attention_mma on the H200.
//
// Differences from flash_attention_mma, both in how work is shared, not in what is computed:
//   the padded-tile skip is voted by the whole block (__syncthreads_and), since a wgmma is issued by all four
//   warps together; and cp.async writes reach wgmma (which reads through the async proxy) after a
//   fence.proxy.async by each writing thread, before the step's barrier.
//
// Index rule as in layout.cu: every product that can pass 2^31 is formed in long long by casting its FIRST factor.
#include "wgmma_common.cuh"

namespace wgmma_detail {

// Blocks per SM the register budget is cut for: as many as fit the shared memory (fused.py shared_bytes), at
// most 3 of one warpgroup or 2 of two; one of two warpgroups when they overlap (their registers: the S tile and
// the previous P live at once would not fit twice; ptxas serializes the wgmma when starved, advisory C7512).
__host__ __device__ constexpr int min_blocks(int head_dim, int block_m, int block_n, int features, bool overlap) {
  const int shared = 1024 + (block_m + 4 * block_n) * head_dim * 2 +
                     ((features & FLASH_WITH_BIAS) ? block_m * (block_n + 8) * 4 : 0);
  const int by_shared = (228 * 1024) / (shared + 1024);
  const int most = block_m == WARPGROUP_ROWS ? 3 : (overlap ? 1 : 2);
  return by_shared > most ? most : by_shared;
}

}  // namespace wgmma_detail

template <typename ELEM, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int FEATURES, bool OVERLAP>
__global__ void __launch_bounds__(BLOCK_M / WARPGROUP_ROWS * WARPGROUP_THREADS,
                                  wgmma_detail::min_blocks(HEAD_DIM, BLOCK_M, BLOCK_N, FEATURES, OVERLAP))
    flash_attention_wgmma(FLASH_KERNEL_PARAMETERS(ELEM)) {
  using namespace wgmma_detail;
  static_assert(sizeof(ELEM) == 2, "f16/bf16 operands");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head tiles of whole 64-element atoms");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "key tiles of the wgmma_ss widths");
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two warpgroups");
  constexpr bool WITH_PADDING = (FEATURES & FLASH_WITH_PADDING) != 0;
  constexpr bool WITH_BIAS = (FEATURES & FLASH_WITH_BIAS) != 0;
  constexpr bool WITH_OFFSET = (FEATURES & FLASH_WITH_KEY_OFFSET) != 0;
  constexpr int THREADS = BLOCK_M / WARPGROUP_ROWS * WARPGROUP_THREADS;
  constexpr int ATOMS = HEAD_DIM / 64;      // 64-element column atoms of a row
  constexpr int D_STEPS = HEAD_DIM / 16;    // k-steps of Q.K^T
  constexpr int S_BLOCKS = BLOCK_N / 8;     // n8 blocks of S
  constexpr int K_SLICES = BLOCK_N / 16;    // k16 slices of P.V
  constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;
  constexpr int LDB = BLOCK_N + 8;          // bias tile row stride, floats
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned smem_raw_at = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned q_tile = (smem_raw_at + 1023u) & ~1023u;  // Q_BYTES
  const unsigned k_tiles = q_tile + Q_BYTES;                // 2 x KV_BYTES (tile j in buffer j % 2)
  const unsigned v_tiles = k_tiles + 2 * KV_BYTES;          // 2 x KV_BYTES
  float* bias_tile = reinterpret_cast<float*>(smem_raw + (v_tiles + 2 * KV_BYTES - smem_raw_at));  // BLOCK_M x LDB

  // Block coordinates as flash_attention_mma: consecutive blocks share (b, h); the last query tile starts first.
  const int q_tiles = (q_seq + BLOCK_M - 1) / BLOCK_M;
  const TileCoords tc = tile_coords(blockIdx.x, q_tiles, heads, BLOCK_M);
  const int b = tc.b;
  const int h = tc.h;
  const int m0 = tc.m0;
  const int warp = threadIdx.x / 32;  // rows 16 warp .. 16 warp + 15 of the tile, in warpgroup warp / 4
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int tig = lane & 3;
  const unsigned q_rows_at = q_tile + (warp / 4) * WARPGROUP_ROWS * ATOM_BYTES;  // this warpgroup's Q rows

  const ELEM* q_rows = q + (long long)b * stride_qb + (long long)h * stride_qh + (long long)m0 * stride_qs;
  const ELEM* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const ELEM* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  // FLASH_WITH_KEY_OFFSET: this (b, h)'s key offsets (null: none) and this thread's two rows' query offsets
  // (0 without them; they apply to the new keys j >= P only).
  const long long bh = (long long)b * heads + h;
  const float* offset_T = (WITH_OFFSET && key_offset_BNT != nullptr) ? key_offset_BNT + bh * total_seq : nullptr;
  float row_offset[2] = {0.0f, 0.0f};
  const bool has_row_offset = WITH_OFFSET && query_offset_BNS != nullptr;

  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const int row_lo = m0 + warp * 16 + g;  // this thread's two query rows
  const int rows[2] = {row_lo, row_lo + 8};
  const RowMask masks[2] = {row_mask(mp, b, h, rows[0]), row_mask(mp, b, h, rows[1])};
  if (has_row_offset) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_offset[r] = query_offset_BNS[bh * q_seq + min(rows[r], q_seq - 1)];
  }
  const float* bias_rows = nullptr;  // attention_bias at (b|0, h|0, row m0, key 0)
  bool bias_vec4 = false;
  if constexpr (WITH_BIAS) {
    const int bb = (bias_d0 == 1) ? 0 : b;
    const int bn = (bias_d1 == 1) ? 0 : h;
    bias_rows = attention_bias + (((long long)bb * bias_d1 + bn) * q_seq + m0) * total_seq;
    bias_vec4 = (total_seq % 4 == 0) && (reinterpret_cast<unsigned long long>(attention_bias) % 16 == 0);
  }
  const int bias_at[2] = {(warp * 16 + g) * LDB + tig * 2, (warp * 16 + g + 8) * LDB + tig * 2};

  const SwizzledTileCopy<ELEM, BLOCK_M, HEAD_DIM, THREADS> q_copy(q_rows, stride_qs, head_size);
  const SwizzledTileCopy<ELEM, BLOCK_N, HEAD_DIM, THREADS> k_copy(k_rows, stride_ks, head_size);
  const SwizzledTileCopy<ELEM, BLOCK_N, HEAD_DIM, THREADS> v_copy(v_rows, stride_vs, v_head_size);
  const BiasTileCopy<BLOCK_M, BLOCK_N, LDB, THREADS> bias_copy(bias_rows, total_seq, q_seq - m0);
  auto load_bias = [&](int n0) {
    if (bias_vec4) {
      bias_copy.copy(bias_tile, n0, total_seq);
    } else {
      load_bias_tile<BLOCK_M, BLOCK_N, LDB, THREADS>(bias_tile, bias_rows, q_seq - m0, total_seq, n0);
    }
  };

  // Step 1 (loads): the Q tile and the first K tile; with OVERLAP, V tile j is copied one step after K tile j
  // (see the loop) and V buffer 1 is zero-filled for the first step's P.V (which has P = 0); else V tile 0.
  q_copy.copy(q_tile, 0, q_seq - m0);
  k_copy.copy(k_tiles, 0, total_seq);
  if constexpr (OVERLAP) {
    v_copy.copy(v_tiles + KV_BYTES, 0, 0);
  } else {
    v_copy.copy(v_tiles, 0, total_seq);
  }
  cp_async_commit();

  float o_acc[ATOMS][32];  // O dims 64 a + 8 i + 2 tig (+1): [a][4 i], [a][4 i + 1] row g; [a][4 i + 2, + 3] row g + 8
  zero_accumulators(o_acc);
  float row_max[2] = {NEG_INFINITY, NEG_INFINITY};  // m_i: running max of the logits seen so far
  float row_sum[2] = {0.0f, 0.0f};                  // l_i: this thread's part of sum exp(x - m_i)
  // With OVERLAP: P of the previous key tile (the A fragments of its P.V; zeros before the first, with the
  // zeroed V buffer 1) and the V buffer of that tile. Every step issues a P.V, so no wgmma sits on a path the
  // compiler would have to treat as divergent (ptxas then serializes every wgmma of the kernel: advisory C7518).
  // (Without OVERLAP each step's P lives in that step only.)
  unsigned p_frag[K_SLICES][4];
#pragma unroll
  for (int kt = 0; kt < K_SLICES; ++kt) p_frag[kt][0] = p_frag[kt][1] = p_frag[kt][2] = p_frag[kt][3] = 0u;
  int pv_buffer = 1;

  // O += P . V from V buffer `v_buffer`, asynchronously (P's registers and O stay untouched until its wait).
  auto issue_pv = [&](unsigned (&p)[K_SLICES][4], int v_buffer) {
    fence_accumulators(o_acc);
    fence_operands(p);
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < K_SLICES; ++kt)
#pragma unroll
      for (int a = 0; a < ATOMS; ++a) {
        const unsigned at = v_tiles + v_buffer * KV_BYTES + a * BLOCK_N * ATOM_BYTES + kt * 16 * ATOM_BYTES;
        Ops<ELEM, BLOCK_N>::o(o_acc[a], p[kt], swizzled_desc(at));
      }
    wgmma_commit();
  };

  // With OVERLAP the loop is software-pipelined across key tiles (FlashAttention-3's intra-warpgroup overlap):
  // step j issues S_j = Q . K_j^T and then O += P_{j-1} . V_{j-1}, and computes the masks and softmax of S_j
  // while that P.V runs on the tensor cores; O is rescaled by step j's alpha once that P.V has completed. So step
  // j reads K tile j and V tile j-1, and copies K tile j+1 and V tile j into the buffers that K tile j-1 and V
  // tile j-2 left (both done: their wgmma completed before this step's barrier). Without OVERLAP (fewer live
  // registers: two blocks of two warpgroups fit an SM) step j runs S_j, its softmax and O += P_j . V_j in turn,
  // and copies K and V tile j+1.
  int key_end = causal_key_end(mp, m0, BLOCK_M, skip_causal_tiles);
  for (int n0 = 0, step = 0; n0 < total_seq; n0 += BLOCK_N, ++step) {
    if (n0 >= key_end) {
      // Every remaining key is in the causal future of every row here: skip when no row max is near lowest.
      if (causal_rest_dominated(row_max)) break;
      key_end = total_seq;
    }
    const int buffer = step & 1;
    // K tile j and V tile j-1 have landed and are visible to the async proxy, and every warpgroup's wgmma of the
    // previous step has completed (its waits below), so the copies may overwrite the buffers they read: the one
    // barrier of a plain step.
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    TileMask tm;
    masked_tile_mask<FEATURES>(tm, mp, b, m0, n0, BLOCK_N, lane, total_seq, causal, past_seq);
    if constexpr (WITH_BIAS) {
      load_bias(n0);
      cp_async_commit();
    }
    // (One condition per branch: with the K and V copies of the non-overlapped step under separate ones, ptxas
    // precomputed the mask predicates of every step, a large loss on the head-128 row; docs/BENCH.md.)
    if constexpr (OVERLAP) {
      if (n0 + BLOCK_N < total_seq) k_copy.copy(k_tiles + (buffer ^ 1) * KV_BYTES, n0 + BLOCK_N, total_seq - n0 - BLOCK_N);
      v_copy.copy(v_tiles + buffer * KV_BYTES, n0, total_seq - n0);
    } else if (n0 + BLOCK_N < total_seq) {
      k_copy.copy(k_tiles + (buffer ^ 1) * KV_BYTES, n0 + BLOCK_N, total_seq - n0 - BLOCK_N);
      v_copy.copy(v_tiles + (buffer ^ 1) * KV_BYTES, n0 + BLOCK_N, total_seq - n0 - BLOCK_N);
    }
    cp_async_commit();

    // Step 2: S = Q . K^T (raw dot products, fp32 accumulators), then the previous tile's P.V behind it.
    float s[S_BLOCKS * 4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D_STEPS; ++ks) {
      const unsigned k_at = (ks % 4) * 32;  // 16 elements into atom ks / 4
      Ops<ELEM, BLOCK_N>::s(s, swizzled_desc(q_rows_at + (ks / 4) * BLOCK_M * ATOM_BYTES + k_at),
                            swizzled_desc(k_tiles + buffer * KV_BYTES + (ks / 4) * BLOCK_N * ATOM_BYTES + k_at),
                            ks > 0);
    }
    wgmma_commit();
    if constexpr (OVERLAP) {
      issue_pv(p_frag, pv_buffer);
      wgmma_wait_all_but_newest();  // S is done; the P.V may still run
    } else {
      wgmma_wait_all();
    }
    fence_operands(s);

    // Steps 2-4 as flash_attention_mma: plain tiles keep the raw dot products (scale folded into the exponent),
    // padded tiles keep them until their row maxima say whether any p can be nonzero.
    if constexpr (FEATURES == FLASH_PLAIN) {
      tm.in_range = n0 + BLOCK_N <= total_seq;
      tm.causal = causal && n0 + BLOCK_N - 1 > past_seq + m0;
      tm.padding = TILE_KEEP_ALL;
      tm.plain = tm.in_range && !tm.causal;
    }
    if constexpr (WITH_BIAS) {  // this step's bias tile (the older of the two groups in flight) has landed
      cp_async_wait_all_but_newest();
      __syncthreads();
    }
    const TileKind kind = tile_kind<FEATURES>(tm, scale);
    const bool plain_tile = kind.plain;
    const bool padded_tile = kind.padded;         // raw products until the vote
    const bool padded_exact = kind.padded_exact;  // exact x (key offsets), same vote
    // With FLASH_WITH_KEY_OFFSET, x = fma(acc, scale, key offset) (+ query offset for j >= P), the key offsets of
    // this thread's columns read once per tile for both of its rows; a tile with no other term stops there.
    float key_off[S_BLOCKS][2];
    bool no_terms = tm.plain;
    if constexpr (WITH_OFFSET) {
      no_terms = !WITH_BIAS && tm.in_range && !tm.causal && tm.padding == TILE_KEEP_ALL;
#pragma unroll
      for (int i = 0; i < S_BLOCKS; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n0 + i * 8 + tig * 2 + e;
          key_off[i][e] = (offset_T != nullptr && j < total_seq) ? offset_T[j] : 0.0f;
        }
    }
    if (!plain_tile && !padded_tile) {
#pragma unroll
      for (int i = 0; i < S_BLOCKS; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = c >> 1;
          const int j = n0 + i * 8 + tig * 2 + (c & 1);
          float x;
          if constexpr (WITH_OFFSET) {  // step 2: the projection biases' shares
            x = fmaf(s[4 * i + c], scale, key_off[i][c & 1]);
            if (has_row_offset && j >= past_seq) x += row_offset[r];
          } else {
            x = s[4 * i + c] * scale;
          }
          if (!no_terms) {
            if (j < total_seq) {
              if constexpr (WITH_BIAS) x += bias_tile[bias_at[r] + i * 8 + (c & 1)];  // step 3
              x = (tm.padding == TILE_PAD_MIXED) ? masked_logit_per_key(x, mp, masks[r], rows[r], j)
                                                 : masked_logit(x, mp, masks[r], tm, rows[r], j);
            } else {
              x = NEG_INFINITY;
            }
          }
          s[4 * i + c] = x;
        }
    }

    // Online softmax, steps A and B: the tile's row max (four independent chains over the n8 blocks, then the
    // quad), m_new and alpha.
    float part_max[2][4];
    partial_row_max<S_BLOCKS>(s, part_max);
    float tile_max[2] = {fmaxf(fmaxf(part_max[0][0], part_max[0][1]), fmaxf(part_max[0][2], part_max[0][3])),
                         fmaxf(fmaxf(part_max[1][0], part_max[1][1]), fmaxf(part_max[1][2], part_max[1][3]))};
    float alpha[2];
    float max_used[2];
    quad_max_and_rescale(tile_max, plain_tile, padded_tile, scale, mask_filter_value, row_max, max_used, alpha);
    // A padded tile whose every p would be 0 adds nothing (O, l and m stay). The vote is block-wide: the P.V
    // wgmma is issued by all four warps of a warpgroup or by none.
    bool skip_tile = false;
    if (padded_tile || padded_exact) {
      // (m did not move; a row still at -inf has l = 0 and O = 0)
      skip_tile = __syncthreads_and(tile_adds_nothing(tile_max, max_used));
      if (padded_tile && !skip_tile) {
#pragma unroll
        for (int i = 0; i < S_BLOCKS * 4; ++i) s[i] = padded_logit(s[i], scale, mask_filter_value);
      }
    }
    float tile_sum[2] = {0.0f, 0.0f};
    if (skip_tile) {
      alpha[0] = alpha[1] = 1.0f;
    } else {
      // Step C: p = exp(x - m_new); l = alpha * l + sum p (this thread's columns; the quad sums at the end).
      const bool fold =
          plain_tile && __all_sync(0xffffffffu, fabsf(max_used[0]) < 1e30f && fabsf(max_used[1]) < 1e30f);
      if (fold) {
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
          const float x = plain_tile ? s[i] * scale : s[i];
          const float p = fast_exp2((x - max_used[r]) * LOG2E);
          s[i] = p;
          tile_sum[r] += p;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + tile_sum[r];

    if constexpr (OVERLAP) {  // the previous tile's P.V has completed: O and P's registers are free again
      wgmma_wait_all();
      fence_accumulators(o_acc);
      fence_operands(p_frag);
    }
    // Step D: rescale the accumulator O by alpha.
    rescale_rows<ATOMS>(o_acc, alpha);
    // Step E (with OVERLAP issued by the next step, or after the loop): O += P . V with P rounded to ELEM (zero
    // for a skipped tile).
    if constexpr (OVERLAP) {
      pack_p<ELEM, BLOCK_N>(p_frag, s, skip_tile);
      pv_buffer = buffer;
    } else {
      unsigned p_now[K_SLICES][4];
      pack_p<ELEM, BLOCK_N>(p_now, s, skip_tile);
      issue_pv(p_now, buffer);
      wgmma_wait_all();
      fence_accumulators(o_acc);
    }
  }
  if constexpr (OVERLAP) {  // the last tile's P.V (its V tile was copied in its own step)
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    issue_pv(p_frag, pv_buffer);
    wgmma_wait_all();
    fence_accumulators(o_acc);
  }
  cp_async_wait_all();  // (without OVERLAP) a prefetch of a skipped causal tile may still be in flight

  // Step F: out = O / l, rounded to ELEM, stored as float32 BSNH (wgmma_common.cuh store_rows).
  store_rows<ELEM, ATOMS>(o_acc, row_sum, rows, q_seq, b, h, heads, v_head_size, tig, out_BSD, out_narrow_BSD);
}
