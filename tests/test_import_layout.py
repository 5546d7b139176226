"""The package's import arrows: no module imports one that imports it back, counting packages.

Importing ``labsupport.checks.framework`` runs ``labsupport/checks/__init__.py`` first, which
imports every lab's check module; so a module that the checks import, and that imports anything
under ``checks/`` itself, closes a loop even where no two files name each other. The graph here
counts that arrow (a module to each subpackage above what it imports), reads module-level and
in-function imports alike, and must have no cycle. The package's root ``__init__`` is left out: it
runs before any module of the package, whoever imports what.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "labsupport"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``module`` imports, with every subpackage whose ``__init__`` that runs.

    A package ``__init__`` that walks ``pkgutil.iter_modules(__path__)`` (as ``checks/`` does, to
    re-export every lab's checks) imports each module beside it.
    """
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    source = path.read_text(encoding="utf-8")
    found: set[str] = set()
    if is_package and "iter_modules(__path__)" in source:
        found |= {m for m in modules if m.rpartition(".")[0] == module}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [stem, *(f"{stem}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            while target and target != PACKAGE:  # the module and each package __init__ above it runs
                found.add(target)
                target = target.rpartition(".")[0]
    return {t for t in found if t != module and not module.startswith(t + ".")}


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    return {m: _imported(m, p, set(files)) for m, p in files.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of arrows in ``graph`` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back_counting_package_inits():
    loop = cycle(import_graph())
    assert loop is None, "import cycle: " + " -> ".join(loop)


@pytest.mark.parametrize("edges, loops", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
])
def test_the_cycle_finder_finds_a_loop_only_where_there_is_one(edges, loops):
    assert (cycle(edges) is not None) == loops


def test_the_graph_counts_the_arrow_into_a_subpackage_init():
    graph = import_graph()
    assert "labsupport.checks" in graph["labsupport.course.grade"]  # grade imports checks.framework
    assert "labsupport.checks.lab13_decode_loop" in graph["labsupport.checks"]
