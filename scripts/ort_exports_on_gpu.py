"""ORT's own Whisper exports (tests/fixtures/ort_exports/) on the GPU: each partitioned in the native form and run in a
plain ORT CUDA session with mha_ep.register(backend="cuda"), against stock ORT CPU on the same feeds (the GPU
machine's check of tests/models/test_ort_exports.py). Prints one line per model: claimed nodes, worst error."""

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

import mha_ep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ort_export_feeds import FIXTURES, feeds_for  # noqa: E402

ort.preload_dlls()
providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
for path in sorted(FIXTURES.glob("*.onnx")):
    feeds = feeds_for(path)
    stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in stock.get_outputs()]
    expected = stock.run(names, feeds)
    result = mha_ep.partition(str(path), route="native")
    options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
    ours = ort.InferenceSession(result.model.SerializeToString(), options, providers=providers)
    got = ours.run(names, feeds)
    worst = max((float(np.max(np.abs(g.astype(np.float64) - e) / np.maximum(1, np.abs(e)))) if g.size else 0.0)
                for g, e in zip(got, expected))  # fmt: skip
    print(f"{path.name}: {result.claimed} claimed, {result.declined} declined, route {mha_ep.route_of(options)}, "
          f"worst rel error vs stock ORT CPU {worst:.2e}", flush=True)
