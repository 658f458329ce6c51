"""Where a repeated-shape call of ``mha_ep.InferenceSession`` under ORT's CUDA graph spends its host time.

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/profile_session_graph.py [--repeats 15]

Per BERT-base row, calls timed in turns (medians, ms), each ending when its outputs are ready:
  A  stock ORT CUDA, enable_cuda_graph, inputs and outputs bound at fixed addresses (its graph replayed)
  B  a plain ORT session on the native route, the same binding and graph (the native op inside ORT's graph)
  C  mha_ep.InferenceSession with enable_cuda_graph, run_device on CuPy feeds (cuda_io: copies in and out)
  C' the same session's ORT call alone (the replay inside C, timed around its run_with_iobinding)
  E  the graph session's run on NumPy feeds, NumPy outputs (E' its ORT call)
  F  stock's graph fed from NumPy: each feed copied into its bound buffer, the replay, each output copied back
  H  C's run_device alone, in µs: it returns before the GPU has run (ONE_STREAM_REPLAY), so this is its host time;
     H - C' is cuda_io's host time around ORT's replay call (issue 32's target: 30 µs), timed with no probe in the call
  O  H with the caller on ORT's own stream (as a caller that gave its stream as ``user_compute_stream``): the
     replay records and waits for no event; O - C' as H - C'
B - A is the native op against stock's attention inside ORT's graph; C / A the whole session call (its copies in and out
included) against stock's bare replay. A replay is queued, not waited for (ONE_STREAM_REPLAY, gpu_session/slots.py), so
C' is host time only and C - C' holds the wait for the GPU.

A second table splits C and E into segments (medians, µs) between marks set where cuda_io's methods begin (">")
and end ("<"); "sync" is the caller's wait for the outputs. A segment that holds a host wait on the GPU shows it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import cupy
import onnxruntime as ort

import mha_ep
from mha_ep.bench.native import bound_call, fixed_binding, output_values
from mha_ep.bench.timer import paired_medians
from mha_ep.models.synthetic import bert_encoder, encoder_feeds
from mha_ep.gpu_session.transfer import HostTransfers

CUDA = "CUDAExecutionProvider"
GRAPH = [(CUDA, {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]


def probe(owner, name: str, marks: list) -> None:
    """Wrap ``owner.name`` (a method) so that each call appends (name>, t) on entry and (name<, t) on return."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        marks.append((name + ">", time.perf_counter()))
        try:
            return original(*args, **kwargs)
        finally:
            marks.append((name + "<", time.perf_counter()))

    setattr(owner, name, wrapped)


def segments(call, marks: list, repeats: int) -> str:
    """Median µs of each segment between consecutive marks of ``call`` (run ``repeats`` times after a warm-up)."""
    spans = defaultdict(list)
    for index in range(repeats + 3):
        marks.clear()
        call()
        marks.append(("sync", time.perf_counter()))
        if index < 3:
            continue
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            spans[f"{a} {b}"].append((tb - ta) * 1e6)
    return ", ".join(f"{k}: {statistics.median(v):.0f}" for k, v in spans.items())


def host_time(call, inner: list, repeats: int) -> tuple:
    """(median µs ``call`` takes to return, median µs of the ORT calls it made: ``inner``'s new entries), over
    ``repeats`` calls after 3 warm-ups, each followed by a synchronize of the current stream outside the timing."""
    own = []
    first = len(inner)
    for _ in range(repeats + 3):
        start = time.perf_counter()
        call()
        own.append(time.perf_counter() - start)
        cupy.cuda.get_current_stream().synchronize()
    ort_calls = inner[first:][-repeats:]
    return statistics.median(own[3:]) * 1e6, statistics.median(ort_calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ort.preload_dlls()
    header = ("| row | A stock graph | B native op in ORT graph | C session graph run_device | C' its ORT call "
              "| C / A | E session graph run (NumPy) | E' its ORT call | F stock graph NumPy | E / F "
              "| H run_device returns µs | H - C' µs | O on ORT's stream µs | O - C' µs |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    breakdown = []
    marks: list = []  # every probe's (name, time) marks: one list, cleared per call
    for batch, sequence, dtype in ((8, 128, "float32"), (8, 128, "float16"), (8, 512, "float16"), (1, 32, "float32")):
        model = bert_encoder(dtype=dtype)
        feeds = encoder_feeds(batch, sequence, dtype=dtype)
        device_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
        stock = ort.InferenceSession(model.SerializeToString(), providers=GRAPH)
        options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
        plain = ort.InferenceSession(mha_ep.partition(model, route="native").model.SerializeToString(), options,
                                     providers=GRAPH)
        calls = []
        stock_values = None
        for session in (stock, plain):
            _, values = output_values(session, feeds)
            stock_values = stock_values or values
            calls.append(bound_call(session, device_feeds, values))
        stock_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
        stock_binding = fixed_binding(stock, stock_feeds, stock_values)

        def stock_numpy():
            for name, array in stock_feeds.items():
                array.set(feeds[name])
            cupy.cuda.get_current_stream().synchronize()  # ORT's stream does not wait for the copies
            stock.run_with_iobinding(stock_binding)
            [value.numpy() for value in stock_binding.get_outputs()]

        graphed = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPH)
        io = graphed.cuda_io
        inner = []
        original = graphed._run_binding

        def timed_binding(binding, run_options):
            start = time.perf_counter()
            original(binding, run_options)
            inner.append(time.perf_counter() - start)

        io.ort.run = timed_binding

        def session_call():
            graphed.run_device(None, device_feeds)
            cupy.cuda.get_current_stream().synchronize()

        def session_numpy():
            graphed.run(None, feeds)

        calls.append(session_call)
        a, b, c = (s * 1e3 for s in paired_medians(calls, args.repeats, warmup=4))
        tail = sorted(inner[-args.repeats:])
        inside = tail[len(tail) // 2] * 1e3
        inner.clear()
        e, f = (s * 1e3 for s in paired_medians([session_numpy, stock_numpy], args.repeats, warmup=4))
        tail = sorted(inner[-args.repeats:])
        inside_numpy = tail[len(tail) // 2] * 1e3
        own, ort_call = host_time(lambda: graphed.run_device(None, device_feeds), inner, 4 * args.repeats)
        with io.ort_stream:
            own_ort, ort_call_ort = host_time(lambda: graphed.run_device(None, device_feeds), inner, 4 * args.repeats)
        print(f"| BERT-base B={batch} S={sequence} {dtype} | {a:.3f} | {b:.3f} | {c:.3f} | {inside:.3f} | {c / a:.2f} "
              f"| {e:.3f} | {inside_numpy:.3f} | {f:.3f} | {e / f:.2f} | {own:.1f} | {own - ort_call:.1f} "
              f"| {own_ort:.1f} | {own_ort - ort_call_ort:.1f} |",
              flush=True)  # fmt: skip
        for owner, name in ((io, "run_device"), (io, "run_host"), (io.graph_slots, "replay_device"),
                            (io.graph_slots, "replay"), (io.graph_slots, "run_slot"), (io.ort, "run")):
            probe(owner, name, marks)
        if not breakdown:  # the class's methods: once
            for name in ("upload", "download"):
                probe(HostTransfers, name, marks)
        breakdown.append((f"B={batch} S={sequence} {dtype}", segments(session_call, marks, args.repeats),
                          segments(session_numpy, marks, args.repeats)))
    print("\n| row | C run_device segments (µs) | E run (NumPy) segments (µs) |\n|---|---|---|")
    for row in breakdown:
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
