"""``mha-ep bench serve``: a model served by Ray Serve (mha_ep.serve) under closed-loop load on this machine,
beside the same requests sent to a plain mha_ep.InferenceSession in this process.

What it measures. For each ``--rows`` value, a pool of ``--pool`` requests (valid random feeds for the model, that
many rows each and a sequence length drawn from ``--sequence LO:HI``, seeded) is sent by ``--clients``
closed-loop clients, threads of this process that each send their next request when the last answer is in:
``--warmup`` untimed requests each, then ``--requests`` each or for ``--duration`` seconds, whichever ends first.
A request's latency runs from the send to the whole answer read; throughput is answers per second of wall time
from the first timed send to the last answer. Routes:
  session   the clients call one plain mha_ep.InferenceSession, made with the replicas' settings, in this process
  engine    the replica's batching without Ray: mha_ep.serve's Engine and Coalescer in this process, one thread
            running the model, at each --max-batch
  http      POST .npz to Serve's HTTP proxy on 127.0.0.1 (Accept .npz), one keep-alive connection per client
  handle    DeploymentHandle.answer from this process (Ray's own transport, no HTTP)
http and handle run for every replica count in ``--replicas`` and every ``--max-batch`` (the rows a run may take;
1 turns batching off). ``batch`` is the mean number of requests in the run that answered a request.
Serve's overhead per request is, per route, the p50 latency of its one-client batching-off row minus the
session's one-client p50: what a request pays for the proxy (http), Ray's handle and the replica's queue, beyond
the model's run. Every answer is checked against the session's answer to the same request: ``bit-equal`` counts
the answers equal to the bit, ``max err`` is the largest |a - b| / max(1, |b|) (every answer, or every
``--check-every``-th); a batched answer may move in its last bits (mha_ep/serve/batching.py says why), an
unbatched one must not.

The clients run in this process, on the machine's own cores: on a small CPU machine they, Serve's proxy and the
replicas share the cores, which the numbers include. On a GPU machine, ``--providers cuda --backend cuda`` puts
each replica on a GPU of its own; ``--make-bert-base float16`` writes the BERT-base encoder of
mha_ep/models/synthetic.py (12 layers, hidden 768, (B, S) key padding mask) to ``--model`` first.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from mha_ep.bench.output import add_output_options, emit

ROUTES = ("session", "engine", "http", "handle")
SERVED = ("http", "handle")
DEFAULT_MODEL = "bert_random_mask2d_fp32.onnx"  # shipped


@dataclass(frozen=True)
class Load:
    """The closed loop of one row: clients, requests each (cap), seconds (cap), untimed requests each, and every
    how many answers of a client is checked."""

    clients: int
    requests: int
    duration: float
    warmup: int
    check_every: int = 1


def parse_list(text: str, kind=int) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def parse_range(text: str) -> tuple:
    low, _, high = text.partition(":")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (whole numbers), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return low, high


def request_pool(model, count: int, rows: int, lengths: tuple, seed: int) -> list:
    """``count`` valid random feeds for ``model``: ``rows`` along its batch dim, a length in ``lengths`` along its
    sequence dim (when it has one: mha_ep/serve/batching.py's plan)."""
    from mha_ep.feeds import random_feeds
    from mha_ep.serve.batching import plan_batching

    plan = plan_batching(model)
    rng = np.random.default_rng(seed)
    pool = []
    for index in range(count):
        dims = {plan.batch_dim: rows} if plan.batch_dim else {}
        if plan.sequence_dim:
            dims[plan.sequence_dim] = int(rng.integers(lengths[0], lengths[1] + 1))
        pool.append(random_feeds(model, seed=seed + index, dims=dims))
    return pool


def npz_bytes(feeds: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **feeds)
    return buffer.getvalue()


def closed_loop(load: Load, client: Callable[[int], Callable[[int], tuple]], pool_size: int,
                expected: list) -> dict:  # fmt: skip
    """Run ``load.clients`` threads; ``client(i)`` gives thread i its ``send(request index) -> (outputs, run)``.
    Latencies, throughput, the runs' request counts and each answer's agreement with ``expected``."""
    start = threading.Barrier(load.clients + 1)
    results = [dict(latencies=[], batch=[], equal=0, checked=0, worst=0.0, errors=[]) for _ in range(load.clients)]
    times = {}

    def body(index: int) -> None:
        mine = results[index]
        position, send = index, None
        try:
            send = client(index)
            for _ in range(load.warmup):
                send(position % pool_size)
                position += load.clients
        except Exception as error:  # noqa: BLE001 - a client that cannot start is an error of the row, not a hang
            mine["errors"].append(f"before timing: {type(error).__name__}: {str(error)[:200]}")
            send = None
        finally:
            start.wait()
        end = time.perf_counter() + load.duration
        for _ in range(load.requests if send is not None else 0):
            if time.perf_counter() > end:
                break
            item = position % pool_size
            began = time.perf_counter()
            try:
                outputs, run = send(item)
            except Exception as error:  # noqa: BLE001 - an error is a result of the row, counted and shown
                mine["errors"].append(f"{type(error).__name__}: {str(error)[:200]}")
                position += load.clients
                continue
            mine["latencies"].append(time.perf_counter() - began)
            mine["batch"].append((run or {}).get("requests", 1))
            if (position // load.clients) % load.check_every == 0:
                for got, want in zip(outputs, expected[item]):
                    mine["checked"] += 1
                    equal = bool(np.array_equal(got, want))
                    mine["equal"] += equal
                    mine["worst"] = mine["worst"] if equal else max(mine["worst"], rel_error(got, want))
            position += load.clients
        times.setdefault("ends", []).append(time.perf_counter())

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(load.clients)]
    for thread in threads:
        thread.start()
    start.wait()
    times["start"] = time.perf_counter()
    for thread in threads:
        thread.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    seconds = max(times.get("ends", [times["start"]])) - times["start"]
    batch = [x for r in results for x in r["batch"]]
    errors = [e for r in results for e in r["errors"]]
    return {
        "clients": load.clients, "answers": len(latencies), "errors": len(errors), "first_errors": errors[:3],
        "seconds": seconds, "throughput_rps": len(latencies) / seconds if seconds > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
        "mean_batch": statistics.fmean(batch) if batch else 0.0,
        "bit_equal": sum(r["equal"] for r in results), "checked": sum(r["checked"] for r in results),
        "max_err": max(r["worst"] for r in results),
    }  # fmt: skip


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max(1, |want|), in float32 (float64 for float64 answers); inf for a shape mismatch."""
    if got.shape != want.shape:
        return float("inf")
    kind = np.float64 if want.dtype == np.float64 else np.float32
    a, b = got.astype(kind, copy=False), want.astype(kind, copy=False)
    return float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b)))) if b.size else 0.0


def percentile(sorted_values: list, q: float) -> float:
    """The q-th percentile (nearest rank) of ascending ``sorted_values``; NaN when empty."""
    if not sorted_values:
        return float("nan")
    rank = max(1, int(np.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def session_client(session, pool: list) -> Callable:
    def client(_index):
        return lambda item: (session.run(None, pool[item]), None)

    return client


class EngineLoop:
    """The replica's batching without Ray: an Engine, one thread running it, and a Coalescer on an event loop of
    its own, which client threads hand requests to (mha_ep/serve/engine.py)."""

    def __init__(self, engine, max_batch: int):
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        from mha_ep.serve.engine import Coalescer

        self.engine = engine
        self.max_batch = max_batch
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="mha-ep-bench-run")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coalescer = Coalescer(engine, self.executor, lambda: self.max_batch)

    def client(self, pool: list) -> Callable:
        import asyncio

        from mha_ep.serve.engine import Failure

        def send(item):
            request = self.engine.request(pool[item])
            if isinstance(request, Failure):
                raise request.error
            work = self.coalescer.submit([request]) if self.max_batch > 1 else self.coalescer.alone(request)
            outcome = asyncio.run_coroutine_threadsafe(work, self.loop).result()
            outcome = outcome[0] if isinstance(outcome, list) else outcome
            if isinstance(outcome, Failure):
                raise outcome.error
            return list(outcome.outputs), outcome.run.to_dict()

        return lambda _index: send

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.executor.shutdown()


def http_client(port: int, route: str, bodies: list) -> Callable:
    headers = {"Content-Type": "application/x-npz", "Accept": "application/x-npz"}

    def client(_index):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

        def send(item):
            connection.request("POST", route, body=bodies[item], headers=headers)
            reply = connection.getresponse()
            data = reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {data[:300]!r}")
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                outputs = [archive[name] for name in archive.files]
            return outputs, json.loads(reply.getheader("X-MHA-EP-Run") or "{}")

        return send

    return client


def handle_client(handle, pool: list) -> Callable:
    def client(_index):
        def send(item):
            answer = handle.answer.remote(None, pool[item]).result(timeout_s=120)
            return list(answer.outputs), answer.run.to_dict()

        return send

    return client


def row_line(r: dict) -> str:
    return (f"| {r['route']} | {r['rows']} | {r.get('replicas', '–')} | {r.get('max_batch', '–')} | {r['clients']} | {r['answers']} "
            f"| {r['errors']} | {r['throughput_rps']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r['mean_batch']:.2f} | {r['bit_equal']}/{r['checked']} | {r['max_err']:.1e} |")  # fmt: skip


HEADER = ("| route | rows | replicas | max batch | clients | answers | errors | req/s | p50 ms | p99 ms | batch "
          "| bit-equal | max err |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def summaries(rows: list) -> dict:
    """What the rows say, as values, per request size (rows): Serve's overhead per route at batch 1 and one
    client; batching on against off at the most clients, per route (the engine's too: batching without Serve);
    each replica count against the fewest."""

    def find(**match):
        return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)

    out = {"overhead_ms": [], "batching": [], "replicas": []}
    most = max(r["clients"] for r in rows)
    for size in sorted({r["rows"] for r in rows}):
        base = find(route="session", rows=size, clients=1)
        for route in SERVED:
            served = [r for r in rows if r["route"] == route and r["rows"] == size and r["clients"] == 1
                      and r["max_batch"] == 1]  # fmt: skip
            if base and served:
                out["overhead_ms"].append({"route": route, "rows": size, "replicas": served[0]["replicas"],
                                           "ms": served[0]["p50_ms"] - base["p50_ms"]})  # fmt: skip
    for r in rows:
        if r["route"] == "session":
            continue
        if r["clients"] == most and r["max_batch"] > 1:
            off = find(route=r["route"], rows=r["rows"], replicas=r.get("replicas"), max_batch=1, clients=most)
            if off:
                out["batching"].append({"route": r["route"], "rows": r["rows"], "replicas": r.get("replicas"),
                                        "max_batch": r["max_batch"], "clients": most,
                                        "throughput_x": r["throughput_rps"] / off["throughput_rps"],
                                        "p99_x": r["p99_ms"] / off["p99_ms"]})  # fmt: skip
        if r["route"] in SERVED:
            fewest = min(x["replicas"] for x in rows if x["route"] == r["route"])
            one = find(route=r["route"], rows=r["rows"], replicas=fewest, max_batch=r["max_batch"],
                       clients=r["clients"])  # fmt: skip
            if r["replicas"] != fewest and one:
                out["replicas"].append({"route": r["route"], "rows": r["rows"], "replicas": r["replicas"],
                                        "against": fewest, "max_batch": r["max_batch"], "clients": r["clients"],
                                        "throughput_x": r["throughput_rps"] / one["throughput_rps"],
                                        "p99_x": r["p99_ms"] / one["p99_ms"]})  # fmt: skip
    return out


def summary_lines(summary: dict) -> list:
    lines = [f"Serve's overhead per request, {o['rows']} row(s), batching off, one client, {o['route']}: "
             f"{o['ms']:.2f} ms over the session's p50" for o in summary["overhead_ms"]]  # fmt: skip
    for s in summary["batching"]:
        where = f"{s['route']}" + ("" if s["replicas"] is None else f", {s['replicas']} replica(s)")
        lines.append(f"batching on (max batch {s['max_batch']}) vs off, {s['rows']} row(s), {s['clients']} clients, "
                     f"{where}: {s['throughput_x']:.2f}x throughput, p99 {s['p99_x']:.2f}x")
    lines += [f"{s['replicas']} replicas vs {s['against']}, max batch {s['max_batch']}, {s['rows']} row(s), "
              f"{s['clients']} clients, {s['route']}: {s['throughput_x']:.2f}x throughput, p99 {s['p99_x']:.2f}x"
              for s in summary["replicas"]]  # fmt: skip
    return lines


def plot(rows: list, path: Path) -> bool:
    """Throughput and p99 of every row (two panels) into ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [f"{r['route']} n{r['rows']} r{r.get('replicas', '-')} b{r.get('max_batch', '-')} c{r['clients']}"
              for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.35 * len(rows)), sharey=True)
    left.barh(labels, [r["throughput_rps"] for r in rows])
    left.set_xlabel("requests per second (higher is better)")
    right.barh(labels, [r["p99_ms"] for r in rows], color="tab:orange")
    right.set_xlabel("p99 latency, ms (lower is better)")
    left.invert_yaxis()
    figure.suptitle("mha_ep served by Ray Serve, closed-loop clients (n rows a request, r replicas, b max batch, "
                    "c clients)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def prepare_model(args) -> Path:
    """The model to serve: ``--model``, written first as the synthetic BERT-base encoder with
    ``--make-bert-base`` when it is not there yet."""
    import mha_ep

    if args.make_bert_base:
        path = Path(args.model or f"bert_base_{args.make_bert_base}.onnx")
        if path.exists():
            print(f"using the model already at {path}", file=sys.stderr)
        else:
            from mha_ep.graph.model_io import save_model
            from mha_ep.models.synthetic import bert_encoder

            print(f"writing BERT-base ({args.make_bert_base}) to {path}", file=sys.stderr)
            save_model(bert_encoder(layers=12, dtype=args.make_bert_base), path)
        return path
    path = Path(args.model) if args.model else mha_ep.shipped_model(DEFAULT_MODEL)
    if not path.is_file():
        raise FileNotFoundError(f"no model at {str(path)!r}")
    return path


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", help=f"the ONNX model to serve (default: the shipped {DEFAULT_MODEL})")
    parser.add_argument("--make-bert-base", choices=("float16", "float32"),
                        help="write mha_ep/models/synthetic.py's BERT-base encoder in this dtype to --model first "
                             "(kept when the file is there already)")  # fmt: skip
    parser.add_argument("--backend", default="reference", choices=("auto", "reference", "cuda"),
                        help="where claimed nodes run, in the replicas and in-process (default reference)")
    parser.add_argument("--providers", default="cpu", choices=("cpu", "cuda"), help="ORT's provider (default cpu)")
    parser.add_argument("--route", default="auto", choices=("auto", "native", "python-op"), help="mha_ep's route")
    parser.add_argument("--replicas", type=parse_list, default=[1], help="replica counts, comma-separated (1)")
    parser.add_argument("--gpus-per-replica", type=float, default=None,
                        help="GPUs each replica asks Ray for (default: 1 with cuda, else 0)")
    parser.add_argument("--max-batch", type=parse_list, default=[1, 16],
                        help="rows a run may take, comma-separated; 1 is batching off (default 1,16)")
    parser.add_argument("--batch-wait-ms", type=float, default=0.0,
                        help="how long a request that finds a replica idle waits for others (default 0: batches "
                             "form from the requests that arrive while a run is going on)")
    parser.add_argument("--clients", type=parse_list, default=[1, 16], help="closed-loop clients (default 1,16)")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per client, at most (400)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row, at most (10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per client first (3)")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of {ROUTES} (all)")
    parser.add_argument("--check-every", type=int, default=1,
                        help="check every Nth answer of a client against the session's (default 1: all; the check "
                             "runs on the client's thread, between its requests)")
    parser.add_argument("--pool", type=int, default=64, help="distinct requests the clients cycle through (64)")
    parser.add_argument("--rows", type=parse_list, default=[1],
                        help="rows (the model's batch dim) per request, comma-separated: a pool each (1)")
    parser.add_argument("--sequence", type=parse_range, default=(16, 64), help="sequence lengths LO:HI (16:64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request pool (0)")
    parser.add_argument("--address", help="a running Ray cluster to use (default: start one on this machine)")
    parser.add_argument("--port", type=int, default=None,
                        help="Serve's HTTP port on 127.0.0.1 (default: a free one; when Serve is running already in "
                             "this process's Ray, the port it listens on)")  # fmt: skip
    add_output_options(parser, out_help="also write bench_serve.json and bench_serve.png into this folder")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        parser.error(f"--routes: unknown {unknown}; choose from {ROUTES}")
    rows = run(args, routes)
    summary = summaries(rows) if rows else {"overhead_ms": [], "batching": [], "replicas": []}
    for line in summary_lines(summary):
        print(line)
    data = {"model": str(args.model_path), "backend": args.backend, "providers": args.providers,
            "sequence": list(args.sequence), "pool": args.pool, "rows": rows, "summary": summary,
            "measures": __doc__.split("\n\n")[1]}  # fmt: skip
    if args.out and plot(rows, Path(args.out) / "bench_serve.png"):
        print(f"wrote {Path(args.out) / 'bench_serve.png'}", file=sys.stderr)
    emit(args, "bench_serve.json", data)
    return 0


def run(args, routes: list) -> list:
    """Every row the options ask for, in order: the session's and the engine's (in this process), then for each
    replica count and max batch one deployment and its http and handle rows."""
    import mha_ep
    from mha_ep.graph.model_io import load_model
    from mha_ep.serve import ServeOptions
    from mha_ep.serve.engine import Engine

    args.model_path = prepare_model(args)
    model = load_model(args.model_path)
    providers = ServeOptions(model=str(args.model_path), providers=args.providers).provider_list()
    session = mha_ep.InferenceSession(model, None, providers, backend=args.backend, route=args.route)
    pools = {size: request_pool(model, args.pool, size, args.sequence, args.seed) for size in args.rows}
    expected = {size: [session.run(None, feeds) for feeds in pool] for size, pool in pools.items()}
    print(f"model {args.model_path} ({session.mode}: {session.mode_reason}); {args.pool} requests of "
          f"{args.rows} row(s), lengths {args.sequence[0]}-{args.sequence[1]}", file=sys.stderr)  # fmt: skip
    print(HEADER)
    results = []

    def measure(route: str, client, size: int, clients: int, **facts) -> None:
        load = Load(clients, args.requests, args.duration, args.warmup, args.check_every)
        row = {"route": route, "rows": size, **facts, **closed_loop(load, client, args.pool, expected[size])}
        results.append(row)
        print(row_line(row), flush=True)

    for size in args.rows:
        for clients in args.clients if "session" in routes else ():
            measure("session", session_client(session, pools[size]), size, clients)
    del session
    if "engine" in routes:
        engine = Engine(args.model_path, args.backend, providers, args.route)
        for max_batch in args.max_batch:
            looped = EngineLoop(engine, max_batch)
            for size in args.rows:
                for clients in args.clients:
                    measure("engine", looped.client(pools[size]), size, clients, max_batch=max_batch)
            looped.close()
        del engine
    served = [route for route in routes if route in SERVED]
    if served:
        serve_rows(args, served, pools, measure)
    return results


def serve_rows(args, served: list, pools: dict, measure) -> None:
    """The http and handle rows: one deployment per replica count and max batch, deleted after its rows."""
    import ray
    from ray import serve

    from mha_ep.serve import ServeOptions, deploy, free_port, start_local

    port = args.port or free_port()
    started_here = not ray.is_initialized()
    start_local(port, address=args.address)
    bodies = {size: [npz_bytes(feeds) for feeds in pool] for size, pool in pools.items()}
    try:
        for replicas in args.replicas:
            for max_batch in args.max_batch:
                options = ServeOptions(model=str(args.model_path), backend=args.backend, providers=args.providers,
                                       route=args.route, route_prefix="/bench", replicas=replicas,
                                       gpus_per_replica=args.gpus_per_replica, max_batch=max_batch,
                                       batch_wait_ms=args.batch_wait_ms)  # fmt: skip
                name = f"bench-r{replicas}-b{max_batch}"
                handle = deploy(options, name)
                for size in args.rows:
                    for clients in args.clients:
                        for route in served:
                            client = (http_client(port, "/bench", bodies[size]) if route == "http"
                                      else handle_client(handle, pools[size]))  # fmt: skip
                            measure(route, client, size, clients, replicas=replicas, max_batch=max_batch)
                serve.delete(name)
    finally:
        if started_here:
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    from mha_ep.bench import main as bench_main

    sys.exit(bench_main(["serve", *sys.argv[1:]]))
