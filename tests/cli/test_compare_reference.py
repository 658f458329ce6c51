"""compare --reference: stock ORT on the fused model against stock ORT on the model before fusion, by name.

A fusion that drops a causal mask (what ORT's BERT fusion does to a decoder's self-attention) is built here by
hand: the reference computes causal attention from MatMuls and a Softmax; the 'fused' models compute it with one
MultiHeadAttention node, with and without ``unidirectional``."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import mha_ep
from mha_ep.comparison import Verdict

from small_models import OPSETS, run_cli

B, S, N, H = 2, 5, 2, 4
D = N * H


def weights(seed=3):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal((D, D)) * 0.5).astype(np.float32) for name in ("wq", "wk", "wv")}


def initializers(w):
    return [numpy_helper.from_array(array, name) for name, array in w.items()]


def projections():
    return [helper.make_node("MatMul", ["x", f"w{p}"], [p], name=f"proj_{p}") for p in "qkv"]


def unfused_model(w, causal=True, extra_input=None, output="out"):
    """Causal self-attention from MatMuls: softmax(q k^T / sqrt(H) + mask) v, heads split by Reshape/Transpose."""
    shape = numpy_helper.from_array(np.array([B, S, N, H], np.int64), "heads_shape")
    merged = numpy_helper.from_array(np.array([B, S, D], np.int64), "merged_shape")
    scale = numpy_helper.from_array(np.array(1.0 / np.sqrt(H), np.float32), "scale")
    mask = np.where(np.triu(np.ones((S, S), bool), 1), np.float32(-1e9), np.float32(0)) if causal else np.zeros((S, S), np.float32)
    nodes = projections()
    for p in "qkv":
        nodes.append(helper.make_node("Reshape", [p, "heads_shape"], [f"{p}_bsnh"]))
        perm = [0, 2, 3, 1] if p == "k" else [0, 2, 1, 3]
        nodes.append(helper.make_node("Transpose", [f"{p}_bsnh"], [f"{p}_heads"], perm=perm))
    nodes += [
        helper.make_node("MatMul", ["q_heads", "k_heads"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "causal_mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_heads"], ["context"]),
        helper.make_node("Transpose", ["context"], ["context_bsnh"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["context_bsnh", "merged_shape"], [output]),
    ]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, [B, S, D])]
    if extra_input:
        inputs.append(helper.make_tensor_value_info(extra_input, TP.FLOAT, [B, S, D]))
        nodes.append(helper.make_node("Identity", [extra_input], [f"{extra_input}_unused"]))
    graph = helper.make_graph(
        nodes, "unfused", inputs, [helper.make_tensor_value_info(output, TP.FLOAT, [B, S, D])],
        initializer=initializers(w) + [shape, merged, scale, numpy_helper.from_array(mask, "causal_mask")],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def fused_model(w, unidirectional: bool, extra_input=None):
    """The same attention as one MultiHeadAttention node (what a fusion makes), causal or not."""
    attrs = {"num_heads": N, **({"unidirectional": 1} if unidirectional else {})}
    nodes = projections() + [
        helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["out"], domain="com.microsoft", name="attention", **attrs)
    ]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, [B, S, D])]
    if extra_input:
        inputs.append(helper.make_tensor_value_info(extra_input, TP.FLOAT, [B, S, D]))
        nodes.append(helper.make_node("Identity", [extra_input], ["extra_out"]))
    graph = helper.make_graph(nodes, "fused", inputs, [helper.make_tensor_value_info("out", TP.FLOAT, [B, S, D])],
                              initializer=initializers(w))  # fmt: skip
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def test_a_faithful_fusion_passes():
    w = weights()
    report = mha_ep.compare(fused_model(w, unidirectional=True), backend="reference", reference=unfused_model(w))
    assert report.verdict is Verdict.PASS, report.text()
    assert [c.name for c in report.fusion] == ["out"] and report.fusion[0].max_rel < 1e-5
    assert "the fusion kept the reference's 1 output(s)" in report.reason


def test_a_fusion_that_dropped_the_causal_mask_is_named_as_the_fusion():
    w = weights()
    report = mha_ep.compare(fused_model(w, unidirectional=False), backend="reference", reference=unfused_model(w))
    assert report.verdict is Verdict.FUSION_CHANGED and report.verdict.exit_code == 4, report.text()
    assert report.fusion[0].max_rel > 0.05  # a real difference in the math, not rounding
    assert report.outputs and report.outputs[0].passed  # mha_ep matches stock ORT on the (wrong) fused model
    assert "the fusion changed the model's math" in report.reason
    assert "mha_ep matches stock ORT on the fused model there" in report.reason
    text = report.text()
    assert "the fusion: stock ORT on this model vs stock ORT on the reference" in text
    assert text.splitlines()[-1].startswith("FUSION CHANGED THE MODEL: ")


def test_without_the_reference_the_same_model_passes():
    """What the user saw before: mha_ep agrees with stock ORT on the broken graph, so compare alone says PASS."""
    report = mha_ep.compare(fused_model(weights(), unidirectional=False), backend="reference")
    assert report.verdict is Verdict.PASS and not report.fusion


def test_an_input_only_the_reference_has_is_reported_not_guessed():
    w = weights()
    report = mha_ep.compare(fused_model(w, True), backend="reference", reference=unfused_model(w, extra_input="cache"))
    assert report.verdict is Verdict.CANNOT_RUN
    assert "needs input(s) ['cache'] that this model does not have" in report.reason and "['x']" in report.reason


def test_an_input_only_the_fused_model_has_is_noted_and_not_fed_to_the_reference():
    w = weights()
    report = mha_ep.compare(fused_model(w, True, extra_input="cache"), backend="reference", reference=unfused_model(w))
    assert report.verdict is Verdict.PASS, report.text()
    assert any("input(s) only in this model, not fed to the reference: ['cache']" in note for note in report.notes)


def test_models_without_a_common_output_cannot_be_compared():
    w = weights()
    report = mha_ep.compare(fused_model(w, True), backend="reference", reference=unfused_model(w, output="context_out"))
    assert report.verdict is Verdict.CANNOT_RUN
    assert "share no output name" in report.reason and "context_out" in report.reason


def test_an_unreadable_reference_cannot_run(tmp_path):
    bad = tmp_path / "unfused.onnx"
    bad.write_bytes(b"not a model")
    report = mha_ep.compare(fused_model(weights(), True), backend="reference", reference=str(bad))
    assert report.verdict is Verdict.CANNOT_RUN and report.reason.startswith("the reference model cannot be loaded")


def test_cli_reference_exit_code_and_json(tmp_path):
    w = weights()
    fused, unfused = tmp_path / "fused.onnx", tmp_path / "unfused.onnx"
    onnx.save(fused_model(w, unidirectional=False), fused)
    onnx.save(unfused_model(w), unfused)
    done = run_cli("compare", str(fused), "--reference", str(unfused), "--backend", "reference", "-q")
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("FUSION CHANGED THE MODEL:")
    as_json = json.loads(run_cli("compare", str(fused), "--reference", str(unfused), "--backend", "reference",
                                 "--json").stdout)  # fmt: skip
    assert as_json["verdict"] == "FUSION CHANGED THE MODEL" and as_json["exit_code"] == 4
    assert as_json["reference"] == str(unfused) and as_json["fusion"][0]["passed"] is False
    onnx.save(fused_model(w, unidirectional=True), fused)
    assert run_cli("compare", str(fused), "--reference", str(unfused), "--backend", "reference", "-q").returncode == 0


@pytest.mark.parametrize("runs", [1, 3])
def test_every_feed_set_is_checked_against_the_reference(runs):
    w = weights()
    report = mha_ep.compare(fused_model(w, False), backend="reference", reference=unfused_model(w), runs=runs)
    assert report.verdict is Verdict.FUSION_CHANGED
