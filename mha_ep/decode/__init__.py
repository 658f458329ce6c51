"""Decode loops on the GPU: generation with the KV cache on the device, and the static-cache loop (one CUDA graph
a step) over what ``mha-ep static-cache`` writes.

  generate.py            greedy generation: the KV cache on the device, the token chosen there
  static_decode.py       StaticDecoder: a static-cache decoder bound once, its step replayed; decode.cu its kernels
  static_generate.py     generate_static: the greedy / beam loop for any static-cache decoder, prompt and encoder
                         outputs given by the caller (mha_ep.generate_static)
  binding.py             CapturedBinding: an IOBinding that refuses a new buffer once ORT captured the graph
  beam.py                beam search's bookkeeping (scores, reordering) shared by the loops
  audio.py               wav reading and Whisper's log-mel features in NumPy
Whisper transcription built on these loops (stock ORT against the plugin, real weights) is a tool:
mha_ep/models/whisper_transcribe.py.
"""
