"""A graph replay's copies as one kernel launch each way (native/segments.py) against one memcpy per buffer.

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/ab_copy_kernel.py [--rounds 15] [--calls 40]

Two ``mha_ep.InferenceSession`` of one BERT-base row under ORT's CUDA graph, in one process: one copies a replay's
feeds in and outputs out with the copy kernel (the default), the other with one ``cudaMemcpyAsync`` per buffer
(``cuda_io._copy_kernel`` set False, as where NVRTC cannot build the kernel). Each round times ``--calls`` calls of
``run_device`` on CuPy feeds per session, in turns: the host time until the call returns (rule 7: a replay waits
for nothing), the caller's stream synchronized after each call, outside the timing. Printed per row: each side's
median over the rounds, its range, their ratio, and the largest difference between the two sessions' outputs
(the copies must not change a bit). Needs CuPy, onnxruntime-gpu and a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cupy
import onnxruntime as ort

import mha_ep
from mha_ep.models.synthetic import bert_encoder, encoder_feeds

GRAPH = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
ROWS = ((1, 32, "float32"), (8, 128, "float16"))


def host_times(session, feeds: dict, calls: int) -> float:
    """Median µs ``run_device`` takes to return, over ``calls`` calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        session.run_device(None, feeds)
        times.append(time.perf_counter() - start)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    ort.preload_dlls()
    print("| row | kernel µs (range) | memcpy µs (range) | kernel / memcpy | max abs difference |")
    print("|---|---|---|---|---|")
    for batch, sequence, dtype in ROWS:
        model = bert_encoder(dtype=dtype)
        feeds = {n: cupy.asarray(v) for n, v in encoder_feeds(batch, sequence, dtype=dtype).items()}
        sessions = {side: mha_ep.InferenceSession(model, backend="cuda", providers=GRAPH)
                    for side in ("kernel", "memcpy")}  # fmt: skip
        sessions["memcpy"].cuda_io._copy_kernel = False  # as where the kernel cannot be built
        outputs = {}
        for side, session in sessions.items():
            for _ in range(5):  # the eager first call, ORT's warm-up and capture, then replays
                outputs[side] = cupy.asnumpy(session.run_device(None, feeds)[0]).astype("float64")
            slots = [slot for slot in session.cuda_io.slots.values() if slot is not None]
            if not slots or any((slot.copies_in is not None) != (side == "kernel") for slot in slots):
                raise SystemExit(f"ab_copy_kernel: the {side} session's slots do not copy as asked")
        rounds = {side: [] for side in sessions}
        for _ in range(args.rounds):
            for side, session in sessions.items():
                rounds[side].append(host_times(session, feeds, args.calls))
        kernel, memcpy = (statistics.median(rounds[side]) for side in ("kernel", "memcpy"))
        print(f"| BERT-base B={batch} S={sequence} {dtype} | {kernel:.1f} ({min(rounds['kernel']):.1f}-"
              f"{max(rounds['kernel']):.1f}) | {memcpy:.1f} ({min(rounds['memcpy']):.1f}-{max(rounds['memcpy']):.1f}) "
              f"| {kernel / memcpy:.2f} | {abs(outputs['kernel'] - outputs['memcpy']).max():g} |", flush=True)


if __name__ == "__main__":
    main()
