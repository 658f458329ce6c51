"""A stand-in for CuPy that records the CUDA calls made through it and runs none: to hold, on any machine, the order
of calls that native/cuda_io.py promises around a graph replay (its rule 7).

``install()`` puts it in ``sys.modules`` as ``cupy``; use it in a child process only (tests/native/
test_replay_protocol.py), since modules imported after it keep it. Every call lands in ``LOG`` as a tuple:
  ("record", event, stream)         Event.record(stream)
  ("wait", stream, event)           Stream.wait_event(event)
  ("synchronize", stream)           Stream.synchronize() or Event.synchronize() (event names start with "event")
  ("copy", dst, src, nbytes, stream) cupy.cuda.runtime.memcpyAsync (the stream found by its pointer)
  ("alloc", stream, shape)          cupy.empty, under the current stream
  ("download" | "upload", stream, shape)  cupy.asnumpy, cupy.asarray
Device memory is addresses only (nothing is copied); host memory (pinned buffers and blocks) is real bytes.
Streams and events are named ("legacy", the names given to Stream, "event1", "event2", ... in order of creation).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types

import numpy as np

LOG: list = []
FAIL_COPIES: list = []  # exceptions the next memcpyAsync calls raise, in order (scripted failures)
_local = threading.local()
_streams: dict = {}  # pointer -> Stream
_counts = {"event": 0, "address": 1 << 20}


def _address(nbytes: int) -> int:
    address = _counts["address"]
    _counts["address"] += max(nbytes, 256)
    return address


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
        self.data = memptr if memptr is not None else _Pointer(_address(self.nbytes))
        self.flags = _Flags()


class Stream:
    def __init__(self, non_blocking: bool = False, name: str = "", ptr: int = 0):
        self.name = name or f"stream{len(_streams)}"
        self.ptr = ptr or 0x1000 + len(_streams)
        _streams[self.ptr] = self

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc_info):
        _stack().pop()
        return False

    def wait_event(self, event) -> None:
        LOG.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        LOG.append(("synchronize", self.name))


LEGACY = Stream(name="legacy", ptr=0x10)


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = [LEGACY]
    return stack


def get_current_stream():
    return _stack()[-1]


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        _counts["event"] += 1
        self.name = f"event{_counts['event']}"

    def record(self, stream=None) -> None:
        LOG.append(("record", self.name, (stream or get_current_stream()).name))

    def synchronize(self) -> None:
        LOG.append(("synchronize", self.name))


class Device:
    def __init__(self, device_id: int = 0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def empty(shape, dtype=np.float32):
    array = ndarray(shape, dtype)
    LOG.append(("alloc", get_current_stream().name, array.shape))
    return array


def asnumpy(array) -> np.ndarray:
    """A download (recorded): zeros of the array's shape and dtype (device memory holds no values here)."""
    LOG.append(("download", get_current_stream().name, list(array.shape)))
    return np.zeros(array.shape, array.dtype)


def asarray(array) -> ndarray:
    """An upload (recorded) of a host array: a new device array of its shape and dtype."""
    array = np.asarray(array)
    LOG.append(("upload", get_current_stream().name, list(array.shape)))
    return ndarray(array.shape, array.dtype)


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    if FAIL_COPIES:
        raise FAIL_COPIES.pop(0)
    LOG.append(("copy", dst, src, nbytes, _streams[stream].name))


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
    return _Pointer(_address(nbytes))


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


def install() -> types.ModuleType:
    """Put the stand-in in sys.modules as cupy (and cupy.cuda, cupy.cuda.runtime); returns it."""
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
    runtime.CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime})
    return cupy
