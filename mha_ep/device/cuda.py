"""The GPU executor of a device plan: ORT CUDA pieces and the cuda backend on one stream, tensors on the device.

How one call runs (docs/FACTS.md §5):
  1. Feeds go up once (a CuPy array, or anything with ``__dlpack__`` on this GPU, is used where it lies; NumPy
     feeds go up together through one pinned buffer, and outputs come down into pinned blocks: transfer.py).
  2. Each piece is an ORT CUDA session created with ``user_compute_stream`` = the backend's stream, and run through
     an IOBinding on device pointers with ``disable_synchronize_execution_providers=1``: no host copy, no
     synchronize. Its outputs are ORT allocations, held as CuPy arrays over the OrtValues (the OrtValue keeps the
     memory alive) until their last reader has been queued.
  3. Each attention step is the cuda backend's device entry on the same stream (ops/backends/cuda/device_entry.py).
  4. Outputs come down once, after one synchronize (or stay on the device: ``device_outputs=True``).
  5. Replay (``CallGraphs``): from the second call of a feed signature on, the whole call (every piece and every
     attention step) is one CUDA graph, captured on the shared stream; the feeds are copied into the graph's
     input buffers and the outputs copied out of its output buffers. When ORT runs a node of a piece on the CPU,
     the steps up to that piece run eagerly each call and the rest is the graph. A signature whose capture
     fails (an op that synchronizes, cuBLAS on the three-phase path) runs eagerly from then on, and says why at
     debug level.

Memory is stream-ordered throughout: ORT's arena and CuPy's pool hand a freed block to the next allocation on the
same stream, and every user of it is on that stream, so nothing waits on the host between steps.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import cupy
import numpy as np
import onnx

from mha_ep.dtypes import elem_type
from mha_ep.device.plan import AttentionStep, DevicePlan, PieceStep
from mha_ep.device.run import attention_problem, run_plan, run_steps
from mha_ep.native.cuda_io import ortvalue_array
from mha_ep.native.transfer import HostTransfers, check_feed_dtype, host_feed
from mha_ep.errors import MhaEpError, refusal_code, run_error
from mha_ep.ops.problem import resolve_padding_mask

log = logging.getLogger("mha_ep")
MAX_GRAPHS = 8  # feed signatures whose whole-call graph is kept, least recently used released first (cuda_io's
# MAX_GRAPHS is another count: ORT cannot release a graph it captured, so there the later signatures run eagerly)
# Device memory the kept graphs may hold together (their buffers stay allocated while they live); beyond it the
# least recently used go first, and a call whose buffers alone exceed it runs eagerly.
MAX_GRAPH_BYTES = 2 << 30
# Relaxed: ORT's arena and CuPy's pool may call cudaMalloc while the call is captured (legal in this mode only).
CAPTURE_MODE = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2)
CAPTURE_AFTER = 2
MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice
MAX_SEEN = 4096  # signatures counted towards CAPTURE_AFTER (forgotten all at once beyond)  # a signature is captured on its second call (its first compiles kernels and sizes arenas)


def cuda_provider_options(stream_ptr: int, device_id: int, user_options: Optional[dict] = None) -> dict:
    """The CUDA provider options of every piece: the caller's, with the shared stream and device forced."""
    options = {str(k): str(v) for k, v in (user_options or {}).items()}
    options.update({"device_id": str(device_id), "user_compute_stream": str(stream_ptr),
                    "has_user_compute_stream": "1", "enable_cuda_graph": "0"})  # fmt: skip
    if device_id == 0 and "device_id" not in (user_options or {}):
        del options["device_id"]  # ORT 1.31 warns "No registered plugin EP device found" when it is given
    return options


class DeviceExecutor:
    """Executor (device/run.py) over CuPy arrays on ``backend``'s device and stream."""

    def __init__(self, plan: DevicePlan, backend, sess_options=None, cuda_options: Optional[dict] = None,
                 session_kwargs: Optional[dict] = None):  # fmt: skip
        import onnxruntime as ort

        self.plan = plan
        self.backend = backend
        self.device_id = backend.device_id
        self.stream = backend.stream
        providers = [("CUDAExecutionProvider", cuda_provider_options(self.stream.ptr, self.device_id, cuda_options)),
                     "CPUExecutionProvider"]  # fmt: skip
        options = sess_options if sess_options is not None else ort.SessionOptions()
        self.sessions: Dict[int, object] = {}
        self.pieces: Dict[int, PieceIO] = {}
        self.graph_refusal: Optional[str] = None  # why the whole call cannot be one graph, if it cannot
        self.eager_head = 0  # steps every call runs eagerly: up to the last piece a graph must not capture
        with tempfile.TemporaryDirectory(prefix="mha_ep_pieces_") as folder:
            for piece in plan.pieces:
                session, refusal = _piece_session(ort, piece, options, providers, os.path.join(folder, "piece.onnx"),
                                                  session_kwargs or {})  # fmt: skip
                if refusal is not None:
                    self.graph_refusal = self.graph_refusal or refusal
                    self.eager_head = 1 + next(i for i, step in enumerate(plan.steps) if step is piece)
                self.sessions[id(piece)] = session
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # ORT's Python run_with_iobinding reads gpu_graph_id on every run; unset, the lookup raises and is caught
        # (docs/BENCH.md, "Host-side choices"). -1 is ORT's "no graph for this run", which the pieces have.
        self.run_options.add_run_config_entry("gpu_graph_id", "-1")
        with cupy.cuda.Device(self.device_id), self.stream:
            self.constants = {name: cupy.asarray(array) for name, array in plan.constants.items()}
        self.transfers = HostTransfers(self.stream, self.device_id, backend.copier)
        for piece in plan.pieces:
            self.pieces[id(piece)] = PieceIO(ort, self.sessions[id(piece)], piece, plan.dtypes, self.device_id,
                                             self.run_options)  # fmt: skip
        self.keep: Optional[list] = None  # while capturing: every buffer the graph touches stays alive here
        self._masks: dict = {}  # this call's resolved padding masks

    def begin_call(self) -> None:
        self._masks.clear()

    def _resolve_mask(self, mask: cupy.ndarray, geometry):
        """resolve_padding_mask memoised within one call: every layer of a model reads the same mask tensor."""
        key = (mask.data.ptr, mask.shape, str(mask.dtype), geometry.batch, geometry.total_seq)
        entry = self._masks.get(key)
        if entry is None:
            entry = self._masks[key] = (mask, resolve_padding_mask(mask, geometry))  # the mask kept: its address
        return entry[1]

    # ------------------------------------------------------------------------------------------ executor API
    def feed(self, name: str, value, dtype: str) -> cupy.ndarray:
        if isinstance(value, cupy.ndarray):
            array = value
        elif (host := host_feed(name, value, dtype)) is not None:
            return self.transfers.to_device({name: host})[name]
        else:
            array = cupy.from_dlpack(value)
        check_feed_dtype(name, array.dtype, dtype)
        if array.device.id != self.device_id:
            raise MhaEpError(f"device mode: feed {name!r} lies on cuda:{array.device.id}, the session runs on "
                             f"cuda:{self.device_id}")  # fmt: skip
        return cupy.ascontiguousarray(array)

    def constant(self, array: np.ndarray) -> cupy.ndarray:
        return cupy.asarray(array)

    def run_piece(self, piece: PieceStep, inputs: Dict[str, cupy.ndarray]) -> Dict[str, cupy.ndarray]:
        for name in piece.inputs:
            if not inputs[name].flags.c_contiguous:
                inputs[name] = cupy.ascontiguousarray(inputs[name])
        values = self.pieces[id(piece)].run(inputs)
        outputs = {name: ortvalue_array(value, self.device_id) for name, value in zip(piece.outputs, values)}
        if self.keep is not None:
            self.keep.extend(outputs.values())
            self.keep.extend(inputs.values())
        return outputs

    def run_attention(self, step: AttentionStep, inputs: Sequence[Optional[cupy.ndarray]]) -> List[Optional[cupy.ndarray]]:
        from mha_ep.ops.backends.cuda.device_entry import run_on_device

        problem = attention_problem(step, inputs, self._resolve_mask)
        try:
            results = run_on_device(self.backend, problem, self.keep)
        except MhaEpError as error:
            raise run_error(step.node_name, str(error), refusal_code(error)) from None
        return [None if name is None else value for name, value in zip(step.outputs, results)]


class PieceIO:
    """One piece's IOBinding on device pointers. Inputs are bound again only when their address or shape changed
    (CuPy's pool hands a repeated call the same blocks); outputs are bound to the device afresh each run, so that
    each run's outputs are new ORT allocations (the last call's may still be held).

    Where this onnxruntime exposes them, the calls go to ORT's C binding objects (``_iobinding``, ``_sess``)
    with the device made once: its Python wrappers cost several times the direct calls (bind_input's
    OrtDevice.make, run_with_iobinding's capture checks, an OrtValue wrapper per output; docs/BENCH.md,
    "Host-side choices"). Otherwise the public wrappers are used, with the same effect."""

    def __init__(self, ort, session, piece: PieceStep, dtypes: Dict[str, str], device_id: int, run_options):
        self.session = session
        self.binding = session.io_binding()
        self.piece = piece
        self.device_id = device_id
        self.run_options = run_options
        self.types = [elem_type(dtypes[name]) for name in piece.inputs]
        self.bound: Dict[str, tuple] = {}  # input name -> (address, shape) bound now
        self.direct = None
        try:
            c_binding, c_session = self.binding._iobinding, session._sess
            c_device = ort.OrtDevice.make("cuda", device_id)._get_c_device()
            if all(callable(getattr(c_binding, f, None)) for f in ("bind_input", "bind_output", "get_outputs",
                                                                  "clear_binding_outputs")):  # fmt: skip
                self.direct = (c_binding, c_session, c_device)
        except AttributeError:  # another onnxruntime: the public wrappers
            pass

    def run(self, inputs: Dict[str, cupy.ndarray]) -> list:
        """Run the piece on ``inputs`` (C-contiguous device arrays); its outputs as ORT values, in order."""
        if self.direct is None:
            return self._run_public(inputs)
        c_binding, c_session, c_device = self.direct
        for name, element_type in zip(self.piece.inputs, self.types):
            array = inputs[name]
            where = (array.data.ptr, array.shape)
            if self.bound.get(name) != where:
                c_binding.bind_input(name, c_device, element_type, list(array.shape), array.data.ptr)
                self.bound[name] = where
        for name in self.piece.outputs:
            c_binding.bind_output(name, c_device)
        try:
            c_session.run_with_iobinding(c_binding, self.run_options)
            vector = c_binding.get_outputs()  # a view of the binding's outputs: take each value before clearing
            return [vector[i] for i in range(len(vector))]
        finally:
            c_binding.clear_binding_outputs()

    def _run_public(self, inputs: Dict[str, cupy.ndarray]) -> list:
        for name, element_type in zip(self.piece.inputs, self.types):
            array = inputs[name]
            self.binding.bind_input(name, "cuda", self.device_id, element_type, list(array.shape), array.data.ptr)
        for name in self.piece.outputs:
            self.binding.bind_output(name, "cuda", self.device_id)
        try:
            self.session.run_with_iobinding(self.binding, self.run_options)
            return self.binding.get_outputs()
        finally:
            self.binding.clear_binding_outputs()


def _piece_session(ort, piece: PieceStep, options, providers, saved: str, session_kwargs: dict):
    """An ORT CUDA session over ``piece``, and None or the reason its work must not be captured in a CUDA graph.

    ORT places some nodes (shape arithmetic, ops without CUDA kernels) on the CPU and puts Memcpy nodes between
    them and the GPU. A captured graph replays those copies, but not the host work around them: a MemcpyToHost
    feeds host code that ran once, at capture, on whatever the buffer held then, and a MemcpyFromHost replays a
    copy out of a host buffer that the capture run allocated and freed. (Stock ORT refuses its own CUDA graphs for
    the same reason.) So the optimized piece, as ORT saves it, is read for Memcpy nodes.
    """
    from mha_ep.model_io import needs_external_data, write_model

    source = piece.model.SerializeToString() if not needs_external_data(piece.model) else saved + ".in.onnx"
    if isinstance(source, str):  # a piece over 2 GiB goes through a file and its external data
        write_model(piece.model, source)
    previous = options.optimized_model_filepath
    options.optimized_model_filepath = saved
    try:
        session = ort.InferenceSession(source, options, providers=providers, **session_kwargs)
    finally:
        options.optimized_model_filepath = previous
    if "CUDAExecutionProvider" not in session.get_providers():
        raise MhaEpError(
            "device mode: ORT created a piece session without the CUDA provider (its CUDA libraries did not load; "
            "call onnxruntime.preload_dlls() first or install the CUDA/cuDNN runtime)"
        )
    try:
        optimized = onnx.load(saved, load_external_data=False)
    except Exception as error:  # noqa: BLE001 - no saved model (ORT could not write it): do not trust a capture
        return session, f"ORT's optimized form of piece {piece.level} could not be inspected ({error})"
    for node in optimized.graph.node:
        if node.op_type in ("MemcpyToHost", "MemcpyFromHost"):
            where = "to the host" if node.op_type == "MemcpyToHost" else "from the host"
            return session, (f"ORT copies {node.input[0]!r} {where} inside piece {piece.level} (a node of it runs "
                             f"on the CPU), which a CUDA graph cannot replay")  # fmt: skip
    return session, None


class DeviceRunner:
    """One device-mode session's runs: the plan, its executor, the whole-call graphs, one call at a time."""

    def __init__(self, plan: DevicePlan, backend, sess_options=None, cuda_options: Optional[dict] = None,
                 graphs: bool = True, session_kwargs: Optional[dict] = None, input_args: Sequence = ()):  # fmt: skip
        self.plan = plan
        self.input_args = list(input_args)  # the model's inputs as ORT's NodeArgs (name, type, shape) for the checks
        self.executor = DeviceExecutor(plan, backend, sess_options, cuda_options, session_kwargs)
        self.graphs = CallGraphs(self)
        self.graphs_enabled = graphs  # whole-call CUDA graphs for repeated feed signatures (module docstring, 5)
        self._lock = threading.Lock()
        self._events: Optional[tuple] = None  # (caller's feeds written, device outputs written), made on first use

    @property
    def stream(self) -> cupy.cuda.Stream:
        return self.executor.stream

    def _checked(self, feeds: dict, output_names) -> list:
        """The outputs a call asks for; raises what onnxruntime's ``run`` raises for a call that does not fit the
        model (native/ort_checks.py: its types and texts, as on the one-session route)."""
        from mha_ep.native.ort_checks import checked_outputs

        return checked_outputs(self.input_args, self.plan.outputs, feeds, output_names)

    def run(self, output_names: Optional[Sequence[str]], feeds: dict, device_outputs: bool = False) -> list:
        names = self._checked(feeds, output_names)
        with self._lock, cupy.cuda.Device(self.executor.device_id):
            # Device feeds were written on the caller's current stream, which need not be ordered with this
            # session's non-blocking stream: the call waits for it, and the caller's stream for device outputs.
            # (One event each way, recorded anew every call: a wait takes the record made before it.)
            if self._events is None:
                self._events = tuple(cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2))
            caller = cupy.cuda.get_current_stream()
            ordered = caller.ptr != self.stream.ptr
            if ordered:
                self._events[0].record(caller)
                self.stream.wait_event(self._events[0])
            with self.stream:
                return self._run(names, feeds, device_outputs, caller if ordered else None)

    def _run(self, names: list, feeds: dict, device_outputs: bool, caller) -> list:
        """One call on this session's stream; ``caller``: the stream that must see device outputs, or None."""
        transfers = self.executor.transfers
        try:
            outputs = None
            self.executor.begin_call()
            if self.graphs_enabled:
                outputs = self.graphs.run(feeds)
            if outputs is None:
                self.executor.begin_call()
                outputs = run_plan(self.plan, self.executor, self._uploaded(feeds), self.executor.constants)
            selected = [outputs[name] for name in names]
            if device_outputs:
                if caller is not None:
                    self._events[1].record(self.stream)
                    caller.wait_event(self._events[1])
                return selected
            return transfers.download(selected)
        finally:
            transfers.settle()  # the caller may write its page-locked feeds again once we return

    def _uploaded(self, feeds: dict) -> dict:
        """``feeds`` with every host feed replaced by its device copy, all of them uploaded together (transfer.py)."""
        host = {name: host_feed(name, feeds[name], self.plan.dtypes[name]) for name in self.plan.inputs}
        host = {name: array for name, array in host.items() if array is not None}
        if not host:
            return feeds
        return {**feeds, **self.executor.transfers.to_device(host)}


def feed_signature(plan: DevicePlan, feeds: dict) -> tuple:
    """The key of a call's graph: each feed's name, shape and dtype (the dtype object: str() of a NumPy dtype costs
    microseconds, and a replay's whole host time before its launch is on the call's critical path)."""
    return tuple((name, tuple(feeds[name].shape), feeds[name].dtype) for name in plan.inputs)


class CallGraph:
    """A captured call: the feeds' buffers (each call's feeds are copied in), the buffers that carry the eager
    head's outputs into the graph, where each graph output lies, the graph, and every buffer the captured work
    touches (kept alive, so no other allocation can take their memory)."""

    def __init__(self, graph, inputs: Dict[str, cupy.ndarray], carried: Dict[str, cupy.ndarray],
                 outputs: Dict[str, cupy.ndarray], keep: list):  # fmt: skip
        self.graph = graph
        self.inputs = inputs
        self.carried = carried
        self.outputs = outputs
        self.keep = keep
        self.nbytes = held_bytes(keep)


def held_bytes(buffers: list) -> int:
    """Device bytes of ``buffers`` (CuPy arrays, CuPy memory pointers), each allocation counted once."""
    sizes: Dict[int, int] = {}
    for buffer in buffers:
        if isinstance(buffer, cupy.ndarray):
            memory = buffer.data.mem
            sizes[id(memory)] = max(sizes.get(id(memory), 0), getattr(memory, "size", 0) or buffer.nbytes)
        elif isinstance(buffer, cupy.cuda.MemoryPointer):
            sizes[id(buffer.mem)] = buffer.mem.size
    return sum(sizes.values())


class CallGraphs:
    """CUDA graphs of calls keyed by feed signature (rules in the module docstring, step 5).

    A piece whose nodes ORT partly runs on the CPU cannot be captured (_piece_session says why). Every step up to
    the last such piece (``executor.eager_head`` of them) then runs eagerly on each call, and the rest of the call
    is one graph: the head's outputs that the rest reads are copied into the graph's buffers first. A model
    without such a piece is one graph from its feeds to its outputs."""

    def __init__(self, runner: DeviceRunner):
        self.runner = runner
        self.entries: "OrderedDict[tuple, Optional[CallGraph]]" = OrderedDict()  # None: capture refused
        self.seen: Dict[tuple, int] = {}

    def run(self, feeds: dict) -> Optional[Dict[str, cupy.ndarray]]:
        """The outputs of a replay (copies; the graph's own buffers are reused by the next replay), or None when
        this call runs eagerly."""
        if self.runner.executor.eager_head >= len(self.runner.plan.steps):
            return None
        try:
            key = feed_signature(self.runner.plan, feeds)
        except (AttributeError, KeyError):
            return None
        if key in self.entries:
            entry = self.entries[key]
            if entry is None:
                return None
            self.entries.move_to_end(key)
            return self._replay_or_refuse(key, entry, feeds)
        if len(self.seen) >= MAX_SEEN:  # a decode loop's growing past makes a new signature every step
            self.seen.clear()
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] < CAPTURE_AFTER:
            return None
        entry = self._capture(feeds, key)
        if entry is None:
            return None
        return self._replay_or_refuse(key, entry, feeds)

    def _replay_or_refuse(self, key: tuple, entry: CallGraph, feeds: dict) -> Dict[str, cupy.ndarray]:
        """A replay; when it fails, the signature runs step by step from then on (the error is raised)."""
        try:
            return self._replay(key, entry, feeds)
        except BaseException:
            try:
                self.runner.stream.synchronize()  # before the entry's buffers go back to the pool
            finally:
                self._add(key, None)
            raise

    def _replay(self, key: tuple, entry: CallGraph, feeds: dict) -> Dict[str, cupy.ndarray]:
        executor = self.runner.executor
        plan = self.runner.plan
        stream = self.runner.stream
        host, addresses = [], []
        for name, buffer in entry.inputs.items():
            value = feeds[name]
            if (type(value) is cupy.ndarray and value.flags.c_contiguous
                    and value.data.device_id == buffer.data.device_id):  # fmt: skip
                # A CuPy feed: its shape and dtype are the signature's, checked when the graph was captured. One
                # raw copy (cupy.copyto's checks cost more host time than the copy takes on the GPU).
                if buffer.nbytes:
                    cupy.cuda.runtime.memcpyAsync(buffer.data.ptr, value.data.ptr, buffer.nbytes,
                                                  MEMCPY_DEVICE_TO_DEVICE, stream.ptr)  # fmt: skip
                continue
            array = host_feed(name, value, plan.dtypes[name])
            if array is not None:  # straight into the graph's buffer
                host.append(array)
                addresses.append(buffer.data.ptr)
            else:
                cupy.copyto(buffer, executor.feed(name, value, plan.dtypes[name]))
        if host:
            executor.transfers.upload(host, addresses)
        head = executor.eager_head
        if head:
            executor.begin_call()
            tensors = {**executor.constants, **entry.inputs}
            run_steps(plan, executor, tensors, 0, head)
            changed = [name for name, buffer in entry.carried.items()
                       if tensors[name].shape != buffer.shape or tensors[name].dtype != buffer.dtype]  # fmt: skip
            if changed:  # the head's output shapes depend on values, not only on the feeds' shapes: no graph
                log.debug("mha_ep device mode: %s changed shape after the capture; signature %s runs eagerly",
                          changed, key)  # fmt: skip
                run_steps(plan, executor, tensors, head)
                outputs = {name: tensors[name].copy() for name in plan.outputs}
                self.runner.stream.synchronize()  # the entry's buffers go back to the pool below
                self._add(key, None)
                return outputs
            for name, buffer in entry.carried.items():
                cupy.copyto(buffer, tensors[name])
        entry.graph.launch(self.runner.stream)
        return {name: array.copy() for name, array in entry.outputs.items()}

    def _capture(self, feeds: dict, key: tuple) -> Optional[CallGraph]:
        executor = self.runner.executor
        plan = self.runner.plan
        stream = self.runner.stream
        head = executor.eager_head
        inputs = {name: executor.feed(name, feeds[name], plan.dtypes[name]).copy() for name in plan.inputs}
        keep: list = list(inputs.values())
        executor.begin_call()
        tensors = {**executor.constants, **inputs}
        run_steps(plan, executor, tensors, 0, head)  # the eager head (nothing when the whole call is captured)
        carried = {name: tensors[name].copy() for name in plan.reads_before(head)
                   if name not in inputs and name not in executor.constants}  # fmt: skip
        keep.extend(carried.values())
        tail = {**executor.constants, **inputs, **carried}
        executor.keep = keep
        executor.begin_call()
        try:
            stream.begin_capture(CAPTURE_MODE)
            try:
                run_steps(plan, executor, tail, head)
            finally:
                graph = stream.end_capture()
        except Exception as error:  # noqa: BLE001 - any failure: this signature runs eagerly from now on
            log.debug("mha_ep device mode: no graph for %s: %s: %s", key, type(error).__name__, error)
            self._add(key, None)
            return None
        finally:
            executor.keep = None
            executor.begin_call()
        outputs = {name: tail[name] for name in plan.outputs}
        entry = CallGraph(graph, inputs, carried, outputs, keep + list(outputs.values()))
        if entry.nbytes > MAX_GRAPH_BYTES:  # kept, this one graph would hold more than all of them may
            log.debug("mha_ep device mode: no graph for %s: its buffers hold %d bytes, more than MAX_GRAPH_BYTES",
                      key, entry.nbytes)  # fmt: skip
            stream.synchronize()
            self._add(key, None)
            return None
        self._add(key, entry)
        return entry

    def _add(self, key: tuple, entry: Optional[CallGraph]) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > MAX_GRAPHS or (len(self.entries) > 1 and self.held_bytes() > MAX_GRAPH_BYTES):
            _, old = self.entries.popitem(last=False)
            if old is not None:
                self.runner.stream.synchronize()  # the stream may still replay it

    def held_bytes(self) -> int:
        """Device bytes the kept graphs hold."""
        return sum(entry.nbytes for entry in self.entries.values() if entry is not None)

    def clear(self) -> None:
        self.runner.stream.synchronize()
        self.entries.clear()
        self.seen.clear()
