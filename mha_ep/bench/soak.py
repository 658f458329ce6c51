"""``mha-ep bench soak``: many threads on one session, good and bad calls mixed, as a server's thread pool runs it.

Columns (each its own session over the same model, on the CUDA provider, columns timed in turns over ``--rounds``):
  stock            ``onnxruntime.InferenceSession`` of the model (stock ORT CUDA)
  plain            ``onnxruntime.InferenceSession`` of the native form, mha_ep registered (mha_ep.register)
  session          ``mha_ep.InferenceSession`` (gpu_session/cuda_io.py: lanes per thread, no session-wide lock)
  session_graphs   the same with ORT's ``enable_cuda_graph`` (no peer: ORT forbids threads on one session while it
                   uses CUDA graphs, so cuda_io runs one call at a time there, on the first caller's thread or the
                   session's worker)
``--columns`` times only some of them (e.g. ``plain,session``: the device time goes to the ratio one wants).
With ``--devices 0,1``: ``gpu0`` (one mha_ep.InferenceSession on GPU 0) against ``gpu0+gpu1`` (one on each GPU at
once, ``--threads`` threads per GPU); ``vs`` is the pair's good calls per second over the one's.

``vs`` is the median over the rounds of each round's ratio (a column against its peer in the same round), and
``vs_rounds`` lists them: on a shared host a whole column's rate moves between runs (plain ORT's between 520 and
4,469 good/s on the H200 machines of one day), and a round's pair ran minutes apart at most.

The calls: a pool of good feeds (``--shapes`` (batch, sequence) pairs drawn once; expected outputs from stock ORT
CUDA, one thread) and BAD_KINDS of bad ones made from them (expected: the exception type stock ORT's ``run`` raises,
or its outputs where it runs them). A thread draws a bad call with probability ``--bad`` and a good one otherwise.
Counted per column: good calls whose outputs are within tolerance of stock's (``good``) or not (``wrong``, which
includes a good call that raised), bad calls that raised an instance of stock's type (``bad_typed``) or not
(``mistyped``); throughput is good calls per second of the column's wall time; p50/p99 are good calls' latencies,
and "CPU p50" the median CPU time of the calling thread in a good call (``time.thread_time``: Python and ORT's host
work on that thread; a column whose latency grows while its CPU time does not is waiting, on the GIL, a lock or the
GPU, rather than working; ``session_graphs`` runs other threads' calls on its worker, whose CPU is not counted).
After its last round each mha_ep session must hold no graph slot and no lane, and answer one more good call
(``clean_after``).
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from mha_ep.bench.output import add_output_options, emit
from mha_ep.progress import write

CUDA = "CUDAExecutionProvider"
TOLERANCE = {"float32": 1e-3, "float16": 2e-2}  # of max(1, |stock|): the GPU suite's whole-model tolerances
BAD_KINDS = ("rank", "dtype", "second_input_longer", "third_input_shorter", "missing_input", "zero_length",
             "batch_mismatch", "float_for_int", "unknown_input", "unknown_output", "nan")  # fmt: skip


@dataclass
class Case:
    kind: str  # "good" or one of BAD_KINDS
    feeds: dict
    names: Optional[list]
    expected: object  # stock's outputs (a list of arrays), or the exception class stock's run raised


@dataclass
class Tally:
    good: int = 0
    wrong: int = 0
    bad_typed: int = 0
    mistyped: int = 0
    latencies: List[float] = field(default_factory=list)  # seconds, good calls
    cpu: List[float] = field(default_factory=list)  # seconds of the calling thread's CPU, good calls
    seconds: float = 0.0
    examples: List[str] = field(default_factory=list)  # the first few wrong or mistyped calls, said

    def add(self, other: "Tally") -> None:
        self.good += other.good
        self.wrong += other.wrong
        self.bad_typed += other.bad_typed
        self.mistyped += other.mistyped
        self.latencies += other.latencies
        self.cpu += other.cpu
        self.examples += other.examples[: max(0, 5 - len(self.examples))]

    @property
    def good_per_s(self) -> float:
        return self.good / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        lat, cpu = sorted(self.latencies), sorted(self.cpu)
        return {"good": self.good, "wrong": self.wrong, "bad_typed": self.bad_typed, "mistyped": self.mistyped,
                "seconds": round(self.seconds, 3), "good_per_s": round(self.good_per_s, 1),
                "p50_ms": round(1e3 * lat[len(lat) // 2], 3) if lat else None,
                "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                "cpu_p50_ms": round(1e3 * cpu[len(cpu) // 2], 3) if cpu else None,
                "examples": self.examples}  # fmt: skip


def bad_feeds(kind: str, feeds: dict, names: List[str]) -> tuple:
    """(feeds, output names) of a bad call of ``kind`` made from the good ``feeds`` (inputs in model order);
    None where the kind does not apply to the model (``nan`` needs a float input)."""
    inputs = list(feeds)
    first, second, last = inputs[0], inputs[min(1, len(inputs) - 1)], inputs[-1]
    bad = {name: value.copy() for name, value in feeds.items()}
    output_names = None
    if kind == "rank":
        bad[first] = bad[first][..., None]
    elif kind == "dtype":
        bad[second] = bad[second].astype(np.int32 if bad[second].dtype == np.int64 else np.float64)
    elif kind == "second_input_longer":  # a mask longer than the keys, say
        bad[second] = np.concatenate([bad[second]] + [bad[second][:, -1:]] * 3, axis=1)
    elif kind == "third_input_shorter":  # token types for one position fewer, say
        bad[last] = bad[last][:, :-1]
    elif kind == "missing_input":
        del bad[last]
    elif kind == "zero_length":
        bad = {name: value[:, :0] for name, value in bad.items()}
    elif kind == "batch_mismatch":
        bad[second] = np.concatenate([bad[second], bad[second][:1]], axis=0)
    elif kind == "float_for_int":
        ints = [name for name in inputs if bad[name].dtype.kind in "iu"]
        if not ints:
            return None
        bad[ints[0]] = bad[ints[0]].astype(np.float32)
    elif kind == "unknown_input":
        bad["not_an_input"] = bad[first]
    elif kind == "unknown_output":
        output_names = [names[0], "not_an_output"]
    elif kind == "nan":
        floats = [name for name in inputs if bad[name].dtype.kind == "f"]
        if not floats:
            return None
        bad[floats[0]][...] = np.nan
    else:
        raise ValueError(f"unknown bad kind {kind!r}; kinds: {BAD_KINDS}")
    return bad, output_names


def expected_of(session, feeds: dict, names: Optional[list]):
    try:
        return session.run(names, feeds)
    except Exception as error:  # noqa: BLE001 - what stock raises is the expectation
        return type(error)


def make_cases(model, stock, shapes: int, seed: int, batches=(1, 2, 3, 4, 8), max_sequence: int = 64) -> List[Case]:
    """Good calls of ``shapes`` (batch, sequence) pairs (batch from ``batches``, sequence 4..``max_sequence``) and
    every applicable bad kind of each; expected from ``stock`` (a stock ORT session), one thread."""
    from mha_ep.feeds import random_feeds

    rng = np.random.default_rng(seed)
    names = [o.name for o in stock.get_outputs()]
    cases = []
    for index in range(shapes):
        dims = {"batch": int(rng.choice(list(batches))), "sequence": int(rng.integers(4, max_sequence + 1))}
        good = random_feeds(model, seed=seed + index, dims=dims)
        cases.append(Case("good", good, None, stock.run(None, good)))
        for kind in BAD_KINDS:
            made = bad_feeds(kind, good, names)
            if made is not None:
                cases.append(Case(kind, made[0], made[1], expected_of(stock, *made)))
    return cases


def judge(case: Case, call: Callable, tolerance: float, tally: Tally) -> None:
    """One call of ``case`` through ``call(names, feeds)``, counted into ``tally``."""
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        got = call(case.names, case.feeds)
    except Exception as error:  # noqa: BLE001 - counted
        if isinstance(case.expected, type) and isinstance(error, case.expected):
            tally.bad_typed += 1
            return
        kind = "wrong" if case.kind == "good" else "mistyped"
        setattr(tally, kind, getattr(tally, kind) + 1)
        if len(tally.examples) < 5:
            want = case.expected.__name__ if isinstance(case.expected, type) else "outputs"
            tally.examples.append(f"{case.kind}: raised {type(error).__name__}: {str(error)[:400]} (stock: {want})")
        return
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    if isinstance(case.expected, type):
        tally.mistyped += 1
        if len(tally.examples) < 5:
            tally.examples.append(f"{case.kind}: ran, where stock raised {case.expected.__name__}")
        return
    if outputs_close(got, case.expected, tolerance):
        if case.kind == "good":
            tally.good += 1
            tally.latencies.append(elapsed)
            tally.cpu.append(cpu)
        else:
            tally.bad_typed += 1  # a "bad" call stock runs (zero length, NaN): same outputs
        return
    tally.wrong += 1
    if len(tally.examples) < 5:
        tally.examples.append(f"{case.kind}: outputs differ from stock's beyond {tolerance}")


def outputs_close(actual, expected, tolerance: float) -> bool:
    if len(actual) != len(expected):
        return False
    for a, e in zip(actual, expected):
        a = np.asarray(a)
        if a.shape != e.shape or a.dtype != e.dtype:
            return False
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        both_nan = np.isnan(a64) & np.isnan(e64)
        error = np.where(both_nan, 0.0, np.abs(a64 - e64) / np.maximum(1.0, np.abs(e64)))
        if a.size and not np.all(error <= tolerance):  # NaN where only one side is NaN fails this
            return False
    return True


def soak(calls: List[Callable], cases: List[Case], threads: int, seconds: Optional[float], bad: float,
         tolerance: float, seed: int, per_thread: Optional[int] = None) -> Tally:  # fmt: skip
    """``threads`` threads per entry of ``calls`` (each a session's ``run``), all at once, for ``seconds`` (the
    bench), or until each thread has made ``per_thread`` calls (a test: a count, never a time)."""
    good = [c for c in cases if c.kind == "good"]
    wrong_ones = [c for c in cases if c.kind != "good"]
    tallies = [Tally() for _ in range(threads * len(calls))]
    start_line = threading.Barrier(len(tallies) + 1)
    stop = threading.Event()

    def worker(index: int) -> None:
        rng = np.random.default_rng(seed + index)
        call = calls[index // threads]
        start_line.wait()
        made = 0
        while not stop.is_set() and (per_thread is None or made < per_thread):
            pool = wrong_ones if rng.random() < bad else good
            judge(pool[int(rng.integers(len(pool)))], call, tolerance, tallies[index])
            made += 1

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(tallies))]
    for w in workers:
        w.start()
    start_line.wait()
    began = time.perf_counter()
    if per_thread is None:
        stop.wait(seconds)  # a bench's duration, not a synchronisation: each worker finishes its call in flight
        stop.set()
    for w in workers:
        w.join()
    total = Tally(seconds=time.perf_counter() - began)
    for tally in tallies:
        total.add(tally)
    return total


def ratio_of_rounds(numerators: List[float], denominators: List[float]) -> tuple:
    """(median, each round's ratio rounded to 3 places) of ``numerators[i] / denominators[i]`` over the rounds
    where the denominator is positive; (None, []) where none is."""
    ratios = [n / d for n, d in zip(numerators, denominators) if d > 0]
    if not ratios:
        return None, []
    return round(float(np.median(ratios)), 3), [round(r, 3) for r in ratios]


def cuda_session(model, device_id: int = 0, graphs: bool = False):
    import mha_ep

    options = {"device_id": str(device_id), **({"enable_cuda_graph": "1"} if graphs else {})}
    return mha_ep.InferenceSession(model, providers=[(CUDA, options), "CPUExecutionProvider"], backend="cuda",
                                   device_id=device_id)  # fmt: skip


def state_after(session) -> dict:
    """What an mha_ep session holds once every call returned (lanes out: must be 0), and how many calls an eager
    run answered after a graph capture broke (cuda_io.capture_retries)."""
    io = session.cuda_io
    return {} if io is None else {**io.in_use(), "capture_retries": io.capture_retries}


COLUMNS = ("stock", "plain", "session", "session_graphs")


def chosen_columns(text: str) -> List[str]:
    """The columns named in ``text`` (comma-separated), in COLUMNS' order; ValueError naming the known ones for
    anything else, or for none."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in COLUMNS]
    if unknown or not names:
        raise ValueError(f"--columns: {unknown or text!r} not among the columns {', '.join(COLUMNS)}")
    return [name for name in COLUMNS if name in names]


def bench_threads(model, args, cases) -> List[dict]:
    from mha_ep.bench.native import sessions

    chosen = chosen_columns(args.columns)
    stock, plain = sessions(model)
    columns = {"stock": stock.run, "plain": plain.run}
    mine = {name: cuda_session(model, graphs=name == "session_graphs") for name in ("session", "session_graphs")
            if name in chosen}  # fmt: skip
    columns.update({name: session.run for name, session in mine.items()})
    columns = {name: call for name, call in columns.items() if name in chosen}
    tallies = {name: Tally() for name in columns}
    rates = {name: [] for name in columns}  # good calls per second, round by round
    for round_index in range(args.rounds):
        for name, call in columns.items():
            got = soak([call], cases, args.threads, args.seconds / args.rounds, args.bad, args.tolerance,
                       seed=1000 * round_index)  # fmt: skip
            tallies[name].add(got)
            tallies[name].seconds += got.seconds
            rates[name].append(got.good_per_s)
    rows = []
    for name, tally in tallies.items():
        row = {"column": name, "threads": args.threads, **tally.row()}
        if name in mine:
            row["clean_after"] = {**state_after(mine[name]), "answers": outputs_close(
                mine[name].run(None, cases[0].feeds), cases[0].expected, args.tolerance)}  # fmt: skip
        rows.append(row)
    by = {r["column"]: r for r in rows}
    for name in ("plain", "session", "session_graphs"):
        for peer in ("stock", "plain"):
            if peer != name and name in by and peer in by:
                by[name][f"vs_{peer}"], by[name][f"vs_{peer}_rounds"] = ratio_of_rounds(rates[name], rates[peer])
    return rows


def bench_devices(model, args, cases, devices: List[int]) -> List[dict]:
    sessions_ = {d: cuda_session(model, device_id=d) for d in devices}
    one = Tally()
    both = Tally()
    rates: tuple = ([], [])  # good calls per second of the one and of the pair, round by round
    for round_index in range(args.rounds):
        got = soak([sessions_[devices[0]].run], cases, args.threads, args.seconds / args.rounds, args.bad,
                   args.tolerance, seed=1000 * round_index)  # fmt: skip
        one.add(got)
        one.seconds += got.seconds
        rates[0].append(got.good_per_s)
        got = soak([sessions_[d].run for d in devices], cases, args.threads, args.seconds / args.rounds, args.bad,
                   args.tolerance, seed=1000 * round_index)  # fmt: skip
        both.add(got)
        both.seconds += got.seconds
        rates[1].append(got.good_per_s)
    first = {"column": f"gpu{devices[0]}", "threads": args.threads, **one.row()}
    pair = {"column": "+".join(f"gpu{d}" for d in devices), "threads": args.threads * len(devices), **both.row()}
    pair["vs_one"], pair["vs_one_rounds"] = ratio_of_rounds(rates[1], rates[0])
    for d, session in sessions_.items():
        pair[f"clean_after_gpu{d}"] = {**state_after(session), "answers": outputs_close(
            session.run(None, cases[0].feeds), cases[0].expected, args.tolerance)}  # fmt: skip
    return [first, pair]


def load_model(name: str):
    """The shipped model of that file name, a synthetic encoder ("bert-base-f16": 12 x 768, hidden states and a
    (B, S) mask in), or a path."""
    import onnx

    from mha_ep import shipped

    if name == "bert-base-f16":
        from mha_ep.models.synthetic import bert_encoder

        return bert_encoder(layers=12, hidden=768, heads=12, ffn=3072, dtype="float16")
    path = shipped.folder() / name
    return onnx.load(str(path if path.exists() else name))


def format_row(r: dict) -> str:
    key = next((k for k in ("vs_plain", "vs_one", "vs_stock") if r.get(k) is not None), None)
    ratio = "" if key is None else f"{r[key]} ({min(r[key + '_rounds'])}-{max(r[key + '_rounds'])})"
    return (f"| {r['column']} | {r['threads']} | {r['good']} | {r['good_per_s']} | {ratio} | {r['wrong']} | "
            f"{r['bad_typed']} | {r['mistyped']} | {r['p50_ms']} | {r['p99_ms']} | {r.get('cpu_p50_ms')} | "
            f"{r.get('clean_after', '')} |")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="mha-ep bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="bert_random_mask2d_fp32.onnx",
                        help="a shipped model's file name, 'bert-base-f16', or a path")
    parser.add_argument("--threads", type=int, default=8, help="threads per session")
    parser.add_argument("--seconds", type=float, default=30.0, help="each column's total time")
    parser.add_argument("--rounds", type=int, default=5,
                        help="turns the columns take (seconds split between them); vs is the median of the rounds'")
    parser.add_argument("--bad", type=float, default=0.3, help="the share of bad calls")
    parser.add_argument("--shapes", type=int, default=24, help="good (batch, sequence) calls in the pool")
    parser.add_argument("--batches", default="1,2,3,4,8", help="the good calls' batch sizes")
    parser.add_argument("--max-sequence", type=int, default=64, help="the good calls' longest sequence")
    parser.add_argument("--columns", default=",".join(COLUMNS),
                        help=f"the columns to time (of {', '.join(COLUMNS)}; ratios need their peer)")
    parser.add_argument("--devices", default="", help="e.g. 0,1: one session per GPU against one GPU alone")
    parser.add_argument("--seed", type=int, default=0, help="seed of the calls' random feeds and of each thread's draws")
    add_output_options(parser, "also write bench_soak.json into this folder")
    args = parser.parse_args(argv)
    try:
        chosen_columns(args.columns)
    except ValueError as error:
        parser.error(str(error))
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    model = load_model(args.model)
    dtype = "float16" if any(i.type.tensor_type.elem_type == 10 for i in model.graph.input) or "fp16" in args.model \
        else "float32"  # fmt: skip
    args.tolerance = TOLERANCE[dtype]
    stock = ort.InferenceSession(model.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
    if CUDA not in stock.get_providers():
        raise SystemExit("mha-ep bench soak: ORT did not get the CUDA provider (onnxruntime-gpu needed)")
    batches = [int(b) for b in args.batches.split(",")]
    cases = make_cases(model, stock, args.shapes, args.seed, batches, args.max_sequence)
    kinds = sorted({c.kind for c in cases} - {"good"})
    write(f"soak: {args.model}, {len(cases)} calls in the pool ({args.shapes} good shapes; bad kinds: {kinds}), "
          f"{args.threads} threads per session, {args.seconds:g} s a column in {args.rounds} turns")
    print("| column | threads | good calls | good/s | vs (rounds) | wrong | bad, stock's type | mistyped | p50 ms "
          "| p99 ms | CPU p50 ms | after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    devices = [int(d) for d in args.devices.split(",") if d.strip()]
    rows = bench_devices(model, args, cases, devices) if len(devices) > 1 else bench_threads(model, args, cases)
    for row in rows:
        write(format_row(row))
    emit(args, "bench_soak.json", {"model": args.model, "threads": args.threads, "seconds": args.seconds,
                                   "bad": args.bad, "bad_kinds": kinds, "batches": batches,
                                   "max_sequence": args.max_sequence, "rows": rows})  # fmt: skip
    return 0 if all(r["wrong"] == 0 and r["mistyped"] == 0 for r in rows) else 1
