"""The user's static loop on the GPU (mha_ep.generate_static over mha_ep.StaticDecoder; marker gpu): the prompt's
token ids and the encoder's outputs given by the caller, the prompt stepped into the cache, then greedy or beam
search, give the tokens of the host loop over the dynamic decoder on stock ORT's CPU provider; any decoder
``mha-ep static-cache`` wrote, whatever its cache and token inputs are called and whether its ids are int64 or
int32 (ORT's Whisper export); a buffer swapped after the graph was captured is refused, never replayed stale."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep.decode.beam import BeamSearch, log_softmax
from mha_ep.graph.static_cache import static_cache

MAX_LENGTH, EOT, PROMPT = 64, 2, 3
SUPPRESS = (5, 9, 13)  # never chosen; FIRST ids also not as the first new token
FIRST = (17, 21)
pytestmark = pytest.mark.gpu


def dynamic_decoder(ids_int32: bool = False, renamed: bool = False) -> onnx.ModelProto:
    """The shipped random Whisper decoder-with-past; int32 input_ids (Gather takes them as they are) or its
    caches renamed as optimum names them (past_key_values.L.key -> present.L.key)."""
    model = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    if ids_int32:
        model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    if renamed:
        names = {}
        for value in list(model.graph.input) + list(model.graph.output):
            if "_self_" in value.name:
                kind, layer = value.name.split("_")[1], value.name.rsplit("_", 1)[1]
                prefix = "past_key_values" if value.name.startswith("past") else "present"
                names[value.name] = f"{prefix}.{layer}.{kind}"
        for value in list(model.graph.input) + list(model.graph.output):
            value.name = names.get(value.name, value.name)
        for node in model.graph.node:
            node.input[:] = [names.get(n, n) for n in node.input]
            node.output[:] = [names.get(n, n) for n in node.output]
    return model


def cross_inputs(entries: int) -> dict:
    rng = np.random.default_rng(23)
    return {f"past_{kind}_cross_{layer}": rng.standard_normal((entries, 4, 100, 16)).astype(np.float32)
            for kind in ("key", "value") for layer in range(2)}  # fmt: skip


def host_logits(model: onnx.ModelProto):
    """logits(ids, cache, cross) -> (last logits (R, V), new cache): one step of the dynamic decoder on ORT CPU."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    ids_type = np.int32 if model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT32 else np.int64

    def step(ids, cache, cross):
        out = dict(zip(names, session.run(None, {"input_ids": np.asarray(ids, ids_type)[:, None], **cache, **cross})))
        return out["logits"][:, -1], {n: out[n.replace("past_key_values", "present").replace("past_", "present_", 1)]
                                      for n in cache}  # fmt: skip

    return step


def empty_cache(model: onnx.ModelProto, rows: int) -> dict:
    return {v.name: np.zeros((rows, 4, 0, 16), np.float32) for v in model.graph.input
            if "self" in v.name or "past_key_values" in v.name}  # fmt: skip


def host_greedy(model, prompt: np.ndarray, cross: dict, steps: int) -> tuple:
    """The tokens of the host loop, and the cache after the prompt (name -> (R, N, P0, H))."""
    step = host_logits(model)
    cache = empty_cache(model, prompt.shape[0])
    for position in range(prompt.shape[1]):
        logits, cache = step(prompt[:, position], cache, cross)
    prompt_cache = dict(cache)
    bias = np.zeros(logits.shape[-1], np.float32)
    bias[list(SUPPRESS)] = -np.inf
    first = bias.copy()
    first[list(FIRST)] = -np.inf
    ids = (logits + first).argmax(-1)
    rows = [[int(t)] for t in ids]
    for _ in range(steps - 1):
        logits, cache = step(ids, cache, cross)
        ids = (logits + bias).argmax(-1)
        for row, token in zip(rows, ids):
            row.append(int(token))
    return [row[: row.index(EOT)] if EOT in row else row for row in rows], prompt_cache


@pytest.mark.parametrize("form", ["int64 ids", "int32 ids (ORT's Whisper export)", "caches named as optimum names them"])
def test_generate_static_gives_the_host_loop_s_greedy_tokens(native_cupy, form):
    cupy, steps = native_cupy, 20
    model = dynamic_decoder(ids_int32="int32" in form, renamed="optimum" in form)
    prompt = np.random.default_rng(7).integers(3, 1000, (2, PROMPT))
    cross = cross_inputs(2)
    expected, prompt_cache = host_greedy(model, prompt, cross, steps)
    decoder = mha_ep.StaticDecoder.from_model(static_cache(model, max_length=MAX_LENGTH, batch=2).model, 2)
    assert decoder.names.pairs_from == "metadata" and decoder.ids.dtype == (np.int32 if "int32" in form else np.int64)
    for attempt in range(3):  # captured on an early run, replayed after; the inputs copied in every time
        with decoder.stream:  # poisoned (on the decoder's stream): the prompt's rows must be written by stepping it
            for cache in decoder.caches:
                cache.buffer.fill(np.nan)
        got = mha_ep.generate_static(decoder, prompt, steps, inputs=cross, eot=EOT, suppress=SUPPRESS,
                                     suppress_first=FIRST)  # fmt: skip
        assert got == expected, attempt
        for cache in decoder.caches:  # the prompt's keys and values, as the host loop's dynamic cache holds them
            # (ORT CUDA's float32 GEMMs run in TF32: 7e-4 apart on the H100)
            np.testing.assert_allclose(cupy.asnumpy(cache.buffer[:, :, :PROMPT]), prompt_cache[cache.past],
                                       rtol=2e-3, atol=2e-3, err_msg=cache.past)  # fmt: skip


def test_generate_static_gives_the_host_beam_search_s_answers(native_cupy):
    """5 beams over 2 entries: the prompt and the inputs a row per entry, repeated for its beams by the loop."""
    beams, entries, steps = 5, 2, 12
    model = dynamic_decoder()
    prompt = np.random.default_rng(8).integers(3, 1000, (entries, PROMPT))
    cross = cross_inputs(entries)
    rows = np.repeat(np.arange(entries), beams)
    step = host_logits(model)
    cache = empty_cache(model, entries * beams)
    row_cross = {n: v[rows] for n, v in cross.items()}
    for position in range(PROMPT):
        logits, cache = step(prompt[rows, position], cache, row_cross)
    bias = np.zeros(logits.shape[-1], np.float32)
    bias[list(SUPPRESS)] = -np.inf
    first = bias.copy()
    first[list(FIRST)] = -np.inf
    search = BeamSearch(entries, beams, EOT)
    sources, ids = search.step(log_softmax(logits + first))
    for _ in range(steps - 1):
        if search.done:
            break
        logits, cache = step(ids, {n: v[sources] for n, v in cache.items()}, row_cross)
        sources, ids = search.step(log_softmax(logits + bias))
    decoder = mha_ep.StaticDecoder.from_model(static_cache(model, max_length=MAX_LENGTH, batch=entries * beams,
                                                           beams=beams).model, entries, beams=beams)  # fmt: skip
    for attempt in range(2):
        got = mha_ep.generate_static(decoder, prompt, steps, inputs=cross, eot=EOT, suppress=SUPPRESS,
                                     suppress_first=FIRST)  # fmt: skip
        assert got == search.result(), attempt


def test_a_buffer_swapped_after_capture_is_refused_and_the_decoder_still_answers(native_cupy):
    """The failure the guard exists for: new buffers bound after ORT captured the graph would be ignored by every
    replay (stale memory, wrong tokens, no error). Both ways of swapping are refused, naming the input; copying
    into the bound buffers keeps working."""
    from mha_ep.decode.binding import CapturedBindingError

    cupy, steps = native_cupy, 8
    model = dynamic_decoder()
    prompt = np.random.default_rng(9).integers(3, 1000, (2, PROMPT))
    cross = cross_inputs(2)
    decoder = mha_ep.StaticDecoder.from_model(static_cache(model, max_length=MAX_LENGTH, batch=2).model, 2)
    first = mha_ep.generate_static(decoder, prompt, steps, inputs=cross)
    with decoder.stream:
        fresh = cupy.asarray(cross["past_key_cross_0"])
    with pytest.raises(CapturedBindingError, match="input 'past_key_cross_0' was bound at 0x"):
        decoder.binding.bind_input("past_key_cross_0", fresh)
    held = decoder.fixed["past_key_cross_0"]
    decoder.fixed["past_key_cross_0"] = fresh  # replaced instead of copied into
    with pytest.raises(CapturedBindingError, match="the array now held for it is at"):
        mha_ep.generate_static(decoder, prompt, steps, inputs=cross)
    decoder.fixed["past_key_cross_0"] = held
    assert mha_ep.generate_static(decoder, prompt, steps, inputs=cross) == first
