"""The benchmarks' command line, without a GPU: each ``mha-ep bench WHAT --help`` shows that benchmark's own
options, and ``--json`` / ``--out`` mean what they mean in the rest of mha-ep (fake results stand in for timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_bench(*args):
    return subprocess.run([sys.executable, "-m", "mha_ep", "bench", *args], capture_output=True, text=True, timeout=300)


def test_bench_hook_help_shows_the_hook_benchmarks_own_options():
    done = run_bench("hook", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: mha-ep bench hook") and "--repeats" in done.stdout
    assert "the bridge" in done.stdout  # its own description, not the list of benchmarks


def test_bench_without_a_known_benchmark_is_a_usage_error():
    for argv in ([], ["nonsense"]):
        done = run_bench(*argv)
        assert done.returncode == 2 and "hook" in done.stderr and "Traceback" not in done.stderr, done.stderr


# ------------------------------------------------------------------ --json: one object on stdout, the table on stderr
def bench_in_process(capsys, *argv):
    from mha_ep.bench import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bench_hook_json_prints_one_object_and_out_writes_it(monkeypatch, capsys, tmp_path):
    from mha_ep.bench import hook

    fake = {"echo": [{"elements": 1024, "stock_ms": 0.05, "array_ms": 0.01, "gb_per_s": 0.4}], "mha_overhead": {}}

    def fake_bench(repeat):
        print("| the hook table |")
        return fake

    monkeypatch.setattr(hook, "bench_hook", fake_bench)
    code, out, err = bench_in_process(capsys, "hook", "--repeats", "1", "--json", "--out", str(tmp_path))
    assert code == 0 and json.loads(out) == fake
    assert "| the hook table |" in err and f"wrote {tmp_path / 'bench_hook.json'}" in err
    assert json.loads((tmp_path / "bench_hook.json").read_text()) == fake
    code, out, err = bench_in_process(capsys, "hook", "--repeats", "1")  # without --json: the table, no JSON
    assert code == 0 and out == "| the hook table |\n"


def test_bench_device_json_prints_its_rows_as_one_object(monkeypatch, capsys):
    import onnxruntime

    from mha_ep.bench import device

    monkeypatch.setattr(onnxruntime, "preload_dlls", lambda: None, raising=False)
    fake = {"label": "fake row", "max_rel_error_vs_ort_cuda": 1e-6, **{f"{c}_ms": 1.0 for c in device.COLUMNS}}
    monkeypatch.setattr(device, "bench_encoder", lambda row, repeats, skip=(): dict(fake, label=row.label))
    code, out, err = bench_in_process(capsys, "device", "--only", "S=128 float32", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["label"] for r in rows] == ["BERT-base encoder B=8 S=128 float32 2D mask"]
    assert "| BERT-base encoder B=8 S=128 float32 2D mask | 1.00 |" in err


def test_bench_device_out_writes_the_object_json_prints(monkeypatch, capsys, tmp_path):
    import onnxruntime

    from mha_ep.bench import device

    monkeypatch.setattr(onnxruntime, "preload_dlls", lambda: None, raising=False)
    fake = {"label": "fake row", "max_rel_error_vs_ort_cuda": 1e-6, **{f"{c}_ms": 1.0 for c in device.COLUMNS}}
    monkeypatch.setattr(device, "bench_encoder", lambda row, repeats, skip=(): dict(fake, label=row.label))
    monkeypatch.setattr(device, "plot", lambda results, path: False)
    code, out, err = bench_in_process(capsys, "device", "--only", "S=128 float32", "--json", "--out", str(tmp_path))
    assert code == 0, err
    assert json.loads((tmp_path / "bench_device.json").read_text()) == json.loads(out)
    assert [p.name for p in tmp_path.iterdir()] == ["bench_device.json"]  # no temporary file left beside it


def test_a_failed_json_write_leaves_the_old_file_whole(monkeypatch, tmp_path):
    from mha_ep.bench import output

    output.write_json(str(tmp_path), "bench_x.json", {"old": 1})

    class Unserialisable:
        def __str__(self):
            raise RuntimeError("cannot write this")

    with pytest.raises(RuntimeError, match="cannot write this"):
        output.write_json(str(tmp_path), "bench_x.json", {"new": Unserialisable()})
    assert json.loads((tmp_path / "bench_x.json").read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["bench_x.json"]


def test_bench_anchors_json_prints_one_object_and_still_writes_its_folder(monkeypatch, capsys, tmp_path):
    from types import SimpleNamespace

    from mha_ep.bench import gpu
    from mha_ep.engine import backends

    monkeypatch.setattr(backends, "create_backend", lambda name, device_id: SimpleNamespace(device="fake GPU"))
    monkeypatch.setattr(gpu, "pinned_bandwidth", lambda: (1e10, 1e10))
    monkeypatch.setattr(gpu, "ort_cuda_available", lambda: False)
    keys = ("kernel_us", "tflops", "host_us", "floor_us", "host_over_floor", "ort_cpu_us", "ort_cuda_dev_us",
            "ort_cuda_host_us", "sdpa_us")  # fmt: skip
    monkeypatch.setattr(gpu, "bench_row", lambda label, *shape, **kw: {"label": label, **dict.fromkeys(keys)})
    code, out, err = bench_in_process(capsys, "anchors", "--no-sweep", "--only", "causal", "--json", "--out", str(tmp_path))
    assert code == 0, err
    data = json.loads(out)
    assert data["device"] == "fake GPU" and data["sweep"] == [] and len(data["anchors"]) >= 1
    assert data == json.loads((tmp_path / "bench.json").read_text())
    assert "| shape (B,S,T,N,H) dtype extra |" in err and "wrote " in err


def test_an_old_json_file_argument_is_a_usage_error():
    done = run_bench("models", "--json", "rows.json")
    assert done.returncode == 2 and "unrecognized arguments: rows.json" in done.stderr, done.stderr


# ------------------------------------------------------------------ every option of every command has help text
class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__(parser.prog)
        self.parser = parser


def bench_parser(monkeypatch, module_name):
    """The parser a benchmark's main(argv) builds, caught at parse_args (nothing runs, no GPU needed)."""
    import argparse
    import importlib

    def catch(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as caught:
        importlib.import_module(f"mha_ep.bench.{module_name}").main([])
    return caught.value.parser


def test_every_option_of_every_subcommand_and_benchmark_has_help(monkeypatch):
    from mha_ep.bench import BENCHMARKS
    from mha_ep.cli import build_parser

    parser = build_parser()
    parsers = {"mha-ep": parser}
    parsers.update({f"mha-ep {name}": sub for name, sub in next(a for a in parser._actions if a.dest == "command").choices.items()
                    if name != "bench"})  # fmt: skip
    for module in [*BENCHMARKS.values(), "fused_timing", "backend_timing"]:
        parsers[f"mha_ep.bench.{module}"] = bench_parser(monkeypatch, module)
    assert len(parsers) == 1 + 5 + 9 + 2  # mha-ep; demo, partition, compare, static-cache, serve; the benchmarks
    missing = [f"{name} {action.option_strings or action.dest}" for name, p in parsers.items()
               for action in p._actions if "-h" not in action.option_strings and not action.help]  # fmt: skip
    assert missing == []


def test_every_benchmark_takes_json_and_out(monkeypatch):
    from mha_ep.bench import BENCHMARKS

    for what, module in BENCHMARKS.items():
        options = {o for action in bench_parser(monkeypatch, module)._actions for o in action.option_strings}
        assert {"--json", "--out"} <= options, what
