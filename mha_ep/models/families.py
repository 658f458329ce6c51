"""Which export and fusion route turns each model family's attention into nodes mha_ep claims.

A model exported from PyTorch has no MultiHeadAttention until a fusion rewrites its MatMul/Softmax subgraphs, and
which fusion matches depends on the family. Two routes:

  torchscript   ``torch.onnx.export(dynamo=False)`` with eager attention, then ORT's transformer optimizer
                (``onnxruntime.transformers.optimizer``) with ``--use_multi_head_attention`` and the row's flags.
  dynamo        ``torch.onnx.export(dynamo=True)``, then the onnxscript fusions
                (``onnxscript.rewriter.ort_fusions.optimize_for_ort``), which make ``com.microsoft::Attention``;
                ``mha_ep.partition(..., lift_attention=True)`` (CLI: ``--lift-attention``) rewrites those, exactly.

``ROUTES`` lists every row of the table in docs/MODELS.md: the family, the route, its flags, and what comes out
of a tiny random-weight model of that family (hidden 32, 2 heads, 1 layer). tests/models/test_fusion_routes.py
builds each and checks the count of claimed nodes; ``python -m mha_ep.models.families`` prints the table as
measured here, with your torch and transformers. torch and transformers are imported inside the builders.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import onnx

from mha_ep.models import export as ex

HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32, 2, 1, 8, 2


@dataclass(frozen=True)
class Example:
    """A tiny model of one family, ready to export: the module (keyword arguments inside), its example inputs."""

    module: object
    inputs: Tuple[object, ...]
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    dynamic_axes: Dict[str, Dict[int, str]]


@dataclass(frozen=True)
class Route:
    """One row of the fusion table: ``family`` exported by ``route`` with ``flags``; ``claimed`` MHA nodes come out
    of the tiny model (``None``: the row's ``blocked_by`` says why nothing does)."""

    family: str
    route: str  # "torchscript" or "dynamo"
    flags: str  # the ORT optimizer's flags (torchscript; "" for dynamo, whose fusions take none)
    claimed: int
    outcome: str  # what the fusion makes, in words
    blocked_by: str = ""  # for a row with claimed == 0: the pattern that no fusion matches
    model_type: str = ""
    opt_level: int = 0
    lift: bool = False  # mha_ep's --lift-attention (partition / compare): the fused model's Attention nodes lifted


def _wrap(forward: Callable, model):
    import torch

    class Wrapper(torch.nn.Module):  # keyword arguments: transformers 5 under the TorchScript exporter
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return forward(self.model, *args)

    return Wrapper().eval()


def _text_inputs(vocab: int, mask: bool = True):
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=generator)
    attention = torch.ones(BATCH, SEQ, dtype=torch.int64)
    attention[1, SEQ // 2 :] = 0
    return (ids, attention) if mask else (ids,)


def _axes(names: Sequence[str]) -> Dict[str, Dict[int, str]]:
    return {name: {0: "batch", 1: "sequence"} for name in names}


def _encoder(model_class, config) -> Example:
    """A text encoder whose forward takes input_ids and attention_mask and returns last_hidden_state."""
    ex.seed_everything(0)
    model = model_class(config).eval()
    ex.randomize_small_params(model, seed=1)
    module = _wrap(lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state, model)
    names = ("input_ids", "attention_mask")
    return Example(module, _text_inputs(config.vocab_size), names, ("last_hidden_state",),
                   _axes(names + ("last_hidden_state",)))  # fmt: skip


def bert_like(name: str) -> Example:
    import transformers as tf

    common = dict(vocab_size=100, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                  max_position_embeddings=64, attn_implementation="eager")  # fmt: skip
    if name == "bert":
        return _encoder(lambda c: tf.BertModel(c, add_pooling_layer=False), tf.BertConfig(num_hidden_layers=LAYERS, **common))
    if name == "roberta":
        return _encoder(lambda c: tf.RobertaModel(c, add_pooling_layer=False),
                        tf.RobertaConfig(num_hidden_layers=LAYERS, pad_token_id=1, **common))  # fmt: skip
    if name == "distilbert":
        config = tf.DistilBertConfig(vocab_size=100, dim=HIDDEN, n_heads=HEADS, hidden_dim=2 * HIDDEN, n_layers=LAYERS,
                                     max_position_embeddings=64, attn_implementation="eager")  # fmt: skip
        return _encoder(tf.DistilBertModel, config)
    if name == "electra":
        return _encoder(tf.ElectraModel, tf.ElectraConfig(num_hidden_layers=LAYERS, embedding_size=HIDDEN, **common))
    if name == "albert":
        # 2 layers and a narrower embedding, as ALBERT has: the first layer then reads the embedding projection
        return _encoder(tf.AlbertModel, tf.AlbertConfig(num_hidden_layers=2, embedding_size=HIDDEN // 2, **common))
    if name == "deberta-v2":
        return _encoder(tf.DebertaV2Model, tf.DebertaV2Config(num_hidden_layers=LAYERS, **common))
    raise ValueError(f"unknown BERT-like family {name!r}")


def vit() -> Example:
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = tf.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=2 * HIDDEN, image_size=32, patch_size=8, attn_implementation="eager")  # fmt: skip
    model = tf.ViTModel(config, add_pooling_layer=False).eval()
    ex.randomize_small_params(model, seed=1)
    module = _wrap(lambda m, pixels: m(pixel_values=pixels).last_hidden_state, model)
    pixels = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return Example(module, (pixels,), ("pixel_values",), ("last_hidden_state",),
                   {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}})  # fmt: skip


def clip_text() -> Example:
    import transformers as tf

    config = tf.CLIPTextConfig(vocab_size=100, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=2 * HIDDEN, max_position_embeddings=64, attn_implementation="eager")  # fmt: skip
    return _encoder(tf.CLIPTextModel, config)


def wav2vec2(masked: bool) -> Example:
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = tf.Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=2 * HIDDEN, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                               feat_extract_norm="layer", do_stable_layer_norm=True, attn_implementation="eager")  # fmt: skip
    model = tf.Wav2Vec2Model(config).eval()
    ex.randomize_small_params(model, seed=1)
    audio = torch.randn(BATCH, 400, generator=torch.Generator().manual_seed(0))
    axes = {"input_values": {0: "batch", 1: "samples"}, "last_hidden_state": {0: "batch", 1: "frames"}}
    if not masked:
        module = _wrap(lambda m, values: m(input_values=values).last_hidden_state, model)
        return Example(module, (audio,), ("input_values",), ("last_hidden_state",), axes)
    mask = torch.ones(BATCH, 400, dtype=torch.int64)
    mask[1, 300:] = 0
    module = _wrap(lambda m, values, mask: m(input_values=values, attention_mask=mask).last_hidden_state, model)
    axes["attention_mask"] = {0: "batch", 1: "samples"}
    return Example(module, (audio, mask), ("input_values", "attention_mask"), ("last_hidden_state",), axes)


def _seq2seq_config(kind: str):
    import transformers as tf

    if kind == "bart":
        return tf.BartConfig(vocab_size=100, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                             encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                             decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=64, attn_implementation="eager")  # fmt: skip
    return tf.T5Config(vocab_size=100, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
                       num_decoder_layers=LAYERS, num_heads=HEADS, attn_implementation="eager")  # fmt: skip


def seq2seq(kind: str, part: str) -> Example:
    """BART or T5: the encoder alone, or the whole model (encoder + decoder, no cache) giving logits."""
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = _seq2seq_config(kind)
    if part == "encoder":
        model_class = tf.BartModel if kind == "bart" else tf.T5EncoderModel
        model = model_class(config).eval()
        ex.randomize_small_params(model, seed=1)
        encoder = model.get_encoder() if kind == "bart" else model
        module = _wrap(lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).last_hidden_state, encoder)
        names = ("input_ids", "attention_mask")
        return Example(module, _text_inputs(100), names, ("last_hidden_state",), _axes(names + ("last_hidden_state",)))
    model_class = tf.BartForConditionalGeneration if kind == "bart" else tf.T5ForConditionalGeneration
    model = model_class(config).eval()
    ex.randomize_small_params(model, seed=1)
    ids, mask = _text_inputs(100)
    decoder_ids = torch.randint(3, 100, (BATCH, 5), generator=torch.Generator().manual_seed(1))
    module = _wrap(
        lambda m, ids, mask, dec: m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, use_cache=False).logits,
        model,
    )
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    axes = _axes(names[:2])
    axes.update({"decoder_input_ids": {0: "batch", 1: "target"}, "logits": {0: "batch", 1: "target"}})
    return Example(module, (ids, mask, decoder_ids), names, ("logits",), axes)


EXAMPLES: Dict[str, Callable[[], Example]] = {
    "BERT": lambda: bert_like("bert"),
    "RoBERTa": lambda: bert_like("roberta"),
    "DistilBERT": lambda: bert_like("distilbert"),
    "ELECTRA": lambda: bert_like("electra"),
    "ALBERT": lambda: bert_like("albert"),
    "DeBERTa-v2": lambda: bert_like("deberta-v2"),
    "ViT": vit,
    "CLIP text": clip_text,
    "Wav2Vec2, masked": lambda: wav2vec2(True),
    "Wav2Vec2, no mask": lambda: wav2vec2(False),
    "BART encoder": lambda: seq2seq("bart", "encoder"),
    "BART encoder-decoder": lambda: seq2seq("bart", "seq2seq"),
    "T5 encoder": lambda: seq2seq("t5", "encoder"),
    "T5 encoder-decoder": lambda: seq2seq("t5", "seq2seq"),
}


def export_torchscript(example: Example) -> onnx.ModelProto:
    return ex.torch_export(example.module, example.inputs, example.input_names, example.output_names,
                           example.dynamic_axes)  # fmt: skip


def export_dynamo(example: Example) -> onnx.ModelProto:
    """The dynamo exporter with its own optimization, then the onnxscript fusions for ORT."""
    import torch
    from onnxscript import ir
    from onnxscript.rewriter import ort_fusions

    dynamic = {name: {axis: torch.export.Dim.AUTO for axis in axes} for name, axes in example.dynamic_axes.items()
               if name in example.input_names}  # fmt: skip
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        logging.getLogger("onnxscript").setLevel(logging.ERROR)
        with torch.no_grad():
            program = torch.onnx.export(example.module, example.inputs, dynamo=True, optimize=True,
                                        input_names=list(example.input_names), output_names=list(example.output_names),
                                        dynamic_shapes=(tuple(dynamic.get(n) for n in example.input_names),),  # forward(*args)
                                        verbose=False)  # fmt: skip
        model = ir.from_proto(program.model_proto)
        model, _ = ort_fusions.optimize_for_ort(model)
        path = Path(tmp) / "model.onnx"
        ir.save(model, str(path))
        return onnx.load(str(path))


WHISPER_PARTS = {"Whisper encoder": "encoder", "Whisper first decoder step": "decoder_init",
                 "Whisper decoder with past": "decoder"}  # fmt: skip


def exported_and_fused(route: Route) -> Tuple[Optional[onnx.ModelProto], onnx.ModelProto]:
    """The row's model as exported (the reference for ``compare --reference``; None on the dynamo route, whose
    exporter already rewrites the graph) and after its fusion, before mha_ep's partition."""
    if route.family in WHISPER_PARTS:  # mha_ep/models/whisper.py's own export wrappers (encoder, two decoder graphs)
        from mha_ep.models import whisper

        model, part = whisper.small_whisper(), WHISPER_PARTS[route.family]
        return whisper.export_part(model, part), whisper.build_part(model, part, lift=False)["model"]
    example = EXAMPLES[route.family]()
    if route.route == "dynamo":
        return None, export_dynamo(example)
    exported = export_torchscript(example)
    fused = ex.fuse(exported, route.model_type, HEADS, HIDDEN, opt_level=route.opt_level)
    return exported, fused


def fused_model(route: Route) -> onnx.ModelProto:
    """The row's model after its export and fusion, before mha_ep's partition."""
    return exported_and_fused(route)[1]


def lifts(route: Route) -> bool:
    return route.lift


def claimed_count(model: onnx.ModelProto, route: Route) -> int:
    """How many attention nodes mha_ep claims in the row's fused model (with the row's --lift-attention)."""
    from mha_ep.partition_pass import partition

    return partition(model, lift_attention=lifts(route)).claimed


LIFT = "--lift-attention"
BERT = "--model_type bert --use_multi_head_attention"
BART = "--model_type bart --opt_level 1 --use_multi_head_attention"
MHA, LIFTED, NOTHING = "MultiHeadAttention", "Attention, lifted into MultiHeadAttention", "nothing"
NO_MASK = ("the scores are Softmax(Mul(MatMul(q, k))) with no mask Add, and ORT's fusions only match attention "
           "with a mask")  # fmt: skip
T5_BIAS = ("T5 adds a relative position bias to unscaled scores, Softmax(Add(Add(MatMul(q, k), bias), mask)): no "
           "fusion of either route matches it")  # fmt: skip
DEBERTA = ("DeBERTa's disentangled attention adds content-to-position and position-to-content scores gathered by "
           "relative position: no fusion of either route matches it")  # fmt: skip


def _ts(family, flags, claimed, outcome, blocked_by="", model_type="bert", opt_level=0, lift=False) -> Route:
    return Route(family, "torchscript", flags, claimed, outcome, blocked_by, model_type=model_type, opt_level=opt_level,
                 lift=lift)  # fmt: skip


def _dynamo(family, claimed, outcome=LIFTED, blocked_by="") -> Route:
    return Route(family, "dynamo", "", claimed, outcome, blocked_by, lift=True)


# The table of docs/MODELS.md, measured with torch 2.13, transformers 5.24, onnxscript 0.7.2 and ORT 1.31.1 on
# the tiny models above (1 layer; ALBERT 2, Whisper 2): the claimed count is what tests/models checks.
ROUTES: Tuple[Route, ...] = (
    _ts("BERT", BERT, 1, MHA),
    _dynamo("BERT", 1),
    _ts("RoBERTa", BERT, 1, MHA),
    _ts("DistilBERT", BERT, 1, MHA),
    _ts("ELECTRA", BERT, 1, MHA),
    _ts("ALBERT", BERT, 1, MHA + " in every layer but the first",
        "the first layer reads ALBERT's embedding projection (MatMul + Add), not a LayerNormalization, where ORT's "
        "BERT fusion anchors its match"),
    _dynamo("ALBERT", 2),
    _ts("DeBERTa-v2", BERT, 0, NOTHING, DEBERTA),
    _dynamo("DeBERTa-v2", 0, NOTHING, DEBERTA),
    _ts("ViT", "--model_type vit --use_multi_head_attention", 0, NOTHING, NO_MASK, model_type="vit"),
    _dynamo("ViT", 1),
    _ts("CLIP text", "--model_type clip --use_multi_head_attention", 0, NOTHING,
        "ORT's CLIP and BERT fusions do not match CLIP's combined causal and padding mask", model_type="clip"),
    _dynamo("CLIP text", 1),
    _ts("Wav2Vec2, masked", BERT, 1, MHA),
    _ts("Wav2Vec2, no mask", BERT, 0, NOTHING, NO_MASK),
    _dynamo("Wav2Vec2, no mask", 1),
    _ts("BART encoder", BERT, 1, MHA),
    _ts("BART encoder", BART, 0, NOTHING, "with --model_type bart the scores are scaled after the MatMul, a form "
        "ORT's BART fusion does not match", model_type="bart", opt_level=1),
    _ts("BART encoder-decoder", BERT, 2, MHA + ", but the decoder's self-attention loses its causal mask: "
        "`compare --reference` says FUSION CHANGED THE MODEL"),
    _dynamo("BART encoder-decoder", 3, "MultiHeadAttention and Attention, lifted"),
    _ts("T5 encoder", BERT, 0, NOTHING, T5_BIAS),
    _dynamo("T5 encoder", 0, NOTHING, T5_BIAS),
    _dynamo("T5 encoder-decoder", 0, NOTHING, T5_BIAS),
    _ts("Whisper encoder", BART, 2, LIFTED, model_type="bart", opt_level=1, lift=True),
    _ts("Whisper first decoder step", BART, 4, "MultiHeadAttention (cross) and Attention, lifted (self)",
        model_type="bart", opt_level=1, lift=True),
    _ts("Whisper decoder with past", BART, 4, MHA, model_type="bart", opt_level=1),
)


def markdown_table(routes: Sequence[Route] = ROUTES) -> str:
    """The rows as docs/MODELS.md shows them."""
    lines = ["| family | export | ORT optimizer flags | mha_ep flag | what comes out | claimed (tiny model) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in routes:
        what = r.outcome + (f": {r.blocked_by}" if r.blocked_by else "")
        export = "TorchScript + ORT optimizer" if r.route == "torchscript" else "dynamo + onnxscript fusions"
        flags = f"`{r.flags}`" if r.flags else "(none)"
        lift = f"`{LIFT}`" if r.lift else ""
        lines.append(f"| {r.family} | {export} | {flags} | {lift} | {what} | {r.claimed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_ep.models.families",
                                     description="Build each row's tiny model, export and fuse it, and print how many "
                                                 "attention nodes mha_ep claims against the table's count.")  # fmt: skip
    parser.add_argument("--family", action="append", help="only this family (repeatable); default: every row")
    args = parser.parse_args(argv)
    rows = [r for r in ROUTES if not args.family or r.family in args.family]
    if not rows:
        parser.error(f"no row for {args.family}; the families: {sorted({r.family for r in ROUTES})}")
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    different = 0
    for index, row in enumerate(rows, 1):
        try:
            got = str(claimed_count(fused_model(row), row))
        except Exception as error:  # noqa: BLE001 - a row that fails to build is reported, the others still run
            got = f"error: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
        different += got != str(row.claimed)
        mark = "ok" if got == str(row.claimed) else "DIFFERS"
        print(f"[{index}/{len(rows)}] {mark:7s} {row.family} via {row.route} `{row.flags}`"
              f"{' ' + LIFT if row.lift else ''}: claimed {got} "
              f"(table: {row.claimed})", flush=True)  # fmt: skip
    print(f"{len(rows) - different} of {len(rows)} rows as in the table")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
