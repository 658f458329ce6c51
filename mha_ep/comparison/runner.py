"""Running a comparison: stock ORT and the plugin on the same feeds (and stock ORT on a reference model), each
output's worst error over the feed sets, collected into a ``CompareReport``."""

from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional

import numpy as np
import onnx
from onnx import helper

from mha_ep.claim.shapes import infer_static_infos
from mha_ep.comparison.maths import compare_arrays, compute_dtype, loosest
from mha_ep.comparison.report import Comparison, CompareReport
from mha_ep.dtypes import elem_type
from mha_ep.errors import BackendUnavailableError
from mha_ep.feeds import random_feeds
from mha_ep.graph.model_io import load_model
from mha_ep.graph.partition import is_ort_mha, is_plugin_mha
from mha_ep.graph.unpack import unpack_packed_attention
from mha_ep.progress import bar as progress_bar_over


def expose_mha_outputs(model: onnx.ModelProto, infos=None) -> List[str]:
    """Rule of --per-node: every MHA node's used outputs become graph outputs (same names in both runs)."""
    infos = infer_static_infos(model) if infos is None else infos
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


def graph_inputs(model: onnx.ModelProto) -> List[str]:
    """The inputs a run must feed: graph inputs that are not initializers."""
    initializers = {init.name for init in model.graph.initializer}
    return [v.name for v in model.graph.input if v.name not in initializers]


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Every graph input that is not an initializer has a feed, and no feed names an unknown input."""
    needed = graph_inputs(model)
    missing = [name for name in needed if name not in feeds]
    unknown = sorted(set(feeds) - {v.name for v in model.graph.input})
    if missing or unknown:
        raise ValueError(
            f"feeds do not fit the model: missing {missing or 'none'}, unknown {unknown or 'none'}; "
            f"the model's inputs are {needed}"
        )


def stock_session(model: onnx.ModelProto):
    """Stock ORT on the CPU, silent: its errors come back as exceptions, and the report gives them one line."""
    import onnxruntime as ort

    quiet = ort.SessionOptions()
    quiet.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), quiet, providers=["CPUExecutionProvider"])


def _timed_run(session, feeds, repeat: int, outputs=None, tick=lambda: None):
    """The outputs of one run (or ``outputs``, already made), and the mean ms of ``repeat`` more; ``tick`` after each."""
    outputs = session.run(None, feeds) if outputs is None else outputs
    tick()
    start = time.perf_counter()
    for _ in range(repeat):
        session.run(None, feeds)
        tick()
    return outputs, (time.perf_counter() - start) * 1000.0 / max(repeat, 1)


def model_label(model) -> str:
    """How a report names a model given as a path, bytes or a ModelProto."""
    if isinstance(model, onnx.ModelProto):
        return model.graph.name or "(model)"
    return "(bytes)" if isinstance(model, bytes) else str(model)


def check_reference(report: CompareReport, reference, stock, model: onnx.ModelProto, outputs: List[str],
                    feed_sets: List[dict], first_stock: list, compute: Optional[str], atol, rtol, say) -> None:  # fmt: skip
    """Stock ORT on ``reference`` (the model before fusion) against stock ORT on ``model``, per feed set, by
    output name: fills ``report.fusion`` (each output's worst set), or ``report.cannot_run``; notes what only
    one of the two models has."""
    try:
        unfused = load_model(reference)
    except (OSError, ValueError) as error:
        report.cannot_run = f"the reference model cannot be loaded: {first_line(error)}"
        return
    needed = graph_inputs(unfused)
    ours = graph_inputs(model)
    missing = [name for name in needed if name not in ours]
    if missing:
        report.cannot_run = (f"the reference {report.reference} needs input(s) {missing} that this model does not "
                             f"have (inputs are matched by name, never guessed); this model's inputs: {ours}")  # fmt: skip
        return
    extra = [name for name in ours if name not in needed]
    if extra:
        report.notes.append(f"input(s) only in this model, not fed to the reference: {extra}")
    theirs = [o.name for o in unfused.graph.output]
    common = [name for name in outputs if name in theirs]
    if not common:
        report.cannot_run = (f"this model and the reference {report.reference} share no output name (this model's: "
                             f"{outputs}; the reference's: {theirs})")  # fmt: skip
        return
    only = sorted(set(outputs) ^ set(theirs))
    if only:
        report.notes.append(f"output(s) in only one of the model and the reference, not compared: {only}")
    say("stock ORT: loading the reference ...")
    try:
        session = stock_session(unfused)
    except Exception as error:  # noqa: BLE001 - the user's reference, reported in one line
        report.cannot_run = f"stock ORT cannot load the reference: {first_line(error)}"
        return
    tolerance_dtype = loosest([compute, compute_dtype(unfused)])
    worst: Dict[str, Comparison] = {}
    for index, feed_set in enumerate(feed_sets):
        say(f"stock ORT: the reference on feed set {index + 1} ...")
        try:
            expected = session.run(None, {name: feed_set[name] for name in needed})
            fused = first_stock if index == 0 else stock.run(None, feed_set)
        except Exception as error:  # noqa: BLE001
            report.cannot_run = f"stock ORT cannot run the reference on feed set {index + 1}: {first_line(error)}"
            return
        by_name_expected = dict(zip(theirs, expected))
        by_name_fused = dict(zip([o.name for o in stock.get_outputs()], fused))
        for name in common:
            comparison = compare_arrays(name, by_name_fused[name], by_name_expected[name], atol=atol, rtol=rtol,
                                        compute_dtype=tolerance_dtype)  # fmt: skip
            if name not in worst or comparison.score > worst[name].score:
                worst[name] = comparison
    report.fusion = [worst[name] for name in common]


def first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:limit]


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
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    progress_bar: bool = False,
    reference=None,
) -> CompareReport:
    """Run ``model`` with stock ORT (CPU) and with the plugin on the same feeds; return the report and its verdict.

    ``runs`` > 1 draws that many random feed sets (seeds ``seed``, ``seed + 1``, ...) and reports each output's
    worst error over them (``report.worst_feeds`` is the set that gave it); ``progress`` (e.g. ``print``) hears
    one line per step; ``progress_bar`` shows a tqdm bar on stderr over the session runs and the per-output (and
    per-node) comparisons (mha_ep/progress.py; the CLI turns it on for a terminal only). ``atol``/``rtol``
    replace the dtype-keyed tolerances. ``reference`` (a path, bytes or ModelProto of the model before fusion)
    also runs it on stock ORT on the same feeds (matched by input name) and compares its outputs with stock ORT's
    on ``model``: verdict FUSION CHANGED THE MODEL when they differ. A model that cannot be loaded or that stock
    ORT cannot run gives verdict CANNOT RUN; bad feeds or dims (the caller's mistake) raise ValueError.
    """
    from mha_ep.graph.partition import partition
    from mha_ep.session import InferenceSession

    say = progress or (lambda line: None)
    if name is None and isinstance(model, onnx.ModelProto):
        name = model.graph.name or "model"
    label = name or (str(model) if not isinstance(model, bytes) else "model")
    try:
        original = load_model(model)
    except (OSError, ValueError) as error:
        return CompareReport(label, backend, None, cannot_run=f"the model cannot be loaded: {first_line(error)}")
    notes = []
    lifted = 0
    if lift_attention:
        from mha_ep.graph.lift import lift_attention as lift

        original, lifted = lift(original)
        notes.append(f"{lifted} Attention node(s) lifted into MHA on both sides (the lift is exact; tests/graph/test_lift.py)")
    say("shape inference and claim decisions ...")
    graph_outputs = [o.name for o in original.graph.output]
    exposed = expose_mha_outputs(original) if per_node else []
    # the remaining Attention nodes are planned again, so the report gives their reasons (not a hint to lift)
    result = partition(original, lift_attention=lift_attention)
    result.lifted_attention = lifted
    compute = compute_dtype(original)
    report = CompareReport(label, backend, result, compute_dtype=compute, notes=notes)
    if reference is not None:
        report.reference = model_label(reference)
    if feeds is not None:
        feed_sets = [dict(feeds)]
    else:
        feed_sets = [random_feeds(original, seed=seed + run, dims=dims) for run in range(max(1, runs))]
    for feed_set in feed_sets:
        check_feeds(original, feed_set)
    report.worst_feeds = feed_sets[0]

    # stock ORT's CPU kernel refuses packed inputs: it runs the node they mean, the inputs apart (graph/unpack.py)
    stock_model, unpacked = unpack_packed_attention(original)
    if unpacked.note():
        report.notes.append(unpacked.note())
    say("stock ORT: loading the model ...")
    try:
        stock = stock_session(stock_model)
    except Exception as error:  # noqa: BLE001 - e.g. an IR version it does not read, bfloat16 MHA, bad attributes
        report.cannot_run = f"stock ORT cannot load this model: {first_line(error)}"
        return report
    say("stock ORT: first run ...")
    try:
        first_stock = stock.run(None, feed_sets[0])
    except Exception as error:  # noqa: BLE001 - e.g. a node whose inputs its kernel refuses
        report.cannot_run = f"stock ORT cannot run this model on these feeds: {first_line(error)}"
        return report
    if reference is not None:
        check_reference(report, reference, stock, original, graph_outputs, feed_sets, first_stock, compute, atol,
                        rtol, say)  # fmt: skip
        if report.cannot_run:
            return report
    if result.claimed == 0:
        return report  # NOTHING CLAIMED: the plugin would run exactly what stock ORT ran

    say("plugin: creating the session ...")
    try:
        plugin = InferenceSession(result, backend=backend, device_id=device_id)
    except BackendUnavailableError as error:
        report.cannot_run = f"the plugin's backend cannot run here: {first_line(error)}"
        return report
    except Exception as error:  # noqa: BLE001 - stock ORT loaded this model, so this is the plugin's failure
        report.plugin_error = f"the plugin session could not be created where stock ORT's was: {first_line(error)}"
        return report
    report.backend = plugin.backend.name
    # the main graph's decisions come one per MHA node in graph order: match them by position, never by (possibly
    # empty) name; a subgraph's nodes (a path) have no outputs the graph can expose
    mha_nodes = [n for n in original.graph.node if is_ort_mha(n) or is_plugin_mha(n)]
    node_of_output = {}
    for index, (node, decision) in enumerate(zip(mha_nodes, [d for d in plugin.decisions if not d.path])):
        if decision.claimed:
            for out in node.output:
                if out:
                    node_of_output[out] = node.name or f"{node.op_type}_{index}"
    node_outputs = [out for out in exposed if out in node_of_output]
    compared = [(f"{node_of_output[o]} -> {o}", o) for o in node_outputs] + [(o, o) for o in graph_outputs]
    worst: Dict[str, Comparison] = {}
    worst_score = -1.0
    steps = len(feed_sets) * (2 * (repeat + 1) + len(compared))  # per feed set: both sessions' runs, each comparison
    with progress_bar_over(steps, "compare", progress_bar) as bar:
        for run, feed_set in enumerate(feed_sets, 1):
            seeded = f" (feeds seed {seed + run - 1})" if feeds is None else ""
            say(f"[{run}/{len(feed_sets)}] running both sessions{seeded}")
            step = f"[{run}/{len(feed_sets)}] " if len(feed_sets) > 1 else ""
            bar.set_description(f"compare {step}plugin runs")
            try:
                plugin_outputs, plugin_ms = _timed_run(plugin, feed_set, repeat, tick=bar.update)
            except Exception as error:  # noqa: BLE001 - MhaRunError names the node; stock ORT ran these feeds
                report.plugin_error = f"the plugin run failed where stock ORT ran: {first_line(error)}"
                report.worst_feeds = feed_set
                return report
            bar.set_description(f"compare {step}stock ORT runs")
            try:
                made = first_stock if run == 1 else None
                stock_outputs, stock_ms = _timed_run(stock, feed_set, repeat, made, bar.update)
            except Exception as error:  # noqa: BLE001
                report.cannot_run = f"stock ORT cannot run this model on feed set {run}: {first_line(error)}"
                return report
            report.plugin_ms, report.stock_ms = max(report.plugin_ms, plugin_ms), max(report.stock_ms, stock_ms)
            by_name_plugin = dict(zip([o.name for o in plugin.get_outputs()], plugin_outputs))
            by_name_stock = dict(zip([o.name for o in stock.get_outputs()], stock_outputs))
            bar.set_description(f"compare {step}" + ("per-node and output errors" if node_outputs else "output errors"))
            for key, out in compared:
                comparison = compare_arrays(key, by_name_plugin[out], by_name_stock[out], atol=atol, rtol=rtol,
                                            compute_dtype=compute)  # fmt: skip
                if key not in worst or comparison.score > worst[key].score:
                    worst[key] = comparison
                if comparison.score > worst_score:
                    worst_score, report.worst_feeds = comparison.score, feed_set
                bar.update()
    report.nodes = [worst[f"{node_of_output[o]} -> {o}"] for o in node_outputs]
    report.outputs = [worst[o] for o in graph_outputs]
    if len(feed_sets) > 1:
        report.notes.append(f"worst of {len(feed_sets)} feed sets (seeds {seed}..{seed + len(feed_sets) - 1}); "
                            f"times are the slowest set's")  # fmt: skip
    return report
