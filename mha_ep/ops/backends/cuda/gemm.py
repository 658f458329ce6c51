"""The two attention GEMMs as cuBLAS strided-batched GemmEx calls (row-major tensors, column-major cuBLAS).

DESIGN.md measured cupy.matmul at 12.6 TFLOP/s for these fp16 shapes and gemmStridedBatchedEx at 143, so the
GEMMs call cuBLAS directly. Inputs in the compute dtype, float32 outputs, CUBLAS_COMPUTE_32F. float32 runs in true
fp32: while our calls are issued, a TF32 math mode on the shared handle is switched off and restored afterwards.

Row-major C[M, N] = A[M, K] . B[K, N] is column-major C^T = B^T . A^T, so every call below swaps its operands:
  scores_BNST[b,n] (S x T) = scale * q_BNSH[b,n] (S x H) . k_BNTH[b,n]^T (H x T)
      cuBLAS: C(T x S) = op_T(K: H x T, ld H) . op_N(Q: H x S, ld H)
  context_BNSH[b,n] (S x Hv) = probs_BNST[b,n] (S x T) . v_BNTH[b,n] (T x Hv)
      cuBLAS: C(Hv x S) = op_N(V: Hv x T, ld Hv) . op_N(P: T x S, ld T)
"""

from __future__ import annotations

import contextlib

import numpy as np
from cupy_backends.cuda.libs import cublas

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUDA_DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_TF32_TENSOR_OP_MATH = 3
MATH_MODE_MASK = 0xF  # the low bits name the mode; higher bits are flags


@contextlib.contextmanager
def fp32_math(handle: int):
    """Disable a TF32 math mode on ``handle`` for the block (the handle is CuPy's, shared with other code)."""
    mode = cublas.getMathMode(handle)
    tf32 = (mode & MATH_MODE_MASK) == CUBLAS_TF32_TENSOR_OP_MATH
    if tf32:
        cublas.setMathMode(handle, mode & ~MATH_MODE_MASK)
    try:
        yield
    finally:
        if tf32:
            cublas.setMathMode(handle, mode)


def _gemm(handle, trans_a, trans_b, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb, stride_b, c, ldc,
          stride_c, batch):
    alpha_host = np.array(alpha, dtype=np.float32)
    beta_host = np.array(0.0, dtype=np.float32)
    cublas.gemmStridedBatchedEx(
        handle, trans_a, trans_b, m, n, k,
        alpha_host.ctypes.data, a, a_type, lda, stride_a,
        b, b_type, ldb, stride_b,
        beta_host.ctypes.data, c, CUDA_R_32F, ldc, stride_c,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
    )  # fmt: skip


def scores_gemm(handle, plan, scale: float, q_BNSH: int, k_BNTH: int, scores_BNST: int) -> None:
    """scores_BNST (float32) = scale * Q . K^T, batched over B*N."""
    s, t, h = plan.q_seq, plan.total_seq, plan.head_size
    elem = CUDA_DATA_TYPES[plan.dtype]
    _gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, t, s, h, scale,
          k_BNTH, elem, h, t * h,
          q_BNSH, elem, h, s * h,
          scores_BNST, t, s * t, plan.batch_heads)  # fmt: skip


def context_gemm(handle, plan, probs_BNST: int, v_BNTH: int, context_BNSH: int) -> None:
    """context_BNSH (float32) = P . V, batched over B*N."""
    s, t, hv = plan.q_seq, plan.total_seq, plan.v_head_size
    elem = CUDA_DATA_TYPES[plan.dtype]
    _gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, hv, s, t, 1.0,
          v_BNTH, elem, hv, t * hv,
          probs_BNST, elem, t, s * t,
          context_BNSH, hv, s * hv, plan.batch_heads)  # fmt: skip
