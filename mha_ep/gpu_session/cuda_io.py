"""The GPU side of a ``mha_ep.InferenceSession`` on the CUDA provider: one ORT session, tensors on the device.

The session is a plain ORT CUDA session over the native form of the model (claimed nodes run as mha_ep's native
CUDA op, on ORT's buffers and stream). This module is how its calls move tensors:

  * ``run`` with NumPy feeds: over OWN_RUN_MAX_BYTES (rule 5 below), the feeds go up through the call's lane's
    page-locked staging buffer (transfer.py), are bound to the session with IOBinding, and the outputs come down
    into pooled page-locked blocks; ORT's own ``run`` would copy every feed from pageable memory and every output
    into fresh pageable arrays. Smaller calls are ORT's own ``run``.
  * ``run_device``: CuPy arrays (or anything with ``__dlpack__``) are bound where they lie, after the caller's
    stream has finished writing them; the outputs are CuPy arrays over ORT's own output buffers (no copy).
  * Graphs: where the caller turned on ORT's ``enable_cuda_graph`` and ORT accepted it (every node on the CUDA
    provider), each call signature (feed names, shapes, dtypes) gets a ``gpu_graph_id`` of its own with inputs
    and outputs at fixed device addresses: the signature's first call runs eagerly (``gpu_graph_id`` -1) to learn
    the output shapes, the next ones are ORT's capture and replays. A call copies its feeds into the signature's
    buffers and its outputs out of them, on ORT's own stream around its replay with no host wait between (rule
    7); with device feeds (``run_device``) ORT's stream waits for the caller's before the copies in, and the
    caller's for ORT's after the copies out, so the outputs are ready in the caller's stream's order. ORT cannot
    drop a graph it captured, so at most ``MAX_GRAPHS`` signatures get one; later ones run eagerly, as does one
    whose fixed buffers cannot be allocated (``slot_allocation_failures``; its call keeps the eager answer).

An eager run synchronizes ORT's stream at its end, so its outputs are ready on any stream once
``run_with_iobinding`` returns; its inputs are made ready before it (the caller's stream is synchronized first,
and so is the call's upload stream, unless it is ORT's own: rule 7).

Threads: any number may call at once, as onnxruntime allows.
  1. A call takes a lane (a stream and a pinned staging buffer of its own: transfer.HostTransfers) from the
     session's pool and gives it back after; the pool grows to the number of calls in flight. The pinned output
     blocks are one pool for all lanes (transfer.PinnedOutputs).
  2. With graphs on, a signature's GraphSlot (its fixed buffers and gpu_graph_id) serves one call at a time.
  3. A graph session's CUDA work (copies, ORT's run, the graph slots) runs one call at a time (a lock), on at
     most two threads: the first thread to call (the owner) runs its own calls, and any other thread's calls run
     on the session's worker thread; the calling threads check and split their calls. ORT's CUDA provider may not
     run one session from several threads at once while it uses CUDA graphs (its documentation says so), and it
     keeps its graphs per thread (the provider's PerThreadContext: each of the two threads warms up and captures
     a signature once, over the slot's same fixed buffers). A hop to the worker costs a thread switch each way
     (docs/bench/HISTORY.md section 8, "a graph session's first caller runs its own calls"; "C - C'" of
     scripts/profile_session_graph.py), which a loop on one thread (a decoder's, a benchmark's) does not pay.
     Without graphs nothing is serialized and every call runs on its own thread.
  4. A call's feeds and outputs are checked against the model once per call key (names, shapes, dtypes, where the
     feeds lie): the verdict is remembered (``_checks``, a refusal included: ort_checks.CheckVerdicts; then
     ``_verdicts``, with the call's graph signature), so a repeated call, good or bad, pays a dictionary lookup.
  5. A host call whose feeds and outputs are small (OWN_RUN_MAX_BYTES: the feeds before the call, the outputs
     from the call key's first call) goes through ORT's own ``run``: it copies as fast there, holds the GIL for
     less of the call, and raises ORT's own exceptions. Not with graphs on: a replay is what those calls want.
  6. Every thread that calls, and the worker, is put in CUDA's thread-local capture mode on its first call
     (capture_mode.py): ORT captures in global mode, where any other thread's allocation or synchronous copy (the
     callers' checks, their own CuPy work) fails and breaks the capture. A call whose run still fails that way
     (a thread that never called mha_ep made the unsafe call) is answered by an eager run (``capture_retries``).
  7. A graph session's ORT runs on a stream the session knows (``ort_stream``: the caller's
     ``user_compute_stream``, else one that session.with_session_stream made), and its lanes use that stream too:
     a replay's copies in, ORT's replay and its copies out queue on one stream, with no host wait between them
     (each way one launch of gpu_session/segments.py's copy kernel where it builds, else one memcpy per buffer). A
     replay runs with ``disable_synchronize_execution_providers``: ``run`` waits once, for its download, and
     ``run_device`` not at all (the caller's stream waits, on an event, for the copies out; a caller on ORT's
     stream itself, its ``user_compute_stream``, needs no event). The order of those calls is held on any machine
     by tests/gpu_session/test_replay_protocol.py.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from mha_ep.gpu_session.capture_mode import ignore_other_captures
from mha_ep.native.ort_checks import CheckVerdicts, call_key, dtype_error, execution_error, out_of_memory, tensor_type

log = logging.getLogger("mha_ep")

MAX_GRAPHS = 16  # signatures with a captured graph per session (ORT keeps each graph until the session goes)
COPY_THREADS = 4  # host copies into the staging buffers (transfer.py, staging.stage_uploads), shared by the lanes
MAX_VERDICTS = 4096  # call keys whose check is remembered (all forgotten at once past this)
# Host calls whose feeds and outputs together are at most this go through ORT's own run (rule 5 of the module
# docstring): below it page-locked staging saves less than its Python costs (docs/BENCH.md, "Host-side choices").
OWN_RUN_MAX_BYTES = 1 << 20
# what failed to allocate when a call's own memory does not fit (ORT's run had its own: ort_checks.out_of_memory)
OWN_MEMORY = "the call's feeds or outputs in mha_ep's own device or page-locked memory"
# ORT's tensor type names -> NumPy dtypes (bfloat16 has none: such sessions keep ORT's own run)
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
             "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
             "tensor(bool)": "bool", "tensor(int16)": "int16", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32",
             "tensor(uint64)": "uint64"}  # fmt: skip


def capture_broke(error: BaseException) -> bool:
    """Whether ORT's run failed because a CUDA stream capture was broken or refused a call (cudaErrorStreamCapture*:
    "operation not permitted when stream is capturing", "operation would make the legacy stream depend on a
    capturing blocking stream", an invalidated capture)."""
    text = str(error)
    return "StreamCapture" in text or "stream is capturing" in text or "capturing blocking stream" in text


def allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is a failed device allocation: CuPy's OutOfMemoryError (a MemoryError), or ORT's arena or
    CUDA allocator refusing one ("Failed to allocate memory for requested buffer of size ...", "CUDA failure 2: out
    of memory")."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("Failed to allocate memory" in text or "out of memory" in text)


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
    options: object = None  # the slot's own RunOptions (gpu_graph_id set) for calls that bring none
    order: List[str] = field(default_factory=list)  # input names in the order of their one allocation
    addresses: Dict[str, int] = field(default_factory=dict)  # name -> device address of its input buffer
    direct_run: Optional[Callable] = None  # the C session's run_with_iobinding bound to the slot's C binding
    direct: object = None  # _Direct of direct_run with ``options``
    copies_in: object = None  # segments.SegmentCopies of every feed into ``addresses`` (None: memcpy calls)
    copied_names: List[str] = field(default_factory=list)  # the feeds copies_in copies (order, bytes > 0)
    copies_out: Dict[tuple, tuple] = field(default_factory=dict)  # wanted outputs -> _copies_out's answer


@dataclass
class Lane:
    """A call's own stream and pinned staging buffer, taken from the session's pool for the call."""

    stream: object
    transfers: object  # transfer.HostTransfers on ``stream``


class CudaSessionIO:
    """How one ORT CUDA session's calls move tensors (module docstring). ``run(binding, options)`` is the
    session's guarded ``run_with_iobinding``; ``options()`` makes a fresh RunOptions (a call may bring its own
    ``make_options``: the caller's run options)."""

    def __init__(self, session, device_id: int, graphs: bool, run: Callable, options: Callable, ort_stream=None):
        import cupy

        from mha_ep.gpu_session.transfer import PinnedOutputs, is_host_feed

        if graphs and ort_stream is None:
            raise ValueError("CudaSessionIO: a session under ORT's CUDA graphs needs ort_stream, the CuPy stream ORT "
                             "computes on (its user_compute_stream: session.with_session_stream)")  # fmt: skip

        self._is_host_feed = is_host_feed  # transfer.py imports CuPy: looked up once here, used on every call
        self._device_array = cupy.ndarray
        self.session = session
        self.device_id = device_id
        self.graphs = graphs
        self._run = run
        self._options = options
        self.input_args = list(session.get_inputs())  # ORT's NodeArgs: a call is checked as run() checks it
        self.inputs = {a.name: numpy_dtype(a.type) for a in self.input_args}
        self.outputs = [a.name for a in session.get_outputs()]
        self.pinned_outputs = PinnedOutputs()
        self._copier = ThreadPoolExecutor(COPY_THREADS, "mha_ep_copy")
        self._lanes: "queue.SimpleQueue[Lane]" = queue.SimpleQueue()  # idle lanes
        self.lanes_made = 0
        self.slots: Dict[tuple, Optional[GraphSlot]] = {}  # signature -> its graph (None: it runs eagerly)
        self.slot_allocation_failures = 0  # first calls whose slot's fixed buffers could not be allocated
        self._lanes_lock = threading.Lock()
        self._graph_count = 0
        # rule 3 of the module docstring: a graph session's CUDA work runs one call at a time, on the first calling
        # thread (the owner) or on the session's worker thread
        self._graph_lock = threading.Lock()
        self._graph_owner: Optional[int] = None
        self._graph_thread = ThreadPoolExecutor(1, "mha_ep_graphs") if graphs else None
        self.capture_retries = 0  # calls answered by an eager run after a graph capture broke (_rerun_or_raise)
        # call key -> [wanted outputs, signature, ORT's own run takes it, the slot its CuPy feeds replay (run_device's
        # _replay_known) or None]
        self._verdicts: Dict[tuple, list] = {}
        # call key -> the check's verdict (the wanted outputs, or the refusal a bad call raises again): ORT's checks,
        # before any copy or graph is touched
        self._checks = CheckVerdicts(self.input_args, self.outputs, MAX_VERDICTS)
        self._types: Dict[str, int] = {}  # dtype name -> ONNX element type
        self.direct = direct_binding(session, device_id)
        self.ort_stream = ort_stream if graphs else None  # rule 7
        self._copy_kernel = None  # segments.copy_function on our device, once a slot wants it (False: unavailable)
        self._fed = self._copied = None
        if graphs:  # an event is its device's (recording it on another device's stream fails): made under ours
            with cupy.cuda.Device(device_id):
                self._fed = cupy.cuda.Event(block=False, disable_timing=True)  # the caller has written the feeds
                self._copied = cupy.cuda.Event(block=False, disable_timing=True)  # the copies out are queued

    # ------------------------------------------------------------------------------------------ calls
    def run_host(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """NumPy (or device) feeds in, NumPy outputs out: small host calls through ORT's own ``run`` (rule 5 of
        the module docstring), others through page-locked memory."""
        ignore_other_captures()  # rule 6
        key, known = self._known(feeds, output_names)
        wanted = known[0] if known is not None else self._checks.wanted(key, feeds, output_names)
        if not self.graphs:
            if known is not None:  # a remembered key: its feeds' kinds and sizes are the key's
                if known[2]:
                    return self._own_run(key, known, wanted, output_names, feeds, make_options)
            elif all(map(self._is_host_feed, feeds.values())) and self._host_bytes(feeds) <= OWN_RUN_MAX_BYTES:
                return self._own_run(key, known, wanted, output_names, feeds, make_options)
        import cupy

        try:
            with cupy.cuda.Device(self.device_id):
                host, device = self._split(feeds, checked=known is not None)
                signature = known[1] if known is not None else self._remember(key, wanted, host, device)
                if device:
                    self._settle_caller()

                def work():
                    lane = self._take_lane()
                    try:
                        arrays = self._call(lane, signature, host, device, wanted, make_options)
                        return lane.transfers.download(arrays)
                    finally:
                        self._give_lane(lane)

                return self._on_graph_thread(work)
        except (RuntimeError, MemoryError) as error:  # MemoryError: CuPy's OutOfMemoryError (_rerun_or_raise)
            return self._rerun_or_raise(error, feeds, wanted, make_options)

    def run_device(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """Device (or NumPy) feeds in, CuPy outputs out."""
        import cupy

        ignore_other_captures()  # rule 6
        key, known = self._known(feeds, output_names)
        if known is not None and known[3] is not None:  # a known call that replays its slot with CuPy feeds
            answer = self._replay_known(known, feeds, make_options)
            if answer is not None:
                return answer
        wanted = known[0] if known is not None else self._checks.wanted(key, feeds, output_names)
        try:
            with cupy.cuda.Device(self.device_id):
                host, device = self._split(feeds, checked=known is not None)
                signature = known[1] if known is not None else self._remember(key, wanted, host, device)
                caller = cupy.cuda.get_current_stream()  # the caller's own: the work below may run on another thread

                def work():
                    slot = self.slots.get(signature) if self.graphs and not host else None
                    if slot is not None:
                        if known is not None and slot.copies_in is not None:  # its next calls: _replay_known
                            known[3] = slot
                        return self._replay_device(slot, device, wanted, make_options, caller)
                    return self._run_device_on_lane(signature, host, device, wanted, make_options, caller)

                return self._on_graph_thread(work)
        except (RuntimeError, MemoryError) as error:
            return [cupy.asarray(a) for a in self._rerun_or_raise(error, feeds, wanted, make_options)]

    def _replay_known(self, known: list, feeds: Mapping, make_options: Optional[Callable]) -> Optional[list]:
        """run_device's replay of a call whose key is known (rule 4) and replays its slot with CuPy feeds: the
        feeds go to the slot's copy launch as they are, with no split into dicts. None where a feed is not
        C-contiguous (the key does not say): the general path makes it so."""
        import cupy

        wanted, slot = known[0], known[3]
        arrays = [feeds[name] for name in slot.copied_names]
        for array in arrays:
            if not array._c_contiguous:
                return None
        try:
            with cupy.cuda.Device(self.device_id):
                caller = cupy.cuda.get_current_stream()  # the caller's own: the work below may run on another thread
                return self._on_graph_thread(
                    functools.partial(self._replay_arrays, slot, arrays, wanted, make_options, caller))
        except (RuntimeError, MemoryError) as error:
            return [cupy.asarray(a) for a in self._rerun_or_raise(error, feeds, wanted, make_options)]

    def _run_device_on_lane(self, signature: tuple, host: dict, device: dict, wanted: List[str],
                            make_options: Optional[Callable], caller) -> list:  # fmt: skip
        """run_device's eager calls, a signature's first calls, and replays with host feeds: on a lane."""
        lane = self._take_lane()
        try:
            caller.synchronize()  # the caller's stream has written its device feeds (ORT's does not wait for it)
            slot = self.slots.get(signature) if self.graphs else None
            arrays = self._call(lane, signature, host, device, wanted, make_options)
            if slot is None:  # an eager run's outputs: ORT's own, and ready (ORT synchronized its stream after it)
                return arrays
            return self._copy_out(slot, wanted, caller)  # the replay's (rule 7: queued on ORT's stream, the lane's)
        finally:
            self._give_lane(lane)

    def _on_graph_thread(self, work: Callable):
        """``work()`` (called under the session's device): here without graphs; with graphs one call at a time
        (rule 3), here on the owner thread (the first to call), else on the session's worker thread, its result or
        its exception handed back."""
        if self._graph_thread is None:
            return work()
        me = threading.get_ident()
        if self._graph_owner is None:
            with self._lanes_lock:
                if self._graph_owner is None:
                    self._graph_owner = me
        if me == self._graph_owner:
            with self._graph_lock:
                return work()
        return self._graph_thread.submit(self._on_worker, work).result()

    def _on_worker(self, work: Callable):
        import cupy

        ignore_other_captures()  # rule 6: the owner, or another session's worker, may be capturing
        with cupy.cuda.Device(self.device_id), self._graph_lock:
            return work()

    @staticmethod
    def _host_bytes(feeds: Mapping) -> int:
        return sum(value.nbytes for value in feeds.values() if isinstance(value, np.ndarray))

    def _own_run(self, key: Optional[tuple], known: Optional[tuple], wanted: List[str], output_names, feeds: Mapping,
                 make_options: Optional[Callable]) -> list:  # fmt: skip
        """ORT's own ``run`` (rule 5): its exceptions are already the ones ``run`` raises. A call key's first call
        comes here and learns whether its feeds and outputs are small enough to stay."""
        options = make_options() if make_options is not None else None
        results = self._run(_Direct(lambda: self.session.run(output_names, dict(feeds), options)), options)
        if known is None and key is not None:
            nbytes = sum(np.asarray(v).nbytes for v in feeds.values()) + sum(r.nbytes for r in results)
            self._remember(key, wanted, feeds, {}, small=nbytes <= OWN_RUN_MAX_BYTES)
        return results

    # ------------------------------------------------------------------------------------- the checks
    def _known(self, feeds: Mapping, output_names) -> Tuple[Optional[tuple], Optional[list]]:
        """(the call's key, its remembered verdict or None). The key is None where the call has feeds other than
        NumPy or CuPy arrays (those are checked every call): ort_checks.call_key."""
        key = call_key(feeds, output_names, self._device_array)
        return key, (self._verdicts.get(key) if key is not None else None)

    def _remember(self, key: Optional[tuple], wanted: List[str], host: Mapping, device: Mapping,
                  small: bool = False) -> tuple:  # fmt: skip
        """The call's graph signature; the verdict (wanted outputs, signature, whether ORT's own run takes the
        call, and later the slot run_device's replays take: _replay_known) remembered under ``key`` (rules 4 and 5
        of the module docstring)."""
        signature = self.signature(host, device)
        if key is not None:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = [wanted, signature, small, None]
        return signature

    def _split(self, feeds: Mapping, checked: bool = False) -> tuple:
        """(host feeds, device feeds), each checked against the model's dtype (unless the call's verdict is
        known: ``checked``) and made C-contiguous."""
        import cupy

        from mha_ep.gpu_session.transfer import host_feed

        host, device = {}, {}
        if checked:  # NumPy and CuPy arrays whose names, shapes and dtypes passed before
            for name, value in feeds.items():
                if type(value) is np.ndarray:
                    host[name] = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                else:  # CuPy's own flag (``flags`` makes an object per call)
                    device[name] = value if value._c_contiguous else cupy.ascontiguousarray(value)
            return host, device
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

    def _rerun_or_raise(self, error: Exception, feeds: Mapping, wanted: List[str], make_options) -> list:
        """Raise what ORT's ``run`` raises for this failed call (ort_checks.execution_error: a stock node's
        failure through IOBinding has lost its type; ort_checks.out_of_memory: an allocation of the call's own
        failed), else ``error`` itself. A run that failed because a CUDA graph capture broke (rule 6: a thread
        outside mha_ep made an unsafe CUDA call meanwhile, or the capture itself could not allocate) is run once
        more, eagerly, and its outputs (NumPy) are the call's answer; counted in ``capture_retries``."""
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
            return self._on_graph_thread(lambda: self.session.run(wanted, host, options))

        if self.graphs and capture_broke(error):
            with self._lanes_lock:  # callers' threads count here
                self.capture_retries += 1
            return rerun()
        failure = execution_error(error, rerun)
        if failure is not error:
            raise failure from error
        if allocation_failed(error):  # CuPy's OutOfMemoryError, CUDA's refusal of a page-locked block: ORT's type
            raise out_of_memory(error, OWN_MEMORY) from error
        raise error

    # -------------------------------------------------------------------------------------- the lanes
    def _take_lane(self) -> Lane:
        try:
            return self._lanes.get_nowait()
        except queue.Empty:
            pass
        import cupy

        from mha_ep.gpu_session.transfer import HostTransfers

        if self.ort_stream is not None:  # rule 7: a graph session's copies queue on ORT's own stream
            stream = self.ort_stream
        else:
            with cupy.cuda.Device(self.device_id):
                stream = cupy.cuda.Stream(non_blocking=True)
        with self._lanes_lock:
            self.lanes_made += 1
        return Lane(stream, HostTransfers(stream, self.device_id, self._copier, self.pinned_outputs))

    def _give_lane(self, lane: Lane) -> None:
        """Back to the pool once its direct uploads have read the caller's page-locked feeds (the caller may write
        them once the call returns). A lane whose stream failed is dropped, not reused."""
        try:
            lane.transfers.settle()
        except Exception:  # noqa: BLE001 - the call's own error is the one raised; this lane is not reused
            return
        self._lanes.put(lane)

    @staticmethod
    def _settle_caller() -> None:
        """The caller's stream has finished writing its device feeds (ORT's stream does not wait for it)."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    @staticmethod
    def signature(host: dict, device: dict) -> tuple:
        merged = {**host, **device}
        return tuple((name, tuple(merged[name].shape), str(merged[name].dtype)) for name in sorted(merged))

    # ---------------------------------------------------------------------------------------- running
    def _call(self, lane: Lane, signature: tuple, host: dict, device: dict, wanted: List[str],
              make_options: Optional[Callable]) -> list:  # fmt: skip
        """Run the session on the feeds: CuPy arrays of the ``wanted`` outputs (with graphs on, under the graph
        lock; a replay's lie in its slot's buffers, valid until the lock is released). ``make_options``: the
        caller's run options' maker, None when the call brought none."""
        slot = self.slots.get(signature) if self.graphs else None
        if slot is not None:
            return self._replay(lane, slot, host, device, wanted, make_options)
        if self.graphs and signature not in self.slots:  # the signature's first call: eager; it tells the shapes
            values = self._eager_values(lane, host, device, make_options)
            self._first_slot(signature, host, device, values)
            return [ortvalue_array(values[name]) for name in wanted]
        return self._eager(lane, host, device, wanted, make_options)

    def _eager(self, lane: Lane, host: dict, device: dict, wanted: List[str], make_options: Optional[Callable]) -> list:
        values = self._eager_values(lane, host, device, make_options)
        return [ortvalue_array(values[name]) for name in wanted]

    def _eager_values(self, lane: Lane, host: dict, device: dict,
                      make_options: Optional[Callable]) -> Dict[str, object]:  # fmt: skip
        uploaded = lane.transfers.to_device(host) if host else {}
        if host and self.ort_stream is None:  # rule 7: a graph session's ORT runs behind the copies, on their stream
            lane.stream.synchronize()
        options = (make_options or self._options)()
        # -1: no graph for this run. Set on every eager run: ORT's Python run_with_iobinding looks the entry up on
        # every run, and a missing one costs a caught exception (docs/BENCH.md, "Host-side choices").
        options.add_run_config_entry("gpu_graph_id", "-1")
        if self.direct is None:
            binding = self.session.io_binding()
            for name, array in {**uploaded, **device}.items():
                binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
            for name in self.outputs:
                binding.bind_output(name, "cuda", self.device_id)
            self._ort(binding, options)
            return dict(zip(self.outputs, binding.get_outputs()))
        c_session, c_device, make_binding = self.direct
        c_binding = make_binding()
        for name, array in {**uploaded, **device}.items():
            c_binding.bind_input(name, c_device, self._element(array.dtype), list(array.shape), array.data.ptr)
        for name in self.outputs:
            c_binding.bind_output(name, c_device)
        self._ort(_Direct(lambda: c_session.run_with_iobinding(c_binding, options)), options)
        vector = c_binding.get_outputs()
        return {name: vector[i] for i, name in enumerate(self.outputs)}

    def _ort(self, binding, options) -> None:
        """ORT's run of ``binding`` (an IOBinding, or _Direct) through the session's error channel."""
        self._run(binding, options)

    def _run_slot(self, slot: GraphSlot, make_options: Optional[Callable]) -> None:
        """ORT's run of the slot's graph (under the graph lock), queued on ORT's stream with no wait for it (rule 7:
        whoever reads the outputs waits). A call without run options of its own uses the slot's RunOptions, made
        once (the native route never sets ``terminate`` on them, and the slot serves one call at a time)."""
        if make_options is None:
            options = slot.options
            if options is None:
                options = slot.options = self._slot_options(slot, self._options())
                if slot.direct_run is not None:
                    slot.direct = _Direct(functools.partial(slot.direct_run, options))
        else:
            options = self._slot_options(slot, make_options())
        if slot.direct_run is None:
            self._ort(slot.binding, options)
        elif make_options is None:
            self._ort(slot.direct, options)
        else:
            self._ort(_Direct(functools.partial(slot.direct_run, options)), options)
        slot.calls += 1

    @staticmethod
    def _slot_options(slot: GraphSlot, options):
        options.add_run_config_entry("gpu_graph_id", str(slot.graph_id))
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    def _element(self, dtype) -> int:
        key = str(dtype)
        if key not in self._types:
            from mha_ep.dtypes import elem_type

            self._types[key] = elem_type(key)
        return self._types[key]

    # ------------------------------------------------------------------------------------ graph slots
    def _first_slot(self, signature: tuple, host: dict, device: dict, values: Dict[str, object]) -> None:
        """The signature's slot, shaped as its first (eager) call's feeds and outputs. None (the signature runs
        eagerly: _run_eagerly) past MAX_GRAPHS, or when its fixed buffers cannot be allocated: the call keeps its
        eager answer, the first such failure is logged, and ``slot_allocation_failures`` counts them."""
        import cupy
        import onnxruntime as ort

        from mha_ep.gpu_session.transfer import device_block

        if self._graph_count >= MAX_GRAPHS:
            self._run_eagerly(signature)
            return
        feeds = {**host, **device}
        order = sorted(feeds)  # the signature's order: a replay's host feeds are staged in it (one DMA when small)
        try:
            with cupy.cuda.Device(self.device_id):
                inputs = device_block([(name, feeds[name].dtype, feeds[name].shape) for name in order])
            outputs = {}
            for name, value in values.items():
                dtype = np.dtype(numpy_dtype(value.data_type()))
                outputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape()), dtype.type, "cuda",
                                                                          self.device_id)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - only a failed allocation is answered here
            if not allocation_failed(error):
                raise
            # the call itself has its answer (ORT's eager run): the signature runs eagerly, and is offered a slot
            # again once the eager signatures are forgotten (_run_eagerly)
            self._run_eagerly(signature)
            if not self.slot_allocation_failures:
                log.warning("mha_ep: a graph session on CUDA device %d runs call signature %s eagerly: its fixed "
                            "buffers could not be allocated (%s)", self.device_id, signature,
                            str(error).splitlines()[0][:300])  # fmt: skip
            self.slot_allocation_failures += 1
            return
        self._graph_count += 1  # ids from 1 (0 is ORT's own)
        binding = self.session.io_binding()
        for name, array in inputs.items():
            binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        slot = GraphSlot(self._graph_count, inputs, outputs, binding, order=order,
                         addresses={name: array.data.ptr for name, array in inputs.items()})  # fmt: skip
        slot.views = {name: ortvalue_array(value) for name, value in outputs.items()}
        kernel = self._copy_function()
        if kernel is not None:
            from mha_ep.gpu_session.segments import SegmentCopies

            slot.copied_names = [name for name in order if inputs[name].nbytes]
            if slot.copied_names:
                slot.copies_in = SegmentCopies(kernel, [inputs[name].nbytes for name in slot.copied_names],
                                               destinations=[slot.addresses[name] for name in slot.copied_names])
        if self.direct is not None:
            slot.direct_run = functools.partial(self.direct[0].run_with_iobinding, binding._iobinding)
        self.slots[signature] = slot

    def _run_eagerly(self, signature: tuple) -> None:
        """Mark ``signature`` as one that runs eagerly (no slot). At most MAX_VERDICTS such marks are kept: past
        that they are all forgotten, and each of those signatures' next call is a first call again (eager, then
        offered a slot: one may be free by then, or the memory for it)."""
        if len(self.slots) - self._graph_count >= MAX_VERDICTS:  # the None entries (every slot counted a graph)
            self.slots = {key: slot for key, slot in self.slots.items() if slot is not None}
        self.slots[signature] = None

    def _replay(self, lane: Lane, slot: GraphSlot, host: dict, device: dict, wanted: List[str],
                make_options: Optional[Callable]) -> list:  # fmt: skip
        """A replay with host feeds (or some of each): the feeds go into the slot's buffers on ORT's stream (the
        lane's, rule 7; the caller's device feeds are settled already), ORT's replay queues behind them, and the
        outputs are the slot's views, to be read on that stream (download, or a copy)."""
        names = [name for name in slot.order if name in host and host[name].nbytes]
        lane.transfers.upload([host[name] for name in names], [slot.addresses[name] for name in names],
                              one_block=True)  # fmt: skip
        self._copy_into(slot, device, lane.stream.ptr)
        self._run_slot(slot, make_options)
        return [slot.views[name] for name in wanted]

    def _replay_device(self, slot: GraphSlot, device: dict, wanted: List[str], make_options: Optional[Callable],
                       caller) -> list:  # fmt: skip
        """A replay with device feeds and device outputs, with no host wait (rule 7): ORT's stream waits for the
        caller's (its writes of the feeds), copies the feeds into the slot's buffers, replays, and copies the
        outputs into fresh arrays; the caller's stream waits for those copies. The next replay, on the same
        stream, cannot overwrite the outputs before they are copied. A caller already on ORT's stream (it passed
        its own as ``user_compute_stream``) needs neither event: one stream orders it all."""
        if slot.copies_in is not None:  # every feed is on the device here: one launch copies them all
            arrays = [device[name] for name in slot.copied_names]
            return self._replay_arrays(slot, arrays, wanted, make_options, caller)
        ort_stream = self.ort_stream
        if caller.ptr != ort_stream.ptr:
            self._fed.record(caller)
            ort_stream.wait_event(self._fed)
        self._copy_into(slot, device, ort_stream.ptr)
        self._run_slot(slot, make_options)
        return self._copy_out(slot, wanted, caller)

    def _replay_arrays(self, slot: GraphSlot, arrays: list, wanted: List[str], make_options: Optional[Callable],
                       caller) -> list:  # fmt: skip
        """_replay_device with the copy kernel: ``arrays`` are the feeds of ``slot.copied_names``, in that order."""
        ort_stream = self.ort_stream
        wait = (self._fed, caller) if caller.ptr != ort_stream.ptr else None
        slot.copies_in.launch(ort_stream, arrays, wait)
        self._run_slot(slot, make_options)
        return self._copy_out(slot, wanted, caller)

    def _copy_out(self, slot: GraphSlot, wanted: List[str], caller) -> list:
        """Fresh arrays of the replay's ``wanted`` outputs, copied out of the slot on ORT's stream behind the replay
        (the next replay, on the same stream, cannot overwrite them first); the caller's stream waits for the
        copies (rule 7), unless it is ORT's stream itself."""
        import cupy

        ort_stream = self.ort_stream
        views = [slot.views[name] for name in wanted]
        # the outputs' memory belongs to the caller's stream (CuPy's pool reuses it in that order): current already
        # on the caller's own thread, entered on the session's worker
        if cupy.cuda.get_current_stream().ptr == caller.ptr:
            outputs = [cupy.empty(view.shape, view.dtype) for view in views]
        else:
            with caller:
                outputs = [cupy.empty(view.shape, view.dtype) for view in views]
        # the caller's stream waits, on the device, for the copies (unless it is ORT's)
        signal = (self._copied, caller) if caller.ptr != ort_stream.ptr else None
        copies, full = self._copies_out(slot, wanted, views)
        if copies is not None:
            copies.launch(ort_stream, outputs if full is None else [outputs[i] for i in full], signal=signal)
            return outputs
        copy, to_device = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToDevice
        for view, out in zip(views, outputs):
            if view.nbytes:
                copy(out.data.ptr, view.data.ptr, view.nbytes, to_device, ort_stream.ptr)
        if signal is not None:
            self._copied.record(ort_stream)
            caller.wait_event(self._copied)
        return outputs

    def _copies_out(self, slot: GraphSlot, wanted: List[str], views: list) -> tuple:
        """(the slot's SegmentCopies of the ``wanted`` outputs out of ``views``, the indexes of the outputs it copies
        or None for all): made on its first use; (None, None) where the copy kernel is unavailable or nothing is to
        be copied."""
        key = tuple(wanted)
        entry = slot.copies_out.get(key)
        if entry is None:
            from mha_ep.gpu_session.segments import SegmentCopies

            kernel = self._copy_function()
            full = [index for index, view in enumerate(views) if view.nbytes]
            copies = None if kernel is None or not full else SegmentCopies(
                kernel, [views[i].nbytes for i in full], sources=[views[i].data.ptr for i in full])  # fmt: skip
            entry = slot.copies_out[key] = (copies, None if len(full) == len(views) else full)
        return entry

    def _copy_function(self):
        """segments.copy_function on the session's device, or None where it cannot be built (NVRTC missing, say:
        logged once, and the replays keep one memcpy call per buffer)."""
        if self._copy_kernel is None:
            import cupy

            from mha_ep.gpu_session.segments import copy_function

            try:
                with cupy.cuda.Device(self.device_id):
                    self._copy_kernel = copy_function(self.device_id)
            except Exception as error:  # noqa: BLE001 - the memcpy calls do the same work
                log.warning("mha_ep: graph replays on CUDA device %d copy with one memcpy call per buffer: the copy "
                            "kernel could not be built (%s)", self.device_id, str(error).splitlines()[0][:300])
                self._copy_kernel = False
        return self._copy_kernel or None

    @staticmethod
    def _copy_into(slot: GraphSlot, device: dict, stream: int) -> None:
        """Queue copies of the device feeds ``device`` into the slot's input buffers on ``stream`` (a pointer)."""
        import cupy

        for name, array in device.items():
            if array.nbytes:
                cupy.cuda.runtime.memcpyAsync(slot.addresses[name], array.data.ptr, array.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, stream)  # fmt: skip

    # ------------------------------------------------------------------------------------------ state
    def held_graphs(self) -> int:
        """Signatures with fixed buffers for a graph."""
        return self._graph_count

    def in_use(self) -> dict:
        """The lanes out right now (none once every call has returned)."""
        return {"lanes_out": self.lanes_made - self._lanes.qsize()}

    @property
    def held_output_bytes(self) -> int:
        """Bytes of pinned output blocks that arrays handed to callers still hold."""
        return self.pinned_outputs.held_bytes
