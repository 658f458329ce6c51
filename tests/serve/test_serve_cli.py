"""``mha-ep serve MODEL`` as a user runs it: it says where it serves (one JSON object with --json), answers a
request as a direct session does, and stops cleanly on Ctrl-C. Its own Ray, in the child process; the test
waits for what the child prints, never for a length of time."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from harness import REPO
from mha_ep.serve import missing_extra

if missing_extra():
    pytest.skip(f"{missing_extra()}: the Ray Serve tests need it", allow_module_level=True)

import mha_ep  # noqa: E402
from mha_ep.serve import free_port  # noqa: E402
from serve_models import bert_feeds, bert_path  # noqa: E402

DEADLINE_S = 120  # a failure bound only


def read_json_object(lines: "queue.Queue", end: float) -> dict:
    """The first JSON object the child prints (indented: from a line "{" to a line "}")."""
    text = []
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith("{") or text:
            text.append(line)
        if line.rstrip() == "}":
            return json.loads("".join(text))
    raise AssertionError(f"mha-ep serve printed no JSON object within {DEADLINE_S} s: {''.join(text)!r}")


def test_mha_ep_serve_says_where_answers_and_stops_on_ctrl_c():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen(
        [sys.executable, "-m", "mha_ep", "serve", bert_path(), "--port", str(port), "--backend", "reference",
         "--cpus-per-replica", "0", "--max-batch", "4", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    lines: "queue.Queue" = queue.Queue()

    def pump():
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        said = read_json_object(lines, time.monotonic() + DEADLINE_S)
        assert said["url"] == f"http://127.0.0.1:{port}/" and said["options"]["max_batch"] == 4
        assert said["batching"]["mask"] == "attention_mask" and said["replica_resources"]["num_gpus"] == 0
        feeds = bert_feeds(12, rows=2, seed=3)
        body = json.dumps({"inputs": {k: v.tolist() for k, v in feeds.items()}}).encode()
        request = urllib.request.Request(said["url"], data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as reply:
            answer = json.loads(reply.read())
        expected = mha_ep.InferenceSession(bert_path(), backend="reference").run(None, feeds)[0]
        assert np.array_equal(np.array(answer["outputs"]["last_hidden_state"], np.float32), expected)
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=DEADLINE_S) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=DEADLINE_S)
