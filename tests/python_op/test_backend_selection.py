"""Backend choice: one clear error when cuda cannot run, a said-once fallback for auto, per-session binding."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import mha_ep
from mha_ep.engine import backends
from mha_ep.engine.backends import create_backend, cuda_unavailable_reason


def tiny_model():
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=2)
    graph = helper.make_graph(
        [node], "tiny", [helper.make_tensor_value_info(n, TP.FLOAT, [1, 3, 8]) for n in "qkv"],
        [helper.make_tensor_value_info("o", TP.FLOAT, [1, 3, 8])],
    )
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


needs_no_gpu = pytest.mark.skipif(cuda_unavailable_reason() is None, reason="a GPU is usable here")


@needs_no_gpu
def test_cuda_without_gpu_is_one_clear_error():
    with pytest.raises(mha_ep.BackendUnavailableError, match="backend='cuda' cannot run: .*(CuPy|GPU)"):
        mha_ep.InferenceSession(tiny_model(), backend="cuda")
    with pytest.raises(mha_ep.BackendUnavailableError, match="cannot run"):
        mha_ep.register(ort.SessionOptions(), backend="cuda")


@needs_no_gpu
def test_auto_falls_back_to_reference_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setitem(backends._said_fallback, "done", False)
    with caplog.at_level(logging.WARNING, logger="mha_ep"):
        first = mha_ep.InferenceSession(tiny_model(), backend="auto")
        second = mha_ep.InferenceSession(tiny_model(), backend="auto")
    assert first.backend.name == second.backend.name == "reference"
    said = [r for r in caplog.records if "reference backend" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="backend must be 'reference', 'cuda' or 'auto', got 'tpu'"):
        mha_ep.InferenceSession(tiny_model(), backend="tpu")


def test_session_binds_its_own_backend(rng):
    """A session's runs use its backend even after register() changed the process default."""

    class Recording:
        name, device = "recording", "test"

        def __init__(self):
            self.calls = 0

        def run(self, problem, borrow_outputs=False):
            self.calls += 1
            self.borrowed = borrow_outputs
            return create_backend("reference").run(problem)

    session = mha_ep.InferenceSession(tiny_model(), backend="reference")
    recording = Recording()
    session.backend = recording
    mha_ep.register(ort.SessionOptions(), backend="reference")  # changes the process default only
    feeds = {n: rng.standard_normal((1, 3, 8)).astype(np.float32) for n in "qkv"}
    session.run(None, feeds)
    assert recording.calls == 1
    assert recording.borrowed  # the op lets the backend hand over views: the bridge copies them at once


def test_register_twice_on_the_same_options_loads_the_library_once():
    """A second register on the same options adds nothing: onnxruntime-extensions' library loaded twice makes ORT
    refuse the session ("Conflicting" kernels), as the last part shows."""
    loaded = []

    class Counting(ort.SessionOptions):
        def register_custom_ops_library(self, path):
            loaded.append(path)
            super().register_custom_ops_library(path)

    options = Counting()
    mha_ep.register(options, backend="reference")
    mha_ep.register(options, backend="reference")
    assert len(loaded) == 1, loaded
    model = mha_ep.partition(tiny_model()).model
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    twice = Counting()
    mha_ep.register(twice, backend="reference")
    twice.register_custom_ops_library(loaded[0])
    with pytest.raises(Exception, match="(?i)conflict"):
        ort.InferenceSession(model.SerializeToString(), twice, providers=["CPUExecutionProvider"])


def test_register_turns_intra_op_spinning_off_unless_the_caller_set_it():
    options = ort.SessionOptions()
    mha_ep.register(options, backend="reference")
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    chosen = ort.SessionOptions()
    chosen.add_session_config_entry("session.intra_op.allow_spinning", "1")
    mha_ep.register(chosen, backend="reference")
    assert chosen.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    session = mha_ep.InferenceSession(tiny_model(), backend="reference")
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("route", ["python-op", "native"])
def test_plain_session_is_a_plain_ort_session_running_the_plugin(route, rng):
    """registration.plain_session, the one builder of plain plugin sessions: the model partitioned for the route,
    the plugin registered, stock ORT CPU's answer; a route that does not exist is refused by name."""
    from mha_models import MhaConfig, build_model, random_feeds, stock_outputs

    from mha_ep.registration import plain_session

    config = MhaConfig(bias=True, mask="1d")
    feeds = random_feeds(config, rng)
    session = plain_session(build_model(config), providers=["CPUExecutionProvider"], backend="reference",
                            route=route)  # fmt: skip
    assert type(session) is ort.InferenceSession
    expected = stock_outputs(config, feeds)["output"]
    np.testing.assert_allclose(session.run(["output"], feeds)[0], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="route must be one of"):
        plain_session(build_model(config), providers=["CPUExecutionProvider"], backend="reference", route="nowhere")
