// Shared past/present buffer attention (docs/SEMANTICS.md §3.9-3.10): the decode step of a static KV cache.
//
// The past is (B, N, M, H) with its first P rows filled, P the value of past_sequence_length, which the kernel
// reads from device memory. No launch parameter depends on P: grid, block, shared memory and arguments are fixed
// by the shapes, so one captured CUDA graph serves every step of a decode loop.
//   shared_buffer_attention<T, M>: one block per output row (b, n, s).
//     query, key and value hold `slots` slots a head: element (b, s, n, h) of query is at
//     (b * S + s) * slots * N * H + n * slots * H + h (key and value alike over L, value's with Hv). slots = 1: the
//     (B, S|L, N*H) rows; slots = 3: the slots of one packed QKV buffer (B, L, N, 3, H), read in place, each pointer
//     at its slot (+0, +H, +2H elements; docs/SEMANTICS.md, "Packed QKV / KV: ours").
//     0. It writes the new rows l = s, s+S, ... of (b, n) at [P, P+L) of present_key / present_value: key + b_k,
//        value + b_v (BSNH -> BNSH, rounded to T once). Rows outside [P, P+L) are not touched: when the present is
//        the past's own buffer nothing else is written; otherwise the step before it copied the past into the
//        present. A bad P writes nothing. (This was a kernel of its own, append_kv: a launch a layer a step.)
//     Then attention over the T = P + L keys: rows j < P from the past (on the beam path from row b/W*W + ci[b, j]),
//     staged a tile of TILE_BYTES at a time into shared memory in one round of loads; rows j >= P from key / value
//     + bias in float32 (exact: what ORT's CPU kernel attends to before it rounds the present); then, in float32
//     and in ORT's order,
//       1. x = scale * q.k                      (q = query + b_q, float32)
//       2. x += attention_bias[b|0, n|0, s, j]
//       3. x += mask: FLOAT32_LOWEST where causal, s < S-1, j > P+s; else mask_filter_value where key j is
//          padded (key lengths (B,): j >= len[b]; keep flags (B, T) / (B, S, T): value > 0, or value != 0 on the
//          beam path); else 0                   (ADDED, never substituted, as ORT does)
//       4. p = exp(x - max) / sum(exp(x - max))  (two passes over the row of scores in shared memory)
//       5. out[b, s, n, :] = sum_j p_j * v_j
//
// Bad values the host cannot see (under a captured graph P and the beam indices are device data): P outside
// [0, M), P + L > M, a beam index outside [0, W), a mask or attention_bias whose T is not P + L. A kernel that
// meets one reports it (report_error: the call's status words, which the native library reads after an eager
// call, and the device's sticky words, bound while ORT captures a graph, which a decode loop reads; docs/SEMANTICS.md
// §3.9), then clamps: P into
// [0, M - L], the beam index into [0, W), the mask and bias reads into their T. Nothing outside the buffers is
// read or written, and nothing is written past row M.
//
// Index rule as in layout.cu: promote the first factor of every product, `(long long)b * heads + n`.
#include "common.cuh"
#include "row_loads.cuh"

#define SHARED_BUFFER_THREADS 128
#define KEYS_IN_FLIGHT 4  // tile rows a warp sums at once (scores)
#define STAGE_LOADS 4     // 16-byte loads of each of K and V a thread issues before it stores any (TILE_BYTES)
#define STATUS_WORDS 8
#define INT_MAX_VALUE 2147483647

// What report_error says (mha_ep/launch.py DeviceError; tests/engine/cuda/test_kernel_constants.py checks the two agree).
enum DeviceError {
  DEVICE_OK = 0,
  PAST_LENGTH_RANGE = 1,   // a = P, b = M
  PAST_PLUS_LENGTH = 2,    // a = P, b = L, c = M
  BEAM_INDEX = 3,          // a = the index, b = the row b*W + w, c = the position j (W: the plan's)
  MASK_LENGTH = 4,         // a = the mask's T, b = P + L
  BIAS_LENGTH = 5,         // a = attention_bias's T, b = P + L
};

// The words of one report, STATUS_WORDS ints: code, a, b, c, site (the plan's kernel config), beams (W, for the
// text of BEAM_INDEX). The first report wins; later ones are dropped.
__device__ __forceinline__ void report_error(int* status, int* sticky, int site, int code, int a, int b, int c,
                                             int beams = 0) {
  int* targets[2] = {status, sticky};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    int* words = targets[k];
    if (words != nullptr && atomicCAS(words, DEVICE_OK, code) == DEVICE_OK) {
      words[1] = a;
      words[2] = b;
      words[3] = c;
      words[4] = site;
      words[5] = beams;
      __threadfence();
    }
  }
}

// P, checked (at most one thread of the grid reports) and clamped into [0, M - L]; ``valid`` says whether it was.
__device__ __forceinline__ int checked_past(const int* __restrict__ past_sequence_length, int kv_seq, int max_seq,
                                            int* status, int* sticky, int site, bool reporter, bool& valid) {
  const int past = *past_sequence_length;
  valid = false;
  if (past < 0 || past >= max_seq) {
    if (reporter) report_error(status, sticky, site, PAST_LENGTH_RANGE, past, max_seq, 0);
  } else if ((long long)past + kv_seq > max_seq) {
    if (reporter) report_error(status, sticky, site, PAST_PLUS_LENGTH, past, kv_seq, max_seq);
  } else {
    valid = true;
    return past;
  }
  return min(max(past, 0), max(max_seq - kv_seq, 0));  // the host checked L <= M (claim/rules.py rule_shared_buffer)
}

// The launch arguments of both kernels (shared_buffer.py shared_buffer_steps; tile_keys is the tiled kernel's).
#define SHARED_BUFFER_PARAMETERS(T, M)                                                                          \
  const T *__restrict__ query, const T *__restrict__ key, const T *__restrict__ value, int slots,              \
      const T *__restrict__ bias_q, const T *__restrict__ bias_k, const T *__restrict__ bias_v,                \
      const T *__restrict__ past_key, const T *__restrict__ past_value,                                       \
      const int *__restrict__ past_sequence_length, const int *__restrict__ cache_indirection, int beams,     \
      const M *__restrict__ mask, int mask_kind, int mask_total, const T *__restrict__ attention_bias,         \
      int bias_d0, int bias_d1, int bias_total, T *__restrict__ output_BSDv, T *__restrict__ present_key,     \
      T *__restrict__ present_value, float scale, float mask_filter_value, int causal, int batch, int q_seq,  \
      int kv_seq, int heads, int head_size, int v_head_size, int max_seq, int tile_keys, int *status,         \
      int *sticky, int site

// A block's output row (b, n, s), blockIdx.x = (b * N + n) * S + s, and what both kernels derive from the call's
// words: P checked and clamped (checked_past), T = P + L keys, the beam path (ORT's needs P > 0, §3.10), the key
// length of a key-lengths mask, and the sources' strides in elements: a row (b, s|l) and a head n (the host checks
// that qk_head and v_head fit int). The grid's first thread reports a bad P, and a mask or attention_bias whose T
// is not P + L.
struct BlockRow {
  int b, n, s, past, total, key_length, batch_row0;
  bool valid, beam;
  long long qk_row, v_row, v_hidden;
  int qk_head, v_head;

  // The batch row that holds past row j of this output row: b, or on the beam path its beam's (the index clamped).
  __device__ __forceinline__ int source(const int* __restrict__ cache_indirection, int beams, int max_seq,
                                        int j) const {
    if (!beam) return b;
    const int index = cache_indirection[(long long)b * max_seq + j];  // (B/W, W, M) flattened: row b = batch*W + w
    return batch_row0 + min(max(index, 0), beams - 1);
  }
};

template <typename M>
__device__ __forceinline__ BlockRow block_row(const int* __restrict__ past_sequence_length,
                                              const int* __restrict__ cache_indirection, int beams,
                                              const M* __restrict__ mask, int mask_kind, int mask_total,
                                              bool has_bias, int bias_total, int slots, int q_seq, int kv_seq,
                                              int heads, int head_size, int v_head_size, int max_seq, int* status,
                                              int* sticky, int site) {
  BlockRow r;
  const long long row = blockIdx.x;
  r.s = (int)(row % q_seq);
  r.n = (int)((row / q_seq) % heads);
  r.b = (int)(row / ((long long)q_seq * heads));
  const bool reporter = row == 0 && threadIdx.x == 0;
  r.past = checked_past(past_sequence_length, kv_seq, max_seq, status, sticky, site, reporter, r.valid);
  r.total = r.past + kv_seq;
  r.beam = cache_indirection != nullptr && r.past > 0;
  if (reporter && (mask_kind == MASK_KEYS_BT || mask_kind == MASK_KEYS_BST) && mask_total != r.total) {
    report_error(status, sticky, site, MASK_LENGTH, mask_total, r.total, 0);
  }
  if (reporter && has_bias && bias_total != r.total) {
    report_error(status, sticky, site, BIAS_LENGTH, bias_total, r.total, 0);
  }
  r.key_length = mask_kind == MASK_KEY_LENGTHS ? min(max((int)mask[r.b], 0), r.total) : r.total;
  r.batch_row0 = r.beam ? r.b / beams * beams : r.b;
  r.v_hidden = (long long)heads * v_head_size;  // the output's rows (B, S, N*Hv)
  r.qk_row = (long long)heads * head_size * slots;
  r.v_row = r.v_hidden * slots;
  r.qk_head = head_size * slots;
  r.v_head = v_head_size * slots;
  return r;
}

// 0. the step's new rows l = s, s + S, ... of (b, n) into rows [P, P + L) of the presents, key + b_k and value + b_v
// rounded to T once (the block's other rows write the rest). Nothing reads them in the kernels: a block reads rows
// j < P of the past, and the new rows from key / value. A bad P writes no row of the cache.
template <typename T>
__device__ __forceinline__ void write_new_rows(const T* __restrict__ key, const T* __restrict__ value,
                                               const T* __restrict__ bias_k, const T* __restrict__ bias_v,
                                               T* __restrict__ present_key, T* __restrict__ present_value,
                                               const BlockRow& r, int q_seq, int kv_seq, int heads, int head_size,
                                               int v_head_size, int max_seq) {
  const int b = r.b, n = r.n, s = r.s;
  const long long qk_row = r.qk_row, v_row = r.v_row;
  const int qk_head = r.qk_head, v_head = r.v_head;
  for (int l = s; l < kv_seq; l += q_seq) {  // a thread one element of the key row or of the value row
    const long long target = ((long long)b * heads + n) * max_seq + r.past + l;
    for (int i = threadIdx.x; i < head_size + v_head_size; i += blockDim.x) {
      const bool is_key = i < head_size;
      const int h = is_key ? i : i - head_size;
      const long long at = is_key ? ((long long)b * kv_seq + l) * qk_row + (long long)n * qk_head + h
                                  : ((long long)b * kv_seq + l) * v_row + (long long)n * v_head + h;
      const T* bias = is_key ? bias_k : bias_v;
      float x = to_float<T>(is_key ? key[at] : value[at]);
      if (bias != nullptr) x += to_float<T>(bias[(long long)n * (is_key ? head_size : v_head_size) + h]);
      if (is_key) {
        present_key[target * head_size + h] = from_float<T>(x);
      } else {
        present_value[target * v_head_size + h] = from_float<T>(x);
      }
    }
  }
}

// ORT's check of the beam indices, by every thread of one block: the first bad one in (row, position) order is
// reported.
__device__ __forceinline__ void check_beam_indices(const int* __restrict__ cache_indirection, int batch, int past,
                                                   int max_seq, int beams, int* status, int* sticky, int site) {
  __shared__ int first_bad;
  if (threadIdx.x == 0) first_bad = INT_MAX_VALUE;
  __syncthreads();
  const long long used = (long long)batch * past;
  for (long long i = threadIdx.x; i < used; i += blockDim.x) {
    const long long at = i / past * max_seq + i % past;
    const int index = cache_indirection[at];
    if (index < 0 || index >= beams) atomicMin(&first_bad, (int)i);
  }
  __syncthreads();
  if (threadIdx.x == 0 && first_bad != INT_MAX_VALUE) {
    const int bad_row = first_bad / past, bad_position = first_bad % past;
    report_error(status, sticky, site, BEAM_INDEX, cache_indirection[(long long)bad_row * max_seq + bad_position],
                 bad_row, bad_position, beams);
  }
}

// Steps 2-3 for key j of output row (b, n, s): scale * q.k, + attention_bias, + the mask (ADDED, as ORT does).
template <typename T, typename M>
struct ScoreRule {
  const T* attention_bias;
  int bias_d0, bias_d1, bias_total;
  const M* mask;
  int mask_kind, mask_total;
  float scale, mask_filter_value;
  int causal, q_seq;
  BlockRow r;

  __device__ __forceinline__ float operator()(int j, float dot) const {
    const int b = r.b, n = r.n, s = r.s;
    float x = scale * dot;
    if (attention_bias != nullptr && j < bias_total) {
      const long long plane = (long long)(bias_d0 == 1 ? 0 : b) * bias_d1 + (bias_d1 == 1 ? 0 : n);
      x += to_float<T>(attention_bias[(plane * q_seq + s) * bias_total + j]);
    }
    bool keep = true;
    if (mask_kind == MASK_KEY_LENGTHS) {
      keep = j < r.key_length;
    } else if ((mask_kind == MASK_KEYS_BT || mask_kind == MASK_KEYS_BST) && j < mask_total) {
      const long long at = mask_kind == MASK_KEYS_BT ? (long long)b * mask_total + j
                                                     : ((long long)b * q_seq + s) * mask_total + j;
      keep = r.beam ? mask[at] != (M)0 : mask[at] > (M)0;
    }
    if (causal && s < q_seq - 1 && j > r.past + s) {
      x += FLOAT32_LOWEST;
    } else if (!keep) {
      x += mask_filter_value;
    }
    return x;
  }
};

// ------------------------------------------------------------------------------------ shared_buffer_attention
template <typename OP>
__device__ float row_reduce(float value, OP op, float* warp_values) {
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if ((threadIdx.x & 31) == 0) warp_values[threadIdx.x / 32] = value;
  __syncthreads();
  float all = warp_values[0];
  for (int w = 1; w < SHARED_BUFFER_THREADS / 32; ++w) all = op(all, warp_values[w]);
  __syncthreads();  // the next reduction may overwrite warp_values
  return all;
}

struct RowMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct RowSum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// A past row's pieces, P = uint4 (16 bytes, when a row and the buffers are 16-byte aligned) or T: piece c of
// tile row j is piece c of row c0 + j of (batch row `source`, head n) of the past (B, N, M, width).
template <typename P, typename T>
__device__ __forceinline__ P past_piece(const T* __restrict__ past, int source, int n, int heads, int max_seq,
                                        int position, int width, int c) {
  const long long row = ((long long)source * heads + n) * max_seq + position;
  return reinterpret_cast<const P*>(past + row * width)[c];
}

// Stage rows [c0, c0 + count) of the past keys of output row (b, n), and of its past values when tile_v is set,
// into the tiles (count x width each, in T, row-major). Every thread issues STAGE_LOADS loads of each before it
// stores any: a tile of TILE_BYTES arrives in one memory latency (a decode step reads a few dozen rows; loading
// them one after another left the block waiting on each, docs/BENCH.md section 11).
template <typename P, typename T, typename ROW>
__device__ __forceinline__ void stage_tiles(T* __restrict__ tile_k, const T* __restrict__ past_k, int width_k,
                                            T* __restrict__ tile_v, const T* __restrict__ past_v, int width_v,
                                            int c0, int count, int n, int heads, int max_seq, ROW past_row) {
  constexpr int PER = sizeof(P) / sizeof(T);
  const int pieces_k = width_k / PER, pieces_v = tile_v != nullptr ? width_v / PER : 0;
  const int total_k = count * pieces_k, total_v = count * pieces_v;
  const int total = max(total_k, total_v);
  for (int i0 = threadIdx.x; i0 < total; i0 += STAGE_LOADS * blockDim.x) {
    P k[STAGE_LOADS], v[STAGE_LOADS];
#pragma unroll
    for (int u = 0; u < STAGE_LOADS; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total_k) {
        const int j = i / pieces_k;
        k[u] = past_piece<P>(past_k, past_row(c0 + j), n, heads, max_seq, c0 + j, width_k, i - j * pieces_k);
      }
      if (i < total_v) {
        const int j = i / pieces_v;
        v[u] = past_piece<P>(past_v, past_row(c0 + j), n, heads, max_seq, c0 + j, width_v, i - j * pieces_v);
      }
    }
#pragma unroll
    for (int u = 0; u < STAGE_LOADS; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < total_k) reinterpret_cast<P*>(tile_k)[i] = k[u];
      if (i < total_v) reinterpret_cast<P*>(tile_v)[i] = v[u];
    }
  }
}

template <typename T, typename M>
__global__ void __launch_bounds__(SHARED_BUFFER_THREADS)
    shared_buffer_attention(SHARED_BUFFER_PARAMETERS(T, M)) {
  // dynamic shared memory (mha_ep/engine/cuda/shared_buffer.py shared_layout): the K and V tiles (T, each rounded
  // up to 16 bytes), then in float32 the row of M scores, q (H) and the partial sums (groups x Hv)
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile_k = reinterpret_cast<T*>(shared_bytes);
  const long long tile_k_bytes = ((long long)tile_keys * head_size * sizeof(T) + 15) / 16 * 16;
  const long long tile_v_bytes = ((long long)tile_keys * v_head_size * sizeof(T) + 15) / 16 * 16;
  T* tile_v = reinterpret_cast<T*>(shared_bytes + tile_k_bytes);
  float* scores_T = reinterpret_cast<float*>(shared_bytes + tile_k_bytes + tile_v_bytes);  // max_seq
  float* q_H = scores_T + max_seq;                                                          // head_size
  float* partial = q_H + head_size;                                                         // groups * v_head_size
  __shared__ float warp_values[SHARED_BUFFER_THREADS / 32];

  const BlockRow r = block_row(past_sequence_length, cache_indirection, beams, mask, mask_kind, mask_total,
                               attention_bias != nullptr, bias_total, slots, q_seq, kv_seq, heads, head_size,
                               v_head_size, max_seq, status, sticky, site);
  const int b = r.b, n = r.n, s = r.s, past = r.past, total = r.total;
  const bool beam = r.beam;

  // q = query + b_q in float32 (step 1): loaded first, stored into shared memory beside the first tile
  const long long q_at = ((long long)b * q_seq + s) * r.qk_row + (long long)n * r.qk_head;
  float q_first = 0.f;
  if (threadIdx.x < head_size) {
    q_first = to_float<T>(query[q_at + threadIdx.x]);
    if (bias_q != nullptr) q_first += to_float<T>(bias_q[(long long)n * head_size + threadIdx.x]);
  }

  if (r.valid) {
    write_new_rows(key, value, bias_k, bias_v, present_key, present_value, r, q_seq, kv_seq, heads, head_size,
                   v_head_size, max_seq);
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (beam && blockIdx.x == 0) check_beam_indices(cache_indirection, batch, past, max_seq, beams, status, sticky, site);
  auto past_row = [&](int j) -> int { return r.source(cache_indirection, beams, max_seq, j); };
  // 16-byte pieces where every past row is 16-byte aligned, else one element at a time
  const bool by_16 = (head_size * (int)sizeof(T)) % 16 == 0 && (v_head_size * (int)sizeof(T)) % 16 == 0 &&
                     (reinterpret_cast<unsigned long long>(past_key) & 15) == 0 &&
                     (reinterpret_cast<unsigned long long>(past_value) & 15) == 0;
  auto stage = [&](int c0, int count, bool keys, bool values) {
    T* k_tile = keys ? tile_k : nullptr;
    T* v_tile = values ? tile_v : nullptr;
    if (!keys) {  // values only: the value tile in the key slot of stage_tiles
      if (by_16) stage_tiles<uint4>(tile_v, past_value, v_head_size, (T*)nullptr, past_value, 0, c0, count, n, heads,
                                    max_seq, past_row);
      else stage_tiles<T>(tile_v, past_value, v_head_size, (T*)nullptr, past_value, 0, c0, count, n, heads, max_seq,
                          past_row);
      return;
    }
    if (by_16) stage_tiles<uint4>(k_tile, past_key, head_size, v_tile, past_value, v_head_size, c0, count, n, heads,
                                  max_seq, past_row);
    else stage_tiles<T>(k_tile, past_key, head_size, v_tile, past_value, v_head_size, c0, count, n, heads, max_seq,
                        past_row);
  };

  const int tiles = (past + tile_keys - 1) / tile_keys;
  const int last_c0 = tiles > 0 ? (tiles - 1) * tile_keys : 0;

  // 2-3. scores, a tile of past rows at a time (the last tile's values staged with its keys, for step 5), a warp
  // per key reading KEYS_IN_FLIGHT rows of the tile before it sums any; then the step's own L rows from key + b_k
  // in float32
  const ScoreRule<T, M> score_of{attention_bias, bias_d0, bias_d1, bias_total, mask, mask_kind, mask_total, scale,
                                 mask_filter_value, causal, q_seq, r};
  for (int t = 0; t < max(tiles, 1); ++t) {
    const int c0 = t * tile_keys;
    const int count = min(tile_keys, past - c0);
    if (t > 0) __syncthreads();  // the warps are done with the previous tile
    if (count > 0) stage(c0, count, true, c0 == last_c0);
    if (t == 0) {
      if (threadIdx.x < head_size) q_H[threadIdx.x] = q_first;
      for (int h = threadIdx.x + blockDim.x; h < head_size; h += blockDim.x) {
        float x = to_float<T>(query[q_at + h]);
        if (bias_q != nullptr) x += to_float<T>(bias_q[(long long)n * head_size + h]);
        q_H[h] = x;
      }
    }
    __syncthreads();
    for (int j0 = warp * KEYS_IN_FLIGHT; j0 < count; j0 += warps * KEYS_IN_FLIGHT) {
      float dots[KEYS_IN_FLIGHT] = {};
      for (int h = lane; h < head_size; h += 32) {
        const float q = q_H[h];
#pragma unroll
        for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
          const int j = min(j0 + u, count - 1);  // a row past the tile reads its last one again, its score unused
          dots[u] += q * to_float<T>(tile_k[(long long)j * head_size + h]);
        }
      }
#pragma unroll
      for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
        const float dot = warp_sum(dots[u]);
        if (lane == 0 && j0 + u < count) scores_T[c0 + j0 + u] = score_of(c0 + j0 + u, dot);
      }
    }
  }
  for (int j = past + warp; j < total; j += warps) {
    float dot = 0.f;
    const T* k_row = key + ((long long)b * kv_seq + (j - past)) * r.qk_row + (long long)n * r.qk_head;
    for (int h = lane; h < head_size; h += 32) {
      float k = to_float<T>(k_row[h]);
      if (bias_k != nullptr) k += to_float<T>(bias_k[(long long)n * head_size + h]);
      dot += q_H[h] * k;
    }
    dot = warp_sum(dot);
    if (lane == 0) scores_T[j] = score_of(j, dot);
  }
  __syncthreads();

  // 4. softmax over the row, in place
  float local_max = NEG_INFINITY;
  for (int j = threadIdx.x; j < total; j += blockDim.x) local_max = fmaxf(local_max, scores_T[j]);
  const float row_max = row_reduce(local_max, RowMax(), warp_values);
  float local_sum = 0.f;
  for (int j = threadIdx.x; j < total; j += blockDim.x) {
    const float e = expf(scores_T[j] - row_max);
    scores_T[j] = e;
    local_sum += e;
  }
  const float row_sum = row_reduce(local_sum, RowSum(), warp_values);
  for (int j = threadIdx.x; j < total; j += blockDim.x) scores_T[j] = scores_T[j] / row_sum;
  const int groups = max(1, (int)blockDim.x / v_head_size);
  const int group = threadIdx.x / v_head_size;
  for (int i = threadIdx.x; i < groups * v_head_size; i += blockDim.x) partial[i] = 0.f;
  __syncthreads();

  // 5. out = P.V: thread t sums the keys j = t / Hv (mod groups) of its column h = t % Hv into partial[group, h],
  // a tile of past rows at a time, the last tile first (staged in step 2), then the step's own L rows
  const bool in_group = groups == 1 || group < groups;
  auto add_tile = [&](int c0, int count) {
    for (int h0 = 0; h0 < v_head_size; h0 += blockDim.x) {
      const int h = h0 + (groups > 1 ? threadIdx.x % v_head_size : threadIdx.x);
      if (h >= v_head_size || !in_group) continue;
      float acc = 0.f;
      for (int j = groups > 1 ? group : 0; j < count; j += groups) {
        acc += scores_T[c0 + j] * to_float<T>(tile_v[(long long)j * v_head_size + h]);
      }
      partial[(long long)(groups > 1 ? group : 0) * v_head_size + h] += acc;
    }
  };
  for (int t = tiles - 1; t >= 0; --t) {
    const int c0 = t * tile_keys;
    const int count = min(tile_keys, past - c0);
    if (c0 != last_c0) {
      __syncthreads();  // every thread is done with the previous tile
      stage(c0, count, false, true);
      __syncthreads();
    }
    add_tile(c0, count);
  }
  for (int h0 = 0; h0 < v_head_size; h0 += blockDim.x) {  // the step's own rows, value + b_v in float32
    const int h = h0 + (groups > 1 ? threadIdx.x % v_head_size : threadIdx.x);
    if (h >= v_head_size || !in_group) continue;
    float acc = 0.f;
    for (int j = past + (groups > 1 ? group : 0); j < total; j += groups) {
      float v = to_float<T>(value[((long long)b * kv_seq + (j - past)) * r.v_row + (long long)n * r.v_head + h]);
      if (bias_v != nullptr) v += to_float<T>(bias_v[(long long)n * v_head_size + h]);
      acc += scores_T[j] * v;
    }
    partial[(long long)(groups > 1 ? group : 0) * v_head_size + h] += acc;
  }
  __syncthreads();
  for (int h = threadIdx.x; h < v_head_size; h += blockDim.x) {
    float acc = partial[h];
    for (int g = 1; g < groups; ++g) acc += partial[(long long)g * v_head_size + h];
    output_BSDv[((long long)b * q_seq + s) * r.v_hidden + (long long)n * v_head_size + h] = from_float<T>(acc);
  }
}

// ------------------------------------------------------------------------------------ shared_buffer_decode
// The same call as shared_buffer_attention, a block per output row, without tiles, score rows or barriers between
// phases (shared_buffer.py shared_buffer_kernel: its heads, max(H, Hv) <= DECODE_MAX_DIM, every S). In the block
// each lane group (split_lanes: 8 lanes of a float16 head of 64, 16 bytes a lane) walks its own keys,
// DECODE_KEYS_IN_FLIGHT of them a round: a past row's K and V slices loaded together straight from global memory
// (the beam path's row redirected), a new row's from key / value + bias in float32; the logits summed by
// shuffles and scored by ScoreRule, then an online softmax in float32 registers (running max m, sum l and output
// o, rescaled by exp(m_old - m_new) when the max grows; p is never rounded, as in the tiled kernel). The groups of
// a warp merge by shuffles, the warps through shared memory once, and the output is O / l (0 / 0 = NaN where no
// logit is finite, as ORT's exp(x - max) gives).
#define DECODE_KEYS_IN_FLIGHT 4  // keys a lane group loads before it uses the first
#define DECODE_WARPS (SHARED_BUFFER_THREADS / 32)

// `VEC` elements of a row from element d0 on, as floats: one 16-byte load where `whole` (the row's loads are whole
// and aligned), else element by element up to the row's `size` (zeros past it).
template <typename T, int VEC>
__device__ __forceinline__ void row_slice(const T* __restrict__ row, int d0, int size, bool whole,
                                          float (&out)[VEC]) {
  if (whole && d0 < size) {
    SplitLoad<T>::load(row + d0, out);
    return;
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) out[e] = d0 + e < size ? to_float<T>(row[d0 + e]) : 0.0f;
}

template <typename T, typename M>
__global__ void __launch_bounds__(SHARED_BUFFER_THREADS) shared_buffer_decode(SHARED_BUFFER_PARAMETERS(T, M)) {
  (void)tile_keys;
  constexpr int VEC = SplitLoad<T>::N;
  constexpr int U = DECODE_KEYS_IN_FLIGHT;
  __shared__ float o_s[DECODE_WARPS][32 * VEC];  // each warp's output row (Hv <= 32 * VEC, the host's bound)
  __shared__ float2 ml_s[DECODE_WARPS];          // each warp's (m, l)

  wait_for_prior_grids();  // launched programmatically (shared_buffer.py), the kernels before it may still run
  const BlockRow r = block_row(past_sequence_length, cache_indirection, beams, mask, mask_kind, mask_total,
                               attention_bias != nullptr, bias_total, slots, q_seq, kv_seq, heads, head_size,
                               v_head_size, max_seq, status, sticky, site);
  const int b = r.b, n = r.n, past = r.past, total = r.total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int lanes = split_lanes<T>(max(head_size, v_head_size));
  const int groups = 32 / lanes;
  const int g = lane / lanes;
  const int d0 = (lane & (lanes - 1)) * VEC;
  // 16-byte loads of the past where its rows are whole loads and its buffers aligned, else element by element
  const bool whole = head_size % VEC == 0 && v_head_size % VEC == 0 &&
                     (reinterpret_cast<unsigned long long>(past_key) & 15) == 0 &&
                     (reinterpret_cast<unsigned long long>(past_value) & 15) == 0;

  // step 1: this lane's slice of q = query + b_q in float32, and of the biases of the new rows
  float q_r[VEC], bk[VEC], bv[VEC];
  row_slice<T, VEC>(query + ((long long)b * q_seq + r.s) * r.qk_row + (long long)n * r.qk_head, d0, head_size, false,
                    q_r);
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const int d = d0 + e;
    if (bias_q != nullptr && d < head_size) q_r[e] += to_float<T>(bias_q[(long long)n * head_size + d]);
    bk[e] = bias_k != nullptr && d < head_size ? to_float<T>(bias_k[(long long)n * head_size + d]) : 0.0f;
    bv[e] = bias_v != nullptr && d < v_head_size ? to_float<T>(bias_v[(long long)n * v_head_size + d]) : 0.0f;
  }
  if (r.valid) {
    write_new_rows(key, value, bias_k, bias_v, present_key, present_value, r, q_seq, kv_seq, heads, head_size,
                   v_head_size, max_seq);
  }
  if (r.beam && blockIdx.x == 0) {
    check_beam_indices(cache_indirection, batch, past, max_seq, beams, status, sticky, site);
  }
  const ScoreRule<T, M> score_of{attention_bias, bias_d0, bias_d1, bias_total, mask, mask_kind, mask_total, scale,
                                 mask_filter_value, causal, q_seq, r};
  const bool plain = attention_bias == nullptr && mask_kind == MASK_NONE && !(causal && r.s < q_seq - 1);

  float m = NEG_INFINITY, l = 0.0f, o[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) o[e] = 0.0f;
  // the warp's rounds (the same for every lane: the shuffles below need the whole warp), group g's keys in each
  for (int warp_base = warp * groups * U; warp_base < total; warp_base += DECODE_WARPS * groups * U) {
    const int base = warp_base + g * U;
    float kd[U][VEC], vd[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load of the round in flight before the first is used
      const int j = min(base + u, total - 1);  // a key past the row reads the last one again, its score unused
      if (j < past) {
        const long long at = ((long long)r.source(cache_indirection, beams, max_seq, j) * heads + n) * max_seq + j;
        row_slice<T, VEC>(past_key + at * head_size, d0, head_size, whole, kd[u]);
        row_slice<T, VEC>(past_value + at * v_head_size, d0, v_head_size, whole, vd[u]);
      } else {  // a new row, exact in float32 (what ORT's CPU kernel attends to before it rounds the present)
        const long long at = (long long)b * kv_seq + (j - past);
        row_slice<T, VEC>(key + at * r.qk_row + (long long)n * r.qk_head, d0, head_size, false, kd[u]);
        row_slice<T, VEC>(value + at * r.v_row + (long long)n * r.v_head, d0, v_head_size, false, vd[u]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          kd[u][e] += bk[e];
          vd[u][e] += bv[e];
        }
      }
    }
    float x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot = fmaf(q_r[e], kd[u][e], dot);
      x[u] = group_sum(dot, lanes);
    }
    // a call with no attention_bias, mask or causal row scores scale * dot (score_of's value then) in a few
    // instructions; the rules' code, four times over, is jumped in one branch (the block's code is fetched cold
    // inside a decode step: see split_keys.cu RowWalk)
    if (plain) {
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = base + u < total ? scale * x[u] : NEG_INFINITY;
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = base + u < total ? score_of(base + u, x[u]) : NEG_INFINITY;
    }
    float round_max = NEG_INFINITY;
#pragma unroll
    for (int u = 0; u < U; ++u) round_max = fmaxf(round_max, x[u]);
    const float m_new = fmaxf(m, round_max);
    if (m_new != NEG_INFINITY) {  // else nothing finite yet: the state stays empty
      const float alpha = expf(m - m_new);  // m = -inf: 0, the state was empty
      l *= alpha;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = expf(x[u] - m_new);  // x = -inf (past the row): 0
        l += p;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = fmaf(p, vd[u][e], o[e]);
      }
      m = m_new;
    }
  }
  // the warp's groups merged (lanes with the same slice), then the warps through shared memory
  for (int offset = lanes; offset < 32; offset <<= 1) {
    float ob[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) ob[e] = __shfl_xor_sync(0xffffffffu, o[e], offset);
    const float mb = __shfl_xor_sync(0xffffffffu, m, offset);
    const float lb = __shfl_xor_sync(0xffffffffu, l, offset);
    const float mm = fmaxf(m, mb);
    const float used = mm == NEG_INFINITY ? 0.0f : mm;
    const float a = expf(m - used), c = expf(mb - used);
    l = l * a + lb * c;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = o[e] * a + ob[e] * c;
    m = mm;
  }
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (d0 + e < v_head_size) o_s[warp][d0 + e] = o[e];
    }
  }
  if (lane == 0) ml_s[warp] = make_float2(m, l);
  __syncthreads();
  float mc = NEG_INFINITY;
#pragma unroll
  for (int w = 0; w < DECODE_WARPS; ++w) mc = fmaxf(mc, ml_s[w].x);
  const float used = mc == NEG_INFINITY ? 0.0f : mc;
  float weight[DECODE_WARPS];
  float lc = 0.0f;
#pragma unroll
  for (int w = 0; w < DECODE_WARPS; ++w) {
    weight[w] = expf(ml_s[w].x - used);
    lc = fmaf(ml_s[w].y, weight[w], lc);
  }
  const long long out_at = ((long long)b * q_seq + r.s) * r.v_hidden + (long long)n * v_head_size;
  for (int d = threadIdx.x; d < v_head_size; d += blockDim.x) {
    float od = 0.0f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) od = fmaf(o_s[w][d], weight[w], od);
    output_BSDv[out_at + d] = from_float<T>(od / lc);
  }
}
