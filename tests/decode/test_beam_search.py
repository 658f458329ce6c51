"""Beam search (mha_ep/decode/beam.py) against a direct port of OpenAI whisper's BeamSearchDecoder and
MaximumLikelihoodRanker, on made-up decoders: the same answers, step for step the same beams."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from mha_ep.decode.beam import BeamSearch, best_tokens, log_softmax

VOCAB, EOT = 40, 7


def logprobs_of(sequence: tuple, eot_bias: float) -> np.ndarray:
    """A made-up decoder: log-probabilities that depend on the whole sequence (so that beams differ), with
    end-of-text made likelier by ``eot_bias`` as the sequence grows."""
    rng = np.random.default_rng(zlib.crc32(repr(sequence).encode()))
    logits = rng.standard_normal(VOCAB).astype(np.float32) * 2.0
    logits[EOT] += eot_bias * len(sequence)
    return log_softmax(logits[None])[0]


def openai_beam_search(batch, beams, steps, eot_bias, prompt=(1, 2)):
    """OpenAI whisper's BeamSearchDecoder.update / finalize and MaximumLikelihoodRanker(None), ported as written:
    sequences as dict keys (duplicates collapse), sorted candidates, finished sequences per audio."""
    tokens = [tuple(prompt)] * (batch * beams)
    sum_logprobs = [0.0] * (batch * beams)
    finished = [{} for _ in range(batch)]
    for _ in range(steps):
        next_tokens, new_finished = [], []
        for i in range(batch):
            scores, sources = {}, {}
            for j in range(beams):
                idx = i * beams + j
                logprobs = logprobs_of(tokens[idx], eot_bias)
                values, ids = best_tokens(logprobs[None], beams + 1)
                for logprob, token in zip(values[0], ids[0]):
                    sequence = tokens[idx] + (int(token),)
                    scores[sequence] = float(np.float32(sum_logprobs[idx] + logprob))
                    sources[sequence] = idx
            saved, finished_here = 0, {}
            for sequence in sorted(scores, key=scores.get, reverse=True):
                if sequence[-1] == EOT:
                    finished_here[sequence] = scores[sequence]
                else:
                    sum_logprobs[len(next_tokens)] = scores[sequence]
                    next_tokens.append(sequence)
                    saved += 1
                    if saved == beams:
                        break
            new_finished.append(finished_here)
        tokens = next_tokens
        for previous, new in zip(finished, new_finished):
            for sequence in sorted(new, key=new.get, reverse=True):
                if len(previous) >= beams:
                    break
                previous[sequence] = new[sequence]
        if all(len(f) >= beams for f in finished):
            break
    answers = []
    for i, sequences in enumerate(finished):
        if len(sequences) < beams:
            for j in list(np.argsort(sum_logprobs[i * beams:(i + 1) * beams]))[::-1]:
                sequences[tokens[i * beams + j] + (EOT,)] = sum_logprobs[i * beams + j]
                if len(sequences) >= beams:
                    break
        texts = [list(s[len(prompt):s.index(EOT, len(prompt))]) for s in sequences]
        scores = [lp / max(len(t), 1) for t, lp in zip(texts, sequences.values())]
        answers.append(texts[int(np.argmax(scores))])
    return answers


def mha_ep_beam_search(batch, beams, steps, eot_bias, prompt=(1, 2)):
    search = BeamSearch(batch, beams, EOT)
    for _ in range(steps):
        logprobs = np.stack([logprobs_of(tuple(prompt) + tuple(t), eot_bias) for t in search.tokens])
        search.step(logprobs)
        if search.done:
            break
    return search.result()


@pytest.mark.parametrize("batch, beams", [(1, 1), (1, 5), (3, 2), (2, 5)])
@pytest.mark.parametrize("eot_bias", [0.0, 0.6, 3.0])
def test_beam_search_gives_openai_whisper_s_answers(batch, beams, eot_bias):
    for steps in (1, 4, 12):
        assert mha_ep_beam_search(batch, beams, steps, eot_bias) == openai_beam_search(batch, beams, steps, eot_bias)


def test_best_tokens_breaks_ties_by_the_lower_id():
    values, ids = best_tokens(np.array([[0.5, 2.0, 2.0, -1.0, 2.0]], np.float32), 3)
    assert ids.tolist() == [[1, 2, 4]] and values.tolist() == [[2.0, 2.0, 2.0]]


def test_the_first_step_reads_beam_zero_only_and_dead_rows_never_return():
    search = BeamSearch(1, 3, EOT)
    logprobs = np.full((3, VOCAB), -np.inf, np.float32)
    logprobs[:, EOT] = -0.1  # end-of-text first everywhere, then two tokens, then nothing
    logprobs[:, 3] = -0.2
    logprobs[:, 4] = -0.3
    sources, tokens = search.step(logprobs)
    assert sources.tolist() == [0, 0, 0] and tokens.tolist() == [3, 4, EOT]
    assert [f.tokens for f in search.finished[0]] == [[]] and search.sum_logprob[2] == -np.inf
    logprobs[:, EOT] = -5.0
    sources, tokens = search.step(logprobs)  # the dead row is never a source
    assert set(sources.tolist()) <= {0, 1} and search.sum_logprob.max() == np.float32(-0.4)
