"""One replica's model, without Ray: an mha_ep.InferenceSession, its batch plan (batching.py), each request
checked as onnxruntime's ``run`` checks it before it may join a batch, shared runs cut back into answers, and a
failed shared run retried one request at a time so that only a bad request gets an error. ``Coalescer`` runs the
engine on one thread and merges the batches that arrive while it is busy. Tests and the benchmark use the engine
in-process; mha_ep/serve/deployment.py puts it in a Ray Serve replica.

Outcomes are values: ``Answer`` (the outputs and how the run went) or ``Failure`` (the exception a Python caller
gets, and the HTTP status status.py gives it). Nothing here raises for a request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Union

import numpy as np

from mha_ep.native.ort_checks import call_error, invalid_argument
from mha_ep.serve.batching import Fit, assemble, fit, plan_batching, runs, split
from mha_ep.serve.codec import to_array
from mha_ep.serve.status import BAD_REQUEST, SERVER_ERROR, RequestError, run_status

CUDA_PROVIDER = "CUDAExecutionProvider"
EMBED_IDS = ((0, 2), (1, 4))  # EmbedLayerNormalization: (ids slot, table slot): word ids, segment ids


@dataclass(frozen=True)
class Request:
    """A request that onnxruntime's checks passed: its feeds, the outputs it wants (None: all), its Fit."""

    feeds: Mapping[str, np.ndarray]
    output_names: Optional[tuple]
    fit: Fit


@dataclass(frozen=True)
class RunInfo:
    """How the run that answered a request went: ``requests`` and ``rows`` in it, this request's ``position``
    among them, ``length`` the sequence length it ran at (padded to; None when the model is not padded), and
    ``retried`` when the shared run failed and this request was run again by itself."""

    requests: int
    position: int
    rows: int
    length: Optional[int]
    retried: bool = False

    def to_dict(self) -> dict:
        return {"requests": self.requests, "position": self.position, "rows": self.rows, "length": self.length,
                "retried": self.retried}  # fmt: skip


@dataclass(frozen=True)
class Answer:
    names: tuple
    outputs: tuple
    run: RunInfo


@dataclass(frozen=True)
class Failure:
    """``error``: what a Python caller gets raised (onnxruntime's own exception where onnxruntime decided);
    ``status``: its HTTP status; ``stage``: "read" (the body), "check" (before any run) or "run"."""

    error: BaseException
    status: int
    stage: str


Outcome = Union[Answer, Failure]


def embedding_guards(model) -> tuple:
    """(graph input, node name, vocabulary size) of every id input an EmbedLayerNormalization node reads (through
    Cast and Identity). Stock ORT CUDA's kernel reads an id outside its table out of bounds and the process loses
    its CUDA context (docs/GPU.md, "One thing mha_ep does not guard"), so a server on the CUDA provider checks them."""
    tables = {init.name: int(init.dims[0]) for init in model.graph.initializer if init.dims}
    origin = {value.name: value.name for value in model.graph.input}
    guards = []
    for node in model.graph.node:
        if node.op_type in ("Cast", "Identity") and node.input and node.input[0] in origin:
            origin[node.output[0]] = origin[node.input[0]]
        if node.op_type != "EmbedLayerNormalization":
            continue
        for ids, table in EMBED_IDS:
            if len(node.input) > table and node.input[ids] in origin and node.input[table] in tables:
                guards.append((origin[node.input[ids]], node.name, tables[node.input[table]]))
    return tuple(guards)


def guard_error(guards: Sequence[tuple], feeds: Mapping[str, np.ndarray]) -> Optional[Exception]:
    """onnxruntime CPU's own error for an id outside its embedding table (InvalidArgument, the node named), for
    the first guarded input that has one; None when every id is in range."""
    for name, node, size in guards:
        values = np.asarray(feeds[name])
        if values.size and (values.min() < 0 or values.max() >= size):
            return invalid_argument(f"Non-zero status code returned while running EmbedLayerNormalization node. "
                                    f"Name:'{node}' Status Message: input index out of range")  # fmt: skip
    return None


class Engine:
    """A model served by one replica. ``model``: an ONNX file (before partitioning); ``backend``, ``providers``,
    ``route``, ``device_id`` and ``sess_options`` as mha_ep.InferenceSession takes them."""

    def __init__(self, model, backend: str = "auto", providers: Sequence = ("CPUExecutionProvider",),
                 route: str = "auto", device_id: int = 0, sess_options=None):  # fmt: skip
        from mha_ep.graph.model_io import load_model
        from mha_ep.session import InferenceSession

        self.model_path = str(model)
        proto = load_model(self.model_path)
        self.plan = plan_batching(proto)
        self.session = InferenceSession(proto, sess_options, list(providers), backend=backend, device_id=device_id,
                                        route=route)  # fmt: skip
        self.inputs = self.session.get_inputs()
        self.input_types = {arg.name: arg.type for arg in self.inputs}
        self.output_names = tuple(arg.name for arg in self.session.get_outputs())
        on_cuda = CUDA_PROVIDER in self.session.get_providers()
        self.guards = embedding_guards(proto) if on_cuda else ()

    def describe(self) -> dict:
        return {"model": self.model_path, "mode": self.session.mode, "mode_reason": self.session.mode_reason,
                "providers": self.session.get_providers(), "inputs": dict(self.input_types),
                "outputs": list(self.output_names), "batching": self.plan.to_dict(),
                "guarded_ids": [name for name, _, _ in self.guards]}  # fmt: skip

    def request(self, feeds: Mapping, output_names: Optional[Sequence[str]] = None) -> Union[Request, Failure]:
        """The Request for ``feeds`` (NumPy arrays, or nested lists converted as codec.to_array does), or the
        Failure (400) onnxruntime's ``run`` would raise for them: call_error's checks (input names, element types,
        ranks, fixed dims, output names), then the embedding guards on the CUDA provider."""
        if not isinstance(feeds, Mapping):
            error = TypeError(f"input_feed must be a mapping of input name to array, got {type(feeds).__name__}")
            return Failure(error, BAD_REQUEST, "read")
        try:
            arrays = {name: to_array(name, value, self.input_types.get(name)) for name, value in feeds.items()}
        except RequestError as error:
            return Failure(error, error.status, "read")
        names = list(output_names) if output_names else None
        error = call_error(self.inputs, self.output_names, arrays, names) or guard_error(self.guards, arrays)
        if error is not None:
            return Failure(error, BAD_REQUEST, "check")
        return Request(arrays, tuple(names) if names else None, fit(self.plan, arrays))

    def groups(self, requests: Sequence[Request], max_rows: int) -> List[List[int]]:
        """The runs ``requests`` make (batching.runs), as lists of their indices."""
        return runs([request.fit for request in requests], max_rows)

    def run(self, requests: Sequence[Request], max_rows: int) -> List[Outcome]:
        """Every request's outcome, in order, through the runs ``groups`` makes."""
        outcomes: List[Optional[Outcome]] = [None] * len(requests)
        for members in self.groups(requests, max_rows):
            for index, outcome in zip(members, self.run_group([requests[i] for i in members])):
                outcomes[index] = outcome
        return outcomes

    def run_group(self, requests: Sequence[Request]) -> List[Outcome]:
        """One shared run of ``requests`` (a group ``groups`` made), cut back into each one's answer; when it
        fails, each request runs again by itself, so only the one that breaks the run gets its error."""
        if len(requests) == 1:
            return [self.run_alone(requests[0])]
        fits = [request.fit for request in requests]
        feeds, length = assemble(self.plan, [request.feeds for request in requests], fits)
        try:
            outputs = self.session.run(None, feeds)
        except Exception:  # noqa: BLE001 - which request broke the run is found by running each alone
            return [self.run_alone(request, retried=True) for request in requests]
        rows = sum(item.rows for item in fits)
        parts = split(self.plan, self.output_names, outputs, fits)
        return [self._answer(request, [part[name] for name in self._wanted(request)],
                             RunInfo(len(requests), position, rows, length))
                for position, (request, part) in enumerate(zip(requests, parts))]  # fmt: skip

    def run_alone(self, request: Request, retried: bool = False) -> Outcome:
        """``request`` in a run of its own: exactly what the session's ``run`` gives, or raises, for its feeds."""
        try:
            outputs = self.session.run(list(request.output_names) if request.output_names else None, request.feeds)
        except Exception as error:  # noqa: BLE001 - every failure is this request's answer
            return Failure(error, run_status(error), "run")
        own = RunInfo(1, 0, request.fit.rows, request.fit.length, retried)
        return self._answer(request, outputs, own)

    def _wanted(self, request: Request) -> tuple:
        return request.output_names or self.output_names

    def _answer(self, request: Request, outputs, run: RunInfo) -> Answer:
        return Answer(self._wanted(request), tuple(outputs), run)


class Coalescer:
    """Runs an Engine on one thread for asyncio callers. Batches handed over while a run is going on wait, and
    all of them are taken together next (Serve's batcher hands a batch over as soon as it is formed, whether the
    model is free or not); the requests taken are grouped into runs of at most ``max_rows()`` rows, and each
    batch's outcomes go back as soon as its runs are done."""

    def __init__(self, engine: Engine, executor, max_rows):
        self.engine = engine
        self.executor = executor
        self.max_rows = max_rows  # a callable: the replica's setting can change between takes
        self.waiting: list = []  # (requests, future) in arrival order
        self.task: Optional[asyncio.Task] = None

    async def submit(self, requests: Sequence[Request]) -> List[Outcome]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((list(requests), future))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def alone(self, request: Request) -> Outcome:
        """``request`` in a run of its own on the engine's thread (batching off, or a request that runs alone)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.engine.run_alone, request)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            taken, self.waiting = self.waiting, []
            requests = [request for batch, _ in taken for request in batch]
            owner = [k for k, (batch, _) in enumerate(taken) for _ in batch]
            outcomes: list = [None] * len(requests)
            left = [len(batch) for batch, _ in taken]
            try:
                for members in self.engine.groups(requests, self.max_rows()):
                    done = await loop.run_in_executor(self.executor, self.engine.run_group,
                                                      [requests[i] for i in members])  # fmt: skip
                    for index, outcome in zip(members, done):
                        outcomes[index] = outcome
                        left[owner[index]] -= 1
                        if left[owner[index]] == 0:
                            self._deliver(taken, owner, outcomes, owner[index])
            except Exception as error:  # noqa: BLE001 - a fault of ours, not a request's: every waiting caller sees it
                for k, (_, future) in enumerate(taken):
                    if left[k] and not future.done():
                        future.set_result([Failure(error, SERVER_ERROR, "run")] * len(taken[k][0]))

    @staticmethod
    def _deliver(taken, owner, outcomes, k) -> None:
        future = taken[k][1]
        if not future.done():  # a caller that went away (its request cancelled) is skipped
            future.set_result([outcome for outcome, o in zip(outcomes, owner) if o == k])
