"""Edge cases from an adversarial review of the CPU paths: each test reproduced one real bug (the docstrings say
what was wrong and what is expected) and now guards its fix.

Every test builds its own small model; stock ORT CPU is the oracle wherever it can run.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.feeds import random_feeds
from mha_models import plugin_session

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def model_of(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "review", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def one_mha(attrs=None, node_inputs=("q", "k", "v"), extra_nodes=(), outputs=None, extra_inputs=(), name="mha"):
    """q, k, v (2, 3, 8) float32 -> MultiHeadAttention -> out, plus optional extra nodes/inputs/outputs."""
    attrs = {"num_heads": 2} if attrs is None else attrs
    node = helper.make_node(
        "MultiHeadAttention", list(node_inputs), ["out"], domain="com.microsoft", name=name, **attrs
    )
    inputs = [helper.make_tensor_value_info(x, TP.FLOAT, [2, 3, 8]) for x in "qkv"] + list(extra_inputs)
    outputs = outputs or [helper.make_tensor_value_info("out", TP.FLOAT, [2, 3, 8])]
    return model_of([node, *extra_nodes], inputs, outputs)


def qkv_feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {x: rng.standard_normal((2, 3, 8)).astype(np.float32) for x in "qkv"}


def run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "mha_ep", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


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
    output of a node the gate declined (it asks for qk) is reported under "per claimed node" - a stock-vs-stock
    comparison presented as plugin coverage. Only the claimed node's output may be listed."""
    nodes = [
        helper.make_node("MultiHeadAttention", ["x", "x", "x"], ["a"], domain="com.microsoft", num_heads=2),
        helper.make_node("MultiHeadAttention", ["a", "a", "a"], ["o", "", "", "qk"], domain="com.microsoft", num_heads=2),
    ]
    model = model_of(
        nodes,
        [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 8])],
        [helper.make_tensor_value_info("o", TP.FLOAT, None), helper.make_tensor_value_info("qk", TP.FLOAT, None)],
    )
    report = mha_ep.compare(model, backend="reference", per_node=True, repeat=1)
    assert (report.partition.claimed, report.partition.declined) == (1, 1)
    assert len(report.nodes) == 1, [c.name for c in report.nodes]
    assert report.nodes[0].name.endswith("-> a")


# -------------------------------------------------------------------------------------------------------- feeds
def test_random_feeds_for_a_scalar_bool_input_are_an_array():
    """feeds._random_tensor: for a 0-d bool input `rng.random(()) < 0.8` is a NumPy bool scalar, not an ndarray;
    ORT refuses it ("Unable to handle object of type <class 'numpy.bool'>") and compare() crashes. Scalar bool
    inputs are common (e.g. use_cache_branch / flags). Expected: a 0-d ndarray and a passing compare."""
    extra_in = [helper.make_tensor_value_info("flag", TP.BOOL, [])]
    model = one_mha(
        extra_nodes=[helper.make_node("Identity", ["flag"], ["flag_out"])],
        extra_inputs=extra_in,
        outputs=[helper.make_tensor_value_info("out", TP.FLOAT, None), helper.make_tensor_value_info("flag_out", TP.BOOL, [])],
    )
    feeds = random_feeds(model)
    assert isinstance(feeds["flag"], np.ndarray) and feeds["flag"].shape == ()
    assert mha_ep.compare(model, backend="reference", repeat=1).passed


def test_random_feeds_keep_total_sequence_length_consistent_with_past_and_sequence():
    """feeds._dim_value matches DEFAULT_DIMS by substring, so `sequence_length`, `past_sequence_length` and
    `total_sequence_length` (ORT's own GPT-2/LLaMA export names) all become 8. A (batch, total_sequence_length)
    mask then has T=8 while the node's T is past + sequence = 16: the "valid" random feeds are invalid and
    compare() raises MhaRunError before comparing anything. Expected: random feeds the model accepts (e.g.
    total = past + sequence, or a past default that makes them consistent)."""
    node = helper.make_node(
        "MultiHeadAttention", ["q", "k", "v", "", "mask", "", "past_k", "past_v"], ["out", "present_k", "present_v"],
        domain="com.microsoft", name="mha", num_heads=2,
    )
    inputs = [helper.make_tensor_value_info(x, TP.FLOAT, ["batch_size", "sequence_length", 8]) for x in "qkv"]
    inputs += [
        helper.make_tensor_value_info(x, TP.FLOAT, ["batch_size", 2, "past_sequence_length", 4])
        for x in ("past_k", "past_v")
    ]
    inputs.append(helper.make_tensor_value_info("mask", TP.INT32, ["batch_size", "total_sequence_length"]))
    outputs = [helper.make_tensor_value_info(x, TP.FLOAT, None) for x in ("out", "present_k", "present_v")]
    model = model_of([node], inputs, outputs)
    feeds = random_feeds(model)
    assert feeds["mask"].shape[1] == feeds["past_k"].shape[2] + feeds["q"].shape[1]
    assert mha_ep.compare(model, backend="reference", repeat=1).passed


# ------------------------------------------------------------------------------------------------------ session
def test_session_run_with_iobinding_raises_mha_run_error():
    """mha_ep.InferenceSession installs its run context (its own backend + the MhaRunError channel) only in
    `run`; `run_with_iobinding` (and `run_with_ort_values`) reach the ORT session through `__getattr__`, so a
    failing claimed node silently yields NaN outputs (logged only) and the op runs on the process-default backend
    ("auto") instead of the session's. Expected: the same MhaRunError as `run`."""
    model = one_mha()
    for value in model.graph.input:
        value.type.tensor_type.ClearField("shape")  # shapes decided at run time
    session = mha_ep.InferenceSession(model, backend="reference")
    feeds = qkv_feeds()
    feeds["k"] = feeds["v"] = np.zeros((2, 3, 6), np.float32)  # key hidden 6 != query hidden 8
    with pytest.raises(mha_ep.MhaRunError):
        session.run(None, feeds)  # the documented channel works through run
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("out")
    with pytest.raises(mha_ep.MhaRunError):
        session.run_with_iobinding(binding)


# ---------------------------------------------------------------------------------------------------- partition
def test_partition_declines_attributes_of_the_wrong_type():
    """attributes_from_mapping converts with int()/float() without checking the ONNX attribute type, so a node
    with num_heads given as a FLOAT attribute (2.0) is claimed. The plugin node copies the FLOAT attribute, and
    creating the session then fails: "Unable to find attribute 'num_heads' due to 'Attribute name and type don't
    match'" (other wrong types - INTS, non-numeric STRING - make partition() itself raise TypeError/ValueError).
    Expected: the node is declined with a reason naming num_heads (ORT also rejects it, with its own message)."""
    model = one_mha(attrs={"num_heads": 2.0})
    (decision,) = mha_ep.partition(model).decisions
    assert not decision.claimed and decision.subject == "num_heads"


def test_partition_declines_a_node_without_query_instead_of_crashing():
    """decide_node: when the query slot is "" the rules see query absent and pass (every query rule needs a
    shape), and then `inputs[0].dtype` dereferences None: partition() raises AttributeError instead of giving
    the node a Decision. Expected: declined, with a reason about the query."""
    model = one_mha(node_inputs=("", "k", "v"))
    (decision,) = mha_ep.partition(model).decisions
    assert not decision.claimed and decision.subject == "query"


def test_saved_partitioned_model_has_ordinary_file_permissions(tmp_path):
    """save_model writes through tempfile.mkstemp, whose file is mode 0600, and os.replace keeps that mode: the
    model written by `mha-ep partition -o` (or over an existing 0644 file) is unreadable to other users, e.g. a
    serving account. Expected: the mode onnx.save would give (0666 & ~umask)."""
    from mha_ep.model_io import save_model

    reference, target = tmp_path / "reference.onnx", tmp_path / "partitioned.onnx"
    onnx.save(one_mha(), reference)
    save_model(mha_ep.partition(one_mha()).model, target)
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_dim_without_value_is_a_one_line_error(tmp_path):
    """cli._dims raises argparse.ArgumentTypeError from inside cmd_compare (not from an argparse `type=`), and
    main() catches only FileNotFoundError/ValueError/MhaEpError: `--dim batch` prints a traceback and exits 1,
    which the CLI documents as "outputs outside tolerance". Expected: one-line error, exit 2."""
    source = tmp_path / "m.onnx"
    onnx.save(one_mha(), source)
    done = run_cli("compare", str(source), "--backend", "reference", "--dim", "batch")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--dim expects NAME=VALUE" in done.stderr


def test_cli_partition_output_to_a_directory_is_a_one_line_error(tmp_path):
    """`mha-ep partition IN -o DIR`: save_model's os.replace raises IsADirectoryError (NotADirectoryError for
    "DIR/"), an OSError that main() does not catch: a traceback instead of the one-line error the CLI gives for
    other bad paths. Expected: exit 2, one line naming the path."""
    source = tmp_path / "m.onnx"
    onnx.save(one_mha(), source)
    (tmp_path / "out").mkdir()
    done = run_cli("partition", str(source), "-o", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


def test_causal_lowest_is_added_to_a_huge_negative_attention_bias(run_backend, rng):
    """ORT adds its causal mask (lowest at future keys) to score + attention_bias; with a Hugging Face style
    combined mask as attention_bias (float32 min at padded and future keys), rows that see only padding are
    decided by score + bias + lowest. Every backend (and on the GPU both cuda paths) must give stock ORT's rows."""
    b, s, n, h = 2, 5, 2, 8
    lowest = np.finfo(np.float32).min
    bias = np.where(np.triu(np.ones((s, s), bool), 1), lowest, 0.0).astype(np.float32)[None, None].repeat(b, 0)
    bias[0, :, :, :2] = lowest  # left padding of batch 0
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "attention_bias"], ["out"],
                            domain="com.microsoft", name="mha", num_heads=n, unidirectional=1)  # fmt: skip
    inputs = [helper.make_tensor_value_info(x, TP.FLOAT, [b, s, n * h]) for x in "qkv"]
    inputs.append(helper.make_tensor_value_info("attention_bias", TP.FLOAT, [b, 1, s, s]))
    model = model_of([node], inputs, [helper.make_tensor_value_info("out", TP.FLOAT, [b, s, n * h])])
    feeds = {x: rng.standard_normal((b, s, n * h)).astype(np.float32) for x in "qkv"}
    feeds["attention_bias"] = bias
    import onnxruntime

    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    actual = plugin_session(model, run_backend).run(None, feeds)[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
