"""gpu_session/transfer.py on a GPU: a lane's uploads keep the caller's memory and the staging buffer guarded, even when
a call fails halfway through its copies (the ``gpu`` marker; skipped without CuPy and a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

GATE = r"""extern "C" __global__ void gate(volatile int* flag) { while (*flag == 0) {} }"""


def test_an_upload_that_fails_halfway_still_guards_what_its_queued_copies_read(cupy_module):
    """A stream held shut by a kernel that spins until the host opens a gate; an upload of a page-locked feed (a
    direct DMA) and two pageable ones (through the staging buffer), whose third DMA fails. The two DMAs queued
    before the failure still read the caller's page-locked array and the staging buffer once the gate opens, so
    both events must be recorded behind them: ``settle`` and the next call's wait for the buffer then cover them.
    Unrecorded, an event reads as complete at once."""
    cupy = cupy_module
    from mha_ep.gpu_session.transfer import HostTransfers

    rng = np.random.default_rng(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    transfers = HostTransfers(stream, 0)
    pinned_memory = cupy.cuda.alloc_pinned_memory(4096 * 4)
    pinned = np.frombuffer(pinned_memory, np.float32, 4096)
    pinned[:] = rng.standard_normal(4096)
    pageable = [rng.standard_normal(1024).astype(np.float32) for _ in range(2)]
    targets = [cupy.full(a.size, np.nan, np.float32) for a in (pinned, *pageable)]
    cupy.cuda.Device().synchronize()  # the fills ran on the legacy stream, which ``stream`` does not wait for
    real_dma, done = transfers._dma, []

    def dma(src, nbytes, dst):  # the third DMA of the call fails
        if len(done) == 2:
            raise RuntimeError("a DMA that fails")
        done.append(dst)
        real_dma(src, nbytes, dst)

    transfers._dma = dma
    flag_memory = cupy.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(flag_memory, np.int32, 1)
    flag[0] = 0
    with stream:  # a RawKernel launches on the current stream
        cupy.RawKernel(GATE, "gate")((1,), (1,), (flag_memory.ptr,))
    try:
        with pytest.raises(RuntimeError, match="a DMA that fails"):
            transfers.upload([pinned, *pageable], [t.data.ptr for t in targets])
        assert done == [targets[0].data.ptr, targets[1].data.ptr]
        assert not transfers._direct_done.done, "settle would not wait for the direct DMA the failed call queued"
        assert not transfers._staging_free.done, "the next call would write the staging buffer under a DMA"
    finally:
        flag[0] = 1
        stream.synchronize()
    transfers.settle()
    np.testing.assert_array_equal(cupy.asnumpy(targets[0]), pinned)
    np.testing.assert_array_equal(cupy.asnumpy(targets[1]), pageable[0])
    assert np.isnan(cupy.asnumpy(targets[2])).all()
