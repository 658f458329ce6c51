// Pieces shared by the Hopper kernels (flash_attention_wgmma.cu, flash_attention_ws.cu): wgmma fences and waits,
// shared-memory descriptors of the 128-byte swizzle, the Ops wrappers per element type, the swizzled cp.async
// tile copy and the O accumulator's steps. The layouts they assume are stated in flash_attention_wgmma.cu's header;
// the online softmax of a tile is flash_tile.cuh's.
#pragma once
#include "flash_tile.cuh"
#include "wgmma_ops.cuh"

#define WARPGROUP_THREADS 128  // four warps issue one wgmma
#define WARPGROUP_ROWS 64      // query rows of one warpgroup: the M of every wgmma
#define ATOM_BYTES 128         // one swizzle atom row: 64 f16/bf16 elements

namespace wgmma_detail {

// cp.async writes go through the generic proxy; wgmma reads shared memory through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Wait until at most the newest committed wgmma group is still running.
__device__ __forceinline__ void wgmma_wait_all_but_newest() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Compiler-level fences on registers a wgmma reads or writes: every access before stays before (CUTLASS's
// warpgroup_fence_operand), placed around the asynchronous instructions.
template <int N> __device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_operands(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Shared-memory matrix descriptor of a tile in the 128-byte swizzle.
__device__ __forceinline__ unsigned long long descriptor(unsigned smem_addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((smem_addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned long long swizzled_desc(unsigned smem_addr) { return descriptor(smem_addr, 16, 1024); }

template <typename ELEM, int BLOCK_N> struct Ops;
template <int BLOCK_N> struct Ops<__half, BLOCK_N> {
  static __device__ __forceinline__ void s(float (&d)[BLOCK_N / 2], unsigned long long a, unsigned long long b,
                                           int accumulate) {
    if constexpr (BLOCK_N == 128) {
      wgmma_ss_m64n128k16_f16(d, a, b, accumulate);
    } else {
      wgmma_ss_m64n64k16_f16(d, a, b, accumulate);
    }
  }
  static __device__ __forceinline__ void o(float (&d)[32], const unsigned (&a)[4], unsigned long long b) {
    wgmma_rs_m64n64k16_f16_transb(d, a, b);
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo: the lower key of the pair
    return *reinterpret_cast<unsigned*>(&v);
  }
};
template <int BLOCK_N> struct Ops<__nv_bfloat16, BLOCK_N> {
  static __device__ __forceinline__ void s(float (&d)[BLOCK_N / 2], unsigned long long a, unsigned long long b,
                                           int accumulate) {
    if constexpr (BLOCK_N == 128) {
      wgmma_ss_m64n128k16_bf16(d, a, b, accumulate);
    } else {
      wgmma_ss_m64n64k16_bf16(d, a, b, accumulate);
    }
  }
  static __device__ __forceinline__ void o(float (&d)[32], const unsigned (&a)[4], unsigned long long b) {
    wgmma_rs_m64n64k16_bf16_transb(d, a, b);
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
};

// One thread's share of copying ROWS x HEAD_DIM ELEM tiles into the swizzled atom layout with cp.async, addresses
// formed once: the thread copies 16-byte chunk `chunk` of rows row0, row0 + ROW_STEP, ... (ROW_STEP is a multiple
// of 8, so every row it copies has the same swizzle). Rows past `rows_valid` and columns past the operand's head
// size are zero-filled (they add nothing to a dot product or to P.V).
template <typename ELEM, int ROWS, int HEAD_DIM, int THREADS> struct SwizzledTileCopy {
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
  static constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  static constexpr int PASSES = ROWS / ROW_STEP;
  static_assert(ROW_STEP % 8 == 0 && ROWS % ROW_STEP == 0, "rows of one thread share a swizzle phase");
  const ELEM* src;        // (row0, chunk) of sequence row 0
  long long stride_s;     // elements from one sequence row to the next
  long long pass_stride;  // ROW_STEP rows
  int row0;
  unsigned smem_at;  // byte offset of (row0, chunk) in a tile
  bool col_valid;

  __device__ __forceinline__ SwizzledTileCopy(const ELEM* rows, long long stride, int dim) {
    row0 = threadIdx.x / CHUNKS_PER_ROW;
    const int chunk = threadIdx.x % CHUNKS_PER_ROW;
    col_valid = chunk * 8 < dim;
    stride_s = stride;
    pass_stride = stride * ROW_STEP;
    src = rows + (long long)row0 * stride + chunk * 8;
    const int atom = chunk / 8;
    smem_at = atom * ROWS * ATOM_BYTES + row0 * ATOM_BYTES + (((chunk % 8) ^ (row0 % 8)) << 4);
  }
  // Sequence rows [first, first + ROWS) into the tile at shared address `tile`.
  __device__ __forceinline__ void copy(unsigned tile, int first, int rows_valid) const {
    const ELEM* g = src + (long long)first * stride_s;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const bool valid = col_valid && row0 + pass * ROW_STEP < rows_valid;
      const unsigned dst = tile + smem_at + pass * ROW_STEP * ATOM_BYTES;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(valid ? g : src),
                   "r"(valid ? 16 : 0));
      g += pass_stride;
    }
  }
};

// Query tile `tile` of a launch over (b, h, query tile) in flash_attention_mma's order: consecutive tiles share
// (b, h), and the last query tile of a head comes first (its causal rows see the most keys).
struct TileCoords {
  int b;
  int h;
  int m0;  // first query row
};
__device__ __forceinline__ TileCoords tile_coords(long long tile, int q_tiles, int heads, int block_m) {
  const long long bh = tile / q_tiles;
  TileCoords t;
  t.m0 = (q_tiles - 1 - (int)(tile % q_tiles)) * block_m;
  t.b = (int)(bh / heads);
  t.h = (int)(bh % heads);
  return t;
}

// O (columns 64 a + 8 i + 2 tig, +1: [a][4 i], [a][4 i + 1] row g, [a][4 i + 2, + 3] row g + 8) starts at 0.
template <int ATOMS> __device__ __forceinline__ void zero_accumulators(float (&o_acc)[ATOMS][32]) {
#pragma unroll
  for (int a = 0; a < ATOMS; ++a)
#pragma unroll
    for (int i = 0; i < 32; ++i) o_acc[a][i] = 0.0f;
}

// fence_operands of every atom of O, around the wgmma that read or write it.
template <int ATOMS> __device__ __forceinline__ void fence_accumulators(float (&o_acc)[ATOMS][32]) {
#pragma unroll
  for (int a = 0; a < ATOMS; ++a) fence_operands(o_acc[a]);
}

// Step E's A operand: P's fragment of key slice kt is S's n8 blocks 2 kt, 2 kt + 1, rounded to ELEM (zeros for a
// skipped tile, `zero`).
template <typename ELEM, int BLOCK_N>
__device__ __forceinline__ void pack_p(unsigned (&p)[BLOCK_N / 16][4], const float (&s)[BLOCK_N / 2],
                                       bool zero = false) {
#pragma unroll
  for (int kt = 0; kt < BLOCK_N / 16; ++kt) {
    p[kt][0] = zero ? 0u : Ops<ELEM, BLOCK_N>::pack(s[8 * kt], s[8 * kt + 1]);
    p[kt][1] = zero ? 0u : Ops<ELEM, BLOCK_N>::pack(s[8 * kt + 2], s[8 * kt + 3]);
    p[kt][2] = zero ? 0u : Ops<ELEM, BLOCK_N>::pack(s[8 * kt + 4], s[8 * kt + 5]);
    p[kt][3] = zero ? 0u : Ops<ELEM, BLOCK_N>::pack(s[8 * kt + 6], s[8 * kt + 7]);
  }
}

// O *= alpha per row: [a][4 i], [a][4 i + 1] are row g, [a][4 i + 2, + 3] row g + 8.
template <int ATOMS>
__device__ __forceinline__ void rescale_rows(float (&o_acc)[ATOMS][32], const float (&alpha)[2]) {
#pragma unroll
  for (int a = 0; a < ATOMS; ++a)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      o_acc[a][4 * i] *= alpha[0];
      o_acc[a][4 * i + 1] *= alpha[0];
      o_acc[a][4 * i + 2] *= alpha[1];
      o_acc[a][4 * i + 3] *= alpha[1];
    }
}

// A row's sum over the quad (its 4 threads hold its columns), in place for this thread's two rows.
__device__ __forceinline__ void quad_sum_rows(float (&row_sum)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
}

// out = O / l (l summed over the quad), rounded to ELEM, stored as BSNH (store_pair: float32, or ELEM) for this thread's two rows
// (rows past q_seq are not stored). l = 0 (every logit -inf) gives 0/0 = NaN, as ORT's CPU kernel does.
template <typename ELEM, int ATOMS>
__device__ __forceinline__ void store_rows(const float (&o_acc)[ATOMS][32], float (&row_sum)[2], const int (&rows)[2],
                                           int q_seq, int b, int h, int heads, int v_head_size, int tig,
                                           float* __restrict__ out_BSD, void* __restrict__ out_narrow_BSD) {
  quad_sum_rows(row_sum);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= q_seq) continue;
    const float inv = 1.0f / row_sum[r];
    const long long out_row = (((long long)b * q_seq + rows[r]) * heads + h) * v_head_size;
#pragma unroll
    for (int a = 0; a < ATOMS; ++a)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = a * 64 + i * 8 + tig * 2;
        if (d >= v_head_size) continue;
        store_pair<ELEM>(out_BSD, out_narrow_BSD, out_row + d, o_acc[a][4 * i + 2 * r] * inv,
                         o_acc[a][4 * i + 2 * r + 1] * inv);
      }
  }
}

}  // namespace wgmma_detail
