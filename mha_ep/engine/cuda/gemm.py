"""The two attention GEMMs as cuBLAS strided-batched GemmEx calls (row-major tensors, column-major cuBLAS).

cupy.matmul is far slower than cuBLAS's gemmStridedBatchedEx for these fp16 shapes (docs/FACTS.md §4), so the
GEMMs call cuBLAS directly. Inputs in the compute dtype, float32 outputs, CUBLAS_COMPUTE_32F. float32 runs in true
fp32: while our calls are issued, a TF32 math mode on the shared handle is switched off and restored afterwards.

The calls are built as steps.Gemm values (the native route's C library issues the same calls on ORT's handle);
``run_gemm`` issues one through CuPy's handle. This module imports CuPy only there.

Row-major C[M, N] = A[M, K] . B[K, N] is column-major C^T = B^T . A^T, so every call below swaps its operands:
  scores_BNST[b,n] (S x T) = scale * q_BNSH[b,n] (S x H) . k_BNTH[b,n]^T (H x T)
      cuBLAS: C(T x S) = op_T(K: H x T, ld H) . op_N(Q: H x S, ld H)
  context_BNSH[b,n] (S x Hv) = probs_BNST[b,n] (S x T) . v_BNTH[b,n] (T x Hv)
      cuBLAS: C(Hv x S) = op_N(V: Hv x T, ld Hv) . op_N(P: T x S, ld T)
"""

from __future__ import annotations

import contextlib

import numpy as np

from mha_ep.engine.cuda.steps import Gemm

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
    from cupy_backends.cuda.libs import cublas

    mode = cublas.getMathMode(handle)
    tf32 = (mode & MATH_MODE_MASK) == CUBLAS_TF32_TENSOR_OP_MATH
    if tf32:
        cublas.setMathMode(handle, mode & ~MATH_MODE_MASK)
    try:
        yield
    finally:
        if tf32:
            cublas.setMathMode(handle, mode)


def run_gemm(step, stream_ptr: int, resolve) -> None:
    """Queue ``step`` (a steps.Gemm; ``resolve`` turns its addresses into ints) on ``stream_ptr`` through CuPy's
    cuBLAS handle of the current device, in true fp32 (fp32_math)."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream_ptr)
    alpha_host = np.array(step.alpha, dtype=np.float32)
    beta_host = np.array(0.0, dtype=np.float32)
    with fp32_math(handle):
        cublas.gemmStridedBatchedEx(
            handle, step.trans_a, step.trans_b, step.m, step.n, step.k,
            alpha_host.ctypes.data, resolve(step.a), step.a_type, step.lda, step.stride_a,
            resolve(step.b), step.b_type, step.ldb, step.stride_b,
            beta_host.ctypes.data, resolve(step.c), CUDA_R_32F, step.ldc, step.stride_c,
            step.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip


def scores_gemm(plan, scale: float, q_BNSH, k_BNTH, scores_BNST) -> Gemm:
    """scores_BNST (float32) = scale * Q . K^T, batched over B*N."""
    s, t, h = plan.q_seq, plan.total_seq, plan.head_size
    elem = CUDA_DATA_TYPES[plan.dtype]
    return Gemm(CUBLAS_OP_T, CUBLAS_OP_N, t, s, h, float(scale),
                k_BNTH, elem, h, t * h,
                q_BNSH, elem, h, s * h,
                scores_BNST, t, s * t, plan.batch_heads)  # fmt: skip


def context_gemm(plan, probs_BNST, v_BNTH, context_BNSH) -> Gemm:
    """context_BNSH (float32) = P . V, batched over B*N."""
    s, t, hv = plan.q_seq, plan.total_seq, plan.v_head_size
    elem = CUDA_DATA_TYPES[plan.dtype]
    return Gemm(CUBLAS_OP_N, CUBLAS_OP_N, hv, s, t, 1.0,
                v_BNTH, elem, hv, t * hv,
                probs_BNST, elem, t, s * t,
                context_BNSH, hv, s * hv, plan.batch_heads)  # fmt: skip
