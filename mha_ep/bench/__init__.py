"""Benchmarks: everything in mha_ep that times or compares speed. They print numbers; nothing here asserts a time.

    mha-ep bench hook      the bridge: an echo Python op's per-call cost and output throughput with
                           onnxruntime-extensions' stock result hook (flatten().tolist()) vs mha_ep's array hook,
                           and the plugin op's fixed per-call overhead on a tiny MHA call (hook.py)
    mha-ep bench anchors   the DESIGN.md anchor shapes, a sequence sweep (JSON + PNG), every provider present
                           (GPU; gpu.py has the columns)
    mha-ep bench models    whole models host to host: shipped BERT/Whisper, real MiniLM and Whisper tiny.en when
                           built; plugin vs ORT CPU (and ORT CUDA); any backend (models.py)
    mha-ep bench device    whole models on the GPU: device-resident mode (eager, device feeds, CUDA graphs) and
                           the bridge against stock ORT CUDA (numpy feeds, IOBinding, its CUDA graph) (device.py)
    python3 -m mha_ep.bench.fused_timing     the fused kernels alone, their tiles, torch SDPA; --compare SOURCES
    python3 -m mha_ep.bench.backend_timing   the cuda backend's device and host time per anchor

Shared by all: ``anchors.py`` (the one anchor table, with the reference times it is judged against, and the one
FLOP model) and ``timer.py`` (the one median timer, on the host and on a CUDA stream). The cuda backend offers one
hook to time, ``CudaBackend.prepared(problem)`` (a staged call to submit); no module under mha_ep/ops imports
anything from here.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    """``mha-ep bench WHAT [options]``: each benchmark parses its own options (``mha-ep bench WHAT --help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "anchors":
        from mha_ep.bench import gpu

        return gpu.main(argv[1:])
    if argv and argv[0] == "models":
        from mha_ep.bench import models

        return models.main(argv[1:])
    if argv and argv[0] == "device":
        from mha_ep.bench import device

        return device.main(argv[1:])
    parser = argparse.ArgumentParser(prog="mha-ep bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("what", choices=["hook", "anchors", "models", "device"], help="which benchmark; WHAT --help for its options")
    parser.add_argument("--repeats", "--repeat", type=int, default=30, help="hook: timed runs per row")
    parser.add_argument("--json", help="hook: also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    from mha_ep.bench.hook import bench_hook

    result = bench_hook(args.repeats)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
