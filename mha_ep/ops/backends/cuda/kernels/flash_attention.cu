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
// Semantics (stock ORT 1.31.1 CPU, semantics doc 3.2-3.7), per query row i and key j, all in float32:
//   1. q, k, v = input + projection bias (bias on load; the host passes null for BNSH key/value, whose bias ORT
//      ignores, and for operands the layout mover already biased), rounded once to ELEM;
//   2. x  = scale * dot(q_i, k_j)
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
// Causal tile skipping: key tiles past the causal frontier of every row of a block hold only x + FLOAT32_LOWEST;
// exp of that minus the row max is exactly 0 once every row max is above CAUSAL_SKIP_MAX_FLOOR, so such tiles are
// skipped only after a block-wide vote says so (and only when the host allows it: no attention_bias, whose values
// could lift those logits). Otherwise they are computed like any other tile.
//
// Index rule as in layout.cu: every product that can pass 2^31 is formed in long long by casting its FIRST factor,
// `(long long)b * stride_b`, never `(long long)(b * stride_b)`.
#include "common.cuh"

#define LOG2E 1.4426950408889634f
#ifndef FLOAT32_LOWEST
#define FLOAT32_LOWEST (-3.402823466e+38f)
#endif
#ifndef NEG_INFINITY
#define NEG_INFINITY __int_as_float(static_cast<int>(0xff800000u))  // NVRTC has no <cmath> INFINITY
#endif
#define CAUSAL_SKIP_MAX_FLOOR (-1.0e38f)  // row max above this: exp(x + FLOAT32_LOWEST - max) underflows to 0
#define SMEM_PAD 8                        // elements added to each shared-memory row (ldmatrix bank spread)
#define LOAD_CHUNK 8                      // elements per vector load (16 bytes of f16/bf16, 32 bytes of f32)

enum FlashMaskKind { FLASH_MASK_NONE = 0, FLASH_MASK_KEY_LENGTHS = 1, FLASH_MASK_KEYS_BT = 2, FLASH_MASK_KEYS_BST = 3 };

template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// ------------------------------------------------------------------------------------------------ the masks
// Per-call mask inputs (kernel arguments gathered once).
struct MaskParams {
  const float* attention_bias;  // (bias_d0, bias_d1, S, T) float32 or null
  int bias_d0;                  // 1 or B
  int bias_d1;                  // 1 or N
  int mask_kind;                // FlashMaskKind
  const int* key_lengths_B;     // FLASH_MASK_KEY_LENGTHS
  const unsigned char* keep;    // FLASH_MASK_KEYS_BT / _BST, nonzero = keep
  float mask_filter_value;
  int causal;                   // unidirectional and S > 1
  int q_seq;
  int total_seq;
  int past_seq;
};

// One query row's slices of the mask inputs.
struct RowMask {
  const float* bias_T;          // attention_bias row or null
  const unsigned char* keep_T;  // keep-flag row or null
  int key_length;               // keys j >= key_length are padded (total_seq when there are no lengths)
};

__device__ __forceinline__ RowMask row_mask(const MaskParams& p, int b, int h, int row) {
  const int i = min(row, p.q_seq - 1);  // rows past S (a partial last tile) read row S-1; they are never stored
  RowMask m{nullptr, nullptr, p.total_seq};
  if (p.attention_bias != nullptr) {
    const int bb = (p.bias_d0 == 1) ? 0 : b;
    const int bn = (p.bias_d1 == 1) ? 0 : h;
    m.bias_T = p.attention_bias + (((long long)bb * p.bias_d1 + bn) * p.q_seq + i) * p.total_seq;
  }
  if (p.mask_kind == FLASH_MASK_KEYS_BT) m.keep_T = p.keep + (long long)b * p.total_seq;
  if (p.mask_kind == FLASH_MASK_KEYS_BST) m.keep_T = p.keep + ((long long)b * p.q_seq + i) * p.total_seq;
  if (p.mask_kind == FLASH_MASK_KEY_LENGTHS) m.key_length = p.key_lengths_B[b];
  return m;
}

// Steps 3-4 for one in-range score x = scale * q.k of row i, key j.
__device__ __forceinline__ float masked_logit(float x, const MaskParams& p, const RowMask& m, int i, int j) {
  if (m.bias_T != nullptr) x += m.bias_T[j];                                          // step 3
  const bool future = p.causal && i < p.q_seq - 1 && j > p.past_seq + i;
  const bool padded = (j >= m.key_length) || (m.keep_T != nullptr && m.keep_T[j] == 0);
  if (future) {
    x += FLOAT32_LOWEST;                                                              // step 4, causal
  } else if (padded) {
    x += p.mask_filter_value;                                                         // step 4, padding
  }
  return x;
}

// Does any score of key tile [n0, n0 + BLOCK_N) of query rows [m0, m0 + BLOCK_M) need steps 3-4 or the
// out-of-range fill? (Otherwise the tile takes the plain x = scale * q.k path.)
__device__ __forceinline__ bool tile_needs_mask(const MaskParams& p, int m0, int n0, int block_n) {
  if (p.attention_bias != nullptr || p.mask_kind != FLASH_MASK_NONE) return true;
  if (n0 + block_n > p.total_seq) return true;
  return p.causal && n0 + block_n - 1 > p.past_seq + m0;
}

// First key index that no row of the block [m0, m0 + block_m) may attend (causal frontier), or total_seq.
__device__ __forceinline__ int causal_key_end(const MaskParams& p, int m0, int block_m, int skip_causal_tiles) {
  const bool holds_last_row = m0 + block_m >= p.q_seq;  // row S-1 sees every key
  if (!p.causal || !skip_causal_tiles || holds_last_row) return p.total_seq;
  return min(p.total_seq, p.past_seq + m0 + block_m);
}

// -------------------------------------------------------------------------------------- global -> shared
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Wait until at most the newest committed group is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::); }

// LOAD_CHUNK elements of `src` (+ bias), rounded to ELEM, into registers (zeros when !valid).
template <typename ELEM, typename IN>
__device__ __forceinline__ void load_chunk(ELEM (&out)[LOAD_CHUNK], const IN* src, const float* bias, bool valid) {
  IN raw[LOAD_CHUNK];
  if (valid) {
#pragma unroll
    for (int piece = 0; piece < (int)(LOAD_CHUNK * sizeof(IN) / 16); ++piece) {
      reinterpret_cast<uint4*>(raw)[piece] = reinterpret_cast<const uint4*>(src)[piece];
    }
  }
#pragma unroll
  for (int e = 0; e < LOAD_CHUNK; ++e) {
    float x = valid ? to_float<IN>(raw[e]) : 0.0f;
    if (valid && bias != nullptr) x += bias[e];  // step 1: float32 sum, one rounding to ELEM below
    out[e] = from_float<ELEM>(x);
  }
}

// A tile of ROWS sequence rows x HEAD_DIM into shared memory `tile` (row stride LD elements):
//   rows >= rows_valid and dims >= dim are zero-filled (they add nothing to a dot product or to P.V);
//   ELEM input without bias goes through cp.async (asynchronous; the caller commits and waits);
//   anything else (float32 input of an f16/bf16 call, or a bias to add) goes through registers (synchronous).
// `src` points at (row 0, d 0); `bias_d` at the bias of this head (dim floats) or null. dim % LOAD_CHUNK == 0.
template <typename ELEM, typename IN, int ROWS, int HEAD_DIM, int LD, int THREADS>
__device__ __forceinline__ void load_tile(ELEM* tile, const IN* src, long long stride_s, int rows_valid, int dim,
                                          const float* bias_d) {
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / LOAD_CHUNK;
  for (int c = threadIdx.x; c < ROWS * CHUNKS_PER_ROW; c += THREADS) {
    const int r = c / CHUNKS_PER_ROW;
    const int d0 = (c % CHUNKS_PER_ROW) * LOAD_CHUNK;
    const bool valid = r < rows_valid && d0 < dim;
    const IN* g = valid ? src + (long long)r * stride_s + d0 : src;
    ELEM* dst = tile + r * LD + d0;
    if constexpr (same_type<IN, ELEM>::value) {
      if (bias_d == nullptr) {
#pragma unroll
        for (int piece = 0; piece < (int)(LOAD_CHUNK * sizeof(ELEM) / 16); ++piece) {
          cp_async_16(reinterpret_cast<uint4*>(dst) + piece, reinterpret_cast<const uint4*>(g) + piece, valid);
        }
        continue;
      }
    }
    ELEM chunk[LOAD_CHUNK];
    load_chunk<ELEM, IN>(chunk, g, (valid && bias_d != nullptr) ? bias_d + d0 : nullptr, valid);
#pragma unroll
    for (int piece = 0; piece < (int)(LOAD_CHUNK * sizeof(ELEM) / 16); ++piece) {
      reinterpret_cast<uint4*>(dst)[piece] = reinterpret_cast<const uint4*>(chunk)[piece];
    }
  }
}

// 2^x on the special-function unit alone (ex2.approx, about 2 ulp; flushes results below 2^-126 to 0, which
// changes no softmax sum: every term is <= 1 and the row max contributes exactly 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

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
// K and V move with cp.async (when the operand is already ELEM without bias) into shared memory: K double
// buffered, so K of tile j+1 loads during the whole of step j; V of tile j loads while S of tile j is computed.
// Fragments of one k-step are read with ldmatrix before its mma instructions are issued (in-order issue would
// otherwise stall every mma on the ldmatrix just before it).
template <typename ELEM, typename IN, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(BLOCK_M * 2)
    flash_attention_mma(const IN* __restrict__ q, long long stride_qb, long long stride_qh, long long stride_qs,
                        const float* __restrict__ bias_q, const IN* __restrict__ k, long long stride_kb,
                        long long stride_kh, long long stride_ks, const float* __restrict__ bias_k,
                        const IN* __restrict__ v, long long stride_vb, long long stride_vh, long long stride_vs,
                        const float* __restrict__ bias_v, const float* __restrict__ attention_bias, int bias_d0,
                        int bias_d1, int mask_kind, const int* __restrict__ key_lengths_B,
                        const unsigned char* __restrict__ keep, float mask_filter_value, int causal,
                        int skip_causal_tiles, float scale, int batch, int heads, int q_seq, int total_seq,
                        int past_seq, int head_size, int v_head_size, float* __restrict__ out_BSD) {
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "tiles are multiples of 16");
  constexpr int THREADS = BLOCK_M * 2;    // one warp per 16 query rows
  constexpr int LD = HEAD_DIM + SMEM_PAD; // shared-memory row stride, elements
  constexpr int D_STEPS = HEAD_DIM / 16;  // k-steps of Q.K^T
  constexpr int S_PAIRS = BLOCK_N / 16;   // pairs of n8 tiles of S (one k16 slice of P each)
  constexpr int O_PAIRS = HEAD_DIM / 16;  // pairs of n8 tiles of O
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ELEM* q_tile = reinterpret_cast<ELEM*>(smem_raw);  // BLOCK_M x LD
  ELEM* k_tiles = q_tile + BLOCK_M * LD;              // 2 x BLOCK_N x LD (tile j in buffer j % 2)
  ELEM* v_tile = k_tiles + 2 * BLOCK_N * LD;          // BLOCK_N x LD

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
  const float* bias_q_h = bias_q == nullptr ? nullptr : bias_q + (long long)h * head_size;
  const float* bias_k_h = bias_k == nullptr ? nullptr : bias_k + (long long)h * head_size;
  const float* bias_v_h = bias_v == nullptr ? nullptr : bias_v + (long long)h * v_head_size;

  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const int row_lo = m0 + warp * 16 + g;  // this thread's two query rows
  const int rows[2] = {row_lo, row_lo + 8};
  const RowMask masks[2] = {row_mask(mp, b, h, rows[0]), row_mask(mp, b, h, rows[1])};

  // Step 1 (loads): the Q tile and the first K tile.
  load_tile<ELEM, IN, BLOCK_M, HEAD_DIM, LD, THREADS>(q_tile, q_rows, stride_qs, q_seq - m0, head_size, bias_q_h);
  load_tile<ELEM, IN, BLOCK_N, HEAD_DIM, LD, THREADS>(k_tiles, k_rows, stride_ks, total_seq, head_size, bias_k_h);
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
      const bool dominated = row_max[0] > CAUSAL_SKIP_MAX_FLOOR && row_max[1] > CAUSAL_SKIP_MAX_FLOOR;
      if (__syncthreads_and(dominated)) break;
      key_end = total_seq;
    }
    const ELEM* k_tile = k_tiles + (step & 1) * BLOCK_N * LD;
    // K of this tile has landed (cp.async), and every warp is done with the previous V tile and with the K buffer
    // the next tile goes to (it held tile step-1).
    cp_async_wait_all();
    __syncthreads();
    load_tile<ELEM, IN, BLOCK_N, HEAD_DIM, LD, THREADS>(v_tile, v_rows + (long long)n0 * stride_vs, stride_vs,
                                                       total_seq - n0, v_head_size, bias_v_h);
    cp_async_commit();
    if (n0 + BLOCK_N < total_seq) {
      load_tile<ELEM, IN, BLOCK_N, HEAD_DIM, LD, THREADS>(k_tiles + ((step + 1) & 1) * BLOCK_N * LD,
                                                         k_rows + (long long)(n0 + BLOCK_N) * stride_ks, stride_ks,
                                                         total_seq - n0 - BLOCK_N, head_size, bias_k_h);
    }
    cp_async_commit();  // (an empty group after the last tile keeps the group count uniform)

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
    const bool masked_tile = tile_needs_mask(mp, m0, n0, BLOCK_N);
    const bool plain_tile = !masked_tile && scale > 0.0f;
    if (!plain_tile) {
#pragma unroll
      for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int r = c >> 1;
            const int j = n0 + np * 16 + hf * 8 + tig * 2 + (c & 1);
            float x = s_acc[np][hf][c] * scale;
            if (masked_tile) x = (j < total_seq) ? masked_logit(x, mp, masks[r], rows[r], j) : NEG_INFINITY;
            s_acc[np][hf][c] = x;
          }
    }

    // Online softmax, step A: the tile's row max (a row lives in the 4 threads of a quad).
    float tile_max[2] = {NEG_INFINITY, NEG_INFINITY};
#pragma unroll
    for (int np = 0; np < S_PAIRS; ++np)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s_acc[np][hf][0], s_acc[np][hf][1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s_acc[np][hf][2], s_acc[np][hf][3]));
      }
    float alpha[2];
    float max_used[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      if (plain_tile) tile_max[r] *= scale;  // max of x = scale * acc
      // Step B: the new running max m_new and the rescale factor alpha = exp(m_old - m_new) of what was summed
      // so far. A row with no finite logit yet keeps m = -inf; it subtracts 0 instead (exp(-inf) = 0, no NaN).
      const float m_new = fmaxf(row_max[r], tile_max[r]);
      max_used[r] = (m_new == NEG_INFINITY) ? 0.0f : m_new;
      alpha[r] = fast_exp2((row_max[r] - max_used[r]) * LOG2E);
      row_max[r] = m_new;
    }
    // Step C: p = exp(x - m_new); l = alpha * l + sum p (this thread's columns; the quad sums at the end).
    // Plain tiles evaluate exp(scale * acc - m) as 2^(acc * scale*log2e - m*log2e), one FFMA per score, when
    // m*log2e cannot overflow for any row of the warp; everything else takes x - m first.
    const bool fold = plain_tile && __all_sync(0xffffffffu, fabsf(max_used[0]) < 1e30f && fabsf(max_used[1]) < 1e30f);
    float tile_sum[2] = {0.0f, 0.0f};
    if (fold) {
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

    // V of this tile has landed (the next K tile, committed after it, may still be in flight).
    cp_async_wait_all_but_newest();
    __syncthreads();

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
        const float2 pair = make_float2(round_to<ELEM>(o_acc[dp][hf][c0] * inv), round_to<ELEM>(o_acc[dp][hf][c0 + 1] * inv));
        *reinterpret_cast<float2*>(out_BSD + out_row + d) = pair;
      }
  }
}

// ---------------------------------------------------------------------------------------- f32: CUDA cores
// One block of 256 threads = F32_BLOCK_M (64) query rows x F32_BLOCK_N (64) keys per step, as a 16 x 16 thread
// grid (ty = tid / 16, tx = tid % 16). Thread (ty, tx) owns rows 4 ty .. 4 ty + 3 and, of S, keys 4 tx .. 4 tx + 3
// (a 4 x 4 register tile); of O, the columns (tx + 16 dd) * O_VEC + e. Q and K sit transposed in shared memory
// (d-major) so both 4-vectors of the S update are single 16-byte loads; P goes through shared memory
// transposed (key-major) for the O update. Row max and sum reduce over the 16 threads of a row (one half warp).
#define F32_THREADS 256
#define F32_BLOCK_M 64
#define F32_BLOCK_N 64
#define F32_LDT (F32_BLOCK_M + 4)  // row stride of the transposed tiles (floats; 16-byte aligned rows)

// A ROWS x HEAD_DIM float32 tile (+ bias) stored transposed: dst[d * F32_LDT + r]; zeros outside (rows_valid, dim).
template <typename IN, int ROWS, int HEAD_DIM>
__device__ __forceinline__ void load_tile_transposed(float* dst, const IN* src, long long stride_s, int rows_valid,
                                                     int dim, const float* bias_d) {
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / LOAD_CHUNK;
  for (int c = threadIdx.x; c < ROWS * CHUNKS_PER_ROW; c += F32_THREADS) {
    const int r = c / CHUNKS_PER_ROW;
    const int d0 = (c % CHUNKS_PER_ROW) * LOAD_CHUNK;
    const bool valid = r < rows_valid && d0 < dim;
    float chunk[LOAD_CHUNK];
    load_chunk<float, IN>(chunk, valid ? src + (long long)r * stride_s + d0 : src, (valid && bias_d != nullptr) ? bias_d + d0 : nullptr,
                          valid);
#pragma unroll
    for (int e = 0; e < LOAD_CHUNK; ++e) {
      const int at = (d0 + e) * F32_LDT + r;  // shared-memory offset (< 48K floats)
      dst[at] = chunk[e];
    }
  }
}

template <typename ELEM, typename IN, int HEAD_DIM>
__global__ void __launch_bounds__(F32_THREADS)
    flash_attention_fp32(const IN* __restrict__ q, long long stride_qb, long long stride_qh, long long stride_qs,
                         const float* __restrict__ bias_q, const IN* __restrict__ k, long long stride_kb,
                         long long stride_kh, long long stride_ks, const float* __restrict__ bias_k,
                         const IN* __restrict__ v, long long stride_vb, long long stride_vh, long long stride_vs,
                         const float* __restrict__ bias_v, const float* __restrict__ attention_bias, int bias_d0,
                         int bias_d1, int mask_kind, const int* __restrict__ key_lengths_B,
                         const unsigned char* __restrict__ keep, float mask_filter_value, int causal,
                         int skip_causal_tiles, float scale, int batch, int heads, int q_seq, int total_seq,
                         int past_seq, int head_size, int v_head_size, float* __restrict__ out_BSD) {
  static_assert(same_type<ELEM, float>::value, "the CUDA-core kernel computes in float32");
  static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM is a multiple of 16");
  constexpr int O_VEC = (HEAD_DIM % 64 == 0) ? 4 : 1;  // O columns per group: 16-byte V loads when they fit
  constexpr int O_GROUPS = HEAD_DIM / (16 * O_VEC);
  constexpr int LDV = HEAD_DIM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q_t = reinterpret_cast<float*>(smem_raw);  // HEAD_DIM x F32_LDT (Q transposed)
  float* k_t = q_t + HEAD_DIM * F32_LDT;             // HEAD_DIM x F32_LDT (K transposed)
  float* v_s = k_t + HEAD_DIM * F32_LDT;             // F32_BLOCK_N x LDV
  float* p_t = v_s + F32_BLOCK_N * LDV;              // F32_BLOCK_N x F32_LDT (P transposed)

  const int q_tiles = (q_seq + F32_BLOCK_M - 1) / F32_BLOCK_M;
  const long long bh = (long long)blockIdx.x / q_tiles;
  const int m0 = (q_tiles - 1 - (int)((long long)blockIdx.x % q_tiles)) * F32_BLOCK_M;
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const int ty = threadIdx.x / 16;
  const int tx = threadIdx.x % 16;

  const IN* q_rows = q + (long long)b * stride_qb + (long long)h * stride_qh + (long long)m0 * stride_qs;
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  const float* bias_q_h = bias_q == nullptr ? nullptr : bias_q + (long long)h * head_size;
  const float* bias_k_h = bias_k == nullptr ? nullptr : bias_k + (long long)h * head_size;
  const float* bias_v_h = bias_v == nullptr ? nullptr : bias_v + (long long)h * v_head_size;

  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  int rows[4];
  RowMask masks[4];
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
    rows[ii] = m0 + ty * 4 + ii;
    masks[ii] = row_mask(mp, b, h, rows[ii]);
  }

  // Step 1 (loads): Q once (transposed, + b_q).
  load_tile_transposed<IN, F32_BLOCK_M, HEAD_DIM>(q_t, q_rows, stride_qs, q_seq - m0, head_size, bias_q_h);

  float o_acc[4][O_GROUPS][O_VEC];
#pragma unroll
  for (int ii = 0; ii < 4; ++ii)
#pragma unroll
    for (int dd = 0; dd < O_GROUPS; ++dd)
#pragma unroll
      for (int e = 0; e < O_VEC; ++e) o_acc[ii][dd][e] = 0.0f;
  float row_max[4] = {NEG_INFINITY, NEG_INFINITY, NEG_INFINITY, NEG_INFINITY};  // m_i
  float row_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                   // l_i (this thread's part)

  int key_end = causal_key_end(mp, m0, F32_BLOCK_M, skip_causal_tiles);
  for (int n0 = 0; n0 < total_seq; n0 += F32_BLOCK_N) {
    if (n0 >= key_end) {
      bool dominated = true;
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) dominated = dominated && row_max[ii] > CAUSAL_SKIP_MAX_FLOOR;
      if (__syncthreads_and(dominated)) break;
      key_end = total_seq;
    }
    __syncthreads();  // every thread is done with the previous K, V and P tiles
    load_tile_transposed<IN, F32_BLOCK_N, HEAD_DIM>(k_t, k_rows + (long long)n0 * stride_ks, stride_ks,
                                                   total_seq - n0, head_size, bias_k_h);
    load_tile<float, IN, F32_BLOCK_N, HEAD_DIM, LDV, F32_THREADS>(v_s, v_rows + (long long)n0 * stride_vs,
                                                                 stride_vs, total_seq - n0, v_head_size, bias_v_h);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    // Step 2: the 4 x 4 score tile, x = scale * q.k in fp32 FFMA.
    float s[4][4];
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) s[ii][0] = s[ii][1] = s[ii][2] = s[ii][3] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < HEAD_DIM; ++d) {
      const float4 qa = *reinterpret_cast<const float4*>(q_t + d * F32_LDT + ty * 4);
      const float4 kb = *reinterpret_cast<const float4*>(k_t + d * F32_LDT + tx * 4);
      const float qv[4] = {qa.x, qa.y, qa.z, qa.w};
      const float kv[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
      for (int ii = 0; ii < 4; ++ii)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) s[ii][jj] = fmaf(qv[ii], kv[jj], s[ii][jj]);
    }
    // Steps 2-4: scale, attention bias, causal and padding; keys past T are not in the row.
    const bool masked_tile = tile_needs_mask(mp, m0, n0, F32_BLOCK_N);
#pragma unroll
    for (int ii = 0; ii < 4; ++ii)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = n0 + tx * 4 + jj;
        float x = s[ii][jj] * scale;
        if (masked_tile) x = (j < total_seq) ? masked_logit(x, mp, masks[ii], rows[ii], j) : NEG_INFINITY;
        s[ii][jj] = x;
      }

    // Online softmax per row (steps A-D as in flash_attention_mma; a row spans the 16 tx threads).
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      float tile_max = fmaxf(fmaxf(s[ii][0], s[ii][1]), fmaxf(s[ii][2], s[ii][3]));  // step A
#pragma unroll
      for (int offset = 8; offset > 0; offset >>= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float m_new = fmaxf(row_max[ii], tile_max);  // step B
      const float max_used = (m_new == NEG_INFINITY) ? 0.0f : m_new;
      const float alpha = exp2f((row_max[ii] - max_used) * LOG2E);
      row_max[ii] = m_new;
      float tile_sum = 0.0f;  // step C
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
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
    for (int jj = 0; jj < 4; ++jj) {
      *reinterpret_cast<float4*>(p_t + (tx * 4 + jj) * F32_LDT + ty * 4) =
          make_float4(s[0][jj], s[1][jj], s[2][jj], s[3][jj]);
    }
    __syncthreads();

    // Step E: O += P . V in fp32 FFMA.
#pragma unroll 4
    for (int jk = 0; jk < F32_BLOCK_N; ++jk) {
      const float4 pa = *reinterpret_cast<const float4*>(p_t + jk * F32_LDT + ty * 4);
      const float pv[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
      for (int dd = 0; dd < O_GROUPS; ++dd) {
        float vv[O_VEC];
        if constexpr (O_VEC == 4) {
          const float4 v4 = *reinterpret_cast<const float4*>(v_s + jk * LDV + (tx + 16 * dd) * 4);
          vv[0] = v4.x;
          vv[1] = v4.y;
          vv[2] = v4.z;
          vv[3] = v4.w;
        } else {
          const int at = jk * LDV + tx + 16 * dd;  // shared-memory offset
          vv[0] = v_s[at];
        }
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
#pragma unroll
          for (int e = 0; e < O_VEC; ++e) o_acc[ii][dd][e] = fmaf(pv[ii], vv[e], o_acc[ii][dd][e]);
      }
    }
  }

  // Step F: out = O / l (l summed over the row's 16 threads); float32 output, no rounding needed.
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) row_sum[ii] += __shfl_xor_sync(0xffffffffu, row_sum[ii], offset);
  }
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
    if (rows[ii] >= q_seq) continue;
    const float inv = 1.0f / row_sum[ii];
    const long long out_row = (((long long)b * q_seq + rows[ii]) * heads + h) * v_head_size;
#pragma unroll
    for (int dd = 0; dd < O_GROUPS; ++dd)
#pragma unroll
      for (int e = 0; e < O_VEC; ++e) {
        const int d = (tx + 16 * dd) * O_VEC + e;
        if (d < v_head_size) out_BSD[out_row + d] = o_acc[ii][dd][e] * inv;
      }
  }
}
