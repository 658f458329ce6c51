"""CPU audits of the cuda backend: 64-bit index promotion in the .cu sources, and the host-side checked geometry.

Port of the original's ``nvrtc_linear_indices_promote_before_every_int_product`` and its checked-geometry tests.
Reads the kernel files as text; needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mha_ep.errors import MhaInputError
from mha_ep.launch import ELEMENT_TYPES, LAUNCH_BLOCK
from mha_ep.limits import I32_MAX, U32_MAX
from mha_ep.engine.cuda import geometry
from mha_ep.engine.cuda.geometry import checked_bytes, checked_grid, checked_i32, plan_launch, row_team
from mha_ep.engine.cuda.kernels import KERNELS, MASK_KERNELS, MASK_TYPES
from mha_ep.engine.cuda.movers import MOVER_DTYPE, MOVER_FIELDS
from mha_ep.engine.problem import Geometry

KERNEL_DIR = Path(geometry.__file__).parent / "kernels"
SOURCES = {path.name: path.read_text() for path in sorted(KERNEL_DIR.glob("*.cu*"))}
ALL_SOURCE = "\n".join(SOURCES.values())


def code_only(text: str) -> str:
    """The source without // comments (the comments quote the forbidden form on purpose)."""
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def test_kernel_files_exist():
    assert {"common.cuh", "layout.cu", "softmax.cu"} <= set(SOURCES)


@pytest.mark.parametrize(
    "required",
    [
        # layout.cu: build_dense_BNTH
        "(long long)batch * heads * total",
        "const long long threads = rows * team",
        "(((long long)b * heads + h) * past_seq + s) * dim + d",
        "(((long long)b * heads + h) * cur_seq + sc) * dim + d",
        "(((long long)b * cur_seq + sc) * heads + h) * (m.cur_slots * dim) + d",
        "bias_NH + (long long)h * dim + d",
        # layout.cu: context_to_BSD
        "(long long)batch * seq * heads * groups",
        "(((long long)b * heads + h) * seq + s) * dim + g * VEC",
        "dst_BNTH + dst",
        "const long long dst = row * dim + d",
        "offset_weight_NH + (long long)h * dim + d",
        "out_BSD + idx * VEC",
        # softmax.cu
        "(long long)batch * heads * q_seq",
        "(((long long)bb * m.bias_d1 + bn) * q_seq + r.i) * total_seq",
        "m.keep + (long long)b * total_seq",
        "m.keep + ((long long)b * q_seq + r.i) * total_seq",
        "scores_BNST + row * total_seq",
        "probs_BNST + row * total_seq",
        "(long long)blockIdx.x * WARPS + threadIdx.x / 32",
        "row += (long long)gridDim.x * WARPS",
        # common.cuh: grid-stride loops
        "(long long)blockIdx.x * blockDim.x + threadIdx.x",
        "(long long)gridDim.x * blockDim.x",
    ],
)
def test_linear_indices_promote_before_every_int_product(required):
    assert required in code_only(ALL_SOURCE), f"kernel source must promote before multiplication: {required}"


@pytest.mark.parametrize(
    "forbidden",
    [
        "(long long)(b * heads + h)",
        "(long long)(b * cur_seq + sc)",
        "(long long)(b * seq + s)",
        "(long long)(bb * m.bias_d1 + bn)",
        "(long long)(b * q_seq + r.i)",
        "bias_NH + h * dim + d",
        "(long long)(idx",
        "blockIdx.x * blockDim.x + threadIdx.x;",  # an int grid index
    ],
)
def test_no_cast_after_an_overflowing_int_expression(forbidden):
    code = code_only(ALL_SOURCE)
    for promoted in ("(long long)", "(unsigned long long)"):  # a 64-bit grid index: promoted before the product
        code = code.replace(f"{promoted}blockIdx.x * blockDim.x + threadIdx.x;", "")
    assert forbidden not in code, f"kernel source casts after an overflowing int expression: {forbidden}"


def test_no_parenthesised_product_is_cast_to_64_bit():
    """Generic form of the rule: `(long long)(x * y ...)` casts a product that was computed in int."""
    pattern = re.compile(r"\(\s*(?:long long|int64_t|size_t)\s*\)\s*\([^()]*\*")
    hits = [(name, m.group(0)) for name, text in SOURCES.items() for m in pattern.finditer(code_only(text))]
    assert not hits, f"cast after an int product: {hits}"


def test_every_subscript_with_a_product_is_64_bit():
    """Each `[...]` holding a `*` starts its arithmetic from a long long (a cast or a long long variable); register
    arrays (declared with a fixed size, e.g. `float s[S_BLOCKS * 4]`) are indexed by small constants and exempt."""
    long_long_names = set(re.findall(r"long long\s+(\w+)", code_only(ALL_SOURCE))) | {"idx", "row"}
    register_arrays = set(re.findall(r"\b(?:float|unsigned)\s+(\w+)\[", code_only(ALL_SOURCE)))
    offenders = []
    for name, text in SOURCES.items():
        for array, subscript in re.findall(r"(\w+)\[([^\[\]]*\*[^\[\]]*)\]", code_only(text)):
            if "(long long)" in subscript or array in register_arrays:
                continue
            if any(re.search(rf"\b{var}\b", subscript) for var in long_long_names):
                continue
            offenders.append((name, subscript))
    assert not offenders, f"subscripts with an int product: {offenders}"


def test_the_host_mover_struct_lists_layout_cu_fields_in_order():
    """movers.MOVER_FIELDS is layout.cu's struct Mover: same names, same order, same C types (pointers as 64-bit
    addresses). The nvcc test below checks the byte offsets too."""
    body = re.search(r"struct Mover \{(.*?)\};", code_only(SOURCES["layout.cu"]), re.S).group(1)
    fields = re.findall(r"^\s*(?:const\s+)?(\w+)(\*?)\s+(\w+);", body, re.M)
    c_type = {("int", ""): np.int32, ("float", ""): np.float32}
    declared = [(name, np.uint64 if star else c_type[(base, star)]) for base, star, name in fields]
    assert declared == list(MOVER_FIELDS)
    assert MOVER_DTYPE.itemsize == -(-(8 * 8 + 9 * 4) // 8) * 8  # 8 pointers, 9 ints / floats, 8-byte aligned


SHARED_BUFFER_SIGNATURE = (  # kernels/shared_buffer.cu SHARED_BUFFER_PARAMETERS, both kernels'
    "const {T}*, const {T}*, const {T}*, int, const {T}*, const {T}*, const {T}*, const {T}*, const {T}*, const int*, "
    "const int*, int, const {M}*, int, int, const {T}*, int, int, int, {T}*, {T}*, {T}*, float, float, int, int, int, "
    "int, int, int, int, int, int, int*, int*, int"
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_for_every_dtype_with_nvcc(tmp_path):
    """Instantiate every name expression the backend asks NVRTC for, and compile for sm_90 (offline check)."""
    signatures = {
        "build_dense_BNTH": "const Mover<float, {T}>, const Mover<float, {T}>, const Mover<float, {T}>, int, int",
        "build_dense_BNTH_native": "const Mover<{T}, {T}>, const Mover<{T}, {T}>, const Mover<{T}, {T}>, int, int",
        "context_to_BSD": "const float*, float*, int, int, int, int",
        "narrow_output": "const float*, {T}*, long long",
        "widen_to_float": "const {T}*, float*, long long",
        "resolve_key_lengths": "const {T}*, int*, int, int",
        "resolve_keep_flags": "const {T}*, unsigned char*, long long",
        "masked_softmax_warp": "const float*, {T}*, const float*, int, int, int, const int*, const unsigned char*, "
        "const float*, const float*, float, int, int, int, int, int, int, float*",
        "masked_softmax": "const float*, {T}*, const float*, int, int, int, const int*, const unsigned char*, "
        "const float*, const float*, float, int, int, int, int, int, int, float*, int",
        "shared_buffer_attention": SHARED_BUFFER_SIGNATURE,
        "shared_buffer_decode": SHARED_BUFFER_SIGNATURE,
    }
    variants = {name: variants for name, (_, variants) in KERNELS.items()}
    assert set(signatures) == set(variants), "a kernel of kernels.KERNELS without a signature here"
    instantiations = []
    for kernel, params in signatures.items():
        for element in (MASK_TYPES if kernel in MASK_KERNELS else ELEMENT_TYPES).values():
            for variant in variants[kernel]:
                arguments = element if variant is None else f"{element}, {variant}"
                instantiations.append(
                    f"template __global__ void {kernel}<{arguments}>({params.format(T=element, M=variant)});"
                )
    # movers.MOVER_DTYPE, the struct the host passes by value, has the C layout of layout.cu's Mover
    layout = []
    for i, pair in enumerate(("float, __half", "__half, __half", "__nv_bfloat16, __nv_bfloat16")):
        layout.append(f"using Mover{i} = Mover<{pair}>;")
        layout.append(f"static_assert(sizeof(Mover{i}) == {MOVER_DTYPE.itemsize}, \"Mover size\");")
        for name, (_, offset) in MOVER_DTYPE.fields.items():
            layout.append(f"static_assert(offsetof(Mover{i}, {name}) == {offset}, \"Mover.{name}\");")
    unit = tmp_path / "all.cu"
    unit.write_text('#include <cstddef>\n#include "layout.cu"\n#include "softmax.cu"\n#include "shared_buffer.cu"\n'
                    + "\n".join(instantiations + layout) + "\n")  # fmt: skip
    done = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", f"-I{KERNEL_DIR}", str(unit), "-o", str(tmp_path / "a.cubin")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------------------- checked geometry
def test_checked_conversions_reject_i32_and_u32_overflow():
    with pytest.raises(MhaInputError, match="past sequence length=2147483648 exceeds CUDA i32 limits"):
        checked_i32(I32_MAX + 1, "past sequence length")
    assert checked_i32(I32_MAX, "past sequence length") == I32_MAX
    with pytest.raises(MhaInputError, match="batch=-1 must be >= 0"):
        checked_i32(-1, "batch")
    too_many_blocks = (U32_MAX + 1) * LAUNCH_BLOCK
    with pytest.raises(MhaInputError, match="mask launch grid blocks"):
        checked_grid(too_many_blocks, "mask launch")
    assert checked_grid(U32_MAX * LAUNCH_BLOCK, "largest grid") == geometry.MAX_GRID_BLOCKS  # capped; grid-stride
    assert checked_grid(0, "empty") == 1


def test_checked_bytes_rejects_isize_overflow():
    with pytest.raises(MhaInputError, match="scores_BNST scratch byte size"):
        checked_bytes(2**62, 4, "scores_BNST scratch")
    assert checked_bytes(2**40, 4, "big") == 2**42


def test_host_geometry_allows_products_above_i32_when_each_int_argument_fits():
    plan = plan_launch(Geometry(batch=65_536, q_seq=2, kv_seq=65_536, past_seq=0, num_heads=2, head_size=4,
                                v_head_size=4), "float32")  # fmt: skip
    assert plan.nbytes["k_BNTH"] == 65_536 * 2 * 65_536 * 4 * 4 == 137_438_953_472
    assert plan.nbytes["scores_BNST"] > I32_MAX
    assert plan.rows == 65_536 * 2 * 2
    assert not plan.row_cache  # a 65536-key row is too long for the shared-memory cache


@pytest.mark.parametrize(
    "geometry_kwargs, message",
    [
        (dict(batch=2**16, num_heads=2**15), "GEMM batch count B\\*N=2147483648"),
        (dict(kv_seq=I32_MAX, past_seq=1), "total sequence length=2147483648"),
        (dict(head_size=I32_MAX + 1), "head_size=2147483648"),
        (dict(v_head_size=I32_MAX + 1), "v_head_size=2147483648"),
        (dict(q_seq=I32_MAX + 1), "query sequence length=2147483648"),
    ],
)
def test_plan_rejects_int_arguments_that_do_not_fit(geometry_kwargs, message):
    base = dict(batch=1, q_seq=1, kv_seq=1, past_seq=0, num_heads=1, head_size=8, v_head_size=8)
    base.update(geometry_kwargs)
    with pytest.raises(MhaInputError, match=message):
        plan_launch(Geometry(**base), "float16")


def test_plan_sizes_and_grids():
    plan = plan_launch(Geometry(batch=2, q_seq=3, kv_seq=4, past_seq=1, num_heads=2, head_size=8, v_head_size=6),
                       "bfloat16")  # fmt: skip
    assert plan.total_seq == 5 and plan.batch_heads == 4 and plan.rows == 12
    assert plan.nbytes == {
        "q_BNSH": 2 * 2 * 3 * 8 * 2,
        "k_BNTH": 2 * 2 * 5 * 8 * 2,
        "v_BNTH": 2 * 2 * 5 * 6 * 2,
        "scores_BNST": 2 * 2 * 3 * 5 * 4,
        "probs_BNST": 2 * 2 * 3 * 5 * 2,
        "context_BNSH": 2 * 2 * 3 * 6 * 4,
        "key_offset_BNT": 2 * 2 * 5 * 4,
        "query_offset_BNS": 2 * 2 * 3 * 4,
    }
    # the movers, in one launch at the VEC both head sizes allow (1: 6 % 4 != 0): a team of 8 threads per row of
    # eight 1-wide groups (Q, K), of 8 per row of six (V); the largest grid is K's, 20 rows of 8 threads
    assert plan.vec_movers == 1 and plan.grids["layout movers"] == 1
    assert [row_team(groups) for groups in (0, 1, 2, 3, 6, 16, 17, 32, 33, 59)] == [1, 1, 2, 4, 8, 16, 32, 32, 32, 32]
    assert plan.softmax_cols_per_lane == 1 and plan.grids["masked_softmax"] == 3  # 4 rows (warps) per block
    assert not plan.row_cache and plan.softmax_shared_bytes == 0
    assert (plan.vec_qk, plan.vec_v) == (4, 1)  # 8 % 4 == 0, 6 % 4 != 0
    with pytest.raises(MhaInputError, match="dtype 'float64'"):
        plan_launch(Geometry(1, 1, 1, 0, 1, 8, 8), "float64")


@pytest.mark.parametrize(
    "total, cols_per_lane, row_cache",
    [(1, 1, False), (32, 1, False), (33, 2, False), (448, 16, False), (1024, 32, False), (1025, 0, True),
     (8192, 0, True), (8193, 0, False)],
)  # fmt: skip
def test_softmax_variant_follows_the_row_length(total, cols_per_lane, row_cache):
    plan = plan_launch(Geometry(batch=2, q_seq=3, kv_seq=total, past_seq=0, num_heads=2, head_size=59,
                                v_head_size=59), "float16")  # fmt: skip
    assert plan.softmax_cols_per_lane == cols_per_lane
    assert plan.row_cache == row_cache
    assert plan.grids["masked_softmax"] == (3 if cols_per_lane else 12)
    assert plan.softmax_shared_bytes == (total * 4 if row_cache else 0)
    assert (plan.vec_qk, plan.vec_v) == (1, 1)
    # a warp per row of 59 groups; the grid of the longest operand (Q: 3 rows per head, K and V: total)
    assert plan.grids["layout movers"] == -(-2 * 2 * max(3, total) * 32 // LAUNCH_BLOCK)
