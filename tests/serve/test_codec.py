"""What travels over HTTP (mha_ep/serve/codec.py) and which status a failure gets (status.py): pure functions of
headers, bytes and exceptions; no Ray."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest

from mha_ep.errors import run_error
from mha_ep.native.ort_checks import invalid_argument, ort_exception
from mha_ep.serve.codec import (
    JSON, NPZ, RUN_HEADER, answer_reply, decode_request, failure_reply, reply_format, request_format,
)  # fmt: skip
from mha_ep.serve.status import RequestError, failing_node, run_status

TYPES = {"ids": "tensor(int64)", "mask": "tensor(int32)", "x": "tensor(float)", "flag": "tensor(bool)"}


def npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_the_content_type_decides_the_format_and_a_missing_one_is_read_off_the_body():
    assert request_format("application/json; charset=utf-8", b"{}") == JSON
    assert request_format("application/x-npz", b"") == NPZ and request_format("application/octet-stream", b"") == NPZ
    assert request_format(None, npz(a=np.zeros(1))) == NPZ and request_format("", b'{"inputs": {}}') == JSON
    with pytest.raises(RequestError, match="Content-Type 'text/plain' is neither application/json nor") as caught:
        request_format("text/plain", b"hello")
    assert caught.value.status == 415


def test_the_answer_takes_the_format_accept_names_else_the_requests():
    assert reply_format("application/x-npz", JSON) == NPZ
    assert reply_format("text/html, application/json;q=0.9", NPZ) == JSON
    assert reply_format("*/*", NPZ) == NPZ and reply_format(None, JSON) == JSON


def test_json_numbers_take_the_inputs_type_where_that_loses_nothing():
    body = json.dumps({"inputs": {"ids": [[1, 2]], "mask": [[1, 0]], "x": [[1, 2.5]], "flag": [True]},
                       "outputs": ["y"]}).encode()  # fmt: skip
    feeds, outputs, kind = decode_request(JSON, body, None, TYPES)
    assert {n: a.dtype.name for n, a in feeds.items()} == {"ids": "int64", "mask": "int32", "x": "float32",
                                                           "flag": "bool"}  # fmt: skip
    assert outputs == ["y"] and kind == JSON and feeds["x"].tolist() == [[1.0, 2.5]]


def test_json_numbers_that_would_lose_something_keep_their_type_for_onnxruntimes_check():
    body = json.dumps({"inputs": {"ids": [[1.5]], "mask": [[2**40]], "flag": [1]}}).encode()
    feeds, _, _ = decode_request(JSON, body, "a, b", TYPES)
    assert {n: a.dtype.name for n, a in feeds.items()} == {"ids": "float64", "mask": "int64", "flag": "int64"}
    assert decode_request(JSON, body, "a, b", TYPES)[1] == ["a", "b"]  # ?outputs=a,b


@pytest.mark.parametrize("body, message", [
    (b"not json", "the body is not JSON (Expecting value"),
    (b'{"feeds": {}}', 'the JSON body must be an object {"inputs"'),
    (b'{"inputs": {"ids": [[1, 2], [3]]}}', "input 'ids' is not a rectangular array of numbers"),
    (b'{"inputs": {"ids": [["a"]]}}', "input 'ids' is not a rectangular array of numbers (read as <U1"),
    (b'{"inputs": {}, "outputs": "y"}', "\"outputs\" must be a list of output names, got 'y'"),
    (b"\xff\xfe", "the body is not JSON"),
])  # fmt: skip
def test_a_body_that_is_not_readable_json_is_a_400_that_says_why(body, message):
    with pytest.raises(RequestError) as caught:
        decode_request(JSON, body, None, TYPES)
    assert caught.value.status == 400 and str(caught.value).startswith(message), str(caught.value)


def test_npz_bodies_carry_arrays_as_they_are_and_bad_ones_are_a_400():
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    feeds, outputs, kind = decode_request(NPZ, npz(ids=ids), "y", TYPES)
    assert kind == NPZ and outputs == ["y"] and feeds["ids"].dtype == np.int32 and np.array_equal(feeds["ids"], ids)
    for body in (b"PK\x03\x04 not a zip", npz(ids=np.array([object()], dtype=object)), b""):
        with pytest.raises(RequestError, match="the body is not a readable .npz archive of arrays"):
            decode_request(NPZ, body, None, TYPES)


def test_a_json_answer_reads_back_to_the_same_float32_bits():
    rng = np.random.default_rng(0)
    value = (rng.standard_normal((2, 3, 4)) * 10.0 ** rng.integers(-30, 30, (2, 3, 4))).astype(np.float32)
    reply = answer_reply(("y",), (value,), {"requests": 2}, JSON)
    data = json.loads(reply.body)
    assert reply.status == 200 and data["dtypes"] == {"y": "float32"} and data["run"] == {"requests": 2}
    back = np.array(data["outputs"]["y"], dtype=np.float32)
    assert np.array_equal(back.view(np.int32), value.view(np.int32))


def test_an_npz_answer_carries_the_arrays_and_the_run_in_a_header():
    value = np.arange(4, dtype=np.float16)
    reply = answer_reply(("y",), (value,), {"requests": 1}, NPZ)
    with np.load(io.BytesIO(reply.body)) as archive:
        assert archive["y"].dtype == np.float16 and np.array_equal(archive["y"], value)
    assert json.loads(reply.headers[RUN_HEADER]) == {"requests": 1} and reply.media_type == NPZ


# ------------------------------------------------------------------ statuses
EMBED = ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running "
         "EmbedLayerNormalization node. Name:'EmbedLayerNormalization_0' Status Message: input index out of range")


@pytest.mark.parametrize("error, status, node", [
    (run_error("layer0/attention", "mha_ep MultiHeadAttention: key_padding_mask shape", 2), 400, "layer0/attention"),
    (run_error("attention", "mha_ep MultiHeadAttention: query hidden 6 not divisible by num_heads 4", 1), 500,
     "attention"),
    (ort_exception("InvalidArgument", EMBED), 400, "EmbedLayerNormalization_0"),
    (ort_exception("Fail", "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape "
                           "node. Name:'reshape_3' Status Message: cannot reshape"), 500, "reshape_3"),
    (ort_exception("RuntimeException", "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : out of memory"), 500, None),
    (ZeroDivisionError("a fault of ours"), 500, None),
])  # fmt: skip
def test_invalid_argument_is_a_400_and_every_other_failure_a_500_naming_its_node(error, status, node):
    assert run_status(error) == status and failing_node(error) == node
    body = json.loads(failure_reply(error, status).body)["error"]
    assert body["status"] == status and body["node"] == node and body["message"] == str(error)


def test_the_error_type_is_the_class_a_python_caller_catches():
    body = json.loads(failure_reply(run_error("n", "m", 2), 400).body)["error"]
    assert body["type"] == "InvalidArgument"
    assert json.loads(failure_reply(invalid_argument("Invalid input name: z"), 400).body)["error"]["type"] == \
        "InvalidArgument"  # fmt: skip
    assert json.loads(failure_reply(RequestError("x", 415), 415).body)["error"]["type"] == "RequestError"


def test_a_request_error_crosses_a_process_boundary():
    error = pickle.loads(pickle.dumps(RequestError("not JSON", 415)))
    assert str(error) == "not JSON" and error.status == 415
