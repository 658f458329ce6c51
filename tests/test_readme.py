"""The README's Python snippet runs as written from any directory, and the README keeps to words a new user knows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_use_it_snippet_runs_from_another_directory(tmp_path):
    snippet = re.search(r"## Use it\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    env = dict(os.environ, PYTHONPATH=str(README.parent))
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 claimed" in done.stdout and (tmp_path / "model_mha_ep.onnx").is_file()


def test_no_internal_jargon_and_no_test_counts():
    text = README.read_text()
    for phrase in ("main job", "the bridge", "anchor shapes", "sixth session", "whisper_small", "bert_small"):
        assert phrase not in text, phrase
    assert not re.search(r"\d+ passed", text)
    assert "Bring your own model" in text and "Conflicting" in text and "ORTModelForFeatureExtraction" in text
