"""The ``mha-ep`` command.

    mha-ep demo                          the main job: shipped BERT and Whisper models, plugin vs stock ORT
    mha-ep partition IN -o OUT           partition a model and print the claim report (--json for JSON)
    mha-ep compare MODEL [--per-node]    stock ORT vs the plugin on random (or given) feeds; exit 1 on mismatch,
                                         2 when stock ORT cannot run the model (nothing to compare against)
    mha-ep bench [...]                   benchmarks (see mha_ep/bench.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np

from mha_ep.errors import MhaEpError


def parse_dim(item: str) -> tuple:
    """--dim NAME=VALUE -> (NAME, VALUE); argparse turns the error into a one-line usage message."""
    name, _, value = item.partition("=")
    if not name or not value.isdigit():
        raise argparse.ArgumentTypeError(f"--dim expects NAME=VALUE with a whole number, got {item!r}")
    return name, int(value)


def _dims(values):
    return dict(values or [])


def load_feeds(path: str) -> dict:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise FileNotFoundError(f"no feeds file at {path!r}") from None
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path!r} is not a readable .npz of feeds: {error}") from None


def cmd_partition(args) -> int:
    from mha_ep.partition import partition, save_model

    result = partition(args.model, lift_attention=args.lift_attention)
    print(result.to_json() if args.json else result.report())
    if args.output:
        save_model(result.model, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from mha_ep.compare import compare

    feeds = load_feeds(args.feeds) if args.feeds else None
    report = compare(
        args.model,
        feeds=feeds,
        backend=args.backend,
        device_id=args.device_id,
        per_node=args.per_node,
        seed=args.seed,
        dims=_dims(args.dim),
        lift_attention=args.lift_attention,
        runs=args.runs,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    if report.oracle is None:
        return 2  # nothing to compare against (e.g. bfloat16 MultiHeadAttention, which stock ORT cannot run)
    return 0 if report.passed else 1


def cmd_demo(args) -> int:
    from mha_ep.demo import run_demo

    return run_demo(backend=args.backend, device_id=args.device_id, per_node=args.per_node)


def cmd_bench(args) -> int:
    from mha_ep.bench import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha-ep", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (backend choice, kernel paths)")
    sub = parser.add_subparsers(dest="command", required=True)

    def backend_options(p):
        p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
        p.add_argument("--device-id", type=int, default=0, help="GPU for the cuda backend")

    p = sub.add_parser("demo", help="run the shipped BERT and Whisper models through the plugin and stock ORT")
    backend_options(p)
    p.add_argument("--per-node", action="store_true", help="also report every claimed node's error")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("partition", help="claim MHA nodes for the plugin and print the decisions")
    p.add_argument("model")
    p.add_argument("-o", "--output", help="where to write the partitioned model")
    p.add_argument("--json", action="store_true")
    p.add_argument("--lift-attention", action="store_true", help="rewrite com.microsoft::Attention into MHA first")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("compare", help="stock ORT vs the plugin on the same feeds")
    p.add_argument("model")
    backend_options(p)
    p.add_argument("--per-node", action="store_true", help="report every claimed node's output error")
    p.add_argument("--feeds", help=".npz file with the feeds (default: random, valid for the model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="random feed sets to try (worst error reported)")
    p.add_argument("--dim", action="append", type=parse_dim, help="value of a symbolic dim for random feeds, NAME=VALUE")
    p.add_argument("--lift-attention", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bench", help="benchmarks: hook | anchors | models; `mha-ep bench WHAT --help`", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # the benchmarks parse (and document) their own options
        from mha_ep.bench import main as bench_main

        command, run = "bench", lambda: bench_main(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
        command, run = args.command, lambda: args.func(args)
    try:
        return run()
    except (OSError, ValueError, MhaEpError) as error:  # bad input: one line, no traceback
        print(f"mha-ep {command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
