"""``mha-ep demo``: plugin vs stock ORT on the shipped models (found by mha_ep/shipped.py; see their MANIFEST.json).

For every shipped BERT and Whisper model: partition it (claim report), run it with the plugin and with stock ORT
on the same valid feeds, and print per-output errors (per node with --per-node) and timings. Exit status 0 only
when every model's outputs match stock ORT within the dtype tolerances of mha_ep/comparison/maths.py.
"""

from __future__ import annotations

import sys
import time

from mha_ep.comparison import compare, table
from mha_ep.models import manifest
from mha_ep.engine.backends import cuda_unavailable_reason
from mha_ep.progress import bar as progress_bar_over
from mha_ep.progress import write


def describe_backend(backend: str, device_id: int) -> str:
    if backend == "reference":
        return "reference (NumPy, reproduces stock ORT's CPU math), as asked"
    reason = cuda_unavailable_reason(device_id)
    if reason is None:
        return f"cuda (CuPy on GPU {device_id})"
    if backend == "cuda":
        return f"cuda was asked for but cannot run: {reason}"
    return f"reference (NumPy): no usable GPU here ({reason})"


def run_demo(backend: str = "auto", device_id: int = 0, per_node: bool = False, out=sys.stdout, as_json=False,
             progress_bar: bool = False) -> int:  # fmt: skip
    """``progress_bar``: a tqdm bar over the models on stderr (mha_ep/progress.py; the CLI's rule: a terminal only)."""
    if as_json:  # the same run; the text goes nowhere and one JSON object goes to ``out``
        import io
        import json

        rows: list = []
        code = _run(backend, device_id, per_node, io.StringIO(), rows, progress_bar)
        data = {"verdict": "PASS" if code == 0 else "FAIL", "exit_code": code, "models": [r.to_dict() for r in rows]}
        print(json.dumps(data, indent=2, default=str), file=out)
        return code
    return _run(backend, device_id, per_node, out, [], progress_bar)


def _run(backend, device_id, per_node, out, reports, progress_bar=False) -> int:
    entries = manifest.load()["models"]
    print(f"mha_ep demo: {len(entries)} shipped models; backend: {describe_backend(backend, device_id)}", file=out)
    if backend == "auto":  # said above, so the sessions need not say it again
        backend = "cuda" if cuda_unavailable_reason(device_id) is None else "reference"
    elif backend == "cuda" and cuda_unavailable_reason(device_id) is not None:
        return 2  # the header said why
    rows = []
    started = time.perf_counter()
    with progress_bar_over(len(entries), "demo", progress_bar, unit="model") as bar:
        for index, entry in enumerate(entries, 1):
            bar.set_postfix_str(entry["file"])
            write(f"\n[{index}/{len(entries)}] {entry['file']}: {entry['description']}", file=out)
            report = compare(
                manifest.model_path(entry),
                feeds=manifest.make_feeds(entry, seed=index),
                backend=backend,
                device_id=device_id,
                per_node=per_node,
                name=entry["file"],
            )
            write(report.text(), file=out)
            worst = max((c.max_rel for c in report.outputs + report.nodes), default=0.0)
            reports.append(report)
            rows.append((entry["file"], report, worst))
            bar.update()
    print(f"\nsummary ({time.perf_counter() - started:.1f} s):", file=out)
    header = ["model", "MHA", "claimed", "declined", "worst rel err", "stock ms", "plugin ms", "verdict"]
    body = [
        [name, len(r.partition.decisions), r.partition.claimed, r.partition.declined, f"{worst:.2e}",
         f"{r.stock_ms:.2f}", f"{r.plugin_ms:.2f}", r.verdict.value]
        for name, r, worst in rows
    ]  # fmt: skip
    for line in table(header, body):
        print(line, file=out)
    failed = [name for name, report, _ in rows if not report.passed]
    total_claimed = sum(r.partition.claimed for _, r, _ in rows)
    total_declined = sum(r.partition.declined for _, r, _ in rows)
    print(f"  {total_claimed} MHA nodes claimed, {total_declined} declined, in {len(rows)} models", file=out)
    if failed:
        print(f"FAIL: {len(failed)} model(s) differ from stock ORT beyond tolerance: {', '.join(failed)}", file=out)
        return 1
    print("PASS: every model's outputs match stock ORT within tolerance", file=out)
    return 0
