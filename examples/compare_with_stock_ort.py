"""Compare the plugin against stock ONNX Runtime on a model, per output and per claimed node.

    python examples/compare_with_stock_ort.py [model.onnx]   (default: the shipped Whisper decoder with past)
"""

import sys

import mha_ep
from mha_ep.models import manifest

entry = manifest.entries()["whisper_random_decoder_fp32.onnx"]
if len(sys.argv) > 1:
    report = mha_ep.compare(sys.argv[1], per_node=True)  # random feeds that are valid for the model
else:
    report = mha_ep.compare(manifest.model_path(entry), feeds=manifest.make_feeds(entry), per_node=True)
print(report.text())
sys.exit(0 if report.passed else 1)
