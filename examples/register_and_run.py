"""Run a model with mha_ep registered in your own onnxruntime.InferenceSession.

    python examples/register_and_run.py [model.onnx]     (default: the shipped small BERT)
"""

import sys

import onnxruntime

import mha_ep
import mha_ep.feeds
from mha_ep.models import manifest

entry = manifest.entries()["bert_random_mask2d_fp32.onnx"]
path = sys.argv[1] if len(sys.argv) > 1 else manifest.model_path(entry)

# 1. Partition: claimed MultiHeadAttention nodes move to the mha_ep domain; the report says why any was declined.
result = mha_ep.partition(path)
print(result.report())

# 2. Register the plugin on the SessionOptions ("auto": the GPU when CuPy sees one, else the NumPy reference).
options = mha_ep.register(onnxruntime.SessionOptions(), backend="auto")
session = onnxruntime.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])

# 3. Run it like any ORT session.
feeds = manifest.make_feeds(entry, seed=0) if len(sys.argv) == 1 else mha_ep.feeds.random_feeds(result.model)
outputs = session.run(None, feeds)
for meta, value in zip(session.get_outputs(), outputs):
    print(f"{meta.name}: shape {value.shape}, dtype {value.dtype}, mean {value.mean():.5f}")

# mha_ep.InferenceSession does steps 1-2 in one call and raises mha_ep.MhaRunError when a claimed node fails.
same = mha_ep.InferenceSession(path, backend="auto").run(None, feeds)
print("mha_ep.InferenceSession gives the same result:", all((a == b).all() for a, b in zip(outputs, same)))
