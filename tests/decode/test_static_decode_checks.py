"""The static decode loops refuse a request they cannot serve before anything runs (mha_ep/decode/static_decode.py:
check_decode_request and the shape checks of greedy_static, beam_static and load_prompt), on any machine: the
checks read shapes only, and a refused call never reaches CuPy (here a stand-in decoder, and no CuPy at all)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mha_ep.errors import MhaInputError
from mha_ep.decode.static_decode import SelfCache, StaticDecoder, beam_static, greedy_static

ROWS, MAX_LENGTH = 4, 16


def decoder(beams: int = 0):
    caches = [SelfCache("past_key_self_0", "present_key_self_0", np.zeros((ROWS, 2, MAX_LENGTH, 8), np.float32))]
    return SimpleNamespace(rows=ROWS, batch=ROWS // max(beams, 1), beams=beams, max_length=MAX_LENGTH, caches=caches,
                           device_id=0)  # fmt: skip


@pytest.mark.parametrize("prompt, steps, words", [
    (MAX_LENGTH, 4, f"a prompt of {MAX_LENGTH} positions does not fit the static cache of max_length {MAX_LENGTH}"),
    (MAX_LENGTH + 5, 4, "rewrite the decoder with a larger static-cache --max-length"),
    (-1, 4, "a prompt of -1 positions"),
    (3, 0, "steps must be a whole number >= 1, got 0"),
    (3, 2.5, "steps must be a whole number >= 1, got 2.5"),
    (3, MAX_LENGTH - 2, f"{MAX_LENGTH - 2} steps after a prompt of 3 positions need {MAX_LENGTH + 1} cache rows; the "
                        f"decoder's buffers hold max_length {MAX_LENGTH}: ask for at most {MAX_LENGTH - 3} steps"),
])  # fmt: skip
def test_greedy_refuses_a_request_the_cache_cannot_serve(prompt, steps, words):
    with pytest.raises(MhaInputError) as caught:
        greedy_static(decoder(), np.zeros((ROWS, 1), np.int64), prompt, steps)
    assert words in str(caught.value)


def test_greedy_refuses_first_ids_of_another_shape():
    with pytest.raises(MhaInputError, match=r"first_ids has shape \(4,\), expected \(rows, 1\) = \(4, 1\)"):
        greedy_static(decoder(), np.zeros((ROWS,), np.int64), 3, 4)


def test_beam_search_refuses_a_prompt_too_long_a_greedy_decoder_and_logits_of_another_shape():
    with pytest.raises(MhaInputError, match="does not fit the static cache"):
        beam_static(decoder(beams=2), np.zeros((ROWS, 10)), [0] * MAX_LENGTH, 4, eot=1)
    with pytest.raises(MhaInputError, match="needs a decoder made with beams"):
        beam_static(decoder(), np.zeros((ROWS, 10)), [0, 0, 0], 4, eot=1)
    with pytest.raises(MhaInputError, match=r"prompt_logits has shape \(2, 10\), expected \(rows, vocabulary\)"):
        beam_static(decoder(beams=2), np.zeros((2, 10)), [0, 0, 0], 4, eot=1)


def test_load_prompt_refuses_a_prompt_too_long_and_presents_that_do_not_match():
    made = decoder()
    with pytest.raises(MhaInputError, match="does not fit the static cache"):
        StaticDecoder.load_prompt(made, {"present_key_self_0": np.zeros((ROWS, 2, MAX_LENGTH, 8))}, MAX_LENGTH)
    with pytest.raises(MhaInputError, match="the prompt's presents lack 'present_key_self_0'"):
        StaticDecoder.load_prompt(made, {}, 3)
    with pytest.raises(MhaInputError, match=r"has shape \(4, 2, 2, 8\), expected \(R, N, length, H\) = \(4, 2, 3, 8\)"):
        StaticDecoder.load_prompt(made, {"present_key_self_0": np.zeros((ROWS, 2, 2, 8))}, 3)
