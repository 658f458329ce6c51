"""replay.py's rules without a GPU: which call shapes are captured, how many are kept, and what the key holds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mha_ep.engine.cuda.replay import ReplayCache, replay_key

from cuda_cases import Case, make_problem


def entries_of(problem):
    """backend.input_entries without importing the backend (which needs CuPy): (name, dtype, shape, array)."""
    names = ("query_BSD", "key", "value", "bias_q", "bias_k", "bias_v", "attention_bias")
    arrays = [(name, getattr(problem, name)) for name in names if getattr(problem, name) is not None]
    return [(name, np.dtype(np.float32), a.shape, a) for name, a in arrays]


def test_a_shape_is_captured_on_its_second_sighting_only():
    cache = ReplayCache(release=lambda entry: None)
    assert not cache.should_capture("a")
    assert cache.should_capture("a")
    cache.add("a", "entry-a")
    assert cache.lookup("a") == "entry-a" and cache.lookup("b") is None
    assert (cache.captured, cache.replayed) == (1, 1)


def test_a_failed_capture_is_not_retried():
    cache = ReplayCache(release=lambda entry: None)
    cache.should_capture("a")
    cache.refuse("a")
    assert not cache.should_capture("a") and not cache.should_capture("a")


def test_the_least_recently_used_entry_is_released_exactly_once():
    released = []
    cache = ReplayCache(release=released.append, entries=2)
    cache.add("a", "A")
    cache.add("b", "B")
    cache.lookup("a")  # b is now the least recently used
    cache.add("c", "C")
    assert released == ["B"] and len(cache) == 2
    cache.discard("a")
    cache.discard("a")
    cache.clear()
    assert released == ["B", "A", "C"] and len(cache) == 0


def test_shapes_seen_once_are_forgotten_beyond_the_limit():
    cache = ReplayCache(release=lambda entry: None, seen=3)
    for key in "abcd":
        assert not cache.should_capture(key)
    assert not cache.should_capture("a")  # pushed out by d: a first sighting again
    assert cache.should_capture("d")


def test_the_key_ignores_contents_and_holds_every_launch_parameter():
    problem = make_problem(Case(b=2, s=5, l=7, n=2, h=16, attention_bias=(True, False)), "float16")
    other_contents = make_problem(replace(Case(b=2, s=5, l=7, n=2, h=16, attention_bias=(True, False)), seed=9),
                                  "float16")  # fmt: skip
    key = replay_key(problem, entries_of(problem))
    assert key == replay_key(other_contents, entries_of(other_contents))
    for changed in (replace(problem, scale=0.5), replace(problem, mask_filter_value=-1.0),
                    replace(problem, causal=not problem.causal), replace(problem, dtype="bfloat16"),
                    replace(problem, want_present_key=True), replace(problem, want_qk=True)):  # fmt: skip
        assert replay_key(changed, entries_of(changed)) != key
    # every flag of the problem is a launch parameter: a new one must reach the key (want_qk once did not)
    import dataclasses

    for field in dataclasses.fields(problem):
        if isinstance(getattr(problem, field.name), bool):
            flipped = replace(problem, **{field.name: not getattr(problem, field.name)})
            assert replay_key(flipped, entries_of(flipped)) != key, field.name
    wider = make_problem(Case(b=2, s=5, l=8, n=2, h=16, attention_bias=(True, False)), "float16")
    assert replay_key(wider, entries_of(wider)) != key
    assert replay_key(replace(problem, mask_filter_value=float("nan")), entries_of(problem)) is None
