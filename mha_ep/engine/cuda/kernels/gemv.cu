// A decoder step's weight product: y (M, N) = x (M, K) . w_nk (N, K)^T for a few rows M <= GEMV_MAX_M, the weight
// stored transposed (its rows the outputs), float32 sums rounded once to the element type (gemv.py, the op
// mha_ep::DecodeMatMul that mha-ep static-cache writes). At M <= 8 the product is a read of the weight, which
// cuBLAS's GEMMs take well under HBM's rate there (docs/BENCH.md section 11, run 4); this kernel reads it once.
//
// Warp w of block b takes the weight rows [(b * GEMV_WARPS + w) * GEMV_ROWS, + GEMV_ROWS); lane l reads 16 bytes
// of each of them at k = VEC * (l + 32 i), GEMV_UNROLL such loads of every row in flight before any arithmetic, and
// the matching 16 bytes of the M rows of x (through L1: every warp reads them). The lanes' sums meet by shuffles.
// K % VEC == 0 and 16-byte aligned x and w_nk (the host's checks: gemv.py).
//
// Launched programmatically (steps.Launch.programmatic), the first round of the weight, a constant no kernel
// writes, is loaded before waiting for the kernels before this one; x and y only after.
#include "common.cuh"

#define GEMV_ROWS 2     // gemv.py GEMV_ROWS: weight rows a warp takes
#define GEMV_UNROLL 4   // 16-byte loads of each row a lane has in flight
#define GEMV_WARPS 4    // gemv.py GEMV_WARPS: warps a block
#define GEMV_MAX_M 8    // gemv.py GEMV_MAX_M: rows of x a launch takes

// Two elements of a 32-bit word as floats.
template <typename T> __device__ __forceinline__ float2 pair_to_float2(unsigned word);
template <> __device__ __forceinline__ float2 pair_to_float2<__half>(unsigned word) {
  return __half22float2(*reinterpret_cast<const __half2*>(&word));
}
template <> __device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(unsigned word) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
}

// sum += the dot product of the 8 elements of two 16-byte vectors
template <typename T>
__device__ __forceinline__ float dot16(const uint4& a, const uint4& b, float sum) {
  const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = pair_to_float2<T>(wa[e]), y = pair_to_float2<T>(wb[e]);
    sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
  }
  return sum;
}

template <typename T, int M>
__global__ void __launch_bounds__(32 * GEMV_WARPS)
    gemv_rows(const T* __restrict__ x, const T* __restrict__ w_nk, T* __restrict__ y, int n, int k) {
  static_assert(M >= 1 && M <= GEMV_MAX_M, "gemv_rows takes 1..GEMV_MAX_M rows of x");
  allow_dependent_grids();
  const int lane = threadIdx.x & 31;
  const int row0 = ((int)blockIdx.x * GEMV_WARPS + (int)(threadIdx.x >> 5)) * GEMV_ROWS;  // n < 2^31 (gemv.py)
  if (row0 >= n) {
    wait_for_prior_grids();  // (a programmatic launch's block ends only once the kernels before it have)
    return;
  }
  const int vectors = k / 8;  // 16-byte vectors a row
  float acc[GEMV_ROWS][M];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  const uint4* w_rows[GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r) {
    w_rows[r] = reinterpret_cast<const uint4*>(w_nk + (long long)min(row0 + r, n - 1) * k);
  }
  uint4 w[GEMV_UNROLL][GEMV_ROWS];
  auto load_round = [&](int base) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int v = base + 32 * u;
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r) w[u][r] = v < vectors ? __ldg(w_rows[r] + v) : make_uint4(0, 0, 0, 0);
    }
  };
  load_round(lane);  // the weight is a constant: in flight before the wait
  wait_for_prior_grids();
  for (int base = lane; base < vectors; base += 32 * GEMV_UNROLL) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int v = base + 32 * u;
      if (v >= vectors) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (long long)m * k) + v);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) acc[r][m] = dot16<T>(xv, w[u][r], acc[r][m]);
      }
    }
    if (base + 32 * GEMV_UNROLL < vectors) load_round(base + 32 * GEMV_UNROLL);
  }
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0 && row0 + r < n) y[(long long)m * n + row0 + r] = from_float<T>(s);
    }
}
