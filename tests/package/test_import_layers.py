"""The package's layers: a module imports, at module level, only modules of its own layer or a lower one, and
the module-level imports have no circle. An import inside a function (lazy) may reach up; each such import is a
deliberate late binding (CuPy-only code, the CLI's subcommands) and is not checked here.

The layers, lowest first, are docs/ARCHITECTURE.md's "Layers" list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness import REPO

PACKAGE = REPO / "mha_ep"

# (layer, module prefixes), lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("base", ("mha_ep.spec", "mha_ep.limits", "mha_ep.launch", "mha_ep.dtypes", "mha_ep.errors", "mha_ep.progress",
              "mha_ep.shipped")),
    ("claim", ("mha_ep.claim",)),
    ("graph", ("mha_ep.model_io", "mha_ep.lift", "mha_ep.partition_result", "mha_ep.partition_pass",
               "mha_ep.static_cache")),
    ("compute", ("mha_ep.ops.problem", "mha_ep.ops.backends")),
    ("op", ("mha_ep.ops",)),
    ("routes", ("mha_ep.native", "mha_ep.device")),
    ("session", ("mha_ep.session",)),
    ("tools", ("mha_ep.comparison", "mha_ep.feeds", "mha_ep.demo", "mha_ep.environment", "mha_ep.models")),
    ("front", ("mha_ep.cli", "mha_ep.bench", "mha_ep.__main__", "mha_ep")),
)  # fmt: skip


def layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS and to docs/ARCHITECTURE.md"
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path) -> set[str]:
    """The mha_ep modules ``path`` imports when it is imported (not inside functions, not under TYPE_CHECKING)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "mha_ep")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "mha_ep":
                    continue
                for alias in node.names:  # `from mha_ep.ops import op` imports the module mha_ep.ops.op
                    candidate = f"{source}.{alias.name}"
                    is_module = (REPO / Path(*candidate.split("."))).with_suffix(".py").is_file() or (
                        REPO / Path(*candidate.split(".")) / "__init__.py"
                    ).is_file()
                    found.add(candidate if is_module else source)

    visit(ast.parse(path.read_text()).body)
    found.discard(module)
    return found


GRAPH = {module_name(path): module_level_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_module_imports_only_its_own_layer_or_lower(module):
    upward = [
        f"{target} ({LAYERS[layer_of(target)][0]})"
        for target in sorted(GRAPH[module])
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, f"{module} ({LAYERS[layer_of(module)][0]}) imports a higher layer at module level: {upward}"


def test_module_level_imports_have_no_circle():
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH or target.count(".") < 1:  # the package root is imported by everything's parent
                continue
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                walk(target)
        path.pop()
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            walk(module)


def test_the_layer_list_is_the_documented_one():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for name, prefixes in LAYERS:
        assert f"**{name}**" in text, f"docs/ARCHITECTURE.md's Layers list lacks the layer {name}"
        for prefix in prefixes:
            if prefix != "mha_ep":
                where = prefix.removeprefix("mha_ep.").replace(".", "/")
                assert f"`{where}" in text, f"docs/ARCHITECTURE.md's layer {name} does not name `{where}`"
