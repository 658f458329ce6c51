"""The engine: one call of MultiHeadAttention as a problem, and the backends that compute it.

  problem.py     a call's inputs checked and resolved into an MhaProblem (the claim rules' run-time half)
  backends.py    the backend interface, ``create_backend`` / ``resolve_backend``, and why cuda is unavailable
  reference.py   the NumPy backend: stock ORT CPU's math, the oracle of every other route
  cuda/          the CuPy backend: pipeline.py plans a call as steps (kernel launches, cuBLAS GEMMs, copies) that
                 the bridge and the native library run; dispatch.py chooses kernels; kernels/ holds the .cu files
  context.py     the run's context: which backend a call runs on and where its errors go
  interrupt.py   Ctrl-C during an ORT run: deferred to the end of the run, never an abort
Nothing here imports onnxruntime-extensions or the native library; the routes (mha_ep.python_op, mha_ep.native)
drive it.
"""
