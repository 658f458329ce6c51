"""``mha-ep bench soak``'s pieces that run anywhere (mha_ep/bench/soak.py): the bad calls it makes, how it judges a
call, and the soak itself, bounded by a count of calls per thread (never a time), on the CPU: many threads on one
``mha_ep.InferenceSession`` and on one stock session, good and bad calls mixed, each answer held to stock ORT's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

import mha_ep
from mha_ep import shipped
from mha_ep.bench import soak

CPU = ["CPUExecutionProvider"]
InvalidArgument = onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument


@pytest.fixture(scope="module")
def bert():
    model = onnx.load(str(shipped.folder() / "bert_random_mask2d_fp32.onnx"))
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=CPU)
    return model, stock, soak.make_cases(model, stock, shapes=3, seed=5)


def test_every_bad_kind_that_applies_is_made_and_stock_refuses_the_ones_that_do_not_fit(bert):
    _, _, cases = bert
    kinds = {case.kind for case in cases}
    # the shipped BERT's inputs are all int64: no float input for NaN
    assert kinds == {"good", *soak.BAD_KINDS} - {"nan"}, kinds
    refused = {case.kind for case in cases if isinstance(case.expected, type)}
    assert {"rank", "dtype", "missing_input", "unknown_input", "unknown_output", "float_for_int"} <= refused, refused


def test_threads_on_one_session_get_stocks_answers_and_stocks_exception_types(bert):
    model, stock, cases = bert
    # Stock ORT CPU runs a zero-length sequence; mha_ep refuses a claimed node's zero-length query
    # (tests/claim/test_bad_input.py, query_zero_length: the original's rule, kept), so that kind is left out here.
    cases = [case for case in cases if case.kind != "zero_length"]
    session = mha_ep.InferenceSession(model, providers=CPU, backend="reference")
    for name, run in (("mha_ep", session.run), ("stock", stock.run)):
        tally = soak.soak([run], cases, threads=4, seconds=None, bad=0.5, tolerance=1e-4, seed=1, per_thread=10)
        assert (tally.wrong, tally.mistyped) == (0, 0), (name, tally.examples)
        assert tally.good + tally.bad_typed == 40 and tally.good and tally.bad_typed, (name, tally.row())


def test_a_wrong_answer_and_a_wrong_exception_type_are_counted(bert):
    _, _, cases = bert
    good = next(c for c in cases if c.kind == "good")
    refused = next(c for c in cases if c.expected is InvalidArgument)
    tally = soak.Tally()
    soak.judge(good, lambda names, feeds: [o + 1e-2 for o in good.expected], 1e-3, tally)
    soak.judge(refused, lambda names, feeds: (_ for _ in ()).throw(ValueError("not ORT's type")), 1e-3, tally)
    soak.judge(refused, lambda names, feeds: good.expected, 1e-3, tally)  # ran where stock raised
    soak.judge(good, lambda names, feeds: good.expected, 1e-3, tally)
    assert (tally.wrong, tally.mistyped, tally.good, tally.bad_typed) == (1, 2, 1, 0), tally.examples


def test_a_good_calls_cpu_time_tells_a_call_that_works_from_one_that_waits(bert):
    """The row's ``cpu_p50_ms`` is the calling thread's CPU time in a good call: a call that computes for 20 ms of
    its thread's CPU shows at least that; one that waits 50 ms (a lock, the GPU) shows a small part of it, whatever
    the machine's load (a waiting thread is given no CPU time)."""
    import threading
    import time

    good = next(c for c in bert[2] if c.kind == "good")

    def works(names, feeds):
        began = time.thread_time()
        while time.thread_time() - began < 0.02:
            pass
        return good.expected

    def waits(names, feeds):
        threading.Event().wait(0.05)
        return good.expected

    busy, idle = soak.Tally(), soak.Tally()
    soak.judge(good, works, 1e-3, busy)
    soak.judge(good, waits, 1e-3, idle)
    assert busy.row()["cpu_p50_ms"] >= 20.0, busy.row()
    assert idle.row()["cpu_p50_ms"] < idle.row()["p50_ms"] / 2, idle.row()
    assert len(busy.cpu) == busy.good == 1


def test_outputs_close_holds_nan_to_nan_and_shapes_exactly():
    a = np.array([1.0, np.nan], np.float32)
    assert soak.outputs_close([a], [a.copy()], 1e-6)
    assert not soak.outputs_close([np.array([1.0, 0.0], np.float32)], [a], 1e-6)
    assert not soak.outputs_close([a[:1]], [a], 1e-6)
    assert not soak.outputs_close([a.astype(np.float64)], [a], 1e-6)


def test_a_ratio_is_the_median_of_each_rounds_ratio_and_the_row_shows_their_range():
    """A column's rate moves between rounds on a shared host; its peer's in the same round moves with it."""
    median, rounds = soak.ratio_of_rounds([90.0, 300.0, 50.0, 10.0], [100.0, 200.0, 100.0, 0.0])
    assert (median, rounds) == (0.9, [0.9, 1.5, 0.5])  # the round whose peer made no good call is left out
    assert soak.ratio_of_rounds([1.0], [0.0]) == (None, [])
    row = {"column": "session", "threads": 8, "good": 10, "good_per_s": 5.0, "vs_plain": median,
           "vs_plain_rounds": rounds, "wrong": 0, "bad_typed": 1, "mistyped": 0, "p50_ms": 1.0, "p99_ms": 2.0,
           "cpu_p50_ms": 0.4}
    assert "| 0.9 (0.5-1.5) |" in soak.format_row(row)
    assert "| 5.0 |  | 0 |" in soak.format_row({**row, "vs_plain": None, "vs_plain_rounds": []})
    assert "| 1.0 | 2.0 | 0.4 |" in soak.format_row(row)


def test_the_columns_asked_for_come_in_their_order_and_a_typo_names_the_known_ones():
    assert soak.chosen_columns("session, plain") == ["plain", "session"]
    assert soak.chosen_columns(",".join(soak.COLUMNS)) == list(soak.COLUMNS)
    for text in ("plain,sesion", "", " , "):
        with pytest.raises(ValueError, match="stock, plain, session, session_graphs"):
            soak.chosen_columns(text)
