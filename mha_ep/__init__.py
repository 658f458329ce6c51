"""mha_ep: run and verify ONNX Runtime's com.microsoft::MultiHeadAttention through our own backends.

    result = mha_ep.partition("model.onnx")            # claim-time gate + graph pass; result.report()
    sess = mha_ep.InferenceSession("model.onnx")       # partition + register + onnxruntime session
    options = mha_ep.register(onnxruntime.SessionOptions(), backend="cuda")   # for your own sessions
    report = mha_ep.compare("model.onnx", per_node=True)   # stock ORT vs plugin, per output and per node

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
    "InferenceSession",
    "compare",
    "Decision",
    "MhaEpError",
    "MhaInputError",
    "MhaRunError",
    "MhaModelError",
    "BackendUnavailableError",
]

from mha_ep.claim import Decision
from mha_ep.errors import BackendUnavailableError, MhaEpError, MhaInputError, MhaModelError, MhaRunError
from mha_ep.partition import PartitionResult, partition
from mha_ep.compare import compare  # after this, `mha_ep.compare` is the function, not the module


def register(session_options, backend: str = "auto", device_id: int = 0):
    """Register the plugin on an onnxruntime.SessionOptions; see mha_ep.ops.registration.register."""
    from mha_ep.ops.registration import register as _register

    return _register(session_options, backend, device_id)


def __getattr__(name):
    if name == "InferenceSession":
        from mha_ep.session import InferenceSession

        return InferenceSession
    raise AttributeError(f"module 'mha_ep' has no attribute {name!r}")
