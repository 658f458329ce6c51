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

// First linear index of this thread and the stride of a grid-stride loop, both 64-bit.
__device__ __forceinline__ long long grid_first_index() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride() { return (long long)gridDim.x * blockDim.x; }
