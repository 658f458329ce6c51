"""The error maths of a comparison and the tolerances it is held to: pure functions of arrays and models.

An element passes when ``|plugin - stock| <= atol`` or ``|plugin - stock| <= rtol * |stock|``; NaN in the same
place on both sides, and equal infinities, count as equal. ``max_rel`` is max |d| / max(1, |stock|). The default
tolerances follow the dtype the model *computes* in, not only its I/O dtype: a model converted with
``convert_float_to_float16(keep_io_types=True)`` computes in float16 behind float32 inputs and outputs and gets
the float16 tolerance. They are for whole models (errors compound over layers); single-node parity is held much
tighter in the tests (1e-5 float32, 4e-3 float16).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from mha_ep.comparison.report import Comparison
from mha_ep.dtypes import dtype_name

MODEL_TOLERANCE = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "bfloat16": 6e-2}
INTEGER_TOLERANCE = 0.0


def errors(actual: np.ndarray, expected: np.ndarray, atol: float = 0.0, rtol: float = 0.0) -> tuple:
    """(max |d|, max |d| / max(1, |e|), score): score is max |d| / max(atol, rtol |e|), <= 1 within tolerance."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        return float("inf"), float("inf"), float("inf")
    if a.size == 0:
        return 0.0, 0.0, 0.0
    if (np.isnan(a) ^ np.isnan(e)).any():
        return float("inf"), float("inf"), float("inf")
    same = (np.isnan(a) & np.isnan(e)) | ((a == e) & np.isinf(e))  # equal NaNs and equal infinities agree
    a, e = np.where(same, 0.0, a), np.where(same, 0.0, e)
    diff = np.abs(a - e)
    allowed = np.maximum(atol, rtol * np.abs(e))
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(diff == 0, 0.0, diff / allowed)  # diff > 0 with nothing allowed: inf
    return float(diff.max()), float((diff / np.maximum(1.0, np.abs(e))).max()), float(np.nan_to_num(score, nan=np.inf).max())


def compare_arrays(
    name: str, actual: np.ndarray, expected: np.ndarray, tolerance: Optional[float] = None,
    atol: Optional[float] = None, rtol: Optional[float] = None, compute_dtype: Optional[str] = None,
) -> Comparison:  # fmt: skip
    """One output's comparison. Default tolerance: the looser of the output dtype's and the compute dtype's
    (integer outputs: exact); ``tolerance`` sets both atol and rtol, ``atol``/``rtol`` override each."""
    dtype = str(np.asarray(expected).dtype)
    if tolerance is None:
        tolerance = default_tolerance(dtype, compute_dtype)
    atol = tolerance if atol is None else atol
    rtol = tolerance if rtol is None else rtol
    max_abs, max_rel, score = errors(actual, expected, atol, rtol)
    return Comparison(name, dtype, tuple(np.shape(expected)), max_abs, max_rel, atol, rtol, score)


def default_tolerance(dtype: str, compute_dtype: Optional[str] = None) -> float:
    if dtype not in MODEL_TOLERANCE:
        return INTEGER_TOLERANCE
    return max(MODEL_TOLERANCE[dtype], MODEL_TOLERANCE.get(compute_dtype or dtype, 0.0))


FLOAT_ELEM_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def compute_dtype(model: onnx.ModelProto) -> Optional[str]:
    """The least precise float dtype the model computes in: over its float initializers and constants, the
    targets of its Casts and its recorded inputs, outputs and value_info. ``None`` when it has no float data."""
    graph = model.graph
    found = {init.data_type for init in graph.initializer if init.data_type in FLOAT_ELEM_TYPES}
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i in FLOAT_ELEM_TYPES:
                found.add(attr.i)
            if node.op_type == "Constant" and attr.name == "value" and attr.t.data_type in FLOAT_ELEM_TYPES:
                found.add(attr.t.data_type)
    values = list(graph.value_info) + list(graph.input) + list(graph.output)
    found |= {v.type.tensor_type.elem_type for v in values if v.type.HasField("tensor_type")}
    return loosest({dtype_name(t) for t in found})


def loosest(dtypes) -> Optional[str]:
    """Of ``dtypes``, the float dtype with the loosest model tolerance; ``None`` when none is a float dtype."""
    names = [n for n in dtypes if n in MODEL_TOLERANCE]
    return max(names, key=lambda n: MODEL_TOLERANCE[n]) if names else None
