"""mha_ep::DecodeMatMul, the native library's second op (a decoder step's weight product, y = x . weight_nk^T):
its CPU kernel in a plain ORT session against float64 sums, its refusals, its plans (gemv_rows for a few rows of
float16 / bfloat16, cuBLAS otherwise, programmatic where asked), and on the GPU (marker gpu) its CUDA kernel in a
plain ORT CUDA session and gemv_rows itself against the same oracle."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import mha_ep
from mha_ep import spec
from mha_ep.engine.cuda.fused import DeviceFacts
from mha_ep.dtypes import rounded
from mha_ep.engine.cuda.gemv import GEMV_MAX_M, gemv_refusal, reference_matmul
from mha_ep.errors import MhaInputError, MhaModelError
from mha_ep.native import configs
from mha_ep.native import plan as native_plan

from native_cases import cuda_native, library  # noqa: F401 - cuda_native: a fixture

ONNX_TYPES = {"float32": TP.FLOAT, "float16": TP.FLOAT16}
NUMPY_TYPES = {"float32": np.float32, "float16": np.float16}
SM90 = DeviceFacts("90", 132)


def matmul_model(weight: np.ndarray, x_shape: tuple, dtype: str, name: str = "proj"):
    """One DecodeMatMul node: x of ``x_shape`` by the initializer ``weight`` (N, K)."""
    node = helper.make_node(spec.MATMUL_OP_TYPE, ["x", "weight_nk"], ["y"], domain=spec.PLUGIN_DOMAIN, name=name,
                            **{spec.ATTR_NODE: name, spec.ATTR_DTYPE: dtype})  # fmt: skip
    y_shape = list(x_shape[:-1]) + [weight.shape[0]]
    graph = helper.make_graph([node], "decode_matmul", [helper.make_tensor_value_info("x", ONNX_TYPES[dtype], x_shape)],
                              [helper.make_tensor_value_info("y", ONNX_TYPES[dtype], y_shape)],
                              [numpy_helper.from_array(weight, "weight_nk")])  # fmt: skip
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid(spec.PLUGIN_DOMAIN, 1)])


def session(model, providers=("CPUExecutionProvider",)):
    """A session of ``model`` on the native route; on the CUDA provider with ORT's CPU fallback off, so that a node
    ORT would leave to the CPU kernel fails the session instead of passing unseen."""
    library()
    on_cuda = "CUDAExecutionProvider" in providers
    options = mha_ep.register(ort.SessionOptions(), backend="cuda" if on_cuda else "reference", route="native")
    if on_cuda:  # (ORT refuses the CPU provider in the list beside this setting)
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        providers = [p for p in providers if p != "CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("x_shape", [(1, 1, 40), (5, 40), (3, 2, 40)])
def test_the_cpu_kernel_gives_the_product_rounded_once(dtype, x_shape, rng):
    weight = rng.standard_normal((24, 40)).astype(NUMPY_TYPES[dtype])
    x = rng.standard_normal(x_shape).astype(NUMPY_TYPES[dtype])
    got = session(matmul_model(weight, x_shape, dtype)).run(None, {"x": x})[0]
    assert got.shape == x_shape[:-1] + (24,) and got.dtype == NUMPY_TYPES[dtype]
    want = reference_matmul(x.astype(np.float32), weight.astype(np.float32), dtype)
    assert np.array_equal(got.astype(np.float32), want)  # the CPU kernel is the reference
    exact = x.astype(np.float64) @ weight.astype(np.float64).T
    assert np.abs(got - exact).max() <= (1e-5 if dtype == "float32" else 2e-2)


def test_a_call_whose_k_differs_from_the_weight_s_is_an_ort_error_naming_both_shapes(rng):
    weight = rng.standard_normal((24, 40)).astype(np.float32)
    made = session(matmul_model(weight, ["batch", 1, "k"], "float32"))
    with pytest.raises(Exception, match=r"input x has shape \(2, 1, 39\) and weight_nk \(24, 40\): expected x"):
        made.run(None, {"x": rng.standard_normal((2, 1, 39)).astype(np.float32)})
    assert made.run(None, {"x": np.ones((2, 1, 40), np.float32)})[0].shape == (2, 1, 24)  # the session goes on


def test_a_node_the_rewrite_would_not_write_is_refused_at_kernel_creation():
    with pytest.raises(MhaModelError, match="attribute mha_ep_dtype is 'float64', expected one of"):
        configs.describe_kernel({spec.ATTR_NODE: b"p", spec.ATTR_DTYPE: b"float64"}, "cpu", spec.MATMUL_OP_TYPE)
    with pytest.raises(MhaModelError, match="mha_ep has no op 'Gemm'"):
        configs.describe_kernel({}, "cpu", "Gemm")


def signature(x_dims, w_dims, element=10, alignment=8):
    return native_plan.Signature(((element, tuple(x_dims), alignment), (element, tuple(w_dims), alignment))
                                 + (None,) * 8)  # fmt: skip


def matmul_config(dtype: str):
    config_id, mask, _ = configs.describe_kernel({spec.ATTR_NODE: b"p", spec.ATTR_DTYPE: dtype.encode()}, "cuda",
                                                 spec.MATMUL_OP_TYPE)  # fmt: skip
    assert mask == 0b11
    return configs.config(config_id)


@pytest.mark.parametrize("rows, dtype, kinds", [
    (1, "float16", ["gemv_rows<__half, 1>"]),
    (GEMV_MAX_M, "bfloat16", [f"gemv_rows<__nv_bfloat16, {GEMV_MAX_M}>"]),
    (GEMV_MAX_M + 1, "float16", ["Gemm", "narrow_output<__half, 1>"]),  # y at any alignment: element stores
    (2, "float32", ["Gemm"]),
])  # fmt: skip
def test_a_few_rows_of_float16_or_bfloat16_take_gemv_rows_and_the_rest_cublas(rows, dtype, kinds):
    element = {"float16": 10, "bfloat16": 16, "float32": 1}[dtype]
    plan = native_plan.plan_steps(matmul_config(dtype), signature((rows, 1, 1280), (3840, 1280), element), SM90)
    assert [getattr(s, "function", type(s).__name__) for s in plan.steps] == kinds
    assert plan.output_shapes == ((rows, 1, 3840), (0,), (0,), (0,))
    summary = library().check_plan(native_plan.encode_plan(plan, lambda launch: 1))
    assert [s["kind"] for s in summary["steps"]] == ["launch" if "<" in k else "gemm" for k in kinds]
    if kinds[0] == "Gemm":
        gemm = plan.steps[0]
        assert (gemm.m, gemm.n, gemm.k, gemm.trans_a, gemm.trans_b, gemm.lda, gemm.ldb, gemm.ldc) == \
            (3840, rows, 1280, 1, 0, 1280, 1280, 3840)  # fmt: skip
        assert (plan.scratch_bytes > 0) == (dtype != "float32")


def test_a_programmatic_device_launches_gemv_rows_programmatically(monkeypatch):
    monkeypatch.setenv("MHA_EP_PROGRAMMATIC", "on")
    config, sig = matmul_config("float16"), signature((1, 1280), (1280, 1280))
    assert native_plan.plan_steps(config, sig, SM90).steps[0].programmatic
    assert not native_plan.plan_steps(config, sig, DeviceFacts("80", 108)).steps[0].programmatic


@pytest.mark.parametrize("x_dims, w_dims, element, words", [
    ((1, 40), (24, 39), 10, r"input x has shape \(1, 40\) and weight_nk \(24, 39\)"),
    ((1, 40), (24, 40, 1), 10, r"weight_nk \(24, 40, 1\): expected x \(..., K\) and weight_nk \(N, K\)"),
    ((1, 40), (24, 40), 1, "input x is float32, expected the node's float16"),
])  # fmt: skip
def test_a_signature_the_op_cannot_take_names_the_input_and_its_shape(x_dims, w_dims, element, words):
    with pytest.raises(MhaInputError, match=words):
        native_plan.plan_steps(matmul_config("float16"), signature(x_dims, w_dims, element), SM90)


def test_empty_products_write_nothing_or_zeros():
    config = matmul_config("float16")
    assert native_plan.plan_steps(config, signature((0, 40), (24, 40)), SM90).steps == []
    (fill,) = native_plan.plan_steps(config, signature((3, 0), (24, 0)), SM90).steps
    assert (fill.byte, fill.nbytes) == (0, 3 * 24 * 2)


@pytest.mark.parametrize("rows, k, dtype, alignment, words", [
    (9, 1280, "float16", 16, "9 rows of x: gemv_rows takes 1 to 8"),
    (1, 1284, "float16", 16, "K = 1284: a row of 2568 bytes is not a whole number of 16-byte loads"),
    (1, 1280, "float16", 8, "only 8-byte aligned"),
    (1, 1280, "float32", 16, "float32: gemv_rows reads float16 and bfloat16"),
])  # fmt: skip
def test_gemv_rows_says_why_it_declines(rows, k, dtype, alignment, words):
    assert words in gemv_refusal(rows, k, 3840, dtype, alignment)


def test_rounding_is_to_nearest_even_for_both_half_types():
    values = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.nan], np.float32)
    assert rounded(values, "float16")[:4].tolist() == [1.0, 1 + 2**-9, 1 + 2**-8, 1 + 3 * 2**-8]
    assert rounded(values, "bfloat16")[:4].tolist() == [1.0, 1.0, 1.0, 1 + 2**-6]
    assert np.isnan(rounded(values, "bfloat16")[5]) and rounded(values, "bfloat16")[4] == -2.5


# ------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_M, GEMV_MAX_M + 3])
def test_the_cuda_kernel_in_a_plain_ort_cuda_session_gives_the_product(rows, dtype, rng, cuda_native):
    """gemv_rows (float16, up to 8 rows) or cuBLAS (the rest) inside ORT's CUDA provider: within a float16 step of
    the float64 product (float32 sums over K = 1280)."""
    weight = (rng.standard_normal((3840, 1280)) / 32).astype(NUMPY_TYPES[dtype])
    x = rng.standard_normal((rows, 1, 1280)).astype(NUMPY_TYPES[dtype])
    made = session(matmul_model(weight, list(x.shape), dtype), ("CUDAExecutionProvider", "CPUExecutionProvider"))
    got = made.run(None, {"x": x})[0].astype(np.float64)
    exact = x.astype(np.float64) @ weight.astype(np.float64).T
    assert np.abs(got - exact).max() <= (1e-4 if dtype == "float32" else 4e-3 * max(1.0, np.abs(exact).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows", list(range(1, GEMV_MAX_M + 1)))
def test_gemv_rows_writes_every_output_once_rounded_from_float32_sums(rows, dtype, rng, cuda_native):
    """The kernel alone (CuPy): every element of a poisoned y written, equal to the float64 product within one
    rounding of the element type and the float32 sums; N not a multiple of a block's rows, K of a round's."""
    import cupy

    from mha_ep.engine.cuda import kernels
    from mha_ep.engine.cuda.gemv import GEMV_ROWS, GEMV_WARPS
    from mha_ep.engine.cuda.pipeline import _narrow  # noqa: F401 - the module the op's cuBLAS path uses
    from mha_ep.launch import ELEMENT_TYPES

    n, k = 1000 + 3, 1280 + 8 * 37
    w32 = rounded((rng.standard_normal((n, k)) / 32).astype(np.float32), dtype)
    x32 = rounded(rng.standard_normal((rows, k)).astype(np.float32), dtype)

    def device(values):
        if dtype == "float16":
            return cupy.asarray(values.astype(np.float16))
        return cupy.asarray((values.view(np.uint32) >> 16).astype(np.uint16))

    y = cupy.full((rows, n), 0xFFFF, cupy.uint16)  # NaN in both types
    function = kernels.compile_function(0, f"gemv_rows<{ELEMENT_TYPES[dtype]}, {rows}>")
    function((-(-n // (GEMV_ROWS * GEMV_WARPS)),), (32 * GEMV_WARPS,),
             (device(x32), device(w32), y, np.int32(n), np.int32(k)))  # fmt: skip
    bits = cupy.asnumpy(y)
    got = bits.view(np.float16).astype(np.float64) if dtype == "float16" else \
        (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # fmt: skip
    assert not np.isnan(got).any(), "an output was never written"
    exact = x32.astype(np.float64) @ w32.astype(np.float64).T
    step = 2**-10 if dtype == "float16" else 2**-7
    assert np.all(np.abs(got - exact) <= step * np.abs(exact) + 1e-3)


@pytest.mark.gpu
def test_a_float16_static_decoder_with_decode_matmul_replays_under_ort_s_cuda_graph(cuda_native):
    """static-cache --decode-matmul's decoder (every weight product a DecodeMatMul) in the static loop's session,
    ORT's CUDA graph on: every node on the CUDA provider (ORT refuses to capture otherwise), and a step's logits
    those of the same decoder without the rule within float16 rounding of float32 sums (cuBLAS against
    gemv_rows), replay after replay."""
    import cupy

    from mha_ep.bench.generate import static_decoder
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    layers, hidden, heads, ffn, prompt, rows = 2, 384, 6, 1536, 3, 2
    model = whisper_decoder_step(layers, hidden, heads, ffn, "float16", vocab=1000)
    feeds = decoder_step_feeds(rows, prompt, layers, hidden, heads, 1500, "float16", seed=4)
    fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    presents = {n.replace("past_", "present_", 1): v for n, v in feeds.items() if n.startswith("past_")}
    stream = cupy.cuda.Stream(non_blocking=True)
    logits = {}
    for rule in (False, True):
        decoder = static_decoder(model, rows, stream, fixed, decode_matmul=rule)
        decoder.load_prompt(presents, prompt)
        with stream:
            decoder.ids[...] = cupy.asarray([[5], [7]], decoder.ids.dtype)
            decoder.past_sequence_length[...] = prompt
        for _ in range(3):  # ORT captures the graph on an early run; the others replay it
            decoder.step()
            stream.synchronize()
            logits.setdefault(rule, []).append(cupy.asnumpy(decoder.logits).astype(np.float64))
    plain, rewritten = logits[False][-1], logits[True]
    assert all(np.array_equal(rewritten[0], r) for r in rewritten[1:]), "a replay gave other logits"
    assert np.abs(rewritten[-1] - plain).max() <= 4e-3 * max(1.0, np.abs(plain).max())
