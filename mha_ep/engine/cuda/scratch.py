"""Per-call device scratch: one owner that releases every allocation exactly once, on every path.

A port of ``MhaScratch`` from the original Rust CUDA execution provider (kept outside this repository). The
runtime is injected, so the ownership rules are tested without a GPU (tests/engine/cuda/test_cuda_scratch.py, with a
fault-injecting runtime). Each rule by its name, an UPPER_CASE heading or the method that is the whole rule, cited as
``rule NAME``:

  allocate: an allocation is recorded only after it succeeded; a failed allocation records nothing.
  FREE_ONCE: ``release`` frees every recorded allocation once, newest first, and forgets it (a second release is a
    no-op).
  SYNC_BEFORE_FREE: once anything was submitted to the stream that may still read or write an allocation
    (``mark_stream_use``), ``release`` synchronizes the stream before the first free, also when it runs because of
    an exception.
  finish_stream_use: the success path's synchronize; its failure propagates, and release still frees.
Use it as a context manager: ``with MhaScratch(runtime) as scratch: ...``; ``__exit__`` is ``release``.

This module must not import CuPy.
"""

from __future__ import annotations

from typing import Any, Protocol


class ScratchRuntime(Protocol):
    """What the scratch needs from a device runtime. ``allocate`` returns an opaque handle with a device address."""

    def allocate(self, nbytes: int) -> Any: ...

    def free(self, allocation: Any) -> None: ...

    def address(self, allocation: Any) -> int: ...

    def upload(self, src: Any, nbytes: int, dst_address: int) -> None: ...

    def synchronize(self) -> None: ...


class MhaScratch:
    """Owns every per-call device allocation until all stream users have completed."""

    def __init__(self, runtime: ScratchRuntime):
        self.runtime = runtime
        self._allocations: list[Any] = []
        self._stream_may_use_allocations = False

    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (at least 1) and return the device address (rule ``allocate``)."""
        allocation = self.runtime.allocate(max(int(nbytes), 1))
        self._allocations.append(allocation)
        return self.runtime.address(allocation)

    def upload(self, src: Any, nbytes: int, dst_address: int) -> None:
        """Asynchronous host-to-device copy into an owned allocation; the stream may use it from now on."""
        self._stream_may_use_allocations = True
        self.runtime.upload(src, nbytes, dst_address)

    def mark_stream_use(self) -> None:
        """Record that work which may touch the allocations was (or is about to be) submitted to the stream."""
        self._stream_may_use_allocations = True

    def finish_stream_use(self) -> None:
        """Rule ``finish_stream_use``: wait for the stream; nothing is pending afterwards."""
        if self._stream_may_use_allocations:
            self.runtime.synchronize()
            self._stream_may_use_allocations = False

    @property
    def live_allocations(self) -> int:
        return len(self._allocations)

    def release(self) -> None:
        """Rules FREE_ONCE and SYNC_BEFORE_FREE. Never raises from a free; the first error of a synchronize is
        re-raised after the frees."""
        error = None
        if self._stream_may_use_allocations:
            self._stream_may_use_allocations = False
            try:
                self.runtime.synchronize()
            except Exception as exc:  # noqa: BLE001 - the frees below must still run
                error = exc
        while self._allocations:
            allocation = self._allocations.pop()
            try:
                self.runtime.free(allocation)
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> "MhaScratch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except Exception:  # noqa: BLE001 - the original exception is the one the caller must see
            pass
