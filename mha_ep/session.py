"""``mha_ep.InferenceSession``: partition + register + onnxruntime.InferenceSession, with a real error channel.

It behaves like ``onnxruntime.InferenceSession`` (``run``, ``get_inputs``, ``get_outputs``, ... are passed
through) and adds: the partition decisions, a backend bound to this session (``backend``, ``device_id``), and
errors from inside a claimed node raised as ``mha_ep.errors.MhaRunError`` with the node's message, after which
the session is still usable.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional, Sequence

import onnx

from mha_ep.errors import MhaEpError, MhaRunError
from mha_ep.ops.context import run_context
from mha_ep.ops.registration import attach, resolve_backend
from mha_ep.partition import PartitionResult, partition

PROTOBUF_LIMIT = 2**31 - 2**24  # serialise through a file above this size


class InferenceSession:
    """``onnxruntime.InferenceSession``'s signature, then mha_ep's own keywords.

    ``path_or_bytes``: a path, serialized model bytes, an ``onnx.ModelProto`` or a ``PartitionResult`` (already
    partitioned: used as it is). ``sess_options``, ``providers`` and ``provider_options`` go to onnxruntime as
    they would there (providers default to ``["CPUExecutionProvider"]``; ORT's execution mode is set to
    sequential, the one in which the per-run context reaches the op). Keyword-only: ``backend`` ("auto",
    "reference", "cuda"), ``device_id`` (the GPU of the cuda backend), ``lift_attention`` (rewrite
    com.microsoft::Attention into MultiHeadAttention first).
    """

    def __init__(
        self,
        path_or_bytes,
        sess_options=None,
        providers: Optional[Sequence] = None,
        provider_options: Optional[Sequence[dict]] = None,
        *,
        backend: str = "auto",
        device_id: int = 0,
        lift_attention: bool = False,
        **kwargs,
    ):
        import onnxruntime as ort

        if isinstance(sess_options, str):
            raise TypeError(
                f"mha_ep.InferenceSession: the second argument is onnxruntime.SessionOptions (as in onnxruntime), "
                f"got the string {sess_options!r}; pass the backend by keyword: backend={sess_options!r}"
            )
        if isinstance(path_or_bytes, PartitionResult):
            self.partition: PartitionResult = path_or_bytes
        else:
            self.partition = partition(path_or_bytes, lift_attention=lift_attention)
        self.backend = resolve_backend(backend, device_id)
        self.device_id = device_id
        options = sess_options if sess_options is not None else ort.SessionOptions()
        # The per-run context reaches the op only on the calling thread: keep ORT's sequential executor.
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        attach(options, self.backend, device_id)
        self._session = _make_session(
            self.partition.model, options, providers or ["CPUExecutionProvider"], provider_options, **kwargs
        )

    @property
    def decisions(self):
        return self.partition.decisions

    @property
    def model(self) -> onnx.ModelProto:
        return self.partition.model

    def run(self, output_names, input_feed, run_options=None):
        """Like onnxruntime's ``run``; raises MhaRunError when a claimed node fails (the session stays usable)."""
        options = self._options(run_options)
        return self._guarded(lambda: self._session.run(output_names, input_feed, options), options)

    def run_with_iobinding(self, iobinding, run_options=None):
        """Like onnxruntime's ``run_with_iobinding``, with this session's backend and error channel."""
        options = self._options(run_options)
        return self._guarded(lambda: self._session.run_with_iobinding(iobinding, options), options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        """Like onnxruntime's ``run_with_ort_values``, with this session's backend and error channel."""
        options = self._options(run_options)
        return self._guarded(
            lambda: self._session.run_with_ort_values(output_names, input_dict_ort_values, options), options
        )

    def run_async(self, *args, **kwargs):
        raise MhaEpError(
            "mha_ep.InferenceSession.run_async is not supported: ORT runs it on a thread of its own, where this "
            "session's backend and error channel cannot follow; call run() from a thread of yours instead"
        )

    @staticmethod
    def _options(run_options):
        import onnxruntime as ort

        return run_options if run_options is not None else ort.RunOptions()

    def _guarded(self, call, options):
        """Run ``call`` with this session's backend on this thread; turn a claimed node's error into MhaRunError."""
        with run_context(self.backend, options) as context:
            try:
                result = call()
            except Exception as error:
                if context.errors:
                    options.terminate = False
                    node, message = context.errors[0]
                    raise MhaRunError(node, message) from error
                raise
        if context.errors:
            options.terminate = False
            node, message = context.errors[0]
            raise MhaRunError(node, message)
        return result

    def __getattr__(self, name):
        return getattr(self._session, name)


def _make_session(model: onnx.ModelProto, options, providers, provider_options=None, **kwargs):
    import onnxruntime as ort

    if provider_options is not None:
        kwargs["provider_options"] = list(provider_options)
    if model.ByteSize() < PROTOBUF_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers), **kwargs)
    with tempfile.TemporaryDirectory(prefix="mha_ep_") as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(path, options, providers=list(providers), **kwargs)
