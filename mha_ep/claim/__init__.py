"""Claim-time gate: decide, for one MultiHeadAttention node, whether mha_ep runs it, and why not.

``decide(attributes, inputs, outputs)`` is a pure function of the node's attributes and the static dtypes and
shapes of its inputs; it never imports CuPy or ONNX Runtime. The rules live in ``claim/rules.py`` and are the same
ones the op runs at execute time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from mha_ep.claim.rules import Call, Refusal, attributes_from_mapping, check
from mha_ep.claim.tensor_info import TensorInfo

__all__ = ["Decision", "TensorInfo", "decide"]


@dataclass(frozen=True)
class Decision:
    """The gate's verdict on one node: claimed, or declined with a reason and the input it is about. ``path``:
    where the node's graph sits, "" for the main graph, else the owning nodes and graph attributes from the main
    graph down (``BeamSearch_0/decoder``; a node without a name is ``<op>_<index>``)."""

    node_name: str
    claimed: bool
    reason: str = ""
    subject: str = ""
    path: str = ""

    @property
    def where(self) -> str:
        """The node's name with its graph's path: ``BeamSearch_0/decoder/Attention_3``."""
        name = self.node_name or "<unnamed>"
        return f"{self.path}/{name}" if self.path else name

    def to_dict(self) -> dict:
        return asdict(self)


def decide(
    attributes: Mapping[str, object],
    inputs: Sequence[Optional[TensorInfo]],
    outputs: Sequence[bool] = (True, False, False, False),
    node_name: str = "",
) -> Decision:
    """Claim or decline one node. ``inputs`` by slot (None = absent), ``outputs`` = which outputs are used."""
    try:
        attrs = attributes_from_mapping(attributes)
    except Refusal as refusal:
        return Decision(node_name, False, refusal.reason, refusal.subject)
    refusal = check(Call(attrs, tuple(inputs), tuple(outputs)))
    if refusal is not None:
        return Decision(node_name, False, refusal.reason, refusal.subject)
    return Decision(node_name, True)
