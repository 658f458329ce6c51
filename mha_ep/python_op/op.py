"""The op body: one call of a claimed node, which never raises.

An exception escaping a Python op aborts the whole process (docs/FACTS.md §1, measured), so every failure becomes a
record on the run's error channel (mha_ep/engine/context.py) plus outputs of the right shape: NaN on a plain ORT
session, where that record is a log line.
"""

from __future__ import annotations

import logging
import traceback

import numpy as np

from mha_ep import spec
from mha_ep.errors import MhaEpError, refusal_code
from mha_ep.engine import interrupt
from mha_ep.engine.context import current_backend, current_context
from mha_ep.engine.problem import build_problem, output_shapes

log = logging.getLogger("mha_ep")
EMPTY = np.zeros((0,), np.float32)


def execute(arrays: list, attributes: dict) -> tuple:
    """One call of a claimed node. Returns (output, present_key, present_value, qk) and never raises."""
    node_name = str(attributes.get(spec.ATTR_NODE, ""))
    context = current_context()
    try:
        supplied, outputs, ort_attributes, dtype = spec.node_config(tuple(sorted(attributes.items())))
        by_slot = [array if name in supplied else None for name, array in zip(spec.PLUGIN_INPUTS, arrays)]
        backend = current_backend(context)
        problem = build_problem(ort_attributes, by_slot, dtype, outputs)
        result = backend.run(problem, borrow_outputs=True)  # the bridge copies the arrays before this thread's next call
        return (
            result.output_BSDv,
            result.present_key_BNTH if result.present_key_BNTH is not None else EMPTY,
            result.present_value_BNTHv if result.present_value_BNTHv is not None else EMPTY,
            result.qk_BNST if result.qk_BNST is not None else EMPTY,
        )
    except BaseException as error:  # noqa: BLE001 - nothing may leave a Python op (it aborts the process)
        return fail(node_name, error, arrays, attributes, context)


# Failure outputs larger than this are not made: the run is stopped instead (a NaN-poisoned output of a crafted
# shape could take all of the host's memory).
POISON_LIMIT_BYTES = 1 << 30
NO_OUTPUTS = (EMPTY,) * len(spec.PLUGIN_OUTPUTS)


def fail(node_name, error, arrays, attributes, context) -> tuple:
    """A failed call's outputs, after recording why; never raises.

    The error goes to the run's channel (``context``): ORT stops before the next node and the session wrapper
    raises it. Without one (a plain ORT session) it is logged and the outputs are NaN; when even those cannot be
    made (a crafted shape too large, a negative dimension), they are zero-size and the log says so.
    A KeyboardInterrupt is not an error of the node: it stops the run and comes back as KeyboardInterrupt
    (mha_ep/engine/interrupt.py).
    """
    try:
        outputs = poisoned_outputs(attributes, arrays)
        if isinstance(error, KeyboardInterrupt):
            interrupt.defer()
            if context is None:
                log.warning(
                    "mha_ep: node %r was interrupted (Ctrl-C); its outputs are %s; KeyboardInterrupt follows "
                    "once the run returns", node_name, "NaN" if outputs is not None else "empty",
                )  # fmt: skip
            return outputs or NO_OUTPUTS
        message = describe(error)
        if outputs is None:
            message += "\n(the node's outputs could not be made, so they are empty)"
        if context is not None:
            context.record(node_name, message, refusal_code(error))
        else:
            log.error(
                "mha_ep: node %r failed; its outputs are %s: %s",
                node_name, "NaN" if outputs is not None else "empty", message,
            )  # fmt: skip
        return outputs or NO_OUTPUTS
    except BaseException:  # noqa: BLE001 - nothing may leave a Python op
        try:
            if context is not None:
                context.record(node_name, "mha_ep MultiHeadAttention: the node failed and its error could not be read")
        except BaseException:  # noqa: BLE001
            pass
        return NO_OUTPUTS


def describe(error: BaseException) -> str:
    if isinstance(error, MhaEpError):
        return str(error)
    # a bug or a backend failure: keep the traceback, it is what a maintainer needs
    return f"{type(error).__name__}: {error}\n{traceback.format_exc()}"


def poisoned_outputs(attributes, arrays):
    """NaN outputs of the shapes ORT expects, or None when they cannot be made."""
    try:
        try:
            want_qk = spec.node_config(tuple(sorted(attributes.items())))[1][spec.OUT_SLOT["qk"]]
        except Exception:  # noqa: BLE001 - unreadable attributes: no qk shape to poison
            want_qk = False
        shapes = output_shapes(attributes, arrays, want_qk)
        total = 0
        for shape in shapes:
            if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
                return None
            total += 4 * int(np.prod(shape, dtype=object)) if shape else 0
        if total > POISON_LIMIT_BYTES:
            return None
        return tuple(np.full(shape, np.nan, np.float32) if shape else EMPTY for shape in shapes)
    except BaseException:  # noqa: BLE001 - MemoryError, or a crafted input that breaks the shape arithmetic
        return None


def on_bridge_error(error, feed, attributes) -> tuple:
    """The bridge's fallback (mha_ep/python_op/bridge.py) when a failure happened outside ``execute``: in the attribute
    cast, or while handing the results back."""
    try:
        attributes = dict(attributes)
    except BaseException:  # noqa: BLE001
        attributes = {}
    try:
        node_name = str(attributes.get(spec.ATTR_NODE, ""))
    except BaseException:  # noqa: BLE001
        node_name = ""
    return fail(node_name, error, list(feed), attributes, current_context())


def op_body(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value, past_sequence_length,
            cache_indirection, **attributes):  # fmt: skip
    return execute([query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value,
                    past_sequence_length, cache_indirection], attributes)  # fmt: skip
