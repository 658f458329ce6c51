"""The native library's CPU kernel in plain ORT sessions (the reference backend behind it): crafted nodes, bad
input, float16/bfloat16 in their type, the Python op's form, ORT's profile, threads, a thousand sessions,
interpreter exit with live sessions."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import threading

import numpy as np
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep import spec

from harness import REPO, SUPPORT
from mha_models import (
    MhaConfig,
    assert_outputs_match,
    build_model,
    oracle_float64,
    random_feeds,
    stock_outputs,
    with_,
)  # fmt: skip
from native_cases import crafted, library, native_session, profile_providers, profiled_options, run_named, tolerance


@pytest.mark.parametrize("changes, message", [
    ({spec.ATTR_INPUTS: None}, "attribute(s) mha_ep_inputs missing"),
    ({spec.ATTR_DTYPE: "float64"}, "mha_ep_dtype is 'float64'"),
    ({spec.ATTR_FLOATS: "scale=zz"}, "mha_ep_floats is not readable"),
    ({"num_heads": 0}, "num_heads must be > 0"),
    ({spec.ATTR_NODE: b"\xff\xfe"}, "mha_ep_node is not UTF-8"),
])  # fmt: skip
def test_a_crafted_node_fails_the_session_with_its_attribute_named(changes, message):
    library()
    model = crafted(build_model(MhaConfig()), **changes)
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_a_bad_input_is_an_ort_error_naming_node_input_and_shape_and_the_next_run_works(rng):
    config = MhaConfig(mask="2d", shapes="symbolic")
    session = native_session(build_model(config))
    good = random_feeds(config, rng)
    bad = dict(good, key_padding_mask=good["key_padding_mask"][:, :3])
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument) as caught:
        session.run(None, bad)
    text = str(caught.value)
    assert "mha_ep MultiHeadAttention node 'mha'" in text and "key_padding_mask" in text and "(2, 3)" in text, text
    assert_outputs_match(run_named(session, good), stock_outputs(config, good), 1e-5, "after the bad run")


def test_bfloat16_and_float16_nodes_keep_their_type_and_run_on_the_cpu_kernels(rng):
    for dtype in ("float16", "bfloat16"):
        config = MhaConfig(dtype=dtype, bias=True, mask="1d", has_past=True, past_seq=2, presents=True)
        part = mha_ep.partition(build_model(config), route="native")
        node = next(n for n in part.model.graph.node if n.domain == spec.PLUGIN_DOMAIN)
        assert all(not name.endswith(spec.TRANSPORT_IN) for name in node.input)
        assert spec.absent_float(dtype) in node.input  # attention_bias's placeholder has the node's type
        session = native_session(build_model(config))
        feeds = random_feeds(config, rng)
        want = oracle_float64(config, feeds) if dtype == "bfloat16" else stock_outputs(config, feeds)
        assert_outputs_match(run_named(session, feeds), want, tolerance(dtype), config.short())


def test_the_python_op_form_of_a_model_runs_on_the_native_kernels(rng):
    config = MhaConfig(dtype="float16", bias=True, mask="2d")
    library()
    part = mha_ep.partition(build_model(config))  # route="python-op": float32 Casts around the node
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
    session = ort.InferenceSession(part.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = random_feeds(config, rng)
    assert_outputs_match(run_named(session, feeds), stock_outputs(config, feeds), tolerance("float16"), "python-op form")


def test_ort_s_profile_places_the_claimed_node_on_the_cpu_provider(rng, tmp_path):
    config = MhaConfig(mask="1d")
    options = profiled_options()
    options.profile_file_prefix = str(tmp_path / "profile")
    session = native_session(build_model(config), options=options)
    session.run(None, random_feeds(config, rng))
    providers, _ = profile_providers(session)
    assert providers == {"CPUExecutionProvider"}


def test_threads_share_one_session_and_several_sessions_run_at_once(rng):
    configs_ = [with_(MhaConfig(mask="2d", bias=True, shapes="symbolic"), batch=1 + i % 3, q_seq=2 + i % 4)
                for i in range(8)]  # fmt: skip
    shared = native_session(build_model(configs_[0]))
    others = [native_session(build_model(configs_[0])) for _ in range(2)]
    feeds = [random_feeds(c, np.random.default_rng(i)) for i, c in enumerate(configs_)]
    expected = [stock_outputs(c, f) for c, f in zip(configs_, feeds)]
    failures = []

    def work(index: int):
        try:
            for turn in range(10):
                session = shared if turn % 2 else others[index % 2]
                assert_outputs_match(run_named(session, feeds[index]), expected[index], 1e-5, f"thread {index}")
        except BaseException as error:  # noqa: BLE001
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def test_a_thousand_sessions_made_and_dropped_do_not_grow_memory(rng):
    import gc

    config = MhaConfig(mask="1d")
    model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
    feeds = random_feeds(config, rng)

    def cycle(count: int):
        for _ in range(count):
            options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            session.run(None, feeds)
            del session, options
        gc.collect()

    cycle(100)  # warm-up: allocator pools, ORT's statics
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cycle(1000)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.1f} MiB over 1000 sessions"


def test_the_interpreter_exits_cleanly_with_live_sessions():
    """Sessions still alive at exit (held by a module global and by a reference cycle), on both routes' forms.
    (A daemon thread still inside a run at exit aborts the process with stock ORT alone: not tested.)"""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(SUPPORT)!r})
        import numpy as np, onnxruntime as ort, mha_ep
        from mha_models import MhaConfig, build_model, random_feeds
        config = MhaConfig(dtype="float16", mask="1d")
        feeds = random_feeds(config, np.random.default_rng(0))
        model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
        kept = []
        for _ in range(3):
            options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
            kept.append(ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]))
            kept[-1].run(None, feeds)
        cycle = {{"session": mha_ep.InferenceSession(build_model(config), backend="reference", route="native")}}
        cycle["self"] = cycle
        cycle["session"].run(None, feeds)
        print("done", flush=True)
    """)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert done.returncode == 0 and "done" in done.stdout, (done.returncode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
