"""Generation over a static-cache decoder (mha_ep/graph/static_cache.py): a step is one replay of the decoder's CUDA
graph and one launch that chooses the tokens on the device; the host reads back only now and then.

    decoder = StaticDecoder(cuda_session(path, stream), batch, stream=stream)
    decoder.set_inputs(cross_kv); decoder.load_prompt(prompt_presents, 3)
    tokens = greedy_static(decoder, first_ids, prompt=3, steps=64, eot=EOT)          # or beam_static(...)

``StaticDecoder`` allocates every buffer once and binds it once (ORT's captured graph holds the addresses): the
self-attention cache (R, N, M, H) per layer, bound as both the past and the present (the kernels write only the
step's new row), ``past_sequence_length`` and ``input_ids`` on the device, cache_indirection (B, W, M) for beam
search, the logits, and every other input (Whisper's cross-attention keys and values, copied in by
``set_inputs``). The session runs on the caller's CuPy stream (ORT's ``user_compute_stream``)
with ORT's ``enable_cuda_graph``: its first runs capture the step, every later run replays it, whatever P is (the
attention kernels read P on the device). ``disable_synchronize_execution_providers`` keeps ORT from waiting for
the GPU, so the host queues steps ahead of it.

Between two replays kernels of decode.cu update, on the same stream: the tokens (``greedy_step``: argmax plus a
0 / -inf suppression bias, a block per row; ``beam_rows`` then ``beam_select``: beam search as
mha_ep/decode/beam.py, the cache indirection reordered), ``input_ids`` and ``past_sequence_length``. The host
reads one int (all rows done?) every ``check_every`` steps, and the tokens once at the end. A device report of a bad length or beam index (native.take_device_error) is
checked at each read and raised as MhaInputError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional

import numpy as np

from mha_ep.errors import MhaEpError, MhaInputError
from mha_ep.decode.beam import Finished, answers

KERNEL_FILE = Path(__file__).with_name("decode.cu")
DECODE_EXPRESSIONS = tuple(f"{kernel}<{element}>" for kernel in ("greedy_step", "beam_rows")
                           for element in ("float", "__half", "__nv_bfloat16")) + ("beam_select",)  # fmt: skip
DECODE_THREADS = 256  # decode.cu DECODE_THREADS
GREEDY_THREADS = 512  # decode.cu GREEDY_THREADS
MAX_CANDIDATES = 16  # decode.cu MAX_CANDIDATES
CHECK_EVERY = 8  # steps between two reads of "all rows done"
ELEMENT = {"tensor(float)": "float", "tensor(float16)": "__half", "tensor(bfloat16)": "__nv_bfloat16"}


def decode_function(device_id: int, name: str):
    """decode.cu's ``name`` (e.g. "greedy_step<float>") compiled for ``device_id`` (that device current), once
    (the engine's kernel cache: kernels.source_function)."""
    from mha_ep.engine.cuda.kernels import source_function

    return source_function(device_id, KERNEL_FILE, name, DECODE_EXPRESSIONS)


def cuda_session(model, stream, *, device_id: int = 0, graph: bool = True):
    """A plain ORT CUDA session of ``model`` (a path or ModelProto; a static-cache decoder, or the encoder and first
    decoder step beside it) on mha_ep's native route, on CuPy ``stream``, with ORT's CUDA graph unless
    ``graph=False``."""
    from mha_ep.registration import plain_session

    cuda = {"device_id": str(device_id), "enable_cuda_graph": "1" if graph else "0",
            "user_compute_stream": str(stream.ptr), "has_user_compute_stream": "1"}  # fmt: skip
    return plain_session(model, providers=[("CUDAExecutionProvider", cuda), "CPUExecutionProvider"])


@dataclass
class SelfCache:
    past: str
    present: str
    buffer: object  # CuPy (R, N, M, H)


class StaticDecoder:
    """A static-cache decoder session with every input and output bound once to buffers of its own (module
    docstring). ``batch`` entries of ``beams`` rows each (``beams`` > 0: the decoder takes cache_indirection,
    static_cache(..., beams=W)); the decoder's other inputs (``fixed``) have static shapes but their rows, or
    shapes given in ``fixed_shapes`` (name -> shape, e.g. an encoder length the model leaves symbolic)."""

    def __init__(self, session, batch: int, *, stream, device_id: int = 0, beams: int = 0,
                 fixed_shapes: Optional[Mapping[str, tuple]] = None):  # fmt: skip
        import cupy
        import onnxruntime as ort

        self.session, self.stream, self.device_id = session, stream, device_id
        self.batch, self.beams = batch, beams
        self.rows = batch * max(beams, 1)
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        for needed in ("input_ids", "past_sequence_length") + (("cache_indirection",) if beams else ()):
            if needed not in inputs:
                raise MhaEpError(f"the decoder has no input {needed!r}: is it a static-cache decoder "
                                 f"(mha-ep static-cache{' --beams' if needed == 'cache_indirection' else ''})?")  # fmt: skip
        if "logits" not in outputs:
            raise MhaEpError("the decoder has no output 'logits'")
        self.caches: List[SelfCache] = []
        with cupy.cuda.Device(device_id), stream:
            for name, out in outputs.items():
                past = name.replace("present_", "past_", 1)
                if not name.startswith("present_") or past not in inputs:
                    continue
                shape = [self.rows if i == 0 else d for i, d in enumerate(inputs[past].shape)]
                if not all(isinstance(d, int) for d in shape):
                    raise MhaEpError(f"input {past} has shape {inputs[past].shape}: a static-cache decoder's cache "
                                     f"has static heads, max_length and head size")  # fmt: skip
                dtype = np.float16 if "float16" in inputs[past].type else np.float32
                self.caches.append(SelfCache(past, name, cupy.zeros(shape, dtype)))
            if not self.caches:
                raise MhaEpError("the decoder has no present_X output whose past_X is an input: nothing to cache")
            self.max_length = int(self.caches[0].buffer.shape[2])
            self.ids = cupy.zeros((self.rows, 1), cupy.int64)
            self.past_sequence_length = cupy.zeros((1,), cupy.int32)
            self.cache_indirection = cupy.zeros((batch, beams, self.max_length), cupy.int32) if beams else None
            vocab = outputs["logits"].shape[-1]
            if not isinstance(vocab, int):
                raise MhaEpError(f"output logits has shape {outputs['logits'].shape}: the vocabulary must be static")
            self.logits_element = ELEMENT[outputs["logits"].type]
            dtype = {"float": np.float32, "__half": np.float16}.get(self.logits_element, np.float32)
            self.logits = cupy.zeros((self.rows, 1, vocab), dtype)
            self.fixed = {}
            own = {"input_ids", "past_sequence_length", "cache_indirection"} | {c.past for c in self.caches}
            for name, value in inputs.items():
                if name in own:
                    continue
                shape = [self.rows if i == 0 else d for i, d in enumerate(value.shape)]
                shape = list((fixed_shapes or {}).get(name, shape))
                if not all(isinstance(d, int) for d in shape):
                    raise MhaEpError(f"input {name} has shape {value.shape}: give its shape in fixed_shapes (a "
                                     f"static-cache decoder's buffers are made once)")  # fmt: skip
                dtype = {"tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(
                    value.type, np.float32)  # fmt: skip
                self.fixed[name] = cupy.zeros(shape, dtype)
        stream.synchronize()  # the buffers are zeroed before ORT's first run reads them
        self.binding = session.io_binding()
        bound = {"input_ids": self.ids, "past_sequence_length": self.past_sequence_length, **self.fixed}
        if beams:
            bound["cache_indirection"] = self.cache_indirection
        for cache in self.caches:
            bound[cache.past] = cache.buffer
        for name, array in bound.items():
            self.binding.bind_input(name, "cuda", device_id, array.dtype.type, list(array.shape), array.data.ptr)
        for cache in self.caches:
            array = cache.buffer
            self.binding.bind_output(cache.present, "cuda", device_id, array.dtype.type, list(array.shape),
                                     array.data.ptr)  # fmt: skip
        self.binding.bind_output("logits", "cuda", device_id, self.logits.dtype.type, list(self.logits.shape),
                                 self.logits.data.ptr)  # fmt: skip
        # every other output (Whisper's output_cross_qk_<i>, for word timestamps): a buffer of its own, written by
        # every step's replay (read it between steps; a graph keeps the address it was captured with)
        self.other_outputs = {}
        kept = {"logits"} | {c.present for c in self.caches}
        symbols = {}  # a symbolic dim of an input whose shape fixed_shapes gave (the encoder's length) -> its value
        for name, value in inputs.items():
            for dim, given in zip(value.shape, (fixed_shapes or {}).get(name, ())):
                if isinstance(dim, str):
                    symbols[dim] = int(given)
        with cupy.cuda.Device(device_id), stream:
            for name, out in outputs.items():
                if name in kept:
                    continue
                shape = [self.rows if i == 0 else symbols.get(d, d) for i, d in enumerate(out.shape)]
                if not all(isinstance(d, int) for d in shape):
                    raise MhaEpError(f"output {name} has shape {out.shape}: a static-cache decoder's outputs are "
                                     "bound once, so their shapes must be static")  # fmt: skip
                dtype = {"tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(
                    out.type, np.float32)  # fmt: skip
                array = self.other_outputs[name] = cupy.zeros(shape, dtype)
                self.binding.bind_output(name, "cuda", device_id, array.dtype.type, list(array.shape),
                                         array.data.ptr)  # fmt: skip
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.last_steps = 0  # decoder steps the last greedy_static / beam_static ran (end-of-text seen late)

    def set_inputs(self, values: Mapping[str, object]) -> None:
        """Copy ``values`` (name -> CuPy or NumPy array, or an ORT value on the device) into the decoder's fixed
        inputs (the buffers stay where the graph expects them)."""
        import cupy

        with cupy.cuda.Device(self.device_id), self.stream:
            for name, value in values.items():
                if name not in self.fixed:
                    raise MhaEpError(f"{name!r} is not one of the decoder's fixed inputs {sorted(self.fixed)}")
                self.fixed[name][...] = as_cupy(value)

    def load_prompt(self, presents: Mapping[str, object], length: int) -> None:
        """Rows [0, length) of every cache from the prompt's presents (name -> CuPy (R, N, length, H), the first
        decoder step's self-attention outputs); the rest of the cache is zeroed. MhaInputError, before any copy,
        for a prompt the cache cannot hold or a present missing or of another shape."""
        check_prompt_length(length, self.max_length)
        for cache in self.caches:
            if cache.present not in presents:
                raise MhaInputError(f"the prompt's presents lack {cache.present!r}; the decoder caches "
                                    f"{sorted(c.present for c in self.caches)}")  # fmt: skip
            got, rows = shape_of(presents[cache.present]), tuple(cache.buffer.shape)
            want = rows[:2] + (length,) + rows[3:]
            if got != want:
                raise MhaInputError(f"present {cache.present!r} has shape {got}, expected (R, N, length, H) = {want}")
        import cupy

        with cupy.cuda.Device(self.device_id), self.stream:
            for cache in self.caches:
                cache.buffer[...] = 0
                cache.buffer[:, :, :length] = as_cupy(presents[cache.present])

    def step(self) -> None:
        """One decoder step: a replay of its graph on the stream (queued; the host does not wait)."""
        self.session.run_with_iobinding(self.binding, self.run_options)

    def check(self) -> None:
        """Raise MhaInputError for a device report of a bad length or beam index since the last check (the
        report names the node; the kernels clamped the value, so no buffer was read or written out of bounds)."""
        from mha_ep import native

        report = native.take_device_error(self.device_id)
        if report is not None:
            raise MhaInputError(report)


def shape_of(value) -> tuple:
    """The shape of an ORT value (its ``shape()`` method), a CuPy or a NumPy array, read without a copy."""
    shape = value.shape
    return tuple(shape() if callable(shape) else shape)


def as_cupy(value):
    """A CuPy view of an ORT value on the device (native.cuda_io), a CuPy array as it is, a NumPy one uploaded."""
    import cupy

    if hasattr(value, "data_ptr"):
        from mha_ep.gpu_session.cuda_io import ortvalue_array

        return ortvalue_array(value)
    return cupy.asarray(value)


def _read_done(flag, stream) -> bool:
    stream.synchronize()
    return bool(int(flag.get()[0]))


def check_prompt_length(prompt: int, max_length: int) -> None:
    """A prompt of ``prompt`` positions must leave the cache of ``max_length`` rows at least one row to decode."""
    if isinstance(prompt, bool) or not isinstance(prompt, (int, np.integer)) or not 0 <= prompt < max_length:
        raise MhaInputError(f"a prompt of {prompt!r} positions does not fit the static cache of max_length "
                            f"{max_length} rows (at least one row must stay for decoding): rewrite the decoder with "
                            "a larger static-cache --max-length, or shorten the prompt")  # fmt: skip


def check_decode_request(decoder, prompt: int, steps: int) -> None:
    """The checks greedy_static and beam_static make before anything runs (MhaInputError naming the value)."""
    check_prompt_length(prompt, decoder.max_length)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise MhaInputError(f"steps must be a whole number >= 1, got {steps!r}")


def greedy_static(decoder: StaticDecoder, first_ids, prompt: int, steps: int, bias=None, eot: Optional[int] = None,
                  check_every: int = CHECK_EVERY) -> List[List[int]]:  # fmt: skip
    """Up to ``steps`` greedy tokens per row from the first ones ``first_ids`` ((R, 1) int64 on the GPU, the
    prompt's choice), after a prompt of ``prompt`` positions already in the cache (load_prompt). The same answer
    as generate.greedy: each row's tokens, the first included, a row stopping before ``eot``. MhaInputError before
    anything runs for a prompt the cache cannot hold, steps < 1, or first ids of another shape than (R, 1)."""
    check_decode_request(decoder, prompt, steps)
    if shape_of(first_ids) != (decoder.rows, 1):
        raise MhaInputError(f"first_ids has shape {shape_of(first_ids)}, expected (rows, 1) = ({decoder.rows}, 1)")
    import cupy

    rows, limit = decoder.rows, decoder.max_length
    steps = min(steps, limit - prompt)
    with cupy.cuda.Device(decoder.device_id), decoder.stream:
        tokens = cupy.full((rows, limit), -1, cupy.int64)
        tokens[:, prompt] = first_ids[:, 0]
        done = (first_ids[:, 0] == (eot if eot is not None else -1)).astype(cupy.uint8)
        done_all = cupy.zeros((1,), cupy.int32)
        arrived = cupy.zeros((1,), cupy.uint32)  # greedy_step's count of finished rows (its last block resets it)
        decoder.ids[...] = first_ids
        decoder.past_sequence_length[...] = prompt
        kernel = decode_function(decoder.device_id, f"greedy_step<{decoder.logits_element}>")
        bias_ptr = 0 if bias is None else bias.data.ptr
        decoder.last_steps = 0
        for step in range(1, steps):
            decoder.step()
            decoder.last_steps += 1
            kernel((rows,), (GREEDY_THREADS,), (decoder.logits, np.uint64(bias_ptr), np.int32(rows),
                                                np.int32(decoder.logits.shape[-1]), decoder.ids,
                                                decoder.past_sequence_length, done, tokens, np.int32(limit),
                                                np.int32(-1 if eot is None else eot), done_all, arrived))  # fmt: skip
            if step % check_every == 0:
                finished = _read_done(done_all, decoder.stream)
                decoder.check()
                if finished:
                    break
        decoder.stream.synchronize()
        decoder.check()
        chosen = cupy.asnumpy(tokens[:, prompt : prompt + steps])
    result = []
    for row in chosen:
        kept = []
        for token in row:
            if token < 0 or (eot is not None and token == eot):
                break
            kept.append(int(token))
        result.append(kept)
    return result


def beam_static(decoder: StaticDecoder, prompt_logits, prompt_tokens, steps: int, eot: int, bias=None,
                first_bias=None, check_every: int = CHECK_EVERY) -> List[List[int]]:  # fmt: skip
    """Beam search (mha_ep/decode/beam.py's rules) for ``steps`` tokens at most, every row's cache holding its
    batch entry's prompt (load_prompt). ``prompt_logits``: (R, V) CuPy, the logits of the prompt's last position;
    ``prompt_tokens``: the prompt's ids (its length P0); ``first_bias`` (default ``bias``): the suppression bias of
    the first choice. Returns each batch entry's answer (the sampled tokens, end-of-text excluded). MhaInputError
    before anything runs for a prompt the cache cannot hold, steps < 1, a decoder without beams, or prompt logits
    of another shape than (R, V)."""
    check_decode_request(decoder, len(prompt_tokens), steps)
    if not decoder.beams:
        raise MhaInputError("beam_static needs a decoder made with beams (static-cache --beams W, StaticDecoder(beams=W))")
    if len(shape_of(prompt_logits)) != 2 or shape_of(prompt_logits)[0] != decoder.rows:
        raise MhaInputError(f"prompt_logits has shape {shape_of(prompt_logits)}, expected (rows, vocabulary) with "
                            f"rows = batch x beams = {decoder.rows}")  # fmt: skip
    import cupy

    batch, beams, rows, limit = decoder.batch, decoder.beams, decoder.rows, decoder.max_length
    prompt = len(prompt_tokens)
    steps = min(steps, limit - prompt)
    k = beams + 1
    if k > MAX_CANDIDATES:
        raise MhaEpError(f"beam search takes at most {MAX_CANDIDATES - 1} beams, got {beams}")
    with cupy.cuda.Device(decoder.device_id), decoder.stream:
        tokens = cupy.full((rows, limit), -1, cupy.int64)
        tokens[:, :prompt] = cupy.asarray(np.asarray(prompt_tokens, np.int64))[None]
        scratch_tokens = cupy.empty_like(tokens)
        scratch_indirection = cupy.empty_like(decoder.cache_indirection)
        decoder.cache_indirection[...] = 0
        sum_logprob = cupy.full((rows,), -np.inf, cupy.float32)
        sum_logprob[::beams] = 0.0
        finished_score = cupy.zeros((batch, beams), cupy.float32)
        finished_length = cupy.zeros((batch, beams), cupy.int32)
        finished_tokens = cupy.zeros((batch, beams, limit), cupy.int64)
        finished_count = cupy.zeros((batch,), cupy.int32)
        done_all = cupy.zeros((1,), cupy.int32)
        decoder.logits[:, 0] = prompt_logits
        decoder.past_sequence_length[...] = prompt - 1
        row_kernel = decode_function(decoder.device_id, f"beam_rows<{decoder.logits_element}>")
        select_kernel = decode_function(decoder.device_id, "beam_select")
        candidate_lp = cupy.empty((rows, k), cupy.float32)
        candidate_token = cupy.empty((rows, k), cupy.int32)
        shared = 16 * rows  # beam_select's chosen rows: source and score (4 bytes each), token (8)

        def choose(bias):
            bias_ptr = np.uint64(0 if bias is None else bias.data.ptr)
            row_kernel((rows,), (DECODE_THREADS,), (decoder.logits, bias_ptr, np.int32(k),
                                                   np.int32(decoder.logits.shape[-1]), candidate_lp,
                                                   candidate_token))  # fmt: skip
            select_kernel((1,), (DECODE_THREADS,), (candidate_lp, candidate_token, np.int32(batch), np.int32(beams),
                                                    decoder.ids, decoder.past_sequence_length, sum_logprob, tokens,
                                                    scratch_tokens, decoder.cache_indirection, scratch_indirection,
                                                    finished_score, finished_length, finished_tokens, finished_count,
                                                    np.int32(prompt), np.int32(limit), np.int32(eot), done_all),
                          shared_mem=shared)  # fmt: skip

        choose(bias if first_bias is None else first_bias)  # the first tokens, from the prompt's logits
        decoder.last_steps = 0
        for step in range(1, steps):
            decoder.step()
            decoder.last_steps += 1
            choose(bias)
            if step % check_every == 0:
                finished = _read_done(done_all, decoder.stream)
                decoder.check()
                if finished:
                    break
        decoder.stream.synchronize()
        decoder.check()
        counts = cupy.asnumpy(finished_count)
        scores, lengths = cupy.asnumpy(finished_score), cupy.asnumpy(finished_length)
        finished_rows, live = cupy.asnumpy(finished_tokens), cupy.asnumpy(tokens)
        live_scores = cupy.asnumpy(sum_logprob)
        position = int(decoder.past_sequence_length.get()[0])
    finished = [[Finished([int(t) for t in finished_rows[b, i, prompt : prompt + lengths[b, i]]], float(scores[b, i]))
                 for i in range(counts[b])] for b in range(batch)]  # fmt: skip
    live_tokens = [[int(t) for t in live[r, prompt : position + 1]] for r in range(rows)]
    return answers(finished, live_tokens, live_scores, beams)
