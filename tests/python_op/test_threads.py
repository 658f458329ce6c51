"""Threads: eight threads sharing one session, each with its own shapes, get stock ORT's answers, and a thread that
keeps failing never leaks its error into the others (every route, through the run_backend fixture)."""

from __future__ import annotations

import numpy as np

import mha_ep

from harness import run_threads
from mha_models import MhaConfig, build_model, plugin_session, random_feeds, stock_outputs, with_

TOLERANCE = 1e-5  # against stock ORT CPU, float32


THREADS = 8


RUNS_PER_THREAD = 12


# One model whose every dim is symbolic, so each thread can feed its own sizes.
THREAD_MODEL_CONFIG = MhaConfig(
    num_heads=2, head_size=8, bias=True, mask="2d", attention_bias="1N", causal=True, has_past=True,
    presents=True, shapes="symbolic",
)


def thread_config(index: int) -> MhaConfig:
    """Thread ``index``'s sizes: different B, S, L, P per thread (S != L for half of them)."""
    return with_(
        THREAD_MODEL_CONFIG,
        batch=1 + index % 3,
        q_seq=1 + index % 4,
        kv_seq=1 + (index * 3) % 5,
        past_seq=index % 3,
    )


# ---------------------------------------------------------------------------------------------------- (a)
def test_eight_threads_share_one_session(run_backend, rng):
    backend = run_backend
    session = plugin_session(build_model(THREAD_MODEL_CONFIG), backend)
    names = ["output", "present_key", "present_value"]
    work = []
    for index in range(THREADS):
        config = thread_config(index)
        cases = []
        for _ in range(3):  # three feeds per thread, cycled
            feeds = random_feeds(config, rng)
            cases.append((feeds, stock_outputs(config, feeds)))
        work.append((config, cases))
    results = {}

    def target(index):
        config, cases = work[index]
        for run in range(RUNS_PER_THREAD):
            feeds, expected = cases[run % len(cases)]
            actual = dict(zip(names, session.run(names, feeds)))
            results[(index, run)] = (config, actual, expected)

    failures = run_threads(target, THREADS)
    assert not failures, f"threads raised: {failures}"
    assert len(results) == THREADS * RUNS_PER_THREAD
    from mha_models import assert_outputs_match

    for (index, run), (config, actual, expected) in sorted(results.items(), key=lambda kv: kv[0]):
        assert_outputs_match(actual, expected, TOLERANCE, f"[{backend}] thread {index} run {run} {config.short()}")


def test_an_error_in_one_thread_stays_in_that_thread(run_backend, rng):
    backend = run_backend
    """Thread 0 feeds a bad key batch on every run and must get MhaRunError every time; the other threads run good
    feeds at the same moment and must never see an error nor a wrong result."""
    config = with_(THREAD_MODEL_CONFIG, has_past=False, presents=False, causal=False, attention_bias=None)
    session = plugin_session(build_model(config), backend)
    good = random_feeds(config, rng)
    expected = stock_outputs(config, good)["output"]
    bad = dict(good, key=np.concatenate([good["key"], good["key"]]))  # key batch 4 vs query batch 2
    outcomes = {}

    def target(index):
        for run in range(RUNS_PER_THREAD):
            if index == 0:
                try:
                    session.run(["output"], bad)
                    outcomes[(index, run)] = "no error"
                except mha_ep.MhaRunError as error:
                    outcomes[(index, run)] = str(error)
            else:
                outcomes[(index, run)] = session.run(["output"], good)[0]

    failures = run_threads(target, 4)
    assert not failures, f"threads raised: {failures}"
    from conftest import max_rel_error

    for (index, run), outcome in sorted(outcomes.items(), key=lambda kv: kv[0]):
        if index == 0:
            assert "key batch 4 must equal query batch 2" in outcome, f"[{backend}] bad thread run {run}: {outcome}"
        else:
            error = max_rel_error(outcome, expected)
            assert error <= TOLERANCE, f"[{backend}] good thread {index} run {run}: error {error:.3g} > {TOLERANCE}"
