"""The anchor shapes every benchmark runs (docs/FACTS.md §2), with the reference times they are judged against, and the
FLOP model.

An anchor's inputs are random normals rounded to its dtype (``anchor_problem``): never zeros, the same for every
benchmark that asks with the same seed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from mha_ep.engine.problem import MhaProblem, build_problem


class AnchorRow(NamedTuple):
    label: str
    b: int
    s: int
    t: int
    n: int
    h: int
    dtype: str
    extra: Optional[str]  # None | "mask2d" (2D key padding mask) | "attn_bias" (B,1,S,T) | "causal"
    ort_cuda_us: float  # stock ORT CUDA device time (docs/FACTS.md §2, measured 2026-11-29)
    sdpa_us: float  # torch SDPA device time, the same run

    @property
    def shape(self) -> tuple:
        """(B, S, T, N, H, dtype, extra): anchor_problem's arguments."""
        return self.b, self.s, self.t, self.n, self.h, self.dtype, self.extra


ANCHORS = (
    AnchorRow("1,128,128,12,64 f32", 1, 128, 128, 12, 64, "float32", None, 64.1, 21.6),
    AnchorRow("8,512,512,12,64 f32", 8, 512, 512, 12, 64, "float32", None, 220.7, 204.7),
    AnchorRow("8,512,512,12,64 f16", 8, 512, 512, 12, 64, "float16", None, 38.4, 25.3),
    AnchorRow("8,512,512,12,64 f16 + 2D key padding mask", 8, 512, 512, 12, 64, "float16", "mask2d", 267.1, 27.0),
    AnchorRow("8,512,512,12,64 f16 + attention_bias (B,1,S,T)", 8, 512, 512, 12, 64, "float16", "attn_bias", 52.6,
              36.1),  # fmt: skip
    AnchorRow("1,4096,4096,16,64 f16", 1, 4096, 4096, 16, 64, "float16", None, 173.0, 148.3),
    AnchorRow("1,4096,4096,16,64 f16 causal", 1, 4096, 4096, 16, 64, "float16", "causal", 124.1, 104.2),
    AnchorRow("4,2048,2048,16,128 f16", 4, 2048, 2048, 16, 128, "float16", None, 234.1, 216.1),
    AnchorRow("1,1,448,6,64 f32 (Whisper decode step)", 1, 1, 448, 6, 64, "float32", None, 63.6, 47.0),
    AnchorRow("4,1500,1500,6,64 f16 (Whisper encoder)", 4, 1500, 1500, 6, 64, "float16", None, 69.8, 53.0),
)


def anchor_problem(b, s, t, n, h, dtype, extra, seed=0) -> MhaProblem:
    rng = np.random.default_rng(seed)
    cast = {"float32": np.float32, "float16": np.float16}[dtype]

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(cast).astype(np.float32)

    arrays = [rand(b, s, n * h), rand(b, t, n * h), rand(b, t, n * h), None, None, None, None, None]
    if extra == "mask2d":
        lengths = rng.integers(t // 2, t + 1, size=b)
        arrays[4] = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    if extra == "attn_bias":
        arrays[5] = rand(b, 1, s, t)
    attrs = {"num_heads": n, "unidirectional": int(extra == "causal")}
    return build_problem(attrs, arrays, dtype, (True, False, False, False))


def flop_count(problem: MhaProblem) -> int:
    """4*B*N*S*T*H (halved for causal), the FLOP model of docs/FACTS.md §2."""
    g = problem.geometry
    flops = 4 * g.batch * g.num_heads * g.q_seq * g.total_seq * g.head_size
    return flops // 2 if problem.causal else flops
