"""The host cost of each call cuda_io makes around a graph replay, and of what could replace several (µs, medians).

    PYTHONPATH=$PWD:/tmp/site python3 scripts/probe_host_calls.py [--rounds 9] [--calls 400]

``run_device`` on a replayed signature (ONE_STREAM_REPLAY, gpu_session/slots.py) waits for nothing: its host time is
Python and CUDA API calls. Issue 32 asks for at most 30 µs of it around ORT's replay call;
scripts/profile_session_graph.py measures the whole (its H - C' column). This times the calls it is made of, one kind at
a time, and the alternatives that would replace several of them, so the next change is chosen on numbers:

  memcpy              cupy.cuda.runtime.memcpyAsync of one small feed (256 B), device to device, on a stream
  3 memcpy            three of them (BERT's three feeds: input ids, token types, mask)
  gather kernel       one RawKernel launch copying the same three feeds into one block (checked once)
  record + wait       Event.record on one stream and Stream.wait_event on another (a replay makes two pairs)
  empty               cupy.empty of one (1, 32, 768) float32 output (the pool's reuse)
  with stream         entering and leaving ``with stream:`` (of a second stream: the probe runs in the first)
  Device(0)           entering and leaving ``with cupy.cuda.Device(0):``
  current stream      cupy.cuda.get_current_stream()
  c_contiguous        a CuPy array's ``flags.c_contiguous`` (the call's split asks it of every feed)
  ctypes driver call  cuCtxGetCurrent through ctypes: the floor of a batch of calls made in C through ctypes
  copies, CuPy        gpu_session/segments.py's copy kernel over the three feeds with a replay's event pair before and
                      after it (record + wait each), launched and recorded by CuPy
  copies, native      the same through the native library's one call (_native.launch_copies)

Each kind: ``--calls`` calls in a row timed as one span and divided by the count (the GPU work they queue is
tiny; the stream is synchronized after each span, outside it), the kinds in turns, ``--rounds`` rounds; printed:
each kind's median over the rounds and its range. Needs CuPy and a GPU, not ORT.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import time

import cupy
import numpy as np

# one launch for three feeds: byte copies (the feeds of a small call are a few hundred bytes each)
GATHER = r"""
extern "C" __global__ void gather3(char* dst, const char* a, const char* b, const char* c,
                                   unsigned long long na, unsigned long long nb, unsigned long long nc) {
  const unsigned long long total = na + nb + nc;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
    dst[i] = i < na ? a[i] : (i < na + nb ? b[i - na] : c[i - na - nb]);
  }
}
"""
FEED_BYTES = 256


def kinds(stream, other) -> dict:
    """The probe's calls, each a function making one of them (module docstring)."""
    rng = np.random.default_rng(0)
    copy, to_device, ptr = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr
    feeds = [cupy.asarray(rng.integers(0, 255, FEED_BYTES, dtype=np.uint8)) for _ in range(3)]
    block = cupy.empty(3 * FEED_BYTES, np.uint8)
    gather = cupy.RawKernel(GATHER, "gather3")
    sizes = [np.uint64(FEED_BYTES)] * 3
    args = (block, *feeds, *sizes)
    with stream:
        gather((1,), (256,), args)
    stream.synchronize()
    if not (cupy.asnumpy(block) == np.concatenate([cupy.asnumpy(f) for f in feeds])).all():
        raise SystemExit("probe_host_calls: the gather kernel copied the wrong bytes")
    event = cupy.cuda.Event(block=False, disable_timing=True)
    driver = ctypes.CDLL("libcuda.so.1")
    context = ctypes.c_void_p()

    def memcpy():
        copy(block.data.ptr, feeds[0].data.ptr, FEED_BYTES, to_device, ptr)

    def memcpy3():
        for index, feed in enumerate(feeds):
            copy(block.data.ptr + index * FEED_BYTES, feed.data.ptr, FEED_BYTES, to_device, ptr)

    def gather_kernel():  # on the current stream: main times every kind inside ``with stream``
        gather((1,), (256,), args)

    def record_wait():
        event.record(stream)
        other.wait_event(event)

    def empty():
        cupy.empty((1, 32, 768), np.float32)

    def with_stream():
        with other:
            pass

    def device():
        with cupy.cuda.Device(0):
            pass

    def contiguous():
        return block.flags.c_contiguous

    from mha_ep.gpu_session import segments

    kernel = segments.copy_function(0)
    if kernel.native is None:
        raise SystemExit("probe_host_calls: the native library's launch_copies is unavailable here")
    targets = [block.data.ptr + index * FEED_BYTES for index in range(3)]
    by_cupy = segments.SegmentCopies(dataclasses.replace(kernel, native=None), [FEED_BYTES] * 3, destinations=targets)
    by_native = segments.SegmentCopies(kernel, [FEED_BYTES] * 3, destinations=targets)
    fed, copied = (cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2))

    return {"memcpy": memcpy, "3 memcpy": memcpy3, "gather kernel": gather_kernel, "record + wait": record_wait,
            "empty": empty, "with stream": with_stream, "Device(0)": device,
            "current stream": cupy.cuda.get_current_stream, "c_contiguous": contiguous,
            "ctypes driver call": lambda: driver.cuCtxGetCurrent(ctypes.byref(context)),
            "copies, CuPy": lambda: by_cupy.launch(stream, feeds, (fed, other), (copied, other)),
            "copies, native": lambda: by_native.launch(stream, feeds, (fed, other), (copied, other))}  # fmt: skip


def span(call, calls: int, stream, other) -> float:
    """µs a call of ``call``, over ``calls`` in a row; the streams are synchronized after, outside the span."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = time.perf_counter() - start
    stream.synchronize()
    other.synchronize()
    return seconds / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400, help="calls in one timed span")
    args = parser.parse_args()
    stream = cupy.cuda.Stream(non_blocking=True)
    other = cupy.cuda.Stream(non_blocking=True)
    calls = kinds(stream, other)
    times = {name: [] for name in calls}
    with stream:  # the current stream, as the caller's is in run_device
        for call in calls.values():  # warm-up: compiles, pools, first launches
            span(call, 20, stream, other)
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(span(call, args.calls, stream, other))
    print(f"| call | µs (median of {args.rounds} rounds of {args.calls}) | range |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |", flush=True)


if __name__ == "__main__":
    main()
