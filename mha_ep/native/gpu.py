"""The native route's planner on the GPU: a CUDA kernel's call signature -> an encoded plan (plan.py), with every
kernel it launches compiled, loaded on the device and allowed its shared memory.

``plan_call`` is the library's callback on a plan-cache miss (the first call of a signature in the process). It
never raises (errors.py). CuPy is imported here only when a plan is made.
"""

from __future__ import annotations

import os

from mha_ep.native import configs, errors
from mha_ep.ops import interrupt
from mha_ep.native.plan import Signature, encode_plan, plan_steps


def function_handle(device_id: int, launch) -> int:
    """The CUfunction of ``launch`` on ``device_id`` (the device current): compiled and loaded once per process
    (kernels.py), with its dynamic shared-memory limit raised when the launch needs more than the default."""
    from mha_ep.ops.backends.cuda import fused, kernels

    if launch.fused:
        kernel = fused.get_fused_kernel(device_id, launch.function, launch.shared)
    else:
        kernel = kernels.get_function(device_id, launch.function)
        fused.raise_shared_limit(kernel, launch.shared)
    return int(kernel.kernel.ptr)


def plan_call(config_id: int, node: str, device_id: int, flags: int, inputs: tuple):
    """bytes (the encoded plan), or (ORT error code, message) naming the node, the input and its shape."""
    try:
        import cupy

        from mha_ep.native import settings
        from mha_ep.ops.backends.cuda.fused import DeviceFacts

        fused_path = settings.fused_path and os.environ.get("MHA_EP_THREE_PHASE") != "1"
        with cupy.cuda.Device(device_id):
            plan = plan_steps(configs.config(config_id), Signature(tuple(inputs)), DeviceFacts.of(device_id), flags,
                              fused_path=fused_path, poison=settings.poison)  # fmt: skip
            return encode_plan(plan, lambda launch: function_handle(device_id, launch))
    except BaseException as error:  # noqa: BLE001 - nothing may go back into ORT as an exception
        return errors.answer(node, error)
    finally:
        interrupt.leaving_op()  # a Ctrl-C deferred during the call is re-sent once ORT has the thread back
