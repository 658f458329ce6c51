"""The plugin op: onnxruntime-extensions registration, the result hook, and the never-raising op body.

Two ``@onnx_op`` definitions share the name ``mha_ep::MultiHeadAttention`` and differ only in the element type of
``key_padding_mask`` (int32, int64); ORT picks one by the node's input types. Every declared input, output and
attribute is required by the bridge: mha_ep/partition.py writes them all (see the placeholder convention in
mha_ep/spec.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
from typing import Optional

import numpy as np

from mha_ep import spec
from mha_ep.errors import BackendUnavailableError, MhaEpError
from mha_ep.ops.backends import cuda_unavailable_reason, create_backend
from mha_ep.ops.context import current_context, default_backend, set_default_backend
from mha_ep.ops.problem import build_problem, output_shapes

log = logging.getLogger("mha_ep")
EMPTY = np.zeros((0,), np.float32)
CONFIG_BACKEND = "mha_ep.backend"  # session config entries that record what register() chose
CONFIG_DEVICE = "mha_ep.device_id"
# ORT's intra-op threads spin for a while after each parallel node, waiting for more work. A claimed node runs
# right after such nodes (the Casts of a float16 model) and copies its inputs on threads of its own, which then
# share the cores with the spinning ones: on the H200 host the 8,512 float16 anchor took 21.2 ms a run with
# spinning and 15.0 ms without (same run, interleaved). attach() turns it off; a caller's own setting is kept.
ORT_SPINNING = "session.intra_op.allow_spinning"
_registered_lock = threading.Lock()
_registered = {"ops": False}
_said_fallback = {"done": False}


# ------------------------------------------------------------------------------------------------------ op body
def execute(arrays: list, attributes: dict) -> tuple:
    """One call of a claimed node. Returns (output, present_key, present_value) and never raises."""
    node_name = str(attributes.get(spec.ATTR_NODE, ""))
    context = current_context()
    try:
        supplied, outputs, ort_attributes, dtype = node_config(tuple(sorted(attributes.items())))
        by_slot = [array if name in supplied else None for name, array in zip(spec.PLUGIN_INPUTS, arrays)]
        backend = context.backend if context is not None else default_backend()
        if backend is None:
            backend = resolve_backend("auto", 0)
            set_default_backend(backend)
        problem = build_problem(ort_attributes, by_slot, dtype, outputs)
        result = backend.run(problem, borrow_outputs=True)  # the bridge copies the arrays before this thread's next call
        return (
            result.output_BSDv,
            result.present_key_BNTH if result.present_key_BNTH is not None else EMPTY,
            result.present_value_BNTHv if result.present_value_BNTHv is not None else EMPTY,
        )
    except BaseException as error:  # noqa: BLE001 - nothing may leave a Python op (it aborts the process)
        return fail(node_name, error, arrays, attributes, context)


@functools.lru_cache(maxsize=1024)
def node_config(attribute_items: tuple) -> tuple:
    """A claimed node's attributes -> (supplied input names, requested outputs, ORT attributes, dtype).

    The same node sends the same attributes on every call, so the parse is memoised on them.
    """
    attributes = dict(attribute_items)
    supplied = frozenset(filter(None, str(attributes[spec.ATTR_INPUTS]).split(",")))
    wanted = set(filter(None, str(attributes[spec.ATTR_OUTPUTS]).split(",")))
    outputs = tuple(name in wanted for name in spec.OUTPUTS)
    ort_attributes = {a.name: attributes[a.name] for a in spec.ORT_ATTRIBUTES if a.name in attributes}
    ort_attributes.update(spec.decode_floats(str(attributes.get(spec.ATTR_FLOATS, ""))))
    return supplied, outputs, ort_attributes, str(attributes[spec.ATTR_DTYPE])


def fail(node_name, error, arrays, attributes, context) -> tuple:
    if isinstance(error, MhaEpError):
        message = str(error)
    else:  # a bug or a backend failure: keep the traceback, it is what a maintainer needs
        message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    try:
        if context is not None:
            context.record(node_name, message)
        else:
            log.error("mha_ep: node %r failed; its outputs are NaN: %s", node_name, message)
    except BaseException:  # noqa: BLE001
        pass
    shapes = output_shapes(attributes, arrays)
    return tuple(np.full(shape, np.nan, np.float32) if shape else EMPTY for shape in shapes)


def _op_body(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value, **attributes):
    return execute([query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value], attributes)


# ------------------------------------------------------------------------------------------------- result hook
def _array_result_hook(k_id, feed, attributes):
    """onnxruntime-extensions' invocation hook, returning arrays instead of ``flatten().tolist()``.

    The C++ side accepts numpy arrays (a 4M-float output: 9 ms instead of 367 ms, DESIGN.md). It reads the buffer
    in C order, so outputs are made contiguous. Every other Python op in the process goes through this hook too,
    so it keeps the stock hook's contract: a tuple of outputs or a single output; string outputs take the stock
    ``tolist`` path (measured: a rank-2 string array handed over as an array aborts the process).
    """
    from onnxruntime_extensions._ocos import Opdef

    if k_id not in Opdef._odlist:
        raise RuntimeError(f"Unable to find function id={k_id}. Did you decorate the operator with @onnx_op?.")
    op = Opdef._odlist[k_id]
    rv = op.body(*feed, **_cast_attributes(k_id, op, attributes))
    results = rv if isinstance(rv, tuple) else (rv,)
    flat = []
    for r in results:
        r = np.asarray(r)
        flat.append(r.shape)
        if r.dtype.kind in "OUS":  # strings: the stock conversion (the bridge cannot cast a rank >= 2 str array)
            flat.append(r.reshape(-1).tolist())
        else:
            flat.append(np.ascontiguousarray(r))
    return (k_id,) + tuple(flat)


_attribute_types: dict = {}  # Opdef id -> {attribute name: int | float | None (string) | unsupported type}


def _cast_attributes(k_id, op, attributes) -> dict:
    """Opdef.cast_attributes, with the declared types read once per op (the stock method converts the C++
    attribute map to a Python dict for every attribute of every call: 40 us for our nine, measured)."""
    casts = _attribute_types.get(k_id)
    if casts is None:
        from onnxruntime_extensions import PyCustomOpDef

        by_type = {PyCustomOpDef.dt_int64: int, PyCustomOpDef.dt_float: float, PyCustomOpDef.dt_string: None}
        casts = _attribute_types.setdefault(
            k_id, {name: by_type.get(kind, kind) for name, kind in dict(op._nativedef.attrs).items()}
        )
    result = {}
    for name, value in attributes.items():
        cast = casts[name]
        if cast is None:
            result[name] = value
        elif cast is int or cast is float:
            result[name] = cast(value)
        else:
            raise RuntimeError(f"Unsupported attribute type {cast}.")
    return result


def ensure_ops_registered() -> None:
    """Declare the plugin op to onnxruntime-extensions once per process and install the array hook."""
    with _registered_lock:
        if _registered["ops"]:
            return
        from onnxruntime_extensions import PyCustomOpDef, onnx_op

        kinds = {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "string": PyCustomOpDef.dt_string}
        attrs = {a.name: kinds[a.kind] for a in spec.PLUGIN_ATTRIBUTES}
        f32 = PyCustomOpDef.dt_float
        for mask_type in (PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64):
            inputs = [mask_type if name == "key_padding_mask" else f32 for name in spec.PLUGIN_INPUTS]
            onnx_op(
                op_type=f"{spec.PLUGIN_DOMAIN}::{spec.OP_TYPE}",
                inputs=inputs,
                outputs=[f32] * len(spec.PLUGIN_OUTPUTS),
                attrs=attrs,
            )(_op_body)
        PyCustomOpDef.install_hooker(_array_result_hook)
        _registered["ops"] = True


# ------------------------------------------------------------------------------------------------- the backend
def resolve_backend(backend: str = "auto", device_id: int = 0):
    """"reference" | "cuda" | "auto" -> a backend object. "auto" falls back to reference and says so once."""
    if backend == "auto":
        reason = cuda_unavailable_reason(device_id)
        if reason is None:
            return create_backend("cuda", device_id)
        if not _said_fallback["done"]:
            _said_fallback["done"] = True
            log.warning("mha_ep: no usable GPU (%s); claimed nodes run on the reference backend (NumPy)", reason)
        return create_backend("reference")
    if backend not in ("reference", "cuda"):
        raise ValueError(f"backend must be 'reference', 'cuda' or 'auto', got {backend!r}")
    return create_backend(backend, device_id)


def register(session_options, backend: str = "auto", device_id: int = 0):
    """Register the plugin on ``session_options`` (an ``onnxruntime.SessionOptions``) and return it.

    Loads the onnxruntime-extensions custom-op library and declares our op. ``backend`` becomes the process
    default used by plain ``onnxruntime.InferenceSession`` objects; ``mha_ep.InferenceSession`` binds its own
    backend per session. Raises BackendUnavailableError for ``backend="cuda"`` without CuPy or a usable GPU.

    Do not also register the onnxruntime-extensions library on the same options yourself (for its tokenizer or
    audio ops): this call loads it, and ORT refuses a second load ("Failed to add kernel ... Conflicting").
    """
    chosen = resolve_backend(backend, device_id)
    attach(session_options, chosen, device_id)
    set_default_backend(chosen)
    return session_options


def attach(session_options, backend, device_id: int = 0) -> None:
    """Load the custom-op library into ``session_options`` once, record the backend chosen for it, and turn
    ORT's intra-op spinning off unless the caller set it (ORT_SPINNING's comment)."""
    ensure_ops_registered()
    if not _has_entry(session_options):
        from onnxruntime_extensions import get_library_path

        session_options.register_custom_ops_library(get_library_path())
        session_options.add_session_config_entry(CONFIG_BACKEND, backend.name)
        session_options.add_session_config_entry(CONFIG_DEVICE, str(device_id))
    if _config_entry(session_options, ORT_SPINNING) is None:
        session_options.add_session_config_entry(ORT_SPINNING, "0")



def _config_entry(session_options, key: str) -> Optional[str]:
    try:
        return session_options.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 - ORT raises when the entry does not exist
        return None


def _has_entry(session_options) -> bool:
    return bool(_config_entry(session_options, CONFIG_BACKEND))


def backend_of(session_options) -> Optional[str]:
    return session_options.get_session_config_entry(CONFIG_BACKEND) if _has_entry(session_options) else None


__all__ = ["register", "resolve_backend", "ensure_ops_registered", "execute", "BackendUnavailableError"]
