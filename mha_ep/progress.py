"""Progress bars for long work (tqdm, on stderr), shown only to a person watching a terminal.

``wanted(quiet, as_json)`` is the one rule: no bar under ``-q`` or ``--json``, nor when stderr is not a TTY (a
pipe, a file, a test), so logs and machine-read output stay clean. ``bar(...)`` is a tqdm that is a no-op when
not wanted; ``write(text, file)`` prints a line without tearing a bar that is on screen.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def wanted(quiet: bool = False, as_json: bool = False, stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and not as_json and callable(isatty) and bool(isatty())


def bar(total: int, desc: str, enabled: bool, unit: str = "step") -> tqdm:
    """A bar on stderr that disappears when done (the text that follows it is the result)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


def write(text: str, file=None) -> None:
    """``print(text, file=file)``, clearing and redrawing any bar on screen around it."""
    file = sys.stdout if file is None else file
    tqdm.write(text, file=file)
    file.flush()
