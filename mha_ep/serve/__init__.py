"""mha_ep.serve: a model served by Ray Serve, one mha_ep.InferenceSession per replica (the ``serve`` extra:
``pip install 'mha-ep[serve]'``). ``mha-ep serve MODEL`` starts it from the command line.

    from mha_ep.serve import ServeOptions, deploy, free_port, start_local
    start_local(free_port())                                          # Ray and Serve's HTTP on 127.0.0.1
    handle = deploy(ServeOptions(model=path, max_batch=16), "bert")   # once Serve reports it RUNNING
    outputs = handle.run.remote(None, feeds).result()                 # or POST JSON / .npz to the route

The pieces, lowest first: batching.py (the batch plan, fits, padding and cutting back: NumPy only), status.py
and codec.py (HTTP statuses and bodies), options.py (ServeOptions and the resources a replica asks for),
engine.py (a replica's model without Ray: checks, shared runs, retries one by one, the coalescer), then the Ray
side: deployment.py (the Serve deployment) and cluster.py (start, deploy, wait, stop). Only the last two import
Ray, on first use.
"""

from __future__ import annotations

from mha_ep.serve.cluster import deploy, free_port, missing_extra, start_local, stop, wait_running
from mha_ep.serve.options import ServeOptions

__all__ = ["ServeOptions", "deploy", "free_port", "missing_extra", "start_local", "stop", "wait_running"]
