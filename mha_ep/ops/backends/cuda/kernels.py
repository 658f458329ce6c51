"""Kernel sources (kernels/*.cu) compiled lazily through CuPy's NVRTC, templated on the compute dtype.

One ``cupy.RawModule`` per (device, source file), built on first use with the name expressions of every dtype and
memoised for the life of the process: a call never compiles twice. ``#include "common.cuh"`` is inlined here, so the
code CuPy hashes for its on-disk cache is the whole source (a header change is never served a stale binary).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import cupy

KERNEL_DIR = Path(__file__).parent / "kernels"
COMMON_HEADER = "common.cuh"
ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
# kernel -> (source file, its template arguments after the element type; None: the element type alone)
KERNELS = {
    "build_dense_BNTH": ("layout.cu", (1, 4)),  # VEC
    "context_to_BSD": ("layout.cu", (1, 4)),  # VEC
    "masked_softmax_warp": ("softmax.cu", (1, 2, 4, 8, 16, 32)),  # COLS_PER_LANE
    "masked_softmax": ("softmax.cu", (None,)),
}
COMPILE_OPTIONS = ()  # accurate expf: no fast-math

_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple, cupy.RawKernel] = {}  # (device, kernel, dtype, variant): the per-call lookup
_lock = threading.Lock()


def kernel_source(file_name: str) -> str:
    """The file's text with the shared header inlined."""
    text = (KERNEL_DIR / file_name).read_text()
    header = (KERNEL_DIR / COMMON_HEADER).read_text().replace("#pragma once\n", "")
    return text.replace(f'#include "{COMMON_HEADER}"', header)


def name_expression(kernel: str, dtype: str, variant: Optional[int] = None) -> str:
    arguments = ELEMENT_TYPES[dtype] if variant is None else f"{ELEMENT_TYPES[dtype]}, {variant}"
    return f"{kernel}<{arguments}>"


def _module(device_id: int, file_name: str) -> cupy.RawModule:
    key = (device_id, file_name)
    with _lock:
        module = _modules.get(key)
        if module is None:
            expressions = [
                name_expression(kernel, dtype, variant)
                for kernel, (source, variants) in KERNELS.items()
                if source == file_name
                for variant in variants
                for dtype in ELEMENT_TYPES
            ]
            module = cupy.RawModule(
                code=kernel_source(file_name), options=COMPILE_OPTIONS, name_expressions=expressions
            )
            _modules[key] = module
    return module


def get_kernel(device_id: int, kernel: str, dtype: str, variant: Optional[int] = None) -> cupy.RawKernel:
    """The compiled ``kernel<T[, variant]>`` for ``dtype`` on ``device_id`` (call with that device current)."""
    key = (device_id, kernel, dtype, variant)
    function = _functions.get(key)
    if function is None:
        function = _module(device_id, KERNELS[kernel][0]).get_function(name_expression(kernel, dtype, variant))
        _functions[key] = function
    return function
