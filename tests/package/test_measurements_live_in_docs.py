"""Measured numbers live in docs/BENCH.md (and docs/FACTS.md), with their date, machine and commit; the code keeps
the reason and points there ("docs/BENCH.md, "Dispatch defaults""). A timing in a comment goes stale the day the
code around it changes, and nobody re-measures a comment. This reads every comment and docstring of mha_ep (Python,
CUDA, C) and fails on a measured-looking number: a time (µs, us, ms, ns), a rate (GB/s, TB/s, TFLOP/s), a
percentage, or a factor faster, slower or off. (Seconds are left alone: clip lengths and time-outs are given in
them.)"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from harness import REPO

PACKAGE = REPO / "mha_ep"
MEASURED = re.compile(
    r"\d(?:[\d,.]*\d)?\s*(?:µs|us|ms|ns)\b"  # a time
    r"|\d\s*(?:[GT]B|[GT]FLOP)/s\b"  # a rate
    r"|\d(?:\.\d+)?\s*%"  # a percentage
    r"|\d(?:\.\d+)?\s*(?:x|×)\s+(?:faster|slower|off)\b"  # a factor
)
# (file relative to mha_ep, the text that may stay): none today. A line here needs a reason a reviewer accepts.
ALLOWED: tuple = ()
C_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)


def python_comments(text: str):
    """(line, text) of every comment and docstring."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def c_comments(text: str):
    """(line, text) of every // and /* */ comment (string and character literals skipped)."""
    for match in C_TOKENS.finditer(text):
        if match.group(0).startswith("/"):
            yield text.count("\n", 0, match.start()) + 1, match.group(0)


def measured_in(path: Path) -> list:
    text = path.read_text()
    comments = python_comments(text) if path.suffix == ".py" else c_comments(text)
    name = str(path.relative_to(PACKAGE))
    return [f"{name}:{line}: {hit.group(0)!r}" for line, comment in comments for hit in MEASURED.finditer(comment)
            if (name, hit.group(0)) not in ALLOWED]  # fmt: skip


SOURCES = sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".c", ".h"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_measured_number_in_a_comment(path):
    hits = measured_in(path)
    assert not hits, ("measured numbers in comments (move them to docs/BENCH.md with their date, and leave the "
                      "reason and a pointer in the code): " + "; ".join(hits))  # fmt: skip


@pytest.mark.parametrize(
    "comment",
    ["# about 30 µs a call", "# 12.6 TFLOP/s", "# 55 GB/s pinned", "# 1.02 ms against 0.65 ms", "# 40 us for nine",
     "# 6-16% faster", "# cost the row 30%", "# 2x off", "# 1.5x slower"],
)  # fmt: skip
def test_the_pattern_catches_the_forms_that_were_moved(comment):
    assert MEASURED.search(comment), comment


def test_the_pattern_leaves_constants_and_shapes_alone():
    for comment in ("# 228 KiB of shared memory per SM", "# a 4 x 8 tile", "# pad or trim to 30 s", "# 2^31",
                    "# 16-byte loads", "# 64 x 128 with overlap", "# bias_ms = 3", "# at most 10 s"):  # fmt: skip
        assert not MEASURED.search(comment), comment


def test_c_comments_skip_string_literals():
    text = 'asm("mov.u32 %0, 5 us;" : "=r"(x));  // the note: 3 ms\nconst char* s = "// 4 ms";\n'
    assert [c for _, c in c_comments(text)] == ["// the note: 3 ms"]
