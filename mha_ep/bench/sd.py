"""``mha-ep bench sd``: Stable Diffusion's attention nodes alone, ours against stock ORT CUDA, in one run.

Each row is one MultiHeadAttention node at a shape a diffusion model runs, in the form ORT's optimizer writes it:
  self   packed QKV: query (B, S, N, 3, H), no key or value (fusion_attention_unet.py, enable_packed_qkv);
  cross  packed KV: query (B, S, N*H), key (B, 77, N, 2, H) from the text encoder (enable_packed_kv);
  joint  SD3 / Flux's joint attention (fusion_mha_mmdit.py): query (B, S, N*H), key and value BNSH (B, N, S, H),
         no mask (a form that is never packed: its columns "stock packed" and "stock unpacked" are the same node).
B = 2 everywhere: classifier-free guidance runs the conditional and unconditional latents as one batch.
Shapes: SD 1.5 at 512x512 (N 8; H 40 / 80 / 160 at S 4096 / 1024 / 256 / 64), SDXL at 1024x1024 (H 64; N 10 at S
4096, N 20 at S 1024), SD3.5-Medium (N 24, H 64, S 4096 image + 256 text tokens) and Flux (N 24, H 128, S 4096 + 512).

Columns, µs per call (a plain ``InferenceSession`` on the CUDA provider, inputs and outputs bound on the GPU with
IOBinding, one call timed until its output is ready; the sessions in turns, medians of ``--repeats`` rounds):
  stock packed     stock ORT CUDA on the packed node (or the sentence it refuses it with);
  stock unpacked   stock ORT CUDA on the same attention with query, key and value apart (its flash / TRT kernels);
  ours             the packed node partitioned by mha_ep onto the native route (mha_ep.register), the same session
                   type; ``vs packed`` / ``vs unpacked`` = ours / each stock column.
FLOP model: 4*B*N*S*L*H (Q.K^T and P.V; the softmax is not counted). Bytes: the least a kernel moves, Q, K and V
read once and the output written once, element size each. TFLOP/s and GB/s are those over ours' time; ``of peak``
compares them with the device's dense float16 / bfloat16 tensor peak and HBM rate (DEVICE_PEAKS, the datasheets).
``err``: ours / stock packed / stock unpacked against the float64 reference (softmax(scale Q.K^T) V of the inputs
rounded to the row's dtype) at REFERENCE_ROWS query rows of every (b, h), max |a - e| / max(1, |e|).
``--json`` prints the rows as one JSON object on stdout (the table goes to stderr); ``--out DIR`` writes
bench_sd.json there.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mha_ep.bench.output import add_output_options, emit
from mha_ep.dtypes import rounded
from mha_ep.bench.timer import paired_medians
from mha_ep.progress import bar, wanted, write

CUDA = "CUDAExecutionProvider"
BATCH = 2  # classifier-free guidance: the conditional and unconditional latents in one batch
TEXT_TOKENS = 77  # CLIP's context length: the key length of every UNet cross attention
# (HBM bytes/s, dense float16 / bfloat16 tensor FLOP/s) by device name: the NVIDIA datasheets (SXM parts)
DEVICE_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}
FORMS = ("self", "cross", "joint")


@dataclass(frozen=True)
class SdAttention:
    """One attention node: ``form`` (FORMS), N heads of H, S query rows and L keys, element ``dtype``."""

    model: str
    form: str
    heads: int
    head_size: int
    seq: int
    dtype: str
    kv_seq: Optional[int] = None  # None: L = S (self / joint); cross: TEXT_TOKENS
    batch: int = BATCH

    @property
    def keys(self) -> int:
        return self.seq if self.kv_seq is None else self.kv_seq

    @property
    def label(self) -> str:
        return (f"{self.model} {self.form} B={self.batch} N={self.heads} H={self.head_size} S={self.seq} "
                f"L={self.keys} {self.dtype}")  # fmt: skip

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.seq * self.keys * self.head_size

    @property
    def bytes_moved(self) -> int:
        rows = 2 * self.batch * self.seq + 2 * self.batch * self.keys  # Q and the output; K and V
        return rows * self.heads * self.head_size * 2

    def model_proto(self, packed: bool):
        """The node as ORT's optimizer writes it (``packed``), or with query, key and value apart."""
        from onnx import TensorProto, helper

        elem = TensorProto.FLOAT16 if self.dtype == "float16" else TensorProto.BFLOAT16
        shapes = self.input_shapes(packed)
        node = helper.make_node("MultiHeadAttention", list(shapes), ["out"], name=f"{self.form}_attention",
                                domain="com.microsoft", num_heads=self.heads)  # fmt: skip
        graph = helper.make_graph(
            [node], f"sd_{self.form}",
            [helper.make_tensor_value_info(name, elem, list(shape)) for name, shape in shapes.items()],
            [helper.make_tensor_value_info("out", elem, [self.batch, self.seq, self.heads * self.head_size])],
        )  # fmt: skip
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)], ir_version=9)  # fmt: skip

    def input_shapes(self, packed: bool) -> dict:
        b, n, h, s, l = self.batch, self.heads, self.head_size, self.seq, self.keys
        if packed and self.form == "self":
            return {"qkv": (b, s, n, 3, h)}
        if packed and self.form == "cross":
            return {"q": (b, s, n * h), "kv": (b, l, n, 2, h)}
        if self.form == "joint":
            return {"q": (b, s, n * h), "k": (b, n, l, h), "v": (b, n, l, h)}
        return {"q": (b, s, n * h), "k": (b, l, n * h), "v": (b, l, n * h)}

    def feeds(self, seed: int = 0) -> tuple[dict, dict]:
        """(packed feeds, unpacked feeds) of the same values, float32 NumPy arrays (cast on the device)."""
        rng = np.random.default_rng(seed)
        b, n, h, s, l = self.batch, self.heads, self.head_size, self.seq, self.keys
        if self.form == "joint":
            feeds = {name: rng.standard_normal(shape).astype(np.float32)
                     for name, shape in self.input_shapes(False).items()}  # fmt: skip
            return feeds, feeds
        if self.form == "self":
            qkv = rng.standard_normal((b, s, n, 3, h)).astype(np.float32)
            apart = {name: np.ascontiguousarray(qkv[:, :, :, i, :]).reshape(b, s, n * h)
                     for i, name in enumerate(("q", "k", "v"))}  # fmt: skip
            return {"qkv": qkv}, apart
        q = rng.standard_normal((b, s, n * h)).astype(np.float32)
        kv = rng.standard_normal((b, l, n, 2, h)).astype(np.float32)
        apart = {"q": q, "k": np.ascontiguousarray(kv[:, :, :, 0, :]).reshape(b, l, n * h),
                 "v": np.ascontiguousarray(kv[:, :, :, 1, :]).reshape(b, l, n * h)}  # fmt: skip
        return {"q": q, "kv": kv}, apart


def sd_rows(dtypes=("float16", "bfloat16")) -> list:
    rows = []
    for dtype in dtypes:
        for h, s in ((40, 4096), (80, 1024), (160, 256), (160, 64)):  # SD 1.5 at 512x512, N 8
            rows.append(SdAttention("SD 1.5", "self", 8, h, s, dtype))
            rows.append(SdAttention("SD 1.5", "cross", 8, h, s, dtype, kv_seq=TEXT_TOKENS))
        for n, s in ((10, 4096), (20, 1024)):  # SDXL at 1024x1024, H 64
            rows.append(SdAttention("SDXL", "self", n, 64, s, dtype))
            rows.append(SdAttention("SDXL", "cross", n, 64, s, dtype, kv_seq=TEXT_TOKENS))
        rows.append(SdAttention("SD3.5-M", "joint", 24, 64, 4096 + 256, dtype))
        rows.append(SdAttention("Flux", "joint", 24, 128, 4096 + 512, dtype))
    return rows


# ------------------------------------------------------------------------------------------------ sessions
def _session(model, options=None):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA, "CPUExecutionProvider"])
    if CUDA not in session.get_providers():
        raise RuntimeError("ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    return session


def _native_session(model):
    import mha_ep
    from mha_ep.registration import plain_session

    part = mha_ep.partition(model, route="native")
    if part.claimed != len(part.decisions):
        raise RuntimeError(f"mha_ep declined the node: {part.report()}")
    session = plain_session(model, providers=[CUDA, "CPUExecutionProvider"])
    if CUDA not in session.get_providers():
        raise RuntimeError("ORT did not get the CUDA provider (onnxruntime-gpu with its CUDA libraries needed)")
    return session


class BoundRun:
    """One session's run on CuPy inputs bound on the GPU (``run()`` ends once its output is ready) and its last
    output (``output()``: a CuPy array of the element's bits). Inputs go through ORT's C binding, which takes the
    ONNX element type as a number (bfloat16 has no NumPy type). It holds its inputs: a binding keeps only their
    addresses, and CuPy's pool would hand freed inputs to the next session's arrays."""

    def __init__(self, session, device_feeds: dict, dtype: str):
        import onnxruntime as ort

        from mha_ep.dtypes import elem_type

        self.session, self.inputs, self.dtype = session, device_feeds, dtype
        self.binding = session.io_binding()
        c_binding = self.binding._iobinding
        device = ort.OrtDevice.make("cuda", 0)._get_c_device()
        for name, array in device_feeds.items():
            c_binding.bind_input(name, device, elem_type(dtype), list(array.shape), array.data.ptr)
        c_binding.bind_output("out", device)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def output(self):
        import cupy

        value = self.binding.get_outputs()[0]
        shape = tuple(value.shape())
        memory = cupy.cuda.UnownedMemory(value.data_ptr(), 2 * int(np.prod(shape)), value)
        return cupy.ndarray(shape, _bits_type(self.dtype), cupy.cuda.MemoryPointer(memory, 0)).copy()


def _bits_type(dtype: str):
    return np.float16 if dtype == "float16" else np.uint16


def _device(array: np.ndarray, dtype: str):
    """``array`` on the GPU in ``dtype`` (bfloat16 as its uint16 bits: round to nearest even)."""
    import cupy

    return cupy.asarray(_rounded_bits(array, dtype))


def _rounded_bits(array: np.ndarray, dtype: str) -> np.ndarray:
    return array.astype(np.float16) if dtype == "float16" else bfloat16_bits(array)


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """``array`` rounded to bfloat16 (to nearest, ties to even: dtypes.rounded), as its uint16 bits."""
    return (rounded(array, "bfloat16").view(np.uint32) >> 16).astype(np.uint16)


def _as_float(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Element bits (float16 values, or bfloat16's uint16) as float64."""
    if dtype == "float16":
        return bits.astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


REFERENCE_ROWS = 48  # query rows the float64 reference computes (first, last and spread between), every (b, h)


def reference_rows(row: "SdAttention", apart: dict) -> tuple[np.ndarray, np.ndarray]:
    """(query row indices, the float64 attention output at them, (B, rows, N*H)) of the unpacked feeds rounded to
    the row's dtype: softmax(scale * Q.K^T) . V, scale 1/sqrt(H), in float64 (the oracle where stock cannot run or
    disagrees)."""
    b, n, h, s, l = row.batch, row.heads, row.head_size, row.seq, row.keys
    as_typed = {name: _as_float(_rounded_bits(value, row.dtype), row.dtype) for name, value in apart.items()}
    picks = np.unique(np.linspace(0, s - 1, min(s, REFERENCE_ROWS)).astype(np.int64))
    q = as_typed["q"][:, picks].reshape(b, len(picks), n, h).transpose(0, 2, 1, 3)
    if row.form == "joint":
        k, v = as_typed["k"], as_typed["v"]
    else:
        k = as_typed["k"].reshape(b, l, n, h).transpose(0, 2, 1, 3)
        v = as_typed["v"].reshape(b, l, n, h).transpose(0, 2, 1, 3)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(h)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return picks, (probs @ v).transpose(0, 2, 1, 3).reshape(b, len(picks), n * h)


def _refusal(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:240]


def bench_row(row: SdAttention, repeats: int) -> dict:
    """Stock packed, stock unpacked and ours (packed, native route), in turns; each output against the float64
    reference at REFERENCE_ROWS query rows."""
    packed_feeds, apart_feeds = row.feeds()
    calls, readers, refused = {}, {}, {}
    plans = (("stock_packed", lambda: _session(row.model_proto(True)), packed_feeds),
             ("stock_unpacked", lambda: _session(row.model_proto(False)), apart_feeds),
             ("ours", lambda: _native_session(row.model_proto(row.form != "joint")), packed_feeds))  # fmt: skip
    for name, make, feeds in plans:
        if name == "stock_packed" and row.form == "joint":
            continue  # never packed: stock unpacked is the same node
        try:
            session = make()
            bound = BoundRun(session, {k: _device(v, row.dtype) for k, v in feeds.items()}, row.dtype)
            bound.run()
            calls[name], readers[name] = bound.run, bound.output
        except Exception as error:  # noqa: BLE001 - stock's refusal is the row's finding, not a failure
            if name == "ours":
                raise
            refused[name] = _refusal(error)
    seconds = dict(zip(calls, paired_medians(list(calls.values()), repeats, warmup=3)))
    us = {name: s * 1e6 for name, s in seconds.items()}
    picks, expected = reference_rows(row, apart_feeds)
    result = {"kind": "sd", "label": row.label, "model": row.model, "form": row.form, "dtype": row.dtype,
              "batch": row.batch, "heads": row.heads, "head_size": row.head_size, "seq": row.seq, "keys": row.keys,
              "flops": row.flops, "bytes": row.bytes_moved, "ours_us": us["ours"]}  # fmt: skip
    for name, read in readers.items():
        actual = _as_float(read().get()[:, picks], row.dtype)
        result[f"{name}_error"] = float(np.max(np.abs(actual - expected) / np.maximum(1.0, np.abs(expected))))
    for name in ("stock_packed", "stock_unpacked"):
        if name in us:
            result[f"{name}_us"] = us[name]
            result[f"vs_{name.split('_')[1]}"] = us["ours"] / us[name]
        elif name in refused:
            result[f"{name}_refused"] = refused[name]
    result["tflops"] = row.flops / (us["ours"] * 1e-6) / 1e12
    result["gbps"] = row.bytes_moved / (us["ours"] * 1e-6) / 1e9
    return result


def with_peaks(result: dict, device_name: str) -> dict:
    """``result`` with its TFLOP/s and GB/s as fractions of the device's peaks (DEVICE_PEAKS), where known."""
    peak = next((value for key, value in DEVICE_PEAKS.items() if key in device_name), None)
    if peak is None or result.get("kind") != "sd":
        return result
    hbm, tensor = peak
    return {**result, "of_peak_flops": result["tflops"] * 1e12 / tensor, "of_peak_hbm": result["gbps"] * 1e9 / hbm}


def format_row(r: dict) -> str:
    if r["kind"] == "error":
        return f"| {r['label']} | failed: {r['error'][:300]} |"

    def stock(name: str) -> str:
        if f"{name}_us" in r:
            return f"{r[f'{name}_us']:.1f}"
        return f"refused: {r[f'{name}_refused']}" if f"{name}_refused" in r else "(same node)"

    ratio = {key: f"{r[key]:.2f}x" if key in r else "-" for key in ("vs_packed", "vs_unpacked")}
    peaks = (f" ({r['of_peak_flops']:.0%} / {r['of_peak_hbm']:.0%} of peak)" if "of_peak_flops" in r else "")
    errors = " / ".join("-" if f"{name}_error" not in r else f"{r[f'{name}_error']:.1e}"
                        for name in ("ours", "stock_packed", "stock_unpacked"))  # fmt: skip
    return (f"| {r['label']} | {stock('stock_packed')} | {stock('stock_unpacked')} | {r['ours_us']:.1f} "
            f"| {ratio['vs_packed']} | {ratio['vs_unpacked']} | {r['tflops']:.0f} TFLOP/s, {r['gbps']:.0f} GB/s{peaks} "
            f"| {errors} |")  # fmt: skip


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench sd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=30, help="rounds timed in turns (median of each)")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16, bfloat16")
    parser.add_argument("--only", default="",
                        help="only rows whose label contains this text (comma-separated: any of them)")  # fmt: skip
    add_output_options(parser, "also write bench_sd.json into this folder")
    args = parser.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    unknown = [d for d in dtypes if d not in ("float16", "bfloat16")]
    if unknown:
        parser.error(f"--dtypes: {unknown} are not float16 / bfloat16")
    import cupy
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    device_name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = [row for row in sd_rows(dtypes) if any(part in row.label for part in args.only.split(","))]
    print(f"device: {device_name}; onnxruntime {ort.__version__}")
    print("| row | stock packed µs | stock unpacked µs | ours µs | vs packed | vs unpacked | ours | err ours / stock "
          "packed / unpacked |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    with bar(len(rows), "bench sd", wanted(as_json=args.json), unit="row") as progress:
        for row in rows:
            try:
                result = with_peaks(bench_row(row, args.repeats), device_name)
            except Exception as error:  # noqa: BLE001 - one failed row is reported, the others still run
                result = {"kind": "error", "label": row.label, "error": f"{type(error).__name__}: {error}"}
            results.append(result)
            write(format_row(result))
            progress.update()
    emit(args, "bench_sd.json", {"device": device_name, "onnxruntime": ort.__version__, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
