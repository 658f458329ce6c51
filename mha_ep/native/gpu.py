"""The native route's planner on the GPU: a CUDA kernel's call signature -> an encoded plan (plan.py), with every
kernel it launches compiled, loaded on the device and allowed its shared memory.

``plan_call`` is the library's callback on a plan-cache miss (the first call of a signature in the process). It
never raises (errors.py). CuPy is imported here only when a plan is made.
"""

from __future__ import annotations

import os
from typing import Optional

from mha_ep.native import ahead, configs, errors
from mha_ep.native.choices import settings
from mha_ep.engine import interrupt
from mha_ep.native.plan import Signature, encode_plan, plan_steps


def function_handle(device_id: int, launch) -> int:
    """The CUfunction of ``launch`` on ``device_id`` (the device current): compiled and loaded once per process
    (kernels.py), with its dynamic shared-memory limit raised when the launch needs more than the default."""
    from mha_ep.engine.cuda import fused, kernels

    if launch.fused:
        kernel = fused.get_fused_kernel(device_id, launch.function, launch.shared)
    else:
        kernel = kernels.get_function(device_id, launch.function)
        fused.raise_shared_limit(kernel, launch.shared)
    return ahead.HANDLES.remember(device_id, launch, int(kernel.kernel.ptr))


def error_words(device_id: int) -> int:
    """The device address of ``device_id``'s sticky report words (device memory the native library allocates once
    and keeps: captured graphs hold the address; called once the library is loaded: from ``plan_call``)."""
    from mha_ep.native import _native

    return int(_native.error_words(device_id))


def take_device_error(device_id: int = 0) -> Optional[str]:
    """The first report a shared-buffer kernel on ``device_id`` made since the last call (launch.DeviceError:
    a past_sequence_length or a beam index out of range, a mask or attention_bias of another length), as ORT's
    sentence naming the node(s) of its kernel config; None when there was none. The report is cleared.

    An eager call raises its own report as the run's ORT error; this is how a decode loop that replays captured
    graphs (where the host cannot wait for the value) learns of one: read it once the stream is synchronized
    (a 32-byte copy).
    The kernels clamped the bad value, so nothing outside the buffers was read or written. Reached through
    ``mha_ep.native.take_device_error``, which loads the library first."""
    from mha_ep.launch import device_error_text
    from mha_ep.native import _native

    report = _native.take_device_error(device_id)
    if report is None:
        return None
    code, a, b, c, site, beams = report
    names = configs.node_names(site) or ("?",)
    nodes = ", ".join(repr(name) for name in names)
    return (f"mha_ep MultiHeadAttention node {nodes} on CUDA device {device_id} (under a replayed graph): "
            f"{device_error_text(code, a, b, c, beams)}")


def plan_ahead(config_id: int, device_id: int, flags: int, inputs: tuple, supplied, make) -> None:
    """Ask the worker of ahead.py for the next steps' plans when ``inputs`` has a past that grows (never raises:
    the call's own plan is made already)."""
    try:
        later = ahead.successors(supplied, inputs, settings.plans_ahead)
        if later:
            from mha_ep.native import _native

            ahead.AHEAD.request(_native, ahead.Request(config_id, device_id, flags, tuple(later), make,
                                                       ahead.AHEAD.generation))
    except Exception:  # noqa: BLE001 - a guess ahead is never the call's error
        pass


def plan_call(config_id: int, node: str, device_id: int, flags: int, inputs: tuple):
    """bytes (the encoded plan), or (ORT error code, message) naming the node, the input and its shape."""
    try:
        import cupy

        from mha_ep.engine.cuda.fused import DeviceFacts

        fused_path = settings.fused_path and os.environ.get("MHA_EP_THREE_PHASE") != "1"
        config = configs.config(config_id)
        poison = settings.poison

        def encoded(inputs: tuple, resolve) -> bytes:
            plan = plan_steps(config, Signature(inputs), facts, flags, fused_path=fused_path, poison=poison,
                              error_site=config_id)  # fmt: skip
            return encode_plan(plan, resolve)

        inputs = tuple(inputs)
        with cupy.cuda.Device(device_id):
            facts = DeviceFacts.of(device_id)
            if "past_sequence_length" in config.supplied:
                error_words(device_id)  # allocated now, before ORT could capture a graph around the call
            plan = encoded(inputs, lambda launch: function_handle(device_id, launch))
        plan_ahead(config_id, device_id, flags, inputs, config.supplied,
                   lambda later: encoded(later, lambda launch: ahead.HANDLES.loaded(device_id, launch)))
        return plan
    except BaseException as error:  # noqa: BLE001 - nothing may go back into ORT as an exception
        return errors.answer(node, error)
    finally:
        interrupt.leaving_op()  # a Ctrl-C deferred during the call is re-sent once ORT has the thread back
