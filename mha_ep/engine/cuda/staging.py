"""Host staging of the cuda backend: packing a call's arrays into one byte buffer, and grow-only pinned buffers.

Every input of a call is copied into one pinned (page-locked) host buffer at 256-byte aligned offsets and moved
with asynchronous copies (pinned transfers are several times faster than pageable ones, docs/FACTS.md §8); the
outputs come back the same way through a second pinned buffer. The buffers belong to one backend instance, are
reused by every call and only grow. The allocator is injected (``cupy.cuda.alloc_pinned_memory`` in the backend),
so this module does not import CuPy.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

ALIGNMENT = 256  # bytes; every segment starts on this boundary (CUDA allocations are 256-byte aligned too)
GROWTH_GRANULE = 1 << 20  # pinned buffers grow in whole MiB, so slowly growing calls do not re-pin every time
COPY_CHUNK_BYTES = 4 << 20  # host copies run in chunks of this size, several at once (numpy drops the GIL)
SINGLE_UPLOAD_BYTES = 1 << 20  # below this, the inputs go up in one copy (per-copy overhead beats overlap)
# Above THREADED_UPLOAD_BYTES the inputs' chunks are copied on the copy threads, in chunks of UPLOAD_CHUNK_BYTES,
# each chunk's DMA queued as soon as it is copied. Smaller chunks lose to thread hand-offs, larger ones to less
# overlap (docs/BENCH.md, "Host-side choices").
THREADED_UPLOAD_BYTES = 1 << 20
UPLOAD_CHUNK_BYTES = 2 << 20


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # bytes from the buffer start
    nbytes: int
    dtype: np.dtype
    shape: tuple


def pack_layout(entries: Sequence[tuple[str, np.dtype, tuple]]) -> tuple[dict[str, Segment], int]:
    """Aligned segments for (name, dtype, shape) entries, in order; returns them by name and the total bytes."""
    segments, offset = {}, 0
    for name, dtype, shape in entries:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        segments[name] = Segment(name, offset, nbytes, dtype, tuple(shape))
        offset = align_up(offset + nbytes)
    return segments, max(offset, ALIGNMENT)


class PinnedStaging:
    """A grow-only host buffer from ``allocate(nbytes)`` (an object with ``.ptr`` and the buffer protocol)."""

    def __init__(self, allocate: Callable[[int], object]):
        self._allocate = allocate
        self._memory: Optional[object] = None
        self._bytes: Optional[np.ndarray] = None

    @property
    def capacity(self) -> int:
        return 0 if self._bytes is None else self._bytes.nbytes

    def ensure(self, nbytes: int) -> np.ndarray:
        """A uint8 view of at least ``nbytes``; the old buffer is dropped only when a larger one is needed."""
        if nbytes > self.capacity:
            size = align_up(max(nbytes, 2 * self.capacity), GROWTH_GRANULE)
            self._bytes = None
            self._memory = None  # release the old pages before pinning new ones
            self._memory = self._allocate(size)
            self._bytes = np.frombuffer(self._memory, dtype=np.uint8, count=size)
        return self._bytes

    @property
    def address(self) -> int:
        return self._memory.ptr

    def view(self, segment: Segment) -> np.ndarray:
        """The segment as an array of its dtype and shape (writable; aliases the pinned buffer)."""
        raw = self._bytes[segment.offset : segment.offset + segment.nbytes]
        return raw.view(segment.dtype).reshape(segment.shape)


def copy_pairs_in_chunks(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], executor: Optional[concurrent.futures.Executor] = None,
    chunk_bytes: int = COPY_CHUNK_BYTES,
) -> Iterator[tuple[int, int, int]]:  # fmt: skip
    """Copy each ``(dst, src)`` pair (same shape, ``dst`` C-contiguous) chunk by chunk, on ``executor``'s threads
    when given. The chunks of *all* pairs are submitted at once, so a call's inputs are copied side by side: one
    input at a time left most copy threads idle (a 12.6 MB input is three 4 MiB chunks; docs/BENCH.md, "Host-side
    choices").

    Yields (pair index, byte offset in that ``dst``, byte count) of each chunk in submission order (pair by pair,
    offsets ascending), as soon as that chunk is complete, so the caller can start the chunk's DMA while later
    chunks are still being copied. Every submitted copy has finished when the generator is closed, also when the
    caller stops early (no thread writes into a reused buffer later).
    """
    chunks = []  # (pair index, dst chunk, src chunk, byte offset, byte count)
    for index, (dst, src) in enumerate(pairs):
        if not dst.flags.c_contiguous:
            raise ValueError("copy_in_chunks needs a C-contiguous destination")
        dst_flat = dst.reshape(-1)
        src_flat = np.asarray(src).reshape(-1)
        count, itemsize = dst_flat.size, dst_flat.itemsize
        per_chunk = max(1, chunk_bytes // itemsize)
        for start in range(0, count, per_chunk):
            stop = min(start + per_chunk, count)
            chunks.append((index, dst_flat[start:stop], src_flat[start:stop], start * itemsize,
                           (stop - start) * itemsize))  # fmt: skip
    if executor is None or len(chunks) <= 1:
        for index, dst_chunk, src_chunk, offset, nbytes in chunks:
            np.copyto(dst_chunk, src_chunk, casting="same_kind")
            yield index, offset, nbytes
        return
    futures = [executor.submit(np.copyto, dst_chunk, src_chunk, casting="same_kind")
               for _, dst_chunk, src_chunk, _, _ in chunks]  # fmt: skip
    try:
        for (index, _, _, offset, nbytes), future in zip(chunks, futures):
            future.result()
            yield index, offset, nbytes
    finally:
        concurrent.futures.wait(futures)


def stage_uploads(
    staging: PinnedStaging, segments: Sequence[Segment], arrays: Sequence[np.ndarray], destinations: Sequence[int],
    upload: Callable[[int, int, int], None], executor: Optional[concurrent.futures.Executor] = None,
    one_block: bool = False,
) -> None:  # fmt: skip
    """Copy each of ``arrays`` into its segment of ``staging`` (already large enough) and queue its move to the
    device address of the same index in ``destinations`` with ``upload(src, nbytes, dst)``.

    Calls of at most SINGLE_UPLOAD_BYTES whose destinations lie in one device allocation (``one_block``, the
    caller's word) as the segments do go up in one copy after all host copies; larger ones, and destinations in
    separate allocations, chunk by chunk (UPLOAD_CHUNK_BYTES), each chunk's upload queued as soon as it is in the
    pinned buffer, on ``executor``'s threads above THREADED_UPLOAD_BYTES. Empty arrays move nothing. (One copy
    across two allocations that merely lie side by side fails: cudaErrorInvalidValue, seen in graph replays.)"""
    if not segments:
        return
    first, last = segments[0], segments[-1]
    total = last.offset + last.nbytes - first.offset
    laid_out = one_block and all(dst - destinations[0] == seg.offset - first.offset
                                 for seg, dst in zip(segments, destinations))  # fmt: skip
    views = [staging.view(segment) for segment in segments]
    if total <= SINGLE_UPLOAD_BYTES and laid_out:
        for view, array in zip(views, arrays):
            np.copyto(view, array, casting="same_kind")
        upload(staging.address + first.offset, total, destinations[0])
        return
    threads = executor if total > THREADED_UPLOAD_BYTES else None
    for index, offset, nbytes in copy_pairs_in_chunks(list(zip(views, arrays)), threads, UPLOAD_CHUNK_BYTES):
        upload(staging.address + segments[index].offset + offset, nbytes, destinations[index] + offset)


def copy_in_chunks(
    dst: np.ndarray, src: np.ndarray, executor: Optional[concurrent.futures.Executor] = None,
    chunk_bytes: int = COPY_CHUNK_BYTES,
) -> Iterator[tuple[int, int]]:  # fmt: skip
    """copy_pairs_in_chunks for one pair: yields (byte offset, byte count) of each chunk of ``dst`` in order."""
    chunks = copy_pairs_in_chunks([(dst, src)], executor, chunk_bytes)
    try:
        for _, offset, nbytes in chunks:
            yield offset, nbytes
    finally:
        chunks.close()


def parallel_copy(dst: np.ndarray, src: np.ndarray, executor: Optional[concurrent.futures.Executor] = None) -> None:
    for _ in copy_in_chunks(dst, src, executor):
        pass
