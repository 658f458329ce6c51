"""Show that an edit of the fused kernels' sources changed no generated code: the PTX of every instantiation the
Python side compiles, from the working tree's kernels/ and from a git revision's, compared byte for byte.

    python3 scripts/ptx_identity.py                 # the working tree against HEAD
    python3 scripts/ptx_identity.py --base main     # ... against another revision
    python3 scripts/ptx_identity.py --base e3459f5 --base-kernels mha_ep/ops/backends/cuda/kernels   # kernels/ moved
    python3 scripts/ptx_identity.py --list          # the instantiations, one a line
    python3 scripts/ptx_identity.py --files flash_attention_ws.cu   # one source file's units only
    python3 scripts/ptx_identity.py --match "__half, 64, 64"        # the instantiations whose name has this

Needs nvcc (no GPU). Per source file of kernels.INSTANTIATED, one translation unit: the source exactly as
kernels.kernel_source builds it for NVRTC (local headers inlined), then one reference to every instantiation
(which instantiates it, as NVRTC's name expressions do), compiled with ``nvcc -ptx`` and the options kernels.py
passes: sm_90a kernels ``-std=c++17 -ftz=true -arch=sm_90a`` (compile_arch_kernel), the others ``-std=c++17`` for
the device's own architecture (CuPy's path; ``--arch``, default sm_90: the H200). No -lineinfo, so the PTX
names no source file or line and any difference is a difference in code. Exit status 0 only when every unit's PTX
is byte-identical. Each PTX is kept under --cache, keyed by the SHA-256 of the unit's text, its options and
nvcc's version, so a unit that did not change is compiled once (the whole set takes minutes).

The instantiations: for every dtype, operand dtype, head tile, feature set (padding mask, attention_bias, key
offset) and causal flag, the names fused.kernel_name gives for the tiles dispatch.py may choose (the mma default,
the wgmma default and the warp-specialized tiles where their rules accept the call), the fused_timing tiles of a
plain call, and the split-key kernels of every dtype.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mha_ep.bench.fused_timing import TILES as TIMING_TILES  # noqa: E402
from mha_ep.launch import ELEMENT_TYPES  # noqa: E402
from mha_ep.engine.cuda import dispatch, fused, kernels  # noqa: E402

HOPPER = dispatch.HOPPER_CAPABILITY
KERNEL_PATH = kernels.KERNEL_DIR.relative_to(REPO)


def call(dtype: str, head: int, padding: bool, bias: bool, causal: bool) -> SimpleNamespace:
    """What dispatch.py and fused.kernel_name read of a call, and nothing else."""
    geometry = SimpleNamespace(batch=2, q_seq=512, num_heads=8, past_seq=0, head_size=head, v_head_size=head)
    return SimpleNamespace(dtype=dtype, geometry=geometry, padding_mask=object() if padding else None,
                           attention_bias=object() if bias else None, causal=causal, scale=head**-0.5)  # fmt: skip


def fused_names() -> set:
    names = set()
    flags = (False, True)
    for dtype, head, padding, bias, offset, causal in itertools.product(
        ("float32", "float16", "bfloat16"), dispatch.HEAD_DIM_TILES, flags, flags, flags, flags
    ):
        problem = call(dtype, head, padding, bias, causal)
        key_offset = offset and dtype in dispatch.LOW_PRECISION_DTYPES
        for operand in sorted({"float32", dtype}):
            tiles = [None]  # the mma default tile (float32 calls: the fp32 kernel)
            if dispatch.wgmma_unsupported_reason(problem, operand, HOPPER) is None:
                tiles.append(dispatch.default_wgmma_tile(problem, key_offset))
            if dispatch.ws_unsupported_reason(problem, operand, HOPPER, key_offset) is None:
                tiles += [t for t in (dispatch.WsTile(), dispatch.WsTile(consumers=3))
                          if dispatch.ws_tile_unsupported_reason(problem, t) is None]  # fmt: skip
            if dtype != "float32" and operand == dtype and not (padding or bias or offset or causal):
                tiles += [t for t in TIMING_TILES if not isinstance(t, dispatch.WsTile)
                          or dispatch.ws_tile_unsupported_reason(problem, t) is None]  # fmt: skip
            for tile in tiles:
                if isinstance(tile, (dispatch.WgmmaTile, dispatch.WsTile)) and (
                    dispatch.wgmma_unsupported_reason(problem, operand, HOPPER) is not None
                ):
                    continue
                names.add(fused.kernel_name(problem, operand, tile, key_offset))
    return names


def split_key_names() -> set:
    elements = [ELEMENT_TYPES[d] for d in ("float32", "float16", "bfloat16")]
    names = {f"{kernel}<{e}, {s}>" for kernel in ("split_key_attention", "split_key_stream") for e in elements
             for s in {"float", e}}  # fmt: skip
    combines = {f"{kernel}<{e}>" for kernel in ("combine_key_splits", "combine_tile_splits") for e in elements}
    return names | combines | {"zero_after_prior_grids<unsigned>"}


def instantiations() -> dict:
    """source file -> sorted instantiation names."""
    by_file: dict = {}
    for name in fused_names() | split_key_names():
        source, _ = kernels.INSTANTIATED[name.split("<", 1)[0]]
        by_file.setdefault(source, []).append(name)
    return {source: sorted(names) for source, names in sorted(by_file.items())}


@contextmanager
def kernel_dir_of(revision, kernel_path: Path = KERNEL_PATH):
    """kernels.KERNEL_DIR pointed at ``revision``'s kernels/, at ``kernel_path`` in that revision (None: the
    working tree's)."""
    if revision is None:
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        files = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{revision}:{kernel_path}"],
                               check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
        for name in files:
            blob = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{kernel_path}/{name}"],
                                  check=True, capture_output=True).stdout  # fmt: skip
            (Path(tmp) / name).write_bytes(blob)
        saved, kernels.KERNEL_DIR = kernels.KERNEL_DIR, Path(tmp)
        try:
            yield
        finally:
            kernels.KERNEL_DIR = saved


def unit_text(source: str, names: list) -> str:
    """kernel_source(source) and a reference to each instantiation of a kernel it defines (a base revision from
    before a kernel was added has none of its entries: they show as differing)."""
    text = kernels.kernel_source(source)
    refs = "".join(f"  (void*){name},\n" for name in names if f"{name.split('<', 1)[0]}(" in text)
    return text + "\nvoid* mha_ep_instances[] = {\n" + refs + "};\n"


def nvcc_options(source: str, arch: str) -> list:
    kernel_arch = kernels.INSTANTIATED[kernels_of(source)[0]][1]
    if kernel_arch is not None:  # compile_arch_kernel
        return list(kernels.COMPILE_OPTIONS) + ["-std=c++17", "-ftz=true", f"-arch={kernel_arch}"]
    return list(kernels.COMPILE_OPTIONS) + ["-std=c++17", f"-arch={arch}"]


def kernels_of(source: str) -> list:
    return [family for family, (file, _) in kernels.INSTANTIATED.items() if file == source]


def nvcc_version() -> str:
    return subprocess.run(["nvcc", "--version"], check=True, capture_output=True, text=True).stdout


def compile_ptx(text: str, options: list, cache: Path, version: str) -> str:
    """The PTX of unit ``text``, from the cache or from nvcc (then cached)."""
    key = hashlib.sha256("\0".join([text, *options, version]).encode()).hexdigest()[:32]
    out = cache / f"{key}.ptx"
    if out.exists():
        return out.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cu"
        unit.write_text(text)
        done = subprocess.run(["nvcc", "-ptx", *options, str(unit), "-o", str(Path(tmp) / "unit.ptx")],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"nvcc failed ({' '.join(options)}):\n{done.stderr}")
        ptx = (Path(tmp) / "unit.ptx").read_text()
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(ptx)
    partial.replace(out)
    return ptx


def entries(ptx: str) -> dict:
    """entry name -> its PTX text (from its .globl line to the next)."""
    parts = ptx.split("\n\t// .globl\t")
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against (default HEAD)")
    parser.add_argument("--base-kernels", type=Path, default=KERNEL_PATH,
                        help=f"where the base revision keeps kernels/ (default {KERNEL_PATH}; before the house moves "
                             "of 2026-12-06: mha_ep/ops/backends/cuda/kernels)")  # fmt: skip
    parser.add_argument("--arch", default="sm_90", help="architecture of the kernels CuPy compiles (default sm_90)")
    parser.add_argument("--list", action="store_true", help="print the instantiations and stop")
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at once (default 2)")
    parser.add_argument("--files", nargs="+", help="only these source files of kernels.INSTANTIATED")
    parser.add_argument("--match", help="only the instantiations whose name contains this (a quick look)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "mha_ep_ptx_identity",
                        help="where compiled PTX is kept (default: mha_ep_ptx_identity in the temporary folder)")
    args = parser.parse_args(argv)
    plan = instantiations()
    if args.files:
        unknown = sorted(set(args.files) - set(plan))
        if unknown:
            raise SystemExit(f"not a source file of kernels.INSTANTIATED: {unknown}; they are {sorted(plan)}")
        plan = {source: names for source, names in plan.items() if source in args.files}
    if args.match:
        plan = {source: [n for n in names if args.match in n] for source, names in plan.items()}
        plan = {source: names for source, names in plan.items() if names}
    if args.list:
        for source, names in plan.items():
            print(f"{source}:", *names, sep="\n  ")
        return 0
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc is not on PATH")
    args.cache.mkdir(parents=True, exist_ok=True)
    version = nvcc_version()
    jobs = []
    for side, revision in (("base", args.base), ("tree", None)):
        with kernel_dir_of(revision, args.base_kernels):
            for source, names in plan.items():
                jobs.append((side, source, unit_text(source, names), nvcc_options(source, args.arch)))
    units = sorted({(text, tuple(options)) for _, _, text, options in jobs})  # an unchanged unit once
    with ThreadPoolExecutor(args.jobs) as pool:
        compiled = dict(zip(units, pool.map(lambda unit: compile_ptx(unit[0], list(unit[1]), args.cache, version),
                                            units)))  # fmt: skip
    ptx = {(side, source): compiled[(text, tuple(options))] for side, source, text, options in jobs}
    texts = {(side, source): text for side, source, text, _ in jobs}
    same = True
    for source, names in plan.items():
        base, tree = ptx[("base", source)], ptx[("tree", source)]
        options = " ".join(nvcc_options(source, args.arch))
        found = len(entries(tree))
        if base == tree:
            edited = "source edited" if texts[("base", source)] != texts[("tree", source)] else "source unchanged"
            print(f"{source}: {len(names)} instantiations, {found} entries, {len(tree)} bytes of PTX ({options}), "
                  f"{edited}: byte-identical")  # fmt: skip
            continue
        same = False
        before, after = entries(base), entries(tree)
        differing = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        print(f"{source}: PTX DIFFERS ({options}) in {len(differing)} of {found} entries")
        for name in differing[:3]:
            diff = difflib.unified_diff(before.get(name, "").splitlines(), after.get(name, "").splitlines(),
                                        "base", "tree", lineterm="", n=1)  # fmt: skip
            print(f"  {name}:", *list(diff)[:20], sep="\n    ")
    print(f"the working tree against {args.base}: " + ("every PTX byte-identical" if same else "PTX differs"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
