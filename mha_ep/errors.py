"""Errors raised by mha_ep. Every message names the input, its shape and what was expected."""

import functools
import importlib.util

MESSAGE_PREFIX = "mha_ep MultiHeadAttention: "  # every refusal and input error starts with it


class MhaEpError(RuntimeError):
    """Base class of every error mha_ep raises on purpose."""


class MhaInputError(MhaEpError, ValueError):
    """An input of a MultiHeadAttention call breaks a rule (shape, rank, dtype, consistency). ``code``: the ORT
    status code stock ORT fails the same call with (mha_ep/claim/rules.py Refusal; INVALID_ARGUMENT mostly)."""

    def __init__(self, *args, code: int = 2):
        super().__init__(*args)
        self.code = code


class BackendUnavailableError(MhaEpError):
    """The requested backend cannot run here (no CuPy, no GPU, wrong device)."""


class MhaRunError(MhaEpError):
    """A claimed node failed inside the plugin op during a run; carries the node's message.

    Raised as ``run_error``'s subclass that is also onnxruntime's exception for the node's status code, the type
    stock ORT raises for the same failure (InvalidArgument for an input the node refuses, Fail otherwise), so a
    server's ``except InvalidArgument`` catches it on every route."""

    def __init__(self, node_name: str, message: str, code: int = 1):
        self.node_name = node_name
        self.message = message
        self.code = code  # ORT's status code: 1 FAIL, 2 INVALID_ARGUMENT (ORT_STATUS_CLASSES)
        detail = message.removeprefix(MESSAGE_PREFIX)
        super().__init__(f"mha_ep MultiHeadAttention node {node_name!r}: {detail}")

    def __reduce__(self):  # the onnxruntime-typed subclasses are made at run time: rebuild through run_error
        return run_error, (self.node_name, self.message, self.code)


# ORT status codes -> onnxruntime's exception classes (onnxruntime.capi.onnxruntime_pybind11_state)
ORT_STATUS_CLASSES = {1: "Fail", 2: "InvalidArgument", 6: "RuntimeException", 11: "EPFail"}
ORT_FAIL, ORT_INVALID_ARGUMENT = 1, 2


def run_error(node_name: str, message: str, code: int = ORT_FAIL) -> MhaRunError:
    """MhaRunError for node ``node_name``, also an instance of onnxruntime's class for status ``code``."""
    return _run_error_class(code)(node_name, message, code)


def refusal_code(error: BaseException) -> int:
    """The ORT status code stock ORT's kernel gives the failure ``error`` stands for: an input the node refuses
    carries it (MhaInputError.code), a model it refuses is INVALID_ARGUMENT, anything else FAIL."""
    if isinstance(error, MhaInputError):
        return error.code
    return ORT_INVALID_ARGUMENT if isinstance(error, MhaModelError) else ORT_FAIL


def status_code_of(error: BaseException) -> int:
    """The ORT status code of onnxruntime exception ``error`` (by its class), FAIL for anything else."""
    name = type(error).__name__
    return next((code for code, cls in ORT_STATUS_CLASSES.items() if cls == name), ORT_FAIL)


@functools.lru_cache(maxsize=None)
def _run_error_class(code: int) -> type:
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state

        base = getattr(state, ORT_STATUS_CLASSES.get(code, "Fail"))
    except (ImportError, AttributeError):  # no onnxruntime: the plain class
        return MhaRunError
    name = f"MhaRunError[{base.__name__}]"
    return type(name, (MhaRunError, base), {"__module__": __name__, "__qualname__": name})


class MhaModelError(MhaEpError, ValueError):
    """A model mha_ep refuses to load or write: a crafted ``mha_ep`` node, an unsafe output path."""


# onnxruntime comes with an extra (one ORT flavour each); whatever needs it without it says so in one ImportError
MISSING_ONNXRUNTIME = (
    "onnxruntime is not installed; install mha_ep with one ORT flavour: "
    "pip install 'mha-ep[cpu]' (CPU), 'mha-ep[gpu]' (CUDA 13 GPU) or 'mha-ep[gpu-cuda12]'"
)


def onnxruntime_missing() -> bool:
    try:
        return importlib.util.find_spec("onnxruntime") is None
    except (ImportError, ValueError):
        return True


def require_onnxruntime() -> None:
    """Raise ImportError naming the extra to install when onnxruntime cannot be imported."""
    if onnxruntime_missing():
        raise ImportError(MISSING_ONNXRUNTIME)
