"""docs/MODELS.md's fusion table and commands. Every row: a tiny random-weight model of the family, exported with
the row's attention and fused by the row's route, gives the row's count of claimed nodes and compare --reference's
verdict on the fusion (mha_ep/models/families.py). The doc's commands: run as printed, in a shell, with the
cells of the table. Needs the models extra (torch, transformers, onnxscript); skips without it."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from mha_ep.comparison import Verdict
from mha_ep.models import families

from harness import REPO

for module in ("torch", "transformers", "onnxscript"):
    pytest.importorskip(module, reason=f"the fusion-route tests build models with the models extra ({module})")

MODELS_MD = REPO / "docs" / "MODELS.md"


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


# ------------------------------------------------------------------------------------------ the doc's commands
def code_blocks(language: str) -> list:
    """The fenced blocks of docs/MODELS.md in ``language``, dedented (they sit in list items)."""
    text = MODELS_MD.read_text()
    return [textwrap.dedent(b) for b in re.findall(rf"^ *```{language}\n(.*?)^ *```", text, re.S | re.M)]


def commands(block: str) -> list:
    """A shell block's commands, one per line once the backslash continuations are joined."""
    return [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def doc_rows() -> list:
    """The table of docs/MODELS.md's section "The table" (up to the next section): each row's cells by the header's
    names."""
    section = MODELS_MD.read_text().split("## The table", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| ")]
    header, rows = rows[0], rows[1:]
    assert tuple(header) == families.HEADER, header
    return [dict(zip(header, row)) for row in rows]


def route_of_row(row: dict):
    """The first route of a table row (eager where it says "eager, sdpa")."""
    route = {v: k for k, v in families.ROUTE_NAMES.items()}[row["export"]]
    flags = row["FLAGS (ORT optimizer)"].strip("`")
    attention = row["attention"].split(",")[0]
    return next(r for r in families.ROUTES
                if (r.family, r.route, r.attention, r.flags) == (row["family"], route, attention, flags))  # fmt: skip


def shell_variables(route, row: dict) -> dict:
    heads, hidden = families.heads_and_hidden(route.family)
    return {"HEADS": str(heads), "HIDDEN": str(hidden), "FLAGS": row["FLAGS (ORT optimizer)"].strip("`"),
            "MHA_EP_FLAGS": row["MHA_EP_FLAGS (mha-ep compare)"].strip("`")}  # fmt: skip


def one_row_per_command(route_name: str) -> list:
    """The route's rows that fill its commands differently or give another verdict: the first of each."""
    chosen, seen = [], set()
    for row in doc_rows():
        route = route_of_row(row)
        keys = {(row["FLAGS (ORT optimizer)"], row["MHA_EP_FLAGS (mha-ep compare)"]), route.verdict_exit}
        if route.route == route_name and not keys <= seen:
            chosen.append(row)
            seen |= keys
    return chosen


def environment(variables: dict) -> dict:
    """The shell of a person who installed mha_ep: this Python first on PATH, this checkout importable."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PATH=path, PYTHONPATH=python_path, **variables)


def run_shell(command: str, cwd: Path, variables: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(variables), capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def check_compare(done: subprocess.CompletedProcess, route) -> None:
    claimed = re.search(r"MultiHeadAttention node\(s\), (\d+) claimed", done.stdout)
    assert done.returncode == route.verdict_exit, (route, done.stdout[-3000:], done.stderr[-3000:])
    assert int(claimed.group(1) if claimed else 0) == route.claimed, (route, done.stdout[-3000:])


@pytest.fixture(scope="module")
def mha_ep_command():
    if shutil.which("mha-ep", path=environment({})["PATH"]) is None:
        pytest.skip("the mha-ep command is not installed (pip install -e .)")


def test_the_doc_has_the_commands_the_tests_run():
    torchscript, dynamo = code_blocks("bash")
    assert commands(torchscript) == [families.OPTIMIZER_COMMAND,
                                     "mha-ep compare model_mha.onnx --reference model.onnx $MHA_EP_FLAGS"]  # fmt: skip
    assert commands(dynamo) == ["mha-ep compare model_attention.onnx --reference model.onnx $MHA_EP_FLAGS"]
    assert len(code_blocks("python")) == 1


@pytest.mark.parametrize("row", one_row_per_command("torchscript"), ids=lambda row: row_id(route_of_row(row)))
def test_the_torchscript_commands_run_as_written(row, built, tmp_path, mha_ep_command):
    """The optimizer's command line and compare's, with the row's cells for FLAGS and MHA_EP_FLAGS."""
    route = route_of_row(row)
    onnx.save(built(route).exported, str(tmp_path / "model.onnx"))
    optimizer, compare = commands(code_blocks("bash")[0])
    done = run_shell(optimizer, tmp_path, shell_variables(route, row))
    assert done.returncode == 0 and (tmp_path / "model_mha.onnx").is_file(), done.stderr[-3000:]
    check_compare(run_shell(compare, tmp_path, shell_variables(route, row)), route)


@pytest.mark.parametrize("row", one_row_per_command("dynamo"), ids=lambda row: row_id(route_of_row(row)))
def test_the_dynamo_compare_command_runs_as_written(row, built, tmp_path, mha_ep_command):
    route = route_of_row(row)
    onnx.save(built(route).exported, str(tmp_path / "model.onnx"))
    onnx.save(built(route).fused, str(tmp_path / "model_attention.onnx"))
    (compare,) = commands(code_blocks("bash")[1])
    check_compare(run_shell(compare, tmp_path, shell_variables(route, row)), route)


def test_the_dynamo_snippet_runs_as_written(tmp_path, mha_ep_command):
    """The Python snippet on a tiny BERT saved as a transformers folder, then compare's command: BERT's row."""
    import transformers

    folder = tmp_path / "tiny-bert"
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    (snippet,) = code_blocks("python")
    done = subprocess.run([sys.executable, "-c", f"folder = {str(folder)!r}\n" + snippet], cwd=tmp_path,
                          env=environment({}), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    route = route_of("BERT", "", "sdpa")  # the snippet's attention
    row = next(r for r in doc_rows() if (r["family"], r["export"]) == ("BERT", families.ROUTE_NAMES["dynamo"]))
    assert "sdpa" in row["attention"], row
    (compare,) = commands(code_blocks("bash")[1])
    check_compare(run_shell(compare, tmp_path, shell_variables(route, row)), route)


def test_the_re_measure_command_runs_as_written(tmp_path):
    """The doc's ``python -m mha_ep.models.families --family ViT`` prints the lines the doc shows after it."""
    lines = [line.strip() for line in MODELS_MD.read_text().splitlines()]
    command = next(line for line in lines if line.startswith("python -m mha_ep.models.families --family"))
    shown = [line[2:] for line in itertools.takewhile(lambda line: line.startswith("# "), lines[lines.index(command) + 1:])]
    done = run_shell(command.split("#")[0], tmp_path, {})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in shown:
        assert line in done.stdout, (line, done.stdout)
