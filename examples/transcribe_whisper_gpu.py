"""Transcribe speech with Whisper tiny.en on the GPU through the fastest loop mha_ep has, greedy and with 5 beams,
and check the tokens against stock ONNX Runtime's loops on the CPU.

The decoder-with-past is rewritten into its static-cache form (``mha-ep static-cache``: a (1, N, 448, H) KV buffer
bound as both past and present, ``past_sequence_length`` on the device), so each step is one replay of ORT's CUDA
graph (the claimed attention nodes read the length on the device) plus one kernel that chooses the tokens; the host
reads the tokens at the end. ``mha_ep.generate_static`` is the loop for any static-cache decoder: you give it the
prompt's token ids and the decoder's other inputs (here the cross-attention keys and values the first decoder step
computes from the encoder's output), it steps the prompt into the cache and decodes. Beam search keeps the buffer in
place and follows the beams through ``cache_indirection``.

Set-up (a GPU machine): pip install -e '.[gpu,models]' and build the models once:
    python -m mha_ep.models.build whisper --which tiny-en --dtype fp32
Run (wavs: 16 kHz mono; default the three utterances shipped in the top-level models/ folder):
    python examples/transcribe_whisper_gpu.py [my.wav ...]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import mha_ep
from mha_ep.decode import audio
from mha_ep.graph.static_cache import static_cache
from mha_ep.models.export import default_out_dir
from mha_ep.models.whisper_transcribe import (
    EOT,
    NO_TIMESTAMPS,
    SOT,
    BeamTranscriber,
    Transcriber,
    model_paths,
    stock_session_factory,
    suppress_lists,
    tokenizer,
)

parser = argparse.ArgumentParser()
parser.add_argument("wavs", nargs="*", type=Path)
parser.add_argument("--beams", type=int, default=5, help="beams of the beam-search pass (0: greedy only)")
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

wavs = args.wavs or [audio.DEFAULT_DIR / name for name in audio.UTTERANCES]
try:
    paths = model_paths(default_out_dir(), dtype="fp32")  # encoder, decoder_init, decoder
except FileNotFoundError as missing:  # not built yet: the message says how
    sys.exit(f"{Path(__file__).name}: {missing}")
suppress, suppress_begin = suppress_lists()
tok = tokenizer()
PROMPT = [[SOT, NO_TIMESTAMPS]]

# The encoder and the first decoder step (the cross-attention keys and values): plain ORT CUDA sessions
cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
encoder = ort.InferenceSession(str(paths["encoder"]), providers=cuda)
first_step = ort.InferenceSession(str(paths["decoder_init"]), providers=cuda)
# The decoder, rewritten once per shape of loop: its buffers are bound once, so one StaticDecoder per batch x beams
decoders = {"greedy": mha_ep.StaticDecoder.from_model(static_cache(paths["decoder"], max_length=448, batch=1).model,
                                                      batch=1)}
stock = {"greedy": Transcriber(paths, stock_session_factory, suppress, suppress_begin)}  # stock ORT, CPU, NumPy
if args.beams:
    rewritten = static_cache(paths["decoder"], max_length=448, batch=args.beams, beams=args.beams).model
    decoders[f"{args.beams} beams"] = mha_ep.StaticDecoder.from_model(rewritten, batch=1, beams=args.beams)
    stock[f"{args.beams} beams"] = BeamTranscriber(paths, stock_session_factory, suppress, suppress_begin,
                                                   beams=args.beams)


def transcribe(decoder, features):
    states = encoder.run(None, {"input_features": features})[0]
    outputs = first_step.run(None, {"input_ids": np.array(PROMPT, np.int64), "encoder_hidden_states": states})
    names = [o.name for o in first_step.get_outputs()]
    cross = {name.replace("present_", "past_", 1): value for name, value in zip(names, outputs) if "cross" in name}
    answer = mha_ep.generate_static(decoder, PROMPT, args.max_tokens, inputs=cross, eot=EOT, suppress=suppress,
                                    suppress_first=suppress_begin)
    return answer[0]


for wav in wavs:
    features = audio.features_for([wav]).astype("float32")  # (1, 80, 3000) log-mel, NumPy
    print(wav.name)
    for name, decoder in decoders.items():
        transcribe(decoder, features)  # the first call captures the decoder's CUDA graph
        start = time.perf_counter()
        ours = transcribe(decoder, features)
        elapsed = time.perf_counter() - start
        theirs = stock[name].decode(features)[0]
        print(f"  {name:8s} stock ORT (CPU): {tok.decode(theirs).strip()}\n"
              f"  {name:8s} mha_ep (GPU)   : {tok.decode(ours).strip()}\n"
              f"  {name:8s} same tokens: {ours == theirs}; {1e3 * elapsed:.1f} ms for {len(ours)} tokens, encoder "
              f"included")
