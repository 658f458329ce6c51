"""The cuda backend's device entry: an MhaProblem whose arrays already lie on the GPU, outputs as CuPy arrays.

Device-resident mode (mha_ep/device/) calls this between ORT CUDA pieces, on the backend's stream, which ORT
shares. It is one DeviceCall of the backend's device-side interface (``CudaBackend.device_steps``, pipeline.py):
  * inputs are CuPy arrays in the node's dtype, and the padding mask is resolved on the device
    (problem.resolve_padding_mask works on CuPy arrays);
  * float16 calls on the fused path read their float16 tensors directly (pipeline step 2); other calls are
    widened to float32 on the device and run the float32 pipeline, their outputs narrowed back;
  * outputs are fresh CuPy arrays in the node's dtype;
  * no synchronize: scratch comes from CuPy's pool, whose blocks are reused in stream order. When ``keep`` is a
    list (a whole call is being captured into a CUDA graph), every buffer the launches touch is appended to it,
    so that no later allocation can take its memory while the graph lives.
"""

from __future__ import annotations

from typing import Optional

import cupy
import numpy as np

from mha_ep.ops.backends.cuda.backend import CudaBackend
from mha_ep.ops.backends.cuda.movers import problem_sources
from mha_ep.ops.backends.cuda.pipeline import DeviceCall, output_shapes
from mha_ep.ops.problem import MhaProblem


class PoolTemporaries:
    """pipeline.Temporaries over CuPy's stream-ordered pool: nothing waits for the stream; ``held`` keeps every
    block alive until the caller drops it."""

    def __init__(self, held: list):
        self.held = held

    def take(self, name: str, nbytes: int) -> int:
        memory = cupy.cuda.alloc(max(int(nbytes), 1))
        self.held.append(memory)
        return memory.ptr


def run_on_device(backend: CudaBackend, problem: MhaProblem, keep: Optional[list] = None) -> list:
    """(output, present_key, present_value) of ``problem`` as CuPy arrays in the node's dtype (None where not
    wanted), queued on ``backend``'s stream. Raises MhaInputError / MhaEpError like ``backend.run``."""
    held: list = []
    with backend.holding():
        sources = {name: _address(array, held) for name, array in problem_sources(problem).items()}
        sources["attention_bias"] = _address(problem.attention_bias, held)
        mask = problem.padding_mask
        if mask is not None:
            sources["mask"] = _address(mask.data if mask.kind == "key_lengths" else mask.data.view(cupy.uint8), held)
        outputs = {}
        for name, shape in output_shapes(problem).items():
            outputs[name] = cupy.empty(shape, problem.dtype)
            if backend.poison_device_buffers:
                outputs[name].fill(np.nan)
        call = DeviceCall(sources=sources, source_dtype=problem.dtype,
                          outputs={name: array.data.ptr for name, array in outputs.items()},
                          output_dtype=problem.dtype, attention_bias_dtype=problem.dtype)  # fmt: skip
        backend.run_steps(backend.device_steps(problem, call, PoolTemporaries(held)))
    if keep is not None:
        keep.extend(held)
        keep.extend(outputs.values())
    return [outputs.get(name) for name in ("output", "present_key", "present_value")]


def _address(array, held: list) -> Optional[int]:
    """The device address of ``array`` made contiguous, kept alive in ``held``; None for None (the pipeline copies
    an address its vector loads cannot take: the bias slices are views at offsets D and 2D)."""
    if array is None:
        return None
    contiguous = cupy.ascontiguousarray(array)
    held.append(contiguous)
    return contiguous.data.ptr
