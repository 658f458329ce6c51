// Fused attention of the mha_ep pipeline (flash-style): scores, masks, online softmax and P.V in one kernel,
// no (B, N, S, T) matrix in device memory. Two kernels share the semantics below:
//   flash_attention_mma   float16 / bfloat16 operands on the tensor cores (mma.sync m16n8k16, fp32 accumulation)
//   flash_attention_fp32  float32 on the CUDA cores in true fp32 (FFMA; no TF32)
//
// Layout legend: B batch, S query length, T = P + L key length (past + new), P past length, N heads,
// H head size, Hv value head size; HEAD_DIM is max(H, Hv) rounded up to the kernel's tile (zero-filled).
// Q, K and V are read through explicit strides (element (b, h, s, d) at b*stride_b + h*stride_h + s*stride_s + d,
// d contiguous), so one kernel reads BSNH (B, S, N*H), BNSH (B, N, S, H) and the dense (B, N, T, H) K/V buffers
// the layout mover builds. The output is written directly as BSNH (B, S, N*Hv) float32, each value rounded to the
// compute dtype ELEM first (what the three-phase path's context_to_BSD writes).
//
// Semantics (stock ORT 1.31.1 CPU, docs/SEMANTICS.md §3.2-3.7), per query row i and key j, all in float32:
//   1. q, k, v = input + projection bias (bias on load; the host passes null for BNSH key/value, whose bias ORT
//      ignores, and for operands the layout mover already biased), rounded once to ELEM;
//   2. x  = scale * dot(q_i, k_j)   (with FLASH_WITH_KEY_OFFSET, fma(dot, scale, key_offset_BNT[b, h, j]), then
//      + query_offset_BNS[b, h, i] when j >= P: float16 / bfloat16 calls of the backend pass Q and K unbiased and the biases' shares of
//      the score here, so no biased operand is rounded: dispatch.py score_terms; either pointer may be null;
//      flash_attention_fp32 and flash_attention_ws take no offsets, the host passes null)
//   3. x += attention_bias[b|0, h|0, i, j]                   (broadcast: bias_d0 / bias_d1 equal to 1)
//   4. x += FLOAT32_LOWEST     when causal, i < S-1, j > P+i  (the additive mask's value there is SET to lowest,
//                                                             replacing padding; the last row is never causal)
//      x += mask_filter_value  else when key j is padded      (ADDED in float32: a fully padded row stays the
//                                                             softmax of the raw scores at every dtype)
//   5. p  = softmax over j (max-subtracted, float32), out_i = sum_j p_ij v_j.
// Step 5 runs as an online softmax over key tiles (FlashAttention-2): running max m_i, running sum l_i, and the
// accumulator rescaled by exp(m_old - m_new) whenever the max grows; the division by l_i happens once at the end.
// Padding mask (compact, never materialised): MASK_KIND 0 none; 1 key lengths int32 (B,), keep j < len[b];
// 2 keep uint8 (B, T); 3 keep uint8 (B, S, T).
//
// Per key tile, the masks are classified once (TileMask): a tile whose keys are all kept, all in range, before the
// causal frontier of every row, with no attention_bias, takes the plain path (x = scale * q.k folded into the
// exponent); key lengths and (B, T) keep flags are voted per tile, so only a tile that mixes kept and padded keys
// reads flags per element. A step's attention_bias tile is copied into shared memory (cp.async, one buffer) at
// the step's start and waited for after its S tile, before the masks need it.
//
// Work skipped, each exact for finite inputs:
//   causal tiles: key tiles past the causal frontier of every row of a block hold only x + FLOAT32_LOWEST; exp of
//     that minus the row max is exactly 0 once every row max is above CAUSAL_SKIP_MAX_FLOOR, so such tiles are
//     skipped after a block-wide vote says so (only when the host allows it: no attention_bias, whose values could
//     lift those logits); otherwise they are computed like any other tile;
//   padded tiles (tensor-core kernel): on a tile whose keys are all padded (and in range, before every causal
//     frontier, with no attention_bias) x = scale * q.k + mask_filter_value is monotonic in q.k, so the row's
//     largest x comes from its largest q.k; when p = exp(x - m) of that x is 0 for every row of the warp (a padded
//     tile after kept keys with mask_filter_value = -10000, say), every p of the tile is 0 and the max does not
//     move: the warp skips the tile's masking, exponentials and P.V.
//   Where ORT multiplies those zero probabilities by the values (0 * inf = NaN), a non-finite value or logit at a
//   key whose probability is exactly 0 leaves this kernel's row finite: the one difference, for non-finite inputs.
//
// Index rule as in layout.cu: every product that can pass 2^31 is formed in long long by casting its FIRST factor,
// `(long long)b * stride_b`, never `(long long)(b * stride_b)`.
#include "flash_tile.cuh"

// ------------------------------------------------------------------------------------ tensor-core helpers
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// D (16x8 f32) += A (16x16, row) . B (16x8, col), fragments as in the PTX ISA's m16n8k16 layout.
template <typename ELEM> struct Mma;
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo: the lower column of the pair
    return *reinterpret_cast<unsigned*>(&v);
  }
};
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
};

// ---------------------------------------------------------------------------- f16 / bf16: tensor cores
// One block = BLOCK_M query rows of one (b, h); warp w owns rows [16 w, 16 w + 16) of the tile. Per key tile:
//   S (16 x BLOCK_N per warp) = Q . K^T on the tensor cores, Q fragments held in registers for the whole loop;
//   masks and the online-softmax update on the S accumulators in registers;
//   the S accumulators become P's A fragments directly (the m16n8 C layout of two n-tiles is the m16k16 A
//   layout), and O += P . V with V fragments from ldmatrix.trans.
// Thread fragment coordinates: g = lane / 4 owns rows g and g + 8 of its warp's 16; tig = lane % 4 owns the
// column pair 2 tig, 2 tig + 1 of each 8-wide n-tile.
// K and V are double buffered in shared memory: the tiles of step j+1 are copied while step j computes, so a
// plain step has one barrier (its tiles have landed, and every warp is done with the buffers the next copies
// overwrite). An attention_bias tile (BLOCK_M x BLOCK_N float32) has one buffer, filled at the start of its own
// step and waited for (a second barrier) after S = Q.K^T: two buffers would put 83 KB per block and leave two
// blocks per SM instead of three (slower on the bias row; docs/BENCH.md, "Kernel notes").
// ELEM operands (which the host passes without projection bias) and 16-byte-aligned bias rows move with cp.async
// from addresses each thread forms once (AsyncTileCopy, BiasTileCopy): the per-chunk address arithmetic of a
// generic copy loop cost the plain rows much of their time (docs/BENCH.md, "Kernel notes").
// Float32 operands (rounded to ELEM, + bias) go through load_tile.
// Fragments of one k-step are read with ldmatrix before its mma instructions are issued (in-order issue would
// otherwise stall every mma on the ldmatrix just before it).
template <typename ELEM, typename IN, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int FEATURES>
__global__ void __launch_bounds__(BLOCK_M * 2)
    flash_attention_mma(FLASH_KERNEL_PARAMETERS(IN)) {
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_M % 16 == 0 && BLOCK_N % 32 == 0, "tiles are multiples of 16 (keys: 32)");
  static_assert((BLOCK_N & (BLOCK_N - 1)) == 0, "BLOCK_N is a power of two (the row max reduces as a tree)");
  // Each instantiation carries only the mask code its calls need (FlashFeatures; the host passes attention_bias
  // exactly when FEATURES has FLASH_WITH_BIAS and a padding mask exactly when it has FLASH_WITH_PADDING): the tile
  // classification and the bias tiles slow the plain kernel's loop even when compiled in but unused
  // (docs/BENCH.md, "Kernel notes").
  constexpr bool WITH_PADDING = (FEATURES & FLASH_WITH_PADDING) != 0;
  constexpr bool WITH_BIAS = (FEATURES & FLASH_WITH_BIAS) != 0;
  constexpr bool WITH_OFFSET = (FEATURES & FLASH_WITH_KEY_OFFSET) != 0;
  constexpr int THREADS = BLOCK_M * 2;    // one warp per 16 query rows
  constexpr int LD = HEAD_DIM + SMEM_PAD; // shared-memory row stride, elements
  constexpr int D_STEPS = HEAD_DIM / 16;  // k-steps of Q.K^T
  constexpr int S_PAIRS = BLOCK_N / 16;   // pairs of n8 tiles of S (one k16 slice of P each)
  constexpr int O_PAIRS = HEAD_DIM / 16;  // pairs of n8 tiles of O
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ELEM* q_tile = reinterpret_cast<ELEM*>(smem_raw);  // BLOCK_M x LD
  ELEM* k_tiles = q_tile + BLOCK_M * LD;              // 2 x BLOCK_N x LD (tile j in buffer j % 2)
  ELEM* v_tiles = k_tiles + 2 * BLOCK_N * LD;         // 2 x BLOCK_N x LD (tile j in buffer j % 2)
  constexpr int LDB = BLOCK_N + 8;                    // bias tile row stride, floats
  float* bias_tile = reinterpret_cast<float*>(v_tiles + 2 * BLOCK_N * LD);  // BLOCK_M x LDB (attention_bias)

  // Block coordinates: consecutive blocks share (b, h) (K/V reuse in L2); the last query tile, the longest under
  // causal masking, starts first.
  const int q_tiles = (q_seq + BLOCK_M - 1) / BLOCK_M;
  const long long bh = (long long)blockIdx.x / q_tiles;
  const int m0 = (q_tiles - 1 - (int)((long long)blockIdx.x % q_tiles)) * BLOCK_M;
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int tig = lane & 3;

  const IN* q_rows = q + (long long)b * stride_qb + (long long)h * stride_qh + (long long)m0 * stride_qs;
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  const IN* bias_q_h = bias_q == nullptr ? nullptr : bias_q + (long long)h * head_size;
  const IN* bias_k_h = bias_k == nullptr ? nullptr : bias_k + (long long)h * head_size;
  const IN* bias_v_h = bias_v == nullptr ? nullptr : bias_v + (long long)h * v_head_size;
  // FLASH_WITH_KEY_OFFSET: this (b, h)'s key offsets (null: none) and this thread's two rows' query offsets
  // (0 without them; they apply to the new keys j >= P only).
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
  constexpr bool has_bias = WITH_BIAS;
  const float* bias_rows = nullptr;  // attention_bias at (b|0, h|0, row m0, key 0)
  bool bias_vec4 = false;
  if constexpr (has_bias) {
    const int bb = (bias_d0 == 1) ? 0 : b;
    const int bn = (bias_d1 == 1) ? 0 : h;
    bias_rows = attention_bias + (((long long)bb * bias_d1 + bn) * q_seq + m0) * total_seq;
    bias_vec4 = (total_seq % 4 == 0) && (reinterpret_cast<unsigned long long>(attention_bias) % 16 == 0);
  }
  const int bias_at[2] = {(warp * 16 + g) * LDB + tig * 2, (warp * 16 + g + 8) * LDB + tig * 2};

  // K and V of the key tile at n0 into buffer `buffer`: ELEM operands (which the host passes without projection
  // bias) through AsyncTileCopy's precomputed addresses, anything else through load_tile; the attention_bias tile
  // of the key tile at n0 into its one buffer.
  using KvCopy = AsyncTileCopy<ELEM, BLOCK_N, HEAD_DIM, LD, THREADS>;
  constexpr bool ASYNC_KV = same_type<IN, ELEM>::value && KvCopy::APPLIES;
  const KvCopy k_copy(reinterpret_cast<const ELEM*>(k_rows), stride_ks, head_size);
  const KvCopy v_copy(reinterpret_cast<const ELEM*>(v_rows), stride_vs, v_head_size);
  const BiasTileCopy<BLOCK_M, BLOCK_N, LDB, THREADS> bias_copy(bias_rows, total_seq, q_seq - m0);
  auto load_kv = [&](int n0, int buffer) {
    ELEM* k_dst = k_tiles + buffer * BLOCK_N * LD;
    ELEM* v_dst = v_tiles + buffer * BLOCK_N * LD;
    if constexpr (ASYNC_KV) {
      k_copy.copy(k_dst, n0, total_seq - n0);
      v_copy.copy(v_dst, n0, total_seq - n0);
    } else {
      load_tile<ELEM, IN, BLOCK_N, HEAD_DIM, LD, THREADS>(k_dst, k_rows + (long long)n0 * stride_ks, stride_ks,
                                                         total_seq - n0, head_size, bias_k_h);
      load_tile<ELEM, IN, BLOCK_N, HEAD_DIM, LD, THREADS>(v_dst, v_rows + (long long)n0 * stride_vs, stride_vs,
                                                         total_seq - n0, v_head_size, bias_v_h);
    }
  };
  auto load_bias = [&](int n0) {
    if (bias_vec4) {
      bias_copy.copy(bias_tile, n0, total_seq);
    } else {
      load_bias_tile<BLOCK_M, BLOCK_N, LDB, THREADS>(bias_tile, bias_rows, q_seq - m0, total_seq, n0);
    }
  };

  // Step 1 (loads): the Q tile and the first key tile.
  load_tile<ELEM, IN, BLOCK_M, HEAD_DIM, LD, THREADS>(q_tile, q_rows, stride_qs, q_seq - m0, head_size, bias_q_h);
  load_kv(0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  unsigned q_frag[D_STEPS][4];
#pragma unroll
  for (int ks = 0; ks < D_STEPS; ++ks) {
    ldmatrix_x4(q_frag[ks], q_tile + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8);
  }

  float o_acc[O_PAIRS][2][4];  // O columns dp * 16 + hf * 8 + 2 tig (+1), rows g (c = 0, 1) and g + 8 (c = 2, 3)
#pragma unroll
  for (int dp = 0; dp < O_PAIRS; ++dp)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) o_acc[dp][hf][0] = o_acc[dp][hf][1] = o_acc[dp][hf][2] = o_acc[dp][hf][3] = 0.0f;
  float row_max[2] = {NEG_INFINITY, NEG_INFINITY};  // m_i: running max of the logits seen so far
  float row_sum[2] = {0.0f, 0.0f};                  // l_i: this thread's part of sum exp(x - m_i)

  int key_end = causal_key_end(mp, m0, BLOCK_M, skip_causal_tiles);
  for (int n0 = 0, step = 0; n0 < total_seq; n0 += BLOCK_N, ++step) {
    if (n0 >= key_end) {
      // Every remaining key is in the causal future of every row here: skip when no row max is near lowest.
      if (causal_rest_dominated(row_max)) break;
      key_end = total_seq;
    }
    const int buffer = step & 1;
    const ELEM* k_tile = k_tiles + buffer * BLOCK_N * LD;
    const ELEM* v_tile = v_tiles + buffer * BLOCK_N * LD;
    // This step's K, V (and bias) tiles have landed (cp.async, issued one step ago), and every warp is done with
    // the buffers the next tile goes to (they held tile step-1): the one barrier of the step.
    cp_async_wait_all();
    __syncthreads();
    // How the masks touch this key tile: with a mask input, classified before the loads and tensor-core work are
    // issued; the plain instantiation decides after its S tile, where the decision cost least on the H200.
    TileMask tm;
    masked_tile_mask<FEATURES>(tm, mp, b, m0, n0, BLOCK_N, lane, total_seq, causal, past_seq);
    if constexpr (has_bias) {
      load_bias(n0);
      cp_async_commit();
    }
    if (n0 + BLOCK_N < total_seq) load_kv(n0 + BLOCK_N, buffer ^ 1);  // lands while this step computes
    cp_async_commit();

    // Step 2: S = Q . K^T (fp32 accumulators).
    float s_acc[S_PAIRS][2][4];  // keys n0 + np * 16 + hf * 8 + 2 tig (+1), rows as o_acc
#pragma unroll
    for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) s_acc[np][hf][0] = s_acc[np][hf][1] = s_acc[np][hf][2] = s_acc[np][hf][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D_STEPS; ++ks) {
      unsigned kb[S_PAIRS][4];  // B fragments of keys np*16 + 0..7 (kb[np][0..1]) and np*16 + 8..15 (kb[np][2..3])
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np) {
        ldmatrix_x4(kb[np], k_tile + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
      }
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np) {
        Mma<ELEM>::run(s_acc[np][0], q_frag[ks], kb[np][0], kb[np][1]);
        Mma<ELEM>::run(s_acc[np][1], q_frag[ks], kb[np][2], kb[np][3]);
      }
    }

    // Steps 2-4: x = scale * q.k, then attention bias, causal and padding; keys past T are not in the row.
    // A plain tile (no bias or mask term, every key in range, scale > 0) keeps the raw dot products: its x is
    // scale * acc, folded into the exponent of step C, and max(x) = scale * max(acc) (rounding is monotonic).
    // A padded tile (every key padded, in range, before every causal frontier, no attention_bias, scale > 0)
    // keeps the raw dot products until its row maxima say whether any p can be nonzero (see the header); with
    // key offsets (not monotonic in q.k) such a tile computes its x like any other, and is still skipped when
    // its row maxima say every p is 0.
    if constexpr (FEATURES == FLASH_PLAIN) {
      tm.in_range = n0 + BLOCK_N <= total_seq;
      tm.causal = causal && n0 + BLOCK_N - 1 > past_seq + m0;
      tm.padding = TILE_KEEP_ALL;
      tm.plain = tm.in_range && !tm.causal;
    }
    if constexpr (has_bias) {  // this step's bias tile (the older of the two groups in flight) has landed
      cp_async_wait_all_but_newest();
      __syncthreads();
    }
    const TileKind kind = tile_kind<FEATURES>(tm, scale);
    const bool plain_tile = kind.plain;
    const bool padded_tile = kind.padded;         // raw products until the vote
    const bool padded_exact = kind.padded_exact;  // exact x, then the same vote
    // With FLASH_WITH_KEY_OFFSET, x = fma(acc, scale, key offset) (+ query offset for j >= P), the key offsets of
    // this thread's columns read once per tile for both of its rows; a tile with no other term stops there.
    float key_off[S_PAIRS][2][2];
    bool no_terms = tm.plain;
    if constexpr (WITH_OFFSET) {
      no_terms = !has_bias && tm.in_range && !tm.causal && tm.padding == TILE_KEEP_ALL;
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = n0 + np * 16 + hf * 8 + tig * 2 + e;
            key_off[np][hf][e] = (offset_T != nullptr && j < total_seq) ? offset_T[j] : 0.0f;
          }
    }
    if (!plain_tile && !padded_tile) {
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = c >> 1;
            const int j = n0 + np * 16 + hf * 8 + tig * 2 + (c & 1);
            float x;
            if constexpr (WITH_OFFSET) {  // step 2: the projection biases' shares
              x = fmaf(s_acc[np][hf][c], scale, key_off[np][hf][c & 1]);
              if (has_row_offset && j >= past_seq) x += row_offset[r];
            } else {
              x = s_acc[np][hf][c] * scale;
            }
            if (!no_terms) {
              if (j < total_seq) {
                if constexpr (has_bias) x += bias_tile[bias_at[r] + np * 16 + hf * 8 + (c & 1)];  // step 3
                x = (tm.padding == TILE_PAD_MIXED) ? masked_logit_per_key(x, mp, masks[r], rows[r], j)
                                                   : masked_logit(x, mp, masks[r], tm, rows[r], j);
              } else {
                x = NEG_INFINITY;
              }
            }
            s_acc[np][hf][c] = x;
          }
    }

    // Online softmax, step A: the tile's row max (a row lives in the 4 threads of a quad).
    // (a pairwise tree: the maxima of independent n-tile pairs first, so no chain of S_PAIRS dependent steps)
    float pair_max[2][S_PAIRS];
#pragma unroll
    for (int np = 0; np < S_PAIRS; ++np) {
      pair_max[0][np] = fmaxf(fmaxf(s_acc[np][0][0], s_acc[np][0][1]), fmaxf(s_acc[np][1][0], s_acc[np][1][1]));
      pair_max[1][np] = fmaxf(fmaxf(s_acc[np][0][2], s_acc[np][0][3]), fmaxf(s_acc[np][1][2], s_acc[np][1][3]));
    }
#pragma unroll
    for (int width = S_PAIRS / 2; width > 0; width /= 2)
#pragma unroll
      for (int np = 0; np < width; ++np) {
        pair_max[0][np] = fmaxf(pair_max[0][np], pair_max[0][np + width]);
        pair_max[1][np] = fmaxf(pair_max[1][np], pair_max[1][np + width]);
      }
    float tile_max[2] = {pair_max[0][0], pair_max[1][0]};
    float alpha[2];
    float max_used[2];
    // Step B: the new running max m_new and the rescale factor alpha = exp(m_old - m_new) of what was summed so
    // far. A row with no finite logit yet keeps m = -inf; it subtracts 0 instead (exp(-inf) = 0, no NaN).
    quad_max_and_rescale(tile_max, plain_tile, padded_tile, scale, mask_filter_value, row_max, max_used, alpha);
    // A padded tile whose every p would be 0 adds nothing (O, l and m stay): skip to the barrier before step E.
    bool skip_tile = false;
    if (padded_tile || padded_exact) {
      skip_tile = __all_sync(0xffffffffu, tile_adds_nothing(tile_max, max_used));
      if (padded_tile && !skip_tile) {
#pragma unroll
        for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int c = 0; c < 4; ++c) s_acc[np][hf][c] = padded_logit(s_acc[np][hf][c], scale, mask_filter_value);
      }
    }
    // Step C: p = exp(x - m_new); l = alpha * l + sum p (this thread's columns; the quad sums at the end).
    // Plain tiles evaluate exp(scale * acc - m) as 2^(acc * scale*log2e - m*log2e), one FFMA per score, when
    // m*log2e cannot overflow for any row of the warp; everything else takes x - m first.
    const bool fold = plain_tile && __all_sync(0xffffffffu, fabsf(max_used[0]) < 1e30f && fabsf(max_used[1]) < 1e30f);
    float tile_sum[2] = {0.0f, 0.0f};
    if (skip_tile) {
      alpha[0] = alpha[1] = 1.0f;  // (m did not move; a row still at -inf has l = 0 and O = 0 either way)
    } else if (fold) {
      const float scale_log2 = scale * LOG2E;
      const float neg_max_log2[2] = {-max_used[0] * LOG2E, -max_used[1] * LOG2E};
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = c >> 1;
            const float p = fast_exp2(fmaf(s_acc[np][hf][c], scale_log2, neg_max_log2[r]));
            s_acc[np][hf][c] = p;
            tile_sum[r] += p;
          }
    } else {
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = c >> 1;
            const float x = plain_tile ? s_acc[np][hf][c] * scale : s_acc[np][hf][c];
            const float p = fast_exp2((x - max_used[r]) * LOG2E);
            s_acc[np][hf][c] = p;
            tile_sum[r] += p;
          }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + tile_sum[r];
    // Step D: rescale the accumulator O by alpha.
#pragma unroll
    for (int dp = 0; dp < O_PAIRS; ++dp)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        o_acc[dp][hf][0] *= alpha[0];
        o_acc[dp][hf][1] *= alpha[0];
        o_acc[dp][hf][2] *= alpha[1];
        o_acc[dp][hf][3] *= alpha[1];
      }

    if (skip_tile) continue;

    // Step E: O += P . V, P rounded to ELEM (as the three-phase path rounds its probabilities).
#pragma unroll
    // The C fragments of S's n-tile pair kt are P's A fragment of k-slice kt: a0 = (row g, keys 2 tig, +1) of
    // the first n-tile, a1 = row g + 8 of it, a2 / a3 the same of the second n-tile.
    for (int kt = 0; kt < S_PAIRS; ++kt) {
      const unsigned p_frag[4] = {Mma<ELEM>::pack(s_acc[kt][0][0], s_acc[kt][0][1]),
                                  Mma<ELEM>::pack(s_acc[kt][0][2], s_acc[kt][0][3]),
                                  Mma<ELEM>::pack(s_acc[kt][1][0], s_acc[kt][1][1]),
                                  Mma<ELEM>::pack(s_acc[kt][1][2], s_acc[kt][1][3])};
      unsigned vb[O_PAIRS][4];  // B fragments of O columns dp*16 + 0..7 (vb[dp][0..1]) and dp*16 + 8..15
#pragma unroll
      for (int dp = 0; dp < O_PAIRS; ++dp) {
        ldmatrix_x4_trans(vb[dp], v_tile + (kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int dp = 0; dp < O_PAIRS; ++dp) {
        Mma<ELEM>::run(o_acc[dp][0], p_frag, vb[dp][0], vb[dp][1]);
        Mma<ELEM>::run(o_acc[dp][1], p_frag, vb[dp][2], vb[dp][3]);
      }
    }
  }
  cp_async_wait_all();  // a prefetch of a skipped tile may still be in flight

  // Step F: out = O / l (l summed over the quad), rounded to ELEM, stored as float32 BSNH.
  // l = 0 (every logit -inf, mask_filter_value = -inf) gives 0/0 = NaN, as ORT's CPU kernel does.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= q_seq) continue;
    const float inv = 1.0f / row_sum[r];
    const long long out_row = (((long long)b * q_seq + rows[r]) * heads + h) * v_head_size;
    const int c0 = r + r;  // accumulator slots of this row: c0, c0 + 1
#pragma unroll
    for (int dp = 0; dp < O_PAIRS; ++dp)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int d = dp * 16 + hf * 8 + tig * 2;
        if (d >= v_head_size) continue;
        store_pair<ELEM>(out_BSD, out_narrow_BSD, out_row + d, o_acc[dp][hf][c0] * inv, o_acc[dp][hf][c0 + 1] * inv);
      }
  }
}

// ---------------------------------------------------------------------------------------- f32: CUDA cores
// One block = F32_BLOCK_M (64) query rows x F32_BLOCK_N (64) keys per step, as a (64 / ROWS) x TX thread grid
// (ty = tid / TX, tx = tid % TX). Thread (ty, tx) owns rows ROWS ty .. ROWS ty + ROWS - 1 and, of S, keys
// tx + TX jj (jj < 64 / TX: a ROWS x KEYS register tile); of O, the columns (tx + TX dd) * O_VEC + e.
// Launched shape (fused.py FP32_ROWS, FP32_ROW_THREADS): ROWS 4, TX 8, 128 threads, a 4 x 8 tile. Each 16-byte
// float a thread loads from shared memory feeds 2.67 FFMA, against the 4 x 4 tile's 2 (which shared-memory traffic
// held well below the FFMA peak; docs/BENCH.md, "Kernel notes"). STAGES and MIN_BLOCKS come from
// fused.fp32_pipeline.
// Q, K and V sit row-major in shared memory, copied there with cp.async (the same load_tile as the tensor-core
// kernel); the S update reads 4 consecutive d of a Q row and of a K row as 16-byte loads (rows padded by 4 floats:
// the K rows of a quarter warp fall in distinct banks). P goes through shared memory transposed (key-major) for
// the O update. Row max and sum reduce over the TX threads of a row (consecutive lanes).
// Pipeline: with STAGES 2, K and V are double buffered: the tiles of step j+1 load while step j computes. With one
// stage each step's K and V load at its start (more blocks fit an SM).
#define F32_BLOCK_M 64
#define F32_BLOCK_N 64
#define F32_LDT (F32_BLOCK_M + 4)  // row stride of the transposed P tile (floats; 16-byte aligned rows)

template <int HEAD_DIM, int STAGES> struct F32Tiles {
  static constexpr int LDQ = HEAD_DIM + 4;  // Q and K row stride (floats)
  static constexpr int LDV = HEAD_DIM;      // V row stride
  static constexpr int Q_FLOATS = F32_BLOCK_M * LDQ;
  static constexpr int K_FLOATS = F32_BLOCK_N * LDQ;
  static constexpr int V_FLOATS = F32_BLOCK_N * LDV;
  static constexpr int P_FLOATS = F32_BLOCK_N * F32_LDT;
  static constexpr int FLOATS = Q_FLOATS + STAGES * (K_FLOATS + V_FLOATS) + P_FLOATS;  // fused.py shared_bytes
};

template <int ROWS, int TX> struct F32Shape {
  static_assert(ROWS % 4 == 0 && F32_BLOCK_M % ROWS == 0, "rows per thread: a multiple of 4 dividing the tile");
  static_assert(TX == 8 || TX == 16, "a row spans 8 or 16 consecutive lanes");
  static constexpr int THREADS = (F32_BLOCK_M / ROWS) * TX;  // fused.py FP32_THREADS for the launched shape
  static constexpr int KEYS = F32_BLOCK_N / TX;              // keys of S per thread
};

template <typename ELEM, typename IN, int HEAD_DIM, int ROWS, int TX, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(F32Shape<ROWS, TX>::THREADS, MIN_BLOCKS)
    flash_attention_fp32(FLASH_KERNEL_PARAMETERS(IN)) {
  static_assert(same_type<ELEM, float>::value, "the CUDA-core kernel computes in float32");
  static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM is a multiple of 16");
  static_assert(STAGES == 1 || STAGES == 2, "one or two K/V buffers");
  using Tiles = F32Tiles<HEAD_DIM, STAGES>;
  using Shape = F32Shape<ROWS, TX>;
  constexpr int THREADS = Shape::THREADS;
  constexpr int KEYS = Shape::KEYS;
  constexpr int LDQ = Tiles::LDQ;
  constexpr int LDV = Tiles::LDV;
  constexpr int O_VEC = (HEAD_DIM % (4 * TX) == 0) ? 4 : 1;  // O columns per group: 16-byte V loads when they fit
  constexpr int O_GROUPS = HEAD_DIM / (TX * O_VEC);
  constexpr int D_UNROLL = ROWS * KEYS > 16 ? 2 : 4;  // passes of the S update unrolled (registers of larger tiles)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q_s = reinterpret_cast<float*>(smem_raw);  // F32_BLOCK_M x LDQ
  float* k_s = q_s + Tiles::Q_FLOATS;               // STAGES x F32_BLOCK_N x LDQ (tile j in buffer j % STAGES)
  float* v_s = k_s + STAGES * Tiles::K_FLOATS;      // STAGES x F32_BLOCK_N x LDV
  float* p_t = v_s + STAGES * Tiles::V_FLOATS;      // F32_BLOCK_N x F32_LDT (P transposed)

  const int q_tiles = (q_seq + F32_BLOCK_M - 1) / F32_BLOCK_M;
  const long long bh = (long long)blockIdx.x / q_tiles;
  const int m0 = (q_tiles - 1 - (int)((long long)blockIdx.x % q_tiles)) * F32_BLOCK_M;
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const int ty = threadIdx.x / TX;
  const int tx = threadIdx.x % TX;
  const int lane = threadIdx.x % 32;

  const IN* q_rows = q + (long long)b * stride_qb + (long long)h * stride_qh + (long long)m0 * stride_qs;
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  const IN* bias_q_h = bias_q == nullptr ? nullptr : bias_q + (long long)h * head_size;
  const IN* bias_k_h = bias_k == nullptr ? nullptr : bias_k + (long long)h * head_size;
  const IN* bias_v_h = bias_v == nullptr ? nullptr : bias_v + (long long)h * v_head_size;

  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const int row0 = m0 + ty * ROWS;  // this thread's rows: row0 + ii (mask row slices formed where a tile needs them)

  // K and V of the key tile at n0 into buffer `stage` (asynchronous for float32 input without bias).
  auto load_kv = [&](int n0, int stage) {
    load_tile<float, IN, F32_BLOCK_N, HEAD_DIM, LDQ, THREADS>(k_s + stage * Tiles::K_FLOATS,
                                                             k_rows + (long long)n0 * stride_ks, stride_ks,
                                                             total_seq - n0, head_size, bias_k_h);
    load_tile<float, IN, F32_BLOCK_N, HEAD_DIM, LDV, THREADS>(v_s + stage * Tiles::V_FLOATS,
                                                             v_rows + (long long)n0 * stride_vs, stride_vs,
                                                             total_seq - n0, v_head_size, bias_v_h);
  };

  // Step 1 (loads): Q once (+ b_q), and with two stages the first K and V tiles.
  load_tile<float, IN, F32_BLOCK_M, HEAD_DIM, LDQ, THREADS>(q_s, q_rows, stride_qs, q_seq - m0, head_size, bias_q_h);
  if (STAGES == 2) load_kv(0, 0);
  cp_async_commit();

  float o_acc[ROWS][O_GROUPS][O_VEC];
#pragma unroll
  for (int ii = 0; ii < ROWS; ++ii)
#pragma unroll
    for (int dd = 0; dd < O_GROUPS; ++dd)
#pragma unroll
      for (int e = 0; e < O_VEC; ++e) o_acc[ii][dd][e] = 0.0f;
  float row_max[ROWS];  // m_i
  float row_sum[ROWS];  // l_i (this thread's part)
#pragma unroll
  for (int ii = 0; ii < ROWS; ++ii) {
    row_max[ii] = NEG_INFINITY;
    row_sum[ii] = 0.0f;
  }

  int key_end = causal_key_end(mp, m0, F32_BLOCK_M, skip_causal_tiles);
  for (int n0 = 0, step = 0; n0 < total_seq; n0 += F32_BLOCK_N, ++step) {
    if (n0 >= key_end) {
      bool dominated = true;
#pragma unroll
      for (int ii = 0; ii < ROWS; ++ii) dominated = dominated && row_max[ii] > CAUSAL_SKIP_MAX_FLOOR;
      if (__syncthreads_and(dominated)) break;
      key_end = total_seq;
    }
    const int stage = (STAGES == 2) ? (step & 1) : 0;
    if (STAGES == 1) {
      __syncthreads();  // every thread is done with the previous K, V and P tiles
      load_kv(n0, 0);
      cp_async_commit();
    }
    // This step's K and V have landed, and every thread is done with the previous step (its P tile, and with
    // two stages the buffers the next tile goes to).
    cp_async_wait_all();
    __syncthreads();
    if (STAGES == 2) {
      if (n0 + F32_BLOCK_N < total_seq) load_kv(n0 + F32_BLOCK_N, stage ^ 1);
      cp_async_commit();
    }
    const float* k_tile = k_s + stage * Tiles::K_FLOATS;
    const float* v_tile = v_s + stage * Tiles::V_FLOATS;

    // Step 2: the ROWS x KEYS score tile, x = scale * q.k in fp32 FFMA, 4 consecutive d per pass.
    float s[ROWS][KEYS];
#pragma unroll
    for (int ii = 0; ii < ROWS; ++ii)
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) s[ii][jj] = 0.0f;
#pragma unroll D_UNROLL
    for (int d = 0; d < HEAD_DIM; d += 4) {
      float4 qa[ROWS];
      float4 kb[KEYS];
#pragma unroll
      for (int ii = 0; ii < ROWS; ++ii) qa[ii] = *reinterpret_cast<const float4*>(q_s + (ty * ROWS + ii) * LDQ + d);
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) kb[jj] = *reinterpret_cast<const float4*>(k_tile + (tx + TX * jj) * LDQ + d);
#pragma unroll
      for (int ii = 0; ii < ROWS; ++ii)
#pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) {
          s[ii][jj] = fmaf(qa[ii].x, kb[jj].x, s[ii][jj]);
          s[ii][jj] = fmaf(qa[ii].y, kb[jj].y, s[ii][jj]);
          s[ii][jj] = fmaf(qa[ii].z, kb[jj].z, s[ii][jj]);
          s[ii][jj] = fmaf(qa[ii].w, kb[jj].w, s[ii][jj]);
        }
    }
    // Steps 2-4: scale, attention bias, causal and padding; keys past T are not in the row.
    const TileMask tm = tile_mask(mp, b, m0, n0, F32_BLOCK_N, lane);
#pragma unroll
    for (int ii = 0; ii < ROWS; ++ii) {
      if (tm.plain) {
#pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) s[ii][jj] *= scale;
        continue;
      }
      const RowMask mask = row_mask(mp, b, h, row0 + ii);
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) {
        const int j = n0 + tx + TX * jj;
        float x = s[ii][jj] * scale;
        if (j < total_seq) {
          if (mask.bias_T != nullptr) x += mask.bias_T[j];  // step 3
          x = masked_logit(x, mp, mask, tm, row0 + ii, j);
        } else {
          x = NEG_INFINITY;
        }
        s[ii][jj] = x;
      }
    }

    // Online softmax per row (steps A-D as in flash_attention_mma; a row spans the TX tx threads).
#pragma unroll
    for (int ii = 0; ii < ROWS; ++ii) {
      float pair_max[KEYS];  // step A: a pairwise tree over the thread's keys
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) pair_max[jj] = s[ii][jj];
#pragma unroll
      for (int width = 1; width < KEYS; width *= 2)
#pragma unroll
        for (int jj = 0; jj < KEYS; jj += 2 * width) pair_max[jj] = fmaxf(pair_max[jj], pair_max[jj + width]);
      float tile_max = pair_max[0];
#pragma unroll
      for (int offset = TX / 2; offset > 0; offset >>= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      float max_used;
      const float alpha = online_softmax_rescale<false>(row_max[ii], tile_max, max_used);  // step B
      float tile_sum = 0.0f;  // step C
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) {
        s[ii][jj] = exp2f((s[ii][jj] - max_used) * LOG2E);
        tile_sum += s[ii][jj];
      }
      row_sum[ii] = row_sum[ii] * alpha + tile_sum;
#pragma unroll
      for (int dd = 0; dd < O_GROUPS; ++dd)
#pragma unroll
        for (int e = 0; e < O_VEC; ++e) o_acc[ii][dd][e] *= alpha;  // step D
    }
    // P to shared memory, key-major: p_t[key][row].
#pragma unroll
    for (int jj = 0; jj < KEYS; ++jj)
#pragma unroll
      for (int r = 0; r < ROWS; r += 4) {
        *reinterpret_cast<float4*>(p_t + (tx + TX * jj) * F32_LDT + ty * ROWS + r) =
            make_float4(s[r][jj], s[r + 1][jj], s[r + 2][jj], s[r + 3][jj]);
      }
    __syncthreads();

    // Step E: O += P . V in fp32 FFMA.
#pragma unroll 4
    for (int jk = 0; jk < F32_BLOCK_N; ++jk) {
      float pv[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; r += 4) {
        const float4 pa = *reinterpret_cast<const float4*>(p_t + jk * F32_LDT + ty * ROWS + r);
        pv[r] = pa.x;
        pv[r + 1] = pa.y;
        pv[r + 2] = pa.z;
        pv[r + 3] = pa.w;
      }
#pragma unroll
      for (int dd = 0; dd < O_GROUPS; ++dd) {
        float vv[O_VEC];
        if constexpr (O_VEC == 4) {
          const float4 v4 = *reinterpret_cast<const float4*>(v_tile + jk * LDV + (tx + TX * dd) * 4);
          vv[0] = v4.x;
          vv[1] = v4.y;
          vv[2] = v4.z;
          vv[3] = v4.w;
        } else {
          const int at = jk * LDV + tx + TX * dd;  // shared-memory offset
          vv[0] = v_tile[at];
        }
#pragma unroll
        for (int ii = 0; ii < ROWS; ++ii)
#pragma unroll
          for (int e = 0; e < O_VEC; ++e) o_acc[ii][dd][e] = fmaf(pv[ii], vv[e], o_acc[ii][dd][e]);
      }
    }
  }
  cp_async_wait_all();  // a prefetch of a skipped tile may still be in flight

  // Step F: out = O / l (l summed over the row's TX threads); float32 output, no rounding needed.
#pragma unroll
  for (int ii = 0; ii < ROWS; ++ii) {
#pragma unroll
    for (int offset = TX / 2; offset > 0; offset >>= 1) row_sum[ii] += __shfl_xor_sync(0xffffffffu, row_sum[ii], offset);
  }
#pragma unroll
  for (int ii = 0; ii < ROWS; ++ii) {
    const int row = row0 + ii;
    if (row >= q_seq) continue;
    const float inv = 1.0f / row_sum[ii];
    const long long out_row = (((long long)b * q_seq + row) * heads + h) * v_head_size;
#pragma unroll
    for (int dd = 0; dd < O_GROUPS; ++dd)
#pragma unroll
      for (int e = 0; e < O_VEC; ++e) {
        const int d = (tx + TX * dd) * O_VEC + e;
        if (d < v_head_size) out_BSD[out_row + d] = o_acc[ii][dd][e] * inv;
      }
  }
}
