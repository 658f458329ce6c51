"""Issue 16, items 4-5: ``save_model`` (``mha-ep partition -o``) never loses a file; models over 2 GiB work.

4. The target is replaced only when it is a regular file (a symbolic link, a FIFO or a device is refused with a
   message and left alone), and only once the new model, and its external data, are complete: a failed write
   leaves the previous model and its data loadable.
5. A model too big for one protobuf goes through external data, end to end (partition, save, load, run, and
   ``mha_ep.InferenceSession``). The size limit is lowered for the test (``partition.PROTOBUF_LIMIT``), so a
   4 MiB initializer takes the path a 2 GiB one takes: a real one would need several GB of memory and disk.
   What only a real one could show, that the decision never calls ``ByteSize()`` (which raises above 2 GiB),
   holds by construction: ``needs_external_data`` sums the tensors' bytes first.
"""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import mha_ep
from mha_ep.graph.model_io import save_model

from harness import REPO
from mha_models import MhaConfig, build_model, random_feeds, stock_outputs
from small_models import one_mha

partition_module = importlib.import_module("mha_ep.graph.model_io")  # where PROTOBUF_LIMIT and the writers live

CONFIG = MhaConfig(batch=1, q_seq=3, kv_seq=3, num_heads=2, head_size=4, shapes="static")
BIG = 1 << 20  # float32 elements of the big initializer (4 MiB)


def big_model() -> onnx.ModelProto:
    """CONFIG's model with its query produced by ``query + sum(big) * 0``: a 4 MiB initializer that the graph
    really reads."""
    model = build_model(CONFIG)
    graph = model.graph
    weight = np.zeros(BIG, np.float32)
    weight[::4096] = 1e-30
    graph.initializer.append(numpy_helper.from_array(weight, "big"))
    graph.node.insert(0, helper.make_node("ReduceSum", ["big"], ["big_sum"], keepdims=0))
    graph.node.insert(1, helper.make_node("Mul", ["big_sum", "zero"], ["big_zero"]))
    graph.node.insert(2, helper.make_node("Add", ["query", "big_zero"], ["query_plus"]))
    graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "zero"))
    mha = next(n for n in graph.node if n.op_type == "MultiHeadAttention")
    mha.input[0] = "query_plus"
    return model


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(partition_module, "PROTOBUF_LIMIT", 1 << 20)


# ------------------------------------------------------------------------------------------------ 4. data loss
def tiny_model() -> onnx.ModelProto:
    return mha_ep.partition(build_model(CONFIG)).model


def test_a_symbolic_link_is_refused_and_left_alone(tmp_path):
    target = tmp_path / "real.onnx"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    with pytest.raises(mha_ep.MhaModelError, match="is a symbolic link"):
        save_model(tiny_model(), link)
    assert link.is_symlink() and target.read_bytes() == b"keep me"


def test_a_fifo_is_refused_and_left_alone(tmp_path):
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    with pytest.raises(mha_ep.MhaModelError, match="not a regular file"):
        save_model(tiny_model(), fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_character_device_is_refused_and_left_alone(tmp_path):
    device = tmp_path / "null"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    except (PermissionError, OSError) as error:
        pytest.skip(f"cannot make a device node here: {error}")
    with pytest.raises(mha_ep.MhaModelError, match="not a regular file"):
        save_model(tiny_model(), device)
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_the_cli_says_why_it_refuses(tmp_path):
    source = tmp_path / "in.onnx"
    onnx.save(build_model(CONFIG), source)
    fifo = tmp_path / "out.onnx"
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "mha_ep", "partition", str(source), "-o", str(fifo)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0 and "not a regular file" in result.stderr + result.stdout, result
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_external_data_outside_the_models_folder_is_a_user_error(tmp_path):
    """onnx refuses a location that leaves the model's folder; that is the user's model, said in one line, not an
    internal error of ours."""
    folder = tmp_path / "m"
    folder.mkdir()
    weight = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])], [weight])  # fmt: skip
    model = helper.make_model(graph)
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    moved = onnx.load(folder / "model.onnx", load_external_data=False)
    for tensor in moved.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside.bin"
    onnx.save(moved, folder / "model.onnx")
    (tmp_path / "outside.bin").write_bytes((folder / "w.bin").read_bytes())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "mha_ep", "partition", str(folder / "model.onnx"), "-o",
                             str(tmp_path / "out.onnx")], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    message = result.stderr + result.stdout
    assert result.returncode != 0 and "internal error" not in message, message
    assert "external data cannot be read" in message and "outside" in message, message
    assert not (tmp_path / "out.onnx").exists()


def test_a_failed_external_data_write_keeps_the_old_model_and_data(tmp_path, monkeypatch, small_limit):
    out = tmp_path / "model.onnx"
    old = mha_ep.partition(big_model()).model
    save_model(old, out)
    assert (tmp_path / "model.onnx.data").exists()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    real_save = onnx.save

    def failing_save(model, path, *args, **kwargs):  # writes part of the new files, then fails (disk full)
        real_save(model, path, *args, **kwargs)
        with open(str(path) + ".data", "r+b") as handle:
            handle.truncate(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_model(mha_ep.partition(big_model()).model, out)
    monkeypatch.setattr(onnx, "save", real_save)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no leftovers either
    loaded = onnx.load(str(out))
    assert numpy_helper.to_array(next(t for t in loaded.graph.initializer if t.name == "big")).shape == (BIG,)


def test_a_failed_write_keeps_the_old_model(tmp_path, monkeypatch):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"old model")
    monkeypatch.setattr(onnx, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        save_model(tiny_model(), out)
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"] and out.read_bytes() == b"old model"


# ------------------------------------------------------------------------------------------------- 5. > 2 GiB
def test_big_models_go_through_external_data_end_to_end(tmp_path, small_limit, rng):
    model = big_model()
    assert partition_module.needs_external_data(model)
    feeds = random_feeds(CONFIG, rng)
    expected = stock_outputs(CONFIG, feeds)["output"]

    session = mha_ep.InferenceSession(model, backend="reference")
    assert session.partition.claimed == 1
    np.testing.assert_allclose(session.run(["output"], feeds)[0], expected, rtol=1e-5, atol=1e-6)
    inline = next(t for t in session.model.graph.initializer if t.name == "big")
    assert inline.data_location == onnx.TensorProto.DEFAULT and len(inline.raw_data) == 4 * BIG  # left as it was

    out = tmp_path / "partitioned.onnx"
    save_model(session.model, out)
    assert (tmp_path / "partitioned.onnx.data").stat().st_size >= 4 * BIG
    assert out.stat().st_size < 1 << 20
    options = mha_ep.register(ort.SessionOptions(), backend="reference")
    plain = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(plain.run(["output"], feeds)[0], expected, rtol=1e-5, atol=1e-6)
    assert mha_ep.partition(str(out)).claimed == 1  # partitioning the saved model reads its data back


def test_the_size_decision_counts_tensor_bytes():
    model = big_model()
    assert partition_module.tensor_bytes(model) >= 4 * BIG
    assert not partition_module.needs_external_data(model)  # 4 MiB is far below the real limit


def test_saved_partitioned_model_has_ordinary_file_permissions(tmp_path):
    """save_model writes through tempfile.mkstemp, whose file is mode 0600, and os.replace keeps that mode: the
    model written by `mha-ep partition -o` (or over an existing 0644 file) is unreadable to other users, e.g. a
    serving account. Expected: the mode onnx.save would give (0666 & ~umask)."""
    from mha_ep.graph.model_io import save_model

    reference, target = tmp_path / "reference.onnx", tmp_path / "partitioned.onnx"
    onnx.save(one_mha(), reference)
    save_model(mha_ep.partition(one_mha()).model, target)
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
