"""`mha-ep demo` on the shipped models: plugin vs stock ORT (reference backend on CI machines)."""

from __future__ import annotations

import io
import subprocess
import sys

from mha_ep.demo import run_demo
from mha_ep.models import manifest


def test_demo_passes_and_claims_every_mha_node():
    out = io.StringIO()
    assert run_demo(backend="reference", per_node=True, out=out) == 0, out.getvalue()
    text = out.getvalue()
    expected = sum(e["mha_nodes"] for e in manifest.load()["models"])
    assert f"{expected} MHA nodes claimed, 0 declined" in text, text
    assert "PASS: every model's outputs match stock ORT within tolerance" in text
    assert "per claimed node, in graph order:" in text


def test_demo_command_says_which_backend_it_used():
    done = subprocess.run([sys.executable, "-m", "mha_ep", "demo"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert "backend: " in first and ("reference (NumPy)" in first or "cuda (CuPy" in first), first


def test_demo_json_is_one_object_with_every_models_verdict():
    import json

    out = io.StringIO()
    assert run_demo(backend="reference", out=out, as_json=True) == 0
    data = json.loads(out.getvalue())
    assert data["verdict"] == "PASS" and data["exit_code"] == 0
    assert len(data["models"]) == len(manifest.load()["models"])
    assert all(m["verdict"] == "PASS" and m["claimed"] == m["partition"]["mha_nodes"] for m in data["models"])
