"""Where the shipped small models, their MANIFEST.json and the speech wavs are, from any working directory.

    import mha_ep
    path = mha_ep.shipped_model("bert_random_mask2d_fp32.onnx")   # a pathlib.Path that exists
    folder = mha_ep.shipped.folder()                               # the folder holding MANIFEST.json

Search order: the copy installed inside the package (``mha_ep/_shipped_models``, put there when a wheel is
built), then the source checkout's top-level ``models/`` folder (an editable install or a clone).
"""

from __future__ import annotations

import functools
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
INSTALLED_DIR = PACKAGE_DIR / "_shipped_models"
SOURCE_DIR = PACKAGE_DIR.parent / "models"
MANIFEST = "MANIFEST.json"


@functools.lru_cache(maxsize=None)
def folder() -> Path:
    """The folder with the shipped models and MANIFEST.json; FileNotFoundError naming both places when neither has it."""
    for candidate in (INSTALLED_DIR, SOURCE_DIR):
        if (candidate / MANIFEST).is_file():
            return candidate
    raise FileNotFoundError(
        f"the shipped models are missing: neither {INSTALLED_DIR} (an installed wheel) nor {SOURCE_DIR} (a source "
        f"checkout) has {MANIFEST}; reinstall mha-ep"
    )


def shipped_model(name: str) -> Path:
    """The path of one shipped file (a model or a wav) by file name; names the available ones when it is not one."""
    path = folder() / name
    if not path.is_file():
        available = sorted(p.name for p in folder().iterdir() if p.suffix in (".onnx", ".wav"))
        raise FileNotFoundError(f"no shipped file named {name!r}; the shipped files are {available}")
    return path
