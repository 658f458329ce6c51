"""Carry real-weight ONNX models to the GPU machine in pieces, and rebuild them there bit for bit.

One device call carries at most 64 MiB, and the real models are 30-200 MB each. ``pack`` writes every model's
graph without weights, plus the weights deduplicated across models (the Whisper decoders share most of theirs)
into numbered chunks below a size limit (a 2-D tensor that is another's transpose, like a tied lm_head, is stored
once); a float32 tensor whose values are all exact in float16 (Whisper tiny.en
ships float16 weights, upcast by the export) travels as float16. ``unpack`` rebuilds the models and checks each
tensor's SHA-256 against the original's.

    python scripts/device_models.py pack OUT_DIR MODEL.onnx [...] [--chunk-mb 55]
    python scripts/device_models.py unpack PACK_DIR... --out MODELS_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import onnx
from onnx import numpy_helper


def fingerprint(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes() + str(array.dtype).encode() + str(array.shape).encode()).hexdigest()


def pack(out_dir: str, models: list[str], chunk_mb: float) -> None:
    os.makedirs(out_dir, exist_ok=True)
    limit = int(chunk_mb * 2**20)
    index = {"tensors": {}, "models": []}
    blobs = {}  # digest -> bytes, assigned to chunks at the end (first fit, largest first)
    for path in models:
        model = onnx.load(path)
        names = []
        for init in model.graph.initializer:
            array = numpy_helper.to_array(init)
            digest = fingerprint(array)
            names.append((init.name, digest))
            if digest in index["tensors"]:
                continue
            if array.ndim == 2:  # a tied lm_head is the embedding transposed: store it once
                twin = fingerprint(np.ascontiguousarray(array.T))
                if twin in index["tensors"]:
                    index["tensors"][digest] = {"transpose_of": twin}
                    continue
            stored = array
            if array.dtype == np.float32 and np.array_equal(array.astype(np.float16).astype(np.float32), array):
                stored = array.astype(np.float16)
            blobs[digest] = np.ascontiguousarray(stored).tobytes()
            index["tensors"][digest] = {"stored": str(stored.dtype), "dtype": str(array.dtype), "shape": list(array.shape)}
        del model.graph.initializer[:]
        graph_file = os.path.basename(path) + ".graph"
        onnx.save(model, os.path.join(out_dir, graph_file))
        index["models"].append({"file": os.path.basename(path), "graph": graph_file, "initializers": names})
        print(f"packed {path}", file=sys.stderr)
    chunks: list[list[str]] = []
    sizes: list[int] = []
    for digest in sorted(blobs, key=lambda d: -len(blobs[d])):
        size = len(blobs[digest])
        if size > limit:
            raise SystemExit(f"a tensor of {size} bytes exceeds the chunk limit of {limit} bytes")
        slot = next((i for i, used in enumerate(sizes) if used + size <= limit), None)
        if slot is None:
            chunks.append([])
            sizes.append(0)
            slot = len(chunks) - 1
        index["tensors"][digest].update(chunk=slot, offset=sizes[slot], bytes=size)
        chunks[slot].append(digest)
        sizes[slot] += size
    for slot, digests in enumerate(chunks):
        with open(os.path.join(out_dir, f"chunk_{slot:03d}.bin"), "wb") as handle:
            for digest in digests:
                handle.write(blobs[digest])
    with open(os.path.join(out_dir, "index.json"), "w") as handle:
        json.dump(index, handle)
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"{len(blobs)} unique tensors in {len(chunks)} chunk(s); {total / 2**20:.1f} MiB in all")


def unpack(pack_dirs: list[str], out_dir: str) -> None:
    files = {}
    for folder in pack_dirs:
        for name in os.listdir(folder):
            files[name] = os.path.join(folder, name)
    index = json.load(open(files["index.json"]))
    chunks: dict = {}
    os.makedirs(out_dir, exist_ok=True)
    for entry in index["models"]:
        model = onnx.load(files[entry["graph"]])
        for name, digest in entry["initializers"]:
            t = index["tensors"][digest]
            transpose = "transpose_of" in t
            if transpose:
                t = index["tensors"][t["transpose_of"]]
            if t["chunk"] not in chunks:
                chunks[t["chunk"]] = np.fromfile(files[f"chunk_{t['chunk']:03d}.bin"], np.uint8)
            raw = chunks[t["chunk"]][t["offset"] : t["offset"] + t["bytes"]]
            array = raw.view(t["stored"]).astype(t["dtype"]).reshape(t["shape"])
            if transpose:
                array = np.ascontiguousarray(array.T)
            if fingerprint(array) != digest:
                raise SystemExit(f"{entry['file']}: tensor {name} does not match the original (sha256)")
            model.graph.initializer.append(numpy_helper.from_array(array, name))
        onnx.save(model, os.path.join(out_dir, entry["file"]))
        print(f"rebuilt {entry['file']}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("out_dir")
    p.add_argument("models", nargs="+")
    p.add_argument("--chunk-mb", type=float, default=55.0)
    u = sub.add_parser("unpack")
    u.add_argument("pack_dirs", nargs="+")
    u.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.out_dir, args.models, args.chunk_mb)
    else:
        unpack(args.pack_dirs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
