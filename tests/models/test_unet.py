"""A Stable Diffusion UNet as ORT's own optimizer writes it (tests/fixtures/unet/, made by mha_ep/models/unet.py: a tiny
random diffusers UNet2DConditionModel, TorchScript-exported, fused by onnxruntime.transformers.optimizer with
model_type="unet"): self attention as packed QKV, cross attention (77 text tokens) as packed KV, which stock ORT's
CPU provider refuses. Every node is claimed on both routes, and the packed UNet run with the plugin matches stock
ORT CPU on the same UNet optimized with packing turned off (the oracle: the same weights, separate Q, K, V)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mha_ep

from conftest import max_rel_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "unet"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
# unet_packed.onnx is the optimizer's full default; its other fusions (NhwcConv, GroupNorm, BiasSplitGelu, ...) have
# CUDA kernels only, so stock ORT CPU cannot load it whatever the attention: the CPU tests use the same packed
# attention with those fusions off (unet_packed_cpuops.onnx), and only partition the default one.
TOLERANCE = 1e-4


def feeds(seed: int = 100) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {name: spec["shape"] for name, spec in MANIFEST["test_feeds"].items() if isinstance(spec, dict)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def forms(model: onnx.ModelProto) -> list:
    """(query rank, key rank or None, value given) of each MultiHeadAttention node."""
    from mha_ep.claim.shapes import infer_static_infos

    ranks = {name: info.rank for name, info in infer_static_infos(model).items()}
    found = []
    for node in model.graph.node:
        if node.op_type == "MultiHeadAttention":
            key = node.input[1] if len(node.input) > 1 and node.input[1] else None
            value = len(node.input) > 2 and bool(node.input[2])
            found.append((ranks.get(node.input[0]), ranks.get(key) if key else None, value))
    return found


@pytest.mark.parametrize("name", ["unet_packed.onnx", "unet_packed_cpuops.onnx"])
@pytest.mark.parametrize("route", ["python-op", "native"])
def test_every_packed_node_of_the_optimized_unet_is_claimed(name, route):
    model = onnx.load(FIXTURES / name)
    result = mha_ep.partition(model, route=route)
    assert result.claimed == 8 and result.declined == 0, result.report()
    assert sorted(set(forms(model))) == [(3, 5, False), (5, None, False)]  # packed KV cross, packed QKV self


@pytest.mark.parametrize("route", ["python-op", "native"])
def test_the_packed_unet_matches_stock_ort_on_the_unet_optimized_without_packing(route):
    data = feeds()
    stock = ort.InferenceSession(str(FIXTURES / "unet_unpacked.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = stock.run(["latent"], data)
    with pytest.raises(Exception, match="Packed QKV of shape"):  # what the oracle stands in for
        ort.InferenceSession(str(FIXTURES / "unet_packed_cpuops.onnx"), providers=["CPUExecutionProvider"]).run(
            ["latent"], data)
    session = mha_ep.InferenceSession(str(FIXTURES / "unet_packed_cpuops.onnx"), backend="reference", route=route)
    assert session.partition.claimed == 8
    (actual,) = session.run(["latent"], data)
    assert actual.shape == expected.shape and np.abs(expected).max() > 0.1
    assert max_rel_error(actual, expected) <= TOLERANCE, max_rel_error(actual, expected)
