"""ONNX element types by name: "float32" <-> TensorProto.FLOAT, "bfloat16" <-> TensorProto.BFLOAT16.

Shared by the claim gate's shape discovery, compare and the random feeds. ``onnx`` is imported where a helper
runs, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import Optional


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
