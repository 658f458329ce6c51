"""Several device-to-device copies in one kernel launch: a graph replay's feeds into its slot, its outputs out.

A replay of a graph session (cuda_io rule 7) copies each device feed into the slot's fixed buffer and each output
out of it. One ``cudaMemcpyAsync`` costs about three times the host time of one kernel launch that copies three
small buffers (docs/BENCH.md, "hostcalls"), so a slot's copies are made by ``kernels/copy_segments.cu``: its
``Segments`` table (sources, destinations, lengths) goes by value as the launch's one parameter.

``SegmentCopies(function, destinations, sources, lengths)`` is one fixed set of copies (a slot's feeds in, or its
outputs out): what a call changes (the caller's feed addresses, or the fresh output arrays) is passed to
``launch``, the rest is written once. The table is rewritten per call and reused at once: a launch copies its
parameters. A set of more than MAX_SEGMENTS copies launches once per MAX_SEGMENTS. ``copy_function(device)`` is the
compiled kernel (NVRTC, once per device and process); where it cannot be built, cuda_io keeps its memcpy calls.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, Optional, Sequence

import numpy as np

MAX_SEGMENTS = 16  # kernels/copy_segments.cu's MAX_SEGMENTS: the copies one launch makes
THREADS = 256  # a block's threads
BYTES_PER_BLOCK = THREADS * 16 * 4  # how much of the longest segment one block takes (16-byte words, four each)
MAX_BLOCKS = 1024  # blocks per segment, at most (each strides over the rest)
LAYOUT = np.dtype([("src", "<u8", (MAX_SEGMENTS,)), ("dst", "<u8", (MAX_SEGMENTS,)),
                   ("bytes", "<u8", (MAX_SEGMENTS,))])  # fmt: skip  # the kernel's struct Segments, by value

_functions: Dict[int, object] = {}  # device -> the kernel's cupy.cuda.Function
_lock = threading.Lock()


def copy_function(device_id: int):
    """The copy kernel's ``cupy.cuda.Function`` on ``device_id`` (call with that device current), compiled on the
    first call of the process."""
    function = _functions.get(device_id)
    if function is None:
        import cupy
        from cupy.cuda.function import CPointer

        from mha_ep.ops.backends.cuda.kernels import kernel_source

        CPointer(0)  # _Launch's parameter: a CuPy without it fails here, and the session keeps its memcpy calls

        with _lock:
            function = _functions.get(device_id)
            if function is None:
                module = cupy.RawModule(code=kernel_source("copy_segments.cu"))
                function = _functions[device_id] = module.get_function("copy_segments").kernel
    return function


def blocks_for(lengths: Sequence[int]) -> int:
    """Blocks per segment for a launch whose longest segment is ``max(lengths)`` bytes."""
    return max(1, min(MAX_BLOCKS, math.ceil(max(lengths, default=0) / BYTES_PER_BLOCK)))


class _Launch:
    """One launch's table: up to MAX_SEGMENTS copies."""

    def __init__(self, function, destinations: Sequence[int], sources: Sequence[int], lengths: Sequence[int]):
        from cupy.cuda.function import CPointer

        self.function = function
        self.count = len(lengths)
        self.table = np.zeros(1, LAYOUT)
        row = self.table[0]
        row["dst"][: self.count] = destinations
        row["src"][: self.count] = sources
        row["bytes"][: self.count] = lengths
        self.src, self.dst = row["src"], row["dst"]  # views: a call rewrites one of them
        self.grid = (blocks_for(lengths), self.count)
        self.args = (CPointer(self.table.ctypes.data),)  # the parameter's bytes: the table (kept alive here)

    def __call__(self, stream, sources: Optional[Sequence[int]], destinations: Optional[Sequence[int]]) -> None:
        if sources is not None:
            for index, address in enumerate(sources):
                self.src[index] = address
        if destinations is not None:
            for index, address in enumerate(destinations):
                self.dst[index] = address
        self.function(self.grid, (THREADS,), self.args, stream=stream)


class SegmentCopies:
    """Fixed copies of ``lengths`` bytes each (none zero), launched together on a stream; ``destinations`` or
    ``sources`` may be None where every call passes its own."""

    def __init__(self, function, lengths: Sequence[int], destinations: Optional[Sequence[int]] = None,
                 sources: Optional[Sequence[int]] = None):  # fmt: skip
        if any(n <= 0 for n in lengths):
            raise ValueError(f"SegmentCopies: every length must be positive, got {list(lengths)}")
        count = len(lengths)
        destinations = [0] * count if destinations is None else list(destinations)
        sources = [0] * count if sources is None else list(sources)
        self.lengths = list(lengths)
        self._parts = [slice(i, i + MAX_SEGMENTS) for i in range(0, count, MAX_SEGMENTS)]  # each launch's copies
        self._launches = [_Launch(function, destinations[p], sources[p], self.lengths[p]) for p in self._parts]

    def launch(self, stream, sources: Optional[Sequence[int]] = None,
               destinations: Optional[Sequence[int]] = None) -> None:  # fmt: skip
        """Queue every copy on ``stream`` (a CuPy stream), with this call's ``sources`` or ``destinations`` (in the
        order of ``lengths``) where given."""
        if len(self._launches) == 1:  # the common case: the call's lists are the launch's as they are
            self._launches[0](stream, sources, destinations)
            return
        for launch, part in zip(self._launches, self._parts):
            launch(stream, None if sources is None else sources[part],
                   None if destinations is None else destinations[part])  # fmt: skip
