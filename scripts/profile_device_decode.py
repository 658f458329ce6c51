"""Where a decode step's time goes in device mode, on the GPU machine (issue 14: the Whisper tiny.en decode step).

    PYTHONPATH=$PWD:/tmp/ortsite python3 scripts/profile_device_decode.py MODELS/whisper_tiny_en_decoder_fp32.onnx

Prints, in one run: stock ORT CUDA (numpy feeds, IOBinding) against device mode (numpy / CuPy feeds, graphs off
and on), medians of 20 in turns; the host time per kind of step of an eager call; the stream span of one call;
the upload and download variants that mha_ep/device/transfer.py chose between; and cProfile of eager calls.
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import cupy
import numpy as np
import onnx
import onnxruntime as ort
ort.preload_dlls()
import mha_ep
from mha_ep.feeds import random_feeds
from mha_ep.bench.timer import paired_medians

path = sys.argv[1]
model = onnx.load(path)
feeds = random_feeds(model, seed=0, dims={"batch": 1, "past_decode_len": 447})
print({k: (v.shape, str(v.dtype)) for k, v in feeds.items()})
print("feed MB", sum(v.nbytes for v in feeds.values()) / 2**20)
P = ["CUDAExecutionProvider", "CPUExecutionProvider"]
stock = ort.InferenceSession(path, providers=P)
dev = mha_ep.InferenceSession(path, backend="cuda", providers=P, device_mode="device")
r = dev.device_runner
r.graphs_enabled = False
print(r.plan.describe())
print("refusal:", r.executor.graph_refusal)
outs = stock.run(None, feeds)
print("out MB", sum(o.nbytes for o in outs) / 2**20)
df = {k: cupy.asarray(v) for k, v in feeds.items()}
io_ = stock.io_binding()
for k, v in df.items():
    io_.bind_input(k, "cuda", 0, v.dtype.type, list(v.shape), v.data.ptr)
for o in stock.get_outputs():
    io_.bind_output(o.name, "cuda", 0)


def s_io():
    stock.run_with_iobinding(io_)
    io_.synchronize_outputs()


def d_feeds():
    dev.run_device(None, df)
    r.stream.synchronize()


def g(enabled, f):
    def w():
        r.graphs_enabled = enabled
        return f()
    return w


calls = {"stock_numpy": lambda: stock.run(None, feeds), "stock_io": s_io, "dev_numpy": g(False, lambda: dev.run(None, feeds)),
         "dev_feeds": g(False, d_feeds), "dev_graph": g(True, lambda: dev.run(None, feeds)), "dev_graph_feeds": g(True, d_feeds)}
med = paired_medians(list(calls.values()), 20)
for k, m in zip(calls, med):
    print(f"{k:12s} {m*1e3:8.3f} ms")
r.graphs_enabled = False
print("eager head", r.executor.eager_head, "graphs", [e is not None for e in r.graphs.entries.values()])
a = dev.run(None, feeds); r.graphs_enabled = True; b = dev.run(None, feeds); c = stock.run(None, feeds); r.graphs_enabled = False
print("max err eager", max(float(np.max(np.abs(x - z))) for x, z in zip(a, c)), "graph", max(float(np.max(np.abs(y - z))) for y, z in zip(b, c)))

# host time per kind of step (no synchronize: the host's own cost, as the eager call pays it)
ex = r.executor
acc = {"piece": [], "attention": [], "feed": []}
orig = {"piece": ex.run_piece, "attention": ex.run_attention, "feed": ex.feed}


def wrap(kind):
    f = orig[kind]

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[kind].append(time.perf_counter() - t)
    return g


ex.run_piece, ex.run_attention, ex.feed = wrap("piece"), wrap("attention"), wrap("feed")
for _ in range(3):
    d_feeds()
for v in acc.values():
    v.clear()
N = 20
t0 = time.perf_counter()
for _ in range(N):
    dev.run_device(None, df)
t1 = time.perf_counter()
r.stream.synchronize()
t2 = time.perf_counter()
print(f"eager dev_feeds host {((t1-t0)/N)*1e3:.3f} ms/call, tail sync {(t2-t1)*1e3:.3f} ms")
for kind, v in acc.items():
    if v:
        print(f"  {kind:10s} n/call {len(v)/N:.0f}  median {statistics.median(v)*1e6:7.1f} us  sum/call {sum(v)/N*1e3:.3f} ms")
ex.run_piece, ex.run_attention, ex.feed = orig["piece"], orig["attention"], orig["feed"]

# GPU time of one eager call (events around it)
s = r.stream
e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
s.synchronize()
e0.record(s)
dev.run_device(None, df)
e1.record(s)
e1.synchronize()
print(f"one eager call, stream span {cupy.cuda.get_elapsed_time(e0, e1):.3f} ms")

# transfers: H2D of the numpy feeds, D2H of the outputs
arrs = list(feeds.values())
houts = [cupy.asarray(o) for o in outs]


def up_plain():
    with s:
        for a in arrs:
            cupy.asarray(a)
    s.synchronize()


pin = cupy.cuda.alloc_pinned_memory(sum(a.nbytes for a in arrs) + 4096 * len(arrs))
dbuf = cupy.empty(sum(a.nbytes for a in arrs) + 4096 * len(arrs), cupy.uint8)


def up_pinned():
    off = 0
    for a in arrs:
        view = np.frombuffer(pin, np.uint8, a.nbytes, off)
        np.copyto(view, a.view(np.uint8).reshape(-1))
        cupy.cuda.runtime.memcpyAsync(dbuf.data.ptr + off, pin.ptr + off, a.nbytes, 1, s.ptr)
        off += (a.nbytes + 4095) // 4096 * 4096
    s.synchronize()


from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(8)


def up_pinned_threads():
    off = 0
    jobs = []
    for a in arrs:
        view = np.frombuffer(pin, np.uint8, a.nbytes, off)
        jobs.append((pool.submit(np.copyto, view, a.view(np.uint8).reshape(-1)), off, a.nbytes))
        off += (a.nbytes + 4095) // 4096 * 4096
    for j, o, n in jobs:
        j.result()
        cupy.cuda.runtime.memcpyAsync(dbuf.data.ptr + o, pin.ptr + o, n, 1, s.ptr)
    s.synchronize()


def down_plain():
    [cupy.asnumpy(h, stream=s) for h in houts]
    s.synchronize()


opin = cupy.cuda.alloc_pinned_memory(sum(h.nbytes for h in houts) + 4096 * len(houts))


def down_pinned_threads():
    off = 0
    views = []
    for h in houts:
        cupy.cuda.runtime.memcpyAsync(opin.ptr + off, h.data.ptr, h.nbytes, 2, s.ptr)
        views.append((np.frombuffer(opin, np.uint8, h.nbytes, off), h))
        off += (h.nbytes + 4095) // 4096 * 4096
    s.synchronize()
    res = [np.empty(h.shape, h.dtype) for h in houts]
    list(pool.map(lambda p: np.copyto(p[0].view(np.uint8).reshape(-1), p[1][0]), zip(res, views)))


def down_pinned_fresh():
    res = []
    for h in houts:
        m = cupy.cuda.alloc_pinned_memory(h.nbytes)
        a = np.frombuffer(m, h.dtype, h.size).reshape(h.shape)
        cupy.cuda.runtime.memcpyAsync(a.ctypes.data, h.data.ptr, h.nbytes, 2, s.ptr)
        res.append(a)
    s.synchronize()


tc = {"up_plain": up_plain, "up_pinned": up_pinned, "up_pinned_threads": up_pinned_threads,
      "down_plain": down_plain, "down_pinned_threads": down_pinned_threads, "down_pinned_fresh": down_pinned_fresh}
med = paired_medians(list(tc.values()), 20)
for k, m in zip(tc, med):
    print(f"{k:20s} {m*1e3:8.3f} ms")

pr = cProfile.Profile()
pr.enable()
for _ in range(20):
    dev.run_device(None, df)
r.stream.synchronize()
pr.disable()
out = io.StringIO()
pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(35)
pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(45)
print(out.getvalue())
