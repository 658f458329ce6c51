"""The native route: claimed nodes as a custom op of ORT's own execution providers, from a C library of ours.

    options = mha_ep.register(onnxruntime.SessionOptions(), backend="cuda")      # route "auto" picks this one
    session = onnxruntime.InferenceSession(partitioned, options, providers=["CUDAExecutionProvider"])

The C files of ``csrc/`` build one shared object, a Python extension module and an ORT custom-op library at
once (``pip install`` builds it with the C compiler alone). ``register`` loads it into a SessionOptions
(``register_custom_ops_library``), which adds the domain ``mha_ep`` with a MultiHeadAttention kernel for
  * CUDAExecutionProvider (when the options ask for it): ORT's device buffers and stream, our kernels launched
    by the CUDA driver from a plan made once per call signature (plan.py, gpu.py) out of the cuda backend's
    pipeline; no Python, no host copy, no Memcpy node on a repeated signature, and ORT's ``enable_cuda_graph``
    captures it; temporaries from ORT's allocator;
  * CPUExecutionProvider: ORT's host buffers handed to Python without a copy (host.py), where the backend the
    session runs (reference, or the cuda backend through host copies) computes the call.
Both read a partitioned model in either form (mha_ep/graph/partition.py): the Python op's, where float16 / bfloat16
nodes talk float32 through Casts, and the native form (``partition(..., route="native")``), where they keep their
own element type, so that a bfloat16 model runs on the GPU in a plain ORT session.

Errors are ORT statuses that name the node, the input, its shape and what was expected: the run fails, the session
stays usable, the process never aborts. This package imports neither CuPy nor onnxruntime until it has to.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
from pathlib import Path
from typing import Optional

from mha_ep.native import choices
from mha_ep.providers import config_entry

CONFIG_EPS = "mha_ep.native_eps"  # session config entry csrc/custom_op.c's RegisterCustomOps reads: "cpu" | "cpu,cuda"
CONFIG_LOADED = "mha_ep.native"  # set once the library is in a SessionOptions (ORT refuses a second load)
_lock = threading.Lock()
_state: dict = {"module": None, "error": None}
settings = choices.settings  # the planner's process-wide choices (choices.py)


SOURCE = Path(__file__).with_name("csrc")  # the library's sources, where the package carries them (a checkout)
REBUILD = "pip install -e . (or python setup.py build_ext --inplace) in the checkout"


def _import():
    from mha_ep.native import _native

    stale = stale_reason(_native, SOURCE)
    if stale is not None:
        raise ImportError(stale)
    return _native


def source_sha256(folder: Path) -> str:
    """The SHA-256 of the library's sources: of the lines ``<SHA-256 of the file>  <name>`` (as sha256sum prints
    them) of every .c and .h file in ``folder``, sorted by name. setup.py builds the same into the library."""
    files = sorted((path for path in folder.iterdir() if path.suffix in (".c", ".h")), key=lambda path: path.name)
    listing = "".join(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n" for path in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def stale_reason(module, source: Path) -> Optional[str]:
    """Why ``module`` (the built library) must be rebuilt before use, or None: it was built from other sources
    than the ``csrc/`` folder ``source`` (an edit since ``pip install -e``, which builds it once). Nothing to
    compare where the sources are absent (a wheel)."""
    if not source.is_dir():
        return None
    built = module.source_sha256() if hasattr(module, "source_sha256") else ""
    actual = source_sha256(source)
    if built == actual:
        return None
    return (f"{Path(module.__file__).name} was built from other sources than {source} (built from "
            f"{built[:12] or 'sources of unknown hash'}, the sources are {actual[:12]}): rebuild it with {REBUILD}")


def library():
    """The configured ``_native`` module; raises ImportError with the reason when it was not built."""
    with _lock:
        if _state["module"] is not None:
            return _state["module"]
        module = _import()
        from mha_ep.native import configs, gpu, host
        from mha_ep.engine import interrupt

        module.configure(configs.describe_kernel, gpu.plan_call, host.compute, configs.ATTRIBUTES)
        interrupt.mark_op_code(host.compute)
        interrupt.mark_op_code(gpu.plan_call)
        atexit.register(module.shutdown)
        _state["module"] = module
        return module


def unavailable_reason() -> Optional[str]:
    """None when the native library is built and loads; else why not, in one sentence."""
    try:
        _import()
    except ImportError as error:
        return (f"the native custom-op library mha_ep/native/_native is not built ({error}); reinstall mha-ep with "
                f"a C compiler and the Python headers present")  # fmt: skip
    return None


def library_path() -> str:
    """The file ORT must open: the very module Python loaded (they then share its globals)."""
    return library().__file__


def stats() -> dict:
    """The plan cache: plans held, hits, misses (planner calls on ORT's thread), evictions, plans made ahead
    (``ahead``) and those a call then used (``ahead_used``); ``ahead_worker``: ahead.py's worker's counts."""
    from mha_ep.native import ahead

    return dict(library().stats(), ahead_worker=ahead.AHEAD.stats())


def take_device_error(device_id: int = 0) -> Optional[str]:
    """The first report of a shared-buffer kernel on ``device_id`` since the last call, as ORT's sentence naming
    the node(s), or None (gpu.take_device_error: how a decode loop replaying CUDA graphs learns of a bad
    past_sequence_length or beam index)."""
    from mha_ep.native import gpu

    library()  # loaded, checked and configured before gpu.py reads its report words
    return gpu.take_device_error(device_id)


def reset_plans() -> None:
    """Forget every plan (the next call of each signature plans again, with the current settings); a plan the
    worker of ahead.py made with the earlier settings is not added after this."""
    from mha_ep.native import ahead

    ahead.AHEAD.reset(library().clear_plans)


def register_library(session_options, with_cuda: bool) -> None:
    """Load the native library into ``session_options``: CPU kernels, and CUDA kernels when ``with_cuda``. Once
    per SessionOptions (a second load is refused by ORT; a second call here keeps the first choice)."""
    path = library_path()
    if config_entry(session_options.get_session_config_entry, CONFIG_LOADED):
        return
    session_options.add_session_config_entry(CONFIG_EPS, "cpu,cuda" if with_cuda else "cpu")
    session_options.register_custom_ops_library(path)
    session_options.add_session_config_entry(CONFIG_LOADED, "1")

