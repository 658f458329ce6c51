"""docs/MODELS.md's fusion table. Every row: a tiny random-weight model of the family, exported with the row's
attention and fused by the row's route, gives the row's count of claimed nodes and compare --reference's verdict
on the fusion (mha_ep/models/families.py). Needs the models extra (torch, transformers, onnxscript); skips
without it."""

from __future__ import annotations

import pytest

from mha_ep.comparison import Verdict
from mha_ep.models import families

for module in ("torch", "transformers", "onnxscript"):
    pytest.importorskip(module, reason=f"the fusion-route tests build models with the models extra ({module})")


def row_id(route) -> str:
    flags = route.flags.split()[1] if route.flags else "lift"
    return f"{route.family}-{route.route}-{route.attention}-{flags}".replace(" ", "_").replace(",", "")


@pytest.fixture(scope="session")
def built():
    """Each row's exported and fused model, built once for every test that needs it."""
    cache = {}

    def get(route) -> families.Built:
        if route not in cache:
            cache[route] = families.build(route)
        return cache[route]

    return get


@pytest.mark.parametrize("route", families.ROUTES, ids=row_id)
def test_the_route_gives_the_tables_row(route, built):
    got = families.measure(route, built(route))
    assert (got.claimed, got.faithful) == (route.claimed, route.faithful), (route, got, got.report)
    assert got.error_matches(route), f"the fusion's error is {got.error:.1e}, the table's {route.error:.1e}: {route}"


def test_every_family_is_measured_by_both_routes_with_each_attention_it_has():
    measured = {(r.family, r.route, r.attention) for r in families.ROUTES}
    for family in families.EXAMPLES:
        attentions = ("eager",) if family in families.NO_SDPA else families.ATTENTIONS
        for route in ("torchscript", "dynamo"):
            for attention in attentions:
                assert (family, route, attention) in measured, (family, route, attention)
    assert {r.family for r in families.ROUTES} == set(families.EXAMPLES)


@pytest.mark.parametrize("family", sorted(families.NO_SDPA))
def test_a_family_without_sdpa_rows_is_one_transformers_refuses_sdpa_for(family):
    """When transformers adds sdpa to the family, this fails: measure its sdpa rows and add them to the table."""
    import transformers

    assert getattr(transformers, families.NO_SDPA[family])._supports_sdpa is False  # noqa: SLF001
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        families.EXAMPLES[family]("sdpa")


def route_of(family: str, flags: str, attention: str = "eager"):
    return next(r for r in families.ROUTES if (r.family, r.flags, r.attention) == (family, flags, attention))


def test_compare_reference_names_the_bert_fusion_of_a_bart_decoder_as_the_change(built):
    """ORT's BERT fusion turns BART's decoder self-attention into a MultiHeadAttention without `unidirectional`:
    mha_ep agrees with stock ORT on the fused graph, and only the reference shows the fusion changed the math."""
    import mha_ep

    model = built(route_of("BART encoder-decoder", families.BERT))
    without = mha_ep.compare(model.fused, backend="reference")
    assert without.verdict is Verdict.PASS, without.text()
    report = mha_ep.compare(model.fused, backend="reference", reference=model.exported)
    assert report.verdict is Verdict.FUSION_CHANGED, report.text()
    assert "mha_ep matches stock ORT on the fused model there" in report.reason


def test_the_optimizer_arguments_are_the_docs_command_filled_in():
    arguments = families.optimizer_arguments(families.BART, 4, 64, "in.onnx", "out.onnx")
    assert arguments == ["--input", "in.onnx", "--output", "out.onnx", "--num_heads", "4", "--hidden_size", "64",
                         "--model_type", "bart", "--opt_level", "1", "--use_multi_head_attention"]  # fmt: skip
