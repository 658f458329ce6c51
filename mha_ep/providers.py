"""ONNX Runtime's execution-provider arguments, read and adjusted: small pure functions over the ``providers`` and
``provider_options`` a caller gives ``mha_ep.InferenceSession`` (onnxruntime's two ways of passing options:
``("Name", {options})`` in ``providers``, or a parallel ``provider_options`` list); and the one reader of an
options object's config entry (config_entry).

Every function that adjusts them works on copies: the caller's lists and dictionaries stay as they were (a server
reuses them for the next session).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence

CUDA_PROVIDER = "CUDAExecutionProvider"


def config_entry(get, key: str) -> Optional[str]:
    """``get(key)`` of an ORT options object (``SessionOptions.get_session_config_entry``,
    ``RunOptions.get_run_config_entry``), or None where the entry is not set: ORT raises for one that is not, and
    cannot list them."""
    try:
        return get(key)
    except Exception:  # noqa: BLE001 - ORT raises when the entry does not exist
        return None


def provider_names(providers: Optional[Sequence]) -> list:
    """Provider names from onnxruntime's forms: "Name" or ("Name", {options})."""
    return [p[0] if isinstance(p, (tuple, list)) else p for p in (providers or [])]


def cuda_options_of(providers: Optional[Sequence], provider_options: Optional[Sequence]) -> dict:
    """A copy of the caller's CUDA provider options, from either of onnxruntime's two ways of passing them."""
    names = provider_names(providers)
    for provider in providers or []:
        if isinstance(provider, (tuple, list)) and provider[0] == CUDA_PROVIDER and len(provider) > 1:
            return dict(provider[1])
    if provider_options and CUDA_PROVIDER in names:
        return dict(provider_options[names.index(CUDA_PROVIDER)] or {})
    return {}


def on_one_device(device_id: Optional[int], providers, provider_options) -> tuple:
    """(device id, providers, provider_options) with the cuda backend and ORT's CUDA provider on one GPU.

    ``device_id`` None: the CUDA provider's own ``device_id`` option (0 without one). Given: the CUDA provider's
    ``device_id`` is set to it where the caller left it out (on copies: the caller's lists stay as they were), and a
    different one there raises ValueError (the op would launch on one GPU and ORT keep its buffers on another)."""
    names = provider_names(providers)
    options = cuda_options_of(providers, provider_options)
    if "device_id" in options:
        theirs = int(options["device_id"])
        if device_id is not None and int(device_id) != theirs:
            raise ValueError(f"mha_ep.InferenceSession: device_id={device_id} but the CUDA provider's options say "
                             f"device_id={options['device_id']!r}; give one of them, or the same GPU in both")  # fmt: skip
        return theirs, providers, provider_options
    if device_id is None:
        return 0, providers, provider_options
    if CUDA_PROVIDER not in names or int(device_id) == 0:
        return int(device_id), providers, provider_options
    options["device_id"] = str(int(device_id))
    return (int(device_id), *with_cuda_options(providers, provider_options, options))


def with_cuda_options(providers, provider_options, options: dict) -> tuple:
    """(providers, provider_options): copies of the caller's, the CUDA provider's options replaced by ``options``
    (in whichever of onnxruntime's two ways the caller passed them)."""
    names = provider_names(providers)
    if provider_options is not None:
        provider_options = [dict(o or {}) for o in provider_options]
        provider_options[names.index(CUDA_PROVIDER)] = options
        return names, provider_options
    return [(CUDA_PROVIDER, options) if name == CUDA_PROVIDER else p for name, p in zip(names, providers)], None


def wants_cuda_graph(providers, provider_options) -> bool:
    """Whether the caller turned on ORT's ``enable_cuda_graph`` for the CUDA provider."""
    value = cuda_options_of(providers, provider_options).get("enable_cuda_graph", "0")
    return str(value).lower() not in ("0", "false", "")


def with_session_stream(providers, provider_options, device_id: int) -> tuple:
    """(providers, provider_options, stream, added): the CUDA provider's compute stream as a CuPy stream. The
    caller's own ``user_compute_stream`` where it gave one (``added`` False); else a new non-blocking stream of the
    session's, added to copies of the options (the caller's lists stay as they were). Only for sessions under
    ORT's CUDA graphs (ONE_STREAM_REPLAY, gpu_session/slots.py): their calls run one at a time anyway, and the copies around a replay then
    queue on the replay's own stream."""
    import cupy

    options = cuda_options_of(providers, provider_options)
    given = options.get("user_compute_stream")
    if given not in (None, "", "0", 0):
        with warnings.catch_warnings():  # CuPy 13 deprecates ExternalStream for stream objects; this is a pointer
            warnings.simplefilter("ignore", DeprecationWarning)
            return providers, provider_options, cupy.cuda.ExternalStream(int(given), device_id), False
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
    options.update({"user_compute_stream": str(stream.ptr), "has_user_compute_stream": "1"})
    return (*with_cuda_options(providers, provider_options, options), stream, True)


def without_cuda_graph(providers, provider_options, drop_stream: bool = False) -> tuple:
    """(providers, provider_options) with the CUDA provider's ``enable_cuda_graph`` taken out, and with
    ``drop_stream`` the ``user_compute_stream`` that with_session_stream added: eager calls run on streams of their
    own."""
    options = cuda_options_of(providers, provider_options)
    options.pop("enable_cuda_graph", None)
    if drop_stream:
        options.pop("user_compute_stream", None)
        options.pop("has_user_compute_stream", None)
    return with_cuda_options(providers, provider_options, options)


@dataclass(frozen=True)
class SessionProviders:
    """What a session's provider arguments say, read once (``read``): the providers and their options as ORT takes
    them (copies of the caller's; the CPU provider alone when none were given), the GPU, whether ORT's CUDA
    provider is among them, and whether its CUDA graph is on. ``with_stream`` and ``eager`` give the adjusted
    value a session needs; nothing reads the caller's lists again."""

    providers: tuple
    provider_options: Optional[tuple]
    device_id: int
    on_cuda: bool
    cuda_graph: bool

    @classmethod
    def read(cls, device_id: Optional[int], providers, provider_options) -> "SessionProviders":
        """The caller's arguments (onnxruntime's forms), put on one GPU (on_one_device: raises ValueError for two)."""
        device_id, providers, provider_options = on_one_device(device_id, providers, provider_options)
        providers = list(providers or ["CPUExecutionProvider"])
        return cls(tuple(providers), None if provider_options is None else tuple(provider_options), device_id,
                   CUDA_PROVIDER in provider_names(providers), wants_cuda_graph(providers, provider_options))  # fmt: skip

    def with_stream(self) -> tuple:
        """(these providers with the CUDA provider's compute stream set, that stream as a CuPy stream, whether it
        was added): with_session_stream."""
        providers, provider_options, stream, added = with_session_stream(self.providers, self.provider_options,
                                                                         self.device_id)  # fmt: skip
        return self._with(providers, provider_options), stream, added

    def eager(self, drop_stream: bool = False) -> "SessionProviders":
        """These providers without ORT's CUDA graph (and without the stream with_stream added): without_cuda_graph."""
        providers, provider_options = without_cuda_graph(self.providers, self.provider_options, drop_stream)
        return replace(self._with(providers, provider_options), cuda_graph=False)

    def _with(self, providers, provider_options) -> "SessionProviders":
        return replace(self, providers=tuple(providers),
                       provider_options=None if provider_options is None else tuple(provider_options))  # fmt: skip
