"""What this install has: versions of mha_ep and its runtime pieces, the GPU, and the backend "auto" picks.

    mha-ep --version          prints environment_lines(mha_ep.__version__)

Whether onnxruntime is there at all (``onnxruntime_missing``, ``require_onnxruntime``: one clear ImportError naming
the extra to install) is errors.py's, below the partition pass that requires it.

Nothing here imports onnxruntime or CuPy unless asked; a missing or broken piece is a line, never an exception.
"""

from __future__ import annotations

import importlib.metadata
from typing import List, Optional

from mha_ep.errors import MISSING_ONNXRUNTIME, onnxruntime_missing

ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "ort-nightly")


def _distribution_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def onnxruntime_line() -> str:
    if onnxruntime_missing():
        return f"onnxruntime: not installed ({MISSING_ONNXRUNTIME})"
    flavours = [f"{n} {v}" for n in ORT_DISTRIBUTIONS if (v := _distribution_version(n))]
    try:
        import onnxruntime as ort

        providers = ", ".join(ort.get_available_providers())
        version = ort.__version__
    except Exception as error:  # noqa: BLE001 - a broken install is a line, not a crash
        return f"onnxruntime: installed but not importable ({type(error).__name__}: {error})"
    # the distribution says which flavour (onnxruntime, onnxruntime-gpu, ...); its version only where it differs
    flavours = [flavour[: -len(version) - 1] if flavour.endswith(f" {version}") else flavour for flavour in flavours]
    flavour = "distribution " + " + ".join(flavours) if flavours else "unknown distribution"
    warning = "; two ORT flavours are installed, which share one module: keep one" if len(flavours) > 1 else ""
    return f"onnxruntime: {version} ({flavour}; providers {providers}){warning}"


def extensions_line() -> str:
    version = _distribution_version("onnxruntime-extensions")
    return f"onnxruntime-extensions: {version or 'not installed (pip install onnxruntime-extensions)'}"


def cupy_line() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "CuPy: not installed (the cuda backend needs the gpu extra)"
    try:
        import cupy

        return f"CuPy: {cupy.__version__}"
    except Exception as error:  # noqa: BLE001
        return f"CuPy: installed but not importable ({type(error).__name__}: {error})"


def device_line(device_id: int = 0) -> str:
    from mha_ep.engine.backends import cuda_unavailable_reason

    reason = cuda_unavailable_reason(device_id)
    if reason is not None:
        return f"CUDA device: none usable ({reason})"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"CUDA device {device_id}: {name}, compute capability {props['major']}.{props['minor']}"


def auto_backend_line(device_id: int = 0) -> str:
    from mha_ep.engine.backends import cuda_unavailable_reason

    if cuda_unavailable_reason(device_id) is None:
        return f'backend "auto": cuda (CuPy on GPU {device_id})'
    return 'backend "auto": reference (NumPy; no usable GPU)'


def native_line() -> str:
    """The native custom-op library (mha_ep/native): built or not, and what register(route="auto") takes."""
    from mha_ep import native

    reason = native.unavailable_reason()
    if reason is not None:
        return f"native library: not built ({reason}); every session takes the onnxruntime-extensions route"
    return (f"native library: built ({native.library_path()}); register(backend='cuda') takes it: claimed nodes "
            f"on ORT's CUDA provider")  # fmt: skip


def environment_lines(version: str, device_id: int = 0) -> List[str]:
    """``mha-ep --version``'s lines; ``version``: mha_ep's own (the package's ``__version__``, which the caller
    passes in: this module sits below the package's front)."""
    import platform

    return [
        f"mha_ep {version} (Python {platform.python_version()})",
        onnxruntime_line(),
        extensions_line(),
        native_line(),
        cupy_line(),
        device_line(device_id),
        auto_backend_line(device_id),
    ]
