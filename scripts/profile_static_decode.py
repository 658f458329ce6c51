"""Where a static-cache decode step's time goes (GPU machine, onnxruntime-gpu on the path; docs/DEVICE_RUNBOOK.md).

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/profile_static_decode.py steps [--size tiny] [--batch 1]
    ... profile_static_decode.py kernels [--size tiny] [--batch 1] [--beams 5]

``steps``: ms per step of whole greedy generations, how often the native library was called (0 after capture:
every step is a graph replay), and one step's host time (ORT's run_with_iobinding) against its time to completion.
``kernels``: every CUDA kernel of one step (torch.profiler, CUPTI), summed by name, GPU µs per step: the static
decoder replayed as a graph, the same decoder run eagerly, the token kernels (greedy_step, or beam_rows and
beam_select with --beams), and stock ORT CUDA's dynamic-cache step at the same P, side by side.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def setup(args):
    import cupy
    import onnxruntime as ort

    ort.preload_dlls()
    from mha_ep.bench.generate import PROMPT, SIZES, VOCAB
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    layers, hidden, heads, ffn = SIZES[args.size]
    model = whisper_decoder_step(layers, hidden, heads, ffn, args.dtype, vocab=VOCAB)
    rows = args.batch * max(args.beams, 1)
    feeds = decoder_step_feeds(rows, PROMPT, layers, hidden, heads, 1500, args.dtype, seed=4)
    feeds.pop("hidden_states")
    cache = {n.replace("past_", "present_", 1): v for n, v in feeds.items() if n.startswith("past_")}
    fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    stream = cupy.cuda.Stream(non_blocking=True)
    return model, feeds, cache, fixed, stream


def make_decoder(model, args, stream, fixed, graph: bool):
    from mha_ep.bench.generate import MAX_LENGTH
    from mha_ep.decode.static_decode import StaticDecoder, cuda_session
    from mha_ep.graph.static_cache import static_cache

    rows = args.batch * max(args.beams, 1)
    static = static_cache(model, max_length=MAX_LENGTH, batch=rows, beams=args.beams).model
    decoder = StaticDecoder(cuda_session(static, stream, graph=graph), args.batch, stream=stream, beams=args.beams,
                            fixed_shapes={name: value.shape for name, value in fixed.items()})  # fmt: skip
    decoder.set_inputs(fixed)
    return decoder


def steps(args) -> None:
    import cupy

    from mha_ep import native
    from mha_ep.bench.generate import PROMPT
    from mha_ep.decode.static_decode import greedy_static

    model, _, cache, fixed, stream = setup(args)
    decoder = make_decoder(model, args, stream, fixed, graph=True)
    first = cupy.asarray(np.ones((args.batch, 1), np.int64))
    for attempt in range(3):
        decoder.load_prompt(cache, PROMPT)
        before = native.stats()
        stream.synchronize()
        start = time.perf_counter()
        greedy_static(decoder, first, PROMPT, args.steps)
        elapsed = time.perf_counter() - start
        after = native.stats()
        print(f"generation {attempt}: {1e3 * elapsed / args.steps:.3f} ms/step; native computes called "
              f"{after['hits'] + after['misses'] - before['hits'] - before['misses']} times in {args.steps - 1} steps")
    decoder.load_prompt(cache, PROMPT)
    stream.synchronize()
    calls, done = [], []
    for _ in range(30):
        decoder.past_sequence_length[...] = PROMPT
        stream.synchronize()
        t0 = time.perf_counter()
        decoder.step()
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        done.append(t2 - t0)
    print(f"one step: ORT run_with_iobinding host {1e6 * statistics.median(calls):.0f} us, to completion "
          f"{1e6 * statistics.median(done):.0f} us")


def print_table(title: str, table: dict) -> None:
    total = sum(micros for _, micros in table.values())
    launches = sum(count for count, _ in table.values())
    print(f"\n{title}: {launches:.0f} kernels, {total:.1f} GPU us per step")
    for name, (count, micros) in sorted(table.items(), key=lambda item: -item[1][1])[:25]:
        print(f"  {micros:8.1f} us  {count:5.1f}x  {name}")


def kernels(args) -> None:
    import cupy
    import onnxruntime as ort

    from mha_ep.bench.generate import PROMPT, PROVIDERS, bound_step
    from mha_ep.decode.static_decode import GREEDY_THREADS, decode_function
    from mha_ep.bench.cupti import kernel_table

    model, feeds, cache, fixed, stream = setup(args)
    for graph in (True, False):
        decoder = make_decoder(model, args, stream, fixed, graph=graph)
        decoder.load_prompt(cache, PROMPT)

        def run(decoder=decoder):
            decoder.past_sequence_length[...] = PROMPT
            decoder.step()
            stream.synchronize()

        print_table(f"static decoder, {'replayed graph' if graph else 'eager'} (B={decoder.rows} rows)",
                    kernel_table(run))  # fmt: skip
    rows = decoder.rows
    with stream:
        done = cupy.zeros((rows,), cupy.uint8)
        tokens = cupy.full((rows, decoder.max_length), -1, cupy.int64)
        done_all = cupy.zeros((1,), cupy.int32)
        arrived = cupy.zeros((1,), cupy.uint32)
        greedy = decode_function(0, f"greedy_step<{decoder.logits_element}, {decoder.id_type}>")

    def token_kernel():
        with stream:
            decoder.past_sequence_length[...] = PROMPT
            greedy((rows,), (GREEDY_THREADS,), (decoder.logits, np.uint64(0), np.int32(rows),
                                                np.int32(decoder.logits.shape[-1]), decoder.ids,
                                                decoder.past_sequence_length, done, tokens,
                                                np.int32(decoder.max_length), np.int32(-1), done_all,
                                                arrived))  # fmt: skip
        stream.synchronize()

    print_table("greedy_step", kernel_table(token_kernel))
    if args.beams:
        from mha_ep.decode.static_decode import beam_static

        decoder = make_decoder(model, args, stream, fixed, graph=True)
        decoder.load_prompt(cache, PROMPT)
        with stream:
            prompt_logits = cupy.asarray(np.random.default_rng(0).standard_normal(
                (rows, decoder.logits.shape[-1])).astype(decoder.logits.dtype))  # fmt: skip
        print_table(f"beam_static, {args.steps} steps, per step",
                    {name: (count / args.steps, micros / args.steps) for name, (count, micros) in kernel_table(
                        lambda: (beam_static(decoder, prompt_logits, [1] * PROMPT, args.steps, eot=-5),
                                 stream.synchronize()), repeats=1).items()})  # fmt: skip
    stock = ort.InferenceSession(model.SerializeToString(), providers=PROVIDERS)
    stock_step = bound_step(stock, {"input_ids": np.ones((rows, 1), np.int64), **feeds})
    print_table(f"stock ORT CUDA, dynamic cache at P={PROMPT}", kernel_table(stock_step))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("steps", "kernels"))
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--beams", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    {"steps": steps, "kernels": kernels}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
