"""When the fused kernel runs and which one (cuda/dispatch.py, cuda/fused.py), on CPU machines: the rule's reasons,
the choice of mma.sync / wgmma / warp-specialized kernels and tiles per device, shared memory and blocks per SM,
the score terms of biased calls."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from mha_ep.launch import ELEMENT_BYTES
from mha_ep.engine.cuda import dispatch, fused, split_keys
from mha_ep.engine.cuda.steps import Pointer
from mha_ep.engine.problem import MhaProblem

import cuda_cases
from cuda_cases import Case, make_problem
from fused_cases import DTYPES, large_query_problem, problem_with


def test_score_terms_keep_the_biases_out_of_low_precision_operands():
    """float32 adds every bias in the operands (exact); float16 / bfloat16 build Q and K unbiased and take the
    biases' shares as offsets, the key offset for a query bias, the query offset for a key bias."""
    case = Case(b=1, s=3, l=4, n=2, h=8)
    assert dispatch.score_terms(cuda_cases.make_problem(case, "float32")) == dispatch.ScoreTerms()
    for dtype in ("float16", "bfloat16"):
        # no past: the key bias's share is the same for every key of a row (cancelled), no query offsets
        terms = dispatch.score_terms(cuda_cases.make_problem(case, dtype))
        assert terms == dispatch.ScoreTerms(False, False, key_offset=True, query_offset=False) and terms.offsets
        past = dispatch.score_terms(cuda_cases.make_problem(replace(case, p=3), dtype, presents=True))
        assert past == dispatch.ScoreTerms(False, False, key_offset=True, query_offset=True)
        plain = dispatch.score_terms(cuda_cases.make_problem(replace(case, bias=False), dtype))
        assert not plain.offsets
        cross = dispatch.score_terms(cuda_cases.make_problem(replace(case, layout="BNSH", p=3), dtype, presents=True))
        assert cross.key_offset and not cross.query_offset  # ORT ignores a BNSH key's bias


def test_score_terms_identity_holds_with_and_without_a_past(rng):
    """The decomposition score_terms states, in float64 on float16 values: scale * (q + b_q) . (K + [j >= P] b_k)
    = scale * q . K + key offset + [j >= P] query offset, exactly (no term dropped, with a past too)."""
    h, p, length, s = 16, 5, 7, 4
    f16 = lambda *shape: rng.standard_normal(shape).astype(np.float16).astype(np.float64)  # noqa: E731
    q, keys, b_q, b_k, scale = f16(s, h), f16(p + length, h), f16(h), f16(h), 0.3
    new = np.arange(p + length) >= p
    exact = scale * (q + b_q) @ (keys + new[:, None] * b_k).T
    key_offset = scale * keys @ b_q
    query_offset = scale * (q + b_q) @ b_k
    ours = scale * q @ keys.T + key_offset[None, :] + new[None, :] * query_offset[:, None]
    np.testing.assert_allclose(ours, exact, rtol=0, atol=1e-12)


def test_score_offsets_keep_calls_off_the_warp_specialized_kernel():
    problem = cuda_cases.make_problem(Case(b=8, s=2048, l=2048, n=16, h=128), "float16")
    capability = dispatch.HOPPER_CAPABILITY
    assert isinstance(dispatch.choose_tile(problem, "float16", capability), dispatch.WsTile)
    assert dispatch.ws_unsupported_reason(problem, "float16", capability, key_offset=True).startswith(
        "the call's scores take a per-key offset")
    assert isinstance(dispatch.choose_tile(problem, "float16", capability, key_offset=True), dispatch.WgmmaTile)
    assert fused.kernel_name(problem, "float16", dispatch.WgmmaTile(64, 128, False), key_offset=True).endswith(
        ", 4, false>")  # FLASH_WITH_KEY_OFFSET


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [8, 40, 64, 80, 96, 128])
def test_fused_applies_to_supported_calls(dtype, h):
    assert dispatch.fused_unsupported_reason(problem_with(h=h, dtype=dtype)) is None
    assert dispatch.fused_unsupported_reason(problem_with(h=h, dtype=dtype, causal=True)) is None


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(h=59, n=1), "head_size 59 is not a multiple of 8"),
        (dict(h=64, hv=20), "v_head_size 20 is not a multiple of 8"),
        (dict(h=176, n=1), r"head sizes \(H=176, Hv=176\) exceed 160, the largest head tile of the fused kernel"),
        (dict(h=64, hv=168), r"head sizes \(H=64, Hv=168\) exceed 160, the largest head tile of the fused kernel"),
        (dict(causal=True, mask_filter_value=-np.inf),
         r"causal with mask_filter_value = -inf \(ORT's result depends on the exact causal fill values\)"),
    ],
)
def test_fused_not_used_reasons(kwargs, reason):
    got = dispatch.fused_unsupported_reason(problem_with(**kwargs))
    assert got is not None and re.fullmatch(reason, got), got


def test_mask_operands_must_match_the_call():
    plain = problem_with()
    biased = make_problem(Case(attention_bias=(True, True)), "float16")
    padded = make_problem(Case(mask="lengths"), "float16")
    fused.check_mask_operands(plain, None, None)
    fused.check_mask_operands(biased, 256, None)
    fused.check_mask_operands(padded, None, 256)
    with pytest.raises(ValueError, match="a device attention_bias must be given exactly when the call has one"):
        fused.check_mask_operands(plain, 256, None)
    with pytest.raises(ValueError, match="a device attention_bias must be given exactly when the call has one"):
        fused.check_mask_operands(biased, None, None)
    with pytest.raises(ValueError, match="a device mask must be given exactly when the call has a padding mask"):
        fused.check_mask_operands(padded, None, None)
    with pytest.raises(ValueError, match="a device mask must be given exactly when the call has a padding mask"):
        fused.check_mask_operands(plain, None, 256)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [Case(h=64), Case(h=64, attention_bias=(True, False)), Case(h=64, mask="BT"),
                                  Case(h=64, mask="BT", attention_bias=(True, True)), Case(h=32)])  # fmt: skip
def test_head_64_tiles_leave_room_for_three_blocks_per_sm(case, dtype):
    """The measured reason for the one attention_bias buffer (BENCH.md): with two, two blocks fitted an SM."""
    problem = make_problem(case, dtype)
    assert dispatch.default_tile(problem) == dispatch.MmaTile(64, 64)
    shared = fused.shared_bytes(problem)
    assert fused.blocks_per_sm_by_shared_memory(shared) >= dispatch.BLOCKS_PER_SM_GOAL, shared


@pytest.mark.parametrize(
    "kwargs, operand_dtype, capability, reason",
    [
        (dict(h=64), "float16", "90", None),
        (dict(h=40, dtype="bfloat16"), "bfloat16", "90", None),  # zero-padded up to the 64 tile
        (dict(h=128, hv=120), "float16", "90", None),
        (dict(h=64, dtype="float32"), "float32", "90", "dtype 'float32' is not a tensor-core dtype"),
        (dict(h=64), "float32", "90", r"operands are float32 \(rounded to float16 on load: the mma kernel's load path\)"),
        (dict(h=64), "float16", "89", r"compute capability 8.9 is not 9.0 \(wgmma is sm_90a code\)"),
        (dict(h=64), "float16", "100", r"compute capability 10.0 is not 9.0 \(wgmma is sm_90a code\)"),
        (dict(h=32), "float16", "90", r"head sizes \(H=32, Hv=32\) are not in 33-128, the heads its tiles \(64, 128\) take"),
        (dict(h=96), "float16", "90", None),  # zero-padded up to the 128 tile
        (dict(h=80, dtype="bfloat16"), "bfloat16", "90", None),  # SD 1.5's middle level
        (dict(h=160), "float16", "90", r"head sizes \(H=160, Hv=160\) are not in 33-128, the heads its tiles \(64, 128\) take"),
    ],
)
def test_wgmma_kernel_choice(kwargs, operand_dtype, capability, reason):
    problem = problem_with(**kwargs)
    got = dispatch.wgmma_unsupported_reason(problem, operand_dtype, capability)
    assert (got is None) if reason is None else (got is not None and re.fullmatch(reason, got)), got
    tile = dispatch.choose_tile(problem, operand_dtype, capability)
    if reason is None:  # (head tile 128 plain calls take the warp-specialized kernel: test_warp_specialized_choice)
        assert tile == (dispatch.WsTile() if dispatch.wgmma_head_tile(problem.geometry.head_size,
                                                                      problem.geometry.v_head_size) == 128
                        else dispatch.default_wgmma_tile(problem))  # fmt: skip
    else:
        assert tile == dispatch.default_tile(problem)
        assert dispatch.ws_unsupported_reason(problem, operand_dtype, capability) == got


@pytest.mark.parametrize(
    "problem_of, expected",
    [
        (lambda: problem_with(h=128), dispatch.WsTile()),
        (lambda: problem_with(h=120, hv=128), dispatch.WsTile()),
        (lambda: problem_with(h=64), dispatch.WgmmaTile(128)),  # 1 query tile: the wgmma kernel's 64-row blocks
        # three consumers where their rounds x 192 rows x WS3_ROW_COST are under two consumers' rounds x 128:
        (lambda: large_query_problem(4096, 16), dispatch.WsTile(consumers=3)),  # 352 tiles (3 rounds) against 512 (4)
        (lambda: large_query_problem(4096, 12), dispatch.WsTile(consumers=3)),  # 264 tiles (2 rounds) against 384 (3)
        (lambda: large_query_problem(1500, 24), dispatch.WsTile(consumers=3)),  # the Whisper encoder row's 192 tiles
        # else two consumers from WS_HEAD64_TILES_PER_SM x 132 128-row tiles on, the wgmma kernel below that:
        (lambda: large_query_problem(512, 192), dispatch.WsTile()),  # 768 tiles (6 rounds) against 576 x 192 rows (5)
        (lambda: large_query_problem(512, 99), dispatch.WsTile()),  # 396 tiles: 3 per SM
        (lambda: large_query_problem(512, 96), dispatch.WgmmaTile(128)),  # 384 tiles (the 8,512,512,12 anchor's)
        (lambda: large_query_problem(2048, 16), dispatch.WgmmaTile(128)),  # 256 tiles; three: 176 (2 rounds, 384 rows)
        # causal: float16 calls take the warp-specialized kernel by the same rules, bfloat16 ones keep wgmma
        (lambda: make_problem(Case(s=300, l=300, h=128, causal=True), "float16"), dispatch.WsTile()),
        (lambda: make_problem(Case(s=300, l=300, h=128, causal=True), "bfloat16"), dispatch.WgmmaTile(64, 128, False)),
        (lambda: large_query_problem(4096, 16, causal=True), dispatch.WsTile(consumers=3)),
        (lambda: large_query_problem(4096, 12, causal=True, attrs={"scale": 1e26}), dispatch.WgmmaTile(128)),
        (lambda: make_problem(Case(h=128, mask="BT"), "float16"), dispatch.WgmmaTile(64, 128, False)),
        (lambda: large_query_problem(4096, 16, mask="lengths"), dispatch.WgmmaTile(64)),
    ],
)  # fmt: skip
def test_warp_specialized_choice(problem_of, expected):
    """flash_attention_ws takes Hopper calls without mask or attention_bias (causal too for float16) of head tile 128,
    and of head tile 64 with enough query tiles (three consumers where their tiles pay)."""
    problem = problem_of()
    assert dispatch.choose_tile(problem, problem.dtype, dispatch.HOPPER_CAPABILITY) == expected
    assert dispatch.choose_tile(problem, problem.dtype, "89") == dispatch.default_tile(problem)


def test_the_warp_specialized_choice_counts_the_devices_sms():
    """On a 114-SM H100 PCIe the S=T=4096 x 16 heads row takes two consumers: 352 192-row tiles are 4 rounds
    (x 192 x 0.85 = 653 rows) against 512 128-row tiles' 5 (640 rows); 132 SMs make it 3 rounds against 4."""
    problem = large_query_problem(4096, 16)
    assert dispatch.choose_tile(problem, "float16", dispatch.HOPPER_CAPABILITY, 132) == dispatch.WsTile(consumers=3)
    assert dispatch.choose_tile(problem, "float16", dispatch.HOPPER_CAPABILITY, 114) == dispatch.WsTile()
    assert dispatch.persistent_rounds(problem, 192, 114) == 4 and dispatch.persistent_rounds(problem, 128, 114) == 5
    fewer = large_query_problem(256, 180)  # 360 tiles of either size: at least 3 per SM of 114, not of 132
    assert dispatch.choose_tile(fewer, "float16", dispatch.HOPPER_CAPABILITY, 114) == dispatch.WsTile()
    assert dispatch.choose_tile(fewer, "float16", dispatch.HOPPER_CAPABILITY, 132) == dispatch.WgmmaTile(128)


@pytest.mark.parametrize(
    "problem_of, reason",
    [
        (lambda: make_problem(Case(h=64, mask="lengths"), "float16"), "the call has a padding mask"),
        (lambda: make_problem(Case(h=64, attention_bias=(True, True)), "bfloat16"), "the call has an attention_bias"),
        (lambda: make_problem(Case(s=9, l=9, h=128, causal=True), "bfloat16"),
         r"a causal bfloat16 call \(logits may reach float32 lowest; only float16 bounds them\)"),
        (lambda: make_problem(Case(s=9, l=9, h=64, causal=True, attrs={"scale": 1e26}), "float16"),
         r"a causal call whose logits may reach 2.75e\+37 \(scale 1e\+26\): only below 1e\+37 is -inf for "
         r"future keys exact"),
        (lambda: make_problem(Case(h=128, attrs={"scale": -0.5}), "float16"),
         r"scale -0.5 is not positive \(the kernel takes max\(scale \* s\) as scale \* max\(s\)\)"),
        (lambda: problem_with(h=160), r"head sizes \(H=160, Hv=160\) are not in 33-128, the heads its tiles \(64, 128\) take"),
    ],
)  # fmt: skip
def test_warp_specialized_reasons(problem_of, reason):
    problem = problem_of()
    got = dispatch.ws_unsupported_reason(problem, problem.dtype, dispatch.HOPPER_CAPABILITY)
    assert got is not None and re.fullmatch(reason, got), got


@pytest.mark.parametrize(
    "case, tile, reason",
    [
        (Case(h=64), dispatch.WsTile(consumers=3), None),
        (Case(h=40), dispatch.WsTile(64, consumers=3), None),  # head tile 64
        (Case(h=128), dispatch.WsTile(), None),
        (Case(h=128), dispatch.WsTile(consumers=3),
         r"three consumer warpgroups need head tile 64 \(their 160 registers\), this call's is 128"),
        (Case(h=64, hv=120), dispatch.WsTile(consumers=3), r"three consumer warpgroups need head tile 64 .* is 128"),
        (Case(h=64), dispatch.WsTile(consumers=4), "4 consumer warpgroups: flash_attention_ws has two or three"),
        (Case(h=64), dispatch.WsTile(192), "192 keys per step: flash_attention_ws takes 64 or 128"),
    ],
)  # fmt: skip
def test_warp_specialized_tile_reasons(case, tile, reason):
    """Which WsTiles flash_attention_ws has an instantiation for (run_fused raises with the reason)."""
    got = dispatch.ws_tile_unsupported_reason(make_problem(case, "float16"), tile)
    assert (got is None) if reason is None else (got is not None and re.fullmatch(reason, got)), got


def test_warp_specialized_launch_choices():
    plain, wide = problem_with(h=64), make_problem(Case(h=128, hv=64), "bfloat16")
    three = dispatch.WsTile(consumers=3)
    causal = make_problem(Case(s=9, l=9, h=64, causal=True), "float16")
    assert fused.kernel_name(plain, "float16", dispatch.WsTile()) == "flash_attention_ws<__half, 64, 128, 2, false>"
    assert (fused.kernel_name(wide, "bfloat16", dispatch.WsTile(64))
            == "flash_attention_ws<__nv_bfloat16, 128, 64, 2, false>")  # fmt: skip
    assert fused.kernel_name(plain, "float16", three) == "flash_attention_ws<__half, 64, 128, 3, false>"
    assert fused.kernel_name(causal, "float16", three) == "flash_attention_ws<__half, 64, 128, 3, true>"
    # 1 KiB alignment slack, Q (128 or 192 rows), 2 stages x (K, V), 10 mbarriers of 8 bytes
    assert fused.shared_bytes(wide, dispatch.WsTile()) == 1024 + (128 + 2 * 2 * 128) * 128 * 2 + 80
    assert fused.shared_bytes(plain, dispatch.WsTile(64)) == 1024 + (128 + 2 * 2 * 64) * 64 * 2 + 80
    assert fused.shared_bytes(plain, three) == 1024 + (192 + 2 * 2 * 128) * 64 * 2 + 80
    assert fused.shared_bytes(wide, dispatch.WsTile()) <= fused.SHARED_LIMIT
    assert (dispatch.WsTile().threads, dispatch.WsTile().block_m, dispatch.WsTile(64).label) == (384, 128, "ws128x64")
    assert (three.threads, three.block_m, three.label) == (512, 192, "ws192x128")
    assert dispatch.query_tiles(wide, 128) == 2 * 2 and dispatch.query_tiles(wide, 64) == 2 * 2


def test_wgmma_launch_choices():
    plain = problem_with(h=64)
    assert fused.kernel_name(plain, "float16", dispatch.WgmmaTile(128)) == (
        "flash_attention_wgmma<__half, 64, 64, 128, 0, true>"
    )
    padded_biased = make_problem(Case(h=128, mask="BT", attention_bias=(True, True)), "bfloat16")
    assert fused.kernel_name(padded_biased, "bfloat16", dispatch.WgmmaTile(64)) == (
        "flash_attention_wgmma<__nv_bfloat16, 128, 64, 64, 3, true>"
    )
    assert fused.kernel_name(plain, "float16", dispatch.WgmmaTile(64, 128, False)) == (
        "flash_attention_wgmma<__half, 64, 128, 64, 0, false>"
    )
    assert fused.shared_bytes(plain, dispatch.WgmmaTile(64, 128)) == 1024 + (128 + 4 * 64) * 64 * 2
    # Q + 2 K + 2 V unpadded rows, 1 KiB of alignment slack, and the float32 bias tile as the mma kernel's
    assert fused.shared_bytes(plain, dispatch.WgmmaTile(128)) == 1024 + (64 + 4 * 128) * 64 * 2
    assert fused.shared_bytes(padded_biased, dispatch.WgmmaTile(64)) == 1024 + (64 + 4 * 64) * 128 * 2 + 64 * 72 * 4
    assert (dispatch.WgmmaTile().threads, dispatch.WgmmaTile().block_m, dispatch.WgmmaTile(64).label) == (128, 64, "wg64x64")
    assert (dispatch.WgmmaTile(64, 128, False).threads, dispatch.WgmmaTile(64, 128, False).label) == (256, "wg128x64s")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "case, tile, blocks",
    [(Case(h=64), dispatch.WgmmaTile(128), 3), (Case(h=64, mask="BST"), dispatch.WgmmaTile(64), 3),
     (Case(h=64, attention_bias=(True, True)), dispatch.WgmmaTile(64), 3),
     (Case(s=9, l=9, h=128, causal=True), dispatch.WgmmaTile(64, 128, False), 2),
     (Case(h=128, mask="BT", attention_bias=(True, False)), dispatch.WgmmaTile(64, 128, False), 1)],
)  # fmt: skip
def test_wgmma_default_tiles_and_their_blocks_per_sm(case, tile, blocks, dtype):
    """The measured defaults (dispatch.default_wgmma_tile) and the blocks per SM their registers are cut for."""
    problem = make_problem(case, dtype)
    assert dispatch.default_wgmma_tile(problem) == tile
    assert fused.wgmma_min_blocks(problem, tile) == blocks
    assert fused.blocks_per_sm_by_shared_memory(fused.shared_bytes(problem, tile)) >= blocks


def test_operands_in_the_call_dtype_carry_no_projection_bias():
    half, single = problem_with(), problem_with(dtype="float32")
    plain = fused.Operand(256, "BNSH", 5, 64)
    biased = fused.Operand(256, "BSNH", 7, 64, bias=512)
    fused.check_operand_bias(half, "float32", {"q": biased, "k": biased})  # rounded on load: bias added there
    fused.check_operand_bias(single, "float32", {"q": biased})  # the float32 kernel adds it on load
    fused.check_operand_bias(half, "float16", {"q": plain, "k": plain, "v": plain})
    with pytest.raises(ValueError, match=r"operands k, v are float16 and carry a projection bias"):
        fused.check_operand_bias(half, "float16", {"q": plain, "k": biased, "v": biased})


@pytest.mark.parametrize(
    "case, dtype, staged",
    [(Case(), "float32", True), (Case(layout="BNSH", mask="BT", attention_bias=(True, True)), "float32", True),
     (Case(p=3), "float32", False), (Case(presents=True), "float32", False), (Case(), "float16", False),
     (Case(), "bfloat16", False)],
)  # fmt: skip
def test_float32_calls_without_past_read_the_staged_inputs(case, dtype, staged):
    """The backend skips the layout movers exactly there (a past needs concatenating, a present writing, and the
    tensor-core kernels read operands in the call's dtype)."""
    problem = cuda_cases.make_problem(case, dtype)
    assert dispatch.reads_staged_inputs(problem) == staged


def test_fp32_pipeline_takes_the_most_blocks_then_two_stages():
    """The (stages, blocks) pairs measured fastest on the H200 at each head tile (fp32_pipeline's docstring)."""
    chosen = {hd: fused.fp32_pipeline(hd) for hd in dispatch.HEAD_DIM_TILES}
    assert chosen == {32: fused.Fp32Pipeline(1, 4), 64: fused.Fp32Pipeline(1, 3), 96: fused.Fp32Pipeline(1, 2),
                      128: fused.Fp32Pipeline(2, 1), 160: fused.Fp32Pipeline(2, 1)}  # fmt: skip
    for hd, pipeline in chosen.items():  # the blocks the kernel's registers are cut for do fit the shared memory
        shared = fused.fp32_shared_bytes(hd, pipeline.stages)
        assert shared <= fused.SHARED_LIMIT
        assert fused.blocks_per_sm_by_shared_memory(shared) >= pipeline.blocks
    assert fused.FP32_THREADS == 128


def test_minus_inf_filter_without_causal_stays_fused():
    assert dispatch.fused_unsupported_reason(problem_with(mask_filter_value=-np.inf)) is None


def test_launch_choices():
    small, large = problem_with(h=40), make_problem(Case(s=300, l=10, h=96), "bfloat16")
    assert fused.kernel_name(small, "float16") == "flash_attention_mma<__half, __half, 64, 64, 64, 0>"
    assert fused.kernel_name(large, "float32") == "flash_attention_mma<__nv_bfloat16, float, 96, 64, 64, 0>"
    wide = dispatch.MmaTile(128, 128)
    assert fused.kernel_name(large, "float32", wide) == "flash_attention_mma<__nv_bfloat16, float, 96, 128, 128, 0>"
    assert (wide.threads, dispatch.DEFAULT_MMA_TILE.threads) == (256, 128)
    assert fused.shared_bytes(large, wide) == (128 + 4 * 128) * (96 + 8) * 2
    assert fused.kernel_name(problem_with(h=128, dtype="float32"), "float32") == (
        "flash_attention_fp32<float, float, 128, 4, 8, 2, 1>"
    )
    assert fused.kernel_name(problem_with(h=128), "float16") == "flash_attention_mma<__half, __half, 128, 128, 128, 0>"
    assert fused.kernel_name(problem_with(h=120), "float16") == "flash_attention_mma<__half, __half, 128, 128, 128, 0>"
    assert fused.shared_bytes(large) == (64 + 4 * 64) * (96 + 8) * 2
    # an attention_bias adds a float32 tile; head 128 then takes the 64 x 64 tile (128 x 128 would not fit)
    biased = make_problem(Case(s=300, l=10, h=128, attention_bias=(True, True)), "float16")
    assert dispatch.default_tile(biased) == dispatch.MmaTile(64, 64)
    assert fused.kernel_name(biased, "float16") == "flash_attention_mma<__half, __half, 128, 64, 64, 2>"
    padded = make_problem(Case(s=300, l=10, h=64, mask="BT"), "bfloat16")
    assert fused.kernel_name(padded, "bfloat16") == "flash_attention_mma<__nv_bfloat16, __nv_bfloat16, 64, 64, 64, 1>"
    assert fused.shared_bytes(biased) == (64 + 4 * 64) * (128 + 8) * 2 + 1 * 64 * (64 + 8) * 4
    assert fused.shared_bytes(biased, wide) > fused.SHARED_LIMIT
    # float32: Q + K and V (single buffered for head 64 and 96, double for 128: fp32_pipeline) + P transposed
    assert fused.shared_bytes(problem_with(h=64, dtype="float32")) == 4 * (64 * 68 + (64 * 68 + 64 * 64) + 64 * 68)
    assert fused.shared_bytes(problem_with(h=96, dtype="float32")) == 4 * (64 * 100 + (64 * 100 + 64 * 96) + 64 * 68)
    assert fused.shared_bytes(problem_with(h=128, dtype="float32")) == 4 * (
        64 * 132 + 2 * (64 * 132 + 64 * 128) + 64 * 68
    )
    assert all(fused.shared_bytes(problem_with(h=h, dtype="float32")) <= fused.SHARED_LIMIT // 2 for h in (32, 64))
    assert fused.Operand(0, "BSNH", 7, 40).strides(3) == (7 * 3 * 40, 40, 3 * 40)
    assert fused.Operand(0, "BNSH", 7, 40).strides(3) == (3 * 7 * 40, 7 * 40, 40)


# ------------------------------------------------------------------------------------ split keys (decode steps)
@pytest.mark.parametrize(
    "case, sms, in_bytes, split",
    [
        # Whisper tiny's cross attention, B=1: 6 (b, h) pairs, 8 x 132 blocks wanted, at least 32 keys a block
        (Case(b=1, s=1, l=1500, n=6, h=64, layout="BNSH"), 132, 4, dispatch.KeySplit(47, 32)),
        # Whisper small's, B=8, float16 operands: 96 pairs want 11 splits each
        (Case(b=8, s=1, l=1500, n=12, h=64, layout="BNSH"), 132, 2, dispatch.KeySplit(11, 137)),
        # ... float32 ones: 137 keys of K and V would not fit SPLIT_SHARED_BYTES, 92 would, so 17 splits
        (Case(b=8, s=1, l=1500, n=12, h=64, layout="BNSH"), 132, 4, dispatch.KeySplit(17, 89)),
        # a GPU already full of pairs: splits only to keep a block's K, V and logits in shared memory
        (Case(b=528, s=4, l=4000, n=1, h=8, bias=False), 132, 4, dispatch.KeySplit(7, 572)),
        (Case(b=528, s=4, l=4000, n=1, h=8, bias=False), 132, 2, dispatch.KeySplit(4, 1000)),  # SPLIT_MAX_CHUNK
        (Case(b=2, s=1, l=5, n=2, h=64), 132, 4, dispatch.KeySplit(1, 5)),  # a short row: one split
        (Case(b=1, s=1, l=300, n=6, h=64), 8, 2, dispatch.KeySplit(10, 30)),  # a small GPU wants fewer blocks
        (Case(b=1, s=5, l=1500, n=6, h=64), 132, 4, None),  # 5 query rows: the flash kernels
    ],
)
def test_key_split_cuts_a_decode_steps_keys_across_the_gpu(case, sms, in_bytes, split):
    problem = make_problem(case, "float32")
    got = dispatch.key_split(problem, sms, in_bytes)
    assert got == split
    if got is not None:  # every key in exactly one split, none empty, the block's shared memory within budget
        t = problem.geometry.total_seq
        assert (got.splits - 1) * got.chunk < t <= got.splits * got.chunk
        assert got.chunk <= dispatch.SPLIT_MAX_CHUNK
        assert dispatch.split_shared_bytes(problem.geometry, got.chunk, in_bytes) <= dispatch.SPLIT_SHARED_BYTES


def test_split_key_shared_memory_fits_the_default_limit_at_the_extremes():
    """The widest block (4 query rows, H = Hv = 128, float32 operands) still takes SPLIT_MIN_CHUNK keys, and no
    block needs its shared-memory limit raised."""
    assert dispatch.SPLIT_SHARED_BYTES <= fused.DEFAULT_SHARED_LIMIT
    widest = make_problem(Case(b=1, s=dispatch.SPLIT_MAX_ROWS, l=9000, n=1, h=128), "float32")
    split = dispatch.key_split(widest, 1)
    assert split.chunk == 37 >= dispatch.SPLIT_MIN_CHUNK  # 244 splits of the 37 keys that fit
    assert split_keys.split_shared_bytes(widest, split.chunk, "float32") <= fused.DEFAULT_SHARED_LIMIT
    assert split_keys.split_shared_bytes(widest, split.chunk + 1, "float32") > dispatch.SPLIT_SHARED_BYTES


@pytest.mark.parametrize(
    "pairs, cut",
    [  # Whisper's cross attention, float16, S = 1, T = 1500, H = 64 on 132 SMs: 528 blocks aimed for, one round
        (20, dispatch.KeyStream(26, 58, 58, 2)),  # large-v3-turbo, B = 1: one tile of K and one of V a block
        (96, dispatch.KeyStream(5, 300, 64, 4)),  # small, B = 8: 5 tiles of K, then 5 of V, through 4 stages
        (100, dispatch.KeyStream(5, 300, 64, 4)),  # 5 beams
        (160, dispatch.KeyStream(3, 500, 64, 4)),  # B = 8, 20 heads
        (480, dispatch.KeyStream(1, 1500, 64, 4)),  # 5 beams x B = 8, 12 heads: one block a pair, no combine wait
        (6, dispatch.KeyStream(47, 32, 32, 2)),  # tiny, B = 1: SPLIT_MIN_CHUNK keys a block
        (600, dispatch.KeyStream(1, 1500, 64, 4)),  # more pairs than blocks aimed for: still one split
    ],
)
def test_key_stream_fills_one_round_of_blocks_at_whispers_shapes(pairs, cut):
    problem = make_problem(Case(b=pairs // 2, s=1, l=1500, n=2, h=64, layout="BNSH", bias=False), "float16")
    got = dispatch.key_stream(problem, 132, 2)
    assert got == cut
    assert (got.splits - 1) * got.span < 1500 <= got.splits * got.span  # every key in one span, none empty
    assert pairs * got.splits <= dispatch.STREAM_BLOCKS_PER_SM * 132 or got.splits == 1
    assert dispatch.stream_shared_bytes(problem.geometry, got, 2) <= fused.DEFAULT_SHARED_LIMIT


def test_key_stream_takes_exactly_the_calls_key_split_takes_and_holds_a_spans_logits():
    """The two kernels are one dispatch decision (key_split None: the flash kernels); a stream block's span is at
    most STREAM_MAX_LOGITS / S keys, and its shared memory is what the kernel carves."""
    for case, sms, in_bytes in [(Case(b=1, s=5, l=1500, n=6, h=64), 132, 2), (Case(b=1, s=1, l=9, n=1, h=136), 132, 2),
                                (Case(b=1, s=4, l=9000, n=1, h=128), 1, 4), (Case(b=2, s=1, l=5, n=2, h=64), 132, 4),
                                (Case(b=528, s=4, l=4000, n=1, h=8, bias=False), 132, 2),
                                (Case(b=2, s=3, l=300, n=2, h=40, hv=24), 8, 2)]:  # fmt: skip
        problem = make_problem(case, "float32")
        g = problem.geometry
        cut = dispatch.key_stream(problem, sms, in_bytes)
        assert (cut is None) == (dispatch.key_split(problem, sms, in_bytes) is None), case
        if cut is None:
            continue
        assert cut.span * g.q_seq <= max(dispatch.STREAM_MAX_LOGITS, dispatch.SPLIT_MIN_CHUNK * g.q_seq)
        assert (cut.splits - 1) * cut.span < g.total_seq <= cut.splits * cut.span
        assert 1 <= cut.tile <= cut.span and 1 <= cut.stages <= dispatch.STREAM_STAGES
        assert cut.stages == min(dispatch.STREAM_STAGES, 2 * -(-cut.span // cut.tile))  # the stages a block uses
    widest = make_problem(Case(b=1, s=dispatch.SPLIT_MAX_ROWS, l=9000, n=1, h=128), "float32")
    cut = dispatch.key_stream(widest, 1, 4)
    assert cut == dispatch.KeyStream(9, 1000, 16, 4)
    floats = 4 * (128 + 1000 + dispatch.SPLIT_WARPS * 128) + 9 + 2  # q, logits, P.V shares, weights, total, verdict
    assert split_keys.stream_shared_bytes(widest, cut, "float32") == 4 * (floats + 1) + 4 * 16 * 128 * 4
    assert split_keys.stream_shared_bytes(widest, cut, "float32") <= fused.SHARED_LIMIT


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_steps_stream_a_decode_steps_keys_in_one_launch(dtype):
    """S <= SPLIT_MAX_ROWS, the default split kernel: a Fill zeroing the pairs' arrival counters, then one
    split_key_stream over (pairs, splits) blocks with the flash arguments passed on (its last blocks write the
    output: out_BSD, or out_narrow for float16 / bfloat16), three scratch buffers (partial outputs, max and sum,
    the counters). One split: no counters, no Fill."""
    facts = fused.DeviceFacts("90", 132)
    taken = {}

    def take(name, nbytes):
        taken[name] = nbytes
        return 4096 * (len(taken) + 100)

    problem = make_problem(Case(b=2, s=1, l=300, n=3, h=64, hv=32, mask="lengths"), dtype)
    g = problem.geometry
    pairs = g.batch * g.num_heads
    operands = dict(
        q=fused.Operand(1 << 20, "BNSH", g.q_seq, 64), k=fused.Operand(2 << 20, "BNSH", g.total_seq, 64),
        v=fused.Operand(3 << 20, "BNSH", g.total_seq, 32), operand_dtype=dtype, attention_bias=None,
        mask=4 << 20, out_BSD=5 << 20,
    )  # fmt: skip
    fill, attention = fused.fused_steps(problem, take=take, facts=facts, **operands)
    cut = dispatch.key_stream(problem, facts.sms, ELEMENT_BYTES[dtype])
    assert cut.splits > 1 and attention.function.startswith("split_key_stream<")
    assert attention.grid == (pairs, cut.splits, 1) and attention.block == (split_keys.SPLIT_THREADS, 1, 1)
    flash_args = fused.fused_step(problem, facts=facts, **operands).args
    assert attention.args[: len(flash_args)] == flash_args  # out_BSD, no out_narrow
    assert attention.shared == split_keys.stream_shared_bytes(problem, cut, dtype)
    rows = pairs * cut.splits * g.q_seq
    assert taken == {"split_O": 4 * rows * g.v_head_size, "split_ML": 8 * rows, "split_arrivals": 4 * pairs}
    counters = 4096 * (3 + 100)
    assert (fill.dst, fill.byte, fill.nbytes) == (counters, 0, 4 * pairs)
    assert attention.args[len(flash_args):] == (np.int32(cut.span), np.int32(cut.tile), Pointer(4096 * 101),
                                                Pointer(4096 * 102), Pointer(counters), np.int32(1), Pointer(None))
    if dtype != "float32":  # the node's own output instead: the last blocks store the call's dtype there
        (_, narrow) = fused.fused_steps(problem, take=take, facts=facts, **{**operands, "out_BSD": None},
                                        out_narrow=6 << 20)  # fmt: skip
        assert narrow.args[len(flash_args) - 2: len(flash_args)] == (Pointer(None), Pointer(6 << 20))
    else:
        with pytest.raises(ValueError, match="out_narrow is for float16 / bfloat16 calls"):
            fused.fused_steps(problem, take=take, facts=facts, **operands, out_narrow=6 << 20)
    many = make_problem(Case(b=40, s=1, l=300, n=15, h=64, mask="lengths"), dtype)  # 600 pairs: one split each
    taken.clear()
    steps = fused.fused_steps(many, take=take, facts=facts, **{**operands, "k": fused.Operand(2 << 20, "BNSH", 300, 64),
                                                              "v": fused.Operand(3 << 20, "BNSH", 300, 64)})  # fmt: skip
    assert [step.function.split("<")[0] for step in steps] == ["split_key_stream"]
    assert steps[0].grid == (600, 1, 1) and steps[0].args[-3] == Pointer(None) and "split_arrivals" not in taken


def test_the_split_kernel_is_chosen_by_argument_or_environment(monkeypatch):
    """fused_steps' split_kernel, else MHA_EP_SPLIT_KERNEL ("pair": the earlier two launches, for A/B timing of a
    whole model), else "stream"; anything else is refused."""
    facts = fused.DeviceFacts("90", 132)
    problem = make_problem(Case(b=2, s=1, l=300, n=3, h=64), "float16")
    g = problem.geometry
    operands = dict(q=fused.Operand(1 << 20, "BNSH", 1, 64), k=fused.Operand(2 << 20, "BNSH", g.total_seq, 64),
                    v=fused.Operand(3 << 20, "BNSH", g.total_seq, 64), operand_dtype="float16", attention_bias=None,
                    mask=None, out_BSD=None, out_narrow=5 << 20)  # fmt: skip

    def kernels(**chosen):
        steps = fused.fused_steps(problem, take=lambda name, nbytes: 1 << 24, facts=facts, **chosen, **operands)
        return [getattr(step, "function", type(step).__name__).split("<")[0] for step in steps]

    monkeypatch.delenv(split_keys.SPLIT_KERNEL_ENV, raising=False)
    assert kernels() == ["Fill", "split_key_stream"]
    assert kernels(split_kernel="pair") == ["split_key_attention", "combine_key_splits"]
    monkeypatch.setenv(split_keys.SPLIT_KERNEL_ENV, "pair")
    assert kernels() == ["split_key_attention", "combine_key_splits"]
    assert kernels(split_kernel="stream") == ["Fill", "split_key_stream"]
    monkeypatch.setenv(split_keys.SPLIT_KERNEL_ENV, "both")
    with pytest.raises(ValueError, match="MHA_EP_SPLIT_KERNEL='both'"):
        kernels()
    with pytest.raises(ValueError, match="split_kernel 'fast' is not one of"):
        kernels(split_kernel="fast")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_steps_launch_the_split_pair_for_decode_steps_and_flash_otherwise(dtype):
    """split_kernel "pair", S <= SPLIT_MAX_ROWS: split_key_attention over (pairs, splits) blocks then
    combine_key_splits, the flash arguments passed on, two scratch buffers (partial outputs, max and sum); S = 5:
    one flash launch."""
    facts = fused.DeviceFacts("90", 132)
    taken = {}

    def take(name, nbytes):
        taken[name] = nbytes
        return 4096 * (len(taken) + 100)

    for s, expected in ((1, ["split_key_attention", "combine_key_splits"]), (5, None)):
        problem = make_problem(Case(b=2, s=s, l=300, n=3, h=64, hv=32, mask="lengths"), dtype)
        g = problem.geometry
        operands = dict(
            q=fused.Operand(1 << 20, "BNSH", g.q_seq, 64), k=fused.Operand(2 << 20, "BNSH", g.total_seq, 64),
            v=fused.Operand(3 << 20, "BNSH", g.total_seq, 32), operand_dtype=dtype, attention_bias=None,
            mask=4 << 20, out_BSD=5 << 20,
        )  # fmt: skip
        steps = fused.fused_steps(problem, take=take, facts=facts, split_kernel="pair", **operands)
        if expected is None:
            assert len(steps) == 1 and steps[0].function.startswith("flash_attention_")
            continue
        split = dispatch.key_split(problem, facts.sms, ELEMENT_BYTES[dtype])
        assert [step.function.split("<")[0] for step in steps] == expected
        attention, combine = steps
        assert attention.grid == (g.batch * g.num_heads, split.splits, 1)
        assert attention.args[: len(fused.fused_step(problem, facts=facts, **operands).args)] == \
            fused.fused_step(problem, facts=facts, **operands).args  # fmt: skip
        assert attention.shared == split_keys.split_shared_bytes(problem, split.chunk, dtype)
        assert combine.grid == (g.batch * g.num_heads * g.q_seq, 1, 1)
        assert combine.args[-2:] == (Pointer(5 << 20), Pointer(None))  # float32 out_BSD, no out_narrow
        rows = g.batch * g.num_heads * split.splits * g.q_seq
        assert taken == {"split_O": 4 * rows * g.v_head_size, "split_ML": 8 * rows}
        if dtype != "float32":  # the node's own output instead: combine_key_splits stores the call's dtype there
            narrow = fused.fused_steps(problem, take=take, facts=facts, split_kernel="pair",
                                       **{**operands, "out_BSD": None}, out_narrow=6 << 20)  # fmt: skip
            assert narrow[1].args[-2:] == (Pointer(None), Pointer(6 << 20))
            assert narrow[0].args[:-7] == attention.args[:-7]  # the same attention launch up to its outputs
        else:
            with pytest.raises(ValueError, match="out_narrow is for float16 / bfloat16 calls"):
                fused.fused_steps(problem, take=take, facts=facts, split_kernel="pair", **operands,
                                  out_narrow=6 << 20)  # fmt: skip


def test_a_float16_call_that_writes_qk_keeps_the_row_constant_bias_term():
    """Without a past, scale * (q_i + b_q) . b_k is the same for every key of a row and the softmax cancels it, so
    score_terms leaves it out; qk is the scores before any softmax, so a call that writes qk keeps it (the GPU
    suite's float16 B1 S1 L1 H1 case, whose single-key softmax hid the missing term from the output, found it)."""
    from dataclasses import replace

    problem = replace(problem_with(h=8, dtype="float16"), bias_q=np.ones(8, np.float32),
                      bias_k=np.ones(8, np.float32), bias_v=np.ones(8, np.float32))  # fmt: skip
    assert not dispatch.score_terms(problem).query_offset
    assert dispatch.score_terms(replace(problem, want_qk=True)).query_offset


# ---------------------------------------------------------------------------------- flash_attention_ws's tail
def shaped(b: int, s: int, t: int, n: int, h: int, causal: bool = False) -> MhaProblem:
    """A float16 problem of this geometry whose arrays are a small call's (the tail rules read the geometry only)."""
    small = make_problem(Case(b=1, s=3, l=5, n=1, h=h, bias=False, causal=causal), "float16")
    return replace(small, geometry=replace(small.geometry, batch=b, q_seq=s, kv_seq=t, num_heads=n))


@pytest.mark.parametrize(
    "shape, tile, sms, expected",
    [
        # SDXL's 4096-token self attention (B 2, N 10): 440 tiles of 192 rows, 3 rounds + 44 tiles in 3 key ranges
        ((2, 4096, 4096, 10, 64), dispatch.WsTile(consumers=3), 132, dispatch.WsTail(396, 44, 3)),
        # SD 1.5's (N 8): 88 tail tiles x 3 = 264 units, 2 a SM: two thirds of a round, where whole tiles take one
        ((2, 4096, 4096, 8, 64), dispatch.WsTile(consumers=3), 132, dispatch.WsTail(264, 88, 3)),
        # SD3.5-M's joint attention: 48 tail tiles of 35 key tiles; 5 splits (2 units a SM of 8 key tiles) end
        # first once each unit pays its pipeline's first and last steps (8 splits: 3 units of 5)
        ((2, 4352, 4352, 24, 64), dispatch.WsTile(consumers=3), 132, dispatch.WsTail(1056, 48, 5)),
        # Flux's (H 128, two consumers): 12 tail tiles of 36 key tiles, 9 splits of 4 key tiles: 108 units
        ((2, 4608, 4608, 24, 128), dispatch.WsTile(), 132, dispatch.WsTail(1716, 12, 9)),
        # fewer tiles than SMs: all of them split; 4 ranges of 4 key tiles, 3 units an SM, end before 2 of 8
        ((1, 300, 2048, 2, 64), dispatch.WsTile(), 8, dispatch.WsTail(0, 6, 4)),
        ((1, 4096, 4096, 16, 128), dispatch.WsTile(), 128, None),  # 512 tiles: whole rounds
        ((4, 2048, 2048, 16, 128), dispatch.WsTile(), 132, None),  # 1024 tiles: 8 rounds (124 in the last): no gain
        ((2, 4096, 896, 10, 64), dispatch.WsTile(consumers=3), 132, None),  # 7 key tiles: under 2 x 4 a split
        ((2, 4096, 4096, 10, 64), dispatch.WsTile(consumers=3), 440, None),  # one round on 440 SMs
    ],
)  # fmt: skip
def test_the_tail_split_rule(shape, tile, sms, expected):
    """dispatch.ws_tail: the tiles past the last full round are cut into the key ranges whose units end first, when
    they end before a whole tile would."""
    problem = shaped(*shape)
    tail = dispatch.ws_tail(problem, tile, sms)
    assert tail == expected
    if tail is not None:
        tiles = dispatch.query_tiles(problem, tile.block_m)
        assert tail.full_tiles % sms == 0 and tail.full_tiles + tail.tail_tiles == tiles
        assert tail.units == tail.full_tiles + tail.slots and 2 <= tail.splits <= dispatch.WS_TAIL_MAX_SPLITS
        key_tiles = -(-problem.geometry.total_seq // tile.block_n)
        assert key_tiles // tail.splits >= dispatch.WS_TAIL_MIN_KEY_TILES
        assert dispatch.ws_rounds(problem, tile, sms) < dispatch.persistent_rounds(problem, tile.block_m, sms)


def test_no_tail_split_for_causal_calls_or_when_switched_off(monkeypatch):
    problem = shaped(2, 4096, 4096, 10, 64)
    assert dispatch.ws_tail(problem, dispatch.WsTile(consumers=3)) is not None
    assert dispatch.ws_tail(shaped(2, 4096, 4096, 10, 64, causal=True), dispatch.WsTile(consumers=3)) is None
    monkeypatch.setenv(dispatch.WS_TAIL_ENV, "off")
    assert dispatch.ws_tail(problem, dispatch.WsTile(consumers=3)) is None
    monkeypatch.setenv(dispatch.WS_TAIL_ENV, "halves")
    with pytest.raises(ValueError, match=r"MHA_EP_WS_TAIL='halves': expected one of \('split', 'off'\)"):
        dispatch.ws_tail(problem, dispatch.WsTile(consumers=3))


def test_the_tail_split_turns_sdxl_s_self_attention_to_three_consumers():
    """SDXL's 4096-token self attention: whole tiles gave three consumers 4 rounds x 192 x 0.85 = 653 rows against
    two consumers' 5 x 128 = 640 (two taken); with the tail split three take 3.35 rounds (546 rows)."""
    problem = shaped(2, 4096, 4096, 10, 64)
    assert not dispatch.prefers_three_consumers(problem, tail_split=False)
    assert dispatch.prefers_three_consumers(problem)
    assert dispatch.choose_tile(problem, "float16", dispatch.HOPPER_CAPABILITY) == dispatch.WsTile(consumers=3)


def test_fused_steps_plan_the_tail_split_and_its_combine():
    """fused_steps on a call ws_tail cuts: the flash_attention_ws launch over min(units, SMs) blocks with its tail
    arguments and two scratch buffers sized for the slots, then combine_tile_splits writing the node's output;
    fused_step alone keeps the whole-tile walk (every tile full, one split, no slots)."""
    problem = make_problem(Case(b=1, s=300, l=1100, n=3, h=64, hv=32, bias=False), "float16")
    tile, facts = dispatch.WsTile(consumers=3), fused.DeviceFacts(dispatch.HOPPER_CAPABILITY, 4)
    g = problem.geometry
    operands = dict(
        q=fused.Operand(1 << 20, "BNSH", g.q_seq, 64), k=fused.Operand(2 << 20, "BNSH", g.total_seq, 64),
        v=fused.Operand(3 << 20, "BNSH", g.total_seq, 32), operand_dtype="float16", attention_bias=None, mask=None,
        out_BSD=None, out_narrow=5 << 20,
    )  # fmt: skip
    taken = {}

    def take(name, nbytes):
        taken[name] = nbytes
        return (7 + len(taken)) << 20

    whole = fused.fused_step(problem, facts=facts, tile=tile, **operands)
    assert whole.grid == (4, 1, 1) and whole.args[-4:] == (6, 1, Pointer(None), Pointer(None))
    launch, combine = fused.fused_steps(problem, take=take, facts=facts, tile=tile, **operands)
    tail = dispatch.ws_tail(problem, tile, facts.sms)
    assert tail == dispatch.WsTail(4, 2, 2) and taken == {"tail_O": 4 * 4 * 192 * 32, "tail_ML": 8 * 4 * 192}
    assert launch.function == whole.function and launch.grid == (4, 1, 1) and launch.args[:-4] == whole.args[:-4]
    assert launch.args[-4:] == (4, 2, Pointer(8 << 20), Pointer(9 << 20))
    assert combine.function == "combine_tile_splits<__half>"
    assert combine.block == (split_keys.TILE_COMBINE_WARPS * 32, 1, 1)
    assert combine.grid == (2 * 192 // split_keys.TILE_COMBINE_WARPS, 1, 1)
    assert combine.args == (Pointer(8 << 20), Pointer(9 << 20), 4, 2, 2, 192, 2, 3, 300, 32,
                            Pointer(None), Pointer(5 << 20))  # fmt: skip
