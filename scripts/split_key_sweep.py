"""Time a decode step's cross attention on the GPU machine, old split-key launches against new: S = 1, T = 1500,
H = 64, the BNSH key and value read in place and the query as the node has it with its float32 bias (the native
route's in-place call, pipeline.reads_kv_in_place), as fused.fused_steps plans it:

  before  split_key_attention, combine_key_splits into a float32 scratch, narrow_output into the node's dtype
          (the plan before the pair wrote the node's dtype itself: 3 launches)
  pair    split_key_attention, combine_key_splits writing the node's dtype (MHA_EP_SPLIT_KERNEL=pair: 2 launches)
  stream  a Fill of the arrival counters, split_key_stream (the default: 1 launch, no Fill with one split)

Each plan runs through runner.run_steps, GRAPH_LAUNCHES submissions captured in one CUDA graph and replayed
(bench/timer.stream_seconds: µs = median replay / GRAPH_LAUNCHES), over rotating copies of K and V, as many as
exceed twice the L2 but at most GRAPH_LAUNCHES (a captured graph replays the same launches; at 20 pairs 77 MB, more
than the L2 and less than twice it). A decoder's layers each read their own cross-attention cache from HBM; one
copy would be served from L2 at the smaller shapes, and ``--thrash`` gives a step's conditions. The kernel is a stream of K and V, so the figure of merit is the read rate:
bytes of K and V over the median time; CuPy's copy of K (read + write) is HBM's rate beside it. Every output is
compared with the pair's (max |Δ|: before and pair are the same bits; stream rounds each p against its own
block's max). The widen_to_float of b_q that precedes every one of them in the plan is not timed.

    PYTHONPATH=$PWD python3 scripts/split_key_sweep.py [--pairs 20,96,100,160,480] [--dtype float16]

``--compare FILE ...`` adds a column per FILE, a variant of split_keys.cu with the same kernel names and parameters
(e.g. ``git show main:mha_ep/engine/cuda/kernels/split_keys.cu``; its local includes come from the shipped kernel
folder): the stream plan with split_key_stream compiled from that file, the same inputs in the same run.

``--no-bias``: the query without b_q, as a decoder step's cross attention has it (mha_ep/models/synthetic.py).
``--cupti``: each plan's attention kernels timed by CUPTI (bench/cupti.py, as ``bench generate --profile`` times a
step), launches of every copy in turn, in place of the graph replays. ``--thrash MB``: before each launch the stream
reads MB of another buffer, as a step's GEMMs read the weights between two attention calls (implies --cupti);
``--warm other|same`` then launches the kernel once, untimed, on another copy (its code back in L2, the timed copy
still cold) or on the same one, before each timed launch: which of the cold things makes a step's launch slow.

``--knobs stream`` times split_key_stream alone over its settings instead (STREAM_STAGES, STREAM_BLOCKS_PER_SM,
SPLIT_LOADS_IN_FLIGHT: defines of kernels/split_keys.cu, and the stage size; dispatch.key_stream cuts the keys with
the same values); ``--knobs pair`` times split_key_attention alone over SPLIT_THREADS, SPLIT_LOADS_IN_FLIGHT and
the keys a block takes, as this script did before the stream kernel:

    PYTHONPATH=$PWD python3 scripts/split_key_sweep.py --knobs stream --stages 2,3,4 --blocks 2,3,4,6 --stage-bytes 4096,8192,16384
    PYTHONPATH=$PWD python3 scripts/split_key_sweep.py --knobs pair --pairs 96,480
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mha_ep.bench.timer import GRAPH_LAUNCHES, stream_seconds  # noqa: E402
from mha_ep.engine.cuda import dispatch, fused, kernels, pipeline  # noqa: E402
from mha_ep.engine.cuda.runner import run_steps  # noqa: E402
from mha_ep.engine.problem import build_problem  # noqa: E402
from mha_ep.launch import ELEMENT_TYPES  # noqa: E402
from mha_ep.native.plan import ShapeOnly  # noqa: E402

PLANS = ("before", "pair", "stream")
HEADS = (20, 12, 8, 6)  # Whisper's head counts: a call's N is the first that divides its pairs (B = pairs / N)


def heads_of(pairs: int) -> int:
    return next((n for n in HEADS if pairs % n == 0), 1)


def cross_problem(pairs: int, keys: int, head: int, dtype: str):
    """The MhaProblem of a decoder's cross attention (shapes only: build_problem reads no data): B x N = pairs,
    S = 1, BNSH key and value of T = ``keys``, a bias of which ORT uses b_q alone (docs/SEMANTICS.md §3.3)."""
    n = heads_of(pairs)
    b = pairs // n
    arrays = [ShapeOnly(np.float32, (b, 1, n * head)), ShapeOnly(np.float32, (b, n, keys, head)),
              ShapeOnly(np.float32, (b, n, keys, head)), ShapeOnly(np.float32, (3 * n * head,))]  # fmt: skip
    return build_problem({"num_heads": n}, arrays + [None] * 4, dtype, (True, False, False, False))


class CrossCall:
    """Device copies of one call's operands: the query, b_q, ``copies`` copies of K and V, the outputs; each plan's
    steps on each copy (``steps[plan][copy]``), their scratch kept alive."""

    def __init__(self, cupy, problem, dtype: str, l2_bytes: int, facts, bias: bool = True, cupti: bool = False,
                 thrash_mb: int = 0, warm: str = ""):  # fmt: skip
        g = problem.geometry
        self.bias, self.thrash_mb, self.warm = bias, thrash_mb, warm
        self.cupti = cupti or thrash_mb > 0 or bool(warm)
        self.cupy, self.problem, self.facts = cupy, problem, facts
        rng = np.random.default_rng(0)
        element = np.dtype(dtype)
        self.kv_bytes = 2 * g.batch * g.num_heads * g.total_seq * g.head_size * element.itemsize
        self.copies = max(1, min(GRAPH_LAUNCHES, -(-2 * l2_bytes // self.kv_bytes)))
        shape = (g.batch, g.num_heads, g.total_seq, g.head_size)

        def normal(*dims, dt=element):
            return cupy.asarray(rng.standard_normal(dims).astype(dt))

        self.q = normal(g.batch, 1, g.num_heads * g.head_size)
        self.bias_q = normal(g.num_heads * g.head_size)  # the node's b_q, in its dtype
        self.k = [normal(*shape) for _ in range(self.copies)]
        self.v = [normal(*shape) for _ in range(self.copies)]
        self.out = {plan: cupy.full((g.batch, 1, g.v_hidden), np.nan, element) for plan in PLANS}
        self.out_f32 = cupy.empty((g.batch, 1, g.v_hidden), cupy.float32)
        self.keep = []
        self.dtype = dtype
        self.steps = {plan: [self.plan(plan, c) for c in range(self.copies)] for plan in PLANS}

    def take(self, name: str, nbytes: int) -> int:
        array = self.cupy.empty((max(nbytes, 1),), self.cupy.uint8)
        self.keep.append(array)
        return array.data.ptr

    def plan(self, plan: str, copy: int) -> list:
        g = self.problem.geometry
        operands = dict(
            q=fused.Operand(self.q.data.ptr, "BSNH", 1, g.head_size, self.bias_q.data.ptr if self.bias else None),
            k=fused.Operand(self.k[copy].data.ptr, "BNSH", g.total_seq, g.head_size),
            v=fused.Operand(self.v[copy].data.ptr, "BNSH", g.total_seq, g.v_head_size),
            operand_dtype=self.dtype, attention_bias=None, mask=None,
        )  # fmt: skip
        common = dict(take=self.take, facts=self.facts, raw_query=True)
        if plan == "before":
            count = g.batch * g.q_seq * g.v_hidden
            steps = fused.fused_steps(self.problem, split_kernel="pair", out_BSD=self.out_f32.data.ptr, **common,
                                      **operands)  # fmt: skip
            return steps + [pipeline._narrow(self.dtype, self.out_f32.data.ptr, self.out[plan].data.ptr, count)]
        return fused.fused_steps(self.problem, split_kernel=plan, out_BSD=None, out_narrow=self.out[plan].data.ptr,
                                 **common, **operands)  # fmt: skip

    def micros(self, plan: str, repeats: int) -> float:
        stream = self.cupy.cuda.Stream(non_blocking=True)
        if self.cupti:
            return cupti_micros([functools.partial(run_steps, 0, steps, stream) for steps in self.steps[plan]], stream,
                                self.thrash_mb, self.warm)  # fmt: skip
        turn = itertools.cycle(range(self.copies))
        return stream_seconds(lambda: run_steps(0, self.steps[plan][next(turn)], stream), stream, repeats) * 1e6

    def output(self, plan: str) -> np.ndarray:
        stream = self.cupy.cuda.Stream(non_blocking=True)
        run_steps(0, self.steps[plan][0], stream)
        stream.synchronize()
        return self.cupy.asnumpy(self.out[plan]).astype(np.float64)

    def copy_micros(self, repeats: int) -> float:
        """CuPy's copy of one K (read + write), timed the same way (HBM's rate)."""
        stream = self.cupy.cuda.Stream(non_blocking=True)
        target = self.cupy.empty_like(self.k[0])
        turn = itertools.cycle(range(self.copies))

        def submit():
            with stream:
                self.cupy.copyto(target, self.k[next(turn)])

        return stream_seconds(submit, stream, repeats) * 1e6


def cupti_micros(submits: list, stream, thrash_mb: int = 0, warm: str = "") -> float:
    """--cupti: the GPU time of the attention kernels alone (CUPTI through torch.profiler, as bench/cupti.py and a
    step's profile time them), per launch, over passes of ``submits`` (every copy once); Fill steps and copies are
    left out. ``thrash_mb`` (--thrash): before each launch the stream reads that many MB of another buffer, as a
    decode step's GEMMs read the layers' weights between two attention calls (its time is not counted). ``warm``
    (--warm, after the thrash, not counted): "other" launches the same kernel on the copy half the ring away first
    (its code and the call's small buffers back in L2, the timed copy's K and V still cold), "same" on the timed
    copy itself (everything warm)."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mha_ep.bench.cupti import kernel_kind

    other = cupy.ones((thrash_mb << 18,), cupy.float32) if thrash_mb else None
    total = cupy.zeros((), cupy.float32)
    count = len(submits)

    def run():
        for c, submit in enumerate(submits):
            if other is not None:
                with stream:
                    cupy.sum(other, out=total)
            if warm:
                submits[c if warm == "same" else (c + count // 2) % count]()
            submit()
        stream.synchronize()

    for _ in range(3):
        run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and kernel_kind(e.name) == "attention"]
    events.sort(key=lambda e: e.time_range.start)
    launches = 5 * count * (2 if warm else 1)
    per = len(events) // launches  # attention kernels a submit launches (the pair plan: two)
    assert per * launches == len(events), (len(events), launches)
    calls = [events[i:i + per] for i in range(0, len(events), per)]
    timed = calls[1::2] if warm else calls
    return sum(e.time_range.end - e.time_range.start for call in timed for e in call) / len(timed)


def describe(problem, facts, dtype: str) -> str:
    itemsize = np.dtype(dtype).itemsize
    cut = dispatch.key_stream(problem, facts.sms, itemsize)
    split = dispatch.key_split(problem, facts.sms, itemsize)
    return (f"stream {cut.splits} splits of {cut.span} keys, tiles of {cut.tile} through {cut.stages} stages; "
            f"pair {split.splits} splits of {split.chunk}")  # fmt: skip


def compare(cupy, args, facts, l2_bytes: int) -> None:
    """The default table: the three plans at each pairs, µs and GB/s of K + V."""
    by_cupti = args.cupti or args.thrash or args.warm
    timing = ("µs: the attention kernels' CUPTI time a launch (Fills left out)" if by_cupti else
              f"µs (median of {args.repeats} graph replays / {GRAPH_LAUNCHES})")  # fmt: skip
    print(f"{args.dtype}, S=1, T={args.keys}, H={args.head}, BNSH in place, {facts.sms} SMs, "
          f"L2 {l2_bytes >> 20} MiB, query {'without' if args.no_bias else 'with'} its bias; {timing}"
          f"{f', {args.thrash} MB read before each' if args.thrash else ''}"
          f"{f', a launch on the {args.warm} copy before each (not timed)' if args.warm else ''}"
          " and GB/s of K + V")  # fmt: skip
    files = [Path(f) for f in args.compare]
    labels = list(PLANS) + [f"stream@{f.name}" for f in files]
    print("| pairs (B x N) | copy of K, r+w | " + " | ".join(labels)
          + " | stream / pair | max|Δ| before, stream | cut |")
    print("|---|---|" + "---|" * len(labels) + "---|---|---|", flush=True)
    for pairs in map(int, args.pairs.split(",")):
        problem = cross_problem(pairs, args.keys, args.head, args.dtype)
        call = CrossCall(cupy, problem, args.dtype, l2_bytes, facts, bias=not args.no_bias, cupti=args.cupti,
                         thrash_mb=args.thrash, warm=args.warm)  # fmt: skip
        copy = call.copy_micros(args.repeats)
        times = {plan: call.micros(plan, args.repeats) for plan in PLANS}
        for f in files:
            with stream_source(str(f)):
                times[f"stream@{f.name}"] = call.micros("stream", args.repeats)
        outputs = {plan: call.output(plan) for plan in PLANS}
        deltas = [float(np.nanmax(np.abs(outputs[plan] - outputs["pair"]))) for plan in ("before", "stream")]
        g = problem.geometry
        cells = [f"{us:.1f} ({call.kv_bytes / us / 1e3:.0f})" for us in times.values()]
        print(f"| {pairs} ({g.batch} x {g.num_heads}) | {copy:.1f} ({call.kv_bytes / copy / 1e3:.0f}) | "
              + " | ".join(cells) + f" | {times['stream'] / times['pair']:.2f} | {deltas[0]:.1e}, {deltas[1]:.1e} | "
              f"{describe(problem, facts, args.dtype)} |", flush=True)  # fmt: skip
        del call
        cupy.get_default_memory_pool().free_all_blocks()


@contextlib.contextmanager
def stream_code(code: str):
    """split_key_stream compiled from ``code`` (fused.get_fused_kernel swapped for the block's duration)."""
    compiled = {}
    shipped_getter = fused.get_fused_kernel

    def get(device_id, name, shared):
        if not name.startswith("split_key_stream<"):
            return shipped_getter(device_id, name, shared)
        kernel = compiled.get(name)
        if kernel is None:
            kernel = compiled[name] = kernels.compile_function(device_id, name, code)
        fused.raise_shared_limit(kernel, shared)
        return kernel

    fused.get_fused_kernel = get
    try:
        yield
    finally:
        fused.get_fused_kernel = shipped_getter


@contextlib.contextmanager
def stream_knobs(stages: int, blocks: int, loads: int, stage_bytes: int):
    """split_key_stream compiled with these defines, and dispatch.key_stream cutting the keys with the same values
    (fused.get_fused_kernel and dispatch.key_stream swapped for the block's duration)."""
    code = (f"#define STREAM_STAGES {stages}\n#define STREAM_BLOCKS_PER_SM {blocks}\n"
            f"#define SPLIT_LOADS_IN_FLIGHT {loads}\n") + kernels.kernel_source("split_keys.cu")  # fmt: skip
    shipped_cut = dispatch.key_stream
    dispatch.key_stream = functools.partial(shipped_cut, blocks_per_sm=blocks, stages=stages, stage_bytes=stage_bytes)
    try:
        with stream_code(code):
            yield
    finally:
        dispatch.key_stream = shipped_cut


def stream_source(path: str):
    """split_key_stream compiled from the file at ``path`` (its local includes from the shipped kernel folder); the
    cut is the shipped dispatch.key_stream's."""
    return stream_code(kernels.expand_includes(Path(path).read_text(), {Path(path).name}))


def sweep_stream(cupy, args, facts, l2_bytes: int) -> None:
    """--knobs stream: split_key_stream (with its Fill) at each setting, µs and GB/s of K + V."""
    print(f"split_key_stream, {args.dtype}, S=1, T={args.keys}, H={args.head}, BNSH in place; µs and GB/s of K + V")
    problems = {pairs: cross_problem(pairs, args.keys, args.head, args.dtype) for pairs in map(int, args.pairs.split(","))}
    knobs = itertools.product(*(map(int, getattr(args, name).split(",")) for name in
                                ("stages", "blocks", "loads", "stage_bytes")))  # fmt: skip
    for stages, blocks, loads, stage_bytes in knobs:
        row = []
        with stream_knobs(stages, blocks, loads, stage_bytes):
            for pairs, problem in problems.items():
                call = CrossCall(cupy, problem, args.dtype, l2_bytes, facts, bias=not args.no_bias, cupti=args.cupti,
                         thrash_mb=args.thrash, warm=args.warm)  # fmt: skip
                us = call.micros("stream", args.repeats)
                cut = dispatch.key_stream(problem, facts.sms, np.dtype(args.dtype).itemsize)
                row.append(f"{pairs}: {us:.1f}us/{call.kv_bytes / us / 1e3:.0f} ({cut.splits}x{cut.span}, "
                           f"tile {cut.tile})")  # fmt: skip
                del call
        print(f"stages {stages} blocks/SM {blocks} loads {loads} stage {stage_bytes}B: " + "  ".join(row), flush=True)


def sweep_pair(cupy, args) -> None:
    """--knobs pair: split_key_attention alone (no combine) over SPLIT_THREADS, SPLIT_LOADS_IN_FLIGHT and keys per
    block, launched by hand (20 launches between two events, as before the stream kernel)."""
    import statistics

    elem = ELEMENT_TYPES[args.dtype]
    dtype = np.dtype(args.dtype)
    heads, head = 1, args.head
    rng = np.random.default_rng(0)
    f32, i32, i64 = np.float32, np.int32, np.int64
    null = np.uint64(0)  # a null pointer argument

    def time_launch(launch, batch: int = 20) -> float:
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(3):
            launch()
        times = []
        for _ in range(args.repeats):
            start.record()
            for _ in range(batch):
                launch()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / batch)
        return statistics.median(times)

    print(f"split_key_attention<{elem}, {elem}>, S=1, T={args.keys}, H={head}, BNSH in place; us and GB/s of K+V")
    for threads, loads in itertools.product(map(int, args.threads.split(",")), map(int, args.loads.split(","))):
        code = f"#define SPLIT_THREADS {threads}\n#define SPLIT_LOADS_IN_FLIGHT {loads}\n"
        code += f"#define SPLIT_BLOCKS_PER_SM {max(1, 512 // threads)}\n"
        code += kernels.kernel_source("split_keys.cu")
        expression = f"split_key_attention<{elem}, {elem}>"
        module = cupy.RawModule(code=code, options=kernels.COMPILE_OPTIONS + ("--std=c++17",),
                                name_expressions=[expression])  # fmt: skip
        function = module.get_function(expression)
        for pairs in map(int, args.pairs.split(",")):
            T = args.keys
            q = cupy.asarray(rng.standard_normal((pairs, 1, head)).astype(dtype))
            k = cupy.asarray(rng.standard_normal((pairs, T, head)).astype(dtype))
            v = cupy.asarray(rng.standard_normal((pairs, T, head)).astype(dtype))
            copy = cupy.empty_like(k)
            micros = time_launch(lambda: cupy.copyto(copy, k))
            row = [f"(copy of K: {micros:.1f}us, {2 * k.nbytes / micros / 1e3:.0f} GB/s read+write)"]
            for chunk in map(int, args.chunks.split(",")):
                splits = -(-T // chunk)
                partial_O = cupy.empty((pairs * splits * head,), cupy.float32)
                partial_ML = cupy.empty((pairs * splits * 2,), cupy.float32)
                floats = head + chunk + (threads // 32) * head  # dispatch.split_shared_bytes, one query row
                shared = 4 * (-(-floats // 4) * 4) + chunk * 2 * head * dtype.itemsize
                if shared > 227 * 1024:
                    continue
                function.max_dynamic_shared_size_bytes = max(shared, 48 * 1024)
                arguments = (
                    q, i64(heads * head), i64(head), i64(head), null,
                    k, i64(heads * T * head), i64(T * head), i64(head), null,
                    v, i64(heads * T * head), i64(T * head), i64(head), null,
                    null, i32(1), i32(1), i32(0), null, null, null, null, f32(-10000.0), i32(0), i32(0),
                    f32(0.125), i32(pairs), i32(heads), i32(1), i32(T), i32(0), i32(head), i32(head), null, null,
                    i32(chunk), partial_O, partial_ML, i32(1), null,
                )  # fmt: skip

                def launch(function=function, splits=splits, shared=shared, arguments=arguments):
                    function((pairs, splits, 1), (threads, 1, 1), arguments, shared_mem=shared)

                micros = time_launch(launch)
                row.append(f"{chunk}:{micros:.1f}us/{2 * k.nbytes / micros / 1e3:.0f}")
            print(f"threads {threads} loads {loads} pairs {pairs}: " + "  ".join(row), flush=True)


def main() -> int:
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--pairs", default="20,96,100,160,480",
                    help="B*N of the call (large-v3-turbo B=1: 20; 5 beams: 100; B=8: 160; small B=8: 96; 480)")
    ap.add_argument("--keys", type=int, default=1500)
    ap.add_argument("--head", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--knobs", choices=("stream", "pair"), help="time one kernel over its settings instead")
    ap.add_argument("--compare", nargs="*", default=[], help="variants of split_keys.cu: a stream column each")
    ap.add_argument("--no-bias", action="store_true", help="a query with no bias (the decoder step's cross attention)")
    ap.add_argument("--cupti", action="store_true", help="time each launch by CUPTI, as a step's profile does")
    ap.add_argument("--thrash", type=int, default=0, help="MB the stream reads before each launch (implies --cupti)")
    ap.add_argument("--warm", choices=("other", "same"), help="an untimed launch before each (cupti_micros says which)")
    ap.add_argument("--stages", default=str(dispatch.STREAM_STAGES), help="--knobs stream: STREAM_STAGES")
    ap.add_argument("--blocks", default=str(dispatch.STREAM_BLOCKS_PER_SM), help="--knobs stream: blocks per SM")
    ap.add_argument("--stage-bytes", default=str(dispatch.STREAM_STAGE_BYTES), help="--knobs stream: a tile's bytes")
    ap.add_argument("--loads", default="4", help="SPLIT_LOADS_IN_FLIGHT (--knobs pair: e.g. 2,4)")
    ap.add_argument("--threads", default="128,256", help="--knobs pair: SPLIT_THREADS")
    ap.add_argument("--chunks", default="32,64,96,128,192,256,384,512", help="--knobs pair: keys per block")
    args = ap.parse_args()

    if args.knobs == "pair":
        sweep_pair(cupy, args)
        return 0
    facts = fused.DeviceFacts.of(0)
    l2_bytes = int(cupy.cuda.Device(0).attributes["L2CacheSize"])
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    if args.knobs == "stream":
        sweep_stream(cupy, args, facts, l2_bytes)
    else:
        compare(cupy, args, facts, l2_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
