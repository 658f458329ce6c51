"""Tiny random Stable Diffusion 1.5-style UNet, exported and fused the way ONNX Runtime's SD tools do it:
``python -m mha_ep.models.unet [--out DIR] [--float16-report]``.

What it makes (names: B batch, S = h*w latent positions, L text tokens, N heads, H head size)::

  sample (B, 4, h, w) f32, timestep (1,) f32, encoder_hidden_states (B, 77, 32) f32  ->  latent (B, 4, h, w) f32

three optimized graphs of the same seeded weights (tests/fixtures/unet/, + MANIFEST.json):

  unet_packed.onnx         ORT's DEFAULT unet fusion options: self-attention MultiHeadAttention with packed QKV,
                           query (B, S, N, 3, H), key/value absent; cross-attention MultiHeadAttention with packed
                           KV, query (B, S, N*H), key (B, L, N, 2, H), value absent. Also NhwcConv, GroupNorm,
                           SkipGroupNorm, BiasSplitGelu, BiasAdd (CUDA-only contrib ops).
  unet_packed_cpuops.onnx  the same packed MultiHeadAttention nodes, but the CUDA-only non-attention fusions
                           off, so the packed MHA nodes are all that stock ORT CPU cannot run.
  unet_unpacked.onnx       packing off (``enable_packed_qkv=False``, ``enable_packed_kv=False``) and the CUDA-only
                           fusions off: the oracle that stock ORT CPU runs. With packing off, ORT's fusion writes
                           self-attention as com.microsoft::Attention (input, packed weight (C, 3C), zero bias),
                           not MHA, and cross-attention as MHA with separate 3-D Q (B, S, C), K and V (B, L, C)
                           and a zero bias (3C,).

Export (the settings of ORT's own engine builders, models/stable_diffusion/engine_builder_ort_cuda.py):
``torch.onnx.export(model, (sample, timestep, encoder_hidden_states), path, export_params=True,
opset_version=17, do_constant_folding=True, dynamo=False, input_names=["sample", "timestep",
"encoder_hidden_states"], output_names=["latent"], dynamic_axes={"sample": {0: "B", 2: "H", 3: "W"},
"encoder_hidden_states": {0: "B"}, "latent": {0: "B", 2: "H", 3: "W"}})`` with the legacy
``diffusers.models.attention_processor.AttnProcessor`` set on every attention (``unet.set_attn_processor``).

Fusion (ORT's models/stable_diffusion/optimize_pipeline.py call, float32 kept)::

  options = FusionOptions("unet")            # packed: defaults (enable_packed_qkv = enable_packed_kv = True)
  # unpacked: options.enable_packed_qkv = options.enable_packed_kv = False, and the CUDA-only fusions off:
  #   enable_nhwc_conv = enable_group_norm = enable_skip_group_norm = enable_bias_splitgelu = enable_bias_add = False
  optimize_model(path, model_type="unet", num_heads=0, hidden_size=0, opt_level=0,
                 optimization_options=options, use_gpu=True)

(optimize_pipeline.py itself only packs when ``--float16`` is given; its float16 step,
``convert_float_to_float16(keep_io_types=False, op_block_list=[])``, leaves the node forms as they are, in float16.)

What fuses and what does not (torch 2.13.0+cpu, diffusers 0.32.2, onnxruntime 1.31.1, onnx 1.23.2):

  legacy AttnProcessor, TorchScript (dynamo=False), opset 14 / 17 / 18,      8 MHA (4 packed QKV + 4 packed KV),
    dynamic or static axes, numpy 2.3.5 or 2.4.6                            the "torch1" pattern
  AttnProcessor2_0 (diffusers' default under torch 2, SDPA), TorchScript,   8 MHA: the "torch2" pattern
    dynamic axes, numpy < 2.4 (2.3.5 checked)
  AttnProcessor2_0, TorchScript, dynamic axes, numpy >= 2.4 (2.4.6)          TypeError "only 0-dimensional arrays
                                                                            can be converted to Python scalars":
    FusionAttentionUnet.get_num_heads calls int() on the shape-(1,) num_heads constant, which numpy 2.4 refuses
    (here ``processor="sdpa"`` applies a small shim for that one call; the legacy processor never reaches it)
  AttnProcessor2_0, TorchScript, static axes                                0 MHA (no error): constant folding
                                                                            removes the Shape->Sqrt scale subgraph
                                                                            the torch2 pattern matches
  dynamo=True (torch 2.13's default), dynamic axes                          export fails (torch.export: the batch
                                                                            dim specialised to 2)
  dynamo=True, static shapes                                                exports; 0 MHA, 0 GroupNorm fused

Other diffusers versions (same torch / ORT): 0.35.2 and 0.36.0 give the same 8 MHA in the same forms with either
processor (sdpa with the shim on numpy 2.4); 0.42.1 does not import beside huggingface_hub 0.36.2 (it needs
``huggingface_hub.resolve_revision``; transformers 4.48.3 pins huggingface_hub < 1.0). Only torch 2.13 was tried.

Stock ORT CPU (1.31.1) on these: unet_unpacked.onnx runs (max |ORT - PyTorch| ~1e-6); unet_packed.onnx is
refused at session creation (``Could not find an implementation for NhwcConv(1) node``); unet_packed_cpuops.onnx
loads and fails at run (``Packed QKV of shape (B, L, N, 3, H) not implemented for CPU``; with the packed QKV
nodes split, ``Packed KV not implemented for CPU``). The same weights, packing off but the other defaults on, also
fail on NhwcConv. ``split_packed_mha`` rewrites packed MHA inputs into separate Q/K/V (Split + Reshape): stock ORT
CPU runs unet_packed_cpuops.onnx that way and matches PyTorch (~1e-6), which checks the packed weights.

torch and diffusers are imported inside the functions that need them; the module imports without them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import onnx

ORT_DOMAIN = "com.microsoft"
OPSET = 17
SEED = 0
FIXTURE_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "unet"
INPUT_NAMES = ("sample", "timestep", "encoder_hidden_states")
OUTPUT_NAMES = ("latent",)
DYNAMIC_AXES = {  # ORT's UNet.get_dynamic_axes (models/stable_diffusion/diffusion_models.py), batch multiplier 1
    "sample": {0: "B", 2: "H", 3: "W"},
    "encoder_hidden_states": {0: "B"},
    "latent": {0: "B", 2: "H", 3: "W"},
}
# fusions of FusionOptions("unet") whose ops only the CUDA (and ROCm/DML) providers implement
CUDA_ONLY_FUSIONS = ("enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
                     "enable_bias_add")
UNPACK = {"enable_packed_qkv": False, "enable_packed_kv": False}
VARIANTS: Dict[str, Dict[str, bool]] = {
    "unet_packed": {},  # ORT's defaults for model_type="unet"
    "unet_packed_cpuops": {k: False for k in CUDA_ONLY_FUSIONS},
    "unet_unpacked": {**UNPACK, **{k: False for k in CUDA_ONLY_FUSIONS}},
}


@dataclass(frozen=True)
class TinyUNet:
    """SD 1.5's UNet2DConditionModel layout at toy size: 2 levels, one cross-attention transformer on the top level
    (down 0, up 1: 2) and in the mid block. block_out_channels (32, 32) and attention_head_dim (8, 4) give 8 heads
    of size 4 on the top level and 4 heads of size 8 in the mid block (diffusers' attention_head_dim is the head
    count for SD 1.x), ~362k parameters (1.5 MB in float32)."""

    sample_size: int = 16
    in_channels: int = 4
    out_channels: int = 4
    layers_per_block: int = 1
    block_out_channels: Tuple[int, ...] = (32, 32)
    down_block_types: Tuple[str, ...] = ("CrossAttnDownBlock2D", "DownBlock2D")
    up_block_types: Tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D")
    cross_attention_dim: int = 32
    attention_head_dim: Tuple[int, ...] = (8, 4)
    norm_num_groups: int = 32
    # export-time shapes (B and the latent h, w stay dynamic; the text length stays 77 as in ORT's pipeline)
    batch: int = 2
    text_len: int = 77


def versions() -> Dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("torch", "diffusers", "transformers", "onnxruntime", "onnx", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _step(what: str):
    @contextlib.contextmanager
    def cm():
        t0 = time.perf_counter()
        print(f"  ... {what}", flush=True)
        yield
        print(f"      done in {time.perf_counter() - t0:.1f} s", flush=True)

    return cm()


def tiny_unet(seed: int = SEED, cfg: TinyUNet = TinyUNet(), processor: str = "legacy"):
    """The seeded random UNet2DConditionModel in eval mode; ``processor``: "legacy" (AttnProcessor, the pattern
    that fuses with any numpy) or "sdpa" (AttnProcessor2_0, diffusers' default)."""
    import random

    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=cfg.sample_size,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        layers_per_block=cfg.layers_per_block,
        block_out_channels=tuple(cfg.block_out_channels),
        down_block_types=tuple(cfg.down_block_types),
        up_block_types=tuple(cfg.up_block_types),
        cross_attention_dim=cfg.cross_attention_dim,
        attention_head_dim=tuple(cfg.attention_head_dim),
        norm_num_groups=cfg.norm_num_groups,
    ).eval()
    # random init leaves norm weights at 1 and biases at 0: give every 1-D parameter its own values so the
    # fixture tests more than the identity parts (the fusion patterns do not depend on them)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    if processor == "legacy":
        unet.set_attn_processor(AttnProcessor())
    elif processor == "sdpa":
        unet.set_attn_processor(AttnProcessor2_0())
    else:
        raise ValueError(f"processor must be 'legacy' or 'sdpa', got {processor!r}")
    return unet


def _wrap(unet):
    import torch

    class UNetLatent(torch.nn.Module):
        """Positional (sample, timestep, encoder_hidden_states) -> latent, as ORT's pipeline exports it."""

        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    return UNetLatent(unet).eval()


def sample_inputs(cfg: TinyUNet = TinyUNet(), seed: int = SEED, batch: Optional[int] = None,
                  size: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Random valid feeds: sample (B, 4, h, w), timestep (1,) in [0, 1000), encoder_hidden_states (B, 77, 32)."""
    rng = np.random.default_rng(seed)
    b = batch or cfg.batch
    s = size or cfg.sample_size
    return {
        "sample": rng.standard_normal((b, cfg.in_channels, s, s)).astype(np.float32),
        "timestep": np.array([rng.integers(0, 1000)], dtype=np.float32),
        "encoder_hidden_states": rng.standard_normal((b, cfg.text_len, cfg.cross_attention_dim)).astype(np.float32),
    }


def export(unet, cfg: TinyUNet = TinyUNet(), opset: int = OPSET) -> onnx.ModelProto:
    """TorchScript export with ORT's engine-builder settings; returns the ModelProto (weights inside)."""
    import warnings

    import torch

    feeds = sample_inputs(cfg)
    args = tuple(torch.from_numpy(feeds[k]) for k in INPUT_NAMES)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "unet.onnx"
        torch.onnx.export(
            _wrap(unet),
            args,
            str(path),
            export_params=True,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes=DYNAMIC_AXES,
        )
        return onnx.load(str(path))


@contextlib.contextmanager
def _numpy24_num_heads_shim():
    """numpy >= 2.4 refuses int() of a shape-(1,) array, which FusionAttentionUnet.get_num_heads does on the
    AttnProcessor2_0 ("torch2") pattern. Patch that one method for the duration (only that conversion changes)."""
    import importlib

    import onnxruntime.transformers.optimizer  # noqa: F401 - puts onnxruntime/transformers on sys.path

    # the optimizer imports its fusions as top-level modules (``from fusion_attention_unet import ...``)
    fau = importlib.import_module("fusion_attention_unet")
    original = fau.FusionAttentionUnet.get_num_heads

    def get_num_heads(self, reshape_q, is_torch2=False):
        if is_torch2:
            parent = self.model.get_parent(reshape_q, 1)
            if parent and parent.op_type == "Concat" and len(parent.input) == 4:
                value = self.model.get_constant_value(parent.input[2])
                if isinstance(value, np.ndarray) and list(value.shape) == [1] and int(value[0]) > 0:
                    return int(value[0])
            return 0
        return original(self, reshape_q, is_torch2)

    fau.FusionAttentionUnet.get_num_heads = get_num_heads
    try:
        yield
    finally:
        fau.FusionAttentionUnet.get_num_heads = original


def optimize(model: onnx.ModelProto, overrides: Optional[Dict[str, bool]] = None, numpy_shim: bool = False):
    """ORT's SD optimizer call (optimize_pipeline.py) with FusionOptions("unet") and ``overrides`` set on it;
    returns the optimized ModelProto (float32)."""
    import os

    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    options = FusionOptions("unet")
    for key, value in (overrides or {}).items():
        if not hasattr(options, key):
            raise AttributeError(f"FusionOptions has no {key}")
        setattr(options, key, value)
    shim = _numpy24_num_heads_shim() if numpy_shim else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, shim:
        path = Path(tmp) / "in.onnx"
        onnx.save(model, str(path))
        before = os.getcwd()
        os.chdir(tmp)  # the optimizer may drop temporary files into the cwd
        try:
            opt = optimize_model(str(path), model_type="unet", num_heads=0, hidden_size=0, opt_level=0,
                                 optimization_options=options, use_gpu=True)
        finally:
            os.chdir(before)
        opt.topological_sort()
        return opt.model


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """optimize_pipeline.py's --float16 step for the unet (no fp32 op block list for SD 1.x)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    m = OnnxModel(onnx.ModelProto.FromString(model.SerializeToString()))
    m.convert_float_to_float16(keep_io_types=False, op_block_list=[])
    return m.model


# ------------------------------------------------------------------------------------------------ description
def _shapes(model: onnx.ModelProto) -> Dict[str, List]:
    """name -> shape (ints and symbols) after ORT's symbolic shape inference (it knows the contrib ops)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inferred = SymbolicShapeInference.infer_shapes(onnx.ModelProto.FromString(model.SerializeToString()),
                                                       auto_merge=True, guess_output_rank=True)
    except Exception:  # noqa: BLE001 - fall back to onnx's own inference
        inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = v.type.tensor_type
        if t.HasField("shape"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    for init in model.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def attention_forms(model: onnx.ModelProto) -> List[dict]:
    """One entry per com.microsoft MultiHeadAttention / Attention node: inputs present with their shapes and the
    rank of query and key, whether value is present, num_heads, and the form's name."""
    shapes = _shapes(model)
    inits = {i.name for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.domain != ORT_DOMAIN or node.op_type not in ("MultiHeadAttention", "Attention"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        names = (["query", "key", "value", "bias"] if node.op_type == "MultiHeadAttention"
                 else ["input", "weights", "bias"])
        inputs = {}
        for role, name in zip(names, list(node.input) + [""] * 8):
            if name:
                inputs[role] = {"name": name, "shape": shapes.get(name), "initializer": name in inits}
        entry = {"name": node.name, "op_type": node.op_type, "num_heads": attrs.get("num_heads"),
                 "inputs": inputs}
        if node.op_type == "MultiHeadAttention":
            q, k = inputs.get("query"), inputs.get("key")
            entry["query_rank"] = len(q["shape"]) if q and q["shape"] is not None else None
            entry["key_rank"] = len(k["shape"]) if k and k["shape"] is not None else None
            entry["key_present"] = k is not None
            entry["value_present"] = "value" in inputs
            entry["bias_present"] = "bias" in inputs
            if entry["query_rank"] == 5 and k is None:
                entry["form"] = "packed QKV: query (B, S, N, 3, H), key/value absent"
            elif entry["key_rank"] == 5 and "value" not in inputs:
                entry["form"] = "packed KV: query (B, S, N*H), key (B, L, N, 2, H), value absent"
            elif entry["query_rank"] == 3 and entry["key_rank"] == 3 and "value" in inputs:
                entry["form"] = "separate Q (B, S, N*H), K, V (B, L, N*H)" + (" + bias (3*N*H)" if "bias" in inputs
                                                                              else "")
            else:
                entry["form"] = "other"
        else:
            entry["form"] = "Attention: input (B, S, C), weights (C, 3C), bias (3C)"
        out.append(entry)
    return out


def _io(values) -> List[dict]:
    out = []
    for v in values:
        t = v.type.tensor_type
        out.append({"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                    "shape": [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                              for d in t.shape.dim]})
    return out


def op_counts(model: onnx.ModelProto) -> Dict[str, int]:
    import collections

    c = collections.Counter((f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type)
                            for n in model.graph.node)
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def describe(model: onnx.ModelProto) -> dict:
    forms = attention_forms(model)
    summary: Dict[str, int] = {}
    for f in forms:
        key = f"{f['op_type']}: {f['form']}"
        summary[key] = summary.get(key, 0) + 1
    return {
        "inputs": _io(model.graph.input),
        "outputs": _io(model.graph.output),
        "mha_nodes": sum(1 for f in forms if f["op_type"] == "MultiHeadAttention"),
        "attention_nodes": sum(1 for f in forms if f["op_type"] == "Attention"),
        "attention_forms_summary": summary,
        "attention_forms": forms,
        "op_counts": op_counts(model),
    }


# ------------------------------------------------------------------------------------------------------ checks
def stock_cpu(path_or_model, feeds: Dict[str, np.ndarray]):
    """(output, None) from stock ORT CPU, or (None, 'ExceptionType: message')."""
    import onnxruntime as ort

    src = str(path_or_model) if isinstance(path_or_model, (str, Path)) else path_or_model.SerializeToString()
    so = ort.SessionOptions()
    so.log_severity_level = 4  # the error comes back in the exception; keep ORT's own log quiet
    try:
        session = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        return None, f"session creation: {type(e).__name__}: {e}"
    try:
        return session.run(None, feeds)[0], None
    except Exception as e:  # noqa: BLE001
        return None, f"run: {type(e).__name__}: {e}"


def split_packed_mha(model: onnx.ModelProto, which=("qkv", "kv")) -> onnx.ModelProto:
    """A copy of ``model`` whose packed MultiHeadAttention nodes take separate Q, K, V instead: packed QKV
    (B, S, N, 3, H) and packed KV (B, L, N, 2, H) are split on axis 3 and reshaped to (B, *, N*H). Stock ORT CPU
    runs the result, which checks the packed fixtures' weights (the interleaving) against PyTorch. ``which``:
    the packed forms to split ("qkv", "kv")."""
    from onnx import helper

    m = onnx.ModelProto.FromString(model.SerializeToString())
    shape3 = "split_packed_mha_shape_BSD"
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), shape3))
    nodes = []
    for node in m.graph.node:
        if node.domain == ORT_DOMAIN and node.op_type == "MultiHeadAttention":
            inputs = list(node.input) + [""] * (3 - len(node.input))
            packed_qkv = bool(inputs[0] and not inputs[1] and not inputs[2]) and "qkv" in which
            packed_kv = bool(inputs[0] and inputs[1] and not inputs[2]) and "kv" in which
            if packed_qkv or packed_kv:
                src = inputs[0] if packed_qkv else inputs[1]
                parts = ("q", "k", "v") if packed_qkv else ("k", "v")
                split = [f"{node.name}_split_{p}" for p in parts]
                nodes.append(helper.make_node("Split", [src], split, name=f"{node.name}_split", axis=3))
                flat = []
                for name in split:
                    nodes.append(helper.make_node("Reshape", [name, shape3], [name + "_bsd"], name=name + "_reshape"))
                    flat.append(name + "_bsd")
                del node.input[:]
                node.input.extend(flat if packed_qkv else [inputs[0], *flat])
        nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def torch_reference(unet, feeds: Dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        args = [torch.from_numpy(feeds[k]) for k in INPUT_NAMES]
        return _wrap(unet)(*args).numpy()


# ------------------------------------------------------------------------------------------------------- build
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path = FIXTURE_DIR, seed: int = SEED, cfg: TinyUNet = TinyUNet(), processor: str = "legacy",
          float16_report: bool = False, command: str = "python -m mha_ep.models.unet") -> dict:
    """Build, export, optimize (packed default, packed with CPU ops, unpacked), check on stock ORT CPU against
    PyTorch, save the .onnx files and MANIFEST.json into ``out``; returns the manifest."""
    import numpy

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shim = processor == "sdpa" and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4)
    manifest = {
        "about": "Tiny random Stable Diffusion 1.5-style UNet2DConditionModel, TorchScript-exported and fused by "
                 "ONNX Runtime's unet optimizer; made by mha_ep/models/unet.py (its docstring says what fuses).",
        "versions": versions(),
        "seed": seed,
        "config": asdict(cfg),
        "attn_processor": {"legacy": "diffusers.models.attention_processor.AttnProcessor",
                           "sdpa": "diffusers.models.attention_processor.AttnProcessor2_0"}[processor],
        "numpy24_num_heads_shim": shim,
        "export": {
            "call": "torch.onnx.export(model, (sample, timestep, encoder_hidden_states), path, export_params=True, "
                    f"opset_version={OPSET}, do_constant_folding=True, dynamo=False, input_names={list(INPUT_NAMES)}, "
                    f"output_names={list(OUTPUT_NAMES)}, dynamic_axes=DYNAMIC_AXES)",
            "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in DYNAMIC_AXES.items()},
            "example_shapes": {"sample": [cfg.batch, cfg.in_channels, cfg.sample_size, cfg.sample_size],
                               "timestep": [1],
                               "encoder_hidden_states": [cfg.batch, cfg.text_len, cfg.cross_attention_dim]},
        },
        "optimizer_call": "options = FusionOptions('unet'); setattr(options, k, v) for fusion_overrides; "
                          "onnxruntime.transformers.optimizer.optimize_model(path, model_type='unet', num_heads=0, "
                          "hidden_size=0, opt_level=0, optimization_options=options, use_gpu=True)",
        "command": command,
        "models": {},
    }

    print(f"[1/5] tiny UNet2DConditionModel (seed {seed}, processor {processor})", flush=True)
    with _step("build"):
        unet = tiny_unet(seed, cfg, processor)
        params = sum(p.numel() for p in unet.parameters())
    print(f"      {params} parameters")
    manifest["parameters"] = params

    print(f"[2/5] torch.onnx.export (TorchScript, opset {OPSET}, constant folding, dynamic B/H/W)", flush=True)
    with _step("export"):
        raw = export(unet, cfg)
    print(f"      {len(raw.graph.node)} nodes")

    feeds = sample_inputs(cfg, seed=seed + 100)
    feeds_odd = sample_inputs(cfg, seed=seed + 101, batch=1, size=cfg.sample_size // 2)
    ref = torch_reference(unet, feeds)
    ref_odd = torch_reference(unet, feeds_odd)

    print("[3/5] ORT optimize_model(model_type='unet', opt_level=0, use_gpu=True) x3", flush=True)
    models = {}
    for name, overrides in VARIANTS.items():
        with _step(f"{name}: FusionOptions('unet') + {overrides or 'defaults'}"):
            models[name] = optimize(raw, overrides, numpy_shim=shim)
        d = describe(models[name])
        print(f"      {d['mha_nodes']} MultiHeadAttention, {d['attention_nodes']} Attention: "
              f"{d['attention_forms_summary']}")
        manifest["models"][name] = {"fusion_overrides": overrides, **d}

    print("[4/5] stock ORT CPU checks", flush=True)
    for name, model in models.items():
        entry = manifest["models"][name]
        y, err = stock_cpu(model, feeds)
        entry["stock_ort_cpu"] = {"runs": err is None, "error": err}
        if err is None:
            y_odd, err_odd = stock_cpu(model, feeds_odd)
            entry["stock_ort_cpu"]["max_abs_error_vs_torch"] = float(np.max(np.abs(y - ref)))
            entry["stock_ort_cpu"]["max_abs_error_vs_torch_b1_half_size"] = (
                float(np.max(np.abs(y_odd - ref_odd))) if err_odd is None else err_odd)
            entry["stock_ort_cpu"]["max_abs_torch_output"] = float(np.max(np.abs(ref)))
            print(f"      {name}: runs; max |ORT - torch| = {entry['stock_ort_cpu']['max_abs_error_vs_torch']:.3g}"
                  f" (B=1, {cfg.sample_size // 2}x{cfg.sample_size // 2}: "
                  f"{entry['stock_ort_cpu']['max_abs_error_vs_torch_b1_half_size']})")
        else:
            print(f"      {name}: {err}")
            y2, err2 = stock_cpu(split_packed_mha(model), feeds)
            if err2 is None:
                entry["stock_ort_cpu"]["split_packed_mha_max_abs_error_vs_torch"] = float(np.max(np.abs(y2 - ref)))
                print(f"      {name} with its packed MHA split to Q/K/V (split_packed_mha): max |ORT - torch| = "
                      f"{entry['stock_ort_cpu']['split_packed_mha_max_abs_error_vs_torch']:.3g}")
            else:
                entry["stock_ort_cpu"]["split_packed_mha_error"] = err2
                print(f"      {name} with split_packed_mha: {err2}")
            if err2 is None:  # the packed KV nodes alone (packed QKV split): stock ORT CPU's error for that form
                _, err3 = stock_cpu(split_packed_mha(model, which=("qkv",)), feeds)
                entry["stock_ort_cpu"]["packed_kv_only_error"] = err3
                print(f"      {name} with only its packed QKV split: {err3}")

    print(f"[5/5] save into {out}", flush=True)
    for name, model in models.items():
        path = out / f"{name}.onnx"
        onnx.save(model, str(path))
        manifest["models"][name].update({"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
        print(f"      {path.name}: {path.stat().st_size / 1e6:.2f} MB")

    if float16_report:
        manifest["float16_report"] = {}
        for name, model in models.items():
            d = describe(to_float16(model))
            manifest["float16_report"][name] = {"mha_nodes": d["mha_nodes"], "attention_nodes": d["attention_nodes"],
                                                "attention_forms_summary": d["attention_forms_summary"],
                                                "inputs": d["inputs"]}
            print(f"      float16 {name}: {d['attention_forms_summary']}")

    manifest["test_feeds"] = {"seed": seed + 100, "note": "sample_inputs(cfg, seed=seed + 100)",
                              **{k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in feeds.items()}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"      MANIFEST.json", flush=True)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURE_DIR, help=f"output folder (default {FIXTURE_DIR})")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--processor", choices=("legacy", "sdpa"), default="legacy",
                        help="diffusers attention processor: legacy AttnProcessor (default) or AttnProcessor2_0")
    parser.add_argument("--float16-report", action="store_true",
                        help="also report the node forms after optimize_pipeline's --float16 conversion")
    args = parser.parse_args(argv)
    command = "python -m mha_ep.models.unet" + ("" if args.out == FIXTURE_DIR else f" --out {args.out}") + (
        f" --seed {args.seed}" if args.seed != SEED else "") + (
        f" --processor {args.processor}" if args.processor != "legacy" else "") + (
        " --float16-report" if args.float16_report else "")
    build(args.out, args.seed, TinyUNet(), args.processor, args.float16_report, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
