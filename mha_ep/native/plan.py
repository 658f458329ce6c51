"""The native route's planner: one call signature -> the plan its C library launches on every call of that signature.

A signature is what the library reads of a call before any Python runs (csrc/cuda_compute.c, ``compute_cuda``):
the node's config (configs.py), the device, and each supplied input's element type, shape and pointer alignment.
From it:
  1. ``signature_problem`` builds an MhaProblem over shape-only arrays (zero-stride views: no memory) with the
     op's own rules (problem.build_problem), so a bad input gets the Python op's message, naming the input, its
     shape and what was expected;
  2. ``plan_steps`` asks the cuda backend's pipeline (engine/cuda/pipeline.py, the one device-side
     interface) for the call's steps on *named* buffers: ``in<i>`` (ORT's input slot i), ``out<i>`` (ORT's output
     i), ``scratch`` (one region from ORT's allocator per call, of the size the plan says);
  3. ``encode_plan`` writes the steps as the int64 words the library parses (its ``parse_plan``): kernel handles,
     grids, argument bytes with the offsets where buffers are bound, TMA maps to encode, GEMMs, copies, and a
     shared buffer's status check.
Output shapes are fixed by the signature too: (B, S, Dv), the presents when wanted, and (0,) for an output the node
does not use (a placeholder name).
This module must not import CuPy: the encoder and the plans are tested on CPU machines (``resolve_function`` names
the kernels there); mha_ep/native/gpu.py resolves them on the device.
"""

from __future__ import annotations

import array
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from mha_ep import spec
from mha_ep.errors import MESSAGE_PREFIX, MhaInputError
from mha_ep.native.configs import AnyConfig, KernelConfig, MatMulConfig
from mha_ep.engine.cuda import dispatch, gemm, tma
from mha_ep.engine.cuda.gemv import matmul_steps
from mha_ep.engine.cuda.fused import DeviceFacts
from mha_ep.engine.cuda.pipeline import DeviceCall, attention_steps, output_shapes
from mha_ep.engine.cuda.steps import (
    Buffer, CheckStatus, Copy, Fill, Gemm, Launch, Pointer, Struct, TensorMap, struct_fields,
)
from mha_ep.engine.problem import Geometry, PaddingMask, build_problem

# ONNX element types (onnxruntime_c_api.h ONNXTensorElementDataType) the op's inputs may have
ELEMENT_NAMES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}
PLAN_MAGIC = 0x5048414D  # csrc/native.h PLAN_MAGIC
PLAN_VERSION = 2
STEP_LAUNCH, STEP_GEMM, STEP_COPY, STEP_FILL, STEP_CHECK_STATUS = 1, 2, 3, 4, 5
STEP_LAUNCH_PROGRAMMATIC = 6  # a launch (the same words) with programmatic stream serialization: Launch.programmatic
SPACES = {"in": 1, "out": 2, "scratch": 3, "sticky": 4}  # Buffer name prefix -> csrc/native.h SPACE_*
STICKY = Buffer("sticky")  # a shared buffer's sticky report words: bound by the library while ORT captures a graph
OUTPUT_ALIGNMENT = 16  # bytes every output must have for the plan's vector stores (else flags UNALIGNED_OUTPUTS)
UNALIGNED_OUTPUTS = 1  # signature flag: the outputs are written to scratch first, then copied into ORT's buffers
SCRATCH_ALIGNMENT = 256
MAX_ARGUMENT_BYTES = 4096  # csrc/native.h MAX_ARGUMENT_BYTES
NULL_POINTER = bytes(8)
CUBLAS_COMPUTE_32F_PEDANTIC = 69  # float32 GEMMs through ORT's handle: never TF32, whatever its math mode


@dataclass(frozen=True)
class Signature:
    """One call signature as the library hands it over: per input slot None (a placeholder) or
    (element type, dims, log2 of the pointer's alignment, capped at 8)."""

    inputs: tuple

    def element(self, slot: int) -> Optional[str]:
        entry = self.inputs[slot]
        return None if entry is None else ELEMENT_NAMES.get(entry[0], f"ONNX type {entry[0]}")

    def alignment(self, slot: int) -> int:
        return 1 << min(int(self.inputs[slot][2]), 8)


class ShapeOnly:
    """An input's element type and shape without its data: all that build_problem, the rules and the pipeline read
    of a planned call's arrays (slicing the first axis, as the bias split does, gives another one)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype, shape):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key) -> "ShapeOnly":
        if not isinstance(key, slice) or not self.shape:
            raise TypeError(f"ShapeOnly takes a slice of its first axis, not {key!r}")
        return ShapeOnly(self.dtype, (len(range(self.shape[0])[key]), *self.shape[1:]))

    def __repr__(self) -> str:
        return f"ShapeOnly({self.dtype}, {self.shape})"


def _shape_only(dtype, dims) -> ShapeOnly:
    return ShapeOnly(dtype, dims)


def shape_only_mask(mask: np.ndarray, geometry: Geometry) -> PaddingMask:
    """resolve_padding_mask's kind and data shape, without data (the device resolves the values: pipeline.py)."""
    if mask.ndim == 1:
        return PaddingMask("key_lengths", _shape_only(np.int32, (geometry.batch,)))
    return PaddingMask("keys_BT" if mask.ndim == 2 else "keys_BST", _shape_only(np.bool_, mask.shape))


def signature_problem(config: KernelConfig, signature: Signature) -> tuple:
    """(MhaProblem over shape-only arrays, the float inputs' element type, the mask's element type or None).
    Raises MhaInputError naming the input for a call the op's rules refuse (problem.build_problem) or a float input
    whose element type is neither float32 (the Python op's transport form) nor the node's dtype."""
    arrays = []
    float_type = None
    mask_type = None
    for slot, name in enumerate(spec.PLUGIN_INPUTS):
        entry = signature.inputs[slot]
        if name not in config.supplied or entry is None:
            arrays.append(None)
            continue
        element = signature.element(slot)
        dims = entry[1]
        if name in spec.INT32_INPUTS:
            if element != "int32":
                raise MhaInputError(f"{MESSAGE_PREFIX}input {name} {list(dims)} is {element}, expected int32")
            arrays.append(_shape_only(np.int32, dims))
            continue
        if name == "key_padding_mask":
            if element not in spec.MASK_DTYPES:
                raise MhaInputError(f"{MESSAGE_PREFIX}input key_padding_mask {list(dims)} is {element}, expected "
                                    f"int32 or int64")  # fmt: skip
            mask_type = element
            arrays.append(_shape_only(np.int32 if element == "int32" else np.int64, dims))
            continue
        if element not in ("float32", config.dtype) or (float_type is not None and element != float_type):
            expected = config.dtype if float_type is None else float_type
            raise MhaInputError(f"{MESSAGE_PREFIX}input {name} {list(dims)} is {element}, expected {expected} like "
                                f"the node's other float inputs (its dtype is {config.dtype})")  # fmt: skip
        float_type = element
        arrays.append(_shape_only(np.float32, dims))  # the rules read float inputs as the node's dtype
    problem = build_problem(config.attributes, arrays, config.dtype, config.outputs, mask_resolver=shape_only_mask)
    return problem, float_type or config.dtype, mask_type


class RegionTemporaries:
    """pipeline.Temporaries as offsets into one scratch region (``Buffer("scratch", offset)``), 256-aligned."""

    def __init__(self):
        self.size = 0

    def take(self, name: str, nbytes: int) -> Buffer:
        offset = -(-self.size // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
        self.size = offset + max(int(nbytes), 1)
        return Buffer("scratch", offset)


@dataclass(frozen=True)
class NativePlan:
    steps: list
    scratch_bytes: int
    output_shapes: tuple  # three shapes, (0,) for an output the node does not use
    output_alignment: int = OUTPUT_ALIGNMENT  # bytes ORT's outputs must have for the steps (else UNALIGNED_OUTPUTS)


def plan_steps(config: AnyConfig, signature: Signature, facts: DeviceFacts, flags: int = 0, *,
               fused_path: bool = True, poison: bool = False, error_site: int = 0) -> NativePlan:  # fmt: skip
    """Steps 1-2 of the module docstring. ``flags`` UNALIGNED_OUTPUTS: ORT's outputs are not OUTPUT_ALIGNMENT-
    aligned, so the steps write scratch and end with copies into them. A shared buffer's steps (element-wise
    accesses: any alignment) write ORT's outputs themselves, so that a present bound to its past's own buffer
    stays that buffer; their sticky reports go to STICKY, reporting ``error_site`` (pipeline.DeviceCall's).
    A DecodeMatMul node's call: matmul_plan."""
    if isinstance(config, MatMulConfig):
        return matmul_plan(config, signature, facts)
    problem, float_type, mask_type = signature_problem(config, signature)
    element = 4 if float_type == "float32" else 2
    alignment = element if problem.shared is not None else OUTPUT_ALIGNMENT
    sources = {}
    for slot, name in enumerate(spec.PLUGIN_INPUTS):
        if signature.inputs[slot] is not None and name in config.supplied and name != "bias":
            sources["mask" if name == "key_padding_mask" else name] = Buffer(f"in{slot}", 0, signature.alignment(slot))
    if problem.bias_q is not None:
        bias = Buffer("in3", 0, signature.alignment(3))
        d = problem.geometry.hidden
        sources["bias_q"] = bias
        if problem.bias_k is not None:
            sources["bias_k"], sources["bias_v"] = bias.at(d * element), bias.at(2 * d * element)
    wanted = output_shapes(problem)
    shapes = tuple(wanted.get(name, (0,)) for name in spec.PLUGIN_OUTPUTS)
    outputs = {name: Buffer(f"out{i}") for i, name in enumerate(spec.PLUGIN_OUTPUTS) if name in wanted}
    temporaries = RegionTemporaries()
    copies = []
    if flags & UNALIGNED_OUTPUTS and problem.shared is None:
        for name, destination in list(outputs.items()):
            nbytes = int(np.prod(wanted[name])) * element
            outputs[name] = temporaries.take(f"{name}_aligned", nbytes)
            copies.append(Copy(destination, outputs[name], nbytes))
    call = DeviceCall(sources=sources, source_dtype=float_type, outputs=outputs, output_dtype=float_type,
                      mask_form=mask_type or "resolved", attention_bias_dtype=float_type,
                      error_flag=STICKY if problem.shared is not None else None, error_site=error_site,
                      packed_sources=problem.packing is not None)  # fmt: skip
    steps = attention_steps(problem, facts, call, temporaries, fused_path=fused_path, poison=poison)
    return NativePlan(steps + copies, temporaries.size, shapes, alignment)


def matmul_shapes(config: MatMulConfig, signature: Signature) -> tuple:
    """(rows M, K, N, y's shape) of a DecodeMatMul call, x (..., K) and weight_nk (N, K) in the node's element
    type; MhaInputError naming the input, its shape and what was expected otherwise."""
    for slot, name in enumerate(spec.MATMUL_INPUTS):
        if signature.inputs[slot] is None:
            raise MhaInputError(f"{MESSAGE_PREFIX}input {name} of {spec.MATMUL_OP_TYPE} is missing")
        if signature.element(slot) != config.dtype:
            raise MhaInputError(f"{MESSAGE_PREFIX}input {name} is {signature.element(slot)}, expected the node's "
                                f"{config.dtype}")  # fmt: skip
    x_dims, w_dims = tuple(signature.inputs[0][1]), tuple(signature.inputs[1][1])
    if not x_dims or len(w_dims) != 2 or x_dims[-1] != w_dims[1]:
        raise MhaInputError(f"{MESSAGE_PREFIX}input x has shape {x_dims} and weight_nk {w_dims}: expected x (..., K) "
                            "and weight_nk (N, K) with the same K")  # fmt: skip
    rows = int(np.prod(x_dims[:-1], dtype=np.int64))
    return rows, int(x_dims[-1]), int(w_dims[0]), x_dims[:-1] + (w_dims[0],)


def matmul_plan(config: MatMulConfig, signature: Signature, facts: DeviceFacts) -> NativePlan:
    """A DecodeMatMul call's steps (engine/cuda/gemv.py matmul_steps) into ORT's output y at any alignment (the
    kernel stores single elements), programmatic where dispatch.programmatic_launches allows it."""
    rows, k, n, shape = matmul_shapes(config, signature)
    element = 4 if config.dtype == "float32" else 2
    temporaries = RegionTemporaries()
    y = Buffer("out0", 0, element)
    if rows * n == 0:
        steps: list = []
    elif k == 0:
        steps = [Fill(y, 0, rows * n * element)]  # an empty sum
    else:
        alignment = min(signature.alignment(0), signature.alignment(1))
        steps = matmul_steps(Buffer("in0", 0, signature.alignment(0)), Buffer("in1", 0, signature.alignment(1)), y,
                             rows=rows, k=k, n=n, dtype=config.dtype, alignment=alignment, take=temporaries.take,
                             programmatic=dispatch.programmatic_launches(facts.capability))  # fmt: skip
    return NativePlan(steps, temporaries.size, (shape, (0,), (0,), (0,)), element)


# ---------------------------------------------------------------------------------------------- encoding
def _ref(address) -> list:
    """(space, index, offset) of a Buffer or the null pointer."""
    if address is None or address == 0:
        return [0, 0, 0]
    if not isinstance(address, Buffer):
        raise ValueError(f"native plan: address {address!r} is not a named buffer")
    prefix = address.name if address.name in ("scratch", "sticky") else address.name.rstrip("0123456789")
    if prefix not in SPACES:
        raise ValueError(f"native plan: buffer {address.name!r} is not an input, an output, the scratch or sticky")
    index = 0 if prefix in ("scratch", "sticky") else int(address.name[len(prefix):])
    return [SPACES[prefix], index, int(address.offset)]


class _Arguments:
    """A launch's argument bytes, laid out as the kernel's parameters (each at its natural alignment)."""

    def __init__(self):
        self.blob = bytearray()
        self.offsets: list = []
        self.patches: list = []  # (offset, ref)
        self.maps: list = []  # (offset, tma.EncodeArguments, ref)

    def place(self, data: bytes, alignment: int) -> int:
        blob = self.blob
        offset = -(-len(blob) // alignment) * alignment
        if offset > len(blob):
            blob.extend(bytes(offset - len(blob)))
        blob.extend(data)
        self.offsets.append(offset)
        return offset

    def add(self, arg) -> None:
        if isinstance(arg, np.generic):  # most arguments: sizes, strides, flags, scalars (place, inlined)
            blob = self.blob
            end = len(blob)
            pad = -end % arg.itemsize
            if pad:
                blob.extend(bytes(pad))
            self.offsets.append(end + pad)
            blob.extend(arg.tobytes())
        elif isinstance(arg, Pointer):
            offset = self.place(NULL_POINTER, 8)
            if arg.address is not None and arg.address != 0:
                self.patches.append((offset, _ref(arg.address)))
        elif isinstance(arg, Struct):
            values = []
            pointers = []
            for value, (name, kind) in zip(arg.values, struct_fields(arg.dtype)):
                if kind == "pointer":
                    values.append(0)
                    if value is not None and value != 0:
                        pointers.append((arg.dtype.fields[name][1], value))
                else:
                    values.append(value)
            data = np.array([tuple(values)], dtype=arg.dtype).tobytes()
            offset = self.place(data, arg.dtype.alignment)
            self.patches.extend((offset + field_offset, _ref(value)) for field_offset, value in pointers)
        elif isinstance(arg, TensorMap):
            offset = self.place(bytes(tma.TENSOR_MAP_BYTES), tma.TENSOR_MAP_ALIGNMENT)
            self.maps.append((offset, tma.encode_arguments(arg.spec), _ref(arg.spec.address)))
        else:
            raise TypeError(f"native plan: kernel argument {arg!r} has no C form")


def _launch_words(step: Launch, function: int) -> list:
    args = _Arguments()
    for arg in step.args:
        args.add(arg)
    if len(args.blob) > MAX_ARGUMENT_BYTES:
        raise ValueError(f"native plan: {step.function} takes {len(args.blob)} bytes of arguments, more than "
                         f"{MAX_ARGUMENT_BYTES}")  # fmt: skip
    kind = STEP_LAUNCH_PROGRAMMATIC if step.programmatic else STEP_LAUNCH
    words = [kind, int(function), *step.grid, *step.block, int(step.shared), len(args.blob), len(args.offsets),
             *args.offsets, len(args.patches)]  # fmt: skip
    for offset, ref in args.patches:
        words += [offset, *ref]
    words.append(len(args.maps))
    for offset, a, ref in args.maps:
        words += [offset, a.data_type, a.rank, *a.dims, *a.strides, *a.box, *a.element_strides, a.interleave,
                  a.swizzle, a.l2_promotion, a.oob_fill, *ref]  # fmt: skip
    blob = bytes(args.blob) + b"\0" * (-len(args.blob) % 8)
    words += list(struct.unpack(f"<{len(blob) // 8}q", blob))
    return words


def _gemm_words(step: Gemm) -> list:
    alpha_bits = struct.unpack("<I", struct.pack("<f", step.alpha))[0]
    compute = CUBLAS_COMPUTE_32F_PEDANTIC if step.a_type == gemm.CUDA_R_32F else gemm.CUBLAS_COMPUTE_32F
    return [STEP_GEMM, step.trans_a, step.trans_b, step.m, step.n, step.k, alpha_bits,
            *_ref(step.a), step.a_type, step.lda, step.stride_a, *_ref(step.b), step.b_type, step.ldb, step.stride_b,
            *_ref(step.c), step.ldc, step.stride_c, step.batch, compute]  # fmt: skip


def encode_plan(plan: NativePlan, resolve_function: Callable[[Launch], int]) -> bytes:
    """The words csrc/plans.c parses (module docstring, step 3); ``resolve_function(launch)`` gives the CUfunction
    handle of a launch (loaded, with its shared-memory limit raised: gpu.py)."""
    words = [PLAN_MAGIC, PLAN_VERSION, plan.scratch_bytes, plan.output_alignment, len(plan.output_shapes)]
    for shape in plan.output_shapes:
        words += [len(shape), *shape]
    words.append(len(plan.steps))
    for step in plan.steps:
        if isinstance(step, Launch):
            words += _launch_words(step, resolve_function(step))
        elif isinstance(step, Gemm):
            words += _gemm_words(step)
        elif isinstance(step, Copy):
            words += [STEP_COPY, *_ref(step.dst), *_ref(step.src), step.nbytes]
        elif isinstance(step, Fill):
            words += [STEP_FILL, *_ref(step.dst), step.byte, step.nbytes]
        elif isinstance(step, CheckStatus):
            words += [STEP_CHECK_STATUS, *_ref(step.status), step.beams]
        else:
            raise TypeError(f"native plan: unknown step {step!r}")
    return array.array("q", words).tobytes() if sys.byteorder == "little" else struct.pack(f"<{len(words)}q", *words)
