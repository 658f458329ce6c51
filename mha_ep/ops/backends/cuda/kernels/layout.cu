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
//      also stored as float32 (the present_key / present_value output the host downloads).
// The query uses this kernel too, with P = 0: (B, S, D) + b_q -> (B, N, S, H).
// SRC is the sources' type: float for the float32 transport arrays (build_dense_BNTH), ELEM for tensors already
// in the compute dtype (build_dense_BNTH_native, device-resident mode), each value widened to float on load.
// VEC: consecutive d handled by one thread (4: 16-byte loads; the host picks it when dim % 4 == 0, which with its
// 256-byte aligned buffers makes every access aligned). Several values per thread keep loads in flight.
template <typename ELEM, int VEC, typename SRC>
__device__ __forceinline__ void build_dense_rows(const SRC* __restrict__ cur, int cur_is_bnsh,
                                                 const SRC* __restrict__ past_BNPH, const SRC* __restrict__ bias_NH,
                                                 ELEM* __restrict__ dst_BNTH, float* __restrict__ dst_f32_BNTH,
                                                 int batch, int heads, int cur_seq, int past_seq, int dim) {
  const int total = past_seq + cur_seq;  // the host checked that P + L fits an int
  const int groups = dim / VEC;          // VEC-wide groups of one row
  const long long count = (long long)batch * heads * total * groups;
  const bool fits_u32 = count <= U32_LIMIT;
  for (long long idx = grid_first_index(); idx < count; idx += grid_stride()) {
    // Step 0: destination coordinates (b, h, s, d..d+VEC) of this group.
    int g, s, h, b;
    unravel4(idx, fits_u32, groups, total, heads, g, s, h, b);
    const int d = g * VEC;
    float value[VEC];
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
      // Step 3: the bias of this head and dim.
      if (bias_NH != nullptr) {
        float bias[VEC];
        load_as_floats<SRC, VEC>(bias_NH + (long long)h * dim + d, bias);
#pragma unroll
        for (int k = 0; k < VEC; ++k) value[k] += bias[k];
      }
    }
    // Step 4: one rounding to the compute dtype, mirrored into the float32 present buffer when asked for.
    const long long dst = idx * VEC;
    ELEM stored[VEC];
    float rounded[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      stored[k] = from_float<ELEM>(value[k]);
      rounded[k] = to_float<ELEM>(stored[k]);
    }
    store_elems<ELEM, VEC>(dst_BNTH + dst, stored);
    if (dst_f32_BNTH != nullptr) store_floats<VEC>(dst_f32_BNTH + dst, rounded);
  }
}

template <typename ELEM, int VEC>
__global__ void build_dense_BNTH(const float* __restrict__ cur, int cur_is_bnsh,
                                 const float* __restrict__ past_BNPH, const float* __restrict__ bias_NH,
                                 ELEM* __restrict__ dst_BNTH, float* __restrict__ dst_f32_BNTH, int batch,
                                 int heads, int cur_seq, int past_seq, int dim) {
  build_dense_rows<ELEM, VEC, float>(cur, cur_is_bnsh, past_BNPH, bias_NH, dst_BNTH, dst_f32_BNTH, batch, heads,
                                     cur_seq, past_seq, dim);
}

// Device-resident mode: sources in the compute dtype. A wanted present *is* dst_BNTH (the host passes the present
// buffer as the operand), so there is no float32 mirror.
template <typename ELEM, int VEC>
__global__ void build_dense_BNTH_native(const ELEM* __restrict__ cur, int cur_is_bnsh,
                                        const ELEM* __restrict__ past_BNPH, const ELEM* __restrict__ bias_NH,
                                        ELEM* __restrict__ dst_BNTH, int batch, int heads, int cur_seq,
                                        int past_seq, int dim) {
  build_dense_rows<ELEM, VEC, ELEM>(cur, cur_is_bnsh, past_BNPH, bias_NH, dst_BNTH, nullptr, batch, heads,
                                    cur_seq, past_seq, dim);
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
