"""Host <-> device copies of a GPU session's call (gpu_session/cuda_io.py): NumPy feeds up, outputs down.

One pinned buffer filled by the copy threads uploads faster than one ``cupy.asarray`` per feed, and pinned
output blocks download several times faster than fresh NumPy arrays (docs/BENCH.md, "Host-side choices"). So:

  * Up: feeds already in page-locked memory (an output of an earlier call, ``cupyx.empty_pinned``) go up
    directly. Others are packed into one grow-only pinned buffer, chunk by chunk on the copy threads
    (staging.stage_uploads, the bridge's own upload), each chunk's DMA queued as soon as it is copied; small
    calls copy on the calling thread and go up in one DMA. An event after the uploads
    guards the buffer: the next call waits for it before writing there again.
  * Down: each output is copied into its own page-locked block and handed back as a NumPy array over it. Fresh
    pageable arrays are what made the download slow (their pages fault in on first touch); a pooled pinned block
    comes back already mapped. The block returns to the pool (PinnedOutputs: one per session, shared by its
    lanes) when the last array over it is gone. The blocks callers hold are capped (PINNED_OUTPUT_BYTES); beyond
    the cap, outputs come back as ordinary arrays. A decode loop that feeds the presents back gets both halves:
    its past goes up by direct DMA.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Sequence

import cupy
import numpy as np

from mha_ep.native.ort_checks import dtype_error, tensor_type
from mha_ep.engine.cuda.staging import PinnedStaging, align_up, pack_layout, stage_uploads

MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
PINNED_OUTPUT_BYTES = 1 << 30  # at most this much of a runner's outputs held by callers in pinned blocks
PINNED_OUTPUT_MIN_BYTES = 64 << 10  # smaller outputs: ordinary arrays (a pinned block would cost more than it saves)
MEMORY_TYPE_HOST = 1  # cudaPointerAttributes.type of page-locked host memory


def device_block(entries) -> Dict[str, cupy.ndarray]:
    """CuPy arrays for (name, dtype, shape) ``entries``, in order, in one device allocation laid out as
    staging.pack_layout lays out the staging buffer (so that staging.stage_uploads may fill it in one copy)."""
    segments, total = pack_layout(entries)
    block = cupy.cuda.alloc(total)
    return {name: cupy.ndarray(shape, dtype, block + segments[name].offset) for name, dtype, shape in entries}


def is_host_feed(value) -> bool:
    """A feed that lies on the host: a NumPy array, or anything without ``__dlpack__`` (lists, scalars)."""
    return isinstance(value, np.ndarray) or not (isinstance(value, cupy.ndarray) or hasattr(value, "__dlpack__"))


def check_feed_dtype(name: str, actual, expected: str) -> None:
    """onnxruntime's InvalidArgument, with ORT's text, when feed ``name`` has element type ``actual`` where the
    model wants NumPy dtype ``expected`` (ort_checks.py: what ``run`` raises)."""
    error = dtype_error(name, actual, tensor_type(expected))
    if error is not None:
        raise error


def host_feed(name: str, value, expected: str) -> Optional[np.ndarray]:
    """``value`` as a C-contiguous host array of dtype ``expected`` (ORT's InvalidArgument otherwise), or
    None when it lies on a device (a CuPy array, or anything else with ``__dlpack__``)."""
    if not is_host_feed(value):
        return None
    # a list or tuple becomes the input's type, as ORT's run converts it
    array = np.ascontiguousarray(value, dtype=expected if isinstance(value, (list, tuple)) else None)
    check_feed_dtype(name, array.dtype, expected)
    return array


def is_page_locked(array: np.ndarray) -> bool:
    """Whether ``array``'s memory is page-locked (registered with CUDA): then a DMA can read it in place."""
    if array.nbytes == 0:
        return False
    try:
        return cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data).type == MEMORY_TYPE_HOST
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


class _PinnedOutput:
    """The owner of one output's pinned block: NumPy arrays over it keep it alive (their ``base``), and the
    runner's count of held bytes drops when the last of them is gone."""

    __slots__ = ("memory", "__array_interface__", "__weakref__")

    def __init__(self, memory, shape: tuple, dtype: np.dtype):
        self.memory = memory
        self.__array_interface__ = {"data": (memory.ptr, False), "shape": shape, "typestr": dtype.str, "version": 3}


class PinnedOutputs:
    """Page-locked blocks for outputs handed to callers, shared by every lane of a session (thread-safe): a pool,
    and the count of bytes callers hold, capped at PINNED_OUTPUT_BYTES."""

    def __init__(self):
        self._pool = cupy.cuda.PinnedMemoryPool()
        self._held_bytes = 0
        self._held_lock = threading.Lock()  # callers on many threads; finalizers on whichever drops the last array

    def host_array(self, shape: tuple, dtype) -> np.ndarray:
        """An uninitialised host array: over a pooled pinned block, or an ordinary one when small or over the cap."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < PINNED_OUTPUT_MIN_BYTES:
            return np.empty(shape, dtype)
        size = align_up(nbytes)
        with self._held_lock:
            if self._held_bytes + size > PINNED_OUTPUT_BYTES:
                return np.empty(shape, dtype)
            self._held_bytes += size
        try:
            owner = _PinnedOutput(self._pool.malloc(size), tuple(shape), dtype)
        except BaseException:
            self._release(size)
            raise
        weakref.finalize(owner, self._release, size)
        return np.asarray(owner)

    def _release(self, nbytes: int) -> None:
        with self._held_lock:
            self._held_bytes -= nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of pinned output blocks that arrays handed to callers still hold."""
        return self._held_bytes


class HostTransfers:
    """One lane's copies (one call at a time on it: the staging buffer and its events are the lane's), on
    ``stream`` of device ``device_id``; ``copier`` is the thread pool for the host copies into the pinned buffer
    (shareable); ``outputs`` the pinned output blocks (shared between a session's lanes; its own when None)."""

    def __init__(self, stream: cupy.cuda.Stream, device_id: int, copier=None, outputs: Optional[PinnedOutputs] = None):
        self.stream = stream
        self.device_id = device_id
        self.copier = copier
        self._staging = PinnedStaging(cupy.cuda.alloc_pinned_memory)
        # recorded after the last DMA out of the staging buffer, and after the last direct upload (settle); each
        # event is made once and recorded again (a record is waited for before the next one)
        self._staging_free = cupy.cuda.Event(block=False, disable_timing=True)
        self._staging_used = False
        self._direct_done = cupy.cuda.Event(block=False, disable_timing=True)
        self._direct_pending = False
        self.outputs = outputs if outputs is not None else PinnedOutputs()

    # ------------------------------------------------------------------------------------------------- up
    def upload(self, arrays: Sequence[np.ndarray], destinations: Sequence[int], one_block: bool = False) -> None:
        """Queue copies of the C-contiguous host ``arrays`` to the device addresses ``destinations`` (``one_block``:
        all of them in one device allocation, so small calls may go up in one copy: staging.stage_uploads)."""
        staged, direct = [], False
        try:
            for array, address in zip(arrays, destinations):
                if array.nbytes == 0:
                    continue
                if is_page_locked(array):
                    self._dma(array.ctypes.data, array.nbytes, address)
                    direct = True
                else:
                    staged.append((array, address))
            if staged:
                self._upload_staged(staged, one_block)
        finally:  # a failed call's queued DMAs still read the caller's memory: settle waits for them too
            if direct:
                self._direct_done.record(self.stream)
                self._direct_pending = True

    def settle(self) -> None:
        """Wait until the direct uploads of page-locked feeds have read them (a caller may write them next)."""
        if self._direct_pending:
            self._direct_done.synchronize()
            self._direct_pending = False

    def _upload_staged(self, staged: list, one_block: bool) -> None:
        segments, total = pack_layout([(str(i), a.dtype, a.shape) for i, (a, _) in enumerate(staged)])
        if self._staging_used:
            self._staging_free.synchronize()  # the previous call's DMA may still read the buffer
        self._staging.ensure(total)
        self._staging_used = True  # from here a DMA may read the buffer (even if a later one fails)
        try:
            stage_uploads(self._staging, list(segments.values()), [array for array, _ in staged],
                          [address for _, address in staged], self._dma, self.copier, one_block)  # fmt: skip
        finally:  # after the DMAs queued so far, a failed call's too: the next call waits for them before writing
            self._staging_free.record(self.stream)

    def _dma(self, src: int, nbytes: int, dst: int) -> None:  # staging.stage_uploads's upload(src, nbytes, dst)
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, MEMCPY_HOST_TO_DEVICE, self.stream.ptr)

    def to_device(self, feeds: Dict[str, np.ndarray]) -> Dict[str, cupy.ndarray]:
        """CuPy arrays holding the host ``feeds`` (C-contiguous), in one device allocation laid out like the
        staging buffer, so that small calls go up in one DMA. The copies are queued on the stream."""
        names = [name for name in feeds if feeds[name].nbytes]
        placed = device_block([(name, feeds[name].dtype, feeds[name].shape) for name in names]) if names else {}
        arrays = {name: placed[name] if name in placed else cupy.empty(array.shape, array.dtype)
                  for name, array in feeds.items()}  # fmt: skip
        self.upload([feeds[name] for name in names], [arrays[name].data.ptr for name in names], one_block=True)
        return arrays

    # ----------------------------------------------------------------------------------------------- down
    def download(self, arrays: Sequence[cupy.ndarray]) -> List[np.ndarray]:
        """NumPy copies of the device ``arrays`` (queued on the stream, then one synchronize, which also frees the
        staging buffer and the caller's page-locked feeds)."""
        results = []
        for array in arrays:
            array = cupy.ascontiguousarray(array)
            host = self.outputs.host_array(array.shape, array.dtype)
            if array.nbytes:
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data, array.data.ptr, array.nbytes, MEMCPY_DEVICE_TO_HOST,
                                              self.stream.ptr)  # fmt: skip
            results.append(host)
        self.stream.synchronize()
        # every DMA this lane queued before is done too: the next call need not wait for the staging buffer, nor
        # settle for direct uploads
        self._staging_used = self._direct_pending = False
        return results

    @property
    def held_output_bytes(self) -> int:
        """Bytes of pinned output blocks that arrays handed to callers still hold (all lanes sharing ``outputs``)."""
        return self.outputs.held_bytes
