"""grade: scores per check, one row per problem, and submissions are never modified."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from labsupport.__main__ import main
from labsupport.grade import CSV_HEADER, Row, expand, expected_checks, format_table, grade_notebook

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
    _notebook(folder / "erin.ipynb", SETUP, IMPORT_CHECK, "import time\ntime.sleep(120)", "check_vector_add(None)")
    return folder


@pytest.fixture(scope="module")
def graded(submissions, tmp_path_factory):
    before = {p.name: p.read_bytes() for p in submissions.iterdir()}
    out = tmp_path_factory.mktemp("out") / "grades.csv"
    paths = [str(submissions), str(submissions / "missing.ipynb")]
    # 20 s per cell: ample for the setup cell on a loaded 2-core CI machine, short for erin's sleep
    code = main(["grade", *paths, "--csv", str(out), "--timeout", "20", "--jobs", "2"])
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
    assert "case [n=1000" in bob["detail"] and "x - y is computed instead of x + y" in bob["detail"]


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
    assert [(r.check, r.points, r.status) for r in fresh] == [("check_vector_add", 0, "not done")]
    assert "NotImplementedError" in fresh[0].detail


def _without_check_cells(nb):
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and c.source.startswith("check_"))]
    return nb


def test_a_deleted_check_call_still_counts_against_the_notebook(tmp_path):
    """The lab's source says which checks it has, so deleting a check cell cannot shrink the total."""
    nb = _without_check_cells(nbformat.read(str(ROOT / "solutions" / "00_first_kernel.ipynb"), as_version=4))
    nb.cells = nb.cells[:4]  # setup, imports and prose: no kernel run, so this is quick
    nbformat.write(nb, str(tmp_path / "tidy.ipynb"))
    rows = grade_notebook(tmp_path / "tidy.ipynb")
    assert [(r.check, r.points, r.max_points, r.status) for r in rows] == [("check_vector_add", 0, 10, "not run")]
    assert "does not call check_vector_add" in rows[0].detail


def test_the_lab_is_found_from_the_file_name_when_metadata_is_gone(tmp_path):
    nb = _without_check_cells(nbformat.read(str(ROOT / "labs" / "00_first_kernel.ipynb"), as_version=4))
    nb.metadata.pop("labsupport")
    path = tmp_path / "alice_00_first_kernel.ipynb"
    assert expected_checks(nb, path) == (["check_vector_add"], {"check_vector_add"})
    assert expected_checks(nb, tmp_path / "unrelated.ipynb") == ([], set())


def test_the_table_groups_checks_under_each_notebook_with_totals():
    rows = [
        Row("a.ipynb", "check_x", 5, 5, "passed"),
        Row("a.ipynb", "check_y", 0, 10, "failed", "case [n=3]: the output is wrong " + "x" * 200),
        Row("b.ipynb", "check_x", 0, 5, "not done", "the exercise still raises NotImplementedError"),
        Row("c.ipynb", "-", 0, 0, "missing", "c.ipynb: no such file"),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0] == "a.ipynb  5/15"
    assert lines[1].split() == ["check_x", "5/5", "passed"]
    assert lines[2].startswith("    check_y") and lines[2].endswith("...") and len(lines[2]) < 140
    assert "b.ipynb  0/5" in lines and any("not done: the exercise" in line for line in lines)
    assert lines[-1] == "3 notebook(s), 0 with full marks; checks: 1 passed, 1 failed, 1 not done, 1 missing"


def test_csv_is_checked_before_any_notebook_runs(tmp_path, monkeypatch, capsys):
    import labsupport.grade

    monkeypatch.setattr(labsupport.grade, "grade_all", lambda *a, **k: pytest.fail("graded before checking --csv"))
    (tmp_path / "notes.csv").write_text("name,mark\n")
    _notebook(tmp_path / "x.ipynb", "print(1)")
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(tmp_path / "notes.csv")]) == 2
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(tmp_path)]) == 2
    assert "not a grades file" in capsys.readouterr().err


def test_the_same_notebook_named_twice_is_graded_once(tmp_path):
    _notebook(tmp_path / "a.ipynb", "1")
    assert expand([str(tmp_path), str(tmp_path / "a.ipynb")]) == [tmp_path / "a.ipynb"]


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
