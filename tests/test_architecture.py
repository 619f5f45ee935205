"""The import graph of puma/: no module imports another that imports it back, and no layer imports a
higher one. The layer order is LAYERS below (docs/architecture.md draws it).

Every import of every module counts: ``import a.b`` and ``from a import b`` (relative too), at
module level, inside functions (a lazy import hides neither a loop nor an upstream import) and
under ``if TYPE_CHECKING``, and ``importlib.import_module("...")`` with a literal name.
``from a import b`` where ``a.b`` is a module is an import of ``a.b``, else of ``a``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "puma"

# Lowest first. A unit may import its own modules and any unit of a lower layer; units of one layer
# are independent of each other. A module belongs to the unit with the longest matching name.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("puma", "puma.errors"),  # the package root (library_versions); the family of user errors
    ("puma.storage", "puma.distributed", "puma.console"),  # foundations: URIs, ranks, the console
    ("puma.config", "puma.runtime", "puma.run_folder"),  # typed config; starting/joining Ray; a run's folder
    # building blocks; the jobs' figures for Prometheus
    ("puma.data", "puma.models", "puma.losses", "puma.optim", "puma.job_metrics"),
    ("puma.methods",),  # one record per method: composes models, losses, data (pseudo-labels)
    ("puma.checkpoint", "puma.cli"),  # rebuild a method's model; a job's config with its method's checks
    ("puma.index", "puma.export"),  # sharded FAISS: build, verify, search; ONNX export of a checkpoint
    ("puma.eval",),  # metrics; evaluation through an index
    ("puma.train", "puma.inference"),  # Ray Train runner; batch embedding and search
    ("puma.sweep", "puma.serve", "puma.report"),  # Ray Tune; the online search service; a run's report
)
# import_module with a computed name: where, and why it cannot reach outside its own package.
DYNAMIC_IMPORTS = {"puma.inference": "PEP 562 lazy exports of its own submodules (_EXPORTS)"}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module ('' when none is)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _base(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything ``module`` imports, at any depth of its source."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, module, path)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in modules else base), node.lineno
        elif _is_import_module(node) and isinstance(node.args[0], ast.Constant):
            yield str(node.args[0].value), node.lineno


def _is_import_module(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and node.args
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module")


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported puma module: first line}, self-imports left out."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name, line in imported_names(module, path, modules):
            target = _owner(name, modules) if name.split(".")[0] == PACKAGE else ""
            if target and target != module:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str]:
    """(layer, unit) of ``module``: the longest unit name that is the module or a package above it."""
    matches = [(len(u), i, u) for i, layer in enumerate(layers) for u in layer
               if module == u or module.startswith(u + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no layer; add its package to LAYERS in {__file__}")
    _, layer, unit = max(matches)
    return layer, unit


def layer_violations(graph: dict[str, dict[str, int]],
                     layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every import of a higher layer, or of another unit of the same layer, as a readable line."""
    out = []
    for module, edges in sorted(graph.items()):
        layer, unit = unit_of(module, layers)
        for target, line in sorted(edges.items()):
            target_layer, target_unit = unit_of(target, layers)
            if target_unit != unit and target_layer >= layer:
                how = "a higher layer" if target_layer > layer else "a sibling of its layer"
                out.append(f"{module} (line {line}, {unit}: layer {layer}) imports {target} "
                           f"({target_unit}: layer {target_layer}), {how}")
    return out


# ----------------------------------------------------------------------------- the tests


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_no_lower_layer_imports_a_higher_one():
    assert layer_violations(import_graph()) == []


def test_every_module_is_in_a_layer_and_every_layer_unit_exists():
    modules = module_files(ROOT)
    for module in modules:
        unit_of(module)
    units = [u for layer in LAYERS for u in layer]
    assert sorted(u for u in units if u not in modules) == []
    assert len(units) == len(set(units))


MAX_MODULE_LINES = 400  # a module that outgrows this does several jobs: split it by what each part owns


def test_no_module_is_over_its_line_budget():
    lines = {name: len(path.read_text().splitlines()) for name, path in module_files(ROOT).items()}
    assert {name: n for name, n in lines.items() if n > MAX_MODULE_LINES} == {}


def test_no_import_hides_in_a_computed_name_or_a_string():
    """import_module with a computed name only where listed; no "puma.x:function" targets in strings."""
    modules = module_files(ROOT)
    dotted = re.compile(rf"^{PACKAGE}(\.\w+)+:\w+$")
    dynamic, strings = set(), []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_import_module(node) and not isinstance(node.args[0], ast.Constant):
                dynamic.add(unit_of(module)[1])
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.match(node.value):
                strings.append(f"{module}: {node.value!r}")
    assert dynamic <= set(DYNAMIC_IMPORTS) and strings == []


# ----------------------------------------------------------------------------- the checker itself


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_lazy_relative_and_upward_imports(tmp_path):
    """A loop hidden in a function, a relative import, importlib with a literal: all seen."""
    root = write(tmp_path, {
        "puma/__init__.py": "",
        "puma/low.py": "def f():\n    from puma.high import g\n",  # lazy and upward
        "puma/high.py": "from . import low\n",  # relative
        "puma/pkg/__init__.py": "from puma.pkg.a import x\n",
        "puma/pkg/a.py": "import importlib\nx = importlib.import_module('puma.pkg.b')\n",
        "puma/pkg/b.py": "from puma.pkg import a\n",  # a submodule: not the package __init__
    })
    graph = import_graph(root)
    assert graph["puma.low"] == {"puma.high": 2} and graph["puma.high"] == {"puma.low": 1}
    assert graph["puma.pkg.a"] == {"puma.pkg.b": 2} and graph["puma.pkg.b"] == {"puma.pkg.a": 1}
    assert cycles(graph) == [["puma.high", "puma.low"], ["puma.pkg.a", "puma.pkg.b"]]
    layers = (("puma", "puma.low"), ("puma.pkg",), ("puma.high",))
    assert layer_violations(graph, layers) == [
        "puma.low (line 2, puma.low: layer 0) imports puma.high (puma.high: layer 2), a higher layer"]


@pytest.mark.parametrize("module, expected", [("puma.methods.vptsp_g", (4, "puma.methods")),
                                              ("puma.storage", (1, "puma.storage")),
                                              ("puma", (0, "puma"))])
def test_units_are_matched_by_their_longest_name(module, expected):
    assert unit_of(module) == expected
