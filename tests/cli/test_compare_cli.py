"""compare (per output and per node), random feeds, and the mha-ep command line."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.feeds import random_feeds

from mha_models import chain_model
from small_models import model_of, one_mha, run_cli


def test_random_feeds_are_valid_for_the_model():
    feeds = random_feeds(chain_model(), seed=3, dims={"sequence": 6})
    assert feeds["input_ids"].shape == (2, 6) and feeds["input_ids"].max() < 50 and feeds["input_ids"].min() >= 0
    mask = feeds["attention_mask"]
    assert mask.dtype == np.int32 and set(np.unique(mask)) <= {0, 1} and (mask[:, 0] == 1).all()


def test_compare_per_node_reports_every_claimed_node_in_graph_order():
    report = mha_ep.compare(chain_model(), backend="reference", per_node=True, repeat=1)
    assert report.passed, report.text()
    assert [c.name for c in report.nodes] == ["layer0 -> a", "layer1 -> o"]
    assert all(c.max_rel < 1e-5 for c in report.nodes)
    assert [c.name for c in report.outputs] == ["o"]


def test_compare_flags_a_wrong_backend():
    class OffByOne:
        name, device = "off-by-one", "test"

        def run(self, problem, borrow_outputs=False):
            from mha_ep.engine.reference import run_reference

            result = run_reference(problem)
            result.output_BSDv = result.output_BSDv + 1.0
            return result

    import mha_ep.session as session_module

    original = session_module.resolve_backend
    session_module.resolve_backend = lambda name, device_id=0: OffByOne()
    try:
        report = mha_ep.compare(chain_model(), per_node=True, repeat=1)
    finally:
        session_module.resolve_backend = original
    assert not report.passed
    assert report.nodes[0].max_abs == pytest.approx(1.0, abs=1e-5)
    assert "FAIL" in report.text()


def test_cli_partition_writes_the_model_and_prints_the_report(tmp_path):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(chain_model(qk_on_second=True), source)
    done = run_cli("partition", str(source), "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert "2 MultiHeadAttention node(s), 1 claimed, 1 declined" in done.stdout
    assert "declined  layer1: mha_ep MultiHeadAttention: output 3 (qk) 'qk' is declared with shape" in done.stdout
    partitioned = onnx.load(target)
    assert [n.domain for n in partitioned.graph.node if n.op_type == "MultiHeadAttention"] == ["mha_ep", "com.microsoft"]
    as_json = json.loads(run_cli("partition", str(source), "--json").stdout)
    assert as_json["claimed"] == 1 and as_json["decisions"][1]["subject"] == "qk"


def test_cli_compare_exit_status_and_json(tmp_path):
    source = tmp_path / "chain.onnx"
    onnx.save(chain_model(), source)
    done = run_cli("compare", str(source), "--backend", "reference", "--per-node", "--dim", "sequence=5", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["passed"] and data["claimed"] == 2 and len(data["nodes"]) == 2
    assert data["outputs"][0]["shape"] == [2, 5, 8]


def test_cli_compare_says_when_stock_ort_cannot_be_the_oracle(tmp_path):
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=2)
    graph = helper.make_graph(
        [helper.make_node("Cast", [f"{x}32"], [x], to=TP.BFLOAT16) for x in "qkv"]
        + [node, helper.make_node("Cast", ["o"], ["o32"], to=TP.FLOAT)],
        "bf16",
        [helper.make_tensor_value_info(f"{x}32", TP.FLOAT, [1, 3, 8]) for x in "qkv"],
        [helper.make_tensor_value_info("o32", TP.FLOAT, [1, 3, 8])],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    source = tmp_path / "bf16.onnx"
    onnx.save(model, source)
    done = run_cli("compare", str(source), "--backend", "reference")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CANNOT RUN: stock ORT cannot load this model" in done.stdout, done.stdout


def test_cli_bad_paths_and_feeds_are_one_line_errors(tmp_path):
    done = run_cli("partition", str(tmp_path / "missing.onnx"))
    assert done.returncode == 2 and "error: no ONNX model at" in done.stderr and "Traceback" not in done.stderr
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    done = run_cli("compare", str(garbage))
    assert done.returncode == 2 and "CANNOT RUN: the model cannot be loaded" in done.stdout, done.stdout
    assert "is not a readable ONNX model" in done.stdout and "Traceback" not in done.stderr
    source, feeds = tmp_path / "chain.onnx", tmp_path / "feeds.npz"
    onnx.save(chain_model(), source)
    np.savez(feeds, input_ids=np.zeros((2, 4), np.int64))
    done = run_cli("compare", str(source), "--feeds", str(feeds), "--backend", "reference")
    assert done.returncode == 2 and "missing ['attention_mask']" in done.stderr, done.stderr


def test_partition_claims_mha_nodes_inside_subgraphs(tmp_path):
    """Once a note ("left to ORT"); now claimed (the pass's rule SUBGRAPHS), and the CLI's report names the path."""
    inner = helper.make_graph(
        [helper.make_node("MultiHeadAttention", ["x", "x", "x"], ["y"], domain="com.microsoft", num_heads=2)],
        "then", [], [helper.make_tensor_value_info("y", TP.FLOAT, [1, 3, 8])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "else", [], [helper.make_tensor_value_info("z", TP.FLOAT, [1, 3, 8])]
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["out"], then_branch=inner, else_branch=other)],
        "g",
        [helper.make_tensor_value_info("c", TP.BOOL, []), helper.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8])],
        [helper.make_tensor_value_info("out", TP.FLOAT, [1, 3, 8])],
    )
    model = helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    result = mha_ep.partition(model)
    assert [(d.where, d.claimed) for d in result.decisions] == [("If_0/then_branch/<unnamed>", True)]
    source = tmp_path / "if.onnx"
    onnx.save(model, source)
    done = run_cli("partition", str(source))
    assert done.returncode == 0 and "claimed   If_0/then_branch/<unnamed>" in done.stdout, done.stdout + done.stderr
    assert "control-flow" not in done.stdout


def test_cli_partition_output_is_written_whole(tmp_path):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(chain_model(), source)
    assert run_cli("partition", str(source), "-o", str(target)).returncode == 0
    onnx.checker.check_model(onnx.load(target))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mha_ep_")] == []


def test_bench_models_runs_the_shipped_models(tmp_path):
    done = run_cli("bench", "models", "--shipped-only", "--backend", "reference", "--repeat", "1", "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout)  # --json: one object on stdout, the table on stderr
    assert printed == json.loads((tmp_path / "bench_models.json").read_text())
    assert printed["backend"] == "reference" and printed["not_built"] == []
    rows = printed["rows"]
    assert [r["file"] for r in rows] == [
        "bert_random_mask2d_fp32.onnx", "whisper_random_decoder_fp32.onnx", "whisper_random_encoder_fp32.onnx"
    ]
    assert all(r["declined"] == 0 and r["max_rel_error"] < 1e-4 and r["plugin_ms"] > 0 for r in rows)
    assert "| BERT random-weight (shipped), B=8 S=128, 2D mask | 2/2 |" in done.stderr


def test_random_feeds_follow_casts_to_the_embedding_tables():
    from mha_ep.feeds import vocabulary_sizes
    from mha_ep.models import manifest

    model = onnx.load(manifest.model_path(manifest.entries()["bert_random_mask1d_fp32.onnx"]))
    assert vocabulary_sizes(model) == {"input_ids": 1000, "token_type_ids": 2}


def test_compare_over_many_feed_sets_reports_the_worst_and_shows_progress(tmp_path):
    lines = []
    report = mha_ep.compare(chain_model(), backend="reference", per_node=True, runs=3, repeat=1, progress=lines.append)
    assert report.passed, report.text()
    runs = [line for line in lines if line.startswith("[")]
    assert runs == [f"[{i}/3] running both sessions (feeds seed {i - 1})" for i in (1, 2, 3)], lines
    assert lines.index("stock ORT: loading the model ...") < lines.index("plugin: creating the session ...")
    single = [mha_ep.compare(chain_model(), backend="reference", seed=s, repeat=1).outputs[0].max_rel for s in range(3)]
    assert report.outputs[0].max_rel == max(single)
    assert "worst of 3 feed sets" in report.text()
    source = tmp_path / "chain.onnx"
    onnx.save(chain_model(), source)
    done = run_cli("compare", str(source), "--backend", "reference", "--runs", "2")
    assert done.returncode == 0 and "[2/2] running both sessions (feeds seed 1)" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------------------ compare
def test_compare_counts_equal_infinities_as_equal():
    """compare.errors: an output holding the same +-inf on both sides gives inf - inf = NaN, so max|d| and rel
    are NaN and the output is reported FAIL although plugin and stock ORT agree bit for bit (Log(Relu(x)) yields
    -inf wherever the attention output is negative). Equal infinities must count as equal, like equal NaNs."""
    extra = [helper.make_node("Relu", ["out"], ["r"]), helper.make_node("Log", ["r"], ["log_r"])]
    model = one_mha(extra_nodes=extra, outputs=[helper.make_tensor_value_info("log_r", TP.FLOAT, [2, 3, 8])])
    report = mha_ep.compare(model, backend="reference", repeat=1)
    (log_r,) = report.outputs
    assert np.isfinite(log_r.max_rel) and log_r.passed, report.text()
    assert report.passed


def test_compare_per_node_lists_only_claimed_nodes_when_nodes_are_unnamed():
    """compare matches claimed nodes to outputs by node *name*; with unnamed nodes every name is "", so the
    output of a node the gate declined (its qk output is declared in a shape it does not write) is reported under "per claimed node" - a stock-vs-stock
    comparison presented as plugin coverage. Only the claimed node's output may be listed."""
    nodes = [
        helper.make_node("MultiHeadAttention", ["x", "x", "x"], ["a"], domain="com.microsoft", num_heads=2),
        helper.make_node("MultiHeadAttention", ["a", "a", "a"], ["o", "", "", "qk"], domain="com.microsoft", num_heads=2),
    ]
    model = model_of(
        nodes,
        [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 8])],
        [helper.make_tensor_value_info("o", TP.FLOAT, None), helper.make_tensor_value_info("qk", TP.FLOAT, [1, 2, 3])],
    )
    report = mha_ep.compare(model, backend="reference", per_node=True, repeat=1)
    assert (report.partition.claimed, report.partition.declined) == (1, 1)
    assert len(report.nodes) == 1, [c.name for c in report.nodes]
    assert report.nodes[0].name.endswith("-> a")
