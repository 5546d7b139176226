"""grade: a grader no submission can break. Each crasher is a notebook that gets its own row while
the others grade normally; the CSV is written atomically after every notebook and never replaces
last week's file unasked."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import nbformat
import pytest

import labsupport.course.grade
import labsupport.course.report
from labsupport.course.cli import main
from labsupport.course.grade import grade_all, guess_lab, student_name
from labsupport.course.manifest import load_manifest
from labsupport.course.notebooks import execute
from labsupport.course.report import CSV_HEADER, Row, format_table, write_csv
from labsupport.course.scan import check_calls, scan_flags

LABS = load_manifest()
SETUP = "import labsupport\nsettings = labsupport.setup()"
ROOFLINE = ("from labsupport.checks import check_arithmetic_intensity\n"
            "check_arithmetic_intensity(lambda m, k, n, b: 2 * m * k * n / (b * (m * k + k * n + m * n)))")
ROOFLINE_POINTS = sum(p for _, p in LABS["04_roofline"])


def _nb(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


def _write(path: Path, *cells: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(_nb(*cells), str(path))
    return path


def _rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _mine(rows, fragment):
    return [r for r in rows if fragment in r["notebook"]]


@pytest.mark.notebook
def test_crashers_get_their_own_rows_and_the_others_grade_normally(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "week 1"
    _write(folder / "ok_04_roofline.ipynb", SETUP, ROOFLINE)
    # an exception message with a lone surrogate, in a cell and inside the learner's function
    _write(folder / "sur_04_roofline.ipynb", SETUP, "raise ValueError('\\ud800')",
           "from labsupport.checks import check_arithmetic_intensity\n"
           "def f(m, k, n, b):\n    raise ValueError('\\udcff \\ud800')\ncheck_arithmetic_intensity(f)")
    _write(folder / "deep_04_roofline.ipynb", SETUP, "x = 1" + "+1" * 5000, ROOFLINE)  # RecursionError
    odd = Path(os.fsdecode(folder.as_posix().encode() + b"/caf\xe9_04_roofline.ipynb"))  # not UTF-8
    _write(odd, SETUP, ROOFLINE)
    _write(folder / "bo\u200bb\u202e_04_roofline.ipynb", "print('nothing')")  # invisible characters
    _write(folder / "boom_04_roofline.ipynb", "print('the scanner fails on this one')")
    _write(folder / "submission.ipynb", ROOFLINE)  # no lab named, but its checks say which
    _write(folder / "mystery.ipynb", "print(1)")  # no lab at all

    real_scan = labsupport.course.grade.scan_flags

    def scan(nb, known=()):  # stands for any bug of the grader's own on one notebook
        if any("the scanner fails" in c.source for c in nb.cells):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte \udcff")
        return real_scan(nb, known)

    monkeypatch.setattr(labsupport.course.grade, "scan_flags", scan)
    out = tmp_path / "grades.csv"
    assert main(["grade", str(folder), "--csv", str(out), "--timeout", "60", "--jobs", "2", "--as-is"]) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    assert len({r["notebook"] for r in rows}) == 8

    ok = _mine(rows, "ok_04_roofline")
    assert [(r["status"], r["student"]) for r in ok] == [("passed", "ok")]
    assert _mine(rows, "deep_04_roofline")[0]["status"] == "passed"
    assert _mine(rows, "caf")[0]["status"] == "passed"

    sur = _mine(rows, "sur_04_roofline")[0]
    assert sur["status"] == "failed" and "\\udcff \\ud800" in sur["detail"]  # escaped, not lost

    odd_row = _mine(rows, "caf")[0]
    assert odd_row["student"] == "caf\\udce9" and "caf\\udce9_04_roofline.ipynb" in odd_row["notebook"]
    assert "caf\\udce9_04_roofline.ipynb" in printed

    bob = _mine(rows, "_04_roofline.ipynb")
    assert any(r["student"] == "bob" for r in bob)

    boom = _mine(rows, "boom_04_roofline")
    assert [(r["status"], r["points"], r["max_points"], r["lab"]) for r in boom] == [
        ("grader error", "0", f"{ROOFLINE_POINTS:g}", "04_roofline")]
    assert "UnicodeDecodeError" in boom[0]["detail"] and "read it by hand" in boom[0]["detail"]

    guessed = _mine(rows, "submission.ipynb")[0]
    assert (guessed["status"], guessed["max_points"], guessed["lab"]) == ("unknown lab", f"{ROOFLINE_POINTS:g}",
                                                                           "04_roofline")
    assert "it looks like lab 04_roofline" in guessed["detail"]
    apart = _mine(rows, "mystery.ipynb")[0]
    assert (apart["status"], apart["max_points"], apart["lab"]) == ("unknown lab", "0", "")
    assert "1 notebook(s) whose lab could not be guessed" in printed
    assert printed.index("mystery.ipynb") > printed.index("whose lab could not be guessed")


def test_a_crash_keeps_the_rows_already_graded(tmp_path, monkeypatch):
    names = [_write(tmp_path / f"s{i}_04_roofline.ipynb", "print(1)") for i in range(3)]

    def fake(path, **kw):
        if path == names[2]:
            raise KeyboardInterrupt  # the grader itself stopped (Ctrl-C, killed): not a notebook's fault
        return [Row(str(path), "check_arithmetic_intensity", 1, 1, "passed", student=path.stem, lab="04_roofline")]

    monkeypatch.setattr(labsupport.course.grade, "grade_notebook", fake)
    out = tmp_path / "grades.csv"
    with pytest.raises(KeyboardInterrupt):
        main(["grade", *map(str, names), "--csv", str(out)])
    assert [r["student"] for r in _rows(out)] == ["s0_04_roofline", "s1_04_roofline"]
    assert not list(tmp_path.glob(".grades.csv.*"))  # no temporary file left behind


def test_an_existing_grades_file_is_replaced_only_with_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(labsupport.course.grade, "grade_notebook",
                        lambda path, **kw: [Row(str(path), "c", 1, 1, "passed")])
    nb = _write(tmp_path / "x_04_roofline.ipynb", "print(1)")
    out = tmp_path / "grades.csv"
    last_week = ",".join(CSV_HEADER) + "\nlast week,,,,,,,,\n"
    out.write_text(last_week)
    assert main(["grade", str(nb), "--csv", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert out.read_text() == last_week
    assert main(["grade", str(nb), "--csv", str(out), "--overwrite"]) == 0
    assert _rows(out)[0]["notebook"] == str(nb)
    assert (tmp_path / "grades.csv.bak").read_text() == last_week


def test_the_csv_is_written_atomically(tmp_path, monkeypatch):
    out = tmp_path / "grades.csv"
    write_csv([Row("a.ipynb", "c", 1, 1, "passed")], out, checked=False)
    before = out.read_bytes()

    class Broken:
        def __init__(self, f):
            self.n = 0

        def writerow(self, row):
            self.n += 1
            if self.n > 1:
                raise OSError("disk full")

    monkeypatch.setattr(labsupport.course.report.csv, "writer", Broken)
    with pytest.raises(OSError):
        write_csv([Row("b.ipynb", "c", 0, 1, "failed")], out, checked=False)
    assert out.read_bytes() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["grades.csv"]


def test_surrogates_are_escaped_everywhere_text_is_written(tmp_path):
    row = Row("caf\udce9.ipynb", "-", 0, 0, "unknown lab", "bad \ud800")
    row.flags = "x \udcff"
    assert (row.notebook, row.detail, row.flags) == ("caf\\udce9.ipynb", "bad \\ud800", "x \\udcff")
    format_table([row]).encode("utf-8")  # printable
    write_csv([row], tmp_path / "g.csv", checked=False)
    assert _rows(tmp_path / "g.csv")[0]["detail"] == "bad \\ud800"


def test_student_names_drop_invisible_characters_and_keep_the_folder_when_names_clash(tmp_path, monkeypatch):
    assert student_name(Path("s/\u200balice\u200d_07_attention.ipynb"), "07_attention") == "alice"
    assert student_name(Path("s/al\u202eice\x07.ipynb"), None) == "alice.ipynb"
    monkeypatch.setattr(labsupport.course.grade, "grade_notebook",
                        lambda path, **kw: [Row(str(path), "c", 1, 1, "passed", student=student_name(path, None))])
    paths = [tmp_path / "a" / "hw.ipynb", tmp_path / "b" / "hw.ipynb", tmp_path / "b" / "other.ipynb"]
    rows = grade_all(paths, manifest=LABS)
    assert [r.student for r in rows] == ["a/hw.ipynb", "b/hw.ipynb", "other.ipynb"]
    same = [tmp_path / "x" / "g" / "hw.ipynb", tmp_path / "y" / "g" / "hw.ipynb"]
    assert [r.student for r in grade_all(same, manifest=LABS)] == [f"{p.parent.as_posix()}/hw.ipynb" for p in same]


def test_the_lab_is_guessed_for_unknown_lab_rows(tmp_path):
    assert guess_lab(_nb(ROOFLINE), tmp_path / "submission.ipynb", LABS) == "04_roofline"
    assert guess_lab(_nb("print(1)"), tmp_path / "submission.ipynb", LABS) is None
    # the name names two labs; the checks it calls decide
    assert guess_lab(_nb(ROOFLINE), tmp_path / "00_first_kernel+04_roofline.ipynb", LABS) == "04_roofline"
    assert guess_lab(_nb("print(1)"), tmp_path / "00_first_kernel+04_roofline.ipynb", LABS) is None
    assert guess_lab(None, tmp_path / "x_06_kv_cache.ipynb", LABS) == "06_kv_cache"


def test_the_flag_scanner_survives_a_very_deep_expression():
    deep = "x = 1" + "+1" * 5000
    assert check_calls(deep + "\ncheck_a(f)") == ["check_a"]
    assert scan_flags(_nb(deep, "import labsupport")) == []
    assert "does not parse mentions labsupport" in scan_flags(_nb(deep + "\nimport labsupport"))[0]


def test_the_table_lists_notebooks_of_no_lab_apart():
    rows = [Row("a.ipynb", "check_x", 5, 5, "passed", lab="04_roofline"),
            Row("m.ipynb", "-", 0, 0, "unknown lab", "neither the file name nor ...", flags="REGISTRY")]
    lines = format_table(rows).splitlines()
    assert lines[0] == "a.ipynb  5/5  [04_roofline]"
    assert not any(line.startswith("m.ipynb") for line in lines)
    start = lines.index("1 notebook(s) whose lab could not be guessed (in no lab's totals; grade them with --lab NAME):")
    assert lines[start + 1].startswith("    m.ipynb: neither") and "REGISTRY" in lines[start + 2]
    assert lines[-1].startswith("1 notebook(s) flagged")


@pytest.mark.notebook
def test_a_lone_surrogate_in_an_error_does_not_lose_the_error():
    run = execute(_nb("raise ValueError('\\ud800')", "print('after')"), timeout=30, stop_on_error=False,
                  quiet=True, notebook_timeout=60)
    assert [(e.index, e.ename, e.evalue) for e in run.errors] == [(0, "ValueError", "\ud800")]
    assert run.notebook.cells[1].outputs[0]["text"] == "after\n"


@pytest.mark.notebook
def test_a_cell_too_deep_to_compile_is_that_cells_error_not_a_stall():
    run = execute(_nb("x = 1" + "+1" * 5000, "print('after')"), timeout=30, stop_on_error=False, quiet=True,
                  notebook_timeout=60)
    assert [(e.index, e.ename) for e in run.errors] == [(0, "RecursionError")]
    assert not run.timeouts and run.notebook.cells[1].outputs[0]["text"] == "after\n"


def test_what_hung_once_is_not_run_again_until_it_is_defined_anew():
    from labsupport.course.grade import skip_what_hung

    test = skip_what_hung(20)("check_kv_bytes_per_token(slow)")
    assert "`slow` already ran past 20 s in the cell starting `check_kv_bytes_per_token(slow)`" in test(
        "check_max_concurrency(slow)")
    assert test("x = slow") and test("print(slower)") == ""
    assert test("def slow(*a):\n    return 1") == ""  # defined anew: runs, and so do later cells using it
    assert test("check_max_concurrency(slow)") == ""
    assert skip_what_hung(20)("import time\ntime.sleep(100)") is None  # nothing named: skip nothing


@pytest.mark.notebook
def test_a_hanging_exercise_function_costs_one_timeout(tmp_path):
    from labsupport.course.grade import grade_notebook

    path = _write(tmp_path / "hang_06_kv_cache.ipynb", SETUP,
                  "import time\nfrom labsupport.checks import check_kv_bytes_per_token, check_max_concurrency",
                  "def slow(*a, **k):\n    time.sleep(300)", "check_kv_bytes_per_token(slow)",
                  "check_max_concurrency(slow)", "print('the notebook went on')")
    rows = grade_notebook(path, timeout=15, manifest=LABS, as_is=True)
    first, second = rows
    assert (first.status, second.status) == ("timeout", "timeout")
    assert "ran past 15 s and was interrupted" in first.detail
    assert second.detail.startswith("`slow` already ran past 15 s in the cell starting `check_kv_bytes_per_token(slow)`")
