"""What the gate knows about one input: its element type and static shape, either possibly unknown.

``TensorInfo.shape`` is ``None`` when even the rank is unknown; otherwise a tuple whose entries are an ``int`` for a
static extent and ``None`` for a symbolic one. ``dtype`` is a NumPy-style name ("float32", "bfloat16", "int32") or
``None`` when unknown. An absent optional input is represented by ``None`` in place of a ``TensorInfo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

Dim = Optional[int]
Shape = Optional[Tuple[Dim, ...]]


@dataclass(frozen=True)
class TensorInfo:
    dtype: Optional[str] = None
    shape: Shape = None

    @property
    def rank(self) -> Optional[int]:
        return None if self.shape is None else len(self.shape)

    def dim(self, axis: int) -> Dim:
        """Static extent of ``axis``, or None when unknown or out of range."""
        if self.shape is None or not -len(self.shape) <= axis < len(self.shape):
            return None
        return self.shape[axis]

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(d is not None for d in self.shape)

    @classmethod
    def of_dtype(cls, dtype, shape) -> "TensorInfo":
        """From a NumPy dtype and a shape."""
        name = _DTYPE_NAMES.get(dtype)
        if name is None:  # str(dtype) costs microseconds
            name = _DTYPE_NAMES.setdefault(dtype, str(dtype))
        return cls(name, tuple(shape))


_DTYPE_NAMES: dict = {}


def format_shape(shape: Shape) -> str:
    if shape is None:
        return "(unknown rank)"
    inner = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"
