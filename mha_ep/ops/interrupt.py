"""Ctrl-C while a claimed node runs: deferred to the end of the run, never an abort.

A ``KeyboardInterrupt`` raised inside a Python op escapes the bridge's ``noexcept`` entry point and aborts the
process (exit 134), and Python raises it wherever the main thread happens to be, also at the first line of the
result hook, before any ``try``. So mha_ep wraps the SIGINT handler it finds (Python's default, or the caller's
own) with one that looks at the interrupted stack first:
- main thread inside an mha_ep op call (the hook's frame is on the stack): nothing is raised there. The run is
  stopped through its terminate channel when it has one (``mha_ep.InferenceSession``: the wrapper raises
  ``KeyboardInterrupt`` once ORT has returned); on a plain ORT session the node finishes, and the interrupt is
  delivered again every 50 ms until the main thread is out of the op, which raises ``KeyboardInterrupt`` in the
  caller's code after the run.
- anywhere else: the wrapped handler runs, as if mha_ep were not there.
Not guaranteed: the latency. A node finishes its work before the run stops, so a Ctrl-C inside a long kernel
waits for it. The handler can only be installed from the main thread, and a handler the caller installs later
replaces it.
"""

from __future__ import annotations

import _thread
import signal
import threading

from mha_ep.ops.context import current_context

REDELIVER_SECONDS = 0.05
_lock = threading.RLock()  # the handler may run on the main thread while it holds the lock
_op_codes: set = set()  # code objects of the functions whose frames mean "inside an mha_ep op call"
_state = {"previous": None, "pending": False, "timer": None}


def mark_op_code(function) -> None:
    """Frames of ``function`` mean "inside an mha_ep op call" (the bridge registers its hook)."""
    _op_codes.add(function.__code__)


def install() -> bool:
    """Wrap the process's SIGINT handler (from the main thread only); True when ours is in place."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is handler:
        return True
    if not callable(current):  # SIG_IGN or SIG_DFL: no KeyboardInterrupt is ever raised
        return False
    _state["previous"] = current
    signal.signal(signal.SIGINT, handler)
    return True


def inside_op(frame) -> bool:
    while frame is not None:
        if frame.f_code in _op_codes:
            return True
        frame = frame.f_back
    return False


def handler(signum, frame):
    if inside_op(frame):
        defer()
        return
    _state["pending"] = False
    previous = _state["previous"]
    if callable(previous):
        previous(signum, frame)
    else:
        raise KeyboardInterrupt


def defer() -> None:
    """An interrupt that reached an mha_ep op: stop the run through its terminate channel, or deliver it again."""
    context = current_context()
    if context is not None:
        context.interrupt()
        return
    with _lock:
        _state["pending"] = True
        if _state["timer"] is None:
            timer = threading.Timer(REDELIVER_SECONDS, _redeliver)
            timer.daemon = True
            _state["timer"] = timer
            timer.start()


def _redeliver() -> None:
    with _lock:
        _state["timer"] = None
        pending = _state["pending"]
    if pending:
        _thread.interrupt_main()  # the handler runs in the main thread: raises there, or defers again
