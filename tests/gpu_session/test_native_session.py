"""``mha_ep.InferenceSession`` on the CUDA provider: one ORT session on the native route, tensors on the GPU
(mha_ep/gpu_session/cuda_io.py), and the greedy loop over it (mha_ep/decode/generate.py).

Every case needs CuPy, a GPU, onnxruntime with the CUDA provider and the native library (the ``gpu`` marker;
skipped cleanly elsewhere). Whole models are held to stock ORT CUDA, both without TF32.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

import mha_ep
from mha_ep import shipped
from mha_ep.feeds import random_feeds
from mha_ep.models.synthetic import bert_encoder, decoder_step_feeds, encoder_feeds, whisper_decoder_step

from conftest import native_cuda_unavailable_reason
from stock_cuda import CUDA, PROVIDERS, assert_close, stock_cuda

pytestmark = pytest.mark.gpu
SHIPPED = sorted(shipped.folder().glob("*.onnx"))
GRAPHS = [(CUDA, {"use_tf32": "0", "enable_cuda_graph": "1"}), "CPUExecutionProvider"]


@pytest.fixture(autouse=True)
def _needs_the_native_cuda_route():
    reason = native_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_models_match_stock_ort_eagerly_and_on_the_device(path):
    import cupy

    model = onnx.load(path)
    dtype = "float16" if "fp16" in path.stem else "float32"
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
    assert session.mode == "native" and session.cuda_io is not None, session.mode_reason
    for seed in range(2):
        feeds = random_feeds(model, seed=seed)
        expected = stock_cuda(model, feeds)
        assert_close(session.run(None, feeds), expected, dtype, f"{path.stem} run, call {seed + 1}")
        device = session.run_device(None, {n: cupy.asarray(v) for n, v in feeds.items()})
        assert all(isinstance(a, cupy.ndarray) for a in device)
        assert_close([cupy.asnumpy(a) for a in device], expected, dtype, f"{path.stem} run_device, call {seed + 1}")


def test_graphs_per_signature_replay_fresh_values_and_new_shapes_get_their_own():
    """enable_cuda_graph: each (B, S) gets a gpu_graph_id; calls 1 eager, 2 captured, 3-4 replayed with new values
    at new addresses (a strided view, a NumPy feed beside CuPy ones), and a second shape in between."""
    import cupy

    model = bert_encoder(layers=2, hidden=64, heads=2, ffn=128, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    assert session.cuda_io is not None and session.cuda_io.graphs, session.mode_reason
    for call in range(5):
        for batch, sequence in ((2, 24), (3, 17)):
            feeds = encoder_feeds(batch, sequence, hidden=64, dtype="float16", seed=10 * call + batch)
            device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
            if call == 3:
                wide = cupy.zeros((batch, sequence, 128), cupy.float16)
                wide[:, :, ::2] = device_feeds["hidden_states"]
                device_feeds["hidden_states"] = wide[:, :, ::2]
            if call == 4:
                device_feeds["attention_mask"] = feeds["attention_mask"]
            expected = stock_cuda(model, feeds)
            got = cupy.asnumpy(session.run_device(None, device_feeds)[0])
            assert_close([got], expected, "float16", f"run_device call {call + 1} B={batch} S={sequence}")
            assert_close(session.run(None, feeds), expected, "float16", f"run call {call + 1}")
    slots = [slot for slot in session.cuda_io.slots.values() if slot is not None]
    assert len(slots) == 2 and all(slot.calls >= 8 for slot in slots), [s.calls for s in slots]


def test_graph_outputs_from_run_device_are_copies_the_next_replay_leaves_alone():
    """Every output a caller keeps stays its call's: the first (eager) call's is ORT's own, later ones are copies
    out of the slot, which the next replay writes again. NumPy feeds and CuPy ones (the replay's two paths)."""
    import cupy

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    for on_device in (False, True):
        session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
        calls = [encoder_feeds(2, 8, hidden=64, seed=seed + 1) for seed in range(4)]
        kept = [session.run_device(None, {n: cupy.asarray(v) for n, v in feeds.items()} if on_device else feeds)[0]
                for feeds in calls]  # fmt: skip
        for index, (feeds, output) in enumerate(zip(calls, kept)):
            assert_close([cupy.asnumpy(output)], stock_cuda(model, feeds), "float32",
                         f"call {index + 1}'s output, kept ({'CuPy' if on_device else 'NumPy'} feeds)")  # fmt: skip


def test_the_cap_on_graphs_leaves_later_signatures_eager(monkeypatch):
    from mha_ep.gpu_session import slots

    monkeypatch.setattr(slots, "MAX_GRAPHS", 1)
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    for sequence in (8, 9, 8, 9, 9):
        feeds = encoder_feeds(2, sequence, hidden=64, seed=sequence)
        assert_close(session.run(None, feeds), stock_cuda(model, feeds), "float32", f"S={sequence}")
    assert [slot is None for slot in session.cuda_io.slots.values()] == [False, True]


def test_a_model_with_a_cpu_node_runs_eagerly_with_the_reason():
    """ORT refuses its CUDA graph when a node runs on the CPU (the shipped Whisper decoder's shape arithmetic): the
    session still runs, eagerly, and says why."""
    path = next(p for p in SHIPPED if p.stem == "whisper_random_decoder_fp32")
    model = onnx.load(path)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    feeds = random_feeds(model, seed=3)
    assert_close(session.run(None, feeds), stock_cuda(model, feeds), "float32", "eager after the refusal")
    if not session.cuda_io.graphs:
        assert "ORT refused its CUDA graph" in session.mode_reason


def test_a_decode_loop_gets_page_locked_outputs_and_feeds_them_back():
    import gc

    from mha_ep.gpu_session.transfer import PINNED_OUTPUT_MIN_BYTES, is_page_locked

    path = next(p for p in SHIPPED if p.stem == "whisper_random_decoder_fp32")
    model = onnx.load(path)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=PROVIDERS)
    names = [o.name for o in stock.get_outputs()]
    # batch 8: the call's feeds and outputs are over OWN_RUN_MAX_BYTES (gpu_session/small_calls.py), so they move
    # through page-locked memory
    feeds = random_feeds(model, seed=7, dims={"batch": 8, "past_decode_len": 300})
    for step in range(3):
        actual, expected = session.run(None, feeds), stock.run(None, feeds)
        assert_close(actual, expected, "float32", f"step {step}")
        big = [a for a in actual if a.nbytes >= PINNED_OUTPUT_MIN_BYTES]
        assert big and all(is_page_locked(a) for a in big), [(a.shape, a.nbytes) for a in actual]
        outputs = dict(zip(names, actual))
        feeds = {**feeds, **{n.replace("present", "past"): v for n, v in outputs.items() if n.startswith("present")}}
        feeds["input_ids"] = np.argmax(outputs["logits"][:, -1:], axis=-1).astype(np.int64)
    io = session.cuda_io
    assert io.held_output_bytes > 0
    del actual, big, outputs, feeds
    gc.collect()
    assert io.held_output_bytes == 0


def test_device_feeds_written_on_the_callers_stream_are_waited_for():
    import cupy

    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
      const long long start = clock64(); while (clock64() - start < cycles) {} }""", "spin")
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    feeds = encoder_feeds(2, 16, hidden=64, seed=5)
    expected = stock_cuda(model, feeds)
    for providers in (PROVIDERS, GRAPHS):
        session = mha_ep.InferenceSession(model, backend="cuda", providers=providers)
        user = cupy.cuda.Stream(non_blocking=True)
        with user:
            device_feeds = {name: cupy.zeros(value.shape, value.dtype) for name, value in feeds.items()}
            for _ in range(3):
                spin((1,), (1,), (np.int64(200_000_000),))
                for name, value in feeds.items():
                    device_feeds[name][...] = cupy.asarray(value)
                got = cupy.asnumpy(session.run_device(None, device_feeds)[0])
                assert_close([got], expected, "float32", "feeds from the caller's stream")
                for array in device_feeds.values():
                    array.fill(0)


@pytest.mark.parametrize("providers", [PROVIDERS, GRAPHS], ids=["eager", "graphs"])
def test_threads_share_one_session_with_bad_calls_among_them(providers):
    """Six threads on ``run`` and six on ``run_device`` of one session at once, 40% bad calls of every kind
    (bench/soak.py makes them): each good call gets stock ORT CUDA's outputs, each bad one raises the type stock's
    ``run`` raises, and afterwards no graph slot or lane is held. Bounded by a count of calls, never a time."""
    import cupy

    from mha_ep.bench import soak

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=PROVIDERS)
    cases = soak.make_cases(model, stock, shapes=4, seed=9)
    assert {case.kind for case in cases} == {"good", *soak.BAD_KINDS}
    # Stock ORT runs a zero-length sequence; mha_ep refuses a claimed node's zero-length query (the original's rule,
    # kept: tests/claim/test_bad_input.py, query_zero_length), so that kind is left out here.
    cases = [case for case in cases if case.kind != "zero_length"]
    session = mha_ep.InferenceSession(model, backend="cuda", providers=providers)

    def on_device(names, feeds):
        return [cupy.asnumpy(a) for a in session.run_device(names, {n: cupy.asarray(v) for n, v in feeds.items()})]

    tally = soak.soak([session.run, on_device], cases, threads=6, seconds=None, bad=0.4, tolerance=1e-3, seed=3,
                      per_thread=15)  # fmt: skip
    assert (tally.wrong, tally.mistyped) == (0, 0), tally.examples
    assert tally.good + tally.bad_typed == 180 and tally.good and tally.bad_typed, tally.row()
    assert session.cuda_io.in_use() == {"lanes_out": 0}
    good = cases[0]
    assert soak.outputs_close(session.run(None, good.feeds), good.expected, 1e-3)


def test_graph_calls_run_on_the_first_calling_thread_and_others_on_the_worker():
    """GraphThreads (gpu_session/lanes.py): a graph session's first calling thread runs its own calls (no thread
    switch), any other thread's calls run on the session's worker thread, one call at a time; ORT keeps a graph per
    thread, so both threads' replays of one signature read the same fixed buffers and give stock's answers."""
    import threading

    import cupy

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    io = session.cuda_io
    ran_on = []
    original = io.ort.run

    def recorded(binding, options):
        ran_on.append(threading.get_ident())
        return original(binding, options)

    io.ort.run = recorded

    def calls(tag, count, results):
        for call in range(count):
            feeds = encoder_feeds(2, 8, hidden=64, seed=100 * len(tag) + call)
            got = cupy.asnumpy(session.run_device(None, {n: cupy.asarray(v) for n, v in feeds.items()})[0])
            results.append((f"{tag} call {call + 1}", got, stock_cuda(model, feeds)))

    results, other = [], []
    calls("first", 4, results)
    thread = threading.Thread(target=calls, args=("other", 4, other))
    thread.start()
    thread.join()
    calls("first again", 2, results)
    for label, got, expected in results + other:
        assert_close([got], expected, "float32", label)
    main = threading.get_ident()
    assert len(ran_on) == 10, ran_on
    assert ran_on[:4] == [main] * 4 and ran_on[-2:] == [main] * 2, "the first thread ran its own calls"
    assert len(set(ran_on[4:8])) == 1 and ran_on[4] not in (main, thread.ident), "the other's ran on the worker"
    slot = next(slot for slot in io.slots.values() if slot is not None)
    assert slot.calls == 9  # every call but the signature's first (eager) went through the slot


def test_a_callers_own_binding_on_a_graph_session_may_not_take_the_sessions_graph_ids():
    """The caller's own run_with_iobinding on a graph session: a gpu_graph_id that run and run_device keep (1 to
    MAX_GRAPHS) is refused before ORT runs, on the thread that captured the session's graphs too; -1 runs it."""
    import cupy

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    feeds = encoder_feeds(2, 8, hidden=64, seed=70)
    for _ in range(3):  # this thread's signature: eager, then ORT's graph 1, captured here
        session.run_device(None, {n: cupy.asarray(v) for n, v in feeds.items()})
    device_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
    binding = session.io_binding()
    for name, array in device_feeds.items():
        binding.bind_input(name, "cuda", 0, array.dtype.type, list(array.shape), array.data.ptr)
    binding.bind_output("last_hidden_state", "cuda", 0)
    options = onnxruntime.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "1")
    with pytest.raises(ValueError, match="gpu_graph_id=1 is one of the ids 1 to 16"):
        session.run_with_iobinding(binding, options)
    options = onnxruntime.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")
    session.run_with_iobinding(binding, options)
    assert_close([binding.copy_outputs_to_cpu()[0]], stock_cuda(model, feeds), "float32", "the caller's own run")


def test_a_graph_session_runs_ort_on_a_stream_it_knows():
    """ONE_STREAM_REPLAY (gpu_session/slots.py): under ORT's CUDA graphs the session hands ORT a stream of its own (or
    keeps the caller's ``user_compute_stream``) and queues its copies on it; the caller's provider list is left as it
    was."""
    import cupy

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    user = cupy.cuda.Stream(non_blocking=True)
    given = [(CUDA, {"use_tf32": "0", "enable_cuda_graph": "1", "user_compute_stream": str(user.ptr),
                     "has_user_compute_stream": "1"}), "CPUExecutionProvider"]  # fmt: skip
    before = repr(GRAPHS)
    for providers, theirs in ((GRAPHS, None), (given, user.ptr)):
        session = mha_ep.InferenceSession(model, backend="cuda", providers=providers)
        io = session.cuda_io
        told = session.get_provider_options()[CUDA]["user_compute_stream"]
        assert told == str(io.ort_stream.ptr), (told, io.ort_stream.ptr)
        if theirs is not None:
            assert io.ort_stream.ptr == theirs
        else:  # the session's own stream lives as long as ORT's session object
            assert session._session._mha_ep_compute_stream is io.ort_stream
        for call in range(4):
            feeds = encoder_feeds(2, 8, hidden=64, seed=30 + call)
            assert_close(session.run(None, feeds), stock_cuda(model, feeds), "float32", f"run call {call + 1}")
    assert repr(GRAPHS) == before


@pytest.mark.parametrize("callers_stream", ["its own", "ORT's"])
def test_a_replay_queues_behind_the_callers_stream_and_returns_before_the_gpu(callers_stream):
    """run_device on a captured signature makes no host wait (ONE_STREAM_REPLAY): with the caller's stream held by a
    kernel that spins until the host opens a gate, the call still returns; the caller then overwrites the feeds
    on its stream, opens the gate, and reads stock's outputs for the feeds it passed. A call that waited for the
    GPU would hold the gate shut: the test then opens the gate itself and fails. "ORT's": the caller's stream is
    the one it gave ORT as ``user_compute_stream`` (a replay then records no event: one stream orders it all)."""
    import threading

    import cupy

    gate = cupy.RawKernel(r"""extern "C" __global__ void gate(volatile int* flag) { while (*flag == 0) {} }""", "gate")
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    caller = cupy.cuda.Stream(non_blocking=True)
    providers = GRAPHS
    if callers_stream == "ORT's":
        given = {"user_compute_stream": str(caller.ptr), "has_user_compute_stream": "1"}
        providers = [(CUDA, {**GRAPHS[0][1], **given}), "CPUExecutionProvider"]
    session = mha_ep.InferenceSession(model, backend="cuda", providers=providers)
    assert (session.cuda_io.ort_stream.ptr == caller.ptr) == (callers_stream == "ORT's")
    flag_memory = cupy.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(flag_memory, np.int32, 1)
    flag[0] = 0
    feeds = encoder_feeds(2, 8, hidden=64, seed=60)
    device_feeds, outputs, errors = {}, [], []
    gated, returned = threading.Event(), threading.Event()

    def calls():  # one thread makes every call: ORT keeps its captured graphs per thread (GraphThreads)
        try:
            with caller:
                for call in range(4):  # eager, then ORT's warm-up and capture: these may wait
                    warm = encoder_feeds(2, 8, hidden=64, seed=50 + call)
                    session.run_device(None, {n: cupy.asarray(v) for n, v in warm.items()})
                device_feeds.update({n: cupy.asarray(v) for n, v in feeds.items()})
                caller.synchronize()
                gate((1,), (1,), (flag_memory.ptr,))
                gated.set()
                outputs.extend(session.run_device(None, device_feeds))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
        finally:
            gated.set()
            returned.set()

    worker = threading.Thread(target=calls)
    worker.start()
    gated.wait()
    waited = not returned.wait(timeout=60)  # a failure guard only: a call that makes no host wait returns at once
    flag[0] = 1
    worker.join()
    assert not errors, errors
    assert not waited, "run_device waited for the GPU on a replay"
    with caller:
        for array in device_feeds.values():
            array.fill(7)
        got = cupy.asnumpy(outputs[0])
    assert_close([got], stock_cuda(model, feeds), "float32", "the replay's outputs, read in the caller's order")


def test_a_replay_whose_outputs_do_not_fit_raises_orts_runtime_exception_and_the_session_goes_on():
    """A full device: stock ORT's run raises its RuntimeException ("Failed to allocate memory ..."), and so does a
    replay whose output array cannot be allocated (CuPy's allocator a pool that may not grow), still a MemoryError; no lane is
    left out, and once memory is back the next replay gives stock's outputs."""
    import cupy
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=GRAPHS)
    feeds = encoder_feeds(2, 8, hidden=64, seed=70)
    device_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
    for _ in range(4):  # eager, then ORT's warm-up and capture
        session.run_device(None, device_feeds)
    full = cupy.cuda.MemoryPool()
    full.set_limit(size=1)  # a pool that may not grow: every allocation from it fails (the replay runs here)
    with cupy.cuda.using_allocator(full.malloc), pytest.raises(RuntimeException) as caught:
        session.run_device(None, device_feeds)
    assert isinstance(caught.value, MemoryError), type(caught.value).__mro__
    assert "RUNTIME_EXCEPTION : mha_ep: Failed to allocate memory" in str(caught.value), str(caught.value)
    assert session.cuda_io.in_use() == {"lanes_out": 0}
    got = cupy.asnumpy(session.run_device(None, device_feeds)[0])
    assert_close([got], stock_cuda(model, feeds), "float32", "the replay after")


def test_a_call_that_finds_the_lanes_taken_gets_a_lane_of_its_own():
    """No call waits on another call's copies: with the session's only lane out (as with a call in its copies),
    the next call gets a new lane, and both go back to the pool."""
    import cupy

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
    io = session.cuda_io
    feeds = encoder_feeds(2, 8, hidden=64, seed=4)
    expected = stock_cuda(model, feeds)
    device_feeds = {n: cupy.asarray(v) for n, v in feeds.items()}
    assert_close([cupy.asnumpy(session.run_device(None, device_feeds)[0])], expected, "float32", "first")
    lane = io.lanes.take()
    assert io.lanes_made == 1
    assert_close([cupy.asnumpy(session.run_device(None, device_feeds)[0])], expected, "float32", "lane held")
    assert io.lanes_made == 2
    io.lanes.give(lane)
    assert io.in_use() == {"lanes_out": 0}


def test_a_bad_call_names_the_node_and_the_session_stays_usable():
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
    bad = encoder_feeds(2, 8, hidden=64)
    bad["attention_mask"] = bad["attention_mask"][:, :5]  # (B, 5) mask for 8 keys
    with pytest.raises((mha_ep.MhaRunError, onnxruntime.capi.onnxruntime_pybind11_state.Fail)) as caught:
        session.run(None, bad)
    assert "layer0.attention" in str(caught.value) and "mask" in str(caught.value).lower(), str(caught.value)
    good = encoder_feeds(2, 8, hidden=64, seed=3)
    assert_close(session.run(None, good), stock_cuda(model, good), "float32", "after the bad call")


def test_feeds_that_do_not_fit_raise_what_ort_run_raises():
    """The GPU path binds through IOBinding, where ORT would say RuntimeError("Error in execution: ...") or check
    nothing under a replayed graph; the call is checked first and raises ``run``'s own type and text
    (native/ort_checks.py), the same as a stock session of the model."""
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS)
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    good = encoder_feeds(1, 4, hidden=64, dtype="float16")
    calls = [
        (session.run, None, encoder_feeds(1, 4, hidden=64, dtype="float32")),  # float32 for float16
        (session.run_device, None, {"hidden_states": good["hidden_states"]}),  # a feed missing
        (session.run, ["nope"], good),  # no such output
        (session.run, None, {**good, "attention_mask": good["attention_mask"][:, :, None]}),  # rank 3 for rank 2
    ]
    for run, names, feeds in calls:
        with pytest.raises(Exception) as ours:
            run(names, feeds)
        with pytest.raises(Exception) as theirs:
            stock.run(names, feeds)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def test_the_cpu_provider_keeps_orts_own_run_and_says_so():
    path = str(SHIPPED[0])
    cpu = mha_ep.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert cpu.cuda_io is None
    with pytest.raises(mha_ep.MhaEpError, match="run_device needs the native route on the CUDA provider"):
        cpu.run_device(None, random_feeds(onnx.load(path), seed=0))
    assert mha_ep.InferenceSession(path, providers=PROVIDERS, route="python-op").mode == "python-op"


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_generation_on_the_device_matches_the_host_loop_token_for_token(batch):
    """mha_ep/decode/generate.py over stock ORT CUDA, a plain native session and mha_ep.InferenceSession: the same
    tokens as the NumPy loop over stock ORT CUDA, with an end-of-text that stops rows at different steps."""
    import cupy

    from mha_ep.bench.generate import host_greedy, sessions_of
    from mha_ep.decode.generate import BoundStepper, DeviceStepper, greedy, suppression_bias

    vocab, layers, hidden, heads = 300, 2, 64, 2
    model = whisper_decoder_step(layers, hidden, heads, 128, vocab=vocab, seed=5)
    feeds = decoder_step_feeds(batch, 3, layers, hidden, heads, encoder_sequence=40, seed=6)
    feeds.pop("hidden_states")
    cache = {n: v for n, v in feeds.items() if n.startswith("past_")}
    fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    first = np.arange(batch, dtype=np.int64)[:, None] + 7
    suppressed = [0, 1, 2]
    host_bias = np.zeros(vocab, np.float32)
    host_bias[suppressed] = -np.inf
    stock = sessions_of(model, "stock")
    expected = host_greedy(stock, first, cache, fixed, 40, [], eot=None, bias=host_bias)
    stop = next(i for i in range(3, 40) if expected[0][i] not in expected[0][:i])
    eot = expected[0][stop]  # a token the first row first says at step stop + 1: it stops there, the others later
    expected = host_greedy(stock, first, cache, fixed, 40, [], eot=eot, bias=host_bias)
    bias = suppression_bias(vocab, suppressed)
    for kind in ("stock", "plain", "session"):
        session = sessions_of(model, kind)
        if kind == "session":
            stepper = DeviceStepper(session)
            state = {n: cupy.asarray(v) for n, v in cache.items()}
            kept = {n: cupy.asarray(v) for n, v in fixed.items()}
        else:
            stepper = BoundStepper(session)
            state = {n: onnxruntime.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for n, v in cache.items()}
            kept = {n: onnxruntime.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for n, v in fixed.items()}
        got = greedy(stepper, cupy.asarray(first), state, kept, 40, bias, eot)
        assert got == expected, f"{kind}: {got} vs {expected}"
    assert len(expected[0]) == stop
