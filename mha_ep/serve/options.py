"""What a served model is deployed with (``ServeOptions``), and the rules that turn it into Ray's settings: the
providers a name stands for, the resources a replica asks Ray for, and how many requests it takes at once.
No Ray here: the CLI and the benchmark check options before a cluster starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

PROVIDERS = {"cpu": ("CPUExecutionProvider",), "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider")}
BACKENDS = ("auto", "reference", "cuda")
ROUTES = ("auto", "native", "python-op")
# Batches Serve may hand a replica while its model is busy; the replica merges them into its next run
# (engine.Coalescer), so they wait in the replica rather than in Serve's router.
BATCHES_IN_HAND = 4
MIN_ONGOING = 32  # requests a replica holds at once at least: fewer, and Serve's router retries the rest against it


@dataclass(frozen=True)
class Resources:
    """What one replica asks Ray for, and why."""

    num_cpus: float
    num_gpus: float
    reason: str

    def actor_options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


@dataclass(frozen=True)
class ServeOptions:
    """A served model. ``model``: an ONNX file every replica can read; ``backend``, ``providers`` ("cpu" or
    "cuda") and ``route`` as mha_ep.InferenceSession takes them; ``route_prefix``: the HTTP route; ``replicas``;
    ``gpus_per_replica`` (None: one with the CUDA provider or the cuda backend, none otherwise) and
    ``cpus_per_replica``; ``max_batch``: the most rows (the model's batch dim) one run takes, 1 turning batching
    off; ``batch_wait_ms``: how long a request that finds the replica idle waits for others to join it;
    ``max_ongoing``: requests one replica holds at once (None: BATCHES_IN_HAND batches' worth, MIN_ONGOING at least)."""

    model: str
    backend: str = "auto"
    providers: str = "cpu"
    route: str = "auto"
    route_prefix: str = "/"
    replicas: int = 1
    gpus_per_replica: Optional[float] = None
    cpus_per_replica: float = 1.0
    max_batch: int = 16
    batch_wait_ms: float = 0.0
    max_ongoing: Optional[int] = None

    def __post_init__(self):
        problem = options_problem(self)
        if problem:
            raise ValueError(problem)

    def provider_list(self) -> list:
        return list(PROVIDERS[self.providers])

    def resources(self) -> Resources:
        return replica_resources(self)

    def ongoing(self) -> int:
        return self.max_ongoing if self.max_ongoing is not None else max(MIN_ONGOING, BATCHES_IN_HAND * self.max_batch)

    def user_config(self) -> dict:
        """The settings a running replica takes without a restart (its ``reconfigure``)."""
        return {"max_batch": self.max_batch, "batch_wait_ms": self.batch_wait_ms}

    def to_dict(self) -> dict:
        return asdict(self)


def options_problem(options: ServeOptions) -> str:
    """The first option that is out of range, named with what it got and what it takes; "" when all are fine."""
    checks = (
        (options.backend in BACKENDS, "backend", options.backend, f"one of {BACKENDS}"),
        (options.providers in PROVIDERS, "providers", options.providers, f"one of {tuple(PROVIDERS)}"),
        (options.route in ROUTES, "route", options.route, f"one of {ROUTES}"),
        (options.route_prefix.startswith("/"), "route_prefix", options.route_prefix, "a path starting with '/'"),
        (options.replicas >= 1, "replicas", options.replicas, "at least 1"),
        (options.gpus_per_replica is None or options.gpus_per_replica >= 0, "gpus_per_replica",
         options.gpus_per_replica, "0 or more"),
        (options.cpus_per_replica >= 0, "cpus_per_replica", options.cpus_per_replica, "0 or more"),
        (options.max_batch >= 1, "max_batch", options.max_batch, "at least 1 (1: batching off)"),
        (options.batch_wait_ms >= 0, "batch_wait_ms", options.batch_wait_ms, "0 or more"),
        (options.max_ongoing is None or options.max_ongoing >= 1, "max_ongoing", options.max_ongoing, "at least 1"),
    )  # fmt: skip
    for ok, name, got, expected in checks:
        if not ok:
            return f"mha_ep.serve: {name} must be {expected}, got {got!r}"
    return ""


def capacity_problem(options: ServeOptions, cluster: dict) -> str:
    """"" when ``cluster`` (Ray's ``cluster_resources()``) has the CPUs and GPUs every replica asks for, else a
    sentence saying what is asked and what there is: Serve would wait for them without end."""
    wanted = options.resources()
    for kind, each in (("CPU", wanted.num_cpus), ("GPU", wanted.num_gpus)):
        have = float(cluster.get(kind, 0.0))
        if each * options.replicas > have:
            return (f"mha_ep.serve: {options.replicas} replica(s) x {each:g} {kind} ({wanted.reason}) is more than "
                    f"the {have:g} {kind} the Ray cluster has; lower replicas, or set gpus_per_replica / "
                    f"cpus_per_replica")  # fmt: skip
    return ""


def replica_resources(options: ServeOptions) -> Resources:
    """One GPU per replica when the model runs on the GPU (the CUDA provider, or the cuda backend), unless
    ``gpus_per_replica`` says otherwise; Ray then makes that GPU the replica's device 0 (CUDA_VISIBLE_DEVICES)."""
    on_gpu = options.providers == "cuda" or options.backend == "cuda"
    if options.gpus_per_replica is not None:
        return Resources(options.cpus_per_replica, options.gpus_per_replica, "gpus_per_replica was given")
    if on_gpu:
        why = "the CUDA provider" if options.providers == "cuda" else "the cuda backend"
        return Resources(options.cpus_per_replica, 1, f"{why} runs on a GPU: one per replica")
    return Resources(options.cpus_per_replica, 0, "the model runs on the CPU")
