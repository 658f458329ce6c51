"""What cuda_io's small-call path (OWN_RUN_MAX_BYTES: ORT's own ``run``) adds to a bare ORT session, on any machine.

    PYTHONPATH=<a folder with CuPy> python3 scripts/small_call_overhead.py [--threads 8] [--rounds 5]

CuPy must import (no GPU is needed: this path makes no CUDA call). The shipped BERT-shaped model runs on ORT's
CPU provider three ways: bare (``session.run``), through ``CudaSessionIO.run_host`` over the same session with
mha_ep.InferenceSession's error channel (``_run_binding``) as on the GPU, and through that mha_ep.InferenceSession's
``run`` over the same CudaSessionIO (the path of the GPU soak's session column, its CUDA calls aside). Printed: good calls per second of each
under ``--threads`` threads with the soak's mix of bad calls (bench/soak.py), in turns, the median of each
round's ratio, and one thread's median microseconds a call of each kind. docs/BENCH.md, "Host-side choices", has
the numbers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort

import mha_ep
from mha_ep import shipped
from mha_ep.bench import soak
from mha_ep.gpu_session.cuda_io import CudaSessionIO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="a column's time in one round")
    args = parser.parse_args()
    model = onnx.load(shipped.folder() / "bert_random_mask2d_fp32.onnx")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the threads are the callers'
    bare = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    channel = mha_ep.InferenceSession(model)  # its error channel, as cuda_io gets it on the GPU
    io = CudaSessionIO(bare, 0, False, channel._run_binding, lambda: None)
    channel._io = io  # channel.run is then mha_ep.InferenceSession.run on the GPU: the soak's session column
    # mha_ep refuses a claimed node's zero-length query, stock runs it (tests/claim/test_bad_input.py): left out
    cases = [c for c in soak.make_cases(model, bare, shapes=8, seed=3, max_sequence=32) if c.kind != "zero_length"]
    calls = {"bare": bare.run, "cuda_io": io.run_host, "session": channel.run}
    rates = {name: [] for name in calls}
    for round_index in range(args.rounds):
        for name, call in calls.items():
            tally = soak.soak([call], cases, threads=args.threads, seconds=args.seconds, bad=0.3, tolerance=1e-4,
                              seed=round_index)  # fmt: skip
            if (tally.wrong, tally.mistyped) != (0, 0):
                raise SystemExit(f"{name}: {tally.examples}")
            rates[name].append(tally.good / tally.seconds)
    print({name: [round(r) for r in values] for name, values in rates.items()}, "good calls/s by round")
    for name in ("cuda_io", "session"):
        median, rounds = soak.ratio_of_rounds(rates[name], rates["bare"])
        print(f"{name} / bare: {median} (rounds {rounds})")
    print("one thread, median µs a call (500 calls each; bad kinds raise, bare's in ORT's C++ with the GIL released,"
          " cuda_io's from its remembered verdict: CallChecks):")
    print(f"{'kind':22s}" + "".join(f"{name:>10s}" for name in calls))
    for kind in ["good", *sorted({c.kind for c in cases} - {"good"})]:
        case = next(c for c in cases if c.kind == kind)
        row = []
        for call in calls.values():
            times = []
            for index in range(550):
                start = time.perf_counter()
                try:
                    call(case.names, case.feeds)
                except Exception:  # noqa: BLE001 - a bad call's time is what is measured
                    pass
                if index >= 50:
                    times.append(time.perf_counter() - start)
            row.append(np.median(times) * 1e6)
        print(f"{kind:22s}" + "".join(f"{value:10.1f}" for value in row))

if __name__ == "__main__":
    main()
