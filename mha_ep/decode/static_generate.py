"""The static decode loop for any decoder ``mha-ep static-cache`` wrote: the caller gives the decoder's fixed inputs
(the encoder's outputs: cross-attention keys and values, or the encoder's hidden states) and the prompt's token
ids; ``generate_static`` fills the cache by stepping the prompt through the decoder (one graph replay a position),
then runs the greedy or beam loop of static_decode.py (one replay and one token-choice kernel a step).

    decoder = StaticDecoder.from_model("decoder_static.onnx", batch=2)            # beams=5 for beam search
    tokens = generate_static(decoder, [[50257, 50362], [50257, 50362]], 64,
                             inputs={"past_key_cross_0": ..., ...}, eot=50256, suppress=[...])

Greedy returns each row's new tokens (the prompt excluded, end-of-text and what follows it excluded); beam search
each batch entry's answer (mha_ep/decode/beam.py's rules). Nothing runs before every check has passed
(``check_generate_request``): a prompt or inputs of the wrong rows, a prompt that leaves no room, or more new
tokens than the cache holds are MhaInputError naming the value, the shape and what was expected.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

import numpy as np

from mha_ep.errors import MhaInputError


def prompt_array(prompt) -> np.ndarray:
    """The prompt as a (rows, P0) int64 array; MhaInputError for ragged rows, an empty prompt or non-integers."""
    try:
        array = np.asarray(prompt)
    except ValueError:  # ragged lists (NumPy 1.24+)
        array = None
    if array is None or array.dtype == object or array.ndim != 2:
        got = describe(prompt) if array is None or array.dtype == object else f"shape {array.shape}"
        raise MhaInputError("prompt must be token ids of one length per row, (rows, P0) (a list of equal-length "
                            f"lists or a 2-D array); got {got}")  # fmt: skip
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise MhaInputError(f"prompt must hold integer token ids, got {array.dtype}")
    if array.shape[1] < 1:
        raise MhaInputError(f"prompt has shape {array.shape}: at least one position per row is needed")
    return array.astype(np.int64)


def describe(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"shape {tuple(shape)}"
    if isinstance(value, (list, tuple)):
        return f"rows of lengths {[len(v) if hasattr(v, '__len__') else 'scalar' for v in value][:8]}"
    return type(value).__name__


def rows_for(name: str, rows: int, batch: int, beams: int) -> None:
    """A per-row value (``name``) holds a row per batch entry or a row per decoder row (batch x beams)."""
    decoder_rows = batch * max(beams, 1)
    if rows not in (batch, decoder_rows):
        beam_words = f" or batch x beams = {batch} x {beams} = {decoder_rows}" if beams else ""
        raise MhaInputError(f"{name} has {rows} rows; the decoder takes batch = {batch}{beam_words} rows")


def check_generate_request(decoder, prompt: np.ndarray, max_new_tokens: int,
                           inputs: Mapping[str, object]) -> None:  # fmt: skip
    """The checks before anything runs (module docstring), on shapes only."""
    from mha_ep.decode.static_decode import check_prompt_length, shape_of

    rows_for(f"prompt (shape {prompt.shape})", prompt.shape[0], decoder.batch, decoder.beams)
    check_prompt_length(prompt.shape[1], decoder.max_length)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise MhaInputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    room = decoder.max_length - prompt.shape[1]
    if max_new_tokens > room:
        raise MhaInputError(f"max_new_tokens {max_new_tokens} after a prompt of {prompt.shape[1]} positions needs "
                            f"{prompt.shape[1] + max_new_tokens} cache rows; the decoder's buffers hold max_length "
                            f"{decoder.max_length}: ask for at most {room}, or rewrite the decoder with a larger "
                            "static-cache --max-length")  # fmt: skip
    for name, value in inputs.items():
        if name not in decoder.fixed:
            raise MhaInputError(f"{name!r} is not one of the decoder's fixed inputs {sorted(decoder.fixed)}")
        got, want = shape_of(value), tuple(decoder.fixed[name].shape)
        if not got or got[1:] != want[1:]:
            raise MhaInputError(f"input {name!r} has shape {got}, expected (rows,) + {want[1:]}")
        if name in decoder.names.entry_inputs:
            if got[0] != decoder.batch:
                raise MhaInputError(f"input {name!r} has shape {got}: the decoder reads it one row per batch entry "
                                    f"(mha-ep static-cache --shared-cross-kv), {decoder.batch} rows, not one per "
                                    "beam: give each entry's rows once")  # fmt: skip
            continue
        rows_for(f"input {name!r} (shape {got})", got[0], decoder.batch, decoder.beams)


def generate_static(decoder, prompt, max_new_tokens: int, *, inputs: Optional[Mapping[str, object]] = None,
                    eot: Optional[int] = None, suppress: Sequence[int] = (),
                    suppress_first: Sequence[int] = ()) -> List[List[int]]:  # fmt: skip
    """Up to ``max_new_tokens`` tokens after ``prompt`` ((rows, P0) token ids: a row per batch entry, or per
    decoder row) over ``decoder`` (a StaticDecoder; greedy, or beam search when it was made with beams), its fixed
    inputs set from ``inputs`` (name -> CuPy or NumPy array, or an ORT value on the device, a row per batch entry or
    per decoder row; a row per batch entry for the inputs a ``--shared-cross-kv`` rewrite shares among beams).
    ``eot``: the end-of-text id (greedy: a row stops before it; beams: a finished sequence ends with it; required
    for beams). ``suppress``: token ids never chosen; ``suppress_first``: more ids never chosen
    as the first new token. Returns greedy's rows / beam search's batch entries, the prompt excluded."""
    prompt = prompt_array(prompt)
    inputs = dict(inputs or {})
    check_generate_request(decoder, prompt, max_new_tokens, inputs)
    if decoder.beams and eot is None:
        raise MhaInputError("beam search needs eot, the end-of-text id (a finished sequence ends with it)")
    import cupy

    from mha_ep.decode.generate import pick, suppression_bias
    from mha_ep.decode.static_decode import as_cupy, beam_static, greedy_static, shape_of

    decoder.verify_buffers()
    beams = max(decoder.beams, 1)
    per_row = np.arange(decoder.rows) // beams  # decoder row -> batch entry
    length = prompt.shape[1]
    vocab = decoder.logits.shape[-1]
    with cupy.cuda.Device(decoder.device_id), decoder.stream:
        values = {}
        for name, value in inputs.items():
            array = as_cupy(value)
            expand = shape_of(value)[0] != decoder.rows and name not in decoder.names.entry_inputs
            values[name] = array[cupy.asarray(per_row)] if expand else array
        decoder.set_inputs(values)
        rows_prompt = prompt[per_row] if prompt.shape[0] != decoder.rows else prompt
        steps_ids = cupy.asarray(rows_prompt.astype(decoder.ids.dtype))
        bias = suppression_bias(vocab, list(suppress), decoder.device_id)
        first_bias = suppression_bias(vocab, list(suppress) + list(suppress_first), decoder.device_id)
        if decoder.beams:
            decoder.cache_indirection[...] = 0  # the prompt: every row reads its own cache rows
        for position in range(length):  # the prompt into the cache, a replay a position
            decoder.ids[:, 0] = steps_ids[:, position]
            decoder.past_sequence_length.fill(position)
            decoder.step()
        decoder.check()
        if decoder.beams:
            return beam_static(decoder, decoder.logits[:, 0].copy(), [int(t) for t in prompt[0]], max_new_tokens,
                               eot, bias, first_bias)  # fmt: skip
        first = pick(decoder.logits, first_bias)
        return greedy_static(decoder, first, length, max_new_tokens, bias, eot)
