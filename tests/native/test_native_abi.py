"""The native library's ABI layer, on any machine: the OrtApi ordinals and OrtCustomOp layout of
onnxruntime_c_api.h, a warning-free build, the planner's plans as the library parses them (and refuses malformed
ones), and the route register() takes."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep import native
from mha_ep.native import plan as native_plan
from mha_ep.engine.cuda.fused import DeviceFacts

from mha_models import (
    MhaConfig,
)  # fmt: skip
from native_cases import SOURCE, described, library, signature_of

# OrtApi ordinals, read off onnxruntime_c_api.h (ORT_API_VERSION 29; the table is append-only, so they hold for
# every later version): the position of each function in struct OrtApi.
ORT_API_ORDINALS = {
    "CreateStatus": 0, "GetErrorMessage": 2, "CreateCustomOpDomain": 26, "CustomOpDomain_Add": 27,
    "AddCustomOpDomain": 28, "GetTensorMutableData": 51, "GetTensorElementType": 60, "GetDimensionsCount": 61,
    "GetDimensions": 62, "GetTensorTypeAndShape": 65, "MemoryInfoGetId": 72, "KernelInfoGetAttribute_float": 85,
    "KernelInfoGetAttribute_int64": 86, "KernelInfoGetAttribute_string": 87, "KernelContext_GetInputCount": 88,
    "KernelContext_GetOutputCount": 89, "KernelContext_GetInput": 90, "KernelContext_GetOutput": 91,
    "ReleaseStatus": 93, "ReleaseTensorTypeAndShapeInfo": 99, "ReleaseAllocator": 132,
    "KernelContext_GetGPUComputeStream": 193, "GetSessionConfigEntry": 238, "KernelInfo_GetNodeName": 244,
    "KernelContext_GetResource": 265, "KernelContext_GetScratchBuffer": 277, "KernelInfoGetAllocator": 278,
}  # fmt: skip


# struct OrtCustomOp after its uint32 version: one function pointer each, in this order (onnxruntime_c_api.h)
CUSTOM_OP_FIELDS = (
    "CreateKernel", "GetName", "GetExecutionProviderType", "GetInputType", "GetInputTypeCount", "GetOutputType",
    "GetOutputTypeCount", "KernelCompute", "KernelDestroy", "GetInputCharacteristic", "GetOutputCharacteristic",
    "GetInputMemoryType", "GetVariadicInputMinArity", "GetVariadicInputHomogeneity", "GetVariadicOutputMinArity",
    "GetVariadicOutputHomogeneity", "CreateKernelV2", "KernelComputeV2", "InferOutputShapeFn", "GetStartVersion",
    "GetEndVersion", "GetMayInplace", "ReleaseMayInplace", "GetAliasMap", "ReleaseAliasMap",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------- the ABI
def test_the_library_loads_and_calls_the_ordinals_of_ort_s_header():
    module = library()
    assert module.ordinals() == ORT_API_ORDINALS
    layout = module.layout()
    assert layout["api_version"] == 18 and layout["op_version"] == 18
    offsets = {name: 8 + 8 * i for i, name in enumerate(CUSTOM_OP_FIELDS)}
    assert layout["custom_op_size"] == 8 + 8 * len(CUSTOM_OP_FIELDS)
    assert layout["create_kernel_v2"] == offsets["CreateKernelV2"]
    assert layout["kernel_compute_v2"] == offsets["KernelComputeV2"]
    assert layout["get_start_version"] == offsets["GetStartVersion"]
    assert layout["input_memory_type"] == offsets["GetInputMemoryType"]
    assert (layout["plan_magic"], layout["plan_version"]) == (native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION)
    assert Path(native.library_path()).resolve().parent == SOURCE.parent  # ORT opens the file Python loaded


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_the_library_compiles_warning_free(tmp_path):
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        pytest.skip("the Python headers are not installed")
    sources = [str(path) for path in sorted(SOURCE.glob("*.c"))]
    done = subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{include}",
                           *sources, "-o", str(tmp_path / "native.so")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_library_built_from_another_source_is_refused_with_how_to_rebuild(tmp_path, monkeypatch):
    """setup.py builds the sources' SHA-256 into the library; an edit to a file of csrc/ (a .c or a .h) since then
    makes the native route unavailable with the rebuild command, instead of tests and sessions silently running the
    old binary."""
    module = library()
    assert module.source_sha256() == native.source_sha256(SOURCE)  # this checkout's build
    listing = "".join(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
                      for path in sorted([*SOURCE.glob("*.c"), *SOURCE.glob("*.h")], key=lambda path: path.name))
    assert native.source_sha256(SOURCE) == hashlib.sha256(listing.encode()).hexdigest()  # every .c and .h, by name
    assert native.stale_reason(module, SOURCE) is None
    edited = tmp_path / "csrc"
    shutil.copytree(SOURCE, edited)
    header = edited / "native.h"
    header.write_bytes(header.read_bytes() + b"\n/* an edit */\n")
    reason = native.stale_reason(module, edited)
    assert reason is not None and "rebuild it with pip install -e ." in reason and str(edited) in reason
    assert native.stale_reason(module, tmp_path / "absent") is None  # a wheel carries no source: nothing to compare
    monkeypatch.setattr(native, "SOURCE", edited)
    assert "rebuild it with" in native.unavailable_reason()


# ------------------------------------------------------------------------------------------------- plans
FACTS = (DeviceFacts("90", 132), DeviceFacts("80", 108))


PLAN_CASES = {
    "f32 staged": MhaConfig(bias=True, mask="1d"),
    "f32 past presents": MhaConfig(bias=True, has_past=True, past_seq=4, presents=True, mask="2d"),
    "f16 mask 2d bias": MhaConfig(dtype="float16", batch=2, q_seq=64, kv_seq=64, num_heads=4, head_size=64,
                                  bias=True, mask="2d", attention_bias="1N"),
    "f16 wide heads": MhaConfig(dtype="float16", batch=4, q_seq=512, kv_seq=512, num_heads=8, head_size=128),
    "f16 three phases": MhaConfig(dtype="float16", head_size=6, mask="3d", mask_dtype="int64"),
    "bf16 BNSH causal": MhaConfig(dtype="bfloat16", kv_layout="BNSH", causal=True, q_seq=5, kv_seq=5, bias=True),
    "f16 past key bias": MhaConfig(dtype="float16", bias=True, has_past=True, past_seq=3, presents=True),
    "f32 shared buffer": MhaConfig(q_seq=1, kv_seq=1, bias=True, has_past=True, past_seq=3, presents=True, max_seq=8),
    "f16 shared beams mask": MhaConfig(dtype="float16", batch=4, q_seq=1, kv_seq=1, bias=True, has_past=True,
                                       past_seq=3, presents=True, max_seq=8, beams=2, mask="2d", mask_dtype="int64"),
    "bf16 shared prompt causal": MhaConfig(dtype="bfloat16", q_seq=4, kv_seq=4, has_past=True, past_seq=0,
                                           presents=True, max_seq=16, causal=True, attention_bias="1N"),
    "f16 cross decode": MhaConfig(dtype="float16", batch=2, q_seq=1, kv_seq=300, num_heads=6, head_size=64,
                                  kv_layout="BNSH", bias=True, mask="1d"),
}


@pytest.mark.parametrize("facts", FACTS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_plans_encode_to_what_the_library_parses(name, facts):
    config = PLAN_CASES[name]
    kernel, signature = signature_of(config)
    for flags in (0, native_plan.UNALIGNED_OUTPUTS):
        plan = native_plan.plan_steps(kernel, signature, facts, flags)
        handles = {}
        encoded = native_plan.encode_plan(plan, lambda launch: handles.setdefault(launch.function, len(handles) + 1))
        summary = library().check_plan(encoded)
        assert summary["scratch_bytes"] == plan.scratch_bytes
        assert summary["outputs"] == [tuple(s) for s in plan.output_shapes]
        assert len(summary["steps"]) == len(plan.steps)
        launches = [s for s in summary["steps"] if s["kind"] == "launch"]
        assert [s["function"] for s in launches] == [handles[s.function] for s in plan.steps if hasattr(s, "function")]
        want = {"output": (config.batch, config.q_seq, config.num_heads * config.hv)}
        if config.presents:
            want["present_key"] = (config.batch, config.num_heads, config.max_seq or config.total_seq, config.head_size)
        assert plan.output_shapes[0] == want["output"]
        assert plan.output_shapes[1] == want.get("present_key", (0,))
        if flags and not config.max_seq:  # every wanted output is written to scratch, then copied into ORT's buffer
            assert [s["kind"] for s in summary["steps"][-len(want) - bool(config.presents):]].count("copy") >= len(want)


def test_plans_bind_only_inputs_outputs_and_scratch_within_its_size():
    from mha_ep.engine.cuda.steps import Buffer, addresses_of

    for config in PLAN_CASES.values():
        kernel, signature = signature_of(config)
        plan = native_plan.plan_steps(kernel, signature, FACTS[0])
        for step in plan.steps:
            for address in addresses_of(step):
                assert isinstance(address, Buffer), (config.short(), step)
                if address.name == "scratch":
                    assert address.offset < plan.scratch_bytes
                else:
                    assert address.name in {f"in{i}" for i in range(10)} | {"out0", "out1", "out2", "sticky"}


def test_unaligned_inputs_are_copied_to_aligned_scratch_before_the_kernels_read_them():
    from mha_ep.engine.cuda.steps import Copy

    kernel, signature = signature_of(PLAN_CASES["f16 mask 2d bias"], alignment=1)
    plan = native_plan.plan_steps(kernel, signature, FACTS[0])
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    assert {c.src.name for c in copies} >= {"in0", "in1", "in2", "in3"} and all(c.dst.name == "scratch" for c in copies)


def test_a_signature_the_rules_refuse_names_the_input_and_its_shape():
    from mha_ep.errors import MhaInputError

    kernel, signature = signature_of(MhaConfig(dtype="float16", mask="2d"))
    entries = list(signature.inputs)
    entries[4] = (6, (2, 3), 8)  # a (B, T) mask with T = 3 instead of 5
    with pytest.raises(MhaInputError, match=r"key_padding_mask"):
        native_plan.plan_steps(kernel, native_plan.Signature(tuple(entries)), FACTS[0])
    entries = list(signature.inputs)
    entries[1] = (1, entries[1][1], 8)  # key in float32 beside a float16 query
    with pytest.raises(MhaInputError, match=r"input key \[2, 5, 16\] is float32, expected float16"):
        native_plan.plan_steps(kernel, native_plan.Signature(tuple(entries)), FACTS[0])


@pytest.mark.parametrize("words, message", [
    ([], "ends early"),
    ([native_plan.PLAN_MAGIC, 99], "not a plan of version"),
    ([native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION, 0, 16, 4, 0, 0, 0, 0, 1, 9], "unknown step kind 9"),
    ([native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION, 0, 16, 4, 0, 0, 0, 0, 1, 3, 1, 19, 0, 3, 0, 0, 16],
     "index = 19"),
    ([native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION, -1], "scratch = -1"),
    ([native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION, 0, 16, 4, 0, 0, 0, 0, 0, 7], "1 words after the last step"),
    ([native_plan.PLAN_MAGIC, native_plan.PLAN_VERSION, 0, 16, 4, 0, 0, 0, 0, 1, 5, 3, 0, 0, -1], "beams = -1"),
])  # fmt: skip
def test_malformed_plans_are_refused_with_a_reason(words, message):
    import struct

    with pytest.raises(ValueError, match=message):
        library().check_plan(struct.pack(f"<{len(words)}q", *words))


def test_route_auto_takes_the_native_library_for_the_cuda_backend_only():
    from mha_ep.engine.backends import create_backend
    from mha_ep.registration import choose_route

    library()
    reference = create_backend("reference")
    assert choose_route("auto", reference)[0] == "python-op"
    assert choose_route("native", reference)[0] == "native"

    class CudaLike:
        name = "cuda"

    assert choose_route("auto", CudaLike())[0] == "native"
    options = mha_ep.register(ort.SessionOptions(), backend="reference")
    assert mha_ep.route_of(options) == "python-op"
    with pytest.raises(ValueError, match="already carry mha_ep's python-op route"):
        mha_ep.register(options, backend="reference", route="native")
    assert mha_ep.route_of(mha_ep.register(ort.SessionOptions(), backend="reference", route="native")) == "native"


def test_the_planner_callback_answers_a_failure_and_never_raises():
    """gpu.plan_call is what the library calls on a plan miss: whatever goes wrong (here, on a CPU machine, CuPy
    itself is missing or the rules refuse the call) comes back as (code, message) naming the node."""
    from mha_ep.native import gpu

    config = MhaConfig(dtype="float16", mask="2d")
    _, signature = signature_of(config)
    entries = list(signature.inputs)
    entries[4] = (6, (2, 3), 8)
    answer = gpu.plan_call(described(config), "mha", 0, 0, tuple(entries))
    assert isinstance(answer, tuple) and answer[0] in (1, 2) and "node 'mha'" in answer[1], answer


@pytest.mark.parametrize("kv_layout", ["BSNH", "BNSH"])
def test_a_float16_call_without_bias_past_or_present_reads_its_inputs_in_place(kv_layout):
    """An encoder's or a diffusion model's attention on the native route (pipeline.reads_sources_in_place: no
    projection bias, no past, no present): no layout mover copies Q, K or V; the flash kernel reads the node's
    buffers through their strides (BSNH query, BSNH or BNSH key / value) and writes the node's float16 output
    itself (out_narrow: no float32 scratch, no narrowing launch). The same call with a bias keeps the movers."""
    from mha_ep.engine.cuda.steps import Buffer, Pointer

    config = MhaConfig(**{**PLAN_CASES["f16 wide heads"].__dict__, "kv_layout": kv_layout})
    plan = native_plan.plan_steps(*signature_of(config), FACTS[0])
    functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in plan.steps]
    assert functions == ["flash_attention_ws"], functions
    args = plan.steps[0].args
    pointers = [arg.address for arg in args if isinstance(arg, Pointer)]
    # out_BSD null, out_narrow_BSD the output; no tail slots (a whole-tile walk: dispatch.ws_tail is None here)
    assert pointers[-4:] == [None, Buffer("out0", 0, 256), None, None], pointers
    assert [args[i].address for i in (0, 5, 10)] == [Buffer(f"in{i}", 0, 256) for i in range(3)]
    b, s, n, h = config.batch, config.q_seq, config.num_heads, config.head_size
    assert [int(x) for x in args[1:4]] == [s * n * h, h, n * h]  # BSNH query
    kv_strides = [s * n * h, h, n * h] if kv_layout == "BSNH" else [n * s * h, s * h, h]
    assert [int(x) for x in args[6:9]] == kv_strides and [int(x) for x in args[11:14]] == kv_strides
    biased = native_plan.plan_steps(*signature_of(MhaConfig(**{**config.__dict__, "bias": True})), FACTS[0])
    assert biased.steps[0].function.startswith("build_dense_BNTH_native"), biased.steps[0]


def test_a_float16_cross_attention_decode_step_reads_its_key_and_value_in_place():
    """A decoder's cross attention on the native route (pipeline.reads_kv_in_place): no layout mover copies the
    BNSH key and value; the arrival counters zeroed, and one split_key_stream reading the node's query, key, value
    and bias buffers (b_q in float16, where the node holds it: no widening launch) and writing the node's float16 output itself (out_narrow: no float32
    scratch, no combine or narrowing launch). The same call with a present wanted keeps the movers; the earlier
    split-key pair (MHA_EP_SPLIT_KERNEL=pair) writes the output from its combine."""
    from mha_ep.engine.cuda.steps import Buffer, Fill, Pointer

    config = PLAN_CASES["f16 cross decode"]
    kernel, signature = signature_of(config)
    plan = native_plan.plan_steps(kernel, signature, FACTS[0])
    functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in plan.steps]
    assert functions == ["resolve_key_lengths", "Fill", "split_key_stream"], functions
    fill, attention = plan.steps[1:]
    pointers = [arg.address for arg in attention.args if isinstance(arg, Pointer)]
    assert Buffer("in0", 0, 256) in pointers and Buffer("in1", 0, 256) in pointers and Buffer("in2", 0, 256) in pointers
    assert attention.args[4].address.name == "in3", attention.args[:5]  # bias_q: the bias input's first slice
    assert attention.args[-2] == 0  # round_query 0: q + b_q stays in float32
    assert attention.args[-1] == Pointer(None)  # no qk
    assert attention.args[-3] == Pointer(fill.dst) and fill.dst.name == "scratch"  # the counters the Fill zeroes
    assert isinstance(fill, Fill) and fill.byte == 0 and fill.nbytes == 4 * config.batch * config.num_heads
    assert attention.args[-9:-7] == (Pointer(None), Pointer(Buffer("out0")))  # out_BSD null, out_narrow the output
    summary = library().check_plan(native_plan.encode_plan(plan, lambda launch: 1))
    assert [s["kind"] for s in summary["steps"]] == ["launch", "fill", "launch"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHA_EP_SPLIT_KERNEL", "pair")
        pair = native_plan.plan_steps(kernel, signature, FACTS[0])
    functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in pair.steps]
    assert functions == ["resolve_key_lengths", "split_key_attention", "combine_key_splits"]
    assert pair.steps[-1].args[-2:] == (Pointer(None), Pointer(Buffer("out0")))  # the combine writes the output
    with_present = native_plan.plan_steps(*signature_of(MhaConfig(**{**config.__dict__, "presents": True})), FACTS[0])
    assert any(getattr(s, "function", "").startswith("build_dense_BNTH_native") for s in with_present.steps)
    # qk (Whisper's --output_cross_qk): the same in-place launches, the split-key kernel writing the scores into a
    # float32 scratch buffer that one narrowing rounds into output 3 (no three-phase path)
    with_qk = native_plan.plan_steps(*signature_of(MhaConfig(**{**config.__dict__, "qk": True})), FACTS[0])
    functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in with_qk.steps]
    assert functions == ["resolve_key_lengths", "Fill", "split_key_stream", "narrow_output"], \
        functions  # fmt: skip
    qk_scratch = with_qk.steps[2].args[-1].address
    assert qk_scratch.name == "scratch" and with_qk.steps[-1].args[0].address == qk_scratch
    assert with_qk.steps[-1].args[1].address == Buffer("out3")
    assert with_qk.output_shapes[3] == (config.batch, config.num_heads, config.q_seq, config.total_seq)


@pytest.mark.parametrize("facts", FACTS, ids=["sm90", "sm80"])
def test_a_programmatic_cross_attention_zeroes_its_counters_in_a_kernel_and_both_launches_are_programmatic(facts):
    """MHA_EP_PROGRAMMATIC=on (dispatch.programmatic_launches), on sm_90: the arrival counters are zeroed by
    zero_after_prior_grids instead of a Fill (a Fill cannot be followed programmatically), and it and
    split_key_stream are launched with programmatic stream serialization, which the library's plan keeps. On sm_80,
    and without the variable, the Fill and a plain launch; an unknown value is refused."""
    from mha_ep.engine.cuda.steps import Pointer

    kernel, signature = signature_of(PLAN_CASES["f16 cross decode"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHA_EP_PROGRAMMATIC", "on")
        plan = native_plan.plan_steps(kernel, signature, facts)
    functions = [getattr(step, "function", type(step).__name__).split("<")[0] for step in plan.steps]
    summary = library().check_plan(native_plan.encode_plan(plan, lambda launch: 1))
    if facts.capability == "80":
        assert functions == ["resolve_key_lengths", "Fill", "split_key_stream"], functions
        assert [s.get("programmatic") for s in summary["steps"]] == [0, None, 0]
        return
    assert functions == ["resolve_key_lengths", "zero_after_prior_grids", "split_key_stream"], functions
    zero, attention = plan.steps[1:]
    assert zero.args == (attention.args[-3], np.int32(2 * 6)) and isinstance(zero.args[0], Pointer)
    assert [s["kind"] for s in summary["steps"]] == ["launch"] * 3
    assert [s["programmatic"] for s in summary["steps"]] == [0, 1, 1]
    plain = native_plan.plan_steps(kernel, signature, facts)
    assert not any(getattr(step, "programmatic", False) for step in plain.steps)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHA_EP_PROGRAMMATIC", "yes")
        with pytest.raises(ValueError, match="MHA_EP_PROGRAMMATIC='yes'"):
            native_plan.plan_steps(kernel, signature, facts)


WIDE_SHARED = MhaConfig(q_seq=1, kv_seq=1, has_past=True, past_seq=3, presents=True, max_seq=8, head_size=192)


@pytest.mark.parametrize("config, programmatic", [(PLAN_CASES["f16 shared beams mask"], True),
                                                  (PLAN_CASES["bf16 shared prompt causal"], True),
                                                  (PLAN_CASES["f32 shared buffer"], True), (WIDE_SHARED, False)],
                         ids=["f16 beams", "bf16 prompt", "f32", "f32 head 192"])  # fmt: skip
def test_a_programmatic_shared_buffer_step_zeroes_its_status_in_a_kernel(config, programmatic):
    """MHA_EP_PROGRAMMATIC=on on sm_90: a shared buffer's shared_buffer_decode follows zero_after_prior_grids (its
    status words) and both are launched programmatically; the tiled kernel (a float32 head of 192, wider than a
    warp's loads) keeps the Fill and a plain launch."""
    from mha_ep.engine.cuda.steps import CheckStatus, Pointer

    kernel, signature = signature_of(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHA_EP_PROGRAMMATIC", "on")
        plan = native_plan.plan_steps(kernel, signature, FACTS[0], error_site=3)
    launches = [step for step in plan.steps if hasattr(step, "function")]
    assert isinstance(plan.steps[-1], CheckStatus)
    if not programmatic:
        assert type(plan.steps[0]).__name__ == "Fill" and not any(step.programmatic for step in launches)
        return
    zero, attention = plan.steps[0], launches[-1]
    assert zero.function == "zero_after_prior_grids<unsigned>" and attention.function.startswith("shared_buffer_decode")
    assert zero.programmatic and attention.programmatic
    assert zero.args[0] == Pointer(plan.steps[-1].status) == attention.args[-3]
    summary = library().check_plan(native_plan.encode_plan(plan, lambda launch: 1))
    assert [s.get("programmatic") for s in summary["steps"] if s["kind"] == "launch"][-1] == 1


# ------------------------------------------------------------------------------------------- shared buffers
def test_a_shared_buffer_plan_is_fixed_by_its_shapes_and_binds_its_past_and_present():
    """A static cache's step (engine/cuda/shared_buffer.py): status zeroed, the past copied into the present
    (a no-op at run time when they are one buffer), the attention (which also writes the new rows into the
    presents), the status check; every launch
    argument is a shape, an attribute or a named buffer (P is read on the device); ORT's outputs are written in
    place at any alignment."""
    from mha_ep.engine.cuda.steps import Buffer, CheckStatus, Fill, Pointer

    config = PLAN_CASES["f16 shared beams mask"]
    kernel, signature = signature_of(config)
    plan = native_plan.plan_steps(kernel, signature, FACTS[0], error_site=3)
    kinds = [type(step).__name__ for step in plan.steps]
    assert kinds == ["Fill", "Copy", "Copy", "Launch", "CheckStatus"], kinds
    fill, copy_key, copy_value, attention, check = plan.steps
    assert isinstance(fill, Fill) and fill.byte == 0 and fill.dst == check.status
    assert (copy_key.dst, copy_key.src) == (Buffer("out1"), Buffer("in6", 0, 256))
    assert (copy_value.dst, copy_value.src) == (Buffer("out2"), Buffer("in7", 0, 256))
    assert copy_key.nbytes == 2 * config.batch * config.num_heads * config.max_seq * config.head_size
    assert attention.function == "shared_buffer_decode<__half, long long>" and attention.shared == 0
    assert attention.grid == (config.batch * config.num_heads * config.q_seq, 1, 1)
    pointers = [arg.address for arg in attention.args if isinstance(arg, Pointer)]
    assert Buffer("in8", 0, 256) in pointers and Buffer("in9", 0, 256) in pointers
    assert Buffer("out1") in pointers and Buffer("out2") in pointers  # the new rows go into the presents
    assert native_plan.STICKY in pointers and np.int32(3) == attention.args[-1]  # the sticky words, the site
    assert isinstance(check, CheckStatus) and check.beams == config.beams
    assert plan.output_alignment == 2 and plan.output_shapes[1] == (4, 2, 8, 8)
    unaligned = native_plan.plan_steps(kernel, signature, FACTS[0], native_plan.UNALIGNED_OUTPUTS)
    assert [type(s) for s in unaligned.steps] == [type(s) for s in plan.steps]  # still ORT's own buffers
    summary = library().check_plan(native_plan.encode_plan(plan, lambda launch: 1))
    assert [s["kind"] for s in summary["steps"]] == ["fill", "copy", "copy", "launch", "check_status"]
    assert summary["output_alignment"] == 2


@pytest.mark.parametrize("head_size, chosen, kernel", [
    (8, "", "shared_buffer_decode"),  # the default
    (8, "tiled", "shared_buffer_attention"),  # asked for, for A/B timing
    (256, "", "shared_buffer_decode"),  # a warp's 32 loads of 8 float16 elements
    (264, "", "shared_buffer_attention"),  # wider than a warp's loads: the tiled kernel, whatever is asked
    (264, "decode", "shared_buffer_attention"),
])  # fmt: skip
def test_a_shared_buffer_step_runs_the_decode_kernel_where_a_warp_covers_the_head(head_size, chosen, kernel,
                                                                                   monkeypatch):
    """shared_buffer.shared_buffer_kernel: the lane-group kernel unless the head is wider than one warp's 16-byte
    loads or MHA_EP_SHARED_KERNEL asks for the tiled one; only the tiled kernel takes dynamic shared memory and a
    tile of keys (its next-to-last argument before the status words)."""
    from mha_ep.engine.cuda.shared_buffer import SHARED_KERNEL_ENV

    monkeypatch.setenv(SHARED_KERNEL_ENV, chosen)
    config = MhaConfig(**{**PLAN_CASES["f16 shared beams mask"].__dict__, "head_size": head_size})
    plan = native_plan.plan_steps(*signature_of(config), FACTS[0])
    attention = next(step for step in plan.steps if type(step).__name__ == "Launch")
    assert attention.function == f"{kernel}<__half, long long>"
    tiled = kernel == "shared_buffer_attention"
    assert (attention.shared > 0, int(attention.args[-4]) > 0) == (tiled, tiled)


def test_an_unknown_shared_kernel_name_is_refused(monkeypatch):
    from mha_ep.engine.cuda.shared_buffer import SHARED_KERNEL_ENV

    monkeypatch.setenv(SHARED_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="MHA_EP_SHARED_KERNEL='fast': expected one of"):
        native_plan.plan_steps(*signature_of(PLAN_CASES["f16 shared beams mask"]), FACTS[0])


@pytest.mark.parametrize("alignment", [8, 1])  # log2: 256 and 2 bytes
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_packed_shared_buffer_plan_reads_the_query_s_slots_in_place(dtype, alignment):
    """Packed QKV over a shared buffer (docs/SEMANTICS.md, "Packed QKV / KV: ours"): the decode kernel reads Q, K
    and V as the slots of ORT's packed query where it lies, at offsets 0, H and 2H elements with 3 slots a head,
    whatever the buffer's alignment (it reads them element by element): no copy of the packed buffer, the steps of
    the unpacked node. The unpacked node's launch reads its own three inputs with 1 slot a head."""
    from mha_ep.engine.cuda.steps import Pointer

    config = MhaConfig(dtype=dtype, batch=4, q_seq=1, kv_seq=1, num_heads=2, head_size=8, bias=True, has_past=True,
                       past_seq=3, presents=True, max_seq=8, beams=2, mask="2d")  # fmt: skip
    element = {"float16": 2, "float32": 4}[dtype]
    plans = {}
    for form in (None, "qkv"):
        kernel, signature = signature_of(config, alignment, form)
        plans[form] = native_plan.plan_steps(kernel, signature, FACTS[0])
    assert [type(s) for s in plans["qkv"].steps] == [type(s) for s in plans[None].steps]
    assert plans["qkv"].output_shapes == plans[None].output_shapes
    for form, slots, sources in ((None, 1, [(f"in{i}", 0) for i in range(3)]),
                                 ("qkv", 3, [("in0", i * 8 * element) for i in range(3)])):
        (attention,) = [step for step in plans[form].steps if getattr(step, "function", "").startswith("shared")]
        assert [(arg.address.name, arg.address.offset) for arg in attention.args[:3]] == sources, attention.args[:3]
        assert attention.args[3] == np.int32(slots) and isinstance(attention.args[4], Pointer)
        # the rest of the launch is the unpacked node's: the bias, the buffers, the shapes
        assert [str(a) for a in attention.args[4:]] == [str(a) for a in plans[None].steps[3].args[4:]]


def test_a_shared_buffer_plan_refuses_what_its_kernel_cannot_hold():
    """The tiled kernel holds a row of M scores in shared memory: a head wider than shared_buffer_decode takes
    (float32: 128) with a long buffer is refused at plan time; the decode kernel keeps no row and takes it."""
    from mha_ep.errors import MhaInputError

    config = MhaConfig(q_seq=1, kv_seq=1, has_past=True, past_seq=0, presents=True, max_seq=20_000, head_size=136)
    kernel, signature = signature_of(config)
    with pytest.raises(MhaInputError, match=r"a shared buffer of max_sequence_length 20000 needs \d+ bytes.*"
                                            r"heads wider than 128 elements take it"):  # fmt: skip
        native_plan.plan_steps(kernel, signature, FACTS[0])
    narrower = native_plan.plan_steps(*signature_of(MhaConfig(**{**config.__dict__, "head_size": 128})), FACTS[0])
    assert any(getattr(step, "function", "").startswith("shared_buffer_decode") for step in narrower.steps)


@pytest.mark.parametrize("code", range(1, 6))
def test_device_reports_read_the_same_from_c_and_python(code):
    """The native library words a kernel's report (after an eager call) as launch.device_error_text does (a decode
    loop's sticky report): one sentence, ORT's where ORT has one."""
    from mha_ep.launch import device_error_text

    assert library().device_error_text(code, 9, 7, 5, 3) == device_error_text(code, 9, 7, 5, beams=3)


def _packed_plan(form: str, dtype: str, head_size: int = 8, bias: bool = False):
    """The native plan of a packed QKV / KV node (B=2, N=2, a (B,) key-length mask) and its packed input's slot."""
    from mha_ep.native import configs
    from mha_models import packed_model
    from native_cases import ELEMENT_CODES

    config = MhaConfig(dtype=dtype, batch=2, q_seq=5 if form == "qkv" else 3, kv_seq=5, num_heads=2,
                       head_size=head_size, mask="1d", bias=bias)  # fmt: skip
    part = mha_ep.partition(packed_model(config, form), route="native")
    node = next(n for n in part.model.graph.node if n.domain == "mha_ep")
    kernel = configs.config(configs.describe_kernel(
        {a.name: __import__("onnx").helper.get_attribute_value(a) for a in node.attribute}, "cuda")[0])
    d = 2 * head_size
    shapes = {"query": (2, config.q_seq, d), "key": (2, 5, 2, 2, head_size), "key_padding_mask": (2,),
              "bias": (3 * d,)}  # fmt: skip
    if form == "qkv":
        shapes["query"] = (2, 5, 2, 3, head_size)
    entries = [None if name not in kernel.supplied else
               (ELEMENT_CODES["int32" if name == "key_padding_mask" else dtype], shapes[name], 16)
               for name in ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key",
                            "past_value", "past_sequence_length", "cache_indirection")]  # fmt: skip
    plan = native_plan.plan_steps(kernel, native_plan.Signature(tuple(entries)), FACTS[0])
    return config, plan, 0 if form == "qkv" else 1


def _reads_of(plan, buffer: str) -> list:
    """(step function, byte offset) of every pointer and mover field into ``buffer`` among the plan's steps."""
    from mha_ep.engine.cuda.steps import Buffer, Launch, Pointer, Struct, struct_fields

    found = []
    for step in plan.steps:
        if not isinstance(step, Launch):
            continue
        for arg in step.args:
            values = [arg.address] if isinstance(arg, Pointer) else []
            if isinstance(arg, Struct):
                values = [v for v, (_, kind) in zip(arg.values, struct_fields(arg.dtype)) if kind == "pointer"]
            found += [(step.function, v.offset) for v in values if isinstance(v, Buffer) and v.name == buffer]
    return found


@pytest.mark.parametrize("form, dtype", [("qkv", "float16"), ("kv", "bfloat16"), ("qkv", "float32")])
def test_a_packed_call_s_plan_reads_the_node_s_packed_buffer_in_place(form, dtype):
    """Packed QKV / KV on the native route: ORT hands the packed tensor as the node has it, and the steps read its
    slots where they lie (packed.source_slots): no copy of the packed buffer, and the fused kernel's Q, K, V
    are the slots at offsets 0, H, 2H elements with strides over all of a row's slots."""
    from mha_ep.engine.cuda.steps import Copy

    config, plan, packed_slot = _packed_plan(form, dtype)
    element = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    slots = 3 if form == "qkv" else 2
    reads = _reads_of(plan, f"in{packed_slot}")
    fused = [step for step in plan.steps if getattr(step, "fused", False)]
    assert fused, [getattr(s, "function", s) for s in plan.steps]
    offsets = sorted({offset for function, offset in reads if function == fused[0].function})
    expected = [i * 8 * element for i in range(slots)] if form == "qkv" else [0, 8 * element]
    assert offsets == expected, reads
    # The fused kernel's strides: (stride_b, stride_h, stride_s) = (L*N*slots*H, slots*H, N*slots*H) for the slots.
    args = fused[0].args
    k_strides = [int(x) for x in args[6:9]]
    assert k_strides == [5 * 2 * slots * 8, slots * 8, 2 * slots * 8], args[:12]
    assert not any(isinstance(step, Copy) for step in plan.steps)
    assert all(not function.startswith("widen") for function, _ in reads) or dtype == "float32"
    assert plan.output_shapes[0] == (2, config.q_seq, 16)


def test_a_packed_call_with_a_bias_moves_its_slots_in_place_with_the_movers():
    """A projection bias sends a packed call through the layout movers: they read the packed buffer's slots in
    place (layout.cu cur_slots = the packed input's slots), and nothing else reads it."""
    from mha_ep.engine.cuda.movers import MOVER_DTYPE
    from mha_ep.engine.cuda.steps import Struct

    _, plan, packed_slot = _packed_plan("qkv", "float16", bias=True)
    reads = _reads_of(plan, f"in{packed_slot}")
    assert {function.split("<")[0] for function, _ in reads} == {"build_dense_BNTH_native"}, reads
    movers = [arg for step in plan.steps for arg in getattr(step, "args", ()) if isinstance(arg, Struct)
              and arg.dtype == MOVER_DTYPE]  # fmt: skip
    assert [int(m.values[MOVER_DTYPE.names.index("cur_slots")]) for m in movers] == [3, 3, 3]
