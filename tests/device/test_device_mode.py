"""Device-resident mode on the GPU (mha_ep/device/cuda.py): whole models with ORT CUDA pieces and our kernels.

Every case needs CuPy, a GPU and onnxruntime with the CUDA provider (the ``gpu`` marker; skipped cleanly
elsewhere). The parity suites also run in this mode through the ``run_backend`` fixture's "cuda-device" case;
these tests cover what only whole models show: several pieces, float16 models, replayed calls, device feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

import mha_ep
from mha_ep import shipped
from mha_ep.feeds import random_feeds
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
from mha_ep.models.synthetic import bert_encoder, encoder_feeds

from conftest import device_mode_unavailable_reason
from stock_cuda import PROVIDERS, assert_close, stock_cuda

pytestmark = pytest.mark.gpu
SHIPPED = sorted(shipped.folder().glob("*.onnx"))


@pytest.fixture(autouse=True)
def _needs_device_mode():
    reason = device_mode_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_models_match_stock_ort_eagerly_and_replayed(path):
    model = onnx.load(path)
    dtype = "float16" if "fp16" in path.stem else "float32"
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    assert session.mode == "device" and session.mode_reason == ""
    for seed in range(4):  # call 1 eager, call 2 captured, calls 3-4 replayed with new values
        feeds = random_feeds(model, seed=seed)
        assert_close(session.run(None, feeds), stock_cuda(model, feeds), dtype, f"{path.stem} call {seed + 1}")
    entries = [entry for entry in session.device_runner.graphs.entries.values() if entry is not None]
    executor = session.device_runner.executor
    assert len(entries) == 1, f"{path.stem}: {len(entries)} graphs, refusal {executor.graph_refusal!r}"
    if executor.graph_refusal is None:  # the whole call is one graph
        assert executor.eager_head == 0 and not entries[0].carried
    else:  # the only reason a shipped model may have: ORT runs a node of a piece on the CPU; the rest is a graph
        assert "the host inside piece" in executor.graph_refusal, executor.graph_refusal
        assert 0 < executor.eager_head < len(session.device_runner.plan.steps)
        assert entries[0].carried, "the eager head hands nothing to the graph"


def test_a_decode_loop_gets_page_locked_outputs_and_feeds_them_back():
    """transfer.py: outputs come back in pinned blocks, a loop feeds the presents back (they go up by direct DMA),
    every step matches stock ORT CUDA, and the blocks go back to the pool once the arrays are gone."""
    import gc

    from mha_ep.native.transfer import PINNED_OUTPUT_MIN_BYTES, is_page_locked

    path = next(p for p in SHIPPED if p.stem == "whisper_random_decoder_fp32")
    model = onnx.load(path)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=PROVIDERS)
    names = [o.name for o in stock.get_outputs()]
    feeds = random_feeds(model, seed=7, dims={"batch": 2, "past_decode_len": 300})
    for step in range(3):
        actual, expected = session.run(None, feeds), stock.run(None, feeds)
        assert_close(actual, expected, "float32", f"step {step}")
        big = [a for a in actual if a.nbytes >= PINNED_OUTPUT_MIN_BYTES]
        assert big and all(is_page_locked(a) for a in big), [(a.shape, a.nbytes) for a in actual]
        outputs = dict(zip(names, actual))
        feeds = {**feeds, **{n.replace("present", "past"): v for n, v in outputs.items() if n.startswith("present")}}
        feeds["input_ids"] = np.argmax(outputs["logits"][:, -1:], axis=-1).astype(np.int64)
    transfers = session.device_runner.executor.transfers
    assert transfers.held_output_bytes > 0
    del actual, big, outputs, feeds
    gc.collect()
    assert transfers.held_output_bytes == 0


def test_outputs_beyond_the_pinned_cap_are_ordinary_arrays(monkeypatch):
    from mha_ep.native import transfer

    monkeypatch.setattr(transfer, "PINNED_OUTPUT_BYTES", 0)
    model = bert_encoder(layers=1, hidden=128, heads=2, ffn=256)
    feeds = encoder_feeds(4, 64, hidden=128, seed=4)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    out = session.run(None, feeds)
    assert not transfer.is_page_locked(out[0]) and out[0].flags.owndata
    assert_close(out, stock_cuda(model, feeds), "float32", "past the cap")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_encoder_with_padding_masks_matches_stock_ort_and_keeps_outputs_on_the_device(dtype):
    import cupy

    model = bert_encoder(layers=2, hidden=128, heads=2, ffn=256, dtype=dtype)
    feeds = encoder_feeds(3, 40, hidden=128, dtype=dtype, seed=1)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    expected = stock_cuda(model, feeds)
    assert_close(session.run(None, feeds), expected, dtype, f"encoder {dtype}")
    device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
    for _ in range(3):  # eager, captured, replayed: all on the device
        out = session.run_device(None, device_feeds)
        assert isinstance(out[0], cupy.ndarray) and str(out[0].dtype) == dtype
        assert_close([cupy.asnumpy(out[0])], expected, dtype, f"encoder {dtype} device feeds")


def test_replays_read_each_calls_device_feeds_wherever_they_lie():
    """A replay copies its CuPy feeds into the graph's buffers: fresh values at fresh addresses each call, a
    non-contiguous view (the checked path), and a NumPy feed beside a CuPy one, each against stock ORT."""
    import cupy

    model = bert_encoder(layers=2, hidden=64, heads=2, ffn=128, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    for seed in range(5):  # 1 eager, 2 captured, 3-5 replayed
        feeds = encoder_feeds(2, 24, hidden=64, dtype="float16", seed=10 + seed)
        device_feeds = {name: cupy.asarray(value) for name, value in feeds.items()}
        if seed == 3:  # a strided view of the same values
            wide = cupy.zeros((2, 24, 128), cupy.float16)
            wide[:, :, ::2] = device_feeds["hidden_states"]
            device_feeds["hidden_states"] = wide[:, :, ::2]
            assert not device_feeds["hidden_states"].flags.c_contiguous
        if seed == 4:
            device_feeds["attention_mask"] = feeds["attention_mask"]  # NumPy beside CuPy
        got = cupy.asnumpy(session.run_device(None, device_feeds)[0])
        assert_close([got], stock_cuda(model, feeds), "float16", f"call {seed + 1}")
    assert sum(entry is not None for entry in session.device_runner.graphs.entries.values()) == 1


def test_device_feeds_written_on_the_callers_stream_are_waited_for():
    """Feeds a caller writes on its own (non-blocking) stream just before the call, behind 0.1 s of other work:
    the session's stream waits for them, and the caller's stream for the device outputs (no race)."""
    import cupy

    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
      const long long start = clock64(); while (clock64() - start < cycles) {} }""", "spin")
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    feeds = encoder_feeds(2, 16, hidden=64, seed=5)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    expected = stock_cuda(model, feeds)
    user = cupy.cuda.Stream(non_blocking=True)
    with user:
        device_feeds = {name: cupy.zeros(value.shape, value.dtype) for name, value in feeds.items()}
        for _ in range(2):  # eager, then captured
            spin((1,), (1,), (np.int64(200_000_000),))
            for name, value in feeds.items():
                device_feeds[name][...] = cupy.asarray(value)
            out = session.run_device(None, device_feeds)
            got = cupy.asnumpy(out[0])
            assert_close([got], expected, "float32", "feeds from the caller's stream")
            for array in device_feeds.values():
                array.fill(0)


def test_poisoned_buffers_show_nothing_unwritten():
    model = bert_encoder(layers=2, hidden=128, heads=2, ffn=256, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    session.backend.poison_device_buffers = True
    session.device_runner.graphs_enabled = False
    feeds = encoder_feeds(2, 33, hidden=128, dtype="float16", seed=2)
    assert_close(session.run(None, feeds), stock_cuda(model, feeds), "float16", "poisoned")


def test_a_bad_call_names_the_node_and_the_session_stays_usable():
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    bad = encoder_feeds(2, 8, hidden=64)
    bad["attention_mask"] = bad["attention_mask"][:, :5]  # (B, 5) mask for 8 keys
    with pytest.raises((mha_ep.MhaRunError, onnxruntime.capi.onnxruntime_pybind11_state.Fail)) as caught:
        session.run(None, bad)
    if isinstance(caught.value, mha_ep.MhaRunError):
        assert caught.value.node_name == "layer0.attention", str(caught.value)
    good = encoder_feeds(2, 8, hidden=64, seed=3)
    assert_close(session.run(None, good), stock_cuda(model, good), "float32", "after the bad call")


def test_feeds_of_the_wrong_dtype_are_one_clear_error():
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    feeds = encoder_feeds(1, 4, hidden=64, dtype="float32")
    with pytest.raises(InvalidArgument, match=r"Unexpected input data type\. Actual: \(tensor\(float\)\) , "
                       r"expected: \(tensor\(float16\)\)"):  # ORT's run's type and text
        session.run(None, feeds)


def test_feeds_that_do_not_fit_raise_what_ort_run_raises():
    """Device mode checks a call as the one-session route does (native/ort_checks.py): ORT's ``run``'s own type
    and text, the same as a stock session of the model."""
    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128, dtype="float16")
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    stock = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    good = encoder_feeds(1, 4, hidden=64, dtype="float16")
    calls = [
        (None, {"hidden_states": good["hidden_states"]}),  # a feed missing
        (["nope"], good),  # no such output
        (None, {**good, "attention_mask": good["attention_mask"][:, :, None]}),  # rank 3 for rank 2
        (None, {**good, "extra": good["attention_mask"]}),  # no such input
    ]
    for names, feeds in calls:
        with pytest.raises(Exception) as ours:
            session.run(names, feeds)
        with pytest.raises(Exception) as theirs:
            stock.run(names, feeds)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def test_device_mode_is_taken_only_when_asked_for():
    """Auto is one ORT session on the native route (mha_ep/native/cuda_io.py); device mode is opt-in."""
    path = str(SHIPPED[0])
    assert mha_ep.InferenceSession(path, providers=PROVIDERS).mode == "native"
    assert mha_ep.InferenceSession(path, providers=PROVIDERS, device_mode="device").mode == "device"
    assert mha_ep.InferenceSession(path, providers=["CPUExecutionProvider"]).mode == "native"
    assert mha_ep.InferenceSession(path, providers=PROVIDERS, route="python-op").mode == "python-op"


def test_host_feeds_of_every_size_arrive_whole_and_outputs_come_back_exact():
    """transfer.py's paths: one DMA (small calls), 2 MiB chunks on the copy threads (over 1 MiB), page-locked arrays
    read in place, empty arrays; a second call reuses the staging buffer after the first one's DMA."""
    import cupy
    import cupyx

    from mha_ep.native.transfer import HostTransfers

    rng = np.random.default_rng(11)
    stream = cupy.cuda.Stream(non_blocking=True)
    transfers = HostTransfers(stream, 0, __import__("concurrent.futures").futures.ThreadPoolExecutor(4))
    pinned = cupyx.empty_pinned((300, 7), np.float32)
    pinned[...] = rng.standard_normal(pinned.shape)
    for sizes in ([(3,), (5, 7)], [(1 << 21,), (3, 1 << 20), (0, 4), (17,)]):
        feeds = {f"x{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(sizes)}
        feeds["i64"] = rng.integers(-5, 5, size=(9,), dtype=np.int64)
        feeds["pinned"] = pinned
        with stream:
            arrays = transfers.to_device(feeds)
            back = transfers.download(list(arrays.values()))
        for (name, expected), actual in zip(feeds.items(), back):
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
            np.testing.assert_array_equal(actual, expected, err_msg=name)


def test_kept_graphs_stay_within_their_memory_cap(monkeypatch):
    """device/cuda.py MAX_GRAPH_BYTES: the least recently used graph goes when a new one would pass the cap, and a
    call whose graph alone passes it runs eagerly; every call's outputs stay right either way."""
    from mha_ep.device import cuda as device_cuda

    model = bert_encoder(layers=1, hidden=64, heads=2, ffn=128)
    session = mha_ep.InferenceSession(model, backend="cuda", providers=PROVIDERS, device_mode="device")
    graphs = session.device_runner.graphs

    def run_three(feeds, label):
        for _ in range(3):  # eager, captured, replayed
            assert_close(session.run(None, feeds), stock_cuda(model, feeds), "float32", label)

    first, second = encoder_feeds(2, 8, hidden=64, seed=1), encoder_feeds(2, 9, hidden=64, seed=2)
    run_three(first, "first")
    one = graphs.held_bytes()
    assert one > 0 and len(graphs.entries) == 1
    monkeypatch.setattr(device_cuda, "MAX_GRAPH_BYTES", one + one // 2)  # room for one graph of this size
    run_three(second, "second")
    kept = [key for key, entry in graphs.entries.items() if entry is not None]
    assert len(kept) == 1 and {n: shape for n, shape, _ in kept[0]}["hidden_states"] == (2, 9, 64), kept  # first went
    monkeypatch.setattr(device_cuda, "MAX_GRAPH_BYTES", 0)
    third = encoder_feeds(3, 5, hidden=64, seed=3)
    run_three(third, "third")
    assert graphs.entries[device_cuda.feed_signature(session.device_runner.plan, third)] is None
