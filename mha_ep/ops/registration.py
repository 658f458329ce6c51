"""Registration and session options: which backend, the custom-op library on a SessionOptions, ORT's spinning.

The pieces it puts together: mha_ep/ops/bridge.py (the onnxruntime-extensions adapter), mha_ep/ops/op.py (the op
body), mha_ep/ops/context.py (how the op finds its backend and where its errors go).
"""

from __future__ import annotations

import logging
from typing import Optional

from mha_ep.errors import BackendUnavailableError
from mha_ep.ops import bridge, interrupt
from mha_ep.ops.backends import create_backend, cuda_unavailable_reason
from mha_ep.ops.context import set_default_backend

log = logging.getLogger("mha_ep")
# Session config entry saying that attach() already loaded the custom-op library into these options (ORT refuses
# a second load); its value is the name of the backend register() chose.
CONFIG_BACKEND = "mha_ep.backend"
# ORT's intra-op threads spin for a while after each parallel node, waiting for more work. A claimed node runs
# right after such nodes (the Casts of a float16 model) and copies its inputs on threads of its own, which then
# share the cores with the spinning ones: on the H200 host the 8,512 float16 anchor took 21.2 ms a run with
# spinning and 15.0 ms without (same run, interleaved). attach() turns it off; a caller's own setting is kept.
ORT_SPINNING = "session.intra_op.allow_spinning"
_said_fallback = {"done": False}
# The unscoped array hook, for the bridge benchmark (mha_ep/bench.py swaps it with the stock hook).
_array_result_hook = bridge.array_result_hook


def ensure_ops_registered() -> None:
    """Declare the plugin op to onnxruntime-extensions once per process and install the result hook; wrap the
    SIGINT handler when called on the main thread (again each time: a no-op once it is in place)."""
    from mha_ep.ops.op import on_bridge_error, op_body

    bridge.declare_ops(op_body, on_bridge_error)
    interrupt.install()


def resolve_backend(backend: str = "auto", device_id: int = 0):
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


def register(session_options, backend: str = "auto", device_id: int = 0):
    """Register the plugin on ``session_options`` (an ``onnxruntime.SessionOptions``) and return it.

    Loads the onnxruntime-extensions custom-op library and declares our op. ``backend`` becomes the process
    default used by plain ``onnxruntime.InferenceSession`` objects; ``mha_ep.InferenceSession`` binds its own
    backend per session. Raises BackendUnavailableError for ``backend="cuda"`` without CuPy or a usable GPU.

    Do not also register the onnxruntime-extensions library on the same options yourself (for its tokenizer or
    audio ops): this call loads it, and ORT refuses a second load ("Failed to add kernel ... Conflicting").
    """
    chosen = resolve_backend(backend, device_id)
    attach(session_options, chosen)
    set_default_backend(chosen)
    return session_options


def attach(session_options, backend) -> None:
    """Load the custom-op library into ``session_options`` once and turn ORT's intra-op spinning off unless the
    caller set it (ORT_SPINNING's comment)."""
    ensure_ops_registered()
    if not _config_entry(session_options, CONFIG_BACKEND):
        from onnxruntime_extensions import get_library_path

        session_options.register_custom_ops_library(get_library_path())
        session_options.add_session_config_entry(CONFIG_BACKEND, backend.name)
    if _config_entry(session_options, ORT_SPINNING) is None:
        session_options.add_session_config_entry(ORT_SPINNING, "0")


def _config_entry(session_options, key: str) -> Optional[str]:
    try:
        return session_options.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 - ORT raises when the entry does not exist
        return None


__all__ = ["register", "resolve_backend", "ensure_ops_registered", "attach", "BackendUnavailableError"]
