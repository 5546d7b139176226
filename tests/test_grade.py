"""grade: scores per check, one row per problem, and submissions are never modified."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from labsupport.__main__ import main
from labsupport.grade import CSV_HEADER, expand, grade_notebook

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.notebook  # starts Jupyter kernels


def _notebook(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


SETUP = "import labsupport\nsettings = labsupport.setup()"
IMPORT_CHECK = "from labsupport.checks import check_vector_add"


@pytest.fixture(scope="module")
def submissions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    _notebook(folder / "alice.ipynb", SETUP, IMPORT_CHECK, "check_vector_add(lambda x, y: x + y)")
    _notebook(folder / "bob.ipynb", SETUP, IMPORT_CHECK, "check_vector_add(lambda x, y: x - y)", "print('after')")
    _notebook(
        folder / "carol.ipynb",
        "raise ModuleNotFoundError(\"No module named 'labsupport'\")  # stands for: import labsupport",
        "settings = labsupport.setup()",
        "check_vector_add(lambda x, y: x + y)",
    )
    (folder / "dave.ipynb").write_text("this is not json")
    _notebook(folder / "erin.ipynb", SETUP, IMPORT_CHECK, "import time\ntime.sleep(60)", "check_vector_add(None)")
    return folder


@pytest.fixture(scope="module")
def graded(submissions, tmp_path_factory):
    before = {p.name: p.read_bytes() for p in submissions.iterdir()}
    out = tmp_path_factory.mktemp("out") / "grades.csv"
    paths = [str(submissions), str(submissions / "missing.ipynb")]
    code = main(["grade", *paths, "--csv", str(out), "--timeout", "12"])
    after = {p.name: p.read_bytes() for p in submissions.iterdir()}
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    return code, rows, before, after


def _row(rows, name):
    return next(r for r in rows if r["notebook"].endswith(name))


def test_grading_goes_on_and_writes_csv(graded):
    code, rows, _, _ = graded
    assert code == 0
    assert len({r["notebook"] for r in rows}) == 6


def test_passing_and_failing_checks_are_scored(graded):
    _, rows, _, _ = graded
    alice, bob = _row(rows, "alice.ipynb"), _row(rows, "bob.ipynb")
    assert (alice["check"], alice["points"], alice["max_points"], alice["status"]) == ("check_vector_add", "10", "10", "passed")
    assert (bob["points"], bob["status"]) == ("0", "failed")
    assert "x - y" in bob["detail"] or "wrong" in bob["detail"]


def test_problems_are_reported_per_file(graded):
    _, rows, _, _ = graded
    carol = _row(rows, "carol.ipynb")
    assert carol["status"] == "setup failed" and "labsupport" in carol["detail"] and carol["points"] == "0"
    assert _row(rows, "dave.ipynb")["status"] == "not a notebook"
    assert _row(rows, "missing.ipynb")["status"] == "missing"
    erin = _row(rows, "erin.ipynb")
    assert erin["status"] == "timeout" and erin["points"] == "0"


def test_submissions_are_not_modified(graded):
    _, _, before, after = graded
    assert before == after


def test_solution_notebook_scores_full_marks_and_learner_notebook_zero(tmp_path):
    shutil.copy(ROOT / "solutions" / "00_first_kernel.ipynb", tmp_path / "solved.ipynb")
    shutil.copy(ROOT / "labs" / "00_first_kernel.ipynb", tmp_path / "fresh.ipynb")
    solved = grade_notebook(tmp_path / "solved.ipynb")
    fresh = grade_notebook(tmp_path / "fresh.ipynb")
    assert [(r.check, r.points, r.status) for r in solved] == [("check_vector_add", 10, "passed")]
    assert [(r.check, r.points, r.status) for r in fresh] == [("check_vector_add", 0, "failed")]
    assert "NotImplementedError" in fresh[0].detail


def test_csv_refuses_to_overwrite_a_foreign_file(tmp_path, capsys):
    precious = tmp_path / "grades.csv"
    precious.write_text("my own notes\n")
    _notebook(tmp_path / "x.ipynb", "print(1)")
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(precious)]) == 2
    assert precious.read_text() == "my own notes\n"
    assert "not a grades file" in capsys.readouterr().err


def test_expand_skips_checkpoints(tmp_path):
    (tmp_path / ".ipynb_checkpoints").mkdir()
    _notebook(tmp_path / ".ipynb_checkpoints" / "a-checkpoint.ipynb", "1")
    _notebook(tmp_path / "a.ipynb", "1")
    assert [p.name for p in expand([str(tmp_path)])] == ["a.ipynb"]
    assert CSV_HEADER[0] == "notebook"


def test_no_notebooks_found(tmp_path, capsys):
    assert main(["grade", str(tmp_path)]) == 2
    assert "no notebooks found" in capsys.readouterr().err
