"""The op body: one call of a claimed node, which never raises.

An exception escaping a Python op aborts the whole process (DESIGN.md, measured), so every failure becomes a
record on the run's error channel (mha_ep/ops/context.py) plus outputs of the right shape: NaN on a plain ORT
session, where that record is a log line.
"""

from __future__ import annotations

import functools
import logging
import traceback

import numpy as np

from mha_ep import spec
from mha_ep.errors import MhaEpError
from mha_ep.ops.context import current_backend, current_context
from mha_ep.ops.problem import build_problem, output_shapes

log = logging.getLogger("mha_ep")
EMPTY = np.zeros((0,), np.float32)


def execute(arrays: list, attributes: dict) -> tuple:
    """One call of a claimed node. Returns (output, present_key, present_value) and never raises."""
    node_name = str(attributes.get(spec.ATTR_NODE, ""))
    context = current_context()
    try:
        supplied, outputs, ort_attributes, dtype = node_config(tuple(sorted(attributes.items())))
        by_slot = [array if name in supplied else None for name, array in zip(spec.PLUGIN_INPUTS, arrays)]
        backend = current_backend(context)
        problem = build_problem(ort_attributes, by_slot, dtype, outputs)
        result = backend.run(problem, borrow_outputs=True)  # the bridge copies the arrays before this thread's next call
        return (
            result.output_BSDv,
            result.present_key_BNTH if result.present_key_BNTH is not None else EMPTY,
            result.present_value_BNTHv if result.present_value_BNTHv is not None else EMPTY,
        )
    except BaseException as error:  # noqa: BLE001 - nothing may leave a Python op (it aborts the process)
        return fail(node_name, error, arrays, attributes, context)


@functools.lru_cache(maxsize=1024)
def node_config(attribute_items: tuple) -> tuple:
    """A claimed node's attributes -> (supplied input names, requested outputs, ORT attributes, dtype).

    The same node sends the same attributes on every call, so the parse is memoised on them.
    """
    attributes = dict(attribute_items)
    supplied = frozenset(filter(None, str(attributes[spec.ATTR_INPUTS]).split(",")))
    wanted = set(filter(None, str(attributes[spec.ATTR_OUTPUTS]).split(",")))
    outputs = tuple(name in wanted for name in spec.OUTPUTS)
    ort_attributes = {a.name: attributes[a.name] for a in spec.ORT_ATTRIBUTES if a.name in attributes}
    ort_attributes.update(spec.decode_floats(str(attributes.get(spec.ATTR_FLOATS, ""))))
    return supplied, outputs, ort_attributes, str(attributes[spec.ATTR_DTYPE])


def fail(node_name, error, arrays, attributes, context) -> tuple:
    if isinstance(error, MhaEpError):
        message = str(error)
    else:  # a bug or a backend failure: keep the traceback, it is what a maintainer needs
        message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    try:
        if context is not None:
            context.record(node_name, message)
        else:
            log.error("mha_ep: node %r failed; its outputs are NaN: %s", node_name, message)
    except BaseException:  # noqa: BLE001
        pass
    shapes = output_shapes(attributes, arrays)
    return tuple(np.full(shape, np.nan, np.float32) if shape else EMPTY for shape in shapes)


def op_body(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value, **attributes):
    return execute([query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value], attributes)
