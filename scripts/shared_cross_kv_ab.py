"""A/B of static_cache's rule SHARED_CROSS_KV in a static beam search (GPU machine, onnxruntime-gpu on the path).

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/shared_cross_kv_ab.py [--size turbo] [--batch 8]
        [--dtype float16] [--steps 64] [--rounds 5]

The random-weight Whisper decoder of ``bench generate`` (mha_ep/bench/generate.py: its seeds, BEAMS beams, the
end-of-text id suppressed), rewritten for beam search twice: with the cross-attention keys and values one row per
beam (bound repeated, as stock ORT's beam loop binds them) and one row per batch entry (--shared-cross-kv, bound
once). Both replayed through ORT's CUDA graph, timed in turns: ms per step of whole searches (bench generate's
static_beam measure), the median over ``--rounds`` each, and whether the two answer the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="turbo")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import cupy
    import onnxruntime as ort

    ort.preload_dlls()
    from mha_ep.bench.generate import BEAMS, ENCODER_POSITIONS, PROMPT, SIZES, Row, static_decoder
    from mha_ep.decode.static_decode import beam_static
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    layers, hidden, heads, ffn = SIZES[args.size]
    vocab = Row(args.size, args.batch, args.dtype).vocab
    model = whisper_decoder_step(layers, hidden, heads, ffn, args.dtype, vocab=vocab)
    feeds = decoder_step_feeds(args.batch, PROMPT, layers, hidden, heads, ENCODER_POSITIONS, args.dtype, seed=4)
    rows = np.repeat(np.arange(args.batch), BEAMS)
    cache = {n.replace("past_", "present_", 1): v[rows] for n, v in feeds.items() if n.startswith("past_")}
    entry_cross = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    rng = np.random.default_rng(3)
    first_logits = cupy.asarray(rng.standard_normal((args.batch, vocab)).astype(np.float32)[rows])
    eot = vocab - 1
    bias = cupy.zeros((vocab,), cupy.float32)
    bias[eot] = -cupy.inf
    stream = cupy.cuda.Stream(non_blocking=True)
    forms = {"per beam": False, "shared": True}
    decoders = {form: static_decoder(model, args.batch, stream, entry_cross if shared else
                                     {n: v[rows] for n, v in entry_cross.items()}, beams=BEAMS,
                                     shared_cross_kv=shared) for form, shared in forms.items()}  # fmt: skip
    answers = {}

    def search(form: str) -> float:
        decoder = decoders[form]
        decoder.load_prompt(cache, PROMPT)
        stream.synchronize()
        start = time.perf_counter()
        answers[form] = beam_static(decoder, first_logits, [0] * PROMPT, args.steps, eot, bias)
        return 1e3 * (time.perf_counter() - start) / max(decoder.last_steps, 1)

    for form in forms:
        search(form)  # captured here
    samples = {form: [] for form in forms}
    for _ in range(args.rounds):
        for form in forms:
            samples[form].append(search(form))
    medians = {form: statistics.median(samples[form]) for form in forms}
    print(f"{args.size} B={args.batch} x {BEAMS} beams {args.dtype}, {args.steps} steps, median of {args.rounds} "
          f"searches each in turns: ms/step cross K/V per beam {medians['per beam']:.4f}, shared "
          f"{medians['shared']:.4f}, shared / per beam {medians['shared'] / medians['per beam']:.3f}; answers "
          f"{'the same' if answers['shared'] == answers['per beam'] else 'DIFFER'}")
    for entry, (ours, theirs) in enumerate(zip(answers["shared"], answers["per beam"])):
        if ours != theirs:  # where each differing entry's answers part (float16 near-ties show late and alone)
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            print(f"  entry {entry}: answers part at token {at} of {max(len(ours), len(theirs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
