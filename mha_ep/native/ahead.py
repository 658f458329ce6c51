"""Plans made ahead: a growing cache's next call signatures, planned off ORT's thread.

A plain decode loop (no static cache) feeds every self-attention node a past one row longer each step, so each step
is a new call signature and the library's plan cache misses once a step: ORT's thread then waits for the Python
planner (gpu.plan_call; its time: docs/BENCH.md section 4) before the step's first self-attention node can launch.
Stock ORT has no such cost. A process's first generation pays it at every step, and so does any length it has not
planned before (or planned before the cache's eviction); `mha-ep bench generate --cold` measures it.

After a miss whose signature has a past that grows (``successors``), gpu.plan_ahead asks a worker thread for the
plans of the next ``settings.plans_ahead`` steps' signatures. The worker makes each with the same planner on the
same settings, and hands it to the library (``_native.add_plan``) under the key the library will look it up with
(``_native.signature_key``, the library's own key layout). A call that finds one uses it without Python; the
next miss (after ``plans_ahead`` steps, or a signature the guess did not foresee) asks again. Every plan is the
planner's own plan for its exact signature: a wrong guess costs only the worker's time, never a wrong result.

What the worker never does: touch the GPU. It resolves kernels only through the handles ORT's thread has loaded
(``remember_handle``); a plan that needs another kernel, or more shared memory than one was given, is left to
the miss that needs it (a module load in this thread could land inside another thread's CUDA graph capture). Its
errors stay in it (counted in ``stats``, never raised). ``mha_ep.native.reset_plans`` bumps a generation, so a
plan made with the settings before a reset is never added after it. The worker gives the GIL back after each plan,
so a thread waiting for it waits for at most one plan.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from mha_ep import spec
from mha_ep.engine.cuda.fused import DEFAULT_SHARED_LIMIT

SLOT = {name: i for i, name in enumerate(spec.PLUGIN_INPUTS)}
PAST_AXIS = 2  # past_key / past_value (B, N, P, H): the axis a decode step grows
KEYED_LAST_AXIS = ("key_padding_mask", "attention_bias")  # (..., T): T = P + L grows with the past


def successors(supplied, inputs: tuple, count: int) -> list:
    """The input tuples (per slot None or (element type, dims, alignment log2), as the planner receives them) of the
    ``count`` calls that follow ``inputs`` in a decode loop whose past grows by the call's key rows L each step:
    past_key / past_value one L longer on their axis 2, and a key_padding_mask or attention_bias whose last axis is
    the total length P + L one L longer there. [] when the call has no growing past: no past_key / past_value, or
    a shared buffer (past_sequence_length: the buffer's shape never changes)."""
    if count <= 0 or "past_key" not in supplied or "past_value" not in supplied or "past_sequence_length" in supplied:
        return []
    past_key, past_value = inputs[SLOT["past_key"]], inputs[SLOT["past_value"]]
    if past_key is None or past_value is None or len(past_key[1]) != 4 or len(past_value[1]) != 4:
        return []
    rows = key_rows(inputs)
    if rows is None or rows <= 0:
        return []
    total = past_key[1][PAST_AXIS] + rows
    out = []
    for step in range(1, count + 1):
        grown = list(inputs)
        for name in ("past_key", "past_value"):
            grown[SLOT[name]] = _grow(inputs[SLOT[name]], PAST_AXIS, rows * step)
        for name in KEYED_LAST_AXIS:
            entry = inputs[SLOT[name]]
            if entry is not None and entry[1] and entry[1][-1] == total:
                grown[SLOT[name]] = _grow(entry, len(entry[1]) - 1, rows * step)
        out.append(tuple(grown))
    return out


def key_rows(inputs: tuple) -> Optional[int]:
    """L, the key rows a call adds to its past: the key's axis 1 (BSD, or packed KV's (B, L, N, 2, H)), else the
    packed query's (B, L, N, 3, H). None when it cannot be read (a BNSH key is not concatenated with a past)."""
    key, query = inputs[SLOT["key"]], inputs[SLOT["query"]]
    if key is not None and len(key[1]) in (3, 5):
        return key[1][1]
    if key is None and query is not None and len(query[1]) == 5:
        return query[1][1]
    return None


def _grow(entry: tuple, axis: int, by: int) -> tuple:
    element, dims, alignment = entry
    dims = list(dims)
    dims[axis] += by
    return element, tuple(dims), alignment


# ------------------------------------------------------------------------------------------------ the worker
class NotLoaded(LookupError):
    """A plan made ahead would need a kernel ORT's thread has not loaded (with that much shared memory)."""


@dataclass(frozen=True)
class Request:
    """The successors of one missed signature to plan: with the planner's settings at the miss."""

    config_id: int
    device_id: int
    flags: int
    inputs: tuple
    make: Callable[[tuple], bytes]  # inputs -> encoded plan, resolving kernels through the handles loaded
    generation: int


class Ahead:
    """The worker and its bookkeeping; one per process (``AHEAD``). ``library`` is the loaded ``_native`` module
    (signature_key, add_plan, has_plan)."""

    def __init__(self):
        self._queue: "queue.Queue[Request]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.generation = 0
        self.counts = {"requests": 0, "planned": 0, "present": 0, "not_loaded": 0, "failed": 0, "stale": 0}
        self.last_error: Optional[str] = None

    def request(self, library, request: Request) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, args=(library,), name="mha_ep-plans-ahead",
                                                daemon=True)
                self._thread.start()
            self.counts["requests"] += 1
        self._queue.put(request)

    def reset(self, clear: Callable[[], None]) -> None:
        """A new generation: plans of earlier requests are no longer added; ``clear`` (the cache's) runs under
        the same lock as every add, so none slips in between."""
        with self._lock:
            self.generation += 1
            clear()

    def wait(self) -> None:
        """Return once every request so far has been worked through (tests, benchmarks)."""
        self._queue.join()

    def _work(self, library) -> None:
        while True:
            request = self._queue.get()
            try:
                self._plan(library, request)
            except BaseException as error:  # noqa: BLE001 - a guess's failure is never anyone's error
                self._count("failed")
                self.last_error = f"{type(error).__name__}: {error}"
            finally:
                self._queue.task_done()

    def _plan(self, library, request: Request) -> None:
        for inputs in request.inputs:
            key = library.signature_key(request.config_id, request.device_id, request.flags, inputs)
            if library.has_plan(key):
                self._count("present")
                continue
            try:
                encoded = request.make(inputs)
            except NotLoaded:
                self._count("not_loaded")
                return  # the next signatures would need it too
            with self._lock:
                if request.generation != self.generation:
                    self.counts["stale"] += 1
                    return
                library.add_plan(key, encoded)
                self.counts["planned"] += 1
            time.sleep(0)  # the GIL back to any thread waiting for it, between two plans

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts, last_error=self.last_error)


AHEAD = Ahead()


class Handles:
    """The kernels ORT's thread has loaded: (device, launch function, fused) -> (CUfunction handle, the dynamic
    shared memory it may launch with)."""

    def __init__(self, default_shared: int):
        self.default_shared = default_shared  # what a kernel may launch with before its limit is raised
        self._handles: dict = {}

    def remember(self, device_id: int, launch, handle: int) -> int:
        key = _handle_key(device_id, launch)
        known = self._handles.get(key)
        shared = max(int(launch.shared), known[1] if known else 0)
        self._handles[key] = (handle, shared)
        return handle

    def loaded(self, device_id: int, launch) -> int:
        known = self._handles.get(_handle_key(device_id, launch))
        if known is None or int(launch.shared) > max(known[1], self.default_shared):
            raise NotLoaded(launch.function)
        return known[0]


def _handle_key(device_id: int, launch) -> tuple:
    return device_id, launch.function, bool(launch.fused)


HANDLES = Handles(DEFAULT_SHARED_LIMIT)
