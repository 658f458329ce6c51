"""How close the choices of a ``bench generate`` random-weight row are (CPU, stock ORT): names the ties where two
GPU loops may part.

    python scripts/beam_margins.py --size base --batch 1 [--dtype float16] [--greedy] [--json out/gen/bench_generate.json]

Re-runs the row's search exactly as mha_ep/bench/generate.py sets it up (the same seeds and ``--steps`` steps) with
stock ORT CPU, and prints per batch entry the steps whose choice hangs on a small margin:
  beam search (the default; mha_ep/decode/beam.py, the end-of-text id suppressed, BEAMS beams): the summed
           log-probability of the last candidate kept minus the first one left out;
  --greedy the greedy loop (generate.host_greedy's choice): the best logit minus the second best.
A margin of 1e-5 is within the float32 rounding two attention kernels differ by; float16 logits are rounded at
about 1e-3 of their size. With ``--json`` (the run's output), it also says where the row's GPU answers part from
each other and from this CPU search, with the margin at that step: stock_beam and static_beam, or with --greedy
each greedy column against stock_iobinding (``greedy_answers``, written since 2026-12-07).
The deployed sizes (turbo, large-v3) take their vocabulary from the bench (51,866); large-v3 in float16 on the CPU
takes minutes a step at B = 8.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def row_setup(size: str, batch: int, dtype: str):
    """The row's decoder session on stock ORT CPU and its feeds, drawn in bench_random's order: (session, vocab,
    first ids (B, 1), prompt cache, cross-attention K/V, rng for the draws after them)."""
    import onnxruntime as ort

    from mha_ep.bench.generate import ENCODER_POSITIONS, PROMPT, SIZES, Row
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    layers, hidden, heads, ffn = SIZES[size]
    vocab = Row(size, batch, dtype).vocab
    model = whisper_decoder_step(layers, hidden, heads, ffn, dtype, vocab=vocab)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)  # the draws in bench_random's order
    first = rng.integers(0, vocab, size=(batch, 1)).astype(np.int64)
    rng.standard_normal((batch, ENCODER_POSITIONS, hidden))
    feeds = decoder_step_feeds(batch, PROMPT, layers, hidden, heads, ENCODER_POSITIONS, dtype, seed=4)
    feeds.pop("hidden_states")
    cache = {n: v for n, v in feeds.items() if n.startswith("past_")}
    fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    return session, vocab, first, cache, fixed, rng


def next_cache(session, outputs: list) -> tuple:
    """(the presents as the next step's pasts, the last position's float32 logits)."""
    named = dict(zip([o.name for o in session.get_outputs()], outputs))
    cache = {n.replace("present_", "past_", 1): v for n, v in named.items() if n.startswith("present_")}
    return cache, named["logits"][:, -1].astype(np.float32)


def greedy_search(size: str, batch: int, steps: int, dtype: str = "float32"):
    """generate.host_greedy's loop (no end-of-text rule, as the random rows run it): (tokens per entry, per token
    per entry the best logit minus the second best where it was chosen; inf for the given first token)."""
    session, _, ids, cache, fixed, _ = row_setup(size, batch, dtype)
    tokens = [[] for _ in range(batch)]
    margins = [[float("inf")] * batch]  # margins[t]: token t's choice (the first is given)
    for step in range(steps):
        for b in range(batch):
            tokens[b].append(int(ids[b, 0]))
        if step == steps - 1:
            break
        cache, logits = next_cache(session, session.run(None, {"input_ids": ids, **fixed, **cache}))
        top = np.sort(logits, axis=-1)[:, -2:]
        margins.append([float(t[1] - t[0]) for t in top])
        ids = logits.argmax(-1).astype(np.int64)[:, None]
    return tokens, margins


def search(size: str, batch: int, steps: int, dtype: str = "float32"):
    """The beam search of bench_random's beam columns: (answer per entry, per step per entry the margin)."""
    from mha_ep.bench.generate import BEAMS
    from mha_ep.decode.beam import BeamSearch, best_tokens, log_softmax

    session, vocab, _, feeds_cache, feeds_fixed, rng = row_setup(size, batch, dtype)
    rows = np.repeat(np.arange(batch), BEAMS)
    first_logits = rng.standard_normal((batch, vocab)).astype(np.float32)[rows]
    cache = {n: v[rows] for n, v in feeds_cache.items()}
    fixed = {n: v[rows] for n, v in feeds_fixed.items()}
    eot = vocab - 1
    bias = np.zeros(vocab, np.float32)
    bias[eot] = -np.inf
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
        cache, logits = next_cache(session, session.run(None, inputs))
        logprobs = log_softmax(logits, bias)
    return beam.result(), margins


def parting(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    from mha_ep.bench.generate import SIZES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=tuple(SIZES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--greedy", action="store_true", help="the greedy columns' choices, not the beam search's")
    ap.add_argument("--json", help="bench_generate.json of the run whose answers to compare")
    ap.add_argument("--below", type=float, default=1e-3, help="print the steps with margins under this")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        ap.error(f"--batch {args.batch} and --steps {args.steps}: both must be at least 1")
    answers, margins = (greedy_search if args.greedy else search)(args.size, args.batch, args.steps, args.dtype)
    for b in range(args.batch):
        close = [(step, m[b]) for step, m in enumerate(margins) if m[b] < args.below]
        print(f"entry {b}: smallest margin {min(m[b] for m in margins):.3g}; steps under {args.below:g}: "
              + ", ".join(f"{step} ({margin:.2g})" for step, margin in close))  # fmt: skip
    if args.json:
        for b, name, at in partings(args, answers):
            print(f"entry {b}: {name}: " + ("identical" if at is None else
                  f"part at token {at}; margin at that step {margins[at][b]:.3g}, smallest over steps "
                  f"{max(0, at - 2)}..{at}: {min(m[b] for m in margins[max(0, at - 2):at + 1]):.3g}"))  # fmt: skip
    return 0


def partings(args, answers: list) -> list:
    """(entry, "x vs y", the first token where they differ or None) for the row of ``args.json`` that ``args``
    names: the beam columns against each other and this CPU search, or (--greedy) each greedy column against
    stock_iobinding and this CPU search."""
    from mha_ep.bench.generate import NAMES

    rows = json.load(open(args.json))["rows"]
    label = f"Whisper-{NAMES.get(args.size, args.size)}-sized"
    row = next((r for r in rows if r["label"].startswith(label) and f"B={args.batch} {args.dtype}" in r["label"]),
               None)  # fmt: skip
    key = "greedy_answers" if args.greedy else "beam_answers"
    if row is None or key not in row:
        raise SystemExit(f"{args.json}: no row {label} B={args.batch} {args.dtype} with {key}")
    got = row[key]
    reference = "stock_iobinding" if args.greedy else "stock_beam"
    pairs = [(reference, c) for c in got if c != reference] + [("cpu", c) for c in got]
    found = []
    for b in range(args.batch):
        for x, y in pairs:
            a = answers[b] if x == "cpu" else got[x][b]
            c = got[y][b]
            found.append((b, f"{x} vs {y}", None if a == c else parting(a, c)))
    return found


if __name__ == "__main__":
    sys.exit(main())
