"""The cuda backend's device entry: an MhaProblem whose arrays already lie on the GPU, outputs as CuPy arrays.

Device-resident mode (mha_ep/device/) calls this between ORT CUDA pieces, on the backend's stream, which ORT
shares. It is the bridge path's steps 2-5 (backend.py) without staging or downloads:
  * inputs are CuPy arrays in the node's dtype, and the padding mask is resolved on the device
    (problem.resolve_padding_mask works on CuPy arrays);
  * float16 calls on the fused path read their float16 tensors directly: build_dense_BNTH_native moves Q, K, V
    into the kernel's operands in one launch (the biases placed as on the bridge path: movers.layout_movers),
    which for a wanted present *are* the present outputs, and narrow_output turns the kernel's float32 output
    (values already rounded to float16) into the node's float16 output. Other calls widen their inputs to the
    float32 the bridge stages (exact) and run the bridge's steps 2-5 unchanged;
  * outputs are fresh CuPy arrays in the node's dtype;
  * no synchronize: scratch goes back to CuPy's pool, whose blocks are reused in stream order. When ``keep`` is
    a list (a whole call is being captured into a CUDA graph), every buffer the launches touch is appended to it
    instead, so that no later allocation can take its memory while the graph lives.
"""

from __future__ import annotations

from typing import Optional

import cupy
import numpy as np

from mha_ep.launch import LAUNCH_BLOCK
from mha_ep.ops.backends.cuda import dispatch, fused
from mha_ep.ops.backends.cuda.backend import (
    CudaBackend, _ptr, cached_plan, input_entries, launch_movers, output_entries,
)
from mha_ep.ops.backends.cuda.kernels import get_kernel
from mha_ep.ops.backends.cuda.movers import layout_movers, problem_sources
from mha_ep.ops.backends.cuda.staging import ALIGNMENT
from mha_ep.ops.problem import MhaProblem

NATIVE_DTYPES = ("float16",)



class PoolScratch:
    """MhaScratch's allocation interface over CuPy's stream-ordered pool: nothing waits for the stream."""

    def __init__(self, held: list):
        self.held = held

    def allocate(self, nbytes: int) -> int:
        memory = cupy.cuda.alloc(max(int(nbytes), 1))
        self.held.append(memory)
        return memory.ptr

    def mark_stream_use(self) -> None:
        pass


def run_on_device(backend: CudaBackend, problem: MhaProblem, keep: Optional[list] = None) -> list:
    """(output, present_key, present_value) of ``problem`` as CuPy arrays in the node's dtype (None where not
    wanted), queued on ``backend``'s stream. Raises MhaInputError / MhaEpError like ``backend.run``."""
    plan = cached_plan(problem.geometry, problem.dtype)
    held: list = []
    if problem.dtype in NATIVE_DTYPES and backend.fused_path and dispatch.fused_unsupported_reason(problem) is None:
        with backend._on_device():
            results = _run_native(backend, problem, plan, held)
        if keep is not None:
            keep.extend(held)
            keep.extend(r for r in results if r is not None)
        return results
    with backend._on_device():
        dev_in = {}
        for name, staged_dtype, _, array in input_entries(problem):
            dev_in[name] = _address(cupy.ascontiguousarray(array, dtype=staged_dtype), held)
        outputs = {}
        for name, dtype, shape in output_entries(problem):
            array = cupy.empty(shape, dtype)
            if backend.poison_device_buffers:
                array.fill(np.nan)
            outputs[name] = array
        dev_out = {name: array.data.ptr for name, array in outputs.items()}
        scratch = PoolScratch(held)
        ops = backend._operands(problem, plan, scratch, dev_out)
        backend._attention(problem, plan, ops, dev_in, dev_out, backend._stream)
        results = [outputs.get(name) for name in ("output", "present_key", "present_value")]
        if problem.dtype != "float32":
            results = [None if r is None else r.astype(problem.dtype) for r in results]
    if keep is not None:
        keep.extend(held)
        keep.extend(outputs.values())
    return results


def _run_native(backend: CudaBackend, problem: MhaProblem, plan, held: list) -> list:
    """The fused path on float16 tensors as they are (module docstring)."""
    g = problem.geometry
    dtype = problem.dtype
    scratch = PoolScratch(held)

    terms = dispatch.score_terms(problem)
    key_apart = problem.bias_k is not None and not terms.key_bias_in_operand  # present holds a bias K leaves out
    shapes = {"k_BNTH": (g.batch, g.num_heads, g.total_seq, g.head_size),
              "v_BNTH": (g.batch, g.num_heads, g.total_seq, g.v_head_size)}  # fmt: skip

    def operand(present_wanted: bool, name: str, apart: bool = False):
        """(present array or None, operand address): a wanted present is the operand, unless ``apart``."""
        present = cupy.empty(shapes[name], dtype) if present_wanted else None
        if present is not None and backend.poison_device_buffers:
            present.fill(np.nan)  # before the movers write it (it may be their operand)
        if present is not None and not apart:
            return present, present.data.ptr
        return present, backend._allocate(scratch, name, plan)

    present_key, k_BNTH = operand(problem.want_present_key, "k_BNTH", apart=key_apart)
    present_value, v_BNTH = operand(problem.want_present_value, "v_BNTH")
    q_BNSH = backend._allocate(scratch, "q_BNSH", plan)
    offsets = backend._offset_buffers(scratch, plan, terms)
    movers = layout_movers(
        plan, terms, problem.kv_layout == "BNSH",
        sources={name: _address(array, held) for name, array in problem_sources(problem).items()},
        dst={"q_BNSH": q_BNSH, "k_BNTH": k_BNTH, "v_BNTH": v_BNTH},
        presents={"present_key": present_key.data.ptr if key_apart and present_key is not None else None},
        offsets=offsets,
    )  # fmt: skip
    launch_movers(backend.device_id, plan, "build_dense_BNTH_native", movers, problem.scale)
    mask = problem.padding_mask
    mask_address = None
    if mask is not None:
        staged = mask.data if mask.kind == "key_lengths" else mask.data.view(cupy.uint8)
        mask_address = _address(staged, held)
    bias = problem.attention_bias
    bias_address = None if bias is None else _address(cupy.ascontiguousarray(bias, dtype=cupy.float32), held)
    out_f32 = cupy.empty((g.batch, g.q_seq, g.v_hidden), cupy.float32)
    held.append(out_f32)
    if backend.poison_device_buffers:
        out_f32.fill(np.nan)
    fused.run_fused(
        backend.device_id, problem,
        q=fused.Operand(q_BNSH, "BNSH", plan.q_seq, plan.head_size),
        k=fused.Operand(k_BNTH, "BNSH", plan.total_seq, plan.head_size),
        v=fused.Operand(v_BNTH, "BNSH", plan.total_seq, plan.v_head_size),
        operand_dtype=dtype, attention_bias=bias_address, mask=mask_address, out_BSD=out_f32.data.ptr,
        stream=backend._stream, key_offset=offsets.get("key_offset_BNT"),
        query_offset=offsets.get("query_offset_BNS"),
    )  # fmt: skip
    output = cupy.empty(out_f32.shape, dtype)
    get_kernel(backend.device_id, "narrow_output", dtype, plan.vec_v)(
        (plan.grids["context_to_BSD"],), (LAUNCH_BLOCK,),
        (_ptr(out_f32.data.ptr), _ptr(output.data.ptr), np.int64(out_f32.size)),
    )  # fmt: skip
    return [output, present_key, present_value]


def _address(array, held: list) -> Optional[int]:
    """The device address of ``array``, contiguous and ALIGNMENT-aligned (copied when it is not: the bias
    slices are views at offsets D and 2D, which the kernels' vector loads may not take), kept alive in ``held``;
    None for None. The bridge's staging aligns every input the same way."""
    if array is None:
        return None
    contiguous = cupy.ascontiguousarray(array)
    if contiguous.data.ptr % ALIGNMENT:
        contiguous = contiguous.copy()
    held.append(contiguous)
    return contiguous.data.ptr
