"""A/B of programmatic launches in a static-cache decode step (GPU machine, onnxruntime-gpu on the path).

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/programmatic_ab.py [--size turbo] [--dtype float16]
        [--batch 1] [--steps 64] [--rounds 7]

Two static decoders of the same random-weight Whisper decoder (mha_ep/bench/generate.py's, as
profile_static_decode.py builds it), each replayed through ORT's CUDA graph: one planned with MHA_EP_PROGRAMMATIC
off, one with it on (dispatch.programmatic_launches: the cross attention's split_key_stream launched
programmatically after zero_after_prior_grids, so that its blocks load their K and V tiles while the kernels before
them still run). Plans are made per process and kept by a captured graph, so the two are planned in turn with the
plan cache cleared between them, then timed in turns: ms per step of whole greedy generations (the loop queued
ahead of the GPU), the median over ``--rounds`` generations each, and whether the two answer the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profile_static_decode import make_decoder, setup  # noqa: E402

MODES = ("off", "on")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="turbo")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    args.beams = 0
    import cupy

    from mha_ep import native
    from mha_ep.bench.generate import PROMPT
    from mha_ep.decode.static_decode import greedy_static
    from mha_ep.engine.cuda.dispatch import PROGRAMMATIC_ENV

    model, _, cache, fixed, stream = setup(args)
    first = cupy.asarray(np.ones((args.batch, 1), np.int64))
    decoders, tokens = {}, {}

    def generation(mode: str) -> float:
        decoder = decoders[mode]
        decoder.load_prompt(cache, PROMPT)
        stream.synchronize()
        start = time.perf_counter()
        tokens[mode] = greedy_static(decoder, first, PROMPT, args.steps)
        return (time.perf_counter() - start) / args.steps

    for mode in MODES:
        os.environ[PROGRAMMATIC_ENV] = mode
        native.reset_plans()
        decoders[mode] = make_decoder(model, args, stream, fixed, graph=True)
        generation(mode)  # planned and captured here
        print(f"{mode}: planned and captured", flush=True)
    samples = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            samples[mode].append(generation(mode) * 1e3)
    medians = {mode: statistics.median(samples[mode]) for mode in MODES}
    print(f"{args.size} B={args.batch} {args.dtype}, {args.steps} steps, median of {args.rounds} generations each "
          f"in turns: ms/step off {medians['off']:.4f}, on {medians['on']:.4f}, on / off "
          f"{medians['on'] / medians['off']:.3f}; tokens {'the same' if tokens['on'] == tokens['off'] else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
