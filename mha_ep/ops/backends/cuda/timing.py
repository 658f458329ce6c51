"""Timing of the cuda backend on the DESIGN.md anchor shapes.

    PYTHONPATH=$PWD python3 -m mha_ep.ops.backends.cuda.timing [--repeats 20]

Per shape it reports
  dev µs:   device time of the attention itself, inputs already on the device (CudaBackend.time_device): on the
            fused path (layout movers + fused kernel) from CUDA-graph replays; on the three-phase path (layout
            kernels, both GEMMs, softmax, output kernel) from ``repeats`` back-to-back submissions between two
            CUDA events, which on small shapes includes the gaps Python's launch cost leaves on the GPU
            (per-kernel sums: run this module under ncu with --repeats 1);
  TFLOP/s:  4*B*N*S*T*H / dev time (half for causal), the FLOP model of DESIGN.md;
  host µs:  median wall time of ``backend.run(problem)``: host float32 arrays in, host float32 arrays out;
  host GB/s: bytes in + out (float32) / host time.
Inputs are random normals rounded to the call's dtype.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mha_ep.ops.backends.cuda.fused import flop_count
from mha_ep.ops.problem import build_problem

# (label, B, S, T, N, H, dtype, extra)
ANCHORS = (
    ("1,128,128,12,64 f32", 1, 128, 128, 12, 64, "float32", None),
    ("8,512,512,12,64 f32", 8, 512, 512, 12, 64, "float32", None),
    ("8,512,512,12,64 f16", 8, 512, 512, 12, 64, "float16", None),
    ("8,512,512,12,64 f16 + 2D key padding mask", 8, 512, 512, 12, 64, "float16", "mask2d"),
    ("8,512,512,12,64 f16 + attention_bias (B,1,S,T)", 8, 512, 512, 12, 64, "float16", "attn_bias"),
    ("1,4096,4096,16,64 f16", 1, 4096, 4096, 16, 64, "float16", None),
    ("1,4096,4096,16,64 f16 causal", 1, 4096, 4096, 16, 64, "float16", "causal"),
    ("4,2048,2048,16,128 f16", 4, 2048, 2048, 16, 128, "float16", None),
    ("1,1,448,6,64 f32 (Whisper decode step)", 1, 1, 448, 6, 64, "float32", None),
    ("4,1500,1500,6,64 f16 (Whisper encoder)", 4, 1500, 1500, 6, 64, "float16", None),
)


def anchor_problem(b, s, t, n, h, dtype, extra, seed=0):
    rng = np.random.default_rng(seed)
    cast = {"float32": np.float32, "float16": np.float16}[dtype]

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(cast).astype(np.float32)

    arrays = [rand(b, s, n * h), rand(b, t, n * h), rand(b, t, n * h), None, None, None, None, None]
    if extra == "mask2d":
        lengths = rng.integers(t // 2, t + 1, size=b)
        arrays[4] = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    if extra == "attn_bias":
        arrays[5] = rand(b, 1, s, t)
    attrs = {"num_heads": n, "unidirectional": int(extra == "causal")}
    return build_problem(attrs, arrays, dtype, (True, False, False, False))


def host_time(backend, problem, repeats: int) -> float:
    backend.run(problem)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.run(problem)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--only", default=None, help="run only the anchors whose label contains this text")
    args = parser.parse_args(argv)

    from mha_ep.ops.backends.cuda import CudaBackend

    backend = CudaBackend(args.device)
    print(f"device: {backend.device}; dev = kernels+GEMMs (CUDA events), host = backend.run numpy->numpy")
    print("| shape (B,S,T,N,H) dtype extra | dev µs | TFLOP/s | host µs | host GB/s |")
    print("|---|---|---|---|---|")
    for label, b, s, t, n, h, dtype, extra in ANCHORS:
        if args.only is not None and args.only not in label:
            continue
        problem = anchor_problem(b, s, t, n, h, dtype, extra)
        dev = backend.time_device(problem, repeats=args.repeats)
        host = host_time(backend, problem, max(5, args.repeats // 2))
        flops = flop_count(problem)
        nbytes = 4 * (2 * b * s * n * h + 2 * b * t * n * h)
        print(f"| {label} | {dev * 1e6:.1f} | {flops / dev / 1e12:.1f} | {host * 1e6:.0f} | {nbytes / host / 1e9:.2f} |")


if __name__ == "__main__":
    main()
