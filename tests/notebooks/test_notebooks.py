"""Every lab notebook runs: solutions top to bottom, learner versions up to their first exercise.

Each cell has a timeout; a cell that runs past it fails the test (it is never reported as a pass).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labsupport.course.notebooks import execute

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9]*.ipynb"))
LABS = sorted((ROOT / "labs").glob("[0-9]*.ipynb"))
CELL_TIMEOUT = 240  # seconds; the slowest solution cell on a 2-core CPU is far below this

pytestmark = pytest.mark.notebook


def _describe(run) -> str:
    if run.timed_out:
        return f"cell {run.timed_out.index} timed out:\n{run.timed_out.source}"
    if run.died:
        return run.died
    e = run.errors[0]
    return f"cell {e.index} raised {e.ename}: {e.evalue}\n--- cell source ---\n{e.source}"


def test_there_are_labs():
    assert SOLUTIONS, "no solution notebooks found"
    assert [p.name for p in SOLUTIONS] == [p.name for p in LABS], "every solution needs a learner notebook"


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_notebook_runs_top_to_bottom(path):
    nb = nbformat.read(str(path), as_version=4)
    run = execute(nb, cwd=path.parent, timeout=CELL_TIMEOUT)
    assert run.ok, f"{path.name}: {_describe(run)}"
    passed = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "PASSED check_" in passed, f"{path.name}: no check printed a pass line"


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_learner_notebook_stops_at_first_exercise(path):
    nb = nbformat.read(str(path), as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    first_stub = next(i for i in code if "raise NotImplementedError" in nb.cells[i].source)
    first_check = next(i for i in code if i > first_stub and "check_" in nb.cells[i].source)
    run = execute(nb, cwd=path.parent, timeout=CELL_TIMEOUT)
    assert not run.timed_out and not run.died, _describe(run)
    assert run.errors, f"{path.name}: ran to the end although its exercises are not done"
    first = run.errors[0]
    assert first.index == first_check, (
        f"{path.name}: the first error is in cell {first.index}, expected the first check (cell "
        f"{first_check}): {first.ename}: {first.evalue}"
    )
    assert first.ename == "CheckFailed" and "NotImplementedError" in first.evalue, (
        f"{path.name}: the first check failed for another reason: {first.ename}: {first.evalue}"
    )
