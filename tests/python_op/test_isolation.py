"""Issue 16, items 6-7: mha_ep touches nothing that is not its own.

6. One ``RunOptions`` shared by 8 threads of one ``mha_ep.InferenceSession``: a thread whose feed is bad must not
   cancel the others' runs (the error channel sets ``terminate`` on a RunOptions of the run's own), and the
   caller's RunOptions is never changed. The caller's readable settings are carried over.
7. A third-party Python op, declared float and returning int32, gives after ``mha_ep.register`` exactly what
   stock onnxruntime-extensions gives (the value 1.0 for 1, not the reinterpreted bits 1e-45).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep.session import own_run_options

from harness import SESSION_PRELUDE, describe, run_script, run_threads
from mha_models import MhaConfig, build_model, random_feeds, stock_outputs

TOLERANCE = 1e-5  # against stock ORT CPU, float32

THREADS = 8
RUNS = 30


def with_nodes_around(model, count: int = 20):
    """``count`` Identity nodes after the MHA node: ORT checks ``terminate`` before each node, so a run spends
    most of its time where a terminate set by another thread would stop it."""
    from onnx import helper

    graph = model.graph
    last = graph.output[0].name
    graph.node[-1].output[0] = last + ".0"
    for index in range(count):
        out = last if index == count - 1 else f"{last}.{index + 1}"
        graph.node.append(helper.make_node("Identity", [f"{last}.{index}"], [out]))
    return model


def test_a_shared_run_options_is_not_cancelled_by_another_threads_error():
    config = MhaConfig(batch=2, q_seq=3, kv_seq=5, num_heads=2, head_size=4, shapes="symbolic")
    session = mha_ep.InferenceSession(with_nodes_around(build_model(config)), backend="reference")
    good = random_feeds(config, np.random.default_rng(3))
    expected = stock_outputs(config, good)["output"]
    bad = dict(good, key=good["key"][:1])  # key batch 1 vs query batch 2
    shared = ort.RunOptions()
    shared.logid = "shared"
    outcomes = {}

    def target(index):
        for run in range(RUNS):
            try:
                out = session.run(["output"], bad if index == 0 else good, shared)[0]
                outcomes[(index, run)] = "ok" if np.allclose(out, expected, atol=1e-5) else "wrong"
            except mha_ep.MhaRunError as error:
                outcomes[(index, run)] = "bad feed" if "key batch 1 must equal query batch 2" in str(error) else str(error)
            except Exception as error:  # noqa: BLE001 - a cancelled run ("Exiting due to terminate flag")
                outcomes[(index, run)] = f"{type(error).__name__}: {error}"

    assert not run_threads(target, THREADS)
    cancelled = {key: value for key, value in outcomes.items() if key[0] != 0 and value != "ok"}
    assert not cancelled, f"good runs cancelled or wrong: {cancelled}"
    assert all(outcomes[(0, run)] == "bad feed" for run in range(RUNS)), outcomes
    assert shared.terminate is False and shared.logid == "shared"


def test_each_run_gets_its_own_run_options_with_the_callers_settings():
    caller = ort.RunOptions()
    caller.log_severity_level = 1
    caller.log_verbosity_level = 2
    caller.logid = "mine"
    caller.only_execute_path_to_fetches = True
    caller.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    own = own_run_options(caller)
    assert own is not caller
    assert (own.log_severity_level, own.log_verbosity_level, own.logid, own.only_execute_path_to_fetches) == (
        1, 2, "mine", True,
    )  # fmt: skip
    assert own.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    own.terminate = True
    assert caller.terminate is False


def test_a_third_party_python_op_keeps_its_stock_results():
    result = run_script(
        """
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    import mha_ep

    @onnx_op(op_type="third_party::AsInt", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def as_int(x):  # declared float, returns int32: stock converts through tolist(), so 1 -> 1.0
        return np.ones(x.shape, np.int32)

    node = helper.make_node("AsInt", ["x"], ["y"], domain="third_party")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("third_party", 1)])
    model.ir_version = 10

    def run():
        options = ort.SessionOptions()
        options.register_custom_ops_library(get_library_path())
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, {"x": np.zeros(3, np.float32)})[0].tolist()

    print("STOCK", run())
    mha_ep.register(ort.SessionOptions(), backend="reference")
    print("AFTER", run())
    """
    )
    assert result.returncode == 0, describe(result)
    assert "STOCK [1.0, 1.0, 1.0]" in result.stdout, describe(result)
    assert "AFTER [1.0, 1.0, 1.0]" in result.stdout, describe(result)


# ---------------------------------------------------------------------------------------------------- (c)
def test_other_python_ops_keep_working_beside_the_array_hook():
    result = run_script(
        SESSION_PRELUDE
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
    from mha_ep.registration import ensure_ops_registered

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
