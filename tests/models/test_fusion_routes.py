"""Every row of docs/MODELS.md's fusion table: a tiny random-weight model of the family, exported and fused by
the row's route, gives the row's count of claimed nodes (mha_ep/models/families.py). Needs the models extra
(torch, transformers, onnxscript); skips without it."""

from __future__ import annotations

import pytest

from mha_ep.comparison import Verdict
from mha_ep.models import families

for module in ("torch", "transformers", "onnxscript"):
    pytest.importorskip(module, reason=f"the fusion-route tests build models with the models extra ({module})")


def row_id(route) -> str:
    return f"{route.family}-{route.route}-{route.model_type or 'lift'}".replace(" ", "_").replace(",", "")


@pytest.mark.parametrize("route", families.ROUTES, ids=row_id)
def test_the_route_claims_the_tables_count(route):
    fused = families.fused_model(route)
    assert families.claimed_count(fused, route) == route.claimed, route


def route_of(family: str, flags: str):
    return next(r for r in families.ROUTES if r.family == family and r.flags == flags)


def test_compare_reference_names_the_bert_fusion_of_a_bart_decoder_as_the_change():
    """ORT's BERT fusion turns BART's decoder self-attention into a MultiHeadAttention without `unidirectional`:
    mha_ep agrees with stock ORT on the fused graph, and only the reference shows the fusion changed the math."""
    import mha_ep

    exported, fused = families.exported_and_fused(route_of("BART encoder-decoder", families.BERT))
    without = mha_ep.compare(fused, backend="reference")
    assert without.verdict is Verdict.PASS, without.text()
    report = mha_ep.compare(fused, backend="reference", reference=exported)
    assert report.verdict is Verdict.FUSION_CHANGED, report.text()
    assert "mha_ep matches stock ORT on the fused model there" in report.reason


@pytest.mark.parametrize("family, dims", [("BERT", {}), ("Wav2Vec2, masked", {"samples": 400}), ("BART encoder", {})])
def test_compare_reference_passes_a_faithful_fusion(family, dims):
    import mha_ep

    exported, fused = families.exported_and_fused(route_of(family, families.BERT))
    report = mha_ep.compare(fused, backend="reference", reference=exported, dims=dims)
    assert report.verdict is Verdict.PASS, report.text()
    assert report.fusion and all(c.passed for c in report.fusion)
