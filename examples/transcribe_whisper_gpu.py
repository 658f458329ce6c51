"""Transcribe speech with Whisper tiny.en on the GPU through the fastest loop mha_ep has, greedy and with 5 beams,
and check the tokens against stock ONNX Runtime's loops on the CPU.

The decoder-with-past is rewritten into its static-cache form (``mha-ep static-cache``: a (1, N, 448, H) KV buffer
bound as both past and present, ``past_sequence_length`` on the device), so each step is one replay of ORT's CUDA
graph (the claimed attention nodes read the length on the device) plus one kernel that chooses the tokens; the host
reads the tokens at the end (mha_ep/decode/static_decode.py). Beam search keeps the buffer in place and follows
the beams through ``cache_indirection``.

Set-up (a GPU machine): pip install -e '.[gpu,models]' and build the models once:
    python -m mha_ep.models.build whisper --which tiny-en --dtype fp32
Run (wavs: 16 kHz mono; default the three utterances shipped in the top-level models/ folder):
    python examples/transcribe_whisper_gpu.py [my.wav ...]
"""

import argparse
import sys
import time
from pathlib import Path

from mha_ep.decode import audio
from mha_ep.models.export import default_out_dir
from mha_ep.models.whisper_transcribe import (
    BeamTranscriber,
    StaticTranscriber,
    Transcriber,
    model_paths,
    stock_session_factory,
    suppress_lists,
    tokenizer,
)

parser = argparse.ArgumentParser()
parser.add_argument("wavs", nargs="*", type=Path)
parser.add_argument("--beams", type=int, default=5, help="beams of the beam-search pass (0: greedy only)")
args = parser.parse_args()

wavs = args.wavs or [audio.DEFAULT_DIR / name for name in audio.UTTERANCES]
try:
    paths = model_paths(default_out_dir(), dtype="fp32")  # encoder, decoder_init, decoder
except FileNotFoundError as missing:  # not built yet: the message says how
    sys.exit(f"{Path(__file__).name}: {missing}")
suppress, suppress_begin = suppress_lists()
tok = tokenizer()

loops = {"greedy": (Transcriber(paths, stock_session_factory, suppress, suppress_begin),  # stock ORT, CPU, NumPy
                    StaticTranscriber(paths, suppress, suppress_begin))}
if args.beams:
    loops[f"{args.beams} beams"] = (BeamTranscriber(paths, stock_session_factory, suppress, suppress_begin,
                                                    beams=args.beams),
                                    StaticTranscriber(paths, suppress, suppress_begin, beams=args.beams))
for wav in wavs:
    features = audio.features_for([wav])  # (1, 80, 3000) log-mel, NumPy
    print(wav.name)
    for name, (stock, on_gpu) in loops.items():
        on_gpu.decode(features)  # the first call captures the decoder's CUDA graph
        start = time.perf_counter()
        ours = on_gpu.decode(features)[0]
        elapsed = time.perf_counter() - start
        theirs = stock.decode(features)[0]
        print(f"  {name:8s} stock ORT (CPU): {tok.decode(theirs).strip()}\n"
              f"  {name:8s} mha_ep (GPU)   : {tok.decode(ours).strip()}\n"
              f"  {name:8s} same tokens: {ours == theirs}; {1e3 * elapsed:.1f} ms for {len(ours)} tokens, encoder "
              f"included")
