"""A packed QKV (B, S, N, 3, H) or packed KV (B, L, N, 2, H) input read in place: its slots as the call's query /
key / value sources, strided views of ORT's one buffer (no unpacking copy). pipeline.attention_steps names them
(source_slots, packed_slot_sources); the fused kernels read a slot as a BSN3H / BSN2H operand
(fused.PACKED_LAYOUTS), the layout movers with ``cur_slots`` (kernels/layout.cu). CuPy is not imported here.
"""

from __future__ import annotations

from mha_ep.engine.cuda.steps import Address, Copy, alignment_of, offset_address
from mha_ep.engine.problem import MhaProblem
from mha_ep.launch import ELEMENT_BYTES

PACKED_SLOTS = {"qkv": ("query", "key", "value"), "kv": ("key", "value")}  # problem.packing -> its slots, in order


def source_slots(problem: MhaProblem, call) -> dict:
    """query / key / value -> the slots of the packed input that source is one of (3: packed QKV, 2: packed KV),
    for a call (pipeline.DeviceCall) whose packed input is read in place (``packed_sources``); empty otherwise. A
    slot is a strided view of ORT's buffer: fused.PACKED_LAYOUTS operands, movers with ``cur_slots``."""
    if not call.packed_sources or problem.packing is None:
        return {}
    names = PACKED_SLOTS[problem.packing]
    return {name: len(names) for name in names}


def packed_rows(problem: MhaProblem) -> int:
    """(b, s, h) rows of the call's packed input: B * (S for packed QKV, L for packed KV) * N."""
    g = problem.geometry
    return g.batch * (g.q_seq if problem.packing == "qkv" else g.kv_seq) * g.num_heads


def slot_sources(problem: MhaProblem, sources: dict, base: Address, element: int) -> dict:
    """``sources`` with query / key / value the addresses of the packed input's slots 0, 1 (, 2) at ``base``."""
    slot_bytes = problem.geometry.head_size * element
    names = PACKED_SLOTS[problem.packing]
    return {**sources, **{name: offset_address(base, i * slot_bytes) for i, name in enumerate(names)}}


def packed_slot_sources(problem: MhaProblem, sources: dict, source_dtype: str, build, alignment: int) -> dict:
    """``sources`` with the packed input (sources["query"] for packed QKV, ["key"] for packed KV, as ORT holds it)
    named by its slots, read in place: no unpacking copy. A packed buffer whose base is not ``alignment``-aligned
    (pipeline.SOURCE_ALIGNMENT) is copied whole first through ``build`` (its ``take`` and ``add``): the slots
    then are, wherever the kernels need it (H % 8)."""
    names = PACKED_SLOTS[problem.packing]
    base = sources[names[0]]
    element = ELEMENT_BYTES[source_dtype]
    if alignment_of(base) < alignment:
        nbytes = packed_rows(problem) * len(names) * problem.geometry.head_size * element
        aligned = build.take(f"{names[0]}_packed_aligned", nbytes)
        build.add(Copy(aligned, base, nbytes))
        base = aligned
    return slot_sources(problem, sources, base, element)
