"""Reading and writing ONNX model files: private copies, clear errors for files that are not models, models over
protobuf's 2 GiB through external data, and writes that replace a file whole or not at all.

Used by the partition pass (mha_ep/graph/partition.py), mha_ep.InferenceSession, compare and the device code.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import stat
import tempfile
from typing import Union

import onnx

from mha_ep.errors import MhaModelError

log = logging.getLogger("mha_ep")


def load_model(model: Union[onnx.ModelProto, bytes, str, os.PathLike]) -> onnx.ModelProto:
    """A private copy of ``model`` (a ModelProto, serialized bytes or a path); a clear ValueError (or
    FileNotFoundError) when it is not a readable ONNX model: an empty or truncated file, or not protobuf at all."""
    if isinstance(model, onnx.ModelProto):
        return copy.deepcopy(model)
    if isinstance(model, (bytes, bytearray, memoryview)):
        where, data = "the model bytes", bytes(model)
    else:
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no ONNX model at {path!r}")
        where = repr(path)
        with open(path, "rb") as handle:
            data = handle.read()
    if not data:
        raise ValueError(f"{where} is not a readable ONNX model: it is empty (0 bytes)")
    try:
        loaded = onnx.load_from_string(data)
    except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ValueError(f"{where} is not a readable ONNX model: {type(error).__name__}: {error}") from None
    if not loaded.HasField("graph") or not loaded.ir_version:
        raise ValueError(f"{where} is not a readable ONNX model: it has no graph or no IR version (truncated?)")
    if not isinstance(model, (bytes, bytearray, memoryview)) and any(
        t.data_location == onnx.TensorProto.EXTERNAL for t in loaded.graph.initializer
    ):
        folder = os.path.dirname(os.path.abspath(path))
        try:
            onnx.load_external_data_for_model(loaded, folder)
        except OSError:
            raise
        except Exception as error:  # noqa: BLE001 - onnx's checker refuses a location (outside the folder, a link)
            raise ValueError(f"{where}: its external data cannot be read: {error}") from None
    return loaded

# One ModelProto serialises to at most 2 GiB (protobuf's limit; above it ``ByteSize()`` itself raises). Models
# over this size are written with their tensors in an external-data file. Tests lower it to try the path cheaply.
PROTOBUF_LIMIT = 2**31 - 2**24

def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes held inline by the model's tensors (initializers and tensor attributes, subgraphs included), read
    field by field: on a model over 2 GiB ``ByteSize()`` raises instead of answering."""

    def of_tensor(t: onnx.TensorProto) -> int:
        return (
            len(t.raw_data)
            + 4 * (len(t.float_data) + len(t.int32_data))
            + 8 * (len(t.int64_data) + len(t.double_data) + len(t.uint64_data))
            + sum(len(x) for x in t.string_data)
        )

    def of_graph(g: onnx.GraphProto) -> int:
        total = sum(of_tensor(t) for t in g.initializer)
        total += sum(of_tensor(t.values) + of_tensor(t.indices) for t in g.sparse_initializer)
        for node in g.node:
            for attr in node.attribute:
                total += (of_tensor(attr.t) if attr.HasField("t") else 0) + sum(of_tensor(t) for t in attr.tensors)
                total += (of_graph(attr.g) if attr.HasField("g") else 0) + sum(of_graph(x) for x in attr.graphs)
        return total

    return of_graph(model.graph) + sum(
        of_tensor(attr.t) for f in model.functions for node in f.node for attr in node.attribute if attr.HasField("t")
    )

def needs_external_data(model: onnx.ModelProto) -> bool:
    """True when ``model`` cannot be serialised as one protobuf (decided without ``ByteSize()`` on big models)."""
    if tensor_bytes(model) > PROTOBUF_LIMIT:
        return True
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except Exception:  # noqa: BLE001 - protobuf's EncodeError above 2 GiB
        return True

def write_model(model: onnx.ModelProto, path: str) -> None:
    """``onnx.save``, with the tensors in ``<name>.data`` beside ``path`` when the model is too big for one protobuf.
    ``model`` is left as it was (onnx.save moves tensors out of the proto it is given; they are read back)."""
    if not needs_external_data(model):
        onnx.save(model, path)
        return
    location = os.path.basename(path) + ".data"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location)
    except BaseException:
        try:
            restore_inline_data(model, folder)
        except Exception as error:  # noqa: BLE001 - the write's own error is the one to raise
            log.warning("mha_ep: after a failed write, tensors of the model object could not be read back: %s", error)
        raise
    restore_inline_data(model, folder)

def restore_inline_data(model: onnx.ModelProto, folder: str) -> None:
    """Undo onnx.save's conversion to external data on ``model``: tensors still holding their bytes are only
    unmarked, the others are read back from the file just written."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

    for tensor in _get_all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if not tensor.HasField("raw_data"):
            load_external_data_for_tensor(tensor, folder)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT

def _default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask

def _check_target(path: str, what: str) -> None:
    """Refuse to replace anything but a regular file: a rename would put a file in place of a symbolic link, a
    FIFO or a device (as root, ``-o /dev/null`` would destroy /dev/null)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise MhaModelError(f"cannot write {what} to {path!r}: it is a directory; give a file name")
    if stat.S_ISLNK(mode):
        raise MhaModelError(
            f"cannot write {what} to {path!r}: it is a symbolic link, which mha_ep would replace with a file rather "
            f"than write through; give the path it points to ({os.path.realpath(path)!r}) or another name"
        )
    if not stat.S_ISREG(mode):
        raise MhaModelError(
            f"cannot write {what} to {path!r}: it is not a regular file (a FIFO, a socket or a device), which mha_ep "
            "will not replace; give a file name"
        )

def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike]) -> None:
    """Write ``model`` to ``path`` whole or not at all, and only ever in place of a regular file.

    Both files (the model, and ``<path>.data`` for a model over 2 GiB) are written in a temporary folder beside
    ``path`` and renamed into place only once both are complete: the data file first, then the model. A failed
    write leaves the previous model and its data as they were.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    _check_target(path, "the model")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write the model to {path!r}: folder {folder!r} does not exist")
    name = os.path.basename(path)
    data = os.path.join(folder, name + ".data")
    external = needs_external_data(model)
    if external:
        _check_target(data, "the model's external data")
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else _default_file_mode()
    staging = tempfile.mkdtemp(prefix=".mha_ep_", dir=folder)
    try:
        write_model(model, os.path.join(staging, name))
        if external:
            os.chmod(os.path.join(staging, name + ".data"), mode)
            os.replace(os.path.join(staging, name + ".data"), data)
        os.chmod(os.path.join(staging, name), mode)  # mkstemp-like 0600 otherwise; the mode a plain save gives
        os.replace(os.path.join(staging, name), path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
