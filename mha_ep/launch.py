"""Kernel launch constants shared by Python and the CUDA sources (kernels/*.cu, *.cuh).

Each value here has a twin in a kernel file (named beside it); tests/cuda/test_kernel_constants.py parses the sources
and fails when the two disagree. Imports nothing: the claim gate, the dispatch rules and the launch code use it.
"""

from __future__ import annotations

import enum
from typing import Optional

LAUNCH_BLOCK = 256  # threads per block of the element-wise kernels (layout movers); the grid-size rule uses it
SOFTMAX_THREADS = 128  # kernels/softmax.cu SOFTMAX_THREADS
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
