"""The bridge's upload knobs on the GPU machine: host time of mha_ep.InferenceSession.run per chunk size, threading
threshold and thread count, beside the floor's echo op, every setting timed in turns (15 rounds) on six anchor and
sweep rows. staging.py's THREADED_UPLOAD_BYTES and UPLOAD_CHUNK_BYTES were chosen with it (docs/BENCH.md).

    PYTHONPATH=$PWD python3 scripts/bridge_upload_knobs.py      # needs CuPy, a GPU and onnxruntime-extensions

Prints one line per row: the echo op's median µs, then each setting's (chunk / threaded above / threads).
"""
import concurrent.futures

import mha_ep
from mha_ep.bench.gpu import anchor_problem, anchor_model, anchor_feeds, echo_session, plugin_like_options
from mha_ep.bench.timer import paired_medians
from mha_ep.engine.cuda import staging
from mha_ep.engine.backends import create_backend
K, M = 1 << 10, 1 << 20
CONFIGS = {"now 4M/4M/8t": (4 * M, 4 * M, 8), "1M/1M/8t": (1 * M, 1 * M, 8), "512K/1M/8t": (512 * K, 1 * M, 8),
           "2M/1M/8t": (2 * M, 1 * M, 8), "1M/1M/12t": (1 * M, 1 * M, 12), "256K/1M/8t": (256 * K, 1 * M, 8)}
pools = {n: concurrent.futures.ThreadPoolExecutor(n) for n in (8, 12)}
ROWS = [(1, 256, 256, 16, 64, "float16", ""), (1, 512, 512, 16, 64, "float16", ""), (1, 1024, 1024, 16, 64, "float16", ""),
        (1, 2048, 2048, 16, 64, "float16", ""), (8, 512, 512, 12, 64, "float32", ""), (8, 512, 512, 12, 64, "float16", "")]
backend = create_backend("cuda")
for row in ROWS:
    problem = anchor_problem(*row)
    model = anchor_model(*row)
    feeds = anchor_feeds(problem, row[5])
    session = mha_ep.InferenceSession(model, backend="cuda")
    session.backend = backend
    echo = echo_session(session.model, plugin_like_options(session))

    def config(name):
        chunk, threaded, threads = CONFIGS[name]
        def call():
            staging.UPLOAD_CHUNK_BYTES, staging.THREADED_UPLOAD_BYTES = chunk, threaded
            backend._copier = pools[threads]
            session.run(None, feeds)
        return call
    names = list(CONFIGS)
    med = paired_medians([config(n) for n in names] + [lambda: echo.run(None, feeds)], 15)
    echo_us = med[-1] * 1e6
    print(row[:6], "echo", round(echo_us), " ".join(f"{n}={m*1e6:.0f}" for n, m in zip(names, med)), flush=True)
