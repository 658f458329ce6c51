"""A GPU session's small host calls: ORT's own ``run``.

A host call whose feeds and outputs are small (OWN_RUN_MAX_BYTES: the feeds before the call, the outputs from the
call key's first call) goes through ORT's own ``run``: it copies as fast there, holds the GIL for less of the
call, and raises ORT's own exceptions. Not with graphs on: a replay is what those calls want. Larger host calls
move through page-locked memory (transfer.py).
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional

import numpy as np

from mha_ep.gpu_session.ort_calls import DirectRun

# Host calls whose feeds and outputs together are at most this go through ORT's own run (the module docstring):
# below it page-locked staging saves less than its Python costs (docs/BENCH.md, "Host-side choices").
OWN_RUN_MAX_BYTES = 1 << 20


def host_bytes(feeds: Mapping) -> int:
    """The bytes of the call's NumPy feeds."""
    return sum(value.nbytes for value in feeds.values() if isinstance(value, np.ndarray))


class SmallCalls:
    """An eager session's small host calls, through ORT's own ``run`` (``ort``: ort_calls.OrtCalls; ``checks``:
    checks.CallChecks, where a call key's first call leaves whether its calls are small)."""

    def __init__(self, ort, checks):
        from mha_ep.gpu_session.transfer import is_host_feed

        self.ort = ort
        self.checks = checks
        self._is_host_feed = is_host_feed  # transfer.py imports CuPy: looked up once here, used on every call

    def fits(self, feeds: Mapping) -> bool:
        """Whether a call with no remembered verdict goes through ORT's own run: all its feeds on the host, and at
        most OWN_RUN_MAX_BYTES of them."""
        return all(map(self._is_host_feed, feeds.values())) and host_bytes(feeds) <= OWN_RUN_MAX_BYTES

    def run(self, key: Optional[tuple], known: Optional[list], wanted: List[str], output_names, feeds: Mapping,
            make_options: Optional[Callable]) -> list:  # fmt: skip
        """ORT's own ``run``: its exceptions are already the ones ``run`` raises. A call key's first call comes here
        and learns whether its feeds and outputs are small enough to stay."""
        options = make_options() if make_options is not None else None
        session = self.ort.session
        results = self.ort.run(DirectRun(lambda: session.run(output_names, dict(feeds), options)), options)
        if known is None and key is not None:
            nbytes = sum(np.asarray(v).nbytes for v in feeds.values()) + sum(r.nbytes for r in results)
            self.checks.remember(key, wanted, feeds, {}, small=nbytes <= OWN_RUN_MAX_BYTES)
        return results
