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
from mha_ep.partition import PartitionResult, needs_external_data, partition, write_model

class InferenceSession:
    def __init__(
        self,
        model,
        backend: str = "auto",
        device_id: int = 0,
        sess_options=None,
        providers: Optional[Sequence] = None,
        lift_attention: bool = False,
    ):
        import onnxruntime as ort

        self.partition: PartitionResult = partition(model, lift_attention=lift_attention)
        self.backend = resolve_backend(backend, device_id)
        self.device_id = device_id
        options = sess_options if sess_options is not None else ort.SessionOptions()
        # The per-run context reaches the op only on the calling thread: keep ORT's sequential executor.
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        attach(options, self.backend)
        self._session = _make_session(self.partition.model, options, providers or ["CPUExecutionProvider"])

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
        return own_run_options(run_options)

    def _guarded(self, call, options):
        """Run ``call`` with this session's backend on this thread; turn a claimed node's error into MhaRunError,
        and a Ctrl-C that reached a claimed node into KeyboardInterrupt once ORT has stopped the run."""
        with run_context(self.backend, options) as context:
            try:
                result = call()
            except Exception as error:
                if context.interrupted:
                    raise KeyboardInterrupt from None
                if context.errors:
                    node, message = context.errors[0]
                    raise MhaRunError(node, message) from error
                raise
        if context.interrupted:
            raise KeyboardInterrupt
        if context.errors:
            node, message = context.errors[0]
            raise MhaRunError(node, message)
        return result

    def __getattr__(self, name):
        return getattr(self._session, name)


# Run config entries that ORT 1.31.1's CPU and CUDA providers read (onnxruntime_run_options_config_keys.h). ORT
# cannot list a RunOptions' entries and answers a missing one with an exception (about 25 us each), so these are
# the ones own_run_options looks for; the QNN entries, any others, and active LoRA adapters are not carried over.
RUN_CONFIG_KEYS = (
    "memory.enable_memory_arena_shrinkage",
    "disable_synchronize_execution_providers",
    "gpu_graph_id",
)
RUN_OPTION_FIELDS = ("log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches", "terminate")


def own_run_options(caller=None):
    """A RunOptions for one run, carrying the caller's readable settings.

    The error channel sets ``terminate`` on the run's RunOptions (mha_ep/ops/context.py); on a RunOptions the
    caller shares between threads that would cancel the other threads' runs, so every run gets its own. Carried
    over: RUN_OPTION_FIELDS and the RUN_CONFIG_KEYS entries the caller set. Not carried: other config entries and
    active adapters (ORT cannot read them back), and a ``terminate`` the caller sets on its own object once the
    run has started (it no longer cancels the run).
    """
    import onnxruntime as ort

    own = ort.RunOptions()
    if caller is None:
        return own
    for name in RUN_OPTION_FIELDS:
        setattr(own, name, getattr(caller, name))
    for key in RUN_CONFIG_KEYS:
        try:
            value = caller.get_run_config_entry(key)
        except Exception:  # noqa: BLE001 - ORT raises for an entry that was not set
            continue
        own.add_run_config_entry(key, value)
    return own


def _make_session(model: onnx.ModelProto, options, providers):
    import onnxruntime as ort

    if not needs_external_data(model):
        return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))
    with tempfile.TemporaryDirectory(prefix="mha_ep_") as folder:  # over 2 GiB: through a file and its data
        path = os.path.join(folder, "model.onnx")
        write_model(model, path)
        return ort.InferenceSession(path, options, providers=list(providers))
