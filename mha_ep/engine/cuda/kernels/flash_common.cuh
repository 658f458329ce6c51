// Shared pieces of the fused attention kernels (flash_attention.cu: mma.sync and fp32; flash_attention_wgmma.cu and
// flash_attention_ws.cu: Hopper's warpgroup MMA; split_keys.cu): their parameter list, the mask rules of steps 3-4
// (semantics in flash_attention.cu's header), the per-tile mask classification, the global -> shared copies
// (cp.async), the fast 2^x and step B of the online softmax.
#pragma once
#include "common.cuh"

#define LOG2E 1.4426950408889634f
#define CAUSAL_SKIP_MAX_FLOOR (-1.0e38f)  // row max above this: exp(x + FLOAT32_LOWEST - max) underflows to 0
#define SMEM_PAD 8                        // elements added to each shared-memory row (ldmatrix bank spread)
#define LOAD_CHUNK 8                      // elements per vector load (16 bytes of f16/bf16, 32 bytes of f32)

template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

// ------------------------------------------------------------------------------------- the kernels' parameters
// The parameters every fused kernel starts with (flash_attention_mma, _fp32, _wgmma, _ws, split_key_attention),
// in the order fused.py passes them (tests/support/fused_cases.py kernel_parameters spells them for explicit
// instantiations): Q, K and V as (OPERAND pointer, batch, head and sequence strides in elements, projection bias
// (N * dim, in OPERAND: the node's own b_q where a kernel reads the node's query as it is) or null), the mask inputs (MaskParams), the score offsets, the scalars and the BSNH output: float32 at out_BSD,
// or, where out_narrow_BSD is not null, in ELEM there (the node's own output: no narrowing pass; the tensor-core
// kernels write it, flash_attention_fp32 and the split-key kernel, whose host passes null, ignore it). What each
// means: flash_attention.cu's header. FLASH_KERNEL_ARGUMENTS passes them on, in the same order.
#define FLASH_KERNEL_PARAMETERS(OPERAND)                                                                          \
  const OPERAND* __restrict__ q, long long stride_qb, long long stride_qh, long long stride_qs,                   \
      const OPERAND* __restrict__ bias_q, const OPERAND* __restrict__ k, long long stride_kb, long long stride_kh,  \
      long long stride_ks, const OPERAND* __restrict__ bias_k, const OPERAND* __restrict__ v, long long stride_vb,  \
      long long stride_vh, long long stride_vs, const OPERAND* __restrict__ bias_v,                              \
      const float* __restrict__ attention_bias, int bias_d0, int bias_d1, int mask_kind,                         \
      const int* __restrict__ key_lengths_B, const unsigned char* __restrict__ keep,                             \
      const float* __restrict__ key_offset_BNT, const float* __restrict__ query_offset_BNS,                      \
      float mask_filter_value, int causal, int skip_causal_tiles, float scale, int batch, int heads, int q_seq,  \
      int total_seq, int past_seq, int head_size, int v_head_size, float* __restrict__ out_BSD,                  \
      void* __restrict__ out_narrow_BSD
#define FLASH_KERNEL_ARGUMENTS                                                                                    \
  q, stride_qb, stride_qh, stride_qs, bias_q, k, stride_kb, stride_kh, stride_ks, bias_k, v, stride_vb,           \
      stride_vh, stride_vs, bias_v, attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep,             \
      key_offset_BNT, query_offset_BNS, mask_filter_value, causal, skip_causal_tiles, scale, batch, heads, q_seq, \
      total_seq, past_seq, head_size, v_head_size, out_BSD, out_narrow_BSD

// One output pair (d, d + 1) of a row at element ``at``: rounded to ELEM (float16 / bfloat16) and stored in ELEM at
// out_narrow_BSD when the host gives it (one 4-byte store: d and every row start are even), else as float32 at
// out_BSD (the rounded value, exactly: what narrow_output would round again without a change).
template <typename ELEM>
__device__ __forceinline__ void store_pair(float* __restrict__ out_BSD, void* __restrict__ out_narrow_BSD,
                                           long long at, float lo, float hi) {
  if (out_narrow_BSD != nullptr) {
    __align__(4) ELEM pair[2] = {from_float<ELEM>(lo), from_float<ELEM>(hi)};
    *reinterpret_cast<unsigned*>(static_cast<ELEM*>(out_narrow_BSD) + at) = *reinterpret_cast<const unsigned*>(pair);
  } else {
    *reinterpret_cast<float2*>(out_BSD + at) = make_float2(round_to<ELEM>(lo), round_to<ELEM>(hi));
  }
}

// ------------------------------------------------------------------------------------------------ the masks
// Per-call mask inputs (kernel arguments gathered once).
struct MaskParams {
  const float* attention_bias;  // (bias_d0, bias_d1, S, T) float32 or null
  int bias_d0;                  // 1 or B
  int bias_d1;                  // 1 or N
  int mask_kind;                // MaskKind (common.cuh)
  const int* key_lengths_B;     // MASK_KEY_LENGTHS
  const unsigned char* keep;    // MASK_KEYS_BT / _BST, nonzero = keep
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
  if (p.mask_kind == MASK_KEYS_BT) m.keep_T = p.keep + (long long)b * p.total_seq;
  if (p.mask_kind == MASK_KEYS_BST) m.keep_T = p.keep + ((long long)b * p.q_seq + i) * p.total_seq;
  if (p.mask_kind == MASK_KEY_LENGTHS) m.key_length = p.key_lengths_B[b];
  return m;
}

// Mask inputs an instantiation of flash_attention_mma is compiled for (its FEATURES template argument).
// FLASH_WITH_KEY_OFFSET: x += key_offset_BNT[b, h, j] (+ query_offset_BNS[b, h, i] for j >= P) right after
// x = scale * q.k: the projection biases' shares of the score, in float32 (dispatch.py score_terms, layout.cu
// bias_dot).
enum FlashFeatures { FLASH_PLAIN = 0, FLASH_WITH_PADDING = 1, FLASH_WITH_BIAS = 2, FLASH_WITH_KEY_OFFSET = 4 };

// How the masks touch one key tile [n0, n0 + block_n) of query rows [m0, m0 + block_m) (uniform over the block).
enum TilePadding { TILE_KEEP_ALL = 0, TILE_PAD_ALL = 1, TILE_PAD_MIXED = 2 };
struct TileMask {
  bool plain;      // no term of steps 3-4 and every key in range: x = scale * q.k
  bool in_range;   // every key of the tile is < total_seq
  bool causal;     // some row of the block has keys of this tile in its causal future
  int padding;     // TilePadding of the tile's in-range keys
};

// The tile's padding: key lengths compare once; (B, T) keep flags are voted by the warp (every warp of the block
// reads the same flags, so every warp reaches the same answer); (B, S, T) flags are read per element.
__device__ __forceinline__ int tile_padding(const MaskParams& p, int b, int n0, int block_n, int lane) {
  if (p.mask_kind == MASK_NONE) return TILE_KEEP_ALL;
  const int end = min(n0 + block_n, p.total_seq);
  if (p.mask_kind == MASK_KEY_LENGTHS) {
    const int length = p.key_lengths_B[b];
    if (end <= length) return TILE_KEEP_ALL;
    return (n0 >= length) ? TILE_PAD_ALL : TILE_PAD_MIXED;
  }
  if (p.mask_kind == MASK_KEYS_BT) {
    const unsigned char* keep_T = p.keep + (long long)b * p.total_seq;
    bool any_kept = false;
    bool any_padded = false;
    for (int j = n0 + lane; j < end; j += 32) {
      const bool kept = keep_T[j] != 0;
      any_kept = any_kept || kept;
      any_padded = any_padded || !kept;
    }
    any_kept = __any_sync(0xffffffffu, any_kept);
    any_padded = __any_sync(0xffffffffu, any_padded);
    if (!any_padded) return TILE_KEEP_ALL;
    return any_kept ? TILE_PAD_MIXED : TILE_PAD_ALL;
  }
  return TILE_PAD_MIXED;
}

__device__ __forceinline__ TileMask tile_mask(const MaskParams& p, int b, int m0, int n0, int block_n, int lane) {
  TileMask t;
  t.in_range = n0 + block_n <= p.total_seq;
  t.causal = p.causal && n0 + block_n - 1 > p.past_seq + m0;
  t.padding = tile_padding(p, b, n0, block_n, lane);
  t.plain = t.in_range && !t.causal && t.padding == TILE_KEEP_ALL && p.attention_bias == nullptr;
  return t;
}

// Step 4 for one in-range logit x of row i, key j (attention_bias, step 3, already added).
__device__ __forceinline__ float masked_logit(float x, const MaskParams& p, const RowMask& m, const TileMask& t, int i,
                                              int j) {
  const bool future = t.causal && i < p.q_seq - 1 && j > p.past_seq + i;
  bool padded = t.padding == TILE_PAD_ALL;
  if (t.padding == TILE_PAD_MIXED) padded = (j >= m.key_length) || (m.keep_T != nullptr && m.keep_T[j] == 0);
  if (future) {
    x += FLOAT32_LOWEST;  // step 4, causal
  } else if (padded) {
    x += p.mask_filter_value;  // step 4, padding
  }
  return x;
}

// Step 4 for one in-range logit x of row i, key j of a tile that mixes kept and padded keys (or whose padding
// was not classified): the key's own padding flag.
__device__ __forceinline__ float masked_logit_per_key(float x, const MaskParams& p, const RowMask& m, int i, int j) {
  const bool future = p.causal && i < p.q_seq - 1 && j > p.past_seq + i;
  const bool padded = (j >= m.key_length) || (m.keep_T != nullptr && m.keep_T[j] == 0);
  if (future) {
    x += FLOAT32_LOWEST;  // step 4, causal
  } else if (padded) {
    x += p.mask_filter_value;  // step 4, padding
  }
  return x;
}

// x of a padded key (step 4 without bias or causal): two roundings, never contracted into one FMA, so the row's
// largest x is padded_logit of its largest q.k (both operations are monotonic).
__device__ __forceinline__ float padded_logit(float acc, float scale, float mask_filter_value) {
  return __fadd_rn(__fmul_rn(acc, scale), mask_filter_value);
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
// Wait until at most the N newest committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// LOAD_CHUNK elements of `src` (+ bias), rounded to ELEM, into registers (zeros when !valid).
template <typename ELEM, typename IN>
__device__ __forceinline__ void load_chunk(ELEM (&out)[LOAD_CHUNK], const IN* src, const IN* bias, bool valid) {
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
    if (valid && bias != nullptr) x += to_float<IN>(bias[e]);  // step 1: float32 sum, one rounding to ELEM below
    out[e] = from_float<ELEM>(x);
  }
}

// A tile of ROWS sequence rows x HEAD_DIM into shared memory `tile` (row stride LD elements):
//   rows >= rows_valid and dims >= dim are zero-filled (they add nothing to a dot product or to P.V);
//   ELEM input without bias goes through cp.async (asynchronous; the caller commits and waits);
//   anything else (float32 input of an f16/bf16 call, or a bias to add) goes through registers (synchronous).
// `src` points at (row 0, d 0); `bias_d` at the bias of this head (dim values, in IN) or null. dim % LOAD_CHUNK == 0.
template <typename ELEM, typename IN, int ROWS, int HEAD_DIM, int LD, int THREADS>
__device__ __forceinline__ void load_tile(ELEM* tile, const IN* src, long long stride_s, int rows_valid, int dim,
                                          const IN* bias_d) {
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

__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}

// One thread's share of copying ROWS x HEAD_DIM tiles of an ELEM operand (no bias to add) into shared memory
// with cp.async, addresses formed once: the thread copies the 16-byte chunk at column `col` of rows
// row0, row0 + ROW_STEP, ... of every tile, so a tile costs one address per pass and no division.
// Rows past `rows_valid` and columns past the head size are zero-filled, as load_tile does.
template <typename ELEM, int ROWS, int HEAD_DIM, int LD, int THREADS> struct AsyncTileCopy {
  static constexpr int CHUNK = 16 / (int)sizeof(ELEM);  // elements per cp.async
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / CHUNK;
  static constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  static constexpr int PASSES = ROWS / ROW_STEP;
  static constexpr bool APPLIES = HEAD_DIM % CHUNK == 0 && THREADS % CHUNKS_PER_ROW == 0 && ROWS % ROW_STEP == 0;
  const ELEM* src;        // (row0, col) of row 0 of the operand
  long long stride_s;     // elements from one sequence row to the next
  long long pass_stride;  // ROW_STEP rows
  int row0;
  int smem_at;            // (row0, col) in a tile
  bool col_valid;

  __device__ __forceinline__ AsyncTileCopy(const ELEM* rows, long long stride, int dim) {
    row0 = threadIdx.x / CHUNKS_PER_ROW;
    const int col = (threadIdx.x % CHUNKS_PER_ROW) * CHUNK;
    col_valid = col < dim;
    stride_s = stride;
    pass_stride = stride * ROW_STEP;
    src = rows + (long long)row0 * stride + col;
    smem_at = row0 * LD + col;
  }
  // Sequence rows [first, first + ROWS) into `tile`; rows at or after `first + rows_valid` are zero-filled.
  __device__ __forceinline__ void copy(ELEM* tile, int first, int rows_valid) const {
    const ELEM* g = src + (long long)first * stride_s;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const bool valid = col_valid && row0 + pass * ROW_STEP < rows_valid;
      cp_async_16(tile + smem_at + pass * ROW_STEP * LD, valid ? g : src, valid);
      g += pass_stride;
    }
  }
};

// The attention_bias tile of query rows [m0, m0 + ROWS) x keys [n0, n0 + COLS) into shared memory `tile` (row
// stride LDB floats) with 4-byte cp.async (the caller commits and waits), for rows that are not 16-byte aligned
// (BiasTileCopy takes the rest); zeros outside (S, T) (rows >= S are never stored, keys >= T become -inf).
// `bias_rows` points at (row m0, key 0) of this (b, h)'s (S, T) slice.
template <int ROWS, int COLS, int LDB, int THREADS>
__device__ __forceinline__ void load_bias_tile(float* tile, const float* bias_rows, int rows_valid, int total_seq,
                                               int n0) {
  for (int c = threadIdx.x; c < ROWS * COLS; c += THREADS) {
    const int r = c / COLS;
    const int col = c % COLS;
    const bool valid = r < rows_valid && n0 + col < total_seq;
    const float* g = valid ? bias_rows + (long long)r * total_seq + n0 + col : bias_rows;
    cp_async_4(tile + r * LDB + col, g, valid);
  }
}

// One thread's share of copying the ROWS x COLS float32 attention_bias tiles of a block (its query rows fixed,
// the keys advancing) with 16-byte cp.async, addresses formed once: the vec4 case of load_bias_tile (T % 4 == 0
// and an aligned base, so a 4-key chunk is all in or all out of range).
template <int ROWS, int COLS, int LDB, int THREADS> struct BiasTileCopy {
  static constexpr int CHUNKS_PER_ROW = COLS / 4;
  static constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  static constexpr int PASSES = ROWS / ROW_STEP;
  static_assert(COLS % 4 == 0 && THREADS % CHUNKS_PER_ROW == 0 && ROWS % ROW_STEP == 0, "tile not divisible");
  const float* src;       // (row0, col) of key 0
  long long pass_stride;  // ROW_STEP bias rows
  int row0;
  int col;
  int smem_at;
  int rows_valid;

  __device__ __forceinline__ BiasTileCopy(const float* bias_rows, int total_seq, int rows_valid_) {
    row0 = threadIdx.x / CHUNKS_PER_ROW;
    col = (threadIdx.x % CHUNKS_PER_ROW) * 4;
    pass_stride = (long long)total_seq * ROW_STEP;
    src = bias_rows + (long long)row0 * total_seq + col;
    smem_at = row0 * LDB + col;
    rows_valid = rows_valid_;
  }
  // Keys [n0, n0 + COLS) into `tile`; rows past rows_valid and keys past total_seq are zero-filled.
  __device__ __forceinline__ void copy(float* tile, int n0, int total_seq) const {
    const bool col_valid = n0 + col < total_seq;
    const float* g = src + n0;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const bool valid = col_valid && row0 + pass * ROW_STEP < rows_valid;
      cp_async_16(tile + smem_at + pass * ROW_STEP * LDB, valid ? g : src, valid);
      g += pass_stride;
    }
  }
};

// 2^x on the special-function unit alone (ex2.approx, about 2 ulp; flushes results below 2^-126 to 0, which
// changes no softmax sum: every term is <= 1 and the row max contributes exactly 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------ the online softmax
// Step B of the online softmax (FlashAttention-2) for one row, shared by every fused kernel: the new running max
// m_new = max(m_old, tile_max) of the logits seen so far (stored back in row_max), the max the exponentials of
// step C subtract (max_used: 0 for a row with no finite logit yet, so exp(-inf - 0) = 0 and never NaN), and the
// returned factor alpha = exp(m_old - m_new) that rescales what was summed so far (l and O, step D).
// FAST_EXP2: ex2.approx (the tensor-core kernels); else exp2f (flash_attention_fp32's accurate path).
template <bool FAST_EXP2>
__device__ __forceinline__ float online_softmax_rescale(float& row_max, float tile_max, float& max_used) {
  const float m_new = fmaxf(row_max, tile_max);
  max_used = (m_new == NEG_INFINITY) ? 0.0f : m_new;
  const float exponent = (row_max - max_used) * LOG2E;
  const float alpha = FAST_EXP2 ? fast_exp2(exponent) : exp2f(exponent);
  row_max = m_new;
  return alpha;
}
