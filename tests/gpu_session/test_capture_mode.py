"""mha_ep/gpu_session/capture_mode.py: a thread put in CUDA's thread-local capture mode ignores another thread's
global-mode capture (ORT's, on a graph session's worker), where a thread left in the default mode may not even
allocate.

The GPU cases hold a real capture open on one thread and allocate on others, in turn, synchronised on events (the
waits' bounds only fail a hung run). The CPU case checks that a machine with no CUDA driver is told so and
nothing else changes.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from mha_ep.gpu_session import capture_mode

from conftest import cuda_unavailable_reason

BOUND_S = 120  # a failure bound on each wait, never a pace


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_driver(), reason="this machine has a CUDA driver: the GPU cases below cover it")
def test_without_a_driver_the_mode_is_unknown_and_left_alone():
    assert capture_mode.current() is None
    assert capture_mode.exchange(capture_mode.THREAD_LOCAL) is None
    assert capture_mode.ignore_other_captures() is False


def _in_thread(work):
    """``work()`` on a fresh thread (a thread's capture mode is its own); its result, or its exception raised."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed back to the test's thread
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.gpu
def test_a_thread_in_thread_local_mode_allocates_beside_another_threads_global_capture():
    reason = cuda_unavailable_reason(0)
    if reason is not None:
        pytest.skip(reason)
    import cupy

    driver = ctypes.CDLL("libcuda.so.1")
    stream = cupy.cuda.Stream(non_blocking=True)
    began, release, ended = threading.Event(), threading.Event(), threading.Event()
    status = {}

    def capture():  # as ORT's CUDA provider captures: global mode, on a non-blocking stream of its own
        cupy.cuda.runtime.setDevice(0)
        status["begin"] = driver.cuStreamBeginCapture_v2(ctypes.c_void_p(stream.ptr), capture_mode.GLOBAL)
        began.set()
        release.wait(BOUND_S)
        graph = ctypes.c_void_p()
        status["end"] = driver.cuStreamEndCapture(ctypes.c_void_p(stream.ptr), ctypes.byref(graph))
        if graph.value:
            driver.cuGraphDestroy(graph)
        ended.set()

    def allocate(thread_local: bool):
        cupy.cuda.runtime.setDevice(0)
        if thread_local:
            assert capture_mode.ignore_other_captures()
            assert capture_mode.current() == capture_mode.THREAD_LOCAL
        else:
            assert capture_mode.current() == capture_mode.GLOBAL
        try:
            return cupy.cuda.runtime.malloc(1 << 20), None
        except cupy.cuda.runtime.CUDARuntimeError as error:
            return None, str(error)

    capturer = threading.Thread(target=capture)
    capturer.start()
    try:
        assert began.wait(BOUND_S) and status["begin"] == 0, status
        local_pointer, local_error = _in_thread(lambda: allocate(True))
        default_pointer, default_error = _in_thread(lambda: allocate(False))
    finally:
        release.set()
        capturer.join(BOUND_S)
    assert ended.is_set()
    for pointer in (local_pointer, default_pointer):
        if pointer:
            cupy.cuda.runtime.free(pointer)
    assert local_error is None, f"thread-local mode still failed beside the capture: {local_error}"
    assert default_error is not None and "Capture" in default_error, (
        "a default-mode thread allocated during another thread's global capture: this test can no longer tell "
        f"the modes apart ({default_error})")


@pytest.mark.gpu
def test_a_relaxed_thread_stays_relaxed():
    reason = cuda_unavailable_reason(0)
    if reason is not None:
        pytest.skip(reason)

    def relaxed_then_ignore():
        capture_mode.exchange(capture_mode.RELAXED)
        assert capture_mode.ignore_other_captures()
        return capture_mode.current()

    assert _in_thread(relaxed_then_ignore) == capture_mode.RELAXED


@pytest.mark.parametrize("text, broke", [
    ("Error in execution: cuda_call.cc:154 CUDA failure 900: operation not permitted when stream is capturing", True),
    ("Error in execution: CUDARuntimeError: cudaErrorStreamCaptureInvalidated: operation failed due to a previous "
     "error during capture", True),
    ("Error in execution: operation would make the legacy stream depend on a capturing blocking stream", True),
    ("Error in execution: Non-zero status code returned while running Gather node. indices element out of data "
     "bounds", False),
    ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: attention_mask", False),
])  # fmt: skip
def test_a_run_that_a_broken_capture_failed_is_told_apart(text, broke):
    """cuda_io answers such a call by an eager run (recovery.py); every other failure keeps ORT's own exception."""
    from mha_ep.gpu_session.recovery import capture_broke

    assert capture_broke(RuntimeError(text)) is broke
