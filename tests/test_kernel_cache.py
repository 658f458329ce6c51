"""kernels.compile_arch_kernel's on-disk cache (the sm_90a build path of the Hopper fused kernel), on CPU.

NVRTC, CuPy's module loader and the CUDA include lookup are replaced by fakes that record their calls, so these
tests check the cache rules themselves: compile once, reuse across processes (a cleared memo), key on the source,
write whole entries only, and work without a writable cache directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mha_ep.ops.backends.cuda import kernels

CODE = "template <int N> __global__ void k() {}"
NAME = "k<1>"


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    """Fake compiler and loader; the cache in tmp_path/cache; an empty per-process memo."""
    calls = {"compile": [], "load": []}

    def compile_(code, name, options):
        calls["compile"].append((code, name, options))
        return b"CUBIN:" + code.encode(), "_Z1kILi1EEvv"

    def load(path, lowered):
        data = Path(path).read_bytes()
        calls["load"].append((Path(path), lowered, data))
        return object(), ("kernel", lowered, data)

    monkeypatch.setattr(kernels, "_nvrtc_compile", compile_)
    monkeypatch.setattr(kernels, "_load", load)
    monkeypatch.setattr(kernels, "_nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(kernels, "cuda_include_options", lambda: ("-I/fake/include",))
    monkeypatch.setattr(kernels, "_arch_kernels", {})
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    return calls


def test_compiles_once_then_reuses_the_disk_entry(fake_nvrtc, tmp_path, monkeypatch):
    first = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert first == ("kernel", "_Z1kILi1EEvv", b"CUBIN:" + CODE.encode())
    (_, _, options), = fake_nvrtc["compile"]
    assert options[-2:] == ("--gpu-architecture=sm_90a", "-I/fake/include") and "--std=c++17" in options
    entries = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert entries == [".cubin", ".name"], entries  # no temporary file left behind

    assert kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a") is first  # memo: no load either
    assert len(fake_nvrtc["load"]) == 1

    monkeypatch.setattr(kernels, "_arch_kernels", {})  # a new process
    again = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert again == first and len(fake_nvrtc["compile"]) == 1 and len(fake_nvrtc["load"]) == 2


def test_a_changed_source_or_arch_is_a_new_entry(fake_nvrtc, tmp_path):
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    kernels.compile_arch_kernel(0, CODE + "\n// edited", NAME, "sm_90a")
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_100a")
    assert len(fake_nvrtc["compile"]) == 3
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 3


def test_an_entry_without_its_cubin_is_rebuilt(fake_nvrtc, tmp_path, monkeypatch):
    """The name is written first and the cubin last: a name alone (an interrupted writer) is no entry."""
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    (cubin,) = (tmp_path / "cache").glob("*.cubin")
    cubin.unlink()
    monkeypatch.setattr(kernels, "_arch_kernels", {})
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert len(fake_nvrtc["compile"]) == 2 and cubin.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_cache_directory_still_gives_the_kernel(fake_nvrtc, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    finally:
        cache.chmod(stat.S_IRWXU)
    assert kernel[2] == b"CUBIN:" + CODE.encode()
    assert list(cache.iterdir()) == []


def test_a_cache_path_that_is_a_file_still_gives_the_kernel(fake_nvrtc, tmp_path, monkeypatch):
    """(The same rule where permissions cannot be taken away, e.g. as root: mkdir fails with an OSError.)"""
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    monkeypatch.setenv(kernels.CACHE_ENV, str(blocker / "kernels"))
    kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert kernel[2] == b"CUBIN:" + CODE.encode()
    loaded_from = fake_nvrtc["load"][0][0]
    assert not loaded_from.exists()  # the temporary file is gone again


def test_local_includes_are_inlined_once_and_system_ones_kept():
    text = kernels.expand_includes('#include "flash_common.cuh"\n#include "common.cuh"\n#include <cuda_fp16.h>\n')
    assert text.count("struct MaskParams {") == 1
    assert text.count("__device__ __forceinline__ T from_float(float x);") == 1  # common.cuh once, not twice
    assert not any(line.startswith('#include "') for line in text.splitlines())
    assert "#include <cuda_fp16.h>" in text
