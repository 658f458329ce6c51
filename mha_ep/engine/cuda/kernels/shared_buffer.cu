// Shared past/present buffer attention (docs/SEMANTICS.md §3.9-3.10): the decode step of a static KV cache.
//
// The past is (B, N, M, H) with its first P rows filled, P the value of past_sequence_length, which these kernels
// read from device memory. No launch parameter depends on P: grid, block, shared memory and arguments are fixed
// by the shapes, so one captured CUDA graph serves every step of a decode loop.
//   append_kv<T>:                  rows [P, P+L) of present_key / present_value := key + b_k, value + b_v (BSNH ->
//                                  BNSH, rounded to T once). Rows outside [P, P+L) are not touched: when the present
//                                  is the past's own buffer nothing else is written; otherwise the step before it
//                                  copied the past into the present. A bad P writes nothing.
//   shared_buffer_attention<T, M>: one block per output row (b, n, s), attention over the T = P + L keys:
//                                  rows j < P from the past (on the beam path from row b/W*W + ci[b, j]), rows
//                                  j >= P from key / value + bias in float32 (exact: what ORT's CPU kernel
//                                  attends to before it rounds the present), then, in float32 and in ORT's order,
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

#define SHARED_BUFFER_THREADS 128
#define KEYS_IN_FLIGHT 4  // past rows a warp (scores) or a thread (P.V) reads before it uses the first
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

// ------------------------------------------------------------------------------------------------- append_kv
template <typename T>
__global__ void append_kv(const T* __restrict__ key_BLD, const T* __restrict__ value_BLDv,
                          const T* __restrict__ bias_k, const T* __restrict__ bias_v, T* __restrict__ present_key,
                          T* __restrict__ present_value, const int* __restrict__ past_sequence_length, int batch,
                          int kv_seq, int heads, int head_size, int v_head_size, int max_seq, int* status,
                          int* sticky, int site) {
  bool valid;
  const int past = checked_past(past_sequence_length, kv_seq, max_seq, status, sticky, site,
                                blockIdx.x == 0 && threadIdx.x == 0, valid);
  if (!valid) return;  // a bad P writes no row of the cache
  const long long key_count = (long long)batch * kv_seq * heads * head_size;
  const long long value_count = (long long)batch * kv_seq * heads * v_head_size;
  for (long long idx = grid_first_index(); idx < key_count + value_count; idx += grid_stride()) {
    const bool is_key = idx < key_count;
    const long long e = is_key ? idx : idx - key_count;
    const int width = is_key ? head_size : v_head_size;
    int h, n, l, b;
    unravel4(e, false, width, heads, kv_seq, h, n, l, b);
    const T* source = is_key ? key_BLD : value_BLDv;
    const T* bias = is_key ? bias_k : bias_v;
    float x = to_float<T>(source[e]);  // BSNH: e = ((b * L + l) * N + n) * width + h
    if (bias != nullptr) x += to_float<T>(bias[(long long)n * width + h]);
    T* present = is_key ? present_key : present_value;
    present[(((long long)b * heads + n) * max_seq + past + l) * width + h] = from_float<T>(x);
  }
}

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

// Where row j of the keys and values of output row (b, n) lies: the past's row of batch row `source_b`, or the
// new row j - P of the call's key / value.
struct KeyRow {
  bool is_new;
  long long offset;  // element offset of the row in past (B, N, M, H) or in key (B, L, N*H)
};

template <typename T, typename M>
__global__ void __launch_bounds__(SHARED_BUFFER_THREADS) shared_buffer_attention(
    const T* __restrict__ query_BSD, const T* __restrict__ key_BLD, const T* __restrict__ value_BLDv,
    const T* __restrict__ bias_q, const T* __restrict__ bias_k, const T* __restrict__ bias_v,
    const T* __restrict__ past_key, const T* __restrict__ past_value, const int* __restrict__ past_sequence_length,
    const int* __restrict__ cache_indirection, int beams, const M* __restrict__ mask, int mask_kind, int mask_total,
    const T* __restrict__ attention_bias, int bias_d0, int bias_d1, int bias_total, T* __restrict__ output_BSDv,
    float scale, float mask_filter_value, int causal, int batch, int q_seq, int kv_seq, int heads, int head_size,
    int v_head_size, int max_seq, int* status, int* sticky, int site) {
  extern __shared__ float shared[];
  float* scores_T = shared;                        // max_seq
  float* q_H = scores_T + max_seq;                 // head_size
  float* partial = q_H + head_size;                // groups * v_head_size
  __shared__ float warp_values[SHARED_BUFFER_THREADS / 32];

  const long long row = blockIdx.x;  // ((b * N) + n) * S + s
  const int s = (int)(row % q_seq);
  const int n = (int)((row / q_seq) % heads);
  const int b = (int)(row / ((long long)q_seq * heads));
  const bool reporter = row == 0 && threadIdx.x == 0;
  bool valid;
  const int past = checked_past(past_sequence_length, kv_seq, max_seq, status, sticky, site, reporter, valid);
  const int total = past + kv_seq;
  const bool beam = cache_indirection != nullptr && past > 0;  // ORT's beam path needs P > 0 (§3.10)
  if (reporter && (mask_kind == MASK_KEYS_BT || mask_kind == MASK_KEYS_BST) && mask_total != total) {
    report_error(status, sticky, site, MASK_LENGTH, mask_total, total, 0);
  }
  if (reporter && attention_bias != nullptr && bias_total != total) {
    report_error(status, sticky, site, BIAS_LENGTH, bias_total, total, 0);
  }

  // 1. q = query + b_q in float32, and the row's key length
  const long long hidden = (long long)heads * head_size;
  for (int h = threadIdx.x; h < head_size; h += blockDim.x) {
    float x = to_float<T>(query_BSD[((long long)b * q_seq + s) * hidden + (long long)n * head_size + h]);
    if (bias_q != nullptr) x += to_float<T>(bias_q[(long long)n * head_size + h]);
    q_H[h] = x;
  }
  int key_length = total;
  if (mask_kind == MASK_KEY_LENGTHS) key_length = min(max((int)mask[b], 0), total);
  __syncthreads();

  const int batch_row0 = beam ? b / beams * beams : b;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (beam && row == 0) {  // ORT's check of the beam indices, reporting the first bad one in (row, position) order
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
  // The past row j of this output row: its batch row (redirected on the beam path, the index clamped).
  auto past_row = [&](int j) -> int {
    if (!beam) return b;
    const int index = cache_indirection[(long long)b * max_seq + j];  // (B/W, W, M) flattened: row b = batch*W + w
    return batch_row0 + min(max(index, 0), beams - 1);
  };

  // 2-3. scores: a warp per key, lanes across the head; a warp reads KEYS_IN_FLIGHT past rows before it sums any
  // (a decode step's row is a few dozen keys: one row at a time left the block waiting on one load after another,
  // docs/BENCH.md section 6)
  auto score_of = [&](int j, float dot) {
    float x = scale * dot;
    if (attention_bias != nullptr && j < bias_total) {
      const long long plane = (long long)(bias_d0 == 1 ? 0 : b) * bias_d1 + (bias_d1 == 1 ? 0 : n);
      x += to_float<T>(attention_bias[(plane * q_seq + s) * bias_total + j]);
    }
    bool keep = true;
    if (mask_kind == MASK_KEY_LENGTHS) {
      keep = j < key_length;
    } else if ((mask_kind == MASK_KEYS_BT || mask_kind == MASK_KEYS_BST) && j < mask_total) {
      const long long at = mask_kind == MASK_KEYS_BT ? (long long)b * mask_total + j
                                                     : ((long long)b * q_seq + s) * mask_total + j;
      keep = beam ? mask[at] != (M)0 : mask[at] > (M)0;
    }
    if (causal && s < q_seq - 1 && j > past + s) {
      x += FLOAT32_LOWEST;
    } else if (!keep) {
      x += mask_filter_value;
    }
    return x;
  };
  for (int j0 = warp * KEYS_IN_FLIGHT; j0 < past; j0 += warps * KEYS_IN_FLIGHT) {
    const T* k_rows[KEYS_IN_FLIGHT];
#pragma unroll
    for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
      const int j = min(j0 + u, past - 1);  // a row past the end reads the last one again, its score unused
      k_rows[u] = past_key + (((long long)past_row(j) * heads + n) * max_seq + j) * head_size;
    }
    float dots[KEYS_IN_FLIGHT] = {};
    for (int h = lane; h < head_size; h += 32) {
      float k[KEYS_IN_FLIGHT];
#pragma unroll
      for (int u = 0; u < KEYS_IN_FLIGHT; ++u) k[u] = to_float<T>(k_rows[u][h]);
#pragma unroll
      for (int u = 0; u < KEYS_IN_FLIGHT; ++u) dots[u] += q_H[h] * k[u];
    }
#pragma unroll
    for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
      const float dot = warp_sum(dots[u]);
      if (lane == 0 && j0 + u < past) scores_T[j0 + u] = score_of(j0 + u, dot);
    }
  }
  for (int j = past + warp; j < total; j += warps) {  // the step's own L rows, from key + b_k in float32
    float dot = 0.f;
    const T* k_row = key_BLD + ((long long)b * kv_seq + (j - past)) * hidden + (long long)n * head_size;
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
  __syncthreads();

  // 5. out = P.V: thread t sums the keys j = t / v_head_size (mod groups) of its column h = t % v_head_size
  const int groups = max(1, (int)blockDim.x / v_head_size);
  const int group = threadIdx.x / v_head_size;
  const long long v_hidden = (long long)heads * v_head_size;
  for (int h0 = 0; h0 < v_head_size; h0 += blockDim.x) {
    const int h = h0 + (groups > 1 ? threadIdx.x % v_head_size : threadIdx.x);
    const bool active = h < v_head_size && (groups == 1 || group < groups);
    float acc = 0.f;
    if (active) {
      const int first = groups > 1 ? group : 0;
      int j = first;
      // the past rows KEYS_IN_FLIGHT at a time: every load issued before the first multiply-add
      for (; j + (KEYS_IN_FLIGHT - 1) * groups < past; j += KEYS_IN_FLIGHT * groups) {
        float v[KEYS_IN_FLIGHT];
        float p[KEYS_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
          const int jj = j + u * groups;  // < M: an int
          v[u] = to_float<T>(past_value[(((long long)past_row(jj) * heads + n) * max_seq + jj) * v_head_size + h]);
          p[u] = scores_T[jj];
        }
#pragma unroll
        for (int u = 0; u < KEYS_IN_FLIGHT; ++u) acc += p[u] * v[u];
      }
      for (; j < total; j += groups) {
        float v;
        if (j < past) {
          v = to_float<T>(past_value[(((long long)past_row(j) * heads + n) * max_seq + j) * v_head_size + h]);
        } else {
          v = to_float<T>(value_BLDv[((long long)b * kv_seq + (j - past)) * v_hidden + (long long)n * v_head_size + h]);
          if (bias_v != nullptr) v += to_float<T>(bias_v[(long long)n * v_head_size + h]);
        }
        acc += scores_T[j] * v;
      }
    }
    if (groups > 1) {
      if (active) partial[(long long)group * v_head_size + h] = acc;
      __syncthreads();
      if (group == 0 && active) {
        for (int g = 1; g < groups; ++g) acc += partial[(long long)g * v_head_size + h];
      }
    }
    if (active && (groups == 1 || group == 0)) {
      output_BSDv[((long long)b * q_seq + s) * v_hidden + (long long)n * v_head_size + h] = from_float<T>(acc);
    }
  }
}
