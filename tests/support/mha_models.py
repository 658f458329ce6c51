"""Single-node ``com.microsoft::MultiHeadAttention`` models and random feeds for the parity and bad-input tests.

Not a test module: the test files import it. Two levels:

* ``MhaConfig`` + ``build_model(config)`` + ``random_feeds(config, rng)``: a *well-formed* call described by its
  geometry and options; the feeds are drawn in the style of ORT's ``benchmark_mha.random_inputs`` (fresh random
  normal values, never zeros; right-padding key lengths ``randint(1, T+1)``; the (B, T) mask built from those
  lengths).
* ``node_model(inputs, outputs, attributes, shapes=...)``: one MHA node over arbitrary input arrays, used for
  *malformed* calls (tests/claim/test_bad_input.py), where the shapes break a rule on purpose.

Layout legend (as in mha_ep/spec.py): B batch, S query length, L new key/value length, P past length,
T = P + L, N heads, H query/key head size, Hv value head size, D = N*H, Dv = N*Hv.

Model conventions:
* IR version 10; opsets ai.onnx 17 and com.microsoft 1; the node is named ``mha`` and its graph inputs carry the
  slot names of mha_ep/spec.py (``query``, ``key``, ..., ``past_value``); outputs ``output``, ``present_key``,
  ``present_value`` (and ``qk`` when asked for). Absent optional inputs are ``""`` with trailing ones trimmed.
* ``shapes``: ``"static"`` (every dim a number: the claim gate sees everything), ``"symbolic"`` (every dim a
  ``dim_param`` of its own, ``<input>_<axis>``, so the gate sees only ranks and dtypes and the execute-time
  checks see the real shapes) or ``"unranked"`` (no shape at all, so even the rank is decided at run time).
* bfloat16: stock ORT's Python API cannot feed or fetch bfloat16 arrays, and its CPU provider has no bf16 MHA.
  A bfloat16 model therefore takes and returns float32 at the graph boundary: every float input goes through
  ``Cast(to=BFLOAT16)`` into the node and every output through ``Cast(to=FLOAT)`` out of it. The feeds are
  float32 arrays whose values are exactly bfloat16 values (``random_feeds`` rounds them), so the graph computes
  on exactly the values the caller holds. The oracle for bf16 is ``oracle_float64(config, feeds)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx import TensorProto as TP

IR_VERSION = 10
OPSETS = (("", 17), ("com.microsoft", 1))
NODE_NAME = "mha"
INPUT_SLOTS = (
    "query",
    "key",
    "value",
    "bias",
    "key_padding_mask",
    "attention_bias",
    "past_key",
    "past_value",
    "past_sequence_length",
    "cache_indirection",
)
OUTPUT_SLOTS = ("output", "present_key", "present_value", "qk")
ELEM = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "float64": TensorProto.DOUBLE,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "float64": np.float64}
MASK_FORMATS = ("none", "1d", "3b2", "2d", "3d")
BROADCASTS = {  # attention_bias option -> (broadcast dim 0, broadcast dim 1), as in test_mha.get_atten_bias_support
    None: None,
    "BN": (False, False),
    "1N": (True, False),
    "B1": (False, True),
    "11": (True, True),
}


@dataclass(frozen=True)
class MhaConfig:
    """One well-formed MultiHeadAttention call.

    ``has_past`` feeds past_key/past_value of length ``past_seq`` (0 is allowed: an empty past). ``presents`` asks
    for present_key/present_value. ``max_seq`` > 0 makes the past a shared buffer (docs/SEMANTICS.md §3.9): past and
    presents (B, N, max_seq, H), past_sequence_length = [past_seq]; ``beams`` > 0 adds cache_indirection
    (B / beams, beams, max_seq) with random beam indices (§3.10). ``mask_filter_value``/``scale``: None leaves the attribute out (ORT's defaults
    -10000 and 1/sqrt(H)). ``attention_bias`` is a key of BROADCASTS. ``fully_padded`` makes batch 0 attend to no
    key at all through the mask (key length 0 / an all-zero mask row), the case where ORT's additive mask gives
    softmax(scores - 10000) for a finite filter value and NaN for -inf.
    """

    batch: int = 2
    q_seq: int = 3
    kv_seq: int = 5
    num_heads: int = 2
    head_size: int = 8
    v_head_size: Optional[int] = None  # None: = head_size
    past_seq: int = 0
    has_past: bool = False
    presents: bool = False
    dtype: str = "float32"
    kv_layout: str = "BSNH"  # "BSNH": key (B,L,D), value (B,L,Dv); "BNSH": key (B,N,L,H), value (B,N,L,Hv)
    bias: bool = False
    mask: str = "none"  # one of MASK_FORMATS
    mask_dtype: str = "int32"
    fully_padded: bool = False
    attention_bias: Optional[str] = None  # one of BROADCASTS
    causal: bool = False
    mask_filter_value: Optional[float] = None
    scale: Optional[float] = None
    shapes: str = "static"  # "static" | "symbolic" | "unranked"
    max_seq: int = 0  # > 0: a shared buffer of this length (M)
    beams: int = 0  # > 0: cache_indirection with this many beams (W); batch is a multiple of it
    qk: bool = False  # ask for output 3, the scores before the softmax (B, N, S, T), typed like the node (QK = T)

    @property
    def hv(self) -> int:
        return self.head_size if self.v_head_size is None else self.v_head_size

    @property
    def total_seq(self) -> int:
        return self.past_seq + self.kv_seq

    def short(self) -> str:
        """A compact description for assertion messages and test ids."""
        parts = [
            f"B{self.batch} S{self.q_seq} L{self.kv_seq} P{self.past_seq if self.has_past else '-'} "
            f"N{self.num_heads} H{self.head_size} Hv{self.hv} {self.dtype} {self.kv_layout}"
        ]
        if self.max_seq:
            parts.append(f"shared M{self.max_seq}" + (f" W{self.beams}" if self.beams else ""))
        if self.bias:
            parts.append("bias")
        if self.mask != "none":
            parts.append(f"mask={self.mask}/{self.mask_dtype}" + ("/fully-padded" if self.fully_padded else ""))
        if self.attention_bias:
            parts.append(f"attn_bias={self.attention_bias}")
        if self.causal:
            parts.append("causal")
        if self.presents:
            parts.append("presents")
        if self.qk:
            parts.append("qk")
        if self.mask_filter_value is not None:
            parts.append(f"mfv={self.mask_filter_value}")
        if self.scale is not None:
            parts.append(f"scale={self.scale!r}")
        if self.shapes != "static":
            parts.append(self.shapes)
        return " ".join(parts)


# -------------------------------------------------------------------------------------------------- shapes
def input_shapes(config: MhaConfig) -> Dict[str, tuple]:
    """Shape of every supplied input slot of ``config``, in slot order."""
    c = config
    b, s, l, p, n, h, hv, t = c.batch, c.q_seq, c.kv_seq, c.past_seq, c.num_heads, c.head_size, c.hv, c.total_seq
    shapes = {"query": (b, s, n * h)}
    if c.kv_layout == "BSNH":
        shapes["key"], shapes["value"] = (b, l, n * h), (b, l, n * hv)
    elif c.kv_layout == "BNSH":
        shapes["key"], shapes["value"] = (b, n, l, h), (b, n, l, hv)
    else:
        raise ValueError(f"kv_layout must be BSNH or BNSH, got {c.kv_layout!r}")
    if c.bias:
        shapes["bias"] = (2 * n * h + n * hv,)
    if c.mask != "none":
        shapes["key_padding_mask"] = {"1d": (b,), "3b2": (3 * b + 2,), "2d": (b, t), "3d": (b, s, t)}[c.mask]
    if c.attention_bias is not None:
        bcast0, bcast1 = BROADCASTS[c.attention_bias]
        shapes["attention_bias"] = (1 if bcast0 else b, 1 if bcast1 else n, s, t)
    if c.has_past:
        rows = c.max_seq or p
        shapes["past_key"], shapes["past_value"] = (b, n, rows, h), (b, n, rows, hv)
    if c.max_seq:
        shapes["past_sequence_length"] = (1,)
    if c.beams:
        shapes["cache_indirection"] = (b // c.beams, c.beams, c.max_seq)
    return shapes


def output_shapes(config: MhaConfig) -> Dict[str, tuple]:
    c = config
    shapes = {"output": (c.batch, c.q_seq, c.num_heads * c.hv)}
    if c.presents:
        rows = c.max_seq or c.total_seq
        shapes["present_key"] = (c.batch, c.num_heads, rows, c.head_size)
        shapes["present_value"] = (c.batch, c.num_heads, rows, c.hv)
    if c.qk:
        shapes["qk"] = (c.batch, c.num_heads, c.q_seq, c.total_seq)
    return shapes


def attributes(config: MhaConfig) -> Dict[str, object]:
    attrs: Dict[str, object] = {"num_heads": config.num_heads}
    if config.causal:
        attrs["unidirectional"] = 1
    if config.mask_filter_value is not None:
        attrs["mask_filter_value"] = float(config.mask_filter_value)
    if config.scale is not None:
        attrs["scale"] = float(config.scale)
    return attrs


# ------------------------------------------------------------------------------------------------ models
def _declared_shape(name: str, shape: Optional[Sequence[int]], shapes: str):
    if shapes == "static":
        return list(shape) if shape is not None else None
    if shapes == "symbolic":
        return None if shape is None else [f"{name}_{axis}" for axis in range(len(shape))]
    if shapes == "unranked":
        return None
    raise ValueError(f"shapes must be static, symbolic or unranked, got {shapes!r}")


def node_model(
    inputs: Mapping[str, tuple],
    outputs: Sequence[str] = ("output",),
    attrs: Optional[Mapping[str, object]] = None,
    shapes: str = "static",
    output_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    float_dtype: str = "float32",
) -> onnx.ModelProto:
    """One MHA node named ``mha`` over graph inputs.

    ``inputs`` maps slot name -> (dtype name, shape); slots not in it are absent. ``outputs`` names the wanted
    outputs (OUTPUT_SLOTS); unwanted ones before a wanted one become "". ``float_dtype="bfloat16"`` wraps the node
    in Casts (module docstring); input dtypes are then given as "bfloat16" and declared as float32 at the boundary.
    """
    attrs = dict({"num_heads": 1} if attrs is None else attrs)
    wrap_bf16 = float_dtype == "bfloat16"
    graph_inputs, node_inputs, nodes = [], [], []
    for slot in INPUT_SLOTS:
        if slot not in inputs:
            node_inputs.append("")
            continue
        dtype, shape = inputs[slot]
        declared = _declared_shape(slot, shape, shapes)
        if wrap_bf16 and dtype == "bfloat16":
            graph_inputs.append(helper.make_tensor_value_info(slot, TensorProto.FLOAT, declared))
            nodes.append(helper.make_node("Cast", [slot], [slot + ".bf16"], to=TensorProto.BFLOAT16))
            node_inputs.append(slot + ".bf16")
        else:
            graph_inputs.append(helper.make_tensor_value_info(slot, ELEM[dtype], declared))
            node_inputs.append(slot)
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    last = max(OUTPUT_SLOTS.index(o) for o in outputs)
    node_outputs, graph_outputs, after = [], [], []
    for slot in OUTPUT_SLOTS[: last + 1]:
        if slot not in outputs:
            node_outputs.append("")
            continue
        shape = None if output_shapes is None or shapes != "static" else output_shapes.get(slot)
        if wrap_bf16:
            node_outputs.append(slot + ".bf16")
            after.append(helper.make_node("Cast", [slot + ".bf16"], [slot], to=TensorProto.FLOAT))
            graph_outputs.append(helper.make_tensor_value_info(slot, TensorProto.FLOAT, shape))
        else:
            node_outputs.append(slot)
            graph_outputs.append(helper.make_tensor_value_info(slot, ELEM[float_dtype], shape))
    nodes.append(
        helper.make_node(
            "MultiHeadAttention", node_inputs, node_outputs, name=NODE_NAME, domain="com.microsoft", **attrs
        )
    )
    nodes.extend(after)
    graph = helper.make_graph(nodes, "single_mha", graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in OPSETS])
    model.ir_version = IR_VERSION
    return model


def build_model(config: MhaConfig) -> onnx.ModelProto:
    """The single-node model of ``config`` (module docstring for the conventions)."""
    inputs = {}
    for slot, shape in input_shapes(config).items():
        dtype = {"key_padding_mask": config.mask_dtype, "past_sequence_length": "int32",
                 "cache_indirection": "int32"}.get(slot, config.dtype)  # fmt: skip
        inputs[slot] = (dtype, shape)
    outputs = ["output"] + (["present_key", "present_value"] if config.presents else []) + (["qk"] if config.qk else [])
    return node_model(
        inputs, outputs, attributes(config), config.shapes, output_shapes(config), float_dtype=config.dtype
    )


# ------------------------------------------------------------------------------------------------- feeds
def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as the feed array of a ``dtype`` model (bfloat16: float32 holding bfloat16 values)."""
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).astype(np.float32)
    return values.astype(NP_DTYPE[dtype])


def nonzero_normal(rng: np.random.Generator, shape, std: float, dtype: str) -> np.ndarray:
    """N(0, std) values rounded to ``dtype``, with any value that rounds to zero redrawn away from zero."""
    values = rng.normal(0.0, std, size=shape)
    values = np.where(np.abs(values) < std * 1e-3, std * 0.5, values)
    return round_to(values, dtype)


def key_lengths(config: MhaConfig, rng: np.random.Generator) -> np.ndarray:
    """Right-padding key lengths, ``randint(1, T+1)`` per batch (benchmark_mha); batch 0 gets 0 if fully_padded."""
    lengths = rng.integers(1, config.total_seq + 1, size=config.batch)
    if config.fully_padded:
        lengths[0] = 0
    return lengths


def make_mask(config: MhaConfig, rng: np.random.Generator, any_values: bool = False) -> np.ndarray:
    """key_padding_mask of ``config.mask`` format.

    1d: (B,) key lengths. 3b2: (3B+2,) = [key lengths | cu_seqlens_q (B+1) | cu_seqlens_k (B+1)] (ORT's CPU kernel
    reads only the lengths). 2d: (B, T) right padding from the lengths. 3d: (B, S, T) right padding plus random
    extra holes, with at least one kept key per row (except the fully padded batch). ``any_values``: kept
    positions hold random positive ints and masked ones 0 or negative (ORT keeps ``> 0``).
    """
    c = config
    b, s, t = c.batch, c.q_seq, c.total_seq
    lengths = key_lengths(c, rng)
    dtype = np.int32 if c.mask_dtype == "int32" else np.int64
    if c.mask == "1d":
        return lengths.astype(dtype)
    if c.mask == "3b2":
        q_lengths = np.full(b, s) if c.has_past and c.past_seq > 0 else np.minimum(lengths, s)
        cu_q = np.concatenate([[0], np.cumsum(q_lengths)])
        cu_k = np.concatenate([[0], np.cumsum(lengths)])
        return np.concatenate([lengths, cu_q, cu_k]).astype(dtype)
    keep_BT = np.arange(t)[None, :] < lengths[:, None]
    if c.mask == "2d":
        keep = keep_BT
    elif c.mask == "3d":
        holes_BST = rng.random((b, s, t)) < 0.25
        keep = keep_BT[:, None, :] & ~holes_BST
        first_kept = np.where(lengths > 0, 0, -1)
        for bi in range(b):
            if first_kept[bi] >= 0:
                empty_rows = ~keep[bi].any(axis=-1)
                keep[bi, empty_rows, rng.integers(0, lengths[bi])] = True
    else:
        raise ValueError(f"mask format {c.mask!r} has no dense form")
    if not any_values:
        return keep.astype(dtype)
    kept_values = rng.integers(1, 5, size=keep.shape)
    masked_values = rng.integers(-2, 1, size=keep.shape)
    return np.where(keep, kept_values, masked_values).astype(dtype)


def random_feeds(
    config: MhaConfig, rng: np.random.Generator, std: float = 1.0, any_mask_values: bool = False
) -> Dict[str, np.ndarray]:
    """Fresh random feeds for ``build_model(config)``: N(0, std) floats (never 0), masks as in make_mask.

    ORT's benchmark uses std 0.1; the default here is 1.0 so that the softmax is far from uniform and a wrong
    scale, bias or mask shows up in the output.
    """
    feeds = {}
    for slot, shape in input_shapes(config).items():
        if slot == "key_padding_mask":
            feeds[slot] = make_mask(config, rng, any_mask_values)
        elif slot == "past_sequence_length":
            feeds[slot] = np.array([config.past_seq], np.int32)
        elif slot == "cache_indirection":
            feeds[slot] = rng.integers(0, config.beams, size=shape).astype(np.int32)
        else:
            feeds[slot] = nonzero_normal(rng, shape, std, config.dtype)
    return feeds


def slot_arrays(feeds: Mapping[str, np.ndarray]) -> list:
    """The feeds in slot order with None for absent inputs (the input of mha_ep.engine.problem.build_problem)."""
    return [feeds.get(slot) for slot in INPUT_SLOTS]


def oracle_float64(config: MhaConfig, feeds: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The float64 oracle (mha_ep's reference semantics computed in float64) for the outputs of ``config``.

    Used where stock ORT cannot run (bfloat16). The feeds are already exactly values of the node's dtype.
    """
    from mha_ep.engine.reference import run_reference
    from mha_ep.engine.problem import build_problem

    outputs = (True, config.presents, config.presents, config.qk)
    arrays = [
        None if a is None else np.asarray(a, np.float32) if a.dtype.kind == "f" else a for a in slot_arrays(feeds)
    ]
    problem = build_problem(attributes(config), arrays, config.dtype, outputs)
    result = run_reference(problem, np.float64)
    out = {"output": result.output_BSDv}
    if config.presents:
        out["present_key"], out["present_value"] = result.present_key_BNTH, result.present_value_BNTHv
    if config.qk:
        out["qk"] = result.qk_BNST
    return out


def naive_same_dtype(config: MhaConfig, feeds: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A naive implementation in ``config.dtype`` (the yardstick of flash-attention's tests for reduced precision):
    every stage is rounded to the dtype - Q+b_q, K+b_k, V+b_v, scale*QK^T, +attention_bias, +mask (added in float32
    first), the probabilities and the output - with float32 accumulation inside the two GEMMs and the softmax."""
    from mha_ep.engine.reference import additive_mask_BST, past_rows, shared_present, softmax_lastaxis, to_BNSH
    from mha_ep.engine.problem import build_problem

    def rnd(x):
        return round_to(np.asarray(x, np.float32), config.dtype).astype(np.float32)

    outputs = (True, config.presents, config.presents, config.qk)
    problem = build_problem(attributes(config), slot_arrays(feeds), config.dtype, outputs)
    n = config.num_heads
    query = problem.query_BSD + (0 if problem.bias_q is None else problem.bias_q)
    q_BNSH = to_BNSH(rnd(query), n)
    if problem.kv_layout == "BSNH":
        key = problem.key + (0 if problem.bias_k is None else problem.bias_k)
        value = problem.value + (0 if problem.bias_v is None else problem.bias_v)
        k_BNLH, v_BNLH = to_BNSH(rnd(key), n), to_BNSH(rnd(value), n)
    else:
        k_BNLH, v_BNLH = rnd(problem.key), rnd(problem.value)
    new_k_BNLH, new_v_BNLH = k_BNLH, v_BNLH
    if problem.past_key_BNPH is not None:
        k_BNLH = np.concatenate([past_rows(problem, problem.past_key_BNPH), k_BNLH], axis=2)
        v_BNLH = np.concatenate([past_rows(problem, problem.past_value_BNPH), v_BNLH], axis=2)
    scores = rnd(np.matmul(q_BNSH, k_BNLH.transpose(0, 1, 3, 2)) * np.float32(problem.scale))
    if problem.attention_bias is not None:
        scores = rnd(scores + problem.attention_bias)
    mask_BST = additive_mask_BST(problem)
    if mask_BST is not None:
        scores = rnd(scores + mask_BST[:, None])
    probs = rnd(softmax_lastaxis(scores))
    g = problem.geometry
    out = rnd(np.matmul(probs, v_BNLH).transpose(0, 2, 1, 3).reshape(g.batch, g.q_seq, g.v_hidden))
    result = {"output": out}
    if config.qk:
        result["qk"] = scores
    if config.presents and problem.shared is not None:
        result["present_key"] = shared_present(problem, problem.past_key_BNPH, new_k_BNLH, np.float32)
        result["present_value"] = shared_present(problem, problem.past_value_BNPH, new_v_BNLH, np.float32)
    elif config.presents:
        result["present_key"], result["present_value"] = k_BNLH, v_BNLH
    return result


def stock_counterpart(config: MhaConfig, feeds: Mapping[str, np.ndarray]):
    """(model, feeds) that stock ORT can run for ``config``: its M type constraint is int32 only, so an int64
    key_padding_mask becomes the same values in int32 (every value fits). Everything else is unchanged."""
    if config.mask_dtype != "int64" or "key_padding_mask" not in feeds:
        return build_model(config), dict(feeds)
    stock_feeds = dict(feeds)
    stock_feeds["key_padding_mask"] = feeds["key_padding_mask"].astype(np.int32)
    return build_model(replace(config, mask_dtype="int32")), stock_feeds


def stock_outputs(config: MhaConfig, feeds: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Stock ORT CPU's outputs for ``config`` on ``feeds`` (the oracle), by output name."""
    import onnxruntime

    model, stock_feeds = stock_counterpart(config, feeds)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, stock_feeds)))


def assert_outputs_match(
    actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], tolerance: float, context: str
) -> None:
    """Every expected output is present in ``actual`` with the same shape and dtype and a NaN-aware
    max |a - e| / max(1, |e|) within ``tolerance``; the message prints the context and both numbers."""
    from conftest import max_rel_error

    assert set(actual) == set(expected), f"{context}: outputs {sorted(actual)} != expected {sorted(expected)}"
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{context}: {name} shape {got.shape} != expected {want.shape}"
        error = max_rel_error(got, want)
        worst = np.unravel_index(int(np.nanargmax(np.abs(np.asarray(got, np.float64) - want))), want.shape) if (
            want.size and np.isfinite(error) and error > tolerance
        ) else None
        detail = "" if worst is None else f"; worst at {worst}: got {got[worst]!r}, expected {want[worst]!r}"
        assert error <= tolerance, (
            f"{context}: {name} max rel error {error:.3g} > tolerance {tolerance:.3g}"
            f" (got max|x| {np.nanmax(np.abs(got)) if got.size else 0:.4g},"
            f" expected max|x| {np.nanmax(np.abs(want)) if want.size else 0:.4g}){detail}"
        )


def with_(config: MhaConfig, **changes) -> MhaConfig:
    """``dataclasses.replace`` under a short name."""
    return replace(config, **changes)


def plugin_session(model, backend: str):
    """The plugin session a parity suite runs: ``backend`` through the bridge (the Python op), "reference-native" /
    "cuda-native" for one ORT session with the native library's CPU / CUDA kernels on a model partitioned in the
    native form."""
    import mha_ep

    if backend == "reference-native":
        return mha_ep.InferenceSession(model, backend="reference", route="native")
    if backend == "cuda-native":
        return mha_ep.InferenceSession(model, backend="cuda", providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                       route="native")  # fmt: skip
    return mha_ep.InferenceSession(model, backend=backend, route="python-op")


def chain_model(num_heads=2, qk_on_second=False):
    """Embedding lookup -> two MHA nodes, the second masked by a 2D attention mask."""
    vocab, hidden = 50, 8
    rng = np.random.default_rng(7)
    table = onnx.numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "embedding")
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["x"], name="embed"),
        helper.make_node("MultiHeadAttention", ["x", "x", "x"], ["a"], domain="com.microsoft", num_heads=num_heads, name="layer0"),
        helper.make_node(
            "MultiHeadAttention", ["a", "a", "a", "", "attention_mask"], ["o", "", "", "qk"] if qk_on_second else ["o"],
            domain="com.microsoft", num_heads=num_heads, name="layer1",
        ),
    ]
    outputs = [helper.make_tensor_value_info("o", TP.FLOAT, ["batch", "sequence", hidden])]
    if qk_on_second:  # declared in a shape the node does not write: the node is declined for it
        outputs.append(helper.make_tensor_value_info("qk", TP.FLOAT, [1, 2, 3]))
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TP.INT32, ["batch", "sequence"])],
        outputs, initializer=[table],
    )
    return helper.make_model(
        graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


# ------------------------------------------------------------------------------------------ packed forms
def packed_feeds(config: MhaConfig, feeds: dict, form: str) -> dict:
    """The unpacked ``feeds`` of ``config`` as the packed node takes them: Q, K, V (or K, V) stacked on axis 3."""
    b, s, l, n, h = config.batch, config.q_seq, config.kv_seq, config.num_heads, config.head_size
    k = feeds["key"].reshape(b, l, n, h)
    v = feeds["value"].reshape(b, l, n, h)
    packed = {name: value for name, value in feeds.items() if name not in ("key", "value")}
    if form == "qkv":
        packed["query"] = np.ascontiguousarray(np.stack([feeds["query"].reshape(b, s, n, h), k, v], axis=3))
    else:
        packed["key"] = np.ascontiguousarray(np.stack([k, v], axis=3))
    return packed


def packed_model(config: MhaConfig, form: str):
    """The packed node of ``config`` (config's other inputs, outputs and attributes unchanged: a shared buffer's
    past, past_sequence_length, cache_indirection and presents too, the packed QKV form mha_ep adds)."""
    b, s, l, n, h = config.batch, config.q_seq, config.kv_seq, config.num_heads, config.head_size
    model = build_model(config)
    declared = {i.name: i for i in model.graph.input}
    inputs = {}
    for slot in INPUT_SLOTS:
        if slot not in declared or (slot == "value") or (slot == "key" and form == "qkv"):
            continue
        elem = declared[slot].type.tensor_type.elem_type
        dtype = {1: "float32", 10: "float16", 6: "int32", 7: "int64"}.get(elem, config.dtype)
        dtype = config.dtype if elem == TensorProto.FLOAT and config.dtype == "bfloat16" else dtype  # Cast-wrapped
        shape = tuple(d.dim_value for d in declared[slot].type.tensor_type.shape.dim)
        if slot == "query" and form == "qkv":
            shape = (b, s, n, 3, h)
        if slot == "key":
            shape = (b, l, n, 2, h)
        inputs[slot] = (dtype, shape)
    outputs = ["output"] + (["present_key", "present_value"] if config.presents else []) + (["qk"] if config.qk else [])
    return node_model(inputs, outputs, attributes(config), config.shapes, output_shapes(config),
                      float_dtype=config.dtype)  # fmt: skip
