"""The cuda backend against the reference semantics, on a GPU (every test here is marked gpu).

Skipped cleanly where CuPy or a GPU is missing; the module itself imports on a CPU machine. Problems are built
with ``build_problem`` from fresh random inputs (never zeros), rounded to the call's dtype. Tolerances:
  float32   vs the reference backend: |cuda - ref| <= 1e-5 * max(1, |ref|)
  float16   vs the reference backend: |cuda - ref| <= 4e-3 * max(1, |ref|)
  bfloat16  vs the float64 oracle:    err(cuda) <= 2 * err(naive bf16 pipeline) + 1e-4
Every backend here poisons its device buffers with NaN before each run, so an element a kernel never writes shows.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import numpy as np
import pytest

from mha_ep.engine.reference import ReferenceBackend, run_reference, to_BNSH
from mha_ep.engine.problem import MhaProblem, build_problem

from cuda_cases import Case, make_problem, naive_low_precision, round_to_dtype

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "float16", "bfloat16")
RELATIVE_TOLERANCE = {"float32": 1e-5, "float16": 4e-3}
BF16_NOISE_FLOOR = 1e-4


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=["fused", "three-phase"])
def backend(cupy_module, request):
    from mha_ep.engine.cuda import CudaBackend

    return CudaBackend(0, poison_device_buffers=True, fused_path=request.param == "fused")


# ----------------------------------------------------------------------------------------------- problems
# ----------------------------------------------------------------------------------------------- checking
def result_arrays(result) -> list[np.ndarray]:
    arrays = [result.output_BSDv]
    if result.present_key_BNTH is not None:
        arrays += [result.present_key_BNTH, result.present_value_BNTHv]
    return arrays


def failing_at_last_step(error: BaseException):
    """A stand-in for the backend's run_steps that queues every step of a call but the last one (the fused kernel
    or the three-phase path's context_to_BSD), then raises ``error``."""
    from mha_ep.engine.cuda import runner

    def run(device_id, call_steps, stream):
        runner.run_steps(device_id, call_steps[:-1], stream)
        raise error

    return run


def assert_matches(problem: MhaProblem, result) -> None:
    names = ["output", "present_key", "present_value"]
    got = result_arrays(result)
    assert (result.present_key_BNTH is None) == (not problem.want_present_key)
    assert (result.present_value_BNTHv is None) == (not problem.want_present_value)
    for name, array in zip(names, got):
        assert array.dtype == np.float32, name
        assert np.isfinite(array).all(), f"{name}: {np.count_nonzero(~np.isfinite(array))} unwritten/NaN elements"
    if problem.dtype in RELATIVE_TOLERANCE:
        want = result_arrays(ReferenceBackend().run(problem))
        tolerance = RELATIVE_TOLERANCE[problem.dtype]
        for name, w, c in zip(names, want, got):
            assert c.shape == w.shape, name
            excess = np.abs(c - w) / np.maximum(1.0, np.abs(w))
            assert excess.max() <= tolerance, f"{name}: max relative error {excess.max():.3g} > {tolerance}"
        return
    oracle = result_arrays(run_reference(problem, np.float64))
    naive = naive_low_precision(problem)
    for name, o, c, nv in zip(names, oracle, got, naive):
        assert c.shape == o.shape, name
        err_cuda = float(np.abs(c - o).max())
        err_naive = float(np.abs(nv - o).max())
        assert err_cuda <= 2 * err_naive + BF16_NOISE_FLOOR, (
            f"{name}: bf16 error vs float64 oracle {err_cuda:.3g} > 2 x naive bf16 error {err_naive:.3g} + "
            f"{BF16_NOISE_FLOOR}"
        )


# -------------------------------------------------------------------------------------------------- cases
CASES = {
    "decode_S1_past_presents_lengths": Case(b=2, s=1, l=1, p=31, n=4, h=64, mask="lengths", presents=True),
    "S113_H40_keysBT_bias_BN": Case(b=2, s=113, l=113, n=3, h=40, mask="BT", attention_bias=(True, True)),
    "S1023_H80_causal": Case(b=1, s=1023, l=1023, n=2, h=80, causal=True, bias=False),
    "H96_S_ne_L_keysBST_bias_1N": Case(b=2, s=37, l=53, n=3, h=96, mask="BST", attention_bias=(False, True)),
    "vhead_ne_head_bias_B1": Case(b=2, s=17, l=29, n=4, h=40, hv=24, attention_bias=(True, False)),
    "causal_with_past_presents": Case(b=2, s=9, l=9, p=7, n=2, h=64, causal=True, presents=True, mask="lengths"),
    "bnsh_cross_keysBT_bias_11": Case(b=2, s=11, l=23, n=4, layout="BNSH", mask="BT", attention_bias=(False, False)),
    "past_without_presents": Case(b=1, s=5, l=5, p=3, n=2, h=32, presents=False),
    "bnsh_presents_no_bias": Case(b=1, s=7, l=13, n=2, h=48, layout="BNSH", bias=False, presents=True),
    "empty_past_presents": Case(b=2, s=4, l=6, p=0, n=2, h=16, presents=True),
    "mask_3b_plus_2": Case(b=3, s=6, l=10, n=2, h=32, mask="lengths_3b2"),
    "causal_L_ne_S_top_left_last_row_free": Case(b=1, s=6, l=10, n=2, h=16, causal=True),
    "causal_over_padding_scale_attr": Case(b=2, s=8, l=8, n=2, h=32, causal=True, mask="BT", attrs={"scale": 0.3}),
    "minus_inf_filter_partial_padding": Case(b=2, s=5, l=9, n=2, h=32, mask="lengths", mask_filter_value=-np.inf),
    "long_row_no_row_cache_T9000": Case(b=1, s=3, l=9000, n=1, h=64, mask="BT", attention_bias=(True, True)),
    "T1500_block_row_cache_causal": Case(b=1, s=4, l=1500, n=2, h=64, mask="BST", attention_bias=(True, False),
                                         causal=True),
    "T200_warp_8_cols": Case(b=2, s=3, l=200, n=2, h=40, mask="lengths"),
    "T3000_block_row_cache_past": Case(b=1, s=2, l=2, p=2998, n=2, h=64, mask="lengths", presents=True),
    "T6000_block_row_cache_mask_bias": Case(b=2, s=2, l=6000, n=1, h=32, mask="BT", attention_bias=(True, True)),
    "whisper_decode_T448": Case(b=1, s=1, l=1, p=447, n=6, h=64, presents=True, mask="BT"),
    "H59_odd_head_scalar_path": Case(b=2, s=13, l=19, p=3, n=2, h=59, presents=True, mask="BT"),
    "Hv37_odd_value_head": Case(b=1, s=9, l=11, n=3, h=40, hv=37, attention_bias=(True, True)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", list(CASES))
def test_matches_reference(backend, case_name, dtype):
    problem = make_problem(CASES[case_name], dtype)
    assert_matches(problem, backend.run(problem))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["lengths", "BT", "BST"])
def test_fully_padded_rows_are_softmax_of_raw_scores(backend, dtype, mask):
    """ORT adds mask_filter_value in float32, so a fully padded row is softmax of the raw scores, not uniform."""
    case = Case(b=2, s=6, l=12, n=2, h=64, bias=False, mask=mask, full_padding=True, seed=3)
    problem = make_problem(case, dtype)
    result = backend.run(problem)
    got = result.output_BSDv[0]  # batch 0: every key padded
    raw = replace(problem, padding_mask=None)
    want = run_reference(raw, np.float64).output_BSDv[0]
    value_BNLH = to_BNSH(problem.value, problem.geometry.num_heads)
    uniform = np.broadcast_to(value_BNLH[0].mean(axis=1)[None], (case.s, case.n, case.h)).reshape(case.s, -1)
    tolerance = {"float32": 1e-3, "float16": 4e-3, "bfloat16": 2e-2}[dtype]  # 1e-3: float32 rounding of x - 10000
    err_raw, err_uniform = np.abs(got - want).max(), np.abs(got - uniform).max()
    assert err_raw <= tolerance, f"fully padded row differs from softmax(raw scores) by {err_raw:.3g}"
    assert err_uniform > 20 * tolerance, f"fully padded row collapsed to uniform (distance {err_uniform:.3g})"
    if dtype != "bfloat16":  # the naive bf16 baseline itself collapses such rows, so bf16 stops at the checks above
        assert_matches(problem, result)


def test_minus_inf_fully_padded_row_is_nan_like_ort(backend):
    """With mask_filter_value = -inf a fully padded row is NaN in ORT (docs/SEMANTICS.md §3.5); so it is here."""
    problem = make_problem(Case(b=2, s=3, l=5, n=1, h=16, mask="lengths", full_padding=True,
                                mask_filter_value=-np.inf), "float32")  # fmt: skip
    result = backend.run(problem)
    assert np.isnan(result.output_BSDv[0]).all()
    want = ReferenceBackend().run(problem).output_BSDv[1]
    np.testing.assert_allclose(result.output_BSDv[1], want, rtol=1e-5, atol=1e-5)


def test_results_are_fresh_arrays_not_the_staging_buffer(backend):
    first_problem = make_problem(Case(seed=1, presents=True, p=2), "float16")
    first = backend.run(first_problem)
    kept = first.output_BSDv.copy()
    backend.run(make_problem(Case(seed=2, presents=True, p=2), "float16"))
    np.testing.assert_array_equal(first.output_BSDv, kept)


def test_borrowed_outputs_are_the_calling_threads_buffer(backend):
    """borrow_outputs=True (the plugin op): views of this thread's pinned buffer, right values, overwritten by the
    same thread's next borrowing call only; calls of other threads and plain calls leave them alone."""
    import threading

    first_problem = make_problem(Case(seed=1, presents=True, p=2), "float16")
    first = backend.run(first_problem, borrow_outputs=True)
    assert_matches(first_problem, first)
    kept = first.output_BSDv.copy()
    assert not first.output_BSDv.flags.owndata

    other = make_problem(Case(seed=2, presents=True, p=2), "float16")
    worker = threading.Thread(target=lambda: backend.run(other, borrow_outputs=True))
    worker.start()
    worker.join()
    backend.run(other)  # a plain call: fresh arrays, its own staging
    np.testing.assert_array_equal(first.output_BSDv, kept)

    second = backend.run(other, borrow_outputs=True)
    assert_matches(other, second)
    assert np.shares_memory(second.output_BSDv, first.output_BSDv)  # the same buffer, reused


def test_device_string_and_device_range(backend, cupy_module):
    from mha_ep.errors import MhaEpError
    from mha_ep.engine.cuda import CudaBackend

    assert backend.name == "cuda"
    assert backend.device.startswith("cuda:0 ")
    count = cupy_module.cuda.runtime.getDeviceCount()
    with pytest.raises(MhaEpError, match=f"device_id {count} is out of range"):
        CudaBackend(count)


def test_work_runs_on_the_backend_device_and_leaves_the_current_device_alone(backend, cupy_module):
    before = cupy_module.cuda.runtime.getDevice()
    backend.run(make_problem(Case(), "float32"))
    assert cupy_module.cuda.runtime.getDevice() == before


def test_threads_sharing_one_backend_get_their_own_answers(backend):
    problems = [make_problem(Case(seed=10 + i, s=16, l=16, presents=True, p=4), "float16") for i in range(6)]
    failures = []

    def work(problem):
        try:
            for _ in range(5):
                assert_matches(problem, backend.run(problem))
        except Exception as error:  # noqa: BLE001 - collected and reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(p,)) for p in problems]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_failure_after_launch_releases_scratch_and_backend_stays_usable(backend, cupy_module, monkeypatch):
    problem = make_problem(Case(s=32, l=32), "float16")
    backend.run(problem)
    pool = cupy_module.get_default_memory_pool()
    baseline = pool.used_bytes()

    injected = RuntimeError("injected failure after the layout kernels were submitted")
    monkeypatch.setattr("mha_ep.engine.cuda.backend.run_steps", failing_at_last_step(injected))
    with pytest.raises(RuntimeError, match="injected failure"):
        backend.run(problem)
    assert pool.used_bytes() == baseline
    monkeypatch.undo()
    assert_matches(problem, backend.run(problem))


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "ordinary"])
def test_thousand_calls_return_the_memory_pool_to_its_baseline(cupy_module, replay):
    """Per-call buffers go back to the pool; a replayed shape's buffers are taken once (its second call)."""
    from mha_ep.engine.cuda import CudaBackend

    backend = CudaBackend(0, replay=replay)
    problem = make_problem(Case(b=1, s=8, l=8, p=4, n=2, h=16, presents=True, mask="BT"), "float16")
    pool = cupy_module.get_default_memory_pool()
    first = backend.run(problem)
    backend.run(problem)
    gc.collect()  # earlier tests' objects (device-mode sessions hold pool memory) must not be freed mid-count
    gc.disable()
    try:
        baseline = pool.used_bytes()
        for _ in range(1000):
            result = backend.run(problem)
    finally:
        gc.enable()
    assert pool.used_bytes() == baseline, f"pool used bytes {pool.used_bytes()} != baseline {baseline}"
    np.testing.assert_array_equal(result.output_BSDv, first.output_BSDv)


REPLAY_CASES = ["S113_H40_keysBT_bias_BN", "whisper_decode_T448", "causal_with_past_presents",
                "bnsh_cross_keysBT_bias_11", "mask_3b_plus_2"]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", REPLAY_CASES)
def test_a_repeated_call_shape_is_replayed_with_fresh_inputs_each_time(cupy_module, case_name, dtype):
    """Call 1 runs the ordinary way, call 2 captures the shape, calls 3-4 replay it; each call has its own random
    inputs (masks included), so an output element the replay left unwritten would keep an older call's value."""
    from mha_ep.engine.cuda import CudaBackend

    backend = CudaBackend(0)
    for seed in range(4):
        problem = make_problem(replace(CASES[case_name], seed=100 + seed), dtype)
        assert_matches(problem, backend.run(problem))
    assert (backend.replays.captured, backend.replays.replayed) == (1, 2)


def test_replay_is_off_for_the_three_phase_path_and_with_poisoned_buffers(cupy_module):
    from mha_ep.engine.cuda import CudaBackend

    assert CudaBackend(0, poison_device_buffers=True).replays is None
    three_phase = CudaBackend(0, fused_path=False)
    problem = make_problem(Case(), "float16")
    for _ in range(3):
        assert_matches(problem, three_phase.run(problem))
    assert (three_phase.replays.captured, three_phase.replays.replayed, len(three_phase.replays)) == (0, 0, 0)


def test_replayed_shapes_beyond_the_limit_release_the_oldest(cupy_module):
    from mha_ep.engine.cuda import CudaBackend
    from mha_ep.engine.cuda.replay import REPLAY_ENTRIES

    backend = CudaBackend(0)
    pool = cupy_module.get_default_memory_pool()
    problems = [make_problem(Case(b=1, s=4 + k, l=6, n=2, h=16), "float32") for k in range(REPLAY_ENTRIES + 3)]
    for problem in problems:
        backend.run(problem)
        backend.run(problem)  # captured
    assert len(backend.replays) == REPLAY_ENTRIES
    held = pool.used_bytes()
    backend.replays.clear()
    assert pool.used_bytes() < held and len(backend.replays) == 0
    assert_matches(problems[0], backend.run(problems[0]))


def test_create_backend_builds_the_cuda_backend(cupy_module):
    from mha_ep.engine.backends import create_backend

    backend = create_backend("cuda", 0)
    assert backend.name == "cuda"
    problem = make_problem(Case(), "float32")
    assert_matches(problem, backend.run(problem))


def test_out_of_device_memory_names_the_buffer_and_releases_everything(cupy_module):
    """scores_BNST of 1 x 1 x 200000 x 200000 float32 is 160 GB, more than the card: a clean MhaEpError."""
    from mha_ep.errors import MhaEpError
    from mha_ep.engine.cuda import CudaBackend

    backend = CudaBackend(0, fused_path=False)  # the fused path allocates no scores buffer to run out on

    length = 200_000
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((1, length, 8), dtype=np.float32) for _ in range(3)]
    problem = build_problem({"num_heads": 1}, arrays, "float32")
    pool = cupy_module.get_default_memory_pool()
    gc.collect()  # backends of earlier tests that are still in reference cycles hand back their memory now
    baseline = pool.used_bytes()
    with pytest.raises(MhaEpError, match="out of device memory allocating scores_BNST"):
        backend.run(problem)
    assert pool.used_bytes() == baseline
    small = make_problem(Case(), "float32")
    assert_matches(small, backend.run(small))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_causal_lowest_is_added_under_a_huge_negative_attention_bias(backend, dtype):
    """A Hugging Face style combined mask passed as attention_bias (float32 min at padded and future keys) with
    unidirectional=1: ORT adds lowest at future keys to score + bias, so a row that only sees padding still
    ranks its keys by score + bias. Setting the logit to lowest instead (the three-phase softmax once did)
    changes such rows; found by review, checked on the CPU against stock ORT (tests/parity/test_parity_random.py)."""
    rng = np.random.default_rng(11)
    b, s, n, h = 2, 6, 2, 64
    lowest = np.finfo(np.float32).min
    future = np.triu(np.ones((s, s), bool), 1)
    bias = np.where(future, lowest, 0.0).astype(np.float32)[None, None].repeat(b, 0)
    bias[0, :, :, :3] = lowest  # left padding of batch 0: its first rows see only padded keys
    arrays = [round_to_dtype(rng.standard_normal((b, s, n * h)).astype(np.float32), dtype) for _ in range(3)]
    problem = build_problem({"num_heads": n, "unidirectional": 1}, arrays + [None, None, bias, None, None], dtype)
    assert_matches(problem, backend.run(problem))


@pytest.mark.gpu
def test_timing_the_prepared_call_measures_and_leaves_the_backend_answering(backend):
    """The benchmarks' timer replays a captured graph of the prepared call on the fused path and times submissions
    on the three-phase path; the backend's stream is usable afterwards either way."""
    from mha_ep.bench.timer import backend_seconds

    problem = make_problem(Case(b=2, s=33, l=40, n=2, h=64, mask="lengths", attention_bias=(True, False)), "float16")
    with backend.prepared(problem) as call:
        assert call.capturable == backend.fused_path
    seconds = backend_seconds(backend, problem, repeats=3, warmup=1)
    assert 0.0 < seconds < 0.1, seconds
    assert_matches(problem, backend.run(problem))


@pytest.mark.gpu
def test_the_prepared_call_reports_cuda_errors_as_mha_ep_errors(backend, cupy_module, monkeypatch):
    from mha_ep.bench.timer import backend_seconds
    from mha_ep.errors import MhaEpError

    problem = make_problem(Case(s=32, l=32), "float16")

    error = cupy_module.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr("mha_ep.engine.cuda.backend.run_steps", failing_at_last_step(error))
    with pytest.raises(MhaEpError, match=r"cuda backend on .*CUDARuntimeError"):
        backend_seconds(backend, problem, repeats=2, warmup=1)
    monkeypatch.undo()
    assert_matches(problem, backend.run(problem))
