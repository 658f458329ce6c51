"""Serve one model from every GPU of this machine in one process: an mha_ep.InferenceSession per GPU, a thread
pool per session, requests to the least busy GPU, every answer checked against stock ORT.

    python examples/serve_two_gpus.py [model.onnx] [--requests 400] [--threads 4]

Default model: the shipped small BERT. Needs onnxruntime-gpu, CuPy and the native library (``pip install -e
".[gpu]"``); on one GPU it serves from that one and says so.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime

import mha_ep
from mha_ep.feeds import random_feeds

CUDA = "CUDAExecutionProvider"


class GpuPool:
    """One session and one thread pool per GPU; ``submit`` sends a request to the GPU with the fewest in flight."""

    def __init__(self, model, devices, threads: int):
        self.sessions = [mha_ep.InferenceSession(model, providers=[(CUDA, {}), "CPUExecutionProvider"],
                                                 backend="cuda", device_id=d) for d in devices]  # fmt: skip
        self.pools = [ThreadPoolExecutor(threads, f"gpu{d}") for d in devices]
        self.in_flight = [0] * len(devices)
        self.served = [0] * len(devices)
        self._lock = threading.Lock()

    def submit(self, feeds: dict):
        with self._lock:
            gpu = self.in_flight.index(min(self.in_flight))
            self.in_flight[gpu] += 1
        future = self.pools[gpu].submit(self.sessions[gpu].run, None, feeds)
        future.add_done_callback(lambda _, gpu=gpu: self._done(gpu))
        return future

    def _done(self, gpu: int) -> None:
        with self._lock:
            self.in_flight[gpu] -= 1
            self.served[gpu] += 1

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(mha_ep.shipped_model("bert_random_mask2d_fp32.onnx")))
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--threads", type=int, default=4, help="threads per GPU")
    args = parser.parse_args()
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - no CuPy, no driver, no GPU: one line, not a traceback
        count, reason = 0, f"{type(error).__name__}: {error}"
    else:
        reason = "no GPU" if count == 0 else ""
    if CUDA not in onnxruntime.get_available_providers():
        reason = reason or f"this onnxruntime has no {CUDA}"
    if reason:
        print(f"serve_two_gpus.py: needs onnxruntime-gpu, CuPy and a GPU ({reason}); pip install -e \".[gpu]\"",
              file=sys.stderr)
        return 1
    onnxruntime.preload_dlls()
    devices = list(range(count))
    print(f"serving {args.model} from {len(devices)} GPU(s): {devices}"
          + ("" if len(devices) > 1 else " (one GPU here: the same code spreads over more)"))
    model = onnx.load(args.model)
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    requests = [random_feeds(model, seed=i, dims={"batch": int(rng.integers(1, 9)), "sequence": int(rng.integers(8, 65))})
                for i in range(16)]  # fmt: skip
    expected = [stock.run(None, feeds) for feeds in requests]
    pool = GpuPool(model, devices, args.threads)
    for feeds in requests:  # a first call per shape on every GPU, outside the timing (kernels compile)
        for session in pool.sessions:  # directly: the pool would send each to GPU 0, the least busy when idle
            session.run(None, feeds)
    pool.served = [0] * len(devices)
    start = time.perf_counter()
    futures = [(i % len(requests), pool.submit(requests[i % len(requests)])) for i in range(args.requests)]
    worst = 0.0
    for index, future in futures:
        for got, want in zip(future.result(), expected[index]):
            worst = max(worst, float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want)))))
    seconds = time.perf_counter() - start
    pool.close()
    print(f"{args.requests} requests in {seconds:.2f} s ({args.requests / seconds:.0f}/s); per GPU: {pool.served}; "
          f"worst error vs stock ORT CUDA {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
