"""The device plan (mha_ep/device/plan.py) and the mode choice (device/mode.py), on the CPU.

The cut is checked with its CPU twin (device/run.py's HostExecutor: ORT CPU pieces, reference attention steps)
against stock ORT on the whole model, so CI proves that device mode's steps compute the model before a GPU runs
them (tests/device/test_device_mode.py runs the same plans on the GPU).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep import shipped, spec
from mha_ep.device import AttentionStep, DevicePlanError, PieceStep, plan_device
from mha_ep.device.mode import (
    DeviceModeUnavailableError,
    cuda_options_of,
    normalise_mode,
    reason_in_plan,
    reason_without_cuda_provider,
)  # fmt: skip
from mha_ep.device.run import HostExecutor, run_plan, run_steps
from mha_ep.feeds import random_feeds
from mha_ep.ops.backends import create_backend

SHIPPED = sorted(shipped.folder().glob("*.onnx"))
TOLERANCE = {"float32": 1e-5, "float16": 4e-3}


def run_twin(model: onnx.ModelProto, feeds: dict) -> dict:
    plan = plan_device(mha_ep.partition(model).model)
    executor = HostExecutor(plan, create_backend("reference"))
    constants = {name: executor.constant(value) for name, value in plan.constants.items()}
    return run_plan(plan, executor, feeds, constants)


def stock(model: onnx.ModelProto, feeds: dict) -> dict:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_cut_of_every_shipped_model_computes_stock_orts_outputs(path):
    model = onnx.load(path)
    feeds = random_feeds(model)
    actual, expected = run_twin(model, feeds), stock(model, feeds)
    assert set(actual) == set(expected)
    dtype = "float16" if "fp16" in path.stem else "float32"
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        e = value.astype(np.float64)
        error = float(np.max(np.abs(actual[name].astype(np.float64) - e) / np.maximum(1.0, np.abs(e))))
        assert error <= TOLERANCE[dtype], f"{path.stem} {name}: {error:.3g}"


@pytest.mark.parametrize("path", [p for p in SHIPPED if "decoder_fp32" in p.stem], ids=lambda p: p.stem)
def test_a_call_split_at_any_step_hands_across_exactly_what_the_rest_reads(path):
    """Device mode's graphs run the steps before a piece ORT partly runs on the CPU eagerly and capture the rest
    (device/cuda.py CallGraphs): the rest must get everything it reads from ``reads_before``, and nothing more is
    needed. Checked at every split point: the rest runs on the handed-across tensors alone and gives the same
    outputs as the whole call."""
    model = onnx.load(path)
    plan = plan_device(mha_ep.partition(model).model)
    executor = HostExecutor(plan, create_backend("reference"))
    constants = {name: executor.constant(value) for name, value in plan.constants.items()}
    feeds = random_feeds(model, seed=5)
    whole = run_plan(plan, executor, feeds, constants)
    for split in range(len(plan.steps) + 1):
        tensors = {**constants, **feeds}
        run_steps(plan, executor, tensors, 0, split)
        handed = {name: tensors[name] for name in plan.reads_before(split)}
        assert set(handed) <= set(tensors)
        rest = {**constants, **handed}
        run_steps(plan, executor, rest, split)
        for name in plan.outputs:
            np.testing.assert_array_equal(rest[name], whole[name], err_msg=f"split at {split}: {name}")
    assert set(plan.reads_before(0)) <= set(plan.inputs) | set(plan.constants)
    assert set(plan.reads_before(len(plan.steps))) == set(plan.outputs)


@pytest.mark.parametrize("path", [p for p in SHIPPED if "fp16" in p.stem][:1], ids=lambda p: p.stem)
def test_the_float32_transport_is_undone(path):
    """Rule 1: attention steps read and write the original float16 tensors; no transport Cast reaches a piece."""
    plan = plan_device(mha_ep.partition(onnx.load(path)).model)
    assert plan.attention_steps and all(s.dtype == "float16" for s in plan.attention_steps)
    for step in plan.attention_steps:
        for name in step.inputs + step.outputs:
            assert name is None or (spec.TRANSPORT_IN not in name and spec.TRANSPORT_OUT not in name), name
    for piece in plan.pieces:
        for node in piece.model.graph.node:
            assert not any(spec.TRANSPORT_IN in t or spec.TRANSPORT_OUT in t for t in list(node.input) + list(node.output))
            assert node.domain != spec.PLUGIN_DOMAIN


def mha(name: str, q: str, k: str, v: str, out: str) -> onnx.NodeProto:
    return helper.make_node("MultiHeadAttention", [q, k, v], [out], domain="com.microsoft", name=name, num_heads=2)


def chain_model() -> onnx.ModelProto:
    """x -> Relu -> MHA a -> Add(+x) -> MHA b -> Sigmoid -> y, and an Exp(x) that depends on no MHA (-> z)."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        mha("a", "r", "r", "r", "a_out"),
        helper.make_node("Add", ["a_out", "x"], ["s"], name="add"),
        mha("b", "s", "r", "s", "b_out"),
        helper.make_node("Sigmoid", ["b_out"], ["y"], name="sigmoid"),
        helper.make_node("Exp", ["x"], ["z"], name="exp"),
    ]
    x = helper.make_tensor_value_info("x", TP.FLOAT, [2, 5, 8])
    outs = [helper.make_tensor_value_info(n, TP.FLOAT, [2, 5, 8]) for n in ("y", "z")]
    graph = helper.make_graph(nodes, "chain", [x], outs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid("com.microsoft", 1)])


def test_nodes_go_to_the_earliest_piece_their_inputs_allow():
    """Rule 2: Exp(x) needs no attention output, so it runs in piece 0 beside Relu, not in a piece of its own."""
    plan = plan_device(mha_ep.partition(chain_model()).model)
    kinds = [(s.kind, s.level) for s in plan.steps]
    assert kinds == [("piece", 0), ("attention", 0), ("piece", 1), ("attention", 1), ("piece", 2)], kinds
    ops = [[n.op_type for n in p.model.graph.node] for p in plan.pieces]
    assert ops == [["Relu", "Exp"], ["Add"], ["Sigmoid"]], ops
    first = plan.pieces[0]
    assert first.inputs == ("x",) and set(first.outputs) == {"r", "z"}, (first.inputs, first.outputs)
    assert [s.node_name for s in plan.attention_steps] == ["a", "b"]
    assert plan.attention_steps[1].inputs[:3] == ("s", "r", "s")


def test_the_chain_model_runs_as_its_steps(rng):
    model = chain_model()
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)}
    actual, expected = run_twin(model, feeds), stock(model, feeds)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5)


def test_every_tensor_is_dropped_after_its_last_reader_and_outputs_are_kept():
    plan = plan_device(mha_ep.partition(chain_model()).model)
    dropped = [name for names in plan.drops for name in names]
    assert "r" in dropped and "y" not in dropped and "z" not in dropped
    index = {name: i for i, names in enumerate(plan.drops) for name in names}
    for i, step in enumerate(plan.steps):
        for name in step.inputs:
            if name in index:
                assert index[name] >= i, f"{name} dropped at step {index[name]}, read at step {i}"


def test_an_initializer_read_by_an_attention_step_is_a_constant(rng):
    model = chain_model()
    bias = rng.standard_normal(24).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(bias, "bias"))
    node = model.graph.node[1]
    node.input.extend(["bias"])
    plan = plan_device(mha_ep.partition(model).model)
    assert "bias" in plan.constants and np.array_equal(plan.constants["bias"], bias)
    assert plan.attention_steps[0].inputs[3] == "bias"
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)}
    actual, expected = run_twin(model, feeds), stock(model, feeds)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5)


def test_an_outer_scope_read_of_a_control_flow_body_becomes_a_piece_input(rng):
    """Rule 4: an If after the first MHA whose branches read ``x`` and ``a_out`` from the outer scope."""
    model = chain_model()
    then_graph = helper.make_graph([helper.make_node("Add", ["a_out", "x"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", TP.FLOAT, None)])  # fmt: skip
    else_graph = helper.make_graph([helper.make_node("Sub", ["a_out", "x"], ["e"])], "else", [],
                                   [helper.make_tensor_value_info("e", TP.FLOAT, None)])  # fmt: skip
    cond = onnx.numpy_helper.from_array(np.array(True), "cond")
    model.graph.initializer.append(cond)
    model.graph.node.insert(2, helper.make_node("If", ["cond"], ["w"], then_branch=then_graph, else_branch=else_graph))
    model.graph.output.append(helper.make_tensor_value_info("w", TP.FLOAT, [2, 5, 8]))
    plan = plan_device(mha_ep.partition(model).model)
    holder = next(p for p in plan.pieces if any(n.op_type == "If" for n in p.model.graph.node))
    assert holder.level == 1 and {"a_out", "x"} <= set(holder.inputs), holder.inputs
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)}
    actual, expected = run_twin(model, feeds), stock(model, feeds)
    np.testing.assert_allclose(actual["w"], expected["w"], rtol=1e-5, atol=1e-5)


def test_a_cut_tensor_of_unknown_type_is_refused_by_name(monkeypatch):
    """Rule 5: piece 1 writes "s" for the second attention step; without its element type the piece cannot be
    typed, and the refusal names the tensor."""
    from mha_ep.device import plan as plan_module

    real = plan_module.infer_static_infos

    def without_s(model):
        infos = real(model)
        infos.pop("s", None)
        return infos

    monkeypatch.setattr(plan_module, "infer_static_infos", without_s)
    with pytest.raises(DevicePlanError, match="element type of tensor 's' \\(written by piece 1\\)"):
        plan_device(mha_ep.partition(chain_model()).model)


def test_feeds_are_checked_by_name():
    plan = plan_device(mha_ep.partition(chain_model()).model)
    executor = HostExecutor(plan, create_backend("reference"))
    with pytest.raises(ValueError, match=r"missing feed\(s\) for graph input\(s\) \['x'\]"):
        run_plan(plan, executor, {}, {})
    with pytest.raises(ValueError, match=r"feed\(s\) \['nope'\] name no graph input"):
        run_plan(plan, executor, {"x": np.zeros((2, 5, 8), np.float32), "nope": np.zeros(1)}, {})
    with pytest.raises(ValueError, match=r"output\(s\) \['r'\] are not graph outputs; the model's outputs are \['y', 'z'\]"):
        run_plan(plan, executor, {"x": np.zeros((2, 5, 8), np.float32)}, {}, ["r"])


def test_an_attention_step_error_names_its_node(rng):
    plan = plan_device(mha_ep.partition(chain_model()).model)
    executor = HostExecutor(plan, create_backend("reference"))
    step = plan.attention_steps[0]
    bad = rng.standard_normal((2, 5, 7)).astype(np.float32)  # D = 7 is not a multiple of num_heads = 2
    with pytest.raises(mha_ep.MhaRunError) as caught:
        executor.run_attention(step, [bad, bad, bad] + [None] * 5)
    assert caught.value.node_name == "a"
    assert "num_heads" in str(caught.value) or "7" in str(caught.value)


# ---------------------------------------------------------------------------------------------- the mode
def test_the_mode_rules_give_the_first_failing_reason():
    assert "do not include CUDAExecutionProvider" in reason_without_cuda_provider(["CPUExecutionProvider"], ["CPUExecutionProvider"])
    assert "do not include" in reason_without_cuda_provider(None, ["CUDAExecutionProvider"])
    missing = reason_without_cuda_provider(["CUDAExecutionProvider"], ["CPUExecutionProvider"])
    assert "has no CUDAExecutionProvider" in missing and "mha-ep[gpu]" in missing
    assert reason_without_cuda_provider([("CUDAExecutionProvider", {})], ["CUDAExecutionProvider"]) is None


def test_modes_and_provider_options_are_read_as_onnxruntime_spells_them():
    assert [normalise_mode(m) for m in ("auto", True, False, None, "device", "python-op")] == [
        "auto", "device", "python-op", "auto", "device", "python-op"]  # fmt: skip
    with pytest.raises(ValueError, match="device_mode must be one of"):
        normalise_mode("gpu")
    assert cuda_options_of([("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})], None) == {
        "arena_extend_strategy": "kSameAsRequested"}  # fmt: skip
    assert cuda_options_of(["CUDAExecutionProvider", "CPUExecutionProvider"], [{"a": 1}, {}]) == {"a": 1}
    assert cuda_options_of(["CPUExecutionProvider"], None) == {}


def test_a_bfloat16_cut_is_a_reason_for_the_bridge():
    plan = plan_device(mha_ep.partition(chain_model()).model)
    assert reason_in_plan(plan) is None
    plan.dtypes["r"] = "bfloat16"
    assert "'r'" in reason_in_plan(plan) and "bfloat16" in reason_in_plan(plan)


def test_a_cpu_machine_runs_the_bridge_and_says_why():
    path = str(SHIPPED[0])
    auto = mha_ep.InferenceSession(path, backend="reference", providers=["CPUExecutionProvider"])
    assert auto.mode == "python-op" and "Python op serves CPU sessions" in auto.mode_reason
    with pytest.raises(DeviceModeUnavailableError, match="device_mode='device' cannot run: the session's providers"):
        mha_ep.InferenceSession(path, backend="reference", providers=["CPUExecutionProvider"], device_mode="device")
    with pytest.raises(mha_ep.MhaEpError, match="run_device needs the native route on the CUDA provider"):
        auto.run_device(None, random_feeds(onnx.load(path)))


def test_plans_describe_their_steps():
    plan = plan_device(mha_ep.partition(chain_model()).model)
    text = plan.describe()
    assert text.startswith("device plan: 3 ORT piece(s), 2 attention step(s)")
    assert "attention 'a' (float32)" in text and "ORT piece 0: 2 node(s)" in text
    assert isinstance(plan.steps[0], PieceStep) and isinstance(plan.steps[1], AttentionStep)
