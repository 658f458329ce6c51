"""A GPU session's threads: each call's lane, and a graph session's CUDA work one call at a time.

Any number of threads may call a session at once, as onnxruntime allows. ``LanePool`` gives each call in flight a
stream and a staging buffer of its own, so no call waits on another's copies. ``GraphThreads`` runs a graph
session's CUDA work one call at a time, on the first calling thread or the session's worker, as ORT's CUDA graphs
ask; without graphs nothing is serialized and every call runs on its own thread.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from mha_ep.gpu_session.capture_mode import ignore_other_captures

COPY_THREADS = 4  # host copies into the staging buffers (transfer.py, staging.stage_uploads), shared by the lanes


@dataclass
class Lane:
    """A call's own stream and pinned staging buffer, taken from the session's pool for the call."""

    stream: object
    transfers: object  # transfer.HostTransfers on ``stream``


class LanePool:
    """A session's lanes. A call takes a lane (a stream and a pinned staging buffer of its own:
    transfer.HostTransfers) from the pool and gives it back after; the pool grows to the number of calls in flight.
    The pinned output blocks are one pool for all lanes (``pinned_outputs``: transfer.PinnedOutputs). A graph
    session's lanes all use ORT's stream, ``ort_stream`` (ONE_STREAM_REPLAY in slots.py); an eager session's lane
    gets a stream of its own."""

    def __init__(self, device_id: int, ort_stream=None):
        from mha_ep.gpu_session.transfer import PinnedOutputs

        self.device_id = device_id
        self.ort_stream = ort_stream
        self.pinned_outputs = PinnedOutputs()
        self._copier = ThreadPoolExecutor(COPY_THREADS, "mha_ep_copy")
        self._idle: "queue.SimpleQueue[Lane]" = queue.SimpleQueue()
        self.made = 0
        self._lock = threading.Lock()

    def take(self) -> Lane:
        """An idle lane, or a new one when every lane is out."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        import cupy

        from mha_ep.gpu_session.transfer import HostTransfers

        if self.ort_stream is not None:  # ONE_STREAM_REPLAY: a graph session's copies queue on ORT's own stream
            stream = self.ort_stream
        else:
            with cupy.cuda.Device(self.device_id):
                stream = cupy.cuda.Stream(non_blocking=True)
        with self._lock:
            self.made += 1
        return Lane(stream, HostTransfers(stream, self.device_id, self._copier, self.pinned_outputs))

    def give(self, lane: Lane) -> None:
        """Back to the pool once its direct uploads have read the caller's page-locked feeds (the caller may write
        them once the call returns). A lane whose stream failed is dropped, not reused."""
        try:
            lane.transfers.settle()
        except Exception:  # noqa: BLE001 - the call's own error is the one raised; this lane is not reused
            return
        self._idle.put(lane)

    def out(self) -> int:
        """The lanes out right now (none once every call has returned)."""
        return self.made - self._idle.qsize()


class GraphThreads:
    """Where a graph session's CUDA work runs. Its CUDA work (copies, ORT's run, the graph slots) runs one call at a
    time (a lock), on at most two threads: the first thread to call (the owner) runs its own calls, and any other
    thread's calls run on the session's worker thread; the calling threads check and split their calls. ORT's CUDA
    provider may not run one session from several threads at once while it uses CUDA graphs (its documentation says
    so), and it keeps its graphs per thread (the provider's PerThreadContext: each of the two threads warms up and
    captures a signature once, over the slot's same fixed buffers). A hop to the worker costs a thread switch each
    way (docs/bench/HISTORY.md section 8, "a graph session's first caller runs its own calls"; "C - C'" of
    scripts/profile_session_graph.py), which a loop on one thread (a decoder's, a benchmark's) does not pay. Without
    graphs nothing is serialized and every call runs on its own thread."""

    def __init__(self, device_id: int, graphs: bool):
        self.device_id = device_id
        self._lock = threading.Lock()  # one call's CUDA work at a time
        self._owner: Optional[int] = None
        self._owner_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, "mha_ep_graphs") if graphs else None

    def run(self, work: Callable):
        """``work()`` (called under the session's device): here without graphs; with graphs one call at a time,
        here on the owner thread (the first to call), else on the session's worker thread, its result or its
        exception handed back."""
        if self._worker is None:
            return work()
        me = threading.get_ident()
        if self._owner is None:
            with self._owner_lock:
                if self._owner is None:
                    self._owner = me
        if me == self._owner:
            with self._lock:
                return work()
        return self._worker.submit(self._on_worker, work).result()

    def _on_worker(self, work: Callable):
        import cupy

        ignore_other_captures()  # the owner, or another session's worker, may be capturing
        with cupy.cuda.Device(self.device_id), self._lock:
            return work()
