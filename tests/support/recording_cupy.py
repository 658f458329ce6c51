"""A stand-in for CuPy that records the CUDA calls made through it and runs none: to hold, on any machine, the order
of calls that gpu_session/slots.py promises around a graph replay (its ONE_STREAM_REPLAY).

``install()`` puts it in ``sys.modules`` as ``cupy``; use it in a child process only (tests/native/
test_replay_protocol.py), since modules imported after it keep it. Every call lands in ``LOG`` as a tuple:
  ("record", event, stream)         Event.record(stream)
  ("wait", stream, event)           Stream.wait_event(event)
  ("synchronize", stream)           Stream.synchronize() or Event.synchronize() (event names start with "event")
  ("copy", dst, src, nbytes, stream) cupy.cuda.runtime.memcpyAsync (the stream found by its pointer)
  ("launch copy_segments", [[dst, src, nbytes], ...], stream)  gpu_session/segments.py's copy kernel, its table read
                                    (CuPy's launch, or the native library's launch_copies: ``launch_copies`` here,
                                    which records its event calls as above, in its order)
  ("alloc", stream, shape)          cupy.empty, under the current stream
  ("download" | "upload", stream, shape)  cupy.asnumpy, cupy.asarray
Device memory is addresses only (nothing is copied); host memory (pinned buffers and blocks) is real bytes.
Streams and events are named ("legacy", the names given to Stream, "event1", "event2", ... in order of creation).

Devices, as CUDA and CuPy have them: ``Device(i)`` makes device i current on the thread; a stream, an event and
device memory belong to the device current when they were made (the legacy stream to whichever is current); each
device has its own current stream (``with stream`` refuses a stream of another device, as CuPy does), and recording
an event on a stream of another device fails, as ``cudaEventRecord`` does. ``PLACES[i]`` is the set of devices
``LOG[i]`` touched: the current one, and those of its stream, event and device addresses.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from typing import Optional

import numpy as np

LOG: list = []
PLACES: list = []  # PLACES[i]: the devices LOG[i] touched
FAIL_COPIES: list = []  # exceptions the next memcpyAsync calls raise, in order (scripted failures)
FAIL_ALLOCS: list = []  # exceptions the next cupy.cuda.alloc or cupy.empty calls raise, in order (scripted)
_local = threading.local()
_streams: dict = {}  # pointer -> Stream
_streams_lock = threading.RLock()  # the recorder's counters, shared by every thread
_counts = {"event": 0, "address": 1 << 20}
_blocks: list = []  # (first address, end, device) of each device allocation
_events: dict = {}  # pointer -> Event
_kernels: dict = {}  # pointer -> _CopyKernel


def current_device() -> int:
    devices = getattr(_local, "devices", None)
    return devices[-1] if devices else 0


def address(nbytes: int) -> int:
    """A fresh device address of ``nbytes`` on the current device (no CuPy allocation: ORT's own, say)."""
    with _streams_lock:  # calls on several threads at once get distinct addresses
        address = _counts["address"]
        _counts["address"] += max(nbytes, 256)
        _blocks.append((address, address + max(nbytes, 256), current_device()))
    return address


def device_of(address: int):
    """The device whose allocation holds ``address`` (None: host memory, or no allocation of this stand-in's)."""
    for first, end, device in _blocks:
        if first <= address < end:
            return device
    return None


def clear() -> None:
    """Forget what was recorded (LOG and PLACES)."""
    del LOG[:], PLACES[:]


def log(entry: tuple, *devices) -> None:
    """Record ``entry``, and the devices it touched: the current one and ``devices`` (None: host, -1: current)."""
    here = current_device()
    LOG.append(entry)
    PLACES.append({here} | {here if d == -1 else d for d in devices if d is not None})


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __add__(self, offset: int) -> "_Pointer":
        return _Pointer(self.ptr + offset)


class _Flags:
    c_contiguous = True


class ndarray:
    def __init__(self, shape, dtype=np.float32, memptr=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.data = memptr if memptr is not None else _Pointer(address(self.nbytes))
        self.flags = _Flags()
        self._c_contiguous = True  # CuPy's readonly attribute behind flags.c_contiguous


class Stream:
    def __init__(self, non_blocking: bool = False, name: str = "", ptr: int = 0, device_id: Optional[int] = None):
        with _streams_lock:  # threads make their streams at once (the "threads" protocol): each its own pointer
            self.name = name or f"stream{len(_streams)}"
            self.ptr = ptr or 0x1000 + len(_streams)
            self.device_id = current_device() if device_id is None else device_id  # -1: the legacy stream
            _streams[self.ptr] = self

    def __enter__(self):
        device = current_device()
        if self.device_id not in (-1, device):  # CuPy's check_stream_device_match
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does not match with "
                               f"the current device ({device})")  # fmt: skip
        _stack(device).append(self)
        return self

    def __exit__(self, *exc_info):
        _stack(current_device()).pop()
        return False

    def wait_event(self, event) -> None:  # across devices too, as cudaStreamWaitEvent allows
        log(("wait", self.name, event.name), self.device_id, event.device_id)

    def synchronize(self) -> None:
        log(("synchronize", self.name), self.device_id)


LEGACY = Stream(name="legacy", ptr=0x10, device_id=-1)


def _stack(device: int) -> list:
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = {}
    return stacks.setdefault(device, [LEGACY])


def get_current_stream():
    """The current device's current stream (CuPy keeps one per device and thread)."""
    return _stack(current_device())[-1]


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        with _streams_lock:  # events made on several threads at once: each its own name and pointer
            _counts["event"] += 1
            self.name = f"event{_counts['event']}"
            self.device_id = current_device()
            self.ptr = 0x7000 + _counts["event"]
            _events[self.ptr] = self

    def record(self, stream=None) -> None:
        stream = stream or get_current_stream()
        device = current_device() if stream.device_id == -1 else stream.device_id
        if device != self.device_id:  # cudaEventRecord: the event and the stream must be of one device
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: invalid resource handle (event {self.name} of "
                                   f"device {self.device_id} recorded on stream {stream.name} of device {device})")
        log(("record", self.name, stream.name), self.device_id, stream.device_id)

    def synchronize(self) -> None:
        log(("synchronize", self.name), self.device_id)


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    def __init__(self, device_id: Optional[int] = None):
        self.id = current_device() if device_id is None else device_id

    def __enter__(self):
        devices = getattr(_local, "devices", None)
        if devices is None:
            devices = _local.devices = []
        devices.append(self.id)
        return self

    def __exit__(self, *exc_info):
        _local.devices.pop()
        return False


def empty(shape, dtype=np.float32):
    if FAIL_ALLOCS:  # CuPy's empty allocates from its pool: cupy.cuda.alloc's failures
        raise FAIL_ALLOCS.pop(0)
    array = ndarray(shape, dtype)
    log(("alloc", get_current_stream().name, array.shape), get_current_stream().device_id)
    return array


def asnumpy(array) -> np.ndarray:
    """A download (recorded): zeros of the array's shape and dtype (device memory holds no values here)."""
    log(("download", get_current_stream().name, list(array.shape)), device_of(array.data.ptr))
    return np.zeros(array.shape, array.dtype)


def asarray(array) -> ndarray:
    """An upload (recorded) of a host array: a new device array of its shape and dtype."""
    array = np.asarray(array)
    result = ndarray(array.shape, array.dtype)
    log(("upload", get_current_stream().name, list(array.shape)), device_of(result.data.ptr))
    return result


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    if FAIL_COPIES:
        raise FAIL_COPIES.pop(0)
    on = _streams[stream]
    log(("copy", dst, src, nbytes, on.name), on.device_id, device_of(dst), device_of(src))


class _HostMemory(bytearray):
    """Page-locked memory's stand-in: host bytes with their address (``ptr``) and the buffer protocol."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self.ptr = ctypes.addressof((ctypes.c_char * max(nbytes, 1)).from_buffer(self)) if nbytes else 0


def alloc_pinned_memory(nbytes: int) -> _HostMemory:
    return _HostMemory(nbytes)


class _PinnedMemoryPool:
    def malloc(self, nbytes: int) -> _HostMemory:
        return _HostMemory(nbytes)


def alloc(nbytes: int) -> _Pointer:
    if FAIL_ALLOCS:
        raise FAIL_ALLOCS.pop(0)
    return _Pointer(address(nbytes))


class OutOfMemoryError(MemoryError):  # CuPy's, a MemoryError
    pass


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        self.ptr, self.size, self.owner = ptr, size, owner


def memory_pointer(memory, offset: int) -> _Pointer:
    return _Pointer(memory.ptr + offset)


class _Attributes:
    type = 0  # not page-locked: host feeds go through the staging buffer


def pointer_attributes(ptr: int) -> _Attributes:
    return _Attributes()


def ascontiguousarray(array):
    return array


KERNEL_FAILURES: list = []  # exceptions the next RawModule builds raise, in order (a kernel that cannot be built)


class CPointer:  # cupy.cuda.function.CPointer: a kernel parameter's bytes, by address
    def __init__(self, p: int = 0):
        self.ptr = p


class _CopyKernel:
    """gpu_session/segments.py's copy kernel (a cupy.cuda.Function): a launch is recorded as
    ("launch copy_segments", [[dst, src, nbytes], ...], stream) read from the table its one parameter points at."""

    def __init__(self, device: int):
        self.device = device
        self.ptr = 0x9000 + len(_kernels)
        _kernels[self.ptr] = self

    def __call__(self, grid, block, args, shared_mem=0, stream=None) -> None:
        from mha_ep.gpu_session.segments import LAYOUT

        stream = get_current_stream() if stream is None else stream
        (pointer,) = args
        table = np.frombuffer((ctypes.c_char * LAYOUT.itemsize).from_address(pointer.ptr), LAYOUT)[0]
        count = grid[1]
        copies = [[int(table["dst"][i]), int(table["src"][i]), int(table["bytes"][i])] for i in range(count)]
        if stream.device_id != current_device() or self.device != current_device():
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: a launch on stream {stream.name} of device "
                                   f"{stream.device_id} with the kernel of device {self.device}")  # fmt: skip
        touched = [device_of(a) for copy in copies for a in copy[:2]]
        log(("launch copy_segments", copies, stream.name), stream.device_id, *touched)


def launch_copies(device, function, grid_x, grid_y, block_x, table, column, stream, addresses, wait_event,
                  wait_stream, signal_event, signal_stream) -> None:
    """The native library's ``launch_copies`` (mha_ep/native/csrc/replay.c), its CUDA calls recorded as CuPy's would be:
    on ``device`` (its context made current), ORT's stream waits for ``wait_event`` recorded on ``wait_stream``, the
    addresses go into the table's column, the kernel is launched, ``signal_stream`` waits for ``signal_event``
    recorded after it. The handles are the stand-in's pointers (streams, events, kernels)."""
    from mha_ep.gpu_session.segments import LAYOUT, MAX_SEGMENTS

    on = _streams[stream]
    if not (table <= column < table + LAYOUT.itemsize) or len(addresses) > grid_y or grid_y > MAX_SEGMENTS:
        raise ValueError(f"launch_copies: table {table}, column {column}, {len(addresses)} addresses, grid_y {grid_y}")
    values = [a if isinstance(a, int) else a.data.ptr for a in addresses]
    with Device(device):
        if wait_event:
            _events[wait_event].record(_streams[wait_stream])
            on.wait_event(_events[wait_event])
        ctypes.memmove(column, (ctypes.c_uint64 * len(values))(*values), 8 * len(values))
        _kernels[function]((grid_x, grid_y), (block_x,), (CPointer(table),), stream=on)
        if signal_event:
            _events[signal_event].record(on)
            _streams[signal_stream].wait_event(_events[signal_event])


class _RawKernel:
    @property
    def kernel(self) -> _CopyKernel:  # CuPy loads the module on the current device
        return _CopyKernel(current_device())


class RawModule:
    def __init__(self, code: str = "", options=(), name_expressions=()):
        if KERNEL_FAILURES:
            raise KERNEL_FAILURES.pop(0)
        if "copy_segments" not in code:
            raise ValueError("the stand-in builds only gpu_session/segments.py's copy kernel")

    def get_function(self, name: str) -> _RawKernel:
        return _RawKernel()


def install(native_launch: bool = True) -> types.ModuleType:
    """Put the stand-in in sys.modules as cupy (and cupy.cuda, cupy.cuda.runtime); returns it. ``native_launch``:
    gpu_session/segments.py launches its copy kernel through ``launch_copies`` (the native library's entry point, as
    where it is built and the driver loads); False: through CuPy's launch and event calls."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    cupy.cuda, cuda.runtime = cuda, runtime
    cupy.ndarray, cupy.empty, cupy.ascontiguousarray = ndarray, empty, ascontiguousarray
    cupy.asnumpy, cupy.asarray = asnumpy, asarray
    cuda.Stream, cuda.Event, cuda.Device, cuda.get_current_stream = Stream, Event, Device, get_current_stream
    cuda.PinnedMemoryPool, cuda.alloc_pinned_memory, cuda.alloc = _PinnedMemoryPool, alloc_pinned_memory, alloc
    runtime.memcpyAsync, runtime.memcpyDeviceToDevice = memcpy_async, 3
    runtime.pointerGetAttributes = pointer_attributes
    cuda.UnownedMemory, cuda.MemoryPointer = UnownedMemory, memory_pointer
    cuda.memory = types.ModuleType("cupy.cuda.memory")
    cuda.memory.OutOfMemoryError = OutOfMemoryError
    runtime.CUDARuntimeError = CUDARuntimeError
    cupy.RawModule = RawModule
    cuda.function = types.ModuleType("cupy.cuda.function")
    cuda.function.CPointer = CPointer
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime,
                        "cupy.cuda.memory": cuda.memory, "cupy.cuda.function": cuda.function})  # fmt: skip
    if native_launch:  # the copy kernel's launches go through the native library's entry point, as on a GPU
        from mha_ep.gpu_session import segments

        segments.use_native_launch(launch_copies)
    return cupy
