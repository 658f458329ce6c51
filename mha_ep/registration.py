"""Registration and session options: which backend, the custom-op library on a SessionOptions, ORT's spinning.

The pieces it puts together: mha_ep/python_op/bridge.py (the onnxruntime-extensions adapter),
mha_ep/python_op/op.py (the op body), mha_ep/engine/context.py (how the op finds its backend and where its errors
go), and mha_ep/native (the other route). Choosing between the two routes puts this module above both: the routes
layer (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import Optional

from mha_ep.errors import BackendUnavailableError
from mha_ep.python_op import bridge
from mha_ep.engine import interrupt
from mha_ep.engine.backends import resolve_backend
from mha_ep.engine.context import set_default_backend
from mha_ep.providers import config_entry

# Session config entry naming the backend attach() was given (the CPU kernels' and the Python op's).
CONFIG_BACKEND = "mha_ep.backend"
# ORT's intra-op threads spin for a while after each parallel node, waiting for more work. A claimed node runs
# right after such nodes (the Casts of a float16 model) and copies its inputs on threads of its own, which then
# share the cores with the spinning ones, and the run is slower (docs/BENCH.md, "Host-side choices"). attach() turns it
# off; a caller's own setting is kept.
ORT_SPINNING = "session.intra_op.allow_spinning"
# The unscoped array hook, for the bridge benchmark (mha_ep/bench.py swaps it with the stock hook).
_array_result_hook = bridge.array_result_hook


def ensure_ops_registered() -> None:
    """Declare the plugin op to onnxruntime-extensions once per process and install the result hook; wrap the
    SIGINT handler when called on the main thread (again each time: a no-op once it is in place)."""
    from mha_ep.python_op.op import on_bridge_error, op_body

    bridge.declare_ops(op_body, on_bridge_error)
    interrupt.install()


ROUTES = ("auto", "native", "python-op")
# Session config entry naming the route attach() loaded into these options: "native" (mha_ep/native: our custom-op
# library, CUDA and CPU kernels) or "python-op" (onnxruntime-extensions' Python op, CPU only). ``route_of`` reads it.
CONFIG_ROUTE = "mha_ep.route"


def choose_route(route: str, backend) -> tuple:
    """(route, why) for ``route`` ("auto", "native", "python-op") and the chosen ``backend``: "auto" takes the
    native library when the backend is the cuda one and the library is built (its CUDA kernels run on ORT's own
    buffers and stream), and the Python op otherwise. Raises BackendUnavailableError for "native" without the
    library."""
    from mha_ep import native

    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    missing = native.unavailable_reason()
    if route == "native":
        if missing is not None:
            raise BackendUnavailableError(f"route='native' cannot run: {missing}")
        return "native", "route='native' was asked for"
    if route == "python-op":
        return "python-op", "route='python-op' was asked for"
    if backend.name != "cuda":
        return "python-op", f"backend {backend.name!r}: the onnxruntime-extensions Python op serves CPU sessions"
    if missing is not None:
        return "python-op", missing
    return "native", "the cuda backend: claimed nodes run on ORT's CUDA provider through mha_ep's native library"


def register(session_options, backend: str = "auto", device_id: int = 0, route: str = "auto"):
    """Register the plugin on ``session_options`` (an ``onnxruntime.SessionOptions``) and return it.

    ``route`` (choose_route): "native" loads mha_ep's own custom-op library (mha_ep/native): with the cuda backend
    its CUDA kernels run claimed nodes on ORT's CUDA provider, on ORT's buffers and stream, and its CPU kernels
    serve nodes ORT places on the CPU; "python-op" loads onnxruntime-extensions and declares the Python op (CPU
    provider, host arrays). "auto" (the default) takes "native" for the cuda backend when the library is built.
    ``route_of(session_options)`` says which was taken. ``backend`` becomes the process default of the CPU
    kernels and the Python op in plain ``onnxruntime.InferenceSession`` objects; ``mha_ep.InferenceSession`` binds
    its own backend per session. Raises BackendUnavailableError for ``backend="cuda"`` without CuPy or a usable
    GPU, and for ``route="native"`` without the library.

    Do not also register the onnxruntime-extensions library on the same options yourself (for its tokenizer or
    audio ops) on the Python-op route: this call loads it, and ORT refuses a second load ("Failed to add kernel
    ... Conflicting").
    """
    chosen = resolve_backend(backend, device_id)
    attach(session_options, chosen, route)
    set_default_backend(chosen)
    return session_options


def attach(session_options, backend, route: str = "auto") -> str:
    """Load the route's custom-op library into ``session_options`` once (choose_route; a second call keeps the
    first route, and asking for the other one raises ValueError: both define mha_ep::MultiHeadAttention) and turn
    ORT's intra-op spinning off unless the caller set it (ORT_SPINNING's comment). Returns the route."""
    taken, _ = choose_route(route, backend)
    present = _config_entry(session_options, CONFIG_ROUTE)
    if present is not None and present != taken and route != "auto":
        raise ValueError(f"these SessionOptions already carry mha_ep's {present} route; route={route!r} cannot be "
                         f"added (both define mha_ep::MultiHeadAttention): use a fresh onnxruntime.SessionOptions")
    if present is not None:
        taken = present
    ensure_interrupt_handler()
    if present is None and taken == "native":
        from mha_ep import native

        native.register_library(session_options, with_cuda=backend.name == "cuda")
    elif present is None:
        from onnxruntime_extensions import get_library_path

        ensure_ops_registered()
        session_options.register_custom_ops_library(get_library_path())
    if present is None:
        session_options.add_session_config_entry(CONFIG_ROUTE, taken)
        session_options.add_session_config_entry(CONFIG_BACKEND, backend.name)
    if _config_entry(session_options, ORT_SPINNING) is None:
        session_options.add_session_config_entry(ORT_SPINNING, "0")
    return taken


def plain_session(model, *, providers, backend: str = "cuda", route: str = "native", session_options=None):
    """A plain ``onnxruntime.InferenceSession`` running ``model`` (a path or ModelProto) with mha_ep: its
    MultiHeadAttention nodes partitioned for ``route`` ("native" or "python-op"), the plugin registered on
    ``session_options`` (default: fresh ones) with ``backend``, on ``providers`` as onnxruntime takes them. The one
    way mha_ep builds such a session (the static-cache loop's, the benchmarks'); mha_ep.InferenceSession is the
    other, with its own error channel and device I/O. Raises MhaEpError when the route asked for is not the one
    registered (the native library missing)."""
    import onnxruntime as ort

    from mha_ep.errors import MhaEpError
    from mha_ep.graph.partition import partition

    partitioned = partition(model, route=route).model.SerializeToString()
    options = register(session_options if session_options is not None else ort.SessionOptions(), backend=backend,
                       route=route)  # fmt: skip
    if route_of(options) != route:
        raise MhaEpError(f"mha_ep.registration.plain_session: route {route!r} was asked for, the options carry "
                         f"{route_of(options)!r}")  # fmt: skip
    return ort.InferenceSession(partitioned, options, providers=list(providers))


def route_of(session_options) -> Optional[str]:
    """"native" or "python-op": the route mha_ep registered on ``session_options``; None when it registered none."""
    return _config_entry(session_options, CONFIG_ROUTE)


def ensure_interrupt_handler() -> None:
    """Wrap the SIGINT handler when called on the main thread (mha_ep/engine/interrupt.py)."""
    interrupt.install()


def _config_entry(session_options, key: str) -> Optional[str]:
    return config_entry(session_options.get_session_config_entry, key)


__all__ = ["register", "resolve_backend", "ensure_ops_registered", "attach", "route_of", "choose_route",
           "BackendUnavailableError"]
