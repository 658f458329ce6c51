"""Transcribe speech with Whisper tiny.en on the GPU, the whole greedy loop on the device, and check the tokens
against stock ONNX Runtime's loop.

The three sessions are ``mha_ep.InferenceSession`` objects on ORT's CUDA provider (one ORT session each; claimed
attention nodes run as mha_ep's native CUDA op). The encoder's output and the self- and cross-attention caches
stay in ORT values on the GPU and are bound as the next step's inputs; the token is chosen on the GPU, and each
step reads back only the chosen token (mha_ep/models/generate.py).

Set-up (a GPU machine): pip install -e '.[gpu,models]' and build the models once:
    python -m mha_ep.models.build whisper --which tiny-en --dtype fp32
Run (wavs: 16 kHz mono; default the three utterances shipped in the top-level models/ folder):
    python examples/transcribe_whisper_gpu.py [my.wav ...]
"""

import argparse
from pathlib import Path

import mha_ep
from mha_ep.models import audio
from mha_ep.models.export import default_out_dir
from mha_ep.models.whisper_transcribe import (
    DeviceTranscriber,
    Transcriber,
    model_paths,
    stock_session_factory,
    suppress_lists,
    tokenizer,
)

parser = argparse.ArgumentParser()
parser.add_argument("wavs", nargs="*", type=Path)
args = parser.parse_args()

wavs = args.wavs or [audio.DEFAULT_DIR / name for name in audio.UTTERANCES]
paths = model_paths(default_out_dir(), dtype="fp32")  # encoder, decoder_init, decoder
suppress, suppress_begin = suppress_lists()
tok = tokenizer()


def gpu_session(path):
    return mha_ep.InferenceSession(str(path), backend="cuda", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


stock = Transcriber(paths, stock_session_factory, suppress, suppress_begin)  # stock ORT, CPU, NumPy loop
on_gpu = DeviceTranscriber(paths, gpu_session, suppress, suppress_begin)
print("decoder session:", on_gpu.sessions["decoder"].mode_reason)
for wav in wavs:
    features = audio.features_for([wav])  # (1, 80, 3000) log-mel, NumPy
    seconds = []
    a, b = stock.decode(features)[0], on_gpu.decode(features, step_seconds=seconds)[0]
    per_token = 1e3 * sorted(seconds)[len(seconds) // 2] if seconds else float("nan")
    print(f"{wav.name}\n  stock ORT: {tok.decode(a).strip()}\n  mha_ep   : {tok.decode(b).strip()}\n"
          f"  same tokens: {a == b}; {per_token:.2f} ms per token (median step)")
