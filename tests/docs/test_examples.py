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


@pytest.mark.parametrize("script", ["transcribe_whisper.py", "transcribe_whisper_gpu.py"])
def test_a_whisper_example_without_its_models_says_how_to_build_them(script, tmp_path):
    """No traceback: one line naming the missing files and the build command, exit status 1."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MHA_EP_CACHE": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{script}: missing" in done.stderr and "python -m mha_ep.models.build whisper" in done.stderr


def test_the_two_gpu_example_without_a_gpu_says_what_it_needs():
    """On a machine without CuPy or a GPU (CI): one line saying what is missing, exit status 1, no traceback."""
    pytest.importorskip("onnxruntime")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("this machine has a GPU: the example serves instead (tests/gpu_session/test_two_gpus.py)")
    except Exception:  # noqa: BLE001 - no CuPy or no driver: the case under test
        pass
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLES / "serve_two_gpus.py")], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "serve_two_gpus.py: needs onnxruntime-gpu, CuPy and a GPU" in done.stderr


def test_the_serving_example_checks_every_answer_against_stock_ort():
    """examples/serve_ray.py: its own local Ray in the child, requests over HTTP and a handle, stock ORT's
    answers as the check (the serve extra; skipped without it)."""
    from mha_ep.serve import missing_extra

    if missing_extra():
        pytest.skip(f"{missing_extra()}: examples/serve_ray.py needs it")
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLES / "serve_ray.py")], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "served answers match stock ORT: True" in done.stdout
