"""ORT's side of a GPU session's call: its tensor types as NumPy's, its values as CuPy arrays, and a run through
IOBinding.

``OrtCalls`` is how the session's other parts reach ORT: ``run(binding, options)`` is the session's guarded
``run_with_iobinding`` (its error channel; a ``DirectRun`` stands in for a binding where the call is another of
ORT's), ``options()`` a fresh RunOptions, ``direct`` ORT's C binding objects where this onnxruntime exposes them
(direct_binding), and ``eager_values`` one eager run (no graph) of a call's feeds on the device.

An eager run synchronizes ORT's stream at its end, so its outputs are ready on any stream once
``run_with_iobinding`` returns; its inputs are made ready before it (the caller's stream is synchronized first,
and so is the call's upload stream, unless it is ORT's own: ONE_STREAM_REPLAY in slots.py).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import numpy as np

# ORT's tensor type names -> NumPy dtypes (bfloat16 has none: such sessions keep ORT's own run)
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
             "tensor(bool)": "bool", "tensor(int16)": "int16", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32",
             "tensor(uint64)": "uint64"}  # fmt: skip


def numpy_dtype(ort_type: str) -> Optional[str]:
    """The NumPy dtype name of an ORT tensor type, or None when NumPy and CuPy have none (bfloat16, strings)."""
    return ORT_TYPES.get(ort_type)


def unsupported_tensors(session) -> List[str]:
    """Inputs and outputs of ``session`` whose type has no CuPy dtype (they keep ORT's own run), as 'name (type)'."""
    args = list(session.get_inputs()) + list(session.get_outputs())
    return [f"{a.name} ({a.type})" for a in args if numpy_dtype(a.type) is None]


_DTYPES: Dict[str, np.dtype] = {}  # ORT type name -> NumPy dtype (looked up once: this runs per output per call)


def ortvalue_array(value, device_id: int = -1):
    """A CuPy array over an ORT value's device buffer on ``device_id`` (-1: the current device; no copy, the array
    keeps the value alive)."""
    import cupy

    kind = value.data_type()
    dtype = _DTYPES.get(kind)
    if dtype is None:
        dtype = _DTYPES.setdefault(kind, np.dtype(numpy_dtype(kind)))
    shape = tuple(value.shape())
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return cupy.empty(shape, dtype)
    memory = cupy.cuda.UnownedMemory(value.data_ptr(), size, value, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def direct_binding(session, device_id: int):
    """(C session, C device, a maker of C bindings) where this onnxruntime exposes its C binding objects, else
    None. The Python wrappers cost several times the direct calls (bind_input's OrtDevice per call, an OrtValue
    wrapper per output, run_with_iobinding's checks)."""
    import onnxruntime as ort

    try:
        c_session = session._sess
        c_device = ort.OrtDevice.make("cuda", device_id)._get_c_device()
        probe = session.io_binding()._iobinding
        if not all(callable(getattr(probe, f, None)) for f in ("bind_input", "bind_output", "get_outputs")):
            return None
    except AttributeError:  # another onnxruntime: the public wrappers
        return None
    return c_session, c_device, lambda: session.io_binding()._iobinding


class DirectRun:
    """Stands in for an IOBinding in the session's ``run(binding, options)`` guard: runs ``call`` instead."""

    def __init__(self, call: Callable):
        self.call = call


class OrtCalls:
    """One ORT CUDA session's runs (module docstring). ``run(binding, options)`` is the session's guarded
    ``run_with_iobinding``; ``options()`` makes a fresh RunOptions (a call may bring its own ``make_options``: the
    caller's run options). ``ort_stream``: the stream a graph session's ORT runs on (None: an eager session)."""

    def __init__(self, session, device_id: int, run: Callable, options: Callable, ort_stream=None):
        self.session = session
        self.device_id = device_id
        self.run = run
        self.options = options
        self.ort_stream = ort_stream
        self.outputs = [a.name for a in session.get_outputs()]
        self.direct = direct_binding(session, device_id)
        self._types: Dict[str, int] = {}  # dtype name -> ONNX element type

    def eager_values(self, lane, host: dict, device: dict, make_options: Optional[Callable]) -> Dict[str, object]:
        """ORT's eager run of the call: ``host`` feeds go up on the lane (lanes.Lane), ``device`` feeds are bound
        where they lie, every output is ORT's own value (name -> ORT value, ready on any stream)."""
        uploaded = lane.transfers.to_device(host) if host else {}
        # ONE_STREAM_REPLAY (slots.py): a graph session's ORT runs behind the copies, on their stream
        if host and self.ort_stream is None:
            lane.stream.synchronize()
        options = (make_options or self.options)()
        # -1: no graph for this run. Set on every eager run: ORT's Python run_with_iobinding looks the entry up on
        # every run, and a missing one costs a caught exception (docs/BENCH.md, "Host-side choices").
        options.add_run_config_entry("gpu_graph_id", "-1")
        if self.direct is None:
            binding = self.session.io_binding()
            for name, array in {**uploaded, **device}.items():
                binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
            for name in self.outputs:
                binding.bind_output(name, "cuda", self.device_id)
            self.run(binding, options)
            return dict(zip(self.outputs, binding.get_outputs()))
        c_session, c_device, make_binding = self.direct
        c_binding = make_binding()
        for name, array in {**uploaded, **device}.items():
            c_binding.bind_input(name, c_device, self.element(array.dtype), list(array.shape), array.data.ptr)
        for name in self.outputs:
            c_binding.bind_output(name, c_device)
        self.run(DirectRun(lambda: c_session.run_with_iobinding(c_binding, options)), options)
        vector = c_binding.get_outputs()
        return {name: vector[i] for i, name in enumerate(self.outputs)}

    def element(self, dtype) -> int:
        """The ONNX element type of a NumPy or CuPy dtype (looked up once per dtype)."""
        key = str(dtype)
        if key not in self._types:
            from mha_ep.dtypes import elem_type

            self._types[key] = elem_type(key)
        return self._types[key]
