"""Ray and Serve on this machine, for the CLI, the example, the benchmark and the tests: start them, deploy a
model, wait for what Serve reports (never for a length of time), and stop them.

    port = free_port()
    start_local(port)                                   # Ray on this machine, Serve's HTTP on 127.0.0.1:port
    handle = deploy(ServeOptions(model=path), "bert")   # returns once the application is RUNNING
    ...
    stop()
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

from mha_ep.serve.options import ServeOptions

MISSING_EXTRA = "mha_ep.serve needs Ray Serve: pip install 'mha-ep[serve]' (ray[serve])"
DEFAULT_HOST = "127.0.0.1"
DEADLINE_S = 120.0  # a bound on waiting for Serve, for failures only: what ends a wait is Serve's report
POLL_S = 0.2
# Serve's own waits on its HTTP proxy, which are failure bounds too. Its default 5 s ready check killed the proxy
# before it had finished starting on a 2-core machine beside two busy processes (serve.start then fails with
# ActorDiedError), so a local instance this module starts gets DEADLINE_S; set before Ray starts, so that Serve's
# controller inherits them. A caller's own values, and a cluster joined at an address, are left as they are.
# Ray also starts its workers at niceness 15, so beside any busy process at the default niceness the replicas and
# the proxy all but stop (the serve tests beside two busy processes ran past 15 minutes); a local instance runs
# them at the default niceness, as its driver.
SERVE_WAITS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(DEADLINE_S),
               "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": str(DEADLINE_S), "RAY_worker_niceness": "0"}  # fmt: skip


def missing_extra() -> str:
    """"" when Ray Serve can be imported, else the sentence naming the extra to install."""
    import importlib.util

    try:
        found = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
    except (ImportError, ValueError):
        found = False
    return "" if found else MISSING_EXTRA


def require_extra() -> None:
    """ImportError naming the ``serve`` extra when Ray Serve is not installed."""
    problem = missing_extra()
    if problem:
        raise ImportError(problem)


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port nothing listens on at ``host`` now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def start_local(port: int, host: str = DEFAULT_HOST, address: Optional[str] = None, num_cpus: Optional[float] = None,
                num_gpus: Optional[float] = None) -> None:  # fmt: skip
    """Ray (a new local instance, or the cluster at ``address``) and Serve with its HTTP proxy on host:port.
    ``num_cpus``/``num_gpus``: what a new local instance offers (None: what Ray finds)."""
    require_extra()
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            for name, value in SERVE_WAITS.items():
                os.environ.setdefault(name, value)
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     log_to_driver=False)  # fmt: skip
    serve.start(http_options={"host": host, "port": port})


def deploy(options: ServeOptions, name: str, deadline_s: float = DEADLINE_S):
    """Deploy ``options`` as application ``name`` at its route and return its handle once Serve reports it
    RUNNING. ValueError when the cluster lacks the replicas' CPUs or GPUs (Serve would wait for them without
    end); RuntimeError with the replica's own error when it fails, or when the deadline passes first."""
    require_extra()
    import ray
    from ray import serve

    from mha_ep.serve.deployment import application
    from mha_ep.serve.options import capacity_problem

    problem = capacity_problem(options, ray.cluster_resources())
    if problem:
        raise ValueError(problem)
    try:
        handle = serve.run(application(options), name=name, route_prefix=options.route_prefix)
    except RuntimeError as error:
        _, deployments, _ = application_state(name, full=True)
        reasons = [last_line(message) for _, _, message in deployments.values() if message]
        raise RuntimeError(f"{error}{''.join(f' {reason}' for reason in reasons)}") from None
    wait_running(name, deadline_s=deadline_s)
    return handle


def last_line(text: str) -> str:
    """The last non-empty line of a traceback Serve reports: the exception and its message."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def application_state(name: str, full: bool = False) -> tuple:
    """(application status, its deployments' statuses and replica states, Serve's message) as Serve reports;
    ``full`` adds each deployment's own message (a failed replica's traceback) to its entry."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return "MISSING", {}, f"no application {name!r}"
    deployments = {}
    for deployment, state in app.deployments.items():
        replicas = {str(getattr(k, "value", k)): v for k, v in state.replica_states.items()}
        deployments[deployment] = (str(state.status.value), replicas) + ((state.message,) if full else ())
    return str(app.status.value), deployments, app.message


def wait_running(name: str, replicas: Optional[int] = None, deadline_s: float = DEADLINE_S) -> tuple:
    """Poll Serve until application ``name`` is RUNNING with every deployment HEALTHY (and, given ``replicas``,
    that many RUNNING); the state, or RuntimeError with the last state when it fails or ``deadline_s`` passes."""
    end = time.monotonic() + deadline_s
    while True:
        state = application_state(name)
        status, deployments, message = state
        healthy = deployments and all(s == "HEALTHY" for s, _ in deployments.values())
        counted = replicas is None or all(r.get("RUNNING", 0) == replicas for _, r in deployments.values())
        if status == "RUNNING" and healthy and counted:
            return state
        if status == "DEPLOY_FAILED":  # UNHEALTHY passes while Serve replaces a replica: keep waiting
            raise RuntimeError(f"Serve application {name!r} is {status}: {message}")
        if time.monotonic() > end:
            raise RuntimeError(f"Serve application {name!r} not running after {deadline_s:.0f} s: {state}")
        time.sleep(POLL_S)


def stop() -> None:
    """Serve, then Ray (when this process started or joined it)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
