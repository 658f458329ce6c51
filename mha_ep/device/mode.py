"""When a ``mha_ep.InferenceSession`` runs in device-resident mode, and why not.

Device mode is opt-in (``device_mode="device"``): by default a session on the CUDA provider is one ORT session on
the native route (mha_ep/native/cuda_io.py), which is as fast or faster everywhere a bench row measured it except
repeated shapes under whole-call graphs, where device mode's graphs still win (docs/BENCH.md, section 5).

Device mode runs when all of these hold, checked in this order (the first that fails is the reason, raised as
DeviceModeUnavailableError):
  1. the session's providers include CUDAExecutionProvider;
  2. the installed onnxruntime has that provider (onnxruntime-gpu);
  3. the backend is, or ``auto`` resolves to, ``cuda`` (CuPy and a GPU);
  4. the model cuts into a device plan (device/plan.py: every tensor crossing a cut has a known element type);
  5. no tensor crossing a cut is bfloat16 (CuPy has no bfloat16 arrays; the one-session route runs such models);
  6. no claimed node has a shared past/present buffer (past_sequence_length with a past: its length is a device
     value, which device mode's host-side planning would have to read every call; the one-session route, whose
     kernels read it on the device, runs static KV caches).
``device_mode``: "device" (or True) asks for it; "auto" (the default), "python-op" (or False) never take it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mha_ep import spec
from mha_ep.errors import MhaEpError

MODES = ("auto", "device", "python-op")
CUDA_PROVIDER = "CUDAExecutionProvider"


class DeviceModeUnavailableError(MhaEpError):
    """device_mode="device" was asked for where it cannot run; the message says why."""


def normalise_mode(device_mode) -> str:
    if device_mode is True:
        return "device"
    if device_mode is False or device_mode is None:
        return "python-op" if device_mode is False else "auto"
    if device_mode in MODES:
        return device_mode
    raise ValueError(f"device_mode must be one of {MODES} (or True/False), got {device_mode!r}")


def provider_names(providers: Optional[Sequence]) -> list:
    """Provider names from onnxruntime's forms: "Name" or ("Name", {options})."""
    return [p[0] if isinstance(p, (tuple, list)) else p for p in (providers or [])]


def cuda_options_of(providers: Optional[Sequence], provider_options: Optional[Sequence]) -> dict:
    """The caller's CUDA provider options, from either of onnxruntime's two ways of passing them."""
    names = provider_names(providers)
    for index, provider in enumerate(providers or []):
        if isinstance(provider, (tuple, list)) and provider[0] == CUDA_PROVIDER and len(provider) > 1:
            return dict(provider[1])
    if provider_options and CUDA_PROVIDER in names:
        return dict(provider_options[names.index(CUDA_PROVIDER)] or {})
    return {}


def reason_without_cuda_provider(providers: Optional[Sequence], available: Sequence[str]) -> Optional[str]:
    """Rules 1-2."""
    if CUDA_PROVIDER not in provider_names(providers):
        return (f"the session's providers {provider_names(providers) or ['CPUExecutionProvider']} do not include "
                f"{CUDA_PROVIDER}")  # fmt: skip
    if CUDA_PROVIDER not in available:
        return (f"the installed onnxruntime has no {CUDA_PROVIDER} (available: {list(available)}); install "
                f"mha-ep[gpu] (onnxruntime-gpu)")  # fmt: skip
    return None


def reason_in_plan(plan) -> Optional[str]:
    """Rules 5 and 6 on a plan that was made (rule 4's failure is the DevicePlanError's own message)."""
    shared = [step.node_name for step in plan.attention_steps
              if step.inputs[spec.SLOT["past_key"]] and step.inputs[spec.SLOT["past_sequence_length"]]]  # fmt: skip
    if shared:
        return (f"claimed node {shared[0]!r} (and {len(shared) - 1} more) has a shared past/present buffer "
                f"(past_sequence_length), whose length only the device reads; the one-session route runs it")  # fmt: skip
    wide = sorted(name for name, dtype in plan.dtypes.items() if dtype == "bfloat16")
    if wide:
        return (f"tensor {wide[0]!r} (and {len(wide) - 1} more) crossing a device step is bfloat16, which CuPy "
                f"cannot hold; the Python-op path runs bfloat16 models")  # fmt: skip
    return None
