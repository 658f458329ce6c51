"""Kernel sources (kernels/*.cu, and any other .cu file of the package) compiled lazily through NVRTC: the one
compile cache of every kernel.

``get_function(device, "kernel<args>")`` is the lookup of every launch, memoised per (device, name expression) for
the life of the process: a call never compiles twice. A .cu file outside KERNELS / INSTANTIATED (the decode loop's
decode.cu, a graph replay's copy_segments.cu) goes through ``source_function(device, path, name, expressions)``,
the same memo keyed by the file. The element-wise kernels (KERNELS: layout movers, softmax)
are built as one ``cupy.RawModule`` per (device, source file) with the name expressions of every dtype and
variant; each fused attention instantiation (INSTANTIATED) is its own module, built on first use. Local ``#include "..."`` lines are inlined
here (kernel_source), so the code CuPy hashes for its on-disk cache is the whole source (a header change is never
served a stale binary).

Architecture-specific kernels (the Hopper fused kernel's wgmma needs ``sm_90a`` code, which CuPy's NVRTC path
cannot target: it always passes the device's plain ``sm_XY``) go through ``compile_arch_kernel``: NVRTC called
directly, the cubin kept under ``kernel_cache_dir()`` keyed by a hash of the source, options and NVRTC version.
The cache is GPU code the process will run, so it is trusted only as far as it is private: a cache folder or entry
that another user owns or may write (group- or world-writable) is refused with a warning and the kernel compiled
in memory; each entry carries its cubin's SHA-256 in its own metadata, and an entry that does not match (a
truncated or damaged file) is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from mha_ep.launch import ELEMENT_TYPES

if TYPE_CHECKING:  # CuPy is imported where a kernel is built, so the source helpers run on CPU machines
    import cupy

KERNEL_DIR = Path(__file__).parent / "kernels"
# kernel -> (source file, its template arguments after the element type; None: the element type alone). Each is
# built for every element type of ELEMENT_TYPES, except the MASK_KERNELS, built for each MASK_TYPES type alone.
KERNELS = {
    "build_dense_BNTH": ("layout.cu", (1, 4)),  # VEC
    "context_to_BSD": ("layout.cu", (1, 4)),  # VEC
    "build_dense_BNTH_native": ("layout.cu", (1, 4)),  # VEC (sources in the compute dtype)
    "narrow_output": ("layout.cu", (1, 4)),  # VEC
    "widen_to_float": ("layout.cu", (1, 4)),  # VEC (the native route: a node's float16 / bfloat16 tensors)
    "resolve_key_lengths": ("layout.cu", (None,)),  # ORT's raw key_padding_mask -> the kernels' form
    "resolve_keep_flags": ("layout.cu", (None,)),
    "masked_softmax_warp": ("softmax.cu", (1, 2, 4, 8, 16, 32)),  # COLS_PER_LANE
    "masked_softmax": ("softmax.cu", (None,)),
    "shared_buffer_attention": ("shared_buffer.cu", ("int", "long long", "unsigned char")),  # the mask's type
    "shared_buffer_decode": ("shared_buffer.cu", ("int", "long long", "unsigned char")),  # the mask's type
}
MASK_TYPES = {"int32": "int", "int64": "long long"}  # key_padding_mask element types -> their CUDA types
MASK_KERNELS = ("resolve_key_lengths", "resolve_keep_flags")
HOPPER_ARCH = "sm_90a"  # wgmma and TMA code: compiled by NVRTC directly (compile_arch_kernel)
# fused kernel -> (source file, the architecture it needs; None: the device's own, through CuPy's NVRTC path)
INSTANTIATED = {
    "flash_attention_fp32": ("flash_attention.cu", None),
    "flash_attention_mma": ("flash_attention.cu", None),
    "flash_attention_wgmma": ("flash_attention_wgmma.cu", HOPPER_ARCH),
    "flash_attention_ws": ("flash_attention_ws.cu", HOPPER_ARCH),
    "split_key_stream": ("split_keys.cu", None),  # a decode step's keys across blocks (dispatch.key_stream)
    "split_key_attention": ("split_keys.cu", None),  # ... the earlier pair (dispatch.key_split), for A/B timing
    "combine_key_splits": ("split_keys.cu", None),
    "combine_tile_splits": ("split_keys.cu", None),  # flash_attention_ws's tail split (dispatch.ws_tail)
    "zero_after_prior_grids": ("split_keys.cu", None),  # split_key_stream's counters before a programmatic launch
    "gemv_rows": ("gemv.cu", None),  # mha_ep::DecodeMatMul's product (gemv.py)
}
COMPILE_OPTIONS = ()  # accurate expf: no fast-math

_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str], cupy.RawKernel] = {}  # (device, name expression): the per-call lookup
_lock = threading.RLock()  # get_function builds under it and compile_arch_kernel takes it again


LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[^\n]*\n', re.MULTILINE)
CACHE_ENV = "MHA_EP_KERNEL_CACHE"  # where compile_arch_kernel keeps its cubins (default: ~/.cache/mha_ep/kernels)
CACHE_DIR_MODE = 0o700  # a cache folder mha_ep creates is private to the user
UNSAFE_MODE_BITS = stat.S_IWGRP | stat.S_IWOTH  # a cache folder or file others may write is refused
log = logging.getLogger("mha_ep")


def expand_includes(text: str, seen: Optional[set] = None) -> str:
    """``text`` with every local ``#include "file"`` (a file of KERNEL_DIR) replaced by that file, recursively,
    each file once (``#pragma once``); system includes (``<...>``) stay."""
    seen = set() if seen is None else seen

    def inline(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return expand_includes((KERNEL_DIR / name).read_text().replace("#pragma once\n", ""), seen)

    return LOCAL_INCLUDE.sub(inline, text)


def kernel_source(file_name: str) -> str:
    """The file's text with its local headers inlined."""
    return expand_includes((KERNEL_DIR / file_name).read_text(), {file_name})


def name_expression(kernel: str, dtype: str, variant=None) -> str:
    """``kernel<T[, variant]>``, T the CUDA type of ``dtype`` (an element type, or for MASK_KERNELS a mask type)."""
    element = (MASK_TYPES if kernel in MASK_KERNELS else ELEMENT_TYPES)[dtype]
    arguments = element if variant is None else f"{element}, {variant}"
    return f"{kernel}<{arguments}>"


def kernel_types(kernel: str) -> tuple:
    """The dtypes ``kernel`` is built for."""
    return tuple(MASK_TYPES if kernel in MASK_KERNELS else ELEMENT_TYPES)


def _module(device_id: int, file_name: str) -> cupy.RawModule:
    import cupy

    key = (device_id, file_name)
    with _lock:
        module = _modules.get(key)
        if module is None:
            expressions = [
                name_expression(kernel, dtype, variant)
                for kernel, (source, variants) in KERNELS.items()
                if source == file_name
                for variant in variants
                for dtype in kernel_types(kernel)
            ]
            module = cupy.RawModule(
                code=kernel_source(file_name), options=COMPILE_OPTIONS, name_expressions=expressions
            )
            _modules[key] = module
    return module


def get_function(device_id: int, expression: str) -> cupy.RawKernel:
    """The compiled template instantiation ``expression`` (e.g. "masked_softmax<float>",
    "flash_attention_ws<__half, 64, 128, 2, false>") on ``device_id``, call with that device current; compiled on
    the first call of the process, then a dictionary lookup."""
    key = (device_id, expression)
    function = _functions.get(key)
    if function is None:
        with _lock:
            function = _functions.get(key)
            if function is None:
                family = expression.split("<", 1)[0]
                if family in KERNELS:
                    function = _module(device_id, KERNELS[family][0]).get_function(expression)
                else:
                    function = compile_function(device_id, expression)
                _functions[key] = function
    return function


def source_function(device_id: int, path: Path, name: str, expressions: Optional[tuple] = None) -> cupy.RawKernel:
    """``name`` from the .cu file at ``path`` (its local includes, files of KERNEL_DIR, inlined) on ``device_id``,
    call with that device current. The file is built once per device as one ``cupy.RawModule`` with
    ``expressions`` (its template instantiations; None: extern "C" kernels, no name expressions) and CuPy's
    default options; ``name`` is then a dictionary lookup."""
    key = (device_id, f"{path}:{name}")
    function = _functions.get(key)
    if function is None:
        import cupy

        with _lock:
            function = _functions.get(key)
            if function is None:
                module_key = (device_id, str(path))
                module = _modules.get(module_key)
                if module is None:
                    code = expand_includes(Path(path).read_text(), {Path(path).name})
                    extra = {} if expressions is None else {"name_expressions": list(expressions)}
                    module = _modules[module_key] = cupy.RawModule(code=code, **extra)
                function = _functions[key] = module.get_function(name)
    return function


def compile_function(device_id: int, expression: str, code: Optional[str] = None) -> cupy.RawKernel:
    """Compile fused instantiation ``expression`` from ``code`` (default: the shipped source of its kernel,
    INSTANTIATED): for sm_90a through compile_arch_kernel (kept on disk), else through CuPy's NVRTC path. Not
    memoised here (get_function is); the timing of other kernel sources calls it with their code."""
    import cupy

    source_file, arch = INSTANTIATED[expression.split("<", 1)[0]]
    code = code or kernel_source(source_file)
    if arch is not None:
        return compile_arch_kernel(device_id, code, expression, arch, COMPILE_OPTIONS)
    module = cupy.RawModule(code=code, options=COMPILE_OPTIONS + ("--std=c++17",), name_expressions=[expression])
    return module.get_function(expression)


# ------------------------------------------------------------------------------- architecture-specific kernels
_arch_kernels: dict[tuple, tuple] = {}  # (device, code, name, options) -> (module, kernel): the module stays loaded


def kernel_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mha_ep" / "kernels")


def cuda_include_options() -> tuple:
    """``-I`` of the CUDA headers (cuda_fp16.h, cuda_bf16.h) where CuPy finds them for its own NVRTC builds: the
    toolkit beside the NVRTC library it loads (a system CUDA, or the nvidia/cu13 wheel)."""
    from cupy import _environment

    cuda_path = _environment.get_cuda_path()
    include = Path(cuda_path) / "include" if cuda_path else None
    return (f"-I{include}",) if include is not None and include.is_dir() else ()


def _nvrtc_version() -> tuple:
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc.getVersion()


def _nvrtc_compile(code: str, name: str, options: tuple) -> tuple[bytes, str]:
    """(cubin, lowered name) of template instantiation ``name`` in ``code``; raises with NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(code, "mha_ep_kernel.cu", (), ())
    try:
        nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC could not compile {name} with {' '.join(options)}:\n{log}") from error
        return nvrtc.getCUBIN(program), nvrtc.getLoweredName(program, name)
    finally:
        nvrtc.destroyProgram(program)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(cubin_path: Path, lowered: str) -> tuple:
    import cupy

    module = cupy.RawModule(path=str(cubin_path))
    return module, module.get_function(lowered)


def untrusted_reason(path: Path) -> Optional[str]:
    """None when ``path`` (a cache folder or file) is the user's own and nobody else may write it; else why not.
    (Not followed through a symbolic link: a link is judged as itself, and refused unless the user's.)"""
    info = path.lstat()
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if stat.S_ISLNK(info.st_mode):
        info = path.stat()
    if info.st_mode & UNSAFE_MODE_BITS:
        return f"{path} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o})"
    return None


_warned: set = set()


def _refuse(reason: str) -> None:
    """Warn, once per reason and process, that a cache folder or entry is not used."""
    if reason not in _warned:
        _warned.add(reason)
        log.warning("mha_ep: kernel cache not used: %s; compiling in memory (chmod go-w, or set %s to a folder of "
                    "your own)", reason, CACHE_ENV)  # fmt: skip


def _cache_folder() -> Optional[Path]:
    """The cache folder, created private when missing; None when it cannot be made or is not trusted."""
    folder = kernel_cache_dir()
    try:
        folder.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
        reason = untrusted_reason(folder)
    except OSError:
        return None  # no usable cache directory: only the recompile is lost
    if reason is not None:
        _refuse(reason)
        return None
    return folder


def _read_entry(cubin_path: Path, meta_path: Path) -> Optional[str]:
    """The lowered kernel name of a whole, trusted entry whose cubin matches its checksum; None when there is no
    such entry (missing, refused with a warning, or corrupt: the caller rebuilds it)."""
    if not (cubin_path.exists() and meta_path.exists()):
        return None
    try:
        for path in (meta_path, cubin_path):
            reason = untrusted_reason(path)
            if reason is not None:
                _refuse(reason)
                return None
        meta = json.loads(meta_path.read_text())
        if hashlib.sha256(cubin_path.read_bytes()).hexdigest() != meta["sha256"]:
            raise ValueError("the cubin does not match its checksum")
        return str(meta["lowered"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("mha_ep: kernel cache entry %s is corrupt (%s); rebuilding it", cubin_path, error)
        return None


def _load_in_memory(cubin: bytes, lowered: str) -> tuple:
    """Load ``cubin`` from a private temporary file that goes away again (no usable or trusted cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return _load(path, lowered)


def compile_arch_kernel(device_id: int, code: str, name: str, arch: str, options: tuple = ()) -> cupy.RawKernel:
    """Template instantiation ``name`` of kernel source ``code`` (local includes already inlined) compiled for
    ``arch`` (e.g. "sm_90a") and loaded on ``device_id`` (call with that device current); memoised per process and
    kept on disk across processes. An entry is ``<key>.cubin`` and ``<key>.meta`` (the lowered name and the cubin's
    SHA-256), each written to a temporary name and renamed into place, the metadata last, so a reader never sees
    half of an entry; a corrupt entry is rebuilt, an untrusted folder or entry refused (module docstring), and an
    unwritable cache directory only costs the recompile."""
    options = tuple(options) + ("--std=c++17", "-ftz=true", f"--gpu-architecture={arch}") + cuda_include_options()
    key = (device_id, code, name, options)
    with _lock:
        entry = _arch_kernels.get(key)
        if entry is None:
            entry = _arch_kernels[key] = _cached_or_compiled(code, name, options)
    return entry[1]


def _cached_or_compiled(code: str, name: str, options: tuple) -> tuple:
    fingerprint = "\0".join([code, name, *options, repr(_nvrtc_version())])
    folder = _cache_folder()
    if folder is not None:
        cubin_path = folder / f"{hashlib.sha256(fingerprint.encode()).hexdigest()[:32]}.cubin"
        meta_path = cubin_path.with_suffix(".meta")
        lowered = _read_entry(cubin_path, meta_path)
        if lowered is not None:
            return _load(cubin_path, lowered)
    cubin, lowered = _nvrtc_compile(code, name, options)
    if folder is not None:
        try:
            _write_atomically(cubin_path, cubin)
            meta = {"lowered": lowered, "sha256": hashlib.sha256(cubin).hexdigest()}
            _write_atomically(meta_path, json.dumps(meta).encode())
            return _load(cubin_path, lowered)
        except OSError:
            pass  # an unwritable cache directory
    return _load_in_memory(cubin, lowered)
