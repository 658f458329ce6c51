"""Random feeds (mha_ep/feeds.py): valid inputs for any model, scalar inputs and past/sequence lengths included."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.feeds import random_feeds

from small_models import model_of, one_mha


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


def test_a_shared_buffers_past_sequence_length_is_drawn_inside_the_buffer():
    """past_sequence_length of a shared-buffer node (docs/SEMANTICS.md §3.9) is P in [0, M - L]: drawn like any
    integer (0..99), a buffer of M = 9 rows refused most draws ("past_sequence_length must be ... less than
    max_sequence_length"), and `mha-ep compare` answered CANNOT RUN on the static-cache rewrite's decoders."""
    from mha_models import MhaConfig, build_model

    config = MhaConfig(batch=2, q_seq=3, kv_seq=3, num_heads=2, head_size=8, has_past=True, past_seq=2,
                       presents=True, max_seq=9)  # fmt: skip
    model = build_model(config)
    drawn = {int(random_feeds(model, seed=seed)["past_sequence_length"].reshape(-1)[0]) for seed in range(60)}
    assert drawn <= set(range(0, 9 - 3 + 1)) and len(drawn) > 3, drawn
    report = mha_ep.compare(model, backend="reference", runs=3)
    assert report.verdict.name == "PASS", report.text()
