"""A GPU session's plumbing: mha_ep.InferenceSession on the CUDA provider with device feeds and ORT's CUDA graphs.

  cuda_io.py       the session's device I/O: the class the session calls (run, run_device), composing the rest
  ort_calls.py     ORT's side of a call: its types as NumPy's, CuPy views of its values, a run through IOBinding
  checks.py        a call's checks against the model, the verdict kept per call key; its graph signature
  small_calls.py   small host calls through ORT's own run (OWN_RUN_MAX_BYTES)
  lanes.py         the threads: a lane (stream, staging buffer) per call, a graph session's calls one at a time
  slots.py         a graph session's slots (fixed buffers per call signature) and their replays on ORT's stream
  recovery.py      a failed call: ORT's exception for it, or an eager rerun after a broken graph capture
  transfer.py      host <-> device copies of a call (pinned buffers, copy threads)
  segments.py      several device-to-device copies in one kernel launch (a graph replay's feeds and outputs)
  capture_mode.py  a thread's CUDA stream-capture mode, so callers leave ORT's graph captures alone
"""
