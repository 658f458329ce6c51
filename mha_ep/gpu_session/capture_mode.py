"""A thread's CUDA stream-capture mode: the threads that call a GPU session leave ORT's graph captures alone.

ORT's CUDA provider captures its graphs in ``cudaStreamCaptureModeGlobal``. While such a capture runs on any thread,
every thread left in the default mode (global too) is prohibited from "potentially unsafe" CUDA calls: an
allocation, a synchronous copy, a synchronize of the legacy stream. The call fails with
``cudaErrorStreamCaptureUnsupported`` and the capture is invalidated, so ORT's run fails as well. With
``enable_cuda_graph`` a session's ORT runs happen on its worker thread (GraphThreads, lanes.py) while its callers
check their calls and do their own CuPy work around them; under 6 threads of ``run_device`` half of the test runs
lost a good call that way (tests/gpu_session/test_native_session.py).

A thread in ``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`` ignores other threads' captures (the driver's
``cuThreadExchangeStreamCaptureMode``, the runtime's ``cudaThreadExchangeStreamCaptureMode``; PyTorch's graphs offer
the same as ``capture_error_mode="thread_local"``). cuda_io puts every thread that calls one of its sessions, and
each session's worker thread, in that mode on its first call (``ignore_other_captures``). Its own captures stay
guarded: a thread is still prohibited from unsafe calls during a capture it began. What the other threads then do
cannot reach the capture: ORT captures on a non-blocking stream of its own, which the legacy stream does not
synchronize with, and an allocation enqueues nothing. Threads that never call mha_ep keep their mode; ORT's own
limits hold for them: a call whose run such a thread's unsafe call still breaks is answered by an eager run
(capture_broke, recovery.py).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2  # CUstreamCaptureMode

_state = threading.local()
_lock = threading.Lock()
_driver: list = []  # [the driver's cuThreadExchangeStreamCaptureMode, or None where it has none]


def _exchange():
    with _lock:
        if not _driver:
            try:
                function = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
            except (OSError, AttributeError):  # no driver, or one older than CUDA 10.1
                function = None
            else:
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.POINTER(ctypes.c_int)]
            _driver.append(function)
        return _driver[0]


def exchange(mode: int) -> Optional[int]:
    """Set this thread's capture mode to ``mode``; its mode before, or None where the driver cannot say."""
    function = _exchange()
    if function is None:
        return None
    value = ctypes.c_int(mode)
    if function(ctypes.byref(value)) != 0:
        return None
    return value.value


def current() -> Optional[int]:
    """This thread's capture mode (GLOBAL, THREAD_LOCAL or RELAXED), or None where the driver cannot say."""
    before = exchange(GLOBAL)
    if before is not None:
        exchange(before)
    return before


def ignore_other_captures() -> bool:
    """Put this thread in THREAD_LOCAL mode (a RELAXED one stays RELAXED), once per thread: the answer is kept in a
    thread-local flag after that. False where the driver has no such call; the thread then keeps its mode."""
    done = getattr(_state, "done", None)
    if done is not None:
        return done
    before = exchange(THREAD_LOCAL)
    if before == RELAXED:  # the thread's owner chose a laxer mode: keep it
        exchange(RELAXED)
    _state.done = before is not None
    return _state.done
