"""The one median timer: host wall time of Python calls, and device time of work submitted to a CUDA stream.

Host: ``paired_medians`` times several functions in turns (a, b, a, b, ...) so each sees the same state of a
shared, noisy host; ``median_seconds`` is its one-function case.
Device: ``stream_seconds`` captures GRAPH_LAUNCHES back-to-back submissions into a CUDA graph after warm-up and
replays it ``repeats`` times, each replay between its own pair of CUDA events: seconds = median replay /
GRAPH_LAUNCHES, without the gaps Python's launches leave on the GPU (docs/BENCH.md, "How these were measured").
Work a graph cannot capture (cuBLAS calls, which CuPy refuses during capture; a failed capture) is timed the
same way from plain submissions, which include those gaps. ``backend_seconds`` times a cuda backend call's device
work (layout movers and kernels, inputs already on the device) through the backend's ``prepared`` hook.
"""

from __future__ import annotations

import logging
import statistics
import time

log = logging.getLogger("mha_ep")
GRAPH_LAUNCHES = 10  # submissions per captured graph


def paired_medians(fns, repeats: int, warmup: int = 2) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in turns (a, b, a, b, ...) so that every function sees
    the same state of a shared, noisy host (a series timed after another can be far off: docs/BENCH.md, "How these
    were measured")."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, series in zip(fns, samples):
            start = time.perf_counter()
            fn()
            series.append(time.perf_counter() - start)
    return [statistics.median(series) for series in samples]


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    return paired_medians([fn], repeats, warmup)[0]


def _median_event_seconds(cupy, stream, run, repeats: int) -> float:
    pairs = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        run()
        stop.record(stream)
        pairs.append((start, stop))
    stream.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in pairs) / 1e3


def stream_seconds(submit, stream, repeats: int, warmup: int = 3, capturable: bool = True) -> float:
    """Device seconds per ``submit()`` (which queues work on ``stream``), from CUDA-graph replays when
    ``capturable`` and the capture succeeds, else from plain submissions (module docstring)."""
    import cupy

    for _ in range(warmup):
        submit()  # compiles and caches every kernel before a capture
    stream.synchronize()
    if capturable:
        try:
            stream.begin_capture()
            try:
                for _ in range(GRAPH_LAUNCHES):
                    submit()
            finally:
                graph = stream.end_capture()
        except cupy.cuda.runtime.CUDARuntimeError as error:
            log.debug("mha_ep: graph capture for timing failed (%s); timing plain submissions", error)
        else:
            graph.launch(stream)
            return _median_event_seconds(cupy, stream, lambda: graph.launch(stream), repeats) / GRAPH_LAUNCHES
    return _median_event_seconds(cupy, stream, submit, repeats)


def backend_seconds(backend, problem, repeats: int = 20, warmup: int = 3) -> float:
    """Device seconds per call of ``problem``'s steps 2-5 on a CudaBackend (inputs already on the device): the
    fused path from graph replays, the three-phase path from plain submissions (on small shapes those include the
    host's launch gaps)."""
    with backend.prepared(problem) as call:
        return stream_seconds(call.submit, call.stream, repeats, warmup, capturable=call.capturable)


def torch_graph_seconds(torch, launch, repeats: int) -> float:
    """The same for a torch launch: graph replays, or plain launches when the capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            launch()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_LAUNCHES):
                launch()
        replay = graph.replay
    except Exception:  # noqa: BLE001 - some SDPA backends refuse capture

        def replay():
            for _ in range(GRAPH_LAUNCHES):
                launch()

    replay()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / 1e3 / GRAPH_LAUNCHES)
    return statistics.median(samples)
