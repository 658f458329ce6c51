"""The GPU side of a ``mha_ep.InferenceSession`` on the CUDA provider: one ORT session, tensors on the device.

The session is a plain ORT CUDA session over the native form of the model (claimed nodes run as mha_ep's native
CUDA op, on ORT's buffers and stream). This module is how its calls move tensors:

  * ``run`` with NumPy feeds: the feeds go up through one page-locked staging buffer (transfer.py), are bound to
    the session with IOBinding, and the outputs come down into pooled page-locked blocks. ORT's own ``run``
    would copy every feed from pageable memory and every output into fresh pageable arrays.
  * ``run_device``: CuPy arrays (or anything with ``__dlpack__``) are bound where they lie, after the caller's
    stream has finished writing them; the outputs are CuPy arrays over ORT's own output buffers (no copy).
  * Graphs: where the caller turned on ORT's ``enable_cuda_graph`` and ORT accepted it (every node on the CUDA
    provider), each call signature (feed names, shapes, dtypes) gets a ``gpu_graph_id`` of its own with inputs
    and outputs at fixed device addresses: the signature's first call runs eagerly (``gpu_graph_id`` -1) to learn
    the output shapes, the next ones are ORT's capture and replays. A call copies its feeds into the signature's
    buffers and its outputs out of them; with device feeds (``run_device``) both copies go on the caller's
    current stream around one synchronization, so the outputs are ready in that stream's order. ORT cannot drop a graph it captured, so at most ``MAX_GRAPHS``
    signatures get one; later ones run eagerly.

ORT runs on a stream of its own and synchronizes it at the end of every run, so outputs are ready on any stream
once ``run_with_iobinding`` returns; the inputs are made ready before it (our upload stream, or the caller's
stream, is synchronized first).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np

from mha_ep.native.ort_checks import call_error, dtype_error, execution_error, tensor_type, wanted_outputs

MAX_GRAPHS = 16  # signatures with a captured graph per session (ORT keeps each graph until the session goes)
COPY_THREADS = 4  # host copies into the staging buffer (transfer.py, staging.stage_uploads)
# ORT's tensor type names -> NumPy dtypes (bfloat16 has none: such sessions keep ORT's own run)
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
             "tensor(bool)": "bool", "tensor(int16)": "int16", "tensor(uint16)": "uint16"}  # fmt: skip


def numpy_dtype(ort_type: str) -> Optional[str]:
    """The NumPy dtype name of an ORT tensor type, or None when NumPy and CuPy have none (bfloat16, strings)."""
    return ORT_TYPES.get(ort_type)


def unsupported_tensors(session) -> List[str]:
    """Inputs and outputs of ``session`` whose type has no CuPy dtype (they keep ORT's own run), as 'name (type)'."""
    args = list(session.get_inputs()) + list(session.get_outputs())
    return [f"{a.name} ({a.type})" for a in args if numpy_dtype(a.type) is None]


_DTYPES: Dict[str, np.dtype] = {}  # ORT type name -> NumPy dtype (looked up once: this runs per output per call)


def ortvalue_array(value):
    """A CuPy array over an ORT value's device buffer (no copy; the array keeps the value alive)."""
    import cupy

    kind = value.data_type()
    dtype = _DTYPES.get(kind)
    if dtype is None:
        dtype = _DTYPES.setdefault(kind, np.dtype(numpy_dtype(kind)))
    shape = tuple(value.shape())
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return cupy.empty(shape, dtype)
    memory = cupy.cuda.UnownedMemory(value.data_ptr(), size, value)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def device_feed(name: str, value, expected: str):
    """A device feed as a C-contiguous CuPy array of dtype ``expected`` (ORT's InvalidArgument otherwise)."""
    import cupy

    array = value if isinstance(value, cupy.ndarray) else cupy.from_dlpack(value)
    error = dtype_error(name, array.dtype, tensor_type(expected))
    if error is not None:
        raise error
    return array if array.flags.c_contiguous else cupy.ascontiguousarray(array)


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


class _Direct:
    """Stands in for an IOBinding in the session's ``run(binding, options)`` guard: runs ``call`` instead."""

    def __init__(self, call: Callable):
        self.call = call


@dataclass
class GraphSlot:
    """One call signature's fixed buffers under ORT's CUDA graph (``graph_id`` its ``gpu_graph_id``)."""

    graph_id: int
    inputs: Dict[str, object]  # name -> CuPy array the graph reads
    outputs: Dict[str, object]  # name -> ORT value the graph writes
    binding: object = None
    calls: int = 0
    views: Dict[str, object] = field(default_factory=dict)  # name -> CuPy array over the output value
    pending: object = None  # a CUDA event after the last run_device's copies out of the outputs


class CudaSessionIO:
    """How one ORT CUDA session's calls move tensors (module docstring). ``run(binding, options)`` is the
    session's guarded ``run_with_iobinding``; ``options()`` makes a fresh RunOptions (a call may bring its own
    ``make_options``: the caller's run options)."""

    def __init__(self, session, device_id: int, graphs: bool, run: Callable, options: Callable):
        import cupy

        from mha_ep.native.transfer import HostTransfers

        self.session = session
        self.device_id = device_id
        self.graphs = graphs
        self._run = run
        self._options = options
        self.input_args = list(session.get_inputs())  # ORT's NodeArgs: a call is checked as run() checks it
        self.inputs = {a.name: numpy_dtype(a.type) for a in self.input_args}
        self.outputs = [a.name for a in session.get_outputs()]
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.transfers = HostTransfers(self.stream, device_id, ThreadPoolExecutor(COPY_THREADS, "mha_ep_copy"))
        self.slots: Dict[tuple, Optional[GraphSlot]] = {}  # signature -> its graph (None: runs eagerly)
        self._lock = threading.Lock()  # the staging buffer and the graph buffers: one call at a time
        self._types: Dict[str, int] = {}  # dtype name -> ONNX element type
        self.direct = direct_binding(session, device_id)

    # ------------------------------------------------------------------------------------------ calls
    def run_host(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """NumPy (or device) feeds in, NumPy outputs out, through page-locked memory."""
        import cupy

        wanted = self._checked(feeds, output_names)
        try:
            with self._lock, cupy.cuda.Device(self.device_id):
                host, device = self._split(feeds)
                if device:
                    self._settle_caller()
                arrays = self._call(host, device, wanted, make_options or self._options)
                results = self.transfers.download(arrays)
                self.transfers.settle()
        except RuntimeError as error:
            self._raise_as_run(error, feeds, wanted, make_options)
        return results

    def run_device(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """Device (or NumPy) feeds in, CuPy outputs out."""
        import cupy

        wanted = self._checked(feeds, output_names)
        try:
            with self._lock, cupy.cuda.Device(self.device_id):
                host, device = self._split(feeds)
                slot = self.slots.get(self.signature(host, device)) if self.graphs and not host else None
                if slot is not None:
                    return self._replay_device(slot, device, wanted, make_options or self._options)
                self._settle_caller()
                arrays = self._call(host, device, wanted, make_options or self._options)
                if self._graph_of(host, device) is not None:  # the graph's buffers are written again next call
                    with self.stream:
                        arrays = [cupy.array(a, copy=True) for a in arrays]
                    self.stream.synchronize()
                self.transfers.settle()
        except RuntimeError as error:
            self._raise_as_run(error, feeds, wanted, make_options)
        return arrays

    # --------------------------------------------------------------------------------------- internals
    def _raise_as_run(self, error: RuntimeError, feeds: Mapping, wanted: List[str], make_options) -> None:
        """Raise what ORT's ``run`` raises for this failed call (ort_checks.execution_error: a stock node's
        failure through IOBinding has lost its type), else ``error`` itself."""
        import cupy

        def rerun():
            host = {}
            for name, value in feeds.items():
                on_device = isinstance(value, cupy.ndarray) or (not isinstance(value, np.ndarray)
                                                                and hasattr(value, "__dlpack__"))  # fmt: skip
                array = value if isinstance(value, cupy.ndarray) else cupy.from_dlpack(value) if on_device else value
                host[name] = cupy.asnumpy(array) if on_device else value
            options = (make_options or self._options)()
            options.add_run_config_entry("gpu_graph_id", "-1")  # never a capture on the failure path
            self.session.run(wanted, host, options)

        failure = execution_error(error, rerun)
        if failure is error:
            raise error
        raise failure from error

    def _checked(self, feeds: Mapping, output_names) -> List[str]:
        """The outputs the call asks for; raises what ORT's ``run`` raises for a call that does not fit the
        model (ort_checks.py), before any copy or graph is touched."""
        error = call_error(self.input_args, self.outputs, feeds, output_names)
        if error is not None:
            raise error
        return wanted_outputs(self.outputs, output_names)

    def _split(self, feeds: Mapping) -> tuple:
        """(host feeds, device feeds), each checked against the model's dtype and made C-contiguous."""
        import cupy

        from mha_ep.native.transfer import host_feed

        host, device = {}, {}
        for name, value in feeds.items():
            if isinstance(value, cupy.ndarray):  # the common device case first: no host checks
                device[name] = device_feed(name, value, self.inputs[name])
                continue
            array = host_feed(name, value, self.inputs[name])
            if array is None:
                device[name] = device_feed(name, value, self.inputs[name])
            else:
                host[name] = array
        return host, device

    @staticmethod
    def _settle_caller() -> None:
        """The caller's stream has finished writing its device feeds (ORT's stream does not wait for it)."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    def _graph_of(self, host: dict, device: dict) -> Optional[GraphSlot]:
        if not self.graphs:
            return None
        return self.slots.get(self.signature(host, device))

    @staticmethod
    def signature(host: dict, device: dict) -> tuple:
        merged = {**host, **device}
        return tuple((name, tuple(merged[name].shape), str(merged[name].dtype)) for name in sorted(merged))

    def _call(self, host: dict, device: dict, wanted: List[str], make_options: Callable) -> list:
        """Run the session on the feeds; CuPy arrays of the ``wanted`` outputs (valid until the next call when they
        are a graph's buffers)."""
        if not self.graphs:
            return self._eager(host, device, wanted, make_options)
        key = self.signature(host, device)
        if key not in self.slots:  # the signature's first call: eager, and it tells the output shapes
            values = self._eager_values(host, device, make_options, skip_graph=True)
            self.slots[key] = self._new_slot(host, device, values) if len(self.slots) < MAX_GRAPHS else None
            return [ortvalue_array(values[name]) for name in wanted]
        slot = self.slots[key]
        if slot is None:
            return self._eager(host, device, wanted, make_options, skip_graph=True)
        return self._replay(slot, host, device, wanted, make_options)

    def _eager(self, host: dict, device: dict, wanted: List[str], make_options: Callable,
               skip_graph: bool = False) -> list:
        values = self._eager_values(host, device, make_options, skip_graph)
        return [ortvalue_array(values[name]) for name in wanted]

    def _eager_values(self, host: dict, device: dict, make_options: Callable, skip_graph: bool) -> Dict[str, object]:
        uploaded = self.transfers.to_device(host) if host else {}
        if host:
            self.stream.synchronize()
        options = make_options()
        # -1: no graph for this run. Set on every eager run: ORT's Python run_with_iobinding looks the entry up on
        # every run, and a missing one costs a caught exception (docs/BENCH.md, "Host-side choices").
        options.add_run_config_entry("gpu_graph_id", "-1")
        if self.direct is None:
            binding = self.session.io_binding()
            for name, array in {**uploaded, **device}.items():
                binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
            for name in self.outputs:
                binding.bind_output(name, "cuda", self.device_id)
            self._run(binding, options)
            return dict(zip(self.outputs, binding.get_outputs()))
        c_session, c_device, make_binding = self.direct
        c_binding = make_binding()
        for name, array in {**uploaded, **device}.items():
            c_binding.bind_input(name, c_device, self._element(array.dtype), list(array.shape), array.data.ptr)
        for name in self.outputs:
            c_binding.bind_output(name, c_device)
        self._run_direct(lambda: c_session.run_with_iobinding(c_binding, options), options)
        vector = c_binding.get_outputs()
        return {name: vector[i] for i, name in enumerate(self.outputs)}

    def _element(self, dtype) -> int:
        key = str(dtype)
        if key not in self._types:
            from mha_ep.dtypes import elem_type

            self._types[key] = elem_type(key)
        return self._types[key]

    def _run_direct(self, call: Callable, options) -> None:
        """A direct C-level run with the session's error channel (the ``run`` callable's guard)."""
        self._run(_Direct(call), options)

    def _new_slot(self, host: dict, device: dict, values: Dict[str, object]) -> GraphSlot:
        import cupy
        import onnxruntime as ort

        graph_id = 1 + sum(slot is not None for slot in self.slots.values())  # ids from 1 (0 is ORT's own)
        with cupy.cuda.Device(self.device_id):
            inputs = {name: cupy.empty(array.shape, array.dtype) for name, array in {**host, **device}.items()}
        outputs = {}
        for name, value in values.items():
            dtype = np.dtype(numpy_dtype(value.data_type()))
            outputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape()), dtype.type, "cuda",
                                                                      self.device_id)  # fmt: skip
        binding = self.session.io_binding()
        for name, array in inputs.items():
            binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        slot = GraphSlot(graph_id, inputs, outputs, binding)
        slot.views = {name: ortvalue_array(value) for name, value in outputs.items()}
        return slot

    def _replay(self, slot: GraphSlot, host: dict, device: dict, wanted: List[str], make_options: Callable) -> list:
        import cupy

        if slot.pending is not None:
            slot.pending.synchronize()  # a run_device's copies out of the outputs have read them
        names = [name for name in host if host[name].nbytes]
        self.transfers.upload([host[name] for name in names], [slot.inputs[name].data.ptr for name in names])
        for name, array in device.items():
            if array.nbytes:
                cupy.cuda.runtime.memcpyAsync(slot.inputs[name].data.ptr, array.data.ptr, array.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)  # fmt: skip
        self.stream.synchronize()
        options = make_options()
        options.add_run_config_entry("gpu_graph_id", str(slot.graph_id))
        if self.direct is None:
            self._run(slot.binding, options)
        else:
            c_session, c_binding = self.direct[0], slot.binding._iobinding
            self._run_direct(lambda: c_session.run_with_iobinding(c_binding, options), options)
        slot.calls += 1
        return [slot.views[name] for name in wanted]

    def _replay_device(self, slot: GraphSlot, device: dict, wanted: List[str], make_options: Callable) -> list:
        """A replay with device feeds and device outputs, in one synchronization: the feeds are copied into the
        graph's buffers on the caller's stream (behind the caller's own writes), that stream is synchronized once,
        ORT replays, and the outputs are copied out on the caller's stream, an event after them; the next call of
        this signature waits for that event before the replay writes the outputs again."""
        import cupy

        caller = cupy.cuda.get_current_stream()
        if slot.pending is not None:
            slot.pending.synchronize()  # the last call's output copies (perhaps on another stream) have read
        copy = cupy.cuda.runtime.memcpyAsync
        to_device = cupy.cuda.runtime.memcpyDeviceToDevice
        for name, array in device.items():
            if array.nbytes:
                copy(slot.inputs[name].data.ptr, array.data.ptr, array.nbytes, to_device, caller.ptr)
        caller.synchronize()
        options = make_options()
        options.add_run_config_entry("gpu_graph_id", str(slot.graph_id))
        if self.direct is None:
            self._run(slot.binding, options)
        else:
            c_session, c_binding = self.direct[0], slot.binding._iobinding
            self._run_direct(lambda: c_session.run_with_iobinding(c_binding, options), options)
        slot.calls += 1
        outputs = []
        for name in wanted:
            view = slot.views[name]
            out = cupy.empty(view.shape, view.dtype)
            if view.nbytes:
                copy(out.data.ptr, view.data.ptr, view.nbytes, to_device, caller.ptr)
            outputs.append(out)
        slot.pending = cupy.cuda.Event(block=False, disable_timing=True)
        slot.pending.record(caller)
        return outputs

    def held_graphs(self) -> int:
        """Signatures with fixed buffers for a graph."""
        return sum(slot is not None for slot in self.slots.values())
