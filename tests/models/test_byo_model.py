"""Bringing your own model: tolerance by compute dtype, lift reasons in the report, how to get MHA nodes, the
onnxruntime-shaped API (SessionOptions second, PartitionResult.save, modules named like modules), the shipped
models from any directory, `mha-ep --version` and a missing onnxruntime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.comparison import compare_arrays, compute_dtype
from mha_ep.feeds import random_feeds

from lift_models import attention_model
from small_models import OPSETS


def run_cli(*args, cwd=None, prelude=""):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    code = f"{prelude}\nimport sys\nfrom mha_ep.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def fp16_compute_model():
    """float32 in and out, float16 inside: what convert_float_to_float16(keep_io_types=True) makes."""
    nodes = [helper.make_node("Cast", [f"{x}32"], [x], to=TP.FLOAT16) for x in "qkv"]
    nodes.append(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=2, name="mha"))
    nodes.append(helper.make_node("Cast", ["o"], ["o32"], to=TP.FLOAT))
    graph = helper.make_graph(
        nodes, "keep_io_types",
        [helper.make_tensor_value_info(f"{x}32", TP.FLOAT, [2, 5, 16]) for x in "qkv"],
        [helper.make_tensor_value_info("o32", TP.FLOAT, [2, 5, 16])],
    )  # fmt: skip
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def one_mha(name="mha"):
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=2, name=name)
    graph = helper.make_graph(
        [node], "one",
        [helper.make_tensor_value_info(x, TP.FLOAT, [2, 3, 8]) for x in "qkv"],
        [helper.make_tensor_value_info("o", TP.FLOAT, [2, 3, 8])],
    )  # fmt: skip
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


# ------------------------------------------------------------------------------------------ 2. tolerances
def test_float16_compute_behind_float32_io_gets_the_float16_tolerance():
    model = fp16_compute_model()
    assert compute_dtype(model) == "float16"
    report = mha_ep.compare(model, backend="reference", repeat=1)
    (output,) = report.outputs
    assert output.dtype == "float32" and output.tolerance == pytest.approx(2e-2), report.text()
    assert report.passed and "computes in float16" in report.text()


def test_float32_models_keep_the_float32_tolerance():
    report = mha_ep.compare(one_mha(), backend="reference", repeat=1)
    assert report.compute_dtype == "float32" and report.outputs[0].tolerance == pytest.approx(1e-4)


def test_atol_and_rtol_override_the_defaults():
    expected = np.array([1.0, 100.0])
    actual = expected + np.array([0.05, 0.5])
    assert not compare_arrays("x", actual, expected).passed
    assert compare_arrays("x", actual, expected, atol=0.06, rtol=0.006).passed  # 0.05 <= atol, 0.5 <= 100 rtol
    assert not compare_arrays("x", actual, expected, atol=0.06, rtol=0.004).passed
    assert not compare_arrays("x", actual, expected, atol=0.0, rtol=0.0).passed


def test_cli_atol_rtol_reach_the_report(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(fp16_compute_model(), path)
    done = run_cli("compare", str(path), "--backend", "reference", "--atol", "0.5", "--rtol", "0.25", "--json")
    data = json.loads(done.stdout)
    assert done.returncode == 0 and data["compute_dtype"] == "float16"
    assert (data["outputs"][0]["atol"], data["outputs"][0]["rtol"]) == (0.5, 0.25)


# ------------------------------------------------------------------------------------------ 3. lift reasons
def test_every_attention_node_not_lifted_is_reported_with_its_reason(tmp_path):
    model, _ = attention_model(mask=("2d",))
    for value in model.graph.input:  # the mask's rank becomes unknown
        if value.name == "mask":
            value.type.tensor_type.ClearField("shape")
    result = mha_ep.partition(model, lift_attention=True)
    assert result.lifted_attention == 0 and len(result.not_lifted) == 1
    assert "mask_index 'mask' has unknown rank" in result.report()
    assert "lift_attention=True" not in result.report()  # it was passed: no hint to pass it
    data = json.loads(result.to_json())
    assert data["not_lifted"][0]["node"] == "attn0" and "has unknown rank" in data["not_lifted"][0]["reason"]
    path = tmp_path / "attention.onnx"
    onnx.save(model, path)
    done = run_cli("partition", str(path), "--lift-attention")
    assert "not lifted  attn0: " in done.stdout and "has unknown rank" in done.stdout, done.stdout
    assert "lift_attention=True" not in done.stdout
    feeds = tmp_path / "feeds.npz"  # the mask has no shape, so random feeds cannot be made: give them
    np.savez(feeds, x=np.ones((2, 7, 24), np.float32), mask=np.ones((2, 7), np.int32))
    done = run_cli("compare", str(path), "--lift-attention", "--backend", "reference", "--feeds", str(feeds), "--json")
    compared = json.loads(done.stdout)
    assert compared["verdict"] == "NOTHING CLAIMED" and done.returncode == 3
    assert "has unknown rank" in compared["partition"]["not_lifted"][0]["reason"]
    assert not any("lift_attention=True" in n for n in compared["partition"]["notes"])


def test_the_lift_hint_appears_only_without_lift_attention():
    model, _ = attention_model(mask=("4d",))
    assert "lift_attention=True" in mha_ep.partition(model).report()
    assert "lift_attention=True" not in mha_ep.partition(model, lift_attention=True).report()


def test_a_model_without_mha_says_how_to_get_mha_nodes():
    model, _ = attention_model()
    model.graph.node[0].op_type = "Identity"
    del model.graph.node[0].input[1:]
    del model.graph.node[0].attribute[:]
    model.graph.node[0].domain = ""
    report = mha_ep.partition(model).report()
    assert "--use_multi_head_attention" in report and "onnxscript" in report and "--lift-attention" in report


def test_random_feeds_for_an_input_without_shape_are_a_clear_error():
    model = one_mha()
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(ValueError, match="'q' has no recorded shape"):
        random_feeds(model)


def test_long_node_names_keep_the_report_aligned():
    model = one_mha(name="encoder.layer.11.attention.self.MultiHeadAttention_with_a_long_name")
    second = helper.make_node("MultiHeadAttention", ["o", "o", "o"], ["o2", "", "", "qk"], domain="com.microsoft",
                              num_heads=2, name="short")  # fmt: skip
    model.graph.node.append(second)
    model.graph.output.append(helper.make_tensor_value_info("o2", TP.FLOAT, None))
    model.graph.output.append(helper.make_tensor_value_info("qk", TP.FLOAT, [1, 2, 3]))  # not what it writes
    lines = [line for line in mha_ep.partition(model).report().splitlines() if "declined  " in line]
    assert lines and lines[0].index("mha_ep MultiHeadAttention:") > len("  declined  short:  ")
    report = mha_ep.compare(model, backend="reference", per_node=True, repeat=1)
    rows = [line for line in report.text().splitlines() if line.startswith("  ok") or line.startswith("  FAIL")]
    assert len({row.index("float32") for row in rows}) == 1, report.text()


# ------------------------------------------------------------------------------------------ 4. the API
def test_inference_session_takes_session_options_second_like_onnxruntime(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(one_mha(), path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = mha_ep.InferenceSession(str(path), options, ["CPUExecutionProvider"], None, backend="reference")
    assert session.partition.claimed == 1 and session.get_providers() == ["CPUExecutionProvider"]
    from_bytes = mha_ep.InferenceSession(path.read_bytes(), options, backend="reference")
    feeds = {x: np.ones((2, 3, 8), np.float32) for x in "qkv"}
    np.testing.assert_array_equal(session.run(None, feeds)[0], from_bytes.run(None, feeds)[0])
    with pytest.raises(TypeError, match="backend='reference'"):
        mha_ep.InferenceSession(str(path), "reference")


def test_partition_result_save_writes_a_loadable_model(tmp_path):
    result = mha_ep.partition(one_mha())
    result.save(tmp_path / "out.onnx")
    saved = onnx.load(tmp_path / "out.onnx")
    assert [n.domain for n in saved.graph.node if n.op_type == "MultiHeadAttention"] == ["mha_ep"]


def test_partition_and_compare_are_plain_functions_and_their_helpers_have_modules_of_their_own():
    import mha_ep.comparison
    import mha_ep.graph.model_io
    import mha_ep.graph.partition

    assert isinstance(mha_ep.partition, types.FunctionType) and isinstance(mha_ep.compare, types.FunctionType)
    assert mha_ep.partition is mha_ep.graph.partition.partition  # importing the pass's module leaves it alone
    assert callable(mha_ep.graph.model_io.save_model) and callable(mha_ep.comparison.compare_arrays)
    assert mha_ep.partition(one_mha()).claimed == 1
    assert mha_ep.compare(one_mha(), backend="reference", repeat=1).passed


def test_shipped_models_are_found_from_any_directory(tmp_path):
    code = ("import mha_ep; p = mha_ep.shipped_model('bert_random_mask2d_fp32.onnx'); "
            "print(p.is_file(), mha_ep.partition(str(p)).claimed)")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.stdout.split() == ["True", "2"], done.stderr
    with pytest.raises(FileNotFoundError, match="the shipped files are"):
        mha_ep.shipped_model("whisper_small.onnx")


# ------------------------------------------------------------------------------------------ 5. environment
def test_version_prints_the_environment():
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"mha_ep {mha_ep.__version__}")
    assert lines[1].startswith(f"onnxruntime: {ort.__version__} (distribution onnxruntime")
    assert lines[1].count(ort.__version__) == 1, lines[1]  # the version once, not again beside the distribution
    assert any(line.startswith("onnxruntime-extensions: ") for line in lines)
    assert any(line.startswith("CuPy: ") for line in lines)
    assert any(line.startswith("CUDA device") for line in lines)
    assert any(line.startswith('backend "auto": ') for line in lines)


@pytest.mark.parametrize("command", [["demo"], ["partition", "model.onnx"], ["compare", "model.onnx", "--json"]])
def test_a_missing_onnxruntime_is_reported_up_front(command):
    done = run_cli(*command, prelude="import sys; sys.modules['onnxruntime'] = None")  # simulates its absence
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "onnxruntime is not installed" in done.stderr and "mha-ep[cpu]" in done.stderr
    version = run_cli("--version", prelude="import sys; sys.modules['onnxruntime'] = None")
    assert version.returncode == 0 and "onnxruntime: not installed" in version.stdout


def test_partition_without_onnxruntime_raises_one_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match="mha-ep\\[cpu\\]"):
        mha_ep.partition(one_mha())


# ------------------------------------------------------------------------------------------ 7. one tool
def test_global_flags_work_after_the_subcommand_and_every_option_has_help(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(one_mha(), path)
    assert run_cli("partition", str(path), "-v").returncode == 0
    assert run_cli("-v", "partition", str(path)).returncode == 0
    from mha_ep.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert name == "bench" or action.help, f"mha-ep {name} {action.option_strings or action.dest} has no help"


# ------------------------------------------------------------------------------------------ 6. ORT internals
def test_private_symbolic_inference_is_used_only_on_tested_ort_releases():
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from mha_ep.claim.shapes import private_symbolic_api_usable

    assert private_symbolic_api_usable("1.31.1", SymbolicShapeInference)
    assert private_symbolic_api_usable("1.23.2", SymbolicShapeInference)
    assert not private_symbolic_api_usable("1.40.0", SymbolicShapeInference)
    assert not private_symbolic_api_usable("1.19.2", SymbolicShapeInference)
    assert not private_symbolic_api_usable("not a version", SymbolicShapeInference)
    assert not private_symbolic_api_usable("1.31.1", type("Renamed", (), {"infer_shapes": staticmethod(lambda m: m)}))


def test_an_untested_ort_release_takes_the_public_entry_point(monkeypatch, tmp_path):
    """Same claims through the public entry point; its debugging file never lands in the user's folder."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "9.0.0")
    monkeypatch.chdir(tmp_path)
    partial = one_mha()
    partial.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_value")  # a dim nobody can infer
    assert mha_ep.partition(one_mha()).claimed == 1
    assert mha_ep.partition(partial).claimed == 1
    assert list(tmp_path.iterdir()) == []
