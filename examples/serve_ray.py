"""Serve a shipped model with Ray Serve on this machine, send it requests from several callers at once, over
HTTP and through a handle, and check every answer against stock ONNX Runtime.

    pip install -e ".[cpu,serve]"
    python examples/serve_ray.py

The same from the command line: ``mha-ep serve MODEL --port 8000``, then POST {"inputs": {...}} as JSON (or an
np.savez archive as application/x-npz) to http://127.0.0.1:8000/.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request

import numpy as np
import onnx
import onnxruntime

import mha_ep
from mha_ep.feeds import random_feeds
from mha_ep.serve import ServeOptions, deploy, free_port, missing_extra, start_local, stop

TOLERANCE = 1e-5  # float32, relative to max(1, |x|): mha_ep's reference backend against stock ORT CPU


def post_json(url: str, feeds: dict) -> dict:
    body = json.dumps({"inputs": {name: value.tolist() for name, value in feeds.items()}}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def worst_error(actual, expected) -> float:
    return float(np.max(np.abs(actual - expected) / np.maximum(1.0, np.abs(expected))))


def main() -> int:
    if missing_extra():
        print(f"serve_ray.py: {missing_extra()}", file=sys.stderr)
        return 1
    path = str(mha_ep.shipped_model("bert_random_mask2d_fp32.onnx"))
    model = onnx.load(path)
    stock = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    requests = [random_feeds(model, seed=i, dims={"batch": 1 + i % 2, "sequence": 6 + 5 * i}) for i in range(8)]
    expected = [stock.run(None, feeds)[0] for feeds in requests]

    port = free_port()
    start_local(port)  # Ray on this machine, Serve's HTTP on 127.0.0.1:port
    try:
        handle = deploy(ServeOptions(model=path, backend="reference", max_batch=8), "bert")
        url = f"http://127.0.0.1:{port}/"
        replies = [None] * len(requests)

        def call(index):  # one caller each, all at once: their requests may share runs
            replies[index] = post_json(url, requests[index])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        over_http = [np.array(r["outputs"]["last_hidden_state"], np.float32) for r in replies]
        shared = sum(r["run"]["requests"] > 1 for r in replies)
        through_handle = [handle.run.remote(None, feeds) for feeds in requests]  # sent at once too
        from_handle = [pending.result(timeout_s=120)[0] for pending in through_handle]
    finally:
        stop()

    worst = max(worst_error(a, e) for answers in (over_http, from_handle) for a, e in zip(answers, expected))
    print(f"{len(requests)} requests over HTTP ({shared} answered from a run shared with other callers) and "
          f"{len(requests)} through a handle; worst error against stock ORT: {worst:.1e} (tolerance {TOLERANCE:g})")
    print(f"served answers match stock ORT: {worst <= TOLERANCE}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
