"""One replica's model without Ray (mha_ep/serve/engine.py) on the reference backend: a request alone is the
session's answer to the bit; a shared run is that batch's run cut back, close to each request's own answer; a
bad request gets onnxruntime's own error, alone or inside a batch, and the others are answered; the coalescer
merges what piles up while the model is busy."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_ep.serve.batching import assemble, split
from mha_ep.serve.engine import Answer, Coalescer, Engine, Failure, embedding_guards, guard_error
from serve_models import (
    attention_feeds, attention_model, batched_tolerance, bert_feeds, bert_model, bert_path, error_of, max_rel_error,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return Engine(bert_path(), backend="reference")


def requests_of(engine, *specs):
    """engine.request for each (length, rows, seed)."""
    made = [engine.request(bert_feeds(length, rows, seed)) for length, rows, seed in specs]
    assert not any(isinstance(r, Failure) for r in made), made
    return made


def test_a_request_alone_is_the_sessions_answer_bit_for_bit(engine):
    for length, rows in ((1, 1), (9, 1), (33, 3), (128, 2)):
        feeds = bert_feeds(length, rows, seed=length)
        answer = engine.run_alone(engine.request(feeds))
        expected = engine.session.run(None, feeds)
        assert isinstance(answer, Answer) and answer.names == ("last_hidden_state",)
        assert np.array_equal(answer.outputs[0], expected[0]), (length, rows)
        assert (answer.run.requests, answer.run.rows, answer.run.length) == (1, rows, length)


def test_a_shared_run_is_that_batchs_run_cut_back_and_close_to_each_requests_own(engine):
    """Bit for bit against the session's run of the same padded batch: serving adds nothing to it. Against each
    request's own run, a tolerance: padding regroups the softmax's and the attention GEMMs' sums over the padded
    length (mha_ep/serve/batching.py), so the last bits may move; the padded keys themselves weigh exactly 0."""
    made = requests_of(engine, (3, 1, 1), (17, 2, 2), (9, 1, 3), (30, 1, 4))
    answers = engine.run(made, max_rows=16)
    feeds, length = assemble(engine.plan, [r.feeds for r in made], [r.fit for r in made])
    whole = split(engine.plan, engine.output_names, engine.session.run(None, feeds), [r.fit for r in made])
    for position, (request, answer, part) in enumerate(zip(made, answers, whole)):
        assert (answer.run.requests, answer.run.position, answer.run.rows, answer.run.length) == (4, position, 5, 30)
        assert np.array_equal(answer.outputs[0], part["last_hidden_state"])
        own = engine.session.run(None, dict(request.feeds))[0]
        assert answer.outputs[0].shape == own.shape
        assert max_rel_error(answer.outputs[0], own) <= batched_tolerance()


def test_a_bad_request_in_a_batch_gets_its_error_and_the_others_their_own_answers(engine):
    made = requests_of(engine, (5, 1, 1), (8, 1, 2), (12, 1, 3))
    bad_feeds = bert_feeds(6, seed=4)
    bad_feeds["input_ids"][0, 2] = 5000  # outside the 1000-row table: EmbedLayerNormalization fails the run
    bad = engine.request(bad_feeds)
    assert not isinstance(bad, Failure)  # nothing before the run can tell
    outcomes = engine.run([made[0], bad, made[1], made[2]], max_rows=16)
    expected = error_of(lambda: engine.session.run(None, bad_feeds))
    failure = outcomes[1]
    assert isinstance(failure, Failure) and (failure.status, failure.stage) == (400, "run")
    assert type(failure.error) is type(expected) and str(failure.error) == str(expected)
    assert "Name:'EmbedLayerNormalization_0'" in str(failure.error)
    for request, outcome in zip(made, (outcomes[0], outcomes[2], outcomes[3])):
        assert isinstance(outcome, Answer) and outcome.run.retried and outcome.run.requests == 1
        assert np.array_equal(outcome.outputs[0], engine.session.run(None, dict(request.feeds))[0])


def broken(change):
    feeds = bert_feeds(5, rows=2)
    change(feeds)
    return feeds


CHECKED = {
    "a wrong input name": broken(lambda f: f.update(input_idz=f.pop("input_ids"))),
    "an input too many": broken(lambda f: f.update(extra=np.zeros((2, 5), np.int64))),
    "a wrong rank": broken(lambda f: f.update(input_ids=f["input_ids"][..., None])),
    "a wrong element type": broken(lambda f: f.update(token_type_ids=f["token_type_ids"].astype(np.float32))),
}


@pytest.mark.parametrize("case", sorted(CHECKED))
def test_a_call_that_does_not_fit_the_model_gets_what_the_sessions_run_raises(engine, case):
    feeds = CHECKED[case]
    failure = engine.request(feeds)
    expected = error_of(lambda: engine.session.run(None, feeds))
    assert isinstance(failure, Failure) and (failure.status, failure.stage) == (400, "check")
    assert type(failure.error) is type(expected) and str(failure.error) == str(expected)


def test_an_unknown_output_name_gets_what_the_sessions_run_raises(engine):
    feeds = bert_feeds(5)
    failure = engine.request(feeds, ["pooled"])
    expected = error_of(lambda: engine.session.run(["pooled"], feeds))
    assert isinstance(failure, Failure) and str(failure.error) == str(expected) and failure.status == 400


def test_a_request_whose_inputs_disagree_runs_alone_and_gets_the_sessions_error(engine):
    feeds = bert_feeds(5, rows=2)
    feeds["attention_mask"] = feeds["attention_mask"][:1]
    request = engine.request(feeds)
    assert request.fit.alone
    outcome, answer = engine.run([request, requests_of(engine, (5, 1, 7))[0]], max_rows=16)
    expected = error_of(lambda: engine.session.run(None, feeds))
    assert isinstance(outcome, Failure) and str(outcome.error) == str(expected) and outcome.status == 400
    assert isinstance(answer, Answer) and not answer.run.retried


def test_a_node_that_fails_is_a_500_naming_it(tmp_path):
    import onnx

    onnx.save(attention_model(), tmp_path / "attention.onnx")
    served = Engine(tmp_path / "attention.onnx", backend="reference")
    failure = served.run_alone(served.request(attention_feeds(hidden=6)))
    assert isinstance(failure, Failure) and (failure.status, failure.stage) == (500, "run")
    assert failure.error.node_name == "attention" and "query hidden 6 not divisible by num_heads 4" in str(failure.error)
    assert isinstance(served.run_alone(served.request(attention_feeds(hidden=8))), Answer)


def test_the_cuda_guard_raises_onnxruntime_cpus_own_error_for_ids_outside_the_table(engine):
    guards = embedding_guards(bert_model())
    assert guards == (("input_ids", "EmbedLayerNormalization_0", 1000), ("token_type_ids", "EmbedLayerNormalization_0", 2))
    assert engine.guards == ()  # only a CUDA provider session checks: ORT CPU answers by itself
    for name, value in (("input_ids", 1000), ("input_ids", -1), ("token_type_ids", 2)):
        feeds = bert_feeds(4)
        feeds[name][0, 1] = value
        expected = error_of(lambda: engine.session.run(None, feeds))
        error = guard_error(guards, feeds)
        assert type(error) is type(expected) and str(error) == str(expected), name
    assert guard_error(guards, bert_feeds(4)) is None


# ------------------------------------------------------------------ the coalescer, with a stand-in engine
class HeldEngine:
    """groups: everything in one run; run_group: records each run and holds the first until released."""

    def __init__(self):
        self.runs = []
        self.started = threading.Event()
        self.release = threading.Event()

    def groups(self, requests, max_rows):
        return [list(range(len(requests)))]

    def run_group(self, requests):
        self.runs.append(list(requests))
        self.started.set()
        assert self.release.wait(timeout=60), "never released"
        return [f"answer {r}" for r in requests]


def test_batches_that_arrive_while_the_model_is_busy_go_into_one_next_run():
    engine = HeldEngine()

    async def scenario():
        coalescer = Coalescer(engine, ThreadPoolExecutor(1), lambda: 16)
        first = asyncio.ensure_future(coalescer.submit(["a"]))
        await asyncio.get_running_loop().run_in_executor(None, engine.started.wait, 60)  # "a" is running
        later = [asyncio.ensure_future(coalescer.submit(batch)) for batch in (["b", "c"], ["d"], ["e"])]
        while len(coalescer.waiting) < 3:  # each task's first step queues its batch behind the running one
            await asyncio.sleep(0)
        engine.release.set()
        return await first, await asyncio.gather(*later)

    first, later = asyncio.run(scenario())
    assert engine.runs == [["a"], ["b", "c", "d", "e"]]
    assert first == ["answer a"] and later == [["answer b", "answer c"], ["answer d"], ["answer e"]]


def test_feeds_that_are_no_mapping_are_a_400_naming_what_came(engine):
    failure = engine.request([bert_feeds(4)])
    assert isinstance(failure, Failure) and (failure.status, failure.stage) == (400, "read")
    assert str(failure.error) == "input_feed must be a mapping of input name to array, got list"
    failure = engine.request({"input_ids": [[1, 2], [3]]})
    assert failure.status == 400 and "input 'input_ids' is not a rectangular array of numbers" in str(failure.error)
