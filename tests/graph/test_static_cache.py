"""The static-cache rewrite (mha_ep/graph/static_cache.py): a decoder-with-past in the shared-buffer form decodes the
same tokens as the dynamic one on stock ORT's CPU provider, its graph has fixed shapes and no Shape node, and what
the rewrite cannot resolve is refused naming the node."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import mha_ep
from mha_ep import spec
from mha_ep.models.synthetic import whisper_decoder_step
from mha_ep.graph.partition import partition
from mha_ep.graph.static_cache import PAST_SEQUENCE_LENGTH, StaticCacheError, static_cache

from small_models import run_cli

PROMPT = 3
STEPS = 16
MAX_LENGTH = 32
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}  # logits, absolute


def session(model) -> ort.InferenceSession:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, feeds: dict) -> dict:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def whisper_prompt(precision: str, batch: int = 2, seed: int = 0, logits: bool = False):
    """The first decoder step on a random prompt of PROMPT tokens: the first token (argmax; ``logits``: the last
    position's logits (B, V) instead), the self pasts (B, N, PROMPT, H) and the cross K/V (B, N, 100, H), named as
    the decoder-with-past's inputs."""
    rng = np.random.default_rng(seed)
    dtype = np.float32 if precision == "fp32" else np.float16
    outputs = run(
        session(mha_ep.shipped_model(f"whisper_random_decoder_init_{precision}.onnx")),
        {"input_ids": rng.integers(0, 1000, (batch, PROMPT)).astype(np.int64),
         "encoder_hidden_states": rng.standard_normal((batch, 100, 64)).astype(dtype)},
    )  # fmt: skip
    pasts = {name.replace("present", "past"): v for name, v in outputs.items() if name.startswith("present")}
    self_kv = {name: v for name, v in pasts.items() if "_self_" in name}
    last = outputs["logits"][:, -1]
    return last if logits else last.argmax(-1), self_kv, {n: v for n, v in pasts.items() if n not in self_kv}


def decode_both(dynamic, static, first, self_kv, others, steps: int, max_length: int, seed: int = 1,
                static_session_of=None, static_feeds=None, p_name=PAST_SEQUENCE_LENGTH):
    """Greedy decoding of ``steps`` tokens with the dynamic decoder (growing pasts) and the static one (pasts
    (B, N, max_length, H), poisoned beyond the prompt; P fed as ``p_name``, with ``static_feeds`` besides), each from
    its own tokens, checking at every step that the static presents keep every row but row P. Returns per model the
    tokens and last-position logits of each step, and the static cache's filled rows next to the dynamic presents."""
    rng = np.random.default_rng(seed)
    past_length = next(iter(self_kv.values())).shape[2]
    cache = {}
    for name, value in self_kv.items():
        buffer = (100 * rng.standard_normal(value.shape[:2] + (max_length,) + value.shape[3:])).astype(value.dtype)
        buffer[:, :, :past_length] = value
        cache[name] = buffer
    grown = dict(self_kv)
    tokens = {"dynamic": first, "static": first}
    trace = {"dynamic": [], "static": [], "rows": []}
    dynamic_session, static_session = session(dynamic), (static_session_of or session)(static)
    for step in range(steps):
        position = past_length + step
        out = run(dynamic_session, {"input_ids": tokens["dynamic"][:, None], **grown, **others})
        grown = {name: out[name.replace("past", "present")] for name in grown}
        feeds = {"input_ids": tokens["static"][:, None], **cache, **others, **(static_feeds or {}),
                 p_name: np.array([position], np.int32)}  # fmt: skip
        out_static = run(static_session, feeds)
        for name in cache:
            present = out_static[name.replace("past", "present")]
            assert present.shape == cache[name].shape
            assert np.array_equal(present[:, :, :position], cache[name][:, :, :position]), f"{name} step {step}"
            assert np.array_equal(present[:, :, position + 1:], cache[name][:, :, position + 1:]), (
                f"{name} step {step}: rows beyond past_sequence_length + 1 were written"
            )
            trace["rows"].append((present[:, :, : position + 1], grown[name]))
            cache[name] = present
        for kind, logits in (("dynamic", out["logits"][:, -1]), ("static", out_static["logits"][:, -1])):
            tokens[kind] = logits.argmax(-1)
            trace[kind].append((tokens[kind], logits.astype(np.float32)))
    return trace


def assert_same_decoding(trace, tolerance: float) -> None:
    for step, ((token, logits), (static_token, static_logits)) in enumerate(zip(trace["dynamic"], trace["static"])):
        assert np.array_equal(token, static_token), f"step {step}: tokens {token} vs {static_token}"
        error = np.abs(logits - static_logits).max()
        assert error <= tolerance, f"step {step}: logits differ by {error}"
    for static_rows, dynamic_rows in trace["rows"]:
        assert np.abs(static_rows.astype(np.float32) - dynamic_rows.astype(np.float32)).max() <= tolerance


@pytest.mark.parametrize("batch", [2, None], ids=["batch2", "batch-symbolic"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_shipped_whisper_decoder_decodes_the_same_tokens(precision, batch):
    """On stock ORT's CPU provider, so with the projections apart (stock ORT refuses packed QKV with a past: rule
    PACKED_PROJECTIONS has its own tests below, on mha_ep)."""
    decoder = onnx.load(mha_ep.shipped_model(f"whisper_random_decoder_{precision}.onnx"))
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=batch, packed_qkv=False)
    assert result.self_layers == tuple(
        (f"past_key_self_{i}", f"past_value_self_{i}", f"present_key_self_{i}", f"present_value_self_{i}")
        for i in range(2)
    )
    first, self_kv, cross = whisper_prompt(precision)
    trace = decode_both(decoder, result.model, first, self_kv, cross, STEPS, MAX_LENGTH)
    assert_same_decoding(trace, TOLERANCE[precision])


@pytest.mark.parametrize("route", ["python-op", "native"])
def test_the_static_decoder_on_mha_ep_decodes_the_same_tokens(route):
    """The rewrite's claimed shared-buffer nodes (every self-attention and cross-attention node: partition claims
    all four; the self nodes' projections packed, rule PACKED_PROJECTIONS) on mha_ep's CPU routes, 16 steps: the
    dynamic decoder's tokens on stock ORT."""
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    assert result.packed_nodes == ["Attention_0", "Attention_2"]
    assert all(d.claimed for d in mha_ep.partition(result.model).decisions)

    def plugin(model):
        return mha_ep.InferenceSession(model, backend="reference", route=route)

    first, self_kv, cross = whisper_prompt("fp32")
    trace = decode_both(decoder, result.model, first, self_kv, cross, STEPS, MAX_LENGTH, static_session_of=plugin)
    assert_same_decoding(trace, TOLERANCE["fp32"])


def beam_decode(step, first_logprobs, beams: int, steps: int, eot: int):
    """Beam search (mha_ep/decode/beam.py) of ``steps`` steps: ``step(ids (R,), sources (R,), position)`` runs the
    decoder once, its cache already following ``sources``, and gives the logits (R, V). Returns the answers and
    every step's logits."""
    from mha_ep.decode.beam import BeamSearch, log_softmax

    search = BeamSearch(len(first_logprobs) // beams, beams, eot)
    sources, ids = search.step(first_logprobs)
    trace = []
    for position in range(steps - 1):
        trace.append(step(ids, sources, position))
        sources, ids = search.step(log_softmax(trace[-1]))
        if search.done:
            break
    return search.result(), trace


@pytest.mark.parametrize("shared", [False, True], ids=["cross-kv-per-beam", "shared-cross-kv"])
def test_beam_search_over_the_static_decoder_with_cache_indirection_matches_the_reordered_dynamic_cache(shared):
    """5 beams over 2 prompts, 12 steps: the dynamic decoder with its cache reordered on the host after every step,
    and the static decoder (beams=5) whose cache never moves, cache_indirection saying which beam's rows each row
    reads (stock ORT's CPU beam path, docs/SEMANTICS.md §3.10), give the same answers; and so does mha_ep's native
    CPU kernel on the latter. ``shared`` (rule SHARED_CROSS_KV): the static decoder reads the cross-attention keys
    and values one row per prompt, not per beam, its cross nodes the 5 beams' queries as 5 rows of one."""
    from mha_ep.decode.beam import log_softmax

    beams, entries, steps, eot = 5, 2, 12, 2
    rows = beams * entries
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    logits, self_kv, entry_cross = whisper_prompt("fp32", batch=entries, logits=True)
    self_kv, cross = ({name: np.repeat(value, beams, axis=0) for name, value in kv.items()}
                      for kv in (self_kv, entry_cross))  # fmt: skip
    first_logprobs = log_softmax(np.repeat(logits, beams, axis=0))  # every beam starts from its entry's prompt

    dynamic, grown = session(decoder), dict(self_kv)

    def dynamic_step(ids, sources, position):
        nonlocal grown
        out = run(dynamic, {"input_ids": ids[:, None], **{n: v[sources] for n, v in grown.items()}, **cross})
        grown = {name: out[name.replace("past", "present")] for name in grown}
        return out["logits"][:, -1]

    expected = beam_decode(dynamic_step, first_logprobs, beams, steps, eot)
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=rows, beams=beams, shared_cross_kv=shared)
    static = result.model  # projections packed
    plain = static_cache(decoder, max_length=MAX_LENGTH, batch=rows, beams=beams, packed_qkv=False,
                         shared_cross_kv=shared).model  # fmt: skip
    assert [n.input[9] for n in static.graph.node if len(n.input) > 9] == ["cache_indirection"] * 2
    if shared:
        assert result.entry_inputs == tuple(sorted(entry_cross)) and len(result.shared_cross_kv) == 2
        assert all(why == "" for _, why in result.shared_cross_kv), result.shared_cross_kv
        declared = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in static.graph.input}
        assert all(declared[name][0] == entries for name in entry_cross), declared
        assert "2 of 2 cross-attention node(s)" in result.report()
        facts = json.loads(next(p.value for p in static.metadata_props if p.key == "mha_ep.static_cache"))
        assert facts["entry_inputs"] == sorted(entry_cross)
        cross = entry_cross  # the static runs read one row per prompt
    for static_run in (session(plain), mha_ep.InferenceSession(static, backend="reference", route="native")):
        cache = {}
        for name, value in self_kv.items():
            cache[name] = np.zeros(value.shape[:2] + (MAX_LENGTH,) + value.shape[3:], np.float32)
            cache[name][:, :, :PROMPT] = value
        indirection = np.zeros((entries, beams, MAX_LENGTH), np.int32)

        def static_step(ids, sources, position):
            p = PROMPT + position  # the rows before p - 1 follow the source beam; row p - 1 is the source's own
            beam = (sources % beams).reshape(entries, beams)
            indirection[...] = np.take_along_axis(indirection, beam[:, :, None], axis=1)
            indirection[:, :, p - 1] = beam
            out = run(static_run, {"input_ids": ids[:, None], **cache, **cross, "cache_indirection": indirection,
                                   PAST_SEQUENCE_LENGTH: np.array([p], np.int32)})  # fmt: skip
            cache.update((name, out[name.replace("past", "present")]) for name in cache)
            return out["logits"][:, -1]

        answers, trace = beam_decode(static_step, first_logprobs, beams, steps, eot)
        assert answers == expected[0] and len(trace) == len(expected[1])
        for position, (got, want) in enumerate(zip(trace, expected[1])):
            assert np.abs(got - want).max() <= TOLERANCE["fp32"], f"{static_run}: step {position}"


def test_synthetic_decoder_gives_the_same_logits():
    decoder = whisper_decoder_step(layers=2, hidden=64, heads=4, ffn=128, vocab=100)
    result = static_cache(decoder, max_length=16, batch=2, packed_qkv=False)  # stock ORT runs it
    rng = np.random.default_rng(5)
    pasts = {f"past_{kind}_self_{layer}": rng.standard_normal((2, 4, 2, 16)).astype(np.float32)
             for layer in range(2) for kind in ("key", "value")}  # fmt: skip
    cross = {f"cross_{kind}_{layer}": rng.standard_normal((2, 4, 10, 16)).astype(np.float32)
             for layer in range(2) for kind in ("key", "value")}  # fmt: skip
    first = rng.integers(0, 100, 2).astype(np.int64)
    trace = decode_both(decoder, result.model, first, pasts, cross, steps=8, max_length=16)
    assert_same_decoding(trace, TOLERANCE["fp32"])
    assert not any(n.op_type == "Shape" for n in result.model.graph.node)
    assert any("encoder_sequence" in note for note in result.notes), result.notes


def test_rewritten_graph_has_fixed_shapes_and_no_shape_node():
    result = static_cache(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"), max_length=MAX_LENGTH, batch=2)
    model = result.model
    graph = model.graph
    assert not [n.name for n in graph.node if n.op_type in ("Shape", "Range", "Tile")]
    for value in list(graph.input) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        assert dims and all(d.HasField("dim_value") for d in dims), value
    self_nodes = [n for n in graph.node if n.op_type == "MultiHeadAttention" and len(n.input) > 6 and n.input[6]]
    assert len(self_nodes) == 2
    for node in self_nodes:
        assert len(node.input) == 9 and node.input[8] == PAST_SEQUENCE_LENGTH
    declared = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert declared[PAST_SEQUENCE_LENGTH] == [1]
    assert declared["past_key_self_0"] == [2, 4, MAX_LENGTH, 16]
    assert declared["past_key_cross_0"] == [2, 4, 100, 16] and declared["input_ids"] == [2, 1]
    assert result.folded > 0 and "past_key_cross_0" in result.unchanged_inputs
    onnx.checker.check_model(model, full_check=True)
    report = result.report()
    assert "2 self-attention" in report and PAST_SEQUENCE_LENGTH in report and "past_key_cross_1" in report


def test_the_input_model_is_left_alone():
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    before = decoder.SerializeToString()
    static_cache(decoder, max_length=8, batch=1)
    assert decoder.SerializeToString() == before


def tiny_decoder(position_nodes, constants: dict, step="seq", extra_nodes=(), extra_outputs=(),
                 extra_inputs=()) -> onnx.ModelProto:  # fmt: skip
    """A one-layer decoder (hidden 8, 2 heads of head size 4, vocab 50): embed_tokens[input_ids] plus
    embed_positions[positions], ``positions`` made by ``position_nodes`` from the shapes (``constants``: their
    int64 initializers), causal self-attention over a past, then logits. ``step``: input_ids' length dim."""
    hidden, heads, head, vocab = 8, 2, 4, 50
    rng = np.random.default_rng(0)
    weights = {"embed_tokens": (vocab, hidden), "embed_positions": (64, hidden), "lm_head": (hidden, vocab)}
    initializers = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
                    for name, shape in weights.items()]  # fmt: skip
    initializers += [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in constants.items()]
    nodes = [
        helper.make_node("Gather", ["embed_tokens", "input_ids"], ["tokens"], name="/decoder/embed_tokens"),
        *position_nodes,
        helper.make_node("Gather", ["embed_positions", "positions"], ["position"], name="/decoder/embed_positions"),
        helper.make_node("Add", ["tokens", "position"], ["x"], name="/decoder/add_positions"),
        helper.make_node("MultiHeadAttention", ["x", "x", "x", "", "", "", "past_key_self_0", "past_value_self_0"],
                         ["y", "present_key_self_0", "present_value_self_0"], domain="com.microsoft",
                         name="self_attn", num_heads=heads, unidirectional=1),
        helper.make_node("MatMul", ["y", "lm_head"], ["logits"], name="/decoder/lm_head"),
        *extra_nodes,
    ]  # fmt: skip
    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", step])] + [
        helper.make_tensor_value_info(f"past_{kind}_self_0", TP.FLOAT, ["batch", heads, "past", head])
        for kind in ("key", "value")
    ] + list(extra_inputs)
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", step, vocab]), *extra_outputs] + [
        helper.make_tensor_value_info(f"present_{kind}_self_0", TP.FLOAT, ["batch", heads, "total", head])
        for kind in ("key", "value")
    ]
    graph = helper.make_graph(nodes, "tiny_decoder", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def shape_arithmetic_decoder() -> onnx.ModelProto:
    """Positions (B, 1) = P through every op the rewrite evaluates: Shape, Slice, Squeeze, Cast, Mul, Sub,
    Unsqueeze, Reshape, Expand and ConstantOfShape on Shape(input_ids), Range(P, P + 1), Concat, Gather, Tile,
    Identity, and an Equal/Where pair that only the reference evaluator folds."""
    make = helper.make_node
    nodes = [
        make("Shape", ["past_key_self_0"], ["past_shape"], name="/decoder/Shape"),
        make("Slice", ["past_shape", "two_1d", "three_1d"], ["p_1d"], name="/decoder/Slice"),
        make("Squeeze", ["p_1d", "zero_1d"], ["p"], name="/decoder/Squeeze"),
        make("Cast", ["p"], ["p_int32"], name="/decoder/Cast", to=TP.INT32),
        make("Cast", ["p_int32"], ["p_int64"], name="/decoder/Cast_1", to=TP.INT64),
        make("Mul", ["p_int64", "two"], ["twice"], name="/decoder/Mul"),
        make("Sub", ["twice", "p_int64"], ["p_again"], name="/decoder/Sub"),
        make("Unsqueeze", ["p_again", "zero_1d"], ["p_again_1d"], name="/decoder/Unsqueeze"),
        make("Reshape", ["p_again_1d", "one_by_one"], ["p_11"], name="/decoder/Reshape"),
        make("Shape", ["input_ids"], ["ids_shape"], name="/decoder/Shape_1"),
        make("Expand", ["p_11", "ids_shape"], ["p_b1"], name="/decoder/Expand"),
        make("ConstantOfShape", ["ids_shape"], ["zeros"], name="/decoder/ConstantOfShape",
             value=numpy_helper.from_array(np.array([0], np.int64))),
        make("Add", ["p", "one"], ["p_next"], name="/decoder/Add"),
        make("Range", ["p", "p_next", "one"], ["p_range"], name="/decoder/Range"),
        make("Concat", ["p_range", "p_1d"], ["p_pair"], name="/decoder/Concat", axis=0),
        make("Gather", ["p_pair", "one"], ["p_second"], name="/decoder/Gather"),
        make("Sub", ["p_second", "p"], ["zero_offset"], name="/decoder/Sub_1"),
        make("Equal", ["one", "one"], ["truth"], name="/decoder/Equal"),
        make("Where", ["truth", "zero_offset", "one"], ["offset"], name="/decoder/Where"),
        make("Add", ["p_b1", "zeros"], ["q"], name="/decoder/Add_1"),
        make("Add", ["q", "offset"], ["q_offset"], name="/decoder/Add_2"),
        make("Tile", ["q_offset", "ones_1d"], ["q_tiled"], name="/decoder/Tile"),
        make("Identity", ["q_tiled"], ["positions"], name="/decoder/Identity"),
    ]  # fmt: skip
    constants = {"two_1d": [2], "three_1d": [3], "zero_1d": [0], "two": 2, "one": 1, "one_by_one": [1, 1],
                 "ones_1d": [1, 1]}  # fmt: skip
    return tiny_decoder(nodes, constants, step=1)


@pytest.mark.parametrize("batch", [2, None], ids=["batch2", "batch-symbolic"])
def test_every_evaluated_op_gives_the_dynamic_logits(batch):
    decoder = shape_arithmetic_decoder()
    result = static_cache(decoder, max_length=12, batch=batch)
    left = {n.op_type for n in result.model.graph.node}
    assert not left & {"Slice", "Squeeze", "Sub", "Range", "Concat", "Equal", "Where"}, left
    if batch is not None:
        assert not left & {"Shape", "Expand", "ConstantOfShape", "Tile", "Identity"}, left
    else:  # the batch is known only at run time: the Shape of input_ids stays, and the nodes that read it
        assert "Shape_1" in " ".join(result.notes) and "Expand" in left
    rng = np.random.default_rng(4)
    pasts = {f"past_{k}_self_0": rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for k in ("key", "value")}
    trace = decode_both(decoder, result.model, rng.integers(0, 50, 2).astype(np.int64), pasts, {}, steps=6,
                        max_length=12)  # fmt: skip
    assert_same_decoding(trace, TOLERANCE["fp32"])


def range_decoder(read_past: bool = False, limit_from=("input_ids", 1), token_types: bool = False) -> onnx.ModelProto:
    """Positions Range(P, P + n), n = Shape(input)[dim] of ``limit_from``: by default input_ids' symbolic step
    length ``seq``, the positions as ``torch.onnx.export`` with ``dynamic_axes`` writes them; ("input_ids", 0): the
    batch, the positions reshaped to (batch, 1); ("prompt", 1): the positions by the step length, and besides them
    an output ``prompt_positions`` Range(P, P + prompt_len), from an input ``prompt`` (batch, prompt_len): a length
    that only the run knows. ``read_past``: a ReduceSum also reads the past. ``token_types``: a second input of the
    step length, ``token_type_ids`` (batch, seq), looked up into an output ``type_rows`` (batch, seq, 3)."""
    make = helper.make_node
    source, dim = limit_from
    by_batch = limit_from == ("input_ids", 0)
    nodes = [
        make("Shape", ["past_key_self_0"], ["past_shape"], name="/decoder/Shape"),
        make("Gather", ["past_shape", "two"], ["past_length"], name="/decoder/Gather"),
        make("Shape", ["input_ids"], ["ids_shape"], name="/decoder/Shape_1"),
        make("Gather", ["ids_shape", "zero" if by_batch else "one"], ["step_length"], name="/decoder/Gather_1"),
        make("Add", ["past_length", "step_length"], ["limit"], name="/decoder/Add"),
        make("Range", ["past_length", "limit", "one"], ["range" if by_batch else "positions"], name="/decoder/Range"),
        *([make("Reshape", ["range", "column"], ["positions"], name="/decoder/Reshape")] if by_batch else []),
    ]
    extra, outputs, inputs = [], [], []
    if read_past:
        extra.append(make("ReduceSum", ["past_key_self_0"], ["past_sum"], name="/decoder/peek"))
        outputs.append(helper.make_tensor_value_info("past_sum", TP.FLOAT, None))
    if source == "prompt":
        extra += [
            make("Shape", ["prompt"], ["prompt_shape"], name="/decoder/prompt_shape"),
            make("Gather", ["prompt_shape", "one"], ["prompt_len"], name="/decoder/prompt_len"),
            make("Add", ["past_length", "prompt_len"], ["prompt_limit"], name="/decoder/prompt_limit"),
            make("Range", ["past_length", "prompt_limit", "one"], ["prompt_positions"], name="/decoder/prompt_range"),
        ]
        outputs.append(helper.make_tensor_value_info("prompt_positions", TP.INT64, ["prompt_len"]))
        inputs.append(helper.make_tensor_value_info("prompt", TP.INT64, ["batch", "prompt_len"]))
    if token_types:
        extra.append(make("Gather", ["type_table", "token_type_ids"], ["type_rows"], name="/decoder/token_types"))
        outputs.append(helper.make_tensor_value_info("type_rows", TP.INT64, ["batch", "seq", 3]))
        inputs.append(helper.make_tensor_value_info("token_type_ids", TP.INT64, ["batch", "seq"]))
    constants = {"two": 2, "one": 1, "zero": 0, "column": [-1, 1], "type_table": [[0, 1, 2], [3, 4, 5]]}
    return tiny_decoder(nodes, constants, extra_nodes=extra,
                        extra_outputs=outputs, extra_inputs=inputs)  # fmt: skip


def test_range_decoder_runs_as_it_is():
    """The refusals below are about the rewrite, not a broken model: stock ORT runs the dynamic one."""
    rng = np.random.default_rng(2)
    feeds = {f"past_{k}_self_0": rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for k in ("key", "value")}
    feeds["input_ids"] = rng.integers(0, 50, (1, 2)).astype(np.int64)
    assert run(session(range_decoder()), feeds)["present_key_self_0"].shape == (1, 2, 5, 4)
    assert run(session(range_decoder(limit_from=("input_ids", 0))), feeds)["logits"].shape == (1, 2, 50)


def declared(model: onnx.ModelProto) -> dict:
    """Every graph input's and output's dims: an int, or the symbol's name."""
    return {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}  # fmt: skip


def test_a_symbolic_step_length_is_pinned_to_1_and_decodes_the_same():
    """input_ids (batch, seq), as torch.onnx.export writes it with dynamic_axes, embedded by a Gather, positions
    Range(P, P + seq): the rewrite pins seq to 1 in every input that carries it, says so, and decodes the dynamic
    decoder's tokens."""
    decoder = range_decoder(token_types=True)
    result = static_cache(decoder, max_length=12, batch=2)
    dims = declared(result.model)
    assert dims["input_ids"] == dims["token_type_ids"] == [2, 1] and dims["logits"] == [2, 1, 50]
    assert dims["type_rows"] == [2, 1, 3]
    assert result.pinned == (("input_ids", 1, "seq", 1), ("token_type_ids", 1, "seq", 1)) and result.step_length == 1
    assert "pinned input_ids dim 1 ('seq') to 1 (--step-length)" in result.report()
    assert "pinned token_type_ids dim 1 ('seq') to 1 (--step-length)" in result.report()
    data = result.to_dict()
    assert data["pinned"][0] == {"input": "input_ids", "dim": 1, "symbol": "seq", "value": 1}
    assert data["step_length"] == 1 and data["kept_inputs"] == []
    assert not {"Shape", "Range"} & {n.op_type for n in result.model.graph.node}
    rng = np.random.default_rng(6)
    pasts = {f"past_{k}_self_0": rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for k in ("key", "value")}
    types = {"token_type_ids": rng.integers(0, 2, (2, 1)).astype(np.int64)}
    trace = decode_both(decoder, result.model, rng.integers(0, 50, 2).astype(np.int64), pasts, types, steps=6,
                        max_length=12)  # fmt: skip
    assert_same_decoding(trace, TOLERANCE["fp32"])


def test_step_length_pins_a_symbolic_step_to_its_value():
    """--step-length 2: two tokens a step, the same logits and cache rows as the dynamic decoder's."""
    decoder = range_decoder()
    result = static_cache(decoder, max_length=12, batch=1, step_length=2)
    assert declared(result.model)["input_ids"] == [1, 2] and result.pinned == (("input_ids", 1, "seq", 2),)
    assert "pinned input_ids dim 1 ('seq') to 2 (--step-length)" in result.report()
    rng = np.random.default_rng(7)
    grown = {f"past_{k}_self_0": rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for k in ("key", "value")}
    cache = {name: np.concatenate([v, 100 * rng.standard_normal((1, 2, 9, 4)).astype(np.float32)], axis=2)
             for name, v in grown.items()}  # fmt: skip
    dynamic, static = session(decoder), session(result.model)
    for position in (3, 5, 7):
        ids = rng.integers(0, 50, (1, 2)).astype(np.int64)
        want = run(dynamic, {"input_ids": ids, **grown})
        got = run(static, {"input_ids": ids, **cache, PAST_SEQUENCE_LENGTH: np.array([position], np.int32)})
        assert np.abs(got["logits"] - want["logits"]).max() <= TOLERANCE["fp32"], position
        for name in grown:
            present = name.replace("past", "present")
            assert np.abs(got[present][:, :, : position + 2] - want[present]).max() <= TOLERANCE["fp32"]
            assert np.array_equal(got[present][:, :, position + 2 :], cache[name][:, :, position + 2 :])
            grown[name], cache[name] = want[present], got[present]


def test_a_static_step_length_is_kept_and_checked():
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    result = static_cache(decoder, max_length=16, step_length=1)
    assert result.step_length == 1 and result.pinned == () and "step length: 1, static in the model" in result.report()
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, step_length=2)
    assert str(caught.value) == ("the step length is static in the model: input 'input_ids' dim 1 is 1, not "
                                 "--step-length 2; give --step-length 1 or leave it out")  # fmt: skip


@pytest.mark.parametrize("step_length", [0, 17, 1.5])
def test_refuses_a_step_length_that_does_not_fit_the_buffer(step_length):
    with pytest.raises(StaticCacheError, match=r"step_length must be a whole number from 1 to max_length 16"):
        static_cache(range_decoder(), max_length=16, step_length=step_length)


def test_refuses_a_range_whose_length_only_the_run_knows():
    with pytest.raises(StaticCacheError) as caught:
        static_cache(range_decoder(limit_from=("prompt", 1)), max_length=16, batch=1)
    message = str(caught.value)
    assert "node '/decoder/prompt_range' (Range)" in message and "past_sequence_length" in message
    assert "start 'past_length'" in message and "limit 'prompt_limit'" in message and "CUDA graph" in message
    assert "input 'prompt' dim 1 ('prompt_len') (no flag pins it: declare it static in the model)" in message
    assert "input_ids" not in message, "input_ids' dims are static here (batch 1, the step length pinned to 1)"


def test_a_refusal_for_the_symbolic_batch_names_the_input_and_batch():
    """Positions Range(P, P + batch): only --batch makes its length known; the rewrite says so, and with it the
    rewrite goes through."""
    decoder = range_decoder(limit_from=("input_ids", 0))
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16)
    message = str(caught.value)
    assert "node '/decoder/Range' (Range)" in message
    assert "input 'input_ids' dim 0 ('batch') (pin it with --batch)" in message
    assert "input 'past_key_self_0' dim 0 ('batch') (pin it with --batch)" in message
    assert [d.dim_value for d in static_cache(decoder, max_length=16, batch=1).model.graph.input[0].type.tensor_type
            .shape.dim] == [1, 1]  # fmt: skip


def test_a_refusal_for_a_shape_of_the_past_names_the_past_and_batch():
    """The past's whole shape as an output, the batch symbolic: the Shape node would have to stay, on a past."""
    shape = helper.make_node("Shape", ["past_key_self_0"], ["past_dims"], name="/decoder/past_dims")
    decoder = tiny_decoder([helper.make_node("Identity", ["zero"], ["positions"], name="/decoder/positions")],
                           {"zero": [0]}, step=1, extra_nodes=[shape],
                           extra_outputs=[helper.make_tensor_value_info("past_dims", TP.INT64, [4])])  # fmt: skip
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16)
    message = str(caught.value)
    assert "node '/decoder/past_dims' (Shape)" in message and "max_length, not past_sequence_length" in message
    assert "input 'past_key_self_0' dim 0 ('batch') (pin it with --batch)" in message
    result = static_cache(decoder, max_length=16, batch=2)
    feeds = {f"past_{k}_self_0": np.zeros((2, 2, 16, 4), np.float32) for k in ("key", "value")}
    feeds.update(input_ids=np.ones((2, 1), np.int64), past_sequence_length=np.array([5], np.int32))
    assert run(session(result.model), feeds)["past_dims"].tolist() == [2, 2, 5, 4]


def with_input(decoder: onnx.ModelProto, name: str, dims, node=None, output=None) -> onnx.ModelProto:
    """``decoder`` with an int64 input ``name`` of ``dims``, and a node reading it into an output of its own."""
    decoder.graph.input.append(helper.make_tensor_value_info(name, TP.INT64, dims))
    if node is not None:
        decoder.graph.node.append(node)
        decoder.graph.output.append(helper.make_tensor_value_info(output, TP.INT64, None))
    return decoder


def test_refuses_an_input_of_the_pasts_length_naming_its_dim():
    decoder = with_input(range_decoder(), "attention_mask", ["batch", "past"],
                         helper.make_node("Identity", ["attention_mask"], ["mask_out"], name="mask"), "mask_out")
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, batch=1)
    assert str(caught.value) == (
        "input 'attention_mask' has dims [1, 'past']: its dim 1 ('past') is the pasts' length ['past'], P, so its "
        "shape would still change every step; no flag pins it (P grows by the step length each step): compute it "
        "in the model from the pasts or past_sequence_length"
    )


def test_a_host_input_of_a_symbolic_dim_no_flag_pins_is_refused_naming_it():
    """With --batch, an Expand to Shape(prompt), prompt (batch, prompt_len): its shape is known only at run time."""
    expand = helper.make_node("Expand", ["one", "prompt_shape"], ["prompt_ones"], name="/decoder/Expand")
    shape = helper.make_node("Shape", ["prompt"], ["prompt_shape"], name="/decoder/prompt_shape")
    decoder = with_input(range_decoder(), "prompt", ["batch", "prompt_len"], shape, "prompt_shape")
    decoder.graph.node.append(expand)
    decoder.graph.output.append(helper.make_tensor_value_info("prompt_ones", TP.INT64, None))
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, batch=1)
    assert str(caught.value) == (
        "node '/decoder/Expand' (Expand): its shape 'prompt_shape' (= [1, ?]) is not a constant, and ORT's CUDA "
        "kernel reads it on the host: ORT's CUDA graph could not capture it; symbolic input dims feed it: input "
        "'prompt' dim 1 ('prompt_len') (no flag pins it: declare it static in the model)"
    )
    decoder.graph.node.remove(expand)
    del decoder.graph.output[-1]
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, batch=1)
    assert str(caught.value) == (
        "node '/decoder/prompt_shape' (Shape): the shape of its input 'prompt' is (1, 'prompt_len'), not static with "
        "--batch 1: the Shape node would stay, and ORT's CUDA graph could not capture it; symbolic input dims feed "
        "it: input 'prompt' dim 1 ('prompt_len') (no flag pins it: declare it static in the model)"
    )


@pytest.mark.parametrize("dim, value, expected", [
    (0, 2, "its past_key 'past_key_self_0' has the static batch 2 (input 'past_key_self_0' dim 0), not --batch 1"),
    (1, "heads", "its past_key 'past_key_self_0' has dims ('batch', 'heads', 'past', 4), not (B, N, P, H) with static "
                 "heads N and head size H; the buffer (B, N, max_length, H) needs both: input 'past_key_self_0' dim 1 "
                 "('heads') is not static, and no flag pins it: declare it static in the model"),
])  # fmt: skip
def test_refuses_pasts_dims_naming_the_dim(dim, value, expected):
    decoder = range_decoder()
    field = decoder.graph.input[1].type.tensor_type.shape.dim[dim]
    if isinstance(value, int):
        field.dim_value = value
    else:
        field.dim_param = value
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, batch=1)
    assert str(caught.value) == f"node 'self_attn' (MultiHeadAttention): {expected}"


def test_refuses_a_model_without_self_attention_with_past():
    with pytest.raises(StaticCacheError) as caught:
        static_cache(mha_ep.shipped_model("whisper_random_decoder_init_fp32.onnx"), max_length=16, batch=1)
    assert "node 'Attention_0' (MultiHeadAttention) has no past_key/past_value" in str(caught.value)


def test_refuses_a_past_that_another_node_reads():
    with pytest.raises(StaticCacheError) as caught:
        static_cache(range_decoder(read_past=True), max_length=16, batch=1)
    assert "node '/decoder/peek' (ReduceSum)" in str(caught.value) and "'past_key_self_0'" in str(caught.value)


def test_a_decoder_in_the_shared_buffer_form_keeps_its_inputs_and_decodes_the_same():
    """The rewrite of a rewritten decoder: its self nodes read past_sequence_length already, so that input is kept
    (not added twice) and the pasts are buffers of max_length rows; it decodes the dynamic decoder's tokens."""
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    once = static_cache(decoder, max_length=MAX_LENGTH, batch=2, packed_qkv=False)  # stock ORT runs it
    twice = static_cache(once.model, max_length=MAX_LENGTH, batch=2, packed_qkv=False)
    assert [v.name for v in twice.model.graph.input] == [v.name for v in once.model.graph.input]
    assert declared(twice.model) == declared(once.model)
    assert twice.kept_inputs == (PAST_SEQUENCE_LENGTH,) and twice.self_layers == once.self_layers
    assert "input kept: past_sequence_length int32 (1,), the rows filled so far" in twice.report()
    first, self_kv, cross = whisper_prompt("fp32")
    assert_same_decoding(decode_both(decoder, twice.model, first, self_kv, cross, 6, MAX_LENGTH), TOLERANCE["fp32"])


def test_refuses_a_shared_buffer_of_another_length():
    once = static_cache(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"), max_length=16, batch=1)
    with pytest.raises(StaticCacheError) as caught:
        static_cache(once.model, max_length=24, batch=1)
    assert str(caught.value) == (
        "input 'past_key_self_0' dim 2 is the static buffer length 16 (its node reads 'past_sequence_length' "
        "already: the past is the shared buffer), not --max-length 24"
    )


def export_decoder(buffers: bool, layers: int = 2, p_name: str = PAST_SEQUENCE_LENGTH, qk: bool = False,
                   p_type=TP.INT32) -> onnx.ModelProto:  # fmt: skip
    """A decoder-with-past as ORT's Whisper export writes it (hidden 8, 2 heads of head size 4, vocab 50): input_ids
    (batch_size, sequence_length) embedded plus positions Range(P, P + sequence_length), then per layer causal
    self-attention over a past and cross-attention over BNSH (B, N, L_enc, H) key/value inputs, with residuals.
    ``buffers``: the ``--use_decoder_masked_mha`` form: P comes from the input ``p_name`` (int32 (1,),
    Squeeze -> Cast), and every MultiHeadAttention node, the cross ones too, reads it and ``cache_indirection``
    (batch_size, beam_width, max_sequence_length) at inputs 8/9; else P = Shape(past_key_self_0)[2] and no node
    has inputs 8/9. The weights are the same either way. ``qk``: each cross node's qk output (B, N, S, L_enc) is a
    graph output ``output_cross_qk_<layer>``."""
    hidden, heads, head, vocab = 8, 2, 4, 50
    rng = np.random.default_rng(3)
    weights = {"embed_tokens": (vocab, hidden), "embed_positions": (64, hidden), "lm_head": (hidden, vocab),
               **{f"cross_q_{i}": (hidden, hidden) for i in range(layers)}}  # fmt: skip
    initializers = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
                    for name, shape in weights.items()]  # fmt: skip
    initializers += [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in (("one", 1), ("two", 2))]
    make = helper.make_node
    if buffers:
        p_nodes = [make("Squeeze", [p_name], ["p_int32"], name="/decoder/Squeeze"),
                   make("Cast", ["p_int32"], ["p"], name="/decoder/Cast", to=TP.INT64)]  # fmt: skip
    else:
        p_nodes = [make("Shape", ["past_key_self_0"], ["past_shape"], name="/decoder/Shape"),
                   make("Gather", ["past_shape", "two"], ["p"], name="/decoder/Gather")]  # fmt: skip
    nodes = [
        make("Gather", ["embed_tokens", "input_ids"], ["tokens"], name="/decoder/embed_tokens"),
        *p_nodes,
        make("Shape", ["input_ids"], ["ids_shape"], name="/decoder/Shape_1"),
        make("Gather", ["ids_shape", "one"], ["step"], name="/decoder/Gather_1"),
        make("Add", ["p", "step"], ["limit"], name="/decoder/Add"),
        make("Range", ["p", "limit", "one"], ["positions"], name="/decoder/Range"),
        make("Gather", ["embed_positions", "positions"], ["position"], name="/decoder/embed_positions"),
        make("Add", ["tokens", "position"], ["x0"], name="/decoder/add_positions"),
    ]
    shared = [p_name, "cache_indirection"] if buffers else []
    batch, cache, cross = "batch_size", ["batch_size", heads, "past_sequence_length", head], \
        ["batch_size", heads, "encode_sequence_length", head]
    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, [batch, "sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, [batch, "sequence_length", vocab])]
    for i in range(layers):
        nodes += [
            make("MultiHeadAttention", [f"x{i}", f"x{i}", f"x{i}", "", "", "", f"past_key_self_{i}",
                                        f"past_value_self_{i}", *shared],
                 [f"self_{i}", f"present_key_self_{i}", f"present_value_self_{i}"], domain="com.microsoft",
                 name=f"/decoder/layers.{i}/self_attn", num_heads=heads, unidirectional=1),
            make("MatMul", [f"self_{i}", f"cross_q_{i}"], [f"cross_query_{i}"], name=f"/decoder/layers.{i}/cross_q"),
            make("MultiHeadAttention",
                 [f"cross_query_{i}", f"past_key_cross_{i}", f"past_value_cross_{i}",
                  *(["", "", "", "", "", *shared] if buffers else [])],
                 [f"cross_{i}", *(["", "", f"output_cross_qk_{i}"] if qk else [])], domain="com.microsoft",
                 name=f"/decoder/layers.{i}/cross_attn", num_heads=heads),
            make("Add", [f"self_{i}", f"cross_{i}"], [f"x{i + 1}"], name=f"/decoder/layers.{i}/residual"),
        ]  # fmt: skip
        inputs += [helper.make_tensor_value_info(f"past_{k}_self_{i}", TP.FLOAT, cache) for k in ("key", "value")]
        inputs += [helper.make_tensor_value_info(f"past_{k}_cross_{i}", TP.FLOAT, cross) for k in ("key", "value")]
        outputs += [helper.make_tensor_value_info(f"present_{k}_self_{i}", TP.FLOAT,
                                                  [batch, heads, "total_sequence_length", head])
                    for k in ("key", "value")]  # fmt: skip
        if qk:
            outputs.append(helper.make_tensor_value_info(f"output_cross_qk_{i}", TP.FLOAT,
                                                         [batch, heads, "sequence_length", "encode_sequence_length"]))
    nodes.append(make("MatMul", [f"x{layers}", "lm_head"], ["logits"], name="/decoder/lm_head"))
    if buffers:
        inputs += [helper.make_tensor_value_info(p_name, p_type, [1]),
                   helper.make_tensor_value_info("cache_indirection", TP.INT32,
                                                 [batch, "beam_width", "max_sequence_length"])]  # fmt: skip
    graph = helper.make_graph(nodes, "export_decoder", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def export_prompt(layers: int = 2, batch: int = 2, seed: int = 8):
    """Random first tokens (batch,), self pasts (batch, 2, PROMPT, 4) and cross K/V (batch, 2, 10, 4) of
    ``export_decoder``'s inputs."""
    rng = np.random.default_rng(seed)
    self_kv = {f"past_{k}_self_{i}": rng.standard_normal((batch, 2, PROMPT, 4)).astype(np.float32)
               for i in range(layers) for k in ("key", "value")}  # fmt: skip
    cross = {f"past_{k}_cross_{i}": rng.standard_normal((batch, 2, 10, 4)).astype(np.float32)
             for i in range(layers) for k in ("key", "value")}  # fmt: skip
    return rng.integers(0, 50, batch).astype(np.int64), self_kv, cross


@pytest.mark.parametrize("batch", [2, None], ids=["batch2", "batch-symbolic"])
def test_the_decoder_masked_mha_export_keeps_its_inputs_and_decodes_the_same(batch):
    """ORT's --use_decoder_masked_mha form: every MHA node, cross ones too, reads past_sequence_length and
    cache_indirection. The rewrite keeps both inputs (adds none), leaves the cross nodes as they are, pins
    sequence_length, and on stock ORT's CPU decodes the tokens of the same decoder without inputs 8/9 whose cache
    grows."""
    decoder = export_decoder(buffers=True)
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=batch)
    names = [v.name for v in result.model.graph.input]
    assert names == [v.name for v in decoder.graph.input] and names.count(PAST_SEQUENCE_LENGTH) == 1
    assert result.kept_inputs == (PAST_SEQUENCE_LENGTH, "cache_indirection") and result.beams == 0
    assert result.cache_indirection == "cache_indirection"
    assert result.pinned[0][:3] == ("input_ids", 1, "sequence_length")
    dims = declared(result.model)
    rows = "batch_size" if batch is None else batch
    assert dims["past_key_self_1"] == dims["present_value_self_0"] == [rows, 2, MAX_LENGTH, 4]
    assert dims[PAST_SEQUENCE_LENGTH] == [1] and dims["input_ids"] == [rows, 1]
    assert dims["cache_indirection"] == ["batch_size", "beam_width", MAX_LENGTH]
    assert dims["past_key_cross_0"] == [rows, 2, "encode_sequence_length", 4]
    before = {n.name: list(n.input) for n in decoder.graph.node if "cross_attn" in n.name}
    assert {n.name: list(n.input) for n in result.model.graph.node if "cross_attn" in n.name} == before
    report = result.report()
    assert "input kept: past_sequence_length int32 (1,), the rows filled so far" in report
    assert "input kept: cache_indirection int32 (batch_size, beam_width, 32), the beam" in report
    first, self_kv, cross = export_prompt()
    beam = {"cache_indirection": np.zeros((2, 1, MAX_LENGTH), np.int32)}  # one beam: every row reads its own
    trace = decode_both(export_decoder(buffers=False), result.model, first, self_kv, cross, 8, MAX_LENGTH,
                        static_feeds=beam)  # fmt: skip
    assert_same_decoding(trace, TOLERANCE["fp32"])


def test_a_past_sequence_length_under_another_name_is_kept_and_reported():
    decoder = export_decoder(buffers=True, p_name="past_seq_len")
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2, beams=1)
    assert result.past_sequence_length == "past_seq_len" and PAST_SEQUENCE_LENGTH not in declared(result.model)
    assert declared(result.model)["cache_indirection"] == [2, 1, MAX_LENGTH]
    assert ("input kept: past_seq_len int32 (1,) (the model's past_sequence_length, under its own name: bind it "
            "there), the rows filled so far (P)") in result.report()  # fmt: skip
    assert result.to_dict()["past_sequence_length"] == "past_seq_len"
    assert all(n.input[8] == "past_seq_len" for n in result.model.graph.node if n.op_type == "MultiHeadAttention")
    first, self_kv, cross = export_prompt()
    beam = {"cache_indirection": np.zeros((2, 1, MAX_LENGTH), np.int32)}
    trace = decode_both(export_decoder(buffers=False), result.model, first, self_kv, cross, 4, MAX_LENGTH,
                        static_feeds=beam, p_name="past_seq_len")  # fmt: skip
    assert_same_decoding(trace, TOLERANCE["fp32"])


def test_cross_nodes_with_a_qk_output_pass_through_the_rewrite():
    """Cross nodes that ask for qk (as ORT's export with --output_cross_qk): they are no self nodes, so they stay
    as they are, their qk outputs keep their names, and stock ORT CPU gives the dynamic decoder's qk."""
    decoder = export_decoder(buffers=True, qk=True)
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    outputs = [v.name for v in result.model.graph.output]
    assert outputs == [v.name for v in decoder.graph.output] and "output_cross_qk_1" in outputs
    assert declared(result.model)["output_cross_qk_0"] == [2, 2, 1, "encode_sequence_length"]
    cross = [list(n.output) for n in result.model.graph.node if "cross_attn" in n.name]
    assert cross == [[f"cross_{i}", "", "", f"output_cross_qk_{i}"] for i in range(2)]
    first, self_kv, cross_kv = export_prompt()
    cache = {name: np.concatenate([v, np.zeros((2, 2, MAX_LENGTH - PROMPT, 4), np.float32)], axis=2)
             for name, v in self_kv.items()}  # fmt: skip
    want = run(session(export_decoder(buffers=False, qk=True)), {"input_ids": first[:, None], **self_kv, **cross_kv})
    got = run(session(result.model), {"input_ids": first[:, None], **cache, **cross_kv,
                                       "cache_indirection": np.zeros((2, 1, MAX_LENGTH), np.int32),
                                       PAST_SEQUENCE_LENGTH: np.array([PROMPT], np.int32)})  # fmt: skip
    for name in ("output_cross_qk_0", "output_cross_qk_1", "logits"):
        assert got[name].shape == want[name].shape and np.abs(got[name] - want[name]).max() <= TOLERANCE["fp32"]


def test_a_past_sequence_length_only_cross_nodes_read_is_kept_for_the_self_nodes():
    """Self nodes without inputs 8/9 (growing pasts), cross nodes with them, P computed from past_sequence_length:
    the rewrite gives the self nodes that same input, not a second one, and decodes the same tokens."""
    decoder = export_decoder(buffers=True)
    for node in decoder.graph.node:
        if node.name.endswith("self_attn"):
            del node.input[8:]
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    assert [v.name for v in result.model.graph.input] == [v.name for v in decoder.graph.input]
    assert result.kept_inputs == (PAST_SEQUENCE_LENGTH,) and result.cache_indirection is None
    self_inputs = [n.input[8:] for n in result.model.graph.node if n.name.endswith("self_attn")]
    assert self_inputs == [[PAST_SEQUENCE_LENGTH]] * 2
    first, self_kv, cross = export_prompt()
    beam = {"cache_indirection": np.zeros((2, 1, MAX_LENGTH), np.int32)}
    trace = decode_both(export_decoder(buffers=False), result.model, first, self_kv, cross, 4, MAX_LENGTH,
                        static_feeds=beam)  # fmt: skip
    assert_same_decoding(trace, TOLERANCE["fp32"])


def test_refuses_self_nodes_in_two_forms():
    decoder = export_decoder(buffers=True)
    second = next(n for n in decoder.graph.node if n.name == "/decoder/layers.1/self_attn")
    del second.input[8:]
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=MAX_LENGTH)
    assert str(caught.value) == (
        "node '/decoder/layers.1/self_attn' (MultiHeadAttention): its past_sequence_length is 'absent', but node "
        "'/decoder/layers.0/self_attn' (MultiHeadAttention) has 'past_sequence_length' there: every self-attention "
        "node needs the same graph input at input 8, or none"
    )


def test_refuses_a_past_sequence_length_that_is_not_int32():
    with pytest.raises(StaticCacheError) as caught:
        static_cache(export_decoder(buffers=True, p_type=TP.INT64), max_length=MAX_LENGTH)
    assert str(caught.value) == ("input 'past_sequence_length' (past_sequence_length of node "
                                 "'/decoder/layers.0/self_attn' (MultiHeadAttention)) has element type INT64, not "
                                 "int32")  # fmt: skip


def test_refuses_a_cache_indirection_of_other_beams():
    decoder = export_decoder(buffers=True)
    decoder.graph.input[-1].type.tensor_type.shape.dim[1].dim_value = 4
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=MAX_LENGTH, batch=10, beams=5)
    assert "input 'cache_indirection' (cache_indirection of node '/decoder/layers.0/self_attn' (MultiHeadAttention)) "\
        "has the static beam width 4 (input 'cache_indirection' dim 1), not --beams 5" == str(caught.value)


def subgraph_decoder(reads: str) -> onnx.ModelProto:
    """Positions (1,) made by an If whose branches compute them: ``reads`` "value": both branches read P, the
    past's length computed outside; "past": both take Shape(past_key_self_0)[2] themselves."""
    make = helper.make_node
    out = helper.make_tensor_value_info("branch_positions", TP.INT64, [1])
    if reads == "past":
        body = [make("Shape", ["past_key_self_0"], ["inner_shape"], name="inner_shape"),
                make("Gather", ["inner_shape", "two_1d"], ["branch_positions"], name="inner_gather")]  # fmt: skip
        outside = []
    else:
        body = [make("Identity", ["p_1d"], ["branch_positions"], name="inner_identity")]
        outside = [make("Shape", ["past_key_self_0"], ["past_shape"], name="/decoder/Shape"),
                   make("Gather", ["past_shape", "two_1d"], ["p_1d"], name="/decoder/Gather")]  # fmt: skip
    branches = {branch: helper.make_graph(body, f"{branch}_positions", [], [out]) for branch in ("then", "else")}
    nodes = [
        *outside,
        make("Equal", ["one", "one"], ["truth"], name="/decoder/Equal"),
        make("If", ["truth"], ["positions"], name="/decoder/If", then_branch=branches["then"],
             else_branch=branches["else"]),
    ]  # fmt: skip
    return tiny_decoder(nodes, {"one": 1, "two_1d": [2]}, step=1)


@pytest.mark.parametrize("reads, what", [("value", "'p_1d', which depends on past_sequence_length (p_1d (= [0] + "
                                                   "P * [1]))"),
                                         ("past", "'past_key_self_0', a self-attention past")])  # fmt: skip
def test_refuses_a_subgraph_that_reads_the_past_or_a_value_on_it(reads, what):
    decoder = subgraph_decoder(reads)
    rng = np.random.default_rng(9)
    feeds = {f"past_{k}_self_0": rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for k in ("key", "value")}
    assert run(session(decoder), {**feeds, "input_ids": np.ones((1, 1), np.int64)})["logits"].shape == (1, 1, 50)
    with pytest.raises(StaticCacheError) as caught:
        static_cache(decoder, max_length=16, batch=1)
    message = str(caught.value)
    assert message.startswith(f"node '/decoder/If' (If): it has a subgraph and reads {what}"), message
    assert "the rewrite does not follow subgraphs (If, Loop, Scan)" in message
    assert "move that computation out of the subgraph" in message


@pytest.mark.parametrize("max_length", [0, -3])
def test_refuses_a_buffer_without_rows(max_length):
    with pytest.raises(StaticCacheError, match="max_length must be a whole number >= 1"):
        static_cache(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"), max_length=max_length)


# ------------------------------------------------------------------------------- rule PACKED_PROJECTIONS
PACKED_TOLERANCE = {"fp32": 1e-6, "fp16": 4e-3}  # logits and cache rows, packed vs unpacked rewrite on mha_ep


def plugin_of(route: str):
    return lambda model: mha_ep.InferenceSession(model, backend="reference", route=route)


@pytest.mark.parametrize("route", ["python-op", "native"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_packed_projections_fuse_every_self_node_and_decode_the_unpacked_rewrite_s_logits(precision, route):
    """The shipped Whisper decoder-with-past: the rewrite packs both self nodes' Q, K and V projections (the report
    says so), and 8 greedy steps of the packed model on mha_ep's CPU routes give the tokens, logits and cache rows
    of the rewrite with the projections apart (each output element is the same dot product: equal in float32 here,
    within float16 rounding), both the dynamic decoder's tokens on stock ORT."""
    decoder = onnx.load(mha_ep.shipped_model(f"whisper_random_decoder_{precision}.onnx"))
    packed = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    plain = static_cache(decoder, max_length=MAX_LENGTH, batch=2, packed_qkv=False)
    assert packed.packed_nodes == ["Attention_0", "Attention_2"] and plain.packed_qkv is None
    assert "packed QKV projections: 2 of 2 self-attention node(s)" in packed.report()
    assert "packed QKV projections: off" in plain.report() and "not packed" not in packed.report()
    first, self_kv, cross = whisper_prompt(precision)
    traces = [decode_both(decoder, result.model, first, self_kv, cross, 8, MAX_LENGTH,
                          static_session_of=plugin_of(route)) for result in (packed, plain)]  # fmt: skip
    for trace in traces:
        assert_same_decoding(trace, TOLERANCE[precision])
    for step, ((token, logits), (plain_token, plain_logits)) in enumerate(zip(traces[0]["static"],
                                                                              traces[1]["static"])):  # fmt: skip
        assert np.array_equal(token, plain_token), f"step {step}: tokens {token} vs {plain_token}"
        error = np.abs(logits - plain_logits).max()
        assert error <= PACKED_TOLERANCE[precision], f"step {step}: logits differ by {error}"
    for (rows, _), (plain_rows, _) in zip(traces[0]["rows"], traces[1]["rows"]):
        error = np.abs(rows.astype(np.float32) - plain_rows.astype(np.float32)).max()
        assert error <= PACKED_TOLERANCE[precision], f"cache rows differ by {error}"


def test_packed_projections_interleave_the_weights_per_head_and_keep_the_bias():
    """What the rule writes for one self node: MatMul(X, W_qkv), W_qkv (E, N*3*H) with column n*3H + slot*H + h the
    column n*H + h of W_q, W_k, W_v; a Reshape to (0, 0, N, 3, H) as the node's query; no key or value; the bias
    and every other input as they were; the three projections and their weights gone; JSON says the same."""
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    before = {n.name: n for n in decoder.graph.node}
    weights = {t.name: numpy_helper.to_array(t) for t in decoder.graph.initializer}
    producers = {o: n for n in decoder.graph.node for o in n.output}
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    graph = result.model.graph
    after = {n.name: n for n in graph.node}
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    heads, head = 4, 16
    for name in ("Attention_0", "Attention_2"):
        node, old = after[name], before[name]
        reshape = next(n for n in graph.node if n.output[0] == node.input[0])
        matmul = next(n for n in graph.node if n.output[0] == reshape.input[0])
        assert (reshape.op_type, matmul.op_type) == ("Reshape", "MatMul")
        assert initializers[reshape.input[1]].tolist() == [0, 0, heads, 3, head]
        projections = [producers[old.input[slot]] for slot in range(3)]
        assert matmul.input[0] == projections[0].input[0]  # X, the layer norm's output
        fused = initializers[matmul.input[1]]
        assert fused.shape == (64, heads * 3 * head)
        for slot, projection in enumerate(projections):
            w = weights[projection.input[1]]
            for n in range(heads):
                start = n * 3 * head + slot * head
                np.testing.assert_array_equal(fused[:, start:start + head], w[:, n * head:(n + 1) * head])
            assert projection.name not in after and projection.input[1] not in initializers
        assert list(node.input[1:3]) == ["", ""] and list(node.input[3:]) == list(old.input[3:]) + [
            PAST_SEQUENCE_LENGTH]
    data = result.to_dict()["packed_qkv"]
    assert data == [{"node": n, "packed": True, "reason": None} for n in ("Attention_0", "Attention_2")]
    again = static_cache(result.model, max_length=MAX_LENGTH, batch=2)
    assert again.packed_nodes == ["Attention_0", "Attention_2"] and "2 packed by an earlier rewrite" in again.report()


def unfusable(change: str) -> onnx.ModelProto:
    """The shipped fp32 decoder with its first self node's projections changed so that rule PACKED_PROJECTIONS does
    not match: "graph-input weight" (W_k a graph input, not a constant), "another input" (the value projection
    reads X through an Identity), "read elsewhere" (the query projection's output is also a graph output)."""
    decoder = onnx.load(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    graph = decoder.graph
    node = next(n for n in graph.node if n.name == "Attention_0")
    producers = {o: n for n in graph.node for o in n.output}
    query, key, value = (producers[node.input[slot]] for slot in range(3))
    if change == "graph-input weight":
        weight = next(t for t in graph.initializer if t.name == key.input[1])
        graph.input.append(helper.make_tensor_value_info(weight.name, TP.FLOAT, list(weight.dims)))
    elif change == "another input":
        graph.node.insert(list(graph.node).index(value), helper.make_node("Identity", [value.input[0]], ["x_again"],
                                                                          name="x_again"))  # fmt: skip
        value.input[0] = "x_again"
    elif change == "read elsewhere":
        graph.output.append(helper.make_tensor_value_info(query.output[0], TP.FLOAT, None))
    return decoder


@pytest.mark.parametrize("change, reason", [
    ("graph-input weight", "the weight 'onnx::MatMul_389' of its key projection (node "
                           "'/decoder/layers.0/self_attn/k_proj/MatMul' (MatMul)) is not a constant initializer (a "
                           "graph input, or computed)"),
    ("another input", "its query, key and value are projections of different inputs "
                      "('/decoder/layers.0/self_attn_layer_norm/LayerNormalization_output_0', "
                      "'/decoder/layers.0/self_attn_layer_norm/LayerNormalization_output_0', 'x_again'), not of one"),
    ("read elsewhere", "its query projection's output '/decoder/layers.0/self_attn/q_proj/MatMul_output_0' is read "
                       "elsewhere too (a graph output)"),
])  # fmt: skip
def test_a_self_node_whose_projections_do_not_match_keeps_them_and_the_report_says_why(change, reason):
    """The first self node keeps its three MatMuls and key / value inputs, the second is packed; the report names
    the node and the reason; the rewrite decodes what the unpacked rewrite does, on mha_ep."""
    decoder = unfusable(change)
    result = static_cache(decoder, max_length=MAX_LENGTH, batch=2)
    assert result.packed_qkv == (("Attention_0", reason), ("Attention_2", ""))
    report = result.report()
    assert "packed QKV projections: 1 of 2" in report and f"not packed: node 'Attention_0': {reason}" in report
    node = next(n for n in result.model.graph.node if n.name == "Attention_0")
    projections = [n.name.split("/")[2] for n in result.model.graph.node if n.op_type == "MatMul"
                   and "/self_attn/" in n.name and n.name.split("/")[-2] in ("q_proj", "k_proj", "v_proj")]
    assert all(node.input[:3]) and projections == ["layers.0"] * 3, projections  # layer 1's: packed
    if change == "graph-input weight":
        return  # the weight is a graph input now: a feed the decode loop below does not make
    first, self_kv, cross = whisper_prompt("fp32")
    plain = static_cache(decoder, max_length=MAX_LENGTH, batch=2, packed_qkv=False)
    traces = [decode_both(decoder, r.model, first, self_kv, cross, 4, MAX_LENGTH, static_session_of=plugin_of("native"))
              for r in (result, plain)]  # fmt: skip
    for (token, logits), (plain_token, plain_logits) in zip(traces[0]["static"], traces[1]["static"]):
        assert np.array_equal(token, plain_token) and np.abs(logits - plain_logits).max() <= PACKED_TOLERANCE["fp32"]


def test_a_decoder_without_projections_is_left_unpacked_naming_what_its_query_is():
    result = static_cache(range_decoder(), max_length=16, batch=1)
    assert result.packed_qkv == (("self_attn", "its query 'x' is not the output of a MatMul (made by node "
                                               "'/decoder/add_positions' (Add))"),)  # fmt: skip


def test_cli_writes_a_loadable_static_decoder(tmp_path):
    target = tmp_path / "x.onnx"
    done = run_cli("static-cache", str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx")), "-o", str(target),
                   "--max-length", "16", "--batch", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 self-attention" in done.stdout and f"wrote {target}" in done.stderr
    model = onnx.load(target)
    onnx.checker.check_model(model, full_check=True)
    assert [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim] == [1, 4, 16, 16]
    session(target)


def test_cli_json_has_the_result_fields(tmp_path):
    target = tmp_path / "x.onnx"
    done = run_cli("static-cache", str(mha_ep.shipped_model("whisper_random_decoder_fp16.onnx")), "-o", str(target),
                   "--max-length", "16", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["max_length"] == 16 and data["batch"] is None and data["output"] == str(target)
    assert data["self_layers"][0]["present_value"] == "present_value_self_0" and data["folded"] > 0
    assert [entry["packed"] for entry in data["packed_qkv"]] == [True, True]


def test_cli_no_packed_qkv_keeps_the_projections(tmp_path):
    """--no-packed-qkv: the rewrite stock ORT runs too (stock ORT refuses packed QKV with a past)."""
    target = tmp_path / "x.onnx"
    done = run_cli("static-cache", str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx")), "-o", str(target),
                   "--max-length", "16", "--batch", "2", "--no-packed-qkv")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "packed QKV projections: off (packed_qkv=False, --no-packed-qkv)" in done.stdout
    nodes = onnx.load(target).graph.node
    assert all(n.input[1] and n.input[2] for n in nodes if n.op_type == "MultiHeadAttention")
    first, self_kv, _ = whisper_prompt("fp32")
    out = run(session(target), {"input_ids": first[:, None], **{n: np.zeros((2, 4, 16, 16), np.float32)
                                                                for n in self_kv}, **{
        f"past_{k}_cross_{i}": np.zeros((2, 4, 100, 16), np.float32) for k in ("key", "value") for i in range(2)},
        PAST_SEQUENCE_LENGTH: np.array([0], np.int32)})  # fmt: skip
    assert out["logits"].shape[:2] == (2, 1)


def test_cli_step_length_pins_the_symbolic_step(tmp_path):
    source, target = tmp_path / "decoder.onnx", tmp_path / "x.onnx"
    onnx.save(range_decoder(), source)
    done = run_cli("static-cache", str(source), "-o", str(target), "--max-length", "16", "--batch", "1",
                   "--step-length", "3", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["pinned"] == [{"input": "input_ids", "dim": 1, "symbol": "seq", "value": 3}]
    assert data["step_length"] == 3
    assert declared(onnx.load(target))["input_ids"] == [1, 3]
    done = run_cli("static-cache", str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx")), "-o", str(target),
                   "--max-length", "16", "--step-length", "3")  # fmt: skip
    assert done.returncode == 2 and "input 'input_ids' dim 1 is 1, not --step-length 3" in done.stderr


def test_cli_refusal_is_one_line_with_exit_code_2(tmp_path):
    target = tmp_path / "x.onnx"
    done = run_cli("static-cache", str(mha_ep.shipped_model("whisper_random_decoder_init_fp32.onnx")), "-o",
                   str(target), "--max-length", "16")  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mha-ep static-cache: error: ") and "Attention_0" in lines[0]
    assert not target.exists()


def test_cli_shared_cross_kv_declares_the_cross_inputs_one_row_an_entry(tmp_path):
    """--beams 2 --shared-cross-kv with a symbolic batch: the cross K/V inputs get dim 0 ``batch_entries``, the report
    names them, and the JSON says each cross node was shared; without --beams the flag is refused."""
    target = tmp_path / "x.onnx"
    source = str(mha_ep.shipped_model("whisper_random_decoder_fp32.onnx"))
    done = run_cli("static-cache", source, "-o", str(target), "--max-length", "16", "--beams", "2",
                   "--shared-cross-kv", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [entry["shared"] for entry in data["shared_cross_kv"]] == [True, True]
    cross = [f"past_{k}_cross_{i}" for i in range(2) for k in ("key", "value")]
    assert sorted(data["entry_inputs"]) == sorted(cross)
    inputs = {v.name: v for v in onnx.load(target).graph.input}
    assert all(inputs[name].type.tensor_type.shape.dim[0].dim_param == "batch_entries" for name in cross)
    refused = run_cli("static-cache", source, "-o", str(tmp_path / "y.onnx"), "--max-length", "16",
                      "--shared-cross-kv")  # fmt: skip
    assert refused.returncode == 2 and "give beams (--beams W) too" in refused.stderr


@pytest.mark.parametrize("change, reason", [
    ("mask", "it has a key_padding_mask (one row per beam)"),
    ("qk", "it writes the qk output (one row per beam)"),
    ("other reader", "is read by"),
])  # fmt: skip
def test_a_cross_node_that_cannot_share_keeps_its_rows_and_the_report_says_why(change, reason):
    """Rule SHARED_CROSS_KV leaves a cross node whose rows differ per beam (a key_padding_mask, the qk output) or
    whose key is read by another node as it was, with the reason; the other layer's node is shared."""
    decoder = whisper_decoder_step(layers=2, hidden=64, heads=4, ffn=128, vocab=100, cross_qk=change == "qk")
    cross = [n for n in decoder.graph.node if n.op_type == "MultiHeadAttention" and n.input[1].startswith("cross_")]
    if change == "qk":  # only layer 0 keeps its qk output
        cross[1].output[3] = ""
        decoder.graph.output.remove(next(o for o in decoder.graph.output if o.name == "output_cross_qk_1"))
    if change == "mask":
        decoder.graph.input.append(helper.make_tensor_value_info("cross_mask", TP.INT32, ["batch", "encoder_sequence"]))
        while len(cross[0].input) < 5:
            cross[0].input.append("")
        cross[0].input[4] = "cross_mask"
    if change == "other reader":
        decoder.graph.node.append(helper.make_node("Identity", [cross[0].input[1]], ["key_copy"]))
        decoder.graph.output.append(helper.make_tensor_value_info("key_copy", TP.FLOAT, None))
    result = static_cache(decoder, max_length=16, batch=4, beams=2, packed_qkv=False, shared_cross_kv=True)
    (first, why_not), (second, why) = result.shared_cross_kv
    assert reason in why_not and why == "", result.shared_cross_kv
    assert f"not shared: node {first!r}: {why_not}" in result.report()
    assert result.entry_inputs == ("cross_key_1", "cross_value_1")
    declared = {v.name: v.type.tensor_type.shape.dim[0].dim_value for v in result.model.graph.input}
    assert declared["cross_key_1"] == 2 and declared["cross_key_0"] == 4


def static_pasts(feeds: dict, rows: int, max_length: int) -> dict:
    """The static decoder's self caches (rows, N, max_length, H) from decoder_step_feeds' pasts: zeros with the
    PROMPT positions in front (a past of fewer rows repeated over them)."""
    cache = {}
    for name, value in feeds.items():
        if name.startswith("past_"):
            cache[name] = np.zeros((rows,) + value.shape[1:2] + (max_length,) + value.shape[3:], value.dtype)
            cache[name][:, :, :PROMPT] = value
    return cache


def test_decode_matmul_turns_a_few_rows_weight_products_into_the_plugin_op_with_the_same_logits():
    """Rule DECODE_MATMUL on a float16 decoder of 2 rows: every MatMul by a constant weight becomes
    mha_ep::DecodeMatMul over the weight transposed, the model imports the plugin domain, and the step's logits
    on mha_ep's reference route are the plain rewrite's within float16 rounding; a float32 decoder, or more rows
    than the op takes, keeps its MatMuls with the reason."""
    from mha_ep.models.synthetic import decoder_step_feeds

    decoder = whisper_decoder_step(layers=2, hidden=64, heads=4, ffn=128, dtype="float16", vocab=100)
    plain = static_cache(decoder, max_length=16, batch=2, packed_qkv=False)
    result = static_cache(decoder, max_length=16, batch=2, packed_qkv=False, decode_matmul=True)
    nodes = result.model.graph.node
    assert not [n for n in nodes if n.op_type == "MatMul"] and len(result.decode_matmul) == 17
    product = next(n for n in nodes if n.op_type == spec.MATMUL_OP_TYPE)
    weight = next(t for t in result.model.graph.initializer if t.name == product.input[1])
    assert product.domain == spec.PLUGIN_DOMAIN and list(weight.dims)[::-1] == [
        d for t in decoder.graph.initializer if t.name == "layer0.self_W_q" for d in t.dims]
    assert spec.PLUGIN_DOMAIN in {o.domain for o in result.model.opset_import}
    assert "decode products: 17 of 17 MatMul(s)" in result.report()
    # each product's type and shape declared (no shape inference reaches a plugin op): the partition pass reads
    # the attention nodes' query types through them and claims every node (without: all 4 declined, and ORT
    # ran them on its CPU provider, which its CUDA graph capture refuses)
    declared = {v.name: v for v in result.model.graph.value_info}
    assert declared[product.output[0]].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value for d in declared[product.output[0]].type.tensor_type.shape.dim] == [2, 1, weight.dims[0]]
    assert partition(result.model, route="native").report().splitlines()[0].endswith("4 claimed, 0 declined")
    feeds = decoder_step_feeds(2, PROMPT, 2, 64, 4, 10, "float16", seed=4)
    feeds.pop("hidden_states")
    cache = static_pasts(feeds, rows=2, max_length=16)
    step = {"input_ids": np.array([[5], [7]], np.int64), **cache, PAST_SEQUENCE_LENGTH: np.array([PROMPT], np.int32),
            **{n: v for n, v in feeds.items() if n.startswith("cross_")}}  # fmt: skip
    logits = [run(mha_ep.InferenceSession(model, backend="reference", route="native"), step)["logits"]
              for model in (plain.model, result.model)]  # fmt: skip
    assert np.abs(logits[0].astype(np.float32) - logits[1].astype(np.float32)).max() <= TOLERANCE["fp16"]
    kept = static_cache(whisper_decoder_step(layers=1, hidden=64, heads=4, ffn=128, vocab=100), max_length=16,
                        batch=2, decode_matmul=True)  # fmt: skip
    assert all("not float16 or bfloat16" in why for _, why in kept.decode_matmul)
    wide = static_cache(decoder, max_length=16, batch=16, packed_qkv=False, decode_matmul=True)
    assert all("more than 8 rows" in why for _, why in wide.decode_matmul), wide.decode_matmul


def test_the_beam_rules_compose_shared_cross_kv_and_decode_matmul_give_the_plain_rewrite_s_logits():
    """One entry, 5 beams of a float16 decoder: --shared-cross-kv and --decode-matmul together (5 rows: every
    weight product as mha_ep::DecodeMatMul, the cross K/V bound once) give, on mha_ep's reference route, the
    logits of the rewrite without them fed the cross K/V once per beam."""
    from mha_ep.models.synthetic import decoder_step_feeds

    decoder = whisper_decoder_step(layers=2, hidden=64, heads=4, ffn=128, dtype="float16", vocab=100)
    plain = static_cache(decoder, max_length=16, batch=5, beams=5, packed_qkv=False)
    both = static_cache(decoder, max_length=16, batch=5, beams=5, packed_qkv=False, shared_cross_kv=True,
                        decode_matmul=True)  # fmt: skip
    assert all(not why for _, why in both.shared_cross_kv) and all(not why for _, why in both.decode_matmul)
    assert partition(both.model, route="native").report().splitlines()[0].endswith("4 claimed, 0 declined")
    feeds = decoder_step_feeds(1, PROMPT, 2, 64, 4, 10, "float16", seed=6)
    feeds.pop("hidden_states")
    cache = static_pasts(feeds, rows=5, max_length=16)  # the entry's prompt in every beam's rows
    cross = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    common = {"input_ids": np.array([[5], [7], [9], [11], [13]], np.int64), **cache,
              PAST_SEQUENCE_LENGTH: np.array([PROMPT], np.int32), "cache_indirection": np.zeros((1, 5, 16), np.int32)}
    want = run(mha_ep.InferenceSession(plain.model, backend="reference", route="native"),
               {**common, **{n: np.repeat(v, 5, axis=0) for n, v in cross.items()}})["logits"]  # fmt: skip
    got = run(mha_ep.InferenceSession(both.model, backend="reference", route="native"), {**common, **cross})["logits"]
    assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= TOLERANCE["fp16"]
