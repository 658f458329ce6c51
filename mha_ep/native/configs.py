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
from typing import Mapping

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

    @property
    def attributes(self) -> dict:
        return dict(self.ort_attributes)

    @property
    def supplied_mask(self) -> int:
        """Bit i set: input slot i of spec.PLUGIN_INPUTS is supplied."""
        return sum(1 << i for i, name in enumerate(spec.PLUGIN_INPUTS) if name in self.supplied)


_lock = threading.Lock()
_configs: list = []
_ids: dict = {}
_nodes: dict = {}  # config id -> the names of the nodes that share it, first NODE_NAMES of them
NODE_NAMES = 4


def config(config_id: int) -> KernelConfig:
    return _configs[config_id]


def node_names(config_id: int) -> tuple:
    """The names of (the first few) nodes whose kernels share config ``config_id``: who a device report names."""
    with _lock:
        return tuple(_nodes.get(config_id, ()))


def describe_kernel(attributes: Mapping[str, object], ep: str) -> tuple:
    """The C library's question at kernel creation: (config id, supplied-slot mask, node name) of the node whose
    attributes (strings as bytes, as ORT stores them) are ``attributes``; raises MhaModelError naming the
    attribute for a node that mha_ep.partition would not have written. ``ep``: "cpu" or "cuda"."""
    config, node = kernel_config(attributes)
    with _lock:
        config_id = _ids.get(config)
        if config_id is None:
            config_id = _ids[config] = len(_configs)
            _configs.append(config)
        names = _nodes.setdefault(config_id, [])
        if node not in names and len(names) < NODE_NAMES:
            names.append(node)
    return config_id, config.supplied_mask, node


def kernel_config(attributes: Mapping[str, object]) -> tuple:
    """(KernelConfig, node name) of a node's raw attributes (module docstring); MhaModelError for a crafted one."""
    raw_name = attributes.get(spec.ATTR_NODE, b"")
    node = raw_name.decode("utf-8", "backslashreplace") if isinstance(raw_name, bytes) else str(raw_name)

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
