"""The benchmarks' host-side pieces that run anywhere: timing in turns, the floor's echo session, the anchor table;
and the rule that keeps them out of the library: nothing under mha_ep/engine, python_op or native imports mha_ep.bench or parses a command
line."""

from __future__ import annotations

import numpy as np

import pytest

import mha_ep
from mha_ep.bench import gpu as bench_gpu
from mha_ep.bench.anchors import ANCHORS, anchor_problem, flop_count
from mha_ep.bench.timer import paired_medians
from mha_ep.registration import ORT_SPINNING


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


def counted_flops(problem) -> int:
    """The naive attention's arithmetic, counted: for every (b, n, i, j) a query row attends, H multiply-adds of
    the score and Hv of P.V, two FLOPs each (the pairs a causal row cannot see are not counted)."""
    from mha_ep.engine.reference import FLOAT32_LOWEST, additive_mask_BST

    g = problem.geometry
    mask_BST = additive_mask_BST(problem)
    causal_pairs = g.q_seq * g.total_seq if not problem.causal else int((mask_BST[0] != FLOAT32_LOWEST).sum())
    return 2 * g.batch * g.num_heads * causal_pairs * (g.head_size + g.v_head_size)


@pytest.mark.parametrize("shape", [(2, 7, 5, 3, 8, "float32", None), (1, 6, 6, 2, 16, "float16", "mask2d"),
                                   (1, 6, 6, 2, 8, "float32", "causal")])  # fmt: skip
def test_the_flop_model_is_the_naive_attention_s_arithmetic(shape):
    """flop_count against a count of the multiply-adds: equal without causal masking; with it, a square call's
    triangle holds S (S + 1) / 2 pairs, which the model's one half counts as S^2 / 2."""
    problem = anchor_problem(*shape)
    counted = counted_flops(problem)
    if problem.causal:
        s = problem.geometry.q_seq
        assert counted * s == flop_count(problem) * (s + 1), (counted, flop_count(problem))
    else:
        assert counted == flop_count(problem)


def test_the_anchor_table():
    assert len({row.label for row in ANCHORS}) == len(ANCHORS) == 10
    assert sum(row.extra == "causal" for row in ANCHORS) >= 1


def test_nothing_under_the_engine_or_the_ops_imports_a_benchmark_or_parses_a_command_line():
    from pathlib import Path

    package = Path(mha_ep.__file__).parent
    paths = [path for folder in ("engine", "python_op", "native") for path in (package / folder).rglob("*.py")]
    assert len(paths) > 20  # the folders are there: the check reads real files
    offenders = [
        str(path.relative_to(package))
        for path in paths
        if any(word in path.read_text() for word in ("mha_ep.bench", "argparse", "sys.argv", "__main__"))
    ]
    assert offenders == []


def test_the_dispatch_rules_import_without_cupy():
    import subprocess
    import sys

    code = ("import sys; sys.modules['cupy'] = None; "  # any import of CuPy now raises ImportError
            "from mha_ep.engine.cuda import dispatch, fused, geometry, kernels; "
            "print(dispatch.choose_tile.__name__)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "choose_tile", done.stderr
