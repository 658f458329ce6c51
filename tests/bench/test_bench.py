"""The benchmarks' host-side pieces that run anywhere: timing in turns, the floor's echo session, the anchor table;
and the rule that keeps them out of the library: nothing under mha_ep/ops imports mha_ep.bench or parses a command
line."""

from __future__ import annotations

import numpy as np

import mha_ep
from mha_ep.bench import gpu as bench_gpu
from mha_ep.bench.anchors import ANCHORS, anchor_problem, flop_count
from mha_ep.bench.timer import paired_medians
from mha_ep.ops.registration import ORT_SPINNING


def test_paired_medians_times_the_functions_in_turns():
    calls = []
    medians = paired_medians([lambda: calls.append("a"), lambda: calls.append("b")], repeats=5, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 5
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_the_floor_echo_session_moves_the_plugin_bytes_with_the_plugin_sessions_settings():
    row = (1, 16, 24, 2, 8, "float16", "mask2d")
    problem = anchor_problem(*row)
    model = bench_gpu.anchor_model(*row)
    feeds = bench_gpu.anchor_feeds(problem, row[5])
    plugin = mha_ep.InferenceSession(model, backend="reference")
    echo = bench_gpu.echo_session(plugin.model, bench_gpu.plugin_like_options(plugin))
    assert echo.get_session_options().get_session_config_entry(ORT_SPINNING) == (
        plugin.get_session_options().get_session_config_entry(ORT_SPINNING)
    )
    (echoed,) = echo.run(None, feeds)
    (computed,) = plugin.run(None, feeds)
    assert echoed.shape == computed.shape == (1, 16, 16) and echoed.dtype == np.float16


def test_the_floor_echo_hands_its_output_back_as_an_array_like_the_plugin(monkeypatch):
    """The floor must move the bytes the way the plugin does: through the array path of mha_ep's own ops, not
    the stock hook's ``flatten().tolist()`` (which made the floor 30x the plugin's own time)."""
    from onnxruntime_extensions import _ocos

    row = (1, 16, 24, 2, 8, "float32", "")
    model = bench_gpu.anchor_model(*row)
    plugin = mha_ep.InferenceSession(model, backend="reference")
    echo = bench_gpu.echo_session(plugin.model, bench_gpu.plugin_like_options(plugin))

    stock, through_stock = _ocos._on_pyop_invocation, []

    def stock_hook(*args):  # records and delegates: raising inside the bridge would abort the process
        through_stock.append(args[0])
        return stock(*args)

    monkeypatch.setattr(_ocos, "_on_pyop_invocation", stock_hook)
    (echoed,) = echo.run(None, bench_gpu.anchor_feeds(anchor_problem(*row), row[5]))
    assert echoed.shape == (1, 16, 16) and not through_stock


def test_the_anchor_table_and_flop_model():
    assert len({row.label for row in ANCHORS}) == len(ANCHORS) == 10
    row = next(row for row in ANCHORS if row.extra == "causal")
    problem = anchor_problem(*row.shape)
    assert flop_count(problem) == 4 * row.b * row.n * row.s * row.t * row.h // 2


def test_nothing_under_ops_imports_a_benchmark_or_parses_a_command_line():
    from pathlib import Path

    ops = Path(mha_ep.__file__).parent / "ops"
    offenders = [
        str(path.relative_to(ops))
        for path in ops.rglob("*.py")
        if any(word in path.read_text() for word in ("mha_ep.bench", "argparse", "sys.argv", "__main__"))
    ]
    assert offenders == []


def test_the_dispatch_rules_import_without_cupy():
    import subprocess
    import sys

    code = ("import sys; sys.modules['cupy'] = None; "  # any import of CuPy now raises ImportError
            "from mha_ep.ops.backends.cuda import dispatch, fused, geometry, kernels; "
            "print(dispatch.choose_tile.__name__)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "choose_tile", done.stderr
