"""Generation over a static-cache decoder on the GPU (mha_ep/decode/static_decode.py; marker gpu): the greedy and
beam loops, a graph replay and one kernel a step, give the answers of the host loops over the dynamic decoder on
stock ORT's CPU provider. The shipped random-weight Whisper decoder (2 layers, 4 heads, vocabulary 1000)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep
from mha_ep.decode.beam import BeamSearch, log_softmax
from mha_ep.graph.static_cache import static_cache

PROMPT, MAX_LENGTH, EOT = 3, 64, 2
pytestmark = pytest.mark.gpu


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


def static_decoder(cupy, rows: int, beams: int = 0, shared_cross_kv: bool = False):
    from mha_ep.decode.static_decode import StaticDecoder, cuda_session

    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    stream = cupy.cuda.Stream(non_blocking=True)
    static = static_cache(decoder, max_length=MAX_LENGTH, batch=rows, beams=beams,
                          shared_cross_kv=shared_cross_kv).model  # fmt: skip
    return StaticDecoder(cuda_session(static, stream), rows // max(beams, 1), stream=stream, beams=beams)


def host_decoder():
    return ort.InferenceSession(str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx")),
                                providers=["CPUExecutionProvider"])  # fmt: skip


def test_greedy_static_gives_the_host_loop_s_tokens(native_cupy):
    from mha_ep.decode.static_decode import greedy_static

    cupy, steps = native_cupy, 20
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


@pytest.mark.parametrize("shared", [False, True], ids=["cross-kv-per-beam", "shared-cross-kv"])
def test_beam_static_gives_the_host_loop_s_answers(native_cupy, shared):
    """``shared``: the decoder rewritten with rule SHARED_CROSS_KV, bound to the cross K/V of each entry once (its
    own buffers hold batch, not batch x beams, rows)."""
    from mha_ep.decode.static_decode import beam_static

    cupy, beams, entries, steps = native_cupy, 5, 2, 16
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
    decoder = static_decoder(cupy, entries * beams, beams, shared_cross_kv=shared)
    if shared:
        cross = {name: value[::beams] for name, value in cross.items()}  # each entry's rows once
        assert all(decoder.fixed[name].shape[0] == entries for name in cross)
    decoder.set_inputs(cross)
    for _ in range(3):
        decoder.load_prompt({n: v for n, v in presents.items() if "_self_" in n}, PROMPT)
        got = beam_static(decoder, cupy.asarray(logits), [0] * PROMPT, steps, EOT, check_every=4)
        assert got == expected


def test_a_static_decoder_writes_the_cross_qk_of_each_step_into_its_own_buffers(native_cupy):
    """ORT's --output_cross_qk form (word timestamps): the static decoder binds every other output, here each
    cross-attention node's qk (B, N, 1, T_enc), to a buffer of its own that every replayed step writes; after one
    step it holds stock ORT CPU's qk of that step, and the tokens stay the host loop's."""
    from mha_ep.decode.static_decode import StaticDecoder, cuda_session, greedy_static
    from mha_ep.models.synthetic import decoder_step_feeds, whisper_decoder_step

    cupy, layers, hidden, heads, frames, vocab = native_cupy, 2, 64, 2, 40, 100
    decoder = whisper_decoder_step(layers, hidden, heads, 128, vocab=vocab, cross_qk=True)
    feeds = decoder_step_feeds(2, PROMPT, layers, hidden, heads, frames, seed=5)
    cache = {n: v for n, v in feeds.items() if n.startswith("past_")}
    cross = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    first = np.array([[7], [42]], np.int64)
    host = ort.InferenceSession(decoder.SerializeToString(), providers=["CPUExecutionProvider"])
    steps, ids, expected, qk_after_one = 6, first, [[7], [42]], None
    for step in range(steps - 1):
        out = run(host, {"input_ids": ids, **cache, **cross})
        qk_after_one = qk_after_one or {n: v for n, v in out.items() if n.startswith("output_cross_qk")}
        cache = {n: out[n.replace("past", "present")] for n in cache}
        ids = out["logits"][:, -1].argmax(-1)[:, None]
        for row, token in zip(expected, ids[:, 0]):
            row.append(int(token))
    stream = cupy.cuda.Stream(non_blocking=True)
    static = static_cache(decoder, max_length=MAX_LENGTH, batch=2).model
    made = StaticDecoder(cuda_session(static, stream), 2, stream=stream,
                         fixed_shapes={n: v.shape for n, v in cross.items()})  # fmt: skip
    assert sorted(made.other_outputs) == sorted(qk_after_one)
    made.set_inputs(cross)
    prompt_cache = {n.replace("past_", "present_", 1): v for n, v in feeds.items() if n.startswith("past_")}
    for _ in range(3):  # captured on an early run, replayed after
        for array in made.other_outputs.values():
            array.fill(cupy.nan)
        made.load_prompt(prompt_cache, PROMPT)
        greedy_static(made, cupy.asarray(first), PROMPT, 2, check_every=1)
        stream.synchronize()
        for name, want in qk_after_one.items():
            # a whole decoder on ORT CUDA against ORT CPU: its float32 MatMuls run on TF32 tensor cores (ORT's
            # use_tf32 default), 2e-4 apart here; a missing or misplaced qk is off by the scores themselves (0.1-0.3)
            np.testing.assert_allclose(cupy.asnumpy(made.other_outputs[name]), want, rtol=2e-3, atol=2e-3)
        made.load_prompt(prompt_cache, PROMPT)
        assert greedy_static(made, cupy.asarray(first), PROMPT, steps, check_every=2) == expected
