"""``mha-ep serve`` before anything starts: a model that cannot be read, or an option out of range, is one line
and exit 2, with no Ray started (the serve extra missing is the same: one line naming the extra). The command
serving and stopping is tests/serve/test_serve_cli.py."""

from __future__ import annotations

import json

import pytest

from mha_ep.serve import missing_extra
from small_models import run_cli

MODEL = "models/bert_random_mask2d_fp32.onnx"


@pytest.mark.parametrize("args, message", [
    (["no_such_model.onnx"], "no ONNX model at 'no_such_model.onnx'"),
    (["README.md"], "'README.md' is not a readable ONNX model"),
    ([MODEL, "--max-batch", "0"], "mha_ep.serve: max_batch must be at least 1 (1: batching off), got 0"),
    ([MODEL, "--replicas", "0"], "mha_ep.serve: replicas must be at least 1, got 0"),
    ([MODEL, "--route-prefix", "bert"], "mha_ep.serve: route_prefix must be a path starting with '/', got 'bert'"),
])  # fmt: skip
def test_what_cannot_be_served_is_one_line_and_exit_2(args, message):
    from harness import REPO

    done = run_cli("serve", *args, cwd=REPO)
    expected = missing_extra() or message
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"mha-ep serve: error: {expected}"), lines


def test_json_errors_are_one_object():
    done = run_cli("serve", "no_such_model.onnx", "--json")
    data = json.loads(done.stdout)
    assert done.returncode == 2 and data["command"] == "serve" and data["exit_code"] == 2 and data["error"]
