"""``mha-ep bench device``: whole models on the GPU, ``mha_ep.InferenceSession`` against stock ORT CUDA, in one run.

Columns (median ms per call, every variant timed in turns, ``--repeats`` rounds; a call ends when its outputs
are ready: on the host for numpy feeds, after a stream synchronize for device feeds):
  ort_numpy       stock ORT CUDA, ``session.run`` with numpy feeds
  ort_iobinding   stock ORT CUDA, inputs and outputs bound on the GPU (IOBinding)
  ort_graph       stock ORT CUDA with ``enable_cuda_graph=1`` (inputs and outputs bound at fixed addresses)
  ort_graph_numpy the same graph fed from NumPy: each feed copied into its bound buffer (``cupy.ndarray.set``), the
                  replay, each output copied back (``OrtValue.numpy``): the host copies a NumPy caller pays
  python_op       mha_ep through the onnxruntime-extensions op, ORT CUDA around it (host copies per node)
  nat_numpy       mha_ep.InferenceSession (one ORT session, native route), ``run`` with NumPy feeds
  nat_feeds       the same, ``run_device`` with CuPy feeds and outputs
  nat_graph       the same with ORT's ``enable_cuda_graph``, ``run`` with NumPy feeds
  nat_graph_feeds the same, ``run_device``
and the worst output error of the session against stock ORT CUDA (relative to max(1, |x|)), eager and under
ORT's graph. (Device-resident mode, whose four dev_* columns stood here, was retired on 2026-12-04: the graph
columns matched or beat it on every row, docs/BENCH.md section 8.)

Rows: the BERT-base-sized encoder of mha_ep/models/synthetic.py (12 layers, hidden 768, 12 heads, (B, S) key
padding mask) at B=8, S=128 and 512, float32 and float16, B=1 S=32 float32 and B=32 S=128 float16; real MiniLM and Whisper tiny.en rows when their models
were built into ``--models-dir``.
FLOP model of the encoder (reported as TFLOP/s of nat_graph_feeds): 2·B·S·(4D² + 2·D·F) per layer for the
projections and FFN plus 4·B·N·S²·H for attention.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from mha_ep.bench.timer import paired_medians

CUDA = "CUDAExecutionProvider"
COLUMNS = ("ort_numpy", "ort_iobinding", "ort_graph", "ort_graph_numpy", "python_op", "nat_numpy", "nat_feeds",
           "nat_graph", "nat_graph_feeds")  # fmt: skip
# the ratios a row prints after its columns, (numerator, denominator): the targets are read from them
RATIOS = (("nat_numpy", "ort_numpy"), ("nat_feeds", "ort_iobinding"), ("nat_graph_feeds", "ort_graph"),
          ("nat_graph", "ort_graph_numpy"), ("python_op", "nat_numpy"))  # fmt: skip


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


ENCODER_ROWS = tuple(EncoderRow(8, s, d) for s in (128, 512) for d in ("float32", "float16")) + (
    EncoderRow(1, 32, "float32"), EncoderRow(32, 128, "float16"))


def time_in_turns(calls: Dict[str, Callable[[], None]], repeats: int, slow: tuple = ("python_op",)) -> Dict[str, float]:
    """Median seconds per call of each callable, all timed in turns (timer.paired_medians); the ``slow`` ones
    (the bridge, whose calls take far longer; docs/bench/HISTORY.md, section 3) in at most 5 rounds of their own,
    right after."""
    fast = [name for name in calls if name not in slow]
    medians = dict(zip(fast, paired_medians([calls[name] for name in fast], repeats)))
    rest = [name for name in calls if name in slow]
    medians.update(zip(rest, paired_medians([calls[name] for name in rest], min(repeats, 5))))
    return medians


def max_rel_error(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e) / np.maximum(1.0, np.abs(e))))


def stock_calls(model_bytes: bytes, feeds: dict, device_feeds: dict, sess_options=None) -> tuple:
    """The ort_numpy, ort_iobinding and ort_graph calls of stock ORT CUDA (every output bound on the GPU), and its
    outputs for the error column."""
    import cupy
    import onnxruntime as ort

    plain = ort.InferenceSession(model_bytes, sess_options, providers=[CUDA, "CPUExecutionProvider"])
    if CUDA not in plain.get_providers():
        raise RuntimeError("stock ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    names = [o.name for o in plain.get_outputs()]
    expected = plain.run(None, feeds)

    def binding(session, fixed_outputs: bool):
        io = session.io_binding()
        for name, array in device_feeds.items():
            io.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
        for name, value in zip(names, expected):
            if fixed_outputs:  # ORT's graph replays need every output at a fixed address
                io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_shape_and_type(
                    list(value.shape), value.dtype.type, "cuda", 0))  # fmt: skip
            else:
                io.bind_output(name, "cuda", 0)
        return io

    def timed(session, io):
        def call():
            session.run_with_iobinding(io)
            io.synchronize_outputs()

        return call

    calls = {"ort_numpy": lambda: plain.run(None, feeds), "ort_iobinding": timed(plain, binding(plain, False))}
    try:
        graph = ort.InferenceSession(model_bytes, sess_options, providers=[(CUDA, {"enable_cuda_graph": "1"}),
                                                                           "CPUExecutionProvider"])  # fmt: skip
    except Exception as error:  # noqa: BLE001 - ORT refuses graphs when a node runs on the CPU: no such column
        print(f"  (stock ORT's CUDA graph refused: {str(error).splitlines()[0][:160]})", file=sys.stderr)
    else:
        fixed = binding(graph, True)
        calls["ort_graph"] = timed(graph, fixed)

        def graph_numpy():
            for name, array in device_feeds.items():
                array.set(feeds[name])
            cupy.cuda.get_current_stream().synchronize()  # ORT's stream does not wait for copies on this one
            graph.run_with_iobinding(fixed)
            [value.numpy() for value in fixed.get_outputs()]

        calls["ort_graph_numpy"] = graph_numpy
    return calls, expected


def bench_model(label: str, model, feeds: dict, repeats: int, flops: Optional[float] = None,
                skip: tuple = ()) -> dict:  # fmt: skip
    """Every column of one model with ``feeds`` (module docstring), but those in ``skip``."""
    import cupy

    import mha_ep

    device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
    calls, expected = stock_calls(model.SerializeToString(), feeds, device_feeds)
    providers = [CUDA, "CPUExecutionProvider"]
    try:
        if "python_op" not in skip:
            bridge = mha_ep.InferenceSession(model, backend="cuda", providers=providers, route="python-op")
            calls["python_op"] = lambda: bridge.run(None, feeds)
    except ImportError as error:  # onnxruntime-extensions missing: no python_op column
        print(f"  (no python_op column: {error})", file=sys.stderr)
    plain = mha_ep.InferenceSession(model, backend="cuda", providers=providers)
    graphed = mha_ep.InferenceSession(model, backend="cuda",
                                      providers=[(CUDA, {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])

    def on_device(session):
        def call():
            session.run_device(None, device_feeds)
            cupy.cuda.get_current_stream().synchronize()

        return call

    calls["nat_numpy"] = lambda: plain.run(None, feeds)
    calls["nat_feeds"] = on_device(plain)
    if graphed.cuda_io is not None and graphed.cuda_io.graphs:
        calls["nat_graph"] = lambda: graphed.run(None, feeds)
        calls["nat_graph_feeds"] = on_device(graphed)
    eager = plain.run(None, feeds)
    medians = time_in_turns({name: call for name, call in calls.items() if name not in skip}, repeats)
    replayed = graphed.run(None, feeds)
    result = {
        "label": label, "mode_reason": plain.mode_reason, "graph_mode_reason": graphed.mode_reason,
        "max_rel_error_vs_ort_cuda": max(max_rel_error(a, e) for a, e in zip(eager, expected)),
        "graph_error_vs_ort_cuda": max(max_rel_error(a, e) for a, e in zip(replayed, expected)),
    }  # fmt: skip
    if flops and "nat_graph_feeds" in medians:
        result["tflops_nat_graph_feeds"] = flops / medians["nat_graph_feeds"] / 1e12
    result.update({f"{name}_ms": seconds * 1e3 for name, seconds in medians.items()})
    return result


def bench_encoder(row: EncoderRow, repeats: int, skip: tuple = ()) -> dict:
    from mha_ep.models.synthetic import bert_encoder, encoder_feeds

    model = bert_encoder(layers=row.layers, dtype=row.dtype)
    return bench_model(row.label, model, encoder_feeds(row.batch, row.sequence, dtype=row.dtype), repeats,
                       row.flops(), skip)  # fmt: skip


def bench_real(row, models_dir: Path, repeats: int, skip: tuple = ()) -> Optional[dict]:
    """A real-weight row of bench/models.py (MiniLM, Whisper tiny.en), or None when its model was not built."""
    import onnx

    from mha_ep.feeds import random_feeds

    path = Path(models_dir) / row.file
    if not path.exists():
        return None
    model = onnx.load(str(path))
    return bench_model(row.label, model, random_feeds(model, seed=0, dims=row.dims), repeats, skip=skip)


def plot(results: list, path: Path) -> bool:
    """Bars of every column per row (ms, log scale) into ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(12, 0.9 + 0.75 * len(results)))
    height = 0.8 / len(COLUMNS)
    for index, column in enumerate(COLUMNS):
        values = [r.get(f"{column}_ms", np.nan) for r in results]
        axes.barh([i + index * height for i in range(len(results))], values, height, label=column)
    axes.set_yticks([i + 0.4 - height / 2 for i in range(len(results))], [r["label"] for r in results], fontsize=8)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("ms per call (median, timed in turns); lower is better")
    axes.legend(fontsize=7, ncols=len(COLUMNS), loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(results)))
    axes.set_title("mha_ep.InferenceSession vs stock ORT CUDA, whole models")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def format_row(r: dict) -> str:
    """The row's medians, then RATIOS: the session against stock ORT CUDA with NumPy feeds, device feeds against
    IOBinding, ORT's graph with device feeds and with NumPy feeds, and the bridge against the session."""
    cells = [f"{r.get(f'{c}_ms', float('nan')):.2f}" for c in COLUMNS]

    def ms(column: str) -> float:
        return r.get(f"{column}_ms", float("nan"))

    ratios = [ms(top) / ms(bottom) for top, bottom in RATIOS]
    return (f"| {r['label']} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.2f}" for x in ratios)
            + f" | {r['max_rel_error_vs_ort_cuda']:.1e} |")  # fmt: skip


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench device", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10, help="rounds of calls timed in turns (median of each)")
    parser.add_argument("--only", default="", help="only rows whose label contains this text")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (12: BERT-base)")
    parser.add_argument("--skip", default="", help="comma-separated columns not to time (e.g. python_op,ort_numpy)")
    parser.add_argument("--rows", choices=("all", "encoder", "real"), default="all",
                        help="the synthetic BERT-base encoder rows, the real-weight rows, or both")
    parser.add_argument("--models-dir", default=None,
                        help="where the real MiniLM / Whisper tiny.en models were built (default: the builder's "
                             "folder); a row whose model is missing is skipped with the command that builds it")
    parser.add_argument("--out", help="folder for bench_device.json and bench_device.png")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object on stdout (the table goes to stderr)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    rows = [EncoderRow(r.batch, r.sequence, r.dtype, args.layers) for r in ENCODER_ROWS
            if args.only in r.label and args.rows != "real"]  # fmt: skip
    print("| row | " + " | ".join(COLUMNS) + " | " + " | ".join(f"{a}/{b}" for a, b in RATIOS)
          + " | err vs ORT CUDA |")  # fmt: skip
    print("|---|" + "---|" * (len(COLUMNS) + len(RATIOS) + 1))
    from mha_ep.bench.models import ROWS as MODEL_ROWS
    from mha_ep.models.export import default_out_dir

    real = [r for r in MODEL_ROWS if not r.shipped and args.only in r.label and args.rows != "encoder"]
    models_dir = Path(args.models_dir) if args.models_dir else default_out_dir()
    results = []
    total = len(rows) + len(real)
    for index, row in enumerate(list(rows) + real, 1):
        print(f"[{index}/{total}] {row.label}", file=sys.stderr, flush=True)
        skip = tuple(c for c in args.skip.split(",") if c)
        result = bench_encoder(row, args.repeats, skip) if isinstance(row, EncoderRow) else bench_real(
            row, models_dir, args.repeats, skip)  # fmt: skip
        if result is None:
            print(f"| {row.label} | not built: `{row.build}` |", flush=True)
            continue
        results.append(result)
        print(format_row(result), flush=True)
    from mha_ep.bench.output import emit

    emit(args, "bench_device.json", {"rows": results})
    if args.out:
        plot(results, Path(args.out) / "bench_device.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
