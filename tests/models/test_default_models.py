"""The shipped default models: they load, MANIFEST.json matches the ONNX graphs, and the plugin (reference
backend) claims every MHA node and matches stock ORT on the manifest's feeds."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest

from mha_ep.models import manifest

ort = pytest.importorskip("onnxruntime")

ENTRIES = manifest.entries()
FILES = sorted(ENTRIES)
# plugin vs stock ORT: fp32 at the CPU kernel's rounding level; fp16 models run in fp32 inside both and are
# rounded once at the end, so they agree to an fp16 ulp of the outputs.
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}


def _io(values):
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        out.append((v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape))
    return out


def test_manifest_lists_every_shipped_model():
    shipped = sorted(p.name for p in manifest.DEFAULT_DIR.glob("*.onnx"))
    assert shipped == FILES
    families = {(e["family"], e["dtype"]) for e in ENTRIES.values()}
    assert {("bert", "fp32"), ("bert", "fp16"), ("whisper", "fp32")} <= families
    parts = {e["part"] for e in ENTRIES.values() if e["family"] == "whisper"}
    assert parts == {"encoder", "decoder_init", "decoder"}
    assert {e.get("mask_variant") for e in ENTRIES.values() if e["family"] == "bert"} == {"1d", "2d"}
    assert sum(e["bytes"] for e in ENTRIES.values()) < 10e6


@pytest.mark.parametrize("name", FILES)
def test_manifest_matches_model(name):
    entry = ENTRIES[name]
    path = manifest.model_path(entry)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    assert path.stat().st_size == entry["bytes"]
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert _io(model.graph.input) == [(i["name"], i["dtype"], i["shape"]) for i in entry["inputs"]]
    assert _io(model.graph.output) == [(o["name"], o["dtype"], o["shape"]) for o in entry["outputs"]]
    mha = [n for n in model.graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(mha) == entry["mha_nodes"] > 0
    assert len(attention) == entry["attention_nodes"] == 0
    for i in entry["inputs"]:
        assert i.get("role") and i.get("meaning"), f"{name}: input {i['name']} has no role/meaning"
    assert entry["command"].startswith("python -m mha_ep.models.build")
    for d in (s for i in entry["inputs"] for s in i["shape"] if isinstance(s, str)):
        assert d in entry["dims"], f"{name}: symbolic dim {d} has no entry in 'dims'"


def test_mha_counts_per_model():
    counts = {e["part"] + ("_" + e["mask_variant"] if "mask_variant" in e else ""): e["mha_nodes"]
              for e in ENTRIES.values()}
    # 2-layer models: BERT one MHA per layer; Whisper encoder 1 per layer (lifted), decoders 2 per layer
    assert counts == {"encoder_1d": 2, "encoder_2d": 2, "encoder": 2, "decoder_init": 4, "decoder": 4}


def _stock(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("name", FILES)
def test_shipped_model_runs_on_stock_ort_with_manifest_feeds(name):
    entry = ENTRIES[name]
    outs = _stock(manifest.model_path(entry), manifest.make_feeds(entry, seed=0))
    assert len(outs) == len(entry["outputs"])
    for o in outs:
        assert np.isfinite(o.astype(np.float32)).all()


def test_padding_is_honoured_by_the_1d_and_2d_bert_models():
    """Changing the ids of padded positions must not change any real token's output."""
    for name in ("bert_random_mask1d_fp32.onnx", "bert_random_mask2d_fp32.onnx"):
        entry = ENTRIES[name]
        feeds = manifest.make_feeds(entry, dims={"batch": 4, "sequence": 12}, seed=3)
        mask = feeds["attention_mask"].astype(bool)
        assert not mask.all()
        other = dict(feeds, input_ids=np.where(mask, feeds["input_ids"], 7))
        a, b = _stock(manifest.model_path(entry), feeds)[0], _stock(manifest.model_path(entry), other)[0]
        np.testing.assert_allclose(a[mask], b[mask], rtol=0, atol=1e-6)


def test_whisper_parts_chain_with_cache():
    """encoder -> first step -> one step with past, on stock ORT, using the manifest's names."""
    e = {ENTRIES[f]["part"]: ENTRIES[f] for f in FILES if ENTRIES[f]["family"] == "whisper" and ENTRIES[f]["dtype"] == "fp32"}
    feats = manifest.make_feeds(e["encoder"], seed=0)
    (states,) = _stock(manifest.model_path(e["encoder"]), feats)
    start = e["decoder_init"]["config"]["decoder_start_token_id"]
    ids = np.full((states.shape[0], 1), start, np.int64)
    init = ort.InferenceSession(str(manifest.model_path(e["decoder_init"])), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in init.get_outputs()], init.run(None, {"input_ids": ids, "encoder_hidden_states": states})))
    dec = ort.InferenceSession(str(manifest.model_path(e["decoder"])), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": outs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)}
    for i in dec.get_inputs()[1:]:
        feeds[i.name] = outs[i.name.replace("past_", "present_")]
    step = dict(zip([o.name for o in dec.get_outputs()], dec.run(None, feeds)))
    assert step["present_key_self_0"].shape[2] == 2
    assert np.isfinite(step["logits"]).all()


# ------------------------------------------------------------------------------------------ plugin vs stock
mha_ep = pytest.importorskip("mha_ep")


@pytest.mark.parametrize("name", FILES)
def test_plugin_reference_backend_claims_all_and_matches_stock(name):
    entry = ENTRIES[name]
    path = manifest.model_path(entry)
    feeds = manifest.make_feeds(entry, seed=1)
    session = mha_ep.InferenceSession(str(path), backend="reference")
    decisions = session.decisions
    declined = [(d.node_name, d.reason) for d in decisions if not d.claimed]
    assert not declined
    assert sum(d.claimed for d in decisions) == entry["mha_nodes"]
    got = session.run(None, feeds)
    want = _stock(path, feeds)
    tol = TOLERANCE[entry["dtype"]]
    for o, g, w in zip(entry["outputs"], got, want):
        err = float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
        scale = max(1.0, float(np.abs(w.astype(np.float64)).max()))
        assert err <= tol * scale, f"{name} output {o['name']}: max |plugin - stock| = {err:.3g} > {tol * scale:.3g}"
