"""ORT's T5 `convert_generation` BeamSearch chain, step by step, without ORT's CPU check sessions.

Run by scripts/make_ort_exports.py in the export venv (torch + transformers + onnxruntime 1.31.1); nothing in ORT
is patched, only its own Python functions are called, with the arguments its command line would pass:

    python -m onnxruntime.transformers.convert_generation -m MODEL --model_type t5 --output OUT -p fp32

runs `convert_generation.main`, which is `convert_generation_model(args)` (export + chain) followed by
`test_t5_model(args)` (HF generate vs an ORT session of the chained model). For T5 fp32 the export,
`t5_to_onnx(args)` -> `models.t5.convert_to_onnx.export_onnx_models(...)`, does for the encoder and then the
decoder: `T5Helper.export_onnx` (torch.onnx), `T5Helper.optimize_onnx` (ORT's T5 fusions: MultiHeadAttention,
SimplifiedLayerNormalization, com.microsoft::RelativePositionBias), then `create_onnxruntime_session` on the CPU and
`T5Helper.verify_onnx` against PyTorch. RelativePositionBias has no CPU kernel, so that session fails for the
encoder, the loop stops, the decoder is never exported and `main` ends in an error.

Subcommand `export` does exactly the steps of `export_onnx_models` with `t5_to_onnx`'s arguments, minus the CPU
session + verify_onnx, then `convert_generation_model(args)` with `--encoder_decoder_init_onnx/--decoder_onnx`
pointing at the optimized files (its documented two-step form, "Example 4"), which writes the BeamSearch model;
`test_t5_model` is not run here.

Subcommand `verify` runs, on models in which make_ort_exports.py replaced every RelativePositionBias by standard ops,
the two checks ORT could not run on the CPU: `T5Helper.verify_onnx` (encoder, decoder vs PyTorch) and
`convert_generation.test_t5_model` (HF `generate(num_beams=...)` vs the BeamSearch model, token for token).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

import onnxruntime.transformers  # noqa: F401  (puts ORT's transformers folder on sys.path, as the CLI does)
from onnxruntime.transformers import convert_generation as cg
from onnxruntime.transformers.models.t5.t5_helper import T5Helper

ORT_ARGS = ["--model_type", "t5", "-p", "fp32"]


def cli_args(model: str, output: str, cache_dir: str, extra: list[str]) -> argparse.Namespace:
    return cg.parse_arguments(["-m", model, "--output", output, "--cache_dir", cache_dir, *ORT_ARGS, *extra])


def export(model: str, output: str, cache_dir: str, out_dir: str) -> dict:
    args = cli_args(model, output, cache_dir, [])
    device = torch.device("cpu")
    # = export_onnx_models(model_name_or_path, cache_dir, output_dir, use_gpu=False, use_external_data_format=False,
    #     optimize_onnx=True, precision="fp32", verbose=False, use_decoder_start_token=False, overwrite=True,
    #     disable_auto_mixed_precision=False, use_int32_inputs=True, model_type="t5", encoder_decoder_init=False,
    #     force_fp16_io=False), the arguments t5_to_onnx passes for `-p fp32`, without the CPU session + verify_onnx.
    models = T5Helper.load_model(args.model_name_or_path, args.cache_dir, device, "t5", "", encoder_decoder_init=False)
    config = models["decoder"].config
    paths = {}
    for name, m in models.items():
        m.to(device)
        onnx_path = T5Helper.get_onnx_path(out_dir, args.model_name_or_path, suffix="_" + name, new_folder=False)
        T5Helper.export_onnx(copy.deepcopy(m).to(device), device, onnx_path, False, False,
                             use_decoder_input_ids=True, use_int32_inputs=True)
        opt_path = T5Helper.get_onnx_path(out_dir, args.model_name_or_path, suffix=f"_{name}_fp32", new_folder=False)
        T5Helper.optimize_onnx(onnx_path, opt_path, False, config.num_heads, config.hidden_size, False,
                               auto_mixed_precision=True, use_gpu=False, force_fp16_io=False)
        paths[name] = opt_path
        print(f"exported and optimized {name}: {opt_path}", flush=True)
    # Example 4 of convert_generation's docstring: chain already exported encoder/decoder.
    chain = ["--encoder_decoder_init_onnx", paths["encoder"], "--decoder_onnx", paths["decoder"]]
    cg.convert_generation_model(cli_args(model, output, cache_dir, chain))
    print(f"BeamSearch model written: {output}", flush=True)
    return {"encoder": paths["encoder"], "decoder": paths["decoder"], "beamsearch": output,
            "chain_args": ORT_ARGS + chain}


def verify(model: str, cache_dir: str, encoder: str, decoder: str, beamsearch: str) -> dict:
    from onnxruntime.transformers.benchmark_helper import create_onnxruntime_session

    device = torch.device("cpu")
    models = T5Helper.load_model(model, cache_dir, device, "t5", "", encoder_decoder_init=False)
    diffs = {}
    for name, path in (("encoder", encoder), ("decoder", decoder)):
        session = create_onnxruntime_session(path, use_gpu=False, verbose=False)
        if session is None:
            raise SystemExit(f"no CPU session for {path}")
        with torch.no_grad():
            diffs[name] = float(T5Helper.verify_onnx(models[name], session, device, True))
        print(f"verify_onnx {name}: max difference vs PyTorch {diffs[name]}", flush=True)
    result = cg.test_t5_model(cli_args(model, beamsearch, cache_dir, ["--total_runs", "1"]))
    print(f"test_t5_model: {result}", flush=True)
    return {"verify_onnx_max_diff": diffs, "test_t5_model_parity": bool(result and result.get("parity"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["export", "verify"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache_dir", default="cache")
    ap.add_argument("--output", help="export: the BeamSearch model to write")
    ap.add_argument("--out_dir", help="export: folder for the encoder/decoder files")
    ap.add_argument("--encoder")
    ap.add_argument("--decoder")
    ap.add_argument("--beamsearch")
    ap.add_argument("--json", required=True, help="write the result here")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.what == "export":
        res = export(a.model, a.output, a.cache_dir, a.out_dir)
    else:
        res = verify(a.model, a.cache_dir, a.encoder, a.decoder, a.beamsearch)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
