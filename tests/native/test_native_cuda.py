"""The native library's CUDA kernels in plain ORT CUDA sessions (marker gpu; onnxruntime-gpu on the path): parity
with stock ORT (poisoned temporaries too), the CUDA provider and no Memcpy in ORT's profile, no Python on a repeated
signature, ORT's CUDA graph capturing claimed nodes, misaligned bindings, session lifetime."""

from __future__ import annotations

import resource

import numpy as np
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep import native
from mha_ep.native import ahead

from mha_models import (
    MhaConfig,
    assert_outputs_match,
    build_model,
    oracle_float64,
    packed_feeds,
    packed_model,
    random_feeds,
    stock_outputs,
    with_,
)  # fmt: skip
from native_cases import (  # noqa: F401 - cuda_native: a fixture
    CUDA, cuda_native, library, native_session, profile_providers, profiled_options, run_named, tolerance,
)


# --------------------------------------------------------------------------------------------- kernels, GPU
GPU_CASES = {
    "f16 bert": MhaConfig(dtype="float16", batch=2, q_seq=128, kv_seq=128, num_heads=12, head_size=64, bias=True,
                          mask="2d"),
    "f32 decode past": MhaConfig(batch=2, q_seq=1, kv_seq=1, past_seq=37, has_past=True, presents=True, num_heads=6,
                                 head_size=64, bias=True, mask="1d"),
    "bf16 causal": MhaConfig(dtype="bfloat16", batch=2, q_seq=33, kv_seq=33, num_heads=4, head_size=64, causal=True,
                             attention_bias="B1"),
    "f16 three phases": MhaConfig(dtype="float16", head_size=6, mask="3d", bias=True),
    "f16 cross BNSH": MhaConfig(dtype="float16", q_seq=7, kv_seq=300, kv_layout="BNSH", num_heads=6, head_size=64,
                                mask="3b2", mask_dtype="int64"),
}


def expected_of(config: MhaConfig, feeds: dict) -> dict:
    return oracle_float64(config, feeds) if config.dtype == "bfloat16" else stock_outputs(config, feeds)


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poisoned"])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_cuda_kernels_in_a_plain_session_match_stock_ort(name, poison, cuda_native, rng, tmp_path):
    native.settings.poison = poison
    native.reset_plans()
    config = GPU_CASES[name]
    options = profiled_options()
    options.profile_file_prefix = str(tmp_path / "profile")
    session = native_session(build_model(config), backend="cuda", providers=CUDA, options=options)
    feeds = random_feeds(config, rng)
    assert_outputs_match(run_named(session, feeds), expected_of(config, feeds), tolerance(config.dtype), name)
    providers, ops = profile_providers(session)
    assert providers == {"CUDAExecutionProvider"}, providers
    assert not {op for op in ops if op.startswith("Memcpy")}, ops  # the model's inputs go up once, by ORT's binding


@pytest.mark.gpu
def test_a_repeated_signature_calls_no_python(cuda_native, rng):
    config = GPU_CASES["f16 bert"]
    session = native_session(build_model(config), backend="cuda", providers=CUDA)
    feeds = random_feeds(config, rng)
    session.run(None, feeds)
    before = native.stats()
    for _ in range(50):
        session.run(None, feeds)
    after = native.stats()
    assert after["misses"] == before["misses"] and after["hits"] >= before["hits"] + 50, (before, after)


@pytest.mark.gpu
def test_a_growing_past_is_planned_ahead_and_gives_the_same_outputs_bit_for_bit(cuda_native):
    """A plain decode loop's self attention (past one row longer each call): with plans_ahead = 8, ORT's thread
    plans at the first call and then once every 9 (ahead.py), and the outputs are those of planning every call."""
    config = with_(MhaConfig(dtype="float16", batch=2, q_seq=1, kv_seq=1, num_heads=4, head_size=64, bias=True,
                             has_past=True, past_seq=3, presents=True), shapes="symbolic")  # fmt: skip
    session = native_session(build_model(config), backend="cuda", providers=CUDA)
    lengths = range(3, 23)
    feeds = {p: random_feeds(with_(config, past_seq=p), np.random.default_rng(p)) for p in lengths}
    runs = {}
    for count in (0, 8):
        native.settings.plans_ahead = count
        native.reset_plans()
        before = native.stats()
        outputs = []
        for p in lengths:
            outputs.append(run_named(session, feeds[p]))
            ahead.AHEAD.wait()  # the worker done before the next call: the counts below are exact
        after = native.stats()
        runs[count] = outputs, after["misses"] - before["misses"], after["ahead_used"] - before["ahead_used"]
    assert runs[0][1:] == (20, 0), runs[0][1:]
    assert runs[8][1:] == (3, 17), runs[8][1:]  # misses at P = 3, 12, 21; the others found a plan made ahead
    for p, planned, made_ahead in zip(lengths, runs[0][0], runs[8][0]):
        for name in planned:
            assert np.array_equal(planned[name], made_ahead[name]), f"P = {p}: {name} differs"


@pytest.mark.gpu
def test_the_python_op_form_and_the_three_phase_path_run_on_the_cuda_kernels(cuda_native, rng):
    config = MhaConfig(dtype="float16", bias=True, mask="2d", q_seq=40, kv_seq=40, num_heads=4, head_size=32)
    library()
    part = mha_ep.partition(build_model(config))  # the float32 transport form
    options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
    feeds = random_feeds(config, rng)
    want = stock_outputs(config, feeds)
    for fused in (True, False):
        native.settings.fused_path = fused
        native.reset_plans()
        session = ort.InferenceSession(part.model.SerializeToString(), options, providers=CUDA)
        assert_outputs_match(run_named(session, feeds), want, tolerance("float16"), f"fused={fused}")


GRAPH_CASES = {
    "f16 S64": MhaConfig(dtype="float16", batch=2, q_seq=64, kv_seq=64, num_heads=4, head_size=64, bias=True,
                         mask="1d"),
    # a decoder's cross attention (pipeline.reads_kv_in_place): the arrival counters' Fill and split_key_stream,
    # whose last blocks combine, captured and replayed
    "f16 cross decode": MhaConfig(dtype="float16", batch=2, q_seq=1, kv_seq=1500, num_heads=6, head_size=64,
                                  kv_layout="BNSH", bias=True, mask="1d"),
}  # fmt: skip


def assert_replays_match_eager(config: MhaConfig, eager, first: dict, seed: int = 0) -> None:
    """``config``'s model in a session with ORT's CUDA graph on, every input and the output bound once to CuPy
    buffers (poisoned before each run): six runs, the first on ``first`` and the rest on fresh inputs (ORT captures
    on an early run and replays from then on), each bit-identical to the ``eager`` session's output."""
    import cupy

    graphed = native_session(build_model(config), backend="cuda",
                             providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])
    inputs = {name: cupy.asarray(value) for name, value in first.items()}
    output = cupy.empty((config.batch, config.q_seq, config.num_heads * config.hv), cupy.float16)
    binding = graphed.io_binding()
    for name, array in inputs.items():
        binding.bind_input(name, "cuda", 0, array.dtype, array.shape, array.data.ptr)
    binding.bind_output("output", "cuda", 0, output.dtype, output.shape, output.data.ptr)
    for turn in range(6):
        feeds = first if turn == 0 else random_feeds(config, np.random.default_rng(seed + turn))
        for name, value in feeds.items():
            inputs[name][...] = cupy.asarray(value)
        output.fill(cupy.nan)
        cupy.cuda.runtime.deviceSynchronize()  # the writes above are on CuPy's stream, ORT runs on its own
        graphed.run_with_iobinding(binding)
        cupy.cuda.runtime.deviceSynchronize()
        want = eager.run(["output"], feeds)[0]
        assert np.array_equal(cupy.asnumpy(output), want), f"turn {turn}: the replay differs from the eager run"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_ort_s_cuda_graph_captures_claimed_nodes_and_replays_bit_identical_with_fresh_inputs(name, cuda_native, rng):
    config = GRAPH_CASES[name]
    eager = native_session(build_model(config), backend="cuda", providers=CUDA)
    assert_replays_match_eager(config, eager, random_feeds(config, rng))


@pytest.mark.gpu
def test_a_programmatic_cross_attention_matches_stock_eagerly_and_replays_under_ort_s_cuda_graph(cuda_native, rng,
                                                                                                monkeypatch):  # fmt: skip
    """MHA_EP_PROGRAMMATIC=on: the decode step's split_key_stream, launched programmatically after
    zero_after_prior_grids (dispatch.programmatic_launches), gives stock ORT's output eagerly, and under ORT's CUDA
    graph the replays of fresh inputs give the eager run's, bit for bit."""
    monkeypatch.setenv("MHA_EP_PROGRAMMATIC", "on")
    native.reset_plans()
    config = GRAPH_CASES["f16 cross decode"]
    eager = native_session(build_model(config), backend="cuda", providers=CUDA)
    feeds = random_feeds(config, rng)
    assert_outputs_match(run_named(eager, feeds), stock_outputs(config, feeds), tolerance(config.dtype), "eager")
    assert_replays_match_eager(config, eager, feeds, seed=100)


@pytest.mark.gpu
def test_cuda_sessions_made_and_dropped_in_a_loop_give_back_host_and_device_memory(cuda_native, rng):
    import gc

    import cupy

    config = GPU_CASES["f32 decode past"]
    model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
    feeds = random_feeds(config, rng)

    def cycle(count: int):
        for _ in range(count):
            options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
            session = ort.InferenceSession(model, options, providers=CUDA)
            session.run(None, feeds)
            del session, options
        gc.collect()

    cycle(20)
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cycle(200)
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert free_before - free_after < 64 << 20, f"device memory fell by {(free_before - free_after) >> 20} MiB"
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.1f} MiB over 200 CUDA sessions"


@pytest.mark.gpu
def test_inputs_and_outputs_bound_off_alignment_are_copied_not_misread(cuda_native, rng):
    """IOBinding at addresses 2 bytes off any vector alignment: the plan copies the inputs into aligned scratch
    and writes the outputs through scratch (UNALIGNED_OUTPUTS), so the results equal an aligned run's."""
    import cupy

    config = MhaConfig(dtype="float16", q_seq=16, kv_seq=16, num_heads=2, head_size=64, bias=True,
                       presents=True)  # fmt: skip
    session = native_session(build_model(config), backend="cuda", providers=CUDA)
    feeds = random_feeds(config, rng)
    want = run_named(session, feeds)
    binding = session.io_binding()
    keep = []
    for name, value in feeds.items():
        raw = cupy.zeros(value.size + 8, value.dtype)
        view = raw[1 : 1 + value.size].reshape(value.shape)
        view[...] = cupy.asarray(value)
        keep.append(raw)
        binding.bind_input(name, "cuda", 0, value.dtype, value.shape, view.data.ptr)
    outputs = {}
    for name, value in want.items():
        raw = cupy.full(value.size + 8, np.nan, value.dtype)
        outputs[name] = raw[1 : 1 + value.size].reshape(value.shape)
        keep.append(raw)
        binding.bind_output(name, "cuda", 0, value.dtype, value.shape, outputs[name].data.ptr)
    session.run_with_iobinding(binding)
    cupy.cuda.runtime.deviceSynchronize()
    for name, value in want.items():
        assert np.array_equal(cupy.asnumpy(outputs[name]), value), name


# ------------------------------------------------------------------------------------ the static KV binding
STATIC = MhaConfig(dtype="float16", batch=4, q_seq=1, kv_seq=1, num_heads=6, head_size=64, bias=True, has_past=True,
                   past_seq=0, presents=True, max_seq=48, beams=2, causal=True)  # fmt: skip


def static_binding(session, config: MhaConfig, rng, form=None):
    """Device buffers (CuPy) for every input and output of ``config``'s node (``form`` "qkv": its packed node), bound
    once: the present is the past's own buffer (mha_ep/graph/static_cache.py's binding) and past_sequence_length a
    device tensor."""
    import cupy

    feeds = random_feeds(config, rng)
    feeds = feeds if form is None else packed_feeds(config, feeds, form)
    buffers = {name: cupy.asarray(value) for name, value in feeds.items()}
    buffers["output"] = cupy.full((config.batch, config.q_seq, config.num_heads * config.hv), cupy.nan, cupy.float16)
    binding = session.io_binding()
    for name, array in buffers.items():
        if name != "output":
            binding.bind_input(name, "cuda", 0, array.dtype.type, array.shape, array.data.ptr)
    binding.bind_output("output", "cuda", 0, np.float16, buffers["output"].shape, buffers["output"].data.ptr)
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        array = buffers[past]
        binding.bind_output(present, "cuda", 0, array.dtype.type, array.shape, array.data.ptr)
    return binding, buffers


@pytest.mark.gpu
@pytest.mark.parametrize("programmatic", ["off", "on"], ids=["plain-launch", "programmatic"])
@pytest.mark.parametrize("form", [None, "qkv"], ids=["unpacked", "packed-qkv"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_a_static_cache_step_replays_for_every_past_length_with_the_present_bound_to_its_past(graph, form,
                                                                                            programmatic, cuda_native,
                                                                                            rng, monkeypatch):  # fmt: skip
    """One binding, twelve decode steps, P advanced on the device between them (under ORT's CUDA graph: one
    capture, every later step a replay). Each step matches stock ORT CPU (the node unpacked) fed a copy of the
    cache; only row P of the cache changes. ``form`` "qkv": the node's query, key and value packed into one
    (B, 1, N, 3, H) query, which the decode kernel reads in place (the static-cache rewrite's fused projections).
    ``programmatic`` "on" (MHA_EP_PROGRAMMATIC): shared_buffer_decode launched programmatically on sm_90."""
    import cupy

    monkeypatch.setenv("MHA_EP_PROGRAMMATIC", programmatic)
    native.reset_plans()
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if graph else "CUDAExecutionProvider"
    model = build_model(STATIC) if form is None else packed_model(STATIC, form)
    session = native_session(model, backend="cuda", providers=[provider, "CPUExecutionProvider"])
    binding, buffers = static_binding(session, STATIC, rng, form)
    for p in range(12):
        step = random_feeds(with_(STATIC, past_seq=p), np.random.default_rng(p))
        for name, value in (step if form is None else packed_feeds(STATIC, step, form)).items():
            if name not in ("past_key", "past_value"):  # the cache stays the one buffer; P goes in on the device
                buffers[name][...] = cupy.asarray(value)
        cupy.cuda.runtime.deviceSynchronize()  # ORT's stream does not wait for CuPy's
        host_cache = {name: cupy.asnumpy(buffers[name]) for name in ("past_key", "past_value")}
        expected = stock_outputs(with_(STATIC, past_seq=p), {**step, **host_cache})
        session.run_with_iobinding(binding)
        cupy.cuda.runtime.deviceSynchronize()
        context = f"step {p} ({'graph' if graph else 'eager'})"
        assert_outputs_match({"output": cupy.asnumpy(buffers["output"])}, {"output": expected["output"]},
                             tolerance("float16"), context)  # fmt: skip
        for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
            after = cupy.asnumpy(buffers[past])
            assert np.array_equal(np.delete(after, p, axis=2), np.delete(host_cache[past], p, axis=2)), context
            assert np.array_equal(after[:, :, p], expected[present][:, :, p]), context
    assert native.take_device_error(0) is None


@pytest.mark.gpu
def test_a_bad_past_length_is_an_ort_error_eagerly_and_a_device_report_under_a_graph(cuda_native, rng):
    """Eager: ORT's own sentence, naming the node. Replayed: the kernels clamp, write no row of the cache, and the
    report waits in native.take_device_error."""
    import cupy

    eager = native_session(build_model(STATIC), backend="cuda", providers=CUDA)
    binding, buffers = static_binding(eager, STATIC, rng)
    buffers["past_sequence_length"][...] = STATIC.max_seq
    cupy.cuda.runtime.deviceSynchronize()
    with pytest.raises(Exception, match=r"node 'mha'.*past_sequence_length must be non-negative and less than "
                                        r"max_sequence_length \(48\), got 48"):  # fmt: skip
        eager.run_with_iobinding(binding)
    graphed = native_session(build_model(STATIC), backend="cuda",
                             providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])
    binding, buffers = static_binding(graphed, STATIC, rng)
    for p in range(3):  # warm-up and capture with good lengths
        buffers["past_sequence_length"][...] = p
        cupy.cuda.runtime.deviceSynchronize()  # ORT's stream does not wait for CuPy's
        graphed.run_with_iobinding(binding)
    cupy.cuda.runtime.deviceSynchronize()
    assert native.take_device_error(0) is None
    cache = {name: buffers[name].copy() for name in ("past_key", "past_value")}
    # L = 1 here, so P + L > M only when P >= M: both bad values are range reports
    for bad, text in ((-3, "less than max_sequence_length (48), got -3"),
                      (STATIC.max_seq, f"less than max_sequence_length (48), got {STATIC.max_seq}")):  # fmt: skip
        buffers["past_sequence_length"][...] = bad
        cupy.cuda.runtime.deviceSynchronize()
        graphed.run_with_iobinding(binding)
        cupy.cuda.runtime.deviceSynchronize()
        report = native.take_device_error(0)
        assert report is not None and text in report and "'mha'" in report, (bad, report)
        assert native.take_device_error(0) is None  # taken
        for name, before in cache.items():
            assert bool((buffers[name] == before).all()), f"{name}: a bad length wrote the cache"
        assert bool(cupy.isfinite(buffers["output"]).all())
    buffers["past_sequence_length"][...] = 5
    buffers["cache_indirection"][...] = 7  # beam indices out of [0, 2)
    cupy.cuda.runtime.deviceSynchronize()
    graphed.run_with_iobinding(binding)
    cupy.cuda.runtime.deviceSynchronize()
    report = native.take_device_error(0)
    assert report is not None and "cache_indirection beam index out of range. Expected [0, 2), got 7" in report
