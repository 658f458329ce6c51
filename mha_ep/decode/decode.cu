// The token choice of a static-cache decode loop, on the device, between two replays of the decoder's graph
// (mha_ep/decode/static_decode.py). A block per row reads the row's logits (loads batched LOADS_IN_FLIGHT deep:
// a row of 51,865 logits is a latency-bound walk otherwise); the host never waits for a token.
//
// ID: the decoder's token input's element type (long long, or int for ORT's Whisper export's int32 input_ids).
//
//   greedy_step<T, ID>: block r: token = argmax_v(logits[r, v] + bias[v]) (ties: the lowest id, as argmax); a row that
//                   has said end-of-text keeps saying it. ids[r] := token, tokens[r, P+1] := token. The last
//                   block to finish (an atomic count of arrivals, reset by it) sets past_sequence_length := P + 1
//                   and done_all := every row has said end-of-text.
//   beam_rows<T> then beam_select<ID>: beam search as OpenAI's whisper decodes (BeamSearchDecoder, patience 1), over
//                   R = B*W rows:
//       1. beam_rows, block r: log-probabilities lp = x - max - log(sum exp(x - max)) of x = logits + bias, and the
//          W + 1 best tokens (ties: the lowest id), into candidate_lp / candidate_token (R, W + 1);
//       2. beam_select (one block), per batch entry b, the W (W + 1) candidates (sum_logprob[beam] + lp) in
//          descending order (ties: the lower beam, then the better rank): a candidate ending in end-of-text is
//          kept as finished (its score, its length, its tokens) while fewer than W are; the others become the next
//          beams until W are;
//       3. the rows are reordered: the tokens (positions [0, P+1)) and cache_indirection of each new beam are
//          its source beam's, position P of cache_indirection names the source beam (that step wrote its keys
//          and values there), ids := the new tokens, sum_logprob := their scores, past_sequence_length := P + 1;
//          done_all := every batch entry has W finished sequences.
// The host reads done_all now and then, and the tokens (and finished sequences) once, at the end.
//
// Index rule as in the attention kernels: promote the first factor of every product, `(long long)r * vocab + v`.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define DECODE_THREADS 256  // static_decode.py DECODE_THREADS: beam_rows' and beam_select's blocks
#define GREEDY_THREADS 512  // static_decode.py GREEDY_THREADS
#define LOADS_IN_FLIGHT 8   // logits a thread loads before it compares them
#define BEAM_LOADS_IN_FLIGHT 2  // ... in beam_rows' top-k pass (its sorted list takes the registers)
#define MAX_CANDIDATES 16  // W + 1 <= MAX_CANDIDATES: at most 15 beams
#define NEG_INFINITY __int_as_float(static_cast<int>(0xff800000u))  // NVRTC has no <cmath> INFINITY

template <typename T> __device__ __forceinline__ float as_float(T x);
template <> __device__ __forceinline__ float as_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float as_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// a better than b: higher value, then lower id
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// The block's best (value, id) pair; every thread receives it (THREADS: the block's size).
template <int THREADS> __device__ void block_best(float& value, int& id) {
  __shared__ float values[THREADS / 32];
  __shared__ int ids[THREADS / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    const int other_id = __shfl_xor_sync(0xffffffffu, id, offset);
    if (better(other, other_id, value, id)) {
      value = other;
      id = other_id;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    values[threadIdx.x / 32] = value;
    ids[threadIdx.x / 32] = id;
  }
  __syncthreads();
  value = values[0];
  id = ids[0];
  for (int w = 1; w < THREADS / 32; ++w) {
    if (better(values[w], ids[w], value, id)) {
      value = values[w];
      id = ids[w];
    }
  }
  __syncthreads();
}

__device__ float block_sum(float value) {
  __shared__ float sums[DECODE_THREADS / 32];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if ((threadIdx.x & 31) == 0) sums[threadIdx.x / 32] = value;
  __syncthreads();
  float all = 0.f;
  for (int w = 0; w < DECODE_THREADS / 32; ++w) all += sums[w];
  __syncthreads();
  return all;
}

template <typename T>
__device__ __forceinline__ float scored(const T* __restrict__ logits, const float* __restrict__ bias, long long row,
                                        int vocab, int v) {
  float x = as_float<T>(logits[row * vocab + v]);
  if (bias != nullptr) x += bias[v];
  return x;
}

// Every v of row `row`, in increasing order per thread (v = threadIdx.x + k * blockDim.x), as visit(x, v) of
// x = logits[row, v] + bias[v]: DEPTH of them loaded before any is visited.
template <int DEPTH, typename T, typename Visit>
__device__ __forceinline__ void for_each_logit(const T* __restrict__ logits, const float* __restrict__ bias,
                                               long long row, int vocab, Visit&& visit) {
  const int stride = blockDim.x;
  int v0 = threadIdx.x;
  for (; v0 + (DEPTH - 1) * stride < vocab; v0 += DEPTH * stride) {
    float x[DEPTH];
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) x[u] = scored(logits, bias, row, vocab, v0 + u * stride);
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) visit(x[u], v0 + u * stride);
  }
  for (int v = v0; v < vocab; v += stride) visit(scored(logits, bias, row, vocab, v), v);
}

// ------------------------------------------------------------------------------------------------ greedy
template <typename T, typename ID>
__global__ void __launch_bounds__(GREEDY_THREADS) greedy_step(
    const T* __restrict__ logits, const float* __restrict__ bias, int rows, int vocab, ID* ids,
    int* past_sequence_length, unsigned char* done, long long* tokens, int max_seq, int eot, int* done_all,
    unsigned* arrived) {
  const int r = blockIdx.x;
  const int past = *past_sequence_length;  // every block reads it before the last one moves it
  float best = NEG_INFINITY;
  int best_id = vocab;
  for_each_logit<LOADS_IN_FLIGHT>(logits, bias, r, vocab, [&](float x, int v) {
    if (better(x, v, best, best_id)) {
      best = x;
      best_id = v;
    }
  });
  block_best<GREEDY_THREADS>(best, best_id);
  if (threadIdx.x == 0) {
    const long long token = done[r] ? eot : best_id;
    ids[r] = (ID)token;
    if (past + 1 < max_seq) tokens[(long long)r * max_seq + past + 1] = token;
    done[r] = done[r] || token == eot;
    __threadfence();  // this row's writes are visible before its arrival is
    if (atomicAdd(arrived, 1u) == (unsigned)rows - 1) {  // the last row: every row's choice is written
      __threadfence();
      const volatile unsigned char* seen = done;
      int all_done = 1;
      for (int rr = 0; rr < rows; ++rr) all_done = all_done && seen[rr];
      *done_all = all_done;
      *past_sequence_length = min(past + 1, max_seq - 1);
      *arrived = 0u;
    }
  }
}

// -------------------------------------------------------------------------------------------------- beam
// The K best (value, id) of this thread's share of a row, sorted, merged across the block into slot 0.
__device__ void block_top(float* top_values, int* top_ids, int k, float* shared_values, int* shared_ids) {
  for (int i = 0; i < k; ++i) {
    shared_values[threadIdx.x * MAX_CANDIDATES + i] = top_values[i];
    shared_ids[threadIdx.x * MAX_CANDIDATES + i] = top_ids[i];
  }
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      float merged_values[MAX_CANDIDATES];
      int merged_ids[MAX_CANDIDATES];
      const float* av = shared_values + (long long)threadIdx.x * MAX_CANDIDATES;
      const int* ai = shared_ids + (long long)threadIdx.x * MAX_CANDIDATES;
      const float* bv = shared_values + (long long)(threadIdx.x + stride) * MAX_CANDIDATES;
      const int* bi = shared_ids + (long long)(threadIdx.x + stride) * MAX_CANDIDATES;
      int a = 0, b = 0;
      for (int i = 0; i < k; ++i) {
        if (better(av[a], ai[a], bv[b], bi[b])) {
          merged_values[i] = av[a];
          merged_ids[i] = ai[a++];
        } else {
          merged_values[i] = bv[b];
          merged_ids[i] = bi[b++];
        }
      }
      for (int i = 0; i < k; ++i) {
        shared_values[threadIdx.x * MAX_CANDIDATES + i] = merged_values[i];
        shared_ids[threadIdx.x * MAX_CANDIDATES + i] = merged_ids[i];
      }
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(DECODE_THREADS) beam_rows(
    const T* __restrict__ logits, const float* __restrict__ bias, int k, int vocab, float* candidate_lp,
    int* candidate_token) {
  __shared__ float shared_values[DECODE_THREADS * MAX_CANDIDATES];
  __shared__ int shared_ids[DECODE_THREADS * MAX_CANDIDATES];
  const int r = blockIdx.x;
  float top_values[MAX_CANDIDATES];
  int top_ids[MAX_CANDIDATES];
  for (int i = 0; i < k; ++i) {
    top_values[i] = NEG_INFINITY;
    top_ids[i] = vocab;
  }
  float row_max = NEG_INFINITY;
  for_each_logit<BEAM_LOADS_IN_FLIGHT>(logits, bias, r, vocab, [&](float x, int v) {
    row_max = fmaxf(row_max, x);
    if (better(x, v, top_values[k - 1], top_ids[k - 1])) {  // insert, keeping the list sorted
      int at = k - 1;
      while (at > 0 && better(x, v, top_values[at - 1], top_ids[at - 1])) {
        top_values[at] = top_values[at - 1];
        top_ids[at] = top_ids[at - 1];
        --at;
      }
      top_values[at] = x;
      top_ids[at] = v;
    }
  });
  int unused = 0;
  block_best<DECODE_THREADS>(row_max, unused);
  float local = 0.f;
  for_each_logit<LOADS_IN_FLIGHT>(logits, bias, r, vocab, [&](float x, int) { local += expf(x - row_max); });
  const float log_total = logf(block_sum(local));
  block_top(top_values, top_ids, k, shared_values, shared_ids);
  if (threadIdx.x < k) {
    candidate_lp[(long long)r * k + threadIdx.x] = shared_values[threadIdx.x] - row_max - log_total;
    candidate_token[(long long)r * k + threadIdx.x] = shared_ids[threadIdx.x];
  }
}

template <typename ID>
__global__ void __launch_bounds__(DECODE_THREADS) beam_select(
    const float* __restrict__ candidate_lp, const int* __restrict__ candidate_token, int batch, int beams,
    ID* ids, int* past_sequence_length, float* sum_logprob, long long* tokens, long long* tokens_scratch,
    int* cache_indirection, int* indirection_scratch, float* finished_score, int* finished_length,
    long long* finished_tokens, int* finished_count, int prompt, int max_seq, int eot, int* done_all) {
  extern __shared__ float chosen[];  // per row: its source row, its token, its score
  const int rows = batch * beams, k = beams + 1;
  const int past = *past_sequence_length;
  int* new_source = reinterpret_cast<int*>(chosen);
  float* new_score = chosen + rows;
  long long* new_token = reinterpret_cast<long long*>(chosen + 2 * rows);  // 8-byte aligned: 2 * rows floats in
  __syncthreads();
  // 2. per batch entry: the candidates in order, finished or next beams
  if (threadIdx.x < batch) {
    const int b = threadIdx.x;
    bool taken[MAX_CANDIDATES * MAX_CANDIDATES] = {};
    int saved = 0;
    for (int n = 0; n < beams * k && saved < beams; ++n) {
      int best = -1;
      float best_score = 0.f;
      for (int c = 0; c < beams * k; ++c) {  // the next best candidate not yet taken (ties: lower beam, rank)
        if (taken[c]) continue;
        const int row = b * beams + c / k;
        const float score = sum_logprob[row] + candidate_lp[(long long)row * k + c % k];
        if (best < 0 || score > best_score) {
          best = c;
          best_score = score;
        }
      }
      taken[best] = true;
      const int source = b * beams + best / k;
      const int token = candidate_token[(long long)source * k + best % k];
      if (best_score == NEG_INFINITY) break;  // only beams that never lived are left
      if (token == eot) {
        const int count = finished_count[b];
        if (count < beams) {
          const long long slot = (long long)b * beams + count;
          finished_score[slot] = best_score;
          finished_length[slot] = past + 1 - prompt;
          for (int j = 0; j <= past && j < max_seq; ++j) {
            finished_tokens[slot * max_seq + j] = tokens[(long long)source * max_seq + j];
          }
          finished_count[b] = count + 1;
        }
      } else {
        const int row = b * beams + saved++;
        new_source[row] = source;
        new_token[row] = token;
        new_score[row] = best_score;
      }
    }
    for (; saved < beams; ++saved) {  // fewer live candidates than beams: repeat the best, never chosen again
      const int row = b * beams + saved;
      new_source[row] = b * beams;
      new_token[row] = eot;
      new_score[row] = NEG_INFINITY;
    }
  }
  __syncthreads();

  // 3. reorder rows: tokens and cache_indirection through scratch
  const long long cells = (long long)rows * max_seq;
  for (long long i = threadIdx.x; i < cells; i += blockDim.x) {
    tokens_scratch[i] = tokens[i];
    indirection_scratch[i] = cache_indirection[i];
  }
  __syncthreads();
  for (long long i = threadIdx.x; i < cells; i += blockDim.x) {
    const int row = (int)(i / max_seq), j = (int)(i % max_seq);
    const int source = new_source[row];
    tokens[i] = j == past + 1 ? new_token[row] : tokens_scratch[(long long)source * max_seq + j];
    cache_indirection[i] = j == past ? source % beams : indirection_scratch[(long long)source * max_seq + j];
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    ids[threadIdx.x] = (ID)new_token[threadIdx.x];
    sum_logprob[threadIdx.x] = new_score[threadIdx.x];
  }
  if (threadIdx.x == 0) {
    int all = 1;
    for (int b = 0; b < batch; ++b) all = all && finished_count[b] >= beams;
    *done_all = all;
    *past_sequence_length = min(past + 1, max_seq - 1);
  }
}
