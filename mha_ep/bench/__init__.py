"""Benchmarks: everything in mha_ep that times or compares speed. They print numbers; nothing here asserts a time.

    mha-ep bench hook      the bridge: an echo Python op's per-call cost and output throughput with
                           onnxruntime-extensions' stock result hook (flatten().tolist()) vs mha_ep's array hook,
                           and the plugin op's fixed per-call overhead on a tiny MHA call (hook.py)
    mha-ep bench anchors   the anchor shapes (docs/FACTS.md §2), a sequence sweep (JSON + PNG), every provider present
                           (GPU; gpu.py has the columns)
    mha-ep bench models    whole models host to host: shipped BERT/Whisper, real MiniLM and Whisper tiny.en when
                           built; plugin vs ORT CPU (and ORT CUDA); any backend (models.py)
    mha-ep bench device    whole models on the GPU: mha_ep.InferenceSession (eager, device feeds, ORT's CUDA
                           graphs) and the bridge against stock ORT CUDA (numpy feeds, IOBinding, its CUDA graph)
                           (device.py)
    mha-ep bench native    the native route in one plain ORT CUDA session against stock ORT CUDA: whole encoders
                           (eager IOBinding, CUDA graphs), a shape's first call, a decoder loop with a growing KV
                           cache, the per-node host cost of a chain of claimed nodes, and serving shapes (a new
                           (batch, sequence) on every call) (native.py)
    mha-ep bench generate  Whisper generation (tiny/base/small sizes, real tiny.en): stock ORT CUDA with numpy
                           feeds and with IOBinding against mha_ep in a plain session, mha_ep.InferenceSession's
                           device loop and the static-cache loop (one CUDA graph a step), greedy and 5 beams; ms
                           per token, tokens, encoder, 30 s total (generate.py)
    mha-ep bench soak      many threads on one session, good and bad calls mixed: stock ORT CUDA, a plain native
                           session and mha_ep.InferenceSession (with and without graphs), wrong answers and
                           exception types counted; --devices 0,1: one session per GPU against one (soak.py)
    mha-ep bench sd        Stable Diffusion's attention nodes alone (packed QKV self attention, packed KV cross
                           attention, SD3 / Flux joint attention) at SD 1.5 / SDXL / SD3.5 / Flux shapes, float16 and
                           bfloat16: ours on the native route against stock ORT CUDA on the packed and the unpacked
                           node, with TFLOP/s and HBM rate against the device's peaks (sd.py)
    mha-ep bench serve     a model served by Ray Serve (mha_ep.serve, the serve extra) under closed-loop clients
                           on 127.0.0.1, beside the same requests to a session in-process: throughput, p50/p99,
                           batching on and off, replica counts, Serve's overhead per request (serve.py)

Each of those nine takes ``--json`` (the results as one JSON object on stdout, the table on stderr, as ``--json``
means everywhere in mha-ep) and ``--out DIR`` (the JSON, and the PNG where there is one, written into DIR;
``anchors`` writes to ./mha_ep_bench unless told otherwise); output.py has the two.

    python3 -m mha_ep.bench.fused_timing     the fused kernels alone, their tiles, torch SDPA; --compare SOURCES
    python3 -m mha_ep.bench.backend_timing   the cuda backend's device and host time per anchor

Shared by all: ``anchors.py`` (the one anchor table, with the reference times it is judged against, and the one
FLOP model) and ``timer.py`` (the one median timer, on the host and on a CUDA stream). The cuda backend offers one
hook to time, ``CudaBackend.prepared(problem)`` (a staged call to submit); no module under mha_ep/engine imports
anything from here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# WHAT -> the module whose ``main(argv)`` runs it (and parses, and documents, its options)
BENCHMARKS = {"hook": "hook", "anchors": "gpu", "models": "models", "device": "device", "native": "native",
              "generate": "generate", "soak": "soak", "serve": "serve", "sd": "sd"}


def main(argv=None) -> int:
    """``mha-ep bench WHAT [options]``: each benchmark parses its own options (``mha-ep bench WHAT --help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in BENCHMARKS:
        from mha_ep.bench.output import json_mode

        module = importlib.import_module(f"mha_ep.bench.{BENCHMARKS[argv[0]]}")
        with json_mode("--json" in argv[1:]):  # tables to stderr; only the results object reaches stdout
            return module.main(argv[1:])
    parser = argparse.ArgumentParser(prog="mha-ep bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("what", choices=list(BENCHMARKS), help="which benchmark; mha-ep bench WHAT --help for its options")
    parser.parse_args(argv[:1])  # no WHAT, or an unknown one: the usage message (exit 2), or --help (exit 0)
    return 2
