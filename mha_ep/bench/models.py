"""``mha-ep bench models``: whole models, host to host, plugin vs stock ORT (CPU, and CUDA when present).

Rows: the shipped random-weight BERT and Whisper-shaped models (always there), and the real-weight MiniLM (S = 128 and 512) and
Whisper tiny.en (decode step with a 447-token past, encoder on 30 s of audio) when they were built into
``--models-dir`` (``python -m mha_ep.models.build ...``; a missing one is listed with the command that builds it).
Feeds are random but valid for each model (mha_ep/feeds.py). Times are medians in ms per ``session.run``; the
error column is the worst output error of the plugin against stock ORT CPU (relative to max(1, |x|)), so a fast
but wrong row shows.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx

from mha_ep.bench.gpu import ort_cuda_available
from mha_ep.bench.output import add_output_options, emit
from mha_ep.bench.timer import median_seconds
from mha_ep.comparison import errors
from mha_ep.feeds import random_feeds
from mha_ep.models.export import default_out_dir
from mha_ep.models.manifest import DEFAULT_DIR


@dataclass(frozen=True)
class ModelRow:
    label: str
    file: str
    dims: dict
    shipped: bool = False
    build: str = ""


ROWS = (
    ModelRow("BERT random-weight (shipped), B=8 S=128, 2D mask", "bert_random_mask2d_fp32.onnx", {"batch": 8, "sequence": 128}, True),
    ModelRow("Whisper-shaped random-weight decoder (shipped), past 63", "whisper_random_decoder_fp32.onnx",
             {"batch": 1, "past_decode_len": 63}, True),  # fmt: skip
    ModelRow("Whisper-shaped random-weight encoder (shipped), B=4", "whisper_random_encoder_fp32.onnx", {"batch": 4}, True),
    ModelRow("MiniLM B=8 S=128, 2D mask", "minilm_mask2d_fp32.onnx", {"batch": 8, "sequence": 128},
             build="python -m mha_ep.models.build bert --which minilm"),  # fmt: skip
    ModelRow("MiniLM B=8 S=512, 2D mask", "minilm_mask2d_fp32.onnx", {"batch": 8, "sequence": 512},
             build="python -m mha_ep.models.build bert --which minilm"),  # fmt: skip
    ModelRow("Whisper tiny.en decode step, past 447", "whisper_tiny_en_decoder_fp32.onnx",
             {"batch": 1, "past_decode_len": 447}, build="python -m mha_ep.models.build whisper --which tiny-en"),
    ModelRow("Whisper tiny.en encoder, B=1 (30 s)", "whisper_tiny_en_encoder_fp32.onnx", {"batch": 1},
             build="python -m mha_ep.models.build whisper --which tiny-en"),  # fmt: skip
)


def bench_row(row: ModelRow, path: Path, backend: str, device_id: int, repeats: int) -> dict:
    import onnxruntime as ort

    import mha_ep

    model = onnx.load(str(path))
    feeds = random_feeds(model, seed=0, dims=row.dims)
    plugin = mha_ep.InferenceSession(model, backend=backend, device_id=device_id)
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    result = {"label": row.label, "file": row.file, "dims": row.dims, "claimed": plugin.partition.claimed,
              "declined": plugin.partition.declined}  # fmt: skip
    ours, theirs = plugin.run(None, feeds), stock.run(None, feeds)
    result["max_rel_error"] = max(errors(a, b)[1] for a, b in zip(ours, theirs))
    result["plugin_ms"] = median_seconds(lambda: plugin.run(None, feeds), repeats) * 1e3
    result["ort_cpu_ms"] = median_seconds(lambda: stock.run(None, feeds), repeats) * 1e3
    result["ort_cuda_ms"] = None
    if ort_cuda_available():
        gpu = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
        result["ort_cuda_ms"] = median_seconds(lambda: gpu.run(None, feeds), repeats) * 1e3
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                        help="where the plugin's claimed nodes run: cuda (CuPy), reference (NumPy), auto (cuda when usable)")  # fmt: skip
    parser.add_argument("--device-id", type=int, default=0, help="GPU for the cuda backend (default 0)")
    parser.add_argument("--repeats", "--repeat", type=int, default=10, help="timed runs per model and session (median; default 10)")
    parser.add_argument("--models-dir", default=str(default_out_dir()),
                        help="where the real models were built (the builder's default: $MHA_EP_CACHE, else "
                             "$XDG_CACHE_HOME/mha_ep/models, else ~/.cache/mha_ep/models)")  # fmt: skip
    parser.add_argument("--shipped-only", action="store_true", help="only the models shipped in the package")
    add_output_options(parser, out_help="also write the rows into this folder as bench_models.json")
    args = parser.parse_args(argv)

    rows = [r for r in ROWS if r.shipped or not args.shipped_only]
    results, not_built = [], []
    print(f"| model | MHA claimed | plugin ({args.backend}) ms | ORT CPU ms | ORT CUDA ms | max rel err vs ORT CPU |")
    print("|---|---|---|---|---|---|")
    for index, row in enumerate(rows, 1):
        path = (DEFAULT_DIR if row.shipped else Path(args.models_dir)) / row.file
        print(f"[{index}/{len(rows)}] {row.label}", file=sys.stderr, flush=True)
        if not path.exists():
            print(f"| {row.label} | not built: `{row.build}` | | | | |")
            not_built.append({"label": row.label, "file": row.file, "build": row.build})
            continue
        r = bench_row(row, path, args.backend, args.device_id, args.repeats)
        results.append(r)
        cuda = "–" if r["ort_cuda_ms"] is None else f"{r['ort_cuda_ms']:.2f}"
        print(f"| {row.label} | {r['claimed']}/{r['claimed'] + r['declined']} | {r['plugin_ms']:.2f} "
              f"| {r['ort_cpu_ms']:.2f} | {cuda} | {r['max_rel_error']:.1e} |", flush=True)  # fmt: skip
    data = {"backend": args.backend, "rows": results, "not_built": not_built}
    emit(args, "bench_models.json", data)
    return 0


if __name__ == "__main__":
    from mha_ep.bench import main as bench_main

    sys.exit(bench_main(["models", *sys.argv[1:]]))
