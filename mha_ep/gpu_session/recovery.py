"""A GPU session's failed calls: what each raises, and the one failure answered instead (a broken graph capture).

Every thread that calls a session, and its worker, ignores other threads' captures (ignore_other_captures,
capture_mode.py): ORT captures in global mode, where any other thread's allocation or synchronous copy (the
callers' checks, their own CuPy work) fails and breaks the capture. A call whose run still fails that way
(``capture_broke``: a thread that never called mha_ep made the unsafe call) is answered by an eager run
(``Recovery.capture_retries`` counts them). Any other failure raises what ORT's ``run`` raises for it.
"""

from __future__ import annotations

import threading
from typing import List, Mapping

import numpy as np

from mha_ep.native.ort_checks import execution_error, out_of_memory

# what failed to allocate when a call's own memory does not fit (ORT's run had its own: ort_checks.out_of_memory)
OWN_MEMORY = "the call's feeds or outputs in mha_ep's own device or page-locked memory"


def capture_broke(error: BaseException) -> bool:
    """Whether ORT's run failed because a CUDA stream capture was broken or refused a call (cudaErrorStreamCapture*:
    "operation not permitted when stream is capturing", "operation would make the legacy stream depend on a
    capturing blocking stream", an invalidated capture)."""
    text = str(error)
    return "StreamCapture" in text or "stream is capturing" in text or "capturing blocking stream" in text


def allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is a failed device allocation: CuPy's OutOfMemoryError (a MemoryError), or ORT's arena or
    CUDA allocator refusing one ("Failed to allocate memory for requested buffer of size ...", "CUDA failure 2: out
    of memory")."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("Failed to allocate memory" in text or "out of memory" in text)


class Recovery:
    """A failed call's answer (module docstring). ``ort``: ort_calls.OrtCalls; ``threads``: lanes.GraphThreads,
    where an eager rerun runs as every call of the session does."""

    def __init__(self, ort, graphs: bool, threads):
        self.ort = ort
        self.graphs = graphs
        self.threads = threads
        self.capture_retries = 0  # calls answered by an eager run after a graph capture broke
        self._lock = threading.Lock()  # callers' threads count here

    def rerun_or_raise(self, error: Exception, feeds: Mapping, wanted: List[str], make_options) -> list:
        """Raise what ORT's ``run`` raises for this failed call (ort_checks.execution_error: a stock node's
        failure through IOBinding has lost its type; ort_checks.out_of_memory: an allocation of the call's own
        failed), else ``error`` itself. A run that failed because a CUDA graph capture broke (capture_broke: a
        thread outside mha_ep made an unsafe CUDA call meanwhile, or the capture itself could not allocate) is run
        once more, eagerly, and its outputs (NumPy) are the call's answer; counted in ``capture_retries``."""
        import cupy

        session = self.ort.session

        def rerun():
            host = {}
            for name, value in feeds.items():
                on_device = isinstance(value, cupy.ndarray) or (not isinstance(value, np.ndarray)
                                                                and hasattr(value, "__dlpack__"))  # fmt: skip
                array = value if isinstance(value, cupy.ndarray) else cupy.from_dlpack(value) if on_device else value
                host[name] = cupy.asnumpy(array) if on_device else value
            options = (make_options or self.ort.options)()
            options.add_run_config_entry("gpu_graph_id", "-1")  # never a capture on the failure path
            return self.threads.run(lambda: session.run(wanted, host, options))

        if self.graphs and capture_broke(error):
            with self._lock:
                self.capture_retries += 1
            return rerun()
        failure = execution_error(error, rerun)
        if failure is not error:
            raise failure from error
        if allocation_failed(error):  # CuPy's OutOfMemoryError, CUDA's refusal of a page-locked block: ORT's type
            raise out_of_memory(error, OWN_MEMORY) from error
        raise error
