"""What the partition pass returns: the new model and a Decision per MultiHeadAttention node, as text and JSON."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Union

import onnx

from mha_ep.claim import Decision
from mha_ep.graph.model_io import save_model


def how_to_get_mha(lift_requested: bool) -> str:
    """The note of a report with no MultiHeadAttention node: where such nodes come from."""
    lift = (
        "the onnxscript ORT fusions (onnxscript.rewriter.ort_fusions) make com.microsoft::Attention, which "
        + ("--lift-attention rewrites where it can (see the reasons above)" if lift_requested
           else "--lift-attention (partition(..., lift_attention=True)) rewrites into MultiHeadAttention")
    )  # fmt: skip
    return (
        "the model has no com.microsoft::MultiHeadAttention node, so there is nothing to claim. To get them: ORT's "
        "transformer optimizer (python -m onnxruntime.transformers.optimizer --input IN --output OUT --model_type "
        f"bert --num_heads N --hidden_size H --use_multi_head_attention), or {lift}"
    )


@dataclass
class PartitionResult:
    """What ``partition`` did: the new model, one Decision per MultiHeadAttention node (the main graph's in
    graph order, then each subgraph's after its graph, its ``path`` saying where), and,
    when ``lift_attention`` was asked for, one LiftDecision per com.microsoft::Attention node."""

    model: onnx.ModelProto
    decisions: List[Decision]
    lifted_attention: int = 0
    notes: List[str] = field(default_factory=list)
    lift_requested: bool = False
    lift_decisions: list = field(default_factory=list)  # mha_ep.graph.lift.LiftDecision, graph order
    route: str = "python-op"  # the form of the claimed nodes (the pass's rule TRANSPORT)

    @property
    def claimed(self) -> int:
        return sum(d.claimed for d in self.decisions)

    @property
    def declined(self) -> int:
        return len(self.decisions) - self.claimed

    @property
    def not_lifted(self) -> list:
        return [d for d in self.lift_decisions if not d.lifted]

    def report(self) -> str:
        """The decisions as text: one line per MHA node (claimed, or declined with its reason; a subgraph's node
        named with its graph's path, ``BeamSearch_0/decoder/Attention_3``), one per
        Attention node that was not lifted (with its reason), then notes."""
        lines = [
            f"mha_ep partition: {len(self.decisions)} MultiHeadAttention node(s), {self.claimed} claimed, "
            f"{self.declined} declined"
        ]
        if self.lift_requested:
            lines.append(f"  {self.lifted_attention} com.microsoft::Attention node(s) lifted into MultiHeadAttention, "
                         f"{len(self.not_lifted)} not lifted")  # fmt: skip
        width = max((len(d.where) + 1 for d in self.decisions), default=0)
        for d in self.decisions:  # reasons start in one column however long the node names are
            name = d.where  # a subgraph's node with its graph's path
            lines.append(f"  claimed   {name}" if d.claimed else f"  declined  {(name + ':').ljust(width)} {d.reason}")
        for d in self.not_lifted:
            lines.append(f"  not lifted  {d.node_name}: {d.reason}")
        if not self.decisions:
            lines.append(f"  note: {how_to_get_mha(self.lift_requested)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "mha_nodes": len(self.decisions),
            "route": self.route,
            "claimed": self.claimed,
            "declined": self.declined,
            "lift_attention": self.lift_requested,
            "lifted_attention": self.lifted_attention,
            "decisions": [d.to_dict() for d in self.decisions],
            "not_lifted": [{"node": d.node_name, "reason": d.reason} for d in self.not_lifted],
            "notes": self.notes + ([how_to_get_mha(self.lift_requested)] if not self.decisions else []),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the partitioned model to ``path``, whole or not at all (see ``save_model``)."""
        save_model(self.model, path)
