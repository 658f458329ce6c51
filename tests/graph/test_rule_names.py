"""The graph passes name their rules (mha_ep/graph/partition.py, lift.py, static_cache.py), and a citation of one
cannot outlive it.

Each rule in a pass's module docstring (its "Rules ..." list, one ``  NAME: ...`` entry a rule) has a name: an
UPPER_CASE heading, or the function, class or method that is the whole rule. The repository cites a rule as
``rule NAME`` (``rules NAME and NAME``), never by its place in the list. Checked here: every name that is code is
in the pass's module; no two rules share a name; every citation in mha_ep/graph/ and tests/graph/, and every one
elsewhere that names its pass ("partition rule TRANSPORT", "the pass's rule SUBGRAPHS", "(graph/partition.py, rule
ALREADY_CLAIMED)"), is a rule that exists; and none of them is a number. The claim rules (mha_ep/claim/) and
cuda_io's keep their own scheme and are not read here.
"""

from __future__ import annotations

import importlib
import re

import pytest

from harness import REPO

PASSES = ("partition", "lift", "static_cache")
ENTRY = re.compile(r"^  ([A-Za-z_]\w*): ", re.M)
HEADING = re.compile(r"[A-Z][A-Z0-9_]*[A-Z0-9]")
NAME = r"(?:``|`)?[A-Za-z_]\w*(?:``|`)?"
AND = r",\s+|\s+and\s+|\s+or\s+"
RULES = rf"[Rr]ules?\s+({NAME}(?:(?:{AND}){NAME})*)"  # "rule NAME", "rules NAME, NAME and NAME", across a line break
# a pass named right before "rule": "partition rule", "the pass's rule", "(`mha_ep/graph/partition.py`, rule"
PASS = r"(?:partition|lift|static[-_ ]cache|the pass)(?:\.py)?(?:'s)?(?: pass(?:'s)?)?\W{0,3}"
CITATION, CITED_WITH_PASS = re.compile(r"\b" + RULES), re.compile(PASS + RULES)
NUMBER, NUMBER_WITH_PASS = re.compile(r"\b[Rr]ules?\s+\d"), re.compile(PASS + r"[Rr]ules?\s+\d")

OWN = [*sorted((REPO / "mha_ep" / "graph").glob("*.py")), *sorted((REPO / "tests" / "graph").glob("*.py"))]
ELSEWHERE = sorted(
    {*(REPO / "mha_ep").rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "scripts").rglob("*.py"),
     *(REPO / "examples").rglob("*.py"), *(REPO / "docs").rglob("*.md"), REPO / "README.md"} - set(OWN)
)  # fmt: skip


def rules_of(name: str):
    """The pass's module and its rules' names, in the docstring's order."""
    module = importlib.import_module(f"mha_ep.graph.{name}")
    doc = module.__doc__
    return module, ENTRY.findall(doc[doc.index("\nRules"):])


def is_code(module, name: str) -> bool:
    """Whether ``name`` is in the module, or is a method of a class the module defines."""
    classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
    return hasattr(module, name) or any(name in vars(c) for c in classes)


def all_rules() -> set:
    """Every graph pass's rule names, and NAME: the word the docstrings say "rule NAME" with."""
    return {rule for name in PASSES for rule in rules_of(name)[1]} | {"NAME"}


def matches(pattern: re.Pattern, path) -> list:
    """(line number, match) for each match of ``pattern`` in the file at ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m) for m in pattern.finditer(text)]


def cited(match: re.Match) -> list:
    """The rule names a ``rule NAME`` citation gives: UPPER_CASE headings and quoted code names; a plain lowercase
    word after "rule" is prose ("rule of", "rules and")."""
    found = []
    for token in re.split(AND, match.group(1)):
        bare = token.strip("`")
        if bare != token or HEADING.fullmatch(bare):
            found.append(bare)
    return found


@pytest.mark.parametrize("name", PASSES)
def test_each_rule_of_a_pass_has_a_name_that_exists(name):
    module, rules = rules_of(name)
    assert len(rules) >= 6, f"{name}.py's docstring lists {rules}: its rules, one '  NAME: ...' entry each"
    for rule in rules:
        assert HEADING.fullmatch(rule) or is_code(module, rule), (
            f"{name}.py's rule {rule!r} is neither an UPPER_CASE heading nor a function, class or method of the module"
        )


def test_no_two_rules_share_a_name():
    names = [rule for name in PASSES for rule in rules_of(name)[1]]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_citation_is_a_rule_that_exists():
    rules = all_rules()
    stale = []
    for path in OWN + ELSEWHERE:
        for number, match in matches(CITATION if path in OWN else CITED_WITH_PASS, path):
            stale += [f"{path.relative_to(REPO)}:{number}: rule {rule}" for rule in cited(match) if rule not in rules]
    assert not stale, "citations of rules no graph pass has:\n" + "\n".join(stale)


def test_no_rule_of_a_graph_pass_is_cited_by_number():
    numbered = []
    for path in OWN + ELSEWHERE:
        for number, match in matches(NUMBER if path in OWN else NUMBER_WITH_PASS, path):
            numbered.append(f"{path.relative_to(REPO)}:{number}: {' '.join(match.group(0).split())}")
    assert not numbered, "a graph pass's rule cited by number, not by name:\n" + "\n".join(numbered)
