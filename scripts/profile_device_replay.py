"""Where a device-mode call's time goes on the GPU machine: the BERT-base-sized encoder (12 layers, B=8, 2D mask).

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/profile_device_replay.py float16 128

Prints, in one run:
  1. a graph replay's segments (300 calls, medians): host time from ``run_device`` to the graph launch (on the
     call's critical path), the launch, host time after it (overlaps the GPU), the wait, the whole call, and the
     graph alone on the GPU (CUDA events);
  2. with torch installed (CUPTI through torch.profiler): every kernel of an eager device-mode call against
     stock ORT CUDA with IOBinding, summed by name per call, and the first layer's kernels in launch order.
"""
import collections
import statistics
import sys
import time

import cupy
import onnxruntime as ort

ort.preload_dlls()
import mha_ep  # noqa: E402
from mha_ep.models.synthetic import bert_encoder, encoder_feeds  # noqa: E402

CUDA = "CUDAExecutionProvider"
dtype, seq = sys.argv[1], int(sys.argv[2])
model = bert_encoder(layers=12, dtype=dtype)
device_feeds = {k: cupy.asarray(v) for k, v in encoder_feeds(8, seq, dtype=dtype).items()}
session = mha_ep.InferenceSession(model, backend="cuda", providers=[CUDA, "CPUExecutionProvider"],
                                  device_mode="device")  # fmt: skip
runner = session.device_runner


def call():
    session.run_device(None, device_feeds)
    runner.stream.synchronize()


# ---------------------------------------------------------------------------------------- 1. replay segments
for _ in range(3):
    call()
entry = next(e for e in runner.graphs.entries.values() if e is not None)
marks = {}


class TimedGraph:
    def __init__(self, graph):
        self.graph = graph

    def launch(self, stream):
        marks["launch"] = time.perf_counter()
        self.graph.launch(stream)
        marks["launched"] = time.perf_counter()


entry.graph = TimedGraph(entry.graph)
segments = collections.defaultdict(list)
for i in range(300):
    t0 = time.perf_counter()
    session.run_device(None, device_feeds)
    t1 = time.perf_counter()
    runner.stream.synchronize()
    t2 = time.perf_counter()
    if i >= 20:
        segments["before the launch"].append(marks["launch"] - t0)
        segments["launch"].append(marks["launched"] - marks["launch"])
        segments["after the launch"].append(t1 - marks["launched"])
        segments["wait"].append(t2 - t1)
        segments["whole call"].append(t2 - t0)
print(f"## graph replay, {dtype} S={seq}: medians of 280 calls")
for name, values in segments.items():
    print(f"{name:18s} {statistics.median(values) * 1e6:8.1f} us")
start, end, gpu = cupy.cuda.Event(), cupy.cuda.Event(), []
for _ in range(50):
    start.record(runner.stream)
    entry.graph.graph.launch(runner.stream)
    end.record(runner.stream)
    end.synchronize()
    gpu.append(cupy.cuda.get_elapsed_time(start, end))
print(f"{'graph on the GPU':18s} {statistics.median(gpu) * 1e3:8.1f} us (CUDA events)")
entry.graph = entry.graph.graph

# ------------------------------------------------------------------------------------------ 2. kernels (CUPTI)
try:
    import torch
    from torch.profiler import ProfilerActivity, profile
except ImportError:
    sys.exit("torch is not installed: no per-kernel profile")

stock = ort.InferenceSession(model.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
binding = stock.io_binding()
for name, array in device_feeds.items():
    binding.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
for output in stock.get_outputs():
    binding.bind_output(output.name, "cuda", 0)


def stock_call():
    stock.run_with_iobinding(binding)
    binding.synchronize_outputs()


def kernels(label, run, runs=10):
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        by_name[event.name[:90]][0] += 1
        by_name[event.name[:90]][1] += event.device_time
    total = sum(us for _, us in by_name.values()) / runs
    print(f"\n## {label}: kernels {total:.0f} us in {len(events) / runs:.0f} launches per call")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"{us / runs:8.1f} us {count / runs:5.1f}x  {name}")
    return sorted(events, key=lambda e: e.time_range.start)


runner.graphs_enabled = False
ours = kernels("mha_ep device mode, eager", call)
kernels("stock ORT CUDA, IOBinding", stock_call)
print("\nmha_ep's first layer, in launch order (us):")
for event in ours[:12]:
    print(f"{event.device_time:7.2f}  {event.name[:100]}")
