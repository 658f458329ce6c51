"""``mha_ep.InferenceSession``: partition + register + onnxruntime.InferenceSession, with a real error channel.

It behaves like ``onnxruntime.InferenceSession`` (``run``, ``get_inputs``, ``get_outputs``, ... are passed
through) and adds: the partition decisions, a backend bound to this session (``backend``, ``device_id``), and
errors from inside a claimed node raised as ``mha_ep.errors.MhaRunError`` with the node's message, after which
the session is still usable.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Optional, Sequence

import onnx

from mha_ep.errors import MESSAGE_PREFIX, MhaEpError, run_error, status_code_of
from mha_ep.engine.context import run_context
from mha_ep.engine.backends import resolve_backend
from mha_ep.registration import attach, choose_route
from mha_ep.graph.model_io import needs_external_data, write_model
from mha_ep.graph.partition import partition
from mha_ep.graph.partition_result import PartitionResult
from mha_ep.providers import CUDA_PROVIDER, SessionProviders, config_entry


class InferenceSession:
    """``onnxruntime.InferenceSession``'s signature, then mha_ep's own keywords.

    ``path_or_bytes``: a path, serialized model bytes, an ``onnx.ModelProto`` or a ``PartitionResult`` (already
    partitioned: used as it is). ``sess_options``, ``providers`` and ``provider_options`` go to onnxruntime as
    they would there (providers default to ``["CPUExecutionProvider"]``; ORT's execution mode is set to
    sequential, the one in which the per-run context reaches the op). Keyword-only: ``backend`` ("auto",
    "reference", "cuda"), ``device_id`` (the GPU: the cuda backend's and the CUDA provider's; on_one_device),
    ``lift_attention`` (rewrite
    com.microsoft::Attention into MultiHeadAttention first), ``route`` ("auto", "native", "python-op":
    registration.choose_route): mha_ep's native library (its CUDA kernels on ORT's buffers and stream) or the
    onnxruntime-extensions Python op. On the CUDA provider with the native route the session moves tensors
    through gpu_session/cuda_io.py: ``run`` with NumPy through page-locked memory, ``run_device`` with CuPy, and ORT's
    ``enable_cuda_graph`` (in the CUDA provider's options) as one graph per call signature; a session ORT refuses
    that graph for runs eagerly and says so (under it, ``run_device`` replays with no host wait: the workload of
    repeated shapes). ``device_mode`` is retired (check_device_mode). ``mode`` ("native" or "python-op") and
    ``mode_reason`` say which runs and why. Other keywords go to onnxruntime. Any number of threads may call
    ``run``, ``run_device`` and ``run_with_iobinding`` at once (gpu_session/cuda_io.py, "Threads").
    """

    def __init__(
        self,
        path_or_bytes,
        sess_options=None,
        providers: Optional[Sequence] = None,
        provider_options: Optional[Sequence[dict]] = None,
        *,
        backend: str = "auto",
        device_id: Optional[int] = None,
        lift_attention: bool = False,
        device_mode="auto",
        route: str = "auto",
        **kwargs,
    ):
        import onnxruntime as ort

        check_device_mode(device_mode)
        if isinstance(sess_options, str):
            raise TypeError(
                f"mha_ep.InferenceSession: the second argument is onnxruntime.SessionOptions (as in onnxruntime), "
                f"got the string {sess_options!r}; pass the backend by keyword: backend={sess_options!r}"
            )
        given = path_or_bytes if isinstance(path_or_bytes, PartitionResult) else None
        self.partition: Optional[PartitionResult] = given
        given_providers = SessionProviders.read(device_id, providers, provider_options)  # the one reading of them
        device_id = self.device_id = given_providers.device_id
        self._io = None
        self.mode_reason = ""
        self.backend = resolve_backend(backend, device_id)
        self.route, route_reason = choose_route(route, self.backend)
        self.mode = self.route
        if given is not None and given.route == "native" and self.route != "native":
            raise MhaEpError(f"mha_ep.InferenceSession: the PartitionResult was made with route='native', which only "
                             f"the native route runs, and this session takes the {self.route} route "
                             f"({route_reason})")  # fmt: skip
        if given is None and (self.partition is None or self.partition.route != self.route):
            form = "native" if self.route == "native" else "python-op"
            self.partition = partition(path_or_bytes, lift_attention=lift_attention, route=form)
        if given_providers.on_cuda and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # ORT silently drops to the CPU when its CUDA libraries do not load
        # The caller's options stay as they were (a server reuses them): the session's settings go on a copy.
        options = copy_session_options(sess_options) if sess_options is not None else ort.SessionOptions()
        # The per-run context reaches the op only on the calling thread: keep ORT's sequential executor.
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        attach(options, self.backend, self.route)
        chosen = given_providers
        graph_note = ""
        ort_stream, added = None, False
        native_cuda = chosen.on_cuda and self.route == "native" and self.backend.name == "cuda"
        if native_cuda and chosen.cuda_graph:
            # ONE_STREAM_REPLAY (gpu_session/slots.py): ORT's graphs run on a stream the session knows, so its copies
            # queue around a replay
            chosen, ort_stream, added = chosen.with_stream()
        try:
            self._session = _make_session(self.partition.model, options, chosen, **kwargs)
        except Exception as error:  # noqa: BLE001 - ORT refuses its CUDA graph when a node runs on the CPU
            if not chosen.cuda_graph:
                raise
            chosen = chosen.eager(drop_stream=added)
            ort_stream, added = None, False
            self._session = _make_session(self.partition.model, options, chosen, **kwargs)
            graph_note = f"; ORT refused its CUDA graph ({str(error).splitlines()[0][:200]}), so every call runs eagerly"
        if added:
            # the stream outlives ORT's session: the ORT object holds it, and releases it after its own C session
            # (this session sits in a reference cycle, whose collector may drop cuda_io first)
            self._session._mha_ep_compute_stream = ort_stream
        self.mode_reason = f"{route_reason}{graph_note}"
        if self.route == "native" and self.backend.name == "cuda" and CUDA_PROVIDER in self._session.get_providers():
            from mha_ep.gpu_session.cuda_io import CudaSessionIO, unsupported_tensors

            odd = unsupported_tensors(self._session)
            if odd:
                self.mode_reason += (f"; tensors {odd[:3]} have no CuPy dtype, so run() is ORT's own and "
                                     f"run_device is not offered")  # fmt: skip
            else:
                graphs = chosen.cuda_graph
                self._io = CudaSessionIO(self._session, device_id, graphs, self._run_binding,
                                         lambda: own_run_options(None), ort_stream=ort_stream)  # fmt: skip
                self.mode_reason += ("; one ORT CUDA session: NumPy feeds and outputs move through page-locked "
                                     "memory, run_device keeps them on the GPU"
                                     + ("; ORT's CUDA graph per call signature" if graphs else ""))  # fmt: skip

    @property
    def decisions(self):
        return self.partition.decisions

    @property
    def model(self) -> onnx.ModelProto:
        return self.partition.model

    def run(self, output_names, input_feed, run_options=None):
        """Like onnxruntime's ``run``; raises MhaRunError when a claimed node fails (the session stays usable). On
        the CUDA provider the feeds may also be CuPy arrays or anything with ``__dlpack__``; NumPy feeds go up and
        the outputs come down through page-locked memory (gpu_session/cuda_io.py)."""
        if self._io is not None:
            return self._io_call(self._io.run_host, output_names, input_feed, run_options)
        options = self._options(run_options)
        return self._guarded(lambda: self._session.run(output_names, input_feed, options), options)

    def run_device(self, output_names, input_feed, run_options=None) -> list:
        """Like ``run``, with the outputs left on the GPU as CuPy arrays over ORT's output buffers (a decode loop
        feeds them back, e.g. its KV cache, with no host round trip). Feeds: CuPy arrays, anything with
        ``__dlpack__``, or NumPy arrays (uploaded). Needs the native route on the CUDA provider."""
        if self._io is None:
            raise MhaEpError(f"run_device needs the native route on the CUDA provider; this session: {self.mode_reason}")
        return self._io_call(self._io.run_device, output_names, input_feed, run_options)

    @property
    def cuda_io(self):
        """How this session's calls move tensors on the GPU (gpu_session/cuda_io.py), or None off the CUDA provider."""
        return self._io

    @staticmethod
    def _io_call(method, output_names, input_feed, run_options):
        make_options = None if run_options is None else (lambda: own_run_options(run_options))
        return method(output_names, input_feed, make_options)

    def _run_binding(self, binding, options):
        """cuda_io's run (ort_calls.OrtCalls.run): an IOBinding, or a call standing in for one (ort_calls.DirectRun),
        with this session's error channel (a claimed node's failure comes back as MhaRunError with the status code
        the node gave it; through IOBinding ORT's own exception would only say RuntimeError)."""
        call = getattr(binding, "call", None)
        if call is not None:
            return self._guarded(call, options)
        return self._guarded(lambda: self._session.run_with_iobinding(binding, options), options)

    def run_with_iobinding(self, iobinding, run_options=None):
        """Like onnxruntime's ``run_with_iobinding``, with this session's backend and error channel. ORT's own call:
        under ``enable_cuda_graph`` one thread at a time, as ORT asks (``run`` and ``run_device`` serialize
        themselves and keep the ``gpu_graph_id`` values 1 to gpu_session/slots.py's MAX_GRAPHS: a RunOptions asking
        for one of those is refused, taken_graph_id)."""
        options = self._caller_run_options(run_options)
        return self._guarded(lambda: self._session.run_with_iobinding(iobinding, options), options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        """Like onnxruntime's ``run_with_ort_values``, with this session's backend and error channel (and
        ``run_with_iobinding``'s rule on ``gpu_graph_id``)."""
        options = self._caller_run_options(run_options)
        return self._guarded(
            lambda: self._session.run_with_ort_values(output_names, input_dict_ort_values, options), options
        )

    def _caller_run_options(self, run_options):
        """The run's own RunOptions for a run the caller makes itself; ValueError when it asks a graph session for a
        ``gpu_graph_id`` that ``run`` and ``run_device`` keep (taken_graph_id: read off the entries the copy
        carried, not looked up again)."""
        carried: dict = {}
        options = own_run_options(run_options, carried)
        if "gpu_graph_id" in carried and self._io is not None and self._io.graphs:
            from mha_ep.gpu_session.slots import MAX_GRAPHS

            reason = taken_graph_id(carried["gpu_graph_id"], MAX_GRAPHS)
            if reason is not None:
                raise ValueError(f"mha_ep.InferenceSession: {reason}")
        return options

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
                    raise context.first_error() from error
                reported = native_failure(str(error))
                if reported is not None:  # the native library's own report (a device-side check): no Python ran
                    raise run_error(*reported, status_code_of(error)) from error
                raise
        if context.interrupted:
            raise KeyboardInterrupt
        if context.errors:
            raise context.first_error()
        return result

    def __getattr__(self, name):  # get_inputs, get_outputs, get_providers, io_binding, ...: onnxruntime's own
        if name.startswith("__") or name == "_session":
            raise AttributeError(name)
        return getattr(self._session, name)


DEVICE_MODE_REPLACED = (
    "the native route under ORT's CUDA graphs runs as fast on every bench row (docs/BENCH.md, section 8): for "
    "repeated shapes pass providers=[('CUDAExecutionProvider', {'enable_cuda_graph': '1'}), 'CPUExecutionProvider'] "
    "and call run_device with CuPy feeds"
)


def check_device_mode(device_mode) -> None:
    """The retired ``device_mode`` keyword (device-resident mode, removed on 2026-12-04): "auto" (the default) says
    nothing; "python-op", False or None warn that it has no effect; "device" or True raise MhaEpError naming what
    replaced it; anything else is a ValueError."""
    if device_mode == "auto":
        return
    if device_mode is True or device_mode == "device":
        raise MhaEpError(f"mha_ep.InferenceSession: device_mode={device_mode!r}: device-resident mode was retired; "
                         f"{DEVICE_MODE_REPLACED}")  # fmt: skip
    if device_mode is False or device_mode is None or device_mode == "python-op":
        warnings.warn(f"mha_ep.InferenceSession: device_mode={device_mode!r} has no effect: the keyword is retired "
                      f"with device-resident mode; leave it out", DeprecationWarning, stacklevel=3)  # fmt: skip
        return
    raise ValueError(f"mha_ep.InferenceSession: device_mode is retired; it accepted 'auto', 'device' or "
                     f"'python-op', got {device_mode!r}")  # fmt: skip


NATIVE_FAILURE = re.compile(r"mha_ep MultiHeadAttention node '(.*?)': (.*)$", re.S)


def native_failure(text: str):
    """(node, message) of a claimed node's failure that the native library reported itself (its status text:
    "mha_ep MultiHeadAttention node '<node>': <message>", e.g. a past_sequence_length the kernels found out of
    range), or None."""
    found = NATIVE_FAILURE.search(text)
    return None if found is None else (found.group(1), MESSAGE_PREFIX + found.group(2).strip())


# Run config entries that ORT 1.31.1's CPU and CUDA providers read (onnxruntime_run_options_config_keys.h). ORT
# cannot list a RunOptions' entries and answers a missing one with an exception, which costs host time
# (docs/BENCH.md, "Host-side choices"), so these are
# the ones own_run_options looks for; the QNN entries, any others, and active LoRA adapters are not carried over.
RUN_CONFIG_KEYS = (
    "memory.enable_memory_arena_shrinkage",
    "disable_synchronize_execution_providers",
    "gpu_graph_id",
)
RUN_OPTION_FIELDS = ("log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches", "terminate")


def own_run_options(caller=None, carried: Optional[dict] = None):
    """A RunOptions for one run, carrying the caller's readable settings.

    The error channel sets ``terminate`` on the run's RunOptions (mha_ep/engine/context.py); on a RunOptions the
    caller shares between threads that would cancel the other threads' runs, so every run gets its own. Carried
    over: RUN_OPTION_FIELDS and the RUN_CONFIG_KEYS entries the caller set. Not carried: other config entries and
    active adapters (ORT cannot read them back), and a ``terminate`` the caller sets on its own object once the
    run has started (it no longer cancels the run). ``carried``, when given, receives the config entries copied.
    """
    import onnxruntime as ort

    own = ort.RunOptions()
    if caller is None:
        return own
    for name in RUN_OPTION_FIELDS:
        setattr(own, name, getattr(caller, name))
    copied = _copy_entries(caller.get_run_config_entry, own.add_run_config_entry, RUN_CONFIG_KEYS)
    if carried is not None:
        carried.update(copied)
    return own


def taken_graph_id(value: Optional[str], kept: int) -> Optional[str]:
    """Why a caller's own run may not use ``gpu_graph_id`` ``value`` on a graph session whose ``run`` and
    ``run_device`` keep the ids 1 to ``kept`` for their signatures' graphs (ORT keys its graphs by id and thread, so
    on the thread that captured one it would replay that graph, over the slot's buffers, not the caller's binding);
    None for any other id, or none set."""
    try:
        graph_id = int(value) if value is not None else None
    except ValueError:
        return None  # ORT's own error for a malformed id
    if graph_id is None or not 1 <= graph_id <= kept:
        return None
    return (f"gpu_graph_id={graph_id} is one of the ids 1 to {kept} that this session's run and run_device keep for "
            f"their own CUDA graphs, and ORT would replay one of those instead of your binding: use an id above "
            f"{kept}, or -1 for no graph")  # fmt: skip


def _copy_entries(get, add, keys) -> dict:
    """``add(key, get(key))`` for each of ``keys`` that is set (providers.config_entry); the entries copied."""
    copied = {}
    for key in keys:
        value = config_entry(get, key)
        if value is not None:
            add(key, value)
            copied[key] = value
    return copied


# Session config entries ORT 1.31.1 reads (onnxruntime_session_options_config_keys.h and the CUDA provider's, as
# named in its library). ORT cannot list a SessionOptions' entries and answers a missing one with an exception, so
# copy_session_options looks for these; mha_ep's own entries (registration.CONFIG_ROUTE, CONFIG_BACKEND) are not
# copied: they record a library registered on the caller's options, which the copy registers anew.
SESSION_CONFIG_KEYS = (
    "ep.context_embed_mode", "ep.context_enable", "ep.context_file_path",
    "ep.context_model_external_initializers_file_name", "ep.cuda.fpa_intb_gemm", "ep.cuda.fpa_intb_profile_m",
    "ep.cuda.gqa_workspace_max_total_sequence_length", "ep.enable_weightless", "mlas.disable_kleidiai",
    "mlas.kleidiai.conv_igemm_max_work", "mlas.nchwc_depthwise_sliding",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch", "mlas.qnbit.force_fp32", "mlas.use_lut_gemm",
    "optimization.constant_folding_max_output_size_in_bytes", "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination", "optimization.enable_gelu_approximation",
    "optimization.minimal_build_optimizations", "session.allow_released_opsets_only",
    "session.collect_node_memory_stats_to_file", "session.compile_only", "session.debug_layout_transformation",
    "session.disable_aot_function_inlining", "session.disable_cpu_ep_fallback", "session.disable_double_qdq_remover",
    "session.disable_model_compile", "session.disable_prepacking", "session.disable_qdq_constant_folding",
    "session.disable_quant_qdq", "session.dynamic_block_base", "session.enable_dq_matmulnbits_fusion",
    "session.enable_moe_expert_counting", "session.enable_moe_expert_statistics", "session.enable_quant_qdq_cleanup",
    "session.fail_on_suboptimal_compiled_model", "session.force_spinning_stop",
    "session.function_expansion_byte_limit", "session.function_expansion_node_limit", "session.gqa_value_layout",
    "session.graph_optimizations_loop_level", "session.inter_op.allow_spinning", "session.inter_op.spin_backoff_max",
    "session.inter_op.spin_duration_us", "session.intra_op.allow_spinning", "session.intra_op.spin_backoff_max",
    "session.intra_op.spin_duration_us", "session.intra_op_thread_affinities", "session.layer_assignment_settings",
    "session.load_model_format", "session.max_shape_override", "session.moe_expert_counter_alpha",
    "session.moe_expert_counter_beta", "session.moe_expert_counter_state_file", "session.name_based_layer_assignment",
    "session.node_partition_config_file", "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes", "session.prepack.enable_parallel",
    "session.qdq_matmulnbits_accuracy_level", "session.qdq_matmulnbits_block_size", "session.qdqisint8allowed",
    "session.record_ep_graph_assignment_info", "session.resource_cuda_partitioning_settings",
    "session.save_external_prepacked_constant_initializers", "session.save_model_format",
    "session.set_denormal_as_zero", "session.strict_shape_type_inference", "session.strict_workspace_verification",
    "session.use_device_allocator_for_initializers", "session.use_env_allocators",
    "session.use_external_initializer_file_buffers_directly", "session.use_ort_model_bytes_directly",
    "session.use_ort_model_bytes_for_initializers", "session.x64quantprecision",
)  # fmt: skip


def copy_session_options(options):
    """A new onnxruntime.SessionOptions with ``options``' readable settings, ``options`` left untouched.

    Copied: every property ORT lets Python set (execution mode, threads, optimization level, logging, profiling,
    ...) and the SESSION_CONFIG_KEYS entries. ORT cannot read back, so cannot copy: custom-op libraries registered
    with ``register_custom_ops_library``, initializers (``add_initializer``, ``add_external_initializers``),
    free-dimension overrides and other config entries. Execution providers added with ``add_provider`` raise
    ValueError: pass them as ``providers`` instead.
    """
    import onnxruntime as ort

    if options.has_providers():
        raise ValueError("mha_ep.InferenceSession: these SessionOptions carry execution providers added with "
                         "add_provider, which onnxruntime cannot copy; pass them as providers=[...] instead")  # fmt: skip
    own = ort.SessionOptions()
    for name, attribute in vars(type(options)).items():
        if isinstance(attribute, property) and attribute.fset is not None:
            setattr(own, name, getattr(options, name))
    _copy_entries(options.get_session_config_entry, own.add_session_config_entry, SESSION_CONFIG_KEYS)
    return own


def _make_session(model: onnx.ModelProto, options, chosen: SessionProviders, **kwargs):
    import onnxruntime as ort

    providers = chosen.providers
    if chosen.provider_options is not None:
        kwargs["provider_options"] = list(chosen.provider_options)
    if not needs_external_data(model):
        return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers), **kwargs)
    with tempfile.TemporaryDirectory(prefix="mha_ep_") as folder:  # over 2 GiB: through a file and its data
        path = os.path.join(folder, "model.onnx")
        write_model(model, path)
        return ort.InferenceSession(path, options, providers=list(providers), **kwargs)
