"""`mha-ep compare` verdicts and exit codes (PASS 0, FAIL 1, CANNOT RUN 2, NOTHING CLAIMED 3) on the models a new
user brings: never a traceback, one line that says which side could not run and why."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.comparison import Verdict

from small_models import run_cli

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def one_node_model(node, inputs, outputs, ir_version=10):
    graph = helper.make_graph([node], "verdicts", inputs, outputs)
    return helper.make_model(graph, ir_version=ir_version, opset_imports=OPSETS)


def mha(num_heads=2, outputs=("o",), query_shape=(2, 3, 8), inputs="qkv", ir_version=10, output_shapes=None):
    node = helper.make_node(
        "MultiHeadAttention", list(inputs), list(outputs), domain="com.microsoft", num_heads=num_heads, name="mha"
    )
    shapes = {"q": list(query_shape), "k": [2, 3, 8], "v": [2, 3, 8]}
    return one_node_model(
        node,
        [helper.make_tensor_value_info(x, TP.FLOAT, shapes[x]) for x in inputs],
        [helper.make_tensor_value_info(o, TP.FLOAT, (output_shapes or {}).get(o)) for o in outputs if o],
        ir_version,
    )


def no_mha():
    return one_node_model(
        helper.make_node("Relu", ["x"], ["y"]),
        [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3])],
    )


def written(tmp_path, model, name="model.onnx"):
    path = tmp_path / name
    onnx.save(model, path)
    return str(path)


CASES = {
    # name: (model or bytes, verdict, words of the one-line reason)
    "empty file": (b"", Verdict.CANNOT_RUN, "cannot be loaded: " ),
    "IR version newer than ORT reads": (mha(ir_version=99), Verdict.CANNOT_RUN, "stock ORT cannot load this model"),
    "bad num_heads": (mha(num_heads=3), Verdict.CANNOT_RUN, "stock ORT cannot run this model"),
    "packed QKV of a wrong size": (
        mha(query_shape=(2, 3, 2, 2, 4), inputs="q"), Verdict.CANNOT_RUN, "stock ORT cannot run this model",
    ),
    "every MHA node declined": (mha(outputs=("o", "", "", "qk"), output_shapes={"qk": [1, 2, 3]}),
                                Verdict.NOTHING_CLAIMED, "were declined"),  # qk declared in a shape it is not
    "no MHA at all": (no_mha(), Verdict.NOTHING_CLAIMED, "has no com.microsoft::MultiHeadAttention"),
    "claimed and right": (mha(), Verdict.PASS, "within tolerance"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compare_verdict_exit_code_and_json(case, tmp_path):
    model, verdict, words = CASES[case]
    path = tmp_path / "model.onnx"
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    report = mha_ep.compare(str(path), backend="reference", repeat=1)
    assert report.verdict is verdict and words in report.reason, report.text()
    done = run_cli("compare", str(path), "--backend", "reference", "--json")
    assert "Traceback" not in done.stderr + done.stdout
    assert done.returncode == verdict.exit_code, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["verdict"] == verdict.value and words in data["reason"] and "\n" not in data["reason"]
    text = run_cli("compare", str(path), "--backend", "reference", "-q")
    assert text.returncode == verdict.exit_code
    assert f"{verdict.value}: " in text.stdout.splitlines()[-1]
    assert "Traceback" not in text.stderr and "[E:onnxruntime" not in text.stderr, text.stderr


def test_exit_codes_are_distinct():
    assert sorted(v.exit_code for v in Verdict) == [0, 1, 2, 3, 4]


def test_nothing_claimed_is_never_pass():
    report = mha_ep.compare(no_mha(), backend="reference", repeat=1)
    assert report.verdict is Verdict.NOTHING_CLAIMED and not report.passed


def test_compare_fail_verdict_is_exit_1(tmp_path):
    """A plugin output outside tolerance: verdict FAIL (an --atol/--rtol of 0 makes any rounding a mismatch)."""
    path = written(tmp_path, mha())
    done = run_cli("compare", path, "--backend", "reference", "--atol", "0", "--rtol", "0", "--seed", "1", "--json")
    data = json.loads(done.stdout)
    if data["outputs"][0]["max_abs"] == 0:
        pytest.skip("the reference backend matched stock ORT bit for bit on these feeds")
    assert done.returncode == 1 and data["verdict"] == "FAIL"


@pytest.mark.parametrize("content", [b"", "truncated"])
def test_partition_of_an_empty_or_truncated_file_is_one_line_exit_2(tmp_path, content):
    path = tmp_path / "bad.onnx"
    whole = mha().SerializeToString()
    path.write_bytes(whole[: len(whole) // 2] if content == "truncated" else content)
    done = run_cli("partition", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "is not a readable ONNX model" in done.stderr, done.stderr
    as_json = run_cli("partition", str(path), "--json")
    assert as_json.returncode == 2 and "is not a readable ONNX model" in json.loads(as_json.stdout)["error"]


def test_a_huge_dim_is_one_line_exit_2(tmp_path):
    model = one_node_model(
        helper.make_node("MultiHeadAttention", ["q", "q", "q"], ["o"], domain="com.microsoft", num_heads=2),
        [helper.make_tensor_value_info("q", TP.FLOAT, ["batch", "sequence", 8])],
        [helper.make_tensor_value_info("o", TP.FLOAT, None)],
    )
    path = written(tmp_path, model)
    for value in ("99999999999999", "2000000000"):
        done = run_cli("compare", path, "--dim", f"batch={value}", "--backend", "reference")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") <= 1, done.stderr
        assert "batch" in done.stderr


def test_compare_saves_feeds_that_reproduce_the_run(tmp_path):
    path = written(tmp_path, mha())
    feeds = tmp_path / "feeds.npz"
    first = run_cli("compare", path, "--backend", "reference", "--seed", "5", "--save-feeds", str(feeds), "--json")
    assert first.returncode == 0, first.stderr
    again = run_cli("compare", path, "--backend", "reference", "--feeds", str(feeds), "--json")
    assert again.returncode == 0
    assert json.loads(first.stdout)["outputs"] == json.loads(again.stdout)["outputs"]
    with np.load(feeds) as data:
        assert sorted(data.files) == ["k", "q", "v"]
