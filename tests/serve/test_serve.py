"""mha_ep.serve on a local Ray (127.0.0.1, one instance for this module), the shipped BERT on the reference
backend: answers over HTTP (JSON, .npz) and through a handle equal a direct session's to the bit when unbatched;
batching across concurrent callers changes no answer; bad requests get their 4xx with onnxruntime's own message
and a failing node its 5xx; a killed replica is replaced and the requests it held get an error, not a hang.

Nothing here waits for a length of time: each step waits for what Serve or the replica reports (the deadlines
are failure bounds only), and a batch forms when its last request arrives (batch_wait_ms is a bound too)."""

from __future__ import annotations

import http.client
import io
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from mha_ep.serve import missing_extra

if missing_extra():
    pytest.skip(f"{missing_extra()}: the Ray Serve tests need it", allow_module_level=True)

import mha_ep  # noqa: E402
from mha_ep.serve import ServeOptions, deploy, free_port, start_local, stop  # noqa: E402
from mha_ep.serve.batching import assemble, fit, plan_batching, split  # noqa: E402
from serve_models import (  # noqa: E402
    attention_feeds, attention_model, batched_tolerance, bert_feeds, bert_model, bert_path, error_of, max_rel_error,
)  # fmt: skip

DEADLINE_S = 120  # a failure bound: every wait below ends on what Serve or a replica reports
BATCH_BOUND_MS = DEADLINE_S * 1000  # a batch runs when it is full; this only bounds a batch that never fills


@pytest.fixture(scope="module")
def port():
    chosen = free_port()
    start_local(chosen, num_cpus=2)
    yield chosen
    stop()


@pytest.fixture(scope="module")
def session():
    return mha_ep.InferenceSession(bert_path(), backend="reference")


def served(name: str, model: str = None, **options):
    return deploy(ServeOptions(model=model or bert_path(), backend="reference", cpus_per_replica=0,
                               route_prefix=f"/{name}", **options), name)  # fmt: skip


@pytest.fixture(scope="module")
def plain(port):
    return served("plain", max_batch=1)


@pytest.fixture(scope="module")
def batched(port):
    return served("batched", max_batch=4, batch_wait_ms=BATCH_BOUND_MS)


def post(port: int, route: str, body: bytes, content_type: str = "application/json", accept: str = None,
         query: str = "") -> tuple:  # fmt: skip
    """(status, headers, body) of one POST."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    headers = {"Content-Type": content_type} if content_type else {}
    if accept:
        headers["Accept"] = accept
    connection.request("POST", route + query, body=body, headers=headers)
    reply = connection.getresponse()
    data = reply.read()
    connection.close()
    return reply.status, reply.headers, data  # headers: case-insensitive (the proxy lowercases them)


def as_json(feeds: dict) -> bytes:
    return json.dumps({"inputs": {name: value.tolist() for name, value in feeds.items()}}).encode()


def as_npz(feeds: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **feeds)
    return buffer.getvalue()


def json_answer(data: bytes) -> tuple:
    answer = json.loads(data)
    output = np.array(answer["outputs"]["last_hidden_state"], dtype=answer["dtypes"]["last_hidden_state"])
    return output, answer["run"]


def test_http_answers_equal_a_direct_session_bit_for_bit(port, plain, session):
    for length, rows in ((1, 1), (9, 2), (64, 1)):
        feeds = bert_feeds(length, rows, seed=length)
        expected = session.run(None, feeds)[0]
        status, _, data = post(port, "/plain", as_json(feeds))
        assert status == 200, data[:300]
        output, run = json_answer(data)
        assert np.array_equal(output, expected) and run == {"requests": 1, "position": 0, "rows": rows,
                                                            "length": length, "retried": False}  # fmt: skip
        status, headers, data = post(port, "/plain", as_npz(feeds), "application/x-npz", accept="application/x-npz")
        with np.load(io.BytesIO(data)) as archive:
            assert status == 200 and np.array_equal(archive["last_hidden_state"], expected)
        assert json.loads(headers["X-MHA-EP-Run"])["length"] == length
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    connection.request("GET", "/plain")
    described = json.loads(connection.getresponse().read())
    assert described["model"] == bert_path() and described["batching"]["mask"] == "attention_mask"


def test_handle_answers_equal_a_direct_session_bit_for_bit(plain, session):
    feeds = bert_feeds(17, rows=3, seed=5)
    outputs = plain.run.remote(None, feeds).result(timeout_s=DEADLINE_S)
    assert np.array_equal(outputs[0], session.run(None, feeds)[0])
    answer = plain.answer.remote(["last_hidden_state"], feeds).result(timeout_s=DEADLINE_S)
    assert answer.names == ("last_hidden_state",) and answer.run.rows == 3


def broken(change, length=5):
    feeds = bert_feeds(length, rows=2, seed=length)
    change(feeds)
    return feeds


def out_of_vocabulary(feeds):
    feeds["input_ids"][1, 3] = 1000  # the table has 1000 rows: EmbedLayerNormalization refuses it at run time


BAD_FEEDS = {
    "a wrong input name": broken(lambda f: f.update(input_idz=f.pop("input_ids"))),
    "an input too many": broken(lambda f: f.update(extra=np.zeros((2, 5), np.int64))),
    "a wrong rank": broken(lambda f: f.update(attention_mask=f["attention_mask"][0])),
    "a wrong element type": broken(lambda f: f.update(input_ids=f["input_ids"].astype(np.float64) + 0.5)),
    "inputs that disagree": broken(lambda f: f.update(attention_mask=f["attention_mask"][:, :3])),
    "an id outside the vocabulary": broken(out_of_vocabulary),
}


def test_bad_requests_get_a_4xx_with_onnxruntimes_own_message_and_the_replica_goes_on(port, plain, session):
    before = plain.describe.remote().result(timeout_s=DEADLINE_S)
    for case, feeds in BAD_FEEDS.items():
        expected = error_of(lambda: session.run(None, feeds))
        for body, kind in ((as_json(feeds), "application/json"), (as_npz(feeds), "application/x-npz")):
            status, _, data = post(port, "/plain", body, kind)
            error = json.loads(data)["error"]
            assert status == 400 and error["message"] == str(expected), (case, kind, error)
        caught = error_of(lambda: plain.run.remote(None, feeds).result(timeout_s=DEADLINE_S))
        assert isinstance(caught, type(expected)) and str(expected) in str(caught), case
    assert json.loads(post(port, "/plain", as_json(BAD_FEEDS["an id outside the vocabulary"]))[2])["error"][
        "node"] == "EmbedLayerNormalization_0"  # fmt: skip
    wrong_output = error_of(lambda: session.run(["pooled"], bert_feeds(4)))
    status, _, data = post(port, "/plain", as_json(bert_feeds(4)), query="?outputs=pooled")
    assert status == 400 and json.loads(data)["error"]["message"] == str(wrong_output)
    for body, kind, code, text in ((b"{not json", "application/json", 400, "the body is not JSON"),
                                   (b"ids=1", "text/plain", 415, "Content-Type 'text/plain' is neither"),
                                   (b"PK\x03\x04 cut short", "application/x-npz", 400, "not a readable .npz")):
        status, _, data = post(port, "/plain", body, kind)
        assert status == code and text in json.loads(data)["error"]["message"], (kind, data)
    after = plain.describe.remote().result(timeout_s=DEADLINE_S)
    assert after["pid"] == before["pid"] and after["failed"] > before["failed"]
    feeds = bert_feeds(6)
    assert np.array_equal(json_answer(post(port, "/plain", as_json(feeds))[2])[0], session.run(None, feeds)[0])


def test_a_failing_node_is_a_5xx_naming_it(port, tmp_path_factory):
    import onnx

    path = tmp_path_factory.mktemp("models") / "attention.onnx"
    onnx.save(attention_model(), path)
    served("failing", model=str(path), max_batch=1)
    status, _, data = post(port, "/failing", as_json(attention_feeds(hidden=6)))
    error = json.loads(data)["error"]
    assert status == 500 and error["node"] == "attention" and error["type"] == "Fail", error
    assert "query hidden 6 not divisible by num_heads 4" in error["message"]
    assert post(port, "/failing", as_json(attention_feeds(hidden=8)))[0] == 200


def concurrently(count: int, call) -> list:
    """``call(i)`` on ``count`` threads released together; their results in order (a failure fails the test)."""
    barrier = threading.Barrier(count)
    results = [None] * count

    def body(index):
        barrier.wait(timeout=DEADLINE_S)
        results[index] = call(index)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    return results


def test_batching_across_concurrent_callers_changes_no_answer(port, batched, session):
    """Four callers at once make one run of four (max_batch 4; the batch runs when the fourth arrives). Each
    answer is bit-equal to the session's run of that same padded batch, cut back (serving adds nothing), and
    within 16 float32 epsilons of the request's own run: padding regroups the softmax's and the attention GEMMs'
    sums over the padded length (mha_ep/serve/batching.py), which may move the last bits."""
    pool = [bert_feeds(length, seed=length) for length in (3, 20, 7, 11)]
    replies = concurrently(4, lambda i: post(port, "/batched", as_json(pool[i])))
    answers = [json_answer(data) for status, _, data in replies if status == 200]
    assert len(answers) == 4, replies
    runs = [run for _, run in answers]
    assert sorted(run["position"] for run in runs) == [0, 1, 2, 3] and {run["requests"] for run in runs} == {4}
    order = sorted(range(4), key=lambda i: runs[i]["position"])
    plan = plan_batching(bert_model())
    fits = [fit(plan, pool[i]) for i in order]
    feeds, length = assemble(plan, [pool[i] for i in order], fits)
    whole = split(plan, ["last_hidden_state"], session.run(None, feeds), fits)
    assert length == 20 and {run["length"] for run in runs} == {20}
    for part, index in zip(whole, order):
        output = answers[index][0]
        assert np.array_equal(output, part["last_hidden_state"])
        assert max_rel_error(output, session.run(None, pool[index])[0]) <= batched_tolerance()


def test_a_bad_request_inside_a_batch_fails_alone(port, batched, session):
    pool = [bert_feeds(length, seed=length) for length in (4, 9, 6, 12)]
    out_of_vocabulary_row = pool[2]["input_ids"]
    out_of_vocabulary_row[0, 1] = 1000
    expected = error_of(lambda: session.run(None, pool[2]))
    replies = concurrently(4, lambda i: post(port, "/batched", as_json(pool[i])))
    for index, (status, _, data) in enumerate(replies):
        if index == 2:
            assert status == 400 and json.loads(data)["error"]["message"] == str(expected)
            continue
        output, run = json_answer(data)
        assert status == 200 and run["retried"] and np.array_equal(output, session.run(None, pool[index])[0])


def wait_for(condition, what: str):
    """Poll ``condition()`` until it gives something true; that value (a failure after DEADLINE_S)."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not seen within {DEADLINE_S} s: {what}")


def described(handle, **match):
    """The replica's describe() when every ``match`` item holds (a callable item: when it returns true), else
    None; None too while the handle still reaches a replica that has died."""
    import ray

    try:
        found = handle.describe.remote().result(timeout_s=DEADLINE_S)
    except ray.exceptions.RayActorError:
        return None
    ok = all(want(found[key]) if callable(want) else found[key] == want for key, want in match.items())
    return found if ok else None


def test_a_killed_replica_is_replaced_and_the_requests_it_held_get_an_error(port):
    """Two requests wait inside the replica for a batch of three; the replica is killed; both get an error (the
    handle's RayActorError, HTTP's 5xx), Serve starts another replica, and it answers."""
    import ray

    doomed = served("doomed", max_batch=3, batch_wait_ms=BATCH_BOUND_MS)
    feeds = bert_feeds(5)
    held = doomed.run.remote(None, feeds)
    over_http = {}
    thread = threading.Thread(target=lambda: over_http.update(reply=post(port, "/doomed", as_json(feeds))))
    thread.start()
    first = wait_for(lambda: described(doomed, in_flight=2), "two requests held by the replica")
    os.kill(first["pid"], signal.SIGKILL)
    caught = error_of(lambda: held.result(timeout_s=DEADLINE_S))
    assert isinstance(caught, ray.exceptions.RayActorError), repr(caught)
    thread.join(timeout=DEADLINE_S)
    assert not thread.is_alive() and over_http["reply"][0] >= 500, over_http
    second = wait_for(lambda: described(doomed, pid=lambda pid: pid != first["pid"]), "a new replica")
    assert second["replica"] != first["replica"]
    outputs = [doomed.run.remote(None, bert_feeds(5 + i, seed=i)) for i in range(3)]  # a full batch runs at once
    assert [o.result(timeout_s=DEADLINE_S)[0].shape for o in outputs] == [(1, 5, 64), (1, 6, 64), (1, 7, 64)]


def test_the_serving_benchmark_runs_tiny_and_reports_every_route(port, capsys):
    """Structure only: the numbers are printed, never judged here."""
    from mha_ep.bench import main

    code = main(["serve", "--clients", "1,2", "--max-batch", "1,2", "--requests", "3", "--duration", "30",
                 "--warmup", "1", "--pool", "4", "--sequence", "4:8", "--port", str(port), "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    rows = data["rows"]
    assert {r["route"] for r in rows} == {"session", "engine", "http", "handle"}
    assert len(rows) == 2 + 4 + 2 * 2 * 2  # session x clients, engine x batch x clients, served x batch x clients
    for row in rows:
        assert row["errors"] == 0 and row["answers"] > 0 and row["p99_ms"] >= row["p50_ms"], row
        if row.get("max_batch", 1) == 1:
            assert row["bit_equal"] == row["checked"] and row["max_err"] == 0.0, row
    assert {o["route"] for o in data["summary"]["overhead_ms"]} == {"http", "handle"}
    assert {b["route"] for b in data["summary"]["batching"]} == {"engine", "http", "handle"}
    assert "closed-loop clients" in data["measures"]
