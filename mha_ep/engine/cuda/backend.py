"""The cuda backend: MhaProblem (host float32 arrays) -> MhaResult (host float32 arrays) on one CUDA device.

Pipeline of one call (legend in mha_ep/spec.py), all on the backend's own non-default stream:
  1. stage:   every input (float32 values; mask as int32 lengths or uint8 keep flags) is copied into one pinned
              buffer in 4 MiB chunks, all inputs' chunks side by side on the copy threads, each chunk's async
              upload starting as soon as it is copied (calls under 4 MiB: copies on the calling thread; under
              1 MiB: plain copies and one upload);
  2-5 are pipeline.py's steps (the device-side interface every route shares: ``device_steps``), here on the
  staged float32 inputs and float32 outputs:
  2. layout:  build_dense_BNTH (one launch: movers.py) makes q_BNSH, k_BNTH and v_BNTH (past prepended, the
              biases of BSNH key/value) in the compute dtype, rounding float32 to it on the device; a wanted
              present is written as float32 in the same pass (for float32 calls k_BNTH / v_BNTH *are* the
              present buffers). float16 / bfloat16 Q and K stay unbiased and the movers compute the scores'
              float32 offsets instead (dispatch.score_terms). Fused float32 calls without past or presents
              skip this step: their kernel reads the staged arrays (dispatch.reads_staged_inputs);
  3. scores:  cuBLAS scores_BNST = scale * Q.K^T in float32 (fp32 accumulation);
  4. softmax: masked_softmax_warp (T <= 1024, a warp per row in registers) or masked_softmax (a block per row)
              adds attention_bias and the compact padding mask in float32, applies ORT's causal rule, and writes
              probs_BNST in the compute dtype (no dense mask is materialised);
  5. context: cuBLAS context_BNSH = P.V in float32; context_to_BSD rounds it to the compute dtype into the
              (B, S, Dv) float32 output;
  6. return:  one async download of [output | present_key | present_value] into a pinned buffer, one stream
              synchronize, and (threaded) copies into fresh numpy arrays; or, for a caller that copies them
              at once (the plugin op: the bridge copies every returned array into ORT's output tensor), views
              of a pinned buffer of the calling thread (``run(problem, borrow_outputs=True)``).
Every per-call device buffer is owned by an MhaScratch and released exactly once on every path.
A call shape seen before on the fused path replays steps 2-5 as a captured CUDA graph on buffers kept for that
shape (replay.py: the rules, and why).

Seams: step 1 (``_stage``: host arrays into device buffers); steps 2-5 (``device_steps``: a DeviceCall on device
addresses -> steps, and ``run_steps``: queue them on a stream, launches only), public, for the native
route too; and ``prepared(problem)``, which stages a call and hands back its steps 2-5 as a ``PreparedCall`` to
submit as often as wanted: the hook the benchmarks time (mha_ep/bench).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import cupy
import numpy as np

from mha_ep.errors import MhaEpError
from cupy_backends.cuda.libs import cublas

from mha_ep.engine.cuda import dispatch, fused
from mha_ep.engine.cuda.geometry import LaunchPlan, cached_plan
from mha_ep.engine.cuda.pipeline import POISON_BYTE, DeviceCall, attention_steps, output_shapes
from mha_ep.engine.cuda.replay import REPLAY_MAX_BYTES, ReplayCache, replay_key
from mha_ep.engine.cuda.scratch import MhaScratch
from mha_ep.engine.cuda.staging import (
    SINGLE_UPLOAD_BYTES, PinnedStaging, Segment, pack_layout, parallel_copy, stage_uploads,
)
from mha_ep.engine.cuda.runner import run_steps
from mha_ep.engine.cuda.steps import Gemm
from mha_ep.engine.problem import MhaProblem, MhaResult

MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2
log = logging.getLogger("mha_ep")
COPY_THREADS = min(8, os.cpu_count() or 1)  # host copies into / out of the pinned buffers
REPLAY_VERDICTS = 1024  # replay keys whose eligibility is remembered (forgotten all at once beyond)
CUDA_ERRORS = (
    cupy.cuda.runtime.CUDARuntimeError,
    cupy.cuda.driver.CUDADriverError,
    cupy.cuda.memory.OutOfMemoryError,
    cupy.cuda.compiler.CompileException,
    cublas.CUBLASError,
)


class CupyScratchRuntime:
    """ScratchRuntime over CuPy's device memory pool and one stream (the device must be current)."""

    def __init__(self, stream: cupy.cuda.Stream):
        self.stream = stream

    def allocate(self, nbytes: int) -> cupy.cuda.MemoryPointer:
        return cupy.cuda.alloc(nbytes)

    def free(self, allocation: cupy.cuda.MemoryPointer) -> None:
        memory = allocation.mem
        if hasattr(memory, "free"):  # PooledMemory: hand the chunk back to the pool now
            memory.free()

    def address(self, allocation: cupy.cuda.MemoryPointer) -> int:
        return allocation.ptr

    def upload(self, src_address: int, nbytes: int, dst_address: int) -> None:
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(dst_address, src_address, nbytes, MEMCPY_HOST_TO_DEVICE, self.stream.ptr)

    def download(self, src_address: int, nbytes: int, dst_address: int) -> None:
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(dst_address, src_address, nbytes, MEMCPY_DEVICE_TO_HOST, self.stream.ptr)

    def synchronize(self) -> None:
        self.stream.synchronize()


def input_entries(problem: MhaProblem) -> list[tuple[str, np.dtype, tuple, np.ndarray]]:
    """(name, staged dtype, shape, array) for every input the call supplies, in upload order."""
    f32 = np.float32
    candidates = [
        ("query", problem.query_BSD),
        ("key", problem.key),
        ("value", problem.value),
        ("bias_q", problem.bias_q),
        ("bias_k", problem.bias_k),
        ("bias_v", problem.bias_v),
        ("attention_bias", problem.attention_bias),
        ("past_key", problem.past_key_BNPH),
        ("past_value", problem.past_value_BNPH),
    ]
    entries = [(name, np.dtype(f32), tuple(a.shape), a) for name, a in candidates if a is not None]
    for name, array in (("past_sequence_length", problem.past_sequence_length),
                        ("cache_indirection", problem.cache_indirection_BWM)):  # a shared buffer's (int32)
        if array is not None:
            entries.append((name, np.dtype(np.int32), tuple(array.shape), array))
    mask = problem.padding_mask
    if mask is not None:
        staged = np.int32 if mask.kind == "key_lengths" else np.uint8
        entries.append(("mask", np.dtype(staged), tuple(mask.data.shape), mask.data))
    return entries


def output_entries(problem: MhaProblem) -> list[tuple[str, np.dtype, tuple]]:
    f32 = np.dtype(np.float32)
    return [(name, f32, shape) for name, shape in output_shapes(problem).items()]


@dataclass(frozen=True)
class DeviceBuffers:
    """A call's inputs, where they and its outputs sit in the packed layout, and the device buffers (bases)."""

    inputs: list  # input_entries(problem)
    in_segments: dict
    in_bytes: int
    in_base: int
    out_segments: dict
    out_bytes: int
    out_base: int

    @property
    def dev_in(self) -> dict:
        return {name: self.in_base + seg.offset for name, seg in self.in_segments.items()}

    @property
    def dev_out(self) -> dict:
        return {name: self.out_base + seg.offset for name, seg in self.out_segments.items()}


@dataclass(frozen=True)
class PreparedCall:
    """A staged call's device work (steps 2-5), ready to submit: ``submit()`` queues it on ``stream`` (launches
    only: no allocation, no synchronization). ``capturable``: the fused path, whose launches a CUDA graph can
    capture (the three-phase path calls cuBLAS, which CuPy refuses during capture)."""

    submit: Callable[[], None]
    stream: object  # cupy.cuda.Stream
    capturable: bool


@dataclass
class ReplayEntry:
    """One replayed call shape: its device buffers (owned by ``scratch`` until the entry is released), where the
    inputs and outputs sit in them, and the captured graph of steps 2-5. (DeviceBuffers' layout fields without its
    ``inputs``: an entry outlives the call that captured it and must not keep that call's host arrays alive.)"""

    scratch: MhaScratch
    stream: cupy.cuda.Stream  # the backend's stream, which may still be using the buffers
    graph: object  # cupy.cuda.Graph
    in_segments: dict
    in_bytes: int
    in_base: int
    out_segments: dict
    out_bytes: int
    out_base: int


def release_replay_entry(entry: ReplayEntry) -> None:
    """ReplayCache's release: wait until the stream no longer uses the entry's buffers, then free them. (A plain
    function: a bound method would make backend -> cache -> backend a cycle, which holds device memory until the
    cyclic garbage collector runs.)"""
    try:
        entry.stream.synchronize()
    finally:
        entry.scratch.release()


class CudaBackend:
    """CuPy backend. All work of an instance runs on ``cuda:<device_id>`` and on the instance's own stream.

    ``poison_device_buffers``: fill every device buffer with NaN before the kernels run (tests: an element a
    kernel forgets to write shows up as NaN instead of stale pool memory).
    """

    name = "cuda"

    def __init__(self, device_id: int = 0, poison_device_buffers: bool = False, fused_path: bool = True,
                 replay: bool = True):  # fmt: skip
        """``fused_path=False`` keeps every call on the three-phase path (tests run the parity suites on both;
        the environment variable MHA_EP_THREE_PHASE=1 does the same for backends that mha_ep creates).
        ``replay=False`` runs every call the ordinary way (no per-shape buffers kept, no graph; poisoned device
        buffers imply it)."""
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device_id < count:
            raise MhaEpError(f"cuda backend: device_id {device_id} is out of range: {count} CUDA GPU(s) visible")
        self.device_id = device_id
        self.poison_device_buffers = poison_device_buffers
        self.fused_path = fused_path and os.environ.get("MHA_EP_THREE_PHASE") != "1"
        with cupy.cuda.Device(device_id):
            props = cupy.cuda.runtime.getDeviceProperties(device_id)
            self.device = f"cuda:{device_id} {props['name'].decode()}"
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._runtime = CupyScratchRuntime(self._stream)
        self._pinned_in = PinnedStaging(cupy.cuda.alloc_pinned_memory)
        self._pinned_out = PinnedStaging(cupy.cuda.alloc_pinned_memory)
        self._borrowed_out = threading.local()  # per thread: the pinned buffer borrowed outputs are views of
        self._lock = threading.Lock()  # the pinned buffers and the stream serve one call at a time
        self._copier = concurrent.futures.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="mha_ep_copy")
        self.replays = ReplayCache(release_replay_entry) if replay and not poison_device_buffers else None
        # replay key -> whether replay.py's rule SMALL_FUSED_CALLS allows it (bounded: REPLAY_VERDICTS)
        self._replay_eligible: dict = {}

    # ------------------------------------------------------------------------------------------------- the call
    def run(self, problem: MhaProblem, borrow_outputs: bool = False) -> MhaResult:
        """Raises MhaInputError for sizes the kernels cannot take, MhaEpError for CUDA failures (out of memory,
        compile, launch, cuBLAS); every device allocation of the call is released either way.

        ``borrow_outputs``: the result's arrays are views of a pinned buffer of the calling thread, valid until
        the same thread's next borrowing call of this backend (no copy into fresh arrays: for a caller that
        copies them at once, as the plugin op's bridge does). Other threads never write that buffer."""
        plan = None if problem.shared is not None else cached_plan(problem.geometry, problem.dtype)
        with self._on_device():
            return self._run(problem, plan, self._output_staging(borrow_outputs), borrow_outputs)

    def _output_staging(self, borrow: bool) -> PinnedStaging:
        if not borrow:
            return self._pinned_out
        staging = getattr(self._borrowed_out, "staging", None)
        if staging is None:
            staging = self._borrowed_out.staging = PinnedStaging(cupy.cuda.alloc_pinned_memory)
        return staging

    @contextlib.contextmanager
    def _on_device(self):
        """One call's hold of the backend (its lock, device and stream), with CUDA failures (out of memory,
        compile, launch, cuBLAS) raised as MhaEpError naming the device."""
        try:
            with self._lock, cupy.cuda.Device(self.device_id), self._stream:
                yield
        except MhaEpError:
            raise
        except CUDA_ERRORS as error:
            raise MhaEpError(f"cuda backend on {self.device}: {type(error).__name__}: {error}") from error

    def _run(self, problem: MhaProblem, plan: Optional[LaunchPlan], out: PinnedStaging, borrow: bool) -> MhaResult:
        key = self._replay_key(problem, plan)
        if key is not None:
            entry = self.replays.lookup(key)
            if entry is None and self.replays.should_capture(key):
                entry = self._capture(problem, plan, key)
            if entry is not None:
                try:
                    return self._run_replay(problem, entry, out, borrow)
                except BaseException:
                    self.replays.discard(key)  # its buffers may be in any state now
                    raise
        with MhaScratch(self._runtime) as scratch:
            dev_in, dev_out, out_segments, out_base, out_bytes = self._stage(problem, scratch, out)
            # Steps 2-5 on the device.
            steps = self._staged_steps(problem, scratch, dev_in, dev_out)
            scratch.mark_stream_use()  # from here on, any failure must wait for the stream before freeing
            run_steps(self.device_id, steps, self._stream)
            # Step 6: one download, one synchronize.
            self._runtime.download(out_base, out_bytes, out.address)
            scratch.finish_stream_use()
        return self._result(out_segments, out, borrow)

    def _device_buffers(self, problem: MhaProblem, scratch: MhaScratch) -> DeviceBuffers:
        """The call's packed input and output layouts and their device buffers, owned by ``scratch``."""
        inputs = input_entries(problem)
        in_segments, in_bytes = pack_layout([(n, d, s) for n, d, s, _ in inputs])
        out_segments, out_bytes = pack_layout(output_entries(problem))
        in_base = self._allocate_bytes(scratch, "the staged inputs", in_bytes)
        out_base = self._allocate_bytes(scratch, "the outputs", out_bytes)
        return DeviceBuffers(inputs, in_segments, in_bytes, in_base, out_segments, out_bytes, out_base)

    def _stage(self, problem: MhaProblem, scratch: MhaScratch, out: PinnedStaging):
        """Step 1: device input and output buffers, and the inputs uploaded into the former."""
        buffers = self._device_buffers(problem, scratch)
        self._pinned_in.ensure(buffers.in_bytes)
        out.ensure(buffers.out_bytes)
        self._poison(scratch, buffers.out_base, buffers.out_bytes)
        self._upload_inputs(buffers.inputs, buffers.in_segments, buffers.in_bytes, buffers.in_base, scratch.upload)
        return buffers.dev_in, buffers.dev_out, buffers.out_segments, buffers.out_base, buffers.out_bytes

    def _upload_inputs(self, inputs, in_segments: dict, in_bytes: int, in_base: int, upload) -> None:
        """The inputs into the pinned buffer and up to ``in_base`` (``upload(src, nbytes, dst)`` queues one copy),
        laid out on the device as in the pinned buffer (staging.stage_uploads: one copy, or chunks on threads)."""
        segments = [in_segments[name] for name, _, _, _ in inputs]
        stage_uploads(self._pinned_in, segments, [array for _, _, _, array in inputs],
                      [in_base + segment.offset for segment in segments], upload, self._copier,
                      one_block=True)  # fmt: skip

    # ------------------------------------------------------------------------------------------ replayed calls
    def _replay_key(self, problem: MhaProblem, plan: Optional[LaunchPlan]):
        """replay.py's key when the call may be replayed (its rules SMALL_FUSED_CALLS and ``replay_key``), else
        None; the rules' verdict is remembered per key."""
        if self.replays is None or not self.fused_path or plan is None:  # no plan: a shared buffer (never replayed)
            return None
        inputs = input_entries(problem)
        key = replay_key(problem, inputs)
        if key is None:
            return None
        eligible = self._replay_eligible.get(key)
        if eligible is None:
            device_bytes = sum(a.nbytes for _, _, _, a in inputs) + sum(
                int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in output_entries(problem)
            ) + sum(plan.nbytes[name] for name in ("q_BNSH", "k_BNTH", "v_BNTH"))  # fmt: skip
            eligible = dispatch.fused_unsupported_reason(problem) is None and device_bytes <= REPLAY_MAX_BYTES
            if len(self._replay_eligible) >= REPLAY_VERDICTS:
                self._replay_eligible.clear()
            self._replay_eligible[key] = eligible
        return key if eligible else None

    def _capture(self, problem: MhaProblem, plan: LaunchPlan, key) -> Optional[ReplayEntry]:
        """Buffers for this shape and the graph of its steps 2-5 (kernels compiled by the call seen before);
        None, and the shape runs the ordinary way from now on, when the capture fails."""
        scratch = MhaScratch(self._runtime)
        try:
            buffers = self._device_buffers(problem, scratch)
            steps = self._staged_steps(problem, scratch, buffers.dev_in, buffers.dev_out)
            self._stream.begin_capture()
            try:
                run_steps(self.device_id, steps, self._stream)
            finally:
                graph = self._stream.end_capture()
        except (MhaEpError, *CUDA_ERRORS) as error:
            scratch.release()
            self.replays.refuse(key)
            log.debug("mha_ep: no replay for this call shape, its capture failed: %s", error)
            return None
        except BaseException:
            scratch.release()
            raise
        entry = ReplayEntry(scratch, self._stream, graph, buffers.in_segments, buffers.in_bytes, buffers.in_base,
                            buffers.out_segments, buffers.out_bytes, buffers.out_base)  # fmt: skip
        self.replays.add(key, entry)
        return entry

    def _run_replay(self, problem: MhaProblem, entry: ReplayEntry, out: PinnedStaging, borrow: bool) -> MhaResult:
        """Steps 1 and 6 as in _run; steps 2-5 are one graph launch on the entry's buffers."""
        self._pinned_in.ensure(entry.in_bytes)
        out.ensure(entry.out_bytes)
        self._upload_inputs(input_entries(problem), entry.in_segments, entry.in_bytes, entry.in_base,
                            self._runtime.upload)  # fmt: skip
        entry.graph.launch(self._stream)
        self._runtime.download(entry.out_base, entry.out_bytes, out.address)
        self._runtime.synchronize()
        return self._result(entry.out_segments, out, borrow)

    @contextlib.contextmanager
    def prepared(self, problem: MhaProblem) -> Iterator[PreparedCall]:
        """``with backend.prepared(problem) as call:`` the call's inputs staged on the device and its steps 2-5
        as ``call.submit``, on the backend's stream, for as many submissions as the block makes (the benchmarks'
        hook: mha_ep/bench times it). The backend is held for the block; its buffers are released after it, and
        CUDA failures inside it are raised as MhaEpError like run's."""
        with self._on_device(), MhaScratch(self._runtime) as scratch:
            dev_in, dev_out, _, _, _ = self._stage(problem, scratch, self._pinned_out)
            steps = self._staged_steps(problem, scratch, dev_in, dev_out)
            scratch.mark_stream_use()

            def submit() -> None:
                run_steps(self.device_id, steps, self._stream)

            yield PreparedCall(submit, self._stream, capturable=not any(isinstance(s, Gemm) for s in steps))
            scratch.finish_stream_use()

    def _result(self, out_segments: dict[str, Segment], out: PinnedStaging, borrow: bool) -> MhaResult:
        def take(name: str) -> Optional[np.ndarray]:
            segment = out_segments.get(name)
            if segment is None:
                return None
            if borrow:
                return out.view(segment)
            if segment.nbytes <= SINGLE_UPLOAD_BYTES:
                return out.view(segment).copy()
            array = np.empty(segment.shape, np.float32)
            parallel_copy(array, out.view(segment), self._copier)
            return array

        return MhaResult(
            output_BSDv=take("output"),
            present_key_BNTH=take("present_key"),
            present_value_BNTHv=take("present_value"),
            qk_BNST=take("qk"),
        )

    # ----------------------------------------------------------------------------------------- device pipeline
    def _allocate_bytes(self, scratch: MhaScratch, name: str, nbytes: int) -> int:
        try:
            return scratch.allocate(nbytes)
        except cupy.cuda.memory.OutOfMemoryError as error:
            raise MhaEpError(
                f"cuda backend on {self.device}: out of device memory allocating {name} ({nbytes} bytes): {error}"
            ) from error

    def _poison(self, scratch: MhaScratch, address: int, nbytes: int) -> None:
        if self.poison_device_buffers and nbytes:
            scratch.mark_stream_use()
            cupy.cuda.runtime.memsetAsync(address, POISON_BYTE, nbytes, self._stream.ptr)

    def _staged_steps(self, problem: MhaProblem, scratch: MhaScratch, dev_in: dict, dev_out: dict) -> list:
        """Steps 2-5 of a bridge call: the staged float32 inputs ``dev_in`` and float32 outputs ``dev_out`` (name ->
        address), temporaries owned by ``scratch``."""
        call = DeviceCall(sources=dev_in, source_dtype="float32", outputs=dev_out, output_dtype="float32")
        return self.device_steps(problem, call, ScratchTemporaries(self, scratch))

    # ------------------------------------------------------------------------------------- device-side interface
    @property
    def stream(self) -> cupy.cuda.Stream:
        """The backend's own stream: every call of the bridge runs on it."""
        return self._stream

    @property
    def copier(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that copy host arrays into and out of the pinned buffers (COPY_THREADS)."""
        return self._copier

    def facts(self) -> fused.DeviceFacts:
        return fused.DeviceFacts.of(self.device_id)

    def device_steps(self, problem: MhaProblem, call: DeviceCall, temporaries) -> list:
        """One call's device work on device buffers, as steps (pipeline.attention_steps): ``call`` says where the
        inputs lie and in which form and where the outputs go, ``temporaries`` hands out scratch memory
        (``take(name, nbytes) -> address``). The one device-side interface of this backend: the bridge, device
        mode and the native route (mha_ep/native) all make their calls through it, with this backend's choices
        (``fused_path``, ``poison_device_buffers``)."""
        return attention_steps(problem, self.facts(), call, temporaries, fused_path=self.fused_path,
                               poison=self.poison_device_buffers)  # fmt: skip

    def run_steps(self, steps, stream: Optional[cupy.cuda.Stream] = None) -> None:
        """Queue ``steps`` (concrete addresses) on ``stream`` (default: the backend's), on this backend's device:
        launches only. CUDA failures are raised as MhaEpError naming the device."""
        try:
            run_steps(self.device_id, steps, self._stream if stream is None else stream)
        except CUDA_ERRORS as error:
            raise MhaEpError(f"cuda backend on {self.device}: {type(error).__name__}: {error}") from error

    @contextlib.contextmanager
    def holding(self):
        """Hold the backend for a block (its lock, device and stream), CUDA failures raised as MhaEpError: what a
        caller that queues work of its own on ``stream`` wraps it in."""
        with self._on_device():
            yield


class ScratchTemporaries:
    """pipeline.Temporaries over an MhaScratch of ``backend`` (CuPy's pool; an out-of-memory names the buffer)."""

    def __init__(self, backend: CudaBackend, scratch: MhaScratch):
        self.backend = backend
        self.scratch = scratch

    def take(self, name: str, nbytes: int) -> int:
        return self.backend._allocate_bytes(self.scratch, name, nbytes)
