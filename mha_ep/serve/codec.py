"""What travels over HTTP: a request body to feeds, an answer or a failure to a reply. Pure functions of the
headers and the bytes; mha_ep/serve/deployment.py wraps them in Starlette's request and response.

Request: POST to the application's route, either
  JSON (Content-Type: application/json): {"inputs": {name: nested list, ...}, "outputs": [name, ...]}, "outputs"
       optional (all of the model's). Numbers take each input's element type where that loses nothing; where it
       would (a fraction for an integer input, a value out of range), the array keeps its own type and
       onnxruntime's type check answers.
  .npz (Content-Type: application/x-npz or application/octet-stream): one array per input, as np.savez writes.
  Either may name the outputs in the query instead: ?outputs=a,b. Without a Content-Type the body's first bytes
  decide (a zip archive is .npz).
Answer (200), in the format the Accept header names (application/json or application/x-npz), else the request's:
  JSON {"outputs": {name: nested list}, "dtypes": {name: dtype}, "run": {...}}: NaN and infinities as the bare
       tokens Python's json writes; a float32 value read back as float32 is the same bits.
  .npz one array per output, the run in the X-MHA-EP-Run header (JSON).
  "run" says how the run that answered went (engine.RunInfo: requests and rows in it, its padded length).
Failure (4xx, 5xx; status.py decides which), always JSON: {"error": {"type", "status", "message", "node"}}.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from mha_ep.serve.status import UNSUPPORTED_MEDIA_TYPE, RequestError, error_body

JSON, NPZ = "application/json", "application/x-npz"
NPZ_ALIASES = (NPZ, "application/octet-stream", "application/zip")
RUN_HEADER = "X-MHA-EP-Run"
ZIP_MAGIC = b"PK\x03\x04"
ORT_TO_NUMPY = {"float": "float32", "double": "float64"}  # onnxruntime's type names NumPy spells otherwise


@dataclass(frozen=True)
class Reply:
    """An HTTP reply as values: status, body bytes, media type, extra headers."""

    status: int
    body: bytes
    media_type: str
    headers: dict = field(default_factory=dict)


def media_type(header: Optional[str]) -> str:
    """"application/json; charset=utf-8" -> "application/json"; "" when absent."""
    return (header or "").split(";", 1)[0].strip().lower()


def request_format(content_type: Optional[str], body: bytes) -> str:
    """JSON or NPZ for a request body with ``content_type``; RequestError 415 naming both for any other type."""
    kind = media_type(content_type)
    if kind == JSON:
        return JSON
    if kind in NPZ_ALIASES:
        return NPZ
    if not kind:
        return NPZ if body.startswith(ZIP_MAGIC) else JSON
    raise RequestError(f"Content-Type {kind!r} is neither {JSON} nor {NPZ} (an np.savez archive)",
                       UNSUPPORTED_MEDIA_TYPE)  # fmt: skip


def reply_format(accept: Optional[str], asked_in: str) -> str:
    """The answer's format: the first of JSON or .npz that ``accept`` names, else the request's own."""
    for part in (accept or "").split(","):
        kind = media_type(part)
        if kind == JSON:
            return JSON
        if kind in NPZ_ALIASES:
            return NPZ
    return asked_in


def numpy_type(ort_type: str) -> Optional[np.dtype]:
    """The NumPy dtype of onnxruntime's "tensor(int64)"; None for what NumPy has no dtype for (bfloat16, ...)."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        return None
    name = ort_type[len("tensor("):-1]
    try:
        return np.dtype(ORT_TO_NUMPY.get(name, name))
    except TypeError:
        return None


def converts_exactly(array: np.ndarray, target: np.dtype) -> bool:
    """Whether ``array`` (as JSON numbers arrive: bool, int64, float64) takes ``target`` without losing anything
    a caller meant: booleans to bool, integers in range to integer types or to floats, floats to floats."""
    kind, to = array.dtype.kind, target.kind
    if array.size == 0:
        return True
    if kind == "b":
        return to == "b"
    if kind in "iu" and to in "iu":
        info = np.iinfo(target)
        return bool(array.min() >= info.min and array.max() <= info.max)
    if kind in "iu":
        return to == "f"
    return kind == "f" and to == "f"


def to_array(name: str, value, ort_type: Optional[str]) -> np.ndarray:
    """Input ``name``'s value (a NumPy array, or nested lists of numbers) as an array, in the model's element type
    ``ort_type`` where that loses nothing (converts_exactly); RequestError 400 for lists that are no rectangular
    array of numbers."""
    if isinstance(value, np.ndarray):
        return value
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:
        raise RequestError(f"input {name!r} is not a rectangular array of numbers: {error}") from None
    if array.dtype.kind not in "biuf":
        raise RequestError(f"input {name!r} is not a rectangular array of numbers (read as {array.dtype} "
                           f"of shape {array.shape})")  # fmt: skip
    target = numpy_type(ort_type) if ort_type else None
    return array.astype(target) if target is not None and converts_exactly(array, target) else array


def output_list(query: Optional[str]) -> Optional[list]:
    """?outputs=a,b -> ["a", "b"]; None when absent or empty."""
    names = [name.strip() for name in (query or "").split(",") if name.strip()]
    return names or None


def decode_request(content_type: Optional[str], body: bytes, outputs_query: Optional[str],
                   input_types: Mapping[str, str]) -> tuple:  # fmt: skip
    """(feeds, output names or None, the request's format) of a request body (module docstring); RequestError
    (400, or 415) when it cannot be read. ``input_types``: input name -> onnxruntime's type string."""
    kind = request_format(content_type, body)
    outputs = output_list(outputs_query)
    if kind == NPZ:
        return read_npz(body), outputs, kind
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise RequestError(f"the body is not JSON ({error}); send {JSON} or an np.savez archive as {NPZ}") from None
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        raise RequestError('the JSON body must be an object {"inputs": {name: array, ...}, "outputs": [name, ...]}')
    asked = data.get("outputs")
    if asked is not None and not (isinstance(asked, list) and all(isinstance(n, str) for n in asked)):
        raise RequestError(f'"outputs" must be a list of output names, got {asked!r}')
    feeds = {name: to_array(name, value, input_types.get(name)) for name, value in data["inputs"].items()}
    return feeds, asked or outputs, kind


def read_npz(body: bytes) -> dict:
    """An np.savez archive's arrays by name; RequestError 400 when it is not one (or holds Python objects)."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise RequestError(f"the body is not a readable .npz archive of arrays ({type(error).__name__}: {error})") \
            from None  # fmt: skip


def answer_reply(names, outputs, run: dict, kind: str) -> Reply:
    """A 200 reply with ``outputs`` (named ``names``) in format ``kind``, and the run's facts."""
    if kind == NPZ:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(names, outputs)))
        return Reply(200, buffer.getvalue(), NPZ, {RUN_HEADER: json.dumps(run)})
    body = {"outputs": {n: a.tolist() for n, a in zip(names, outputs)},
            "dtypes": {n: str(a.dtype) for n, a in zip(names, outputs)}, "run": run}  # fmt: skip
    return Reply(200, json.dumps(body).encode(), JSON)


def failure_reply(error: BaseException, status: int) -> Reply:
    """The JSON reply of a failed request (status.error_body)."""
    return Reply(status, json.dumps(error_body(error, status)).encode(), JSON)

