"""The package's layers, checked over every import statement in mha_ep, at module level and inside functions.

The rules (the layers, lowest first, are docs/ARCHITECTURE.md's "Layers" list):
  1. At module level (what runs when the module is imported) a module imports only modules of its own layer or a
     lower one.
  2. Inside a function (a lazy import: CuPy-heavy code, a subcommand's module, loaded on first use) the same
     holds, save the imports listed in REACHING_UP: each one a deliberate late binding, with its reason.
  3. Module-level and function-level imports together have no circle, at any depth.
Imports under ``if TYPE_CHECKING:`` never run and are not counted. ``importlib.import_module`` with a computed name
(bench/__init__.py's subcommands, within the front layer) cannot be read here and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness import REPO

PACKAGE = REPO / "mha_ep"

# (layer, module prefixes), lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("base", ("mha_ep.spec", "mha_ep.limits", "mha_ep.launch", "mha_ep.dtypes", "mha_ep.errors", "mha_ep.progress",
              "mha_ep.shipped", "mha_ep.providers")),
    ("claim", ("mha_ep.claim",)),
    ("graph", ("mha_ep.graph",)),
    ("engine", ("mha_ep.engine",)),
    ("python_op", ("mha_ep.python_op",)),
    ("native", ("mha_ep.native",)),
    ("routes", ("mha_ep.registration",)),
    ("gpu_session", ("mha_ep.gpu_session",)),
    ("session", ("mha_ep.session",)),
    ("decode", ("mha_ep.decode",)),
    ("tools", ("mha_ep.comparison", "mha_ep.feeds", "mha_ep.demo", "mha_ep.environment", "mha_ep.models",
               "mha_ep.serve")),
    ("front", ("mha_ep.cli", "mha_ep.bench", "mha_ep.__main__", "mha_ep")),
)  # fmt: skip

# Function-level imports of a higher layer, kept on purpose: (importer, imported module) -> why, in one line.
# Fix a reach-up (move what is imported down a layer, or pass it in) before listing it here.
REACHING_UP: dict = {}


def layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS and to docs/ARCHITECTURE.md"
    return best[0]


def describe(module: str) -> str:
    return f"{module} ({LAYERS[layer_of(module)][0]})"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


C_EXTENSIONS = {"mha_ep.native._native": "csrc"}  # setup.py's extension -> its sources' folder beside it


def is_module(name: str) -> bool:
    """A .py file, a package, or a C extension (native/_native: its sources, native/csrc/, count, built or not)."""
    where = REPO / Path(*name.split("."))
    if name in C_EXTENSIONS:
        return any((where.parent / C_EXTENSIONS[name]).glob("*.c"))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


class Imports(ast.NodeVisitor):
    """The mha_ep modules one file imports: ``eager`` at module level, ``lazy`` inside a function (name -> the
    line of its first import)."""

    def __init__(self, path: Path):
        self.module = module_name(path)
        self.package = self.module if path.name == "__init__.py" else self.module.rpartition(".")[0]
        self.eager: dict = {}
        self.lazy: dict = {}
        self.depth = 0  # functions around the node being visited
        self.visit(ast.parse(path.read_text()))
        for found in (self.eager, self.lazy):
            found.pop(self.module, None)
        for name in self.eager:  # a module imported at module level is imported, wherever else it is imported again
            self.lazy.pop(name, None)

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        if "TYPE_CHECKING" in ast.unparse(node.test):  # never runs
            for statement in node.orelse:
                self.visit(statement)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split(".")[0] == "mha_ep":
                self.add(alias.name, node)

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "mha_ep":
            return
        for alias in node.names:  # `from mha_ep.ops import op` imports the module mha_ep.python_op.op
            candidate = f"{source}.{alias.name}"
            self.add(candidate if is_module(candidate) else source, node)

    def add(self, name: str, node):
        (self.lazy if self.depth else self.eager).setdefault(name, node.lineno)


FILES = {module_name(path): Imports(path) for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {module: found.eager for module, found in FILES.items()}  # module-level imports
LAZY = {module: found.lazy for module, found in FILES.items()}  # function-level imports, beyond the module-level ones


def reaching_up(imports: dict) -> list:
    """(importer, imported, line) of every import of a higher layer in ``imports`` (GRAPH or LAZY)."""
    return [(module, target, line) for module, found in sorted(imports.items())
            for target, line in sorted(found.items()) if layer_of(target) > layer_of(module)]  # fmt: skip


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_module_imports_only_its_own_layer_or_lower(module):
    upward = [describe(target) for importer, target, _ in reaching_up({module: GRAPH[module]})]
    assert not upward, f"{describe(module)} imports a higher layer at module level: {upward}"


def test_a_function_level_import_of_a_higher_layer_is_listed_with_its_reason():
    unlisted = [f"{describe(importer)} -> {describe(target)} (line {line})"
                for importer, target, line in reaching_up(LAZY) if (importer, target) not in REACHING_UP]  # fmt: skip
    assert not unlisted, (
        "function-level imports of a higher layer: move what they import down a layer, or pass it in; if one is "
        "a deliberate late binding, list it in REACHING_UP with its reason:\n  " + "\n  ".join(unlisted)
    )


def test_every_listed_reach_up_still_exists_and_says_why():
    present = {(importer, target) for importer, target, _ in reaching_up(LAZY)}
    stale = [pair for pair in REACHING_UP if pair not in present]
    assert not stale, f"REACHING_UP lists imports that no longer reach up (remove them): {stale}"
    for pair, reason in REACHING_UP.items():
        assert isinstance(reason, str) and reason.strip() and "\n" not in reason, f"{pair}: give one line of reason"


def test_imports_have_no_circle_at_any_depth():
    edges = {module: {**LAZY[module], **GRAPH[module]} for module in GRAPH}
    state: dict = {}
    path: list = []
    circles: list = []

    def hop(source: str, target: str) -> str:
        return f"{target} (inside a function, line {LAZY[source][target]})" if target in LAZY[source] else target

    def walk(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if target not in edges:  # a C extension: it imports nothing of ours
                continue
            if state.get(target) == "open":
                circle = path[path.index(target):] + [target]
                circles.append(" -> ".join([circle[0]] + [hop(a, b) for a, b in zip(circle, circle[1:])]))
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            walk(module)
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


def test_the_scan_sees_function_level_imports():
    """The checks above rest on the scan: it must find a known lazy import and a known module-level one."""
    assert "mha_ep.engine.cuda.backend" in LAZY["mha_ep.engine.cuda"]  # CudaBackend, loaded on use
    assert "mha_ep.engine.cuda.steps" in GRAPH["mha_ep.engine.cuda.runner"]
    assert "mha_ep.native._native" in LAZY["mha_ep.native.host"]  # the C extension, by its source


def test_the_layer_list_is_the_documented_one():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for name, prefixes in LAYERS:
        assert f"**{name}**" in text, f"docs/ARCHITECTURE.md's Layers list lacks the layer {name}"
        for prefix in prefixes:
            if prefix != "mha_ep":
                where = prefix.removeprefix("mha_ep.").replace(".", "/")
                assert f"`{where}" in text, f"docs/ARCHITECTURE.md's layer {name} does not name `{where}`"
