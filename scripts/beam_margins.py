"""How close the beam-search choices of a ``bench generate`` random-weight row are (CPU, stock ORT): names the ties
where two GPU loops may part.

    python scripts/beam_margins.py --size base --batch 1 [--dtype float16] [--json out/gen/bench_generate.json]

Re-runs the row's beam search exactly as mha_ep/bench/generate.py sets it up (the same seeds, the end-of-text id
suppressed, BEAMS beams, ``--steps`` steps) with stock ORT CPU and mha_ep/decode/beam.py, and prints per batch
entry the steps whose choice hangs on a small margin: the summed log-probability of the last candidate kept
minus the first one left out (a margin of 1e-5 is within the float32 rounding two attention kernels differ by).
With ``--json`` (the run's output), it also says where the row's stock_beam and static_beam answers part from
each other and from this CPU search, with the margin at that step.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def search(size: str, batch: int, steps: int, dtype: str = "float32"):
    import onnxruntime as ort

    from mha_ep.bench.generate import BEAMS, ENCODER_POSITIONS, PROMPT, SIZES, VOCAB
    from mha_ep.decode.beam import BeamSearch, best_tokens, log_softmax
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    layers, hidden, heads, ffn = SIZES[size]
    model = whisper_decoder_step(layers, hidden, heads, ffn, dtype, vocab=VOCAB)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)  # the draws in bench_random's order
    rng.integers(0, VOCAB, size=(batch, 1))
    rng.standard_normal((batch, ENCODER_POSITIONS, hidden))
    rows = np.repeat(np.arange(batch), BEAMS)
    first_logits = rng.standard_normal((batch, VOCAB)).astype(np.float32)[rows]
    feeds = decoder_step_feeds(batch, PROMPT, layers, hidden, heads, ENCODER_POSITIONS, dtype, seed=4)
    feeds.pop("hidden_states")
    cache = {n: v[rows] for n, v in feeds.items() if n.startswith("past_")}
    fixed = {n: v[rows] for n, v in feeds.items() if n.startswith("cross_")}
    eot = VOCAB - 1
    bias = np.zeros(VOCAB, np.float32)
    bias[eot] = -np.inf
    names = [o.name for o in session.get_outputs()]
    beam = BeamSearch(batch, BEAMS, eot)
    margins = []  # per step, per entry
    logprobs = log_softmax(first_logits, bias)
    for step in range(steps):
        values, ids = best_tokens(logprobs, BEAMS + 1)
        step_margins = []
        for b in range(batch):
            rows_b = range(b * BEAMS, (b + 1) * BEAMS)
            scores = sorted((np.float32(beam.sum_logprob[r] + values[r, k]) for r in rows_b for k in range(BEAMS + 1)),
                            reverse=True)  # fmt: skip
            step_margins.append(float(scores[BEAMS - 1] - scores[BEAMS]))
        margins.append(step_margins)
        sources, tokens = beam.step_top(values, ids)
        if step == steps - 1:
            break
        inputs = {"input_ids": tokens[:, None].astype(np.int64), **{n: v[sources] for n, v in cache.items()}, **fixed}
        outputs = dict(zip(names, session.run(None, inputs)))
        cache = {n.replace("present_", "past_", 1): v for n, v in outputs.items() if n.startswith("present_")}
        logprobs = log_softmax(outputs["logits"][:, -1].astype(np.float32), bias)
    return beam.result(), margins


def parting(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=("tiny", "base", "small"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--json", help="bench_generate.json of the run whose answers to compare")
    ap.add_argument("--below", type=float, default=1e-3, help="print the steps with margins under this")
    args = ap.parse_args(argv)
    answers, margins = search(args.size, args.batch, args.steps, args.dtype)
    for b in range(args.batch):
        close = [(step, m[b]) for step, m in enumerate(margins) if m[b] < args.below]
        print(f"entry {b}: smallest margin {min(m[b] for m in margins):.3g}; steps under {args.below:g}: "
              + ", ".join(f"{step} ({margin:.2g})" for step, margin in close))  # fmt: skip
    if args.json:
        rows = json.load(open(args.json))["rows"]
        label = f"Whisper-{args.size}-sized"
        row = next(r for r in rows if r["label"].startswith(label) and f"B={args.batch} {args.dtype}" in r["label"])
        got = row["beam_answers"]
        for b in range(args.batch):
            stock, static = got["stock_beam"][b], got["static_beam"][b]
            for name, (x, y) in {"stock_beam vs static_beam": (stock, static), "cpu vs stock_beam": (answers[b], stock),
                                 "cpu vs static_beam": (answers[b], static)}.items():  # fmt: skip
                if x == y:
                    print(f"entry {b}: {name}: identical ({len(x)} tokens)")
                    continue
                at = parting(x, y)
                print(f"entry {b}: {name}: part at token {at}; margin at that step {margins[at][b]:.3g}, "
                      f"smallest over steps {max(0, at - 2)}..{at}: {min(m[b] for m in margins[max(0, at - 2):at + 1]):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
