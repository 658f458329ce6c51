"""Running a call's steps (steps.py values) through CuPy, on concrete addresses: the bridge's way (the native
route's C library launches the same steps itself: mha_ep/native).

    run_steps(device_id, steps, stream)                       # queue them on a cupy Stream: launches only
    run_fused(device_id, problem, stream=..., q=..., ...)     # fused.fused_step's launch, run now

A step's pieces come from the modules that build them: kernels.py compiles a Launch's kernel (fused.py's
``get_fused_kernel`` for a fused one, which raises its shared-memory limit), tma.py encodes a TensorMap, gemm.py
issues a Gemm. Those modules import steps.py, never this one, so the values and their builders stay free of the
runner. This module imports CuPy only inside ``run_steps`` and ``run_fused``.
"""

from __future__ import annotations

import numpy as np

from mha_ep.engine.cuda import fused, gemm, kernels, tma
from mha_ep.engine.cuda.steps import (
    Address, Buffer, CheckStatus, Copy, Fill, Gemm, Launch, Pointer, Struct, TensorMap, struct_fields,
)
from mha_ep.engine.problem import MhaProblem


def struct_array(arg: Struct) -> np.ndarray:
    """``arg`` on concrete addresses as a one-element structured array (what CuPy passes by value)."""
    values = tuple(_concrete(v) if kind == "pointer" else v for v, (_, kind) in zip(arg.values, struct_fields(arg.dtype)))
    return np.array([values], dtype=arg.dtype)


def _concrete(address: Address) -> int:
    if address is None:
        return 0
    if isinstance(address, Buffer):
        raise ValueError(f"cuda steps: address {address} is symbolic; CuPy runs steps on concrete addresses")
    return int(address)


def _kernel_argument(arg):
    if isinstance(arg, Pointer):
        return np.uint64(_concrete(arg.address))
    if isinstance(arg, Struct):
        return struct_array(arg)
    if isinstance(arg, TensorMap):
        return tma.encode(arg.spec)
    return arg


def run_steps(device_id: int, steps, stream) -> None:
    """Queue ``steps`` (concrete addresses) on ``stream`` (a cupy Stream) on device ``device_id``: launches only,
    no allocation, no synchronization."""
    import cupy

    with cupy.cuda.Device(device_id), stream:
        for step in steps:
            if isinstance(step, Launch):
                if step.fused:
                    function = fused.get_fused_kernel(device_id, step.function, step.shared)
                else:
                    function = kernels.get_function(device_id, step.function)
                args = tuple(_kernel_argument(a) for a in step.args)
                function(step.grid, step.block, args, shared_mem=step.shared)
            elif isinstance(step, Gemm):
                gemm.run_gemm(step, stream.ptr, _concrete)
            elif isinstance(step, Copy):
                if step.nbytes and _concrete(step.dst) != _concrete(step.src):
                    cupy.cuda.runtime.memcpyAsync(_concrete(step.dst), _concrete(step.src), step.nbytes,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)  # fmt: skip
            elif isinstance(step, Fill):
                if step.nbytes:
                    cupy.cuda.runtime.memsetAsync(_concrete(step.dst), step.byte, step.nbytes, stream.ptr)
            elif isinstance(step, CheckStatus):
                continue
            else:
                raise TypeError(f"cuda steps: unknown step {step!r}")


def run_fused(device_id: int, problem: MhaProblem, *, stream=None, **operands) -> None:
    """Launch the fused kernel for ``problem`` on ``stream`` (default: the current stream) of ``device_id``:
    ``fused.fused_step``'s arguments, this device's facts. Launches only: no allocation, no synchronization."""
    import cupy

    step = fused.fused_step(problem, facts=fused.DeviceFacts.of(device_id), **operands)
    run_steps(device_id, [step], stream if stream is not None else cupy.cuda.get_current_stream())
