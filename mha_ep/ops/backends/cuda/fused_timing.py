"""Device timing of the fused attention kernel on the DESIGN.md anchor shapes, beside torch SDPA and the
three-phase path, all measured in one run on one GPU.

    PYTHONPATH=$PWD python3 -m mha_ep.ops.backends.cuda.fused_timing [--repeats 50] [--no-torch] [--no-three-phase]

Columns (µs = median over ``repeats`` launches, each between its own pair of CUDA events, after warm-up; inputs
already on the device, random normals rounded to the dtype, never zeros):
  fused:          flash_attention_* alone, on the dense operands the layout mover builds (q_BNSH, k_BNTH, v_BNTH
                  in the call's dtype); the fused path's kernel-only time;
  TFLOP/s:        4*B*N*S*T*H / fused time (halved for causal), DESIGN.md's FLOP model;
  fused staged:   the same kernel reading the staged float32 BSNH arrays directly (rounding on load): the whole
                  device part of a call that needs no layout step;
  3-phase:        CudaBackend.time_device (layout kernels + cuBLAS + softmax + output kernel; its own mean);
  torch SDPA:     torch.nn.functional.scaled_dot_product_attention on (B, N, S, H) tensors of the dtype (padding as a
                  boolean attn_mask, attention_bias as an additive float mask, causal as is_causal);
  ORT CUDA dev:   DESIGN.md's anchor (measured 2026-11-29), with the target met (<=) or missed;
  max|Δ| torch:   largest absolute difference between the fused output and torch's (a sanity check).
"""

from __future__ import annotations

import argparse

import numpy as np

from mha_ep.ops.backends.cuda import fused
from mha_ep.ops.problem import build_problem

# (label, B, S, T, N, H, dtype, extra, ORT CUDA dev µs, torch SDPA dev µs) from DESIGN.md
ANCHORS = (
    ("1,128,128,12,64 f32", 1, 128, 128, 12, 64, "float32", None, 64.1, 21.6),
    ("8,512,512,12,64 f32", 8, 512, 512, 12, 64, "float32", None, 220.7, 204.7),
    ("8,512,512,12,64 f16", 8, 512, 512, 12, 64, "float16", None, 38.4, 25.3),
    ("8,512,512,12,64 f16 + 2D key padding mask", 8, 512, 512, 12, 64, "float16", "mask2d", 267.1, 27.0),
    ("8,512,512,12,64 f16 + attention_bias (B,1,S,T)", 8, 512, 512, 12, 64, "float16", "attn_bias", 52.6, 36.1),
    ("1,4096,4096,16,64 f16", 1, 4096, 4096, 16, 64, "float16", None, 173.0, 148.3),
    ("1,4096,4096,16,64 f16 causal", 1, 4096, 4096, 16, 64, "float16", "causal", 124.1, 104.2),
    ("4,2048,2048,16,128 f16", 4, 2048, 2048, 16, 128, "float16", None, 234.1, 216.1),
    ("1,1,448,6,64 f32 (Whisper decode step)", 1, 1, 448, 6, 64, "float32", None, 63.6, 47.0),
    ("4,1500,1500,6,64 f16 (Whisper encoder)", 4, 1500, 1500, 6, 64, "float16", None, 69.8, 53.0),
)


def anchor_problem(b, s, t, n, h, dtype, extra, seed=0):
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


def median_us(cupy, launch, repeats: int, warmup: int = 5) -> float:
    """Median device time of ``launch()`` in µs: one event pair per launch on the current stream."""
    for _ in range(warmup):
        launch()
    pairs = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        launch()
        stop.record()
        pairs.append((start, stop))
    pairs[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in pairs])) * 1e3


class Anchor:
    """Device copies of one anchor problem in both operand forms, and a fused launch for each."""

    def __init__(self, cupy, problem):
        g = problem.geometry
        self.problem = problem
        b, s, t, n, h = g.batch, g.q_seq, g.total_seq, g.num_heads, g.head_size
        dt = cupy.float16 if problem.dtype == "float16" else cupy.float32
        self.q_BSD, self.k_BTD, self.v_BTD = (cupy.asarray(a) for a in (problem.query_BSD, problem.key, problem.value))
        self.q_BNSH = cupy.ascontiguousarray(self.q_BSD.reshape(b, s, n, h).transpose(0, 2, 1, 3).astype(dt))
        self.k_BNTH = cupy.ascontiguousarray(self.k_BTD.reshape(b, t, n, h).transpose(0, 2, 1, 3).astype(dt))
        self.v_BNTH = cupy.ascontiguousarray(self.v_BTD.reshape(b, t, n, h).transpose(0, 2, 1, 3).astype(dt))
        self.mask = None
        if problem.padding_mask is not None:
            self.mask = cupy.asarray(problem.padding_mask.data.astype(np.uint8))
        self.attention_bias = None if problem.attention_bias is None else cupy.asarray(problem.attention_bias)
        self.out = cupy.full((b, s, g.v_hidden), np.nan, dtype=cupy.float32)

    def launch(self, form: str) -> None:
        g, p = self.problem.geometry, self.problem
        if form == "dense":
            ops = [(self.q_BNSH, g.q_seq), (self.k_BNTH, g.total_seq), (self.v_BNTH, g.total_seq)]
            layout, operand_dtype = "BNSH", p.dtype
        else:
            ops = [(self.q_BSD, g.q_seq), (self.k_BTD, g.total_seq), (self.v_BTD, g.total_seq)]
            layout, operand_dtype = "BSNH", "float32"
        q, k, v = (fused.Operand(a.data.ptr, layout, seq, g.head_size) for a, seq in ops)
        fused.run_fused(0, p, q=q, k=k, v=v, operand_dtype=operand_dtype,
                        attention_bias=None if self.attention_bias is None else self.attention_bias.data.ptr,
                        mask=None if self.mask is None else self.mask.data.ptr, out_BSD=self.out.data.ptr)  # fmt: skip


def torch_sdpa(torch, anchor: Anchor, extra):
    """A launch of torch SDPA on the anchor's data and its (B, S, N*H) float32 result."""
    p = anchor.problem
    g = p.geometry
    dt = torch.float16 if p.dtype == "float16" else torch.float32
    q, k, v = (torch.as_tensor(a, device="cuda").to(dt) for a in (anchor.q_BNSH, anchor.k_BNTH, anchor.v_BNTH))
    kwargs = {}
    if extra == "mask2d":
        keep = torch.as_tensor(anchor.mask, device="cuda").bool()
        kwargs["attn_mask"] = keep[:, None, None, :]
    if extra == "attn_bias":
        kwargs["attn_mask"] = torch.as_tensor(anchor.attention_bias, device="cuda").to(dt)
    if extra == "causal":
        kwargs["is_causal"] = True

    def launch():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    result = launch().float().permute(0, 2, 1, 3).reshape(g.batch, g.q_seq, g.v_hidden)
    return launch, result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-three-phase", action="store_true")
    parser.add_argument("--only", default=None, help="substring of the anchor labels to run")
    args = parser.parse_args(argv)

    import cupy

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    backend = None
    if not args.no_three_phase:
        from mha_ep.ops.backends.cuda import CudaBackend

        backend = CudaBackend(0)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; µs = median of {args.repeats} launches (CUDA events), operands on the device")
    print("| shape (B,S,T,N,H) dtype extra | fused µs | TFLOP/s | fused staged µs | 3-phase µs | torch SDPA µs "
          "| fused/torch thr. | ORT CUDA dev µs | <= ORT | max|Δ| torch |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, b, s, t, n, h, dtype, extra, ort_us, _ in ANCHORS:
        if args.only and args.only not in label:
            continue
        problem = anchor_problem(b, s, t, n, h, dtype, extra)
        anchor = Anchor(cupy, problem)
        fused_us = median_us(cupy, lambda: anchor.launch("dense"), args.repeats)
        fused_out = cupy.asnumpy(anchor.out)
        staged_us = median_us(cupy, lambda: anchor.launch("staged"), args.repeats)
        tflops = fused.flop_count(problem) / (fused_us * 1e-6) / 1e12
        three = "n/a"
        if backend is not None:
            try:
                three = f"{backend.time_device(problem) * 1e6:.1f}"
            except Exception as error:  # noqa: BLE001 - the three-phase column is a comparison only
                three = f"error: {type(error).__name__}"
        torch_us, ratio, delta = "n/a", "n/a", "n/a"
        if torch is not None:
            launch, result = torch_sdpa(torch, anchor, extra)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for i in range(args.repeats + 5):
                start.record()
                launch()
                stop.record()
                stop.synchronize()
                if i >= 5:
                    samples.append(start.elapsed_time(stop) * 1e3)
            t_us = float(np.median(samples))
            torch_us, ratio = f"{t_us:.1f}", f"{t_us / fused_us:.2f}"
            delta = f"{float(np.nanmax(np.abs(fused_out - result.cpu().numpy()))):.2e}"
        finite = "" if np.isfinite(fused_out).all() else " NON-FINITE OUTPUT"
        print(f"| {label} | {fused_us:.1f} | {tflops:.1f} | {staged_us:.1f} | {three} | {torch_us} | {ratio} | "
              f"{ort_us} | {'yes' if fused_us <= ort_us else 'MISS'} | {delta}{finite} |")  # fmt: skip


if __name__ == "__main__":
    main()
