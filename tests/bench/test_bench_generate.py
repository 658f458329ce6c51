"""The generation and serving benchmarks' host-side pieces on the CPU: the decoder they generate with (its
embedding, positions and logits), the cross-attention cache builder, the NumPy loop, the token agreement, the
serving spread, the table row and the options (the GPU columns run on the device: docs/DEVICE_RUNBOOK.md)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from mha_ep.bench import generate, native
from mha_ep.models.synthetic import decoder_step_feeds, whisper_cross_kv, whisper_decoder_step

LAYERS, HIDDEN, HEADS, VOCAB = 2, 64, 2, 97


def cpu_session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def decoder_feeds(batch: int, past: int, seed: int = 0) -> dict:
    feeds = decoder_step_feeds(batch, past, LAYERS, HIDDEN, HEADS, encoder_sequence=12, seed=seed)
    feeds.pop("hidden_states")
    feeds["input_ids"] = np.arange(batch, dtype=np.int64)[:, None] + 3
    return feeds


def test_the_generation_decoder_embeds_tokens_at_the_pasts_position_and_ends_in_logits():
    session = cpu_session(whisper_decoder_step(LAYERS, HIDDEN, HEADS, 128, vocab=VOCAB))
    names = [o.name for o in session.get_outputs()]
    assert names[0] == "logits" and names[1:] == [f"present_{kv}_self_{l}" for l in range(LAYERS) for kv in ("key", "value")]
    feeds = decoder_feeds(2, 5)
    logits, key0 = session.run(["logits", "present_key_self_0"], feeds)
    assert logits.shape == (2, 1, VOCAB) and key0.shape == (2, HEADS, 6, HIDDEN // HEADS)
    assert float(np.std(logits)) > 0.05
    other_token = dict(feeds, input_ids=feeds["input_ids"] + 1)
    assert not np.allclose(session.run(["logits"], other_token)[0], logits)
    # the same token, caches and values at a past one longer: the position embedding moves the logits
    longer = decoder_feeds(2, 6)
    longer["input_ids"] = feeds["input_ids"]
    assert not np.allclose(session.run(["logits"], longer)[0], logits)


def test_the_cross_cache_is_the_projected_states_split_into_heads():
    model = whisper_cross_kv(LAYERS, HIDDEN, HEADS)
    states = np.random.default_rng(1).standard_normal((2, 12, HIDDEN)).astype(np.float32)
    outputs = dict(zip([o.name for o in cpu_session(model).get_outputs()],
                       cpu_session(model).run(None, {"encoder_hidden_states": states})))  # fmt: skip
    weights = {t.name: t for t in model.graph.initializer}
    from onnx import numpy_helper

    key = states @ numpy_helper.to_array(weights["W_cross_key_1"])
    expected = key.reshape(2, 12, HEADS, HIDDEN // HEADS).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(outputs["cross_key_1"], expected, rtol=1e-5, atol=1e-6)
    assert outputs["cross_value_0"].shape == (2, HEADS, 12, HIDDEN // HEADS)


def test_the_numpy_loop_stops_each_row_at_end_of_text_and_suppresses_tokens():
    session = cpu_session(whisper_decoder_step(LAYERS, HIDDEN, HEADS, 128, vocab=VOCAB, seed=2))
    feeds = decoder_feeds(3, 2, seed=3)
    first = feeds.pop("input_ids")
    cache = {n: v for n, v in feeds.items() if n.startswith("past_")}
    fixed = {n: v for n, v in feeds.items() if n.startswith("cross_")}
    free = generate.host_greedy(session, first, cache, fixed, 12, [])
    assert [len(t) for t in free] == [12, 12, 12] and [t[0] for t in free] == first[:, 0].tolist()
    banned = free[0][1]
    bias = np.zeros(VOCAB, np.float32)
    bias[banned] = -np.inf
    seconds: list = []
    suppressed = generate.host_greedy(session, first, cache, fixed, 12, seconds, bias=bias)
    assert all(banned not in t[1:] for t in suppressed) and len(seconds) == 12
    stop = next(i for i in range(1, 12) if free[1][i] not in free[1][:i])
    stopped = generate.host_greedy(session, first, cache, fixed, 12, [], eot=free[1][stop])
    assert stopped[1] == free[1][:stop]


def test_agreement_counts_positions_and_length_differences():
    assert generate.agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert generate.agreement([[1, 9, 3], [4]], [[1, 2, 3], [4, 5]]) == pytest.approx(3 / 5)
    assert generate.agreement([[]], [[]]) == 1.0


def test_serving_shapes_are_distinct_and_within_the_spread():
    shapes = native.serving_shapes(60, seed=4)
    assert len(set(shapes)) == 60 and shapes == native.serving_shapes(60, seed=4)
    assert all(b in (1, 2, 4, 8, 16, 32) and 8 <= s <= 512 for b, s in shapes)
    assert len({b for b, _ in shapes}) >= 4 and len({s for _, s in shapes}) >= 30


def test_a_generation_row_prints_every_column_and_the_ratios():
    samples = {c: [[0.001 * (i + 1)] * 3] for i, c in enumerate(generate.COLUMNS)}
    tokens = {c: [[1, 2, 3]] for c in generate.COLUMNS}
    tokens["stock_numpy"] = [[1, 2]]
    tokens["mhaep_session"] = [[1, 2, 4]]
    encoder = {c: 1.0 for c in generate.COLUMNS}
    row = generate.summarise("row", samples, tokens, encoder, steps=3)
    assert row["mhaep_plain_vs_iobinding"] == pytest.approx(1.5) and row["stock_numpy_agreement"] == 1.0
    assert row["mhaep_session_agreement"] == pytest.approx(2 / 3)
    assert row["mhaep_plain_total_30s_ms"] == pytest.approx(1.0 + 3 * 3.0)
    assert row["static_greedy_vs_iobinding"] == pytest.approx(3.0)
    assert row["greedy_answers"]["mhaep_session"] == [[1, 2, 4]] and set(row["greedy_answers"]) == set(tokens)
    beams = {"stock_beam": [[0.004, 0.004]], "static_beam": [[0.001, 0.001]]}
    row = generate.summarise_beams(row, beams, {"stock_beam": [[5, 6]], "static_beam": [[5, 7]]})
    assert row["static_beam_vs_stock_beam"] == pytest.approx(0.25) and row["static_beam_agreement"] == 0.5
    cells = [cell.strip() for cell in generate.format_row(row).strip("|").split("|")]
    assert cells[0] == "row" and cells[1:7] == ["1.000", "2.000", "3.000", "4.000", "5.000", "6.000"]
    assert cells[7:13] == ["1.50", "2.00", "2.50", "3.00", "4.000/1.000", "0.25"]


def test_cold_generations_plan_anew_each_time_with_plans_ahead_and_without_in_turns(monkeypatch):
    """--cold: every generation starts from an empty plan cache, plans ahead as set and off in turns; the mean step
    (a miss every plans_ahead + 1 steps shows in it), the planner calls a generation; the setting comes back."""
    from mha_ep import native
    from mha_ep.decode import generate as loops

    seen, misses = [], {"misses": 0}

    def greedy(stepper, first, cache, fixed, steps, step_seconds):
        ahead = native.settings.plans_ahead
        seen.append((ahead, native.stats()["plans"]))
        misses["misses"] += 1 if ahead else steps  # one plan, or one a step
        step_seconds.extend([0.004] + [0.001] * (steps - 1) if ahead else [0.002] * steps)
        return [[1] * steps]

    real_stats = native.stats
    monkeypatch.setattr(loops, "greedy", greedy)
    monkeypatch.setattr(native, "stats", lambda: dict(real_stats(), misses=misses["misses"]))
    monkeypatch.setattr(native.settings, "plans_ahead", 16)
    row = generate.cold_generations(None, None, {}, {}, steps=4, repeats=3, synchronize=lambda: None)
    assert seen == [(16, 0), (0, 0)] * 3  # in turns, each from an empty cache
    assert native.settings.plans_ahead == 16
    assert row["mhaep_plain_cold_ms_per_token"] == pytest.approx(1.75)  # the mean step, not the median (1.0)
    assert row["mhaep_plain_cold_no_ahead_ms_per_token"] == pytest.approx(2.0)
    assert (row["mhaep_plain_cold_planner_calls"], row["mhaep_plain_cold_no_ahead_planner_calls"]) == (1, 4)
    assert row["cold_ahead_vs_no_ahead"] == pytest.approx(0.875)
    row["mhaep_plain_cold_vs_iobinding"] = 0.5
    assert generate.cold_cells(row) == " 1.750 (1) / 2.000 (4) | 0.88 | 0.50 |"
    assert generate.cold_cells({}) == ""


def test_a_static_loop_is_timed_over_the_decoder_steps_it_ran_without_the_encoder():
    """static_loop reads the transcriber's own account (loop_seconds, decoder.last_steps: the loop alone, the
    steps run past end-of-text included), not a wall clock around decode(), which also runs the encoder."""

    class Transcriber:
        decoder = type("Decoder", (), {"last_steps": 0})()
        loop_seconds = 0.0

        def decode(self, features):
            self.loop_seconds, self.decoder.last_steps = 0.016, 16  # 10 tokens, ended at the 16th step's check
            return [list(range(10))]

    tokens, per_step = generate.static_loop(Transcriber(), np.zeros((1, 80, 3000), np.float32))
    assert tokens == [list(range(10))] and per_step == [pytest.approx(0.001)] * 16


def test_the_options_have_help(capsys):
    with pytest.raises(SystemExit) as done:
        generate.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in ("--repeats", "--steps", "--sizes", "--batches", "--models", "--json", "--out"):
        assert option in text
    with pytest.raises(SystemExit):
        generate.main(["--sizes", "huge"])


def test_a_step_must_read_every_weight_once_one_embedding_row_a_row_the_cross_cache_and_the_filled_rows():
    from onnx import numpy_helper

    model = whisper_decoder_step(LAYERS, HIDDEN, HEADS, 128, vocab=VOCAB)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    tables = arrays.pop("embed_tokens").nbytes + arrays.pop("embed_positions").nbytes
    got = generate.step_bytes(model, rows=3, past=10, encoder_positions=12, element_bytes=4)
    assert got["weights"] == sum(a.nbytes for a in arrays.values()) + 2 * 3 * HIDDEN * 4 < tables + got["weights"]
    assert got["cross_kv"] == LAYERS * 2 * 3 * 12 * HIDDEN * 4 and got["self_cache"] == LAYERS * 2 * 3 * 10 * HIDDEN * 4
    assert got["total"] == got["weights"] + got["cross_kv"] + got["self_cache"]


@pytest.mark.parametrize("name, kind", [
    ("void split_key_attention<__half, __half>(float const*", "attention"),
    ("void shared_buffer_decode<__half, int>(__half const*", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("void onnxruntime::contrib::cuda::masked_multihead_attention_kernel<", "attention"),
    ("nvjet_hsh_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("void onnxruntime::contrib::cuda::AddBiasTransposeQKV<__half>", "layout"),
    ("void onnxruntime::contrib::cuda::ConcatTensorToTensor<float>", "layout"),
    ("void onnxruntime::contrib::cuda::SkipLayerNormKernelSmall<__half, float", "other"),
])  # fmt: skip
def test_a_kernel_s_kind_is_read_from_its_name(name, kind):
    from mha_ep.bench.cupti import by_kind, kernel_kind

    assert kernel_kind(name) == kind
    split = by_kind({name: (2.0, 5.0), "elementwise_kernel": (1.0, 1.5)})
    assert split[kind] == (6.5 if kind == "other" else 5.0) and split["other"] >= 1.5 and split["total"] == 6.5 and split["launches"] == 3.0


def test_the_deployed_sizes_say_their_encoder_is_cut_and_a_row_prints_the_columns_it_measured():
    row = generate.Row("turbo", 8, "float16")
    assert row.vocab == 51866 and row.encoder_layers == 2
    assert row.label.startswith("Whisper-large-v3-turbo-sized (4 x 1280, 20 heads) B=8 float16")
    assert row.label.endswith("encoder cut to 2 layers")
    kept = ("stock_iobinding", "mhaep_plain", "static_greedy")
    samples = {c: [[0.001]] for c in kept}
    result = generate.summarise("row", samples, {c: [[1, 2]] for c in kept}, {c: 1.0 for c in kept}, steps=2)
    result = generate.summarise_beams(result, {"stock_beam": [[0.002]], "static_beam": [[0.001]]},
                                      {"stock_beam": [[1]], "static_beam": [[1]]})  # fmt: skip
    result["profile"] = {"static": {"total": 500.0, "attention": 100.0, "gemm": 300.0, "layout": 20.0, "other": 80.0,
                                    "floor_ratio": 2.5},
                         "stock": {"total": 600.0, "attention": 150.0, "gemm": 300.0, "layout": 50.0, "other": 100.0},
                         "static_vs_stock_gpu": 500 / 600}  # fmt: skip
    cells = [cell.strip() for cell in generate.format_row(result).strip("|").split("|")]
    assert cells[1:7] == ["-", "1.000", "1.000", "-", "-", "1.000"]
    assert cells[-6:] == ["500 (100/300/20/80)", "600 (150/300/50/100)", "-", "0.83", "-", "2.5x"]
    # with the plain session's step profiled too
    result["profile"]["plain"] = {"total": 540.0, "attention": 130.0, "gemm": 300.0, "layout": 30.0, "other": 80.0}
    result["profile"]["plain_vs_stock_gpu"] = 540 / 600
    cells = [cell.strip() for cell in generate.format_row(result).strip("|").split("|")]
    assert cells[-6:] == ["500 (100/300/20/80)", "600 (150/300/50/100)", "540 (130/300/30/80)", "0.83", "0.90",
                          "2.5x"]  # fmt: skip


def test_the_options_refuse_large_v3_in_float32_and_unknown_columns(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--sizes", "large-v3", "--dtype", "float32"])
    assert "over protobuf's 2 GB limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--columns", "stock_iobinding,fastest"])
    assert "unknown column(s) ['fastest']" in capsys.readouterr().err


def test_out_holds_every_finished_row_while_later_rows_run(tmp_path, monkeypatch):
    """--out rewrites bench_generate.json after each row (whole, through a rename): a run that a time limit cuts
    off keeps the rows it finished. A row that fails is reported in its place, and the rows after it still run."""
    import json

    seen = []

    def fake_row(row, repeats, steps, columns, profile, **options):
        path = tmp_path / "bench_generate.json"
        seen.append(json.loads(path.read_text())["rows"] if path.exists() else None)
        if row.batch == 2:
            raise RuntimeError("out of memory")
        return {"label": row.label, "steps": steps, "columns": list(columns)}

    monkeypatch.setattr(generate, "bench_random", fake_row)
    monkeypatch.setattr(generate, "format_row", lambda result: f"| {result['label']} |")
    assert generate.main(["--sizes", "tiny", "--batches", "1,2,3", "--out", str(tmp_path)]) == 0
    assert seen[0] is None and [r["label"] for r in seen[1]] == [generate.Row("tiny", 1, "float32", False).label]
    assert "RuntimeError: out of memory" in seen[2][1]["error"]
    rows = json.loads((tmp_path / "bench_generate.json").read_text())["rows"]
    assert len(rows) == 3 and "error" in rows[1] and rows[2]["label"].endswith("B=3 float32, random weights")


def _margins_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "beam_margins.py"
    spec = importlib.util.spec_from_file_location("beam_margins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_greedy_margins_follow_the_bench_s_own_greedy_loop_and_name_where_two_columns_part(tmp_path):
    import json
    from types import SimpleNamespace

    margins_script = _margins_script()
    steps = 5
    tokens, margins = margins_script.greedy_search("tiny", 2, steps)
    session, _, first, cache, fixed, _ = margins_script.row_setup("tiny", 2, "float32")
    assert tokens == generate.host_greedy(session, first, cache, fixed, steps, [])
    assert len(margins) == steps and margins[0] == [float("inf")] * 2
    assert all(0 <= m < float("inf") for step in margins[1:] for m in step)

    other = [list(tokens[0]), tokens[1][:3] + [tokens[1][3] + 1] + tokens[1][4:]]  # entry 1 parts at token 3
    path = tmp_path / "bench_generate.json"
    label = generate.Row("tiny", 2).label
    path.write_text(json.dumps({"rows": [{"label": label, "greedy_answers": {
        "stock_iobinding": tokens, "static_greedy": other}}]}))  # fmt: skip
    args = SimpleNamespace(json=str(path), size="tiny", batch=2, dtype="float32", greedy=True)
    found = margins_script.partings(args, tokens)
    assert (0, "stock_iobinding vs static_greedy", None) in found
    assert (1, "stock_iobinding vs static_greedy", 3) in found and (1, "cpu vs static_greedy", 3) in found
    assert (1, "cpu vs stock_iobinding", None) in found
    args.batch = 3
    with pytest.raises(SystemExit, match="no row"):
        margins_script.partings(args, tokens)


def test_shared_cross_kv_both_runs_each_row_both_ways_and_says_so_in_the_label(monkeypatch):
    """--shared-cross-kv both: each (size, batch) row twice, the static beam rewrite without and with static_cache's
    rule SHARED_CROSS_KV, the label naming the second."""
    seen = []
    monkeypatch.setattr(generate, "bench_random",
                        lambda row, *args, **options: seen.append(row) or {"label": row.label})  # fmt: skip
    monkeypatch.setattr(generate, "format_row", lambda result: f"| {result['label']} |")
    assert generate.main(["--sizes", "tiny", "--batches", "1", "--shared-cross-kv", "both"]) == 0
    assert [row.shared_cross_kv for row in seen] == [False, True]
    assert seen[1].label == seen[0].label + ", static beam's cross K/V one row per entry"
