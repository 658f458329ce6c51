"""Ctrl-C while a claimed node runs: deferred to the end of the run, never an abort.

A ``KeyboardInterrupt`` raised in Python code that ORT's C++ called during a run (a Python op, mha_ep's native
callbacks, or code they reach first, such as numpy's version check at the first use of its C API from the
bridge) escapes into C++ and aborts the process (exit 134); Python raises it wherever the main thread happens to
be, also at the first line of the result hook, before any ``try``. So mha_ep wraps the SIGINT handler it finds
(Python's default, or the caller's own) with one that looks at the interrupted stack first:
- main thread in Python code called from inside an ORT run (``inside_op``: an mha_ep op's frame is on the stack,
  or ORT's own ``run`` frame is, below the frame being executed): nothing is raised there. The run is stopped
  through its terminate channel when it has one (``mha_ep.InferenceSession``: the wrapper raises
  ``KeyboardInterrupt`` once ORT has returned). On a plain ORT session the interrupt is kept pending and
  delivered again as soon as the main thread leaves the op (``leaving_op``: a helper thread re-sends it when the
  op hands the GIL back to ORT), so the run in which it arrived raises ``KeyboardInterrupt`` in the caller's code
  when it returns; a timer re-sends it every REDELIVER_SECONDS as well, for callbacks that are not mha_ep's.
- anywhere else: the wrapped handler runs, as if mha_ep were not there.
Not guaranteed: the latency within a run. A node finishes its work before the run stops, so a Ctrl-C inside a
long kernel waits for it. The handler can only be installed from the main thread, and a handler the caller
installs later replaces it.
"""

from __future__ import annotations

import _thread
import signal
import threading

from mha_ep.engine.context import current_context

REDELIVER_SECONDS = 0.05
_lock = threading.RLock()  # the handler may run on the main thread while it holds the lock
_op_codes: set = set()  # code objects of the functions whose frames mean "inside an mha_ep op call"
_state = {"previous": None, "pending": False, "timer": None, "helper": None}
_ort_run_codes: set = set()  # code objects of onnxruntime's Python run methods (mark_ort_runs)
_wake = threading.Event()  # leaving_op -> the helper thread: re-send the pending interrupt now


def mark_op_code(function) -> None:
    """Frames of ``function`` mean "inside an mha_ep op call" (the bridge registers its hook)."""
    _op_codes.add(function.__code__)


def mark_ort_runs() -> None:
    """Frames of onnxruntime's Python ``run`` methods below the executing frame mean "called from inside a run"."""
    try:
        from onnxruntime.capi import onnxruntime_inference_collection as collection
    except Exception:  # noqa: BLE001 - no onnxruntime: nothing of it can be on the stack
        return
    for cls in (collection.Session, collection.InferenceSession):
        for name in ("run", "run_with_iobinding", "run_with_ort_values", "run_with_ortvaluevector"):
            function = cls.__dict__.get(name)
            if function is not None and hasattr(function, "__code__"):
                _ort_run_codes.add(function.__code__)


def install() -> bool:
    """Wrap the process's SIGINT handler (from the main thread only); True when ours is in place."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not _ort_run_codes:
        mark_ort_runs()
    current = signal.getsignal(signal.SIGINT)
    if current is handler:
        return True
    if not callable(current):  # SIG_IGN or SIG_DFL: no KeyboardInterrupt is ever raised
        return False
    _state["previous"] = current
    signal.signal(signal.SIGINT, handler)
    return True


def inside_op(frame) -> bool:
    """Whether ``frame`` (the main thread's executing frame) runs inside an mha_ep op call, or in any Python code
    that ORT's C++ called during a run (ORT's run frame is on the stack below it)."""
    executing = frame
    while frame is not None:
        if frame.f_code in _op_codes or (frame.f_code in _ort_run_codes and frame is not executing):
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
        if _state["helper"] is None:
            helper = threading.Thread(target=_helper, name="mha_ep_interrupt", daemon=True)
            _state["helper"] = helper
            helper.start()
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


def leaving_op() -> None:
    """Called as an mha_ep op call ends (on any thread): a pending interrupt is re-sent as soon as this thread hands
    the GIL back, while the main thread is in ORT's C++ outside Python, so that it is raised when the run returns."""
    if _state["pending"] and threading.current_thread() is threading.main_thread():
        _wake.set()


def _helper() -> None:
    while True:
        _wake.wait()
        _wake.clear()
        if _state["pending"]:
            _thread.interrupt_main()  # takes the GIL: runs once the op has handed it back
