"""Kernel sources (kernels/*.cu) compiled lazily through CuPy's NVRTC, templated on the compute dtype.

One ``cupy.RawModule`` per (device, source file), built on first use with the name expressions of every dtype and
memoised for the life of the process: a call never compiles twice. ``#include "common.cuh"`` is inlined here, so the
code CuPy hashes for its on-disk cache is the whole source (a header change is never served a stale binary).
"""

from __future__ import annotations

import threading
from pathlib import Path

import cupy

KERNEL_DIR = Path(__file__).parent / "kernels"
COMMON_HEADER = "common.cuh"
ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
# source file -> the templated kernels it defines
KERNEL_FILES = {
    "layout.cu": ("build_dense_BNTH", "context_to_BSD"),
    "softmax.cu": ("masked_softmax",),
}
COMPILE_OPTIONS = ()  # accurate expf: no fast-math

_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str, str], cupy.RawKernel] = {}  # (device, kernel, dtype): the per-call lookup
_lock = threading.Lock()


def kernel_source(file_name: str) -> str:
    """The file's text with the shared header inlined."""
    text = (KERNEL_DIR / file_name).read_text()
    header = (KERNEL_DIR / COMMON_HEADER).read_text().replace("#pragma once\n", "")
    return text.replace(f'#include "{COMMON_HEADER}"', header)


def name_expression(kernel: str, dtype: str) -> str:
    return f"{kernel}<{ELEMENT_TYPES[dtype]}>"


def _file_of(kernel: str) -> str:
    for file_name, kernels in KERNEL_FILES.items():
        if kernel in kernels:
            return file_name
    raise KeyError(f"no kernel source defines {kernel!r}")


def _module(device_id: int, file_name: str) -> cupy.RawModule:
    key = (device_id, file_name)
    with _lock:
        module = _modules.get(key)
        if module is None:
            expressions = [name_expression(k, d) for k in KERNEL_FILES[file_name] for d in ELEMENT_TYPES]
            module = cupy.RawModule(
                code=kernel_source(file_name), options=COMPILE_OPTIONS, name_expressions=expressions
            )
            _modules[key] = module
    return module


def get_kernel(device_id: int, kernel: str, dtype: str) -> cupy.RawKernel:
    """The compiled ``kernel<T>`` for ``dtype`` on ``device_id`` (call with that device current)."""
    key = (device_id, kernel, dtype)
    function = _functions.get(key)
    if function is None:
        function = _module(device_id, _file_of(kernel)).get_function(name_expression(kernel, dtype))
        _functions[key] = function
    return function
