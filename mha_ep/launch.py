"""Kernel launch constants shared by Python and the CUDA sources (kernels/*.cu, *.cuh).

Each value here has a twin in a kernel file (named beside it); tests/engine/cuda/test_kernel_constants.py parses the sources
and fails when the two disagree. Imports nothing: the claim gate, the dispatch rules and the launch code use it.
"""

from __future__ import annotations

import enum
from typing import Optional

LAUNCH_BLOCK = 256  # threads per block of the element-wise kernels (layout movers); the grid-size rule uses it
SOFTMAX_THREADS = 128  # kernels/softmax.cu SOFTMAX_THREADS
SHARED_BUFFER_THREADS = 128  # kernels/shared_buffer.cu SHARED_BUFFER_THREADS
STATUS_WORDS = 8  # kernels/shared_buffer.cu STATUS_WORDS: code, a, b, c, site, then padding
WARP = 32
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the compute dtypes' element sizes
ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}  # their CUDA types


class MaskKind(enum.IntEnum):
    """How a call's padding mask reaches the kernels (kernels/common.cuh ``enum MaskKind``): none, int32 (B,) key
    lengths, uint8 (B, T) or (B, S, T) keep flags."""

    NONE = 0
    KEY_LENGTHS = 1
    KEYS_BT = 2
    KEYS_BST = 3

    @classmethod
    def of(cls, kind: Optional[str]) -> "MaskKind":
        """The kind of ``PaddingMask.kind`` ("key_lengths", "keys_BT", "keys_BST"), or NONE for no mask."""
        return cls.NONE if kind is None else cls[kind.upper()]


class DeviceError(enum.IntEnum):
    """What a shared-buffer kernel reports about values only the device sees (kernels/shared_buffer.cu
    ``enum DeviceError``): the report's code, then up to three numbers, then the site (a kernel config id)."""

    OK = 0
    PAST_LENGTH_RANGE = 1  # P, M
    PAST_PLUS_LENGTH = 2  # P, L, M
    BEAM_INDEX = 3  # the index, the batch row b*W + w, the position j
    MASK_LENGTH = 4  # the mask's T, P + L
    BIAS_LENGTH = 5  # attention_bias's T, P + L


def device_error_text(code: int, a: int, b: int, c: int, beams: int = 0) -> str:
    """The sentence of a device report, in stock ORT's words where ORT has them (docs/SEMANTICS.md §2.6); the
    native library's C code words them the same (tests/native/test_native_abi.py compares the two)."""
    if code == DeviceError.PAST_LENGTH_RANGE:
        return f"past_sequence_length must be non-negative and less than max_sequence_length ({b}), got {a}"
    if code == DeviceError.PAST_PLUS_LENGTH:
        return (f"past_sequence_length ({a}) plus kv_sequence_length ({b}) must not exceed max_sequence_length "
                f"({c}).")  # fmt: skip
    if code == DeviceError.BEAM_INDEX:
        return (f"cache_indirection beam index out of range. Expected [0, {beams}), got {a} at flattened batch_beam "
                f"index {b}, sequence position {c}")  # fmt: skip
    if code == DeviceError.MASK_LENGTH:
        return f"key_padding_mask covers {a} keys, but past_sequence_length + kv_sequence_length is {b}"
    if code == DeviceError.BIAS_LENGTH:
        return f"Input 'attention_bias' dimension 3 should be same as total_sequence_length ({b}), got {a}"
    return f"device error code {code} ({a}, {b}, {c})"
