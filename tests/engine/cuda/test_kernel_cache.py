"""kernels.compile_arch_kernel's on-disk cache (the sm_90a build path of the Hopper fused kernel), on CPU.

NVRTC, CuPy's module loader and the CUDA include lookup are replaced by fakes that record their calls, so these
tests check the cache rules themselves: compile once, reuse across processes (a cleared memo), key on the source,
write whole entries only, work without a writable cache directory, refuse a folder or entry another user could
have written (GPU code would run from it), and rebuild an entry whose cubin does not match its checksum.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from mha_ep.engine.cuda import kernels

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
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    return calls


def test_compiles_once_then_reuses_the_disk_entry(fake_nvrtc, tmp_path, monkeypatch):
    first = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert first == ("kernel", "_Z1kILi1EEvv", b"CUBIN:" + CODE.encode())
    (_, _, options), = fake_nvrtc["compile"]
    assert options[-2:] == ("--gpu-architecture=sm_90a", "-I/fake/include") and "--std=c++17" in options
    entries = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert entries == [".cubin", ".meta"], entries  # no temporary file left behind

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
    """The cubin is written first and its metadata last: a lone file (an interrupted writer) is no entry."""
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


def _new_process(monkeypatch):
    monkeypatch.setattr(kernels, "_arch_kernels", {})


def test_a_corrupt_cubin_is_rebuilt(fake_nvrtc, tmp_path, monkeypatch, caplog):
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    (cubin,) = (tmp_path / "cache").glob("*.cubin")
    cubin.write_bytes(b"CUBIN:trunc")  # a damaged entry: every later process would load it and fail
    _new_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mha_ep"):
        kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert kernel[2] == b"CUBIN:" + CODE.encode()
    assert len(fake_nvrtc["compile"]) == 2 and cubin.read_bytes() == b"CUBIN:" + CODE.encode()
    assert "corrupt" in caplog.text and "rebuilding" in caplog.text

    _new_process(monkeypatch)  # the rebuilt entry is whole again: loaded, not compiled
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert len(fake_nvrtc["compile"]) == 2


def test_unreadable_metadata_is_rebuilt(fake_nvrtc, tmp_path, monkeypatch):
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    (meta,) = (tmp_path / "cache").glob("*.meta")
    meta.write_text("{not json")
    _new_process(monkeypatch)
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert len(fake_nvrtc["compile"]) == 2 and json.loads(meta.read_text())["lowered"] == "_Z1kILi1EEvv"


def test_the_entry_records_its_checksum(fake_nvrtc, tmp_path):
    import hashlib

    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    (meta,) = (tmp_path / "cache").glob("*.meta")
    (cubin,) = (tmp_path / "cache").glob("*.cubin")
    assert json.loads(meta.read_text())["sha256"] == hashlib.sha256(cubin.read_bytes()).hexdigest()


def test_a_new_cache_folder_is_private(fake_nvrtc, tmp_path):
    kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) & 0o077 == 0
    for path in (tmp_path / "cache").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH) == 0


def _plant(folder: Path, monkeypatch) -> None:
    """Another user's entry for exactly this kernel (the key is a hash of public inputs), in ``folder``."""
    planted = kernels._cached_or_compiled  # compute the real key by writing an entry, then replace its cubin
    planted(CODE, NAME, ("--std=c++17", "-ftz=true", "--gpu-architecture=sm_90a", "-I/fake/include"))
    import hashlib

    for cubin in folder.glob("*.cubin"):
        evil = b"EVIL GPU CODE"
        cubin.write_bytes(evil)
        meta = cubin.with_suffix(".meta")
        meta.write_text(json.dumps({"lowered": "_Z1kILi1EEvv", "sha256": hashlib.sha256(evil).hexdigest()}))


def test_a_group_writable_cache_folder_is_refused_with_a_warning(fake_nvrtc, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    _plant(cache, monkeypatch)
    fake_nvrtc["compile"].clear()
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="mha_ep"):
        kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert kernel[2] == b"CUBIN:" + CODE.encode()  # compiled, not the planted cubin
    assert len(fake_nvrtc["compile"]) == 1
    assert all(data != b"EVIL GPU CODE" for _, _, data in fake_nvrtc["load"])
    assert "group- or world-writable" in caplog.text and str(cache) in caplog.text
    assert {p.read_bytes() for p in cache.glob("*.cubin")} == {b"EVIL GPU CODE"}  # nothing written there either


def test_a_group_writable_entry_is_refused_and_replaced(fake_nvrtc, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    _plant(cache, monkeypatch)
    fake_nvrtc["compile"].clear()
    (cubin,) = cache.glob("*.cubin")
    cubin.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="mha_ep"):
        kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert kernel[2] == b"CUBIN:" + CODE.encode() and len(fake_nvrtc["compile"]) == 1
    assert "group- or world-writable" in caplog.text
    assert cubin.read_bytes() == b"CUBIN:" + CODE.encode()  # the user's own folder: the entry is rebuilt
    assert stat.S_IMODE(cubin.stat().st_mode) & 0o022 == 0


def test_a_cache_folder_of_another_user_is_refused(fake_nvrtc, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    _plant(cache, monkeypatch)
    fake_nvrtc["compile"].clear()
    real_uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_uid + 1)  # as seen by another user
    with caplog.at_level(logging.WARNING, logger="mha_ep"):
        kernel = kernels.compile_arch_kernel(0, CODE, NAME, "sm_90a")
    assert kernel[2] == b"CUBIN:" + CODE.encode() and len(fake_nvrtc["compile"]) == 1
    assert f"owned by uid {real_uid}, not by this user" in caplog.text
