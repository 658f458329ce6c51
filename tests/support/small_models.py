"""One-node models and the CLI runner of the small regression tests (partition, compare, feeds, CLI)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from onnx import TensorProto as TP
from onnx import helper

from harness import REPO

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def model_of(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "review", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS)


def one_mha(attrs=None, node_inputs=("q", "k", "v"), extra_nodes=(), outputs=None, extra_inputs=(), name="mha"):
    """q, k, v (2, 3, 8) float32 -> MultiHeadAttention -> out, plus optional extra nodes/inputs/outputs."""
    attrs = {"num_heads": 2} if attrs is None else attrs
    node = helper.make_node(
        "MultiHeadAttention", list(node_inputs), ["out"], domain="com.microsoft", name=name, **attrs
    )
    inputs = [helper.make_tensor_value_info(x, TP.FLOAT, [2, 3, 8]) for x in "qkv"] + list(extra_inputs)
    outputs = outputs or [helper.make_tensor_value_info("out", TP.FLOAT, [2, 3, 8])]
    return model_of([node, *extra_nodes], inputs, outputs)


def qkv_feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {x: rng.standard_normal((2, 3, 8)).astype(np.float32) for x in "qkv"}


def run_cli(*args, cwd=None):
    """``python -m mha_ep ARGS`` in a fresh process with this checkout importable, whatever ``cwd`` is."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "mha_ep", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
