"""A graph replay's host time by how its copies are made: the native library's one call each way (the default),
CuPy's launch of the same kernel with its event calls, or one memcpy per buffer.

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/ab_copy_kernel.py [--rounds 15] [--calls 40]

Three ``mha_ep.InferenceSession`` of one BERT-base row under ORT's CUDA graph, in one process:
  native  the copy kernel and the replay's event pair through ``_native.launch_copies`` (gpu_session/segments.py)
  cupy    the same kernel launched by CuPy, the events recorded and waited for by CuPy (as before launch_copies)
  memcpy  one ``cudaMemcpyAsync`` per buffer (``GraphSlots._copy_kernel`` set False, as where NVRTC cannot build it)
Each round times ``--calls`` calls of ``run_device`` on CuPy feeds per session, in turns: H, the host time until
the call returns (ONE_STREAM_REPLAY: a replay waits for nothing), and C', the session's ORT call inside it (timed around
cuda_io's ``ort.run``: the session's guard and ORT's ``run_with_iobinding`` of the replay), the caller's stream
synchronized after each call, outside the timing. H - C' is cuda_io's host time around ORT's replay call (issue
32's target: 30 µs). Printed per row and side: medians over the rounds of each round's median, the range of H, and
the largest difference from the native session's outputs (the copies must not change a bit). Needs CuPy,
onnxruntime-gpu and a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import cupy
import onnxruntime as ort

import mha_ep
from mha_ep.models.synthetic import bert_encoder, encoder_feeds
from mha_ep.gpu_session import segments

GRAPH = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
ROWS = ((1, 32, "float32"), (8, 128, "float16"))
SIDES = ("native", "cupy", "memcpy")


def timed_ort(io) -> list:
    """Time ``io``'s ORT calls (its ``ort.run``) into the returned list, in seconds."""
    inner, original = [], io.ort.run

    def run(binding, options):
        start = time.perf_counter()
        try:
            return original(binding, options)
        finally:
            inner.append(time.perf_counter() - start)

    io.ort.run = run
    return inner


def host_times(session, feeds: dict, calls: int, inner: list) -> tuple:
    """(median µs ``run_device`` takes to return, median µs of its ORT call), over ``calls`` calls."""
    times = []
    del inner[:]
    for _ in range(calls):
        start = time.perf_counter()
        session.run_device(None, feeds)
        times.append(time.perf_counter() - start)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(times) * 1e6, statistics.median(inner) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    ort.preload_dlls()
    print("| row | side | H µs (range) | C' µs | H - C' µs | H / native H | max abs difference |")
    print("|---|---|---|---|---|---|---|")
    for batch, sequence, dtype in ROWS:
        model = bert_encoder(dtype=dtype)
        feeds = {n: cupy.asarray(v) for n, v in encoder_feeds(batch, sequence, dtype=dtype).items()}
        sessions = {side: mha_ep.InferenceSession(model, backend="cuda", providers=GRAPH) for side in SIDES}
        with cupy.cuda.Device(0):
            kernel = segments.copy_function(0)
        if kernel.native is None:
            raise SystemExit("ab_copy_kernel: the native library's launch_copies is unavailable here")
        sessions["cupy"].cuda_io.graph_slots._copy_kernel = dataclasses.replace(kernel, native=None)
        sessions["memcpy"].cuda_io.graph_slots._copy_kernel = False  # as where the kernel cannot be built
        outputs, inner = {}, {}
        for side, session in sessions.items():
            for _ in range(5):  # the eager first call, ORT's warm-up and capture, then replays
                outputs[side] = cupy.asnumpy(session.run_device(None, feeds)[0]).astype("float64")
            slots = [slot for slot in session.cuda_io.slots.values() if slot is not None]
            natives = {slot.copies_in._launches[0].kernel.native is not None for slot in slots if slot.copies_in}
            if not slots or natives != ({True} if side == "native" else {False} if side == "cupy" else set()):
                raise SystemExit(f"ab_copy_kernel: the {side} session's slots do not copy as asked")
            inner[side] = timed_ort(session.cuda_io)
        rounds = {side: [] for side in SIDES}
        for _ in range(args.rounds):
            for side, session in sessions.items():
                rounds[side].append(host_times(session, feeds, args.calls, inner[side]))
        native_h = statistics.median(h for h, _ in rounds["native"])
        for side in SIDES:
            hs = [h for h, _ in rounds[side]]
            h, c = statistics.median(hs), statistics.median(c for _, c in rounds[side])
            print(f"| BERT-base B={batch} S={sequence} {dtype} | {side} | {h:.1f} ({min(hs):.1f}-{max(hs):.1f}) "
                  f"| {c:.1f} | {h - c:.1f} | {h / native_h:.2f} "
                  f"| {abs(outputs[side] - outputs['native']).max():g} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
