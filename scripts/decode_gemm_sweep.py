"""Time a decode step's weight GEMMs on the GPU machine: M = 1..8 rows against a Whisper large-v3-turbo layer's
weights, in the forms a graph can write them, and a plain GEMV kernel as the rate a kernel of our own could reach.

Why: a turbo float16 static step spends about 194 of its 365 µs in ORT's M = 1 GEMMs (docs/BENCH.md section 11),
whose cuBLAS kernels read the weights at about 1.4-1.6 TB/s; the step's floor is its bytes over HBM's rate. This
measures whether a form of the same product that ORT already has (FusedMatMul or Gemm with transB = 1 over the
transposed weight, in which every output's dot product reads one contiguous row) gets a faster cuBLAS kernel, and
how fast a GEMV that reads 16 bytes a lane can go at these sizes.

Forms (one ORT CUDA session each, COPIES distinct weights so that they exceed twice the L2 and are read from HBM):
  matmul     MatMul(X (1, M, K), W (K, N))             what ORT's exporters and mha-ep static-cache write
  fused_t    com.microsoft FusedMatMul(X, Wt (N, K), transB = 1)
  gemm_t     Gemm(X (M, K), Wt (N, K), transB = 1)
  swap       MatMul(Wt (N, K), X^T (K, M)): the product transposed, cuBLAS's M the weight's N (for M = 1 X^T is a
             Reshape of X, no copy; for M > 1 it would need a transpose, not timed)
  gemv       gemv_rows below over Wt (N, K), launched by CuPy, ROWS rows a warp, WARPS warps a block
  mma        gemv_mma below: the weight as mma.sync's A operand, M <= 8 rows as B's 8 columns, split-K over WARPS
  gemv_rows  the kernel mha_ep::DecodeMatMul launches (mha_ep/engine/cuda/kernels/gemv.cu, its one setting)
µs: GPU time per product (CUPTI through torch.profiler: every kernel of a run over COPIES products), GB/s: the
weight's bytes over it. FLOP model: 2·M·K·N per product (negligible here: the product is a read of W).

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/decode_gemm_sweep.py [--rows 1,5,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mha_ep.bench.cupti import kernel_table  # noqa: E402

# (name, K, N) of one turbo decoder layer (d_model 1280, ffn 5120; Q/K/V of self attention packed) and the logits.
SHAPES = (
    ("qkv", 1280, 3840),
    ("out", 1280, 1280),
    ("fc1", 1280, 5120),
    ("fc2", 5120, 1280),
    ("logits", 1280, 51866),
)
TARGET_BYTES = 120 << 20  # weights a run reads: more than twice the H100's 50 MiB L2

GEMV_SOURCE = r"""
#include <cuda_fp16.h>
// y (M, N) = x (M, K) . wt (N, K)^T, fp32 sums. Warp w of block b takes rows [(b * WARPS + w) * ROWS, + ROWS);
// lane l reads 16 bytes (8 halves) of each row at k = 8 * (l + 32 i), UNROLL of them before any arithmetic.
// x is read through L1 (it is tiny and every warp reads it). K % 8 == 0.
template <int M, int ROWS, int UNROLL>
__device__ void gemv_rows(const half* __restrict__ x, const half* __restrict__ wt, half* __restrict__ y, int n, int k,
                          int warps) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * ROWS;
  if (row0 >= n) return;
  float acc[ROWS][M];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  const int vectors = k / 8;
  for (int base = lane; base < vectors; base += 32 * UNROLL) {
    uint4 w[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int v = base + 32 * u;
        const int row = min(row0 + r, n - 1);
        const uint4* w_row = reinterpret_cast<const uint4*>(wt + (long long)row * k);
        w[u][r] = v < vectors ? __ldg(w_row + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int v = base + 32 * u;
      if (v >= vectors) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (long long)m * k) + v);
        const half2* xh = reinterpret_cast<const half2*>(&xv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const half2* wh = reinterpret_cast<const half2*>(&w[u][r]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 a = __half22float2(xh[e]), b = __half22float2(wh[e]);
            acc[r][m] = fmaf(a.x, b.x, fmaf(a.y, b.y, acc[r][m]));
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0 && row0 + r < n) y[(long long)m * n + row0 + r] = __float2half(s);
    }
}
#define GEMV(M, ROWS, UNROLL)                                                                              \
  extern "C" __global__ void gemv_m##M##_r##ROWS##_u##UNROLL(const half* x, const half* wt, half* y, int n, int k, \
                                                            int warps) {                                           \
    gemv_rows<M, ROWS, UNROLL>(x, wt, y, n, k, warps);                                                              \
  }
GEMV(1, 1, 4) GEMV(1, 2, 4) GEMV(1, 4, 2) GEMV(1, 2, 8)
GEMV(5, 1, 4) GEMV(5, 2, 4) GEMV(5, 4, 2)
GEMV(8, 1, 4) GEMV(8, 2, 4) GEMV(8, 4, 2)

// The same product on the tensor cores, any M <= 8: D (16 x 8) = Wt rows (16 x k) . x^T (k x 8), mma.sync m16n8k16
// (the weight is the A operand, the M rows the 8 columns of B). Any order of k serves a dot product if A and B use
// the same one, so thread (g = lane / 4, t = lane % 4) loads 16 bytes of rows g and g + 8 of Wt and of row g of x at
// k = kb + 8 t (one load each, 64 contiguous bytes a row per 4 threads) and feeds words 0-1 to one mma and 2-3 to
// the next. A block of WARPS warps takes 16 rows, warp w every WARPS-th chunk of 32 k; the warps' sums meet in
// shared memory.
template <int WARPS, int UNROLL>
__device__ void gemv_mma(const half* __restrict__ x, const half* __restrict__ wt, half* __restrict__ y, int m_rows,
                         int n, int k) {
  __shared__ float sums[WARPS][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const half* wa = wt + (long long)min(row0 + g, n - 1) * k + 8 * t;
  const half* wb = wt + (long long)min(row0 + g + 8, n - 1) * k + 8 * t;
  const bool has_x = g < m_rows;
  const half* xr = x + (long long)(has_x ? g : 0) * k + 8 * t;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  const int chunks = k / 32;
  for (int c0 = warp; c0 < chunks; c0 += WARPS * UNROLL) {
    uint4 a[UNROLL], b[UNROLL], xv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * WARPS;
      const bool in = c < chunks;
      a[u] = in ? __ldg(reinterpret_cast<const uint4*>(wa + 32 * c)) : make_uint4(0, 0, 0, 0);
      b[u] = in ? __ldg(reinterpret_cast<const uint4*>(wb + 32 * c)) : make_uint4(0, 0, 0, 0);
      xv[u] = in && has_x ? __ldg(reinterpret_cast<const uint4*>(xr + 32 * c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                   "{%8, %9}, {%0, %1, %2, %3};\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a[u].x), "r"(b[u].x), "r"(a[u].y), "r"(b[u].y), "r"(xv[u].x), "r"(xv[u].y));
      asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                   "{%8, %9}, {%0, %1, %2, %3};\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a[u].z), "r"(b[u].z), "r"(a[u].w), "r"(b[u].w), "r"(xv[u].z), "r"(xv[u].w));
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) sums[warp][lane][i] = d[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += sums[w][lane][i];
    const int row = row0 + g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    if (row < n && col < m_rows) y[(long long)col * n + row] = __float2half(s);
  }
}
#define GEMV_MMA(WARPS, UNROLL) \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) gemv_mma_w##WARPS##_u##UNROLL( \
      const half* x, const half* wt, half* y, int m_rows, int n, int k) {                            \
    gemv_mma<WARPS, UNROLL>(x, wt, y, m_rows, n, k);                                                 \
  }
GEMV_MMA(4, 4) GEMV_MMA(4, 8) GEMV_MMA(8, 4) GEMV_MMA(8, 2)
"""
MMA_CONFIGS = ((4, 4), (4, 8), (8, 4), (8, 2))  # (WARPS, UNROLL)
GEMV_CONFIGS = ((1, 4), (2, 4), (4, 2), (2, 8))  # (ROWS, UNROLL); M = 1 has all, M = 5, 8 the first three
GEMV_WARPS = (4, 8)


def copies_for(k: int, n: int) -> int:
    return max(1, -(-TARGET_BYTES // (k * n * 2)))


SWEPT_ROWS = (1, 5, 8)  # the M of GEMV_SOURCE's GEMV(M, ...) instantiations


def build_model(form: str, rows: int, k: int, n: int, copies: int, rng) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x_shape = {"gemm_t": [rows, k], "swap": [k, rows]}.get(form, [1, rows, k])
    inits, nodes, outputs = [], [], []
    for c in range(copies):
        w = (rng.standard_normal((n, k) if form != "matmul" else (k, n)) * 0.02).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"w{c}"))
        if form == "matmul":
            nodes.append(helper.make_node("MatMul", ["x", f"w{c}"], [f"y{c}"]))
        elif form == "swap":
            nodes.append(helper.make_node("MatMul", [f"w{c}", "x"], [f"y{c}"]))
        elif form == "fused_t":
            nodes.append(helper.make_node("FusedMatMul", ["x", f"w{c}"], [f"y{c}"], domain="com.microsoft", transB=1))
        else:
            nodes.append(helper.make_node("Gemm", ["x", f"w{c}"], [f"y{c}"], transB=1))
        out_shape = {"gemm_t": [rows, n], "swap": [n, rows]}.get(form, [1, rows, n])
        outputs.append(helper.make_tensor_value_info(f"y{c}", TensorProto.FLOAT16, out_shape))
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, x_shape)],
                              outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def time_ort(ort, form: str, rows: int, k: int, n: int, rng, repeats: int) -> tuple:
    import cupy

    copies = copies_for(k, n)
    session = ort.InferenceSession(build_model(form, rows, k, n, copies, rng), providers=["CUDAExecutionProvider"])
    x_shape = {"gemm_t": (rows, k), "swap": (k, rows)}.get(form, (1, rows, k))
    x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(x_shape).astype(np.float16), "cuda", 0)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", x)
    for c in range(copies):
        binding.bind_output(f"y{c}", "cuda")
    session.run_with_iobinding(binding)
    ys = binding.get_outputs()
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", x)
    for c, y in enumerate(ys):
        binding.bind_ortvalue_output(f"y{c}", y)

    def run():
        session.run_with_iobinding(binding)

    table = kernel_table(run, repeats=repeats)
    micros = sum(us for _, us in table.values()) / copies
    launches = sum(count for count, _ in table.values()) / copies
    names = sorted(table, key=lambda name: -table[name][1])[:1]
    cupy.cuda.runtime.deviceSynchronize()
    return micros, launches, names[0][:60] if names else ""


def time_ours(function, rows: int, k: int, n: int, blocks: int, threads: int, tail: tuple, rng,
              repeats: int) -> tuple:  # fmt: skip
    """(µs a product, max |error| / max |expected|) of the kernel ``function`` (a CuPy RawKernel) launched as
    (x, wt, y, *tail) over every copy of the weight in turn; y starts as NaN, so an unwritten element shows in the
    error."""
    import cupy

    copies = copies_for(k, n)
    x = cupy.asarray(rng.standard_normal((rows, k)).astype(np.float16))
    ws = [cupy.asarray((rng.standard_normal((n, k)) * 0.02).astype(np.float16)) for _ in range(copies)]
    y = cupy.full((rows, n), np.nan, dtype=cupy.float16)

    def run():
        for w in ws:
            function((blocks,), (threads,), (x, w, y) + tail)

    table = kernel_table(run, repeats=repeats)
    micros = sum(us for _, us in table.values()) / copies
    expected = x.astype(cupy.float32) @ ws[-1].astype(cupy.float32).T
    error = float(cupy.max(cupy.abs(y.astype(cupy.float32) - expected)) / max(1.0, float(cupy.max(cupy.abs(expected)))))
    return micros, error


def best_of_ours(module, rows: int, k: int, n: int, rng, repeats: int) -> dict:
    """The fastest setting of each kernel of GEMV_SOURCE at M = ``rows``: {"gemv": (µs, setting, error), "mma":
    (...)}."""
    trials = {"gemv": [], "mma": []}
    for rows_per_warp, unroll in GEMV_CONFIGS if rows == 1 else GEMV_CONFIGS[:3]:
        for warps in GEMV_WARPS:
            tail = (np.int32(n), np.int32(k), np.int32(warps))
            micros, error = time_ours(module.get_function(f"gemv_m{rows}_r{rows_per_warp}_u{unroll}"), rows, k, n,
                                      -(-n // (warps * rows_per_warp)), 32 * warps, tail, rng, repeats)  # fmt: skip
            trials["gemv"].append((micros, (rows_per_warp, unroll, warps), error))
    for warps, unroll in MMA_CONFIGS:
        tail = (np.int32(rows), np.int32(n), np.int32(k))
        micros, error = time_ours(module.get_function(f"gemv_mma_w{warps}_u{unroll}"), rows, k, n, -(-n // 16),
                                  32 * warps, tail, rng, repeats)  # fmt: skip
        trials["mma"].append((micros, (warps, unroll), error))
    return {name: min(found) for name, found in trials.items()}


def time_product(rows: int, k: int, n: int, rng, repeats: int) -> Optional[tuple]:
    """(µs, error) of the kernel mha_ep::DecodeMatMul launches (kernels/gemv.cu gemv_rows, as engine/cuda/gemv.py
    launches it), or None where it does not take the product."""
    from mha_ep.engine.cuda import kernels
    from mha_ep.engine.cuda.gemv import GEMV_ROWS, GEMV_WARPS, gemv_refusal

    if gemv_refusal(rows, k, n, "float16", 256) is not None:
        return None
    function = kernels.compile_function(0, f"gemv_rows<__half, {rows}>")
    return time_ours(function, rows, k, n, -(-n // (GEMV_ROWS * GEMV_WARPS)), 32 * GEMV_WARPS,
                     (np.int32(n), np.int32(k)), rng, repeats)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,5,8", help="M: decoder rows a step (B, or B x beams)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rows_asked = [int(r) for r in args.rows.split(",")]
    if any(rows not in SWEPT_ROWS for rows in rows_asked):
        ap.error(f"--rows {args.rows}: the sweep's own kernels (GEMV_SOURCE's GEMV lines) are built for M in "
                 f"{SWEPT_ROWS}")  # fmt: skip
    import cupy
    import onnxruntime as ort

    rng = np.random.default_rng(7)
    module = cupy.RawModule(code=GEMV_SOURCE, options=("-std=c++17",), name_expressions=None)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; onnxruntime {ort.__version__}; float16; µs per product (GB/s of the weight)")
    header = ["M", "shape (K x N)", "MB", "matmul", "fused_t", "gemm_t", "swap", "gemv best (ROWS, UNROLL, WARPS)",
              "err", "mma best (WARPS, UNROLL)", "err", "best ours / matmul", "gemv_rows (DecodeMatMul's)",
              "gemv_rows / matmul", "matmul kernel", "swap kernel"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for rows in rows_asked:
        for label, k, n in SHAPES:
            mb = k * n * 2 / 1e6
            cells = {}
            kernel = swap_kernel = ""
            for form in ("matmul", "fused_t", "gemm_t", "swap"):
                try:
                    micros, _, top = time_ort(ort, form, rows, k, n, rng, args.repeats)
                    cells[form] = micros
                    if form == "matmul":
                        kernel = top
                    if form == "swap":
                        swap_kernel = top
                except Exception as error:  # a form ORT refuses: say so in its cell
                    cells[form] = None
                    print(f"  {form} M={rows} {label}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
            ours = best_of_ours(module, rows, k, n, rng, args.repeats)
            best, mma = ours["gemv"], ours["mma"]
            product = time_product(rows, k, n, rng, args.repeats)

            def cell(us):
                return "refused" if us is None else f"{us:.1f} ({k * n * 2 / us / 1e3:.0f})"

            print(f"| {rows} | {label} {k} x {n} | {mb:.1f} | {cell(cells['matmul'])} | {cell(cells['fused_t'])} | "
                  f"{cell(cells['gemm_t'])} | {cell(cells['swap'])} | {cell(best[0])} {best[1]} | {best[2]:.1e} | "
                  f"{cell(mma[0])} {mma[1]} | {mma[2]:.1e} | {min(best[0], mma[0]) / cells['matmul']:.2f} | "
                  + ("- | - | " if product is None else
                     f"{cell(product[0])} err {product[1]:.1e} | {product[0] / cells['matmul']:.2f} | ")
                  + f"{kernel} | {swap_kernel} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
