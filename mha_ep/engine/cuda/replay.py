"""Replayed calls: the device work of a repeated call shape captured once as a CUDA graph.

A call's device work on the fused path (three layout movers and the fused kernel) costs the host one Python
kernel launch each, plus allocating and freeing its buffers: more than the kernels themselves for small calls
(docs/BENCH.md, "Host-side choices"). When the same call shape comes back, the cuda backend keeps that shape's
device buffers and replays a captured graph instead: one launch, no allocation. Per call the host then only packs
the inputs into the pinned buffer, uploads them, launches the graph, downloads the outputs and synchronizes.

The rules (pure, tested without a GPU), each by its name: an UPPER_CASE heading, or the function or method that
is the whole rule; they are cited as ``rule NAME``:
  should_capture: a shape is captured on its second sighting: a shape seen once (a decode step whose key length
    grows every step) never pays for a capture or holds memory;
  SMALL_FUSED_CALLS: only fused-path calls whose device buffers total at most REPLAY_MAX_BYTES are replayed (the
    three-phase path calls cuBLAS, which CuPy refuses to capture; for large calls the launches are a negligible
    part); the cuda backend's ``_replay_key`` applies it;
  LRU_ENTRIES: at most REPLAY_ENTRIES shapes hold buffers; the least recently used one is released first;
  replay_key: the key holds everything the captured launches depend on besides array contents.

This module must not import CuPy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional

REPLAY_ENTRIES = 8  # shapes whose buffers and graph are kept
REPLAY_MAX_BYTES = 64 << 20  # device bytes of one replayed shape (inputs, outputs and operands)
SEEN_SHAPES = 256  # shapes remembered as seen once


def replay_key(problem, inputs) -> Optional[tuple]:
    """Everything a captured call depends on except the array contents, or None when it cannot be a dict key
    (a NaN attribute never equals itself). ``inputs`` are backend.input_entries(problem)."""
    floats = (problem.scale, problem.mask_filter_value)
    if any(value != value for value in floats):
        return None
    staged = tuple((name, dtype.str, shape) for name, dtype, shape, _ in inputs)
    return (problem.geometry, problem.dtype, floats, problem.causal, problem.kv_layout, staged,
            problem.want_present_key, problem.want_present_value, problem.want_qk)  # fmt: skip


class ReplayCache:
    """Which shapes are replayed, and their entries (opaque to this class), least recently used first out.

    ``release(entry)`` is called exactly once for every entry that leaves the cache (eviction or ``clear``).
    """

    def __init__(self, release: Callable[[Any], None], entries: int = REPLAY_ENTRIES, seen: int = SEEN_SHAPES):
        self._release = release
        self._limit = entries
        self._seen_limit = seen
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._refused: set = set()
        self.captured = 0
        self.replayed = 0

    def lookup(self, key: Hashable) -> Optional[Any]:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.replayed += 1
        return entry

    def should_capture(self, key: Hashable) -> bool:
        """Rule ``should_capture``: True on the second sighting of ``key`` (not after a failed capture); records
        the first."""
        if key in self._refused:
            return False
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)
        return False

    def add(self, key: Hashable, entry: Any) -> None:
        """Rule LRU_ENTRIES: keep ``entry``; release the least recently used ones beyond the limit."""
        self._entries[key] = entry
        self.captured += 1
        while len(self._entries) > self._limit:
            _, oldest = self._entries.popitem(last=False)
            self._release(oldest)

    def refuse(self, key: Hashable) -> None:
        """A capture of ``key`` failed: run it the ordinary way from now on."""
        self._refused.add(key)

    def discard(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._release(entry)

    def clear(self) -> None:
        while self._entries:
            _, entry = self._entries.popitem(last=False)
            self._release(entry)

    def __len__(self) -> int:
        return len(self._entries)
