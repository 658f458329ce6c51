// Masked softmax of the mha_ep attention pipeline: scores (B, N, S, T) float32 -> probabilities (B, N, S, T) in
// the compute dtype ELEM; everything is float32 until the final store. Two kernels, one semantics:
//   masked_softmax_warp<ELEM, COLS_PER_LANE>: one warp per row, the row in registers (T <= 32 * COLS_PER_LANE,
//       at most 1024): all loads in flight at once, shuffle-only reductions;
//   masked_softmax<ELEM>: one block per row, for longer rows (shared-memory row cache up to 8192 keys; a
//       register-resident block variant was slower on the H200: docs/BENCH.md, "Kernel notes").
//
// Semantics (ORT 1.31.1 CPU, docs/SEMANTICS.md §3.4-3.6), per score x = scale * q.k (the GEMM's alpha):
//   0. x += key_offset_BNT[b, h, j] (+ query_offset_BNS[b, h, i] when j >= P)
//                                                        (when given: the projection biases' shares of a
//                                                         float16 / bfloat16 score, dispatch.py score_terms)
//   1. x += attention_bias[b|0, h|0, i, j]             (broadcast over dims 0/1 of size 1)
//   2. x += mask_filter_value where key j is padded      (ADDED in float32, never substituted: a fully padded row
//                                                         stays softmax of the raw scores, at every dtype)
//   3. x += FLOAT32_LOWEST where causal, i < S-1, j > P+i (ORT's additive mask holds lowest there in place of the
//                                                         padding value, and is ADDED like step 2: score + bias
//                                                         still count, e.g. under a bias of -inf; the last row is
//                                                         never causally masked). Steps 2 and 3 exclude each other.
//      qk_BNST[row, j] = x                               (when given: output 3, the masked scores before the
//                                                         softmax, float32; docs/SEMANTICS.md §3.8)
//   4. p  = exp(x - max) / sum(exp(x - max))              (max-subtracted, float32, accurate expf, two-pass)
// The padding mask is read in its compact form (no materialised B x S x T mask):
//   MaskKind (common.cuh): 0 none; 1 key lengths int32 (B,), keep j < len[b]; 2 keep uint8 (B, T); 3 keep uint8 (B, S, T).
//
// Index rule as in layout.cu: promote the first factor, `(long long)b * heads + h`.
#include "common.cuh"

#define SOFTMAX_THREADS 128

struct MaskArgs {
  const float* attention_bias;  // (d0, d1, S, T) float32 or null
  int bias_d0;                  // 1 or B
  int bias_d1;                  // 1 or N
  int mask_kind;                // MaskKind
  const int* key_lengths_B;     // MASK_KEY_LENGTHS
  const unsigned char* keep;    // MASK_KEYS_BT / MASK_KEYS_BST, 1 = keep
  float mask_filter_value;
  int causal;                   // unidirectional and S > 1
  const float* key_offset_BNT;  // (B, N, T) float32 or null
  const float* query_offset_BNS;  // (B, N, S) float32 or null
};

// Block-wide reduction of one float per thread (OP: max or sum); every thread receives the row's result.
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

template <typename OP>
__device__ float block_reduce(float value, OP op) {
  __shared__ float warp_values[SOFTMAX_THREADS / 32];
  __shared__ float row_result;
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if ((threadIdx.x & 31) == 0) warp_values[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    float all = warp_values[0];
    for (int w = 1; w < SOFTMAX_THREADS / 32; ++w) all = op(all, warp_values[w]);
    row_result = all;
  }
  __syncthreads();
  const float result = row_result;
  __syncthreads();  // the next reduction may overwrite warp_values / row_result
  return result;
}

// One score row (b, h, i): its query index and its slices of the bias and mask inputs.
struct RowSlices {
  int i;                           // query position
  const float* bias_row_T;         // attention_bias row, or null
  const unsigned char* keep_row_T; // keep flags of the row (MASK_KEYS_BT / MASK_KEYS_BST), or null
  const float* offset_row_T;       // key offsets of the row's (b, h), or null
  float row_offset;                // the row's query offset (0 without one), for the keys j >= P
  int key_length;                  // MASK_KEY_LENGTHS: keys j >= key_length are padded
};

__device__ __forceinline__ RowSlices row_slices(const MaskArgs& m, long long row, int heads, int q_seq,
                                                int total_seq) {
  RowSlices r;
  r.i = (int)(row % q_seq);
  const long long bh = row / q_seq;
  const int h = (int)(bh % heads);
  const int b = (int)(bh / heads);
  r.bias_row_T = nullptr;
  r.offset_row_T = (m.key_offset_BNT != nullptr) ? m.key_offset_BNT + bh * total_seq : nullptr;
  r.row_offset = (m.query_offset_BNS != nullptr) ? m.query_offset_BNS[row] : 0.0f;
  if (m.attention_bias != nullptr) {
    const int bb = (m.bias_d0 == 1) ? 0 : b;
    const int bn = (m.bias_d1 == 1) ? 0 : h;
    r.bias_row_T = m.attention_bias + (((long long)bb * m.bias_d1 + bn) * q_seq + r.i) * total_seq;
  }
  r.keep_row_T = nullptr;
  if (m.mask_kind == MASK_KEYS_BT) r.keep_row_T = m.keep + (long long)b * total_seq;
  if (m.mask_kind == MASK_KEYS_BST) r.keep_row_T = m.keep + ((long long)b * q_seq + r.i) * total_seq;
  r.key_length = (m.mask_kind == MASK_KEY_LENGTHS) ? m.key_lengths_B[b] : total_seq;
  return r;
}

// Steps 1-3 for one score: the masked logit.
__device__ __forceinline__ float masked_logit(float x, const MaskArgs& m, const RowSlices& r, int j, int q_seq,
                                              int past_seq) {
  if (r.offset_row_T != nullptr) x += r.offset_row_T[j];                                  // step 0
  if (j >= past_seq) x += r.row_offset;
  if (r.bias_row_T != nullptr) x += r.bias_row_T[j];                                      // step 1
  const bool padded = (m.mask_kind == MASK_KEY_LENGTHS) ? (j >= r.key_length)
                      : (r.keep_row_T != nullptr)      ? (r.keep_row_T[j] == 0)
                                                       : false;
  const bool future = m.causal && r.i < q_seq - 1 && j > past_seq + r.i;
  if (future) {
    x += FLOAT32_LOWEST;                                                                  // step 3
  } else if (padded) {
    x += m.mask_filter_value;                                                             // step 2
  }
  return x;
}

// One warp per row; lane l owns columns j = l + 32 k, k < COLS_PER_LANE (coalesced), kept in registers.
template <typename ELEM, int COLS_PER_LANE>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    masked_softmax_warp(const float* __restrict__ scores_BNST, ELEM* __restrict__ probs_BNST,
                        const float* __restrict__ attention_bias, int bias_d0, int bias_d1, int mask_kind,
                        const int* __restrict__ key_lengths_B, const unsigned char* __restrict__ keep,
                        const float* __restrict__ key_offset_BNT, const float* __restrict__ query_offset_BNS,
                        float mask_filter_value, int causal, int batch, int heads, int q_seq, int total_seq,
                        int past_seq, float* __restrict__ qk_BNST) {
  const MaskArgs m{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value, causal,
                   key_offset_BNT, query_offset_BNS};
  const int lane = threadIdx.x & 31;
  const int WARPS = SOFTMAX_THREADS / 32;
  const long long rows = (long long)batch * heads * q_seq;
  for (long long row = (long long)blockIdx.x * WARPS + threadIdx.x / 32; row < rows;
       row += (long long)gridDim.x * WARPS) {
    const RowSlices r = row_slices(m, row, heads, q_seq, total_seq);
    const float* scores_T = scores_BNST + row * total_seq;
    ELEM* probs_T = probs_BNST + row * total_seq;
    // Load every score of this lane first (independent loads in flight); columns past T hold -inf.
    float x[COLS_PER_LANE];
#pragma unroll
    for (int k = 0; k < COLS_PER_LANE; ++k) {
      const int j = lane + 32 * k;
      x[k] = (j < total_seq) ? scores_T[j] : NEG_INFINITY;
    }
    // Steps 1-3 and the row maximum.
    float row_max = NEG_INFINITY;
#pragma unroll
    for (int k = 0; k < COLS_PER_LANE; ++k) {
      const int j = lane + 32 * k;
      if (j < total_seq) {
        x[k] = masked_logit(x[k], m, r, j, q_seq, past_seq);
        if (qk_BNST != nullptr) qk_BNST[row * total_seq + j] = x[k];
      }
      row_max = fmaxf(row_max, x[k]);
    }
    row_max = warp_max(row_max);
    // Step 4: exponentials, their sum (columns past T add exp(-inf) = 0), the division and one rounding.
    float row_sum = 0.0f;
#pragma unroll
    for (int k = 0; k < COLS_PER_LANE; ++k) {
      x[k] = expf(x[k] - row_max);
      if (lane + 32 * k < total_seq) row_sum += x[k];
    }
    row_sum = warp_sum(row_sum);
#pragma unroll
    for (int k = 0; k < COLS_PER_LANE; ++k) {
      const int j = lane + 32 * k;
      if (j < total_seq) probs_T[j] = from_float<ELEM>(x[k] / row_sum);
    }
  }
}

// row_cache: the masked logits, then their exponentials, stay in dynamic shared memory (total_seq floats) between
// the three passes; otherwise each pass recomputes them from the scores (rows too long for shared memory). Each
// thread only ever touches its own columns j, so the passes need no barrier beyond the reductions'.
template <typename ELEM>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    masked_softmax(const float* __restrict__ scores_BNST, ELEM* __restrict__ probs_BNST,
                   const float* __restrict__ attention_bias, int bias_d0, int bias_d1, int mask_kind,
                   const int* __restrict__ key_lengths_B, const unsigned char* __restrict__ keep,
                   const float* __restrict__ key_offset_BNT, const float* __restrict__ query_offset_BNS,
                   float mask_filter_value, int causal, int batch, int heads, int q_seq, int total_seq, int past_seq,
                   float* __restrict__ qk_BNST, int row_cache) {
  extern __shared__ float logits_T[];
  const MaskArgs m{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value, causal,
                   key_offset_BNT, query_offset_BNS};
  const long long rows = (long long)batch * heads * q_seq;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const RowSlices r = row_slices(m, row, heads, q_seq, total_seq);
    const float* scores_T = scores_BNST + row * total_seq;
    ELEM* probs_T = probs_BNST + row * total_seq;
    // Pass 1: masked logits (steps 1-3) and their maximum. fmaxf ignores NaN; a NaN logit still reaches the sum.
    float row_max = NEG_INFINITY;
#pragma unroll 4
    for (int j = threadIdx.x; j < total_seq; j += SOFTMAX_THREADS) {
      const float x = masked_logit(scores_T[j], m, r, j, q_seq, past_seq);
      if (row_cache) logits_T[j] = x;
      if (qk_BNST != nullptr) qk_BNST[row * total_seq + j] = x;
      row_max = fmaxf(row_max, x);
    }
    row_max = block_reduce(row_max, MaxOp());

    // Pass 2: exponentials (one expf per score) and their sum. An all -inf row gives exp(-inf - -inf) = NaN,
    // as in ORT (docs/SEMANTICS.md §3.5: mask_filter_value -inf and a fully padded row).
    float row_sum = 0.0f;
#pragma unroll 4
    for (int j = threadIdx.x; j < total_seq; j += SOFTMAX_THREADS) {
      const float x = row_cache ? logits_T[j] : masked_logit(scores_T[j], m, r, j, q_seq, past_seq);
      const float e = expf(x - row_max);
      if (row_cache) logits_T[j] = e;
      row_sum += e;
    }
    row_sum = block_reduce(row_sum, SumOp());

    // Pass 3: step 4's division, rounded once to the compute dtype.
#pragma unroll 4
    for (int j = threadIdx.x; j < total_seq; j += SOFTMAX_THREADS) {
      const float e = row_cache ? logits_T[j]
                                : expf(masked_logit(scores_T[j], m, r, j, q_seq, past_seq) - row_max);
      probs_T[j] = from_float<ELEM>(e / row_sum);
    }
    __syncthreads();  // logits_T is reused by the next row of this block
  }
}
