"""Time a static cache's decode step on the GPU machine: the shared-buffer call's kernel (kernels/shared_buffer.cu)
at a Whisper decoder's self attention, the tiled ``shared_buffer_attention`` against ``shared_buffer_decode``, and
against other sources of the decode kernel in the same run:

    PYTHONPATH=$PWD python3 scripts/shared_buffer_sweep.py [--batches 1,8] [--past 35,200] [--beams 0,5]
    git show main:mha_ep/engine/cuda/kernels/shared_buffer.cu > /tmp/before.cu
    PYTHONPATH=$PWD python3 scripts/shared_buffer_sweep.py --compare /tmp/before.cu

The call is what `mha-ep static-cache` makes of a decoder's self attention: one new row (S = L = 1), float16 by
default, N 20, H 64 (large-v3-turbo), a (B, N, M, H) past and present bound to one buffer (the Copy of the past
into the present is a no-op then and is not timed), P past rows read from the device, and on the beam path
cache_indirection (B/W, W, M) with random indices below W. Only the kernel's launch is timed: runner.run_steps,
GRAPH_LAUNCHES submissions captured in one CUDA graph and replayed (bench/timer.stream_seconds: µs = median replay /
GRAPH_LAUNCHES), over rotating copies of the cache, as many as exceed twice the L2 but at most GRAPH_LAUNCHES (a
captured graph replays the same launches): at B = 1 these fit in the L2 and the P rows are read from it, where each
decoder layer of a step reads its own cache from HBM; ``--thrash`` gives a step's conditions. The bytes a call must read are its P rows of K and V (B x N x P x (H + Hv) elements), so
GB/s is beside each time, though at these sizes a call is a chain of dependent reads, not a stream. Every output
is compared with the tiled kernel's (max |Δ|: both sum in float32, in other orders).

``--cupti``: each kernel timed by CUPTI (bench/cupti.py, as ``bench generate --profile`` times a step), every copy
launched in turn, in place of the graph replays; ``--thrash MB`` reads MB of another buffer before each launch and
``--warm other|same`` launches the kernel once untimed before each (as split_key_sweep.py's).

A ``--compare`` file is a variant of shared_buffer.cu with the same kernel names and parameters (its local
includes come from the shipped kernel folder); its ``shared_buffer_decode`` replaces the shipped one in its column.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mha_ep.bench.timer import GRAPH_LAUNCHES, stream_seconds  # noqa: E402
from mha_ep.engine.cuda import kernels, pipeline  # noqa: E402
from mha_ep.engine.cuda.runner import run_steps  # noqa: E402
from mha_ep.engine.cuda.shared_buffer import SHARED_KERNEL_ENV, shared_buffer_steps  # noqa: E402
from mha_ep.engine.cuda.steps import Launch  # noqa: E402
from mha_ep.engine.problem import build_problem  # noqa: E402

DECODE = "shared_buffer_decode<"


def shared_problem(batch: int, heads: int, head: int, max_seq: int, past: int, beams: int, dtype: str):
    """The MhaProblem of one decode step over a shared buffer (build_problem reads the shapes and P)."""
    element = np.dtype(dtype)
    hidden = heads * head
    arrays = [np.zeros((batch, 1, hidden), element) for _ in range(3)] + [None, None, None]
    arrays += [np.zeros((batch, heads, max_seq, head), element) for _ in range(2)]
    arrays += [np.array([past], np.int32)]
    arrays += [np.zeros((batch // beams, beams, max_seq), np.int32) if beams else None]
    return build_problem({"num_heads": heads}, arrays, dtype, (True, True, True, False))


class SharedCall:
    """Device buffers of one call: query, key, value, ``copies`` caches (past = present), P, the beam indices, an
    output per column; each column's launch on each copy."""

    def __init__(self, cupy, problem, dtype: str, l2_bytes: int, past: int, beams: int, columns: dict,
                 cupti: bool = False, thrash_mb: int = 0, warm: str = ""):  # fmt: skip
        g, shared = problem.geometry, problem.shared
        self.cupy, self.problem, self.dtype = cupy, problem, dtype
        self.cupti, self.thrash_mb, self.warm = cupti or thrash_mb > 0 or bool(warm), thrash_mb, warm
        rng = np.random.default_rng(0)
        element = np.dtype(dtype)

        def normal(*dims):
            return cupy.asarray(rng.standard_normal(dims).astype(element))

        shape = (g.batch, g.num_heads, shared.max_seq, g.head_size)
        cache_bytes = 2 * int(np.prod(shape)) * element.itemsize
        self.read_bytes = 2 * g.batch * g.num_heads * past * g.head_size * element.itemsize
        self.copies = max(1, min(GRAPH_LAUNCHES, -(-2 * l2_bytes // cache_bytes)))
        self.query, self.key, self.value = (normal(g.batch, 1, g.num_heads * g.head_size) for _ in range(3))
        self.caches = [(normal(*shape), normal(*shape)) for _ in range(self.copies)]
        self.past = cupy.asarray(np.array([past], np.int32))
        self.indirection = None
        if beams:
            indices = rng.integers(0, beams, size=(g.batch // beams, beams, shared.max_seq)).astype(np.int32)
            self.indirection = cupy.asarray(indices)
        self.out = {name: cupy.full((g.batch, 1, g.v_hidden), np.nan, element) for name in columns}
        self.keep = []
        self.launches = {name: [self.launch(name, kernel, c) for c in range(self.copies)]
                         for name, kernel in columns.items()}  # fmt: skip

    def take(self, name: str, nbytes: int) -> int:
        array = self.cupy.zeros((max(nbytes, 1),), self.cupy.uint8)
        self.keep.append(array)
        return array.data.ptr

    def launch(self, column: str, kernel: str, copy: int) -> Launch:
        """The column's kernel launch on cache ``copy`` (shared_buffer_steps with MHA_EP_SHARED_KERNEL=kernel)."""
        past_key, past_value = self.caches[copy]
        sources = {"query": self.query.data.ptr, "key": self.key.data.ptr, "value": self.value.data.ptr,
                   "past_key": past_key.data.ptr, "past_value": past_value.data.ptr,
                   "past_sequence_length": self.past.data.ptr,
                   "cache_indirection": None if self.indirection is None else self.indirection.data.ptr}  # fmt: skip
        outputs = {"output": self.out[column].data.ptr, "present_key": past_key.data.ptr,
                   "present_value": past_value.data.ptr}  # fmt: skip
        call = pipeline.DeviceCall(sources, self.dtype, outputs, self.dtype, mask_form="int32")
        saved = os.environ.get(SHARED_KERNEL_ENV)
        os.environ[SHARED_KERNEL_ENV] = kernel
        try:
            steps = shared_buffer_steps(self.problem, call, self.take)
        finally:
            if saved is None:
                os.environ.pop(SHARED_KERNEL_ENV)
            else:
                os.environ[SHARED_KERNEL_ENV] = saved
        (launch,) = [step for step in steps if isinstance(step, Launch)]
        return launch

    def micros(self, column: str, repeats: int) -> float:
        stream = self.cupy.cuda.Stream(non_blocking=True)
        if self.cupti:
            from split_key_sweep import cupti_micros

            return cupti_micros([functools.partial(run_steps, 0, [launch], stream) for launch in self.launches[column]],
                                stream, self.thrash_mb, self.warm)  # fmt: skip
        turn = itertools.cycle(self.launches[column])
        return stream_seconds(lambda: run_steps(0, [next(turn)], stream), stream, repeats) * 1e6

    def output(self, column: str) -> np.ndarray:
        self.cupy.cuda.runtime.deviceSynchronize()  # the buffers' fills ran on CuPy's default stream
        stream = self.cupy.cuda.Stream(non_blocking=True)
        run_steps(0, [self.launches[column][0]], stream)
        stream.synchronize()
        return self.cupy.asnumpy(self.out[column]).astype(np.float64)


def swap_decode_kernel(files: list):
    """kernels.get_function answering ``shared_buffer_decode<...>`` of column ``file`` from that file's source; the
    column is chosen by a prefix on the expression (columns() names each launch ``FILE|expression``)."""
    shipped = kernels.get_function
    compiled = {}

    def get(device_id, expression):
        if "|" not in expression:
            return shipped(device_id, expression)
        path, name = expression.split("|", 1)
        function = compiled.get((path, name))
        if function is None:
            import cupy

            code = kernels.expand_includes(Path(path).read_text(), {Path(path).name})
            module = cupy.RawModule(code=code, options=kernels.COMPILE_OPTIONS + ("--std=c++17",),
                                    name_expressions=[name])  # fmt: skip
            function = compiled[(path, name)] = module.get_function(name)
        return function

    kernels.get_function = get
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--past", default="35,200", help="P: past rows of the cache")
    parser.add_argument("--beams", default="0,5", help="0: greedy; W: the beam path with W beams (B x W rows)")
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--head", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=448)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compare", nargs="*", default=[], help="variants of shared_buffer.cu")
    parser.add_argument("--cupti", action="store_true", help="time each launch by CUPTI, as a step's profile does")
    parser.add_argument("--thrash", type=int, default=0, help="MB read before each launch (implies --cupti)")
    parser.add_argument("--warm", choices=("other", "same"), help="an untimed launch before each (split_key_sweep's)")
    args = parser.parse_args()
    import cupy

    l2_bytes = int(cupy.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    columns = {"tiled": "tiled", "decode": "decode"}
    files = swap_decode_kernel(args.compare)
    labels = ["tiled", "decode"] + [Path(f).name for f in files]
    print(f"device: {name}, L2 {l2_bytes >> 20} MiB; {args.dtype}, S = L = 1, N {args.heads}, H {args.head}, "
          f"M {args.max_length}; "
          + ("µs: the kernel's CUPTI time a launch" if args.cupti or args.thrash or args.warm else
             f"µs (median of {args.repeats} graph replays / {GRAPH_LAUNCHES})")
          + (f", {args.thrash} MB read before each" if args.thrash else "")
          + (f", a launch on the {args.warm} copy before each (not timed)" if args.warm else "")
          + " and GB/s of the P rows")
    print("| B (beams) | P | " + " | ".join(labels) + " | decode / tiled | max|Δ| vs tiled |")
    print("|---|---|" + "---|" * len(labels) + "---|---|", flush=True)
    for batch, past, beams in itertools.product(*(map(int, a.split(",")) for a in (args.batches, args.past,
                                                                                    args.beams))):  # fmt: skip
        rows = batch * max(beams, 1)
        problem = shared_problem(rows, args.heads, args.head, args.max_length, past, beams, args.dtype)
        wanted = dict(columns, **{f: "decode" for f in files})
        call = SharedCall(cupy, problem, args.dtype, l2_bytes, past, beams, wanted, cupti=args.cupti,
                          thrash_mb=args.thrash, warm=args.warm)  # fmt: skip
        for f in files:  # the file's decode kernel in its column
            call.launches[f] = [Launch(f"{f}|{launch.function}", launch.grid, launch.block, launch.shared,
                                       launch.args) for launch in call.launches[f]]  # fmt: skip
        times = {column: call.micros(column, args.repeats) for column in call.launches}
        tiled = call.output("tiled")
        delta = max(float(np.nanmax(np.abs(call.output(c) - tiled))) for c in call.launches if c != "tiled")
        cells = [f"{us:.1f} ({call.read_bytes / us / 1e3:.0f})" for us in times.values()]
        print(f"| {rows} ({beams or 'greedy'}) | {past} | " + " | ".join(cells)
              + f" | {times['decode'] / times['tiled']:.2f} | {delta:.1e} |", flush=True)  # fmt: skip
        del call
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
