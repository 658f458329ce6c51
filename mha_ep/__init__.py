"""mha_ep: run and verify ONNX Runtime's com.microsoft::MultiHeadAttention through our own backends.

    result = mha_ep.partition("model.onnx")            # claim-time gate + graph pass; result.report()
    sess = mha_ep.InferenceSession("model.onnx", sess_options, providers, backend="auto")  # onnxruntime's order
    options = mha_ep.register(onnxruntime.SessionOptions(), backend="cuda")   # for your own sessions
    report = mha_ep.compare("model.onnx", per_node=True)   # stock ORT vs plugin, per output and per node
    path = mha_ep.shipped_model("bert_random_mask2d_fp32.onnx")   # the shipped models, from anywhere

Where things live (docs/ARCHITECTURE.md has the map): spec.py (the contract), claim/ (the gate and the shared
rules), graph/ (the partition pass, model files, lift, static cache), engine/ (execute-time validation, backends:
reference = NumPy, cuda = CuPy), python_op/ (the onnxruntime-extensions op), native/ (the native custom-op
library), registration.py (the route), gpu_session/ and session.py (mha_ep.InferenceSession), decode/ (GPU decode
loops), comparison/, cli.py. Heavy imports (onnxruntime, CuPy) happen on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "partition",
    "PartitionResult",
    "register",
    "route_of",
    "InferenceSession",
    "StaticDecoder",
    "generate_static",
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
from mha_ep.graph.partition import partition
from mha_ep.graph.partition_result import PartitionResult
from mha_ep.shipped import shipped_model  # noqa: E402


def compare(model, *args, **kwargs):
    """Stock ORT vs the plugin on the same feeds, per output and per node; see mha_ep.comparison.compare."""
    from mha_ep.comparison import compare as _compare

    return _compare(model, *args, **kwargs)


def register(session_options, backend: str = "auto", device_id: int = 0, route: str = "auto"):
    """Register the plugin on an onnxruntime.SessionOptions; see mha_ep.registration.register."""
    from mha_ep.registration import register as _register

    return _register(session_options, backend, device_id, route)


def route_of(session_options):
    """"native" or "python-op": the route ``mha_ep.register`` put on ``session_options`` (None: none)."""
    from mha_ep.registration import route_of as _route_of

    return _route_of(session_options)


def __getattr__(name):
    if name == "InferenceSession":
        from mha_ep.session import InferenceSession

        return InferenceSession
    if name == "StaticDecoder":  # decode/static_decode.py: a static-cache decoder bound once, replayed a step
        from mha_ep.decode.static_decode import StaticDecoder

        return StaticDecoder
    if name == "generate_static":  # decode/static_generate.py: the greedy / beam loop over any static-cache decoder
        from mha_ep.decode.static_generate import generate_static

        return generate_static
    raise AttributeError(f"module 'mha_ep' has no attribute {name!r}")
