"""Scratch ownership of the cuda backend, without a GPU (port of the original's MhaScratch tests).

A fault-injecting runtime stands in for CUDA: it counts committed bytes, records every event, and fails the
allocation, upload or synchronize it is told to. This module must not import CuPy.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from mha_ep.engine.cuda.scratch import MhaScratch
from mha_ep.engine.cuda.staging import (
    ALIGNMENT,
    PinnedStaging,
    copy_in_chunks,
    copy_pairs_in_chunks,
    pack_layout,
    parallel_copy,
    stage_uploads,
)

from harness import REPO

ALLOCATIONS = 6


class InjectedFault(RuntimeError):
    pass


class FaultScratchRuntime:
    def __init__(self, fail_allocation_at: int = 0, fail_upload: bool = False, fail_synchronize: bool = False):
        self.fail_allocation_at = fail_allocation_at
        self.fail_upload = fail_upload
        self.fail_synchronize = fail_synchronize
        self.allocation_attempts = 0
        self.next_pointer = 1
        self.committed_bytes = 0
        self.live_sizes: dict[int, int] = {}
        self.free_counts: Counter = Counter()
        self.events: list[str] = []

    def allocate(self, nbytes: int) -> int:
        self.allocation_attempts += 1
        if self.allocation_attempts == self.fail_allocation_at:
            raise InjectedFault(f"injected scratch allocation failure at attempt {self.allocation_attempts}")
        pointer = self.next_pointer
        self.next_pointer += 1
        self.live_sizes[pointer] = nbytes
        self.committed_bytes += nbytes
        self.events.append("allocate")
        return pointer

    def free(self, allocation: int) -> None:
        assert allocation in self.live_sizes, "free must name a live scratch allocation"
        self.committed_bytes -= self.live_sizes.pop(allocation)
        self.free_counts[allocation] += 1
        self.events.append("free")

    def address(self, allocation: int) -> int:
        return allocation * 4096

    def upload(self, src, nbytes: int, dst_address: int) -> None:
        if self.fail_upload:
            raise InjectedFault("injected H2D failure")
        self.events.append("upload")

    def synchronize(self) -> None:
        self.events.append("synchronize")
        if self.fail_synchronize:
            raise InjectedFault("injected synchronize failure")

    def assert_cleaned_once(self, successful_allocations: int) -> None:
        assert self.committed_bytes == 0, "committed scratch bytes must return to the baseline"
        assert not self.live_sizes, "no scratch allocation may remain live"
        assert len(self.free_counts) == successful_allocations
        assert all(count == 1 for count in self.free_counts.values()), (
            f"every allocation must be freed exactly once: {dict(self.free_counts)}"
        )


@pytest.mark.parametrize("failed_attempt", range(2, ALLOCATIONS + 1))
def test_scratch_returns_committed_bytes_after_each_late_allocation_failure(failed_attempt):
    runtime = FaultScratchRuntime(fail_allocation_at=failed_attempt)
    with pytest.raises(InjectedFault, match=f"attempt {failed_attempt}"):
        with MhaScratch(runtime) as scratch:
            for _ in range(ALLOCATIONS):
                scratch.allocate(64)
    runtime.assert_cleaned_once(failed_attempt - 1)
    assert "synchronize" not in runtime.events, "nothing was submitted, so nothing needs waiting for"


def test_scratch_returns_committed_bytes_after_h2d_failure():
    runtime = FaultScratchRuntime(fail_upload=True)
    with pytest.raises(InjectedFault, match="H2D"):
        with MhaScratch(runtime) as scratch:
            addresses = [scratch.allocate(64) for _ in range(ALLOCATIONS)]
            scratch.upload(np.zeros(64, np.uint8), 64, addresses[-1])
    runtime.assert_cleaned_once(ALLOCATIONS)
    # the upload was (being) submitted: the stream is waited for before the first free
    assert runtime.events == ["allocate"] * ALLOCATIONS + ["synchronize"] + ["free"] * ALLOCATIONS


def test_scratch_is_exception_safe_and_orders_stream_completion_before_free():
    runtime = FaultScratchRuntime()
    with pytest.raises(InjectedFault, match="after stream submission"):
        with MhaScratch(runtime) as scratch:
            scratch.allocate(64)
            scratch.mark_stream_use()
            raise InjectedFault("injected exception after stream submission")
    runtime.assert_cleaned_once(1)
    assert runtime.events == ["allocate", "synchronize", "free"]


def test_scratch_success_path_synchronizes_once_then_frees_newest_first():
    runtime = FaultScratchRuntime()
    with MhaScratch(runtime) as scratch:
        first = scratch.allocate(64)
        second = scratch.allocate(32)
        scratch.mark_stream_use()
        scratch.finish_stream_use()
        assert scratch.live_allocations == 2
    runtime.assert_cleaned_once(2)
    assert runtime.events == ["allocate", "allocate", "synchronize", "free", "free"]
    assert (first, second) == (4096, 8192)


def test_scratch_release_is_idempotent_and_frees_despite_a_failed_synchronize():
    runtime = FaultScratchRuntime(fail_synchronize=True)
    scratch = MhaScratch(runtime)
    scratch.allocate(64)
    scratch.allocate(64)
    scratch.mark_stream_use()
    with pytest.raises(InjectedFault, match="synchronize"):
        scratch.release()
    runtime.assert_cleaned_once(2)
    scratch.release()  # nothing left: no second free, no second synchronize
    assert runtime.events.count("free") == 2
    assert runtime.events.count("synchronize") == 1


def test_exception_in_body_wins_over_a_failed_release():
    runtime = FaultScratchRuntime(fail_synchronize=True)
    with pytest.raises(KeyError):
        with MhaScratch(runtime) as scratch:
            scratch.allocate(64)
            scratch.mark_stream_use()
            raise KeyError("the caller's error")
    runtime.assert_cleaned_once(1)


def test_zero_byte_allocations_still_get_one_byte():
    runtime = FaultScratchRuntime()
    with MhaScratch(runtime) as scratch:
        scratch.allocate(0)
        assert runtime.committed_bytes == 1
    runtime.assert_cleaned_once(1)


def test_pack_layout_aligns_every_segment_and_keeps_order():
    segments, total = pack_layout(
        [("query", np.float32, (2, 3, 5)), ("empty_past", np.float32, (2, 1, 0, 4)), ("mask", np.uint8, (2, 7))]
    )
    assert [s.offset % ALIGNMENT for s in segments.values()] == [0, 0, 0]
    assert segments["query"].nbytes == 120
    assert segments["empty_past"].nbytes == 0
    assert segments["mask"].offset >= segments["query"].offset + 120
    assert total >= segments["mask"].offset + 14 and total % ALIGNMENT == 0


class FakePinned(bytearray):
    ptr = 0x1000


def test_pinned_staging_only_grows():
    sizes = []

    def allocate(nbytes):
        sizes.append(nbytes)
        return FakePinned(nbytes)

    staging = PinnedStaging(allocate)
    staging.ensure(10)
    first = staging.capacity
    staging.ensure(first)  # fits: no new allocation
    staging.ensure(5)
    assert sizes == [first]
    staging.ensure(first + 1)
    assert len(sizes) == 2 and staging.capacity >= first + 1
    segments, _ = pack_layout([("x", np.float32, (3,))])
    staging.view(segments["x"])[:] = [1, 2, 3]
    assert staging.ensure(1)[:12].view(np.float32).tolist() == [1.0, 2.0, 3.0]


def test_cpu_modules_do_not_import_cupy():
    code = (
        "import sys; import mha_ep.engine.cuda.scratch, mha_ep.engine.cuda.staging, "
        "mha_ep.engine.cuda.geometry, mha_ep.engine.cuda.dispatch, mha_ep.engine.cuda, "
        "mha_ep.engine.cuda.steps, mha_ep.engine.cuda.runner; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("threads", [0, 3])
def test_copy_in_chunks_yields_each_chunk_in_order_once_copied(threads):
    executor = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    src = np.random.default_rng(0).standard_normal((3, 1000, 70)).astype(np.float32)
    dst = np.full(src.shape, np.nan, np.float32)
    seen = []
    for offset, nbytes in copy_in_chunks(dst, src, executor, chunk_bytes=100_000):
        flat = dst.reshape(-1).view(np.uint8)[offset : offset + nbytes]
        assert np.array_equal(flat, src.reshape(-1).view(np.uint8)[offset : offset + nbytes])
        seen.append((offset, nbytes))
    assert seen[0][0] == 0 and sum(n for _, n in seen) == src.nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(seen, seen[1:]))
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("threads", [0, 4])
def test_copy_pairs_in_chunks_copies_every_pair_and_yields_its_chunks_in_order(threads):
    """All pairs' chunks go to the threads at once; each chunk is reported once, complete, pair by pair."""
    executor = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    rng = np.random.default_rng(1)
    sources = [rng.standard_normal(shape).astype(np.float32) for shape in ((2, 300, 50), (7,), (1000, 33))]
    pairs = [(np.full(src.shape, np.nan, np.float32), src) for src in sources]
    seen = {index: [] for index in range(len(pairs))}
    order = []
    for index, offset, nbytes in copy_pairs_in_chunks(pairs, executor, chunk_bytes=16_000):
        dst, src = pairs[index]
        assert np.array_equal(dst.reshape(-1).view(np.uint8)[offset : offset + nbytes],
                              src.reshape(-1).view(np.uint8)[offset : offset + nbytes])  # fmt: skip
        seen[index].append((offset, nbytes))
        order.append(index)
    assert order == sorted(order)
    for index, (dst, src) in enumerate(pairs):
        chunks = seen[index]
        assert chunks[0][0] == 0 and sum(n for _, n in chunks) == src.nbytes
        assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
        np.testing.assert_array_equal(dst, src)


def test_copy_in_chunks_waits_for_every_copy_when_closed_early():
    executor = concurrent.futures.ThreadPoolExecutor(4)
    src = np.ones(1_000_000, np.float32)
    dst = np.zeros_like(src)
    chunks = copy_in_chunks(dst, src, executor, chunk_bytes=40_000)
    next(chunks)
    chunks.close()  # the caller stops (an upload failed): no copy may still be running afterwards
    snapshot = dst.copy()
    executor.shutdown(wait=True)
    np.testing.assert_array_equal(dst, snapshot)


def test_copy_casts_float64_and_refuses_strided_destinations():
    dst = np.empty((4, 5), np.float32)
    parallel_copy(dst, np.arange(20, dtype=np.float64).reshape(4, 5))
    assert dst[3, 4] == 19.0
    with pytest.raises(ValueError, match="C-contiguous"):
        list(copy_in_chunks(np.empty((5, 4), np.float32).T, dst))


@pytest.mark.parametrize("one_block", [True, False])
@pytest.mark.parametrize("threads", [0, 3])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("sizes", [[(3,), (5, 7), (0,)], [(300_000,), (2, 400_000), (0, 4), (17,)]])
def test_stage_uploads_moves_every_byte_to_its_destination(sizes, scattered, threads, one_block):
    """The one upload of the bridge and of a GPU session's lanes: small calls laid out like the segments in one device
    allocation go up in one copy, anything else chunk by chunk (destinations that merely lie side by side may be
    two allocations, which one copy cannot span); every byte of every array reaches its own destination, casts
    included."""
    from mha_ep.engine.cuda import staging as staging_module

    executor = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in sizes] + [np.arange(5, dtype=np.int64)]
    segments, total = pack_layout([(str(i), np.int32 if a.dtype == np.int64 else a.dtype, a.shape)
                                   for i, a in enumerate(arrays)])  # fmt: skip
    segments = list(segments.values())
    pinned = PinnedStaging(lambda n: FakePinned(n))
    pinned.ensure(total)
    base = 1 << 32  # fake device addresses; scattered: each array somewhere else
    destinations = [base + (i * (1 << 24) if scattered else seg.offset) for i, seg in enumerate(segments)]
    uploads = []
    stage_uploads(pinned, segments, arrays, destinations, lambda src, n, dst: uploads.append((src, n, dst)), executor,
                  one_block)  # fmt: skip
    raw = pinned.ensure(1)
    device = np.zeros(max(destinations) - base + total, np.uint8)  # the fake device memory the copies land in
    for src, n, dst in uploads:
        device[dst - base : dst - base + n] = raw[src - FakePinned.ptr : src - FakePinned.ptr + n]
    small = total <= staging_module.SINGLE_UPLOAD_BYTES and not scattered and one_block
    assert (len(uploads) == 1) == small
    for array, segment, dst in zip(arrays, segments, destinations):
        expected = array.astype(segment.dtype).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(device[dst - base : dst - base + segment.nbytes], expected)
