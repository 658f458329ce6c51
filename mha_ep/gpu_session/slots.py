"""A graph session's slots: one call signature's fixed buffers under ORT's CUDA graph, and its replays.

Where the caller turned on ORT's ``enable_cuda_graph`` and ORT accepted it (every node on the CUDA provider), each
call signature (feed names, shapes, dtypes: checks.CallChecks.signature) gets a ``gpu_graph_id`` of its own with
inputs and outputs at fixed device addresses: the signature's first call runs eagerly (``gpu_graph_id`` -1) to
learn the output shapes (``first_slot``), the next ones are ORT's capture and replays. A call copies its feeds
into the signature's buffers and its outputs out of them, on ORT's own stream around its replay with no host wait
between (ONE_STREAM_REPLAY below); with device feeds (``run_device``) ORT's stream waits for the caller's before
the copies in, and the caller's for ORT's after the copies out, so the outputs are ready in the caller's stream's
order. ORT cannot drop a graph it captured, so at most ``MAX_GRAPHS`` signatures get one; later ones run eagerly,
as does one whose fixed buffers cannot be allocated (``allocation_failures``; its call keeps the eager answer).

Rule ONE_STREAM_REPLAY: a graph session's ORT runs on a stream the session knows (``ort_stream``: the caller's
``user_compute_stream``, else one that session.with_session_stream made), and its lanes use that stream too
(lanes.LanePool): a replay's copies in, ORT's replay and its copies out queue on one stream, with no host wait
between them (each way one launch of gpu_session/segments.py's copy kernel where it builds, else one memcpy per
buffer). A replay runs with ``disable_synchronize_execution_providers``: ``run`` waits once, for its download, and
``run_device`` not at all (the caller's stream waits, on an event, for the copies out; a caller on ORT's stream
itself, its ``user_compute_stream``, needs no event). The order of those calls is held on any machine by
tests/gpu_session/test_replay_protocol.py.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from mha_ep.gpu_session import checks
from mha_ep.gpu_session.ort_calls import DirectRun, numpy_dtype, ortvalue_array
from mha_ep.gpu_session.recovery import allocation_failed

log = logging.getLogger("mha_ep")

MAX_GRAPHS = 16  # signatures with a captured graph per session (ORT keeps each graph until the session goes)


@dataclass
class GraphSlot:
    """One call signature's fixed buffers under ORT's CUDA graph (``graph_id`` its ``gpu_graph_id``). A slot serves
    one call at a time: a graph session's CUDA work runs one call at a time (lanes.GraphThreads)."""

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
    direct: object = None  # DirectRun of direct_run with ``options``
    copies_in: object = None  # segments.SegmentCopies of every feed into ``addresses`` (None: memcpy calls)
    copied_names: List[str] = field(default_factory=list)  # the feeds copies_in copies (order, bytes > 0)
    copies_out: Dict[tuple, tuple] = field(default_factory=dict)  # wanted outputs -> _copies_out's answer


class GraphSlots:
    """A graph session's slots by call signature (``slots``: None for a signature that runs eagerly), and their
    replays (module docstring). ``ort``: ort_calls.OrtCalls; ``ort_stream`` the stream ORT runs on (None: an eager
    session, which has no slots)."""

    def __init__(self, ort, device_id: int, graphs: bool, ort_stream=None):
        import cupy

        self.ort = ort
        self.device_id = device_id
        self.ort_stream = ort_stream if graphs else None  # ONE_STREAM_REPLAY
        self.slots: Dict[tuple, Optional[GraphSlot]] = {}  # signature -> its graph (None: it runs eagerly)
        self.allocation_failures = 0  # first calls whose slot's fixed buffers could not be allocated
        self.count = 0  # slots made (each holds a graph of ORT's)
        self._copy_kernel = None  # segments.copy_function on our device, once a slot wants it (False: unavailable)
        self._fed = self._copied = None
        if graphs:  # an event is its device's (recording it on another device's stream fails): made under ours
            with cupy.cuda.Device(device_id):
                self._fed = cupy.cuda.Event(block=False, disable_timing=True)  # the caller has written the feeds
                self._copied = cupy.cuda.Event(block=False, disable_timing=True)  # the copies out are queued

    # ------------------------------------------------------------------------------------ making slots
    def first_slot(self, signature: tuple, host: dict, device: dict, values: Dict[str, object]) -> None:
        """The signature's slot, shaped as its first (eager) call's feeds and outputs. None (the signature runs
        eagerly: run_eagerly) past MAX_GRAPHS, or when its fixed buffers cannot be allocated: the call keeps its
        eager answer, the first such failure is logged, and ``allocation_failures`` counts them."""
        import cupy
        import onnxruntime as ort

        from mha_ep.gpu_session.transfer import device_block

        if self.count >= MAX_GRAPHS:
            self.run_eagerly(signature)
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
            # again once the eager signatures are forgotten (run_eagerly)
            self.run_eagerly(signature)
            if not self.allocation_failures:
                log.warning("mha_ep: a graph session on CUDA device %d runs call signature %s eagerly: its fixed "
                            "buffers could not be allocated (%s)", self.device_id, signature,
                            str(error).splitlines()[0][:300])  # fmt: skip
            self.allocation_failures += 1
            return
        self.count += 1  # ids from 1 (0 is ORT's own)
        binding = self.ort.session.io_binding()
        for name, array in inputs.items():
            binding.bind_input(name, "cuda", self.device_id, array.dtype.type, list(array.shape), array.data.ptr)
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        slot = GraphSlot(self.count, inputs, outputs, binding, order=order,
                         addresses={name: array.data.ptr for name, array in inputs.items()})  # fmt: skip
        slot.views = {name: ortvalue_array(value) for name, value in outputs.items()}
        kernel = self._copy_function()
        if kernel is not None:
            from mha_ep.gpu_session.segments import SegmentCopies

            slot.copied_names = [name for name in order if inputs[name].nbytes]
            if slot.copied_names:
                slot.copies_in = SegmentCopies(kernel, [inputs[name].nbytes for name in slot.copied_names],
                                               destinations=[slot.addresses[name] for name in slot.copied_names])
        if self.ort.direct is not None:
            slot.direct_run = functools.partial(self.ort.direct[0].run_with_iobinding, binding._iobinding)
        self.slots[signature] = slot

    def run_eagerly(self, signature: tuple) -> None:
        """Mark ``signature`` as one that runs eagerly (no slot). At most checks.MAX_VERDICTS such marks are kept:
        past that they are all forgotten, and each of those signatures' next call is a first call again (eager,
        then offered a slot: one may be free by then, or the memory for it)."""
        if len(self.slots) - self.count >= checks.MAX_VERDICTS:  # the None entries (every slot counted a graph)
            self.slots = {key: slot for key, slot in self.slots.items() if slot is not None}
        self.slots[signature] = None

    # ------------------------------------------------------------------------------------------ replays
    def run_slot(self, slot: GraphSlot, make_options: Optional[Callable]) -> None:
        """ORT's run of the slot's graph (under the graph lock), queued on ORT's stream with no wait for it
        (ONE_STREAM_REPLAY: whoever reads the outputs waits). A call without run options of its own uses the slot's
        RunOptions, made once (the native route never sets ``terminate`` on them, and the slot serves one call at a
        time)."""
        if make_options is None:
            options = slot.options
            if options is None:
                options = slot.options = self._slot_options(slot, self.ort.options())
                if slot.direct_run is not None:
                    slot.direct = DirectRun(functools.partial(slot.direct_run, options))
        else:
            options = self._slot_options(slot, make_options())
        if slot.direct_run is None:
            self.ort.run(slot.binding, options)
        elif make_options is None:
            self.ort.run(slot.direct, options)
        else:
            self.ort.run(DirectRun(functools.partial(slot.direct_run, options)), options)
        slot.calls += 1

    @staticmethod
    def _slot_options(slot: GraphSlot, options):
        options.add_run_config_entry("gpu_graph_id", str(slot.graph_id))
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    def replay(self, lane, slot: GraphSlot, host: dict, device: dict, wanted: List[str],
               make_options: Optional[Callable]) -> list:  # fmt: skip
        """A replay with host feeds (or some of each): the feeds go into the slot's buffers on ORT's stream (the
        lane's: ONE_STREAM_REPLAY; the caller's device feeds are settled already), ORT's replay queues behind them,
        and the outputs are the slot's views, to be read on that stream (download, or a copy)."""
        names = [name for name in slot.order if name in host and host[name].nbytes]
        lane.transfers.upload([host[name] for name in names], [slot.addresses[name] for name in names],
                              one_block=True)  # fmt: skip
        self._copy_into(slot, device, lane.stream.ptr)
        self.run_slot(slot, make_options)
        return [slot.views[name] for name in wanted]

    def replay_device(self, slot: GraphSlot, device: dict, wanted: List[str], make_options: Optional[Callable],
                      caller) -> list:  # fmt: skip
        """A replay with device feeds and device outputs, with no host wait (ONE_STREAM_REPLAY): ORT's stream waits
        for the caller's (its writes of the feeds), copies the feeds into the slot's buffers, replays, and copies
        the outputs into fresh arrays; the caller's stream waits for those copies. The next replay, on the same
        stream, cannot overwrite the outputs before they are copied. A caller already on ORT's stream (it passed
        its own as ``user_compute_stream``) needs neither event: one stream orders it all."""
        if slot.copies_in is not None:  # every feed is on the device here: one launch copies them all
            arrays = [device[name] for name in slot.copied_names]
            return self.replay_arrays(slot, arrays, wanted, make_options, caller)
        ort_stream = self.ort_stream
        if caller.ptr != ort_stream.ptr:
            self._fed.record(caller)
            ort_stream.wait_event(self._fed)
        self._copy_into(slot, device, ort_stream.ptr)
        self.run_slot(slot, make_options)
        return self.copy_out(slot, wanted, caller)

    def replay_arrays(self, slot: GraphSlot, arrays: list, wanted: List[str], make_options: Optional[Callable],
                      caller) -> list:  # fmt: skip
        """replay_device with the copy kernel: ``arrays`` are the feeds of ``slot.copied_names``, in that order."""
        ort_stream = self.ort_stream
        wait = (self._fed, caller) if caller.ptr != ort_stream.ptr else None
        slot.copies_in.launch(ort_stream, arrays, wait)
        self.run_slot(slot, make_options)
        return self.copy_out(slot, wanted, caller)

    def copy_out(self, slot: GraphSlot, wanted: List[str], caller) -> list:
        """Fresh arrays of the replay's ``wanted`` outputs, copied out of the slot on ORT's stream behind the replay
        (the next replay, on the same stream, cannot overwrite them first); the caller's stream waits for the
        copies (ONE_STREAM_REPLAY), unless it is ORT's stream itself."""
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
