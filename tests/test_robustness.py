"""Robustness: threads, failures inside the op, and other Python ops living beside ours.

(a) 8 threads share one ``mha_ep.InferenceSession``, each running its own random feeds (its own B, S, L, P) many
    times; every result matches stock ORT (computed beforehand on the main thread). A thread that keeps failing
    does not leak its error into the others.
(b) In a subprocess (an exception escaping a Python op aborts the whole process, exit 134, so these paths are
    never run inside pytest's own process), asserting the exit status and the messages:
    - a plain ``onnxruntime.InferenceSession`` with ``mha_ep.register`` and a bad feed: exit 0, the error logged on
      the ``mha_ep`` logger, NaN outputs, and the same session then runs a good feed correctly;
    - a backend with a bug (a plain RuntimeError inside the op), injected by patching
      ``mha_ep.ops.backends.reference.run_reference`` or by giving the session a fake backend object: through
      ``mha_ep.InferenceSession`` it surfaces as ``MhaRunError`` carrying the RuntimeError's text and the session
      works on the next run; through a plain ORT session it is logged (with the traceback) and the outputs are NaN.
(c) Ordinary onnxruntime-extensions Python ops (one returning strings, as a str array and as an object array, of
    rank 1 and rank 2; one returning a non-contiguous float array; one with two outputs) keep working in a process
    where mha_ep installed its array result hook, before and after an MHA run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import mha_ep
from mha_models import MhaConfig, build_model, plugin_session, random_feeds, stock_outputs, with_

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
THREADS = 8
RUNS_PER_THREAD = 12
TOLERANCE = 1e-5

# One model whose every dim is symbolic, so each thread can feed its own sizes.
THREAD_MODEL_CONFIG = MhaConfig(
    num_heads=2, head_size=8, bias=True, mask="2d", attention_bias="1N", causal=True, has_past=True,
    presents=True, shapes="symbolic",
)


def thread_config(index: int) -> MhaConfig:
    """Thread ``index``'s sizes: different B, S, L, P per thread (S != L for half of them)."""
    return with_(
        THREAD_MODEL_CONFIG,
        batch=1 + index % 3,
        q_seq=1 + index % 4,
        kv_seq=1 + (index * 3) % 5,
        past_seq=index % 3,
    )


def run_threads(target, count: int) -> list:
    """Run ``target(index)`` on ``count`` threads released together; returns the exceptions they raised."""
    barrier = threading.Barrier(count)
    failures = []

    def body(index):
        try:
            barrier.wait(timeout=60)
            target(index)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            failures.append((index, error))

    threads = [threading.Thread(target=body, args=(i,), name=f"mha-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return failures


# ---------------------------------------------------------------------------------------------------- (a)
def test_eight_threads_share_one_session(run_backend, rng):
    backend = run_backend
    session = plugin_session(build_model(THREAD_MODEL_CONFIG), backend)
    names = ["output", "present_key", "present_value"]
    work = []
    for index in range(THREADS):
        config = thread_config(index)
        cases = []
        for _ in range(3):  # three feeds per thread, cycled
            feeds = random_feeds(config, rng)
            cases.append((feeds, stock_outputs(config, feeds)))
        work.append((config, cases))
    results = {}

    def target(index):
        config, cases = work[index]
        for run in range(RUNS_PER_THREAD):
            feeds, expected = cases[run % len(cases)]
            actual = dict(zip(names, session.run(names, feeds)))
            results[(index, run)] = (config, actual, expected)

    failures = run_threads(target, THREADS)
    assert not failures, f"threads raised: {failures}"
    assert len(results) == THREADS * RUNS_PER_THREAD
    from mha_models import assert_outputs_match

    for (index, run), (config, actual, expected) in sorted(results.items(), key=lambda kv: kv[0]):
        assert_outputs_match(actual, expected, TOLERANCE, f"[{backend}] thread {index} run {run} {config.short()}")


def test_an_error_in_one_thread_stays_in_that_thread(run_backend, rng):
    backend = run_backend
    """Thread 0 feeds a bad key batch on every run and must get MhaRunError every time; the other threads run good
    feeds at the same moment and must never see an error nor a wrong result."""
    config = with_(THREAD_MODEL_CONFIG, has_past=False, presents=False, causal=False, attention_bias=None)
    session = plugin_session(build_model(config), backend)
    good = random_feeds(config, rng)
    expected = stock_outputs(config, good)["output"]
    bad = dict(good, key=np.concatenate([good["key"], good["key"]]))  # key batch 4 vs query batch 2
    outcomes = {}

    def target(index):
        for run in range(RUNS_PER_THREAD):
            if index == 0:
                try:
                    session.run(["output"], bad)
                    outcomes[(index, run)] = "no error"
                except mha_ep.MhaRunError as error:
                    outcomes[(index, run)] = str(error)
            else:
                outcomes[(index, run)] = session.run(["output"], good)[0]

    failures = run_threads(target, 4)
    assert not failures, f"threads raised: {failures}"
    from conftest import max_rel_error

    for (index, run), outcome in sorted(outcomes.items(), key=lambda kv: kv[0]):
        if index == 0:
            assert "key batch 4 must equal query batch 2" in outcome, f"[{backend}] bad thread run {run}: {outcome}"
        else:
            error = max_rel_error(outcome, expected)
            assert error <= TOLERANCE, f"[{backend}] good thread {index} run {run}: error {error:.3g} > {TOLERANCE}"


# ---------------------------------------------------------------------------------------------------- (b)
def run_script(code: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"


PRELUDE = """
    import logging, sys
    import numpy as np
    import onnxruntime as ort
    import mha_ep
    from conftest import max_rel_error
    from mha_models import MhaConfig, build_model, random_feeds, stock_outputs
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")
    config = MhaConfig(batch=2, q_seq=3, kv_seq=5, num_heads=2, head_size=4, bias=True, mask="2d", shapes="symbolic")
    rng = np.random.default_rng(7)
    good = random_feeds(config, rng)
    expected = stock_outputs(config, good)["output"]
"""


def test_plain_session_bad_feed_logs_and_returns_nan(backend):
    """The Python op in a plain session has no error channel: the error is logged, the outputs are NaN."""
    result = run_script(
        PRELUDE
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
        PRELUDE
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
    import mha_ep.ops.backends.reference as reference
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
        PRELUDE
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
        assert line.startswith(f"{marker} MhaRunError mha "), describe(result)
        assert text in line and "RuntimeError" in line, f"{marker}: {line}\n{describe(result)}"
    for marker in ("NEXT_ERROR_1", "NEXT_ERROR_2"):
        error = float(result.stdout.split(marker + " ")[1].split()[0])
        assert error <= TOLERANCE, f"{marker}: run after the failure: error {error:.3g}\n{describe(result)}"


def test_plain_session_backend_bug_is_logged_with_traceback_not_fatal():
    result = run_script(
        PRELUDE
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


# ---------------------------------------------------------------------------------------------------- (c)
def test_other_python_ops_keep_working_beside_the_array_hook():
    result = run_script(
        PRELUDE
        + """
    from onnx import TensorProto, helper
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    # mha_ep first: its session installs its result hook, through which every Python op in the process runs
    mha_session = mha_ep.InferenceSession(build_model(config), backend="reference")
    print("MHA_ERROR_BEFORE", max_rel_error(mha_session.run(None, good)[0], expected))

    @onnx_op(op_type="mha_ep_test::Shout", inputs=[PyCustomOpDef.dt_string], outputs=[PyCustomOpDef.dt_string])
    def shout(words):  # returns a numpy str array ('<U...')
        return np.array([w.upper() + "!" for w in words.reshape(-1)]).reshape(words.shape)

    @onnx_op(op_type="mha_ep_test::Tag", inputs=[PyCustomOpDef.dt_string], outputs=[PyCustomOpDef.dt_string])
    def tag(words):  # returns an object array of Python str
        out = np.empty(words.shape, dtype=object)
        for index, w in np.ndenumerate(words):
            out[index] = f"<{w}>"
        return out

    @onnx_op(op_type="mha_ep_test::Strided", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def strided(x):  # a transposed view of every other column: not C-contiguous
        y = (x * 2.0)[:, ::2].T
        assert not y.flags["C_CONTIGUOUS"]
        return y

    @onnx_op(op_type="mha_ep_test::Split2", inputs=[PyCustomOpDef.dt_float],
             outputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64])
    def split2(x):  # two outputs of different types
        return x[::-1].copy(), np.arange(x.size, dtype=np.int64).reshape(x.shape)[:, ::-1]

    S, F, I = TensorProto.STRING, TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        helper.make_node("Shout", ["words"], ["shouted"], domain="mha_ep_test"),
        helper.make_node("Tag", ["shouted"], ["tagged"], domain="mha_ep_test"),
        helper.make_node("Strided", ["x"], ["strided"], domain="mha_ep_test"),
        helper.make_node("Split2", ["x"], ["reversed", "indices"], domain="mha_ep_test"),
    ]
    graph = helper.make_graph(
        nodes, "python_ops",
        [helper.make_tensor_value_info("words", S, [4]), helper.make_tensor_value_info("x", F, [3, 5])],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("shouted", S), ("tagged", S), ("strided", F), ("reversed", F), ("indices", I))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mha_ep_test", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    words = np.array(["ab", "cd", "éf", ""], dtype=object)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    for attempt in range(2):
        shouted, tagged, strided_out, reversed_out, indices = session.run(None, {"words": words, "x": x})
        checks = {
            "shouted": shouted.tolist() == ["AB!", "CD!", "ÉF!", "!"],
            "tagged": tagged.tolist() == ["<AB!>", "<CD!>", "<ÉF!>", "<!>"],
            "strided": strided_out.shape == (3, 3) and np.array_equal(strided_out, (x * 2.0)[:, ::2].T),
            "reversed": np.array_equal(reversed_out, x[::-1]),
            "indices": indices.dtype == np.int64 and np.array_equal(indices, np.arange(15).reshape(3, 5)[:, ::-1]),
        }
        print("CHECKS", attempt, checks)
        if attempt == 0:
            print("MHA_ERROR_AFTER", max_rel_error(mha_session.run(None, good)[0], expected))
    print("DONE")
    """
    )
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout, describe(result)
    for attempt in (0, 1):
        line = next(l for l in result.stdout.splitlines() if l.startswith(f"CHECKS {attempt}"))
        assert "False" not in line and line.count("True") == 5, f"{line}\n{describe(result)}"
    for marker in ("MHA_ERROR_BEFORE", "MHA_ERROR_AFTER"):
        error = float(result.stdout.split(marker + " ")[1].split()[0])
        assert error <= TOLERANCE, f"{marker}: error {error:.3g}\n{describe(result)}"


@pytest.mark.parametrize("kind", ["str_array", "object_array"])
def test_string_op_with_a_rank_2_output_keeps_working_beside_the_array_hook(kind):
    """A (2, 2) string output of an ordinary Python op, after mha_ep installed its hook (the stock hook runs it).
    It aborted the process (pybind11::cast_error, SIGABRT) until 265d5a0 sent string outputs down the tolist path."""
    result = run_script(
        f"""
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    from mha_ep.ops.registration import ensure_ops_registered

    ensure_ops_registered()  # what the first mha_ep.register / mha_ep.InferenceSession does

    @onnx_op(op_type="mha_ep_test::Upper", inputs=[PyCustomOpDef.dt_string], outputs=[PyCustomOpDef.dt_string])
    def upper(words):
        values = [w.upper() for w in words.reshape(-1)]
        if {kind!r} == "object_array":
            return np.array(values, dtype=object).reshape(words.shape)
        return np.array(values).reshape(words.shape)

    node = helper.make_node("Upper", ["words"], ["upper"], domain="mha_ep_test")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("words", TensorProto.STRING, [2, 2])],
                              [helper.make_tensor_value_info("upper", TensorProto.STRING, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mha_ep_test", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    out = session.run(None, {{"words": np.array([["ab", "cd"], ["ef", "g"]], dtype=object)}})[0]
    print("UPPER", out.tolist())
    """
    )
    assert result.returncode == 0, describe(result)
    assert "UPPER [['AB', 'CD'], ['EF', 'G']]" in result.stdout, describe(result)
