"""Progress bars (tqdm, on stderr) for compare's session runs and comparisons and demo's models: shown on a
terminal only, never under -q or --json, never in a pipe."""

from __future__ import annotations

import io
import subprocess
import sys

import onnx

import mha_ep
from mha_ep import progress

from mha_models import chain_model


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_is_wanted_only_on_a_terminal_without_quiet_or_json():
    assert progress.wanted(stream=Terminal())
    assert not progress.wanted(quiet=True, stream=Terminal())
    assert not progress.wanted(as_json=True, stream=Terminal())
    assert not progress.wanted(stream=io.StringIO())  # a pipe or a file
    assert not progress.wanted(stream=object())  # no isatty at all


def recording(monkeypatch, module):
    """Keep every bar ``module`` makes, to read its count and total once it is closed."""
    bars = []

    def make(*args, **kwargs):
        bars.append(progress.bar(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(module, "progress_bar_over", make)
    return bars


def test_compare_counts_every_session_run_and_comparison_on_its_bar(monkeypatch, capsys):
    from mha_ep.comparison import runner as compare_module

    bars = recording(monkeypatch, compare_module)
    report = mha_ep.compare(chain_model(), backend="reference", per_node=True, runs=2, repeat=1, progress_bar=True)
    assert report.passed, report.text()
    # per feed set: 2 sessions x (1 + repeat) runs + 2 node outputs + 1 model output = 7; two feed sets
    assert [(bar.n, bar.total) for bar in bars] == [(14, 14)]
    assert "compare" in capsys.readouterr().err
    mha_ep.compare(chain_model(), backend="reference", repeat=1)
    assert capsys.readouterr().err == ""  # off by default: a library call prints nothing


def test_demo_shows_a_bar_over_the_models(monkeypatch, capsys):
    from mha_ep import demo
    from mha_ep.models import manifest

    loaded = manifest.load()
    monkeypatch.setattr(manifest, "load", lambda: dict(loaded, models=loaded["models"][:2]))
    bars = recording(monkeypatch, demo)
    out = io.StringIO()
    assert demo.run_demo(backend="reference", out=out, progress_bar=True) == 0, out.getvalue()
    assert [(bar.n, bar.total, bar.unit) for bar in bars] == [(2, 2, "model")]
    assert "demo" in capsys.readouterr().err
    assert "PASS" in out.getvalue() and "\r" not in out.getvalue()


def test_the_cli_in_a_pipe_prints_no_bar(tmp_path):
    source = tmp_path / "chain.onnx"
    onnx.save(chain_model(), source)
    done = subprocess.run([sys.executable, "-m", "mha_ep", "compare", str(source), "--backend", "reference", "--per-node"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mha-ep compare: plugin: creating the session ..." in done.stderr  # the step lines stay
    assert "\r" not in done.stderr and "%|" not in done.stderr
