"""``mha-ep bench hook``: the bridge. An echo Python op's per-call cost and output throughput with
onnxruntime-extensions' stock result hook (flatten().tolist()) vs mha_ep's array hook, and the plugin op's fixed
per-call overhead on a tiny MHA call.

Byte model of the hook rows: bytes out = 4 * elements (float32); GB/s = bytes out / time per call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np

from mha_ep.bench.output import add_output_options, emit
from mha_ep.bench.timer import median_seconds

ECHO_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)  # float32 elements returned per call


def _median_ms(fn, repeat: int, warmup: int = 2) -> float:
    return median_seconds(fn, repeat, warmup) * 1000.0


def _echo_session():
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    from mha_ep.registration import ensure_ops_registered

    ensure_ops_registered()  # installs the array hook; the bench swaps hooks itself below

    @onnx_op(op_type="mha_ep.bench::Echo", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def echo(x):
        return x

    node = helper.make_node("Echo", ["x"], ["y"], domain="mha_ep.bench")
    graph = helper.make_graph(
        [node],
        "echo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mha_ep.bench", 1)]
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bench_hook(repeat: int) -> dict:
    from onnxruntime_extensions import PyCustomOpDef
    from onnxruntime_extensions import _ocos as stock

    from mha_ep import registration

    session = _echo_session()
    rows = []
    print(f"{'elements':>10} {'MB out':>8} {'stock hook ms':>14} {'array hook ms':>14} {'speed-up':>9} {'GB/s (array)':>13}")
    for n in ECHO_SIZES:
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        feed = {"x": x}
        PyCustomOpDef.install_hooker(stock._on_pyop_invocation)
        stock_ms = _median_ms(lambda: session.run(None, feed), max(3, repeat // (1 + n // 65536)))
        PyCustomOpDef.install_hooker(registration._array_result_hook)
        array_ms = _median_ms(lambda: session.run(None, feed), repeat)
        out = session.run(None, feed)[0]
        assert np.array_equal(out, x), "echo op returned wrong data"
        mb = 4 * n / 1e6
        rows.append({"elements": n, "stock_ms": stock_ms, "array_ms": array_ms, "gb_per_s": mb / array_ms})
        print(f"{n:>10} {mb:>8.2f} {stock_ms:>14.3f} {array_ms:>14.3f} {stock_ms / array_ms:>8.1f}x {mb / array_ms:>13.2f}")
    return {"echo": rows, "mha_overhead": bench_mha_overhead(repeat)}


def bench_mha_overhead(repeat: int) -> dict:
    """A tiny MHA call through the plugin: session.run total vs the backend's own run (reference backend)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    import mha_ep
    from mha_ep.engine.problem import build_problem

    b, s, n, h = 1, 1, 6, 64
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=n)
    graph = helper.make_graph(
        [node],
        "tiny",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [b, s, n * h]) for x in "qkv"],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [b, s, n * h])],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    rng = np.random.default_rng(1)
    feeds = {x: rng.standard_normal((b, s, n * h)).astype(np.float32) for x in "qkv"}
    plugin = mha_ep.InferenceSession(model, backend="reference")
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session_ms = _median_ms(lambda: plugin.run(None, feeds), repeat)
    stock_ms = _median_ms(lambda: stock.run(None, feeds), repeat)
    arrays = [feeds["q"], feeds["k"], feeds["v"]]
    backend_ms = _median_ms(lambda: plugin.backend.run(build_problem({"num_heads": n}, arrays)), repeat)
    print(
        f"\nMHA (B,S,T,N,H)=({b},{s},{s},{n},{h}) through the plugin: {session_ms * 1000:.0f} us per run, of which "
        f"validation + reference math {backend_ms * 1000:.0f} us; bridge + session overhead "
        f"{(session_ms - backend_ms) * 1000:.0f} us (stock ORT CPU whole run: {stock_ms * 1000:.0f} us)"
    )
    return {"session_ms": session_ms, "backend_ms": backend_ms, "stock_ms": stock_ms}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench hook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", "--repeat", type=int, default=30,
                        help="timed runs per row (the stock hook's large rows get fewer; default 30)")  # fmt: skip
    add_output_options(parser, out_help="also write the numbers into this folder as bench_hook.json")
    args = parser.parse_args(argv)
    result = bench_hook(args.repeats)
    emit(args, "bench_hook.json", result)
    return 0


if __name__ == "__main__":
    from mha_ep.bench import main as bench_main

    sys.exit(bench_main(["hook", *sys.argv[1:]]))
