"""The native route (mha_ep/native): the custom-op library's ABI layer, its plans, and its kernels in plain ORT sessions.

CPU (every machine, CI included; the parity suites also run through its CPU kernels: the ``run_backend`` fixture's
"reference-native" case):
  * the library is built, loads, and calls the OrtApi ordinals and OrtCustomOp layout of onnxruntime_c_api.h;
  * it compiles warning-free with the machine's C compiler;
  * plans: the planner's encoding is what the library parses; malformed plans are refused with a reason;
  * kernels: attributes are read and refused like the partition's check; errors are ORT statuses naming the node,
    the input and its shape, and the next run works; threads; sessions made and dropped in a loop; interpreter
    shutdown with live sessions; ORT's profile places the node on the provider it should.
GPU (marker ``gpu``; onnxruntime-gpu on the path): the same sessions on CUDAExecutionProvider: no Memcpy node and
the CUDA provider in ORT's profile, no planner call on a repeated signature, bfloat16 in a plain session, ORT's
CUDA graph capturing claimed nodes with replays bit-identical to eager runs, the Python op's form of a model, the
three-phase path and poisoned temporaries.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep
from conftest import PARITY_TOLERANCE, native_cuda_unavailable_reason
from mha_ep import native, spec
from mha_ep.native import configs
from mha_ep.native import plan as native_plan
from mha_ep.ops.backends.cuda.fused import DeviceFacts
from mha_models import (
    MhaConfig, assert_outputs_match, build_model, input_shapes, oracle_float64, random_feeds, stock_outputs, with_,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SOURCE = REPO / "mha_ep" / "native" / "_native.c"
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
ELEMENT_CODES = {"float32": 1, "float16": 10, "bfloat16": 16, "int32": 6, "int64": 7}

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


def library():
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.fail(reason)  # CI builds it (the README's install): its absence is a failure, not a skip
    return native.library()


def native_session(model, backend: str = "reference", providers=None, options=None, **kwargs):
    """A plain onnxruntime.InferenceSession over ``model`` partitioned in the native form, registered natively."""
    library()
    part = mha_ep.partition(model, route="native")
    options = mha_ep.register(options or ort.SessionOptions(), backend=backend, route="native")
    return ort.InferenceSession(part.model.SerializeToString(), options, providers=providers or ["CPUExecutionProvider"],
                                **kwargs)  # fmt: skip


def run_named(session, feeds) -> dict:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def tolerance(dtype: str) -> float:
    return PARITY_TOLERANCE.get(dtype, 2e-2)


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
    done = subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{include}",
                           str(SOURCE), "-o", str(tmp_path / "native.so")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


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
}


def described(config: MhaConfig) -> int:
    """The config id the library gets for ``config``'s claimed node (native form)."""
    part = mha_ep.partition(build_model(config), route="native")
    node = next(n for n in part.model.graph.node if n.domain == spec.PLUGIN_DOMAIN)
    return configs.describe_kernel({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}, "cuda")[0]


def signature_of(config: MhaConfig, alignment: int = 8):
    """(KernelConfig, Signature) of ``config``'s node as the library would hand them to the planner."""
    kernel = configs.config(described(config))
    shapes = input_shapes(config)
    entries = []
    for name in spec.PLUGIN_INPUTS:
        if name not in kernel.supplied:
            entries.append(None)
            continue
        dtype = config.mask_dtype if name == "key_padding_mask" else config.dtype
        entries.append((ELEMENT_CODES[dtype], shapes[name], alignment))
    return kernel, native_plan.Signature(tuple(entries))


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
            want["present_key"] = (config.batch, config.num_heads, config.total_seq, config.head_size)
        assert plan.output_shapes[0] == want["output"]
        assert plan.output_shapes[1] == want.get("present_key", (0,))
        if flags:  # every wanted output is written to scratch, then copied into ORT's buffer
            assert [s["kind"] for s in summary["steps"][-len(want) - bool(config.presents):]].count("copy") >= len(want)


def test_plans_bind_only_inputs_outputs_and_scratch_within_its_size():
    from mha_ep.ops.backends.cuda.steps import Buffer, addresses_of

    for config in PLAN_CASES.values():
        kernel, signature = signature_of(config)
        plan = native_plan.plan_steps(kernel, signature, FACTS[0])
        for step in plan.steps:
            for address in addresses_of(step):
                assert isinstance(address, Buffer), (config.short(), step)
                if address.name == "scratch":
                    assert address.offset < plan.scratch_bytes
                else:
                    assert address.name in {f"in{i}" for i in range(8)} | {"out0", "out1", "out2"}


def test_unaligned_inputs_are_copied_to_aligned_scratch_before_the_kernels_read_them():
    from mha_ep.ops.backends.cuda.steps import Copy

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
    ([native_plan.PLAN_MAGIC, 1, 0, 16, 3, 0, 0, 0, 1, 9], "unknown step kind 9"),
    ([native_plan.PLAN_MAGIC, 1, 0, 16, 3, 0, 0, 0, 1, 3, 1, 9, 0, 3, 0, 0, 16], "index = 9"),
    ([native_plan.PLAN_MAGIC, 1, -1], "scratch = -1"),
    ([native_plan.PLAN_MAGIC, 1, 0, 16, 3, 0, 0, 0, 0, 7], "1 words after the last step"),
])  # fmt: skip
def test_malformed_plans_are_refused_with_a_reason(words, message):
    import struct

    with pytest.raises(ValueError, match=message):
        library().check_plan(struct.pack(f"<{len(words)}q", *words))


# --------------------------------------------------------------------------------------------- kernels, CPU
def crafted(model: onnx.ModelProto, **changes) -> onnx.ModelProto:
    """``model`` partitioned natively, with the claimed node's attributes replaced by ``changes`` (None: removed)."""
    part = mha_ep.partition(model, route="native").model
    node = next(n for n in part.graph.node if n.domain == spec.PLUGIN_DOMAIN)
    kept = [a for a in node.attribute if a.name not in changes]
    del node.attribute[:]
    node.attribute.extend(kept)
    for name, value in changes.items():
        if value is not None:
            node.attribute.append(onnx.helper.make_attribute(name, value))
    return part


@pytest.mark.parametrize("changes, message", [
    ({spec.ATTR_INPUTS: None}, "attribute(s) mha_ep_inputs missing"),
    ({spec.ATTR_DTYPE: "float64"}, "mha_ep_dtype is 'float64'"),
    ({spec.ATTR_FLOATS: "scale=zz"}, "mha_ep_floats is not readable"),
    ({"num_heads": 0}, "num_heads must be > 0"),
    ({spec.ATTR_NODE: b"\xff\xfe"}, "mha_ep_node is not UTF-8"),
])  # fmt: skip
def test_a_crafted_node_fails_the_session_with_its_attribute_named(changes, message):
    library()
    model = crafted(build_model(MhaConfig()), **changes)
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_a_bad_input_is_an_ort_error_naming_node_input_and_shape_and_the_next_run_works(rng):
    config = MhaConfig(mask="2d", shapes="symbolic")
    session = native_session(build_model(config))
    good = random_feeds(config, rng)
    bad = dict(good, key_padding_mask=good["key_padding_mask"][:, :3])
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument) as caught:
        session.run(None, bad)
    text = str(caught.value)
    assert "mha_ep MultiHeadAttention node 'mha'" in text and "key_padding_mask" in text and "(2, 3)" in text, text
    assert_outputs_match(run_named(session, good), stock_outputs(config, good), 1e-5, "after the bad run")


def test_bfloat16_and_float16_nodes_keep_their_type_and_run_on_the_cpu_kernels(rng):
    for dtype in ("float16", "bfloat16"):
        config = MhaConfig(dtype=dtype, bias=True, mask="1d", has_past=True, past_seq=2, presents=True)
        part = mha_ep.partition(build_model(config), route="native")
        node = next(n for n in part.model.graph.node if n.domain == spec.PLUGIN_DOMAIN)
        assert all(not name.endswith(spec.TRANSPORT_IN) for name in node.input)
        assert spec.absent_float(dtype) in node.input  # attention_bias's placeholder has the node's type
        session = native_session(build_model(config))
        feeds = random_feeds(config, rng)
        want = oracle_float64(config, feeds) if dtype == "bfloat16" else stock_outputs(config, feeds)
        assert_outputs_match(run_named(session, feeds), want, tolerance(dtype), config.short())


def test_the_python_op_form_of_a_model_runs_on_the_native_kernels(rng):
    config = MhaConfig(dtype="float16", bias=True, mask="2d")
    library()
    part = mha_ep.partition(build_model(config))  # route="python-op": float32 Casts around the node
    options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
    session = ort.InferenceSession(part.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = random_feeds(config, rng)
    assert_outputs_match(run_named(session, feeds), stock_outputs(config, feeds), tolerance("float16"), "python-op form")


def profile_providers(session) -> tuple:
    """(providers of the MultiHeadAttention events, op names of every node event) of a profiled session's run."""
    path = session.end_profiling()
    events = json.loads(Path(path).read_text())
    Path(path).unlink()
    nodes = [e for e in events if e.get("cat") == "Node" and "args" in e and "op_name" in e["args"]]
    providers = {e["args"].get("provider") for e in nodes if e["args"]["op_name"] == "MultiHeadAttention"}
    return providers, {e["args"]["op_name"] for e in nodes}


def profiled_options():
    options = ort.SessionOptions()
    options.enable_profiling = True
    return options


def test_ort_s_profile_places_the_claimed_node_on_the_cpu_provider(rng, tmp_path):
    config = MhaConfig(mask="1d")
    options = profiled_options()
    options.profile_file_prefix = str(tmp_path / "profile")
    session = native_session(build_model(config), options=options)
    session.run(None, random_feeds(config, rng))
    providers, _ = profile_providers(session)
    assert providers == {"CPUExecutionProvider"}


def test_threads_share_one_session_and_several_sessions_run_at_once(rng):
    configs_ = [with_(MhaConfig(mask="2d", bias=True, shapes="symbolic"), batch=1 + i % 3, q_seq=2 + i % 4)
                for i in range(8)]  # fmt: skip
    shared = native_session(build_model(configs_[0]))
    others = [native_session(build_model(configs_[0])) for _ in range(2)]
    feeds = [random_feeds(c, np.random.default_rng(i)) for i, c in enumerate(configs_)]
    expected = [stock_outputs(c, f) for c, f in zip(configs_, feeds)]
    failures = []

    def work(index: int):
        try:
            for turn in range(10):
                session = shared if turn % 2 else others[index % 2]
                assert_outputs_match(run_named(session, feeds[index]), expected[index], 1e-5, f"thread {index}")
        except BaseException as error:  # noqa: BLE001
            failures.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def test_a_thousand_sessions_made_and_dropped_do_not_grow_memory(rng):
    import gc

    config = MhaConfig(mask="1d")
    model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
    feeds = random_feeds(config, rng)

    def cycle(count: int):
        for _ in range(count):
            options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            session.run(None, feeds)
            del session, options
        gc.collect()

    cycle(100)  # warm-up: allocator pools, ORT's statics
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cycle(1000)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.1f} MiB over 1000 sessions"


def test_the_interpreter_exits_cleanly_with_live_sessions():
    """Sessions still alive at exit (held by a module global and by a reference cycle), on both routes' forms.
    (A daemon thread still inside a run at exit aborts the process with stock ORT alone: not tested.)"""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import numpy as np, onnxruntime as ort, mha_ep
        from mha_models import MhaConfig, build_model, random_feeds
        config = MhaConfig(dtype="float16", mask="1d")
        feeds = random_feeds(config, np.random.default_rng(0))
        model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
        kept = []
        for _ in range(3):
            options = mha_ep.register(ort.SessionOptions(), backend="reference", route="native")
            kept.append(ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]))
            kept[-1].run(None, feeds)
        cycle = {{"session": mha_ep.InferenceSession(build_model(config), backend="reference", route="native",
                                                     device_mode="python-op")}}
        cycle["self"] = cycle
        cycle["session"].run(None, feeds)
        print("done", flush=True)
    """)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert done.returncode == 0 and "done" in done.stdout, (done.returncode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_route_auto_takes_the_native_library_for_the_cuda_backend_only():
    from mha_ep.ops.backends import create_backend
    from mha_ep.ops.registration import choose_route

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


# --------------------------------------------------------------------------------------------- kernels, GPU
@pytest.fixture
def cuda_native():
    reason = native_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native route's CUDA kernels cannot run here: {reason}")
    ort.preload_dlls()
    yield
    native.settings.poison = False
    native.settings.fused_path = True
    native.reset_plans()


GPU_CASES = {
    "f16 bert": MhaConfig(dtype="float16", batch=2, q_seq=128, kv_seq=128, num_heads=12, head_size=64, bias=True,
                          mask="2d"),
    "f32 decode past": MhaConfig(batch=2, q_seq=1, kv_seq=1, past_seq=37, has_past=True, presents=True, num_heads=6,
                                 head_size=64, bias=True, mask="1d"),
    "bf16 causal": MhaConfig(dtype="bfloat16", batch=2, q_seq=33, kv_seq=33, num_heads=4, head_size=64, causal=True,
                             attention_bias="B1"),
    "f16 three phases": MhaConfig(dtype="float16", head_size=6, mask="3d", bias=True),
    "f16 cross BNSH": MhaConfig(dtype="float16", q_seq=7, kv_seq=300, kv_layout="BNSH", num_heads=6, head_size=64,
                                mask="3b2", mask_dtype="int64"),
}


def expected_of(config: MhaConfig, feeds: dict) -> dict:
    return oracle_float64(config, feeds) if config.dtype == "bfloat16" else stock_outputs(config, feeds)


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [False, True], ids=["plain", "poisoned"])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_cuda_kernels_in_a_plain_session_match_stock_ort(name, poison, cuda_native, rng, tmp_path):
    native.settings.poison = poison
    native.reset_plans()
    config = GPU_CASES[name]
    options = profiled_options()
    options.profile_file_prefix = str(tmp_path / "profile")
    session = native_session(build_model(config), backend="cuda", providers=CUDA, options=options)
    feeds = random_feeds(config, rng)
    assert_outputs_match(run_named(session, feeds), expected_of(config, feeds), tolerance(config.dtype), name)
    providers, ops = profile_providers(session)
    assert providers == {"CUDAExecutionProvider"}, providers
    assert not {op for op in ops if op.startswith("Memcpy")}, ops  # the model's inputs go up once, by ORT's binding


@pytest.mark.gpu
def test_a_repeated_signature_calls_no_python(cuda_native, rng):
    config = GPU_CASES["f16 bert"]
    session = native_session(build_model(config), backend="cuda", providers=CUDA)
    feeds = random_feeds(config, rng)
    session.run(None, feeds)
    before = native.stats()
    for _ in range(50):
        session.run(None, feeds)
    after = native.stats()
    assert after["misses"] == before["misses"] and after["hits"] >= before["hits"] + 50, (before, after)


@pytest.mark.gpu
def test_the_python_op_form_and_the_three_phase_path_run_on_the_cuda_kernels(cuda_native, rng):
    config = MhaConfig(dtype="float16", bias=True, mask="2d", q_seq=40, kv_seq=40, num_heads=4, head_size=32)
    library()
    part = mha_ep.partition(build_model(config))  # the float32 transport form
    options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
    feeds = random_feeds(config, rng)
    want = stock_outputs(config, feeds)
    for fused in (True, False):
        native.settings.fused_path = fused
        native.reset_plans()
        session = ort.InferenceSession(part.model.SerializeToString(), options, providers=CUDA)
        assert_outputs_match(run_named(session, feeds), want, tolerance("float16"), f"fused={fused}")


@pytest.mark.gpu
def test_ort_s_cuda_graph_captures_claimed_nodes_and_replays_bit_identical_with_fresh_inputs(cuda_native, rng):
    import cupy

    config = MhaConfig(dtype="float16", batch=2, q_seq=64, kv_seq=64, num_heads=4, head_size=64, bias=True,
                       mask="1d")  # fmt: skip
    model = build_model(config)
    eager = native_session(model, backend="cuda", providers=CUDA)
    graphed = native_session(model, backend="cuda", providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
                                                                  "CPUExecutionProvider"])  # fmt: skip
    first = random_feeds(config, rng)
    inputs = {name: cupy.asarray(value) for name, value in first.items()}
    output = cupy.empty((config.batch, config.q_seq, config.num_heads * config.hv), cupy.float16)
    binding = graphed.io_binding()
    for name, array in inputs.items():
        binding.bind_input(name, "cuda", 0, array.dtype, array.shape, array.data.ptr)
    binding.bind_output("output", "cuda", 0, output.dtype, output.shape, output.data.ptr)
    for turn in range(6):  # ORT captures on an early run and replays from then on
        feeds = first if turn == 0 else random_feeds(config, np.random.default_rng(turn))
        for name, value in feeds.items():
            inputs[name][...] = cupy.asarray(value)
        graphed.run_with_iobinding(binding)
        cupy.cuda.runtime.deviceSynchronize()
        want = eager.run(["output"], feeds)[0]
        assert np.array_equal(cupy.asnumpy(output), want), f"turn {turn}: the replay differs from the eager run"


@pytest.mark.gpu
def test_cuda_sessions_made_and_dropped_in_a_loop_give_back_host_and_device_memory(cuda_native, rng):
    import gc

    import cupy

    config = GPU_CASES["f32 decode past"]
    model = mha_ep.partition(build_model(config), route="native").model.SerializeToString()
    feeds = random_feeds(config, rng)

    def cycle(count: int):
        for _ in range(count):
            options = mha_ep.register(ort.SessionOptions(), backend="cuda", route="native")
            session = ort.InferenceSession(model, options, providers=CUDA)
            session.run(None, feeds)
            del session, options
        gc.collect()

    cycle(20)
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cycle(200)
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert free_before - free_after < 64 << 20, f"device memory fell by {(free_before - free_after) >> 20} MiB"
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.1f} MiB over 200 CUDA sessions"


@pytest.mark.gpu
def test_inputs_and_outputs_bound_off_alignment_are_copied_not_misread(cuda_native, rng):
    """IOBinding at addresses 2 bytes off any vector alignment: the plan copies the inputs into aligned scratch
    and writes the outputs through scratch (UNALIGNED_OUTPUTS), so the results equal an aligned run's."""
    import cupy

    config = MhaConfig(dtype="float16", q_seq=16, kv_seq=16, num_heads=2, head_size=64, bias=True,
                       presents=True)  # fmt: skip
    session = native_session(build_model(config), backend="cuda", providers=CUDA)
    feeds = random_feeds(config, rng)
    want = run_named(session, feeds)
    binding = session.io_binding()
    keep = []
    for name, value in feeds.items():
        raw = cupy.zeros(value.size + 8, value.dtype)
        view = raw[1 : 1 + value.size].reshape(value.shape)
        view[...] = cupy.asarray(value)
        keep.append(raw)
        binding.bind_input(name, "cuda", 0, value.dtype, value.shape, view.data.ptr)
    outputs = {}
    for name, value in want.items():
        raw = cupy.full(value.size + 8, np.nan, value.dtype)
        outputs[name] = raw[1 : 1 + value.size].reshape(value.shape)
        keep.append(raw)
        binding.bind_output(name, "cuda", 0, value.dtype, value.shape, outputs[name].data.ptr)
    session.run_with_iobinding(binding)
    cupy.cuda.runtime.deviceSynchronize()
    for name, value in want.items():
        assert np.array_equal(cupy.asnumpy(outputs[name]), value), name


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
