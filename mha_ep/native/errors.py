"""How the native route's Python callbacks answer the C library when a call fails: never by raising.

A failure becomes (ORT error code, message): the library turns it into the OrtStatus that ends the run, and ORT's
own error names the node again ("... running MultiHeadAttention node. Name:'mha' Status Message: <ours>"). Through
``mha_ep.InferenceSession`` the failure is also recorded on the run's context (mha_ep/engine/context.py), so the
session raises MhaRunError with the node and the message, as on the Python-op route.
"""

from __future__ import annotations

import logging

from mha_ep.errors import MESSAGE_PREFIX, ORT_FAIL, refusal_code
from mha_ep.engine.context import current_context
from mha_ep.python_op.op import describe

log = logging.getLogger("mha_ep")


def failure(node: str, error: BaseException) -> tuple:
    """(code, message) of ``error`` raised by a call of node ``node``, recorded on the run's context if any."""
    message = describe(error)
    code = refusal_code(error)
    context = current_context()
    if context is not None:
        context.record(node, message, code)
    return code, f"mha_ep MultiHeadAttention node '{node}': {message.removeprefix(MESSAGE_PREFIX)}"


def interrupted(node: str) -> tuple:
    """A Ctrl-C that reached a call: the run stops (KeyboardInterrupt follows, mha_ep/engine/interrupt.py)."""
    context = current_context()
    if context is not None:
        context.interrupt()
    return ORT_FAIL, f"mha_ep MultiHeadAttention node '{node}': interrupted (KeyboardInterrupt)"


def answer(node: str, error: BaseException) -> tuple:
    """What a callback that caught ``error`` returns: interrupted() for a Ctrl-C, failure() otherwise; never
    raises (a failure while describing the failure still gives an answer)."""
    try:
        if isinstance(error, KeyboardInterrupt):
            return interrupted(node)
        return failure(node, error)
    except BaseException:  # noqa: BLE001
        return ORT_FAIL, f"mha_ep MultiHeadAttention node '{node}': the call failed"
