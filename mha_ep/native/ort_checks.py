"""What ``onnxruntime.InferenceSession.run`` raises for a call that does not fit the model, for the calls mha_ep
makes through IOBinding (gpu_session/cuda_io.py).

Through IOBinding ORT reports a bad feed as a RuntimeError ("Error in execution: Invalid rank for input ..."), and
under a replayed CUDA graph it checks nothing. A server written against ``run`` catches ORT's own types
(``InvalidArgument``) and ValueError, so the GPU path checks the call first and raises what ``run`` would, in
``run``'s order: onnxruntime's Python layer (ValueError for missing inputs), then its C++ checks per feed (the
name, the element type, the rank, the fixed dimensions), then the output names. With several bad feeds ORT names
the first in a hash map's order of its own; this names the first in feed order, with the text ORT gives for it. The texts are ORT
1.31.1's; tests/native/test_ort_checks.py holds them to ORT's own ``run`` on the CPU.

A feed with no ``dtype`` and ``shape`` (a list: ORT converts it to the input's type) is left to the copy that
converts it.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

EXECUTION_ERROR = "Error in execution: "  # how ORT's IOBinding run reports a failed run, the status code dropped
INVALID_ARGUMENT = "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : "  # how ORT's Python binding prefixes status code 2
RUNTIME_EXCEPTION = "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : "  # ... and status code 6 (a failed allocation)
ORT_ELEMENT_NAMES = {"float32": "float", "float64": "double"}  # NumPy names that ORT spells differently


def ort_exception(name: str, text: str) -> Exception:
    """An instance of onnxruntime's exception class ``name`` (InvalidArgument, Fail, ...) carrying ``text``."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return getattr(state, name)(text)


def invalid_argument(text: str) -> Exception:
    """ORT's InvalidArgument with the binding's prefix, as ``run`` raises it."""
    return ort_exception("InvalidArgument", INVALID_ARGUMENT + text)


@functools.lru_cache(maxsize=None)
def _out_of_memory_class() -> type:
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    name = "OutOfMemory[RuntimeException]"
    # made at run time, so pickled (a Ray Serve replica's answer) through a function of this module
    reduce = lambda self: (_out_of_memory_with, self.args)  # noqa: E731
    return type(name, (RuntimeException, MemoryError), {"__module__": __name__, "__qualname__": name,
                                                        "__reduce__": reduce})  # fmt: skip


def _out_of_memory_with(*args) -> Exception:
    return _out_of_memory_class()(*args)


def out_of_memory(error: BaseException, what: str) -> Exception:
    """What ``run`` raises where an allocation of mha_ep's own for the call failed (``error``: CuPy's
    OutOfMemoryError, or a CUDA error of a page-locked allocation; ``what``: the memory, said): stock ORT's run
    raises its RuntimeException for one of its own ("Failed to allocate memory for requested buffer of size ...").
    The exception is onnxruntime's RuntimeException and a MemoryError, so ``except RuntimeException`` catches it
    as it catches ORT's own, and ``except MemoryError`` as before; its text says what could not be allocated and
    keeps the allocator's own words."""
    first = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    return _out_of_memory_class()(f"{RUNTIME_EXCEPTION}mha_ep: Failed to allocate memory for {what}: {first}")


def tensor_type(dtype) -> str:
    """ORT's type string of a tensor of NumPy ``dtype``: float32 -> "tensor(float)"."""
    name = np.dtype(dtype).name
    return f"tensor({ORT_ELEMENT_NAMES.get(name, name)})"


def dtype_error(name: str, actual, expected_type: str) -> Optional[Exception]:
    """ORT's error for feed ``name`` of element type ``actual`` where the model wants ``expected_type``
    ("tensor(int64)"), or None when they agree."""
    got = tensor_type(actual)
    if got == expected_type:
        return None
    return invalid_argument(f"Unexpected input data type. Actual: ({got}) , expected: ({expected_type})")


def shape_error(name: str, shape: Sequence[int], expected: Optional[Sequence]) -> Optional[Exception]:
    """ORT's error for feed ``name`` of ``shape`` where the model declares ``expected`` (ints fixed, strings or
    None symbolic), or None when it fits. ``expected`` None or empty: no shape declared, as far as ORT's NodeArg
    tells (it gives [] both for an input without a shape and for a rank-0 one, and ORT's run accepts any rank for
    the first); a rank-0 input fed a higher rank is then left to ORT's own check in the run."""
    if not expected:
        return None
    if len(shape) != len(expected):
        return invalid_argument(f"Invalid rank for input: {name} Got: {len(shape)} Expected: {len(expected)} "
                                f"Please fix either the inputs/outputs or the model.")  # fmt: skip
    wrong = [(i, got, want) for i, (got, want) in enumerate(zip(shape, expected))
             if isinstance(want, int) and want >= 0 and got != want]  # fmt: skip
    if not wrong:
        return None
    lines = "".join(f" index: {i} Got: {got} Expected: {want}\n" for i, got, want in wrong)
    return invalid_argument(f"Got invalid dimensions for input: {name} for the following indices\n{lines} "
                            f"Please fix either the inputs/outputs or the model.")  # fmt: skip


def call_error(inputs: Sequence, output_names_of_model: Sequence[str], feeds: Mapping,
               output_names: Optional[Sequence[str]]) -> Optional[Exception]:  # fmt: skip
    """The exception ``run(output_names, feeds)`` raises on a session whose inputs are ``inputs`` (ORT's NodeArgs:
    name, type, shape) and whose outputs are named ``output_names_of_model``; None when ORT would run the call."""
    names = list(feeds)
    missing = [arg.name for arg in inputs if arg.name not in feeds and not arg.type.startswith("optional")]
    if missing:
        return ValueError(f"Required inputs ({missing}) are missing from input feed ({names}).")
    declared = {arg.name: arg for arg in inputs}
    for name in names:
        arg = declared.get(name)
        if arg is None:
            return invalid_argument(f"Invalid input name: {name}")
        value = feeds[name]
        if not arg.type.startswith("tensor(") or not (hasattr(value, "dtype") and hasattr(value, "shape")):
            continue
        try:
            dtype = np.dtype(value.dtype)
        except TypeError:  # a DLPack tensor of another library: its element type is checked once it is CuPy's
            dtype = None
        error = (dtype_error(name, dtype, arg.type) if dtype is not None else None) or \
            shape_error(name, tuple(value.shape), arg.shape)  # fmt: skip
        if error is not None:
            return error
    for name in output_names or ():
        if name not in output_names_of_model:
            return invalid_argument(f"Invalid output name:{name}")
    return None


def wanted_outputs(output_names_of_model: Sequence[str], output_names: Optional[Sequence[str]]) -> list:
    """The outputs a call asks for: all of the model's when ``output_names`` is None or empty, as ``run``."""
    return list(output_names_of_model) if not output_names else list(output_names)


def call_key(feeds: Mapping, output_names, device_array: type) -> Optional[tuple]:
    """A call's key: the output names asked for, and each feed's name, shape, dtype and kind (NumPy, or
    ``device_array``: CuPy's ndarray) in feed order: all that call_error reads. None where a feed is of another
    kind (a list, a DLPack tensor of another library) or the names are not a sequence: such calls are checked
    every time."""
    items = []
    for name, value in feeds.items():
        kind = type(value)
        if kind is not np.ndarray and kind is not device_array:
            return None
        items.append((name, value.shape, value.dtype, kind is np.ndarray))
    try:
        names = tuple(output_names) if output_names else None
    except TypeError:
        return None
    return names, tuple(items)


class CheckVerdicts:
    """call_error's verdict per call key, so a repeated call is checked by one dictionary lookup (CallChecks in
    gpu_session/checks.py).

    A call key (call_key: the output names, and each feed's name, shape, dtype and kind in feed order) holds
    everything call_error reads, so its verdict is the key's: the outputs a passing call wants, or the
    refusal of a call that does not fit. A refused call raises a new exception of the first one's type and
    arguments each time, as ORT's ``run`` raises anew. A server's bad calls repeat (a client with the wrong dtype
    sends it again), and stock ORT checks them in C++ with the GIL released; checked in Python each time they held
    the GIL several times longer than a remembered verdict does (docs/BENCH.md, "Host-side choices"). Past
    ``limit`` keys all are forgotten at once.
    Calls without a key (feeds other than NumPy or CuPy arrays) are checked every time."""

    def __init__(self, inputs: Sequence, output_names_of_model: Sequence[str], limit: int):
        self.inputs = list(inputs)
        self.outputs = list(output_names_of_model)
        self.limit = limit
        self._verdicts: dict = {}  # call key -> list of wanted outputs, or (exception type, its args)

    def wanted(self, key: Optional[tuple], feeds: Mapping, output_names: Optional[Sequence[str]]) -> list:
        """The outputs the call asks for; raises what ``run`` raises for a call that does not fit the model."""
        verdict = self._verdicts.get(key) if key is not None else None
        if verdict is None:
            error = call_error(self.inputs, self.outputs, feeds, output_names)
            verdict = wanted_outputs(self.outputs, output_names) if error is None else (type(error), error.args)
            if key is not None:
                if len(self._verdicts) >= self.limit:
                    self._verdicts.clear()
                self._verdicts[key] = verdict
        if type(verdict) is tuple:
            kind, args = verdict
            raise kind(*args)
        return verdict

    def __len__(self) -> int:
        return len(self._verdicts)


def execution_error(error: BaseException, rerun: Callable[[], object]) -> BaseException:
    """What ``run`` raises for a call whose IOBinding run failed with ``error``.

    ORT's ``run_with_iobinding`` (the Python wrapper and the C binding alike) turns a failed status into
    RuntimeError("Error in execution: <message>"), so a stock node's failure (a Gather's index out of range, a
    Reshape that cannot be made) loses the type ``run`` would give it. ``rerun`` runs the same call through ORT's
    ``run`` (failure path only: the call is done once more); its exception is returned. ``error`` itself comes back
    when it is no such report (a claimed node's MhaRunError, anything else) or the second run does not fail."""
    if type(error) is not RuntimeError or not str(error).startswith(EXECUTION_ERROR):
        return error
    try:
        rerun()
    except Exception as ort_error:  # noqa: BLE001 - whatever run raises is the answer
        return ort_error
    return error
