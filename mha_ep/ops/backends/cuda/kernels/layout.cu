// Layout movers of the mha_ep attention pipeline (memory-bound, one thread per destination element).
//
// Layout legend: B batch, S query length, L new key/value length, P past length, T = P + L, N heads,
// H head size (of whichever tensor is moved), D = N*H. Host-facing tensors are float32; the attention operands
// are the compute dtype T (the template parameter ELEM).
//
// Index rule: every linear index is a long long, and every product of int geometry is promoted by casting its
// FIRST factor, `(long long)b * heads + h`, never `(long long)(b * heads + h)` (the cast after an int overflow).
#include "common.cuh"

// Build a dense (B, N, P+L, H) operand in one pass:
//   1. rows s < P come from past_BNPH (the KV cache is prepended along the sequence axis);
//   2. rows s >= P come from the current tensor, read as BSNH (B, L, N, H) or BNSH (B, N, L, H);
//   3. the per-(head, dim) bias is added to the current rows only (ORT: never to the past; the host passes
//      null for BNSH key/value, whose bias ORT ignores);
//   4. the float sum is rounded once to ELEM and stored; when dst_f32_BNTH is given, the same rounded value is
//      also stored as float32 (the present_key / present_value output the host downloads), and when
//      dst_present_BNTH is given, in ELEM (device-resident mode's present).
// bias_in_operand 0 (float16 / bfloat16 query and key: dispatch.py score_terms): the operand dst_BNTH gets the
// rows without the bias (exact), the presents still get them with it (and without a present the bias is not read).
// The query uses this kernel too, with P = 0: (B, S, D) + b_q -> (B, N, S, H).
// SRC is the sources' type: float for the float32 transport arrays (build_dense_BNTH), ELEM for tensors already
// in the compute dtype (build_dense_BNTH_native, device-resident mode), each value widened to float on load.
// VEC: consecutive d handled by one thread (4: 16-byte loads; the host picks it when dim % 4 == 0, which with its
// 256-byte aligned buffers makes every access aligned). Several values per thread keep loads in flight.
template <typename ELEM, int VEC, typename SRC>
__device__ __forceinline__ void build_dense_rows(const SRC* __restrict__ cur, int cur_is_bnsh,
                                                 const SRC* __restrict__ past_BNPH, const SRC* __restrict__ bias_NH,
                                                 int bias_in_operand, ELEM* __restrict__ dst_BNTH,
                                                 float* __restrict__ dst_f32_BNTH,
                                                 ELEM* __restrict__ dst_present_BNTH, int batch, int heads,
                                                 int cur_seq, int past_seq, int dim) {
  const int total = past_seq + cur_seq;  // the host checked that P + L fits an int
  const int groups = dim / VEC;          // VEC-wide groups of one row
  const long long count = (long long)batch * heads * total * groups;
  const bool fits_u32 = count <= U32_LIMIT;
  const bool bias_stored = bias_NH != nullptr && (bias_in_operand || dst_f32_BNTH != nullptr ||
                                                  dst_present_BNTH != nullptr);
  for (long long idx = grid_first_index(); idx < count; idx += grid_stride()) {
    // Step 0: destination coordinates (b, h, s, d..d+VEC) of this group.
    int g, s, h, b;
    unravel4(idx, fits_u32, groups, total, heads, g, s, h, b);
    const int d = g * VEC;
    float value[VEC];
    float biased[VEC];
    if (s < past_seq) {
      // Step 1: the past rows.
      load_as_floats<SRC, VEC>(past_BNPH + (((long long)b * heads + h) * past_seq + s) * dim + d, value);
    } else {
      // Step 2: the current rows, from either layout.
      const int sc = s - past_seq;
      if (cur_is_bnsh) {
        load_as_floats<SRC, VEC>(cur + (((long long)b * heads + h) * cur_seq + sc) * dim + d, value);
      } else {
        load_as_floats<SRC, VEC>(cur + (((long long)b * cur_seq + sc) * heads + h) * dim + d, value);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) biased[k] = value[k];
    if (s >= past_seq && bias_stored) {
      // Step 3: the bias of this head and dim.
      float bias[VEC];
      load_as_floats<SRC, VEC>(bias_NH + (long long)h * dim + d, bias);
#pragma unroll
      for (int k = 0; k < VEC; ++k) biased[k] += bias[k];
    }
    // Step 4: one rounding to the compute dtype for each stored form.
    const long long dst = idx * VEC;
    ELEM stored[VEC];
    ELEM present[VEC];
    float rounded[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      present[k] = from_float<ELEM>(biased[k]);
      rounded[k] = to_float<ELEM>(present[k]);
      stored[k] = bias_in_operand ? present[k] : from_float<ELEM>(value[k]);
    }
    store_elems<ELEM, VEC>(dst_BNTH + dst, stored);
    if (dst_f32_BNTH != nullptr) store_floats<VEC>(dst_f32_BNTH + dst, rounded);
    if (dst_present_BNTH != nullptr) store_elems<ELEM, VEC>(dst_present_BNTH + dst, present);
  }
}

template <typename ELEM, int VEC>
__global__ void build_dense_BNTH(const float* __restrict__ cur, int cur_is_bnsh,
                                 const float* __restrict__ past_BNPH, const float* __restrict__ bias_NH,
                                 int bias_in_operand, ELEM* __restrict__ dst_BNTH, float* __restrict__ dst_f32_BNTH,
                                 int batch, int heads, int cur_seq, int past_seq, int dim) {
  build_dense_rows<ELEM, VEC, float>(cur, cur_is_bnsh, past_BNPH, bias_NH, bias_in_operand, dst_BNTH, dst_f32_BNTH,
                                     nullptr, batch, heads, cur_seq, past_seq, dim);
}

// Device-resident mode: sources in the compute dtype. A wanted present whose values the operand holds *is*
// dst_BNTH (the host passes the present buffer as the operand); one that holds a bias the operand leaves out is
// dst_present_BNTH. There is no float32 mirror.
template <typename ELEM, int VEC>
__global__ void build_dense_BNTH_native(const ELEM* __restrict__ cur, int cur_is_bnsh,
                                        const ELEM* __restrict__ past_BNPH, const ELEM* __restrict__ bias_NH,
                                        int bias_in_operand, ELEM* __restrict__ dst_BNTH,
                                        ELEM* __restrict__ dst_present_BNTH, int batch, int heads, int cur_seq,
                                        int past_seq, int dim) {
  build_dense_rows<ELEM, VEC, ELEM>(cur, cur_is_bnsh, past_BNPH, bias_NH, bias_in_operand, dst_BNTH, nullptr,
                                    dst_present_BNTH, batch, heads, cur_seq, past_seq, dim);
}

// Context (B, N, S, Hv) float32 accumulators of the P.V GEMM -> output (B, S, N*Hv) float32, each value rounded
// to ELEM first (the node's output dtype; the Cast back to it in the graph is then exact). VEC as above.
template <typename ELEM, int VEC>
__global__ void context_to_BSD(const float* __restrict__ ctx_BNSH, float* __restrict__ out_BSD, int batch,
                               int heads, int seq, int dim) {
  const int groups = dim / VEC;
  const long long count = (long long)batch * seq * heads * groups;
  const bool fits_u32 = count <= U32_LIMIT;
  for (long long idx = grid_first_index(); idx < count; idx += grid_stride()) {
    // The destination index walks (b, s, h, d): writes are coalesced, reads are coalesced within one head.
    int g, h, s, b;
    unravel4(idx, fits_u32, groups, heads, seq, g, h, s, b);
    float value[VEC];
    load_floats<VEC>(ctx_BNSH + (((long long)b * heads + h) * seq + s) * dim + g * VEC, value);
#pragma unroll
    for (int k = 0; k < VEC; ++k) value[k] = round_to<ELEM>(value[k]);
    store_floats<VEC>(out_BSD + idx * VEC, value);
  }
}

// Output (B, S, Dv) float32 whose values are already rounded to ELEM -> the node's ELEM output (exact).
template <typename ELEM, int VEC>
__global__ void narrow_output(const float* __restrict__ src, ELEM* __restrict__ dst, long long count) {
  for (long long idx = grid_first_index(); idx < count / VEC; idx += grid_stride()) {
    float value[VEC];
    load_floats<VEC>(src + idx * VEC, value);
    ELEM stored[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) stored[k] = from_float<ELEM>(value[k]);
    store_elems<ELEM, VEC>(dst + idx * VEC, stored);
  }
}

// The offsets of a float16 / bfloat16 call's scores (dispatch.py score_terms): the projection biases' shares of
// every score, in float32, from the exact (unbiased) operands the attention kernels read. One kernel, two uses:
//   key offsets    out[b, h, j] = scale * sum_d k_BNTH[b, h, j, d] * bias_q[h, d]              (add null)
//   query offsets  out[b, h, i] = scale * sum_d (q_BNSH[b, h, i, d] + bias_q[h, d]) * bias_k[h, d]
// i.e. out[b, h, r] = scale * sum_d (x[b, h, r, d] + add[h, d]) * weight[h, d] over the rows r of x (B, N, R, H),
// weight null: 0. guard (a key bias whose query offsets the host leaves out, P = 0) adds 0 * sum_d guard[h, d]:
// NaN when it is not finite, as ORT's scores then are.
// One warp per row: lanes stride over d, then a shuffle sum. SRC is the biases' type (float: the bridge's float32
// transport; ELEM: device-resident mode).
template <typename ELEM, typename SRC>
__device__ __forceinline__ void bias_dot_rows(const ELEM* __restrict__ x_BNRH, const SRC* __restrict__ add_NH,
                                              const SRC* __restrict__ weight_NH, const SRC* __restrict__ guard_NH,
                                              float scale, float* __restrict__ out_BNR, int batch, int heads,
                                              int rows_per_head, int dim) {
  const long long rows = (long long)batch * heads * rows_per_head;
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows; row += warps) {
    const long long h_at = (long long)((row / rows_per_head) % heads) * dim;
    const ELEM* x_row = x_BNRH + row * dim;
    float dot = 0.0f;
    float guard = 0.0f;
    for (int d = lane; d < dim; d += 32) {
      if (weight_NH != nullptr) {
        float x = to_float<ELEM>(x_row[d]);
        if (add_NH != nullptr) x += to_float<SRC>(add_NH[h_at + d]);
        dot = fmaf(x, to_float<SRC>(weight_NH[h_at + d]), dot);
      }
      if (guard_NH != nullptr) guard += 0.0f * to_float<SRC>(guard_NH[h_at + d]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      guard += __shfl_xor_sync(0xffffffffu, guard, offset);
    }
    if (lane == 0) out_BNR[row] = scale * dot + guard;
  }
}

template <typename ELEM>
__global__ void bias_dot(const ELEM* __restrict__ x_BNRH, const float* __restrict__ add_NH,
                         const float* __restrict__ weight_NH, const float* __restrict__ guard_NH, float scale,
                         float* __restrict__ out_BNR, int batch, int heads, int rows_per_head, int dim) {
  bias_dot_rows<ELEM, float>(x_BNRH, add_NH, weight_NH, guard_NH, scale, out_BNR, batch, heads, rows_per_head, dim);
}

template <typename ELEM>
__global__ void bias_dot_native(const ELEM* __restrict__ x_BNRH, const ELEM* __restrict__ add_NH,
                                const ELEM* __restrict__ weight_NH, const ELEM* __restrict__ guard_NH, float scale,
                                float* __restrict__ out_BNR, int batch, int heads, int rows_per_head, int dim) {
  bias_dot_rows<ELEM, ELEM>(x_BNRH, add_NH, weight_NH, guard_NH, scale, out_BNR, batch, heads, rows_per_head, dim);
}
