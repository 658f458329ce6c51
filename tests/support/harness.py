"""Test harness shared by the suites: the repository's paths, Python code run in a subprocess (an abort there
cannot take pytest down), and threads released together."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


TESTS = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent  # the helpers (pyproject: pytest's pythonpath)


def run_threads(target, count: int) -> list:
    """Run ``target(index)`` on ``count`` threads released together; returns the exceptions they raised."""
    barrier = threading.Barrier(count)
    failures = []

    def body(index):
        try:
            barrier.wait(timeout=60)
            target(index)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            failures.append((index, error))

    threads = [threading.Thread(target=body, args=(i,), name=f"mha-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return failures


def run_script(code: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh Python with the repository, tests/support/ and tests/ (conftest) importable; an abort there
    shows as an exit status, not as a dead pytest."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SUPPORT), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"


# The start of a subprocess script: logging to stderr, a plain session of one node model on the Python op.
NODE_PRELUDE = """
    import logging, sys
    import numpy as np
    import onnx, onnxruntime as ort
    import mha_ep
    from mha_models import node_model
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")

    def plain_session(model):
        options = mha_ep.register(ort.SessionOptions(), backend="reference")
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
"""


def assert_survived(result, *texts):
    assert result.returncode == 0, describe(result)
    assert "DONE" in result.stdout, describe(result)
    for text in texts:
        assert text in result.stdout + result.stderr, f"{text!r} missing\n{describe(result)}"


# The start of a subprocess script: one symbolic-shape model, its good feeds and stock ORT's output for them.
SESSION_PRELUDE = """
    import logging, sys
    import numpy as np
    import onnxruntime as ort
    import mha_ep
    from conftest import max_rel_error
    from mha_models import MhaConfig, build_model, random_feeds, stock_outputs
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")
    config = MhaConfig(batch=2, q_seq=3, kv_seq=5, num_heads=2, head_size=4, bias=True, mask="2d", shapes="symbolic")
    rng = np.random.default_rng(7)
    good = random_feeds(config, rng)
    expected = stock_outputs(config, good)["output"]
"""
