"""Beam search as OpenAI's whisper decodes (``BeamSearchDecoder`` with patience 1, ``MaximumLikelihoodRanker``
without a length penalty), on the host: the rules every beam loop of mha_ep follows, and the oracle of the device
version (mha_ep/decode/decode.cu ``beam_rows`` and ``beam_select``, which the GPU loop runs).

Rows are R = B * W, row b*W + w being beam w of batch entry b. A step:
  1. per row, log-probabilities of the logits (plus a suppression bias of 0 / -inf) and its W + 1 best tokens
     (ties: the lower token id);
  2. per batch entry, the W (W + 1) candidates, score = the beam's summed log-probability + the token's, in
     descending order (ties: the lower beam, then the better rank): a candidate that ends in end-of-text becomes a
     finished sequence while the entry has fewer than W; the others become the next beams until there are W.
     At the first step every beam of an entry is the same prompt, so only beam 0 takes part (the others start at
     -inf), as OpenAI's decoder collapses identical sequences;
  3. the decoder's cache follows the beams: new beam w' reads what its source beam read (``sources``).
The search is over once every entry has W finished sequences, or after the step budget. The answer of an entry is
the sequence with the best log-probability / length among its finished ones, topped up with its live beams by
summed log-probability when fewer than W finished (length: the sampled tokens, end-of-text excluded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

MAX_BEAMS = 15  # decode.cu MAX_CANDIDATES - 1


def log_softmax(logits_RV: np.ndarray, bias_V: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 log-probabilities of each row: x - max - log(sum(exp(x - max))), x = logits + bias."""
    x = np.asarray(logits_RV, np.float32)
    if bias_V is not None:
        x = x + np.asarray(bias_V, np.float32)
    top = x.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True, dtype=np.float32))


def best_tokens(logprobs_RV: np.ndarray, count: int) -> tuple:
    """(values, ids) of each row's ``count`` best tokens, best first (ties: the lower id)."""
    order = np.lexsort((np.arange(logprobs_RV.shape[1])[None, :].repeat(len(logprobs_RV), 0), -logprobs_RV), axis=-1)
    ids = order[:, :count]
    return np.take_along_axis(logprobs_RV, ids, axis=-1), ids


@dataclass
class Finished:
    tokens: List[int]  # the sampled tokens, end-of-text excluded
    score: float  # their summed log-probability, end-of-text included


@dataclass
class BeamSearch:
    """The state of one beam search over ``batch`` entries of ``beams`` beams (module docstring)."""

    batch: int
    beams: int
    eot: int
    sum_logprob: np.ndarray = field(init=False)  # (R,) float32
    tokens: List[List[int]] = field(init=False)  # each row's sampled tokens
    finished: List[List[Finished]] = field(init=False)

    def __post_init__(self):
        if not 1 <= self.beams <= MAX_BEAMS:
            raise ValueError(f"beams must be in 1..{MAX_BEAMS}, got {self.beams}")
        rows = self.batch * self.beams
        self.sum_logprob = np.full(rows, -np.inf, np.float32)
        self.sum_logprob[:: self.beams] = 0.0  # step 2: only beam 0 of the identical prompts takes part at first
        self.tokens = [[] for _ in range(rows)]
        self.finished = [[] for _ in range(self.batch)]

    @property
    def done(self) -> bool:
        return all(len(entry) >= self.beams for entry in self.finished)

    def step(self, logprobs_RV: np.ndarray) -> tuple:
        """One step on the rows' log-probabilities (R, V): (sources (R,), tokens (R,)), the next beams' source rows
        and their new tokens (the next decoder input)."""
        return self.step_top(*best_tokens(np.asarray(logprobs_RV, np.float32), self.beams + 1))

    def step_top(self, values: np.ndarray, ids: np.ndarray) -> tuple:
        """``step`` on each row's W + 1 best log-probabilities and their token ids (R, W + 1), best first."""
        w = self.beams
        k = w + 1
        sources = np.zeros(self.batch * w, np.int64)
        chosen = np.zeros(self.batch * w, np.int64)
        scores = np.full(self.batch * w, -np.inf, np.float32)
        tokens = []
        for b in range(self.batch):
            rows = range(b * w, (b + 1) * w)
            candidates = [(np.float32(self.sum_logprob[r] + values[r, rank]), c, r, int(ids[r, rank]))
                          for c, (r, rank) in enumerate((r, rank) for r in rows for rank in range(k))]  # fmt: skip
            candidates.sort(key=lambda item: (-item[0], item[1]))
            saved = 0
            for score, _, source, token in candidates:
                if saved == w or score == -np.inf:
                    break
                if token == self.eot:
                    if len(self.finished[b]) < w:
                        self.finished[b].append(Finished(list(self.tokens[source]), float(score)))
                    continue
                row = b * w + saved
                sources[row], chosen[row], scores[row] = source, token, score
                saved += 1
            for row in range(b * w + saved, (b + 1) * w):  # fewer live candidates than beams: dead rows
                sources[row], chosen[row] = b * w, self.eot
        for row in range(self.batch * w):
            tokens.append(self.tokens[sources[row]] + [int(chosen[row])])
        self.tokens, self.sum_logprob = tokens, scores
        return sources, chosen

    def result(self) -> List[List[int]]:
        """Each entry's answer (module docstring)."""
        return answers(self.finished, self.tokens, self.sum_logprob, self.beams)


def answers(finished: Sequence[Sequence[Finished]], tokens: Sequence[Sequence[int]], sum_logprob: np.ndarray,
            beams: int) -> List[List[int]]:  # fmt: skip
    """Each entry's answer from its finished sequences, topped up with its live beams (``tokens``, ``sum_logprob``
    by row) by summed log-probability while it has fewer than ``beams``."""
    result = []
    for b, entry in enumerate(finished):
        candidates = list(entry)
        rows = range(b * beams, (b + 1) * beams)
        for row in sorted(rows, key=lambda r: -sum_logprob[r]):
            if len(candidates) >= beams:
                break
            if sum_logprob[row] > -np.inf:
                candidates.append(Finished(list(tokens[row]), float(sum_logprob[row])))
        result.append(best_of(candidates))
    return result


def best_of(candidates: Sequence[Finished]) -> List[int]:
    """MaximumLikelihoodRanker without a length penalty: the best score / length (the first of equals)."""
    if not candidates:
        return []
    ranked = [c.score / max(len(c.tokens), 1) for c in candidates]
    return list(candidates[int(np.argmax(ranked))].tokens)
