"""``mha-ep bench sd`` on the CPU: its nodes are the forms ORT's optimizer writes, mha_ep claims each of them, the
packed and unpacked feeds hold the same attention, and the FLOP / byte models count what they say."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep.bench import sd


def small(form: str, dtype: str = "float16") -> sd.SdAttention:
    """A row's form at a size the CPU runs in a moment (H 40: SD 1.5's; 5 keys for cross attention)."""
    return sd.SdAttention("test", form, 2, 40, 6, dtype, kv_seq=5 if form == "cross" else None)


def test_the_rows_cover_every_shape_the_issue_names():
    labels = {(r.model, r.form, r.heads, r.head_size, r.seq, r.keys) for r in sd.sd_rows(("float16",))}
    for h, s in ((40, 4096), (80, 1024), (160, 256), (160, 64)):
        assert ("SD 1.5", "self", 8, h, s, s) in labels and ("SD 1.5", "cross", 8, h, s, 77) in labels
    assert {("SDXL", "self", 10, 64, 4096, 4096), ("SDXL", "self", 20, 64, 1024, 1024)} <= labels
    assert ("SD3.5-M", "joint", 24, 64, 4352, 4352) in labels and ("Flux", "joint", 24, 128, 4608, 4608) in labels
    assert len(sd.sd_rows()) == 2 * len(sd.sd_rows(("float16",)))


@pytest.mark.parametrize("form", sd.FORMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_row_s_node_is_claimed_in_its_packed_form(form, dtype):
    row = small(form, dtype)
    model = row.model_proto(packed=form != "joint")
    node = model.graph.node[0]
    assert node.domain == "com.microsoft" and node.op_type == "MultiHeadAttention"
    if form == "self":
        assert list(node.input) == ["qkv"]
    elif form == "cross":
        assert list(node.input) == ["q", "kv"]
    part = mha_ep.partition(model, route="native")
    assert part.claimed == 1, part.report()


@pytest.mark.parametrize("form", ["self", "cross"])
def test_packed_and_unpacked_feeds_are_the_same_attention(form):
    """The reference backend on the packed node equals stock ORT CPU on the unpacked one (the oracle the bench's
    ``err`` column uses on the GPU, stock unpacked), float32 here so that ORT CPU runs it."""
    row = small(form, "float16")
    packed, apart = row.feeds(seed=3)
    stock = ort.InferenceSession(_float32(row.model_proto(False)).SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, apart)[0]  # fmt: skip
    part = mha_ep.partition(_float32(row.model_proto(True)))
    options = mha_ep.register(ort.SessionOptions(), backend="reference")
    ours = ort.InferenceSession(part.model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, packed)[0]  # fmt: skip
    assert np.abs(stock).max() > 0.1
    np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-5)


def _float32(model):
    from onnx import TensorProto

    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


def test_the_flop_and_byte_models_count_the_naive_attention():
    """4*B*N*S*L*H: the multiply-adds of Q.K^T and P.V counted one by one on a small row; bytes: Q, K, V and
    the output once, two bytes an element."""
    row = small("cross")
    b, n, h, s, l = row.batch, row.heads, row.head_size, row.seq, row.keys
    multiply_adds = sum(h for _ in range(b * n * s * l)) + sum(l for _ in range(b * n * s * h))
    assert row.flops == 2 * multiply_adds
    elements = sum(int(np.prod(shape)) for shape in row.input_shapes(False).values()) + b * s * n * h
    assert row.bytes_moved == 2 * elements


def test_a_refused_stock_column_says_so_and_peaks_are_fractions():
    result = {"kind": "sd", "label": "x", "ours_us": 50.0, "stock_packed_refused": "packed QKV format is not "
              "implemented for current GPU", "stock_unpacked_us": 60.0, "vs_unpacked": 50 / 60, "tflops": 400.0,
              "gbps": 1200.0, "ours_error": 1e-3, "stock_unpacked_error": 2e-3}  # fmt: skip
    line = sd.format_row(sd.with_peaks(result, "NVIDIA H200"))
    assert "refused: packed QKV format is not implemented" in line and "0.83x" in line
    assert "(40% / 25% of peak)" in line and "| 1.0e-03 / - / 2.0e-03 |" in line
    assert "of_peak_flops" not in sd.with_peaks(result, "some other GPU")


def test_bfloat16_feeds_are_rounded_to_nearest_even():
    """The bench's own bfloat16 rounding (CuPy has no bfloat16) agrees with ml_dtypes', ties and all."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 4096),
                             np.float32([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.0e38])])  # fmt: skip
    expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(sd.bfloat16_bits(values), expected)


@pytest.mark.parametrize("form", sd.FORMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_float64_reference_rows_are_stock_ort_cpu_s_attention(form, dtype):
    """reference_rows (the bench's oracle) equals stock ORT CPU's float32 MultiHeadAttention on the inputs rounded
    to the row's dtype, at the rows it picks."""
    row = sd.SdAttention("test", form, 3, 16, 70, dtype, kv_seq=9 if form == "cross" else None)
    _, apart = row.feeds(seed=4)
    picks, expected = sd.reference_rows(row, apart)
    assert len(picks) == sd.REFERENCE_ROWS and picks[0] == 0 and picks[-1] == row.seq - 1
    rounded = {name: sd._as_float(sd._rounded_bits(value, dtype), dtype).astype(np.float32)
               for name, value in apart.items()}  # fmt: skip
    stock = ort.InferenceSession(_float32(row.model_proto(False)).SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, rounded)[0]  # fmt: skip
    np.testing.assert_allclose(expected, stock[:, picks], rtol=1e-5, atol=1e-5)
