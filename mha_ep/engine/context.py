"""Which backend a call runs on, and where its errors go.

The onnxruntime-extensions op is process-global and receives only inputs and attributes, so the per-run facts
travel beside it. ``current_backend`` is the one way the op finds its backend:
- ``mha_ep.InferenceSession.run`` enters ``run_context(backend, run_options)`` on the calling thread. ORT's
  sequential executor runs the Python op on that same thread, so the op finds the session's backend and an error
  slot there. An error is recorded, ``run_options.terminate`` is set (ORT stops before the next node), and the
  wrapper raises ``MhaRunError`` with the op's message once ``run`` returns; the session stays usable.
- A plain ``onnxruntime.InferenceSession`` (no context on the thread) uses the process default chosen by the last
  ``mha_ep.register(...)`` call (``"auto"`` when none was made). It has no error channel: the op logs the error on the ``mha_ep`` logger and
  returns NaN-poisoned outputs. It never raises: an exception escaping a Python op aborts the whole process
  (docs/FACTS.md §1, measured).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

_local = threading.local()
_default_lock = threading.Lock()
_default = {"backend": None}


@dataclass
class RunContext:
    backend: object
    run_options: object = None  # onnxruntime.RunOptions
    errors: list = field(default_factory=list)  # [(node_name, message)]
    codes: list = field(default_factory=list)  # the ORT status code of each error (errors.ORT_STATUS_CLASSES)
    interrupted: bool = False  # a Ctrl-C reached an op of this run (mha_ep/engine/interrupt.py)

    def record(self, node_name: str, message: str, code: int = 1) -> None:
        """A claimed node's failure: its message, and the ORT status code stock ORT would end the run with (2,
        INVALID_ARGUMENT, for an input the node refuses; 1, FAIL, otherwise)."""
        self.errors.append((node_name, message))
        self.codes.append(code)
        self.stop()

    def first_error(self):
        """The first recorded failure as the MhaRunError the session raises."""
        from mha_ep.errors import run_error

        node, message = self.errors[0]
        return run_error(node, message, self.codes[0])

    def interrupt(self) -> None:
        self.interrupted = True
        self.stop()

    def stop(self) -> None:
        """ORT stops the run before the next node (these RunOptions are the run's own: session.py)."""
        if self.run_options is not None:
            self.run_options.terminate = True


class run_context:
    """``with run_context(backend, run_options) as context:`` this thread's RunContext for one run, the previous one
    back after it (a class, not a generator: it is entered on every call of a GPU session's small-call path)."""

    __slots__ = ("context", "previous")

    def __init__(self, backend, run_options=None):
        self.context = RunContext(backend, run_options)
        self.previous: Optional[RunContext] = None

    def __enter__(self) -> RunContext:
        self.previous = getattr(_local, "context", None)
        _local.context = self.context
        return self.context

    def __exit__(self, *exc_info) -> bool:
        _local.context = self.previous
        return False


def current_context() -> Optional[RunContext]:
    return getattr(_local, "context", None)


def set_default_backend(backend) -> None:
    with _default_lock:
        _default["backend"] = backend


def current_backend(context: Optional[RunContext] = None):
    """The backend a call on this thread runs on: its run context's, else the process default (made on first use
    with ``backend="auto"`` when no ``mha_ep.register`` chose one)."""
    if context is None:
        context = current_context()
    if context is not None:
        return context.backend
    backend = _default["backend"]
    if backend is None:
        from mha_ep.engine.backends import resolve_backend

        with _default_lock:
            if _default["backend"] is None:
                _default["backend"] = resolve_backend("auto", 0)
            backend = _default["backend"]
    return backend
