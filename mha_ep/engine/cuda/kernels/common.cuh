// Shared helpers of the mha_ep CUDA kernels: element conversions between float and the compute dtype T.
//
// T is one of float, __half, __nv_bfloat16. Every kernel reads and writes host-facing data as float32 (the
// transport type) and the attention operands as T; rounding to T happens exactly once, in from_float.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Value of T nearest to x, as a float: what a T store followed by a float load would give.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float<T>(from_float<T>(x)); }

// Programmatic dependent launch (sm_90 and later; compiled out below). A kernel launched with the programmatic
// stream serialization attribute (steps.Launch.programmatic) may start while the kernel before it in the stream
// still runs: before wait_for_prior_grids it may only read what that kernel does not write, and write nothing
// outside shared memory. Launched without the attribute, both are no-ops.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream, when it is launched programmatically, start before this one ends.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// First linear index of this thread and the stride of a grid-stride loop, both 64-bit.
__device__ __forceinline__ long long grid_first_index() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride() { return (long long)gridDim.x * blockDim.x; }

// Coordinates of a linear index over a 4-d box: idx = ((c3 * n2 + c2) * n1 + c1) * n0 + c0.
// 64-bit division is emulated (many instructions); when the whole box fits 32 bits (FITS_U32, uniform across
// the grid) the cheaper 32-bit unsigned division is used. Each coordinate fits an int (the host checks the dims).
__device__ __forceinline__ void unravel4(long long idx, bool fits_u32, int n0, int n1, int n2, int& c0, int& c1,
                                         int& c2, int& c3) {
  if (fits_u32) {
    unsigned rest = (unsigned)idx;
    c0 = (int)(rest % (unsigned)n0);
    rest /= (unsigned)n0;
    c1 = (int)(rest % (unsigned)n1);
    rest /= (unsigned)n1;
    c2 = (int)(rest % (unsigned)n2);
    c3 = (int)(rest / (unsigned)n2);
  } else {
    long long rest = idx;
    c0 = (int)(rest % n0);
    rest /= n0;
    c1 = (int)(rest % n1);
    rest /= n1;
    c2 = (int)(rest % n2);
    c3 = (int)(rest / n2);
  }
}

// Coordinates of a linear index over a 3-d box: idx = (c2 * n1 + c1) * n0 + c0 (FITS_U32 as for unravel4).
__device__ __forceinline__ void unravel3(long long idx, bool fits_u32, int n0, int n1, int& c0, int& c1, int& c2) {
  if (fits_u32) {
    unsigned rest = (unsigned)idx;
    c0 = (int)(rest % (unsigned)n0);
    rest /= (unsigned)n0;
    c1 = (int)(rest % (unsigned)n1);
    c2 = (int)(rest / (unsigned)n1);
  } else {
    long long rest = idx;
    c0 = (int)(rest % n0);
    rest /= n0;
    c1 = (int)(rest % n1);
    c2 = (int)(rest / n1);
  }
}

// A warp's max and sum of one float per lane, every lane receiving the result (shuffles only).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

#define U32_LIMIT 4294967295LL
#define FLOAT32_LOWEST (-3.402823466e+38f)  // ORT's causal fill (mha_ep/engine/problem.py FLOAT32_LOWEST)
#define NEG_INFINITY __int_as_float(static_cast<int>(0xff800000u))  // NVRTC has no <cmath> INFINITY

// How a call's padding mask reaches a kernel (mha_ep/launch.py MaskKind; tests/test_kernel_constants.py checks the
// two agree): none; int32 (B,) key lengths, key j kept iff j < len[b]; uint8 (B, T) or (B, S, T) keep flags.
enum MaskKind { MASK_NONE = 0, MASK_KEY_LENGTHS = 1, MASK_KEYS_BT = 2, MASK_KEYS_BST = 3 };

// VEC consecutive floats: one 16-byte access when VEC == 4 (the host guarantees 16-byte alignment then), else
// scalar accesses.
template <int VEC>
__device__ __forceinline__ void load_floats(const float* __restrict__ p, float* v) {
  if constexpr (VEC == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = p[k];
  }
}

// VEC values of ELEM widened to float: one 8-byte load for four 2-byte elements, one 16-byte load for floats.
template <typename ELEM, int VEC>
__device__ __forceinline__ void load_as_floats(const ELEM* __restrict__ p, float* v) {
  if constexpr (VEC == 4 && sizeof(ELEM) == 2) {
    const uint2 packed = *reinterpret_cast<const uint2*>(p);
    ELEM x[4];
    memcpy(x, &packed, sizeof(packed));
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = to_float<ELEM>(x[k]);
  } else if constexpr (sizeof(ELEM) == 4) {
    load_floats<VEC>(reinterpret_cast<const float*>(p), v);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = to_float<ELEM>(p[k]);
  }
}

template <int VEC>
__device__ __forceinline__ void store_floats(float* __restrict__ p, const float* v) {
  if constexpr (VEC == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = v[k];
  }
}

// VEC values of ELEM: one 8-byte store for four 2-byte elements, one 16-byte store for four floats.
template <typename ELEM, int VEC>
__device__ __forceinline__ void store_elems(ELEM* __restrict__ p, const ELEM* v) {
  if constexpr (VEC == 4 && sizeof(ELEM) == 2) {
    uint2 packed;
    memcpy(&packed, v, sizeof(packed));
    *reinterpret_cast<uint2*>(p) = packed;
  } else if constexpr (VEC == 4 && sizeof(ELEM) == 4) {
    float4 packed;
    memcpy(&packed, v, sizeof(packed));
    *reinterpret_cast<float4*>(p) = packed;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = v[k];
  }
}
