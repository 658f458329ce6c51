"""Time split_key_attention (kernels/split_keys.cu) alone over its knobs, on the GPU machine: a decode step's
cross attention (S = 1, T = 1500, H = 64, BNSH key and value read in place) at Whisper's shapes, for each block
size, loads in flight (SPLIT_THREADS, SPLIT_LOADS_IN_FLIGHT, both overridable defines) and keys per block. The
kernel is a stream of K and V, so the figure of merit is its read rate: bytes of K and V over the median time.

    PYTHONPATH=$PWD:/tmp/ortsite:/tmp/site python3 scripts/split_key_sweep.py [--dtype float16] [--pairs 96,480]
"""

import argparse
import itertools
import statistics

import numpy as np


def time_launch(cupy, launch, repeats: int, batch: int = 20) -> float:
    """Median over ``repeats`` of the GPU time of ``batch`` launches in a row, per launch (one launch between two
    events would time the host's launch too)."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        launch()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(batch):
            launch()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / batch)
    return statistics.median(times)


def main() -> int:
    import cupy

    from mha_ep.engine.cuda import kernels
    from mha_ep.engine.cuda.kernels import ELEMENT_TYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--pairs", default="6,96,480", help="B*N of the call (Whisper small B=8: 96; 5 beams: 480)")
    ap.add_argument("--keys", type=int, default=1500)
    ap.add_argument("--threads", default="128,256")
    ap.add_argument("--loads", default="2,4")
    ap.add_argument("--chunks", default="32,64,96,128,192,256,384,512")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    elem = ELEMENT_TYPES[args.dtype]
    dtype = np.dtype(args.dtype)
    heads, head = 1, 64
    rng = np.random.default_rng(0)
    f32 = np.float32
    null = np.uint64(0)  # a null pointer argument
    i32, i64 = np.int32, np.int64
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
            micros = time_launch(cupy, lambda: cupy.copyto(copy, k), args.repeats)
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
                    f32(0.125), i32(pairs), i32(heads), i32(1), i32(T), i32(0), i32(head), i32(head), null,
                    i32(chunk), partial_O, partial_ML, i32(1),
                )  # fmt: skip

                def launch(function=function, splits=splits, shared=shared, arguments=arguments):
                    function((pairs, splits, 1), (threads, 1, 1), arguments, shared_mem=shared)

                micros = time_launch(cupy, launch, args.repeats)
                row.append(f"{chunk}:{micros:.1f}us/{2 * k.nbytes / micros / 1e3:.0f}")
            print(f"threads {threads} loads {loads} pairs {pairs}: " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
