"""mha_ep: run and verify ONNX Runtime's com.microsoft::MultiHeadAttention through our own backends.

    result = mha_ep.partition("model.onnx")            # claim-time gate + graph pass; result.report()
    sess = mha_ep.InferenceSession("model.onnx", sess_options, providers, backend="auto")  # onnxruntime's order
    options = mha_ep.register(onnxruntime.SessionOptions(), backend="cuda")   # for your own sessions
    report = mha_ep.compare("model.onnx", per_node=True)   # stock ORT vs plugin, per output and per node
    path = mha_ep.shipped_model("bert_random_mask2d_fp32.onnx")   # the shipped models, from anywhere

``mha_ep.partition`` and ``mha_ep.compare`` are the modules of those names, and calling them calls their main
function (``mha_ep.partition.partition``, ``mha_ep.compare.compare``).

Where things live: spec.py (the contract), claim/ (the gate and the shared rules), partition.py (the pass),
ops/ (the op, bridge adapter, registration, execute-time validation, backends: reference = NumPy, cuda = CuPy), compare.py, cli.py.
Heavy imports (onnxruntime, CuPy) happen on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "partition",
    "PartitionResult",
    "register",
    "route_of",
    "InferenceSession",
    "compare",
    "shipped_model",
    "Decision",
    "MhaEpError",
    "MhaInputError",
    "MhaRunError",
    "MhaModelError",
    "BackendUnavailableError",
]

from mha_ep.claim import Decision
from mha_ep.errors import BackendUnavailableError, MhaEpError, MhaInputError, MhaModelError, MhaRunError
from mha_ep.partition import PartitionResult
from mha_ep import partition  # noqa: E402 - the module; calling it partitions (mha_ep.partition(path))
from mha_ep import compare  # noqa: E402 - the module; calling it compares (mha_ep.compare(path))
from mha_ep.shipped import shipped_model  # noqa: E402


def register(session_options, backend: str = "auto", device_id: int = 0, route: str = "auto"):
    """Register the plugin on an onnxruntime.SessionOptions; see mha_ep.ops.registration.register."""
    from mha_ep.ops.registration import register as _register

    return _register(session_options, backend, device_id, route)


def route_of(session_options):
    """"native" or "python-op": the route ``mha_ep.register`` put on ``session_options`` (None: none)."""
    from mha_ep.ops.registration import route_of as _route_of

    return _route_of(session_options)


def __getattr__(name):
    if name == "InferenceSession":
        from mha_ep.session import InferenceSession

        return InferenceSession
    raise AttributeError(f"module 'mha_ep' has no attribute {name!r}")
