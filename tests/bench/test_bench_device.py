"""The device benchmark's host-side pieces on the CPU: the FLOP model, timing in turns, the table row, the plot,
and its options (the GPU columns themselves run on the device: docs/DEVICE_RUNBOOK.md)."""

from __future__ import annotations

import pytest

from mha_ep.bench import device


def fake_result(label: str = "row", scale: float = 1.0) -> dict:
    result = {f"{column}_ms": scale * (index + 1) for index, column in enumerate(device.COLUMNS)}
    result.update(label=label, max_rel_error_vs_ort_cuda=2e-3)
    return result


def test_the_encoder_flop_model_counts_dense_layers_and_attention():
    row = device.EncoderRow(batch=2, sequence=4, dtype="float32", layers=1)
    dense = 2 * 2 * 4 * (4 * 768 * 768 + 2 * 768 * 3072)
    attention = 4 * 2 * 12 * 4 * 4 * 64
    assert row.flops() == dense + attention


def test_calls_are_timed_in_turns_and_the_slow_ones_in_at_most_five_rounds():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "python_op")}
    medians = device.time_in_turns(calls, repeats=8)
    assert set(medians) == {"a", "b", "python_op"}
    fast = [name for name in order if name != "python_op"]
    assert fast[4:20] == ["a", "b"] * 8, fast  # after each one's two warm-up calls: a, b, a, b, ...
    assert order.count("python_op") == 2 + 5


def test_a_row_prints_every_column_and_the_target_ratios():
    line = device.format_row(fake_result())
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    width = len(device.COLUMNS)
    assert cells[0] == "row" and len(cells) == 1 + width + len(device.RATIOS) + 1
    columns = dict(zip(device.COLUMNS, map(float, cells[1 : 1 + width])))
    ratios = list(map(float, cells[1 + width : 1 + width + len(device.RATIOS)]))
    assert ratios == [round(columns["nat_numpy"] / columns["ort_numpy"], 2),
                      round(columns["nat_feeds"] / columns["ort_iobinding"], 2),
                      round(columns["nat_graph_feeds"] / columns["ort_graph"], 2),
                      round(columns["nat_graph"] / columns["ort_graph_numpy"], 2),
                      round(columns["python_op"] / columns["nat_numpy"], 2)]  # fmt: skip
    assert not any(column.startswith("dev_") for column in device.COLUMNS)  # device mode is retired


def test_the_plot_is_a_png_with_a_bar_per_column_and_row(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench_device.png"
    assert device.plot([fake_result("one"), fake_result("two", 3.0)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_options_have_help(capsys):
    with pytest.raises(SystemExit) as done:
        device.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in ("--repeats", "--only", "--layers", "--rows", "--models-dir", "--out"):
        assert option in text
