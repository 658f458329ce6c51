"""Which export and fusion route turns each model family's attention into nodes mha_ep claims.

A model exported from PyTorch has no MultiHeadAttention until a fusion rewrites its MatMul/Softmax subgraphs, and
which fusion matches depends on the family and on its attention implementation (transformers'
``attn_implementation``: ``"eager"`` writes the MatMul/Softmax out, ``"sdpa"`` calls
``torch.nn.functional.scaled_dot_product_attention``, which each exporter decomposes its own way). Two routes:

  torchscript   ``torch.onnx.export(dynamo=False)``, then ORT's transformer optimizer command
                (``python -m onnxruntime.transformers.optimizer``, OPTIMIZER_COMMAND) with the row's flags.
  dynamo        ``torch.onnx.export(dynamo=True)``, then the onnxscript fusions
                (``onnxscript.rewriter.ort_fusions.optimize_for_ort``), which make ``com.microsoft::Attention`` and
                sometimes MultiHeadAttention; ``--lift-attention`` rewrites the Attention nodes, exactly.

``ROUTES`` lists every row of the table in docs/MODELS.md (``markdown_table`` renders it): the family, the route,
the attention, the flags, and what comes out of a tiny random-weight model of that family (hidden 32, 2 heads,
1 layer): the nodes mha_ep claims, and whether ``mha-ep compare --reference`` finds the fused model faithful to the
model before fusion. tests/models/test_fusion_routes.py measures each row and runs the doc's commands;
``python -m mha_ep.models.families`` prints the rows as measured with your torch, transformers, onnxscript and ORT.
torch and transformers are imported inside the builders.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import onnx

from mha_ep.models import export as ex

HIDDEN, HEADS, LAYERS, SEQ, BATCH = 32, 2, 1, 8, 2
ATTENTIONS = ("eager", "sdpa")
# a family that transformers 5 builds with eager attention only (its model class has _supports_sdpa = False)
NO_SDPA = {"DeBERTa-v2": "DebertaV2Model"}


@dataclass(frozen=True)
class Example:
    """A tiny model of one family, ready to export: the module (keyword arguments inside), its example inputs, and
    the head count and hidden size the ORT optimizer is told (``--num_heads``, ``--hidden_size``)."""

    module: object
    inputs: Tuple[object, ...]
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    dynamic_axes: Dict[str, Dict[int, str]]
    heads: int = HEADS
    hidden: int = HIDDEN


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


def bert_like(name: str, attention: str) -> Example:
    import transformers as tf

    common = dict(vocab_size=100, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                  max_position_embeddings=64, attn_implementation=attention)  # fmt: skip
    if name == "bert":
        return _encoder(lambda c: tf.BertModel(c, add_pooling_layer=False), tf.BertConfig(num_hidden_layers=LAYERS, **common))
    if name == "roberta":
        return _encoder(lambda c: tf.RobertaModel(c, add_pooling_layer=False),
                        tf.RobertaConfig(num_hidden_layers=LAYERS, pad_token_id=1, **common))  # fmt: skip
    if name == "distilbert":
        config = tf.DistilBertConfig(vocab_size=100, dim=HIDDEN, n_heads=HEADS, hidden_dim=2 * HIDDEN, n_layers=LAYERS,
                                     max_position_embeddings=64, attn_implementation=attention)  # fmt: skip
        return _encoder(tf.DistilBertModel, config)
    if name == "electra":
        return _encoder(tf.ElectraModel, tf.ElectraConfig(num_hidden_layers=LAYERS, embedding_size=HIDDEN, **common))
    if name == "albert":
        # 2 layers and a narrower embedding, as ALBERT has: the first layer then reads the embedding projection
        return _encoder(tf.AlbertModel, tf.AlbertConfig(num_hidden_layers=2, embedding_size=HIDDEN // 2, **common))
    if name == "deberta-v2":
        return _encoder(tf.DebertaV2Model, tf.DebertaV2Config(num_hidden_layers=LAYERS, **common))
    raise ValueError(f"unknown BERT-like family {name!r}")


def vit(attention: str) -> Example:
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = tf.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=2 * HIDDEN, image_size=32, patch_size=8, attn_implementation=attention)  # fmt: skip
    model = tf.ViTModel(config, add_pooling_layer=False).eval()
    ex.randomize_small_params(model, seed=1)
    module = _wrap(lambda m, pixels: m(pixel_values=pixels).last_hidden_state, model)
    pixels = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return Example(module, (pixels,), ("pixel_values",), ("last_hidden_state",),
                   {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}})  # fmt: skip


def clip_text(attention: str) -> Example:
    import transformers as tf

    config = tf.CLIPTextConfig(vocab_size=100, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=2 * HIDDEN, max_position_embeddings=64, attn_implementation=attention)  # fmt: skip
    return _encoder(tf.CLIPTextModel, config)


WAV2VEC2_SAMPLES = 400  # the tiny model's conv stack (kernels 10 and 3, strides 5 and 2) wants this many samples


def wav2vec2(masked: bool, attention: str) -> Example:
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = tf.Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=2 * HIDDEN, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                               feat_extract_norm="layer", do_stable_layer_norm=True, attn_implementation=attention)  # fmt: skip
    model = tf.Wav2Vec2Model(config).eval()
    ex.randomize_small_params(model, seed=1)
    audio = torch.randn(BATCH, WAV2VEC2_SAMPLES, generator=torch.Generator().manual_seed(0))
    axes = {"input_values": {0: "batch", 1: "samples"}, "last_hidden_state": {0: "batch", 1: "frames"}}
    if not masked:
        module = _wrap(lambda m, values: m(input_values=values).last_hidden_state, model)
        return Example(module, (audio,), ("input_values",), ("last_hidden_state",), axes)
    mask = torch.ones(BATCH, WAV2VEC2_SAMPLES, dtype=torch.int64)
    mask[1, 3 * WAV2VEC2_SAMPLES // 4 :] = 0
    module = _wrap(lambda m, values, mask: m(input_values=values, attention_mask=mask).last_hidden_state, model)
    axes["attention_mask"] = {0: "batch", 1: "samples"}
    return Example(module, (audio, mask), ("input_values", "attention_mask"), ("last_hidden_state",), axes)


def _seq2seq_config(kind: str, attention: str):
    import transformers as tf

    if kind == "bart":
        return tf.BartConfig(vocab_size=100, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                             encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                             decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=64, attn_implementation=attention)  # fmt: skip
    return tf.T5Config(vocab_size=100, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS,
                       num_decoder_layers=LAYERS, num_heads=HEADS, attn_implementation=attention)  # fmt: skip


def seq2seq(kind: str, part: str, attention: str) -> Example:
    """BART or T5: the encoder alone, or the whole model (encoder + decoder, no cache) giving logits."""
    import torch
    import transformers as tf

    ex.seed_everything(0)
    config = _seq2seq_config(kind, attention)
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


# mha_ep/models/whisper.py's own small model and export wrappers: the encoder, the first decoder step (it makes
# the cache) and the decoder with past (it reads it). Its TorchScript export (whisper.export_part) stands in for
# transformers' causal mask, which ORT's BART fusion needs; the dynamo exporter takes the wrappers as they are.
WHISPER_PARTS = {"Whisper encoder": "encoder", "Whisper first decoder step": "decoder_init",
                 "Whisper decoder with past": "decoder"}  # fmt: skip


def small_whisper(attention: str):
    from mha_ep.models import whisper

    model = whisper.small_whisper()
    model.set_attn_implementation(attention)
    return model


def whisper_part(part: str, attention: str) -> Example:
    """One Whisper part as an Example, with the inputs, names and dynamic axes of whisper.export_part."""
    import torch

    from mha_ep.models import whisper

    model = small_whisper(attention)
    config = model.config
    layers, heads, hidden = config.decoder_layers, config.decoder_attention_heads, config.d_model
    positions = config.max_source_positions
    modules = dict(zip(whisper.PARTS, whisper._wrappers(model)))  # noqa: SLF001 - the wrappers export_part uses
    module = _wrap(lambda m, *args: m(*args), modules[part])  # forward(*args), as export_dynamo's shapes expect
    generator = torch.Generator().manual_seed(0)
    if part == "encoder":
        features = torch.randn(BATCH, config.num_mel_bins, 2 * positions, generator=generator)
        return Example(module, (features,), ("input_features",), ("encoder_hidden_states",),
                       {"input_features": {0: "batch"}, "encoder_hidden_states": {0: "batch"}}, heads, hidden)  # fmt: skip
    ids = torch.randint(3, config.vocab_size, (BATCH, 4), generator=generator)
    if part == "decoder_init":
        states = torch.randn(BATCH, positions, hidden, generator=generator)
        outputs = ("logits", *whisper._names(layers, "present", "self"), *whisper._names(layers, "present", "cross"))  # noqa: SLF001
        return Example(module, (ids, states), ("input_ids", "encoder_hidden_states"), outputs,
                       {"input_ids": {0: "batch", 1: "decode_len"}, "encoder_hidden_states": {0: "batch"}}, heads,
                       hidden)  # fmt: skip
    self_names, cross_names = whisper._names(layers, "past", "self"), whisper._names(layers, "past", "cross")  # noqa: SLF001
    head_size = hidden // heads
    pasts = [torch.randn(BATCH, heads, 3, head_size, generator=generator) for _ in self_names]
    pasts += [torch.randn(BATCH, heads, positions, head_size, generator=generator) for _ in cross_names]
    axes = {"input_ids": {0: "batch"}}
    axes.update({name: {0: "batch", 2: "past_decode_len"} for name in self_names})
    axes.update({name: {0: "batch"} for name in cross_names})
    outputs = ("logits", *whisper._names(layers, "present", "self"))  # noqa: SLF001
    return Example(module, (ids[:, :1], *pasts), ("input_ids", *self_names, *cross_names), outputs, axes, heads, hidden)


EXAMPLES: Dict[str, Callable[[str], Example]] = {
    "BERT": lambda attention: bert_like("bert", attention),
    "RoBERTa": lambda attention: bert_like("roberta", attention),
    "DistilBERT": lambda attention: bert_like("distilbert", attention),
    "ELECTRA": lambda attention: bert_like("electra", attention),
    "ALBERT": lambda attention: bert_like("albert", attention),
    "DeBERTa-v2": lambda attention: bert_like("deberta-v2", attention),
    "ViT": vit,
    "CLIP text": clip_text,
    "Wav2Vec2, masked": lambda attention: wav2vec2(True, attention),
    "Wav2Vec2, no mask": lambda attention: wav2vec2(False, attention),
    "BART encoder": lambda attention: seq2seq("bart", "encoder", attention),
    "BART encoder-decoder": lambda attention: seq2seq("bart", "seq2seq", attention),
    "T5 encoder": lambda attention: seq2seq("t5", "encoder", attention),
    "T5 encoder-decoder": lambda attention: seq2seq("t5", "seq2seq", attention),
    **{family: (lambda attention, part=part: whisper_part(part, attention)) for family, part in WHISPER_PARTS.items()},
}

# the symbolic input dims the tiny model needs set for compare's random feeds (others get mha_ep's default)
DIMS = {"Wav2Vec2, masked": {"samples": WAV2VEC2_SAMPLES}, "Wav2Vec2, no mask": {"samples": WAV2VEC2_SAMPLES}}


def export_torchscript(family: str, attention: str) -> onnx.ModelProto:
    """The TorchScript export of the family's tiny model (Whisper: through whisper.export_part)."""
    if family in WHISPER_PARTS:
        from mha_ep.models import whisper

        return whisper.export_part(small_whisper(attention), WHISPER_PARTS[family])
    example = EXAMPLES[family](attention)
    return ex.torch_export(example.module, example.inputs, example.input_names, example.output_names,
                           example.dynamic_axes)  # fmt: skip


# docs/MODELS.md prints this command; $HEADS and $HIDDEN are the model's, $FLAGS the row's
OPTIMIZER_COMMAND = ("python -m onnxruntime.transformers.optimizer --input model.onnx --output model_mha.onnx "
                     "--num_heads $HEADS --hidden_size $HIDDEN $FLAGS")  # fmt: skip


def optimizer_arguments(flags: str, heads: int, hidden: int, source: str, target: str) -> List[str]:
    """OPTIMIZER_COMMAND's arguments (after ``python -m onnxruntime.transformers.optimizer``), filled in."""
    values = {"model.onnx": [source], "model_mha.onnx": [target], "$HEADS": [str(heads)], "$HIDDEN": [str(hidden)],
              "$FLAGS": shlex.split(flags)}  # fmt: skip
    return [word for token in shlex.split(OPTIMIZER_COMMAND)[3:] for word in values.get(token, [token])]


def optimize(exported: onnx.ModelProto, flags: str, heads: int, hidden: int) -> onnx.ModelProto:
    """ORT's optimizer command on ``exported``, in this process: the command's own argument parser and the steps
    its main() takes for these flags (main() itself also resets the root logger, which a caller's logging keeps).
    tests/models/test_fusion_routes.py runs the command itself too."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp, ex._cwd(tmp):  # noqa: SLF001 - the optimizer drops files in the cwd
        onnx.save(exported, "model.onnx")
        argv = ["optimizer.py", *optimizer_arguments(flags, heads, hidden, "model.onnx", "model_mha.onnx")]
        with mock.patch.object(sys, "argv", argv):
            args = optimizer._parse_arguments()  # noqa: SLF001 - the command's parser, so FLAGS mean what they mean there
        model = optimizer.optimize_model(args.input, args.model_type, args.num_heads, args.hidden_size,
                                         opt_level=args.opt_level, optimization_options=FusionOptions.parse(args),
                                         use_gpu=args.use_gpu, provider=args.provider,
                                         only_onnxruntime=args.only_onnxruntime)  # fmt: skip
        model.save_model_to_file(args.output, args.use_external_data_format, convert_attribute=args.convert_attribute)
        return onnx.load(args.output)


def export_dynamo(example: Example) -> Tuple[onnx.ModelProto, onnx.ModelProto]:
    """The dynamo exporter with its own optimization (the model before fusion), then the onnxscript fusions for
    ORT (the fused model)."""
    import torch
    from onnxscript import ir
    from onnxscript.rewriter import ort_fusions

    dynamic = {name: dict(axes) for name, axes in example.dynamic_axes.items() if name in example.input_names}
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
        logging.getLogger("onnxscript").setLevel(logging.ERROR)
        with torch.no_grad():
            program = torch.onnx.export(example.module, example.inputs, dynamo=True, optimize=True,
                                        input_names=list(example.input_names), output_names=list(example.output_names),
                                        dynamic_shapes=(tuple(dynamic.get(n) for n in example.input_names),),  # forward(*args)
                                        verbose=False)  # fmt: skip
        exported = program.model_proto
        model, _ = ort_fusions.optimize_for_ort(ir.from_proto(exported))
        path = Path(tmp) / "model.onnx"
        ir.save(model, str(path))
        return exported, onnx.load(str(path))


LIFT = "--lift-attention"


@dataclass(frozen=True)
class Route:
    """One row of the fusion table: ``family`` exported by ``route`` with ``attention`` and fused with ``flags``;
    ``claimed`` MHA nodes come out of the tiny model (0: the row's ``blocked_by`` says why none do), and
    ``faithful`` says whether ``compare --reference`` finds the fused model's outputs within tolerance of the
    model before fusion, ``error`` the largest difference it measured here (two significant digits)."""

    family: str
    route: str  # "torchscript" or "dynamo"
    attention: str  # transformers' attn_implementation: "eager" or "sdpa"
    flags: str  # the ORT optimizer's flags (torchscript; "" for dynamo, whose fusions take none)
    claimed: int
    outcome: str  # what the fusion makes, in words
    blocked_by: str = ""  # for a row with claimed == 0 (or fewer than every layer): the pattern no fusion matches
    lift: bool = False  # mha_ep's --lift-attention (partition / compare): the fused model's Attention nodes lifted
    faithful: bool = True
    error: float = 0.0

    @property
    def mha_ep_flags(self) -> str:
        """The flags ``mha-ep compare`` takes for this row: --lift-attention, and the dims of the tiny model."""
        dims = " ".join(f"--dim {name}={value}" for name, value in DIMS.get(self.family, {}).items())
        return " ".join(filter(None, [LIFT if self.lift else "", dims]))

    @property
    def verdict_exit(self) -> int:
        """The exit code of the row's ``mha-ep compare --reference``: 4 FUSION CHANGED THE MODEL, 3 NOTHING
        CLAIMED, 0 PASS."""
        return 4 if not self.faithful else 3 if self.claimed == 0 else 0


@dataclass
class Built:
    """A row's tiny model as exported (the reference) and after its fusion, before mha_ep's partition."""

    exported: onnx.ModelProto
    fused: onnx.ModelProto


def heads_and_hidden(family: str) -> Tuple[int, int]:
    """$HEADS and $HIDDEN of the optimizer command for the family's tiny model."""
    if family in WHISPER_PARTS:
        from mha_ep.models import whisper

        return whisper.SmallWhisper.heads, whisper.SmallWhisper.d_model
    return HEADS, HIDDEN


def build(route: Route) -> Built:
    if route.route == "dynamo":
        return Built(*export_dynamo(EXAMPLES[route.family](route.attention)))
    exported = export_torchscript(route.family, route.attention)
    return Built(exported, optimize(exported, route.flags, *heads_and_hidden(route.family)))


@dataclass(frozen=True)
class Measurement:
    """What a row's tiny model gives: the claimed count and compare --reference's verdict and worst fusion error."""

    claimed: int
    faithful: bool
    error: float  # the largest absolute difference of an output, stock ORT on the fused model vs on the reference
    verdict: str
    report: str = field(default="", repr=False)

    def matches(self, route: Route) -> bool:
        return (self.claimed, self.faithful) == (route.claimed, route.faithful) and self.error_matches(route)

    def error_matches(self, route: Route) -> bool:
        """float32 rounding differs a little between CPUs: a faithful row's error within 4x the table's, or 1e-6."""
        return not route.faithful or self.error <= max(4 * route.error, 1e-6)


def measure(route: Route, built: Optional[Built] = None) -> Measurement:
    """Build the row's model (unless given) and compare it with ``--reference`` as docs/MODELS.md does."""
    from mha_ep.comparison import Verdict, compare

    built = built or build(route)
    report = compare(built.fused, backend="reference", reference=built.exported, dims=DIMS.get(route.family),
                     lift_attention=route.lift)  # fmt: skip
    if report.cannot_run or not report.fusion:
        raise RuntimeError(f"{route.family} via {route.route} ({route.attention}): compare cannot run: {report.text()}")
    claimed = report.partition.claimed if report.partition else 0
    error = max(c.max_abs for c in report.fusion)
    return Measurement(claimed, report.verdict is not Verdict.FUSION_CHANGED, error, report.verdict.value,
                       report.text())  # fmt: skip


def rounded(error: float) -> float:
    """An error as a row records it: two significant digits."""
    return float(f"{error:.1e}")


BERT = "--model_type bert --use_multi_head_attention"
BART = "--model_type bart --opt_level 1 --use_multi_head_attention"
VIT = "--model_type vit --use_multi_head_attention"
CLIP = "--model_type clip --use_multi_head_attention"
MHA, LIFTED, NOTHING = "MultiHeadAttention", "Attention, lifted into MultiHeadAttention", "nothing"
NO_MASK = ("the scores are Softmax(Mul(MatMul(q, k))) with no mask Add, and ORT's fusions only match attention "
           "with a mask")  # fmt: skip
SDPA_TORCHSCRIPT = ("the TorchScript exporter writes sdpa as MatMul(Mul(q, c), Mul(k, c)), the scale split over q and k, "
                    "a form ORT's fusions do not match")  # fmt: skip
T5_EAGER = ("T5's eager attention adds its position bias and its mask in two Adds, Softmax(Add(Add(MatMul(q, k), "
            "bias), mask)), which no fusion of either route matches (its sdpa attention adds them as one)")  # fmt: skip
DEBERTA = ("DeBERTa's disentangled attention adds content-to-position and position-to-content scores gathered by "
           "relative position: no fusion of either route matches it")  # fmt: skip
ALBERT_FIRST = ("the first layer reads ALBERT's embedding projection (MatMul + Add), not a LayerNormalization, where "
                "ORT's BERT fusion anchors its match")  # fmt: skip
BART_SCALED = "with --model_type bart the scores are scaled after the MatMul, a form ORT's BART fusion does not match"
BART_DECODER = ", but the decoder's self-attention loses its causal mask"


def _ts(family, attention, flags, claimed, outcome, error, blocked_by="", lift=False, faithful=True) -> Route:
    return Route(family, "torchscript", attention, flags, claimed, outcome, blocked_by, lift, faithful, error)


def _sdpa_ts(family, error, flags=BERT, lift=False) -> Route:
    """The TorchScript route with sdpa attention: nothing fuses, in every family."""
    return _ts(family, "sdpa", flags, 0, NOTHING, error, SDPA_TORCHSCRIPT, lift)


def _dynamo(family, attention, claimed, error, outcome=LIFTED, blocked_by="") -> Route:
    return Route(family, "dynamo", attention, "", claimed, outcome, blocked_by, True, True, error)


def _both(make, *args, **kwargs) -> Tuple[Route, Route]:
    """The same row measured with eager and with sdpa attention."""
    return make(*args[:1], "eager", *args[1:], **kwargs), make(*args[:1], "sdpa", *args[1:], **kwargs)


# The table of docs/MODELS.md, measured with torch 2.13, transformers 5.25, onnxscript 0.7.2 and ORT 1.31.1 on
# the tiny models above; tests/models/test_fusion_routes.py checks every row (Measurement.matches).
ROUTES: Tuple[Route, ...] = (
    _ts("BERT", "eager", BERT, 1, MHA, 7.2e-7),
    _sdpa_ts("BERT", 7.2e-7),
    *_both(_dynamo, "BERT", 1, 0.0),
    _ts("RoBERTa", "eager", BERT, 1, MHA, 7.2e-7),
    _sdpa_ts("RoBERTa", 7.2e-7),
    *_both(_dynamo, "RoBERTa", 1, 0.0),
    _ts("DistilBERT", "eager", BERT, 1, MHA, 7.2e-7),
    _sdpa_ts("DistilBERT", 7.2e-7),
    *_both(_dynamo, "DistilBERT", 1, 0.0),
    _ts("ELECTRA", "eager", BERT, 1, MHA, 7.2e-7),
    _sdpa_ts("ELECTRA", 7.2e-7),
    *_both(_dynamo, "ELECTRA", 1, 0.0),
    _ts("ALBERT", "eager", BERT, 1, MHA + " in every layer but the first", 9.5e-7, ALBERT_FIRST),
    _sdpa_ts("ALBERT", 9.5e-7),
    *_both(_dynamo, "ALBERT", 2, 0.0),
    _ts("DeBERTa-v2", "eager", BERT, 0, NOTHING, 9.5e-7, DEBERTA),
    _dynamo("DeBERTa-v2", "eager", 0, 0.0, NOTHING, DEBERTA),
    _ts("ViT", "eager", VIT, 0, NOTHING, 7.2e-7, NO_MASK),
    _sdpa_ts("ViT", 7.2e-7, VIT),
    *_both(_dynamo, "ViT", 1, 4.8e-7),
    _ts("CLIP text", "eager", CLIP, 0, NOTHING, 7.2e-7,
        "ORT's CLIP and BERT fusions do not match CLIP's combined causal and padding mask"),
    _sdpa_ts("CLIP text", 7.2e-7, CLIP),
    *_both(_dynamo, "CLIP text", 1, 7.2e-7),
    _ts("Wav2Vec2, masked", "eager", BERT, 1, MHA, 9.5e-7),
    _sdpa_ts("Wav2Vec2, masked", 9.5e-7),
    _dynamo("Wav2Vec2, masked", "eager", 1, 4.8e-7),
    _dynamo("Wav2Vec2, masked", "sdpa", 1, 4.8e-7, MHA),
    _ts("Wav2Vec2, no mask", "eager", BERT, 0, NOTHING, 7.2e-7, NO_MASK),
    _sdpa_ts("Wav2Vec2, no mask", 7.2e-7),
    _dynamo("Wav2Vec2, no mask", "eager", 1, 4.8e-7),
    _dynamo("Wav2Vec2, no mask", "sdpa", 1, 4.8e-7, MHA),
    _ts("BART encoder", "eager", BERT, 1, MHA, 7.2e-7),
    _sdpa_ts("BART encoder", 1.2e-6),
    _ts("BART encoder", "eager", BART, 0, NOTHING, 1.2e-6, BART_SCALED),
    _sdpa_ts("BART encoder", 1.2e-6, BART),
    *_both(_dynamo, "BART encoder", 1, 0.0),
    _ts("BART encoder-decoder", "eager", BERT, 2, MHA + BART_DECODER, 4.9e-3, faithful=False),
    _sdpa_ts("BART encoder-decoder", 6.0e-8),
    *_both(_dynamo, "BART encoder-decoder", 3, 0.0, "MultiHeadAttention and Attention, lifted"),
    _ts("T5 encoder", "eager", BERT, 0, NOTHING, 4.8e-7, T5_EAGER),
    _sdpa_ts("T5 encoder", 4.8e-7),
    _dynamo("T5 encoder", "eager", 0, 4.8e-7, NOTHING, T5_EAGER),
    _dynamo("T5 encoder", "sdpa", 1, 4.8e-7, MHA),
    _ts("T5 encoder-decoder", "eager", BERT, 0, NOTHING, 7.2e-7, T5_EAGER),
    _sdpa_ts("T5 encoder-decoder", 7.2e-7),
    _dynamo("T5 encoder-decoder", "eager", 0, 7.2e-7, NOTHING, T5_EAGER),
    _dynamo("T5 encoder-decoder", "sdpa", 3, 7.2e-7, MHA),
    _ts("Whisper encoder", "eager", BART, 2, LIFTED, 9.5e-7, lift=True),
    _sdpa_ts("Whisper encoder", 8.3e-7, BART, lift=True),
    _dynamo("Whisper encoder", "eager", 2, 7.2e-7),
    _dynamo("Whisper encoder", "sdpa", 2, 7.2e-7, MHA),
    _ts("Whisper first decoder step", "eager", BART, 4, "MultiHeadAttention (cross) and Attention, lifted (self)",
        5.4e-7, lift=True),
    _sdpa_ts("Whisper first decoder step", 7.2e-7, BART, lift=True),
    *_both(_dynamo, "Whisper first decoder step", 4, 6.0e-7, MHA),
    _ts("Whisper decoder with past", "eager", BART, 4, MHA, 4.8e-7),
    _sdpa_ts("Whisper decoder with past", 4.0e-7, BART),
    _dynamo("Whisper decoder with past", "eager", 4, 4.3e-7, MHA),
    _dynamo("Whisper decoder with past", "sdpa", 4, 6.0e-7, MHA),
)

HEADER = ("family", "export", "attention", "FLAGS (ORT optimizer)", "MHA_EP_FLAGS (mha-ep compare)", "what comes out",
          "claimed (tiny model)", "faithful (compare --reference: max error)")  # fmt: skip
ROUTE_NAMES = {"torchscript": "TorchScript + ORT optimizer", "dynamo": "dynamo + onnxscript fusions"}


def _error_text(error: float) -> str:
    mantissa, _, exponent = f"{error:.1e}".partition("e")
    return "0" if error == 0 else f"{mantissa}e{int(exponent)}"


def cells(route: Route, attention: str) -> Tuple[str, ...]:
    """One row of the table as docs/MODELS.md shows it (``attention``: the row's, or "eager, sdpa")."""
    what = route.outcome + (f": {route.blocked_by}" if route.blocked_by else "")
    faithful = (f"yes ({_error_text(route.error)})" if route.faithful else
                f"no ({_error_text(route.error)}): FUSION CHANGED THE MODEL")  # fmt: skip
    return (route.family, ROUTE_NAMES[route.route], attention, f"`{route.flags}`" if route.flags else "",
            f"`{route.mha_ep_flags}`" if route.mha_ep_flags else "", what, str(route.claimed), faithful)  # fmt: skip


def markdown_table(routes: Sequence[Route] = ROUTES) -> str:
    """The rows as docs/MODELS.md shows them: one line for an eager and an sdpa row that agree in all else."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    index = 0
    while index < len(routes):
        route, attention = routes[index], routes[index].attention
        following = routes[index + 1] if index + 1 < len(routes) else None
        if following is not None and following.attention != route.attention and \
                replace(following, attention=route.attention) == route:
            attention, index = f"{route.attention}, {following.attention}", index + 1
        lines.append("| " + " | ".join(cells(route, attention)) + " |")
        index += 1
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_ep.models.families",
                                     description="Build each row's tiny model, export and fuse it, and print how many "
                                                 "attention nodes mha_ep claims and how far compare --reference finds "
                                                 "the fused model from the model before fusion, against the table.")  # fmt: skip
    parser.add_argument("--family", action="append", help="only this family (repeatable); default: every row")
    parser.add_argument("--attention", choices=ATTENTIONS, help="only rows with this attention")
    parser.add_argument("--markdown", action="store_true", help="then print the rows' table as measured here")
    args = parser.parse_args(argv)
    rows = [r for r in ROUTES if (not args.family or r.family in args.family)
            and (not args.attention or r.attention == args.attention)]  # fmt: skip
    if not rows:
        parser.error(f"no row for {args.family}; the families: {sorted({r.family for r in ROUTES})}")
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    different, measured = 0, []
    for index, row in enumerate(rows, 1):
        try:
            got = measure(row)
            measured.append(replace(row, claimed=got.claimed, faithful=got.faithful, error=rounded(got.error)))
            same = got.matches(row)
            text = f"claimed {got.claimed}, {'faithful' if got.faithful else 'FUSION CHANGED'} ({got.error:.1e})"
        except Exception as error:  # noqa: BLE001 - a row that fails to build is reported, the others still run
            same, text = False, f"error: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
            measured.append(row)
        different += not same
        table = f"claimed {row.claimed}, {'faithful' if row.faithful else 'FUSION CHANGED'} ({row.error:.1e})"
        print(f"[{index}/{len(rows)}] {'ok' if same else 'DIFFERS':7s} {row.family} via {row.route}, {row.attention}"
              f"{' `' + row.flags + '`' if row.flags else ''}: {text} (table: {table})", flush=True)  # fmt: skip
    print(f"{len(rows) - different} of {len(rows)} rows as in the table")
    if args.markdown:
        print(markdown_table(measured))
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
