"""The shipped default models: read MANIFEST.json and make valid feeds from it (NumPy only, no torch).

    from mha_ep.models import manifest
    for entry in manifest.load()["models"]:
        path = manifest.model_path(entry)
        feeds = manifest.make_feeds(entry, seed=0)          # every input, valid values, consistent dims

Each manifest entry has: ``file``, ``family`` (bert | whisper), ``part``, ``dtype``, ``description``,
``config`` (vocab size, heads, layers, ...), ``dims`` (an example value and a maximum for each symbolic dim),
``inputs``/``outputs`` (name, dtype, shape with symbolic dims as strings; inputs add ``role`` and ``meaning``,
and ids add ``low``/``high``), ``mha_nodes``, ``attention_nodes``, ``op_counts``, ``bytes``, ``sha256`` and
``command`` (how it was built).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional

import numpy as np

from mha_ep.shipped import folder as _shipped_folder

DEFAULT_DIR = _shipped_folder()  # the shipped models: mha_ep/shipped.py finds them in a checkout or a wheel
MANIFEST_PATH = DEFAULT_DIR / "MANIFEST.json"


def load(path=MANIFEST_PATH) -> dict:
    return json.loads(Path(path).read_text())


def entries(path=MANIFEST_PATH) -> Dict[str, dict]:
    """Manifest entries by file name."""
    return {e["file"]: e for e in load(path)["models"]}


def model_path(entry: Mapping, folder=DEFAULT_DIR) -> Path:
    return Path(folder) / entry["file"]


def resolve_dims(entry: Mapping, dims: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """Concrete values for every symbolic dim: the caller's, else the manifest's example; derived dims follow."""
    out = {name: int(spec["example"]) for name, spec in entry["dims"].items() if "example" in spec}
    out.update(dims or {})
    for name, spec in entry["dims"].items():
        limit = spec.get("max")
        if limit is not None and out.get(name, 0) > limit:
            raise ValueError(f"{entry['file']}: dim {name}={out[name]} exceeds its maximum {limit}")
    if "past_decode_len" in out:
        out["total_decode_len"] = out["past_decode_len"] + 1
    return out


def make_feeds(entry: Mapping, dims: Optional[Mapping[str, int]] = None, seed: int = 0) -> Dict[str, np.ndarray]:
    """Valid random feeds for one manifest entry: token ids inside the vocabulary, right-padded 0/1 attention
    masks with at least one token per row, float inputs in the model's float dtype."""
    rng = np.random.default_rng(seed)
    sizes = resolve_dims(entry, dims)
    feeds: Dict[str, np.ndarray] = {}
    for io in entry["inputs"]:
        shape = tuple(sizes[d] if isinstance(d, str) else int(d) for d in io["shape"])
        dtype = np.dtype(io["dtype"])
        role = io.get("role")
        if role == "attention_mask":
            batch, seq = shape
            lengths = np.maximum(1, seq - rng.integers(0, seq, batch))
            lengths[0] = seq  # one full row
            feeds[io["name"]] = (np.arange(seq)[None, :] < lengths[:, None]).astype(dtype)
        elif "low" in io:
            feeds[io["name"]] = rng.integers(io["low"], io["high"], shape).astype(dtype)
        elif role == "input_features":
            feeds[io["name"]] = rng.uniform(-1.0, 1.0, shape).astype(dtype)
        else:  # hidden states and K/V caches
            feeds[io["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds
