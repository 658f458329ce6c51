"""gpu_session/segments.py: several device-to-device copies in one launch of kernels/copy_segments.cu.

On any machine: the table the host writes is the kernel's ``struct Segments`` byte for byte, and the grid's size.
On a GPU (the ``gpu`` marker): every byte of every segment lands, aligned or not, 1 byte to megabytes, over more
than one launch's worth of segments, and nothing outside them is written (destinations poisoned first).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from mha_ep.gpu_session import segments
from mha_ep.engine.cuda.kernels import KERNEL_DIR


def test_the_host_table_is_the_kernels_struct():
    source = (KERNEL_DIR / "copy_segments.cu").read_text()
    (maximum,) = re.findall(r"#define MAX_SEGMENTS (\d+)", source)
    assert int(maximum) == segments.MAX_SEGMENTS
    fields = re.findall(r"unsigned long long (\w+)\[MAX_SEGMENTS\];", source)
    assert fields == list(segments.LAYOUT.names) == ["src", "dst", "bytes"]
    assert segments.LAYOUT.itemsize == 3 * 8 * segments.MAX_SEGMENTS  # no padding: three arrays of 64-bit words
    assert [segments.LAYOUT.fields[name][1] for name in fields] == [0, 128, 256]


def test_the_grid_grows_with_the_longest_segment_and_is_bounded():
    assert segments.blocks_for([256, 768]) == 1
    assert segments.blocks_for([segments.BYTES_PER_BLOCK + 1]) == 2
    assert segments.blocks_for([1 << 40]) == segments.MAX_BLOCKS
    assert segments.blocks_for([]) == 1


def test_a_segment_of_no_bytes_is_refused_and_so_is_a_set_with_no_side_or_both_fixed():
    with pytest.raises(ValueError, match="every length must be positive"):
        segments.SegmentCopies(object(), [16, 0], sources=[1, 2])
    for sides in ({}, {"sources": [1], "destinations": [2]}):
        with pytest.raises(ValueError, match="give either destinations or sources"):
            segments.SegmentCopies(object(), [16], **sides)


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False], ids=["native launch", "cupy launch"])
def test_every_byte_lands_aligned_or_not_over_several_launches(cupy_module, native):
    cupy = cupy_module
    rng = np.random.default_rng(11)
    # lengths and offsets: aligned words, odd tails, single bytes, a large one, more than MAX_SEGMENTS of them
    lengths = [1, 15, 16, 17, 255, 256, 4096, 4099, 3 << 20, 7, 64, 1000] * 2
    offsets = [0, 1, 3, 16, 8, 0, 5, 16, 0, 2, 9, 0] * 2
    assert len(lengths) > segments.MAX_SEGMENTS
    stream = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(0):
        kernel = segments.copy_function(0)
    assert kernel.native is not None, "on a GPU the native library's launch_copies launches the kernel"
    if not native:
        kernel = dataclasses.replace(kernel, native=None)
    sources = [cupy.asarray(rng.integers(0, 256, n + off, dtype=np.uint8)) for n, off in zip(lengths, offsets)]
    targets = [cupy.full(n + 2 * off + 32, 0xA5, np.uint8) for n, off in zip(lengths, offsets)]
    cupy.cuda.Device().synchronize()
    copies = segments.SegmentCopies(kernel, lengths,
                                    destinations=[t.data.ptr + 16 + off for t, off in zip(targets, offsets)])
    copies.launch(stream, [s.data.ptr + off for s, off in zip(sources, offsets)])
    stream.synchronize()
    for index, (n, off) in enumerate(zip(lengths, offsets)):
        got = cupy.asnumpy(targets[index])
        want = cupy.asnumpy(sources[index])[off:off + n]
        assert (got[16 + off:16 + off + n] == want).all(), f"segment {index} ({n} bytes at offset {off})"
        assert (got[:16 + off] == 0xA5).all() and (got[16 + off + n:] == 0xA5).all(), f"segment {index} spilled"
    # the same copies again with other sources, given as arrays (their .data.ptr), written on another stream that
    # the copies wait for (an event), and read on a third that waits for the copies: the table is rewritten per call
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with writer:
        again = [cupy.asarray(rng.integers(0, 256, n, dtype=np.uint8)) for n in lengths]
    fed, copied = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
    copies.launch(stream, again, wait=(fed, writer), signal=(copied, reader))
    with reader:
        landed = [targets[index][16 + off:16 + off + n].copy() for index, (n, off) in enumerate(zip(lengths, offsets))]
    reader.synchronize()
    for index, array in enumerate(again):
        assert (cupy.asnumpy(landed[index]) == cupy.asnumpy(array)).all(), index


def test_the_native_launch_refuses_what_is_not_a_copy_launch_before_touching_the_driver():
    """_native.launch_copies checks its arguments before the CUDA driver is loaded (so on any machine): the count,
    the table's column, the addresses (ints or objects with .data.ptr)."""
    from mha_ep import native

    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    launch = native.library().launch_copies
    table = np.zeros(1, segments.LAYOUT)
    base = table.ctypes.data
    good = (0, 0x1234, 1, 2, segments.THREADS, base, base + 128, 0)
    with pytest.raises(TypeError, match="takes 13 arguments"):
        launch(*good)
    with pytest.raises(ValueError, match="3 addresses for a launch of 2 segments"):
        launch(*good, [1, 2, 3], 0, 0, 0, 0)
    with pytest.raises(ValueError, match="not a copy launch"):
        launch(0, 0x1234, 1, 2, segments.THREADS, base, base + segments.LAYOUT.itemsize, 0, [1], 0, 0, 0, 0)
    with pytest.raises(ValueError, match="not a copy launch"):
        launch(0, 0x1234, 1, segments.MAX_SEGMENTS + 1, segments.THREADS, base, base, 0, [1], 0, 0, 0, 0)
    with pytest.raises(ValueError, match="run past the table's end"):
        launch(0, 0x1234, 1, 2, segments.THREADS, base, base + segments.LAYOUT.itemsize - 8, 0, [1, 2], 0, 0, 0, 0)
    with pytest.raises(AttributeError, match="data"):
        launch(*good, [1, object()], 0, 0, 0, 0)
    with pytest.raises(OverflowError):
        launch(*good, [1, -1], 0, 0, 0, 0)
    assert not table["dst"].any(), "a refused launch writes nothing into the table"


@pytest.mark.parametrize("mode", ["segments", "segments cupy launch"], ids=["native launch", "cupy launch"])
def test_more_copies_than_one_launch_takes_go_in_launches_of_max_segments_each(mode):
    """Over the stand-in CuPy (tests/support/recording_cupy.py reads each launch's table): 20 copies are two launches, of
    16 and 4, every destination and length written once and the sources of each call in place."""
    from test_replay_protocol import calls_of

    log = calls_of(mode)["log"]
    assert [(entry[0], len(entry[1]), entry[2]) for entry in log] == [("launch copy_segments", 16, "copies"),
                                                                      ("launch copy_segments", 4, "copies")] * 2
    tables = [row for entry in log for row in entry[1]]
    expected = [[1000 * i, base * 100000 + i, 16 * (i + 1)] for base in (7, 9) for i in range(20)]
    assert tables == expected
