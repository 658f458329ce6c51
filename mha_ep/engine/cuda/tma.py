"""TMA tensor maps (cuda.h's CUtensorMap) for the tile loads of kernels/flash_attention_ws.cu.

A map is a recipe the copy engine follows: where a 4D tensor lives, its sizes and byte strides, and the box one
load brings into shared memory, in which swizzle. Here it is a value first (``TileMap``, built and checked on any
machine), then 128 opaque bytes the driver encodes (``encode``: cuTensorMapEncodeTiled from libcuda through
ctypes, memoised), passed to the kernel by value as a ``__grid_constant__`` parameter:

    spec = TileMap.for_operand("q", address, "float16", dim=H, seq=S, heads=N, batch=B,
                               strides=(stride_b, stride_h, stride_s), box_rows=128)
    argument = encode(spec)      # a numpy array of one 128-byte record: CuPy passes it by value

The map's dimensions are (dim, seq, head, batch), innermost first, with the operand's own strides, so the BSNH and
BNSH layouts (and any other whose head dimension is contiguous) read alike. A box is 64 elements x ``box_rows`` x
1 x 1: one 128-byte swizzle atom per row, the layout the kernel's wgmma descriptors read (kernels/
flash_attention_wgmma.cu's header). Rows and columns outside the tensor arrive as zeros.

This module imports neither CuPy nor libcuda until ``encode`` runs.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mha_ep.engine.cuda.steps import Buffer, alignment_of

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
TENSOR_MAP_ALIGNMENT = 64  # the driver writes the map to a 64-byte aligned address
BOX_COLUMNS = 64  # elements of one box row: one 128-byte swizzle atom of 2-byte elements
MAX_BOX_ROWS = 256  # boxDim[i] <= 256
GLOBAL_ALIGNMENT = 16  # the global address and every stride: multiples of 16 bytes
MAX_STRIDE = 1 << 40  # globalStrides[i] < 2^40
MAX_DIM = 1 << 32  # globalDim[i] <= 2^32
# cuda.h (CUDA 12/13) enum values
DATA_TYPES = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
ELEMENT_BYTES = 2
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements are zeros
RECORD = np.dtype((np.void, TENSOR_MAP_BYTES))


@dataclass(frozen=True)
class TileMap:
    """What cuTensorMapEncodeTiled gets for one operand: ``dims`` (dim, seq, heads, batch) in elements,
    ``strides`` the byte strides of seq, head and batch, a box of BOX_COLUMNS x ``box_rows`` x 1 x 1."""

    name: str  # the operand ("q", "k", "v"), for messages
    address: object  # an int, or a steps.Buffer that the native route binds when it encodes the map
    dtype: str
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    box_rows: int

    @classmethod
    def for_operand(cls, name: str, address: int, dtype: str, *, dim: int, seq: int, heads: int, batch: int,
                    strides: tuple[int, int, int], box_rows: int) -> "TileMap":  # fmt: skip
        """The map of an operand with element (b, h, s, 0) at ``address`` + (b*stride_b + h*stride_h +
        s*stride_s) elements, ``strides`` = (stride_b, stride_h, stride_s) in elements (fused.Operand.strides);
        raises ValueError when TMA cannot read it (tile_map_problem)."""
        stride_b, stride_h, stride_s = strides
        byte_strides = (stride_s * ELEMENT_BYTES, stride_h * ELEMENT_BYTES, stride_b * ELEMENT_BYTES)
        address = address if isinstance(address, Buffer) else int(address)
        spec = cls(name, address, dtype, (dim, seq, heads, batch), byte_strides, box_rows)
        problem = tile_map_problem(spec)
        if problem is not None:
            raise ValueError(f"TMA tile map of operand {name}: {problem}")
        return spec


def tile_map_problem(spec: TileMap) -> Optional[str]:
    """None when the driver can encode ``spec``; else what it would refuse, as a sentence. The rules, in order:
    a 2-byte dtype TMA knows; a 16-byte aligned address; every stride a positive multiple of 16 bytes below
    2^40; every size in 1..2^32; box rows in 1..256."""
    if spec.dtype not in DATA_TYPES:
        return f"dtype {spec.dtype!r} is not one of {sorted(DATA_TYPES)}"
    if alignment_of(spec.address) < GLOBAL_ALIGNMENT:
        address = spec.address if isinstance(spec.address, tuple) else f"{spec.address:#x}"
        return f"address {address} is not {GLOBAL_ALIGNMENT}-byte aligned"
    for axis, stride in zip(("seq", "head", "batch"), spec.strides):
        if stride <= 0 or stride % GLOBAL_ALIGNMENT or stride >= MAX_STRIDE:
            return (f"the {axis} stride of {stride} bytes is not a positive multiple of {GLOBAL_ALIGNMENT} below "
                    f"2^40")  # fmt: skip
    for axis, size in zip(("dim", "seq", "head", "batch"), spec.dims):
        if not 1 <= size <= MAX_DIM:
            return f"the {axis} size {size} is not in 1..2^32"
    if not 1 <= spec.box_rows <= MAX_BOX_ROWS:
        return f"box rows {spec.box_rows} is not in 1..{MAX_BOX_ROWS}"
    return None


_driver_lock = threading.Lock()
_driver: list = []  # [libcuda] once loaded


def _libcuda():
    with _driver_lock:
        if not _driver:
            library = ctypes.CDLL("libcuda.so.1")
            encode_tiled = getattr(library, "cuTensorMapEncodeTiled", None)
            if encode_tiled is None:
                raise RuntimeError("the CUDA driver (libcuda.so.1) has no cuTensorMapEncodeTiled: TMA tile maps, and "
                                   "with them flash_attention_ws, need a CUDA 12 or newer driver")  # fmt: skip
            encode_tiled.restype = ctypes.c_int
            encode_tiled.argtypes = [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ]  # fmt: skip
            library.cuGetErrorString.restype = ctypes.c_int
            library.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver.append(library)
        return _driver[0]


def _error_string(library, result: int) -> str:
    text = ctypes.c_char_p()
    if library.cuGetErrorString(result, ctypes.byref(text)) == 0 and text.value:
        return f"CUresult {result}: {text.value.decode()}"
    return f"CUresult {result}"


@dataclass(frozen=True)
class EncodeArguments:
    """cuTensorMapEncodeTiled's arguments for a TileMap, besides the map and the global address: one definition
    for ``encode`` here and for the native route's C library, which encodes the map at every call."""

    data_type: int
    rank: int
    dims: tuple
    strides: tuple
    box: tuple
    element_strides: tuple
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def encode_arguments(spec: TileMap) -> EncodeArguments:
    return EncodeArguments(DATA_TYPES[spec.dtype], 4, tuple(spec.dims), tuple(spec.strides),
                           (BOX_COLUMNS, spec.box_rows, 1, 1), (1, 1, 1, 1), INTERLEAVE_NONE, SWIZZLE_128B,
                           L2_PROMOTION_128B, FLOAT_OOB_FILL_NONE)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def encode(spec: TileMap) -> np.ndarray:
    """The driver's 128-byte encoding of ``spec`` as a read-only numpy array of one record (RECORD), which a CuPy
    kernel launch passes by value. Memoised: a map holds only the address, sizes and strides, so a buffer freed
    and allocated again at the same address with the same shape gets the same, still valid, map."""
    problem = tile_map_problem(spec)
    if problem is not None:
        raise ValueError(f"TMA tile map of operand {spec.name}: {problem}")
    library = _libcuda()
    raw = np.zeros(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % TENSOR_MAP_ALIGNMENT
    a = encode_arguments(spec)
    result = library.cuTensorMapEncodeTiled(
        ctypes.c_void_p(raw.ctypes.data + offset), a.data_type, a.rank, ctypes.c_void_p(spec.address),
        (ctypes.c_uint64 * 4)(*a.dims), (ctypes.c_uint64 * 3)(*a.strides), (ctypes.c_uint32 * 4)(*a.box),
        (ctypes.c_uint32 * 4)(*a.element_strides), a.interleave, a.swizzle, a.l2_promotion, a.oob_fill,
    )  # fmt: skip
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the TMA tile map of operand {spec.name} "
                           f"({_error_string(library, result)}): {spec}")  # fmt: skip
    record = raw[offset : offset + TENSOR_MAP_BYTES].copy().view(RECORD)
    record.flags.writeable = False
    return record
