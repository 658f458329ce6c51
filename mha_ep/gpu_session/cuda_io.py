"""The GPU side of a ``mha_ep.InferenceSession`` on the CUDA provider: one ORT session, tensors on the device.

The session is a plain ORT CUDA session over the native form of the model (claimed nodes run as mha_ep's native
CUDA op, on ORT's buffers and stream). ``CudaSessionIO`` is how its calls move tensors:

  * ``run`` with NumPy feeds: over OWN_RUN_MAX_BYTES (small_calls.py), the feeds go up through the call's lane's
    page-locked staging buffer (transfer.py), are bound to the session with IOBinding, and the outputs come down
    into pooled page-locked blocks; ORT's own ``run`` would copy every feed from pageable memory and every output
    into fresh pageable arrays. Smaller calls are ORT's own ``run``.
  * ``run_device``: CuPy arrays (or anything with ``__dlpack__``) are bound where they lie, after the caller's
    stream has finished writing them; the outputs are CuPy arrays over ORT's own output buffers (no copy).
  * Graphs: where the caller turned on ORT's ``enable_cuda_graph`` and ORT accepted it, each call signature gets
    a graph slot of its own, with inputs and outputs at fixed device addresses, replayed on ORT's own stream with
    no host wait (slots.py). An eager run (ort_calls.py) synchronizes ORT's stream at its end.

Its parts, one job each (this class composes them): ort_calls.OrtCalls (ORT's run through IOBinding, the eager
run), checks.CallChecks (call keys and their verdicts), small_calls.SmallCalls (ORT's own run for small host
calls), lanes.LanePool and lanes.GraphThreads (the threads), slots.GraphSlots (graph slots and replays),
recovery.Recovery (a failed run, a broken capture).

Threads: any number may call at once, as onnxruntime allows. The rules that make it so, each named where it is
kept (grep the name):
  * LanePool (lanes.py): a call takes a lane, a stream and a pinned staging buffer of its own, from the session's
    pool and gives it back after; the pinned output blocks are one pool for all lanes.
  * GraphSlot (slots.py): with graphs on, a signature's slot serves one call at a time.
  * GraphThreads (lanes.py): a graph session's CUDA work runs one call at a time, on the first calling thread
    (the owner) or on the session's worker thread; without graphs nothing is serialized.
  * CallChecks (checks.py): a call is checked against the model once per call key; the verdict, a refusal
    included, is remembered, so a repeated call pays a dictionary lookup.
  * OWN_RUN_MAX_BYTES (small_calls.py): a small host call goes through ORT's own ``run`` (not with graphs on).
  * ignore_other_captures (capture_mode.py): every thread that calls, and the worker, ignores other threads'
    CUDA graph captures; a call whose run still fails that way is answered by an eager run (capture_broke,
    recovery.py; ``capture_retries``).
  * ONE_STREAM_REPLAY (slots.py): a graph session's ORT runs on a stream the session knows (``ort_stream``), and
    a replay's copies in, ORT's replay and its copies out queue on that one stream with no host wait between.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Mapping, Optional

from mha_ep.gpu_session.capture_mode import ignore_other_captures
from mha_ep.gpu_session.checks import CallChecks
from mha_ep.gpu_session.lanes import GraphThreads, Lane, LanePool
from mha_ep.gpu_session.ort_calls import OrtCalls, numpy_dtype, ortvalue_array, unsupported_tensors
from mha_ep.gpu_session.recovery import Recovery
from mha_ep.gpu_session.slots import GraphSlots
from mha_ep.gpu_session.small_calls import SmallCalls

# the names other modules have imported from here, kept importable (each lives in the module named above)
__all__ = ["CudaSessionIO", "numpy_dtype", "ortvalue_array", "unsupported_tensors"]


class CudaSessionIO:
    """How one ORT CUDA session's calls move tensors (module docstring). ``run(binding, options)`` is the
    session's guarded ``run_with_iobinding``; ``options()`` makes a fresh RunOptions (a call may bring its own
    ``make_options``: the caller's run options). ``ort_stream``: the CuPy stream ORT computes on, for a graph
    session (ONE_STREAM_REPLAY, slots.py)."""

    def __init__(self, session, device_id: int, graphs: bool, run: Callable, options: Callable, ort_stream=None):
        import cupy

        if graphs and ort_stream is None:
            raise ValueError("CudaSessionIO: a session under ORT's CUDA graphs needs ort_stream, the CuPy stream ORT "
                             "computes on (its user_compute_stream: session.with_session_stream)")  # fmt: skip

        self.session = session
        self.device_id = device_id
        self.graphs = graphs
        self.ort_stream = ort_stream if graphs else None  # ONE_STREAM_REPLAY
        self.ort = OrtCalls(session, device_id, run, options, self.ort_stream)
        self.lanes = LanePool(device_id, self.ort_stream)
        self.threads = GraphThreads(device_id, graphs)
        self.checks = CallChecks(list(session.get_inputs()), self.ort.outputs, cupy.ndarray)
        self.small_calls = SmallCalls(self.ort, self.checks)
        self.recovery = Recovery(self.ort, graphs, self.threads)
        self.graph_slots = GraphSlots(self.ort, device_id, graphs, self.ort_stream)

    # ------------------------------------------------------------------------------------------ calls
    def run_host(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """NumPy (or device) feeds in, NumPy outputs out: small host calls through ORT's own ``run``
        (OWN_RUN_MAX_BYTES, small_calls.py), others through page-locked memory."""
        ignore_other_captures()
        key, known = self.checks.known(feeds, output_names)
        wanted = known[0] if known is not None else self.checks.wanted(key, feeds, output_names)
        # a remembered key's verdict says whether its calls are small (its feeds' kinds and sizes are the key's)
        if not self.graphs and (known[2] if known is not None else self.small_calls.fits(feeds)):
            return self.small_calls.run(key, known, wanted, output_names, feeds, make_options)
        import cupy

        try:
            with cupy.cuda.Device(self.device_id):
                host, device = self.checks.split(feeds, checked=known is not None)
                signature = known[1] if known is not None else self.checks.remember(key, wanted, host, device)
                if device:
                    self._settle_caller()

                def work():
                    lane = self.lanes.take()
                    try:
                        arrays = self._call(lane, signature, host, device, wanted, make_options)
                        return lane.transfers.download(arrays)
                    finally:
                        self.lanes.give(lane)

                return self.threads.run(work)
        except (RuntimeError, MemoryError) as error:  # MemoryError: CuPy's OutOfMemoryError (Recovery)
            return self.recovery.rerun_or_raise(error, feeds, wanted, make_options)

    def run_device(self, output_names, feeds: Mapping, make_options: Optional[Callable] = None) -> list:
        """Device (or NumPy) feeds in, CuPy outputs out."""
        import cupy

        ignore_other_captures()
        key, known = self.checks.known(feeds, output_names)
        if known is not None and known[3] is not None:  # a known call that replays its slot with CuPy feeds
            answer = self._replay_known(known, feeds, make_options)
            if answer is not None:
                return answer
        wanted = known[0] if known is not None else self.checks.wanted(key, feeds, output_names)
        try:
            with cupy.cuda.Device(self.device_id):
                host, device = self.checks.split(feeds, checked=known is not None)
                signature = known[1] if known is not None else self.checks.remember(key, wanted, host, device)
                caller = cupy.cuda.get_current_stream()  # the caller's own: the work below may run on another thread

                def work():
                    slot = self.graph_slots.slots.get(signature) if self.graphs and not host else None
                    if slot is not None:
                        if known is not None and slot.copies_in is not None:  # its next calls: _replay_known
                            known[3] = slot
                        return self.graph_slots.replay_device(slot, device, wanted, make_options, caller)
                    return self._run_device_on_lane(signature, host, device, wanted, make_options, caller)

                return self.threads.run(work)
        except (RuntimeError, MemoryError) as error:
            return [cupy.asarray(a) for a in self.recovery.rerun_or_raise(error, feeds, wanted, make_options)]

    def _replay_known(self, known: list, feeds: Mapping, make_options: Optional[Callable]) -> Optional[list]:
        """run_device's replay of a call whose key is known (CallChecks) and replays its slot with CuPy feeds: the
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
                return self.threads.run(
                    functools.partial(self.graph_slots.replay_arrays, slot, arrays, wanted, make_options, caller))
        except (RuntimeError, MemoryError) as error:
            return [cupy.asarray(a) for a in self.recovery.rerun_or_raise(error, feeds, wanted, make_options)]

    def _run_device_on_lane(self, signature: tuple, host: dict, device: dict, wanted: List[str],
                            make_options: Optional[Callable], caller) -> list:  # fmt: skip
        """run_device's eager calls, a signature's first calls, and replays with host feeds: on a lane."""
        lane = self.lanes.take()
        try:
            caller.synchronize()  # the caller's stream has written its device feeds (ORT's does not wait for it)
            slot = self.graph_slots.slots.get(signature) if self.graphs else None
            arrays = self._call(lane, signature, host, device, wanted, make_options)
            if slot is None:  # an eager run's outputs: ORT's own, and ready (ORT synchronized its stream after it)
                return arrays
            # the replay's (ONE_STREAM_REPLAY: queued on ORT's stream, the lane's)
            return self.graph_slots.copy_out(slot, wanted, caller)
        finally:
            self.lanes.give(lane)

    def _call(self, lane: Lane, signature: tuple, host: dict, device: dict, wanted: List[str],
              make_options: Optional[Callable]) -> list:  # fmt: skip
        """Run the session on the feeds: CuPy arrays of the ``wanted`` outputs (with graphs on, under the graph
        lock; a replay's lie in its slot's buffers, valid until the lock is released). ``make_options``: the
        caller's run options' maker, None when the call brought none."""
        graph_slots = self.graph_slots
        slot = graph_slots.slots.get(signature) if self.graphs else None
        if slot is not None:
            return graph_slots.replay(lane, slot, host, device, wanted, make_options)
        values = self.ort.eager_values(lane, host, device, make_options)
        if self.graphs and signature not in graph_slots.slots:  # the signature's first call: it tells the shapes
            graph_slots.first_slot(signature, host, device, values)
        return [ortvalue_array(values[name]) for name in wanted]

    @staticmethod
    def _settle_caller() -> None:
        """The caller's stream has finished writing its device feeds (ORT's stream does not wait for it)."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()

    # ------------------------------------------------------------------------------------------ state
    @property
    def slots(self) -> dict:
        """Signature -> its GraphSlot (None: it runs eagerly)."""
        return self.graph_slots.slots

    def held_graphs(self) -> int:
        """Signatures with fixed buffers for a graph."""
        return self.graph_slots.count

    @property
    def slot_allocation_failures(self) -> int:
        """First calls whose slot's fixed buffers could not be allocated (their signatures run eagerly)."""
        return self.graph_slots.allocation_failures

    @property
    def capture_retries(self) -> int:
        """Calls answered by an eager run after a graph capture broke (recovery.py)."""
        return self.recovery.capture_retries

    @property
    def lanes_made(self) -> int:
        """Lanes the session has made (its pool grows to the number of calls in flight)."""
        return self.lanes.made

    def in_use(self) -> dict:
        """The lanes out right now (none once every call has returned)."""
        return {"lanes_out": self.lanes.out()}

    @property
    def held_output_bytes(self) -> int:
        """Bytes of pinned output blocks that arrays handed to callers still hold."""
        return self.lanes.pinned_outputs.held_bytes
