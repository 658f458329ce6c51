"""The cuda backend (CuPy: NVRTC kernels in kernels/*.cu + cuBLAS strided-batched GEMMs).

``CudaBackend`` is imported lazily, so the CPU-only parts of this package (scratch ownership, launch geometry,
staging layout) import without CuPy: ``from mha_ep.engine.cuda import CudaBackend`` needs CuPy,
``from mha_ep.engine.cuda.scratch import MhaScratch`` does not.
"""

from __future__ import annotations

__all__ = ["CudaBackend"]


def __getattr__(name: str):
    if name == "CudaBackend":
        from mha_ep.engine.cuda.backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
