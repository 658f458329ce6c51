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
ID_TYPES = {np.dtype(np.int64): "long long", np.dtype(np.int32): "int"}  # the token input's type -> decode.cu's ID
DECODE_EXPRESSIONS = (tuple(f"greedy_step<{element}, {ids}>" for element in ("float", "__half", "__nv_bfloat16")
                            for ids in ID_TYPES.values())
                      + tuple(f"beam_rows<{element}>" for element in ("float", "__half", "__nv_bfloat16"))
                      + tuple(f"beam_select<{ids}>" for ids in ID_TYPES.values()))  # fmt: skip
DECODE_THREADS = 256  # decode.cu DECODE_THREADS
GREEDY_THREADS = 512  # decode.cu GREEDY_THREADS
MAX_CANDIDATES = 16  # decode.cu MAX_CANDIDATES
CHECK_EVERY = 8  # steps between two reads of "all rows done"
ELEMENT = {"tensor(float)": "float", "tensor(float16)": "__half", "tensor(bfloat16)": "__nv_bfloat16"}


def decode_function(device_id: int, name: str):
    """decode.cu's ``name`` (e.g. "greedy_step<float, long long>") compiled for ``device_id`` (that device current), once
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


NUMPY_TYPES = {"tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
               "tensor(float)": np.float32, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8}  # fmt: skip
ID_NAMES = ("input_ids", "decoder_input_ids")  # the token input, when the caller names none (else: the one int input)


def numpy_type(ort_type: str, name: str):
    """The NumPy element type of input or output ``name``'s ORT type string; MhaEpError for one CuPy cannot hold
    (bfloat16: a bfloat16 decoder is not one this loop binds)."""
    if ort_type not in NUMPY_TYPES:
        raise MhaEpError(f"{name} is {ort_type}: the static loop binds buffers of {sorted(NUMPY_TYPES)} only")
    return NUMPY_TYPES[ort_type]


@dataclass(frozen=True)
class DecoderNames:
    """Which of a static-cache decoder's inputs and outputs are what: the (past, present) cache pairs, the P and
    cache_indirection inputs, the token input and the logits output. ``pairs_from``: where the pairs came from
    (the rewrite's metadata, graph/static_cache_result.METADATA_KEY, or the present_X / past_X naming).
    ``entry_inputs``: the inputs of one row per batch entry, not per beam (the metadata's; rule SHARED_CROSS_KV)."""

    pairs: tuple
    past_sequence_length: str
    cache_indirection: Optional[str]
    ids: str
    logits: str
    pairs_from: str
    entry_inputs: tuple = ()


def decoder_names(inputs: Mapping[str, object], outputs: Mapping[str, object], metadata: Mapping[str, str],
                  ids: Optional[str] = None, logits: Optional[str] = None) -> DecoderNames:  # fmt: skip
    """The names of a static-cache decoder's parts (DecoderNames) from its inputs and outputs (name -> ORT NodeArg)
    and its metadata; ``ids`` / ``logits`` name the token input and logits output where the defaults (ID_NAMES or
    the one integer input besides P and cache_indirection; "logits") do not fit. MhaEpError naming what is missing."""
    from mha_ep.graph.static_cache_result import read_binding_facts

    facts = read_binding_facts(metadata)
    if facts is not None:
        pairs = tuple((layer[past], layer[present]) for layer in facts["self_layers"]
                      for past, present in (("past_key", "present_key"), ("past_value", "present_value")))  # fmt: skip
        p_name, ci_name, source = facts["past_sequence_length"], facts["cache_indirection"], "metadata"
        entry_inputs = tuple(facts.get("entry_inputs", ()))  # (a model stamped before 2026-12-07 has none)
    else:
        entry_inputs = ()
        pairs = tuple((name.replace("present_", "past_", 1), name) for name in outputs
                      if name.startswith("present_") and name.replace("present_", "past_", 1) in inputs)  # fmt: skip
        p_name, source = "past_sequence_length", "present_X / past_X names"
        ci_name = "cache_indirection" if "cache_indirection" in inputs else None
    if not pairs:
        raise MhaEpError("the decoder has no present output whose past is an input (no mha_ep static-cache metadata, "
                         "no present_X / past_X pair): nothing to cache. Rewrite it with mha-ep static-cache")  # fmt: skip
    for past, present in pairs:
        if past not in inputs or present not in outputs:
            raise MhaEpError(f"the decoder's metadata pairs past {past!r} with present {present!r}, but the model "
                             "lacks one of them: was it edited after mha-ep static-cache?")  # fmt: skip
    if p_name not in inputs:
        raise MhaEpError(f"the decoder has no input {p_name!r}: is it a static-cache decoder (mha-ep static-cache)?")
    own = {p_name, ci_name} | {past for past, _ in pairs}
    if ids is None:
        named = [n for n in ID_NAMES if n in inputs]
        integer = [n for n, v in inputs.items() if n not in own and v.type in ("tensor(int64)", "tensor(int32)")]
        found = named or integer
        if len(found) != 1:
            raise MhaEpError(f"which input takes the tokens? None is named {' or '.join(ID_NAMES)}, and the integer "
                             f"inputs are {integer}: name it (ids=...)")  # fmt: skip
        ids = found[0]
    if ids not in inputs:
        raise MhaEpError(f"the decoder has no input {ids!r} (ids=); its inputs: {sorted(inputs)}")
    if inputs[ids].type not in ("tensor(int64)", "tensor(int32)"):
        raise MhaEpError(f"input {ids!r} is {inputs[ids].type}: the token input must be int64 or int32")
    logits = logits or "logits"
    if logits not in outputs:
        raise MhaEpError(f"the decoder has no output {logits!r} (logits=); its outputs: {sorted(outputs)}")
    missing = [name for name in entry_inputs if name not in inputs]
    if missing:
        raise MhaEpError(f"the decoder's metadata names {missing} as inputs of one row per batch entry, but the "
                         "model lacks them: was it edited after mha-ep static-cache?")  # fmt: skip
    return DecoderNames(pairs, p_name, ci_name, ids, logits, source, entry_inputs)


class StaticDecoder:
    """A static-cache decoder session with every input and output bound once to buffers of its own (module
    docstring). ``batch`` entries of ``beams`` rows each (``beams`` > 0: the decoder takes cache_indirection,
    static_cache(..., beams=W)); the decoder's other inputs (``fixed``) have static shapes but their rows, or
    shapes given in ``fixed_shapes`` (name -> shape, e.g. an encoder length the model leaves symbolic). Any decoder
    ``mha-ep static-cache`` wrote: its caches, P and cache_indirection inputs come from the rewrite's metadata, and
    so do the inputs of one row per batch entry (``--shared-cross-kv``: the encoder's keys and values, unrepeated);
    ``ids`` / ``logits`` name the token input and the logits output where they are not input_ids / logits.

    Its buffers are bound once (decode/binding.py's CapturedBinding): after the first step, binding another buffer
    raises CapturedBindingError, and the loops check before they start that ``fixed``, ``caches``, ``ids`` ... are
    still the bound arrays. New values go into the buffers (``set_inputs``, ``load_prompt``)."""

    def __init__(self, session, batch: int, *, stream, device_id: int = 0, beams: int = 0,
                 fixed_shapes: Optional[Mapping[str, tuple]] = None, ids: Optional[str] = None,
                 logits: Optional[str] = None):  # fmt: skip
        import cupy
        import onnxruntime as ort

        from mha_ep.decode.binding import CapturedBinding

        check_rows(batch, beams)
        self.session, self.stream, self.device_id = session, stream, device_id
        self.batch, self.beams = batch, beams
        self.rows = batch * max(beams, 1)
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        self.names = names = decoder_names(inputs, outputs, session.get_modelmeta().custom_metadata_map, ids, logits)
        if beams and names.cache_indirection is None:
            raise MhaEpError("the decoder has no cache_indirection input: beams need a decoder rewritten with beams "
                             "(mha-ep static-cache --beams W)")  # fmt: skip
        self.caches: List[SelfCache] = []
        with cupy.cuda.Device(device_id), stream:
            for past, present in names.pairs:
                declared = inputs[past].shape
                if isinstance(declared[0], int) and declared[0] != self.rows:
                    raise MhaInputError(f"input {past} holds {declared[0]} rows (shape {declared}), but batch x beams "
                                        f"= {batch} x {max(beams, 1)} = {self.rows}: make the decoder with "
                                        f"mha-ep static-cache --batch {self.rows}, or pass batch="
                                        f"{declared[0] // max(beams, 1)}")  # fmt: skip
                shape = [self.rows if i == 0 else d for i, d in enumerate(declared)]
                if not all(isinstance(d, int) for d in shape):
                    raise MhaEpError(f"input {past} has shape {declared}: a static-cache decoder's cache "
                                     f"has static heads, max_length and head size")  # fmt: skip
                self.caches.append(SelfCache(past, present, cupy.zeros(shape, numpy_type(inputs[past].type, past))))
            self.max_length = int(self.caches[0].buffer.shape[2])
            self.ids = cupy.zeros((self.rows, 1), numpy_type(inputs[names.ids].type, names.ids))
            self.id_type = ID_TYPES[self.ids.dtype]  # decode.cu's ID
            self.past_sequence_length = cupy.zeros((1,), cupy.int32)
            self.cache_indirection = cupy.zeros((batch, beams, self.max_length), cupy.int32) if beams else None
            vocab = outputs[names.logits].shape[-1]
            if not isinstance(vocab, int):
                raise MhaEpError(f"output {names.logits} has shape {outputs[names.logits].shape}: the vocabulary "
                                 "must be static")  # fmt: skip
            if outputs[names.logits].type not in ELEMENT:
                raise MhaEpError(f"output {names.logits} is {outputs[names.logits].type}: logits must be float, "
                                 "float16 or bfloat16")  # fmt: skip
            self.logits_element = ELEMENT[outputs[names.logits].type]
            self.logits = cupy.zeros((self.rows, 1, vocab), numpy_type(outputs[names.logits].type, names.logits))
            self.fixed = {}
            own = {names.ids, names.past_sequence_length, names.cache_indirection} | {c.past for c in self.caches}
            for name, value in inputs.items():
                if name in own:
                    continue
                rows = batch if name in names.entry_inputs else self.rows  # rule SHARED_CROSS_KV: one an entry
                shape = [rows if i == 0 else d for i, d in enumerate(value.shape)]
                shape = list((fixed_shapes or {}).get(name, shape))
                if shape and isinstance(value.shape[0], int) and shape[0] != value.shape[0]:
                    raise MhaInputError(f"input {name} is declared {value.shape}, and fixed_shapes gives it "
                                        f"{tuple(shape)}: its rows are {value.shape[0]}"
                                        + (" (one a batch entry: rule SHARED_CROSS_KV)"
                                           if name in names.entry_inputs else ""))  # fmt: skip
                if not all(isinstance(d, int) for d in shape):
                    raise MhaEpError(f"input {name} has shape {value.shape}: give its shape in fixed_shapes (a "
                                     f"static-cache decoder's buffers are made once)")  # fmt: skip
                self.fixed[name] = cupy.zeros(shape, numpy_type(value.type, name))
        stream.synchronize()  # the buffers are zeroed before ORT's first run reads them
        self.binding = CapturedBinding(session, device_id)
        for name, array in self.bound_inputs().items():
            self.binding.bind_input(name, array)
        # every other output (Whisper's output_cross_qk_<i>, for word timestamps): a buffer of its own, written by
        # every step's replay (read it between steps; a graph keeps the address it was captured with)
        self.other_outputs = {}
        kept = {names.logits} | {c.present for c in self.caches}
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
                self.other_outputs[name] = cupy.zeros(shape, numpy_type(out.type, name))
        for name, array in self.bound_outputs().items():
            self.binding.bind_output(name, array)
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.last_steps = 0  # decoder steps the last greedy_static / beam_static ran (end-of-text seen late)

    @classmethod
    def from_model(cls, model, batch: int, *, beams: int = 0, stream=None, device_id: int = 0,
                   fixed_shapes: Optional[Mapping[str, tuple]] = None, ids: Optional[str] = None,
                   logits: Optional[str] = None) -> "StaticDecoder":  # fmt: skip
        """A StaticDecoder over ``model`` (a path or ModelProto that mha-ep static-cache wrote) in its own plain ORT
        CUDA-graph session (cuda_session) on ``stream`` (default: a new non-blocking CuPy stream)."""
        import cupy

        check_rows(batch, beams)
        with cupy.cuda.Device(device_id):
            stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        session = cuda_session(model, stream, device_id=device_id)
        return cls(session, batch, stream=stream, device_id=device_id, beams=beams, fixed_shapes=fixed_shapes,
                   ids=ids, logits=logits)  # fmt: skip

    def bound_inputs(self) -> dict:
        """Input name -> the buffer bound to it (the arrays this decoder holds now)."""
        bound = {self.names.ids: self.ids, self.names.past_sequence_length: self.past_sequence_length, **self.fixed}
        if self.beams:
            bound[self.names.cache_indirection] = self.cache_indirection
        bound.update({cache.past: cache.buffer for cache in self.caches})
        return bound

    def bound_outputs(self) -> dict:
        """Output name -> the buffer bound to it."""
        return {**{cache.present: cache.buffer for cache in self.caches}, self.names.logits: self.logits,
                **self.other_outputs}  # fmt: skip

    def verify_buffers(self) -> None:
        """CapturedBindingError when an array this decoder holds (``fixed[name]``, a cache, ``ids``, ...) is no
        longer the buffer bound under its name, e.g. replaced by a new array instead of copied into: ORT's graph
        would replay over the old one."""
        self.binding.verify(self.bound_inputs(), self.bound_outputs())

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
        self.binding.run(self.run_options)

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


def check_rows(batch: int, beams: int) -> None:
    """A decoder's batch entries and beams: whole numbers, batch >= 1, beams 0 (greedy) or 2..MAX_CANDIDATES - 1."""
    for name, value, low in (("batch", batch, 1), ("beams", beams, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise MhaInputError(f"{name} must be a whole number >= {low}, got {value!r}")
    if beams >= MAX_CANDIDATES:
        raise MhaInputError(f"beam search takes at most {MAX_CANDIDATES - 1} beams (decode.cu MAX_CANDIDATES), got "
                            f"{beams}")  # fmt: skip


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
    if steps > decoder.max_length - prompt:  # the tokens at positions [prompt, prompt + steps) need cache rows
        raise MhaInputError(f"{steps} steps after a prompt of {prompt} positions need {prompt + steps} cache rows; the "
                            f"decoder's buffers hold max_length {decoder.max_length}: ask for at most "
                            f"{decoder.max_length - prompt} steps, or rewrite the decoder with a larger static-cache "
                            "--max-length")  # fmt: skip


def greedy_static(decoder: StaticDecoder, first_ids, prompt: int, steps: int, bias=None, eot: Optional[int] = None,
                  check_every: int = CHECK_EVERY) -> List[List[int]]:  # fmt: skip
    """Up to ``steps`` greedy tokens per row from the first ones ``first_ids`` ((R, 1) int64 on the GPU, the
    prompt's choice), after a prompt of ``prompt`` positions already in the cache (load_prompt). The same answer
    as generate.greedy: each row's tokens, the first included, a row stopping before ``eot``. MhaInputError before
    anything runs for a prompt the cache cannot hold, steps < 1, or first ids of another shape than (R, 1)."""
    check_decode_request(decoder, prompt, steps)
    if shape_of(first_ids) != (decoder.rows, 1):
        raise MhaInputError(f"first_ids has shape {shape_of(first_ids)}, expected (rows, 1) = ({decoder.rows}, 1)")
    decoder.verify_buffers()
    import cupy

    rows, limit = decoder.rows, decoder.max_length
    with cupy.cuda.Device(decoder.device_id), decoder.stream:
        tokens = cupy.full((rows, limit), -1, cupy.int64)
        tokens[:, prompt] = first_ids[:, 0]
        done = (first_ids[:, 0] == (eot if eot is not None else -1)).astype(cupy.uint8)
        done_all = cupy.zeros((1,), cupy.int32)
        arrived = cupy.zeros((1,), cupy.uint32)  # greedy_step's count of finished rows (its last block resets it)
        decoder.ids[...] = first_ids
        decoder.past_sequence_length[...] = prompt
        kernel = decode_function(decoder.device_id, f"greedy_step<{decoder.logits_element}, {decoder.id_type}>")
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
    decoder.verify_buffers()
    import cupy

    batch, beams, rows, limit = decoder.batch, decoder.beams, decoder.rows, decoder.max_length
    prompt = len(prompt_tokens)
    k = beams + 1
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
        select_kernel = decode_function(decoder.device_id, f"beam_select<{decoder.id_type}>")
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
