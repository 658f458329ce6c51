"""Affine evaluation: the integer shape arithmetic of a graph evaluated at build time as ``const + P * coeff``.

P is one number only the run knows (the static-cache rewrite's past length: mha_ep/graph/static_cache.py, rule
AFFINE_EVALUATION). An integer tensor whose every element is a constant plus P times a constant (``Affine``) is
known at build time up to P: a Shape of a tensor whose one dim is P, the Gather, Slice, Concat, Add, Mul, Range, ...
that ORT's exporters build on it. ``EVALUATORS`` holds one function per op, ``(args, attrs) -> Affine or None``;
``fold`` runs any other default-domain node whose inputs are all integer constants through onnx's reference
evaluator. An element set by a dim that stays symbolic is marked unknown, and a value is ``None`` where the op is
not affine in P (P * P) or its result would be data rather than shape arithmetic (more than ``MAX_ELEMENTS``).

Only ``onnx`` and ``numpy`` are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

MAX_ELEMENTS = 1 << 16  # shape arithmetic is small; a larger integer tensor is data and stays a node
DEFAULT_DOMAINS = ("", "ai.onnx")
INTEGER_TYPES = {onnx.TensorProto.BOOL, onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
                 onnx.TensorProto.INT64, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32,
                 onnx.TensorProto.UINT64}  # fmt: skip


def is_integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer) or dtype == np.bool_


@dataclass(frozen=True)
class Affine:
    """An integer tensor known at build time as ``const + P * coeff``. The three arrays have the tensor's shape:
    ``const`` in its dtype, ``coeff`` int64, ``unknown`` bool: the elements set only at run time, by a dim that stays
    symbolic. An element depends on P exactly where its ``coeff`` is not 0."""

    const: np.ndarray
    coeff: np.ndarray
    unknown: np.ndarray

    @classmethod
    def of(cls, const, coeff=None, unknown=None) -> "Affine":
        """``const`` (any shape) with a zero ``coeff`` and nothing unknown unless given (both of const's shape)."""
        const = np.asarray(const)
        return cls(
            const,
            np.zeros(const.shape, np.int64) if coeff is None else np.asarray(coeff, np.int64),
            np.zeros(const.shape, bool) if unknown is None else np.asarray(unknown, bool),
        )

    @property
    def known(self) -> bool:
        return not self.unknown.any()

    @property
    def on_p(self) -> bool:
        return bool(self.coeff.any())

    @property
    def constant(self) -> bool:
        return self.known and not self.on_p

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "Affine":
        """The same element movement (gather, slice, reshape, ...) applied to all three arrays."""
        return Affine.of(fn(self.const), fn(self.coeff), fn(self.unknown))

    def describe(self) -> str:
        """``const + P * coeff`` as text, the elements only the run knows as ``?`` in ``const``."""
        const = np.where(self.unknown, "?", self.const.astype(str))
        text = np.array2string(const, separator=", ").replace("'", "")
        return f"{text} + P * {np.array2string(self.coeff, separator=', ')}" if self.on_p else text


def _join(fn: Callable[[List[np.ndarray]], np.ndarray], values: Sequence[Affine]) -> Affine:
    """``fn`` applied to the const, coeff and unknown arrays of several values (Concat)."""
    return Affine.of(fn([v.const for v in values]), fn([v.coeff for v in values]), fn([v.unknown for v in values]))


def _ints(value: Optional[Affine]) -> Optional[np.ndarray]:
    """The int64 numbers of a constant value; None for an absent or non-constant one."""
    return value.const.astype(np.int64) if value is not None and value.constant else None


def _given(args: Sequence[Optional[Affine]], slot: int) -> Optional[Affine]:
    return args[slot] if len(args) > slot else None


def bounded(shape) -> bool:
    return int(np.prod(shape, dtype=np.int64)) <= MAX_ELEMENTS


# EVALUATORS: one function per op, ``(args, attrs) -> Affine or None``; ``args`` holds an Affine per input (None for
# an absent optional one), None means "not evaluable at build time" and leaves the node to run.
def _eval_constant(args, attrs) -> Optional[Affine]:
    if "value" in attrs:
        value = numpy_helper.to_array(attrs["value"])
    elif "value_int" in attrs or "value_ints" in attrs:
        value = np.array(attrs.get("value_int", attrs.get("value_ints")), np.int64)
    else:
        return None
    return Affine.of(value) if is_integer(value.dtype) else None


def _eval_gather(args, attrs) -> Optional[Affine]:
    indices = _ints(args[1])
    if indices is None:
        return None
    return args[0].map(lambda a: np.take(a, indices, axis=attrs.get("axis", 0)))


def _eval_slice(args, attrs) -> Optional[Affine]:
    if len(args) > 1:  # opset >= 10: inputs
        if any(a is not None and not a.constant for a in args[1:]):
            return None
        starts, ends = _ints(args[1]), _ints(args[2])
        axes = _ints(_given(args, 3))
        steps = _ints(_given(args, 4))
    else:
        starts, ends, axes, steps = attrs["starts"], attrs["ends"], attrs.get("axes"), None
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * args[0].const.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[int(axis)] = slice(int(start), int(end), int(step))  # Python's clamping is ONNX's
    return args[0].map(lambda a: a[tuple(index)])


def _axes_of(args, attrs) -> Tuple[bool, Optional[Tuple[int, ...]]]:
    """(evaluable, axes) of Squeeze/Unsqueeze: input 1 (opset >= 13) or the attribute; None: not given."""
    if _given(args, 1) is not None:
        axes = _ints(args[1])
        return axes is not None, None if axes is None else tuple(int(a) for a in axes)
    return True, tuple(attrs["axes"]) if "axes" in attrs else None


def _eval_squeeze(args, attrs) -> Optional[Affine]:
    evaluable, axes = _axes_of(args, attrs)
    return args[0].map(lambda a: np.squeeze(a, axis=axes)) if evaluable else None


def _eval_unsqueeze(args, attrs) -> Optional[Affine]:
    evaluable, axes = _axes_of(args, attrs)
    return args[0].map(lambda a: np.expand_dims(a, axes)) if evaluable and axes is not None else None


def _eval_concat(args, attrs) -> Optional[Affine]:
    return _join(lambda arrays: np.concatenate(arrays, axis=attrs["axis"]), args)


def _eval_reshape(args, attrs) -> Optional[Affine]:
    shape = _ints(args[1])
    if shape is None:
        return None
    source = args[0].const.shape
    target = [source[i] if d == 0 and not attrs.get("allowzero", 0) else int(d) for i, d in enumerate(shape)]
    return args[0].map(lambda a: a.reshape(target))


def _eval_cast(args, attrs) -> Optional[Affine]:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(attrs["to"]))
    value = args[0]
    if not is_integer(dtype) or (value.on_p and dtype not in (np.int32, np.int64)):
        return None
    return Affine.of(value.const.astype(dtype), value.coeff, value.unknown)


def _eval_add(args, attrs) -> Optional[Affine]:
    a, b = args
    return Affine.of(a.const + b.const, a.coeff + b.coeff, a.unknown | b.unknown)


def _eval_sub(args, attrs) -> Optional[Affine]:
    a, b = args
    return Affine.of(a.const - b.const, a.coeff - b.coeff, a.unknown | b.unknown)


def _eval_mul(args, attrs) -> Optional[Affine]:
    a, b = args
    if not (a.constant or b.constant):  # P * P, or P * a dim known only at run time, is not affine
        return None
    return Affine.of(a.const * b.const, a.coeff * b.const + b.coeff * a.const, a.unknown | b.unknown)


def _eval_range(args, attrs) -> Optional[Affine]:
    start, limit, delta = args
    if not (start.known and limit.known and delta.constant) or start.coeff.item() != limit.coeff.item():
        return None
    step = delta.const.item()
    if step == 0:
        return None
    count = max(math.ceil((limit.const.item() - start.const.item()) / step), 0)
    if count > MAX_ELEMENTS:
        return None
    values = (start.const + np.arange(count) * step).astype(start.const.dtype)
    return Affine.of(values, np.full(count, start.coeff.item()))


def _eval_tile(args, attrs) -> Optional[Affine]:
    repeats = _ints(args[1])
    if repeats is None or not bounded(np.multiply(args[0].const.shape, repeats)):
        return None
    return args[0].map(lambda a: np.tile(a, repeats))


def _eval_expand(args, attrs) -> Optional[Affine]:
    shape = _ints(args[1])
    if shape is None:
        return None
    target = np.broadcast_shapes(args[0].const.shape, tuple(int(d) for d in shape))
    return args[0].map(lambda a: np.broadcast_to(a, target).copy()) if bounded(target) else None


def _eval_identity(args, attrs) -> Optional[Affine]:
    return args[0]


def _eval_constant_of_shape(args, attrs) -> Optional[Affine]:
    shape = _ints(args[0])
    if shape is None or not bounded(shape):
        return None
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return Affine.of(np.full(tuple(int(d) for d in shape), value.reshape(-1)[0], value.dtype))


EVALUATORS: Dict[str, Callable[[list, dict], Optional[Affine]]] = {
    "Constant": _eval_constant,
    "Gather": _eval_gather,
    "Slice": _eval_slice,
    "Squeeze": _eval_squeeze,
    "Unsqueeze": _eval_unsqueeze,
    "Concat": _eval_concat,
    "Reshape": _eval_reshape,
    "Cast": _eval_cast,
    "Add": _eval_add,
    "Sub": _eval_sub,
    "Mul": _eval_mul,
    "Range": _eval_range,
    "Tile": _eval_tile,
    "Expand": _eval_expand,
    "Identity": _eval_identity,
    "ConstantOfShape": _eval_constant_of_shape,
}


def fold(node: onnx.NodeProto, args: Sequence[Optional[Affine]], opsets) -> Optional[List[Affine]]:
    """The fallback of ``EVALUATORS``: a default-domain node whose inputs are all integer constants, run by onnx's
    reference evaluator; None when it is not such a node, fails there, or makes anything but small integer tensors."""
    present = [(name, a) for name, a in zip(node.input, args) if name]
    control_flow = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if node.domain not in DEFAULT_DOMAINS or not present or any(a.type in control_flow for a in node.attribute):
        return None
    if not all(a.constant and is_integer(a.const.dtype) for _, a in present):
        return None
    from onnx.reference import ReferenceEvaluator

    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.const.dtype), a.const.shape)
              for name, a in present]  # fmt: skip
    outputs = [helper.make_value_info(name, onnx.TypeProto()) for name in node.output if name]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    try:
        results = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets)).run(
            None, {name: a.const for name, a in present}
        )
    except Exception:  # noqa: BLE001 - a node the reference evaluator cannot run stays a node
        return None
    results = [np.asarray(r) for r in results]
    if not all(is_integer(r.dtype) and r.size <= MAX_ELEMENTS for r in results):
        return None
    return [Affine.of(r) for r in results]


@dataclass
class Evaluated:
    """What evaluating a graph found, by tensor name: ``values``, the integer tensors known as Affine;
    ``constants``, the tensors known at build time that are no Affine (float weights, ...); ``tainted``, the tensors
    computed at run time from a value that depends on P."""

    values: Dict[str, Affine] = field(default_factory=dict)
    constants: Set[str] = field(default_factory=set)
    tainted: Set[str] = field(default_factory=set)

    def depends_on_p(self, name: str) -> bool:
        value = self.values.get(name)
        return name in self.tainted or (value is not None and value.on_p)

    def is_constant(self, name: str) -> bool:
        return name in self.constants or (name in self.values and self.values[name].constant)

    def how(self, name: str) -> str:
        """A value for a message: ``(= const + P * coeff)``, ``?`` where only the run knows it."""
        value = self.values.get(name)
        return f"(= {value.describe()})" if value is not None else "(computed at run time)"
