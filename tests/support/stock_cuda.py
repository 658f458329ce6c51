"""What the GPU session tests (tests/gpu_session/test_native_session.py and their neighbours) hold mha_ep
to: stock ORT CUDA's outputs for the same model and feeds, both without TF32, and the closeness rule. The pieces
around attention are the same ORT CUDA kernels, so what differs is the attention (held to ORT CPU at 1e-5 / 4e-3
node by node in the parity suites) carried through the rest of a whole model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime

CUDA = "CUDAExecutionProvider"
PROVIDERS = [(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"]
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def stock_cuda(model: onnx.ModelProto, feeds: dict) -> list:
    """Stock ORT CUDA's outputs of ``model`` for ``feeds`` (the provider must be taken)."""
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=PROVIDERS)
    assert CUDA in session.get_providers()
    return session.run(None, feeds)


def assert_close(actual, expected, dtype: str, label: str) -> None:
    """Every output of the same shape and dtype, within TOLERANCE[dtype] of max(1, |expected|)."""
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{label}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
        e64 = e.astype(np.float64)
        error = float(np.max(np.abs(a.astype(np.float64) - e64) / np.maximum(1.0, np.abs(e64))))
        assert error <= TOLERANCE[dtype], f"{label}: error {error:.3g} > {TOLERANCE[dtype]}"
