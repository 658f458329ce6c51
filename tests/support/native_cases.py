"""Helpers of the native route's tests (mha_ep/native): the library (a failure, not a skip, where it is missing:
the README's install builds it), plain ORT sessions on a natively partitioned model, the planner's view of a node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import onnx
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep import native, spec
from mha_ep.native import configs
from mha_ep.native import plan as native_plan

from conftest import PARITY_TOLERANCE, native_cuda_unavailable_reason
from harness import REPO
from mha_models import (
    MhaConfig,
    build_model,
    input_shapes,
    packed_model,
)  # fmt: skip

SOURCE = REPO / "mha_ep" / "native" / "csrc"  # the library's C sources


CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]


ELEMENT_CODES = {"float32": 1, "float16": 10, "bfloat16": 16, "int32": 6, "int64": 7}


@pytest.fixture
def cuda_native():
    """The native route's CUDA kernels, or a skip naming why they cannot run here; the process-wide settings and
    plans put back after the test (import it into a test module to use it)."""
    reason = native_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native route's CUDA kernels cannot run here: {reason}")
    ort.preload_dlls()
    yield
    native.settings.poison = False
    native.settings.fused_path = True
    native.settings.plans_ahead = type(native.settings).plans_ahead
    native.reset_plans()


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


def described(config: MhaConfig, form: Optional[str] = None) -> int:
    """The config id the library gets for ``config``'s claimed node (native form; ``form``: its packed node,
    mha_models.packed_model)."""
    part = mha_ep.partition(build_model(config) if form is None else packed_model(config, form), route="native")
    node = next(n for n in part.model.graph.node if n.domain == spec.PLUGIN_DOMAIN)
    return configs.describe_kernel({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}, "cuda")[0]


def signature_of(config: MhaConfig, alignment: int = 8, form: Optional[str] = None):
    """(KernelConfig, Signature) of ``config``'s node as the library would hand them to the planner (``form``
    "qkv": its packed QKV node, query (B, L, N, 3, H))."""
    kernel = configs.config(described(config, form))
    shapes = input_shapes(config)
    if form == "qkv":
        shapes["query"] = (config.batch, config.q_seq, config.num_heads, 3, config.head_size)
    elif form is not None:
        raise ValueError(f"signature_of takes form None or 'qkv', got {form!r}")
    entries = []
    for name in spec.PLUGIN_INPUTS:
        if name not in kernel.supplied:
            entries.append(None)
            continue
        dtype = {"key_padding_mask": config.mask_dtype, "past_sequence_length": "int32",
                 "cache_indirection": "int32"}.get(name, config.dtype)  # fmt: skip
        entries.append((ELEMENT_CODES[dtype], shapes[name], alignment))
    return kernel, native_plan.Signature(tuple(entries))


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
