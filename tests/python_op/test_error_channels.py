"""Where a claimed node's error goes: MhaRunError through mha_ep.InferenceSession (every run method), an ORT
error on the native route, a log line and NaN outputs through a plain session on the Python op, and never an abort."""

from __future__ import annotations

import numpy as np
import pytest

import mha_ep

from harness import SESSION_PRELUDE, describe, run_script
from small_models import one_mha, qkv_feeds

TOLERANCE = 1e-5  # against stock ORT CPU, float32


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




def test_plain_session_bad_feed_logs_and_returns_nan(backend):
    """The Python op in a plain session has no error channel: the error is logged, the outputs are NaN."""
    result = run_script(
        SESSION_PRELUDE
        + f"""
    model = mha_ep.partition(build_model(config)).model
    options = mha_ep.register(ort.SessionOptions(), backend={backend!r}, route="python-op")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    bad = dict(good, key=good["key"][:1])  # key batch 1 vs query batch 2
    out = session.run(None, bad)[0]
    print("BAD_SHAPE", out.shape, "ALL_NAN", bool(np.isnan(out).all()))
    again = session.run(None, good)[0]
    print("GOOD_ERROR", max_rel_error(again, expected))
    print("DONE")
    """
    )
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout, describe(result)
    assert "BAD_SHAPE (2, 3, 8) ALL_NAN True" in result.stdout, describe(result)
    assert "LOG mha_ep ERROR" in result.stderr, describe(result)
    assert "key batch 1 must equal query batch 2" in result.stderr, describe(result)
    error = float(result.stdout.split("GOOD_ERROR ")[1].split()[0])
    assert error <= TOLERANCE, f"good feed after the bad one: error {error:.3g} > {TOLERANCE}\n{describe(result)}"


def test_plain_native_session_bad_feed_is_an_ort_error_and_the_session_recovers(backend):
    """The native route in a plain session: the run fails with ORT's error carrying the node, the input and the
    expectation (nothing is logged as NaN), and the next run is right. The cuda backend's session runs its claimed
    node on the CUDA provider."""
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if backend == "cuda" else ["CPUExecutionProvider"]
    result = run_script(
        SESSION_PRELUDE
        + f"""
    if {backend!r} == "cuda":
        ort.preload_dlls()
    model = mha_ep.partition(build_model(config), route="native").model
    options = mha_ep.register(ort.SessionOptions(), backend={backend!r}, route="native")
    session = ort.InferenceSession(model.SerializeToString(), options, providers={providers!r})
    bad = dict(good, key=good["key"][:1])  # key batch 1 vs query batch 2
    try:
        session.run(None, bad)
        print("NO_ERROR")
    except Exception as error:
        print("ORT_ERROR", type(error).__name__, repr(str(error)))
    again = session.run(None, good)[0]
    print("GOOD_ERROR", max_rel_error(again, expected))
    print("DONE")
    """
    )
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout and "NO_ERROR" not in result.stdout, describe(result)
    line = next(l for l in result.stdout.splitlines() if l.startswith("ORT_ERROR"))
    assert "InvalidArgument" in line and "node 'mha'" in line, line
    assert "key batch 1 must equal query batch 2" in line, line
    error = float(result.stdout.split("GOOD_ERROR ")[1].split()[0])
    assert error <= TOLERANCE, f"good feed after the bad one: error {error:.3g} > {TOLERANCE}\n{describe(result)}"


BUGGY_BACKENDS = """
    import mha_ep.engine.reference as reference
    real_run_reference = reference.run_reference
    calls = {"n": 0}

    def buggy_run_reference(problem, *args, **kwargs):  # a bug on the first call only
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected backend bug 4711")
        return real_run_reference(problem, *args, **kwargs)

    class BrokenBackend:  # a backend object whose run always fails
        name = "broken"
        device = "nowhere"

        def run(self, problem, borrow_outputs=False):
            raise RuntimeError("fake backend failure 9001")
"""


def test_backend_bug_becomes_mha_run_error_and_the_session_recovers():
    result = run_script(
        SESSION_PRELUDE
        + BUGGY_BACKENDS
        + """
    session = mha_ep.InferenceSession(build_model(config), backend="reference")
    reference.run_reference = buggy_run_reference
    try:
        session.run(None, good)
        print("NO_ERROR_1")
    except mha_ep.MhaRunError as error:
        print("RUN_ERROR_1", type(error).__name__, error.node_name, repr(str(error)[:400]))
    print("NEXT_ERROR_1", max_rel_error(session.run(None, good)[0], expected))

    real_backend = session.backend
    session.backend = BrokenBackend()
    try:
        session.run(None, good)
        print("NO_ERROR_2")
    except mha_ep.MhaRunError as error:
        print("RUN_ERROR_2", type(error).__name__, error.node_name, repr(str(error)[:400]))
    session.backend = real_backend
    print("NEXT_ERROR_2", max_rel_error(session.run(None, good)[0], expected))
    print("DONE")
    """
    )
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout and "NO_ERROR" not in result.stdout, describe(result)
    for marker, text in (("RUN_ERROR_1", "injected backend bug 4711"), ("RUN_ERROR_2", "fake backend failure 9001")):
        line = next((l for l in result.stdout.splitlines() if l.startswith(marker)), "")
        assert line.startswith(f"{marker} MhaRunError[Fail] mha "), describe(result)  # a bug: ORT's FAIL
        assert text in line and "RuntimeError" in line, f"{marker}: {line}\n{describe(result)}"
    for marker in ("NEXT_ERROR_1", "NEXT_ERROR_2"):
        error = float(result.stdout.split(marker + " ")[1].split()[0])
        assert error <= TOLERANCE, f"{marker}: run after the failure: error {error:.3g}\n{describe(result)}"


def test_plain_session_backend_bug_is_logged_with_traceback_not_fatal():
    result = run_script(
        SESSION_PRELUDE
        + BUGGY_BACKENDS
        + """
    model = mha_ep.partition(build_model(config)).model
    options = mha_ep.register(ort.SessionOptions(), backend="reference")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    reference.run_reference = buggy_run_reference
    out = session.run(None, good)[0]
    print("BUG_SHAPE", out.shape, "ALL_NAN", bool(np.isnan(out).all()))
    print("NEXT_ERROR", max_rel_error(session.run(None, good)[0], expected))
    print("DONE")
    """
    )
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout, describe(result)
    assert "BUG_SHAPE (2, 3, 8) ALL_NAN True" in result.stdout, describe(result)
    assert "LOG mha_ep ERROR" in result.stderr, describe(result)
    assert "RuntimeError: injected backend bug 4711" in result.stderr, describe(result)
    assert "Traceback" in result.stderr and "buggy_run_reference" in result.stderr, describe(result)
    error = float(result.stdout.split("NEXT_ERROR ")[1].split()[0])
    assert error <= TOLERANCE, f"run after the bug: error {error:.3g}\n{describe(result)}"


def test_an_escaping_exception_would_abort_the_process():
    """The hazard the two tests above guard against, shown once: a Python op that raises aborts the process (exit
    134 / SIGABRT), so 'exit 0' in those tests means something. If onnxruntime-extensions ever stops aborting, this
    test fails and the note in docs/FACTS.md §1 can be updated."""
    result = run_script(
        """
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    @onnx_op(op_type="mha_ep_test::Boom", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def boom(x):
        raise RuntimeError("boom from a Python op")

    node = helper.make_node("Boom", ["x"], ["y"], domain="mha_ep_test")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mha_ep_test", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    print("BEFORE", flush=True)
    session.run(None, {"x": np.ones(2, np.float32)})
    print("SURVIVED", flush=True)
    """
    )
    assert "BEFORE" in result.stdout, describe(result)
    assert result.returncode in (134, -6) and "SURVIVED" not in result.stdout, describe(result)
