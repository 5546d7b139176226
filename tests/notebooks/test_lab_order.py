"""Run All in a learner notebook stops at the first unfinished exercise, so every lab puts the
measurements that need none of the learner's code before its first check, and says so at the top.

Static checks on the released learner notebooks (nothing is executed here; test_notebooks.py runs
them)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted((ROOT / "labs").glob("[0-9]*.ipynb"))
# What counts as a measurement: a timing or a memory measurement of the device.
MEASUREMENT = re.compile(
    r"\b(benchmark|timed_stream|measure_matmul|measure_copy|measure_prefill|measure_decode|peak_bytes"
    r"|profile_step|time_step|run_benchmark|profile_decode_step|time_all_reduce|time_decode_step|run_stack)\("
)


def _cells(path):
    return nbformat.read(str(path), as_version=4).cells


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_opening_explains_run_all(path):
    opening = next(c.source for c in _cells(path) if c.cell_type == "markdown")
    assert "Run All" in opening and "stops at the first" in opening, (
        f"{path.name}: the first markdown cell should tell learners how Run All behaves"
    )


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_a_measurement_runs_before_the_first_exercise_check(path):
    cells = _cells(path)
    code = [(i, c.source) for i, c in enumerate(cells) if c.cell_type == "code"]
    first_stub = next(i for i, src in code if "raise NotImplementedError" in src)
    first_check = next(i for i, src in code if i > first_stub and re.search(r"^check_\w+\(", src, re.M))
    before = [src for i, src in code if i < first_check]
    assert any(MEASUREMENT.search(src) for src in before), (
        f"{path.name}: no measurement runs before the first check (cell {first_check}); Run All on a "
        f"fresh notebook would measure nothing"
    )
    # and none of those measurements calls a function the learner has not written yet
    stubs = {m.group(1) for i, src in code if i >= first_stub for m in re.finditer(r"^def (\w+)\(", src, re.M)}
    for src in before:
        for call in MEASUREMENT.finditer(src):
            line = src[call.start() : src.find("\n", call.start())]
            assert not any(re.search(rf"\b{name}\b", line) for name in stubs), (
                f"{path.name}: a measurement before the first check uses an exercise: {line.strip()}"
            )


def _defined(source: str) -> set[str]:
    """The names a cell defines at its top level (functions, classes, assignments)."""
    import ast

    from labsupport.course.scan import python_source

    names = set()
    for node in ast.parse(python_source(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_the_first_cell_that_uses_an_exercise_is_its_check(path):
    """Run All stops at the first cell that fails. Once a learner has written the exercises before
    one, that cell must be the next exercise's check (a short 'still raises NotImplementedError'),
    not a cell that calls the unwritten function and fails with a long traceback."""
    from labsupport.course.scan import check_calls

    code = [(i, c.source) for i, c in enumerate(_cells(path)) if c.cell_type == "code"]
    for n, (i, source) in enumerate(code):
        if "raise NotImplementedError" not in source or not _defined(source):
            continue  # not an exercise, or one that raises at the top level (Run All stops on it)
        names = _defined(source)
        users = [(j, s) for j, s in code[n + 1:] if any(re.search(rf"\b{re.escape(x)}\b", s) for x in names)]
        assert users, f"{path.name}: nothing uses the exercise in cell {i} ({sorted(names)})"
        j, first = users[0]
        assert check_calls(first), (
            f"{path.name}: cell {j} uses the exercise of cell {i} before any check does:\n{first[:300]}")
