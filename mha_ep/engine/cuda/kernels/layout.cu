// Layout movers of the mha_ep attention pipeline (memory-bound, one thread per destination element).
//
// Layout legend: B batch, S query length, L new key/value length, P past length, T = P + L, N heads,
// H head size (of whichever tensor is moved), D = N*H. Host-facing tensors are float32; the attention operands
// are the compute dtype T (the template parameter ELEM).
//
// Index rule: every linear index is a long long, and every product of int geometry is promoted by casting its
// FIRST factor, `(long long)b * heads + h`, never `(long long)(b * heads + h)` (the cast after an int overflow).
#include "common.cuh"

// Row teams: the threads that move one destination row (dim / VEC groups of VEC values) are `team` consecutive
// lanes of one warp, team = the least power of two >= the groups, at most 32 (a team of 32 strides over longer
// rows). The lanes of a team can then sum a dot product over their row with shuffles. geometry.py row_team sizes
// the grid by the same rule (only the grid: the grid-stride loop covers any grid).
__device__ __forceinline__ int row_team(int groups) {
  int team = 1;
  while (team < groups && team < 32) team <<= 1;
  return team;
}

// One layout mover's arguments, passed by value (backend.py MOVER_FIELDS is this layout, field for field: the
// host builds it as a NumPy structured scalar). SRC is the sources' type, ELEM the operands'.
template <typename SRC, typename ELEM>
struct Mover {
  const SRC* cur;            // the current rows: BSNH (B, L, N, H) or BNSH (B, N, L, H)
  const SRC* past_BNPH;      // the past rows, or null
  const SRC* bias_NH;        // the per-(head, dim) bias, or null
  ELEM* dst_BNTH;            // the dense operand
  float* dst_f32_BNTH;       // its float32 present, or null (the bridge)
  ELEM* dst_present_BNTH;    // its present in ELEM apart from the operand, or null (device-resident mode)
  const SRC* offset_weight_NH;  // step 5 (below): the offsets' weight, or null
  float* offset_BNR;         // step 5: one float32 per row, or null (no offsets)
  int cur_is_bnsh;
  int bias_in_operand;
  int offset_adds_bias;
  int offset_guard;
  float offset_scale;
  int cur_seq;
  int past_seq;
  int dim;
  int cur_slots;             // BSNH rows of a packed input: slots a head holds (3 QKV, 2 KV; 1 plain), read in place
};

// Build a dense (B, N, P+L, H) operand in one pass:
//   1. rows s < P come from past_BNPH (the KV cache is prepended along the sequence axis);
//   2. rows s >= P come from the current tensor, read as BSNH (B, L, N, H) or BNSH (B, N, L, H); a BSNH source
//      may be one slot of a packed input (B, L, N, cur_slots, H), cur pointing at the slot's first element;
//   3. the per-(head, dim) bias is added to the current rows only (ORT: never to the past; the host passes
//      null for BNSH key/value, whose bias ORT ignores);
//   4. the float sum is rounded once to ELEM and stored; when dst_f32_BNTH is given, the same rounded value is
//      also stored as float32 (the present_key / present_value output the host downloads), and when
//      dst_present_BNTH is given, in ELEM (device-resident mode's present).
//   5. when offset_BNR is given, one float32 per row (the scores' offsets of a float16 / bfloat16 call,
//      dispatch.py score_terms), from the row this pass stores in dst_BNTH:
//        offset_BNR[b, h, s] = offset_scale * sum_d (dst[b, h, s, d] + [offset_adds_bias] bias[h, d])
//                                                   * offset_weight[h, d]      (no weight: 0)
//                              + [offset_guard] 0 * sum_d bias[h, d]
//      The key mover gives the key offsets (weight b_q); the query mover the query offsets (its bias b_q added,
//      weight b_k). The guard is NaN when the bias is not finite: the host asks for it where it leaves out the
//      query offsets of a key bias (score_terms), so that the scores are NaN as in ORT.
// bias_in_operand 0 (float16 / bfloat16 query and key: dispatch.py score_terms): the operand dst_BNTH gets the
// rows without the bias (exact), the presents still get them with it (and the bias is read only where a stored
// form or an offset needs it).
// The query uses this too, with P = 0: (B, S, D) + b_q -> (B, N, S, H).
// SRC: float for the float32 transport arrays (build_dense_BNTH), ELEM for tensors already in the compute dtype
// (build_dense_BNTH_native, device-resident mode), each value widened to float on load.
// VEC: consecutive d handled by one thread per step (4: 16-byte loads; the host picks it when every moved head
// size is a multiple of 4, which with its 256-byte aligned buffers makes every access aligned).
// The host launches blocks of whole warps (LAUNCH_BLOCK): a warp's lanes take the same trips through the loop.
template <typename ELEM, int VEC, typename SRC>
__device__ __forceinline__ void build_dense_rows(const Mover<SRC, ELEM>& m, int batch, int heads) {
  const int dim = m.dim;
  const int past_seq = m.past_seq;
  const int cur_seq = m.cur_seq;
  const int total = past_seq + cur_seq;  // the host checked that P + L fits an int
  const int groups = dim / VEC;          // VEC-wide groups of one row
  const int team = row_team(groups);
  const int team_log2 = __ffs(team) - 1;
  const long long rows = (long long)batch * heads * total;
  const long long threads = rows * team;  // whole teams: a team is all inside the loop or all outside
  const bool fits_u32 = rows <= U32_LIMIT;
  const bool offsets = m.offset_BNR != nullptr;
  const bool bias_read = m.bias_NH != nullptr && (m.bias_in_operand || m.dst_f32_BNTH != nullptr ||
                                                  m.dst_present_BNTH != nullptr ||
                                                  (offsets && (m.offset_adds_bias || m.offset_guard)));
  const int lane = threadIdx.x & 31;
  for (long long warp_first = grid_first_index() - lane; warp_first < threads; warp_first += grid_stride()) {
    const long long idx = warp_first + lane;
    const long long row = idx >> team_log2;       // (b, h, s) of the destination row
    const int member = (int)(idx & (team - 1));  // this lane's place in the row's team
    float dot = 0.0f;
    float guard = 0.0f;
    if (idx < threads) {
      int s, h, b;
      unravel3(row, fits_u32, total, heads, s, h, b);
      for (int d = member * VEC; d < dim; d += team * VEC) {
        float value[VEC];
        float biased[VEC];
        float bias[VEC] = {};
        if (s < past_seq) {
          // Step 1: the past rows.
          load_as_floats<SRC, VEC>(m.past_BNPH + (((long long)b * heads + h) * past_seq + s) * dim + d, value);
        } else {
          // Step 2: the current rows, from either layout.
          const int sc = s - past_seq;
          if (m.cur_is_bnsh) {
            load_as_floats<SRC, VEC>(m.cur + (((long long)b * heads + h) * cur_seq + sc) * dim + d, value);
          } else {
            load_as_floats<SRC, VEC>(m.cur + (((long long)b * cur_seq + sc) * heads + h) * (m.cur_slots * dim) + d,
                                     value);
          }
        }
        if (bias_read && (s >= past_seq || m.offset_guard)) {
          load_as_floats<SRC, VEC>(m.bias_NH + (long long)h * dim + d, bias);
        }
        // Step 3: the bias of this head and dim, on the current rows (without one, the value as it is: -0 stays -0).
#pragma unroll
        for (int k = 0; k < VEC; ++k) biased[k] = s >= past_seq && bias_read ? value[k] + bias[k] : value[k];
        // Step 4: one rounding to the compute dtype for each stored form.
        const long long dst = row * dim + d;
        ELEM stored[VEC];
        ELEM present[VEC];
        float rounded[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          present[k] = from_float<ELEM>(biased[k]);
          rounded[k] = to_float<ELEM>(present[k]);
          stored[k] = m.bias_in_operand ? present[k] : from_float<ELEM>(value[k]);
        }
        store_elems<ELEM, VEC>(m.dst_BNTH + dst, stored);
        if (m.dst_f32_BNTH != nullptr) store_floats<VEC>(m.dst_f32_BNTH + dst, rounded);
        if (m.dst_present_BNTH != nullptr) store_elems<ELEM, VEC>(m.dst_present_BNTH + dst, present);
        // Step 5: this lane's share of the row's offset.
        if (offsets) {
          float weight[VEC] = {};
          if (m.offset_weight_NH != nullptr) {
            load_as_floats<SRC, VEC>(m.offset_weight_NH + (long long)h * dim + d, weight);
          }
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float x = to_float<ELEM>(stored[k]) + (m.offset_adds_bias ? bias[k] : 0.0f);
            dot = fmaf(x, weight[k], dot);
            if (m.offset_guard) guard += 0.0f * bias[k];
          }
        }
      }
    }
    if (offsets) {  // uniform across the mover's blocks: every lane of the warp shuffles
#pragma unroll
      for (int step = 16; step > 0; step >>= 1) {
        if (step < team) {
          dot += __shfl_xor_sync(0xffffffffu, dot, step);
          guard += __shfl_xor_sync(0xffffffffu, guard, step);
        }
      }
      if (idx < threads && member == 0) m.offset_BNR[row] = m.offset_scale * dot + guard;
    }
  }
}

// The three movers of a call in one launch (small memory-bound kernels are latency-bound: one launch keeps
// three times the loads in flight): blockIdx.y 0, 1, 2 move Q, K, V, each over the x grid.
template <typename ELEM, int VEC, typename SRC>
__device__ __forceinline__ void build_three(const Mover<SRC, ELEM>& q, const Mover<SRC, ELEM>& k,
                                            const Mover<SRC, ELEM>& v, int batch, int heads) {
  if (blockIdx.y == 0) {
    build_dense_rows<ELEM, VEC, SRC>(q, batch, heads);
  } else if (blockIdx.y == 1) {
    build_dense_rows<ELEM, VEC, SRC>(k, batch, heads);
  } else {
    build_dense_rows<ELEM, VEC, SRC>(v, batch, heads);
  }
}

// The bridge: sources are the float32 transport arrays, presents float32 (dst_f32_BNTH).
template <typename ELEM, int VEC>
__global__ void build_dense_BNTH(const Mover<float, ELEM> q, const Mover<float, ELEM> k,
                                 const Mover<float, ELEM> v, int batch, int heads) {
  build_three<ELEM, VEC, float>(q, k, v, batch, heads);
}

// Device-resident mode: sources in the compute dtype. A wanted present whose values the operand holds *is*
// dst_BNTH (the host passes the present buffer as the operand); one that holds a bias the operand leaves out is
// dst_present_BNTH. There is no float32 mirror.
template <typename ELEM, int VEC>
__global__ void build_dense_BNTH_native(const Mover<ELEM, ELEM> q, const Mover<ELEM, ELEM> k,
                                        const Mover<ELEM, ELEM> v, int batch, int heads) {
  build_three<ELEM, VEC, ELEM>(q, k, v, batch, heads);
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

// A node's ELEM tensor (float16 / bfloat16, as ORT hands it to the native route) -> float32, exact: the inputs of
// the float32 pipeline (pipeline.py step 3) and attention_bias, which every kernel reads as float32. VEC as above.
template <typename ELEM, int VEC>
__global__ void widen_to_float(const ELEM* __restrict__ src, float* __restrict__ dst, long long count) {
  for (long long idx = grid_first_index(); idx < count / VEC; idx += grid_stride()) {
    float value[VEC];
    load_as_floats<ELEM, VEC>(src + idx * VEC, value);
    store_floats<VEC>(dst + idx * VEC, value);
  }
}

// ORT's raw key_padding_mask (int32 or int64) -> the kernels' forms, read as ORT's CPU kernel reads it
// (problem.py resolve_padding_mask; the bridge does the same on the host):
//   resolve_key_lengths: a (B,) or (3B+2,) mask: key lengths are the first B entries, clamped to [0, T];
//   resolve_keep_flags:  a (B, T) or (B, S, T) mask: key kept (1) iff its value is > 0.
template <typename M>
__global__ void resolve_key_lengths(const M* __restrict__ mask, int* __restrict__ lengths_B, int batch,
                                    int total_seq) {
  for (long long b = grid_first_index(); b < batch; b += grid_stride()) {
    const long long value = (long long)mask[b];
    lengths_B[b] = (int)(value < 0 ? 0 : (value > total_seq ? total_seq : value));
  }
}

template <typename M>
__global__ void resolve_keep_flags(const M* __restrict__ mask, unsigned char* __restrict__ keep, long long count) {
  for (long long idx = grid_first_index(); idx < count; idx += grid_stride()) {
    keep[idx] = mask[idx] > 0 ? 1 : 0;
  }
}
