"""Timing of the cuda backend on the anchor shapes (docs/FACTS.md §2).

    PYTHONPATH=$PWD python3 -m mha_ep.bench.backend_timing [--repeats 20]

Per shape it reports
  dev µs:   device time of the attention itself, inputs already on the device (timer.backend_seconds): on the
            fused path (layout movers + fused kernel) from CUDA-graph replays; on the three-phase path (layout
            kernels, both GEMMs, softmax, output kernel) from ``repeats`` back-to-back submissions between two
            CUDA events, which on small shapes includes the gaps Python's launch cost leaves on the GPU
            (per-kernel sums: run this module under ncu with --repeats 1);
  TFLOP/s:  4*B*N*S*T*H / dev time (half for causal), the FLOP model of docs/FACTS.md §2;
  host µs:  median wall time of ``backend.run(problem)``: host float32 arrays in, host float32 arrays out;
  host GB/s: bytes in + out (float32) / host time.
Inputs are random normals rounded to the call's dtype.
"""

from __future__ import annotations

import argparse

from mha_ep.bench.anchors import ANCHORS, anchor_problem, flop_count
from mha_ep.bench.timer import backend_seconds, median_seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per anchor (median; default 20)")
    parser.add_argument("--device", type=int, default=0, help="GPU to run on (default 0)")
    parser.add_argument("--only", default=None, help="run only the anchors whose label contains this text")
    args = parser.parse_args(argv)

    from mha_ep.engine.cuda import CudaBackend

    backend = CudaBackend(args.device)
    print(f"device: {backend.device}; dev = kernels+GEMMs (CUDA events), host = backend.run numpy->numpy")
    print("| shape (B,S,T,N,H) dtype extra | dev µs | TFLOP/s | host µs | host GB/s |")
    print("|---|---|---|---|---|")
    for row in ANCHORS:
        if args.only is not None and args.only not in row.label:
            continue
        label, (b, s, t, n, h, _, _) = row.label, row.shape
        problem = anchor_problem(*row.shape)
        dev = backend_seconds(backend, problem, repeats=args.repeats)
        host = median_seconds(lambda: backend.run(problem), max(5, args.repeats // 2), warmup=1)
        flops = flop_count(problem)
        nbytes = 4 * (2 * b * s * n * h + 2 * b * t * n * h)
        print(f"| {label} | {dev * 1e6:.1f} | {flops / dev / 1e12:.1f} | {host * 1e6:.0f} | {nbytes / host / 1e9:.2f} |")


if __name__ == "__main__":
    main()
