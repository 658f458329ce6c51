// Rows read 16 bytes a lane, shared by the kernels that walk a decode step's keys by lane groups (split_keys.cu's
// split-key kernels, shared_buffer.cu's shared_buffer_decode).
#pragma once
#include "common.cuh"

// 16 bytes of a K or V row as SplitLoad<IN>::N floats, one load (the callers check 16-byte aligned addresses and
// strides, and rows of whole loads: a load never straddles a row's end).
template <typename IN> struct SplitLoad;
template <> struct SplitLoad<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void load(const float* p, float (&out)[N]) {
    const float4 raw = *reinterpret_cast<const float4*>(p);
    out[0] = raw.x;
    out[1] = raw.y;
    out[2] = raw.z;
    out[3] = raw.w;
  }
};
template <> struct SplitLoad<__half> {
  static constexpr int N = 8;
  static __device__ __forceinline__ void load(const __half* p, float (&out)[N]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const float2 p0 = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 p1 = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    const float2 p2 = __half22float2(*reinterpret_cast<const __half2*>(&raw.z));
    const float2 p3 = __half22float2(*reinterpret_cast<const __half2*>(&raw.w));
    out[0] = p0.x;
    out[1] = p0.y;
    out[2] = p1.x;
    out[3] = p1.y;
    out[4] = p2.x;
    out[5] = p2.y;
    out[6] = p3.x;
    out[7] = p3.y;
  }
};
template <> struct SplitLoad<__nv_bfloat16> {
  static constexpr int N = 8;
  // A bfloat16 is a float32's high 16 bits: each 32-bit word holds two, the low one first.
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, float (&out)[N]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    out[0] = __uint_as_float(raw.x << 16);
    out[1] = __uint_as_float(raw.x & 0xffff0000u);
    out[2] = __uint_as_float(raw.y << 16);
    out[3] = __uint_as_float(raw.y & 0xffff0000u);
    out[4] = __uint_as_float(raw.z << 16);
    out[5] = __uint_as_float(raw.z & 0xffff0000u);
    out[6] = __uint_as_float(raw.w << 16);
    out[7] = __uint_as_float(raw.w & 0xffff0000u);
  }
};

// Lanes that read one row of `size` elements, 16 bytes each: a power of two from 1 to 32 (the callers keep size
// within 32 loads: split_keys.cu SPLIT_MAX_DIM, shared_buffer.cu DECODE_MAX_DIM).
template <typename IN> __device__ __forceinline__ int split_lanes(int size) {
  const int vectors = (size + SplitLoad<IN>::N - 1) / SplitLoad<IN>::N;  // a partial load counts (H 20 of 8s)
  int lanes = 1;
  while (lanes < vectors) lanes <<= 1;
  return lanes;
}

// The sum of v over each aligned group of `lanes` lanes, every lane of the group receiving it.
__device__ __forceinline__ float group_sum(float v, int lanes) {
  for (int offset = lanes >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
