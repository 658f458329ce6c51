"""The CUDA calls of a GPU session's calls, in order, on any machine (gpu_session/cuda_io.py and its parts,
ONE_STREAM_REPLAY of gpu_session/slots.py above all).

A child process (tests/support/replay_protocol_child.py) puts tests/support/recording_cupy.py in CuPy's place (every
CUDA call recorded, none run) and a stand-in for ORT's session under a graph session's CudaSessionIO, and calls it three
times with one signature: the first call runs eagerly and makes the signature's slot, the next two replay it.
``run_device`` is called from the session's first thread and, the third time, from another one (whose call runs on the
session's worker); ``run`` with NumPy feeds from one thread. ONE_STREAM_REPLAY's promise, call by call: ORT's stream
waits for the caller's (an event) before the feeds are copied into the slot on ORT's stream; ORT's replay is queued with
``disable_synchronize_execution_providers``; the output is allocated under the caller's stream and copied on ORT's; the
caller's stream waits for ORT's (another event); nothing is waited for on the host, except ``run``'s one wait for its
download. Without graphs: the host waits for the caller's stream and the upload's, then ORT's run synchronizes its own.
A replay that fails is answered (a broken capture) or raises ORT's type (a node's failure), and leaves no lane out; an
upload that fails still guards the staging buffer. Sessions on two devices touch only their own; a slot that cannot be
allocated leaves its signature eager, its call answered. The GPU side of the same promise:
tests/gpu_session/test_native_session.py (``test_a_replay_queues_behind_the_callers_stream_and_returns_before_the_gpu``)
and tests/gpu_session/test_two_gpus.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"
NAMES = ("input_ids", "token_type_ids", "attention_mask")
FEED_BYTES = 32 * 8  # a (1, 32) int64 feed
OUTPUT_BYTES = 32 * 768 * 4  # the (1, 32, 768) float32 output
ANY = "any"  # in an expected call: any value there


def calls_of(kind: str) -> dict:
    """The child's record of three calls with ``kind`` "device" (run_device) or "host" (run, NumPy feeds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT.parents[1]), str(SUPPORT)])}
    done = subprocess.run([sys.executable, str(SUPPORT / "replay_protocol_child.py"), kind], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_calls(got: list, expected: list, label: str) -> None:
    calls = [tuple(c) for c in got]
    assert len(calls) == len(expected) and all(
        len(c) == len(e) and all(w == ANY or g == w for g, w in zip(c, e)) for c, e in zip(calls, expected)
    ), f"{label}:\n  got      {calls}\n  expected {expected}"


def feeds_in(got: dict) -> list:
    """The copy kernel's table for a replay's feeds: each into its slot buffer, in the slot's order (sorted)."""
    return [[got["slot"][n], got["feeds"][n], FEED_BYTES] for n in sorted(NAMES)]


@pytest.mark.parametrize("launch", ["", " cupy launch"], ids=["native launch", "cupy launch"])
def test_run_device_waits_once_on_its_first_call_and_a_replay_waits_for_nothing_on_the_host(launch):
    """The same CUDA calls in the same order whether the copy kernel and its events go through the native library's
    one entry point (launch_copies) or through CuPy's launch and event calls."""
    got = calls_of("device" + launch)
    assert got["slot_calls"] == 2  # the second and third calls replayed the slot's graph
    assert got["bound"] == got["slot"], "the graph reads the buffers the replays' copies write"
    first, *replays = got["calls"]
    # the signature's first call: the caller's stream written out, then ORT's eager run (it synchronizes its own
    # stream at the end), whose outputs are the call's: no copy
    assert_calls(first["log"], [("synchronize", "caller"), ("ort run", "-1", None)], "the first call")
    assert got["outputs"][0] != [got["view"]]
    for index, call in enumerate(replays, start=1):
        caller, calls = call["caller"], call["log"]
        fed, copied = calls[0][1], calls[-2][1]
        expected = [
            ("record", fed, caller),  # the caller's stream has written the feeds: an event on it
            ("wait", "ort", fed),  # ORT's stream waits for it, on the device
            ("launch copy_segments", feeds_in(got), "ort"),  # every feed into the slot, one launch
            ("ort run", "1", "1"),  # the slot's graph, queued: ORT does not synchronize its stream after it
            ("alloc", caller, [1, 32, 768]),  # the output is the caller's stream's memory (CuPy's pool order)
            ("launch copy_segments", [[got["outputs"][index][0], got["view"], OUTPUT_BYTES]], "ort"),  # out, on ORT's
            ("record", copied, "ort"),
            ("wait", caller, copied),  # the caller's stream reads the output after the copy, on the device
        ]
        assert_calls(calls, expected, f"replay {index} ({caller})")
        assert fed != copied
    assert [c["caller"] for c in got["calls"]] == ["caller", "caller", "second caller"]


def test_where_the_copy_kernel_cannot_be_built_a_replay_copies_with_one_memcpy_a_buffer():
    """gpu_session/segments.py's kernel is compiled on a session's first slot; where NVRTC cannot build it the session
    says so once, on the mha_ep logger, and its replays make the same copies with one memcpy call per buffer."""
    got = calls_of("device without kernel")
    assert got["slot_calls"] == 2
    assert len(got["logged"]) == 1 and "the copy kernel could not be built (CompileException" in got["logged"][0]
    for index, call in enumerate(got["calls"][1:], start=1):
        caller, calls = call["caller"], call["log"]
        expected = [
            ("record", calls[0][1], caller),
            ("wait", "ort", calls[0][1]),
            *[("copy", got["slot"][n], got["feeds"][n], FEED_BYTES, "ort") for n in NAMES],  # feed order
            ("ort run", "1", "1"),
            ("alloc", caller, [1, 32, 768]),
            ("copy", got["outputs"][index][0], got["view"], OUTPUT_BYTES, "ort"),
            ("record", calls[-2][1], "ort"),
            ("wait", caller, calls[-2][1]),
        ]
        assert_calls(calls, expected, f"replay {index} ({caller})")


@pytest.mark.parametrize("launch", ["", " cupy launch"], ids=["native launch", "cupy launch"])
def test_a_caller_on_orts_own_stream_replays_with_no_event(launch):
    """A caller whose stream is ORT's (it gave it as ``user_compute_stream``): its writes, the copies in, the replay
    and the copies out are ordered by that one stream, so a replay records and waits for no event."""
    got = calls_of("device on ort" + launch)
    assert got["slot_calls"] == 2
    first, *replays = got["calls"]
    assert_calls(first["log"], [("synchronize", "ort"), ("ort run", "-1", None)], "the first call")
    for index, call in enumerate(replays, start=1):
        expected = [
            ("launch copy_segments", feeds_in(got), "ort"),
            ("ort run", "1", "1"),
            ("alloc", "ort", [1, 32, 768]),
            ("launch copy_segments", [[got["outputs"][index][0], got["view"], OUTPUT_BYTES]], "ort"),
        ]
        assert_calls(call["log"], expected, f"replay {index}")


def test_a_call_whose_own_memory_does_not_fit_raises_orts_runtime_exception_and_the_next_call_works():
    """Stock ORT's run raises its RuntimeException ("Failed to allocate memory ...") where the device is full;
    mha_ep's own copies (a replay's output array, a NumPy feed's device block, a page-locked block) raise the same
    type, still a MemoryError, with the allocator's words kept and its error as the cause; no lane is left out,
    and the next call is answered."""
    sessions = calls_of("out of memory")
    for session in sessions:
        label, calls = session["label"], session["calls"]
        failed = [call for call in calls if call["outcome"][0] != "answered"]
        assert len(failed) == 1 and calls[-1]["outcome"][0] == "answered", (label, calls)
        (call,) = failed
        kind, text = call["outcome"]
        assert call["runtime_exception"] and call["memory_error"], (label, call)
        assert text.startswith("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : mha_ep: Failed to allocate memory"), text
        assert ("Out of memory allocating 98,304 bytes" in text) == (call["cause"] == "OutOfMemoryError"), text
        assert call["cause"] in ("OutOfMemoryError", "CUDARuntimeError") and "out of memory" in text.lower(), call
        assert all(c["in_use"] == {"lanes_out": 0} and c["scripted_left"] == 0 for c in calls), (label, calls)
    assert [s["label"] for s in sessions] == ["replay", "eager upload", "eager, refused by CUDA"]


def test_run_with_numpy_feeds_goes_up_in_one_copy_and_waits_once_for_its_download():
    """``run`` on a graph session: the feeds go up from the lane's staging buffer in one copy on ORT's stream, and ORT's
    run queues behind it with no host wait between (ONE_STREAM_REPLAY; its first, eager call too); the output comes down
    on the same stream, and the host waits once, for that download. The next call finds the staging buffer free (the
    download's wait covered its copy) and waits for nothing more."""
    got = calls_of("host")
    assert got["slot_calls"] == 2
    assert got["bound"] == got["slot"]
    (staging,) = got["staging"]  # one lane: the calls came one after the other
    start, nbytes = got["block"]
    for index, call in enumerate(got["calls"]):
        staged = call["log"][1][1]
        (output,) = got["outputs"][index]
        replay = index > 0
        expected = [
            ("copy", start if replay else ANY, staging, nbytes, "ort"),  # every feed up in one copy
            ("record", staged, "ort"),  # the staging buffer is read until here
            ("ort run", "1", "1") if replay else ("ort run", "-1", None),
            ("copy", output, got["view"] if replay else ANY, OUTPUT_BYTES, "ort"),  # down, page-locked
            ("synchronize", "ort"),  # the call's one wait
        ]
        assert_calls(call["log"], expected, f"call {index + 1}")


def test_without_graphs_run_device_waits_for_the_callers_stream_and_returns_orts_outputs():
    """An eager session (no graphs): ORT runs on a stream of its own, which waits for nobody, so the caller's
    stream is synchronized first; ORT synchronizes its stream at the end of the run, and its outputs are the
    call's (no copy)."""
    got = calls_of("eager device")
    for index, call in enumerate(got["calls"]):
        assert_calls(call["log"], [("synchronize", call["caller"]), ("ort run", "-1", None)], f"call {index + 1}")
    assert got["staging"] == []


def test_without_graphs_run_uploads_on_a_lane_and_waits_for_it_before_orts_run():
    """An eager session's run with a NumPy feed among CuPy ones: the caller's stream is synchronized (its device
    feeds), the NumPy feed goes up from the lane's staging buffer on the lane's stream, which is synchronized
    before ORT's run (ORT's stream is its own); the output comes down on the lane's stream, one more wait. The
    next call on the lane finds the staging buffer free."""
    got = calls_of("eager host")
    (staging,) = got["staging"]
    lanes = set()
    for index, call in enumerate(got["calls"]):
        calls = call["log"]
        lane = calls[1][4]
        lanes.add(lane)
        (output,) = got["outputs"][index]
        expected = [
            ("synchronize", "caller"),  # the caller's device feeds are written
            ("copy", ANY, staging, FEED_BYTES, lane),  # the NumPy feed up
            ("record", calls[2][1], lane),
            ("synchronize", lane),  # ORT's stream does not wait for the lane's
            ("ort run", "-1", None),
            ("copy", output, ANY, OUTPUT_BYTES, lane),  # down into the page-locked block
            ("synchronize", lane),
        ]
        assert_calls(calls, expected, f"call {index + 1}")
    assert len(lanes) == 1 and lanes.isdisjoint({"caller", "legacy"})  # one lane, a stream of its own


def test_a_replay_that_fails_is_answered_or_raises_orts_type_and_the_next_replay_works():
    """A graph session's replay whose run fails (recovery.capture_broke, ort_checks.execution_error): a broken capture
    is answered by an eager run through ORT's own run (counted in capture_retries); a node's failure raises the type
    ORT's own run gives it; neither leaves a lane out, and the next call replays the slot as before."""
    got = calls_of("failures")
    eager, capture, failed, replay = got["calls"]
    assert all(call["scripted_left"] == 0 for call in got["calls"])  # every scripted failure happened
    assert [call["in_use"] for call in got["calls"]] == [{"lanes_out": 0}] * 4
    assert [call["capture_retries"] for call in got["calls"]] == [0, 1, 1, 1]
    replayed = ["record", "wait", "launch copy_segments", "ort run"]
    assert [c[0] for c in capture["log"]] == replayed + ["download"] * 3 + ["ort own run", "upload"]
    assert capture["log"][-2] == ["ort own run", "-1"] and capture["outcome"] == ["answered", [[1, 32, 768]]]
    assert [c[0] for c in failed["log"]] == replayed + ["download"] * 3 + ["ort own run"]
    assert failed["outcome"] == ["InvalidArgument",
                                 "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : indices element out of data bounds"]
    assert [c[0] for c in replay["log"]] == replayed + ["alloc", "launch copy_segments", "record", "wait"]
    assert replay["outcome"] == eager["outcome"] == ["answered", [[1, 32, 768]]]
    assert got["slot_calls"] == 1  # the replays that failed are not counted as the slot's


def test_an_upload_that_fails_still_guards_the_staging_buffer_for_the_next_call():
    """transfer.HostTransfers: a replay's copy up refused by CUDA still records the staging event behind whatever
    it queued, so the next call waits for it before writing the staging buffer again; the failing call raises the
    CUDA error, leaves no lane out, and the next call is answered."""
    first, failed, after = calls_of("upload fails")["calls"]
    assert [c[0] for c in first["log"]] == ["copy", "record", "ort run", "copy", "synchronize"]
    staged = first["log"][1][1]
    assert [tuple(c) for c in failed["log"]] == [("record", staged, "ort")]
    assert failed["outcome"] == ["CUDARuntimeError", "cudaErrorInvalidValue"]
    # the buffer is written again only once the failed call's DMAs are done; then the replay as ever
    assert [c[0] for c in after["log"]] == ["synchronize", "copy", "record", "ort run", "copy", "synchronize"]
    assert after["log"][0] == ["synchronize", staged] and after["log"][3] == ["ort run", "1", "1"]
    assert after["outcome"] == first["outcome"] == ["answered", [[1, 32, 768]]]
    assert [c["in_use"] for c in (first, failed, after)] == [{"lanes_out": 0}] * 3


def test_run_device_with_numpy_feeds_copies_a_replays_outputs_out_on_orts_stream_with_no_host_wait_after():
    """run_device with NumPy feeds on a graph session: the feeds go up on ORT's stream (the staging buffer waited for
    once it was used), the replay queues behind them, and the outputs are copied out as a device-feed replay's are
    (slots.GraphSlots.copy_out): into arrays of the caller's stream, on ORT's stream, the caller's stream waiting on an
    event. The only host waits are for the caller's stream and the staging buffer, before the copies."""
    got = calls_of("device numpy")
    assert got["slot_calls"] == 2
    (staging,) = got["staging"]
    start, nbytes = got["block"]
    first, *replays = got["calls"]
    assert [c[0] for c in first["log"]] == ["synchronize", "copy", "record", "ort run"]  # eager: ORT's own outputs
    for index, call in enumerate(replays, start=1):
        staged, copied = call["log"][1][1], call["log"][-2][1]
        expected = [
            ("synchronize", "caller"),
            ("synchronize", staged),  # the last call's copy up has read the staging buffer
            ("copy", start, staging, nbytes, "ort"),
            ("record", staged, "ort"),
            ("ort run", "1", "1"),
            ("alloc", "caller", [1, 32, 768]),
            ("launch copy_segments", [[got["outputs"][index][0], got["view"], OUTPUT_BYTES]], "ort"),
            ("record", copied, "ort"),
            ("wait", "caller", copied),
        ]
        assert_calls(call["log"], expected, f"replay {index}")


def test_sessions_on_two_devices_each_touch_only_their_own_device():
    """Issue 32, item 5, on any machine: sessions on devices 0 and 1, made while device 0 is current, each answer
    run_device and run (graphs on and off, a call from another thread among them), and every CUDA call a session
    makes touches its own device only: the current device, the stream, the event, the memory copied and allocated.
    CUDA refuses an event recorded on another device's stream (the stand-in raises as it does): the graph
    session's two events were once made on whichever device was current."""
    got = calls_of("two devices")
    assert sorted(got) == ["eager on 0", "eager on 1", "graphs on 0", "graphs on 1"]
    for label, session in got.items():
        device = session["device"]
        kinds = [c["kind"] for c in session["calls"]]
        assert kinds == ["run_device"] * 3 + ["run"] * 3, label
        for index, call in enumerate(session["calls"]):
            where = f"{label}, call {index} ({call['kind']})"
            assert call["outcome"][0] == "answered", f"{where}: {call['outcome']}"
            if call["kind"] == "run_device":
                assert call["outcome"][1] == [device], f"{where}: its output lies on device {call['outcome'][1]}"
            assert call["log"], f"{where}: no CUDA call recorded"
            strays = [(entry, places) for entry, places in zip(call["log"], call["places"]) if places != [device]]
            assert not strays, f"{where} touched another device: {strays}"
        # the graph sessions replayed their slot: two run_device calls and three run calls after the first call
        assert session["slot_calls"] == (5 if label.startswith("graphs") else 0), label


def test_a_slot_that_cannot_be_allocated_leaves_its_signature_eager_and_the_call_answered():
    """A graph session's first call of a signature runs eagerly, then allocates the signature's fixed buffers.
    When CuPy (the inputs' block) or ORT (an output value) cannot allocate them, the call keeps its eager answer,
    the signature runs eagerly from then on, no graph id is spent, and the first such failure is logged. Any other
    failure there is raised. The eager signatures a session remembers are bounded (all forgotten past
    MAX_VERDICTS, 3 here)."""
    got = calls_of("slot allocation")
    calls = {(c["sequence"], c["failure"]): c for c in got["calls"]}
    answered = [c for c in got["calls"] if c["failure"] != "lost context"]
    assert all(c["outcome"][0] == "answered" for c in answered), [c["outcome"] for c in answered]
    assert calls[(32, "block OOM")]["ort runs"] == ["-1"] and calls[(32, "block OOM")]["slots"] == {"32": None}
    assert calls[(32, None)]["ort runs"] == ["-1"], "a signature whose slot failed runs eagerly"
    assert calls[(16, None)]["slots"]["16"] == 1, "the next signature gets the first graph id: none was spent"
    assert [c["ort runs"] for c in got["calls"] if c["sequence"] == 16] == [["-1"], ["1"]]
    assert calls[(8, "value OOM")]["outcome"][0] == "answered" and calls[(8, "value OOM")]["slots"]["8"] is None
    lost = calls[(24, "lost context")]
    assert lost["outcome"] == ["RuntimeError", "CUDA failure 700: an illegal memory access was encountered"]
    assert "24" not in lost["slots"]
    assert (got["failures"], got["held"]) == (2, 1)
    assert len(got["logged"]) == 1 and "could not be allocated (out of memory" in got["logged"][0]
    # past 3 eager signatures all are forgotten; the slot stays
    assert [sorted(c["slots"]) for c in got["calls"][-5:]] == [
        ["12", "16", "32", "8"], ["11", "16"], ["10", "11", "16"], ["10", "11", "16", "9"], ["16", "7"]]


def test_a_failed_allocation_is_told_apart_from_other_failures():
    from mha_ep.gpu_session.recovery import allocation_failed

    class OutOfMemoryError(MemoryError):  # CuPy's
        pass

    assert allocation_failed(OutOfMemoryError("out of memory to allocate 768 bytes"))
    assert allocation_failed(RuntimeError("BFCArena::AllocateRawInternal Failed to allocate memory for requested "
                                          "buffer of size 98304"))  # fmt: skip
    assert allocation_failed(RuntimeError("CUDA failure 2: out of memory ; GPU=0 ; expr=cudaMalloc(&p, size);"))
    assert not allocation_failed(RuntimeError("CUDA failure 700: an illegal memory access was encountered"))
    assert not allocation_failed(ValueError("out of memory"))  # only a RuntimeError's text is read


def test_eight_threads_on_a_graph_session_replay_one_call_at_a_time():
    """GraphThreads: a graph session's CUDA work runs one call at a time, whichever thread calls (the owner runs its own
    calls, the others' run on the session's worker). 8 threads call run_device at once, switching as often as Python
    lets them: every call is answered, and each replay's eight CUDA calls lie together in the record, all of one
    caller's stream, in ONE_STREAM_REPLAY's order; no lane is left out."""
    got = calls_of("threads")
    assert len(got["outcomes"]) == 160 and all(o[0] == "answered" for o in got["outcomes"]), got["outcomes"][:3]
    assert got["slot_calls"] == 160 and got["in_use"] == {"lanes_out": 0}
    log = [tuple(entry) for entry in got["log"]]
    assert len(log) == 160 * 8
    callers = []
    for start in range(0, len(log), 8):
        replay = log[start:start + 8]
        caller = replay[0][2]
        expected = [("record", ANY, caller), ("wait", "ort", ANY), ("launch copy_segments", ANY, "ort"),
                    ("ort run", "1", "1"), ("alloc", caller, [1, 32, 768]), ("launch copy_segments", ANY, "ort"),
                    ("record", ANY, "ort"), ("wait", caller, ANY)]  # fmt: skip
        assert_calls(replay, expected, f"replay {start // 8 + 1}")
        callers.append(caller)
    assert sorted(set(callers)) == [f"caller{i}" for i in range(8)]
    assert all(callers.count(f"caller{i}") == 20 for i in range(8))
