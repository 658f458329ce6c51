"""onnxruntime-gpu for one GPU architecture, small enough to carry to the GPU machine in one call instead of six.

    python3 scripts/ort_gpu_for_sm.py WHEEL_OR_PIECES_DIR --sm 90 --out .device/ortsm90 [--piece-mb 45]

The onnxruntime-gpu wheel (256 MB) is mostly `libonnxruntime_providers_cuda.so`, whose `.nv_fatbin` section holds
a cubin of every kernel for each architecture it was built for (1.31.1: sm_75, 80, 86, 89, 90, 120; 218 MB). A GPU
loads only the cubins of its own architecture. This script zeroes the payloads of the others (their headers stay,
so the fatbin's layout and every offset are unchanged), leaves out the TensorRT provider and the C API's library
(``LEFT_OUT``), and packs the installed tree as one tar.xz (sm_90: 42 MB), split into pieces of --piece-mb.
`scripts/device_check.sh install-sm` joins the pieces, checks their SHA-256 and unpacks them into $ORT_SITE.

It also zeroes the kept architecture's cubins whose every kernel is a Mixture-of-Experts GEMM (``MOE_KERNEL``:
ORT's llm MoE kernels, 49.8 MB of sm_90's 76.9 in 1.31.1), which no MultiHeadAttention model here runs; with the
C API's library left out, the pack then fits one call beside the working tree (``--keep-moe`` keeps them). A cubin
is read through its kernels' names (``.text.<name>`` sections; CUDA 13 compresses each with zstd: the
``zstandard`` package reads it); one that cannot be read is kept. A zeroed cubin is only ever loaded when one of
its kernels runs (the CUDA runtime loads modules lazily: ``CUDA_MODULE_LOADING=LAZY``, which device_check.sh
sets), and it then fails to load: an error, never a wrong result.

The result runs only on GPUs of the kept architecture: a kernel of another would find a zeroed cubin. It is a
carrying device for a machine whose calls are short-lived, never something to ship. Fatbin layout (as CUDA 12/13's
`fatbinary.h` and the open decoders read it): a header (magic 0xBA55ED50, version, header size, payload size),
then entries, each (kind, version, header size, padded payload size, ..., sm version at byte 28, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import struct
import sys
import tarfile
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

CUDA_LIBRARY = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
# left out of the pack: TensorRT's provider, and the C API's library (libonnxruntime.so.<version>: the Python module
# holds ORT's core itself and loads neither; nothing here links it)
LEFT_OUT = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so",)
LEFT_OUT_PATTERN = re.compile(r"onnxruntime/capi/libonnxruntime\.so(\.[0-9]+)*")
FATBIN_MAGIC = 0xBA55ED50
ENTRY = struct.Struct("<HHII")  # kind, version, header size, padded payload size
SM_AT = 28  # the entry's sm version, a uint32 at this byte of its header
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# every kernel of a cubin this pattern matches is a Mixture-of-Experts GEMM (cub's EmptyKernel stub aside)
MOE_KERNEL = re.compile(rb"GroupProblemShape|MoeFCGemm|[Mm]oe_?[Gg]emv|fused_moe")
STUB_KERNEL = re.compile(rb"EmptyKernel")


def section(elf: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 little-endian section ``name``."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_index, _, _, _, offset, size in headers:
        end = elf.index(b"\0", names_at + name_index)
        if elf[names_at + name_index:end].decode() == name:
            return offset, size
    raise ValueError(f"no section {name}")


def fatbin_entries(elf: bytes) -> list[tuple[int, int, int, int]]:
    """Every fatbin entry of the library: (payload offset, payload size, kind, sm version)."""
    offset, size = section(elf, ".nv_fatbin")
    entries, at, end = [], offset, offset + size
    while at + 16 <= end:
        magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", elf, at)
        if magic != FATBIN_MAGIC:  # alignment padding between fatbins
            at += 8
            continue
        entry, stop = at + header_size, at + header_size + fat_size
        while entry < stop:
            kind, _, entry_header, padded = ENTRY.unpack_from(elf, entry)
            sm, = struct.unpack_from("<I", elf, entry + SM_AT)
            entries.append((entry + entry_header, padded, kind, sm))
            entry += entry_header + padded
        at = stop
    return entries


def kernel_names(payload: bytes) -> list | None:
    """The kernel names of a cubin payload (its ``.text.<name>`` sections), zstd-compressed or a plain ELF; None
    when it is neither (it is then kept)."""
    if payload[:4] == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            raise SystemExit("the cubins are zstd-compressed: pip install zstandard to read them, or --keep-moe")
        try:
            payload = zstandard.ZstdDecompressor().decompressobj().decompress(payload)  # the padding after the frame
            # is left unread
        except zstandard.ZstdError:
            return None
    elif payload[:4] != b"\x7fELF":
        return None
    return re.findall(rb"\.text\.(\w+)", payload)


def only_moe(names: list | None) -> bool:
    """Every kernel of the cubin is a Mixture-of-Experts GEMM (at least one is; stubs aside)."""
    kernels = [n for n in names or () if not STUB_KERNEL.search(n)]
    return bool(kernels) and all(MOE_KERNEL.search(n) for n in kernels)


def keep_only(elf: bytearray, sm: int, drop_moe: bool = False) -> Counter:
    """Zero every fatbin payload of another architecture, in place, and with ``drop_moe`` the kept architecture's
    Mixture-of-Experts cubins (``only_moe``); bytes by sm, and the MoE bytes zeroed under "moe"."""
    sizes: Counter = Counter()
    for start, size, _, entry_sm in fatbin_entries(bytes(elf)):
        sizes[entry_sm] += size
        if entry_sm != sm:
            elf[start:start + size] = bytes(size)
        elif drop_moe and only_moe(kernel_names(bytes(elf[start:start + size]))):
            sizes["moe"] += size
            elf[start:start + size] = bytes(size)
    if sizes[sm] == 0:
        raise SystemExit(f"the library has no sm_{sm} cubin (it has {sorted(k for k in sizes if k != 'moe')}): "
                         "nothing would run")
    return sizes


def read_wheel(source: Path) -> bytes:
    """The wheel's bytes: a .whl file, or the pieces q0, q1, ... of the device runbook in a folder."""
    if source.is_dir():
        pieces = sorted(p for p in source.iterdir() if p.name.startswith("q"))
        if not pieces:
            raise SystemExit(f"no wheel pieces q0, q1, ... in {source}")
        return b"".join(p.read_bytes() for p in pieces)
    return source.read_bytes()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the onnxruntime-gpu wheel, or a folder of its pieces q0, q1, ...")
    parser.add_argument("--sm", type=int, default=90, help="the architecture kept (90: H100 / H200)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the pieces a0, a1, ... and SHA256")
    parser.add_argument("--piece-mb", type=float, default=45.0, help="largest piece, MB")
    parser.add_argument("--keep-moe", action="store_true",
                        help="keep the Mixture-of-Experts cubins of the kept architecture (module docstring)")
    args = parser.parse_args(argv)
    wheel = zipfile.ZipFile(io.BytesIO(read_wheel(args.source)))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        for info in wheel.infolist():
            if info.is_dir() or info.filename in LEFT_OUT or LEFT_OUT_PATTERN.fullmatch(info.filename):
                continue
            data = wheel.read(info)
            if info.filename == CUDA_LIBRARY:
                library = bytearray(data)
                sizes = keep_only(library, args.sm, drop_moe=not args.keep_moe)
                data = bytes(library)
                moe = sizes.pop("moe", 0)
                print("fatbin MB by sm: " + ", ".join(f"sm_{k} {v / 1e6:.1f}" for k, v in sorted(sizes.items()))
                      + f"; kept sm_{args.sm}" + (f" less {moe / 1e6:.1f} of MoE cubins" if moe else ""),
                      file=sys.stderr)  # fmt: skip
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            member.mode = 0o755 if ".so" in Path(info.filename).name else 0o644
            tar.addfile(member, io.BytesIO(data))
    packed = buffer.getvalue()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("a*"):
        old.unlink()
    step = int(args.piece_mb * 1e6)
    with tempfile.TemporaryDirectory(dir=args.out) as staging:  # every piece written before any is in place
        names = []
        for i in range(0, len(packed), step):
            name = f"a{i // step}"
            (Path(staging) / name).write_bytes(packed[i:i + step])
            names.append(name)
        (Path(staging) / "SHA256").write_text(hashlib.sha256(packed).hexdigest() + "\n")
        for name in names + ["SHA256"]:
            (Path(staging) / name).replace(args.out / name)
    print(f"{len(packed) / 1e6:.1f} MB in {len(names)} piece(s) in {args.out}: {', '.join(names)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
