"""Where a repeated-shape call of ``mha_ep.InferenceSession`` under ORT's CUDA graph loses to device mode.

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/profile_session_graph.py [--repeats 15]

Per BERT-base row, five calls timed in turns (medians, ms), each ending when its outputs are ready:
  A  stock ORT CUDA, enable_cuda_graph, inputs and outputs bound at fixed addresses (its graph replayed)
  B  a plain ORT session on the native route, the same binding and graph (the native op inside ORT's graph)
  C  mha_ep.InferenceSession with enable_cuda_graph, run_device on CuPy feeds (cuda_io: copies in and out)
  C' the same session's ORT call alone (the replay inside C, timed around run_with_iobinding)
  D  device mode, run_device (its whole-call graph)
B - A is the native op against stock's attention inside ORT's graph, C - B what cuda_io adds around the replay,
D - B a whole-call graph of our own against ORT's graph with the native op's launches in it.
"""

from __future__ import annotations

import argparse
import time

import cupy
import onnxruntime as ort

import mha_ep
from mha_ep.bench.native import bound_call, output_values
from mha_ep.bench.timer import paired_medians
from mha_ep.models.synthetic import bert_encoder, encoder_feeds

CUDA = "CUDAExecutionProvider"
GRAPH = [(CUDA, {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ort.preload_dlls()
    print("| row | A stock graph | B native op in ORT graph | C session graph run_device | C' its ORT call | D device mode "
          "| C - C' µs | C / D |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, sequence, dtype in ((8, 128, "float32"), (8, 128, "float16"), (8, 512, "float16"), (1, 32, "float32")):
        model = bert_encoder(dtype=dtype)
        feeds = encoder_feeds(batch, sequence, dtype=dtype)
        device_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
        stock = ort.InferenceSession(model.SerializeToString(), providers=GRAPH)
        options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
        plain = ort.InferenceSession(mha_ep.partition(model, route="native").model.SerializeToString(), options,
                                     providers=GRAPH)
        calls = []
        for session in (stock, plain):
            _, values = output_values(session, feeds)
            calls.append(bound_call(session, device_feeds, values))
        graphed = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPH)
        inner = []
        original = graphed._run_binding

        def timed_binding(binding, run_options):
            start = time.perf_counter()
            original(binding, run_options)
            inner.append(time.perf_counter() - start)

        graphed.cuda_io._run = timed_binding

        def session_call():
            graphed.run_device(None, device_feeds)
            cupy.cuda.get_current_stream().synchronize()

        device = mha_ep.InferenceSession(model, backend="cuda", providers=[CUDA, "CPUExecutionProvider"],
                                         device_mode="device")

        def device_call():
            device.run_device(None, device_feeds)
            device.device_runner.stream.synchronize()

        calls += [session_call, device_call]
        a, b, c, d = (s * 1e3 for s in paired_medians(calls, args.repeats, warmup=4))
        tail = sorted(inner[-args.repeats:])
        inside = tail[len(tail) // 2] * 1e3
        print(f"| BERT-base B={batch} S={sequence} {dtype} | {a:.3f} | {b:.3f} | {c:.3f} | {inside:.3f} | {d:.3f} "
              f"| {(c - inside) * 1e3:.0f} | {c / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
