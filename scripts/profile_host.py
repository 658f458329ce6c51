"""Where the plugin's host-to-host time goes, per call, on the GPU machine: cProfile of repeated
``mha_ep.InferenceSession.run`` calls on one anchor row (docs/FACTS.md §2) (the same model and feeds as ``bench anchors``),
beside the do-nothing echo op through the same bridge.

    PYTHONPATH=$PWD python3 scripts/profile_host.py --only "1,128,128" [--calls 300] [--top 30]
    PYTHONPATH=$PWD python3 scripts/profile_host.py --shape 1,256,256,16,64,float16    # a sweep row

Prints the median host µs of the plugin and of the echo op, then the profile's functions sorted by own time and
by cumulative time, per call (µs).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from mha_ep.bench.anchors import ANCHORS, anchor_problem
from mha_ep.bench.gpu import anchor_feeds, anchor_model, echo_session
from mha_ep.bench.timer import median_seconds


def print_profile(profile: cProfile.Profile, calls: int, sort: str, top: int) -> None:
    stats = pstats.Stats(profile)
    rows = []
    for (filename, line, name), (_, ncalls, own, cumulative, _) in stats.stats.items():
        rows.append((own if sort == "own" else cumulative, own, cumulative, ncalls, f"{filename}:{line}({name})"))
    rows.sort(reverse=True)
    print(f"\n-- by {sort} time, µs per plugin call ({calls} calls)")
    print(f"{'own':>8} {'cum':>8} {'calls/run':>9}  function")
    for _, own, cumulative, ncalls, where in rows[:top]:
        short = where.replace(sys.prefix, "<py>")
        print(f"{own / calls * 1e6:8.1f} {cumulative / calls * 1e6:8.1f} {ncalls / calls:9.1f}  {short[-110:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--only", help="substring of the anchor label (e.g. '1,128,128')")
    which.add_argument("--shape", help="B,S,T,N,H,dtype of a plain call (the sweep rows: 1,256,256,16,64,float16)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args(argv)

    import mha_ep

    if args.shape:
        *dims, dtype = args.shape.split(",")
        (b, s, t, n, h), extra, label = (int(d) for d in dims), None, args.shape
    else:
        row = next(a for a in ANCHORS if args.only in a.label)
        label, (b, s, t, n, h, dtype, extra) = row.label, row.shape
    problem = anchor_problem(b, s, t, n, h, dtype, extra)
    feeds = anchor_feeds(problem, dtype)
    session = mha_ep.InferenceSession(anchor_model(b, s, t, n, h, dtype, extra), backend=args.backend)
    echo = echo_session(session.model)
    plugin_us = median_seconds(lambda: session.run(None, feeds), 50) * 1e6
    echo_us = median_seconds(lambda: echo.run(None, feeds), 50) * 1e6
    print(f"{label}: plugin {plugin_us:.0f} µs per call, echo op {echo_us:.0f} µs (median of 50)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        session.run(None, feeds)
    profile.disable()
    print_profile(profile, args.calls, "own", args.top)
    print_profile(profile, args.calls, "cumulative", args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
