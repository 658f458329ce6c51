// Attention of a few query rows over many keys (a decode step: S <= SPLIT_MAX_ROWS), the keys split across blocks
// (flash-decoding). The flash kernels (flash_attention.cu) give a block 64 query rows of one (b, h) and walk every
// key in it: at S = 1 that is B*N blocks, each a long serial walk with 63 of its 64 rows idle (Whisper tiny's cross
// attention, B = 1, T = 1500: 6 blocks, many times as long as the keys and values take to read; docs/BENCH.md,
// "Kernel notes"). Here, in one launch (split_keys.py "stream", the default):
//   split_key_stream<ELEM, IN>      grid (B*N, splits): block (bh, c) takes keys [c*span, min((c+1)*span, T)) for
//                                   every query row of (b, h), writes the span's unnormalised output O_c, its max
//                                   m_c and its sum l_c (partial_O, partial_ML), and counts its arrival
//                                   (arrivals[bh], zeroed by the host before the launch); the last block of (b, h)
//                                   to arrive combines the splits as combine_key_splits does (combine_row).
// or in two (split_keys.py "pair", the earlier kernels, kept for A/B timing):
//   split_key_attention<ELEM, IN>   grid (B*N, splits): block (bh, c) takes keys [c*chunk, min((c+1)*chunk, T)) and
//                                   writes O_c, m_c and l_c;
//   combine_key_splits<ELEM>        grid B*N*S: m = max m_c, l = sum l_c exp(m_c - m),
//                                   out = (sum O_c exp(m_c - m)) / l, rounded to ELEM, stored BSNH in ELEM at
//                                   out_narrow_BSD when the host gives it (the node's own float16 / bfloat16
//                                   output: no narrowing launch after), else as float32 at out_BSD.
// The arguments up to out_narrow_BSD are flash_attention_*'s (fused.py fused_step), with the same meaning,
// semantics and strides (flash_attention.cu's header, steps 1-5): q, k, v rounded to ELEM after the projection
// bias, x = fma(q.k, scale, key_offset[j]) (+ query_offset[i] for j >= P), + attention_bias, causal
// (+FLOAT32_LOWEST) or padding (+mask_filter_value); p = exp(x - m_c) in float32 with m_c the max over the block's
// keys, P.V with p rounded to ELEM (as the tensor-core kernel rounds its P fragments; no-op in float32), the sum of
// p unrounded. A row with no finite logit gives 0/0 = NaN, as ORT.
// Nothing is skipped (no causal-tile vote): every key's p is computed, an exact 0 where flash skips.
// qk_BNST (when not null): output 3, each masked logit x stored as it is computed, float32 (B, N, S, T)
// (docs/SEMANTICS.md §3.8): the scores of a decode step's qk cost one store each, no second pass.
//
// In a block of SPLIT_THREADS: the kernel is a stream of K and V. A split_key_attention block asks for its whole
// chunk of both, K then V, as two cp.async groups into shared memory (the chunk is sized to fit,
// dispatch.key_split), and computes while V is still arriving: a warp that loaded a few rows and waited for them
// before the next kept the read at a fraction of HBM's rate (docs/BENCH.md section 6). But then a block computes
// with nothing in flight, and at Whisper's shapes the grid runs in two rounds of load-then-compute. A
// split_key_stream block walks a longer span through STREAM_STAGES tiles of shared memory, each a tile of K or of
// V rows (its K tiles, then its V tiles): it computes tile t while tiles t+1 .. t+STREAM_STAGES-1 load, so one
// round of blocks (dispatch.key_stream) keeps HBM busy to the end. The query rows (floats, ELEM-rounded unless
// round_query is 0) sit in shared memory and, each lane's slice of them, in registers. A key row is read from
// shared memory by a group of lanes, 16 bytes a lane (split_lanes: 8 lanes for a float16 head of 64, 16 for a
// float32 one), the group's dot products summed by shuffles; a warp per row takes the block's max, exponentials
// and sum; P.V again by lane groups over keys, summed across groups by shuffles and across warps in shared
// memory.
//
// Index rule as in layout.cu: promote the first factor of every product, `(long long)b * stride_b`; shared-memory
// rows (under 64 KiB) are formed in int as row pointers, `(x_s + i * chunk)[jj]`.
#include "common.cuh"
#include "flash_common.cuh"
#include "row_loads.cuh"  // SplitLoad: the host checks aligned addresses and strides (fused.py _check_aligned)

#ifndef SPLIT_THREADS  // (scripts/split_key_sweep.py overrides the three #ifndef settings)
#define SPLIT_THREADS 128  // fused.py SPLIT_THREADS
#endif
#define SPLIT_WARPS (SPLIT_THREADS / 32)
#define SPLIT_MAX_ROWS 4   // dispatch.py SPLIT_MAX_ROWS: query rows a block holds (one warp each in the softmax)
#ifndef SPLIT_LOADS_IN_FLIGHT
#define SPLIT_LOADS_IN_FLIGHT 4  // 16-byte loads a lane issues before it uses the first
#endif
#ifndef SPLIT_BLOCKS_PER_SM
#define SPLIT_BLOCKS_PER_SM 4  // resident blocks the registers allow (SPLIT_SHARED_BYTES allows 4 too)
#endif
#define SPLIT_MAX_DIM 128  // dispatch.py SPLIT_MAX_DIM: head sizes (H, Hv) a warp covers, 16 bytes a lane

// (row, column) of element idx = threadIdx.x, threadIdx.x + SPLIT_THREADS, ... of a row-major walk with `width`
// columns, kept as a pair and advanced without a division. Why: inside a decode step, where the GEMMs have read
// tens of MB since the kernel's last launch, it runs slower than alone (docs/BENCH.md section 11, run 4), and its
// code, fetched through the L2, is a suspect; the strided copy loops, unrolled with an integer division per
// element, were much of that code. The loops that use the walk stay rolled (#pragma unroll 1).
struct RowWalk {
  int r, c, dr, dc, width;
  __device__ __forceinline__ explicit RowWalk(int w)
      : r(threadIdx.x / w), c(threadIdx.x - (threadIdx.x / w) * w), dr(SPLIT_THREADS / w),
        dc(SPLIT_THREADS - (SPLIT_THREADS / w) * w), width(w) {}
  __device__ __forceinline__ void next() {
    r += dr;
    c += dc;
    if (c >= width) {
      c -= width;
      ++r;
    }
  }
};

// ---------------------------------------------------------------------------------------- the steps of a block
// Step 1: the query rows of (b, h), + b_q, into q_s as floats, rounded to ELEM (round_query 0: kept in float32, as
// ORT's float32 math of a float16 graph sums q + b_q: the native route's call whose raw float16 query the kernel
// reads, fused_steps).
template <typename ELEM, typename IN>
__device__ __forceinline__ void split_query_rows(float* __restrict__ q_s, const IN* __restrict__ q_rows,
                                                 long long stride_qs, const IN* __restrict__ bias_q, int h,
                                                 int q_seq, int head_size, int round_query) {
  RowWalk walk(head_size);
#pragma unroll 1
  for (int idx = threadIdx.x; idx < q_seq * head_size; idx += SPLIT_THREADS, walk.next()) {
    const int i = walk.r;
    const int d = walk.c;
    float x = to_float<IN>(q_rows[(long long)i * stride_qs + d]);
    if (bias_q != nullptr) x += to_float<IN>(bias_q[(long long)h * head_size + d]);
    q_s[idx] = round_query ? round_to<ELEM>(x) : x;
  }
}

// What steps 2-4 read beside the K rows: the query rows in shared memory, the bias and offsets, the masks.
template <typename IN> struct SplitScores {
  const float* q_s;
  const IN* bias_k;               // (N * H) in IN, or null
  const float* offset_T;          // key_offset_BNT's row of (b, h) or null
  const float* query_offset_BNS;  // or null
  float* qk_BNST;                 // output 3 or null
  MaskParams mp;
  float scale;
  long long bh;
  int b, h, head_size;
};

// Steps 2-4 for `rows` K rows in shared memory (row r at k_tile + r * head_size: key key0 + r): each query row's
// logit of key key0 + r into x_s at column x0 + r (rows x_stride apart), and into qk_BNST when it is asked for.
// Lane `sub` of group `g` holds elements [sub*VEC, sub*VEC + VEC) of the query rows and of key rows
// base + u*groups + g, u < U.
template <typename ELEM, typename IN, int ROWS>
__device__ __forceinline__ void split_logits(const SplitScores<IN>& sc, const IN* k_tile, int rows, int key0, int x0,
                                             float* x_s, int x_stride, int warp, int lane) {
  constexpr int VEC = SplitLoad<IN>::N;
  constexpr int U = SPLIT_LOADS_IN_FLIGHT;
  const int head_size = sc.head_size;
  const int q_seq = sc.mp.q_seq;
  // K rows are rounded to ELEM after their bias; without one an ELEM row is left as it is
  const bool round_k = !same_type<ELEM, IN>::value || sc.bias_k != nullptr;
  const int lanes = split_lanes<IN>(head_size);
  const int groups = 32 / lanes;
  const int sub = lane & (lanes - 1);
  const int g = lane / lanes;
  const int d0 = sub * VEC;
  const bool reads = d0 < head_size;
  float q_r[ROWS][VEC];
  float bk[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    bk[e] = (reads && sc.bias_k != nullptr) ? to_float<IN>(sc.bias_k[(long long)sc.h * head_size + d0 + e]) : 0.0f;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) q_r[i][e] = (reads && i < q_seq) ? (sc.q_s + i * head_size)[d0 + e] : 0.0f;
  }
  for (int base = warp * groups * U; base < rows; base += SPLIT_WARPS * groups * U) {
    float kd[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = min(base + u * groups + g, rows - 1);
      if (reads) {
        SplitLoad<IN>::load((k_tile + r * head_size) + d0, kd[u]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kd[u][e] = 0.0f;
      }
    }
    float acc[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < ROWS; ++i) acc[u][i] = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float kr = round_k ? round_to<ELEM>(kd[u][e] + bk[e]) : kd[u][e];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
          if (i < q_seq) acc[u][i] = fmaf(q_r[i][e], kr, acc[u][i]);
        }
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        if (i < q_seq) acc[u][i] = group_sum(acc[u][i], lanes);  // q_seq and lanes are uniform
      }
    }
    if (sub == 0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int r = base + u * groups + g;
        if (r >= rows) break;
        const int j = key0 + r;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
          if (i >= q_seq) break;
          float x = fmaf(acc[u][i], sc.scale, sc.offset_T != nullptr ? sc.offset_T[j] : 0.0f);  // = dot * scale
          if (sc.query_offset_BNS != nullptr && j >= sc.mp.past_seq) x += sc.query_offset_BNS[sc.bh * q_seq + i];
          const RowMask m = row_mask(sc.mp, sc.b, sc.h, i);
          if (m.bias_T != nullptr) x += m.bias_T[j];
          const float logit = masked_logit_per_key(x, sc.mp, m, i, j);
          (x_s + i * x_stride)[x0 + r] = logit;
          if (sc.qk_BNST != nullptr) sc.qk_BNST[(sc.bh * q_seq + i) * sc.mp.total_seq + j] = logit;  // output 3
        }
      }
    }
  }
}

// Step 5a over the first `count` logits of each query row in x_s (rows x_stride apart): the max, p = exp(x - max)
// in place (max_used 0 for a row with no finite logit: p = 0, never NaN), the sum; row i's (max, sum) to ml[i].
// A warp per row.
__device__ __forceinline__ void split_softmax(float* __restrict__ x_s, int x_stride, int count, int q_seq,
                                              float2* __restrict__ ml, int warp, int lane) {
  for (int i = warp; i < q_seq; i += SPLIT_WARPS) {
    float* x_row = x_s + i * x_stride;
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
}

// Step 5b for `rows` V rows in shared memory (row r at v_tile + r * v_head_size), each weighed by the p at column
// x0 + r of x_s (rows x_stride apart) rounded to ELEM: o += p_ir v_r, in this thread's registers (lane groups over
// keys as in split_logits, lanes over d; split_store_share sums them).
template <typename ELEM, typename IN, int ROWS>
__device__ __forceinline__ void split_values(const IN* v_tile, int rows, int x0, const float* x_s, int x_stride,
                                             const IN* __restrict__ bias_v, int h, int v_head_size, int q_seq,
                                             int warp, int lane, float (&o)[ROWS][SplitLoad<IN>::N]) {
  constexpr int VEC = SplitLoad<IN>::N;
  constexpr int U = SPLIT_LOADS_IN_FLIGHT;
  // V rows are rounded to ELEM after their bias; without one an ELEM row is left as it is
  const bool round_v = !same_type<ELEM, IN>::value || bias_v != nullptr;
  const int lanes = split_lanes<IN>(v_head_size);
  const int groups = 32 / lanes;
  const int sub = lane & (lanes - 1);
  const int g = lane / lanes;
  const int d0 = sub * VEC;
  const bool reads = d0 < v_head_size;
  float bv[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    bv[e] = (reads && bias_v != nullptr) ? to_float<IN>(bias_v[(long long)h * v_head_size + d0 + e]) : 0.0f;
  }
  for (int base = warp * groups * U; base < rows; base += SPLIT_WARPS * groups * U) {
    float vd[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = min(base + u * groups + g, rows - 1);
      if (reads) {
        SplitLoad<IN>::load((v_tile + r * v_head_size) + d0, vd[u]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) vd[u][e] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = base + u * groups + g;
      if (r < rows) {
        float p[ROWS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) p[i] = (i < q_seq) ? round_to<ELEM>((x_s + i * x_stride)[x0 + r]) : 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float vr = round_v ? round_to<ELEM>(vd[u][e] + bv[e]) : vd[u][e];
#pragma unroll
          for (int i = 0; i < ROWS; ++i) o[i][e] = fmaf(p[i], vr, o[i][e]);
        }
      }
    }
  }
}

// This thread's o summed over the lane groups (lanes with the same sub), then group 0 writes this warp's share
// into o_s (SPLIT_WARPS x q_seq x v_head_size).
template <typename IN, int ROWS>
__device__ __forceinline__ void split_store_share(float (&o)[ROWS][SplitLoad<IN>::N], float* __restrict__ o_s,
                                                  int v_head_size, int q_seq, int warp, int lane) {
  constexpr int VEC = SplitLoad<IN>::N;
  const int lanes = split_lanes<IN>(v_head_size);
  const int sub = lane & (lanes - 1);
  const int g = lane / lanes;
  const int d0 = sub * VEC;
  const bool reads = d0 < v_head_size;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (i >= q_seq) break;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float x = o[i][e];
      for (int offset = lanes; offset < 32; offset <<= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
      o[i][e] = x;
    }
    if (g == 0 && reads) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) (o_s + (warp * q_seq + i) * v_head_size)[d0 + e] = o[i][e];
    }
  }
}

// The block's O over its keys, the warps' shares in o_s summed, into out (q_seq x v_head_size floats).
__device__ __forceinline__ void split_block_output(const float* __restrict__ o_s, float* __restrict__ out, int q_seq,
                                                   int v_head_size) {
#pragma unroll 1
  for (int idx = threadIdx.x; idx < q_seq * v_head_size; idx += SPLIT_THREADS) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < SPLIT_WARPS; ++w) sum += (o_s + w * q_seq * v_head_size)[idx];
    out[idx] = sum;
  }
}

// A partial written by another block of this launch (COHERENT: split_key_stream's last block reads them through
// L2, never a line this SM's L1 may hold from before) or by an earlier launch (combine_key_splits).
template <bool COHERENT, typename T> __device__ __forceinline__ T load_partial(const T* __restrict__ p) {
  if constexpr (COHERENT) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

// The block's max or sum of one value a thread (every thread calls it; SPLIT_THREADS threads), in a fixed order.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v) {
  __shared__ float warp_values[SPLIT_WARPS];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = MAX ? fmaxf(v, other) : v + other;
  }
  __syncthreads();  // an earlier call's readers are done with warp_values
  if (threadIdx.x % 32 == 0) warp_values[threadIdx.x / 32] = v;
  __syncthreads();
  float all = warp_values[0];
#pragma unroll
  for (int w = 1; w < SPLIT_WARPS; ++w) all = MAX ? fmaxf(all, warp_values[w]) : all + warp_values[w];
  return all;
}

#define COMBINE_KEPT 4       // splits' (m, l) a thread keeps in registers between its two passes (4 x SPLIT_THREADS)
#define COMBINE_IN_FLIGHT 8  // partial outputs a thread loads before it sums the first (16 spills on sm_80)

// One (b, h, i) row of the output at out_row: the splits' partial outputs weighed by exp(m_c - m) and divided by
// the weighed sum, stored in ELEM at out_narrow_BSD when it is given (as flash_common.cuh's store_pair does for the
// flash kernels), else rounded to ELEM as float32 at out_BSD. `weight` (splits floats) and `total` are shared memory
// of the block, whose threads all call it. A row's time is its dependent reads through L2 (a decode step's last
// block waits on them), so each pass reads in parallel: thread t the (m, l) of splits t, t + SPLIT_THREADS, ...
// (block reductions for m and l), then each output element's partials COMBINE_IN_FLIGHT at a time.
template <typename ELEM, bool COHERENT>
__device__ __forceinline__ void combine_row(const float* __restrict__ partial_O, const float2* __restrict__ partial_ML,
                                            int splits, int q_seq, int v_head_size, long long bh, int i,
                                            long long out_row, float* __restrict__ weight, float& total,
                                            float* __restrict__ out_BSD, void* __restrict__ out_narrow_BSD) {
  const float2* ml_row = partial_ML + bh * splits * q_seq + i;  // split c's (m_c, l_c): ml_row + c * q_seq
  const float* o_row = partial_O + (bh * splits * q_seq + i) * v_head_size;  // its O_c: + c * q_seq * v_head_size
  float2 kept[COMBINE_KEPT];
  float m = NEG_INFINITY;
#pragma unroll
  for (int u = 0; u < COMBINE_KEPT; ++u) {
    const int c = threadIdx.x + u * SPLIT_THREADS;
    kept[u] = c < splits ? load_partial<COHERENT>(ml_row + (long long)c * q_seq) : make_float2(NEG_INFINITY, 0.0f);
    m = fmaxf(m, kept[u].x);
  }
  for (int c = threadIdx.x + COMBINE_KEPT * SPLIT_THREADS; c < splits; c += SPLIT_THREADS) {
    m = fmaxf(m, load_partial<COHERENT>(ml_row + (long long)c * q_seq).x);
  }
  m = block_reduce<true>(m);
  const float max_used = (m == NEG_INFINITY) ? 0.0f : m;
  float l = 0.0f;
#pragma unroll
  for (int u = 0; u < COMBINE_KEPT; ++u) {
    const int c = threadIdx.x + u * SPLIT_THREADS;
    if (c < splits) {
      weight[c] = exp2f((kept[u].x - max_used) * LOG2E);
      l = fmaf(kept[u].y, weight[c], l);
    }
  }
  for (int c = threadIdx.x + COMBINE_KEPT * SPLIT_THREADS; c < splits; c += SPLIT_THREADS) {
    const float2 ml = load_partial<COHERENT>(ml_row + (long long)c * q_seq);
    weight[c] = exp2f((ml.x - max_used) * LOG2E);
    l = fmaf(ml.y, weight[c], l);
  }
  l = block_reduce<false>(l);  // its barriers also publish weight
  if (threadIdx.x == 0) total = l;
  const float inv = 1.0f / l;  // l = 0 (every logit -inf): 0/0 = NaN, as ORT
  for (int d = threadIdx.x; d < v_head_size; d += SPLIT_THREADS) {
    float o = 0.0f;
    for (int c0 = 0; c0 < splits; c0 += COMBINE_IN_FLIGHT) {
      float part[COMBINE_IN_FLIGHT];
#pragma unroll
      for (int u = 0; u < COMBINE_IN_FLIGHT; ++u) {
        const int c = c0 + u;
        part[u] = c < splits ? load_partial<COHERENT>(o_row + (long long)c * q_seq * v_head_size + d) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < COMBINE_IN_FLIGHT; ++u) {
        if (c0 + u < splits) o = fmaf(part[u], weight[c0 + u], o);
      }
    }
    if (out_narrow_BSD != nullptr) {
      static_cast<ELEM*>(out_narrow_BSD)[out_row + d] = from_float<ELEM>(o * inv);
    } else {
      out_BSD[out_row + d] = round_to<ELEM>(o * inv);
    }
  }
}

// ---------------------------------------------------------------------------------- the split-key pair (A/B)
// The kernel's body for at most ROWS query rows (the register arrays' size; 1 for a decode step's S = 1, whose
// loops would otherwise issue SPLIT_MAX_ROWS rows' multiply-adds).
template <typename ELEM, typename IN, int ROWS>
__device__ __forceinline__ void split_key_rows(FLASH_KERNEL_PARAMETERS(IN), int chunk, float* __restrict__ partial_O,
                                               float2* __restrict__ partial_ML, int round_query,
                                               float* __restrict__ qk_BNST) {
  (void)skip_causal_tiles;
  (void)batch;
  (void)out_BSD;  // the output is combine_key_splits' to write
  (void)out_narrow_BSD;
  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;                        // q_seq x head_size
  float* x_s = q_s + q_seq * head_size;     // q_seq x chunk: the logits, then p
  float* o_s = x_s + q_seq * chunk;         // SPLIT_WARPS x q_seq x v_head_size: each warp's share of P.V
  // chunk x head_size, then chunk x v_head_size IN elements: the chunk's K and V rows (16-byte aligned: the floats
  // above rounded up to a multiple of 4, fused.py split_shared_bytes)
  IN* k_s = reinterpret_cast<IN*>(smem + ((q_seq * (head_size + chunk + SPLIT_WARPS * v_head_size) + 3) & ~3));
  IN* v_s = k_s + chunk * head_size;
  constexpr int VEC = SplitLoad<IN>::N;     // elements of a 16-byte load

  const long long bh = blockIdx.x;
  const int b = (int)blockIdx.x / heads;  // B*N fits an int (dispatch.key_split): no 64-bit division
  const int h = (int)blockIdx.x - b * heads;
  const int split = blockIdx.y;
  const int n0 = split * chunk;
  const int count = min(chunk, total_seq - n0);  // >= 1: the host makes ceil(T / chunk) splits
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // The chunk's K rows, then its V rows, into shared memory as they are (two cp.async groups).
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;
  {
    const int pieces = head_size / VEC;  // 16-byte pieces of a row
    for (int idx = threadIdx.x; idx < count * pieces; idx += SPLIT_THREADS) {
      const int r = idx / pieces;
      const int c = idx - r * pieces;
      cp_async_16((k_s + r * head_size) + c * VEC, k_rows + (long long)(n0 + r) * stride_ks + c * VEC, true);
    }
    cp_async_commit();
    const int v_pieces = v_head_size / VEC;
    for (int idx = threadIdx.x; idx < count * v_pieces; idx += SPLIT_THREADS) {
      const int r = idx / v_pieces;
      const int c = idx - r * v_pieces;
      cp_async_16((v_s + r * v_head_size) + c * VEC, v_rows + (long long)(n0 + r) * stride_vs + c * VEC, true);
    }
    cp_async_commit();
  }

  split_query_rows<ELEM, IN>(q_s, q + (long long)b * stride_qb + (long long)h * stride_qh, stride_qs, bias_q, h,
                             q_seq, head_size, round_query);  // step 1
  cp_async_wait_all_but_newest();  // this thread's K pieces; the barrier makes them everyone's
  __syncthreads();

  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const SplitScores<IN> sc{q_s, bias_k, key_offset_BNT == nullptr ? nullptr : key_offset_BNT + bh * total_seq,
                       query_offset_BNS, qk_BNST, mp, scale, bh, b, h, head_size};
  split_logits<ELEM, IN, ROWS>(sc, k_s, count, n0, 0, x_s, chunk, warp, lane);  // steps 2-4
  __syncthreads();

  split_softmax(x_s, chunk, count, q_seq, partial_ML + (bh * gridDim.y + split) * q_seq, warp, lane);  // step 5a
  cp_async_wait_all();  // this thread's V pieces
  __syncthreads();

  float o[ROWS][VEC];  // step 5b: O_c = sum_j p_ij v_j
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[i][e] = 0.0f;
  split_values<ELEM, IN, ROWS>(v_s, count, 0, x_s, chunk, bias_v, h, v_head_size, q_seq, warp, lane, o);
  split_store_share<IN, ROWS>(o, o_s, v_head_size, q_seq, warp, lane);
  __syncthreads();
  split_block_output(o_s, partial_O + (bh * gridDim.y + split) * q_seq * v_head_size, q_seq, v_head_size);
}

template <typename ELEM, typename IN>
__global__ void __launch_bounds__(SPLIT_THREADS, SPLIT_BLOCKS_PER_SM)
    split_key_attention(FLASH_KERNEL_PARAMETERS(IN), int chunk, float* __restrict__ partial_O,
                        float2* __restrict__ partial_ML, int round_query, float* __restrict__ qk_BNST) {
  if (q_seq == 1) {
    split_key_rows<ELEM, IN, 1>(FLASH_KERNEL_ARGUMENTS, chunk, partial_O, partial_ML, round_query, qk_BNST);
  } else {
    split_key_rows<ELEM, IN, SPLIT_MAX_ROWS>(FLASH_KERNEL_ARGUMENTS, chunk, partial_O, partial_ML, round_query,
                                             qk_BNST);
  }
}

// One (b, h, i) row (combine_row).
template <typename ELEM>
__global__ void __launch_bounds__(SPLIT_THREADS)
    combine_key_splits(const float* __restrict__ partial_O, const float2* __restrict__ partial_ML, int splits,
                       int heads, int q_seq, int v_head_size, float* __restrict__ out_BSD,
                       void* __restrict__ out_narrow_BSD) {
  extern __shared__ float weight[];  // splits
  __shared__ float total;
  const long long bh = blockIdx.x / q_seq;
  const int i = (int)(blockIdx.x % q_seq);
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const long long out_row = (((long long)b * q_seq + i) * heads + h) * v_head_size;
  combine_row<ELEM, false>(partial_O, partial_ML, splits, q_seq, v_head_size, bh, i, out_row, weight, total,
                           out_BSD, out_narrow_BSD);
}

// ------------------------------------------------------------------------- the flash kernel's tail (combine)
// One output element, as combine_row stores its own (which keeps its inline store: moving it into this helper
// changed split_key_stream's PTX, scripts/ptx_identity.py): ELEM at out_narrow_BSD when it is given, else rounded
// to ELEM as float32 at out_BSD.
template <typename ELEM>
__device__ __forceinline__ void store_one(float* out_BSD, void* out_narrow_BSD, long long at, float x) {
  if (out_narrow_BSD != nullptr) {
    static_cast<ELEM*>(out_narrow_BSD)[at] = from_float<ELEM>(x);
  } else {
    out_BSD[at] = round_to<ELEM>(x);
  }
}

#define TILE_SPLITS_MAX 32     // dispatch.py WS_TAIL_MAX_SPLITS: one split's (m, l) per lane
#define TILE_COMBINE_WARPS 4   // rows of a combine_tile_splits block, one a warp
// flash_attention_ws's tail split (its header): tail tile t (query tile first_tile + t, in tile_coords' order:
// consecutive tiles share (b, h), the last query tile of a head first) was cut into `splits` units of contiguous
// keys; unit (t, c) left slot t * splits + c of partial_O (block_m rows x v_head_size, unnormalised) and partial_ML
// (block_m (max, sum) pairs). One warp a row: m = max m_c, weights exp(m_c - m), out = sum w_c O_c / sum w_c l_c,
// stored as flash_attention_ws's store_rows does (ELEM at out_narrow_BSD when given, else rounded to ELEM as
// float32 at out_BSD). l = 0 (every logit -inf) gives NaN, as ORT. Rows past q_seq are not stored.
template <typename ELEM>
__global__ void __launch_bounds__(TILE_COMBINE_WARPS * 32)
    combine_tile_splits(const float* __restrict__ partial_O, const float2* __restrict__ partial_ML,
                        long long first_tile, int tail_tiles, int splits, int block_m, int q_tiles, int heads,
                        int q_seq, int v_head_size, float* __restrict__ out_BSD, void* __restrict__ out_narrow_BSD) {
  const long long row_id = (long long)blockIdx.x * TILE_COMBINE_WARPS + threadIdx.x / 32;
  if (row_id >= (long long)tail_tiles * block_m) return;
  const int lane = threadIdx.x % 32;
  const int t = (int)(row_id / block_m);
  const int r = (int)(row_id % block_m);
  const long long tile = first_tile + t;
  const long long bh = tile / q_tiles;
  const int row = (q_tiles - 1 - (int)(tile % q_tiles)) * block_m + r;
  if (row >= q_seq) return;  // (the whole warp: one row)
  const int b = (int)(bh / heads);
  const int h = (int)(bh % heads);
  const long long first_slot = (long long)t * splits;
  const float2 ml = lane < splits ? partial_ML[(first_slot + lane) * block_m + r] : make_float2(NEG_INFINITY, 0.0f);
  float m = ml.x;
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  const float max_used = (m == NEG_INFINITY) ? 0.0f : m;
  const float weight = lane < splits ? exp2f((ml.x - max_used) * LOG2E) : 0.0f;
  float l = ml.y * weight;
  for (int offset = 16; offset > 0; offset >>= 1) l += __shfl_xor_sync(0xffffffffu, l, offset);
  const float inv = 1.0f / l;
  const long long out_row = (((long long)b * q_seq + row) * heads + h) * v_head_size;
  const float* o_rows = partial_O + (first_slot * block_m + r) * v_head_size;  // slot c: + c * block_m * v_head_size
  for (int d0 = 0; d0 < v_head_size; d0 += 32) {  // every lane takes every turn: the shuffles need the whole warp
    const int d = d0 + lane;
    float o = 0.0f;
    for (int c = 0; c < splits; ++c) {
      const float w = __shfl_sync(0xffffffffu, weight, c);
      if (d < v_head_size) o = fmaf(o_rows[(long long)c * block_m * v_head_size + d], w, o);
    }
    if (d < v_head_size) store_one<ELEM>(out_BSD, out_narrow_BSD, out_row + d, o * inv);
  }
}

// ------------------------------------------------------------------------------------ split_key_stream (one launch)
#ifndef STREAM_STAGES
#define STREAM_STAGES 4  // dispatch.py STREAM_STAGES: a block's K / V tiles in shared memory, in flight or in use
#endif
#ifndef STREAM_BLOCKS_PER_SM
#define STREAM_BLOCKS_PER_SM 4  // dispatch.py STREAM_BLOCKS_PER_SM: the grid's aim, and the registers' bound
#endif
static_assert(STREAM_STAGES >= 2, "a stream block loads one tile while it computes another");

// The kernel's body for at most ROWS query rows (as split_key_rows).
template <typename ELEM, typename IN, int ROWS>
__device__ __forceinline__ void split_key_stream_rows(FLASH_KERNEL_PARAMETERS(IN), int span, int tile,
                                                      float* __restrict__ partial_O, float2* __restrict__ partial_ML,
                                                      unsigned* __restrict__ arrivals, int round_query,
                                                      float* __restrict__ qk_BNST) {
  (void)skip_causal_tiles;
  (void)batch;
  // All of it dynamic (the host's size is the whole block's: dispatch.stream_shared_bytes).
  extern __shared__ __align__(16) float smem[];
  const int splits = gridDim.y;
  float* q_s = smem;                                         // q_seq x head_size
  float* x_s = q_s + q_seq * head_size;                      // q_seq x span: the logits, then p
  float* o_s = x_s + q_seq * span;                           // SPLIT_WARPS x q_seq x v_head_size
  float* weight = o_s + SPLIT_WARPS * q_seq * v_head_size;   // splits: combine_row's
  float& total = weight[splits];                             // combine_row's
  int& last = *reinterpret_cast<int*>(weight + splits + 1);  // this block is the last of its (b, h) to finish
  // STREAM_STAGES tiles of `tile` rows of row_size IN elements, each a tile of K or V rows (16-byte aligned: the
  // floats above rounded up to a multiple of 4)
  const int row_size = max(head_size, v_head_size);
  IN* ring = reinterpret_cast<IN*>(
      smem + ((q_seq * (head_size + span + SPLIT_WARPS * v_head_size) + splits + 2 + 3) & ~3));
  constexpr int VEC = SplitLoad<IN>::N;  // elements of a 16-byte load

  const long long bh = blockIdx.x;
  const int b = (int)blockIdx.x / heads;  // B*N fits an int (dispatch.key_split): no 64-bit division
  const int h = (int)blockIdx.x - b * heads;
  const int split = blockIdx.y;
  const int n0 = split * span;
  const int count = min(span, total_seq - n0);  // >= 1: the host makes ceil(T / span) splits
  const int tiles = (count + tile - 1) / tile;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const IN* k_rows = k + (long long)b * stride_kb + (long long)h * stride_kh;
  const IN* v_rows = v + (long long)b * stride_vb + (long long)h * stride_vh;

  // Unit u < tiles is the span's K rows [u * tile, u * tile + tile), unit tiles + t its V rows of tile t: one
  // cp.async group into stage u % STREAM_STAGES. Past the last unit the group is empty, so that the groups still
  // in flight after unit u's are always the STREAM_STAGES - 2 newest (arrive).
  auto issue = [&](int unit) {
    if (unit < 2 * tiles) {
      const bool value = unit >= tiles;
      const int r0 = (value ? unit - tiles : unit) * tile;
      const int rows = min(tile, count - r0);
      const int size = value ? v_head_size : head_size;
      const long long stride = value ? stride_vs : stride_ks;
      const IN* src = (value ? v_rows : k_rows) + (long long)(n0 + r0) * stride;
      IN* dst = ring + (unit % STREAM_STAGES) * tile * row_size;
      const int pieces = size / VEC;  // 16-byte pieces of a row
      RowWalk walk(pieces);
#pragma unroll 1  // see RowWalk
      for (int idx = threadIdx.x; idx < rows * pieces; idx += SPLIT_THREADS, walk.next()) {
        cp_async_16((dst + walk.r * size) + walk.c * VEC, src + (long long)walk.r * stride + walk.c * VEC, true);
      }
    }
    cp_async_commit();
  };
  // Unit `unit` in shared memory for every thread (this thread's pieces, then the barrier), and the stage that unit
  // - 1 used, which every warp is done with once past the barrier, refilled with unit + STREAM_STAGES - 1.
  auto arrive = [&](int unit) -> const IN* {
    cp_async_wait_pending<STREAM_STAGES - 2>();
    __syncthreads();
    issue(unit + STREAM_STAGES - 1);
    return ring + (unit % STREAM_STAGES) * tile * row_size;
  };

  for (int unit = 0; unit < STREAM_STAGES - 1; ++unit) issue(unit);  // the first tiles in flight before anything
  // Launched programmatically (split_keys.py), the block gets here while the kernels before it still run: the K and
  // V rows above are not theirs to write (the caller's promise), the query, biases, masks and scratch may be.
  wait_for_prior_grids();
  split_query_rows<ELEM, IN>(q_s, q + (long long)b * stride_qb + (long long)h * stride_qh, stride_qs, bias_q, h,
                             q_seq, head_size, round_query);  // step 1 (arrive's barrier makes it everyone's)
  const MaskParams mp{attention_bias, bias_d0, bias_d1, mask_kind, key_lengths_B, keep, mask_filter_value,
                      causal, q_seq, total_seq, past_seq};
  const SplitScores<IN> sc{q_s, bias_k, key_offset_BNT == nullptr ? nullptr : key_offset_BNT + bh * total_seq,
                       query_offset_BNS, qk_BNST, mp, scale, bh, b, h, head_size};
  for (int t = 0; t < tiles; ++t) {  // steps 2-4, a K tile at a time
    const IN* k_tile = arrive(t);
    split_logits<ELEM, IN, ROWS>(sc, k_tile, min(tile, count - t * tile), n0 + t * tile, t * tile, x_s, span, warp,
                                 lane);  // fmt: skip
  }
  __syncthreads();  // every logit of the span written

  float2* ml = partial_ML + (bh * splits + split) * q_seq;
  split_softmax(x_s, span, count, q_seq, ml, warp, lane);  // step 5a, while the first V tiles arrive
  float o[ROWS][VEC];  // step 5b: O_c = sum_j p_ij v_j, a V tile at a time (arrive's barrier orders the p first)
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[i][e] = 0.0f;
  for (int t = 0; t < tiles; ++t) {
    const IN* v_tile = arrive(tiles + t);
    split_values<ELEM, IN, ROWS>(v_tile, min(tile, count - t * tile), t * tile, x_s, span, bias_v, h, v_head_size,
                                 q_seq, warp, lane, o);  // fmt: skip
  }
  split_store_share<IN, ROWS>(o, o_s, v_head_size, q_seq, warp, lane);
  __syncthreads();
  split_block_output(o_s, partial_O + (bh * splits + split) * q_seq * v_head_size, q_seq, v_head_size);

  // The last block of (b, h) to finish combines the splits. Each thread's partial stores are made visible to the
  // device before its block's arrival is counted (the fence, then the barrier, then one atomic per block); the
  // last arriver fences again before it reads the others' partials, through L2 (combine_row's COHERENT loads).
  // The counters are zero at the launch: the host zeroes them in the same stream right before it (a Fill step,
  // split_keys.py: a call's scratch is not kept from one call to the next, nor shared by concurrent streams).
  // One split (the grid's y is 1) needs no counter: the block is its pair's last.
  __threadfence();
  __syncthreads();
  if (splits > 1) {
    if (threadIdx.x == 0) last = atomicAdd(arrivals + bh, 1u) == (unsigned)(splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
  }
  for (int i = 0; i < q_seq; ++i) {
    const long long out_row = (((long long)b * q_seq + i) * heads + h) * v_head_size;
    combine_row<ELEM, true>(partial_O, partial_ML, splits, q_seq, v_head_size, bh, i, out_row, weight, total, out_BSD,
                            out_narrow_BSD);
    __syncthreads();  // weight and total are the next row's
  }
}

// A split_key_stream launch's arrival counters zeroed where a Fill would be, as a kernel that a programmatic
// split_key_stream can follow (a Fill cannot be followed programmatically). It lets that launch start at once, and
// writes only once the kernels before it are done (the counters are a call's scratch, which they may still use).
template <typename WORD>
__global__ void __launch_bounds__(SPLIT_THREADS) zero_after_prior_grids(WORD* __restrict__ words, int count) {
  allow_dependent_grids();
  wait_for_prior_grids();
  for (int i = threadIdx.x; i < count; i += blockDim.x) words[i] = 0;  // one block (split_keys.py)
}

template <typename ELEM, typename IN>
__global__ void __launch_bounds__(SPLIT_THREADS, STREAM_BLOCKS_PER_SM)
    split_key_stream(FLASH_KERNEL_PARAMETERS(IN), int span, int tile, float* __restrict__ partial_O,
                     float2* __restrict__ partial_ML, unsigned* __restrict__ arrivals, int round_query,
                     float* __restrict__ qk_BNST) {
  if (q_seq == 1) {
    split_key_stream_rows<ELEM, IN, 1>(FLASH_KERNEL_ARGUMENTS, span, tile, partial_O, partial_ML, arrivals,
                                       round_query, qk_BNST);
  } else {
    split_key_stream_rows<ELEM, IN, SPLIT_MAX_ROWS>(FLASH_KERNEL_ARGUMENTS, span, tile, partial_O, partial_ML,
                                                    arrivals, round_query, qk_BNST);
  }
}
