"""Make tests/fixtures/ort_exports/: tiny random-weight models written by ONNX Runtime's OWN export scripts.

Every model here comes out of ORT 1.31.1's scripts, run as subprocesses on a tiny random model that this script
saves with `save_pretrained` (fixed seed); nothing in ORT is patched. What ships (all fp32, weights inside the
file, no external data):

    whisper_qk_decoder.onnx     Whisper decoder with past, from
                                `convert_to_onnx --optimize_onnx --no_beam_search_op --output_cross_qk`:
                                4 MultiHeadAttention, the 2 cross-attention ones with a 4th output (qk)
    whisper_decoder.onnx        the same decoder without `--output_cross_qk`: 4 MultiHeadAttention, no qk
    whisper_decoder_init.onnx   the first decoder step (no past), from `--separate_encoder_and_decoder_init`:
                                2 MultiHeadAttention (cross) + 2 Attention (self)
    whisper_beamsearch.onnx     the script's default chain: one com.microsoft::WhisperBeamSearch node whose
                                `decoder` subgraph holds 4 MultiHeadAttention and whose `encoder` subgraph
                                (encoder + first decoder step) holds 2 MultiHeadAttention + 4 Attention

The Whisper: vocabulary 281 (the 256 byte symbols in GPT-2's order, no merges, then <|endoftext|> = 256,
<|startoftranscript|> = 257, <|en|>, <|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>,
<|nospeech|>, <|notimestamps|> = 264 and 16 timestamps <|0.00|> = 265 .. <|0.30|>), d_model 64, 4 heads, 2
encoder + 2 decoder layers, FFN 128, 80 mel bins, 128 target positions. max_source_positions stays 1500:
ORT's Whisper script traces the encoder with 3000 mel frames, and transformers' WhisperEncoder refuses any
other length than 2 * max_source_positions.

Not shipped, and why (each step below prints it again):
- The encoder files that the Whisper script writes with `--no_beam_search_op` (`*_encoder_fp32.onnx`: the
  encoder plus the cross K/V projections) hold 2 com.microsoft::Attention and no MultiHeadAttention; the qk and
  plain runs write byte-identical ones.
- A `convert_generation` BeamSearch of an encoder-decoder. `convert_generation` knows gpt2, t5 and mt5 only;
  ORT's BART script (`models/bart/export.py`) imports a `utils` package that the wheel does not ship. For T5, the
  fp32 path always runs ORT's T5 optimizer, which rewrites the position bias into
  com.microsoft::RelativePositionBias, an op with no CPU kernel: the script's own check session on the
  CPU fails ("Could not find an implementation for RelativePositionBias(1)"), it stops after the encoder and
  no BeamSearch model is written. `--try-t5` runs that attempt again and prints the failure.

Known and tolerated: with `--output_cross_qk` the Whisper script also exports a "jump times" model (no
attention) after the decoder and encoder. It calls `torch.onnx.export` without `dynamo=False`, and torch >= 2.9
exports with dynamo by default, which fails on that model (GuardOnDataDependentSymNode in index_QKs). By then
the decoder and encoder are written, optimized and checked against PyTorch; only the script's exit code is 1.
This script accepts that run only if the log's traceback ends in whisper_jump_times and both files exist.

Versions used (2026-12-06, 2 CPU cores, no GPU): Python 3.11.7, torch 2.13.0+cpu, transformers 4.48.3,
tokenizers 0.21.4, onnxruntime 1.31.1, onnx 1.23.2, onnx-ir 1.1.0 (imported by the Whisper script), onnxscript
0.7.2 (torch's dynamo exporter imports it in the jump-times step; without it that step fails one line earlier,
same outcome), numpy 2.4.6, ninja 1.13.2 (the jump-times step compiles two torch extensions; without ninja the
Whisper script runs `pip install ninja` itself), datasets 3.6.0 with huggingface-hub 0.36.2 (the chained model's
parity check imports datasets and, if it is missing, runs `pip install datasets`, which here brought
huggingface-hub 2.4.0, which transformers 4.48 rejects; with datasets installed and HF_DATASETS_OFFLINE=1 the
check fails fast on the hub and the script only warns), sentencepiece 0.2.3 (only for `--try-t5`). Set up, then
run (about 2.5 minutes on 2 cores; two runs gave byte-identical .onnx files):

    python3 -m venv /work/venv-export
    /work/venv-export/bin/pip install torch==2.13.0 transformers==4.48.3 onnxruntime==1.31.1 onnx==1.23.2 \\
        onnx-ir==1.1.0 onnxscript==0.7.2 ninja 'datasets<4' 'huggingface-hub<1.0' sentencepiece
    /work/venv-export/bin/python scripts/make_ort_exports.py --try-t5   # --try-t5: also retry the T5 BeamSearch

It writes the models and MANIFEST.json into tests/fixtures/ort_exports/, then loads and runs every shipped
model with stock onnxruntime on the CPU, with the feeds of tests/ort_export_feeds.py (numpy + onnx only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "ort_exports"
sys.path.insert(0, str(ROOT / "tests"))
import ort_export_feeds  # noqa: E402

SEED = 0
THREADS = "2"
WHISPER_NAME = "whisper-tiny-random"
T5_NAME = "t5-tiny-random"

WHISPER_MODULE = "onnxruntime.transformers.models.whisper.convert_to_onnx"
WHISPER_COMMON = ["--optimize_onnx", "--precision", "fp32"]

# run name -> (extra flags, whether the jump-times failure is expected)
WHISPER_RUNS = {
    "qk": (["--no_beam_search_op", "--output_cross_qk"], True),
    "plain": (["--no_beam_search_op"], False),
    "separate": (["--no_beam_search_op", "--separate_encoder_and_decoder_init"], False),
    "beamsearch": ([], False),
}

# fixture -> (run, file the script writes, what it is)
FIXTURES = {
    "whisper_qk_decoder.onnx": (
        "qk",
        f"{WHISPER_NAME}_decoder_fp32.onnx",
        "Whisper decoder with past (self-attention KV cache in, cross K/V as inputs), cross-attention MHA with "
        "output_qk (4th output), from --no_beam_search_op --output_cross_qk",
    ),
    "whisper_decoder.onnx": (
        "plain",
        f"{WHISPER_NAME}_decoder_fp32.onnx",
        "Whisper decoder with past, from --no_beam_search_op (no qk outputs)",
    ),
    "whisper_decoder_init.onnx": (
        "separate",
        f"{WHISPER_NAME}_decoder_init_fp32.onnx",
        "Whisper first decoder step (input_ids + encoder_hidden_states in, self and cross present K/V out), from "
        "--no_beam_search_op --separate_encoder_and_decoder_init",
    ),
    "whisper_beamsearch.onnx": (
        "beamsearch",
        f"{WHISPER_NAME}_beamsearch.onnx",
        "Whisper chained by the script's default (no --no_beam_search_op): one com.microsoft::WhisperBeamSearch "
        "node, subgraph attributes encoder (encoder + first decoder step) and decoder (decoder with past)",
    ),
}


def step(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=THREADS,
        MKL_NUM_THREADS=THREADS,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONHASHSEED="0",
    )
    # The scripts shell out to `pip` by name: keep this interpreter's venv first on PATH.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def randomize_(model, seed: int) -> None:
    """Random init leaves biases at 0 and LayerNorm at 1; give them random values so nothing is shared."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias") or "layer_norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make_whisper_folder(folder: Path) -> dict:
    """A tiny random WhisperForConditionalGeneration with a tiny valid Whisper tokenizer and processor."""
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    # Byte-level BPE with the 256 byte symbols in GPT-2's order (so ' ' -> 'Ġ' is 220, as in Whisper) and no
    # merges: it encodes any text, one token per byte.
    vocab = {sym: i for i, sym in enumerate(bytes_to_unicode().values())}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    specials = [
        "<|startoftranscript|>",
        "<|en|>",
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ] + [f"<|{0.02 * i:.2f}|>" for i in range(16)]
    tok = WhisperTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))  # adds <|endoftext|> = 256
    tok.add_special_tokens({"additional_special_tokens": specials})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", *specials]}
    tok.save_pretrained(folder)
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok).save_pretrained(folder)

    eot = ids["<|endoftext|>"]
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,  # ORT's script traces 3000 mel frames; Whisper needs 2 * this
        max_target_positions=128,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        begin_suppress_tokens=[220, eot],
        suppress_tokens=[],
    )
    torch.manual_seed(SEED)
    model = WhisperForConditionalGeneration(config).eval()
    randomize_(model, SEED)
    model.save_pretrained(folder, safe_serialization=True)
    return {"vocab_size": len(tok), "special_token_ids": ids}


def make_t5_folder(folder: Path) -> None:
    """A tiny random T5ForConditionalGeneration with a tiny sentencepiece vocabulary (for --try-t5)."""
    import sentencepiece as spm
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    text = [
        "translate English to French: The product is released",
        "summarize: research continues to show that pets bring real health benefits to their owners.",
        "Having a dog around can lead to lower levels of stress for both adults and kids.",
        "walk in park",
        "the quick brown fox jumps over the lazy dog",
    ] * 4
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(folder / "spiece"),
        vocab_size=96,
        hard_vocab_limit=False,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (folder / "spiece.vocab").unlink()
    T5Tokenizer(str(folder / "spiece.model"), extra_ids=0, legacy=True).save_pretrained(folder)
    config = T5Config(
        vocab_size=80,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(SEED)
    model = T5ForConditionalGeneration(config).eval()
    randomize_(model, SEED)
    model.save_pretrained(folder, safe_serialization=True)


def run_script(cmd: list[str], log: Path, cwd: Path) -> int:
    step("  $ " + " ".join(cmd))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=child_env())
    step(f"  exit code {rc} after {time.time() - t0:.0f} s (log: {log})")
    return rc


def display_cmd(module: str, args: list[str]) -> str:
    return "python -m " + module + " " + " ".join(args)


def mha_counts(graph: onnx.GraphProto) -> dict:
    """MultiHeadAttention nodes in `graph` and in every graph attribute below it, recursively."""
    main = [n for n in graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]
    sub = []
    attention = [n for n in graph.node if n.op_type == "Attention" and n.domain == "com.microsoft"]
    subgraphs = {}

    def walk(g: onnx.GraphProto, path: str) -> None:
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    sg_path = f"{path}/{n.op_type}:{n.name}.{a.name}"
                    m = [x for x in a.g.node if x.op_type == "MultiHeadAttention" and x.domain == "com.microsoft"]
                    att = [x for x in a.g.node if x.op_type == "Attention" and x.domain == "com.microsoft"]
                    subgraphs[sg_path] = {
                        "multihead_attention": len(m),
                        "with_qk_output": sum(1 for x in m if len(x.output) > 3 and x.output[3]),
                        "attention": len(att),
                    }
                    sub.extend(m)
                    walk(a.g, sg_path)

    walk(graph, "main")
    qk = lambda nodes: sum(1 for x in nodes if len(x.output) > 3 and x.output[3])  # noqa: E731
    return {
        "main_graph": {"multihead_attention": len(main), "with_qk_output": qk(main), "attention": len(attention)},
        "subgraphs_total": {"multihead_attention": len(sub), "with_qk_output": qk(sub)},
        "subgraphs": subgraphs,
    }


def io_of(graph: onnx.GraphProto) -> dict:
    def desc(v: onnx.ValueInfoProto) -> dict:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": shape}

    inits = {i.name for i in graph.initializer}
    return {
        "inputs": [desc(v) for v in graph.input if v.name not in inits],
        "outputs": [desc(v) for v in graph.output],
    }


def embed_and_save(src: Path, dst: Path) -> None:
    """Load with any external data and save with every tensor inside the one file."""
    model = onnx.load(str(src), load_external_data=True)
    onnx.save_model(model, str(dst), save_as_external_data=False)
    onnx.load(str(dst))  # reads back


def feeds_for(name: str, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Valid random feeds (seeded by the fixture's name) for a shipped fixture; see tests/ort_export_feeds.py."""
    return ort_export_feeds.feeds_for_model(model, name)


def run_on_cpu(path: Path) -> tuple[list[dict], dict, list]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = int(THREADS)
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = feeds_for(path.name, onnx.load(str(path), load_external_data=False))
    outs = sess.run(None, feeds)
    result = []
    for meta, value in zip(sess.get_outputs(), outs):
        finite = bool(np.isfinite(value).all()) if value.dtype.kind == "f" else True
        result.append({"name": meta.name, "shape": list(value.shape), "dtype": value.dtype.name, "finite": finite})
    feeds_desc = {k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in feeds.items()}
    return result, feeds_desc, outs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ["torch", "transformers", "tokenizers", "onnxruntime", "onnx", "onnx-ir", "onnxscript", "numpy",
                "ninja", "datasets", "huggingface-hub", "sentencepiece"]:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="build folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the build folder")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--try-t5", action="store_true", help="also retry convert_generation on a tiny T5")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(int(THREADS))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ort_exports_"))
    work.mkdir(parents=True, exist_ok=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    step(f"versions: {versions()}")
    step(f"build folder: {work}")

    step(f"[1] tiny random Whisper + tokenizer + processor -> {work / WHISPER_NAME}")
    whisper_info = make_whisper_folder(work / WHISPER_NAME)
    step(f"    vocab {whisper_info['vocab_size']}, special ids {whisper_info['special_token_ids']}")

    commands = {}
    for i, (run, (flags, jump_times_may_fail)) in enumerate(WHISPER_RUNS.items(), start=2):
        run_dir = work / f"out_{run}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        script_args = ["-m", WHISPER_NAME, "--output", f"out_{run}", "--cache_dir", "cache", *WHISPER_COMMON, *flags]
        commands[run] = display_cmd(WHISPER_MODULE, script_args)
        step(f"[{i}] ORT Whisper export '{run}'")
        rc = run_script([sys.executable, "-m", WHISPER_MODULE, *script_args], work / f"log_{run}.txt", work)
        if rc != 0:
            log = (work / f"log_{run}.txt").read_text()
            tail = log[log.rfind("Traceback") :] if "Traceback" in log else log[-2000:]
            if jump_times_may_fail and "whisper_jump_times.py" in tail:
                step("    tolerated: the jump-times model (no attention) failed to export with torch's dynamo "
                     "default; the decoder and encoder were written and verified before it")
                commands[run] += "  # exits 1 in the jump-times export, after writing decoder and encoder"
            else:
                print(tail[-3000:])
                raise SystemExit(f"ORT Whisper export '{run}' failed (exit code {rc})")
        for f in sorted(run_dir.glob("*.onnx")):
            counts = mha_counts(onnx.load(str(f), load_external_data=False).graph)
            n_mha = counts["main_graph"]["multihead_attention"] + counts["subgraphs_total"]["multihead_attention"]
            step(f"    wrote {f.name} ({f.stat().st_size} bytes): MultiHeadAttention {n_mha}")

    same = sha256(work / "out_plain" / f"{WHISPER_NAME}_decoder_fp32.onnx") == sha256(
        work / "out_separate" / f"{WHISPER_NAME}_decoder_fp32.onnx"
    )
    step(f"    decoder of 'separate' identical to 'plain': {same} (only 'plain' ships)")
    same_enc = sha256(work / "out_plain" / f"{WHISPER_NAME}_encoder_fp32.onnx") == sha256(
        work / "out_qk" / f"{WHISPER_NAME}_encoder_fp32.onnx"
    )
    step(f"    encoder of 'qk' identical to 'plain': {same_enc}; encoders hold no MultiHeadAttention: not shipped")

    t5_note = None
    if args.try_t5:
        step(f"[6] tiny random T5 -> {work / T5_NAME}, then convert_generation (expected to fail on the CPU)")
        make_t5_folder(work / T5_NAME)
        t5_args = ["-m", T5_NAME, "--model_type", "t5", "--output", "out_t5/t5_beamsearch.onnx",
                   "--cache_dir", "cache", "-p", "fp32"]
        rc = run_script([sys.executable, "-m", "onnxruntime.transformers.convert_generation", *t5_args],
                        work / "log_t5.txt", work)
        log = (work / "log_t5.txt").read_text()
        reason = [ln for ln in log.splitlines() if "Could not find an implementation" in ln]
        t5_note = {"command": display_cmd("onnxruntime.transformers.convert_generation", t5_args), "exit_code": rc,
                   "beamsearch_written": (work / "out_t5" / "t5_beamsearch.onnx").exists(),
                   "reason": reason[0].strip() if reason else log[-500:]}
        step(f"    T5: exit code {rc}, BeamSearch written: {t5_note['beamsearch_written']}; {t5_note['reason']}")

    step(f"[7] copy fixtures with weights inside the file -> {out}")
    for old in out.glob("*.onnx"):
        old.unlink()
    manifest = {
        "about": "Tiny random-weight models written by ONNX Runtime 1.31.1's own export scripts; made by "
        "scripts/make_ort_exports.py (its docstring says how). MHA counts are com.microsoft::MultiHeadAttention "
        "nodes; with_qk_output counts those with a non-empty 4th output (output_qk).",
        "versions": versions(),
        "seed": SEED,
        "whisper_model": {
            "config": {"vocab_size": whisper_info["vocab_size"], "d_model": 64, "heads": 4, "encoder_layers": 2,
                       "decoder_layers": 2, "ffn_dim": 128, "num_mel_bins": 80, "max_source_positions": 1500,
                       "max_target_positions": 128},
            "special_token_ids": whisper_info["special_token_ids"],
        },
        "not_shipped": {
            "whisper encoder (--no_beam_search_op)": "holds 2 com.microsoft::Attention, no MultiHeadAttention",
            "convert_generation BeamSearch (T5/BART)": "convert_generation knows gpt2/t5/mt5 only; ORT's BART "
            "script imports a `utils` package the wheel lacks; ORT's T5 optimizer (always run for fp32) makes "
            "com.microsoft::RelativePositionBias, which has no CPU kernel, so the script's CPU check session fails "
            "and no BeamSearch model is written",
        },
        "files": {},
    }
    if t5_note:
        manifest["not_shipped"]["t5_attempt"] = t5_note
    for name, (run, src_name, what) in FIXTURES.items():
        dst = out / name
        embed_and_save(work / f"out_{run}" / src_name, dst)
        model = onnx.load(str(dst))
        manifest["files"][name] = {
            "what": what,
            "made_by": commands[run],
            "script_output_file": src_name,
            "bytes": dst.stat().st_size,
            "sha256": sha256(dst),
            **io_of(model.graph),
            "mha": mha_counts(model.graph),
        }
        step(f"    {name}: {dst.stat().st_size} bytes")

    step("[8] run every fixture on stock onnxruntime, CPUExecutionProvider")
    for name in FIXTURES:
        outs, feeds_desc, values = run_on_cpu(out / name)
        manifest["files"][name]["cpu_run"] = {"feeds": feeds_desc, "outputs": outs}
        step(f"    {name}: ok")
        for o in outs:
            print(f"        {o['name']}: {o['dtype']} {o['shape']}" + ("" if o["finite"] else " NOT FINITE"))
        if name == "whisper_beamsearch.onnx":
            print(f"        sequences[0]: {values[0][0].tolist()}")
        if not all(o["finite"] for o in outs):
            raise SystemExit(f"{name}: outputs not finite")

    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    step(f"[9] wrote {out / 'MANIFEST.json'}; {out} holds {total} bytes ({total / 2**20:.2f} MiB)")
    if args.workdir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
