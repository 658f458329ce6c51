"""Backends: one interface, two implementations.

A backend is an object with ``name`` (str), ``device`` (str, for reports) and ``run(problem: MhaProblem) ->
MhaResult``. ``reference`` is NumPy and reproduces stock ORT's CPU math; ``cuda`` is CuPy (NVRTC kernels in .cu
files + cuBLAS) and is imported only when asked for, so nothing here needs CuPy.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Protocol

from mha_ep.errors import BackendUnavailableError
from mha_ep.engine.problem import MhaProblem, MhaResult

BACKENDS = ("reference", "cuda", "auto")
log = logging.getLogger("mha_ep")
_said_fallback = {"done": False}


class Backend(Protocol):
    name: str
    device: str

    def run(self, problem: MhaProblem, borrow_outputs: bool = False) -> MhaResult:
        """``borrow_outputs``: the result may alias memory of the backend that the calling thread's next call
        reuses (the caller copies it at once); otherwise the arrays are the caller's."""
        ...


def cuda_unavailable_reason(device_id: int = 0) -> Optional[str]:
    """None when the cuda backend can run on ``device_id``; otherwise what is missing, in one sentence."""
    try:
        import cupy  # noqa: F401
    except Exception as error:  # noqa: BLE001 - ImportError or a broken CUDA install
        return f"CuPy is not importable ({type(error).__name__}: {error}); install mha-ep[gpu]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001
        return f"no usable CUDA GPU ({type(error).__name__}: {error})"
    if count == 0:
        return "no CUDA GPU is visible"
    if not 0 <= device_id < count:
        return f"device_id {device_id} is out of range: {count} CUDA GPU(s) visible"
    return None


@functools.lru_cache(maxsize=None)
def create_backend(name: str, device_id: int = 0) -> Backend:
    """The backend named ``name`` ("reference" or "cuda"), one instance per (name, device)."""
    if name == "reference":
        from mha_ep.engine.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "cuda":
        reason = cuda_unavailable_reason(device_id)
        if reason is not None:
            raise BackendUnavailableError(f"backend='cuda' cannot run: {reason}")
        from mha_ep.engine.cuda import CudaBackend

        return CudaBackend(device_id)
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def resolve_backend(backend: str = "auto", device_id: int = 0) -> Backend:
    """"reference" | "cuda" | "auto" -> a backend object. "auto" falls back to reference and says so once."""
    if backend == "auto":
        reason = cuda_unavailable_reason(device_id)
        if reason is None:
            return create_backend("cuda", device_id)
        if not _said_fallback["done"]:
            _said_fallback["done"] = True
            log.warning("mha_ep: no usable GPU (%s); claimed nodes run on the reference backend (NumPy)", reason)
        return create_backend("reference")
    if backend not in ("reference", "cuda"):
        raise ValueError(f"backend must be 'reference', 'cuda' or 'auto', got {backend!r}")
    return create_backend(backend, device_id)
