"""lift_attention: exact against stock ORT on small Attention models; declined forms stay unchanged with reasons."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from mha_ep.graph.lift import lift_attention, plan_lift

from lift_models import F32, B, D, E, H, N, S, attention_model, feeds_for, op_types, run

ort = pytest.importorskip("onnxruntime")


LIFTED_CASES = {
    "bidirectional": dict(),
    "unidirectional_with_present": dict(unidirectional=1, present=True),
    "bidirectional_with_present": dict(present=True),
    "mask_2d": dict(mask=("2d",)),
    "mask_3d": dict(mask=("3d",)),
    "mask_1d_key_lengths": dict(mask=("1d",)),
    "unidirectional_mask_2d": dict(unidirectional=1, mask=("2d",), present=True),
    "attention_bias": dict(attention_bias=True),
    "scale_and_filter": dict(extra_attrs=dict(scale=0.2, mask_filter_value=-5000.0), mask=("2d",)),
    "qkv_hidden_sizes_v_differs": dict(qkv_sizes=(D, D, 2 * N)),
    "runtime_weights": dict(runtime_weights=True, present=True, unidirectional=1),
    "opset_11": dict(opset=11, present=True, unidirectional=1, runtime_weights=True),
}


@pytest.mark.parametrize("case", sorted(LIFTED_CASES))
def test_lift_is_exact(case):
    kwargs = LIFTED_CASES[case]
    model, w = attention_model(**kwargs)
    feeds = feeds_for(model, w, mask=kwargs.get("mask"))
    want = run(model, feeds)
    lifted, count = lift_attention(model)
    assert count == 1
    onnx.checker.check_model(lifted)
    types = op_types(lifted)
    assert ("com.microsoft", "Attention") not in types
    assert types.count(("com.microsoft", "MultiHeadAttention")) == 1
    mha = next(n for n in lifted.graph.node if n.op_type == "MultiHeadAttention")
    assert mha.name == "attn0"  # the node keeps its name
    got = run(lifted, feeds)
    assert len(got) == len(want)
    for g, w_ in zip(got, want):
        assert g.shape == w_.shape
        np.testing.assert_allclose(g, w_, rtol=0, atol=2e-5)
    # the input model is left alone
    assert ("com.microsoft", "Attention") in op_types(model)


DECLINED_CASES = {
    "past_input": (dict(past=True, unidirectional=1), "input 'past'"),
    "mask_1d_end_start": (dict(mask=("1d", 2 * B)), "cannot be told apart"),
    "mask_4d_megatron": (dict(mask=("4d",)), "is rank 4"),
    "rotary": (dict(extra_attrs=dict(do_rotary=1)), "do_rotary=1"),
    "qkv_hidden_sizes_k_differs": (dict(qkv_sizes=(D, 2 * N, D)), "key hidden == query hidden"),
    "present_with_v_differs": (dict(qkv_sizes=(D, D, 2 * N), present=True), "combined present"),
}


@pytest.mark.parametrize("case", sorted(DECLINED_CASES))
def test_declined_forms_stay_unchanged(case):
    kwargs, reason = DECLINED_CASES[case]
    model, _ = attention_model(**kwargs)
    before = model.SerializeToString()
    lifted, count = lift_attention(model)
    assert count == 0
    assert lifted.SerializeToString() == before
    (decision,) = plan_lift(model)
    assert not decision.lifted
    assert decision.node_name == "attn0"
    assert reason in decision.reason


def test_mixed_graph_lifts_only_what_it_can():
    """Two Attention nodes in one graph: one liftable, one with past; the count says one."""
    liftable, _ = attention_model(unidirectional=1, present=True)
    node = helper.make_node(
        "Attention", ["x", "w", "qkv_bias", "", "past"], ["y2", "present2"], "attn1", domain="com.microsoft",
        num_heads=N, unidirectional=1,
    )
    g = liftable.graph
    g.node.append(node)
    g.input.append(helper.make_tensor_value_info("past", F32, [2, "batch", N, 3, H]))
    g.output.append(helper.make_tensor_value_info("y2", F32, ["batch", S, D]))
    lifted, count = lift_attention(liftable)
    assert count == 1
    kinds = {n.name: n.op_type for n in lifted.graph.node}
    assert kinds["attn0"] == "MultiHeadAttention"
    assert kinds["attn1"] == "Attention"
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((B, S, E)).astype(np.float32),
        "past": rng.standard_normal((2, B, N, 3, H)).astype(np.float32),
    }
    for g_, w_ in zip(run(lifted, feeds), run(liftable, feeds)):
        np.testing.assert_allclose(g_, w_, rtol=0, atol=2e-5)


def test_in_place_lift_rewrites_the_given_model_and_partition_leaves_its_input_alone():
    from mha_ep.graph.partition import partition

    model, _ = attention_model(unidirectional=1, present=True, mask=("2d",))
    original = model.SerializeToString()
    copied, count = lift_attention(model)
    assert count == 1 and model.SerializeToString() == original
    in_place, count = lift_attention(model, in_place=True)
    assert count == 1 and in_place is model
    assert in_place.SerializeToString() == copied.SerializeToString()
    fresh, _ = attention_model(unidirectional=1, present=True, mask=("2d",))
    before = fresh.SerializeToString()
    result = partition(fresh, lift_attention=True)
    assert result.lifted_attention == 1 and fresh.SerializeToString() == before


def test_model_without_attention_is_returned_as_is():
    x = helper.make_tensor_value_info("x", F32, [2])
    y = helper.make_tensor_value_info("y", F32, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    out, count = lift_attention(model)
    assert count == 0 and out is model


def test_lift_module_needs_neither_torch_nor_onnxruntime():
    import ast
    import pathlib

    import mha_ep.graph.lift as lift_module

    tree = ast.parse(pathlib.Path(lift_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "copy", "dataclasses", "typing", "numpy", "onnx"}
