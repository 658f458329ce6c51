"""What a native kernel knows of its node: the node's attributes read once, when ORT creates the kernel.

ORT creates one kernel per claimed node and session; the C library hands the node's attributes to
``describe_kernel`` and keeps the answer: a config id, which input slots carry real tensors, and the node's name.
Nodes whose attributes are equal apart from their name share one config (every layer of a BERT does), so the
library's plan cache (keyed on the config id) serves them all from one plan per call signature.

This module must not import CuPy or onnxruntime: the CPU suite tests it directly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar, Mapping, Union

from mha_ep import spec
from mha_ep.claim.rules import Refusal, attributes_from_mapping
from mha_ep.errors import MESSAGE_PREFIX, MhaModelError

# (name, kind) of every attribute the library reads from a node (spec.PLUGIN_ATTRIBUTES, in their order).
ATTRIBUTES = tuple((a.name, a.kind) for a in spec.PLUGIN_ATTRIBUTES)


@dataclass(frozen=True)
class KernelConfig:
    """A claimed node's attributes, as every call of it reads them (spec.node_config)."""

    ort_attributes: tuple  # sorted (name, value) items of ORT's attributes, exact floats included
    dtype: str  # the node's element type: float32 | float16 | bfloat16
    outputs: tuple  # wanted flags of spec.OUTPUTS (output, present_key, present_value, qk)
    supplied: frozenset  # names of the input slots carrying real tensors
    op: ClassVar[str] = spec.OP_TYPE

    @property
    def attributes(self) -> dict:
        return dict(self.ort_attributes)

    @property
    def supplied_mask(self) -> int:
        """Bit i set: input slot i of spec.PLUGIN_INPUTS is supplied."""
        return sum(1 << i for i, name in enumerate(spec.PLUGIN_INPUTS) if name in self.supplied)


@dataclass(frozen=True)
class MatMulConfig:
    """A mha_ep::DecodeMatMul node (spec.MATMUL_OP_TYPE): its element type; both inputs always supplied."""

    dtype: str
    op: ClassVar[str] = spec.MATMUL_OP_TYPE
    supplied: ClassVar[frozenset] = frozenset(spec.MATMUL_INPUTS)
    supplied_mask: ClassVar[int] = (1 << len(spec.MATMUL_INPUTS)) - 1


AnyConfig = Union[KernelConfig, MatMulConfig]
_lock = threading.Lock()
_configs: list = []
_ids: dict = {}
_nodes: dict = {}  # config id -> the names of the nodes that share it, first NODE_NAMES of them
NODE_NAMES = 4


def config(config_id: int) -> AnyConfig:
    return _configs[config_id]


def node_names(config_id: int) -> tuple:
    """The names of (the first few) nodes whose kernels share config ``config_id``: who a device report names."""
    with _lock:
        return tuple(_nodes.get(config_id, ()))


def describe_kernel(attributes: Mapping[str, object], ep: str, op: str = spec.OP_TYPE) -> tuple:
    """The C library's question at kernel creation: (config id, supplied-slot mask, node name) of the node whose
    attributes (strings as bytes, as ORT stores them) are ``attributes``; raises MhaModelError naming the
    attribute for a node that mha_ep.partition (or, for ``op`` DecodeMatMul, mha-ep static-cache) would not have
    written. ``ep``: "cpu" or "cuda"."""
    if op == spec.MATMUL_OP_TYPE:
        config, node = matmul_config(attributes)
    elif op == spec.OP_TYPE:
        config, node = kernel_config(attributes)
    else:
        raise MhaModelError(f"mha_ep has no op {op!r} (its ops: {spec.OP_TYPE}, {spec.MATMUL_OP_TYPE})")
    with _lock:
        config_id = _ids.get(config)
        if config_id is None:
            config_id = _ids[config] = len(_configs)
            _configs.append(config)
        names = _nodes.setdefault(config_id, [])
        if node not in names and len(names) < NODE_NAMES:
            names.append(node)
    return config_id, config.supplied_mask, node


def node_name(attributes: Mapping[str, object]) -> str:
    """The node's name from its ATTR_NODE attribute ("" without one), whatever its bytes."""
    raw_name = attributes.get(spec.ATTR_NODE, b"")
    return raw_name.decode("utf-8", "backslashreplace") if isinstance(raw_name, bytes) else str(raw_name)


def matmul_config(attributes: Mapping[str, object]) -> tuple:
    """(MatMulConfig, node name) of a DecodeMatMul node's raw attributes: its ATTR_DTYPE, one of FLOAT_DTYPES;
    MhaModelError otherwise."""
    node = node_name(attributes)
    raw = attributes.get(spec.ATTR_DTYPE)
    dtype = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    if dtype not in spec.FLOAT_DTYPES:
        raise MhaModelError(f"mha_ep {spec.MATMUL_OP_TYPE} node {node!r} cannot be run: attribute {spec.ATTR_DTYPE} "
                            f"is {dtype!r}, expected one of {', '.join(spec.FLOAT_DTYPES)}")  # fmt: skip
    return MatMulConfig(dtype), node


def kernel_config(attributes: Mapping[str, object]) -> tuple:
    """(KernelConfig, node name) of a node's raw attributes (module docstring); MhaModelError for a crafted one."""
    node = node_name(attributes)

    def refuse(what: str):
        raise MhaModelError(f"mha_ep node {node!r} cannot be run: {what}")

    values = {}
    for name, kind in ATTRIBUTES:
        if name not in attributes:
            continue
        value = attributes[name]
        if kind == "string" and isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                refuse(f"attribute {name} is not UTF-8 text ({value[:40]!r})")
        values[name] = value
    missing = [name for name, _ in ATTRIBUTES if name not in values]
    if missing:
        refuse(f"attribute(s) {', '.join(missing)} missing (a node mha_ep.partition writes has all of them)")
    try:
        supplied, outputs, ort_attributes, dtype = spec.node_config(tuple(sorted(values.items())))
    except ValueError as error:
        refuse(f"attribute {spec.ATTR_FLOATS} is not readable ({error})")
    try:
        attributes_from_mapping(ort_attributes)
    except Refusal as refusal:
        refuse(refusal.reason.removeprefix(MESSAGE_PREFIX))
    if dtype not in spec.FLOAT_DTYPES:
        refuse(f"attribute {spec.ATTR_DTYPE} is {dtype!r}, expected one of {', '.join(spec.FLOAT_DTYPES)}")
    unknown = sorted(supplied - set(spec.PLUGIN_INPUTS))
    if unknown:
        refuse(f"attribute {spec.ATTR_INPUTS} names {', '.join(map(repr, unknown))}, not among "
               f"{', '.join(spec.PLUGIN_INPUTS)}")  # fmt: skip
    return KernelConfig(tuple(sorted(ort_attributes.items())), dtype, outputs, frozenset(supplied)), node
