"""The CUDA calls of a graph replay through ``run_device``, in order, on any machine (native/cuda_io.py rule 7).

A child process puts tests/recording_cupy.py in CuPy's place (every CUDA call recorded, none run), gives a graph
session's CudaSessionIO a slot for the call's signature as the signature's first call leaves it, and calls
``run_device`` from the session's first thread and from another one (whose call runs on the session's worker).
Rule 7's promise, call by call: ORT's stream waits for the caller's (an event) before the feeds are copied into the
slot on ORT's stream; ORT's replay is queued with ``disable_synchronize_execution_providers``; the output is
allocated under the caller's stream and copied on ORT's; the caller's stream waits for ORT's (another event); and
nothing is waited for on the host. The GPU side of the same promise: tests/native/test_native_session.py,
``test_a_replay_queues_behind_the_callers_stream_and_returns_before_the_gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, threading
import recording_cupy
cupy = recording_cupy.install()
import numpy as np, onnxruntime as ort
from mha_ep.native import cuda_io

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

io = cuda_io.CudaSessionIO(Session(), 0, True, run, ort.RunOptions, ort_stream=cupy.cuda.Stream(name="ort"))
feeds = {n: cupy.ndarray((1, 32), np.int64) for n in ("input_ids", "token_type_ids", "attention_mask")}
key, _ = io._known(feeds, None)
host, device = io._split(feeds)
signature = io._remember(key, ["last_hidden_state"], host, device)
inputs = {n: cupy.ndarray(a.shape, a.dtype) for n, a in device.items()}
slot = cuda_io.GraphSlot(1, inputs, {"last_hidden_state": None}, binding=object(), order=sorted(inputs),
                         addresses={n: a.data.ptr for n, a in inputs.items()})
slot.views = {"last_hidden_state": cupy.ndarray((1, 32, 768), np.float32)}
io.slots[signature] = slot
result = {"feeds": {n: a.data.ptr for n, a in feeds.items()}, "slot": slot.addresses,
          "view": slot.views["last_hidden_state"].data.ptr, "calls": {}, "outputs": {}}

def call(caller):
    with cupy.cuda.Stream(name=caller):
        outputs = io.run_device(None, feeds)
    result["outputs"][caller] = [o.data.ptr for o in outputs]

for caller, on_a_thread in (("caller", False), ("second caller", True)):
    del recording_cupy.LOG[:]
    if on_a_thread:
        thread = threading.Thread(target=call, args=(caller,))
        thread.start()
        thread.join()
    else:
        call(caller)
    result["calls"][caller] = list(recording_cupy.LOG)
result["slot_calls"] = slot.calls
print(json.dumps(result))
"""


def replay_calls() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_replay_queues_its_copies_and_orts_run_between_two_stream_waits_and_waits_on_the_host_for_nothing():
    got = replay_calls()
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
