"""Problems, tolerances and the GPU harness of the fused-kernel tests: ``run_fused`` on device copies of a
problem's inputs in three operand forms ("staged": the float32 arrays as the op received them, bias added on load;
"dense": q_BNSH / k_BNTH / v_BNTH in the call's dtype with bias and past applied; "dense_BSNH": the same in BSNH),
every output poisoned with NaN first. Tolerances: float32 and float16 against run_reference within 1e-5 / 4e-3 of
max(1, |ref|); bfloat16 error against float64 within 2x a naive bfloat16 implementation's plus 1e-4."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from mha_ep.engine.cuda import dispatch, fused, runner
from mha_ep.engine.cuda.split_keys import SPLIT_KERNELS
from mha_ep.engine.reference import run_reference
from mha_ep.engine.problem import FLOAT32_LOWEST, MhaProblem, build_problem

import cuda_cases
from cuda_cases import Case, dense_operands, from_device, naive_low_precision, to_device

KERNEL_DIR = Path(fused.__file__).parent / "kernels"


FUSED_FILES = ("flash_attention.cu", "flash_common.cuh", "flash_tile.cuh", "wgmma_common.cuh",
               "flash_attention_wgmma.cu", "flash_attention_ws.cu", "split_keys.cu")  # the fused kernels' code


SOURCE = "\n".join((KERNEL_DIR / name).read_text() for name in FUSED_FILES)




DTYPES = ("float32", "float16", "bfloat16")


RELATIVE_TOLERANCE = {"float32": 1e-5, "float16": 4e-3}


BF16_NOISE_FLOOR = 1e-4


# ----------------------------------------------------------------------------------------------- problems
def make_problem(case: Case, dtype: str) -> MhaProblem:
    """Presents are wanted exactly when there is a past (ORT needs both presents with a past, docs/SEMANTICS.md §3.9)."""
    return cuda_cases.make_problem(case, dtype, presents=case.p is not None)


# ------------------------------------------------------------------------------------------------ GPU harness
def run_fused_on_gpu(cupy, problem: MhaProblem, form: str, tile=None, split=False,
                     narrow: bool = False, tail_sms: Optional[int] = None) -> np.ndarray:  # fmt: skip
    """Output (B, S, Dv) float32 of the fused kernel on device copies of ``problem`` in operand ``form``
    (``split``: fused_steps' split-key launches, their scratch poisoned, instead of the flash kernel: True for the
    default kernel, or its name, "stream" or "pair"; ``narrow``: float16 / bfloat16 calls write the output in the
    call's dtype, out_narrow, read back as float32; ``tail_sms``: fused_steps planned for a device of that many
    SMs, whose flash_attention_ws ``tile`` must take a tail split (dispatch.ws_tail): the kernel over that many
    blocks, its tail slots poisoned, then combine_tile_splits)."""
    g = problem.geometry
    keep = []  # device arrays stay alive until the kernel is done

    def dev(array, dtype="float32"):
        if array is None:
            return None
        device_array = to_device(cupy, array, dtype)
        keep.append(device_array)
        return device_array.data.ptr

    offset_args = {}
    if form == "raw":  # the native route's cross attention (pipeline.reads_kv_in_place): no mover at all
        assert split and problem.kv_layout == "BNSH" and problem.past_key_BNPH is None, "raw: a split BNSH call"
        q = fused.Operand(dev(problem.query_BSD, problem.dtype), "BSNH", g.q_seq, g.head_size,
                          dev(problem.bias_q, problem.dtype))  # the node's b_q as it is
        k = fused.Operand(dev(problem.key, problem.dtype), "BNSH", g.kv_seq, g.head_size)
        v = fused.Operand(dev(problem.value, problem.dtype), "BNSH", g.kv_seq, g.v_head_size)
        operand_dtype = problem.dtype
    elif form == "staged":
        assert problem.past_key_BNPH is None, "a past needs the dense form"
        kv_seq = g.kv_seq
        q = fused.Operand(dev(problem.query_BSD), "BSNH", g.q_seq, g.head_size, dev(problem.bias_q))
        k = fused.Operand(dev(problem.key), problem.kv_layout, kv_seq, g.head_size, dev(problem.bias_k))
        v = fused.Operand(dev(problem.value), problem.kv_layout, kv_seq, g.v_head_size, dev(problem.bias_v))
        operand_dtype = "float32"
    elif form == "dense":
        q_BNSH, k_BNTH, v_BNTH = dense_operands(problem)
        q = fused.Operand(dev(q_BNSH, problem.dtype), "BNSH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BNTH, problem.dtype), "BNSH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BNTH, problem.dtype), "BNSH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
    elif form == "offsets":  # what the backend launches for f16/bf16 (dispatch.score_terms): unbiased Q and K
        terms = dispatch.score_terms(problem)
        assert not (terms.query_bias_in_operand or terms.key_bias_in_operand), problem.dtype
        unbiased = replace(problem, bias_q=None, bias_k=None)
        q_BNSH, k_BNTH, _ = dense_operands(unbiased)
        v_BNTH = dense_operands(problem)[2]
        q = fused.Operand(dev(q_BNSH, problem.dtype), "BNSH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BNTH, problem.dtype), "BNSH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BNTH, problem.dtype), "BNSH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
        offsets = host_score_offsets(problem, q_BNSH, k_BNTH)
        offset_args = {name: dev(value) for name, value in offsets.items()}
    else:
        assert form == "dense_BSNH", form
        q_BSNH, k_BTNH, v_BTNH = (x.transpose(0, 2, 1, 3) for x in dense_operands(problem))
        q = fused.Operand(dev(q_BSNH, problem.dtype), "BSNH", g.q_seq, g.head_size)
        k = fused.Operand(dev(k_BTNH, problem.dtype), "BSNH", g.total_seq, g.head_size)
        v = fused.Operand(dev(v_BTNH, problem.dtype), "BSNH", g.total_seq, g.v_head_size)
        operand_dtype = problem.dtype
    mask = None
    if problem.padding_mask is not None:
        staged = np.int32 if problem.padding_mask.kind == "key_lengths" else np.uint8
        mask_device = cupy.asarray(np.ascontiguousarray(problem.padding_mask.data, staged))
        keep.append(mask_device)
        mask = mask_device.data.ptr
    out = cupy.full((g.batch, g.q_seq, g.v_hidden), np.nan, dtype=cupy.float32)  # poison
    if narrow:
        assert problem.dtype != "float32", "out_narrow is for float16 / bfloat16 calls"
        out = cupy.full((g.batch, g.q_seq, g.v_hidden), 0xFFFF, dtype=cupy.uint16)  # NaN in float16 and bfloat16
        offset_args["out_narrow"] = out.data.ptr
    # The uploads (a pageable copy returns before its DMA ends) and the poison ran on CuPy's default stream, which a
    # non-blocking stream does not wait for: done before the kernel reads them. The flash branch lacked this wait;
    # the likely cause of a flash_attention_ws case that failed once under 12 pytest-xdist workers and passed alone.
    attention_bias = dev(problem.attention_bias)
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    operands = dict(q=q, k=k, v=v, operand_dtype=operand_dtype, attention_bias=attention_bias,
                    mask=mask, out_BSD=None if narrow else out.data.ptr, **offset_args)  # fmt: skip
    if tail_sms is not None:
        from mha_ep.engine.cuda.runner import run_steps

        def take_poisoned(name: str, nbytes: int) -> int:
            with stream:
                scratch = cupy.full((nbytes,), 0xFF, cupy.uint8)  # NaN in every float of it
            keep.append(scratch)
            return scratch.data.ptr

        facts = fused.DeviceFacts(fused.device_capability(0), tail_sms)
        steps = fused.fused_steps(problem, take=take_poisoned, facts=facts, tile=tile, **operands)
        assert [step.function.split("<")[0] for step in steps] == ["flash_attention_ws", "combine_tile_splits"]
        run_steps(0, steps, stream)
    elif split:
        from mha_ep.engine.cuda.runner import run_steps

        def take(name: str, nbytes: int) -> int:
            # Poisoned on the launches' own stream: planned after the wait above, a fill on CuPy's default stream
            # could land after the stream's Fill had zeroed split_key_stream's arrival counters (its last block
            # then never combines: NaN rows). Under 12 pytest-xdist workers sharing the GPU, 7 stream cases failed
            # so on an H100 and passed alone.
            with stream:
                scratch = cupy.full((nbytes,), 0xFF, cupy.uint8)  # NaN in every float of it
            keep.append(scratch)
            return scratch.data.ptr

        kernel = SPLIT_KERNELS[0] if split is True else split
        steps = fused.fused_steps(problem, take=take, facts=fused.DeviceFacts.of(0), raw_query=form == "raw",
                                  split_kernel=kernel, **operands)  # fmt: skip
        functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in steps]
        assert functions in SPLIT_STEPS[kernel], functions
        run_steps(0, steps, stream)
    else:
        runner.run_fused(0, problem, stream=stream, tile=tile, **operands)
    stream.synchronize()
    if narrow and problem.dtype == "float16":
        return cupy.asnumpy(out).view(np.float16).astype(np.float32)
    return from_device(cupy, out)  # (uint16: bfloat16 bits)


SPLIT_STEPS = {  # the steps of each split kernel: the stream's Fill zeroes its arrival counters (none: one split)
    "stream": (["Fill", "split_key_stream"], ["split_key_stream"]),
    "pair": (["split_key_attention", "combine_key_splits"],),
}


def host_score_offsets(problem: MhaProblem, q_BNSH: np.ndarray, k_BNTH: np.ndarray) -> dict:
    """run_fused's key_offset / query_offset as the layout movers compute them (float32), on the host."""
    n, scale = problem.geometry.num_heads, np.float32(problem.scale)
    terms = dispatch.score_terms(problem)
    out = {}
    if terms.key_offset:
        b_q = np.zeros(problem.geometry.head_size * n, np.float32) if problem.bias_q is None else problem.bias_q
        out["key_offset"] = scale * np.einsum("bnjd,nd->bnj", k_BNTH, b_q.reshape(n, -1)).astype(np.float32)
    if terms.query_offset:
        b_q = 0.0 if problem.bias_q is None else problem.bias_q.reshape(n, 1, -1)
        b_k = problem.bias_k.reshape(n, -1)
        out["query_offset"] = scale * np.einsum("bnid,nd->bni", q_BNSH + b_q, b_k).astype(np.float32)
    return out


def assert_matches_reference(problem: MhaProblem, got: np.ndarray) -> None:
    g = problem.geometry
    assert got.shape == (g.batch, g.q_seq, g.v_hidden)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} unwritten/NaN output elements"
    if problem.dtype in RELATIVE_TOLERANCE:
        want = run_reference(problem).output_BSDv
        tolerance = RELATIVE_TOLERANCE[problem.dtype]
        excess = np.abs(got - want) / np.maximum(1.0, np.abs(want))
        assert excess.max() <= tolerance, f"max relative error {excess.max():.3g} > {tolerance}"
        return
    oracle = run_reference(problem, np.float64).output_BSDv
    err_fused = float(np.abs(got - oracle).max())
    err_naive = float(np.abs(naive_low_precision(problem)[0] - oracle).max())
    assert err_fused <= 2 * err_naive + BF16_NOISE_FLOOR, (
        f"bf16 error vs float64 oracle {err_fused:.3g} > 2 x naive bf16 error {err_naive:.3g} + {BF16_NOISE_FLOOR}"
    )


# -------------------------------------------------------------------------------------------------- cases
CASES = {
    "S1_T203_H64_lengths": Case(b=2, s=1, l=203, n=3, h=64, mask="lengths"),
    "S113_T203_H40_keysBT_bias_BN": Case(b=2, s=113, l=203, n=2, h=40, mask="BT", attention_bias=(True, True)),
    "S113_T1_H80": Case(b=2, s=113, l=1, n=2, h=80),
    "S1023_T1024_H64_plain": Case(b=1, s=1023, l=1024, n=2, h=64),
    "S1023_T1024_H128_causal_past1": Case(b=1, s=1023, l=1023, p=1, n=2, h=128, causal=True, bias=False),
    "S1023_T1024_H96_keysBST_bias_1N": Case(b=1, s=1023, l=1024, n=2, h=96, mask="BST", attention_bias=(False, True)),
    "H80_lengths_3b2_bias_B1": Case(b=3, s=37, l=203, n=2, h=80, mask="lengths_3b2", attention_bias=(True, False)),
    "vhead24_ne_head40_bias_11": Case(b=2, s=17, l=29, n=4, h=40, hv=24, attention_bias=(False, False)),
    "bnsh_cross_keysBT": Case(b=2, s=11, l=203, n=4, h=64, layout="BNSH", mask="BT"),
    "causal_with_past_lengths": Case(b=2, s=9, l=9, p=7, n=2, h=64, causal=True, mask="lengths"),
    "causal_L_ne_S_top_left_last_row_free": Case(b=1, s=200, l=300, n=2, h=64, causal=True),
    "causal_with_attention_bias": Case(b=2, s=150, l=150, n=2, h=64, causal=True, attention_bias=(True, True)),
    "causal_over_padding_scale_attr": Case(b=2, s=130, l=130, n=2, h=32, causal=True, mask="BT",
                                           attrs={"scale": 0.3}),  # fmt: skip
    "minus_inf_filter_partial_padding": Case(b=2, s=70, l=90, n=2, h=32, mask="lengths", mask_filter_value=-np.inf),
    # whole key tiles padded after the kept ones: the tensor-core kernel's underflow skip (mask_filter_value -10000)
    # and the per-tile classification of key lengths and (B, T) flags; -2 keeps padded keys visible in the sum
    "lengths_whole_padded_tiles": Case(b=3, s=65, l=700, n=2, h=64, mask="lengths"),
    "keysBT_prefix_whole_padded_tiles": Case(b=3, s=65, l=700, n=2, h=64, mask="BT_prefix"),
    "keysBT_prefix_small_filter": Case(b=3, s=65, l=700, n=2, h=64, mask="BT_prefix", mask_filter_value=-2.0),
    "H128_bias_T260_vector_copies": Case(b=1, s=130, l=260, n=2, h=128, attention_bias=(True, True)),
    "causal_lowest_filter_fully_padded": Case(b=2, s=200, l=200, n=1, h=64, causal=True, mask="lengths",
                                              full_padding=True, mask_filter_value=float(FLOAT32_LOWEST)),  # fmt: skip
}


FORMS = ("staged", "dense")


TILE_CASES = ("S113_T203_H40_keysBT_bias_BN", "S1023_T1024_H128_causal_past1", "causal_over_padding_scale_attr",
              "causal_L_ne_S_top_left_last_row_free", "vhead24_ne_head40_bias_11")


WGMMA_CASES = [name for name, case in CASES.items() if dispatch.wgmma_head_tile(case.h, case.hv or case.h) is not None]


WS_CASES = {  # no padding mask or attention_bias: flash_attention_ws has no code for them
    "S1023_T1024_H64_plain": CASES["S1023_T1024_H64_plain"],
    # 144 query tiles of 128 rows: more than one per block on a 132-SM GPU (the persistent loop, the Q buffer's
    # release and refill); 8 key tiles, the last one partial (104 keys)
    "S300_T1000_H64_more_tiles_than_sms": Case(b=4, s=300, l=1000, n=12, h=64),
    "S1_T7_H48_one_partial_key_tile": Case(b=2, s=1, l=7, n=3, h=48),
    "S130_T128_H128_hv64_one_full_key_tile": Case(b=2, s=130, l=128, n=2, h=128, hv=64),
    "S200_T300_H128_bnsh_scale_attr": Case(b=1, s=200, l=300, n=2, h=128, layout="BNSH", attrs={"scale": 0.05}),
    # causal (float16 only): frontier tiles, the diagonal masked per key, work-sorted snake order over the blocks
    "causal_S1023_T1024_H64_past1": Case(b=1, s=1023, l=1023, p=1, n=3, h=64, causal=True, bias=False),
    "causal_S700_T700_H64_more_tiles_than_sms": Case(b=4, s=700, l=700, n=12, h=64, causal=True),
    "causal_L_ne_S_last_row_free": Case(b=1, s=200, l=300, n=2, h=64, causal=True),
    "causal_S130_T130_H128_past_presents": Case(b=2, s=130, l=130, p=70, n=2, h=128, causal=True),
    "unidirectional_S1_past8_no_causal_mask": Case(b=2, s=1, l=1, p=8, n=2, h=64, causal=True),
}


# decode steps (S <= dispatch.SPLIT_MAX_ROWS) for the split-key kernels: one split up to about 150 (T = 5000)
SPLIT_CASES = {
    "S1_T1500_H64_whisper_cross_BNSH": Case(b=1, s=1, l=1500, n=6, h=64, layout="BNSH", bias=False),
    "S1_T203_H64_lengths": CASES["S1_T203_H64_lengths"],
    "S1_T5_one_split": Case(b=2, s=1, l=5, n=2, h=64),
    "S4_T700_causal_past_lengths": Case(b=2, s=4, l=4, p=696, n=3, h=64, causal=True, mask="lengths"),
    "S3_T300_H40_hv24_keysBST_bias_BN": Case(b=2, s=3, l=300, n=2, h=40, hv=24, mask="BST",
                                              attention_bias=(True, True)),  # fmt: skip
    "S2_T5000_H128_keysBT_bias_1N": Case(b=1, s=2, l=5000, n=2, h=128, mask="BT", attention_bias=(False, True)),
    "S1_T90_lengths_minus_inf_filter": Case(b=2, s=1, l=90, n=2, h=32, mask="lengths", mask_filter_value=-np.inf),
    "S1_T64_fully_padded_batch0": Case(b=2, s=1, l=64, n=2, h=64, mask="lengths", full_padding=True),
    "S1_past200_causal_scale_attr": Case(b=2, s=1, l=1, p=200, n=3, h=64, bias_scale=1.0, causal=True,
                                         attrs={"scale": 0.3}),  # fmt: skip
    # a decoder's cross attention with a sharp query bias: the raw form keeps q + b_q in float32
    "S1_T700_BNSH_bias_q_lengths": Case(b=2, s=1, l=700, n=3, h=64, layout="BNSH", mask="lengths", bias_scale=1.0,
                                        attrs={"scale": 0.3}),  # fmt: skip
    "S2_T300_H40_BNSH_bias_BN": Case(b=2, s=2, l=300, n=2, h=40, layout="BNSH", attention_bias=(True, True)),
    # split_key_stream blocks that walk many tiles (dispatch.key_stream on a 132-SM GPU): 280 pairs, one split of
    # 1500 keys each (24 tiles of K, then of V, through 4 stages, no arrival counter); 80 pairs, 6 splits of 500
    # (float16: 16 tiles of 32 keys of a head of 128), 3 query rows, (B, T) keep flags and a (B, N) bias; heads of
    # 40 and 24 (tiles of the wider)
    "S1_T1500_H64_one_split_many_tiles": Case(b=4, s=1, l=1500, n=70, h=64, layout="BNSH", bias=False),
    "S3_T3000_H128_keysBT_bias_BN_tiles": Case(b=2, s=3, l=3000, n=40, h=128, mask="BT",
                                               attention_bias=(True, True)),  # fmt: skip
    "S2_T2000_H40_hv24_keysBST_tiles": Case(b=2, s=2, l=2000, n=40, h=40, hv=24, mask="BST"),
}


# float16 / bfloat16 calls with projection biases at a sharp scale and wide heads: rounding the biased Q and K to
# float16 moved outputs by up to 6e-3 against ORT CPU there (issue 14); score_terms' offsets keep them exact.
OFFSET_CASES = {
    "H128_S70_T150_scale0.3": Case(b=2, s=70, l=150, n=2, h=128, bias_scale=1.0, attrs={"scale": 0.3}),
    "H96_S70_T150_scale0.3_mma": Case(b=2, s=70, l=150, n=2, h=96, bias_scale=1.0, attrs={"scale": 0.3}),
    "H64_lengths_padded_tiles": Case(b=3, s=90, l=300, n=2, h=64, bias_scale=1.0, mask="lengths",
                                     attrs={"scale": 0.3}),
    "H128_BT_mask_attention_bias": Case(b=2, s=40, l=200, n=2, h=128, bias_scale=1.0, mask="BT",
                                        attention_bias=(True, False), attrs={"scale": 0.3}),
    "H128_past_S9": Case(b=2, s=9, l=9, p=140, n=2, h=128, bias_scale=1.0, attrs={"scale": 0.3}),
    "H64_past_S1_causal": Case(b=2, s=1, l=1, p=200, n=3, h=64, bias_scale=1.0, causal=True, attrs={"scale": 0.3}),
}  # fmt: skip


# flash_attention_ws's tail split (dispatch.ws_tail) on a pretend device of `sms` SMs (the launch's grid): case,
# tile, SMs, and the split dispatch.ws_tail must choose. Query tiles are walked last query tile of a head first, so
# the tail holds each head's first tile; S <= the tile's rows makes that tile partial.
WS_TAIL_CASES = {
    "three_consumers_S300_T1100_two_tail_tiles": (Case(b=1, s=300, l=1100, n=3, h=64), dispatch.WsTile(consumers=3), 4,
                                                  dispatch.WsTail(4, 2, 2)),
    "three_consumers_partial_tiles_S100_T1500": (Case(b=2, s=100, l=1500, n=3, h=64, bias=False),
                                                 dispatch.WsTile(consumers=3), 4, dispatch.WsTail(4, 2, 2)),
    "two_consumers_H128_hv64_T2100_partial_key_tile": (Case(b=2, s=200, l=2100, n=2, h=128, hv=64),
                                                       dispatch.WsTile(), 7, dispatch.WsTail(7, 1, 4)),
    "two_consumers_bnsh_no_whole_tile_S60_T1300": (Case(b=1, s=60, l=1300, n=2, h=64, layout="BNSH"),
                                                   dispatch.WsTile(), 5, dispatch.WsTail(0, 2, 2)),
}  # fmt: skip


def ws_tiles() -> list:
    return [dispatch.WsTile(), dispatch.WsTile(64), dispatch.WsTile(consumers=3), dispatch.WsTile(64, consumers=3)]


# ------------------------------------------------------------------------------------- dispatch rule (CPU)
def problem_with(h=64, hv=None, n=2, dtype="float16", causal=False, mask_filter_value=None, l=7):  # noqa: E741
    hv = hv or h
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 5, n * h)).astype(np.float32),
              rng.standard_normal((1, l, n * h)).astype(np.float32),
              rng.standard_normal((1, l, n * hv)).astype(np.float32)]  # fmt: skip
    attrs = {"num_heads": n, "unidirectional": int(causal)}
    if mask_filter_value is not None:
        attrs["mask_filter_value"] = mask_filter_value
    return build_problem(attrs, arrays, dtype)


def large_query_problem(s: int, n: int, **case) -> MhaProblem:
    """A head-64 call with ceil(s / 128) * n query tiles of 128 rows (B = 1, 8 keys: small arrays)."""
    return make_problem(Case(b=1, s=s, l=8, n=n, h=64, **case), "float16")


# ------------------------------------------------------------------------------------- source audit (CPU)
def code_only(text: str) -> str:
    return "\n".join(line.split("//")[0] for line in text.splitlines())


CODE = code_only(SOURCE)


def kernel_parameters(operand_type: str, name: str = "") -> str:
    """The parameter list every fused kernel shares (flash_attention_mma / _fp32 / _wgmma / _ws), for explicit
    instantiations: Q, K, V as (pointer, three strides, bias) in ``operand_type``, then masks, the score offsets,
    scalars, the two outputs (float32, and the narrow one the tensor-core kernels may write); flash_attention_ws
    (``name``) adds its three TMA tensor maps and its tail split (full_tiles, tail_splits, tail_O, tail_ML)."""
    operand = [f"const {operand_type}*", "long long", "long long", "long long", f"const {operand_type}*"]
    rest = ["const float*", "int", "int", "int", "const int*", "const unsigned char*", "const float*", "const float*",
            "float", "int", "int", "float"]  # fmt: skip
    maps = []
    if name.startswith("flash_attention_ws<"):
        maps = ["const __grid_constant__ TensorMap"] * 3 + ["long long", "int", "float*", "float2*"]
    return ", ".join(operand * 3 + rest + ["int"] * 7 + ["float*", "void*"] + maps)


WGMMA_DEFAULT_CASES = {  # one call per default tile and feature set the H200 runs
    "head64_plain": Case(h=64),
    "head64_mask": Case(h=64, mask="BT"),
    "head64_bias_mask": Case(h=64, mask="lengths", attention_bias=(True, True)),
    "head128_causal": Case(s=9, l=9, h=128, causal=True),
    "head128_plain": Case(h=128),  # flash_attention_ws
    "head128_bias": Case(h=128, attention_bias=(True, False)),
}
