// Attention of a few query rows over many keys (a decode step: S <= SPLIT_MAX_ROWS), the keys split across blocks
// (flash-decoding). The flash kernels (flash_attention.cu) give a block 64 query rows of one (b, h) and walk every
// key in it: at S = 1 that is B*N blocks, each a long serial walk with 63 of its 64 rows idle (Whisper tiny's cross
// attention, B = 1, T = 1500: 6 blocks, about 140 us where the keys and values take 2 us to read). Here:
//   split_key_attention<ELEM, IN>   grid (B*N, splits): block (bh, c) takes keys [c*chunk, min((c+1)*chunk, T)) for
//                                   every query row of (b, h), and writes the chunk's unnormalised output O_c, its
//                                   max m_c and its sum l_c (partial_O, partial_ML);
//   combine_key_splits<ELEM>        grid B*N*S: m = max m_c, l = sum l_c exp(m_c - m),
//                                   out = (sum O_c exp(m_c - m)) / l, rounded to ELEM, as float32 BSNH.
// The arguments up to out_BSD are flash_attention_*'s (fused.py fused_step), with the same meaning, semantics and
// strides (flash_attention.cu's header, steps 1-5): q, k, v rounded to ELEM after the projection bias, x = fma(q.k,
// scale, key_offset[j]) (+ query_offset[i] for j >= P), + attention_bias, causal (+FLOAT32_LOWEST) or padding
// (+mask_filter_value); p = exp(x - m) in float32, P.V with p rounded to ELEM (as the tensor-core kernel rounds its
// P fragments; no-op in float32), the sum of p unrounded. A row with no finite logit gives 0/0 = NaN, as ORT.
// Nothing is skipped (no causal-tile vote): every key's p is computed, an exact 0 where flash skips.
//
// In a block of SPLIT_THREADS: the query rows (floats, ELEM-rounded unless round_query is 0) sit in shared memory;
// a warp forms the S dot products of SPLIT_KEYS_PER_PASS keys at once, lanes over d (SplitLoad: coalesced row
// reads), then a shuffle sum; a warp per row takes the chunk's max, exponentials and sum; a warp per key again
// for P.V, lanes over d, summed across warps in shared memory.
//
// Index rule as in layout.cu: promote the first factor of every product, `(long long)b * stride_b`; shared-memory
// rows (under 48 KiB) are formed in int as row pointers, `(x_s + i * chunk)[jj]`.
#include "common.cuh"
#include "flash_common.cuh"

#define SPLIT_THREADS 128  // fused.py SPLIT_THREADS
#define SPLIT_WARPS (SPLIT_THREADS / 32)
#define SPLIT_MAX_ROWS 4   // dispatch.py SPLIT_MAX_ROWS: query rows a block holds (one warp each in the softmax)
#define SPLIT_KEYS_PER_PASS 4  // keys a warp scores at once
#define SPLIT_MAX_DIM 128  // dispatch.py SPLIT_MAX_DIM: head sizes (H, Hv) the lanes cover, 4 elements per lane

// A lane's share of a K or V row: SplitLoad<IN>::N consecutive elements as floats, one load (16-byte aligned rows,
// H a multiple of 8: a vector never straddles the head's end). 16-bit rows: 8 bytes a lane (two bytes a lane
// left a float16 step's cross attention at 47 us a layer against 16 for cuDNN's, docs/BENCH.md section 6).
template <typename IN> struct SplitLoad;
template <> struct SplitLoad<float> {
  static constexpr int N = 1;
  static __device__ __forceinline__ void load(const float* p, float (&out)[N]) { out[0] = *p; }
};
template <> struct SplitLoad<__half> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void load(const __half* p, float (&out)[N]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
  }
};
template <> struct SplitLoad<__nv_bfloat16> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, float (&out)[N]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
  }
};

template <typename ELEM, typename IN>
__global__ void __launch_bounds__(SPLIT_THREADS)
    split_key_attention(const IN* __restrict__ q, long long stride_qb, long long stride_qh, long long stride_qs,
                        const float* __restrict__ bias_q, const IN* __restrict__ k, long long stride_kb,
                        long long stride_kh, long long stride_ks, const float* __restrict__ bias_k,
                        const IN* __restrict__ v, long long stride_vb, long long stride_vh, long long stride_vs,
                        const float* __restrict__ bias_v, const float* __restrict__ attention_bias, int bias_d0,
                        int bias_d1, int mask_kind, const int* __restrict__ key_lengths_B,
                        const unsigned char* __restrict__ keep, const float* __restrict__ key_offset_BNT,
                        const float* __restrict__ query_offset_BNS, float mask_filter_value, int causal,
                        int skip_causal_tiles, float scale, int batch, int heads, int q_seq, int total_seq,
                        int past_seq, int head_size, int v_head_size, float* __restrict__ out_BSD, int chunk,
                        float* __restrict__ partial_O, float2* __restrict__ partial_ML, int round_query) {
  (void)skip_causal_tiles;
  (void)batch;
  (void)out_BSD;
  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;                        // q_seq x head_size
  float* x_s = q_s + q_seq * head_size;     // q_seq x chunk: the logits, then p
  float* o_s = x_s + q_seq * chunk;         // SPLIT_WARPS x q_seq x v_head_size: each warp's share of P.V

  const long long bh = blockIdx.x;
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const int split = blockIdx.y;
  const int n0 = split * chunk;
  const int count = min(chunk, total_seq - n0);  // >= 1: the host makes ceil(T / chunk) splits
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Step 1: the query rows, + b_q, rounded to ELEM (round_query 0: kept in float32, as ORT's float32 math of a
  // float16 graph sums q + b_q: the native route's call whose raw float16 query the kernel reads, fused_steps).
  const IN* q_rows = q + (long long)b * stride_qb + (long long)h * stride_qh;
  for (int idx = threadIdx.x; idx < q_seq * head_size; idx += SPLIT_THREADS) {
    const int i = idx / head_size;
    const int d = idx - i * head_size;
    float x = to_float<IN>(q_rows[(long long)i * stride_qs + d]);
    if (bias_q != nullptr) x += bias_q[(long long)h * head_size + d];
    q_s[idx] = round_query ? round_to<ELEM>(x) : x;
  }
  __syncthreads();

  // Steps 2-4: the logits of the chunk's keys, a warp per SPLIT_KEYS_PER_PASS keys at a time (their rows loaded
  // together: more loads in flight per warp).
  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const float* bias_k_h = bias_k == nullptr ? nullptr : bias_k + (long long)h * head_size;
  const float* offset_T = key_offset_BNT == nullptr ? nullptr : key_offset_BNT + bh * total_seq;
  constexpr int VEC = SplitLoad<IN>::N;            // elements a lane loads at once
  constexpr int PIECES = SPLIT_MAX_DIM / (32 * VEC);  // ... and how many times a row
  for (int base = warp * SPLIT_KEYS_PER_PASS; base < count; base += SPLIT_WARPS * SPLIT_KEYS_PER_PASS) {
    float kd[SPLIT_KEYS_PER_PASS][PIECES][VEC];
#pragma unroll
    for (int u = 0; u < SPLIT_KEYS_PER_PASS; ++u) {
      const IN* k_row = k_rows + (long long)(n0 + min(base + u, count - 1)) * stride_ks;
#pragma unroll
      for (int t = 0; t < PIECES; ++t) {
        const int d = VEC * (lane + 32 * t);
        if (d < head_size) {
          SplitLoad<IN>::load(k_row + d, kd[u][t]);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) kd[u][t][e] = 0.0f;
        }
      }
    }
    float acc[SPLIT_KEYS_PER_PASS][SPLIT_MAX_ROWS];
#pragma unroll
    for (int u = 0; u < SPLIT_KEYS_PER_PASS; ++u)
#pragma unroll
      for (int i = 0; i < SPLIT_MAX_ROWS; ++i) acc[u][i] = 0.0f;
#pragma unroll
    for (int t = 0; t < PIECES; ++t) {
      const int d0 = VEC * (lane + 32 * t);
      if (d0 >= head_size) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int d = d0 + e;
        const float bk = bias_k_h != nullptr ? bias_k_h[d] : 0.0f;
#pragma unroll
        for (int u = 0; u < SPLIT_KEYS_PER_PASS; ++u) {
          const float kr = round_to<ELEM>(bias_k_h != nullptr ? kd[u][t][e] + bk : kd[u][t][e]);
#pragma unroll
          for (int i = 0; i < SPLIT_MAX_ROWS; ++i) {
            if (i < q_seq) acc[u][i] = fmaf((q_s + i * head_size)[d], kr, acc[u][i]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < SPLIT_KEYS_PER_PASS; ++u)
#pragma unroll
      for (int i = 0; i < SPLIT_MAX_ROWS; ++i) {
        if (i < q_seq) acc[u][i] = warp_sum(acc[u][i]);  // q_seq is uniform: no divergent shuffle
      }
    if (lane < q_seq) {
      const int i = lane;
      const RowMask m = row_mask(mp, b, h, i);
#pragma unroll
      for (int u = 0; u < SPLIT_KEYS_PER_PASS; ++u) {
        const int jj = base + u;
        if (jj >= count) break;
        const int j = n0 + jj;
        float dot = acc[u][0];
#pragma unroll
        for (int r = 1; r < SPLIT_MAX_ROWS; ++r) dot = (i == r) ? acc[u][r] : dot;
        float x = fmaf(dot, scale, offset_T != nullptr ? offset_T[j] : 0.0f);  // = dot * scale without offsets
        if (query_offset_BNS != nullptr && j >= past_seq) x += query_offset_BNS[bh * q_seq + i];
        if (m.bias_T != nullptr) x += m.bias_T[j];                   // step 3
        (x_s + i * chunk)[jj] = masked_logit_per_key(x, mp, m, i, j);  // step 4
      }
    }
  }
  __syncthreads();

  // Step 5a: the chunk's max, p = exp(x - max) (max_used 0 for a row with no finite logit: p = 0, never NaN), sum.
  float2* ml = partial_ML + (bh * gridDim.y + split) * q_seq;
  for (int i = warp; i < q_seq; i += SPLIT_WARPS) {
    float* x_row = x_s + i * chunk;
    float m = NEG_INFINITY;
    for (int jj = lane; jj < count; jj += 32) m = fmaxf(m, x_row[jj]);
    m = warp_max(m);
    const float max_used = (m == NEG_INFINITY) ? 0.0f : m;
    float l = 0.0f;
    for (int jj = lane; jj < count; jj += 32) {
      const float p = exp2f((x_row[jj] - max_used) * LOG2E);
      x_row[jj] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) ml[i] = make_float2(m, l);
  }
  __syncthreads();

  // Step 5b: O_c = sum_j p_ij v_j, a warp per key, lanes over d.
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  const float* bias_v_h = bias_v == nullptr ? nullptr : bias_v + (long long)h * v_head_size;
  float o[SPLIT_MAX_ROWS][PIECES][VEC];
#pragma unroll
  for (int i = 0; i < SPLIT_MAX_ROWS; ++i)
#pragma unroll
    for (int t = 0; t < PIECES; ++t)
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[i][t][e] = 0.0f;
#pragma unroll 4
  for (int jj = warp; jj < count; jj += SPLIT_WARPS) {
    const IN* v_row = v_rows + (long long)(n0 + jj) * stride_vs;
    float p[SPLIT_MAX_ROWS];
#pragma unroll
    for (int i = 0; i < SPLIT_MAX_ROWS; ++i) p[i] = (i < q_seq) ? round_to<ELEM>((x_s + i * chunk)[jj]) : 0.0f;
#pragma unroll
    for (int t = 0; t < PIECES; ++t) {
      const int d0 = VEC * (lane + 32 * t);
      if (d0 < v_head_size) {
        float vv[VEC];
        SplitLoad<IN>::load(v_row + d0, vv);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float vd = vv[e];
          if (bias_v_h != nullptr) vd += bias_v_h[d0 + e];
          vd = round_to<ELEM>(vd);
#pragma unroll
          for (int i = 0; i < SPLIT_MAX_ROWS; ++i) o[i][t][e] = fmaf(p[i], vd, o[i][t][e]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < SPLIT_MAX_ROWS; ++i) {
    if (i >= q_seq) break;
#pragma unroll
    for (int t = 0; t < PIECES; ++t) {
      const int d0 = VEC * (lane + 32 * t);
      if (d0 >= v_head_size) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e) (o_s + (warp * q_seq + i) * v_head_size)[d0 + e] = o[i][t][e];
    }
  }
  __syncthreads();
  float* out = partial_O + (bh * gridDim.y + split) * q_seq * v_head_size;
  for (int idx = threadIdx.x; idx < q_seq * v_head_size; idx += SPLIT_THREADS) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < SPLIT_WARPS; ++w) sum += (o_s + w * q_seq * v_head_size)[idx];
    out[idx] = sum;
  }
}

// One (b, h, i) row: the splits' partial outputs weighed by exp(m_c - m) and divided by the weighed sum.
template <typename ELEM>
__global__ void __launch_bounds__(SPLIT_THREADS)
    combine_key_splits(const float* __restrict__ partial_O, const float2* __restrict__ partial_ML, int splits,
                       int heads, int q_seq, int v_head_size, float* __restrict__ out_BSD) {
  extern __shared__ float weight[];  // splits
  __shared__ float total;
  const long long bh = blockIdx.x / q_seq;
  const int i = (int)(blockIdx.x % q_seq);
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  float m = NEG_INFINITY;
  for (int c = 0; c < splits; ++c) m = fmaxf(m, partial_ML[(bh * splits + c) * q_seq + i].x);
  const float max_used = (m == NEG_INFINITY) ? 0.0f : m;
  for (int c = threadIdx.x; c < splits; c += SPLIT_THREADS) {
    weight[c] = exp2f((partial_ML[(bh * splits + c) * q_seq + i].x - max_used) * LOG2E);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float l = 0.0f;
    for (int c = 0; c < splits; ++c) l += partial_ML[(bh * splits + c) * q_seq + i].y * weight[c];
    total = l;
  }
  __syncthreads();
  const float inv = 1.0f / total;  // l = 0 (every logit -inf): 0/0 = NaN, as ORT
  const long long out_row = (((long long)b * q_seq + i) * heads + h) * v_head_size;
  for (int d = threadIdx.x; d < v_head_size; d += SPLIT_THREADS) {
    float o = 0.0f;
    for (int c = 0; c < splits; ++c) o = fmaf(partial_O[((bh * splits + c) * q_seq + i) * v_head_size + d], weight[c], o);
    out_BSD[out_row + d] = round_to<ELEM>(o * inv);
  }
}
