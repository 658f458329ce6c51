// Masked softmax of the mha_ep attention pipeline: scores (B, N, S, T) float32 -> probabilities (B, N, S, T) in
// the compute dtype ELEM. One block per score row (b, h, i); everything is float32 until the final store.
//
// Semantics (ORT 1.31.1 CPU, semantics doc 3.4-3.6), per score x = scale * q.k (the GEMM's alpha):
//   1. x += attention_bias[b|0, h|0, i, j]             (broadcast over dims 0/1 of size 1)
//   2. x += mask_filter_value where key j is padded      (ADDED in float32, never substituted: a fully padded row
//                                                         stays softmax of the raw scores, at every dtype)
//   3. x  = FLOAT32_LOWEST where causal, i < S-1, j > P+i (SET, overriding the padding; the last row is never
//                                                         causally masked)
//   4. p  = exp(x - max) / sum(exp(x - max))              (max-subtracted, float32, expf)
// The padding mask is read in its compact form (no materialised B x S x T mask):
//   MASK_KIND 0 none; 1 key lengths int32 (B,), keep j < len[b]; 2 keep uint8 (B, T); 3 keep uint8 (B, S, T).
//
// Index rule as in layout.cu: promote the first factor, `(long long)b * heads + h`.
#include "common.cuh"

#define SOFTMAX_THREADS 128
#define FLOAT32_LOWEST (-3.402823466e+38f)
#define NEG_INFINITY __int_as_float(static_cast<int>(0xff800000u))  // NVRTC has no <cmath> INFINITY

enum MaskKind { MASK_NONE = 0, MASK_KEY_LENGTHS = 1, MASK_KEYS_BT = 2, MASK_KEYS_BST = 3 };

struct MaskArgs {
  const float* attention_bias;  // (d0, d1, S, T) float32 or null
  int bias_d0;                  // 1 or B
  int bias_d1;                  // 1 or N
  int mask_kind;                // MaskKind
  const int* key_lengths_B;     // MASK_KEY_LENGTHS
  const unsigned char* keep;    // MASK_KEYS_BT / MASK_KEYS_BST, 1 = keep
  float mask_filter_value;
  int causal;                   // unidirectional and S > 1
};

// (m, l): running maximum and sum of exp(x - m) of an online softmax. An all -inf prefix is (-inf, 0).
struct RowStat {
  float max;
  float sum;
};

__device__ __forceinline__ RowStat row_stat_push(RowStat a, float x) {
  if (x > a.max) {
    a.sum = a.sum * expf(a.max - x) + 1.0f;  // expf(-inf) = 0 rescales an empty prefix to 0
    a.max = x;
  } else if (x != NEG_INFINITY) {
    a.sum += expf(x - a.max);
  }
  return a;
}

__device__ __forceinline__ RowStat row_stat_merge(RowStat a, RowStat b) {
  const float m = fmaxf(a.max, b.max);
  if (m == NEG_INFINITY) return RowStat{m, 0.0f};
  const float sa = (a.max == NEG_INFINITY) ? 0.0f : a.sum * expf(a.max - m);
  const float sb = (b.max == NEG_INFINITY) ? 0.0f : b.sum * expf(b.max - m);
  return RowStat{m, sa + sb};
}

// Block-wide merge of every thread's RowStat; every thread receives the row's result.
__device__ RowStat block_row_stat(RowStat stat) {
  __shared__ RowStat warp_stats[SOFTMAX_THREADS / 32];
  __shared__ RowStat row_result;
  for (int offset = 16; offset > 0; offset >>= 1) {
    RowStat other{__shfl_xor_sync(0xffffffffu, stat.max, offset), __shfl_xor_sync(0xffffffffu, stat.sum, offset)};
    stat = row_stat_merge(stat, other);
  }
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) warp_stats[warp] = stat;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowStat all = warp_stats[0];
    for (int w = 1; w < SOFTMAX_THREADS / 32; ++w) all = row_stat_merge(all, warp_stats[w]);
    row_result = all;
  }
  __syncthreads();
  const RowStat result = row_result;
  __syncthreads();  // the next row may overwrite warp_stats / row_result
  return result;
}

// Steps 1-3 for one score: the masked logit.
__device__ __forceinline__ float masked_logit(float x, const MaskArgs& m, const float* bias_row_T,
                                              const unsigned char* keep_row_T, int key_length, int i, int j,
                                              int q_seq, int past_seq) {
  if (bias_row_T != nullptr) x += bias_row_T[j];                                      // step 1
  const bool padded = (m.mask_kind == MASK_KEY_LENGTHS) ? (j >= key_length)
                      : (keep_row_T != nullptr)        ? (keep_row_T[j] == 0)
                                                       : false;
  if (padded) x += m.mask_filter_value;                                               // step 2
  if (m.causal && i < q_seq - 1 && j > past_seq + i) x = FLOAT32_LOWEST;              // step 3
  return x;
}

// ROW_CACHE: the masked logits of the row are kept in dynamic shared memory (total_seq floats) between the two
// passes; otherwise the second pass recomputes them from the scores (rows too long for shared memory).
template <typename ELEM>
__global__ void __launch_bounds__(SOFTMAX_THREADS)
    masked_softmax(const float* __restrict__ scores_BNST, ELEM* __restrict__ probs_BNST,
                   const float* __restrict__ attention_bias, int bias_d0, int bias_d1, int mask_kind,
                   const int* __restrict__ key_lengths_B, const unsigned char* __restrict__ keep,
                   float mask_filter_value, int causal, int batch, int heads, int q_seq, int total_seq, int past_seq,
                   int row_cache) {
  extern __shared__ float logits_T[];
  const MaskArgs m{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value, causal};
  const long long rows = (long long)batch * heads * q_seq;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    // Row coordinates (b, h, i) and the row's slices of the score, bias and mask inputs.
    const int i = (int)(row % q_seq);
    const long long bh = row / q_seq;
    const int h = (int)(bh % heads);
    const int b = (int)(bh / heads);
    const float* scores_T = scores_BNST + row * total_seq;
    ELEM* probs_T = probs_BNST + row * total_seq;
    const float* bias_row_T = nullptr;
    if (m.attention_bias != nullptr) {
      const int bb = (m.bias_d0 == 1) ? 0 : b;
      const int bn = (m.bias_d1 == 1) ? 0 : h;
      bias_row_T = m.attention_bias + (((long long)bb * m.bias_d1 + bn) * q_seq + i) * total_seq;
    }
    const unsigned char* keep_row_T = nullptr;
    if (m.mask_kind == MASK_KEYS_BT) keep_row_T = m.keep + (long long)b * total_seq;
    if (m.mask_kind == MASK_KEYS_BST) keep_row_T = m.keep + ((long long)b * q_seq + i) * total_seq;
    const int key_length = (m.mask_kind == MASK_KEY_LENGTHS) ? m.key_lengths_B[b] : total_seq;

    // Pass 1: masked logits (steps 1-3) and the online (max, sum) of this thread's columns.
    RowStat stat{NEG_INFINITY, 0.0f};
    for (int j = threadIdx.x; j < total_seq; j += SOFTMAX_THREADS) {
      const float x = masked_logit(scores_T[j], m, bias_row_T, keep_row_T, key_length, i, j, q_seq, past_seq);
      if (row_cache) logits_T[j] = x;
      stat = row_stat_push(stat, x);
    }
    // Row-wide (max, sum); the block barrier inside also publishes logits_T.
    stat = block_row_stat(stat);

    // Pass 2: step 4, probabilities rounded once to the compute dtype.
    for (int j = threadIdx.x; j < total_seq; j += SOFTMAX_THREADS) {
      const float x = row_cache ? logits_T[j]
                                : masked_logit(scores_T[j], m, bias_row_T, keep_row_T, key_length, i, j, q_seq,
                                               past_seq);
      probs_T[j] = from_float<ELEM>(expf(x - stat.max) / stat.sum);
    }
    __syncthreads();  // logits_T is reused by the next row of this block
  }
}
