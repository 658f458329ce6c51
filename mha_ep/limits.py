"""Checked integer limits of a CUDA launch: the sizes every kernel, cuBLAS call and buffer of a call must fit.

The kernels take ``int`` geometry, launch grids count blocks in a u32, buffer byte sizes must fit isize. Each
check returns its value or raises ``LimitError`` naming the quantity; the claim gate turns that into a refusal
(mha_ep/claim/rules.py) and the cuda backend into an input error (cuda/geometry.py), each with its own prefix.
Imports nothing of mha_ep: both the gate and the backends use it.
"""

from __future__ import annotations

from mha_ep.launch import LAUNCH_BLOCK

I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
ISIZE_MAX = 2**63 - 1


class LimitError(ValueError):
    """A size beyond a CUDA limit. ``reason``: the sentence (no prefix); ``subject``: the input it is about (the
    first word of the quantity's name)."""

    def __init__(self, reason: str, name: str):
        super().__init__(reason)
        self.reason = reason
        self.subject = name.split(" ")[0]


def checked_i32(value: int, name: str) -> int:
    if value > I32_MAX:
        raise LimitError(f"{name}={value} exceeds CUDA i32 limits", name)
    return value


def checked_bytes(elements: int, element_size: int, name: str) -> int:
    nbytes = elements * element_size
    if nbytes > ISIZE_MAX:
        raise LimitError(f"{name} byte size {nbytes} exceeds isize::MAX", name)
    return nbytes


def checked_grid(count: int, name: str) -> int:
    """Blocks of LAUNCH_BLOCK threads for ``count`` elements, checked against the u32 block count."""
    blocks = -(-count // LAUNCH_BLOCK)
    if blocks > U32_MAX:
        raise LimitError(f"{name} grid blocks={blocks} for element count {count} exceeds CUDA u32 limits", name)
    return blocks
