"""Edge cases of mha_ep/graph/lift.py and mha_ep/models/ from a review: each test reproduced one real bug (the
docstrings say what was wrong and what is expected) and now guards its fix.

Every lift test compares the lifted model against the original with stock ORT CPU on the same feeds, which is the
contract of ``lift_attention`` ("exact against stock ORT"; the input model is a valid ORT model).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_ep.graph.lift import lift_attention

ort = pytest.importorskip("onnxruntime")

B, S, E, N, H = 2, 5, 8, 2, 4
D = N * H


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _attention_model(*, elem=TensorProto.FLOAT, np_dtype=np.float32, x_intermediate=False, ir_version=8, opset=17,
                     weights_also_input=False, present=False, seed=0):
    """x -> [Identity] -> com.microsoft::Attention(x, w, b) -> y (+ present)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((E, 3 * D)) * 0.3).astype(np_dtype)
    b = (rng.standard_normal(3 * D) * 0.3).astype(np_dtype)
    nodes, x = [], "x"
    if x_intermediate:
        nodes.append(helper.make_node("Identity", ["x"], ["x_mid"], "pre"))
        x = "x_mid"
    outputs = ["attn_out"] + (["present"] if present else [])
    nodes.append(helper.make_node("Attention", [x, "w", "qkv_bias"], outputs, "attn0", domain="com.microsoft",
                                  num_heads=N))
    nodes.append(helper.make_node("Identity", ["attn_out"], ["y"], "post"))
    inputs = [helper.make_tensor_value_info("x", elem, ["batch", S, E])]
    if weights_also_input:  # the initializers are listed as graph inputs too (IR < 4 requires it)
        inputs += [helper.make_tensor_value_info("w", elem, [E, 3 * D]),
                   helper.make_tensor_value_info("qkv_bias", elem, [3 * D])]
    graph_outputs = [helper.make_tensor_value_info("y", elem, ["batch", S, D])]
    graph = helper.make_graph(nodes, "attention", inputs, graph_outputs,
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "qkv_bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = ir_version
    return model, w


@pytest.mark.parametrize("form", ["ir3_initializer_listed_as_input", "overridable_initializer_fed"])
def test_lift_weights_that_are_also_a_graph_input(form):
    """What is wrong: graph/lift.py:145 slices ``weights`` whenever it is an initializer, and graph/lift.py:316-320 then
    drops the packed initializer, although the same name is also a graph input. For an IR 3 model (initializers
    must be listed as inputs; opset-11 era exports) the lifted model turns ``w`` into a *required* input: ORT
    fails with "Required inputs (['w']) are missing". For an IR >= 4 model the input is an overridable default:
    a caller that feeds ``w`` gets the baked-in slices instead (silently wrong numbers).
    Expected: a weights name that is a graph input is treated as runtime weights (the Split path), or the packed
    initializer is kept; the lifted model takes the same feeds and gives the same outputs as the original."""
    if form == "ir3_initializer_listed_as_input":
        model, w = _attention_model(ir_version=3, opset=11, weights_also_input=True)
        feeds = {"x": np.random.default_rng(1).standard_normal((B, S, E)).astype(np.float32)}
    else:
        model, w = _attention_model(ir_version=8, weights_also_input=True)
        feeds = {"x": np.random.default_rng(1).standard_normal((B, S, E)).astype(np.float32),
                 "w": (2.0 * w).astype(np.float32), "qkv_bias": np.zeros(3 * D, np.float32)}
    want = _run(model, feeds)
    lifted, count = lift_attention(model)
    assert count == 1
    got = _run(lifted, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-5)


def test_lift_float16_attention_whose_input_has_no_value_info():
    """What is wrong: graph/lift.py:245 takes the Q/K/V value_info element type from ``_elem_type`` on the *original*
    model's graph inputs/value_info/outputs only; when the Attention input is an intermediate tensor and the
    Attention output is not a graph output (value_info stripped, usual after optimisation), it falls back to
    FLOAT. For a float16 model the added value_info then says float while the MatMul produces float16, and ORT
    refuses to load the lifted model: "Type Error: Type (tensor(float)) of output arg (attn0/lift/v) ... does not
    match expected type (tensor(float16))". Stock ORT CPU runs the original float16 Attention model.
    Expected: the element type comes from the weights initializer / shape inference (or no value_info is written
    when it is unknown), and the lifted model runs with the same result."""
    model, _ = _attention_model(elem=TensorProto.FLOAT16, np_dtype=np.float16, x_intermediate=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((B, S, E)).astype(np.float16)}
    want = _run(model, feeds)
    lifted, count = lift_attention(model)
    assert count == 1
    for vi in lifted.graph.value_info:
        if "/lift/" in vi.name:
            assert vi.type.tensor_type.elem_type == TensorProto.FLOAT16, vi.name
    got = _run(lifted, feeds)
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=0, atol=2e-3)


def _if_node(reads: str, out: str):
    then = helper.make_graph([helper.make_node("Identity", [reads], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", [reads], ["e_out"])], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    return helper.make_node("If", ["cond"], [out], "if0", then_branch=then, else_branch=other)


@pytest.mark.parametrize("reader", ["outer_initializer", "present"])
def test_lift_keeps_what_subgraphs_read_from_the_outer_scope(reader):
    """What is wrong: the "used" sets of graph/lift.py:197 (read by present_used, line 167) and graph/lift.py:316 (initializers kept) look only
    at the top-level nodes' inputs, not at names a subgraph (If / Loop / Scan body) reads from the outer scope.
    (a) An initializer read only inside an If branch is dropped as "no longer used": the lifted model is
    INVALID_GRAPH ("input 'scale2' of node ... is not output of any previous nodes").
    (b) A ``present`` consumed only inside an If branch counts as unused, so the lifted MHA does not produce it:
    the lifted model is INVALID_GRAPH as well.
    Expected: implicit (outer-scope) inputs of subgraphs count as used in both places."""
    model, _ = _attention_model(present=(reader == "present"))
    g = model.graph
    g.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    if reader == "outer_initializer":
        g.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "scale2"))
        then = helper.make_graph([helper.make_node("Mul", ["y", "scale2"], ["t_out"])], "then", [],
                                 [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
        other = helper.make_graph([helper.make_node("Identity", ["y"], ["e_out"])], "else", [],
                                  [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
        g.node.append(helper.make_node("If", ["cond"], ["z"], "if0", then_branch=then, else_branch=other))
    else:
        g.node.append(_if_node("present", "z"))
    g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    feeds = {"x": np.random.default_rng(1).standard_normal((B, S, E)).astype(np.float32)}
    want = _run(model, feeds)
    lifted, count = lift_attention(model)
    assert count == 1
    got = _run(lifted, feeds)
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(g_, w_, rtol=0, atol=2e-5)


# ------------------------------------------------------------------------------------------ ctranslate2.py
def _write_model_bin(path, spec, revision, variables, aliases, version=6):
    """Inverse of mha_ep.models.ctranslate2.read_model_bin (binary version >= 4)."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
           np.dtype(np.float16): 4}

    def string(s):
        raw = s.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = [struct.pack("<I", version), string(spec), struct.pack("<I", revision), struct.pack("<I", len(variables))]
    for name, array in variables.items():
        array = np.array(array, order="C", copy=True)  # (ascontiguousarray would make scalars 1-D)
        out += [string(name), struct.pack("<B", array.ndim), struct.pack(f"<{array.ndim}I", *array.shape),
                struct.pack("<B", ids[array.dtype]), struct.pack("<I", array.nbytes), array.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [string(alias), string(target)]
    path.write_bytes(b"".join(out))


def test_load_whisper_refuses_a_quantized_model_bin(tmp_path):
    """What is wrong: ``load_whisper``'s docstring promises a ValueError "when a CTranslate2 variable of a weight
    kind is left unused", but no such check exists (ctranslate2.py:222-229 only compares the mapped names with the
    PyTorch parameters). An int8-quantized model.bin (CTranslate2's ``--quantization int8``: ``weight`` int8 plus a
    float32 ``weight_scale``) is therefore loaded silently with the raw int8 codes as float weights and the scales
    ignored: a garbage model with no error.
    Expected: a ValueError naming the unused ``.../weight_scale`` variable (or a dequantisation)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mha_ep.models.ctranslate2 import load_whisper, read_model_bin, whisper_model_dir

    try:
        source = whisper_model_dir() / "model.bin"
    except ImportError as error:
        pytest.skip(str(error))
    spec, revision, variables, aliases = read_model_bin(source)
    variables = dict(variables)
    name = "encoder/layer_0/ffn/linear_0/weight"
    weight = variables[name].astype(np.float32)
    scale = (127.0 / np.maximum(np.abs(weight).max(axis=1), 1e-8)).astype(np.float32)
    variables[name] = np.round(weight * scale[:, None]).astype(np.int8)
    variables[name + "_scale"] = scale
    _write_model_bin(tmp_path / "model.bin", spec, revision, variables, aliases)
    with pytest.raises(ValueError, match="weight_scale"):
        load_whisper(tmp_path)
