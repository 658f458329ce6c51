"""``mha-ep bench native``: the native route in one plain ORT CUDA session against stock ORT CUDA, in one run.

Every row times stock ORT CUDA (``ort_*``) and a plain ``onnxruntime.InferenceSession`` over the same model
partitioned in the native form with ``mha_ep.register(..., backend="cuda")`` (``native_*``), in turns
(timer.paired_medians), medians of ``--repeats`` rounds; a call ends when its outputs are ready on the GPU.

  encoder   whole encoders, inputs and outputs bound on the GPU: ``*_iobinding`` eager, ``*_graph`` with ORT's
            ``enable_cuda_graph`` (repeated shapes; outputs at fixed addresses). BERT-base (12 x 768, 12 heads,
            (B, S) padding mask) at B=8, S=128 / 512, float32 / float16; MiniLM-sized (6 x 384); a Whisper-tiny-
            sized encoder (4 x 384, 6 heads, S=1500, no mask); BERT-large (24 x 1024, 16 heads) B=8 S=512 float16.
            FLOP model: 2*B*S*(4*D^2 + 2*D*F) per layer for the projections and FFN, plus 4*B*N*S^2*H attention.
  first     a shape's first call (serving: a new (B, S) on every call): ``--fresh`` sequence lengths from the row's
            S upward, each the first call of its shape in both sessions, the two sessions in turns.
  serving   a new (batch, sequence) on every call, drawn from a serving spread (serving_shapes): stock ORT CUDA
            with IOBinding, the native route in a plain session, and ``mha_ep.InferenceSession.run_device``, each
            call the first of its shape everywhere (no graph or plan replayed); ``vs`` = total native / total stock.
  decode    a Whisper-style decoder step (mha_ep/models/synthetic.py whisper_decoder_step: self-attention over a
            past that grows by one every step, cross-attention over a 1500-position encoder) in a greedy-style loop:
            the presents come back as OrtValues on the GPU and are bound as the next step's past; ms per token =
            one generation's time / its steps, median over generations timed in turns. Tiny- and small-sized.
  qk        a Whisper decoder's cross-attention node (query (B, 1, D), BNSH key/value of 1500 frames, b_q only), as
            ORT's export writes it with --output_cross_qk (output 3, qk, (B, N, 1, 1500)) and without it: stock and
            native, each with and without qk, eager IOBinding, in µs per call; ``vs`` = native / stock with qk.
            Tiny, small and large-v3-turbo head counts (6, 12, 20; H = 64), B = 1 and 5 (beams), float16 / float32.
            FLOP model 4*B*N*T*H; qk's bytes B*N*T*element.
  chain     ``--chain`` MultiHeadAttention nodes in a row (each one's output the next one's query; B=1, S=1, T=16,
            one head of 64) against the same chain of stock nodes and a chain of Adds: host time per claimed node
            beyond a stock one = (native - stock) / nodes.
Columns of every row are in milliseconds; ``vs`` is native / stock. ``--json`` prints the rows as one JSON object
on stdout (the table goes to stderr); ``--out DIR`` writes bench_native.json and bench_native.png there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from mha_ep.bench.timer import paired_medians
from mha_ep.bench.output import add_output_options, emit
from mha_ep.progress import bar, wanted, write

CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class Encoder:
    name: str
    batch: int
    sequence: int
    dtype: str
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    mask: bool = True

    @property
    def label(self) -> str:
        mask = "2D mask" if self.mask else "no mask"
        return f"{self.name} B={self.batch} S={self.sequence} {self.dtype} {mask}"

    def model(self):
        from mha_ep.models.synthetic import bert_encoder

        return bert_encoder(self.layers, self.hidden, self.heads, self.ffn, self.dtype, mask=self.mask)

    def feeds(self, sequence: Optional[int] = None, batch: Optional[int] = None) -> dict:
        from mha_ep.models.synthetic import encoder_feeds

        feeds = encoder_feeds(batch or self.batch, sequence or self.sequence, self.hidden, self.dtype)
        if not self.mask:
            feeds.pop("attention_mask")
        return feeds

    def flops(self) -> float:
        tokens = self.batch * self.sequence
        dense = 2 * tokens * (4 * self.hidden**2 + 2 * self.hidden * self.ffn)
        attention = 4 * self.batch * self.heads * self.sequence**2 * (self.hidden // self.heads)
        return float(self.layers * (dense + attention))


BERT_BASE = dict(name="BERT-base")
ENCODERS = (
    Encoder(batch=8, sequence=128, dtype="float32", **BERT_BASE),
    Encoder(batch=8, sequence=128, dtype="float16", **BERT_BASE),
    Encoder(batch=8, sequence=512, dtype="float32", **BERT_BASE),
    Encoder(batch=8, sequence=512, dtype="float16", **BERT_BASE),
    Encoder("MiniLM-sized", 8, 128, "float32", layers=6, hidden=384, heads=12, ffn=1536),
    Encoder("Whisper-tiny-sized encoder", 4, 1500, "float16", layers=4, hidden=384, heads=6, ffn=1536, mask=False),
    Encoder("BERT-large", 8, 512, "float16", layers=24, hidden=1024, heads=16, ffn=4096),
)
FIRST_CALLS = (Encoder(batch=32, sequence=128, dtype="float16", **BERT_BASE),
               Encoder(batch=1, sequence=32, dtype="float32", **BERT_BASE))  # fmt: skip


SERVING = (Encoder(batch=0, sequence=0, dtype="float16", **BERT_BASE),)  # (B, S) drawn per call: serving_shapes


@dataclass(frozen=True)
class Decoder:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    batch: int = 1
    dtype: str = "float32"

    @property
    def label(self) -> str:
        return f"Whisper-{self.name}-sized decoder B={self.batch} {self.dtype}, past growing"


DECODERS = tuple(Decoder(name, *size, batch=batch) for batch in (1, 8)
                 for name, size in (("tiny", (4, 384, 6, 1536)), ("small", (12, 768, 12, 3072))))  # fmt: skip


def sessions(model, graph: bool = False) -> tuple:
    """(stock session, native session) of ``model`` on the CUDA provider (``graph``: ORT's enable_cuda_graph)."""
    import onnxruntime as ort

    from mha_ep.registration import plain_session

    cuda = (CUDA, {"enable_cuda_graph": "1"}) if graph else CUDA
    providers = [cuda, "CPUExecutionProvider"]
    stock = ort.InferenceSession(model.SerializeToString(), providers=providers)
    native = plain_session(model, providers=providers)
    for session in (stock, native):
        if CUDA not in session.get_providers():
            raise RuntimeError("ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    return stock, native


def fixed_binding(session, device_feeds: dict, outputs: dict):
    """An IOBinding of ``session``: inputs from CuPy arrays, outputs into ORT values at fixed addresses."""
    binding = session.io_binding()
    for name, array in device_feeds.items():
        binding.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
    for name, value in outputs.items():
        binding.bind_ortvalue_output(name, value)
    return binding


def bound_call(session, device_feeds: dict, outputs: dict) -> Callable[[], None]:
    """A run of ``session`` with fixed_binding, ending once the outputs are ready."""
    binding = fixed_binding(session, device_feeds, outputs)

    def call():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return call


def output_values(session, feeds: dict) -> tuple:
    """(numpy outputs of one run, fresh device OrtValues of their shapes and types)."""
    import onnxruntime as ort

    results = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    values = {name: ort.OrtValue.ortvalue_from_shape_and_type(list(r.shape), r.dtype.type, "cuda", 0)
              for name, r in zip(names, results)}  # fmt: skip
    return results, values


def max_rel_error(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(a - e) / np.maximum(1.0, np.abs(e)))) if a.size else 0.0


def bench_encoder(row: Encoder, repeats: int) -> dict:
    import cupy

    model = row.model()
    feeds = row.feeds()
    device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
    calls = {}
    errors = {}
    for graph in (False, True):
        stock, native = sessions(model, graph)
        want, stock_out = output_values(stock, feeds)
        got, native_out = output_values(native, feeds)
        suffix = "graph" if graph else "iobinding"
        calls[f"ort_{suffix}"] = bound_call(stock, device_feeds, stock_out)
        calls[f"native_{suffix}"] = bound_call(native, device_feeds, native_out)
        errors[suffix] = max(max_rel_error(g, w) for g, w in zip(got, want))
    medians = dict(zip(calls, paired_medians(list(calls.values()), repeats, warmup=3)))
    result = {"kind": "encoder", "label": row.label, **{f"{n}_ms": s * 1e3 for n, s in medians.items()},
              "max_rel_error_vs_ort_cuda": max(errors.values()),
              "tflops_native_graph": row.flops() / medians["native_graph"] / 1e12}  # fmt: skip
    result["vs_iobinding"] = result["native_iobinding_ms"] / result["ort_iobinding_ms"]
    result["vs_graph"] = result["native_graph_ms"] / result["ort_graph_ms"]
    return result


def bench_first_calls(row: Encoder, fresh: int) -> dict:
    """Each of ``fresh`` sequence lengths once, the first call of its shape in both sessions (module docstring)."""
    import cupy

    stock, native = sessions(row.model())
    row.feeds()  # (numpy's first use outside the timed calls)
    times = {"ort": [], "native": []}
    for offset in range(1, fresh + 1):  # S + offset: shapes neither session nor the plan cache has seen
        feeds = {n: cupy.asarray(v) for n, v in row.feeds(sequence=row.sequence + offset).items()}
        for name, session in (("ort", stock), ("native", native)):
            names = [o.name for o in session.get_outputs()]
            binding = session.io_binding()
            for key, array in feeds.items():
                binding.bind_input(key, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
            for key in names:
                binding.bind_output(key, "cuda", 0)
            cupy.cuda.runtime.deviceSynchronize()
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"kind": "first", "label": f"{row.label}, first call of {fresh} new shapes (S+1..S+{fresh})",
            "ort_first_ms": medians["ort"], "native_first_ms": medians["native"],
            "vs_first": medians["native"] / medians["ort"]}  # fmt: skip


def serving_shapes(calls: int, seed: int = 0) -> list:
    """``calls`` distinct (batch, sequence) pairs as a serving queue sees them: batch from a skewed choice of
    1..32 (most requests alone or in small batches), sequence log-normal around 96 tokens, within 8..512."""
    rng = np.random.default_rng(seed)
    pairs: list = []
    while len(pairs) < calls:
        batch = int(rng.choice([1, 1, 1, 2, 2, 4, 4, 8, 16, 32]))
        sequence = int(np.clip(round(float(rng.lognormal(np.log(96), 0.7))), 8, 512))
        if (batch, sequence) not in pairs:
            pairs.append((batch, sequence))
    return pairs


def bench_serving(row: Encoder, calls: int) -> dict:
    """A new (batch, sequence) on every call (serving_shapes), so that no graph and no plan is ever replayed.

    Every call is the first of its shape in stock ORT CUDA with IOBinding and in one mha_ep session, the two in
    turns (the order alternating): even calls in a plain session on the native route with IOBinding, odd calls in
    ``mha_ep.InferenceSession`` with ``run_device`` (the two share the process's plan cache, so each gets shapes
    of its own). A warm-up pass over other shapes first compiles the kernels the spread needs, as a server's
    start would; the timed shapes are new to every cache. ``vs`` = mha_ep's total / stock's total over the same
    calls."""
    import cupy

    import mha_ep

    model = row.model()
    stock, native = sessions(model)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=[CUDA, "CPUExecutionProvider"])

    def bound(target, feeds):
        names = [o.name for o in target.get_outputs()]
        binding = target.io_binding()
        for key, array in feeds.items():
            binding.bind_input(key, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
        for key in names:
            binding.bind_output(key, "cuda", 0)
        target.run_with_iobinding(binding)
        binding.synchronize_outputs()

    def device_run(feeds):
        session.run_device(None, feeds)
        cupy.cuda.get_current_stream().synchronize()

    mine = {"native": lambda feeds: bound(native, feeds), "session": device_run}
    shapes = serving_shapes(calls + calls // 2, seed=11)
    warm, timed = shapes[calls:], shapes[:calls]
    for batch, sequence in warm:
        feeds = {n: cupy.asarray(v) for n, v in row.feeds(sequence=sequence, batch=batch).items()}
        for run in (lambda f: bound(stock, f), *mine.values()):
            run(feeds)
    times: dict = {"ort": {"native": [], "session": []}, "native": [], "session": []}
    for index, (batch, sequence) in enumerate(timed):
        which = "native" if index % 2 == 0 else "session"
        feeds = {n: cupy.asarray(v) for n, v in row.feeds(sequence=sequence, batch=batch).items()}
        pair = [("ort", lambda f: bound(stock, f)), (which, mine[which])]
        for name, run in (pair if index % 4 < 2 else pair[::-1]):
            cupy.cuda.runtime.deviceSynchronize()
            start = time.perf_counter()
            run(feeds)
            elapsed = time.perf_counter() - start
            (times["ort"][which] if name == "ort" else times[which]).append(elapsed)
    totals = {name: sum(times[name]) * 1e3 for name in mine}
    stock_totals = {name: sum(times["ort"][name]) * 1e3 for name in mine}
    return {"kind": "serving", "label": f"{row.name} {row.dtype} 2D mask, serving: {calls} calls, each a new (B, S) "
            f"(B 1-32, S 8-512 log-normal around 96), half plain session, half mha_ep.InferenceSession",
            "shapes": timed, "ort_total_ms": sum(stock_totals.values()), "native_total_ms": totals["native"],
            "session_total_ms": totals["session"], "ort_native_total_ms": stock_totals["native"],
            "ort_session_total_ms": stock_totals["session"],
            "vs_serving": totals["native"] / stock_totals["native"],
            "session_vs_serving": totals["session"] / stock_totals["session"]}  # fmt: skip


def decode_loop(session, row: Decoder, steps: int, start_past: int) -> Callable[[], float]:
    """One greedy-style generation of ``steps`` decoder steps whose presents are the next step's past (device
    OrtValues, no host round trip); returns its seconds."""
    import cupy
    import onnxruntime as ort

    from mha_ep.models.synthetic import decoder_step_feeds

    feeds = decoder_step_feeds(row.batch, start_past, row.layers, row.hidden, row.heads, dtype=row.dtype)
    fixed = {name: cupy.asarray(value) for name, value in feeds.items() if not name.startswith("past_")}
    first_past = {name: ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
                  for name, value in feeds.items() if name.startswith("past_")}  # fmt: skip
    names = [o.name for o in session.get_outputs()]

    def generation() -> float:
        past = dict(first_past)
        cupy.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        for _ in range(steps):
            binding = session.io_binding()
            for name, array in fixed.items():
                binding.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
            for name, value in past.items():
                binding.bind_ortvalue_input(name, value)
            for name in names:
                binding.bind_output(name, "cuda", 0)
            session.run_with_iobinding(binding)
            results = dict(zip(names, binding.get_outputs()))
            past = {name.replace("present_", "past_"): value for name, value in results.items()
                    if name.startswith("present_")}  # fmt: skip
        binding.synchronize_outputs()
        return time.perf_counter() - start

    return generation


def bench_decoder(row: Decoder, repeats: int, steps: int) -> dict:
    from mha_ep.models.synthetic import whisper_decoder_step

    stock, native = sessions(whisper_decoder_step(row.layers, row.hidden, row.heads, row.ffn, row.dtype))
    loops = {"ort": decode_loop(stock, row, steps, 4), "native": decode_loop(native, row, steps, 4)}
    for loop in loops.values():
        loop()  # warm-up generation (plans, ORT's arena)
    samples = {name: [] for name in loops}
    for _ in range(repeats):
        for name, loop in loops.items():
            samples[name].append(loop() / steps)
    medians = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    return {"kind": "decode", "label": f"{row.label} ({steps} steps from past 4)", "ort_ms_per_token": medians["ort"],
            "native_ms_per_token": medians["native"], "vs_decode": medians["native"] / medians["ort"]}  # fmt: skip


def chain_model(nodes: int, kind: str):
    """``nodes`` nodes in a row over q (1, 1, 64): stock MultiHeadAttention (key/value (1, 16, 64)) or Add."""
    import onnx
    from onnx import TensorProto, helper

    graph_nodes = []
    current = "q"
    for i in range(nodes):
        out = "out" if i == nodes - 1 else f"q{i}"
        if kind == "add":
            graph_nodes.append(helper.make_node("Add", [current, "zero"], [out], name=f"add{i}"))
        else:
            graph_nodes.append(helper.make_node("MultiHeadAttention", [current, "k", "v"], [out], name=f"mha{i}",
                                                domain="com.microsoft", num_heads=1))  # fmt: skip
        current = out
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, 64]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 16, 64]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 16, 64])]  # fmt: skip
    initializers = [onnx.numpy_helper.from_array(np.zeros((1, 1, 64), np.float32), "zero")] if kind == "add" else []
    graph = helper.make_graph(graph_nodes, f"chain_{kind}", inputs if kind != "add" else inputs[:1],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 64])],
                              initializer=initializers)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)  # fmt: skip


def bench_chain(nodes: int, repeats: int) -> dict:
    import cupy
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((1, 1, 64), np.float32), "k": rng.standard_normal((1, 16, 64), np.float32),
             "v": rng.standard_normal((1, 16, 64), np.float32)}  # fmt: skip
    device = {name: cupy.asarray(value) for name, value in feeds.items()}
    stock, native = sessions(chain_model(nodes, "mha"))
    add = ort.InferenceSession(chain_model(nodes, "add").SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
    calls = {}
    for name, session, inputs in (("ort", stock, device), ("native", native, device), ("add", add, {"q": device["q"]})):
        _, values = output_values(session, {k: v for k, v in feeds.items() if k in inputs})
        calls[name] = bound_call(session, inputs, values)
    medians = dict(zip(calls, paired_medians(list(calls.values()), repeats * 20, warmup=20)))
    per_node = {name: seconds * 1e6 / nodes for name, seconds in medians.items()}
    return {"kind": "chain", "label": f"chain of {nodes} nodes, B=1 S=1 T=16 N=1 H=64 float32, eager IOBinding",
            "ort_us_per_node": per_node["ort"], "native_us_per_node": per_node["native"],
            "add_us_per_node": per_node["add"],
            "native_minus_ort_us_per_node": per_node["native"] - per_node["ort"]}  # fmt: skip


@dataclass(frozen=True)
class CrossQk:
    """A Whisper decoder's cross-attention node as ORT's export writes it with ``--output_cross_qk``: query (B, 1, D)
    with its bias [b_q | 0 | 0], key and value (B, N, 1500, H) from the encoder, output 3 qk (B, N, 1, 1500)."""

    name: str
    batch: int
    heads: int
    dtype: str
    frames: int = 1500
    head_size: int = 64

    @property
    def label(self) -> str:
        return f"{self.name} cross attention + qk, B={self.batch} N={self.heads} T={self.frames} {self.dtype}"

    @property
    def qk_bytes(self) -> int:
        return self.batch * self.heads * self.frames * (4 if self.dtype == "float32" else 2)

    def model(self, qk: bool):
        import onnx
        from onnx import TensorProto, helper

        elem = TensorProto.FLOAT if self.dtype == "float32" else TensorProto.FLOAT16
        b, n, t, h = self.batch, self.heads, self.frames, self.head_size
        node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "bias"], ["out", "", "", "qk"] if qk else ["out"],
                                name="cross", domain="com.microsoft", num_heads=n)  # fmt: skip
        bias = np.zeros(3 * n * h, np.float32)
        bias[: n * h] = np.random.default_rng(1).standard_normal(n * h) * 0.1
        outputs = [helper.make_tensor_value_info("out", elem, [b, 1, n * h])]
        if qk:
            outputs.append(helper.make_tensor_value_info("qk", elem, [b, n, 1, t]))
        graph = helper.make_graph(
            [node], "cross_qk",
            [helper.make_tensor_value_info("q", elem, [b, 1, n * h]), helper.make_tensor_value_info("k", elem, [b, n, t, h]),
             helper.make_tensor_value_info("v", elem, [b, n, t, h])], outputs,
            initializer=[onnx.numpy_helper.from_array(bias.astype(np.float32 if self.dtype == "float32" else np.float16), "bias")],
        )  # fmt: skip
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                                 ir_version=9)  # fmt: skip

    def feeds(self) -> dict:
        rng = np.random.default_rng(0)
        dtype = np.float32 if self.dtype == "float32" else np.float16
        b, n, t, h = self.batch, self.heads, self.frames, self.head_size
        return {"q": rng.standard_normal((b, 1, n * h)).astype(dtype),
                "k": rng.standard_normal((b, n, t, h)).astype(dtype),
                "v": rng.standard_normal((b, n, t, h)).astype(dtype)}  # fmt: skip


CROSS_QK = [CrossQk(size, batch, heads, dtype) for size, heads in (("tiny", 6), ("small", 12), ("turbo", 20))
            for batch in (1, 5) for dtype in ("float16", "float32")]  # fmt: skip


def bench_cross_qk(row: CrossQk, repeats: int) -> dict:
    """Stock's and ours, each with and without qk, in turns: four eager IOBinding calls of one node."""
    import cupy

    feeds = row.feeds()
    device = {name: cupy.asarray(value) for name, value in feeds.items()}
    calls, results = {}, {}
    for qk in (False, True):
        stock, native = sessions(row.model(qk))
        for name, session in (("ort", stock), ("native", native)):
            results[(name, qk)], values = output_values(session, feeds)
            calls[f"{name}_{'qk' if qk else 'plain'}"] = bound_call(session, device, values)
    medians = dict(zip(calls, paired_medians(list(calls.values()), repeats * 20, warmup=10)))
    us = {name: seconds * 1e6 for name, seconds in medians.items()}
    errors = [max_rel_error(a, e) for a, e in zip(results[("native", True)], results[("ort", True)])]
    return {"kind": "qk", "label": row.label, "ort_plain_us": us["ort_plain"], "ort_qk_us": us["ort_qk"],
            "native_plain_us": us["native_plain"], "native_qk_us": us["native_qk"],
            "vs_qk": us["native_qk"] / us["ort_qk"], "qk_bytes": row.qk_bytes,
            "max_rel_error_output_vs_ort_cuda": errors[0], "max_rel_error_qk_vs_ort_cuda": errors[1]}  # fmt: skip


def format_row(r: dict) -> str:
    kind = r["kind"]
    if kind == "encoder":
        return (f"| {r['label']} | {r['ort_iobinding_ms']:.3f} | {r['native_iobinding_ms']:.3f} | {r['vs_iobinding']:.2f} "
                f"| {r['ort_graph_ms']:.3f} | {r['native_graph_ms']:.3f} | {r['vs_graph']:.2f} "
                f"| {r['max_rel_error_vs_ort_cuda']:.1e} |")  # fmt: skip
    if kind == "first":
        return f"| {r['label']} | first call | {r['ort_first_ms']:.3f} | {r['native_first_ms']:.3f} | {r['vs_first']:.2f} |"
    if kind == "serving":
        return (f"| {r['label']} | total ms, stock vs plain native | {r['ort_native_total_ms']:.1f} "
                f"| {r['native_total_ms']:.1f} | {r['vs_serving']:.2f} | stock vs session {r['ort_session_total_ms']:.1f} "
                f"| {r['session_total_ms']:.1f} | {r['session_vs_serving']:.2f} |")  # fmt: skip
    if kind == "qk":
        return (f"| {r['label']} | µs: stock {r['ort_plain_us']:.1f} / +qk {r['ort_qk_us']:.1f} | ours "
                f"{r['native_plain_us']:.1f} / +qk {r['native_qk_us']:.1f} | {r['vs_qk']:.2f} | qk {r['qk_bytes']} B "
                f"| err out {r['max_rel_error_output_vs_ort_cuda']:.1e}, qk {r['max_rel_error_qk_vs_ort_cuda']:.1e} |")  # fmt: skip
    if kind == "decode":
        return (f"| {r['label']} | ms/token | {r['ort_ms_per_token']:.3f} | {r['native_ms_per_token']:.3f} "
                f"| {r['vs_decode']:.2f} |")  # fmt: skip
    return (f"| {r['label']} | µs/node | {r['ort_us_per_node']:.2f} | {r['native_us_per_node']:.2f} | "
            f"+{r['native_minus_ort_us_per_node']:.2f} (Add: {r['add_us_per_node']:.2f}) |")


def plot(results: list, path) -> bool:
    """native / stock per row (lower is better; 1 is parity) into ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars = []
    for r in results:
        for key in ("vs_iobinding", "vs_graph", "vs_first", "vs_decode", "vs_serving", "session_vs_serving", "vs_qk"):
            if key in r:
                bars.append((f"{r['label']} [{key.replace('vs_', '')}]", r[key]))
    if not bars:
        return False
    figure, axes = plt.subplots(figsize=(11, 0.9 + 0.32 * len(bars)))
    axes.barh(range(len(bars)), [b[1] for b in bars], color=["tab:green" if b[1] <= 1 else "tab:red" for b in bars])
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("mha_ep native route / stock ORT CUDA (median time, timed in turns); lower is better")
    axes.set_title("mha_ep's native custom op in a plain ORT CUDA session vs stock ORT CUDA")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench native", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10, help="rounds timed in turns (median of each)")
    parser.add_argument("--rows", default="encoder,first,serving,decode,chain",
                        help="comma-separated row kinds: encoder, first, serving, decode, chain, qk")
    parser.add_argument("--calls", type=int, default=60, help="calls (each a new shape) of the serving row")
    parser.add_argument("--only", default="", help="only rows whose label contains this text")
    parser.add_argument("--fresh", type=int, default=7, help="new shapes per first-call row")
    parser.add_argument("--steps", type=int, default=64, help="decoder steps per generation")
    parser.add_argument("--chain", type=int, default=24, help="nodes of the chain row")
    add_output_options(parser, "also write bench_native.json and bench_native.png into this folder")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    kinds = set(args.rows.split(","))
    work = []
    if "encoder" in kinds:
        work += [(row.label, lambda row=row: bench_encoder(row, args.repeats)) for row in ENCODERS]
    if "first" in kinds:
        work += [(row.label, lambda row=row: bench_first_calls(row, args.fresh)) for row in FIRST_CALLS]
    if "serving" in kinds:
        work += [(f"{row.label} serving", lambda row=row: bench_serving(row, args.calls)) for row in SERVING]
    if "decode" in kinds:
        work += [(row.label, lambda row=row: bench_decoder(row, args.repeats, args.steps)) for row in DECODERS]
    if "qk" in kinds:
        work += [(row.label, lambda row=row: bench_cross_qk(row, args.repeats)) for row in CROSS_QK]
    if "chain" in kinds:
        work.append((f"chain of {args.chain} nodes", lambda: bench_chain(args.chain, args.repeats)))
    work = [(label, run) for label, run in work if args.only in label]
    print("| row | ort_iobinding (or: what) | native_iobinding (or: ort) | vs (or: native) | ort_graph (or: vs) "
          "| native_graph | vs | err vs ORT CUDA |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    with bar(len(work), "bench native", wanted(as_json=args.json), unit="row") as progress:
        for label, run in work:
            try:
                result = run()
                line = format_row(result)
            except Exception as error:  # noqa: BLE001 - one failed row is reported, the others still run
                result = {"kind": "error", "label": label, "error": f"{type(error).__name__}: {error}"}
                line = f"| {label} | failed: {result['error'][:300]} |"
            results.append(result)
            write(line)
            progress.update()
    from mha_ep import native

    emit(args, "bench_native.json", {"rows": results, "plans": native.stats()})
    if args.out:
        from pathlib import Path

        plot([r for r in results if r["kind"] != "error"], Path(args.out) / "bench_native.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
