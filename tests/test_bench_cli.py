"""The benchmarks' command line, without a GPU: each ``mha-ep bench WHAT --help`` shows that benchmark's own
options, and ``--json`` / ``--out`` mean what they mean in the rest of mha-ep (fake results stand in for timings)."""

from __future__ import annotations

import subprocess
import sys


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
