"""Generation over a static-cache decoder on the GPU (mha_ep/models/static_decode.py; marker gpu): the greedy and
beam loops, a graph replay and one kernel a step, give the answers of the host loops over the dynamic decoder on
stock ORT's CPU provider. The shipped random-weight Whisper decoder (2 layers, 4 heads, vocabulary 1000)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep.models.beam import BeamSearch, log_softmax
from mha_ep.static_cache import static_cache

from conftest import native_cuda_unavailable_reason

PROMPT, MAX_LENGTH, EOT = 3, 64, 2
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    reason = native_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the native route's CUDA kernels cannot run here: {reason}")
    ort.preload_dlls()
    import cupy

    return cupy


def run(session, feeds: dict) -> dict:
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def prompt(entries: int, beams: int = 1):
    """The first decoder step on random prompts (stock ORT CPU): its last logits and presents, every entry's
    repeated for its beams."""
    rng = np.random.default_rng(11)
    init = ort.InferenceSession(str(mha_ep.shipped_model("whisper_random_decoder_init_fp32.onnx")),
                                providers=["CPUExecutionProvider"])  # fmt: skip
    out = run(init, {"input_ids": rng.integers(3, 1000, (entries, PROMPT)).astype(np.int64),
                     "encoder_hidden_states": rng.standard_normal((entries, 100, 64)).astype(np.float32)})
    rows = np.repeat(np.arange(entries), beams)
    return out["logits"][rows, -1], {n: v[rows] for n, v in out.items() if n.startswith("present_")}


def static_decoder(cupy, rows: int, beams: int = 0):
    from mha_ep.models.static_decode import StaticDecoder, cuda_session

    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    stream = cupy.cuda.Stream(non_blocking=True)
    static = static_cache(decoder, max_length=MAX_LENGTH, batch=rows, beams=beams).model
    return StaticDecoder(cuda_session(static, stream), rows // max(beams, 1), stream=stream, beams=beams)


def host_decoder():
    return ort.InferenceSession(str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx")),
                                providers=["CPUExecutionProvider"])  # fmt: skip


def test_greedy_static_gives_the_host_loop_s_tokens(gpu):
    from mha_ep.models.static_decode import greedy_static

    cupy, steps = gpu, 20
    logits, presents = prompt(2)
    first = logits.argmax(-1)
    cache = {n.replace("present", "past"): v for n, v in presents.items() if "_self_" in n}
    cross = {n.replace("present", "past"): v for n, v in presents.items() if "cross" in n}
    session, ids, expected = host_decoder(), first, [[int(t)] for t in first]
    for _ in range(steps - 1):
        out = run(session, {"input_ids": ids[:, None], **cache, **cross})
        cache = {n: out[n.replace("past", "present")] for n in cache}
        ids = out["logits"][:, -1].argmax(-1)
        for row, token in zip(expected, ids):
            row.append(int(token))
    decoder = static_decoder(cupy, 2)
    decoder.set_inputs(cross)
    for _ in range(3):  # ORT captures the graph on an early run; every call after replays it
        decoder.load_prompt({n: v for n, v in presents.items() if "_self_" in n}, PROMPT)
        got = greedy_static(decoder, cupy.asarray(first[:, None]), PROMPT, steps, check_every=4)
        assert got == expected


def test_beam_static_gives_the_host_loop_s_answers(gpu):
    from mha_ep.models.static_decode import beam_static

    cupy, beams, entries, steps = gpu, 5, 2, 16
    logits, presents = prompt(entries, beams)
    cache = {n.replace("present", "past"): v for n, v in presents.items() if "_self_" in n}
    cross = {n.replace("present", "past"): v for n, v in presents.items() if "cross" in n}
    search, session = BeamSearch(entries, beams, EOT), host_decoder()
    sources, ids = search.step(log_softmax(logits))
    for _ in range(steps - 1):
        if search.done:
            break
        out = run(session, {"input_ids": ids[:, None], **{n: v[sources] for n, v in cache.items()}, **cross})
        cache = {n: out[n.replace("past", "present")] for n in cache}
        sources, ids = search.step(log_softmax(out["logits"][:, -1]))
    expected = search.result()
    decoder = static_decoder(cupy, entries * beams, beams)
    decoder.set_inputs(cross)
    for _ in range(3):
        decoder.load_prompt({n: v for n, v in presents.items() if "_self_" in n}, PROMPT)
        got = beam_static(decoder, cupy.asarray(logits), [0] * PROMPT, steps, EOT, check_every=4)
        assert got == expected
