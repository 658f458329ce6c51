"""native/ort_checks.py raises what onnxruntime's own ``run`` raises, type and text, for every kind of call that does
not fit the model: each case runs on a stock ORT CPU session and through the checker, and the two must agree."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mha_ep.native import ort_checks


@pytest.fixture(scope="module")
def session():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4, 2])
    m = helper.make_tensor_value_info("m", TensorProto.INT64, ["B", 3])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2, "S"])
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (("y", TensorProto.FLOAT), ("z", TensorProto.INT64),
                                                                       ("w", TensorProto.FLOAT16))]  # fmt: skip
    nodes = [helper.make_node("Identity", [i], [o]) for i, o in (("x", "y"), ("m", "z"), ("h", "w"))]
    graph = helper.make_graph(nodes, "g", [x, m, h], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def good():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 4, 2)).astype(np.float32), "m": rng.integers(0, 9, (2, 3)),
            "h": rng.standard_normal((2, 5)).astype(np.float16)}  # fmt: skip


CASES = {
    "fits": (lambda f: f, None),
    "symbolic dims may take any size": (lambda f: {**f, "x": np.ones((7, 4, 2), np.float32)}, None),
    "a zero-size batch": (lambda f: {**f, "x": np.ones((0, 4, 2), np.float32), "m": np.ones((0, 3), np.int64)}, None),
    "int32 for int64": (lambda f: {**f, "m": f["m"].astype(np.int32)}, None),
    "float64 for float": (lambda f: {**f, "x": f["x"].astype(np.float64)}, None),
    "float32 for float16": (lambda f: {**f, "h": f["h"].astype(np.float32)}, None),
    "rank 3 for rank 2": (lambda f: {**f, "m": f["m"][..., None]}, None),
    "rank 1 for rank 3": (lambda f: {**f, "x": f["x"].reshape(-1)}, None),
    "one fixed dimension off": (lambda f: {**f, "x": np.ones((2, 5, 2), np.float32)}, None),
    "two fixed dimensions off": (lambda f: {**f, "x": np.ones((2, 5, 3), np.float32)}, None),
    "a fixed leading dimension off": (lambda f: {**f, "h": np.ones((3, 5), np.float16)}, None),
    "dtype and rank both wrong: dtype first": (lambda f: {**f, "m": np.ones((2, 3, 1), np.int32)}, None),
    "a missing feed": (lambda f: {"x": f["x"], "h": f["h"]}, None),
    "two missing feeds": (lambda f: {"h": f["h"]}, None),
    "an unknown feed": (lambda f: {**f, "q": f["x"]}, None),
    "an unknown output": (lambda f: f, ["y", "nope"]),
    "outputs by name": (lambda f: f, ["w", "y"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_checker_raises_what_ort_run_raises(session, case):
    make, output_names = CASES[case]
    feeds = make(good())
    try:
        session.run(output_names, feeds)
        expected = None
    except Exception as error:  # noqa: BLE001 - whatever ORT raises is the oracle
        expected = error
    got = ort_checks.call_error(session.get_inputs(), [o.name for o in session.get_outputs()], feeds, output_names)
    if expected is None:
        assert got is None
    else:
        assert got is not None, f"ORT raised {type(expected).__name__}: {expected}"
        assert (type(got), str(got)) == (type(expected), str(expected))


def test_of_several_bad_feeds_the_checker_names_one_as_ort_would_alone(session):
    """ORT checks the feeds in the order of a hash map of its own, so with two bad feeds it names either; the
    checker names the first in feed order, with the text ORT gives for that feed alone."""
    feeds = {"h": np.ones((3, 5), np.float16), "m": good()["m"], "x": np.ones((2, 9, 2), np.float32)}
    with pytest.raises(Exception) as both:
        session.run(None, feeds)
    with pytest.raises(Exception) as alone:
        session.run(None, {**good(), "h": feeds["h"]})
    got = ort_checks.call_error(session.get_inputs(), ["y", "z", "w"], feeds, None)
    assert type(got) is type(both.value) is type(alone.value) and str(got) == str(alone.value)


def test_a_list_feed_is_left_to_the_conversion_as_ort_converts_it(session):
    feeds = {**good(), "x": good()["x"].tolist()}
    session.run(None, feeds)  # ORT converts the list to the input's type
    assert ort_checks.call_error(session.get_inputs(), ["y", "z", "w"], feeds, None) is None


def test_wanted_outputs_are_all_of_them_when_none_are_named():
    assert ort_checks.wanted_outputs(["y", "z"], None) == ["y", "z"]
    assert ort_checks.wanted_outputs(["y", "z"], []) == ["y", "z"]
    assert ort_checks.wanted_outputs(["y", "z"], ["z"]) == ["z"]


def test_a_stock_nodes_failure_through_iobinding_gets_the_type_run_gives_it():
    """ORT's IOBinding run reports a failing Reshape as RuntimeError("Error in execution: ..."); execution_error
    re-runs the call through ``run`` and returns its exception, type and text."""
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, ["N"])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Reshape", ["data", "shape"], ["out"])], "g", [data, shape], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"data": np.random.default_rng(1).standard_normal(6).astype(np.float32), "shape": np.array([4, 5])}
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("out")
    with pytest.raises(RuntimeError) as through_binding:
        session.run_with_iobinding(binding)
    assert type(through_binding.value) is RuntimeError
    assert str(through_binding.value).startswith(ort_checks.EXECUTION_ERROR)
    with pytest.raises(Exception) as through_run:
        session.run(None, feeds)
    got = ort_checks.execution_error(through_binding.value, lambda: session.run(None, feeds))
    assert type(got) is type(through_run.value) and str(got) == str(through_run.value)
    assert type(got) is not RuntimeError  # ORT's own class, which `except RuntimeError` handlers never took


def test_execution_error_leaves_other_errors_and_passing_reruns_alone():
    from mha_ep.errors import MhaRunError

    claimed = MhaRunError("mha", "mha_ep MultiHeadAttention: bad")
    assert ort_checks.execution_error(claimed, lambda: 1 / 0) is claimed
    other = RuntimeError("CUDA out of memory")
    assert ort_checks.execution_error(other, lambda: 1 / 0) is other
    transient = RuntimeError(ort_checks.EXECUTION_ERROR + "something")
    assert ort_checks.execution_error(transient, lambda: None) is transient


def test_an_input_without_a_declared_shape_takes_any_rank_as_run_does():
    """ORT's NodeArg gives [] for an input with no shape, and ORT's run accepts any rank there; the checker must
    not read [] as rank 0 (it did: "Invalid rank for input: query Got: 3 Expected: 0" on unranked models)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert stock.get_inputs()[0].shape == []
    for shape in ((3,), (2, 3, 4)):
        feeds = {"x": np.ones(shape, np.float32)}
        assert stock.run(None, feeds)[0].shape == shape
        assert ort_checks.call_error(stock.get_inputs(), ["y"], feeds, None) is None


class DeviceArray:  # stands in for CuPy's ndarray: call_key tells the two kinds apart by type alone
    pass


def outcome(call):
    """(the exception's type, its text, the exception) a call raised, or ("ran", its result, None)."""
    try:
        return "ran", call(), None
    except Exception as error:  # noqa: BLE001 - compared with ORT's own
        return type(error), str(error), error


@pytest.mark.parametrize("case", list(CASES))
def test_a_remembered_verdict_is_what_run_gives_each_time_and_checked_once(session, case, monkeypatch):
    """CheckVerdicts (CallChecks, gpu_session/checks.py): a call key's first call is checked, later ones are answered
    from the remembered verdict, a refusal raised anew each time with ORT's type and text."""
    make, output_names = CASES[case]
    feeds = make(good())
    outputs = [o.name for o in session.get_outputs()]
    ran = outcome(lambda: session.run(output_names, feeds))
    checks = []
    real = ort_checks.call_error
    monkeypatch.setattr(ort_checks, "call_error", lambda *args: checks.append(1) or real(*args))
    verdicts = ort_checks.CheckVerdicts(session.get_inputs(), outputs, limit=8)
    key = ort_checks.call_key(feeds, output_names, DeviceArray)
    assert key is not None
    first, second = (outcome(lambda: verdicts.wanted(key, feeds, output_names)) for _ in range(2))
    assert len(checks) == 1 and len(verdicts) == 1
    if ran[0] == "ran":
        assert first[:2] == second[:2] == ("ran", ort_checks.wanted_outputs(outputs, output_names))
    else:
        assert first[:2] == second[:2] == ran[:2], f"ORT raised {ran[0].__name__}: {ran[1]}"
        assert second[2] is not first[2]  # a new exception: tracebacks do not pile up on one object


def test_a_call_key_holds_every_fact_the_check_reads(session):
    feeds = good()
    key = ort_checks.call_key(feeds, None, DeviceArray)
    assert key == ort_checks.call_key({k: v.copy() for k, v in feeds.items()}, [], DeviceArray)  # data: no part
    others = [
        {**feeds, "x": feeds["x"].astype(np.float64)},  # a dtype
        {**feeds, "x": feeds["x"][:1]},  # a shape
        {"m": feeds["m"], "x": feeds["x"], "h": feeds["h"]},  # the feeds' order (ORT names the first bad one)
        {**feeds, "q": feeds["x"]},  # a name
    ]
    assert len({key, *(ort_checks.call_key(f, None, DeviceArray) for f in others)}) == 1 + len(others)
    assert key != ort_checks.call_key(feeds, ["y"], DeviceArray)
    device = DeviceArray()
    device.shape, device.dtype = feeds["x"].shape, feeds["x"].dtype
    assert key != ort_checks.call_key({**feeds, "x": device}, None, DeviceArray)  # where a feed lies
    assert ort_checks.call_key({**feeds, "x": feeds["x"].tolist()}, None, DeviceArray) is None  # converted by ORT
    assert ort_checks.call_key(feeds, 3, DeviceArray) is None  # not a sequence of names: left to ORT


def test_calls_without_a_key_are_checked_every_time_and_the_memory_is_bounded(session, monkeypatch):
    checks = []
    real = ort_checks.call_error
    monkeypatch.setattr(ort_checks, "call_error", lambda *args: checks.append(1) or real(*args))
    verdicts = ort_checks.CheckVerdicts(session.get_inputs(), ["y", "z", "w"], limit=2)
    listed = {**good(), "x": good()["x"].tolist()}
    for _ in range(2):
        assert verdicts.wanted(None, listed, None) == ["y", "z", "w"]
    assert len(checks) == 2 and len(verdicts) == 0
    for batch in (1, 2, 3):
        feeds = {**good(), "x": np.ones((batch, 4, 2), np.float32)}
        verdicts.wanted(ort_checks.call_key(feeds, None, DeviceArray), feeds, None)
        assert len(verdicts) <= 2


def test_a_failed_allocation_of_mha_eps_own_is_orts_runtime_exception_and_a_memory_error():
    """Stock ORT's run raises RuntimeException ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : ... Failed to allocate
    memory for requested buffer ...") where the device is full; cuda_io's own copies raise that type too, still a
    MemoryError, naming what did not fit and keeping the allocator's words; it survives pickling (a Ray Serve
    replica's answer crosses processes)."""
    import pickle

    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    cupys = MemoryError("Out of memory allocating 98,304 bytes (allocated so far: 1,024 bytes).")
    error = ort_checks.out_of_memory(cupys, "the outputs")
    for got in (error, pickle.loads(pickle.dumps(error))):
        assert isinstance(got, RuntimeException) and isinstance(got, MemoryError), type(got).__mro__
        assert str(got) == ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : mha_ep: Failed to allocate memory for the "
                            "outputs: Out of memory allocating 98,304 bytes (allocated so far: 1,024 bytes).")
    assert str(ort_checks.out_of_memory(MemoryError(), "x")).endswith("for x: MemoryError")
