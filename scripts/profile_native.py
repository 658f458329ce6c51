"""Where the native route's time goes on a row of ``mha-ep bench native`` (run on the GPU machine with
onnxruntime-gpu and torch on the path; docs/DEVICE_RUNBOOK.md):

    python3 scripts/profile_native.py kernels "Whisper-tiny"     every CUDA kernel of one eager IOBinding run of the
                                                                  stock and the native session (torch.profiler,
                                                                  CUPTI), summed by name, GPU µs
    python3 scripts/profile_native.py planner "B=1 S=32"         a shape's first call: its wall time, the planner's
                                                                  share (gpu.plan_call timed), and a cProfile of it

The row is the first of bench/native.py's ENCODERS or FIRST_CALLS whose label contains the text.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from mha_ep.bench import native as bench
from mha_ep.bench.cupti import kernel_table


def pick(text: str, rows) -> bench.Encoder:
    for row in rows:
        if text in row.label:
            return row
    raise SystemExit(f"no row's label contains {text!r}: {[r.label for r in rows]}")


def kernels(text: str) -> None:
    import cupy

    row = pick(text, bench.ENCODERS + bench.FIRST_CALLS)
    feeds = row.feeds()
    device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
    stock, native = bench.sessions(row.model())
    for label, session in (("stock ORT CUDA", stock), ("mha_ep native", native)):
        _, outputs = bench.output_values(session, feeds)
        table = kernel_table(bench.bound_call(session, device_feeds, outputs))
        total = sum(micros for _, micros in table.values())
        print(f"\n== {row.label}: {label}, {total:.1f} GPU µs per run, {sum(c for c, _ in table.values()):.0f} kernels")
        for name, (count, micros) in sorted(table.items(), key=lambda item: -item[1][1])[:25]:
            print(f"  {micros:9.1f} µs  x{count:4.0f}  {name}")


def planner(text: str) -> None:
    import cupy

    from mha_ep.native import gpu

    row = pick(text, bench.FIRST_CALLS + bench.ENCODERS)
    stock, native = bench.sessions(row.model())
    spent = []
    real = gpu.plan_call

    def timed(*args):
        start = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent.append(time.perf_counter() - start)

    from mha_ep.native import _native, configs, host

    _native.configure(configs.describe_kernel, timed, host.compute, configs.ATTRIBUTES)
    profiler = cProfile.Profile()
    for offset in range(1, 8):
        feeds = {n: cupy.asarray(v) for n, v in row.feeds(sequence=row.sequence + 100 + offset).items()}
        for label, session in (("stock", stock), ("native", native)):
            binding = session.io_binding()
            for key, array in feeds.items():
                binding.bind_input(key, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
            for output in session.get_outputs():
                binding.bind_output(output.name, "cuda", 0)
            before = len(spent)
            cupy.cuda.runtime.deviceSynchronize()
            start = time.perf_counter()
            if label == "native":
                profiler.enable()
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            profiler.disable()
            wall = (time.perf_counter() - start) * 1e3
            planned = sum(spent[before:]) * 1e3
            print(f"S={row.sequence + 100 + offset} {label:6s} first call {wall:7.3f} ms, planner {planned:6.3f} ms "
                  f"in {len(spent) - before} plan(s)")
    _native.configure(configs.describe_kernel, real, host.compute, configs.ATTRIBUTES)
    text_out = io.StringIO()
    pstats.Stats(profiler, stream=text_out).sort_stats("cumulative").print_stats(30)
    print(text_out.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("kernels", "planner"), help="which profile")
    parser.add_argument("row", help="text of the row's label (bench/native.py)")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    ort.preload_dlls()
    {"kernels": kernels, "planner": planner}[args.what](args.row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
