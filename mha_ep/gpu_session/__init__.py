"""A GPU session's plumbing: mha_ep.InferenceSession on the CUDA provider with device feeds and ORT's CUDA graphs.

  cuda_io.py       the session's device I/O: thread lanes, call checks, graph slots, failure recovery
  transfer.py      host <-> device copies of a call (pinned buffers, copy threads)
  segments.py      several device-to-device copies in one kernel launch (a graph replay's feeds and outputs)
  capture_mode.py  a thread's CUDA stream-capture mode, so callers leave ORT's graph captures alone
"""
