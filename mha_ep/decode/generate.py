"""Greedy generation on the GPU with the KV cache on the device: the loop a Whisper user runs, one token a step.

A *stepper* runs one decoder-with-past step on the GPU and hands back the step's logits as a CuPy array and its
presents as the next step's past, never through the host:

  BoundStepper      any ORT-like session (stock ``onnxruntime.InferenceSession``, one with ``mha_ep.register``,
                    or ``mha_ep.InferenceSession``) through IOBinding: the cache lives in ORT values on the GPU,
                    bound as the next step's inputs;
  DeviceStepper     ``mha_ep.InferenceSession.run_device``: the cache as CuPy arrays over ORT's buffers.

``greedy`` drives a stepper: the token is chosen on the GPU (``argmax`` over the last position's logits plus a
suppression bias of 0 / -inf), written on the GPU as the next ``input_ids``, and the only read per step is the
chosen tokens (8 bytes a row), which the loop needs to stop at end-of-text. ORT runs on a stream of its own and
synchronizes it before ``run_with_iobinding`` returns; CuPy's work runs on CuPy's stream and that small read
waits for it, so every step's inputs are ready before ORT reads them.

``bound_beam`` is beam search (mha_ep/decode/beam.py) over a stepper: the log-probabilities and each row's W + 1
best tokens on the GPU, the choice among them on the host (a few hundred bytes a step), the cache's rows
reordered on the GPU (a gather along the batch axis) before each step: the loop stock ORT allows, the yardstick of
the static-cache beam loop (mha_ep/decode/static_decode.py).

Cache names follow the exported models: an output ``present_X`` is the next step's input ``past_X`` (Whisper's
``present_key_self_0`` -> ``past_key_self_0``; mha_ep/models/synthetic.py's decoder the same).
"""

from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np


def past_name(present: str) -> str:
    return present.replace("present_", "past_", 1)


def suppression_bias(vocab: int, suppressed: Sequence[int], device_id: int = 0):
    """A (vocab,) float32 CuPy vector: -inf at the suppressed token ids, 0 elsewhere (added before argmax)."""
    import cupy

    with cupy.cuda.Device(device_id):
        bias = cupy.zeros((vocab,), cupy.float32)
        if len(suppressed):
            bias[cupy.asarray(np.asarray(list(suppressed), np.int64))] = -cupy.inf
    return bias


def pick(logits, bias):
    """The greedy token of each row on the GPU: argmax of the last position's logits (float32) plus ``bias``;
    (B, 1) int64 CuPy array."""
    import cupy

    last = logits[:, -1, :].astype(cupy.float32)
    if bias is not None:
        last = last + bias
    return cupy.argmax(last, axis=-1).astype(cupy.int64).reshape(-1, 1)


def bind(binding, name: str, value, device_id: int) -> None:
    """Bind an ORT value or a CuPy array as input ``name``."""
    if hasattr(value, "data_ptr"):
        binding.bind_ortvalue_input(name, value)
    else:
        binding.bind_input(name, "cuda", device_id, value.dtype.type, list(value.shape), value.data.ptr)


class BoundStepper:
    """One decoder session stepped through IOBinding (module docstring)."""

    def __init__(self, session, device_id: int = 0):
        self.session = session
        self.device_id = device_id
        self.outputs = [o.name for o in session.get_outputs()]

    def run(self, feeds: Mapping[str, object]) -> Dict[str, object]:
        """ORT values of every output, on the GPU, for feeds of ORT values or CuPy arrays."""
        binding = self.session.io_binding()
        for name, value in feeds.items():
            bind(binding, name, value, self.device_id)
        for name in self.outputs:
            binding.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        return dict(zip(self.outputs, binding.get_outputs()))

    def step(self, ids, cache: Mapping[str, object], fixed: Mapping[str, object]) -> tuple:
        """(logits as a CuPy array, the next step's cache) for the token ids ``ids`` (B, 1) on the GPU."""
        from mha_ep.gpu_session.cuda_io import ortvalue_array

        values = self.run({"input_ids": ids, **fixed, **cache})
        logits = ortvalue_array(values.pop("logits"))
        return logits, {past_name(n): v for n, v in values.items() if n.startswith("present_")}


class DeviceStepper:
    """One ``mha_ep.InferenceSession`` stepped through ``run_device`` (module docstring)."""

    def __init__(self, session):
        self.session = session
        self.outputs = [o.name for o in session.get_outputs()]

    def run(self, feeds: Mapping[str, object]) -> Dict[str, object]:
        return dict(zip(self.outputs, self.session.run_device(None, dict(feeds))))

    def step(self, ids, cache: Mapping[str, object], fixed: Mapping[str, object]) -> tuple:
        values = self.run({"input_ids": ids, **fixed, **cache})
        logits = values.pop("logits")
        return logits, {past_name(n): v for n, v in values.items() if n.startswith("present_")}


def greedy(stepper, ids, cache: Mapping[str, object], fixed: Mapping[str, object], steps: int,
           bias=None, eot: Optional[int] = None, step_seconds: Optional[list] = None) -> List[List[int]]:
    """Up to ``steps`` greedy decoder steps from the first token ids ``ids`` ((B, 1) int64 on the GPU) and the
    prompt's ``cache``; ``fixed`` are the inputs every step reads as they are (Whisper's cross-attention cache).
    Returns each row's tokens, ``ids``' own first, at most ``steps`` (the decoder runs once per token kept, as in
    whisper_transcribe.Transcriber); a row stops at ``eot`` (which it does not include) and the loop when every row
    has. ``step_seconds`` (a list) receives each step's wall time, its token read included."""
    import cupy

    batch = int(ids.shape[0])
    tokens: List[List[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    done_device = cupy.zeros((batch, 1), bool)
    for _ in range(steps):
        start = time.perf_counter()
        chosen = cupy.asnumpy(ids).reshape(-1)  # the one read of a step: the tokens just chosen
        for row in range(batch):
            if done[row]:
                continue
            if eot is not None and chosen[row] == eot:
                done[row] = True
            else:
                tokens[row].append(int(chosen[row]))
        if done.all():
            break
        logits, cache = stepper.step(ids, cache, fixed)
        picked = pick(logits, bias)
        if eot is not None:
            done_device |= ids == eot
            picked = cupy.where(done_device, eot, picked)
        ids = picked
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - start)
    return tokens


def top_candidates(logits_RV, bias, count: int) -> tuple:
    """(values, ids), NumPy (R, count): each row's ``count`` best log-probabilities of logits + bias (CuPy, on the
    GPU: log-softmax, then a partition) and their ids, best first (ties: the lower id)."""
    import cupy

    x = logits_RV.astype(cupy.float32)
    if bias is not None:
        x = x + bias
    top = x.max(axis=-1, keepdims=True)
    logprobs = x - top - cupy.log(cupy.exp(x - top).sum(axis=-1, keepdims=True))
    ids = cupy.argpartition(-logprobs, count - 1, axis=-1)[:, :count]
    values = cupy.take_along_axis(logprobs, ids, axis=-1)
    values, ids = cupy.asnumpy(values), cupy.asnumpy(ids)
    order = np.lexsort((ids, -values), axis=-1)
    return np.take_along_axis(values, order, axis=-1), np.take_along_axis(ids, order, axis=-1)


def bound_beam(stepper, first_logits, cache: Mapping[str, object], fixed: Mapping[str, object], beams: int,
               steps: int, eot: int, bias=None, first_bias=None, step_seconds: Optional[list] = None) -> List[List[int]]:  # fmt: skip
    """Beam search over ``stepper`` (module docstring) for at most ``steps`` tokens: ``first_logits`` (R, V) CuPy,
    the prompt's last logits, every row's ``cache`` its batch entry's prompt; ``first_bias`` the first choice's
    suppression bias (default ``bias``). Each batch entry's answer (end-of-text excluded)."""
    import cupy

    from mha_ep.decode.beam import BeamSearch
    from mha_ep.gpu_session.cuda_io import ortvalue_array

    rows = int(first_logits.shape[0])
    search = BeamSearch(rows // beams, beams, eot)
    sources, tokens = search.step_top(*top_candidates(first_logits, first_bias if first_bias is not None else bias,
                                                      beams + 1))  # fmt: skip
    for _ in range(steps - 1):
        if search.done:
            break
        start = time.perf_counter()
        order = cupy.asarray(sources)
        reordered = {n: cupy.take(ortvalue_array(v) if hasattr(v, "data_ptr") else v, order, axis=0)
                     for n, v in cache.items()}  # fmt: skip
        cupy.cuda.get_current_stream().synchronize()  # ORT's stream does not wait for CuPy's
        logits, cache = stepper.step(cupy.asarray(tokens)[:, None], reordered, fixed)
        sources, tokens = search.step_top(*top_candidates(logits[:, -1, :], bias, beams + 1))
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - start)
    return search.result()
