"""A call's device work as values: the steps the cuda backend's pipeline returns (pipeline.py).

Two routes drive one pipeline and differ only in who runs its steps:
  * the bridge runs them through CuPy (runner.py ``run_steps``), on concrete addresses;
  * the native route (mha_ep/native) encodes them once per call signature for its C library, which launches them
    with the CUDA driver on ORT's buffers and stream; there, addresses are ``Buffer`` names bound at every call.

A step is one of:
  Launch  one kernel: its NVRTC name expression, grid, block, dynamic shared memory and arguments;
  Gemm    one cuBLAS strided-batched GemmEx (fp32 compute, fp32 output, host alpha; the math mode is never TF32);
  Copy    a device-to-device copy (none when the source is the destination: a shared past/present buffer bound
          to one OrtValue);
  Fill    a byte pattern over device memory (poisoned buffers, for tests);
  CheckStatus  after an eager call, the status words the shared-buffer kernels report into (shared_buffer.py): the
          native library raises ORT's error for a report; the CuPy runner skips it (its callers validated every
          value on the host before the call).
A kernel argument is a numpy scalar (np.int32, np.int64, np.float32: its C type), ``Pointer`` (an address, or
None for null), ``Struct`` (a C struct by value whose pointer fields hold addresses) or ``TensorMap`` (a TMA map,
cuda.h's CUtensorMap, encoded from its spec once the address is known).

This module holds values only and imports no CuPy; fused.py, gemm.py and tma.py build steps of them, and runner.py,
which imports those three, runs them.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import NamedTuple, Union

import numpy as np

BUFFER_ALIGNMENT = 256  # what a Buffer's base promises unless it says otherwise (ORT's and CuPy's allocations)


class Buffer(NamedTuple):
    """A device address named until the call runs: the base bound to ``name`` plus ``offset`` bytes. ``align``
    is the alignment in bytes the base is known to have (a power of two)."""

    name: str
    offset: int = 0
    align: int = BUFFER_ALIGNMENT

    def at(self, nbytes: int) -> "Buffer":
        """The address ``nbytes`` further on."""
        return Buffer(self.name, self.offset + int(nbytes), self.align)


Address = Union[int, Buffer, None]


def offset_address(address: Address, nbytes: int) -> Address:
    """``address`` + ``nbytes`` (an int, or a Buffer's ``at``): a slot of a packed input inside its buffer."""
    return address.at(nbytes) if isinstance(address, Buffer) else int(address) + int(nbytes)


def alignment_of(address: Address) -> int:
    """The largest power of two known to divide ``address`` (capped at BUFFER_ALIGNMENT; None, the null pointer,
    counts as aligned)."""
    if address is None:
        return BUFFER_ALIGNMENT
    if isinstance(address, Buffer):
        base, offset = min(address.align, BUFFER_ALIGNMENT), address.offset
    else:
        base, offset = BUFFER_ALIGNMENT, int(address)
    return min(base, offset & -offset) if offset else base


@dataclass(frozen=True)
class Pointer:
    address: Address


@dataclass(frozen=True)
class Struct:
    """A C struct passed by value: ``dtype`` a numpy structured dtype with C alignment (its layout is the
    kernel's struct, checked by tests), ``values`` one per field, in order; pointer fields (np.uint64) hold
    addresses."""

    dtype: np.dtype
    values: tuple


@dataclass(frozen=True)
class TensorMap:
    """A TMA map of ``spec`` (a tma.TileMap whose ``address`` may be a Buffer), encoded when it is launched."""

    spec: object


@dataclass(frozen=True)
class Launch:
    """One kernel launch. ``fused``: one of kernels.INSTANTIATED (looked up through fused.get_fused_kernel, which
    raises its shared-memory limit; bench/fused_timing.py swaps it). ``programmatic``: the native route launches
    it with CUDA's programmatic stream serialization (sm_90 and later), so that it may start before the kernel
    before it ends; the kernel must wait for it (common.cuh wait_for_prior_grids) before it reads anything that
    kernel may write. Other launchers launch it as any other."""

    function: str
    grid: tuple
    block: tuple
    shared: int
    args: tuple
    fused: bool = False
    programmatic: bool = False


@dataclass(frozen=True)
class Gemm:
    """C = alpha * op(A) . op(B), column-major, batched with strides (elements), fp32 compute into float32 C."""

    trans_a: int
    trans_b: int
    m: int
    n: int
    k: int
    alpha: float
    a: Address
    a_type: int
    lda: int
    stride_a: int
    b: Address
    b_type: int
    ldb: int
    stride_b: int
    c: Address
    ldc: int
    stride_c: int
    batch: int


@dataclass(frozen=True)
class Copy:
    dst: Address
    src: Address
    nbytes: int


@dataclass(frozen=True)
class Fill:
    dst: Address
    byte: int
    nbytes: int


@dataclass(frozen=True)
class CheckStatus:
    """launch.STATUS_WORDS int32 at ``status``: a report of launch.DeviceError; ``beams`` the call's W (its text)."""

    status: Address
    beams: int


Step = Union[Launch, Gemm, Copy, Fill, CheckStatus]


def addresses_of(step: Step) -> list:
    """Every address a step reads or writes (for checks: a symbolic step binds only known names)."""
    if isinstance(step, Launch):
        found = []
        for arg in step.args:
            if isinstance(arg, Pointer):
                found.append(arg.address)
            elif isinstance(arg, Struct):
                found.extend(v for v, (name, kind) in zip(arg.values, struct_fields(arg.dtype)) if kind == "pointer")
            elif isinstance(arg, TensorMap):
                found.append(arg.spec.address)
        return [a for a in found if a is not None and a != 0]
    if isinstance(step, Gemm):
        return [step.a, step.b, step.c]
    if isinstance(step, Copy):
        return [step.dst, step.src]
    if isinstance(step, CheckStatus):
        return [step.status]
    return [step.dst]


@functools.lru_cache(maxsize=None)
def struct_fields(dtype: np.dtype) -> tuple:
    """(field name, "pointer" | "value") of a Struct's dtype: np.uint64 fields are pointers."""
    return tuple((name, "pointer" if dtype.fields[name][0] == np.dtype(np.uint64) else "value") for name in dtype.names)
