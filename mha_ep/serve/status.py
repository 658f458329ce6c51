"""Which HTTP status a failed request gets, and the node it names: pure functions of the error.

  a body that is neither JSON nor .npz, or an array that cannot be read     400 (415 for another Content-Type)
  a call that does not fit the model (onnxruntime's own check: names,       400, onnxruntime's exception and text
    element types, ranks, fixed dims; mha_ep/native/ort_checks.call_error)
  a run onnxruntime fails with INVALID_ARGUMENT (a claimed node's            400, the node named
    MhaRunError carries the code too: mha_ep.errors)
  a run failing with any other status (FAIL, RUNTIME_EXCEPTION, EP_FAIL),    500, the node named
    or with an exception that is not onnxruntime's
"""

from __future__ import annotations

import re
from typing import Optional

from mha_ep.errors import ORT_INVALID_ARGUMENT, MhaRunError, status_code_of

BAD_REQUEST, UNSUPPORTED_MEDIA_TYPE, SERVER_ERROR = 400, 415, 500
# How onnxruntime names the node a run failed in: "... while running EmbedLayerNormalization node. Name:'x' ..."
ORT_NODE = re.compile(r"while running \S+ node\. Name:'(.*?)'")


class RequestError(ValueError):
    """A request body mha_ep cannot read as feeds; ``status`` is its HTTP status (400, or 415 for a Content-Type
    that is neither JSON nor .npz)."""

    def __init__(self, message: str, status: int = BAD_REQUEST):
        super().__init__(message)
        self.status = status


def run_status(error: BaseException) -> int:
    """The HTTP status of a run that raised ``error``: 400 for onnxruntime's INVALID_ARGUMENT (the caller's input
    broke a rule of a node), 500 for every other status and for anything that is not onnxruntime's."""
    code = error.code if isinstance(error, MhaRunError) else status_code_of(error)
    return BAD_REQUEST if code == ORT_INVALID_ARGUMENT else SERVER_ERROR


def failing_node(error: BaseException) -> Optional[str]:
    """The node a run failed in: a claimed node's MhaRunError carries it, onnxruntime names it in its text."""
    if isinstance(error, MhaRunError):
        return error.node_name
    found = ORT_NODE.search(str(error))
    return found.group(1) if found else None


def error_type(error: BaseException) -> str:
    """The class a Python caller would catch: onnxruntime's (InvalidArgument, Fail, ...) for a claimed node's
    MhaRunError too, else the exception's own class name."""
    if isinstance(error, MhaRunError):
        bases = [cls.__name__ for cls in type(error).__mro__ if cls.__module__.startswith("onnxruntime")]
        return bases[0] if bases else "MhaRunError"
    return type(error).__name__


def error_body(error: BaseException, status: int) -> dict:
    """The JSON body of a failed request: the class, the status, onnxruntime's (or mha_ep's) message, the node."""
    return {"error": {"type": error_type(error), "status": status, "message": str(error),
                      "node": failing_node(error)}}  # fmt: skip
