"""A decoder step's weight product, mha_ep::DecodeMatMul, as device steps: y (M, N) = x (M, K) . w_nk (N, K)^T.

    matmul_steps(x, w_nk, y, rows=M, k=K, n=N, dtype=..., alignment=..., take=...) -> steps

Where ``gemv_refusal`` finds nothing against it (float16 / bfloat16, M <= GEMV_MAX_M, K a whole number of 16-byte
vectors, x and w_nk 16-byte aligned): one launch of ``gemv_rows`` (kernels/gemv.cu), which reads the weight once,
16 bytes a lane with several loads in flight. ``programmatic``: it is launched programmatically (sm_90), loading
its first round of the weight, a constant, before it waits for the kernels before it. Else cuBLAS through ORT's
handle (a Gemm step) into float32 (scratch from ``take``, then narrowed into y; y itself for float32).
The sums are float32, rounded once to the element type. CuPy is not imported here.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from mha_ep import spec
from mha_ep.dtypes import rounded
from mha_ep.engine.cuda import gemm
from mha_ep.engine.cuda.pipeline import _narrow
from mha_ep.engine.cuda.steps import Address, Gemm, Launch, Pointer
from mha_ep.launch import ELEMENT_BYTES, ELEMENT_TYPES
from mha_ep.limits import I32_MAX

GEMV_ROWS = 2  # kernels/gemv.cu GEMV_ROWS: weight rows a warp takes
GEMV_WARPS = 4  # kernels/gemv.cu GEMV_WARPS: warps a block
GEMV_MAX_M = spec.MATMUL_MAX_ROWS  # kernels/gemv.cu GEMV_MAX_M: rows of x a launch takes
VECTOR_BYTES = 16  # a lane's load
GEMV_DTYPES = ("float16", "bfloat16")


def gemv_refusal(rows: int, k: int, n: int, dtype: str, alignment: int) -> Optional[str]:
    """Why gemv_rows cannot take this product (cuBLAS does it then), or None."""
    if dtype not in GEMV_DTYPES:
        return f"{dtype}: gemv_rows reads {' and '.join(GEMV_DTYPES)}"
    if not 1 <= rows <= GEMV_MAX_M:
        return f"{rows} rows of x: gemv_rows takes 1 to {GEMV_MAX_M}"
    if (k * ELEMENT_BYTES[dtype]) % VECTOR_BYTES:
        return f"K = {k}: a row of {k * ELEMENT_BYTES[dtype]} bytes is not a whole number of 16-byte loads"
    if alignment < VECTOR_BYTES:
        return f"x or weight_nk is only {alignment}-byte aligned: gemv_rows loads 16 bytes at a time"
    if n > I32_MAX or rows * k > I32_MAX:
        return f"N = {n} or M x K = {rows * k} beyond the kernel's int indices"
    return None


def matmul_steps(x: Address, w_nk: Address, y: Address, *, rows: int, k: int, n: int, dtype: str, alignment: int,
                 take: Callable[[str, int], Address], programmatic: bool = False) -> list:  # fmt: skip
    """The steps of the module docstring for one product of ``rows`` rows."""
    if gemv_refusal(rows, k, n, dtype, alignment) is None:
        blocks = -(-n // (GEMV_ROWS * GEMV_WARPS))
        return [Launch(f"gemv_rows<{ELEMENT_TYPES[dtype]}, {rows}>", (blocks, 1, 1), (32 * GEMV_WARPS, 1, 1), 0,
                       (Pointer(x), Pointer(w_nk), Pointer(y), np.int32(n), np.int32(k)), fused=True,
                       programmatic=programmatic)]  # fmt: skip
    # column-major: y^T (N x M) = w_nk (viewed K x N, transposed) . x^T (viewed K x M)
    out = y if dtype == "float32" else take("matmul_f32", 4 * rows * n)
    element = gemm.CUDA_DATA_TYPES[dtype]
    steps: list = [Gemm(gemm.CUBLAS_OP_T, gemm.CUBLAS_OP_N, n, rows, k, 1.0, w_nk, element, k, 0, x, element, k, 0,
                        out, n, 0, 1)]  # fmt: skip
    if dtype != "float32":
        steps.append(_narrow(dtype, out, y, rows * n))
    return steps


def reference_matmul(x: np.ndarray, w_nk: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """The op's values (the CPU kernel's, and the tests' oracle): x . w_nk^T over the last axis of x, summed in
    float64, rounded once to ``dtype``, as float32."""
    return rounded((x.astype(np.float64) @ w_nk.astype(np.float64).T).astype(np.float32), dtype)
