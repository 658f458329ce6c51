"""The README and docs/ (docs/bench/HISTORY.md included) name only files that exist: every path rooted at one of
the repository's own folders (``mha_ep/``, ``tests/``, ``scripts/``, ``examples/``, ``docs/``), and every
``bench/...`` file docs/BENCH.md points to beside it, is in the checkout. A file a journal entry names after it was
removed says so on the same line ("removed", "retired"). (Paths of ORT's own sources, ``models/whisper/...``, and
example names a user picks, ``model.onnx``, are not the repository's and are not checked.) And every saved run in
docs/bench/ is named by a doc: a file no doc names is not kept."""

from __future__ import annotations

import re

import pytest

from harness import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "bench").glob("*.md"))]
SAVED_RUNS = sorted(p for p in (REPO / "docs" / "bench").iterdir() if p.suffix in (".json", ".png"))
ROOTED = re.compile(r"(?<![\w./-])((?:mha_ep|tests|scripts|examples|docs)/[\w./-]*[\w/])")
BENCH = re.compile(r"(?<![\w./-])(bench/[\w.-]+\.(?:json|png))")
HISTORY = ("removed", "retired")


def missing(doc) -> list:
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if any(word in line for word in HISTORY):
            continue
        for match in ROOTED.finditer(line):
            path = match.group(1).rstrip("/.")
            if not (REPO / path).exists():
                found.append(f"{doc.name}:{number}: {path}")
        for match in BENCH.finditer(line):
            if not (REPO / "docs" / match.group(1)).exists():
                found.append(f"{doc.name}:{number}: docs/{match.group(1)}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_the_doc_names_only_files_that_exist(doc):
    assert missing(doc) == []


def test_the_check_sees_a_missing_file(tmp_path):
    doc = tmp_path / "X.md"
    doc.write_text("See `mha_ep/no_such_module.py` and bench/none.json.\nOld: `mha_ep/device` (retired).\n")
    assert missing(doc) == ["X.md:1: mha_ep/no_such_module.py", "X.md:1: docs/bench/none.json"]


def test_the_benchmark_history_is_checked_too():
    assert REPO / "docs" / "bench" / "HISTORY.md" in DOCS


@pytest.mark.parametrize("run", SAVED_RUNS, ids=lambda path: path.name)
def test_every_saved_run_is_named_by_a_doc(run):
    named = re.compile(rf"(?<![\w.-])(?:docs/)?bench/{re.escape(run.name)}(?![\w.-])")
    assert any(named.search(doc.read_text()) for doc in DOCS), f"no doc names docs/bench/{run.name}"
