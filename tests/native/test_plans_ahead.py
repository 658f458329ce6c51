"""Plans made ahead (mha_ep/native/ahead.py), on any machine: which signatures a growing past leads to, the key the
library looks them up with, plans added to its cache, and the worker: it plans the successors of a miss with the
planner, leaves a plan whose kernel ORT's thread has not loaded, keeps its errors to itself and adds nothing made
before a reset. The GPU side (a plain decode loop that then misses once in plans_ahead + 1 steps, bit for bit the
same outputs) is tests/native/test_native_cuda.py's."""

from __future__ import annotations

import struct
import threading

import pytest

from mha_ep import native
from mha_ep.engine.cuda.fused import DeviceFacts
from mha_ep.native import ahead, gpu
from mha_ep.native import plan as native_plan

from mha_models import MhaConfig, with_
from native_cases import library, signature_of

FACTS = DeviceFacts("90", 132)
DECODE = MhaConfig(dtype="float16", batch=2, q_seq=1, kv_seq=1, num_heads=4, head_size=64, bias=True, has_past=True,
                   past_seq=7, presents=True)  # fmt: skip


def inputs_of(config: MhaConfig):
    kernel, signature = signature_of(config)
    return kernel, signature.inputs


def slot(name: str) -> int:
    return ahead.SLOT[name]


# ----------------------------------------------------------------------------------------------- successors
def test_a_growing_past_leads_to_the_next_steps_signatures_and_nothing_else_changes():
    kernel, inputs = inputs_of(DECODE)
    later = ahead.successors(kernel.supplied, inputs, 3)
    assert len(later) == 3
    for step, grown in enumerate(later, start=1):
        for i, (was, now) in enumerate(zip(inputs, grown)):
            if i in (slot("past_key"), slot("past_value")):
                assert now[1] == (2, 4, 7 + step, 64) and now[0] == was[0] and now[2] == was[2]
            else:
                assert now == was, (i, was, now)
    # they are the signatures the same node has at those past lengths
    for step, grown in enumerate(later, start=1):
        assert grown == inputs_of(with_(DECODE, past_seq=7 + step))[1]


@pytest.mark.parametrize("mask", ["2d", "3d"])
def test_a_mask_over_the_total_length_grows_with_the_past(mask):
    config = with_(DECODE, mask=mask)
    kernel, inputs = inputs_of(config)
    later = ahead.successors(kernel.supplied, inputs, 2)
    assert later == [inputs_of(with_(config, past_seq=p))[1] for p in (8, 9)]


def test_an_attention_bias_over_the_total_length_grows_with_the_past():
    config = with_(DECODE, attention_bias="1N")
    kernel, inputs = inputs_of(config)
    assert ahead.successors(kernel.supplied, inputs, 1) == [inputs_of(with_(config, past_seq=8))[1]]


def test_several_key_rows_a_call_grow_the_past_by_as_many():
    config = with_(DECODE, q_seq=3, kv_seq=3)
    kernel, inputs = inputs_of(config)
    assert ahead.successors(kernel.supplied, inputs, 2) == [inputs_of(with_(config, past_seq=10))[1],
                                                            inputs_of(with_(config, past_seq=13))[1]]


@pytest.mark.parametrize("config", [
    MhaConfig(dtype="float16", bias=True),  # no past
    with_(DECODE, max_seq=16),  # a shared buffer: its shape never changes
    MhaConfig(dtype="float16", q_seq=1, kv_seq=300, kv_layout="BNSH", bias=True),  # cross attention, no past
], ids=["no past", "shared buffer", "cross"])  # fmt: skip
def test_no_successors_where_nothing_grows(config):
    kernel, inputs = inputs_of(config)
    assert ahead.successors(kernel.supplied, inputs, 4) == []


def test_no_successors_when_none_are_asked_for():
    kernel, inputs = inputs_of(DECODE)
    assert ahead.successors(kernel.supplied, inputs, 0) == []


# -------------------------------------------------------------------------------------------- the library
def test_the_signature_key_is_the_layout_compute_cuda_keys_calls_with():
    lib = library()
    kernel, inputs = inputs_of(with_(DECODE, mask="2d"))
    words = [5, 1, 1]  # config, device, flags
    for i, entry in enumerate(inputs):
        if entry is not None:
            words += [i, entry[0], len(entry[1]), *entry[1], entry[2]]
    key = lib.signature_key(5, 1, 1, inputs)
    assert struct.unpack(f"<{len(key) // 8}q", key) == tuple(words)
    with pytest.raises(ValueError, match="tuple of 10 slots"):
        lib.signature_key(5, 1, 1, inputs[:9])
    with pytest.raises(ValueError, match="rank 9, more than 8"):
        lib.signature_key(5, 1, 1, ((10, (1,) * 9, 8),) + inputs[1:])


def encoded(kernel, inputs) -> bytes:
    handles = {}
    plan = native_plan.plan_steps(kernel, native_plan.Signature(inputs), FACTS)
    return native_plan.encode_plan(plan, lambda launch: handles.setdefault(launch.function, len(handles) + 1))


def test_a_plan_added_ahead_is_held_once_and_counted_and_a_reset_forgets_it():
    lib = library()
    native.reset_plans()
    kernel, inputs = inputs_of(DECODE)
    key = lib.signature_key(3, 0, 0, inputs)
    before = native.stats()
    assert not lib.has_plan(key)
    assert lib.add_plan(key, encoded(kernel, inputs)) is True
    assert lib.has_plan(key)
    assert lib.add_plan(key, encoded(kernel, inputs)) is False  # the one there stays
    after = native.stats()
    assert after["plans"] == before["plans"] + 1 and after["ahead"] == before["ahead"] + 1
    assert after["ahead_used"] == before["ahead_used"]  # used only by a call (the GPU test)
    native.reset_plans()
    assert not lib.has_plan(key)


def test_a_malformed_plan_or_key_is_refused_and_nothing_is_added():
    lib = library()
    native.reset_plans()
    kernel, inputs = inputs_of(DECODE)
    key = lib.signature_key(3, 0, 0, inputs)
    good = encoded(kernel, inputs)
    with pytest.raises(ValueError, match="mha_ep native plan"):
        lib.add_plan(key, good[:-8])
    with pytest.raises(ValueError, match="whole number of 8-byte words"):
        lib.add_plan(key, good[:-3])
    with pytest.raises(ValueError, match="plan key is 1 to"):
        lib.add_plan(key[:-3], good)
    with pytest.raises(ValueError, match="plan key is 1 to"):
        lib.has_plan(b"")
    assert not lib.has_plan(key) and native.stats()["plans"] == 0


# ------------------------------------------------------------------------------------------------ the worker
def make_for(kernel, loaded=None):
    """The planner as gpu.plan_call hands it to the worker, on a CPU machine: the kernels resolved through
    ``loaded`` (an ahead.Handles; None: every kernel loaded)."""
    handles = {}

    def resolve(launch):
        return loaded.loaded(0, launch) if loaded is not None else handles.setdefault(launch.function, len(handles) + 1)

    def make(inputs):
        return native_plan.encode_plan(native_plan.plan_steps(kernel, native_plan.Signature(inputs), FACTS), resolve)

    return make


def request_for(worker, kernel, inputs, count, make, config_id=3):
    later = tuple(ahead.successors(kernel.supplied, inputs, count))
    worker.request(library(), ahead.Request(config_id, 0, 0, later, make, worker.generation))
    return later


def test_the_worker_plans_the_successors_of_a_miss_and_skips_those_held():
    lib = library()
    native.reset_plans()
    worker = ahead.Ahead()
    kernel, inputs = inputs_of(DECODE)
    first = ahead.successors(kernel.supplied, inputs, 1)[0]
    lib.add_plan(lib.signature_key(3, 0, 0, first), encoded(kernel, first))
    later = request_for(worker, kernel, inputs, 5, make_for(kernel))
    worker.wait()
    assert all(lib.has_plan(lib.signature_key(3, 0, 0, grown)) for grown in later)
    counts = worker.stats()
    assert (counts["planned"], counts["present"], counts["failed"]) == (4, 1, 0), counts
    assert native.stats()["plans"] == 5
    native.reset_plans()


def test_a_plan_whose_kernel_ort_s_thread_has_not_loaded_is_left_to_its_miss():
    lib = library()
    native.reset_plans()
    worker = ahead.Ahead()
    kernel, inputs = inputs_of(DECODE)
    handles = ahead.Handles(48 * 1024)  # nothing loaded
    later = request_for(worker, kernel, inputs, 3, make_for(kernel, handles))
    worker.wait()
    assert not any(lib.has_plan(lib.signature_key(3, 0, 0, grown)) for grown in later)
    assert worker.stats()["not_loaded"] == 1 and worker.stats()["planned"] == 0
    # once ORT's thread has loaded every kernel of the call's plan, the same request plans them all
    plan = native_plan.plan_steps(kernel, native_plan.Signature(inputs), FACTS)
    for step in plan.steps:
        if isinstance(step, native_plan.Launch):
            handles.remember(0, step, 1000 + len(step.function))
    request_for(worker, kernel, inputs, 3, make_for(kernel, handles))
    worker.wait()
    assert all(lib.has_plan(lib.signature_key(3, 0, 0, grown)) for grown in later)
    native.reset_plans()


def test_handles_remember_the_shared_memory_a_kernel_was_given():
    handles = ahead.Handles(48 * 1024)
    small = native_plan.Launch("k<1>", (1, 1, 1), (32, 1, 1), 1024, (), fused=True)
    large = native_plan.Launch("k<1>", (1, 1, 1), (32, 1, 1), 100 * 1024, (), fused=True)
    handles.remember(0, small, 7)
    assert handles.loaded(0, small) == 7
    with pytest.raises(ahead.NotLoaded):
        handles.loaded(0, large)  # its limit was never raised that far
    with pytest.raises(ahead.NotLoaded):
        handles.loaded(1, small)  # another device
    handles.remember(0, large, 7)
    assert handles.loaded(0, large) == 7 and handles.loaded(0, small) == 7


def test_the_worker_keeps_its_errors_and_goes_on_with_the_next_request():
    lib = library()
    native.reset_plans()
    worker = ahead.Ahead()
    kernel, inputs = inputs_of(DECODE)

    def broken(inputs):
        raise RuntimeError("a planner bug")

    request_for(worker, kernel, inputs, 2, broken)
    later = request_for(worker, kernel, inputs, 2, make_for(kernel))
    worker.wait()
    counts = worker.stats()
    assert counts["failed"] == 1 and counts["planned"] == 2 and "a planner bug" in counts["last_error"]
    assert all(lib.has_plan(lib.signature_key(3, 0, 0, grown)) for grown in later)
    native.reset_plans()


def test_a_plan_made_before_a_reset_is_not_added_after_it():
    lib = library()
    native.reset_plans()
    worker = ahead.Ahead()
    kernel, inputs = inputs_of(DECODE)
    planning, release = threading.Event(), threading.Event()
    real = make_for(kernel)

    def held(inputs):
        planning.set()
        assert release.wait(60), "the test never released the worker"
        return real(inputs)

    later = request_for(worker, kernel, inputs, 2, held)
    assert planning.wait(60), "the worker never started"
    worker.reset(lib.clear_plans)  # settings changed while the worker was planning
    release.set()
    worker.wait()
    assert not any(lib.has_plan(lib.signature_key(3, 0, 0, grown)) for grown in later)
    assert worker.stats()["stale"] == 1 and worker.stats()["planned"] == 0


def test_plan_call_s_hook_asks_only_for_a_growing_past_and_never_raises(monkeypatch):
    lib = library()
    native.reset_plans()
    worker = ahead.Ahead()
    monkeypatch.setattr(ahead, "AHEAD", worker)
    monkeypatch.setattr(native.settings, "plans_ahead", 4)
    kernel, inputs = inputs_of(DECODE)
    gpu.plan_ahead(3, 0, 0, inputs, kernel.supplied, make_for(kernel))
    cross_kernel, cross = inputs_of(MhaConfig(dtype="float16", q_seq=1, kv_seq=300, kv_layout="BNSH", bias=True))
    gpu.plan_ahead(4, 0, 0, cross, cross_kernel.supplied, make_for(cross_kernel))
    gpu.plan_ahead(3, 0, 0, ("not", "inputs"), kernel.supplied, make_for(kernel))  # a bad guess: no exception
    worker.wait()
    assert worker.stats()["requests"] == 1 and worker.stats()["planned"] == 4
    assert native.stats()["plans"] == 4
    monkeypatch.setattr(native.settings, "plans_ahead", 0)
    gpu.plan_ahead(3, 0, 0, inputs, kernel.supplied, make_for(kernel))
    assert worker.stats()["requests"] == 1
    native.reset_plans()
