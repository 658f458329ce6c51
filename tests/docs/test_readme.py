"""The README's Python snippet runs as written from any directory, the README keeps to words a new user knows and to
a front door's length, and the docs it hands the manual to (docs/CLI.md, docs/BRING_YOUR_OWN_MODEL.md) stay true."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from harness import REPO

README = REPO / "README.md"
CLI = REPO / "docs" / "CLI.md"
BYOM = REPO / "docs" / "BRING_YOUR_OWN_MODEL.md"


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
    guide = BYOM.read_text()
    assert "Conflicting" in guide and "ORTModelForFeatureExtraction" in guide
    assert "docs/BRING_YOUR_OWN_MODEL.md" in text and "docs/CLI.md" in text


def test_the_readme_is_a_front_door():
    """What it is, the two set-up commands, the smallest use, the headline numbers and links: 150 lines at most."""
    assert len(README.read_text().splitlines()) <= 150


def setup_commands() -> list[str]:
    section = README.read_text().split("## Set up\n", 1)[1].split("\n\n", 2)
    return [line.strip() for line in section[0].splitlines() + section[1].splitlines() if line.strip()][:2]


def test_ci_runs_exactly_the_readmes_test_command():
    demo, tests = setup_commands()
    assert demo.endswith("mha-ep demo") and tests.endswith("python3 -m pytest -q"), (demo, tests)
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests, f".ci/run's last line {ci[-1]!r} is not the README's test command {tests!r}"


def test_each_setup_command_makes_its_own_virtual_environment():
    """A system Python that is "externally managed" (PEP 668) refuses pip installs; both commands work there."""
    for command in setup_commands():
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && "), command
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "/.venv/" in ignored or ".venv/" in ignored


def test_the_verdict_table_lists_every_verdict_with_its_exit_code():
    from mha_ep.comparison import Verdict

    text = CLI.read_text()
    for verdict in Verdict:
        assert f"| {verdict.value} | {verdict.exit_code} |" in text, verdict


def test_the_models_doc_shows_the_tested_fusion_table():
    """docs/MODELS.md's table is families.ROUTES, row for row (the rows tests/models/test_fusion_routes.py runs)."""
    from mha_ep.models import families

    assert families.markdown_table() in (REPO / "docs" / "MODELS.md").read_text()
    assert "docs/MODELS.md" in README.read_text()


def test_the_command_line_synopsis_lists_every_option_of_each_subcommand():
    """docs/CLI.md's one-paragraph synopsis names every option ``--help`` shows (but -h, -v), for each subcommand."""
    import argparse

    from mha_ep import cli

    text = CLI.read_text()
    synopsis = text.split("Every subcommand (each with `--help`", 1)[1].split("The verdict of", 1)[0]
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices  # noqa: SLF001
    for name in ("partition", "compare", "demo", "static-cache", "serve"):
        assert f"mha-ep {name} " in synopsis, name
        part = synopsis.split(f"mha-ep {name} ", 1)[1].split("`", 1)[0]
        for action in commands[name]._actions:  # noqa: SLF001
            options = [o for o in action.option_strings if o not in ("-h", "--help", "-v", "--verbose")]
            if options:
                assert any(f"{o} " in part or f"{o}]" in part for o in options), (
                    f"mha-ep {name}: {options[-1]} missing from docs/CLI.md's synopsis"
                )
