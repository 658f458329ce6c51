"""The GPU bench's host-side pieces that run anywhere: timing in turns, and the floor's echo session."""

from __future__ import annotations

import numpy as np

import mha_ep
from mha_ep import bench_gpu
from mha_ep.ops.backends.cuda.timing import anchor_problem
from mha_ep.ops.registration import ORT_SPINNING


def test_paired_medians_times_the_functions_in_turns():
    calls = []
    medians = bench_gpu.paired_medians([lambda: calls.append("a"), lambda: calls.append("b")], repeats=5, warmup=1)
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
