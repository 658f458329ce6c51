"""What ``compare`` reports: a verdict, per-output (and per-node) comparisons, and the report's text and JSON.

Verdicts, in the order they are decided (``Verdict``; the CLI's exit code in brackets):
  1. CANNOT RUN (2): the model cannot be loaded, or stock ORT itself cannot load or run it, or the plugin's
     backend cannot run here. ``CompareReport.reason`` is one line saying which and why.
  2. FUSION CHANGED THE MODEL (4), only with ``reference`` (the model before fusion): stock ORT on the model
     differs from stock ORT on the reference, on the same feeds, so the fusion that made the model's
     MultiHeadAttention nodes changed its math; whether mha_ep matches stock ORT on the fused model is reported
     beside it. Feeds are matched to the reference by input name; an input the reference needs and the model
     lacks is CANNOT RUN (never guessed), inputs and outputs found in only one of the two are listed in notes.
  3. NOTHING CLAIMED (3): no node would run on the plugin (no MultiHeadAttention, or every one declined), so there
     is nothing of ours to check; the partition report says why.
  4. FAIL (1): an output (or, with ``per_node``, a claimed node's output) is outside tolerance, or the plugin run
     failed where stock ORT ran.
  5. PASS (0): everything is within tolerance (and, with ``reference``, the fusion kept the model's outputs).

Values only: how a ``Comparison``'s numbers are computed is ``maths.py``, how the runs are made ``runner.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from mha_ep.graph.partition_result import PartitionResult


class Verdict(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    CANNOT_RUN = "CANNOT RUN"
    NOTHING_CLAIMED = "NOTHING CLAIMED"
    FUSION_CHANGED = "FUSION CHANGED THE MODEL"

    @property
    def exit_code(self) -> int:
        return {"PASS": 0, "FAIL": 1, "CANNOT RUN": 2, "NOTHING CLAIMED": 3, "FUSION CHANGED THE MODEL": 4}[self.value]


@dataclass
class Comparison:
    name: str
    dtype: str
    shape: tuple
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    score: float  # max over elements of |d| / max(atol, rtol * |stock|); <= 1 passes

    @property
    def passed(self) -> bool:
        return self.score <= 1.0

    @property
    def tolerance(self) -> float:
        return max(self.atol, self.rtol)

    def cells(self) -> list:
        tol = f"{self.atol:.0e}" if self.atol == self.rtol else f"a {self.atol:.0e} r {self.rtol:.0e}"
        return ["ok" if self.passed else "FAIL", self.name, self.dtype, str(self.shape),
                f"{self.max_abs:.3e}", f"{self.max_rel:.3e}", tol]  # fmt: skip

    def to_dict(self) -> dict:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "max_abs": self.max_abs,
            "max_rel": self.max_rel, "atol": self.atol, "rtol": self.rtol, "tolerance": self.tolerance,
            "passed": self.passed,
        }  # fmt: skip


COMPARISON_HEADER = ["", "name", "dtype", "shape", "max|d|", "rel", "tol"]


def table(header: list, rows: List[list], indent: str = "  ") -> List[str]:
    """Rows as aligned text columns, each as wide as its longest cell (long node names do not shift the rest)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    return [
        (indent + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))).rstrip()
        for row in [header, *rows]
    ]


@dataclass
class CompareReport:
    model: str
    backend: str
    partition: Optional[PartitionResult]  # None: the model could not be loaded
    outputs: List[Comparison] = field(default_factory=list)
    nodes: List[Comparison] = field(default_factory=list)
    stock_ms: float = 0.0
    plugin_ms: float = 0.0
    cannot_run: str = ""  # set: verdict CANNOT RUN, and this line says which side and why
    plugin_error: str = ""  # set: the plugin run failed where stock ORT ran (verdict FAIL)
    compute_dtype: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    oracle: str = "stock ORT CPU"
    worst_feeds: Optional[Dict[str, np.ndarray]] = field(default=None, repr=False)  # the set behind the worst error
    reference: Optional[str] = None  # the model before fusion, when given: stock ORT on it vs stock ORT on model
    fusion: List[Comparison] = field(default_factory=list)  # per common output: stock(model) vs stock(reference)

    @property
    def fusion_changed(self) -> List[Comparison]:
        return [c for c in self.fusion if not c.passed]

    @property
    def verdict(self) -> Verdict:
        if self.cannot_run:
            return Verdict.CANNOT_RUN
        if self.fusion_changed:
            return Verdict.FUSION_CHANGED
        if self.partition is None or self.partition.claimed == 0:
            return Verdict.NOTHING_CLAIMED
        if self.plugin_error or not all(c.passed for c in self.outputs + self.nodes):
            return Verdict.FAIL
        return Verdict.PASS

    @property
    def reason(self) -> str:
        """One line behind the verdict."""
        verdict = self.verdict
        if verdict is Verdict.CANNOT_RUN:
            return self.cannot_run
        if verdict is Verdict.FUSION_CHANGED:
            worst = max(self.fusion_changed, key=lambda c: c.score)
            ours = [c for c in self.outputs if c.name == worst.name]
            if self.plugin_error:
                plugin = f"; the plugin also failed: {self.plugin_error}"
            elif ours:
                plugin = ("; mha_ep matches stock ORT on the fused model there" if ours[0].passed else
                          f"; mha_ep differs from stock ORT on the fused model too (rel {ours[0].max_rel:.3g})")  # fmt: skip
            else:
                plugin = ""
            return (f"stock ORT gives other outputs for this model than for the reference {self.reference}: "
                    f"{len(self.fusion_changed)} output(s) outside tolerance, worst {worst.name} (rel "
                    f"{worst.max_rel:.3g}, tolerance {worst.tolerance:.0e}): the fusion changed the model's math"
                    f"{plugin}")  # fmt: skip
        if verdict is Verdict.NOTHING_CLAIMED:
            if self.partition is None or not self.partition.decisions:
                return "the model has no com.microsoft::MultiHeadAttention node, so nothing ran on the plugin"
            return (f"all {len(self.partition.decisions)} MultiHeadAttention node(s) were declined (reasons above), "
                    f"so nothing ran on the plugin")  # fmt: skip
        kept = f"; the fusion kept the reference's {len(self.fusion)} output(s)" if self.fusion else ""
        if self.plugin_error:
            return self.plugin_error + kept
        failed = [c.name for c in self.outputs + self.nodes if not c.passed]
        if failed:
            return (f"{len(failed)} output(s) outside tolerance: {', '.join(failed[:5])}"
                    f"{' ...' if len(failed) > 5 else ''}{kept}")  # fmt: skip
        return (f"{len(self.outputs)} output(s){f' and {len(self.nodes)} node output(s)' if self.nodes else ''} "
                f"within tolerance{kept}")  # fmt: skip

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS

    def text(self) -> str:
        lines = [f"== {self.model}: plugin ({self.backend}) vs {self.oracle}"]
        if self.partition is not None:
            lines.append(self.partition.report())
        # one table for both parts, so their columns line up however long the node names are
        rows = table(COMPARISON_HEADER, [c.cells() for c in self.nodes + self.outputs])
        if self.nodes:
            lines.append("per claimed node, in graph order:")
            lines.extend(rows[: 1 + len(self.nodes)])
        if self.outputs:
            lines.append("model outputs" + (f" (the model computes in {self.compute_dtype})" if self.compute_dtype else "") + ":")
            lines.extend(rows[:1] + rows[1 + len(self.nodes):])
            lines.append(f"  time per run: stock {self.stock_ms:.2f} ms, plugin {self.plugin_ms:.2f} ms")
        if self.fusion:
            lines.append(f"the fusion: stock ORT on this model vs stock ORT on the reference {self.reference}:")
            lines.extend(table(COMPARISON_HEADER, [c.cells() for c in self.fusion]))
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.append(f"{self.verdict.value}: {self.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        part = self.partition
        return {
            "model": self.model,
            "verdict": self.verdict.value,
            "exit_code": self.verdict.exit_code,
            "reason": self.reason,
            "passed": self.passed,
            "backend": self.backend,
            "oracle": self.oracle,
            "compute_dtype": self.compute_dtype,
            "claimed": part.claimed if part else 0,
            "declined": part.declined if part else 0,
            "partition": json_of(part) if part else None,
            "outputs": [c.to_dict() for c in self.outputs],
            "nodes": [c.to_dict() for c in self.nodes],
            "reference": self.reference,
            "fusion": [c.to_dict() for c in self.fusion],
            "stock_ms": self.stock_ms,
            "plugin_ms": self.plugin_ms,
            "notes": self.notes,
        }


def json_of(part: PartitionResult) -> dict:
    import json

    return json.loads(part.to_json())

