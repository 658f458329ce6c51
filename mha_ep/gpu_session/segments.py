"""Several device-to-device copies in one kernel launch: a graph replay's feeds into its slot, its outputs out.

A replay of a graph session (ONE_STREAM_REPLAY, slots.py) copies each device feed into the slot's fixed buffer and
each output out of it. A replay copies several buffers each way, and one ``cudaMemcpyAsync`` per buffer costs the
host about twice what one kernel launch copying three of them does (docs/BENCH.md, "hostcalls"), so a slot's copies
are made by ``kernels/copy_segments.cu``: its ``Segments`` table (sources, destinations, lengths) goes by value as
the launch's one parameter.

``SegmentCopies(kernel, lengths, destinations=... | sources=...)`` is one fixed set of copies (a slot's feeds in, or
its outputs out): the side given is written once, the other (the caller's feed addresses, or the fresh output
arrays) is passed to each ``launch``. The table is rewritten per call and reused at once: a launch copies its
parameters. A set of more than MAX_SEGMENTS copies launches once per MAX_SEGMENTS. ``copy_function(device)`` is the
compiled kernel (NVRTC, once per device and process); where it cannot be built, slots.py keeps its memcpy calls.

A launch is one call into the native library (``_native.launch_copies``): with the replay's events around it (ORT's
stream waits for the caller's before the copies in, the caller's for ORT's after the copies out), the addresses
written into the table and the kernel launched by the driver, without Python between. CuPy's launch of the same
kernel, and its event calls, cost the host several times more (docs/BENCH.md, section 8). Where the native library
is not built, or the driver does not load through it, CuPy launches (``native_launch``).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

MAX_SEGMENTS = 16  # kernels/copy_segments.cu's MAX_SEGMENTS: the copies one launch makes
THREADS = 256  # a block's threads
BYTES_PER_BLOCK = THREADS * 16 * 4  # how much of the longest segment one block takes (16-byte words, four each)
MAX_BLOCKS = 1024  # blocks per segment, at most (each strides over the rest)
LAYOUT = np.dtype([("src", "<u8", (MAX_SEGMENTS,)), ("dst", "<u8", (MAX_SEGMENTS,)),
                   ("bytes", "<u8", (MAX_SEGMENTS,))])  # fmt: skip  # the kernel's struct Segments, by value

_functions: Dict[int, "CopyKernel"] = {}  # device -> the compiled kernel
_lock = threading.Lock()
_UNSET = object()
_native = {"launch": _UNSET}  # _native.launch_copies, None (CuPy launches), or unset (not looked up yet)


@dataclass(frozen=True)
class CopyKernel:
    """The copy kernel on one device: its ``cupy.cuda.Function`` (``.ptr``: the CUfunction) and how it is launched
    (``native``: _native.launch_copies; None: CuPy's launch and event calls)."""

    function: object
    device: int
    native: Optional[Callable] = None


def native_launch() -> Optional[Callable]:
    """``_native.launch_copies`` where the native library is built and loads the CUDA driver, else None (looked up
    once per process; ``use_native_launch`` sets it)."""
    launch = _native["launch"]
    if launch is _UNSET:
        from mha_ep import native

        launch = None
        if native.unavailable_reason() is None:
            module = native.library()
            if module.driver_error() is None:
                launch = module.launch_copies
        _native["launch"] = launch
    return launch


def use_native_launch(launch: Optional[Callable]) -> None:
    """Launch through ``launch`` (a stand-in with launch_copies' arguments, or None: CuPy) from now on; kernels
    compiled before keep their way."""
    _native["launch"] = launch


def copy_function(device_id: int) -> CopyKernel:
    """The copy kernel on ``device_id`` (call with that device current), compiled on the first call of the
    process (the engine's kernel cache: kernels.source_function)."""
    kernel = _functions.get(device_id)
    if kernel is None:
        from cupy.cuda.function import CPointer

        from mha_ep.engine.cuda.kernels import KERNEL_DIR, source_function

        CPointer(0)  # _Launch's parameter: a CuPy without it fails here, and the session keeps its memcpy calls
        launch = native_launch()
        with _lock:
            kernel = _functions.get(device_id)
            if kernel is None:
                function = source_function(device_id, KERNEL_DIR / "copy_segments.cu", "copy_segments").kernel
                kernel = _functions[device_id] = CopyKernel(function, device_id, launch)
    return kernel


def blocks_for(lengths: Sequence[int]) -> int:
    """Blocks per segment for a launch whose longest segment is ``max(lengths)`` bytes."""
    return max(1, min(MAX_BLOCKS, math.ceil(max(lengths, default=0) / BYTES_PER_BLOCK)))


Events = Optional[Tuple[object, object]]  # (a CuPy event, a CuPy stream), or None


class _Nothing:
    ptr = 0  # launch_copies' "no event" (and its stream, unread)


_NO_EVENT = (_Nothing, _Nothing)


class _Launch:
    """One launch's table: up to MAX_SEGMENTS copies, one side of them (``side``: "src" or "dst") per call."""

    def __init__(self, kernel: CopyKernel, side: str, destinations: Sequence[int], sources: Sequence[int],
                 lengths: Sequence[int]):  # fmt: skip
        from cupy.cuda.function import CPointer

        self.kernel = kernel
        self.count = len(lengths)
        self.table = np.zeros(1, LAYOUT)
        row = self.table[0]
        row["dst"][: self.count] = destinations
        row["src"][: self.count] = sources
        row["bytes"][: self.count] = lengths
        self.column = row[side]  # a view: a call rewrites it
        self.grid = (blocks_for(lengths), self.count)
        self.args = (CPointer(self.table.ctypes.data),)  # the parameter's bytes: the table (kept alive here)
        table = self.table.ctypes.data
        # launch_copies with what no call changes bound: (stream, addresses, wait_event, wait_stream, signal_event,
        # signal_stream) remain
        self.native = None if kernel.native is None else functools.partial(
            kernel.native, kernel.device, kernel.function.ptr, *self.grid, THREADS, table,
            table + LAYOUT.fields[side][1])  # fmt: skip

    def __call__(self, stream, addresses: Sequence, wait: Events, signal: Events) -> None:
        if self.native is not None:
            if wait is None:
                wait = _NO_EVENT
            if signal is None:
                signal = _NO_EVENT
            self.native(stream.ptr, addresses, wait[0].ptr, wait[1].ptr, signal[0].ptr, signal[1].ptr)
            return
        if wait is not None:
            wait[0].record(wait[1])
            stream.wait_event(wait[0])
        column = self.column
        for index, address in enumerate(addresses):
            column[index] = address if type(address) is int else address.data.ptr
        self.kernel.function(self.grid, (THREADS,), self.args, stream=stream)
        if signal is not None:
            signal[0].record(stream)
            signal[1].wait_event(signal[0])


class SegmentCopies:
    """Fixed copies of ``lengths`` bytes each (none zero), launched together on a stream. One of ``destinations``
    and ``sources`` is given (written once); the other is each launch's ``addresses``."""

    def __init__(self, kernel: CopyKernel, lengths: Sequence[int], destinations: Optional[Sequence[int]] = None,
                 sources: Optional[Sequence[int]] = None):  # fmt: skip
        if any(n <= 0 for n in lengths):
            raise ValueError(f"SegmentCopies: every length must be positive, got {list(lengths)}")
        if (destinations is None) == (sources is None):
            raise ValueError("SegmentCopies: give either destinations or sources (the other side is each launch's)")
        count = len(lengths)
        side = "src" if sources is None else "dst"
        destinations = [0] * count if destinations is None else list(destinations)
        sources = [0] * count if sources is None else list(sources)
        self.lengths = list(lengths)
        self._parts = [slice(i, i + MAX_SEGMENTS) for i in range(0, count, MAX_SEGMENTS)]  # each launch's copies
        self._launches = [_Launch(kernel, side, destinations[p], sources[p], self.lengths[p]) for p in self._parts]

    def launch(self, stream, addresses: Sequence, wait: Events = None, signal: Events = None) -> None:
        """Queue every copy on ``stream`` (a CuPy stream), with this call's ``addresses`` (ints, or CuPy arrays: the
        side not fixed, in the order of ``lengths``). ``wait``: (event, its stream): ``stream`` waits for that
        stream's work so far first; ``signal``: (event, a stream) that waits for the copies after."""
        if len(self._launches) == 1:  # the common case: the call's list is the launch's as it is
            self._launches[0](stream, addresses, wait, signal)
            return
        last = len(self._launches) - 1
        for index, (launch, part) in enumerate(zip(self._launches, self._parts)):
            launch(stream, addresses[part], wait if index == 0 else None, signal if index == last else None)
