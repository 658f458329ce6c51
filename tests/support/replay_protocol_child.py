"""The child process of tests/gpu_session/test_replay_protocol.py: a GPU session's CudaSessionIO over stand-ins for
CuPy (tests/support/recording_cupy.py) and for ORT's session, its calls' CUDA calls printed as JSON.

    python tests/support/replay_protocol_child.py MODE

MODE: device, "device without kernel", "device on ort", "device numpy", host, "eager device", "eager host",
failures, "upload fails", "two devices", "slot allocation", threads, "out of memory" or segments.

The session's first call of a signature runs eagerly and makes the signature's slot (slots.py, ``first_slot``); later
calls replay it. ``device``: run_device with CuPy feeds, the first two calls from this thread (the session's owner),
the third from another thread (its call runs on the session's worker); ``device on ort``: the same three calls from
this thread on ORT's own stream; ``device without kernel``: ``device`` where the copy kernel cannot be built.
``host``: run with NumPy feeds, three calls from this thread. ``device numpy``: run_device with NumPy feeds, three
calls from this thread. ``eager ...``: the same without graphs (``eager host``: one NumPy feed and two CuPy ones, so
that run takes the page-locked path rather than ORT's own run). Printed: each call's recorded CUDA calls and ORT
runs, the feeds' and the slot's addresses, the slot's binding, the outputs' addresses, the lanes' staging buffers.
``two devices``: sessions on devices 0 and 1 (``two_devices``), with each CUDA call's devices. ``slot allocation``:
slots that cannot be allocated (``slot_allocation``). ``threads``: 8 threads at once on one graph session
(``threads``). ``out of memory``: calls whose own memory does not fit (``out_of_memory``). ``segments``:
gpu_session/segments.py's launches of more copies than one launch takes (``many_segments``).

The copy kernel and its event pair go through the native library's entry point (recording_cupy.launch_copies); a
mode ending in "cupy launch" (``device cupy launch``, ``device on ort cupy launch``, ``segments cupy launch``)
launches them through CuPy instead, as where the library or the driver is absent.
"""

from __future__ import annotations

import json
import sys
import threading

import recording_cupy

# "... cupy launch": gpu_session/segments.py launches its kernel through CuPy (the native library's entry point absent)
cupy = recording_cupy.install(native_launch=not sys.argv[1].endswith("cupy launch"))

import numpy as np  # noqa: E402 - after the stand-in, as every module that imports CuPy must be
import onnxruntime as ort  # noqa: E402

from mha_ep.gpu_session import checks, cuda_io, slots  # noqa: E402
from mha_ep.engine.cuda.staging import pack_layout  # noqa: E402

NAMES = ("input_ids", "token_type_ids", "attention_mask")
OUTPUT = "last_hidden_state"
OUTPUT_SHAPE = (1, 32, 768)


class Arg:  # ORT's NodeArg as cuda_io reads it
    def __init__(self, name: str, type_: str, shape: list):
        self.name, self.type, self.shape = name, type_, shape


class Value:
    """An OrtValue on the device, as cuda_io reads it; ``ortvalue_from_shape_and_type`` is ORT's maker. ORT
    allocates it on its session's device, whichever device is current."""

    def __init__(self, shape, device_id: int = 0):
        self._shape = list(shape)
        with cupy.cuda.Device(device_id):
            self._ptr = recording_cupy.address(int(np.prod(shape)) * 4)  # ORT's allocator, not CuPy's

    def data_type(self) -> str:
        return "tensor(float)"

    def shape(self) -> list:
        return self._shape

    def data_ptr(self) -> int:
        return self._ptr

    @staticmethod
    def ortvalue_from_shape_and_type(shape, element_type, device, device_id):
        if VALUE_FAILURES:
            raise VALUE_FAILURES.pop(0)
        return Value(shape, device_id)


class Binding:
    """ORT's IOBinding as cuda_io uses it: an unbound output gets a fresh value from each run, as ORT allocates."""

    def __init__(self, device_id: int = 0):
        self.inputs, self.outputs = {}, {}
        self.device_id = device_id

    def bind_input(self, name, device, device_id, element_type, shape, ptr):
        self.inputs[name] = ptr

    def bind_output(self, name, device, device_id):
        self.outputs[name] = None

    def bind_ortvalue_output(self, name, value):
        self.outputs[name] = value

    def get_outputs(self):
        return [value or Value(OUTPUT_SHAPE, self.device_id) for value in self.outputs.values()]


class Session:
    def __init__(self, device_id: int = 0):
        self.device_id = device_id

    def get_inputs(self):
        return [Arg(n, "tensor(int64)", ["B", "S"]) for n in NAMES]

    def get_outputs(self):
        return [Arg(OUTPUT, "tensor(float)", ["B", "S", 768])]

    def io_binding(self):
        return Binding(self.device_id)

    def run(self, output_names, feeds, options):  # ORT's own run: the answer to a call whose IOBinding run failed
        recording_cupy.log(("ort own run", entry(options, "gpu_graph_id")))
        if FAILURES and FAILURES[0] is not None:
            raise FAILURES.pop(0)
        return [np.zeros(OUTPUT_SHAPE, np.float32)]


FAILURES: list = []  # scripted: what the next runs raise (None: that run succeeds), in order
VALUE_FAILURES: list = []  # scripted: what the next OrtValue allocations raise, in order


def entry(options, key: str):
    try:
        return options.get_run_config_entry(key)
    except Exception:  # noqa: BLE001 - ORT raises for an entry that is not set
        return None


def run(binding, options) -> None:  # the session's guarded run_with_iobinding
    recording_cupy.log(("ort run", entry(options, "gpu_graph_id"),
                               entry(options, "disable_synchronize_execution_providers")))  # fmt: skip
    if FAILURES:
        failure = FAILURES.pop(0)
        if failure is not None:
            raise failure


def io_session(device: int = 0, graphs: bool = True):
    """A CudaSessionIO over the stand-in ORT session on ``device``, with graphs on ORT's own stream ("ort", or
    "ort<device>" past device 0) or without; ORT values are the stand-in's (slots.GraphSlots.first_slot makes the
    slot's outputs with them)."""
    ort.OrtValue = Value
    ort_stream = None
    if graphs:
        with cupy.cuda.Device(device):
            ort_stream = cupy.cuda.Stream(name=f"ort{device or ''}")
    return cuda_io.CudaSessionIO(Session(device), device, graphs, run, ort.RunOptions, ort_stream=ort_stream)


def outcome_of(call, describe) -> list:
    """["answered", describe(what call() returned)], or [the exception's type name, its text]."""
    try:
        return ["answered", describe(call())]
    except Exception as error:  # noqa: BLE001 - reported
        return [type(error).__name__, str(error)]


def shapes(outputs) -> list:
    return [list(o.shape) for o in outputs]


def main(kind: str) -> None:
    import logging

    graphs = not kind.startswith("eager")
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("mha_ep").addHandler(handler)
    if kind == "device without kernel":  # NVRTC missing, say: the copy kernel cannot be built
        recording_cupy.KERNEL_FAILURES[:] = [RuntimeError("CompileException: nvrtc: libnvrtc.so.12 not found")]
        kind = "device"
    kind = kind.removesuffix(" cupy launch")
    io = io_session(graphs=graphs)
    rng = np.random.default_rng(0)
    on_device = kind in ("device", "device on ort", "eager device")
    # "eager host": one NumPy feed beside two CuPy ones, so that run takes the page-locked path, not ORT's own run
    feeds = {n: cupy.ndarray((1, 32), np.int64) if on_device or (kind == "eager host" and n != NAMES[0])
             else rng.integers(0, 99, (1, 32)) for n in NAMES}  # fmt: skip
    result = {"feeds": {n: a.data.ptr for n, a in feeds.items() if isinstance(a, cupy.ndarray)}, "calls": [],
              "outputs": []}  # fmt: skip

    device_outputs = on_device or kind == "device numpy"  # run_device, whichever the feeds

    def call(caller: str) -> None:
        with io.ort_stream if caller == "ort" else cupy.cuda.Stream(name=caller):
            outputs = io.run_device(None, feeds) if device_outputs else io.run_host(None, feeds)
        result["outputs"].append([o.data.ptr if device_outputs else o.ctypes.data for o in outputs])

    callers = [("caller", False), ("caller", False), ("second caller" if on_device else "caller", on_device)]
    if kind == "device on ort":  # the caller works on ORT's own stream (it gave it as user_compute_stream)
        callers = [("ort", False)] * 3
    for caller, on_a_thread in callers:
        recording_cupy.clear()
        if on_a_thread:
            thread = threading.Thread(target=call, args=(caller,))
            thread.start()
            thread.join()
        else:
            call(caller)
        result["calls"].append({"caller": caller, "log": list(recording_cupy.LOG)})
    idle = io.lanes._idle
    staging = [lane.transfers._staging for lane in (idle.get_nowait() for _ in range(idle.qsize()))]
    result["staging"] = [buffer.address for buffer in staging if buffer.capacity]
    if graphs:
        (slot,) = io.slots.values()
        order = slot.order
        segments, _ = pack_layout([(n, np.dtype(np.int64), (1, 32)) for n in order])
        result.update(slot=slot.addresses, bound=slot.binding.inputs, view=slot.views[OUTPUT].data.ptr,
                      slot_calls=slot.calls,
                      block=[slot.addresses[order[0]], segments[order[-1]].offset + segments[order[-1]].nbytes])
    result["logged"] = logged
    print(json.dumps(result))


def failures() -> None:
    """A graph session's replays that fail: the first call eager, then a replay whose run a broken capture fails
    (answered by an eager run through ORT's own run: capture_broke), one whose run fails in a node (ORT's own run then
    raises the type ``run`` gives: ort_checks.execution_error), and a replay that works."""
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    io = io_session()
    feeds = {n: cupy.ndarray((1, 32), np.int64) for n in NAMES}
    scripts = [
        [],
        [RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")],
        [RuntimeError("Error in execution: Non-zero status code returned while running Gather node."),
         InvalidArgument("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : indices element out of data bounds")],
        [],
    ]  # fmt: skip
    calls = []
    for script in scripts:
        FAILURES[:] = script
        recording_cupy.clear()
        with cupy.cuda.Stream(name="caller"):
            outcome = outcome_of(lambda: io.run_device(None, feeds), shapes)
        calls.append({"log": list(recording_cupy.LOG), "outcome": outcome, "in_use": io.in_use(),
                      "capture_retries": io.capture_retries, "scripted_left": len(FAILURES)})  # fmt: skip
    (slot,) = io.slots.values()
    print(json.dumps({"calls": calls, "slot_calls": slot.calls}))


def upload_fails() -> None:
    """A graph session's run with NumPy feeds whose upload fails on a replay: the first call eager, the second's
    copy up refused by CUDA, then a third call."""
    io = io_session()
    feeds = {n: np.random.default_rng(1).integers(0, 99, (1, 32)) for n in NAMES}
    calls = []
    for fail in (False, True, False):
        recording_cupy.FAIL_COPIES[:] = [cupy.cuda.runtime.CUDARuntimeError("cudaErrorInvalidValue")] if fail else []
        recording_cupy.clear()
        outcome = outcome_of(lambda: io.run_host(None, feeds), shapes)
        calls.append({"log": list(recording_cupy.LOG), "outcome": outcome, "in_use": io.in_use()})
    print(json.dumps({"calls": calls}))


def out_of_memory() -> None:
    """Calls whose own memory does not fit (each allocation refused once, then calls that fit): a graph session's replay
    whose output array cannot be allocated (CuPy's OutOfMemoryError), an eager session's run whose NumPy feed's
    device block cannot be (the same), and one whose allocation CUDA refuses (CUDARuntimeError,
    cudaErrorMemoryAllocation: what CuPy's page-locked pool raises). Printed: each call's outcome, whether its
    exception is onnxruntime's RuntimeException and a MemoryError, the lanes out after it."""
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    oom = recording_cupy.OutOfMemoryError("Out of memory allocating 98,304 bytes (allocated so far: 0 bytes).")
    refused = cupy.cuda.runtime.CUDARuntimeError("cudaErrorMemoryAllocation: out of memory")
    rng = np.random.default_rng(3)
    report = []
    for label, graphs, failure in (("replay", True, oom), ("eager upload", False, oom),
                                   ("eager, refused by CUDA", False, refused)):  # fmt: skip
        io = io_session(graphs=graphs)
        device = {n: cupy.ndarray((1, 32), np.int64) for n in NAMES}
        # a NumPy feed beside CuPy ones: the page-locked path even without graphs (OWN_RUN_MAX_BYTES would take
        # all-NumPy)
        mixed = {n: rng.integers(0, 99, (1, 32)) if n == NAMES[0] else device[n] for n in NAMES}
        calls = []
        for fail in (False, True, False) if graphs else (True, False):
            recording_cupy.FAIL_ALLOCS[:] = [failure] if fail else []
            error = None
            try:
                with cupy.cuda.Stream(name="caller"):
                    outputs = io.run_device(None, device) if graphs else io.run_host(None, mixed)
                outcome = ["answered", shapes(outputs)]
            except Exception as caught:  # noqa: BLE001 - reported
                error, outcome = caught, [type(caught).__name__, str(caught)]
            calls.append({"outcome": outcome, "runtime_exception": isinstance(error, RuntimeException),
                          "memory_error": isinstance(error, MemoryError), "in_use": io.in_use(),
                          "cause": type(error.__cause__).__name__ if error is not None else None,
                          "scripted_left": len(recording_cupy.FAIL_ALLOCS)})  # fmt: skip
        report.append({"label": label, "calls": calls})
    print(json.dumps(report))


def many_segments() -> None:
    """gpu_session/segments.py over the stand-in's copy kernel: 20 copies (more than one launch takes), their sources
    given per call, launched twice. Printed: the recorded launches."""
    from mha_ep.gpu_session import segments

    stream = cupy.cuda.Stream(name="copies")
    lengths = [16 * (i + 1) for i in range(20)]
    copies = segments.SegmentCopies(segments.copy_function(0), lengths, destinations=[1000 * i for i in range(20)])
    for base in (7, 9):
        copies.launch(stream, [base * 100000 + i for i in range(20)])
    print(json.dumps({"log": list(recording_cupy.LOG)}))


def two_devices() -> None:
    """Sessions on devices 0 and 1 side by side, with graphs and without, made while device 0 is current (as a
    process makes them): each takes run_device calls (CuPy feeds on its device, the caller's stream of that device;
    with graphs, the third call from another thread) and run calls (NumPy feeds, with device 0 current). Printed:
    per session, each call's outcome, its CUDA calls and the devices each of them touched."""
    rng = np.random.default_rng(2)
    sessions = [(f"{'graphs' if graphs else 'eager'} on {device}", device, graphs, io_session(device, graphs))
                for graphs in (True, False) for device in (0, 1)]  # fmt: skip
    report = {}
    for label, device, graphs, io in sessions:
        with cupy.cuda.Device(device):
            caller = cupy.cuda.Stream(name=f"caller{device}")
            on_device = {n: cupy.ndarray((1, 32), np.int64) for n in NAMES}
        # a NumPy feed beside CuPy ones: the page-locked path even without graphs (OWN_RUN_MAX_BYTES would take
        # all-NumPy)
        mixed = {n: rng.integers(0, 99, (1, 32)) if n == NAMES[0] else on_device[n] for n in NAMES}
        host = {n: rng.integers(0, 99, (1, 32)) for n in NAMES} if graphs else mixed
        calls = []

        def call(kind: str) -> None:
            recording_cupy.clear()
            if kind == "run_device":
                with cupy.cuda.Device(device), caller:
                    outcome = outcome_of(lambda: io.run_device(None, on_device),
                                         lambda outputs: [recording_cupy.device_of(o.data.ptr) for o in outputs])
            else:
                outcome = outcome_of(lambda: io.run_host(None, host), shapes)
            calls.append({"kind": kind, "outcome": outcome, "log": list(recording_cupy.LOG),
                          "places": [sorted(p) for p in recording_cupy.PLACES]})  # fmt: skip

        for index in range(3):
            if graphs and index == 2:  # another thread: its call runs on the session's worker
                thread = threading.Thread(target=call, args=("run_device",))
                thread.start()
                thread.join()
            else:
                call("run_device")
        for _ in range(3):
            call("run")
        report[label] = {"device": device, "calls": calls,
                         "slot_calls": sum(s.calls for s in io.slots.values() if s is not None)}  # fmt: skip
    print(json.dumps(report))


def slot_allocation() -> None:
    """A graph session whose slots cannot always be allocated, run_device with CuPy feeds, one call per line of
    ``calls``: (sequence length, what the slot's allocation meets). A first call whose slot's device block (CuPy)
    or output value (ORT) cannot be allocated keeps its eager answer and the signature runs eagerly; a failure
    that is no allocation's is raised. Then, with MAX_GRAPHS reached and MAX_VERDICTS made 3, eager signatures are
    forgotten past 3. Printed: each call's outcome, ORT's runs, the slots and the failures counted and logged."""
    import logging

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("mha_ep").addHandler(handler)
    io = io_session()
    oom = recording_cupy.OutOfMemoryError("out of memory to allocate 768 bytes (allocated so far: 0 bytes)")
    arena = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: "
                         "BFCArena::AllocateRawInternal Failed to allocate memory for requested buffer of size 98304")
    lost = RuntimeError("CUDA failure 700: an illegal memory access was encountered")
    calls = [(32, "block OOM"), (32, None), (16, None), (16, None), (8, "value OOM"), (24, "lost context"),
             (12, "no slots left"), (11, None), (10, None), (9, None), (7, None)]
    report = []
    for index, (sequence, failure) in enumerate(calls):
        if failure == "no slots left":
            slots.MAX_GRAPHS, checks.MAX_VERDICTS = io.held_graphs(), 3
        recording_cupy.FAIL_ALLOCS[:] = [oom] if failure == "block OOM" else []
        VALUE_FAILURES[:] = [arena] if failure == "value OOM" else [lost] if failure == "lost context" else []
        feeds = {n: cupy.ndarray((1, sequence), np.int64) for n in NAMES}
        recording_cupy.clear()
        with cupy.cuda.Stream(name="caller"):
            outcome = outcome_of(lambda: io.run_device(None, feeds), shapes)
        runs = [entry[1] for entry in recording_cupy.LOG if entry[0] == "ort run"]
        report.append({"sequence": sequence, "failure": failure, "outcome": outcome, "ort runs": runs,
                       "slots": {str(key[0][1][1]): None if slot is None else slot.graph_id
                                 for key, slot in io.slots.items()}})  # fmt: skip
    print(json.dumps({"calls": report, "failures": io.slot_allocation_failures, "held": io.held_graphs(),
                      "logged": logged}))  # fmt: skip


def threads() -> None:
    """A graph session's run_device from 8 threads at once (20 calls each, one signature, after the first call made
    the slot), each thread on a caller stream of its own, this one (the session's owner) among them. Printed: the
    recorded calls of every thread, in order; each call's outcome; the slot's replays; the lanes out after."""
    io = io_session()
    feeds = {n: cupy.ndarray((1, 32), np.int64) for n in NAMES}
    with cupy.cuda.Stream(name="first"):
        io.run_device(None, feeds)
    recording_cupy.clear()
    outcomes: list = []
    start = threading.Barrier(8)
    sys.setswitchinterval(1e-6)  # the threads switch as often as Python lets them: calls would interleave unlocked

    def caller(index: int) -> None:
        with cupy.cuda.Stream(name=f"caller{index}"):
            start.wait()  # all eight call at once
            for _ in range(20):
                outcomes.append(outcome_of(lambda: io.run_device(None, feeds), lambda out: out[0].data.ptr))

    # this thread made the first call, so it owns the session (its calls run here, the others' on the worker):
    # it is caller 0
    workers = [threading.Thread(target=caller, args=(i,)) for i in range(1, 8)]
    for worker in workers:
        worker.start()
    caller(0)
    for worker in workers:
        worker.join()
    (slot,) = io.slots.values()
    print(json.dumps({"log": list(recording_cupy.LOG), "outcomes": outcomes, "slot_calls": slot.calls,
                      "in_use": io.in_use()}))  # fmt: skip


if __name__ == "__main__":
    modes = {"failures": failures, "upload fails": upload_fails, "two devices": two_devices,
             "slot allocation": slot_allocation, "threads": threads, "out of memory": out_of_memory,
             "segments": many_segments, "segments cupy launch": many_segments}
    modes.get(sys.argv[1], lambda: main(sys.argv[1]))()
