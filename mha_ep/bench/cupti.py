"""Every CUDA kernel of a piece of GPU work, its GPU time summed by name (CUPTI, through torch.profiler: torch is
optional, and without it ``kernel_table`` raises ImportError), and each kernel's kind, so that a decode step's time
reads as attention, GEMMs, layout moves and the rest (bench/generate.py --profile, scripts/profile_native.py,
scripts/profile_static_decode.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, Tuple

# Substrings of kernel names, lower-cased, first match wins: ours (kernels/*.cu), cuDNN's and ORT's contrib kernels.
KINDS = (
    ("attention", ("attention", "shared_buffer", "split_key", "combine_key", "flash", "fmha", "sdpa", "mha", "softmax",
                   "decodermasked", "masked_multihead", "cudnn")),
    ("gemm", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "cublas", "ampere_", "sm90_", "sm80_", "matmul")),
    ("layout", ("transpose", "concat", "layout", "mover", "addbias", "copy_segments", "slot", "narrow", "widen",
                "present", "gather_kv", "reorder", "append_kv")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    """"attention", "gemm", "layout" or "other" for a kernel's (demangled) name."""
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def kernel_table(run: Callable[[], None], repeats: int = 5) -> Dict[str, Tuple[float, float]]:
    """name -> (launches per run, GPU µs per run) of every kernel of ``run()`` (three warm-up runs first)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    table = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type.name == "CUDA" or getattr(event, "is_cuda", False):
            entry = table[event.name[:90]]
            entry[0] += 1
            entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return {name: (count / repeats, micros / repeats) for name, (count, micros) in table.items()}


def by_kind(table: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """GPU µs per kind (kernel_kind) and in total, and the launches, of a kernel_table."""
    split = {"attention": 0.0, "gemm": 0.0, "layout": 0.0, "other": 0.0}
    for name, (_, micros) in table.items():
        split[kernel_kind(name)] += micros
    split["total"] = sum(micros for _, micros in table.values())
    split["launches"] = sum(count for count, _ in table.values())
    return split


def top(table: Dict[str, Tuple[float, float]], count: int = 12) -> list:
    """The ``count`` kernels with the most GPU time: [name, launches, µs] each."""
    ranked = sorted(table.items(), key=lambda item: -item[1][1])[:count]
    return [[name, launches, micros] for name, (launches, micros) in ranked]
