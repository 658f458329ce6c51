"""Stock ORT vs the plugin on the same feeds: per-output (and, on request, per-node) error report.

Errors are max |plugin - stock| / max(1, |stock|); NaN in the same place on both sides counts as equal. The
tolerances below are for whole models (errors compound over layers); single-node parity is held much tighter in
the tests (1e-5 float32, 4e-3 float16).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import numpy as np
import onnx
from onnx import helper

from mha_ep.claim.shapes import infer_static_infos
from mha_ep.dtypes import elem_type
from mha_ep.feeds import random_feeds
from mha_ep.partition import PartitionResult, is_ort_mha, is_plugin_mha, load_model

MODEL_TOLERANCE = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "bfloat16": 6e-2}
INTEGER_TOLERANCE = 0.0


@dataclass
class Comparison:
    name: str
    dtype: str
    shape: tuple
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.tolerance

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        return (
            f"  {verdict} {self.name:<48} {self.dtype:<8} {str(self.shape):<20} max|d| {self.max_abs:.3e}  "
            f"rel {self.max_rel:.3e}  (tol {self.tolerance:.0e})"
        )


@dataclass
class CompareReport:
    model: str
    backend: str
    partition: PartitionResult
    outputs: List[Comparison] = field(default_factory=list)
    nodes: List[Comparison] = field(default_factory=list)
    stock_ms: float = 0.0
    plugin_ms: float = 0.0
    oracle: Optional[str] = "stock ORT CPU"  # None: stock ORT could not run the model
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when an oracle ran and every output (and node) is within tolerance."""
        return self.oracle is not None and all(c.passed for c in self.outputs + self.nodes)

    def text(self) -> str:
        lines = [f"== {self.model}: plugin ({self.backend}) vs {self.oracle or 'no oracle'}", self.partition.report()]
        if self.nodes:
            lines.append("per claimed node, in graph order:")
            lines.extend(c.line() for c in self.nodes)
        lines.append("model outputs:")
        lines.extend(c.line() for c in self.outputs)
        lines.append(f"  time per run: stock {self.stock_ms:.2f} ms, plugin {self.plugin_ms:.2f} ms")
        lines.extend(f"  note: {n}" for n in self.notes)
        verdict = "NO ORACLE" if self.oracle is None else "PASS" if self.passed else "FAIL"
        lines.append(f"  {verdict}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def rows(items):
            return [
                {
                    "name": c.name,
                    "dtype": c.dtype,
                    "shape": list(c.shape),
                    "max_abs": c.max_abs,
                    "max_rel": c.max_rel,
                    "tolerance": c.tolerance,
                    "passed": c.passed,
                }
                for c in items
            ]

        return {
            "model": self.model,
            "backend": self.backend,
            "oracle": self.oracle,
            "claimed": self.partition.claimed,
            "declined": self.partition.declined,
            "outputs": rows(self.outputs),
            "nodes": rows(self.nodes),
            "stock_ms": self.stock_ms,
            "plugin_ms": self.plugin_ms,
            "passed": self.passed,
        }


def errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        return float("inf"), float("inf")
    if a.size == 0:
        return 0.0, 0.0
    if (np.isnan(a) ^ np.isnan(e)).any():
        return float("inf"), float("inf")
    same = (np.isnan(a) & np.isnan(e)) | ((a == e) & np.isinf(e))  # equal NaNs and equal infinities agree
    a, e = np.where(same, 0.0, a), np.where(same, 0.0, e)
    diff = np.abs(a - e)
    return float(diff.max()), float((diff / np.maximum(1.0, np.abs(e))).max())


def compare_arrays(name: str, actual: np.ndarray, expected: np.ndarray, tolerance: Optional[float] = None):
    dtype = str(np.asarray(expected).dtype)
    if tolerance is None:
        tolerance = MODEL_TOLERANCE.get(dtype, INTEGER_TOLERANCE)
    max_abs, max_rel = errors(actual, expected)
    return Comparison(name, dtype, tuple(np.shape(expected)), max_abs, max_rel, tolerance)


def expose_mha_outputs(model: onnx.ModelProto) -> List[str]:
    """Rule of --per-node: every MHA node's used outputs become graph outputs (same names in both runs)."""
    infos = infer_static_infos(model)
    existing = {o.name for o in model.graph.output}
    exposed = []
    for node in model.graph.node:
        if not is_ort_mha(node):
            continue
        for name in node.output[:3]:
            if name and name not in existing:
                info = infos.get(name)
                elem = elem_type(info.dtype) if info is not None and info.dtype else onnx.TensorProto.FLOAT
                model.graph.output.append(helper.make_tensor_value_info(name, elem, None))
                existing.add(name)
            if name:
                exposed.append(name)
    return exposed


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Every graph input that is not an initializer has a feed, and no feed names an unknown input."""
    initializers = {init.name for init in model.graph.initializer}
    needed = [v.name for v in model.graph.input if v.name not in initializers]
    missing = [name for name in needed if name not in feeds]
    unknown = sorted(set(feeds) - {v.name for v in model.graph.input})
    if missing or unknown:
        raise ValueError(
            f"feeds do not fit the model: missing {missing or 'none'}, unknown {unknown or 'none'}; "
            f"the model's inputs are {needed}"
        )


def _timed_run(session, feeds, repeat: int):
    outputs = session.run(None, feeds)
    start = time.perf_counter()
    for _ in range(repeat):
        session.run(None, feeds)
    return outputs, (time.perf_counter() - start) * 1000.0 / max(repeat, 1)


def compare(
    model,
    feeds: Optional[Mapping[str, np.ndarray]] = None,
    backend: str = "auto",
    device_id: int = 0,
    per_node: bool = False,
    seed: int = 0,
    dims: Optional[Mapping[str, int]] = None,
    lift_attention: bool = False,
    repeat: int = 3,
    name: Optional[str] = None,
    runs: int = 1,
    progress=None,
) -> CompareReport:
    """Run ``model`` with stock ORT (CPU) and with the plugin on the same feeds; return the error report.

    ``runs`` > 1 draws that many random feed sets (seeds ``seed``, ``seed + 1``, ...) and reports each output's
    worst error over them; ``progress`` (e.g. ``print``) hears one line per set.
    """
    import onnxruntime as ort

    from mha_ep.session import InferenceSession

    label = name or (str(model) if not isinstance(model, onnx.ModelProto) else model.graph.name or "model")
    original = load_model(model)
    notes = []
    if lift_attention:
        from mha_ep.lift import lift_attention as lift

        original, lifted = lift(original)
        notes.append(f"{lifted} Attention node(s) lifted into MHA on both sides (the lift is exact; tests/test_lift.py)")
    graph_outputs = [o.name for o in original.graph.output]
    exposed = expose_mha_outputs(original) if per_node else []
    if feeds is not None:
        feed_sets = [dict(feeds)]
    else:
        feed_sets = [random_feeds(original, seed=seed + run, dims=dims) for run in range(max(1, runs))]
    for feed_set in feed_sets:
        check_feeds(original, feed_set)

    plugin = InferenceSession(original, backend=backend, device_id=device_id)
    report = CompareReport(label, plugin.backend.name, plugin.partition, notes=notes)
    try:
        stock = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - e.g. bfloat16 MHA, which stock ORT cannot run
        report.oracle = None
        report.notes.append(
            f"stock ORT cannot run this model, so there is nothing to compare against: "
            f"{str(error).splitlines()[0][:300]} (single-node bfloat16 parity is checked against a float64 "
            f"reference in tests/test_parity_random.py)"
        )
        return report
    # decisions come one per MHA node in graph order: match them by position, never by (possibly empty) name
    mha_nodes = [n for n in original.graph.node if is_ort_mha(n) or is_plugin_mha(n)]
    node_of_output = {}
    for index, (node, decision) in enumerate(zip(mha_nodes, plugin.decisions)):
        if decision.claimed:
            for out in node.output:
                if out:
                    node_of_output[out] = node.name or f"{node.op_type}_{index}"
    node_outputs = [out for out in exposed if out in node_of_output]
    worst: Dict[str, Comparison] = {}
    for run, feed_set in enumerate(feed_sets, 1):
        if len(feed_sets) > 1 and progress is not None:
            progress(f"[{run}/{len(feed_sets)}] feeds seed {seed + run - 1}")
        plugin_outputs, plugin_ms = _timed_run(plugin, feed_set, repeat)
        stock_outputs, stock_ms = _timed_run(stock, feed_set, repeat)
        report.plugin_ms, report.stock_ms = max(report.plugin_ms, plugin_ms), max(report.stock_ms, stock_ms)
        by_name_plugin = dict(zip([o.name for o in plugin.get_outputs()], plugin_outputs))
        by_name_stock = dict(zip([o.name for o in stock.get_outputs()], stock_outputs))
        for key, out in [(f"{node_of_output[o]} -> {o}", o) for o in node_outputs] + [(o, o) for o in graph_outputs]:
            comparison = compare_arrays(key, by_name_plugin[out], by_name_stock[out])
            if key not in worst or comparison.max_rel > worst[key].max_rel:
                worst[key] = comparison
    report.nodes = [worst[f"{node_of_output[o]} -> {o}"] for o in node_outputs]
    report.outputs = [worst[o] for o in graph_outputs]
    if len(feed_sets) > 1:
        report.notes.append(f"worst of {len(feed_sets)} feed sets (seeds {seed}..{seed + len(feed_sets) - 1}); "
                            f"times are the slowest set's")  # fmt: skip
    return report
