"""TMA tile maps (mha_ep/engine/cuda/tma.py) and the three flash_attention_ws passes (fused.ws_tensor_maps).

CPU tests: the map of an operand in BSNH and BNSH (sizes innermost first, byte strides, box), each rule that
refuses a map, and which maps a warp-specialized launch asks for (the driver's encoder replaced by a recorder).
GPU test (marked gpu): the driver's encoding is 128 bytes, read-only and memoised. The kernel reading through the
maps is tested in tests/engine/cuda/test_fused_kernels.py (test_warp_specialized_kernel_matches_reference, BNSH and BSNH operands).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mha_ep.engine.cuda import dispatch, fused, tma

from cuda_cases import Case
from fused_cases import make_problem

B, S, N, H = 2, 300, 3, 48


def test_bnsh_operand_map():
    op = fused.Operand(0x10000, "BNSH", S, H)
    spec = tma.TileMap.for_operand("k", op.address, "float16", dim=H, seq=S, heads=N, batch=B, strides=op.strides(N),
                                   box_rows=128)  # fmt: skip
    assert spec.dims == (H, S, N, B)
    assert spec.strides == (H * 2, S * H * 2, N * S * H * 2)  # seq, head, batch in bytes
    assert (spec.box_rows, spec.dtype, spec.address) == (128, "float16", 0x10000)


def test_bsnh_operand_map_keeps_the_layouts_own_strides():
    """BSNH: the head stride (H elements) is smaller than the seq stride (N*H): TMA takes strides in any order."""
    op = fused.Operand(0x10000, "BSNH", S, H)
    spec = tma.TileMap.for_operand("q", op.address, "bfloat16", dim=H, seq=S, heads=N, batch=B,
                                   strides=op.strides(N), box_rows=64)  # fmt: skip
    assert spec.dims == (H, S, N, B)
    assert spec.strides == (N * H * 2, H * 2, S * N * H * 2)


VALID = tma.TileMap("q", 0x10000, "float16", (H, S, N, B), (96, 96 * S, 96 * S * N), 128)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"dtype": "float32"}, "dtype 'float32' is not one of ['bfloat16', 'float16']"),
        ({"address": 0x10008}, "address 0x10008 is not 16-byte aligned"),
        ({"strides": (40, 96 * S, 96 * S * N)}, "the seq stride of 40 bytes is not a positive multiple of 16"),
        ({"strides": (96, 0, 96 * S * N)}, "the head stride of 0 bytes is not a positive multiple of 16"),
        ({"strides": (96, 96 * S, 1 << 40)}, "the batch stride of 1099511627776 bytes is not a positive multiple"),
        ({"dims": (H, 0, N, B)}, "the seq size 0 is not in 1..2^32"),
        ({"dims": (H, S, N, (1 << 32) + 1)}, "the batch size 4294967297 is not in 1..2^32"),
        ({"box_rows": 257}, "box rows 257 is not in 1..256"),
    ],
)
def test_each_rule_names_what_tma_cannot_read(change, expected):
    assert tma.tile_map_problem(VALID) is None
    assert tma.tile_map_problem(replace(VALID, **change)).startswith(expected)


def test_for_operand_and_encode_refuse_before_the_driver_names_the_operand():
    with pytest.raises(ValueError, match=r"TMA tile map of operand v: address 0x10002 is not 16-byte aligned"):
        tma.TileMap.for_operand("v", 0x10002, "float16", dim=H, seq=S, heads=N, batch=B, strides=(S * H, H, H * 1),
                                box_rows=128)  # fmt: skip
    with pytest.raises(ValueError, match=r"TMA tile map of operand q: box rows 0"):
        tma.encode(replace(VALID, box_rows=0))  # (no libcuda on a CPU machine: refused before it is loaded)


def test_ws_launch_passes_the_maps_of_q_k_and_v():
    """Q's boxes hold the kernel's 128 query rows, K's and V's the tile's keys; V's rows are Hv wide (the maps
    are encoded when the step is launched: steps.TensorMap)."""
    problem = make_problem(Case(b=B, s=S, l=200, n=N, h=128, hv=64), "float16")
    g = problem.geometry
    q = fused.Operand(0x100000, "BNSH", g.q_seq, 128)
    k = fused.Operand(0x200000, "BSNH", g.total_seq, 128)
    v = fused.Operand(0x300000, "BNSH", g.total_seq, 64)
    got = fused.ws_tensor_maps(problem, "float16", dispatch.WsTile(64), {"q": q, "k": k, "v": v})
    recorded = [arg.spec for arg in got]
    assert [spec.name for spec in recorded] == ["q", "k", "v"]
    assert [(s.address, s.dims, s.box_rows) for s in recorded] == [
        (0x100000, (128, S, N, B), dispatch.WS_BLOCK_M),
        (0x200000, (128, 200, N, B), 64),
        (0x300000, (64, 200, N, B), 64),
    ]
    assert recorded[1].strides == (N * 128 * 2, 128 * 2, 200 * N * 128 * 2)  # k in BSNH


def test_three_consumer_tiles_load_192_query_rows():
    problem = make_problem(Case(b=B, s=S, l=200, n=N, h=64), "bfloat16")
    ops = {name: fused.Operand(0x100000 * (i + 1), "BNSH", seq, 64)
           for i, (name, seq) in enumerate((("q", S), ("k", 200), ("v", 200)))}  # fmt: skip
    got = [arg.spec for arg in fused.ws_tensor_maps(problem, "bfloat16", dispatch.WsTile(consumers=3), ops)]
    assert [(spec.box_rows, spec.dtype) for spec in got] == [(192, "bfloat16"), (128, "bfloat16"), (128, "bfloat16")]


def test_a_driver_without_the_encoder_is_named(monkeypatch):
    class OldDriver:  # a pre-CUDA-12 libcuda: no cuTensorMapEncodeTiled
        pass

    monkeypatch.setattr(tma, "_driver", [])
    monkeypatch.setattr(tma.ctypes, "CDLL", lambda name: OldDriver())
    with pytest.raises(RuntimeError, match=r"has no cuTensorMapEncodeTiled: .* need a CUDA 12 or newer driver"):
        tma.encode.__wrapped__(replace(VALID, address=0x20000))


@pytest.mark.gpu
def test_the_driver_encodes_a_read_only_memoised_128_byte_record(cupy_module):
    buffer = cupy_module.zeros(B * N * S * H, dtype=cupy_module.float16)
    spec = replace(VALID, address=buffer.data.ptr)
    record = tma.encode(spec)
    assert record.dtype == tma.RECORD and record.shape == (1,) and record.nbytes == 128
    assert not record.flags.writeable
    assert record.tobytes() != bytes(128)
    assert tma.encode(replace(VALID, address=buffer.data.ptr)) is record
