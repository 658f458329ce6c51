"""The CUDA calls of a graph replay, in order, on any machine (native/cuda_io.py rule 7).

A child process puts tests/recording_cupy.py in CuPy's place (every CUDA call recorded, none run), gives a graph
session's CudaSessionIO a slot for the call's signature as the signature's first call leaves it, and calls it twice:
``run_device`` from the session's first thread and from another one (whose call runs on the session's worker), or
``run`` with NumPy feeds. Rule 7's promise, call by call: ORT's stream waits for the caller's (an event) before the
feeds are copied into the slot on ORT's stream; ORT's replay is queued with
``disable_synchronize_execution_providers``; the output is allocated under the caller's stream and copied on ORT's;
the caller's stream waits for ORT's (another event); nothing is waited for on the host, except ``run``'s one wait
for its download. The GPU side of the same promise: tests/native/test_native_session.py,
``test_a_replay_queues_behind_the_callers_stream_and_returns_before_the_gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, threading
import recording_cupy
cupy = recording_cupy.install()
import numpy as np, onnxruntime as ort
from mha_ep.native import cuda_io
from mha_ep.native.transfer import device_block
from mha_ep.ops.backends.cuda.staging import pack_layout

class Arg:
    def __init__(self, name, type_, shape):
        self.name, self.type, self.shape = name, type_, shape

class Session:  # ORT's session as cuda_io reads it: its inputs and outputs (no C binding objects: the wrappers)
    def get_inputs(self):
        return [Arg(n, "tensor(int64)", ["B", "S"]) for n in ("input_ids", "token_type_ids", "attention_mask")]
    def get_outputs(self):
        return [Arg("last_hidden_state", "tensor(float)", ["B", "S", 768])]

def run(binding, options):  # the session's guarded run_with_iobinding
    recording_cupy.LOG.append(("ort run", options.get_run_config_entry("gpu_graph_id"),
                               options.get_run_config_entry("disable_synchronize_execution_providers")))

on_device = sys.argv[1] == "device"
io = cuda_io.CudaSessionIO(Session(), 0, True, run, ort.RunOptions, ort_stream=cupy.cuda.Stream(name="ort"))
names = ("input_ids", "token_type_ids", "attention_mask")
rng = np.random.default_rng(0)
feeds = {n: cupy.ndarray((1, 32), np.int64) if on_device else rng.integers(0, 99, (1, 32)) for n in names}
# the signature's slot as its first (eager) call leaves it: its inputs one block in signature order
key, _ = io._known(feeds, None)
host, device = io._split(feeds)
signature = io._remember(key, ["last_hidden_state"], host, device)
order = sorted(names)
inputs = device_block([(n, np.dtype(np.int64), (1, 32)) for n in order])
slot = cuda_io.GraphSlot(1, inputs, {"last_hidden_state": None}, binding=object(), order=order,
                         addresses={n: a.data.ptr for n, a in inputs.items()})
slot.views = {"last_hidden_state": cupy.ndarray((1, 32, 768), np.float32)}
io.slots[signature] = slot
segments, _ = pack_layout([(n, np.dtype(np.int64), (1, 32)) for n in order])
result = {"feeds": {n: a.data.ptr for n, a in feeds.items()} if on_device else {}, "slot": slot.addresses,
          "view": slot.views["last_hidden_state"].data.ptr, "calls": {}, "outputs": {},
          "block": [slot.addresses[order[0]], segments[order[-1]].offset + segments[order[-1]].nbytes]}

def call(caller):
    with cupy.cuda.Stream(name=caller):
        outputs = io.run_device(None, feeds) if on_device else io.run_host(None, feeds)
    result["outputs"][caller] = [o.data.ptr if on_device else o.ctypes.data for o in outputs]

calls = (("caller", False), ("second caller", True)) if on_device else (("caller", False), ("caller again", False))
for caller, on_a_thread in calls:
    del recording_cupy.LOG[:]
    if on_a_thread:
        thread = threading.Thread(target=call, args=(caller,))
        thread.start()
        thread.join()
    else:
        call(caller)
    result["calls"][caller] = list(recording_cupy.LOG)
result["slot_calls"] = slot.calls
lanes = [io._lanes.get_nowait() for _ in range(io._lanes.qsize())]
result["staging"] = [lane.transfers._staging.address for lane in lanes]
print(json.dumps(result))
"""


def replay_calls(feeds: str) -> dict:
    """The child's record of two replays with ``feeds`` "device" (run_device) or "host" (run, NumPy)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", CHILD, feeds], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_replay_queues_its_copies_and_orts_run_between_two_stream_waits_and_waits_on_the_host_for_nothing():
    got = replay_calls("device")
    assert got["slot_calls"] == 2  # both calls replayed the slot's graph
    names = ("input_ids", "token_type_ids", "attention_mask")
    for caller in ("caller", "second caller"):  # the first thread's own call, then one run on the session's worker
        calls = [tuple(c) for c in got["calls"][caller]]
        fed, copied = calls[0][1], calls[-2][1]
        (output,) = got["outputs"][caller]
        expected = [
            ("record", fed, caller),  # the caller's stream has written the feeds: an event on it
            ("wait", "ort", fed),  # ORT's stream waits for it, on the device
            *[("copy", got["slot"][n], got["feeds"][n], 32 * 8, "ort") for n in names],  # into the slot's buffers
            ("ort run", "1", "1"),  # the slot's graph, queued: ORT does not synchronize its stream after it
            ("alloc", caller, [1, 32, 768]),  # the output is the caller's stream's memory (CuPy's pool order)
            ("copy", output, got["view"], 32 * 768 * 4, "ort"),  # out of the slot's output, on ORT's stream
            ("record", copied, "ort"),
            ("wait", caller, copied),  # the caller's stream reads the output after the copy, on the device
        ]
        assert calls == expected, caller
        assert fed != copied
        assert not any(c[0] == "synchronize" for c in calls)


def test_a_replay_of_numpy_feeds_goes_up_in_one_copy_and_waits_once_for_its_download():
    """``run`` with NumPy feeds on a replayed signature (rule 7): the feeds go up from the lane's staging buffer
    in one copy into the slot's one input block, on ORT's stream; the replay queues behind it; the output comes
    down on the same stream, and the host waits once, for that download. The next call finds the staging buffer
    free (the download's wait covered its copy) and waits for nothing more."""
    got = replay_calls("host")
    assert got["slot_calls"] == 2
    (staging,) = got["staging"]  # one lane: the calls came one after the other
    start, nbytes = got["block"]
    for caller in ("caller", "caller again"):
        calls = [tuple(c) for c in got["calls"][caller]]
        staged = calls[1][1]
        (output,) = got["outputs"][caller]
        expected = [
            ("copy", start, staging, nbytes, "ort"),  # every feed up in one copy, into the slot's block
            ("record", staged, "ort"),  # the staging buffer is read until here
            ("ort run", "1", "1"),
            ("copy", output, got["view"], 32 * 768 * 4, "ort"),  # down into the output's page-locked block
            ("synchronize", "ort"),  # the call's one wait
        ]
        assert calls == expected, caller
