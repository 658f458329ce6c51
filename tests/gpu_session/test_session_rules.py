"""The GPU session's rules that need no GPU: which CUDA options turn ORT's graph on and how it is taken out when
ORT refuses it, the call checks, the type table and the signature that keys a graph (mha_ep/session.py,
mha_ep/gpu_session/checks.py and ort_calls.py; the GPU side is tests/gpu_session/test_native_session.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_ep.gpu_session.checks import CallChecks
from mha_ep.gpu_session.ort_calls import numpy_dtype, unsupported_tensors
from mha_ep.providers import cuda_options_of, provider_names, wants_cuda_graph, without_cuda_graph

CUDA = "CUDAExecutionProvider"


@pytest.mark.parametrize("value, wanted", [("1", True), (1, True), ("True", True), ("0", False), ("false", False),
                                           (0, False), ("", False)])  # fmt: skip
def test_enable_cuda_graph_is_read_from_either_form_of_provider_options(value, wanted):
    assert wants_cuda_graph([(CUDA, {"enable_cuda_graph": value}), "CPUExecutionProvider"], None) is wanted
    assert wants_cuda_graph([CUDA, "CPUExecutionProvider"], [{"enable_cuda_graph": value}, {}]) is wanted
    assert not wants_cuda_graph(["CPUExecutionProvider"], None)


def test_taking_the_graph_out_keeps_every_other_option_and_provider():
    providers = [(CUDA, {"enable_cuda_graph": "1", "use_tf32": "0"}), "CPUExecutionProvider"]
    out, options = without_cuda_graph(providers, None)
    assert options is None and provider_names(out) == [CUDA, "CPUExecutionProvider"]
    assert cuda_options_of(out, None) == {"use_tf32": "0"}
    out, options = without_cuda_graph([CUDA, "CPUExecutionProvider"], [{"enable_cuda_graph": "1", "device_id": "0"}, {}])
    assert out == [CUDA, "CPUExecutionProvider"] and options == [{"device_id": "0"}, {}]
    assert not wants_cuda_graph(out, options)


def test_types_without_a_cupy_dtype_are_named():
    assert numpy_dtype("tensor(float16)") == "float16" and numpy_dtype("tensor(int64)") == "int64"
    assert numpy_dtype("tensor(bfloat16)") is None

    class Arg:
        def __init__(self, name, type_):
            self.name, self.type = name, type_

    class Session:
        def get_inputs(self):
            return [Arg("x", "tensor(bfloat16)"), Arg("m", "tensor(int32)")]

        def get_outputs(self):
            return [Arg("y", "tensor(bfloat16)")]

    assert unsupported_tensors(Session()) == ["x (tensor(bfloat16))", "y (tensor(bfloat16))"]


def test_a_graph_is_keyed_by_every_feeds_name_shape_and_dtype():
    a = {"x": np.zeros((2, 3), np.float32)}
    b = {"m": np.zeros((2,), np.int32)}
    key = CallChecks.signature(a, b)
    assert key == (("m", (2,), "int32"), ("x", (2, 3), "float32"))
    assert key == CallChecks.signature({}, {**a, **b})
    assert key != CallChecks.signature({"x": np.zeros((2, 4), np.float32)}, b)



def test_a_callers_own_run_may_not_take_a_graph_id_the_session_keeps():
    """run and run_device keep gpu_graph_id 1 to MAX_GRAPHS for their signatures' graphs; the caller's own
    run_with_iobinding asking for one of those is refused with the ids it may use (session.taken_graph_id)."""
    from mha_ep.session import taken_graph_id

    for value in ("1", "16", 5):
        reason = taken_graph_id(value, 16)
        assert reason is not None and "use an id above 16, or -1 for no graph" in reason, value
    for value in (None, "0", "-1", "17", "not a number"):
        assert taken_graph_id(value, 16) is None, value
