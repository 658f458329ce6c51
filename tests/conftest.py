"""Shared fixtures: one test body runs against every backend.

``backend`` is "reference" everywhere and "cuda" too when CuPy and a GPU are usable; the cuda case carries the
``gpu`` marker, so ``pytest -m gpu`` selects it on the device machine and CPU machines skip it cleanly.
"""

from __future__ import annotations

import signal
import zlib

import numpy as np
import pytest

from mha_ep.engine.backends import cuda_unavailable_reason



def pytest_configure(config) -> None:
    """A suite started in the background by a shell without job control (``bash .ci/run &``) inherits SIGINT
    ignored, and so would every child the Ctrl-C tests start: their SIGINTs would be lost (tests/python_op/
    test_interrupts.py, tests/serve/test_serve_cli.py). Take Python's own handler back, as an interactive start has
    it; the children then start with SIGINT's default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Tolerances against stock ORT CPU, relative to max(1, |expected|).
PARITY_TOLERANCE = {"float32": 1e-5, "float16": 4e-3}


@pytest.fixture(params=["reference", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request) -> str:
    if request.param == "cuda":
        reason = cuda_unavailable_reason(0)
        if reason is not None:
            pytest.skip(f"cuda backend unavailable: {reason}")
    return request.param


def cuda_provider_unavailable_reason() -> str | None:
    """None when the cuda backend and ORT's CUDA provider can both run here (CuPy, a GPU, onnxruntime-gpu)."""
    reason = cuda_unavailable_reason(0)
    if reason is not None:
        return f"cuda backend unavailable: {reason}"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    return None


def native_cuda_unavailable_reason() -> str | None:
    """None when the native route's CUDA kernels can run here (the library, CuPy and a GPU, onnxruntime-gpu)."""
    from mha_ep import native

    return native.unavailable_reason() or cuda_provider_unavailable_reason()


@pytest.fixture(params=["reference", "reference-native", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda-native", marks=pytest.mark.gpu)])  # fmt: skip
def run_backend(request) -> str:
    """``backend`` plus the other ways a suite's model runs, built with tests/mha_models.plugin_session:
    "reference-native" (the native library's CPU kernels: its ABI layer, checked on every CPU machine) and
    "cuda-native" (the native library's CUDA kernels in one ORT CUDA session)."""
    if request.param == "reference-native":
        from mha_ep import native

        reason = native.unavailable_reason()
        if reason is not None:  # CI builds it: a missing library is a failure there, not a skip
            pytest.fail(reason)
    if request.param == "cuda":
        reason = cuda_unavailable_reason(0)
        if reason is not None:
            pytest.skip(f"cuda backend unavailable: {reason}")
    if request.param == "cuda-native":
        reason = native_cuda_unavailable_reason()
        if reason is not None:
            pytest.skip(f"the native route's CUDA kernels cannot run here: {reason}")
    return request.param


@pytest.fixture(scope="module")
def native_cupy():
    """CuPy, where the native route's CUDA kernels can run (onnxruntime-gpu's libraries preloaded), or a clean skip
    naming what is missing (the static decode loops' GPU tests)."""
    reason = native_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native route's CUDA kernels cannot run here: {reason}")
    import onnxruntime as ort

    ort.preload_dlls()
    import cupy

    return cupy


@pytest.fixture(scope="module")
def cupy_module():
    """CuPy with a usable GPU, or a clean skip (the GPU tests of the cuda backend and the fused kernel)."""
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - no driver, no device
        pytest.skip(f"no usable CUDA GPU ({type(error).__name__})")
    if count == 0:
        pytest.skip("no CUDA GPU is visible")
    return cupy


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test's name (printed on failure by pytest)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def max_rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - e| / max(1, |e|), NaN-aware: NaN in both places counts as equal, NaN in one is infinite error;
    equal infinities are equal."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != expected {e.shape}")
    both_nan = np.isnan(a) & np.isnan(e)
    one_nan = np.isnan(a) ^ np.isnan(e)
    if one_nan.any():
        return float("inf")
    same = both_nan | (a == e)  # equal infinities too (qk holds -inf where mask_filter_value is -inf)
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(a - e) / np.maximum(1.0, np.abs(np.where(same, 0.0, e))))
    return float(diff.max()) if diff.size else 0.0


def skip_reason(report) -> str:
    """The reason of a skipped test's report, without pytest's file:line prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """One line per reason for the skipped tests, most frequent first (a CPU run skips every GPU case)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    counts: dict[str, int] = {}
    for report in skipped:
        reason = skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.write_line(f"{count:6d}  {reason}")
