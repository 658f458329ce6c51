"""The batch plan, fits, runs, padding and cutting back (mha_ep/serve/batching.py): pure functions of the model
and the feeds, no Ray and no onnxruntime. Every refusal's sentence is checked."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.serve.batching import (
    BatchPlan, Fit, assemble, batch_dim_of, fit, plan_batching, runs, sequence_axis_problem, split,
)  # fmt: skip
from serve_models import OPSETS, attention_model, bert_feeds, bert_model, pooled_bert


def test_the_shipped_bert_pads_along_its_sequence_with_its_attention_mask():
    plan = plan_batching(bert_model())
    assert (plan.batch_dim, plan.sequence_dim, plan.mask) == ("batch", "sequence", "attention_mask")
    assert plan.padded_inputs == ("input_ids", "attention_mask", "token_type_ids")
    assert plan.cut_outputs == ("last_hidden_state",)
    assert "'attention_mask' is the key-padding mask of every MultiHeadAttention node" in plan.pad_reason


def test_a_mask_that_reaches_attention_as_embed_layer_normalizations_mask_index_pads_too():
    plan = plan_batching(onnx.load(str(mha_ep.shipped_model("bert_random_mask1d_fp32.onnx"))))
    assert plan.mask == "attention_mask" and plan.sequence_dim == "sequence", plan.describe()


def test_a_model_without_a_key_padding_mask_batches_equal_lengths_only():
    plan = plan_batching(attention_model())
    assert plan.can_batch and not plan.can_pad
    assert plan.pad_reason == ("no input of shape ('batch', S) is the key_padding_mask of every MultiHeadAttention "
                               "node: requests share a run only when their lengths are equal")  # fmt: skip


def test_a_node_that_mixes_positions_stops_padding_and_is_named():
    plan = plan_batching(pooled_bert())
    assert plan.can_batch and not plan.can_pad
    assert plan.pad_reason.startswith("node 'pool' (ReduceMean) may mix positions"), plan.pad_reason


def test_attention_that_reads_an_attention_bias_is_not_padded():
    dims = ["batch", "sequence", 8]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "mask", "bias"], ["out"],
                            domain="com.microsoft", name="mha", num_heads=2)  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, dims) for n in "qkv"] + [
        helper.make_tensor_value_info("mask", TP.INT32, ["batch", "sequence"]),
        helper.make_tensor_value_info("bias", TP.FLOAT, ["batch", 2, "rows", "keys"])]  # fmt: skip
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("out", TP.FLOAT, dims)])
    plan = plan_batching(helper.make_model(graph, opset_imports=OPSETS, ir_version=10))
    assert plan.pad_reason.startswith("node 'mha' (MultiHeadAttention) reads attention_bias, which padding would "
                                      "change"), plan.pad_reason  # fmt: skip


def test_the_batch_dim_must_be_one_symbolic_dim_first_everywhere():
    assert batch_dim_of({"x": ["b", "s"], "y": ["b", 3]}) == (
        "b", "every input and output starts with 'b': requests share a run along it")
    assert batch_dim_of({"x": [2, "s"], "y": ["b"]}) == (
        None, "'x' has 2 first, not a symbolic batch dim: each request runs alone")
    assert batch_dim_of({"x": ["b"], "y": ["n"]})[1] == (
        "the inputs and outputs start with different dims ({'x': 'b', 'y': 'n'}): each request runs alone")
    assert batch_dim_of({"x": None})[1] == "'x' has no batch axis (its shape is None): each request runs alone"


def test_the_sequence_dim_must_sit_once_at_axis_one():
    assert sequence_axis_problem({"x": ["b", "s"], "y": ["b", "s", 4]}, "s") == ""
    assert sequence_axis_problem({"x": ["b", 4, "s"]}, "s") == "'x' of shape ['b', 4, 's'] does not carry 's' once at axis 1"
    assert sequence_axis_problem({"x": ["b", "s", "s"]}, "s") != ""


# ------------------------------------------------------------------ fits and runs
PLAN = plan_batching(bert_model())


def test_a_request_fits_with_its_rows_and_length():
    item = fit(PLAN, bert_feeds(7, rows=2))
    assert (item.rows, item.length, item.paddable, item.alone) == (2, 7, True, "")


def test_a_request_whose_inputs_disagree_runs_alone_and_says_why():
    feeds = bert_feeds(7, rows=2)
    feeds["attention_mask"] = feeds["attention_mask"][:1]
    assert fit(PLAN, feeds).alone.startswith("its inputs disagree on 'batch': {'input_ids': (2, 7), "
                                             "'attention_mask': (1, 7)")  # fmt: skip
    feeds = bert_feeds(7)
    feeds["token_type_ids"] = feeds["token_type_ids"][:, :5]
    assert fit(PLAN, feeds).alone.startswith("its inputs disagree on 'sequence'")
    assert fit(PLAN, bert_feeds(7, rows=0)).alone == "it has no rows ('batch' is 0)"


def test_a_mask_row_that_keeps_no_key_is_never_padded():
    feeds = bert_feeds(6, rows=2)
    feeds["attention_mask"][1] = 0
    item = fit(PLAN, feeds)
    assert not item.paddable and not item.alone


def test_runs_group_paddable_requests_up_to_max_rows():
    fits = [Fit(1, 5), Fit(2, 9), Fit(1, 7), Fit(3, 2)]
    assert runs(fits, 3) == [[0, 1], [2], [3]]  # 3 rows is max_rows or more: a run of its own
    assert runs(fits, 8) == [[0, 1, 2, 3]]


def test_runs_keep_apart_what_cannot_share_a_run():
    fits = [Fit(1, 5), Fit(1, 5, paddable=False), Fit(1, 6, paddable=False), Fit(1, 5, paddable=False),
            Fit(1, 5, key=(("x", (3,)),)), Fit(0, alone="why")]  # fmt: skip
    assert runs(fits, 16) == [[0], [1, 3], [2], [4], [5]]
    assert runs(fits, 1) == [[i] for i in range(6)]  # batching off


def test_assemble_pads_with_zeros_and_split_cuts_back_to_each_request():
    plan = BatchPlan(("ids", "mask"), ("ids", "mask", "pooled"), "b", "", "s", "mask", "", ("ids", "mask"),
                     ("ids", "mask"))  # fmt: skip
    rng = np.random.default_rng(3)
    feeds = [{"ids": rng.integers(1, 9, (rows, length)), "mask": np.ones((rows, length), np.int64)}
             for rows, length in ((1, 4), (2, 7), (1, 2))]  # fmt: skip
    fits = [Fit(f["ids"].shape[0], f["ids"].shape[1]) for f in feeds]
    stacked, length = assemble(plan, feeds, fits)
    assert length == 7 and stacked["ids"].shape == (4, 7)
    assert not stacked["mask"][0, 4:].any() and not stacked["ids"][3, 2:].any()
    pooled = np.arange(4)[:, None] * np.ones((4, 3))  # an output without the sequence dim: rows only
    back = split(plan, ["ids", "mask", "pooled"], [stacked["ids"], stacked["mask"], pooled], fits)
    for own, original, rows in zip(back, feeds, ([0], [1, 2], [3])):
        assert np.array_equal(own["ids"], original["ids"]) and np.array_equal(own["mask"], original["mask"])
        assert np.array_equal(own["pooled"], pooled[rows])
    assert back[0]["ids"].base is None  # an answer owns its arrays


@pytest.mark.parametrize("max_rows", [1, 2, 16])
def test_every_request_is_in_exactly_one_run(max_rows):
    rng = np.random.default_rng(max_rows)
    fits = [Fit(int(rng.integers(1, 4)), int(rng.integers(1, 9)), paddable=bool(rng.random() < 0.7))
            for _ in range(40)]  # fmt: skip
    grouped = runs(fits, max_rows)
    assert sorted(i for run in grouped for i in run) == list(range(40))
    for run in grouped:
        assert len(run) == 1 or sum(fits[i].rows for i in run) <= max_rows
