"""Where a benchmark's results go: the same two options in every ``mha-ep bench WHAT``, meaning what they mean
in the rest of mha-ep.

    --json      the results as one JSON object on stdout; the table goes to stderr
    --out DIR   also write the results (``bench_WHAT.json``, and a PNG where the benchmark draws one) into DIR

A benchmark prints its table with plain ``print``; ``json_mode`` (entered by ``mha_ep.bench.main`` when ``--json``
is given) points stdout at stderr for the run, and ``print_json`` writes the one object to the real stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

_json_stdout: Optional[object] = None  # the real stdout while json_mode is on


def add_output_options(parser, out_help: str = "also write the results as JSON into this folder") -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON object on stdout (the table goes to stderr)")  # fmt: skip
    parser.add_argument("--out", metavar="DIR", help=out_help)


@contextlib.contextmanager
def json_mode(enabled: bool = True):
    """While on, ``print`` goes to stderr and only ``print_json`` reaches stdout. Nested uses are one."""
    global _json_stdout
    if not enabled or _json_stdout is not None:
        yield
        return
    _json_stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stdout = None


def print_json(data) -> None:
    """The results as one JSON object on stdout (the real one, under json_mode)."""
    print(json.dumps(data, indent=2, default=str), file=_json_stdout or sys.stdout, flush=True)


def write_json(folder: str, name: str, data) -> Path:
    """``data`` as ``folder/name`` (the folder made when missing), written whole or not at all (a temporary file
    beside it, then a rename); the path, for a 'wrote' line."""
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, default=str)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def emit(args, name: str, data) -> None:
    """What ``--out`` and ``--json`` ask for: ``data`` written as ``DIR/name`` (and said on stderr), then printed as
    one JSON object on stdout."""
    if args.out:
        print(f"wrote {write_json(args.out, name, data)}", file=sys.stderr)
    if args.json:
        print_json(data)
