"""The native route's CPU kernel: ORT's host buffers, read in place, computed by the session's backend.

``compute`` is the library's callback for a call placed on CPUExecutionProvider: the inputs arrive as (element
type, dims, address) of ORT's own buffers, which become numpy views (no copy); float16 and bfloat16 inputs are
widened to the float32 that backends take (exact). The call runs the op body's steps (problem.build_problem, the
backend's ``run``) on the backend the run's context names (mha_ep.InferenceSession) or the process default (the
last ``mha_ep.register``), and the outputs are written into buffers ORT allocates (``_native.kernel_output``),
narrowed back to the node's type (exact: the backends round to it). A shared buffer's present that ORT hands over
as the past's own buffer (one OrtValue bound as both) gets only its new rows [P, P+L) written. It never raises
(errors.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

from mha_ep import spec
from mha_ep.native import configs, errors
from mha_ep.engine import interrupt
from mha_ep.engine.context import current_backend, current_context
from mha_ep.engine.problem import build_problem

# ONNX element type -> numpy dtype of its storage (bfloat16 as its 16 bits)
STORAGE = {1: np.float32, 10: np.float16, 16: np.uint16, 6: np.int32, 7: np.int64}
FLOAT_TYPES = {1: "float32", 10: "float16", 16: "bfloat16"}
EMPTY = np.zeros((0,), np.float32)


def host_view(address: int, dims: tuple, element_type: int, writable: bool = False) -> np.ndarray:
    """The ORT buffer at ``address`` as a numpy array of ``dims`` (no copy; read-only unless ``writable``)."""
    dtype = np.dtype(STORAGE[element_type])
    count = int(np.prod(dims, dtype=np.int64))
    if count == 0 or not address:
        return np.zeros(dims, dtype)
    array = np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype).reshape(dims)
    array.flags.writeable = writable
    return array


def to_float32(array: np.ndarray, element_type: int) -> np.ndarray:
    """A float input in float32, exact (bfloat16: its 16 bits are the top half of a float32)."""
    if element_type == 16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array if array.dtype == np.float32 else array.astype(np.float32)


def from_float32(values: np.ndarray, element_type: int) -> np.ndarray:
    """float32 values already rounded to the node's type, in its storage (exact)."""
    values = np.ascontiguousarray(values, np.float32)
    if element_type == 16:
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        bits[np.isnan(values)] = 0x7FC0  # a NaN whose payload lay in the low half stays NaN
        return bits
    with np.errstate(over="ignore"):  # qk's float32-lowest causal fill rounds to -inf in float16, as ORT's does
        return values.astype(STORAGE[element_type])


def compute_matmul(config: "configs.MatMulConfig", inputs: tuple, token: int) -> None:
    """A DecodeMatMul call on the CPU: y = x . weight_nk^T (engine/cuda/gemv.py reference_matmul) into ORT's y."""
    from mha_ep.engine.cuda.gemv import reference_matmul
    from mha_ep.native import _native as native  # the library that called us: loaded and configured

    arrays = []
    for slot, name in enumerate(spec.MATMUL_INPUTS):
        element_type, dims, address = inputs[slot]
        if element_type not in FLOAT_TYPES:
            raise TypeError(f"input {name} has ONNX element type {element_type}, expected a float type")
        arrays.append(to_float32(host_view(address, tuple(dims), element_type), element_type))
    x, weight = arrays
    if weight.ndim != 2 or not x.ndim or x.shape[-1] != weight.shape[1]:
        from mha_ep.errors import MESSAGE_PREFIX, MhaInputError

        raise MhaInputError(f"{MESSAGE_PREFIX}input x has shape {x.shape} and weight_nk {weight.shape}: expected x "
                            "(..., K) and weight_nk (N, K) with the same K")  # fmt: skip
    values = reference_matmul(x, weight, config.dtype)
    out_type = inputs[0][0]
    address = native.kernel_output(token, 0, tuple(int(d) for d in values.shape))
    if values.size:
        host_view(address, values.shape, out_type, writable=True)[...] = from_float32(values, out_type)
    return None


def compute(config_id: int, node: str, inputs: tuple, token: int):
    """One call on the CPU (module docstring): None, or (ORT error code, message)."""
    try:
        config = configs.config(config_id)
        if isinstance(config, configs.MatMulConfig):
            return compute_matmul(config, inputs, token)
        arrays = []
        addresses = {}
        out_type = 1
        for slot, name in enumerate(spec.PLUGIN_INPUTS):
            entry = inputs[slot]
            if entry is None:
                arrays.append(None)
                continue
            element_type, dims, address = entry
            addresses[name] = address
            if element_type not in STORAGE:
                raise TypeError(f"input {name} has ONNX element type {element_type}, which mha_ep cannot read")
            array = host_view(address, tuple(dims), element_type)
            if element_type in FLOAT_TYPES:
                array = to_float32(array, element_type)
                if name == "query":
                    out_type = element_type
            arrays.append(array)
        context = current_context()
        backend = current_backend(context)
        problem = build_problem(config.attributes, arrays, config.dtype, config.outputs)
        result = backend.run(problem, borrow_outputs=True)
        outputs = (result.output_BSDv, result.present_key_BNTH, result.present_value_BNTHv, result.qk_BNST)
        from mha_ep.native import _native as native  # the library that called us: loaded and configured

        for index, values in enumerate(outputs):
            values = EMPTY if values is None else values
            address = native.kernel_output(token, index, tuple(int(d) for d in values.shape))
            if not values.size:
                continue
            target = host_view(address, values.shape, out_type, writable=True)
            past = {1: "past_key", 2: "past_value"}.get(index)
            if problem.shared is not None and past is not None and address == addresses.get(past):
                rows = slice(problem.shared.past_seq, problem.geometry.total_seq)  # the past's own buffer
                target[:, :, rows] = from_float32(values[:, :, rows], out_type)
            else:
                target[...] = from_float32(values, out_type)
        return None
    except BaseException as error:  # noqa: BLE001 - nothing may go back into ORT as an exception
        return errors.answer(node, error)
    finally:
        interrupt.leaving_op()  # a Ctrl-C deferred during the call is re-sent once ORT has the thread back
