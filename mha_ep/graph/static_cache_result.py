"""What the static-cache rewrite returns (mha_ep/graph/static_cache.py): the rewritten model and what was done to
it, as a report, as JSON-ready data, and saved."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import onnx

from mha_ep.graph.graph_facts import dims_of
from mha_ep.graph.model_io import save_model
from mha_ep.graph.packed_projections import ALREADY
from mha_ep.graph.static_cache_checks import CACHE_INDIRECTION, PAST_SEQUENCE_LENGTH

# The model metadata key under which the rewrite records which graph input is the past of which output, and the
# names of the P and cache_indirection inputs (JSON, StaticCacheResult.binding_facts): a loop over any static-cache
# decoder (mha_ep/decode/static_decode.py) reads its buffers from it, whatever the model names them.
METADATA_KEY = "mha_ep.static_cache"


def read_binding_facts(metadata: dict) -> Optional[dict]:
    """The binding facts a static-cache rewrite stamped into a model's metadata (name -> value, as ORT's
    ``session.get_modelmeta().custom_metadata_map`` or a ModelProto's metadata_props give it); None without them."""
    text = metadata.get(METADATA_KEY)
    return None if text is None else json.loads(text)


@dataclass
class StaticCacheResult:
    """What ``static_cache`` did: the rewritten model, the self-attention layers that got the shared buffer
    (past_key, past_value, present_key, present_value per node, graph order), the buffer's max_length and batch
    (None: the batch dim stays symbolic), how many nodes were folded or removed, and notes; the step length (None:
    not known), the input dims pinned to it (input, dim index, symbol, value), the names of the P and
    cache_indirection inputs (None: none), and which of the two the model had already (rules SELF_NODES,
    SHARED_BUFFER and OTHER_INPUTS); per self node (graph order), "" where its Q, K and V projections became one
    MatMul and a packed QKV query, else why not (rule PACKED_PROJECTIONS; None: not asked, packed_qkv=False); per
    cross node, "" where its beams share one K / V row per batch entry, else why not, and the inputs that hold one
    row per entry (rule SHARED_CROSS_KV; None: not asked); per MatMul, "" where it became mha_ep::DecodeMatMul,
    else why not (rule DECODE_MATMUL; None: not asked)."""

    model: onnx.ModelProto
    self_layers: Tuple[Tuple[str, str, str, str], ...]
    max_length: int
    batch: Optional[int]
    folded: int
    notes: List[str] = field(default_factory=list)
    beams: int = 0
    step_length: Optional[int] = None
    pinned: Tuple[Tuple[str, int, str, int], ...] = ()
    past_sequence_length: str = PAST_SEQUENCE_LENGTH
    cache_indirection: Optional[str] = None
    kept_inputs: Tuple[str, ...] = ()
    packed_qkv: Optional[Tuple[Tuple[str, str], ...]] = None
    shared_cross_kv: Optional[Tuple[Tuple[str, str], ...]] = None
    entry_inputs: Tuple[str, ...] = ()
    decode_matmul: Optional[Tuple[Tuple[str, str], ...]] = None

    @property
    def packed_nodes(self) -> List[str]:
        """The self nodes whose query is packed QKV, by this rewrite or an earlier one (rule PACKED_PROJECTIONS)."""
        return [node for node, why in self.packed_qkv or () if why in ("", ALREADY)]

    def packing_lines(self) -> List[str]:
        """The report's lines on rule PACKED_PROJECTIONS."""
        if self.packed_qkv is None:
            return ["  packed QKV projections: off (packed_qkv=False, --no-packed-qkv): every self node keeps its "
                    "three Q, K and V MatMuls"]  # fmt: skip
        earlier = sum(why == ALREADY for _, why in self.packed_qkv)
        lines = [f"  packed QKV projections: {len(self.packed_nodes)} of {len(self.packed_qkv)} self-attention "
                 "node(s) read Q, K and V from one MatMul and a packed (B, L, N, 3, H) query"
                 + (f" ({earlier} packed by an earlier rewrite)" if earlier else "")]  # fmt: skip
        if self.packed_nodes:
            lines.append("  note: stock ORT refuses packed QKV with a past: run the model with mha_ep claiming its "
                         "attention nodes, or rewrite it with --no-packed-qkv")  # fmt: skip
        lines.extend(f"  not packed: node {node!r}: {why}" for node, why in self.packed_qkv
                     if why not in ("", ALREADY))  # fmt: skip
        return lines

    def sharing_lines(self) -> List[str]:
        """The report's lines on rule SHARED_CROSS_KV (none where it was not asked)."""
        if self.shared_cross_kv is None:
            return []
        shared = [node for node, why in self.shared_cross_kv if not why]
        lines = [f"  shared cross K/V: {len(shared)} of {len(self.shared_cross_kv)} cross-attention node(s) read "
                 f"one key / value row per batch entry for its {self.beams} beams; bind "
                 f"{', '.join(self.entry_inputs) or 'nothing'} with batch / beams rows"]  # fmt: skip
        lines.extend(f"  not shared: node {node!r}: {why}" for node, why in self.shared_cross_kv if why)
        return lines

    def decode_matmul_lines(self) -> List[str]:
        """The report's line on rule DECODE_MATMUL (none where it was not asked)."""
        if self.decode_matmul is None:
            return []
        done = sum(not why for _, why in self.decode_matmul)
        reasons = sorted({why for _, why in self.decode_matmul if why})
        return [f"  decode products: {done} of {len(self.decode_matmul)} MatMul(s) run as mha_ep::DecodeMatMul (the "
                "model then runs only with mha_ep registered)" + (f"; kept: {'; '.join(reasons)}" if reasons else "")]

    @property
    def unchanged_inputs(self) -> List[str]:
        """The graph inputs other than the self pasts, P and cache_indirection (cross K/V, input_ids, ...)."""
        pasts = {name for layer in self.self_layers for name in layer[:2]}
        pasts |= {self.past_sequence_length, self.cache_indirection}
        return [v.name for v in self.model.graph.input if v.name not in pasts]

    def declared(self, name: str) -> str:
        """An input's declared dims as text: ``(1,)``, ``(batch, 5, 448)``."""
        value = next(v for v in self.model.graph.input if v.name == name)
        dims = [str(d) for d in dims_of(value) or ()]
        return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"

    def input_line(self, name: str, role: str, what: str) -> str:
        """The report's line on the P or cache_indirection input: new, or kept (under its own name)."""
        if name not in self.kept_inputs:
            return f"  new input: {name} int32 {self.declared(name)}, {what}"
        named = "" if name == role else f" (the model's {role}, under its own name: bind it there)"
        return f"  input kept: {name} int32 {self.declared(name)}{named}, {what}"

    def report(self) -> str:
        """A short summary: the shared buffer, the P (and cache_indirection) input, the pinned dims, the folded
        shape nodes, the inputs left as they are."""
        batch = "batch" if self.batch is None else str(self.batch)
        lines = [
            f"mha_ep static-cache: {len(self.self_layers)} self-attention MultiHeadAttention node(s) share their "
            f"past and present in one ({batch}, N, {self.max_length}, H) buffer",
            self.input_line(self.past_sequence_length, PAST_SEQUENCE_LENGTH,
                            "the rows filled so far (P); a step writes only the rows [P, P + step)"),
            *([self.input_line(self.cache_indirection, CACHE_INDIRECTION,
                               "the beam each row's cache row is read from (beam search)")]
              if self.cache_indirection else []),
            *(f"  pinned {name} dim {index} ({symbol!r}) to {value} (--step-length)"
              for name, index, symbol, value in self.pinned),
            *([f"  step length: {self.step_length}, static in the model"]
              if self.step_length is not None and not self.pinned else []),
            f"  shape arithmetic: {self.folded} node(s) folded into constants or device computations from "
            f"{self.past_sequence_length}",
            *self.packing_lines(),
            *self.sharing_lines(),
            *self.decode_matmul_lines(),
            f"  inputs as they were: {', '.join(self.unchanged_inputs) or 'none'}",
        ]  # fmt: skip
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The result's fields as JSON-ready data (the model left out)."""
        return {
            "self_layers": [dict(zip(("past_key", "past_value", "present_key", "present_value"), layer))
                            for layer in self.self_layers],
            "max_length": self.max_length,
            "batch": self.batch,
            "beams": self.beams,
            "step_length": self.step_length,
            "pinned": [dict(zip(("input", "dim", "symbol", "value"), pin)) for pin in self.pinned],
            "past_sequence_length": self.past_sequence_length,
            "cache_indirection": self.cache_indirection,
            "kept_inputs": list(self.kept_inputs),
            "folded": self.folded,
            "packed_qkv": None if self.packed_qkv is None else [
                {"node": node, "packed": why in ("", ALREADY), "reason": why or None} for node, why in self.packed_qkv],
            "shared_cross_kv": None if self.shared_cross_kv is None else [
                {"node": node, "shared": not why, "reason": why or None} for node, why in self.shared_cross_kv],
            "entry_inputs": list(self.entry_inputs),
            "decode_matmul": None if self.decode_matmul is None else [
                {"node": node, "rewritten": not why, "reason": why or None} for node, why in self.decode_matmul],
            "unchanged_inputs": self.unchanged_inputs,
            "notes": self.notes,
        }  # fmt: skip

    def binding_facts(self) -> dict:
        """What a loop over the rewritten decoder needs to bind it: the (past_key, past_value, present_key,
        present_value) names per layer, max_length, batch, beams, the P and cache_indirection inputs, and the
        inputs of one row per batch entry (rule SHARED_CROSS_KV)."""
        facts = self.to_dict()
        return {key: facts[key] for key in ("self_layers", "max_length", "batch", "beams", "past_sequence_length",
                                            "cache_indirection", "entry_inputs")}  # fmt: skip

    def stamp(self) -> None:
        """Record ``binding_facts`` in the model's metadata under METADATA_KEY (replacing an earlier stamp)."""
        kept = [p for p in self.model.metadata_props if p.key != METADATA_KEY]
        del self.model.metadata_props[:]
        self.model.metadata_props.extend(kept)
        entry = self.model.metadata_props.add()
        entry.key, entry.value = METADATA_KEY, json.dumps(self.binding_facts(), sort_keys=True)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the rewritten model to ``path``, whole or not at all (see ``save_model``)."""
        save_model(self.model, path)
