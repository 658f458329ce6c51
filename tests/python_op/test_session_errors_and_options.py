"""mha_ep.InferenceSession as a server sees it: a claimed node's failure is onnxruntime's own exception type as
well as MhaRunError, on both routes, and the caller's SessionOptions come out of the session unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

import mha_ep
from mha_ep.errors import MhaRunError, run_error
from mha_ep.session import SESSION_CONFIG_KEYS, copy_session_options

from small_models import one_mha, qkv_feeds

ROUTES = ("python-op", "native")


def bad_key_feeds():
    feeds = qkv_feeds()
    feeds["k"] = feeds["v"] = np.random.default_rng(5).standard_normal((2, 3, 6)).astype(np.float32)  # hidden 6 != 8
    return feeds


def unshaped_model():
    model = one_mha()
    for value in model.graph.input:
        value.type.tensor_type.ClearField("shape")  # shapes decided at run time
    return model


@pytest.mark.parametrize("route", ROUTES)
def test_a_refused_input_raises_ort_invalid_argument_as_stock_ort_does(route):
    model = unshaped_model()
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(InvalidArgument):
        stock.run(None, bad_key_feeds())
    session = mha_ep.InferenceSession(model, backend="reference", route=route)
    try:
        session.run(None, bad_key_feeds())
    except InvalidArgument as error:  # a server's handler written for stock ORT
        assert isinstance(error, MhaRunError) and error.node_name == "mha" and error.code == 2
        assert type(error).__name__ == "MhaRunError[InvalidArgument]"
        assert "key" in str(error)
    else:
        pytest.fail("no error")
    assert np.isfinite(session.run(None, qkv_feeds())[0]).all()  # the session is still usable


def test_run_errors_keep_their_type_through_pickling_and_without_a_code():
    error = run_error("mha", "mha_ep MultiHeadAttention: query too short", 2)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and isinstance(again, InvalidArgument)
    assert (again.node_name, again.message, again.code, str(again)) == (error.node_name, error.message, 2, str(error))
    assert isinstance(run_error("mha", "x"), Fail) and not isinstance(run_error("mha", "x"), InvalidArgument)
    assert isinstance(MhaRunError("mha", "x"), RuntimeError)  # the plain class stays a RuntimeError too


def fully_set_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads = 3
    options.intra_op_num_threads = 2
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.enable_mem_pattern = False
    options.use_deterministic_compute = True
    options.log_severity_level = 3
    options.logid = "server"
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return options


def readable(options) -> dict:
    state = {n: str(getattr(options, n)) for n, a in vars(type(options)).items() if isinstance(a, property)}
    for key in (*SESSION_CONFIG_KEYS, "mha_ep.route", "mha_ep.backend"):
        try:
            state[key] = options.get_session_config_entry(key)
        except Exception:  # noqa: BLE001 - not set
            pass
    return state


def test_the_copy_carries_every_readable_setting():
    options = fully_set_options()
    assert readable(copy_session_options(options)) == readable(options)


@pytest.mark.parametrize("route", ROUTES)
def test_the_callers_options_are_unchanged_and_serve_another_route(route):
    """The session runs sequentially with mha_ep's library registered, on a copy: the caller's PARALLEL mode and
    entries stay, and the same object then builds a session of the other route (it used to raise ValueError)."""
    options = fully_set_options()
    before = readable(options)
    first = mha_ep.InferenceSession(unshaped_model(), options, backend="reference", route=route)
    assert readable(options) == before
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    other = "native" if route == "python-op" else "python-op"
    second = mha_ep.InferenceSession(unshaped_model(), options, backend="reference", route=other)
    assert readable(options) == before
    expected = ort.InferenceSession(unshaped_model().SerializeToString(), providers=["CPUExecutionProvider"])
    for session in (first, second):
        np.testing.assert_allclose(session.run(None, qkv_feeds())[0], expected.run(None, qkv_feeds())[0],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_options_with_added_providers_are_refused_with_a_way_out():
    options = ort.SessionOptions()
    try:
        options.add_provider("CPUExecutionProvider", {})
    except Exception:  # noqa: BLE001 - an onnxruntime without add_provider for this EP
        pytest.skip("this onnxruntime cannot add the CPU provider to SessionOptions")
    with pytest.raises(ValueError, match=r"providers=\[\.\.\.\]"):
        copy_session_options(options)


def test_device_id_and_the_cuda_providers_device_are_one_gpu():
    """``device_id`` reaches ORT's CUDA provider where the caller left its device out (on copies), is read from it
    when not given, and a different one in each place is refused with both named."""
    from mha_ep.providers import on_one_device

    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    providers = [cuda, cpu]
    assert on_one_device(None, providers, None) == (0, providers, None)
    assert on_one_device(1, providers, None) == (1, [(cuda, {"device_id": "1"}), cpu], None)
    assert providers == [cuda, cpu]  # the caller's list unchanged
    options = [{"arena_extend_strategy": "kSameAsRequested"}, {}]
    assert on_one_device(1, providers, options)[2] == [{"arena_extend_strategy": "kSameAsRequested",
                                                        "device_id": "1"}, {}]  # fmt: skip
    assert options[0] == {"arena_extend_strategy": "kSameAsRequested"}
    assert on_one_device(None, [(cuda, {"device_id": "1"}), cpu], None)[0] == 1
    assert on_one_device(1, [(cuda, {"device_id": 1})], None)[0] == 1
    with pytest.raises(ValueError, match=r"device_id=0 but the CUDA provider's options say device_id='1'"):
        on_one_device(0, [(cuda, {"device_id": "1"})], None)
    assert on_one_device(1, [cpu], None) == (1, [cpu], None)  # no CUDA provider: nothing to set


def test_a_refused_graph_drops_the_stream_the_session_added_and_keeps_the_callers():
    """When ORT refuses its CUDA graph, the session retries without ``enable_cuda_graph`` and without the
    ``user_compute_stream`` it added for the graph (ONE_STREAM_REPLAY), but never takes out a stream the caller gave;
    on copies, in both of onnxruntime's ways of passing provider options."""
    from mha_ep.providers import without_cuda_graph

    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    ours = {"enable_cuda_graph": "1", "user_compute_stream": "1234", "has_user_compute_stream": "1", "device_id": "0"}
    providers = [(cuda, dict(ours)), cpu]
    assert without_cuda_graph(providers, None, drop_stream=True) == ([(cuda, {"device_id": "0"}), cpu], None)
    kept = without_cuda_graph(providers, None, drop_stream=False)[0][0][1]
    assert kept == {"user_compute_stream": "1234", "has_user_compute_stream": "1", "device_id": "0"}
    assert providers[0][1] == ours  # the caller's dictionary unchanged
    options = [dict(ours), {}]
    assert without_cuda_graph([cuda, cpu], options, drop_stream=True) == ([cuda, cpu], [{"device_id": "0"}, {}])
    assert options[0] == ours


def test_a_session_reads_its_providers_once_into_one_value():
    """SessionProviders.read: the providers as ORT takes them (CPU alone by default), the GPU, whether the CUDA
    provider and its graph are on, in either of onnxruntime's ways of passing options; ``eager`` drops the graph
    and leaves the caller's lists as they were."""
    from mha_ep.providers import SessionProviders

    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    plain = SessionProviders.read(None, None, None)
    assert (plain.providers, plain.device_id, plain.on_cuda, plain.cuda_graph) == ((cpu,), 0, False, False)
    theirs = [(cuda, {"enable_cuda_graph": "1"}), cpu]
    graph = SessionProviders.read(1, theirs, None)
    assert (graph.device_id, graph.on_cuda, graph.cuda_graph) == (1, True, True)
    assert graph.providers[0] == (cuda, {"enable_cuda_graph": "1", "device_id": "1"})
    eager = graph.eager()
    assert not eager.cuda_graph and eager.providers[0] == (cuda, {"device_id": "1"})
    assert theirs[0][1] == {"enable_cuda_graph": "1"}  # the caller's dictionary unchanged
    apart = SessionProviders.read(None, [cuda, cpu], [{"enable_cuda_graph": "true"}, {}])
    assert apart.cuda_graph and apart.provider_options == ({"enable_cuda_graph": "true"}, {})
    assert not apart.eager().cuda_graph and apart.eager().provider_options[0] == {}


def test_the_retired_device_mode_names_its_replacement_and_the_rest_of_the_keyword_warns():
    """Device-resident mode was retired: asking for it raises MhaEpError naming what replaced it (ORT's CUDA graph
    on the native route), the values that never took it only warn, and anything else is a ValueError."""
    import warnings

    from mha_ep.errors import MhaEpError
    from mha_ep.session import check_device_mode

    for value in ("device", True):
        with pytest.raises(MhaEpError, match=r"retired.*enable_cuda_graph.*run_device"):
            check_device_mode(value)
    for value in ("python-op", False, None):
        with pytest.warns(DeprecationWarning, match="has no effect"):
            check_device_mode(value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_mode("auto")  # the default: silent
    with pytest.raises(ValueError, match="got 'gpu'"):
        check_device_mode("gpu")
    with pytest.raises(MhaEpError, match="retired"):
        mha_ep.InferenceSession(b"not read: the keyword is checked first", device_mode="device")
