"""``mha-ep bench device``: whole models on the GPU, device-resident mode against stock ORT CUDA, in one run.

Columns (median ms per call, every variant timed in turns, ``--repeats`` rounds; a call ends when its outputs
are ready: on the host for numpy feeds, after a stream synchronize for device feeds):
  ort_numpy       stock ORT CUDA, ``session.run`` with numpy feeds
  ort_iobinding   stock ORT CUDA, inputs and outputs bound on the GPU (IOBinding)
  ort_graph       stock ORT CUDA with ``enable_cuda_graph=1`` (inputs and outputs bound at fixed addresses)
  bridge          mha_ep through the onnxruntime-extensions op, ORT CUDA around it (host copies per node)
  dev_numpy       mha_ep device mode, numpy feeds, whole-call graphs off
  dev_feeds       mha_ep device mode, CuPy feeds and outputs (``run_device``), graphs off
  dev_graph       mha_ep device mode, numpy feeds, whole-call graphs on
  dev_graph_feeds mha_ep device mode, CuPy feeds and outputs, graphs on
and the worst output error of device mode against stock ORT CUDA (relative to max(1, |x|)).

Rows: the BERT-base-sized encoder of mha_ep/models/synthetic.py (12 layers, hidden 768, 12 heads, (B, S) key
padding mask) at B=8, S=128 and 512, float32 and float16; real MiniLM and Whisper tiny.en rows when their models
were built into ``--models-dir``.
FLOP model of the encoder (reported as TFLOP/s of dev_graph): 2·B·S·(4D² + 2·D·F) per layer for the
projections and FFN plus 4·B·N·S²·H for attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from mha_ep.bench.timer import paired_medians

CUDA = "CUDAExecutionProvider"
COLUMNS = ("ort_numpy", "ort_iobinding", "ort_graph", "bridge", "dev_numpy", "dev_feeds", "dev_graph",
           "dev_graph_feeds")  # fmt: skip


@dataclass(frozen=True)
class EncoderRow:
    batch: int
    sequence: int
    dtype: str
    layers: int = 12

    @property
    def label(self) -> str:
        return f"BERT-base encoder B={self.batch} S={self.sequence} {self.dtype} 2D mask"

    def flops(self, hidden: int = 768, ffn: int = 3072, heads: int = 12) -> float:
        tokens = self.batch * self.sequence
        dense = 2 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
        attention = 4 * self.batch * heads * self.sequence * self.sequence * (hidden // heads)
        return float(self.layers * (dense + attention))


ENCODER_ROWS = tuple(EncoderRow(8, s, d) for s in (128, 512) for d in ("float32", "float16"))


def time_in_turns(calls: Dict[str, Callable[[], None]], repeats: int, slow: tuple = ("bridge",)) -> Dict[str, float]:
    """Median seconds per call of each callable, all timed in turns (timer.paired_medians); the ``slow`` ones
    (the bridge: 40-150 ms a call) in at most 5 rounds of their own, right after."""
    fast = [name for name in calls if name not in slow]
    medians = dict(zip(fast, paired_medians([calls[name] for name in fast], repeats)))
    rest = [name for name in calls if name in slow]
    medians.update(zip(rest, paired_medians([calls[name] for name in rest], min(repeats, 5))))
    return medians


def max_rel_error(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e) / np.maximum(1.0, np.abs(e))))


def stock_calls(model_bytes: bytes, feeds: dict, device_feeds: dict, output: str, sess_options=None) -> dict:
    """ort_numpy, ort_iobinding and ort_graph calls of stock ORT CUDA, and its output for the error column."""
    import onnxruntime as ort

    plain = ort.InferenceSession(model_bytes, sess_options, providers=[CUDA, "CPUExecutionProvider"])
    if CUDA not in plain.get_providers():
        raise RuntimeError("stock ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    calls = {"ort_numpy": lambda: plain.run(None, feeds)}

    def bound(session):
        binding = session.io_binding()
        for name, array in device_feeds.items():
            binding.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
        binding.bind_output(output, "cuda", 0)
        return binding

    io = bound(plain)

    def iobinding():
        plain.run_with_iobinding(io)
        io.synchronize_outputs()

    calls["ort_iobinding"] = iobinding
    graph = ort.InferenceSession(model_bytes, sess_options, providers=[(CUDA, {"enable_cuda_graph": "1"}),
                                                                       "CPUExecutionProvider"])  # fmt: skip
    gio = graph.io_binding()
    for name, array in device_feeds.items():
        gio.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
    out = ort.OrtValue.ortvalue_from_shape_and_type(list(plain.run(None, feeds)[0].shape),
                                                    feeds[next(iter(feeds))].dtype.type, "cuda", 0)  # fmt: skip
    gio.bind_ortvalue_output(output, out)

    def graphed():
        graph.run_with_iobinding(gio)
        gio.synchronize_outputs()

    calls["ort_graph"] = graphed
    return calls, plain.run(None, feeds)[0]


def bench_encoder(row: EncoderRow, repeats: int) -> dict:
    import cupy

    import mha_ep
    from mha_ep.models.synthetic import bert_encoder, encoder_feeds

    model = bert_encoder(layers=row.layers, dtype=row.dtype)
    model_bytes = model.SerializeToString()
    feeds = encoder_feeds(row.batch, row.sequence, dtype=row.dtype)
    device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
    calls, stock_out = stock_calls(model_bytes, feeds, device_feeds, "last_hidden_state")
    providers = [CUDA, "CPUExecutionProvider"]
    device = mha_ep.InferenceSession(model, backend="cuda", providers=providers, device_mode="device")
    runner = device.device_runner
    bridge = mha_ep.InferenceSession(model, backend="cuda", providers=providers, device_mode="bridge")
    calls["bridge"] = lambda: bridge.run(None, feeds)

    def with_graphs(enabled: bool, call):
        def wrapped():
            runner.graphs_enabled = enabled
            call()

        return wrapped

    def on_device():
        device.run_device(None, device_feeds)
        runner.stream.synchronize()

    calls["dev_numpy"] = with_graphs(False, lambda: device.run(None, feeds))
    calls["dev_feeds"] = with_graphs(False, on_device)
    calls["dev_graph"] = with_graphs(True, lambda: device.run(None, feeds))
    calls["dev_graph_feeds"] = with_graphs(True, on_device)
    ours = device.run(None, feeds)[0]
    medians = time_in_turns(calls, repeats)
    replayed = sum(entry is not None for entry in runner.graphs.entries.values())
    runner.graphs_enabled = True
    result = {"label": row.label, "mode": device.mode, "steps": runner.plan.describe().splitlines()[0],
              "graphs_captured": replayed, "max_rel_error_vs_ort_cuda": max_rel_error(ours, stock_out),
              "graph_error_vs_ort_cuda": max_rel_error(device.run(None, feeds)[0], stock_out),
              "tflops_dev_graph": row.flops() / medians["dev_graph"] / 1e12}  # fmt: skip
    result.update({f"{name}_ms": seconds * 1e3 for name, seconds in medians.items()})
    return result


def format_row(r: dict) -> str:
    """The row's medians, then the ratios the targets are read from: device mode (graphs on, its default) against
    stock ORT CUDA with numpy feeds, device feeds against IOBinding, graphs against ORT's graph, bridge / device."""
    cells = [f"{r.get(f'{c}_ms', float('nan')):.2f}" for c in COLUMNS]
    ratios = (r["dev_graph_ms"] / r["ort_numpy_ms"], r["dev_graph_feeds_ms"] / r["ort_iobinding_ms"],
              r["dev_graph_feeds_ms"] / r["ort_graph_ms"], r["bridge_ms"] / r["dev_graph_ms"])  # fmt: skip
    return (f"| {r['label']} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.2f}" for x in ratios)
            + f" | {r['max_rel_error_vs_ort_cuda']:.1e} |")  # fmt: skip


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench device", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10, help="rounds of calls timed in turns (median of each)")
    parser.add_argument("--only", default="", help="only rows whose label contains this text")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (12: BERT-base)")
    parser.add_argument("--out", help="folder for bench_device.json")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object on stdout (the table goes to stderr)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    rows = [EncoderRow(r.batch, r.sequence, r.dtype, args.layers) for r in ENCODER_ROWS if args.only in r.label]
    print("| row | " + " | ".join(COLUMNS) + " | dev_graph/ort_numpy | dev_graph_feeds/ort_iobinding "
          "| dev_graph_feeds/ort_graph | bridge/dev_graph | err vs ORT CUDA |")  # fmt: skip
    print("|---|" + "---|" * (len(COLUMNS) + 5))
    results = []
    for index, row in enumerate(rows, 1):
        print(f"[{index}/{len(rows)}] {row.label}", file=sys.stderr, flush=True)
        result = bench_encoder(row, args.repeats)
        results.append(result)
        print(format_row(result), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_device.json").write_text(json.dumps(results, indent=2))
    if args.json:
        from mha_ep.bench.output import print_json

        print_json({"rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
