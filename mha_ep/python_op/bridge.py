"""The adapter to onnxruntime-extensions' Python-op bridge: declaring the op, the result hook, the attribute cast.

Written against onnxruntime-extensions 0.15.2 (docs/FACTS.md §1). It
reads three private names of that version, ``_ocos.Opdef._odlist``, ``Opdef._nativedef.attrs`` and the stock hook
``_ocos._on_pyop_invocation``; ``check_version`` says so once when another version is installed, and refuses
when those names are gone.

What the bridge does with a Python op's call: its C++ compute entry point calls one process-wide "hook" with the
op's id, the input arrays and the attribute map; the hook calls the op's Python function and hands back the
outputs. The entry point is ``noexcept``: anything the hook raises aborts the process (exit 134).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from mha_ep import spec
from mha_ep.errors import MhaEpError
from mha_ep.engine import interrupt

log = logging.getLogger("mha_ep")
SUPPORTED_VERSION = "0.15.2"
_declared_lock = threading.Lock()
_declared = {"done": False}


def check_version() -> None:
    """Refuse an onnxruntime-extensions without the private names the adapter reads; warn on another version."""
    import onnxruntime_extensions
    from onnxruntime_extensions import _ocos
    from packaging.version import Version

    missing = [name for name in ("Opdef", "_on_pyop_invocation") if not hasattr(_ocos, name)]
    if not missing and not hasattr(_ocos.Opdef, "_odlist"):
        missing.append("Opdef._odlist")
    version = getattr(onnxruntime_extensions, "__version__", "unknown")
    if missing:
        raise MhaEpError(
            f"onnxruntime-extensions {version} lacks {', '.join(missing)}, which mha_ep's bridge adapter reads "
            f"(written against {SUPPORTED_VERSION}); install onnxruntime-extensions=={SUPPORTED_VERSION}"
        )
    try:
        same = Version(version) == Version(SUPPORTED_VERSION)
    except Exception:  # noqa: BLE001 - an unparsable version is "not the same"
        same = False
    if not same:
        log.warning(
            "mha_ep: onnxruntime-extensions %s is installed; the bridge adapter was written against %s",
            version,
            SUPPORTED_VERSION,
        )


_own_ops: dict = {}  # Opdef id -> on_error(error, feed, attributes) -> outputs, for the ops mha_ep declared


def declare_ops(body, on_error) -> None:
    """Declare ``body`` as ``mha_ep::MultiHeadAttention`` to onnxruntime-extensions once per process and install
    ``result_hook``. ``on_error(error, feed, attributes)`` must return the outputs of a failed call and never raise.

    Two declarations share the op name and differ only in the element type of ``key_padding_mask`` (int32,
    int64); ORT picks one by the node's input types. Every declared input, output and attribute is required by
    the bridge: mha_ep/graph/partition.py writes them all (see the placeholder convention in mha_ep/spec.py).
    """
    with _declared_lock:
        if _declared["done"]:
            return
        check_version()
        from onnxruntime_extensions import PyCustomOpDef, onnx_op

        kinds = {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "string": PyCustomOpDef.dt_string}
        attrs = {a.name: kinds[a.kind] for a in spec.PLUGIN_ATTRIBUTES}
        f32 = PyCustomOpDef.dt_float
        for mask_type in (PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64):
            i32 = PyCustomOpDef.dt_int32
            inputs = [mask_type if name == "key_padding_mask" else i32 if name in spec.INT32_INPUTS else f32
                      for name in spec.PLUGIN_INPUTS]  # fmt: skip
            opdef = onnx_op(
                op_type=f"{spec.PLUGIN_DOMAIN}::{spec.OP_TYPE}",
                inputs=inputs,
                outputs=[f32] * len(spec.PLUGIN_OUTPUTS),
                attrs=attrs,
            )(body)
            _own_ops[id(opdef)] = on_error
        interrupt.mark_op_code(result_hook)
        interrupt.mark_op_code(array_result_hook)
        PyCustomOpDef.install_hooker(result_hook)
        _declared["done"] = True


def adopt_op(opdef, on_error) -> None:
    """Give another op that mha_ep declares (the benchmarks' do-nothing floor op, mha_ep/bench/gpu.py) the path
    of mha_ep's own ops: arrays handed back as they are, and ``on_error(error, feed, attributes)``'s outputs
    instead of an exception. (Through the stock hook its outputs would go back as ``flatten().tolist()``, far
    slower than the calls it is the floor of: no floor; docs/BENCH.md, "Host-side choices".)"""
    _own_ops[id(opdef)] = on_error


# What the hook hands back when even a failure's outputs cannot be made: three zero-size float32 outputs.
_NO_OUTPUTS = ((0,), np.zeros((0,), np.float32)) * len(spec.PLUGIN_OUTPUTS)


def result_hook(k_id, feed, attributes):
    """The hook mha_ep installs: its own ops take the array path and never raise; every other Python op in the
    process goes to the stock hook, so its results are exactly what stock onnxruntime-extensions gives."""
    on_error = _own_ops.get(k_id)
    if on_error is None:
        from onnxruntime_extensions import _ocos

        return _ocos._on_pyop_invocation(k_id, feed, attributes)
    try:
        try:
            return array_result_hook(k_id, feed, attributes)
        except BaseException as error:  # noqa: BLE001 - escaping the bridge aborts the process
            try:
                return (k_id,) + to_bridge(on_error(error, feed, attributes))
            except BaseException:  # noqa: BLE001
                return (k_id,) + _NO_OUTPUTS
    finally:
        interrupt.leaving_op()  # a Ctrl-C deferred during the call is re-sent once ORT has the thread back


def array_result_hook(k_id, feed, attributes):
    """onnxruntime-extensions' invocation hook, returning arrays instead of ``flatten().tolist()``.

    The C++ side accepts numpy arrays, far cheaper than ``tolist`` for large outputs (docs/FACTS.md §1). It reads the buffer
    in C order, so outputs are made contiguous. It keeps the stock hook's contract: a tuple of outputs or a single
    output; string outputs take the stock ``tolist`` path (measured: a rank-2 string array handed over as an array
    aborts the process). Installed as is, it would do this for every Python op in the process (the bridge
    benchmark does that); mha_ep installs ``result_hook``, which uses it for mha_ep's own ops only.
    """
    from onnxruntime_extensions._ocos import Opdef

    if k_id not in Opdef._odlist:
        raise RuntimeError(f"Unable to find function id={k_id}. Did you decorate the operator with @onnx_op?.")
    op = Opdef._odlist[k_id]
    rv = op.body(*feed, **cast_attributes(k_id, op, attributes))
    return (k_id,) + to_bridge(rv)


def to_bridge(rv) -> tuple:
    """An op's return value -> (shape, data, shape, data, ...) as the bridge reads it."""
    results = rv if isinstance(rv, tuple) else (rv,)
    flat = []
    for r in results:
        r = np.asarray(r)
        flat.append(r.shape)
        if r.dtype.kind in "OUS":  # strings: the stock conversion (the bridge cannot cast a rank >= 2 str array)
            flat.append(r.reshape(-1).tolist())
        else:
            flat.append(np.ascontiguousarray(r))
    return tuple(flat)


_attribute_types: dict = {}  # Opdef id -> {attribute name: int | float | None (string) | unsupported type}


def cast_attributes(k_id, op, attributes) -> dict:
    """Opdef.cast_attributes, with the declared types read once per op (the stock method converts the C++
    attribute map to a Python dict for every attribute of every call; docs/BENCH.md, "Host-side choices")."""
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
