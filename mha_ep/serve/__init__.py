"""mha_ep.serve: serving a model to many callers. The pieces so far, lowest first: batching.py (the batch plan,
fits, padding and cutting back: NumPy only), status.py and codec.py (HTTP statuses and bodies), options.py
(what a served model is deployed with), engine.py (a replica's model without Ray: checks, shared runs, retries
one by one, the coalescer)."""
