"""The ``mha-ep`` command.

    mha-ep demo                          the shipped BERT and Whisper models, plugin vs stock ORT
    mha-ep partition IN -o OUT           partition a model and print the claim report
    mha-ep compare MODEL [--per-node]    stock ORT vs the plugin on random (or given) feeds, with a verdict
    mha-ep compare MODEL --reference U   ... and stock ORT on MODEL vs on U, the model before fusion
    mha-ep bench WHAT [--json] [--out D] benchmarks: hook, anchors, models, device, native, generate, soak, serve, sd
                                         (mha-ep bench WHAT --help)
    mha-ep static-cache DECODER -o OUT --max-length M [--batch B] [--beams W [--shared-cross-kv]]
                      [--step-length L] [--no-packed-qkv] [--decode-matmul]
                                         a decoder-with-past rewritten to a static KV cache: one graph of fixed shapes
    mha-ep serve MODEL [--replicas N] [--port P] [--max-batch B]
                                         serve a model over HTTP with Ray Serve (the serve extra), batching callers
    mha-ep --version                     mha_ep, onnxruntime, onnxruntime-extensions, CuPy, the GPU, the backend

Exit codes: 0 PASS (or done), 1 FAIL (outputs outside tolerance), 2 cannot run (bad input, a model that cannot
be loaded, or that stock ORT cannot load or run), 3 NOTHING CLAIMED (compare: no node ran on the plugin), 4 FUSION
CHANGED THE MODEL (compare --reference: the fusion, not mha_ep, changed the outputs).
--json, in every subcommand that takes it: the result as one JSON object on stdout, errors included.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np

EXIT_CANNOT_RUN = 2
FEED_BYTES_LIMIT = 8 << 30  # random feeds larger than this are a mistake in --dim, not a test


def parse_dim(item: str) -> tuple:
    """--dim NAME=VALUE -> (NAME, VALUE); argparse turns the error into a one-line usage message."""
    name, _, value = item.partition("=")
    if not name or not value.isdigit():
        raise argparse.ArgumentTypeError(f"--dim expects NAME=VALUE with a whole number, got {item!r}")
    if int(value) >= 2**31:
        raise argparse.ArgumentTypeError(f"--dim {name}={value} is too large: a dim must be below 2**31")
    return name, int(value)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def load_feeds(path: str) -> dict:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise FileNotFoundError(f"no feeds file at {path!r}") from None
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path!r} is not a readable .npz of feeds: {error}") from None


def save_feeds(path: str, feeds: dict) -> None:
    with open(path, "wb") as handle:  # np.savez on a name would append ".npz"; a handle keeps the name given
        np.savez(handle, **feeds)


def emit(args, text: str, data: dict) -> None:
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json", False) else text)


def cmd_partition(args) -> int:
    from mha_ep.graph.partition import partition

    result = partition(args.model, lift_attention=args.lift_attention, route=args.route)
    if args.output:
        result.save(args.output)
    data = json.loads(result.to_json())
    data["output"] = args.output
    emit(args, result.report(), data)
    if args.output and not args.json:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_static_cache(args) -> int:
    from mha_ep.graph.static_cache import static_cache

    result = static_cache(args.model, max_length=args.max_length, batch=args.batch, beams=args.beams,
                          step_length=args.step_length, packed_qkv=args.packed_qkv,
                          shared_cross_kv=args.shared_cross_kv, decode_matmul=args.decode_matmul)
    result.save(args.output)
    data = result.to_dict()
    data["output"] = args.output
    emit(args, result.report(), data)
    if not args.json:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from mha_ep import progress
    from mha_ep.comparison import compare

    feeds = load_feeds(args.feeds) if args.feeds else None
    report = compare(
        args.model,
        feeds=feeds,
        backend=args.backend,
        device_id=args.device_id,
        per_node=args.per_node,
        seed=args.seed,
        dims=dict(args.dim or []),
        lift_attention=args.lift_attention,
        runs=args.runs,
        atol=args.atol,
        rtol=args.rtol,
        progress=None if args.quiet else lambda line: progress.write(f"mha-ep compare: {line}", file=sys.stderr),
        progress_bar=progress.wanted(args.quiet, args.json),
        reference=args.reference,
    )
    if args.save_feeds and report.worst_feeds is not None:
        save_feeds(args.save_feeds, report.worst_feeds)
        report.notes.append(f"feeds saved to {args.save_feeds} (rerun with --feeds {args.save_feeds})")
    emit(args, report.text(), report.to_dict())
    return report.verdict.exit_code


def cmd_demo(args) -> int:
    from mha_ep import progress
    from mha_ep.demo import run_demo

    return run_demo(backend=args.backend, device_id=args.device_id, per_node=args.per_node, as_json=args.json,
                    progress_bar=progress.wanted(args.quiet, args.json))  # fmt: skip


def cmd_serve(args) -> int:
    """Deploy MODEL with Ray Serve on this machine (or the cluster at --address), say where, and serve until
    Ctrl-C or SIGTERM; then Serve and Ray stop."""
    import os

    from mha_ep.errors import MhaEpError
    from mha_ep.graph.model_io import load_model
    from mha_ep.serve import ServeOptions, cluster
    from mha_ep.serve.batching import plan_batching

    cluster.require_extra()
    plan = plan_batching(load_model(args.model))  # a model that cannot be read fails here, before Ray starts
    options = ServeOptions(model=os.path.abspath(args.model), backend=args.backend, providers=args.providers,
                           route=args.route, route_prefix=args.route_prefix, replicas=args.replicas,
                           gpus_per_replica=args.gpus_per_replica, cpus_per_replica=args.cpus_per_replica,
                           max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms)  # fmt: skip
    cluster.start_local(args.port, host=args.host, address=args.address)
    try:
        try:
            cluster.deploy(options, args.name)
        except RuntimeError as error:
            raise MhaEpError(f"the model could not be served: {error}") from None
        url = f"http://{args.host}:{args.port}{options.route_prefix}"
        resources = options.resources()
        data = {"url": url, "name": args.name, "options": options.to_dict(), "batching": plan.to_dict(),
                "replica_resources": {**resources.actor_options(), "reason": resources.reason}}  # fmt: skip
        emit(args, f"mha-ep serve: {args.model} at {url} ({options.replicas} replica(s), {resources.num_gpus:g} "
                   f"GPU each: {resources.reason}; batching: {plan.describe()}). POST JSON or .npz; Ctrl-C stops.",
             data)  # fmt: skip
        sys.stdout.flush()
        wait_for_stop()
    finally:
        cluster.stop()
    return 0


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM."""
    import signal
    import threading

    stopping = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        while not stopping.wait(timeout=3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_bench(argv) -> int:
    """The benchmarks parse (and document) their own options: ``mha-ep bench WHAT --help``."""
    from mha_ep.bench import main as bench_main

    return bench_main(argv)


class OneLineParser(argparse.ArgumentParser):
    """A usage mistake is one line (and exit 2), pointing at --help, not the whole usage block."""

    def error(self, message):
        self.exit(EXIT_CANNOT_RUN, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from mha_ep import __version__
        from mha_ep.environment import environment_lines

        print("\n".join(environment_lines(__version__)))
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    # Global flags live on a parent parser given to every subcommand too, so they work before or after it.
    common = OneLineParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging (backend choice, kernel paths) and tracebacks of internal errors")  # fmt: skip
    parser = OneLineParser(
        prog="mha-ep", description=__doc__, formatter_class=argparse.RawTextHelpFormatter, parents=[common]
    )
    parser.add_argument("--version", action=VersionAction, help="print mha_ep's environment (versions, GPU, backend) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do (mha-ep COMMAND --help)")

    def backend_options(p):
        p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                       help="where claimed nodes run: cuda (CuPy), reference (NumPy), auto (cuda when usable)")  # fmt: skip
        p.add_argument("--device-id", type=int, default=0, help="GPU for the cuda backend (default 0)")

    def json_option(p):
        p.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object")

    def lift_option(p):
        p.add_argument("--lift-attention", action="store_true",
                       help="rewrite com.microsoft::Attention into MatMuls + MultiHeadAttention first; the report "
                            "gives the reason for every Attention node that is not lifted")  # fmt: skip

    p = sub.add_parser("demo", parents=[common], help="run the shipped BERT and Whisper models through the plugin and stock ORT")
    backend_options(p)
    p.add_argument("--per-node", action="store_true", help="also report every claimed node's error")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr (there is none off a terminal)")
    json_option(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("partition", parents=[common], help="claim MHA nodes for the plugin and print the decisions")
    p.add_argument("model", help="the ONNX model to partition")
    p.add_argument("-o", "--output", help="where to write the partitioned model")
    p.add_argument("--route", choices=("python-op", "native"), default="python-op",
                   help="the claimed nodes' form: python-op (default; float16/bfloat16 nodes talk float32 through "
                        "Casts, runs on both routes) or native (nodes keep their type; for sessions that "
                        "mha_ep.register put on the native route)")
    json_option(p)
    lift_option(p)
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("compare", parents=[common], help="stock ORT vs the plugin on the same feeds, with a verdict",
                       description="Verdicts and exit codes: PASS 0, FAIL 1 (outputs outside tolerance), CANNOT RUN 2 "
                                   "(the model cannot be loaded, or stock ORT cannot load or run it), NOTHING CLAIMED 3 "
                                   "(no node ran on the plugin), FUSION CHANGED THE MODEL 4 (with --reference: stock "
                                   "ORT's outputs for the model differ from its outputs for the model before fusion).")  # fmt: skip
    p.add_argument("model", help="the ONNX model (not partitioned) to compare")
    backend_options(p)
    p.add_argument("--per-node", action="store_true", help="report every claimed node's output error")
    p.add_argument("--reference", metavar="UNFUSED.onnx",
                   help="the model before fusion: stock ORT runs it on the same feeds (matched by input name), and "
                        "a difference from stock ORT on MODEL is verdict FUSION CHANGED THE MODEL")  # fmt: skip
    p.add_argument("--feeds", help=".npz file with the feeds (default: random, valid for the model)")
    p.add_argument("--save-feeds", metavar="PATH",
                   help="write the feeds used (with --runs: the set with the worst error) to this .npz, for --feeds")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    p.add_argument("--runs", type=int, default=1, help="random feed sets to try; the worst error is reported")
    p.add_argument("--dim", action="append", type=parse_dim, metavar="NAME=VALUE",
                   help="value of a symbolic input dim for random feeds (repeatable)")  # fmt: skip
    p.add_argument("--atol", type=non_negative_float,
                   help="absolute tolerance for every output (default: by the dtype the model computes in)")  # fmt: skip
    p.add_argument("--rtol", type=non_negative_float,
                   help="relative tolerance for every output (default: by the dtype the model computes in)")  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines or bar on stderr (the bar shows only on a terminal, never with --json)")  # fmt: skip
    lift_option(p)
    json_option(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("static-cache", parents=[common],
                       help="rewrite a decoder-with-past so that one graph of fixed shapes serves every step",
                       description="Self-attention pasts and presents become one (B, N, M, H) buffer the caller binds "
                                   "to both, a new input past_sequence_length (int32, (1,)) says how many rows are "
                                   "filled, and the shape arithmetic on the past's length becomes constants and "
                                   "device computations (mha_ep/graph/static_cache.py).")  # fmt: skip
    p.add_argument("model", metavar="DECODER", help="the decoder-with-past (as ORT's optimizer leaves Whisper's)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--max-length", type=int, required=True, metavar="M",
                   help="rows of the KV buffer: the longest past plus step the decoder will see")  # fmt: skip
    p.add_argument("--batch", type=int, metavar="B",
                   help="fix every input's batch dim, the rows (default: symbolic; ORT's CUDA graph needs it fixed)")
    p.add_argument("--beams", type=int, default=0, metavar="W",
                   help="add the cache_indirection input (B / W, W, M) of beam search with W beams (default: none)")
    p.add_argument("--step-length", type=int, metavar="L",
                   help="the rows a step feeds: pins input_ids' symbolic dim 1, and every input dim of its symbol, to "
                        "L (default: 1; a static step length must equal L)")  # fmt: skip
    p.add_argument("--no-packed-qkv", dest="packed_qkv", action="store_false",
                   help="keep each self-attention node's Q, K and V projections as three MatMuls (default: one MatMul "
                        "and a packed QKV query, which only mha_ep runs: stock ORT refuses packed QKV with a past)")
    p.add_argument("--shared-cross-kv", action="store_true",
                   help="with --beams: the cross-attention keys and values one row per batch entry, not per beam, "
                        "each read once for the entry's W beams (bind the encoder's unrepeated)")  # fmt: skip
    p.add_argument("--decode-matmul", action="store_true",
                   help="the float16 / bfloat16 weight products of at most 8 rows (--batch x step length) as "
                        "mha_ep::DecodeMatMul, which reads each weight once at HBM's rate; only mha_ep runs it")
    json_option(p)
    p.set_defaults(func=cmd_static_cache)

    p = sub.add_parser("serve", parents=[common], help="serve a model over HTTP with Ray Serve, batching callers",
                       description="One mha_ep.InferenceSession per replica; requests from several callers share a "
                                   "run along the model's batch dim (padded along its sequence dim where it has a "
                                   "key-padding mask) and are cut back, so each answer is its own. POST "
                                   "{\"inputs\": {name: array}} as JSON, or an np.savez archive as "
                                   "application/x-npz; GET describes the model. Needs the serve extra: "
                                   "pip install 'mha-ep[serve]'.")  # fmt: skip
    p.add_argument("model", help="the ONNX model to serve (not partitioned)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                   help="where claimed nodes run: cuda (CuPy), reference (NumPy), auto (cuda when usable)")  # fmt: skip
    p.add_argument("--providers", default="cpu", choices=["cpu", "cuda"],
                   help="ORT's execution provider in each replica (cuda: one GPU per replica unless "
                        "--gpus-per-replica says otherwise)")  # fmt: skip
    p.add_argument("--route", choices=("auto", "native", "python-op"), default="auto",
                   help="how claimed nodes reach their backend: native library or onnxruntime-extensions' Python op")
    p.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas, each with its own session (default 1)")
    p.add_argument("--gpus-per-replica", type=float, metavar="G",
                   help="GPUs each replica asks Ray for (default: 1 with --providers cuda or --backend cuda, else 0)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, metavar="C", help="CPUs each replica asks Ray for (1)")
    p.add_argument("--max-batch", type=int, default=16, metavar="B",
                   help="the most rows (the model's batch dim) one run takes; 1 turns batching off (default 16)")
    p.add_argument("--batch-wait-ms", type=float, default=2.0, metavar="MS",
                   help="how long a request that finds a replica idle waits for others to join it (default 2)")
    p.add_argument("--port", type=int, default=8000, metavar="P", help="HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1)")
    p.add_argument("--route-prefix", default="/", help="the HTTP path the model answers at (default /)")
    p.add_argument("--name", default="mha_ep", help="the Serve application's name (default mha_ep)")
    p.add_argument("--address", help="a running Ray cluster to deploy on (default: start Ray on this machine)")
    json_option(p)
    p.set_defaults(func=cmd_serve)

    sub.add_parser("bench", add_help=False, help="benchmarks: hook | anchors | models | device | native | generate | soak | serve | sd (mha-ep bench WHAT --help)")
    return parser


def _error(command: str, as_json: bool, message: str, code: int = EXIT_CANNOT_RUN) -> int:
    if as_json:
        data = {"command": command, "error": message, "exit_code": code}
        if command == "compare":
            data.update(verdict="CANNOT RUN", reason=message)
        print(json.dumps(data, indent=2))
    print(f"mha-ep {command}: error: {message}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s")
    as_json = getattr(args, "json", False)
    from mha_ep.errors import MISSING_ONNXRUNTIME, MhaEpError, onnxruntime_missing

    if onnxruntime_missing():
        return _error(args.command, as_json, MISSING_ONNXRUNTIME)

    try:
        return args.func(args)
    except (OSError, ValueError, ImportError, MhaEpError) as error:  # bad input: one line, no traceback
        return _error(args.command, as_json, str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    except MemoryError:
        return _error(args.command, as_json, "out of memory (are the --dim values what you meant?)")
    except KeyboardInterrupt:
        print(f"mha-ep {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - a bug of ours: still one line, the traceback only with -v
        if verbose:
            raise
        return _error(args.command, as_json, f"internal error: {type(error).__name__}: {error} (run with -v for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
