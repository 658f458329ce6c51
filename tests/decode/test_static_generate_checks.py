"""The user's static loop (mha_ep/decode/static_generate.py) and what it stands on, on any machine: its checks
refuse a request before anything runs (a stand-in decoder, no CuPy); a static-cache decoder's parts are found by
the rewrite's metadata whatever the model calls them (decoder_names); CapturedBinding refuses a buffer bound after
ORT captured the graph (a recording stand-in for ORT's IOBinding)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

import mha_ep
from mha_ep.decode.binding import CapturedBinding, CapturedBindingError
from mha_ep.decode.static_decode import check_rows, decoder_names
from mha_ep.decode.static_generate import check_generate_request, generate_static, prompt_array
from mha_ep.errors import MhaEpError, MhaInputError
from mha_ep.graph.static_cache import static_cache
from mha_ep.graph.static_cache_result import METADATA_KEY, read_binding_facts

MAX_LENGTH = 16


def decoder(batch: int = 2, beams: int = 0, entry_inputs: tuple = ()):
    fixed = {"cross_key_0": np.zeros((batch * max(beams, 1), 2, 10, 8), np.float32)}
    fixed.update((name, np.zeros((batch, 2, 10, 8), np.float32)) for name in entry_inputs)
    return SimpleNamespace(batch=batch, beams=beams, rows=batch * max(beams, 1), max_length=MAX_LENGTH, fixed=fixed,
                           names=SimpleNamespace(entry_inputs=entry_inputs))  # fmt: skip


@pytest.mark.parametrize("prompt, words", [
    ([[1, 2], [3]], "prompt must be token ids of one length per row, (rows, P0)"),
    ([1, 2, 3], "got shape (3,)"),
    (np.zeros((2, 2), np.float32), "prompt must hold integer token ids, got float32"),
    (np.zeros((2, 0), np.int64), "prompt has shape (2, 0): at least one position per row is needed"),
])  # fmt: skip
def test_a_prompt_that_is_not_rows_of_token_ids_is_refused(prompt, words):
    with pytest.raises(MhaInputError) as caught:
        prompt_array(prompt)
    assert words in str(caught.value)


@pytest.mark.parametrize("beams, prompt_rows, new, words", [
    (0, 3, 4, "prompt (shape (3, 2)) has 3 rows; the decoder takes batch = 2 rows"),
    (5, 7, 4, "has 7 rows; the decoder takes batch = 2 or batch x beams = 2 x 5 = 10 rows"),
    (0, 2, MAX_LENGTH - 1, f"max_new_tokens {MAX_LENGTH - 1} after a prompt of 2 positions needs {MAX_LENGTH + 1} "
                           f"cache rows; the decoder's buffers hold max_length {MAX_LENGTH}: ask for at most "
                           f"{MAX_LENGTH - 2}"),
    (0, 2, 0, "max_new_tokens must be a whole number >= 1, got 0"),
])  # fmt: skip
def test_the_loop_refuses_rows_beams_and_lengths_the_buffers_cannot_serve(beams, prompt_rows, new, words):
    with pytest.raises(MhaInputError) as caught:
        generate_static(decoder(beams=beams), np.ones((prompt_rows, 2), np.int64), new, eot=1)
    assert words in str(caught.value)


def test_a_prompt_as_long_as_the_cache_is_refused():
    with pytest.raises(MhaInputError, match=f"a prompt of {MAX_LENGTH} positions does not fit the static cache"):
        generate_static(decoder(), np.ones((2, MAX_LENGTH), np.int64), 1)


def test_inputs_of_another_name_shape_or_rows_are_refused_before_anything_runs():
    made, prompt = decoder(beams=3), prompt_array([[1, 2], [3, 4]])
    with pytest.raises(MhaInputError, match=r"'encoder_out' is not one of the decoder's fixed inputs \['cross_key_0'\]"):
        check_generate_request(made, prompt, 4, {"encoder_out": np.zeros((2, 2, 10, 8))})
    with pytest.raises(MhaInputError, match=r"input 'cross_key_0' has shape \(2, 2, 11, 8\), expected \(rows,\) \+ \(2, 10, 8\)"):
        check_generate_request(made, prompt, 4, {"cross_key_0": np.zeros((2, 2, 11, 8))})
    with pytest.raises(MhaInputError, match="has 4 rows; the decoder takes batch = 2 or batch x beams = 2 x 3 = 6"):
        check_generate_request(made, prompt, 4, {"cross_key_0": np.zeros((4, 2, 10, 8))})
    for rows in (2, 6):  # a row per batch entry or per decoder row
        check_generate_request(made, prompt, 4, {"cross_key_0": np.zeros((rows, 2, 10, 8))})


def test_an_input_shared_among_beams_takes_one_row_per_batch_entry_only():
    """A --shared-cross-kv decoder's cross K/V hold a row per batch entry: given a row per beam, the loop refuses them
    before anything runs and says why."""
    made, prompt = decoder(beams=3, entry_inputs=("cross_key_1",)), prompt_array([[1, 2], [3, 4]])
    check_generate_request(made, prompt, 4, {"cross_key_1": np.zeros((2, 2, 10, 8))})
    with pytest.raises(MhaInputError, match=r"input 'cross_key_1' has shape \(6, 2, 10, 8\): the decoder reads it one "
                                            "row per batch entry"):  # fmt: skip
        check_generate_request(made, prompt, 4, {"cross_key_1": np.zeros((6, 2, 10, 8))})


def test_a_decoder_s_entry_inputs_come_from_the_rewrite_s_metadata_and_must_be_its_inputs():
    inputs, outputs, metadata = parts()
    facts = json.loads(metadata[METADATA_KEY])
    assert decoder_names(inputs, outputs, metadata).entry_inputs == ()  # a stamp from before the rule
    facts["entry_inputs"] = ["cross.0"]
    assert decoder_names(inputs, outputs, {METADATA_KEY: json.dumps(facts)}).entry_inputs == ("cross.0",)
    facts["entry_inputs"] = ["cross.9"]
    with pytest.raises(MhaEpError, match=r"names \['cross.9'\] as inputs of one row per batch entry"):
        decoder_names(inputs, outputs, {METADATA_KEY: json.dumps(facts)})


def test_beam_search_without_an_end_of_text_id_is_refused():
    with pytest.raises(MhaInputError, match="beam search needs eot"):
        generate_static(decoder(beams=2), [[1], [2]], 4)


@pytest.mark.parametrize("batch, beams, words", [
    (0, 0, "batch must be a whole number >= 1, got 0"),
    (2, -1, "beams must be a whole number >= 0, got -1"),
    (2, 16, "beam search takes at most 15 beams (decode.cu MAX_CANDIDATES), got 16"),
    (True, 0, "batch must be a whole number >= 1, got True"),
])  # fmt: skip
def test_a_decoder_refuses_batches_and_beams_it_cannot_make(batch, beams, words):
    with pytest.raises(MhaInputError) as caught:
        check_rows(batch, beams)
    assert words in str(caught.value)


def arg(name, type_="tensor(float)", shape=(2, 4, 16, 8)):
    return SimpleNamespace(name=name, type=type_, shape=list(shape))


def parts(ids_type="tensor(int64)", ids_name="input_ids"):
    inputs = {a.name: a for a in [arg(ids_name, ids_type, (2, 1)), arg("pkv.0.key"), arg("pkv.0.value"),
                                  arg("past_sequence_length", "tensor(int32)", (1,)), arg("cross.0", shape=(2, 4, 9, 8))]}
    outputs = {a.name: a for a in [arg("logits", shape=(2, 1, 50)), arg("present.0.key"), arg("present.0.value")]}
    facts = {"self_layers": [{"past_key": "pkv.0.key", "past_value": "pkv.0.value", "present_key": "present.0.key",
                              "present_value": "present.0.value"}], "max_length": 16, "batch": 2, "beams": 0,
             "past_sequence_length": "past_sequence_length", "cache_indirection": None}  # fmt: skip
    return inputs, outputs, {METADATA_KEY: json.dumps(facts)}


def test_a_decoder_s_caches_are_found_by_the_rewrite_s_metadata_whatever_their_names():
    inputs, outputs, metadata = parts()
    names = decoder_names(inputs, outputs, metadata)
    assert names.pairs == (("pkv.0.key", "present.0.key"), ("pkv.0.value", "present.0.value"))
    assert (names.ids, names.logits, names.pairs_from) == ("input_ids", "logits", "metadata")
    with pytest.raises(MhaEpError, match="no present output whose past is an input"):  # no metadata, no X_ naming
        decoder_names(inputs, outputs, {})


def test_the_token_input_is_found_by_its_name_or_as_the_one_integer_input_int32_included():
    inputs, outputs, metadata = parts("tensor(int32)", "tokens")
    assert decoder_names(inputs, outputs, metadata).ids == "tokens"
    inputs["other_ids"] = arg("other_ids", "tensor(int64)", (2, 1))
    with pytest.raises(MhaEpError, match=r"which input takes the tokens\? .* \['tokens', 'other_ids'\]: name it"):
        decoder_names(inputs, outputs, metadata)
    assert decoder_names(inputs, outputs, metadata, ids="tokens").ids == "tokens"
    with pytest.raises(MhaEpError, match="input 'cross.0' is tensor\\(float\\): the token input must be int64 or int32"):
        decoder_names(inputs, outputs, metadata, ids="cross.0")
    with pytest.raises(MhaEpError, match="the decoder has no output 'scores'"):
        decoder_names(inputs, outputs, metadata, ids="tokens", logits="scores")


def test_the_rewrite_stamps_its_binding_facts_and_the_partition_keeps_them():
    model = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    result = static_cache(model, max_length=MAX_LENGTH, batch=2)
    for stamped in (result.model, mha_ep.partition(result.model, route="native").model):
        facts = read_binding_facts({p.key: p.value for p in stamped.metadata_props})
        assert [tuple(layer.values()) for layer in facts["self_layers"]] == [tuple(layer) for layer in result.self_layers]
        assert (facts["max_length"], facts["batch"], facts["past_sequence_length"]) == (MAX_LENGTH, 2, "past_sequence_length")
    again = static_cache(result.model, max_length=MAX_LENGTH, batch=2).model  # a second stamp replaces the first
    assert [p.key for p in again.metadata_props].count(METADATA_KEY) == 1


class RecordingBinding:
    def __init__(self):
        self.calls = []

    def bind_input(self, name, *args):
        self.calls.append(("input", name, args[-1]))

    def bind_output(self, name, *args):
        self.calls.append(("output", name, args[-1]))


class Session:
    def __init__(self):
        self.binding, self.runs = RecordingBinding(), 0

    def io_binding(self):
        return self.binding

    def run_with_iobinding(self, binding, options=None):
        self.runs += 1


def buffer(address, shape=(2, 3), dtype=np.float32):
    return SimpleNamespace(data=SimpleNamespace(ptr=address), shape=shape, dtype=np.dtype(dtype))


def test_a_captured_binding_refuses_a_new_buffer_after_the_first_run_and_names_both():
    session = Session()
    binding = CapturedBinding(session)
    first, second = buffer(0x1000), buffer(0x2000)
    binding.bind_input("states", first)
    binding.bind_input("states", second)  # before any run: a new buffer is fine
    binding.bind_output("logits", buffer(0x3000))
    binding.run()
    binding.bind_input("states", second)  # the same buffer again: nothing to do, nothing refused
    assert [call[1:] for call in session.binding.calls] == [("states", 0x1000), ("states", 0x2000), ("logits", 0x3000)]
    with pytest.raises(CapturedBindingError) as caught:
        binding.bind_input("states", first)
    assert ("input 'states' was bound at 0x2000 float32[2, 3] when ORT captured the decoder's CUDA graph; binding "
            "it at 0x1000 float32[2, 3] would not be seen") in str(caught.value)
    assert "Copy the new values into the bound buffer" in str(caught.value)
    with pytest.raises(CapturedBindingError, match=r"float16\[2, 3\]"):  # same address, another element type
        binding.bind_output("logits", buffer(0x3000, dtype=np.float16))
    with pytest.raises(CapturedBindingError, match="'new_input' was not bound when ORT captured"):
        binding.bind_input("new_input", buffer(0x4000))
    assert session.binding.calls[-1][1:] == ("logits", 0x3000) and session.runs == 1


def test_verify_finds_an_array_replaced_instead_of_copied_into():
    binding = CapturedBinding(Session())
    held = {"states": buffer(0x1000)}
    binding.bind_input("states", held["states"])
    binding.run()
    binding.verify(held)
    held["states"] = buffer(0x5000)  # the mistake: a new array, where a copy into the bound one was meant
    with pytest.raises(CapturedBindingError, match="the array now held for it is at 0x5000"):
        binding.verify(held)
