"""``mha-ep bench anchors``: the anchor shapes (docs/FACTS.md §2), a sequence-length sweep, and the shipped models.

Columns (µs per call, median; "–" where a provider is absent or a row is too big for it):
  kernel      plugin device time, inputs already on the GPU (timer.backend_seconds: layout movers + fused kernel
              replayed as a CUDA graph; three-phase calls from back-to-back submissions, which include the host's
              launch gaps on small shapes)
  TFLOP/s     FLOP model 4*B*N*S*T*H (halved for causal) / kernel time
  host        plugin host-to-host: mha_ep.InferenceSession.run, numpy in and out (f16 rows: float16 numpy)
  floor       the bridge floor: a do-nothing Python op in the same graph moving the same bytes (echo, in a
              session with the plugin session's settings, timed in turns with the plugin's runs)
              + those bytes at the pinned bandwidth measured in this run + the kernel time
  host/floor  how close the plugin's own path is to that floor
  ort cpu     stock ORT CPU host-to-host (skipped above 5e10 FLOPs)
  ort cuda    stock ORT CUDA: device-resident (IOBinding on GPU buffers) and host-to-host, when onnxruntime
              has the CUDA provider
  sdpa        torch.nn.functional.scaled_dot_product_attention device time (graph replays, as the kernel column),
              when torch with CUDA is importable
Byte model of the floor: bytes in = every float input as float32 (the transport type) + mask; bytes out = the
float32 output.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Optional

import numpy as np
from onnx import TensorProto, helper

from mha_ep import spec
from mha_ep.bench.anchors import ANCHORS, anchor_problem, flop_count
from mha_ep.bench.output import print_json, write_json
from mha_ep.bench.timer import backend_seconds, median_seconds, paired_medians, torch_graph_seconds

CPU_FLOP_LIMIT = 5e10
ORT_DEV_REPEATS = 20  # device-resident ORT CUDA runs are short: more samples than the host columns get
SWEEP = (256, 512, 1024, 2048, 4096)  # S = T, B=1, N=16, H=64, float16


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- models and feeds
def anchor_model(b, s, t, n, h, dtype, extra):
    elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    inputs = ["query", "key", "value", "", "", ""]
    infos = [helper.make_tensor_value_info(x, elem, [b, s if x == "query" else t, n * h]) for x in inputs[:3]]
    if extra == "mask2d":
        inputs[4] = "key_padding_mask"
        infos.append(helper.make_tensor_value_info("key_padding_mask", TensorProto.INT32, [b, t]))
    if extra == "attn_bias":
        inputs[5] = "attention_bias"
        infos.append(helper.make_tensor_value_info("attention_bias", elem, [b, 1, s, t]))
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node(
        "MultiHeadAttention", inputs, ["output"], domain="com.microsoft", num_heads=n,
        unidirectional=int(extra == "causal"), name="mha",
    )
    graph = helper.make_graph([node], "anchor", infos, [helper.make_tensor_value_info("output", elem, [b, s, n * h])])
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def anchor_feeds(problem, dtype):
    cast = np.float16 if dtype == "float16" else np.float32
    feeds = {"query": problem.query_BSD.astype(cast), "key": problem.key.astype(cast), "value": problem.value.astype(cast)}
    if problem.padding_mask is not None:
        feeds["key_padding_mask"] = problem.padding_mask.data.astype(np.int32)
    if problem.attention_bias is not None:
        feeds["attention_bias"] = problem.attention_bias.astype(cast)
    return feeds


# --------------------------------------------------------------------------------------------------- the floor
_echo_outputs: dict = {}


def _echo_body(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value, past_sequence_length,
               cache_indirection, **attributes):  # fmt: skip
    """The do-nothing op: same inputs and outputs as the plugin op, returns a preallocated output."""
    shape = (query.shape[0], query.shape[1], value.shape[-1])
    out = _echo_outputs.get(shape)
    if out is None:
        out = _echo_outputs[shape] = np.zeros(shape, np.float32)
    empty = np.zeros((0,), np.float32)
    return (out,) + (empty,) * (len(spec.PLUGIN_OUTPUTS) - 1)


def echo_session(partitioned, session_options=None):
    """The partitioned model with the plugin node turned into the echo op (Casts and bytes unchanged), in a
    session made with ``session_options`` (default: fresh ones)."""
    import onnxruntime as ort
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    from mha_ep.python_op import bridge
    from mha_ep.registration import ensure_ops_registered

    ensure_ops_registered()
    if "registered" not in _echo_outputs:
        kinds = {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "string": PyCustomOpDef.dt_string}
        f32 = PyCustomOpDef.dt_float
        opdef = onnx_op(
            op_type="mha_ep.bench::EchoMha",
            inputs=[PyCustomOpDef.dt_int32 if x == "key_padding_mask" or x in spec.INT32_INPUTS else f32
                    for x in spec.PLUGIN_INPUTS],  # fmt: skip
            outputs=[f32] * len(spec.PLUGIN_OUTPUTS),
            attrs={a.name: kinds[a.kind] for a in spec.PLUGIN_ATTRIBUTES},
        )(_echo_body)
        bridge.adopt_op(opdef, lambda error, feed, attributes: (np.zeros((0,), np.float32),) * len(spec.PLUGIN_OUTPUTS))
        _echo_outputs["registered"] = True
    model = type(partitioned)()
    model.CopyFrom(partitioned)
    for node in model.graph.node:
        if node.domain == spec.PLUGIN_DOMAIN:
            node.domain, node.op_type = "mha_ep.bench", "EchoMha"
    model.opset_import.append(helper.make_opsetid("mha_ep.bench", 1))
    del model.functions[:]
    options = session_options if session_options is not None else ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def plugin_like_options(plugin_session):
    """Fresh SessionOptions with the intra-op spinning setting of ``plugin_session`` (an mha_ep.InferenceSession:
    mha_ep.register chose it), for the echo session of the floor."""
    import onnxruntime as ort

    from mha_ep.registration import ORT_SPINNING

    options = ort.SessionOptions()
    options.add_session_config_entry(
        ORT_SPINNING, plugin_session.get_session_options().get_session_config_entry(ORT_SPINNING)
    )
    return options


def pinned_bandwidth(nbytes: int = 256 << 20) -> tuple[float, float]:
    """(host->device, device->host) bytes/s with pinned host memory, measured now."""
    import cupy

    host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    device = cupy.empty(nbytes, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    results = []
    for kind in (1, 2):
        def copy():
            if kind == 1:
                cupy.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, nbytes, 1, stream.ptr)
            else:
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, nbytes, 2, stream.ptr)
            stream.synchronize()

        results.append(nbytes / median_seconds(copy, 5))
    return results[0], results[1]


def transport_bytes(problem) -> tuple[int, int]:
    arrays = [problem.query_BSD, problem.key, problem.value, problem.attention_bias]
    bytes_in = sum(4 * a.size for a in arrays if a is not None)
    if problem.padding_mask is not None:
        bytes_in += problem.padding_mask.data.size * 4
    return bytes_in, 4 * problem.query_BSD.shape[0] * problem.query_BSD.shape[1] * problem.geometry.v_hidden


# ----------------------------------------------------------------------------------------- other providers
def ort_cuda_available() -> bool:
    """onnxruntime lists the CUDA provider (a GPU build); its CUDA libraries are preloaded from the Python
    environment where the build offers that (onnxruntime-gpu >= 1.21: ``preload_dlls``)."""
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        return True
    except Exception:  # noqa: BLE001
        return False


def time_ort_cuda(model, feeds, repeats, dev_repeats) -> tuple[Optional[float], Optional[float]]:
    """(device-resident, host-to-host) seconds per run of stock ORT on CUDA; (None, None) when the session did not
    get the CUDA provider (ORT falls back to the CPU when the CUDA libraries do not load: that is no CUDA time)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    if "CUDAExecutionProvider" not in session.get_providers():
        log(f"stock ORT: the session runs on {session.get_providers()}, not CUDA; no ORT CUDA column for this row")
        return None, None
    host = median_seconds(lambda: session.run(None, feeds), repeats)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    binding.bind_output("output", "cuda")
    dev = median_seconds(lambda: session.run_with_iobinding(binding), dev_repeats)
    return dev, host


def time_sdpa(problem, dtype, extra, repeats) -> Optional[float]:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None
    if not torch.cuda.is_available():
        return None
    g = problem.geometry
    tdtype = torch.float16 if dtype == "float16" else torch.float32
    dev = torch.device("cuda")

    def bnsh(x, length):
        return torch.from_numpy(x).to(dev, tdtype).view(g.batch, length, g.num_heads, -1).transpose(1, 2)

    q, k, v = bnsh(problem.query_BSD, g.q_seq), bnsh(problem.key, g.kv_seq), bnsh(problem.value, g.kv_seq)
    mask = None
    if extra == "mask2d":
        keep = torch.from_numpy(problem.padding_mask.keep_BST(1, g.total_seq).copy()).to(dev)
        mask = keep[:, None, :, :]
    if extra == "attn_bias":
        mask = torch.from_numpy(problem.attention_bias).to(dev, tdtype)
    causal = extra == "causal"

    def launch():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    return torch_graph_seconds(torch, launch, repeats)  # the kernel column's timer: graph replays, median


# ---------------------------------------------------------------------------------------------------- the rows
def bench_row(label, b, s, t, n, h, dtype, extra, backend, bandwidth, repeats, with_cpu=True) -> dict:
    import onnxruntime as ort

    import mha_ep

    problem = anchor_problem(b, s, t, n, h, dtype, extra)
    model = anchor_model(b, s, t, n, h, dtype, extra)
    feeds = anchor_feeds(problem, dtype)
    heavy = flop_count(replace(problem, causal=False)) > CPU_FLOP_LIMIT  # stock ORT CPU computes every score
    host_repeats = max(3, repeats // 4) if heavy else repeats
    row = {"label": label, "shape": [b, s, t, n, h], "dtype": dtype, "extra": extra}
    kernel = backend_seconds(backend, problem, repeats=repeats)
    row["kernel_us"] = kernel * 1e6
    row["tflops"] = flop_count(problem) / kernel / 1e12
    session = mha_ep.InferenceSession(model, backend=backend.name)
    session.backend = backend
    echo = echo_session(session.model, plugin_like_options(session))
    host_s, echo_s = paired_medians([lambda: session.run(None, feeds), lambda: echo.run(None, feeds)], host_repeats)
    row["host_us"] = host_s * 1e6
    bytes_in, bytes_out = transport_bytes(problem)
    row["bytes_in"], row["bytes_out"] = bytes_in, bytes_out
    row["echo_us"] = echo_s * 1e6
    row["floor_us"] = (echo_s + bytes_in / bandwidth[0] + bytes_out / bandwidth[1] + kernel) * 1e6
    row["host_over_floor"] = row["host_us"] / row["floor_us"]
    row["ort_cpu_us"] = None
    if with_cpu and not heavy:
        stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        row["ort_cpu_us"] = median_seconds(lambda: stock.run(None, feeds), max(3, repeats // 4)) * 1e6
    row["ort_cuda_dev_us"] = row["ort_cuda_host_us"] = None
    if ort_cuda_available():
        dev, host = time_ort_cuda(model, feeds, host_repeats, max(repeats, ORT_DEV_REPEATS))
        if dev is not None:
            row["ort_cuda_dev_us"], row["ort_cuda_host_us"] = dev * 1e6, host * 1e6
    sdpa = time_sdpa(problem, dtype, extra, repeats)
    row["sdpa_us"] = None if sdpa is None else sdpa * 1e6
    return row


def fmt(value, digits=0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def print_table(rows) -> None:
    print("| shape (B,S,T,N,H) dtype extra | kernel µs | TFLOP/s | host µs | floor µs | host/floor | ort cpu µs "
          "| ort cuda dev µs | ort cuda host µs | sdpa µs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {fmt(r['kernel_us'], 1)} | {fmt(r['tflops'], 1)} | {fmt(r['host_us'])} "
            f"| {fmt(r['floor_us'])} | {fmt(r['host_over_floor'], 2)} | {fmt(r['ort_cpu_us'])} "
            f"| {fmt(r['ort_cuda_dev_us'], 1)} | {fmt(r['ort_cuda_host_us'])} | {fmt(r['sdpa_us'], 1)} |"
        )


def plot_sweep(rows, path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    lengths = [r["shape"][1] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, name in (
        ("kernel_us", "mha_ep kernel (device)"),
        ("host_us", "mha_ep host-to-host"),
        ("ort_cuda_dev_us", "ORT CUDA (device)"),
        ("ort_cuda_host_us", "ORT CUDA host-to-host"),
        ("sdpa_us", "torch SDPA (device)"),
    ):
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            ax.plot(lengths, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S = T (B=1, N=16, H=64, float16)")
    ax.set_ylabel("µs per call")
    ax.set_title("MultiHeadAttention time vs sequence length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench anchors", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", "--repeat", type=int, default=20, help="timed calls per column (median; default 20)")
    parser.add_argument("--device-id", type=int, default=0, help="GPU to run on (default 0)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON object on stdout (the tables go to stderr)")  # fmt: skip
    parser.add_argument("--out", metavar="DIR", default="mha_ep_bench",
                        help="folder for bench.json and sweep.png (default ./mha_ep_bench)")  # fmt: skip
    parser.add_argument("--only", help="run only anchor rows whose label contains this text")
    parser.add_argument("--no-sweep", action="store_true", help="skip the sequence-length sweep (and its PNG)")
    args = parser.parse_args(argv)

    from mha_ep.engine.backends import create_backend

    backend = create_backend("cuda", args.device_id)
    bandwidth = pinned_bandwidth()
    log(f"device: {backend.device}; pinned H2D {bandwidth[0] / 1e9:.1f} GB/s, D2H {bandwidth[1] / 1e9:.1f} GB/s; "
        f"ORT CUDA provider: {'yes' if ort_cuda_available() else 'no'}")
    anchors = [a for a in ANCHORS if not args.only or args.only in a.label]
    rows = []
    for index, anchor in enumerate(anchors, 1):
        log(f"[{index}/{len(anchors)}] {anchor.label}")
        rows.append(bench_row(anchor.label, *anchor.shape, backend=backend, bandwidth=bandwidth, repeats=args.repeats))
    print(f"\nanchors on {backend.device} (pinned H2D {bandwidth[0] / 1e9:.1f} GB/s, D2H {bandwidth[1] / 1e9:.1f} GB/s)")
    print_table(rows)
    sweep = []
    if not args.no_sweep:
        for index, length in enumerate(SWEEP, 1):
            log(f"[sweep {index}/{len(SWEEP)}] S=T={length}")
            sweep.append(bench_row(f"1,{length},{length},16,64 f16", 1, length, length, 16, 64, "float16", None,
                                   backend=backend, bandwidth=bandwidth, repeats=args.repeats, with_cpu=False))
        print("\nsweep")
        print_table(sweep)
    data = {"device": backend.device, "pinned_bytes_per_s": bandwidth, "anchors": rows, "sweep": sweep}
    path = write_json(args.out, "bench.json", data)
    png = plot_sweep(sweep, os.path.join(args.out, "sweep.png")) if sweep else None
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    if args.json:
        print_json(data)
    return 0
