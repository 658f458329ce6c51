"""ONNX element types by name: "float32" <-> TensorProto.FLOAT, "bfloat16" <-> TensorProto.BFLOAT16.

Shared by the claim gate's shape discovery, compare and the random feeds; and ``rounded``, float32 values rounded
to float16 / bfloat16 in NumPy (DecodeMatMul's CPU kernel, the benches' inputs). ``onnx`` is imported where a
helper runs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def dtype_name(elem_type: int) -> Optional[str]:
    """The numpy-style name of an ONNX element type ("float32", "int64", "bfloat16"); None for UNDEFINED."""
    import onnx

    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    name = onnx.TensorProto.DataType.Name(elem_type).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def elem_type(name: str) -> int:
    """Inverse of dtype_name: "float32" -> TensorProto.FLOAT, "bfloat16" -> TensorProto.BFLOAT16."""
    import onnx

    onnx_name = {"float32": "FLOAT", "float64": "DOUBLE"}.get(name, name.upper())
    return onnx.TensorProto.DataType.Value(onnx_name)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to ``dtype`` (float16 or bfloat16: to nearest, ties to even; a NaN stays NaN;
    float32: as they are), as float32."""
    values = np.ascontiguousarray(values, np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        out = (kept & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(values), values, out)
    return values
