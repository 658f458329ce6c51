"""The Ray Serve deployment of a model: one Engine per replica (engine.py), answering HTTP (JSON or .npz:
codec.py) and Python callers through a handle, with requests batched across callers.

Python callers use onnxruntime's signature, and get onnxruntime's own exceptions (Ray wraps them, and they stay
instances of onnxruntime's classes):

    handle = mha_ep.serve.deploy(ServeOptions(model="model.onnx"), name="bert")
    outputs = handle.run.remote(None, feeds).result()      # a list of arrays, as session.run returns
    answer = handle.answer.remote(None, feeds).result()    # engine.Answer: names, outputs, and the run's facts

Batching: a request is checked first (engine.Engine.request: onnxruntime's own checks), so a bad one never
joins a batch; ``@serve.batch`` collects the checked ones for ``batch_wait_ms`` (at most ``max_batch`` of
them), engine.Coalescer merges the batches that pile up while a run is going on, and the engine pads, runs and
cuts back (batching.py), running a failed batch's requests again one by one. ``max_batch`` 1 turns batching off:
each request runs by itself, in arrival order. Both settings change without a restart (``reconfigure``).

A request that fails gets its error and the replica goes on. A replica that dies is replaced by Serve; the
requests it held get an error (RayActorError through a handle, a 5xx over HTTP), never silence.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

from ray import serve
from starlette.responses import Response

from mha_ep.serve.codec import JSON, RequestError, answer_reply, decode_request, failure_reply, reply_format
from mha_ep.serve.engine import Answer, Coalescer, Engine, Failure
from mha_ep.serve.options import BATCHES_IN_HAND, ServeOptions
from mha_ep.serve.status import SERVER_ERROR

METHOD_NOT_ALLOWED = 405
CONSTRUCTOR_RETRIES = 3  # a model a replica cannot load fails the deployment soon, with the replica's error


@serve.deployment
class MhaModel:
    """One replica: the model's Engine, a thread that runs it, and the batcher in front of it."""

    def __init__(self, options: ServeOptions):
        self.options = options
        self.engine = Engine(options.model, options.backend, options.provider_list(), options.route)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="mha-ep-run")
        self.max_batch = options.max_batch
        self.batch_wait_ms = options.batch_wait_ms
        self.coalescer = Coalescer(self.engine, self.executor, lambda: self.max_batch)
        self.in_flight = 0  # requests inside this replica now (checked, queued or running)
        self.answered = 0
        self.failed = 0
        self.reconfigure(options.user_config())

    def reconfigure(self, config: dict) -> None:
        """Serve's hook for ``user_config``: ``max_batch`` and ``batch_wait_ms`` (ServeOptions.user_config)."""
        self.max_batch = int(config.get("max_batch", self.max_batch))
        self.batch_wait_ms = float(config.get("batch_wait_ms", self.batch_wait_ms))
        self._batched.set_max_batch_size(self.max_batch)
        self._batched.set_batch_wait_timeout_s(self.batch_wait_ms / 1e3)

    async def __call__(self, request) -> Response:
        """HTTP: POST feeds as JSON or .npz (codec.py), GET this replica's description."""
        if request.method == "GET":
            return Response(json.dumps(self.describe()).encode(), media_type=JSON)
        if request.method != "POST":
            return _response(failure_reply(RequestError(f"{request.method} is not served: POST the feeds, or GET "
                                                        f"the model's description"), METHOD_NOT_ALLOWED))  # fmt: skip
        body = await request.body()
        try:
            feeds, names, asked_in = decode_request(request.headers.get("content-type"), body,
                                                    request.query_params.get("outputs"), self.engine.input_types)
        except RequestError as error:
            self.failed += 1
            return _response(failure_reply(error, error.status))
        outcome = await self.outcome(feeds, names)
        if isinstance(outcome, Failure):
            return _response(failure_reply(outcome.error, outcome.status))
        kind = reply_format(request.headers.get("accept"), asked_in)
        return _response(answer_reply(outcome.names, outcome.outputs, outcome.run.to_dict(), kind))

    async def run(self, output_names, input_feed) -> list:
        """onnxruntime's ``run(output_names, input_feed)``: the outputs as a list, or onnxruntime's exception."""
        return list((await self.answer(output_names, input_feed)).outputs)

    async def answer(self, output_names, input_feed) -> Answer:
        """The engine's Answer (outputs and how the run went), or onnxruntime's exception raised."""
        outcome = await self.outcome(input_feed, output_names)
        if isinstance(outcome, Failure):
            raise outcome.error
        return outcome

    async def outcome(self, feeds, output_names) -> object:
        """Answer or Failure for one request: checked, then run alone or batched. Never raises."""
        self.in_flight += 1
        try:
            checked = self.engine.request(feeds, output_names)
            if isinstance(checked, Failure):
                outcome = checked
            elif self.max_batch <= 1 or checked.fit.alone or checked.fit.rows >= self.max_batch:
                outcome = await self.coalescer.alone(checked)
            else:
                outcome = await self._batched(checked)
        except Exception as error:  # noqa: BLE001 - a fault of ours: this request's 500, and the replica goes on
            outcome = Failure(error, SERVER_ERROR, "serve")
        finally:
            self.in_flight -= 1
        if isinstance(outcome, Failure):
            self.failed += 1
        else:
            self.answered += 1
        return outcome

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002, max_concurrent_batches=BATCHES_IN_HAND)
    async def _batched(self, requests: list) -> list:
        return await self.coalescer.submit(requests)

    def describe(self) -> dict:
        """This replica: who it is, what it serves and how, and what it holds now."""
        context = serve.get_replica_context()
        return {"replica": context.replica_id.unique_id, "pid": os.getpid(), "max_batch": self.max_batch,
                "batch_wait_ms": self.batch_wait_ms, "in_flight": self.in_flight, "answered": self.answered,
                "failed": self.failed, **self.engine.describe()}  # fmt: skip


def _response(reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


def application(options: ServeOptions):
    """The Serve application of ``options``: MhaModel with its replicas, their resources and settings."""
    return MhaModel.options(
        num_replicas=options.replicas,
        ray_actor_options=options.resources().actor_options(),
        max_ongoing_requests=options.ongoing(),
        user_config=options.user_config(),
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
    ).bind(options)
