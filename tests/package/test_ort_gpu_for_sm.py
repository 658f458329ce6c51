"""scripts/ort_gpu_for_sm.py on a small made-up wheel: an ELF library whose .nv_fatbin holds cubins of two
architectures. The kept architecture's bytes and every other file come back unchanged, the other architecture's
payloads are zeros at the same offsets, the pieces join to their SHA-256, and a library without the asked
architecture is refused."""

import hashlib
import importlib.util
import io
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ort_gpu_for_sm", REPO / "scripts" / "ort_gpu_for_sm.py")
ort_gpu_for_sm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ort_gpu_for_sm)

ENTRY_HEADER = 64


def fatbin(payloads) -> bytes:
    """One fatbin: its header, then an entry (kind 2: a cubin) per (sm, payload)."""
    body = b""
    for sm, payload in payloads:
        header = bytearray(ENTRY_HEADER)
        struct.pack_into("<HHII", header, 0, 2, 0x101, ENTRY_HEADER, len(payload))
        struct.pack_into("<I", header, ort_gpu_for_sm.SM_AT, sm)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", ort_gpu_for_sm.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_library(section_data: bytes) -> bytes:
    """A minimal ELF64 little-endian file: a text-ish prefix, .nv_fatbin, .shstrtab and the section headers."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    prefix = b"\x90" * 100
    fat_at = 64 + len(prefix)
    names_at = fat_at + len(section_data)
    shoff = names_at + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)

    def section_header(name, offset, size):
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 8, 0)

    sections = section_header(0, 0, 0) + section_header(1, fat_at, len(section_data)) + section_header(
        12, names_at, len(names))
    return bytes(header) + prefix + section_data + names + sections


def wheel(library: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(ort_gpu_for_sm.CUDA_LIBRARY, library)
        z.writestr("onnxruntime/__init__.py", "version = 1\n")
        z.writestr(ort_gpu_for_sm.LEFT_OUT[0], b"trt")
    return buffer.getvalue()


def test_other_architectures_are_zeroed_in_place_and_the_pieces_join_to_their_hash(tmp_path):
    rng = np.random.default_rng()
    sm80, sm90, sm90b = (rng.integers(1, 256, n, dtype=np.uint8).tobytes() for n in (4000, 3000, 1000))
    section = fatbin([(80, sm80), (90, sm90)]) + bytes(8) + fatbin([(90, sm90b), (80, sm80)])  # padding between
    library = elf_library(section)
    source = tmp_path / "ort.whl"
    source.write_bytes(wheel(library))
    out = tmp_path / "pieces"
    assert ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(out), "--piece-mb", "0.002"]) == 0
    pieces = sorted(out.glob("a*"), key=lambda p: int(p.name[1:]))
    assert len(pieces) > 1, "the piece size splits the pack"
    packed = b"".join(p.read_bytes() for p in pieces)
    assert hashlib.sha256(packed).hexdigest() == (out / "SHA256").read_text().strip()
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:xz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert set(files) == {ort_gpu_for_sm.CUDA_LIBRARY, "onnxruntime/__init__.py"}  # TensorRT's library left out
    assert files["onnxruntime/__init__.py"] == b"version = 1\n"
    cut = files[ort_gpu_for_sm.CUDA_LIBRARY]
    assert len(cut) == len(library)
    kept = [(at, size, sm) for at, size, _, sm in ort_gpu_for_sm.fatbin_entries(cut)]
    assert [sm for _, _, sm in kept] == [80, 90, 90, 80]
    for at, size, sm in kept:
        expected = {90: library[at:at + size]}.get(sm, bytes(size))
        assert cut[at:at + size] == expected, sm
    changed = [i for i in range(len(library)) if cut[i] != library[i]]
    inside_80 = [(at, at + size) for at, size, sm in kept if sm == 80]
    assert all(any(a <= i < b for a, b in inside_80) for i in changed)


def test_a_library_without_the_asked_architecture_is_refused(tmp_path):
    source = tmp_path / "ort.whl"
    source.write_bytes(wheel(elf_library(fatbin([(80, b"\1" * 64)]))))
    with pytest.raises(SystemExit, match="no sm_90 cubin"):
        ort_gpu_for_sm.main([str(source), "--sm", "90", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
