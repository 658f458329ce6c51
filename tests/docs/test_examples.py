"""The example scripts a user copies keep working (run as a user would, in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import REPO

EXAMPLES = REPO / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("register_and_run.py", "mha_ep.InferenceSession gives the same result: True"),
        ("compare_with_stock_ort.py", "PASS"),
    ],
)
def test_example_runs(script, expected):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert expected in done.stdout
