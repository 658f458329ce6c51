"""mha_ep.serve: serving a model to many callers. The pieces so far, lowest first: batching.py (the batch plan,
fits, padding and cutting back: NumPy only), status.py and codec.py (HTTP statuses and bodies)."""
