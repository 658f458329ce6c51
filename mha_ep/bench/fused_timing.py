"""Device timing of the fused attention kernel on the anchor shapes (docs/FACTS.md §2), beside torch SDPA and the
three-phase path, all measured in one run on one GPU.

    PYTHONPATH=$PWD python3 -m mha_ep.bench.fused_timing [--repeats 50] [--no-torch] [--no-three-phase]
    PYTHONPATH=$PWD python3 -m mha_ep.bench.fused_timing --compare OTHER.cu [MORE.cu ...] [--only TEXT]

``--compare`` times kernel sources side by side instead: the shipped kernels and each OTHER.cu (a variant of
flash_attention.cu, flash_attention_wgmma.cu or flash_attention_ws.cu with the same kernel names and parameters, e.g. an older revision
from ``git show REV:path`` or an experiment; kernels it does not define are the shipped ones), every one on the
same inputs and default tile, with each output's largest |Δ| from the shipped kernel's. The kernel's speed moves
with code that never runs (the compiler schedules the whole loop), so a change is judged by this table.

Timing: timer.stream_seconds (a CUDA graph of GRAPH_LAUNCHES back-to-back launches, captured after warm-up and
replayed ``repeats`` times, each replay between its own pair of CUDA events; µs = median replay / GRAPH_LAUNCHES). Inputs are
already on the device: random normals rounded to the dtype, never zeros. Columns:
  fused:          flash_attention_* alone with the kernel and tile run_fused chooses on this device, on the dense
                  operands the layout mover builds (q_BNSH, k_BNTH, v_BNTH in the call's dtype); the fused path's
                  kernel-only time (flash_attention_ws as a whole-tile walk: its tail split, dispatch.ws_tail, is
                  fused_steps' two launches, which ``mha-ep bench sd`` times with MHA_EP_WS_TAIL on and off);
  tiles:          f16/bf16 only: the same for each tile of TILES (BLOCK_M x BLOCK_N; "wg": the wgmma kernel, on
                  a compute capability 9.0 device, with a trailing "s" when its steps do not overlap; "ws": the
                  warp-specialized kernel, no padding mask or attention_bias: ws128 two consumers, ws192 three),
                  best marked *;
  TFLOP/s:        4*B*N*S*T*H / fused time (halved for causal), the FLOP model of docs/FACTS.md §2;
  fused staged:   flash_attention_mma reading the staged float32 BSNH arrays directly (rounding on load): the whole
                  device part of a call that needs no layout step;
  3-phase:        timer.backend_seconds with the fused path switched off (layout kernels + cuBLAS + softmax +
                  output kernel, from plain submissions);
  torch SDPA:     torch.nn.functional.scaled_dot_product_attention on (B, N, S, H) tensors of the dtype (padding as a
                  boolean attn_mask, attention_bias as an additive float mask, causal as is_causal), timed the same
                  way through a torch CUDA graph (back-to-back launches when capture fails);
  ORT CUDA dev:   the anchor table's reference (bench/anchors.py), with the target met (<=) or missed;
  max|Δ| torch:   largest absolute difference between the fused output and torch's (a sanity check).
"""

from __future__ import annotations

import argparse

import numpy as np

from mha_ep.bench.anchors import ANCHORS, anchor_problem, flop_count
from mha_ep.bench.timer import GRAPH_LAUNCHES, backend_seconds, stream_seconds, torch_graph_seconds
from mha_ep.engine.cuda import dispatch, fused, kernels, runner

TILE_AGREEMENT = 1e-2  # largest |Δ| between a tile's output and the default tile's (fp32 accumulation, P in f16)
TILES = (dispatch.MmaTile(64, 64), dispatch.MmaTile(128, 64), dispatch.MmaTile(64, 128), dispatch.MmaTile(128, 128),
         dispatch.WgmmaTile(64), dispatch.WgmmaTile(128), dispatch.WgmmaTile(64, 128, False),
         dispatch.WgmmaTile(128, 128, False), dispatch.WsTile(), dispatch.WsTile(consumers=3))  # fmt: skip


def graph_us(cupy, launch, repeats: int) -> float:
    """Per-launch device time in µs of ``launch(stream)`` on a stream of its own (timer.stream_seconds)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    return stream_seconds(lambda: launch(stream), stream, repeats) * 1e6


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
        cupy.cuda.Device().synchronize()  # the timed launches run on other (non-blocking) streams

    def launch(self, form: str, stream=None, tile=None) -> None:
        g, p = self.problem.geometry, self.problem
        if form == "dense":
            ops = [(self.q_BNSH, g.q_seq), (self.k_BNTH, g.total_seq), (self.v_BNTH, g.total_seq)]
            layout, operand_dtype = "BNSH", p.dtype
        else:
            ops = [(self.q_BSD, g.q_seq), (self.k_BTD, g.total_seq), (self.v_BTD, g.total_seq)]
            layout, operand_dtype = "BSNH", "float32"
        q, k, v = (fused.Operand(a.data.ptr, layout, seq, g.head_size) for a, seq in ops)
        runner.run_fused(0, p, q=q, k=k, v=v, operand_dtype=operand_dtype,
                         attention_bias=None if self.attention_bias is None else self.attention_bias.data.ptr,
                         mask=None if self.mask is None else self.mask.data.ptr, out_BSD=self.out.data.ptr,
                         stream=stream, tile=tile)  # fmt: skip


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


def source_getter(source: str, shipped):
    """A stand-in for fused.get_fused_kernel that compiles the kernels ``source`` defines (a variant of
    flash_attention.cu, flash_attention_wgmma.cu or flash_attention_ws.cu) and takes the others from ``shipped``."""
    from mha_ep.engine.cuda.kernels import expand_includes

    code = expand_includes(source)
    compiled = {}

    def get(device_id, name, shared):
        if f"{name.split('<')[0]}(" not in code:
            return shipped(device_id, name, shared)
        kernel = compiled.get(name)
        if kernel is None:
            kernel = compiled[name] = kernels.compile_function(device_id, name, code)
        fused.raise_shared_limit(kernel, shared)
        return kernel

    return get


def compare_sources(cupy, paths, repeats: int, only=None) -> None:
    """The --compare table: µs per launch of the shipped kernels and of each source in ``paths``."""
    from pathlib import Path

    shipped_getter = fused.get_fused_kernel
    getters = {"shipped": shipped_getter}
    getters.update({Path(path).name: source_getter(Path(path).read_text(), shipped_getter) for path in paths})
    print(f"µs per launch (median of {repeats} graph replays / {GRAPH_LAUNCHES}); max|Δ| from the shipped kernel")
    print("| shape (B,S,T,N,H) dtype extra | " + " | ".join(getters) + " |")
    print("|---|" + "---|" * len(getters))
    try:
        for row in ANCHORS:
            if only and only not in row.label:
                continue
            label, anchor = row.label, Anchor(cupy, anchor_problem(*row.shape))
            cells, reference = [], None
            for name, getter in getters.items():
                fused.get_fused_kernel = getter
                try:
                    us = graph_us(cupy, lambda st: anchor.launch("dense", st), repeats)
                except Exception as error:  # noqa: BLE001 - an experiment that fails to build is a table cell
                    cells.append(f"{type(error).__name__}: {str(error).splitlines()[0][:60]}")
                    continue
                out = cupy.asnumpy(anchor.out)
                reference = out if reference is None else reference
                cells.append(f"{us:.1f} (Δ {float(np.nanmax(np.abs(out - reference))):.1e})")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    finally:
        fused.get_fused_kernel = shipped_getter


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50, help="CUDA-graph replays per cell (median; default 50)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch SDPA column")
    parser.add_argument("--no-three-phase", action="store_true", help="skip the three-phase (unfused) column")
    parser.add_argument("--only", default=None, help="substring of the anchor labels to run")
    parser.add_argument("--launch-only", action="store_true",
                        help="one fused launch per anchor and no timing (for a profiler such as ncu)")  # fmt: skip
    parser.add_argument("--compare", nargs="+", metavar="SOURCE.cu", default=None,
                        help="time these flash_attention.cu variants beside the shipped one (see above)")  # fmt: skip
    args = parser.parse_args(argv)

    import cupy

    if args.compare:
        compare_sources(cupy, args.compare, args.repeats, args.only)
        return

    if args.launch_only:
        for row in ANCHORS:
            if args.only is None or args.only in row.label:
                label, anchor = row.label, Anchor(cupy, anchor_problem(*row.shape))
                anchor.launch("dense")
                cupy.cuda.Device().synchronize()
                print(f"launched: {label}")
        return

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    backend = None
    if not args.no_three_phase:
        from mha_ep.engine.cuda import CudaBackend

        backend = CudaBackend(0, fused_path=False)  # the column compares against the three-phase path
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; µs per launch = median of {args.repeats} CUDA-graph replays of {GRAPH_LAUNCHES} launches / "
          f"{GRAPH_LAUNCHES}; operands on the device")
    print("| shape (B,S,T,N,H) dtype extra | fused µs | TFLOP/s | tiles µs (BMxBN) | fused staged µs | 3-phase µs "
          "| torch SDPA µs | fused/torch thr. | ORT CUDA dev µs | <= ORT | max|Δ| torch |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in ANCHORS:
        if args.only and args.only not in row.label:
            continue
        label, dtype, extra, ort_us = row.label, row.dtype, row.extra, row.ort_cuda_us
        problem = anchor_problem(*row.shape)
        anchor = Anchor(cupy, problem)
        fused_us = graph_us(cupy, lambda st: anchor.launch("dense", st), args.repeats)
        fused_out = cupy.asnumpy(anchor.out)
        staged_us = graph_us(cupy, lambda st: anchor.launch("staged", st), args.repeats)
        tiles = "-"
        if dtype != "float32":
            per_tile, notes = {}, {}
            for tile in TILES:
                try:
                    per_tile[tile] = graph_us(cupy, lambda st, tile=tile: anchor.launch("dense", st, tile), args.repeats)
                except ValueError as error:  # a tile whose kernel cannot run this call, or whose shared memory does not fit it
                    notes[tile] = f"{tile.label}:n/a ({error})"
                    continue
                drift = float(np.nanmax(np.abs(cupy.asnumpy(anchor.out) - fused_out)))
                if not drift <= TILE_AGREEMENT:  # the same function on every tile (NaN counts as a miss)
                    notes[tile] = f"{tile.label}:{per_tile.pop(tile):.1f} DIFFERS from the default tile by {drift:.2e}"
            best = min(per_tile, key=per_tile.get)
            tiles = " ".join(notes.get(t) or f"{t.label}:{per_tile[t]:.1f}{'*' if t == best else ''}" for t in TILES)
        tflops = flop_count(problem) / (fused_us * 1e-6) / 1e12
        three = "n/a"
        if backend is not None:
            try:
                three = f"{backend_seconds(backend, problem) * 1e6:.1f}"
            except Exception as error:  # noqa: BLE001 - the three-phase column is a comparison only
                three = f"error: {type(error).__name__}"
        torch_us, ratio, delta = "n/a", "n/a", "n/a"
        if torch is not None:
            launch, result = torch_sdpa(torch, anchor, extra)
            t_us = torch_graph_seconds(torch, launch, args.repeats) * 1e6
            torch_us, ratio = f"{t_us:.1f}", f"{t_us / fused_us:.2f}"
            delta = f"{float(np.nanmax(np.abs(fused_out - result.cpu().numpy()))):.2e}"
        finite = "" if np.isfinite(fused_out).all() else " NON-FINITE OUTPUT"
        print(f"| {label} | {fused_us:.1f} | {tflops:.1f} | {tiles} | {staged_us:.1f} | {three} | {torch_us} | {ratio} | "
              f"{ort_us} | {'yes' if fused_us <= ort_us else 'MISS'} | {delta}{finite} |")  # fmt: skip


if __name__ == "__main__":
    main()
