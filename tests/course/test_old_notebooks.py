"""Notebooks released before the package was reorganised still grade exactly as they did.

The fixtures in ``old_notebooks/`` are learner notebooks as ``release`` wrote them at commit 2fc2407
(``git show 2fc2407:labs/06_kv_cache.ipynb``), with exercises filled in from that commit's solution
notebooks, as a learner would hand them in: lab 06 fully solved, lab 05 with its second exercise
left undone. They use the names of that time: ``from labsupport.model import Transformer``,
``max_concurrency(..., weight_bytes=2, ...)``, ``decode_step_bytes(..., weight_bytes=...)``.

The expected rows are what the grader of commit 2fc2407 gave for them (the same CSV, byte for byte,
when this test was written), except where a check was deliberately hardened since (CHANGELOG): lab 05's
prefill count now uses the query width n_heads * head_dim, and Qwen3-0.6B (2,048 wide queries on a
1,024 model width) fails the old spec's d_model count (issue 26).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from labsupport.course.grade import grade_notebook
from labsupport.course.notebooks import execute, load

HERE = Path(__file__).resolve().parent / "old_notebooks"
pytestmark = pytest.mark.notebook  # starts Jupyter kernels

# (check, points, max_points, status) per notebook, as graded by the grader of commit 2fc2407
BEFORE = {
    "alice_06_kv_cache.ipynb": [
        ("check_kv_bytes_per_token", 5.0, 5.0, "passed"),
        ("check_max_concurrency", 5.0, 5.0, "passed"),
    ],
    "alice_05_phases.ipynb": [
        ("check_prefill_flops", 0.0, 5.0, "failed"),  # 5.0 "passed" before issue 26's query width
        ("check_decode_bytes", 0.0, 5.0, "not done"),
    ],
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_a_notebook_released_before_the_move_grades_as_before(name, tmp_path):
    path = tmp_path / name
    shutil.copy(HERE / name, path)
    rows = grade_notebook(path, timeout=300)
    assert [(r.check, r.points, r.max_points, r.status) for r in rows] == BEFORE[name]
    assert {(r.student, r.lab, r.flags) for r in rows} == {("alice", name[len("alice_"):-len(".ipynb")], "")}
    failed = [r for r in rows if r.status == "failed"]
    assert all("instead of the query width" in r.detail and "released before" in r.detail for r in failed)
    not_done = [r for r in rows if r.status == "not done"]
    assert all(r.detail == "the exercise still raises NotImplementedError" for r in not_done)
    assert (HERE / name).read_bytes() == path.read_bytes()  # the submission is never modified


def test_an_old_solved_notebook_runs_every_cell_without_an_error():
    """Not only the checks: every old name the notebook uses (labsupport.model, weight_bytes=) still works."""
    run = execute(load(HERE / "alice_06_kv_cache.ipynb"), timeout=300, stop_on_error=False, quiet=True)
    assert run.ok, [(e.first_line, e.ename, e.evalue) for e in run.errors]
    sources = "\n".join(c.source for c in run.notebook.cells)
    assert "from labsupport.model import Transformer" in sources and "weight_bytes=" in sources
