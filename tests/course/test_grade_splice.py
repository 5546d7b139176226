"""grade: answers, not notebooks. The notebook run is the course's, with the learner's exercise cells
put in; what else they changed is reported, not run. And where the kernel ran is said on every row."""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

import labsupport.course.grade
from labsupport.course.cli import main
from labsupport.course.grade import grade_notebook
from labsupport.course.manifest import load_course_cells
from labsupport.course.notebooks import Execution
from labsupport.course.report import CSV_HEADER, Row, format_table
from labsupport.course.sandbox import Sandbox
from labsupport.course.splice import needed, splice

ROOT = Path(__file__).resolve().parents[2]
COURSE = load_course_cells("05_phases")
FIRST, SECOND = [c for c in COURSE if c["exercise"]]  # prefill_flops, decode_bytes_per_step


def _lab05() -> nbformat.NotebookNode:
    return nbformat.read(str(ROOT / "labs" / "05_phases.ipynb"), as_version=4)


def _cell(nb, cid):
    return next(c for c in nb.cells if c.get("id") == cid)


def test_release_records_the_exercise_cells_and_the_names_they_define():
    assert (FIRST["id"], FIRST["defines"]) == ("05-phases-017", ["prefill_flops"])
    assert (SECOND["id"], SECOND["defines"]) == ("05-phases-025", ["decode_bytes_per_step"])
    released = [c for c in _lab05().cells if c.cell_type == "code"]
    assert [(c["id"], c.source) for c in released] == [(c["id"], c["source"]) for c in COURSE]


def test_only_the_exercise_cells_are_the_learners():
    nb = _lab05()
    _cell(nb, FIRST["id"]).source = "def helper():\n    return 2\n\ndef prefill_flops(cfg, p, causal=False):\n    return helper()"
    _cell(nb, "05-phases-018").source = "print('PASSED check_prefill_flops')"  # an edited check cell
    _cell(nb, "05-phases-002").source += "\nimport labsupport.checks.framework as fw"  # an edited import cell
    nb.cells.insert(3, nbformat.v4.new_code_cell("prefill_flops = lambda *a, **k: 42"))  # an added cell
    out = splice(nb, COURSE)
    ran = {c["id"]: c.source for c in out.notebook.cells}
    assert ran[FIRST["id"]].startswith("def helper():")  # the whole exercise cell is theirs, helpers too
    assert ran["05-phases-018"] == "check_prefill_flops(prefill_flops)"  # the course's check cell ran
    assert "fw" not in ran["05-phases-002"]
    assert "lambda *a, **k: 42" not in "".join(ran.values())
    assert out.learner == [FIRST["id"], SECOND["id"]] and out.moved == [] and out.missing == []
    assert [e.split(" ")[0] for e in out.edited] == ["05-phases-002", "05-phases-018"]
    assert len(out.extra) == 1 and "prefill_flops = lambda" in out.extra[0]
    assert [out.roles[i] for i, c in enumerate(out.notebook.cells) if c["id"] in (FIRST["id"], "05-phases-018")] == [
        "learner", "course"]
    assert "1 added cell(s) not run" in out.ignored() and "2 edited course cell(s) ignored" in out.ignored()


def test_an_exercise_cell_is_found_by_its_names_when_its_id_changed_and_missing_ones_are_named():
    nb = _lab05()
    _cell(nb, FIRST["id"])["id"] = "renamed-by-a-tool"
    nb.cells = [c for c in nb.cells if c.get("id") != SECOND["id"]]
    out = splice(nb, COURSE)
    assert out.learner == [FIRST["id"]] and out.moved == [FIRST["id"]]
    assert out.missing == [f"exercise cell {SECOND['id']} missing (no cell defines decode_bytes_per_step)"]
    assert _cell(out.notebook, SECOND["id"]).source == SECOND["source"]  # the course's stub in its place
    assert "the course's stub ran in its place" in out.ignored()


def test_a_notebook_with_none_of_the_exercise_cells_is_reported_unmatched_and_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(labsupport.course.grade, "execute", lambda *a, **k: pytest.fail("ran an unmatched notebook"))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("check_prefill_flops(lambda *a: 0)")]
    nbformat.write(nb, str(tmp_path / "eve_05_phases.ipynb"))
    rows = grade_notebook(tmp_path / "eve_05_phases.ipynb", unsandboxed="a test")
    assert [(r.check, r.points, r.max_points, r.status) for r in rows] == [("-", 0, 10, "unmatched")]
    assert "exercise cell 05-phases-017 missing (no cell defines prefill_flops)" in rows[0].detail
    assert "1 added cell(s) not run" in rows[0].ignored


def test_only_the_cells_the_checks_need_run():
    out = needed(splice(_lab05(), COURSE))
    ids = [c["id"] for c in out.notebook.cells]
    assert ids == ["05-phases-001", "05-phases-002", FIRST["id"], "05-phases-018", SECOND["id"], "05-phases-026"]
    assert [out.roles[i] for i in range(len(ids))] == ["course", "course", "learner", "course", "learner", "course"]
    nb = _lab05()  # a learner's exercise cell that uses a course name pulls in the cell that binds it
    _cell(nb, FIRST["id"]).source = "def prefill_flops(cfg, p, causal=False):\n    return len(measured)"
    assert "05-phases-006" in [c["id"] for c in needed(splice(nb, COURSE)).notebook.cells]


def test_results_count_only_from_the_course_check_cells(monkeypatch, tmp_path):
    from labsupport.checks.framework import RESULT_MIME

    def fake_execute(nb, **kwargs):  # what a kernel would report: a forged pass, then the real failure
        for cell in nb.cells:
            if cell["id"] == FIRST["id"]:
                cell.outputs = [nbformat.v4.new_output("display_data", data={RESULT_MIME: {
                    "check": "check_prefill_flops", "passed": True}})]
            if cell["id"] == "05-phases-018":
                cell.outputs = [nbformat.v4.new_output("display_data", data={RESULT_MIME: {
                    "check": "check_prefill_flops", "passed": False, "reason": "failed", "message": "wrong"}})]
            if cell["id"] == "05-phases-026":  # a pass from a cell that then failed
                cell.outputs = [nbformat.v4.new_output("display_data", data={RESULT_MIME: {
                    "check": "check_decode_bytes", "passed": True}}),
                    nbformat.v4.new_output("error", ename="SystemExit", evalue="", traceback=[])]
        run = Execution(nb)
        run.errors = []
        from labsupport.course.notebooks import CellError
        index = next(i for i, c in enumerate(nb.cells) if c["id"] == "05-phases-026")
        run.errors.append(CellError(index, "SystemExit", "", nb.cells[index].source))
        return run

    monkeypatch.setattr(labsupport.course.grade, "execute", fake_execute)
    nbformat.write(_lab05(), str(tmp_path / "fay_05_phases.ipynb"))
    rows = grade_notebook(tmp_path / "fay_05_phases.ipynb", unsandboxed="a test")
    assert [(r.check, r.points, r.status) for r in rows] == [("check_prefill_flops", 0, "failed"),
                                                           ("check_decode_bytes", 0, "failed")]
    assert "forged result: check_prefill_flops reported as passed from the learner's cell 05-phases-017" in rows[0].flags
    assert "check_decode_bytes reported passed in cell 05-phases-026, which then failed" in rows[0].flags


def test_unsandboxed_grading_says_so_on_every_row_and_in_the_table(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, str(tmp_path / "gus_05_phases.ipynb"))  # unmatched: graded without a kernel
    out = tmp_path / "g.csv"
    assert main(["grade", str(tmp_path), "--csv", str(out), "--no-sandbox"]) == 0
    captured = capsys.readouterr()
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_HEADER and CSV_HEADER[:9] == ["notebook", "student", "lab", "check", "points",
                                                               "max_points", "status", "detail", "flags"]
    assert rows[0]["sandbox"] == "UNSANDBOXED: --no-sandbox was given"
    assert "UNSANDBOXED" in captured.out and "WARNING: grading UNSANDBOXED" in captured.err


def test_the_table_names_the_learners_cells_and_what_was_ignored():
    row = Row("a.ipynb", "check_x", 1, 1, "passed", sandbox="bwrap", learner_cells="05-phases-017",
              ignored="1 added cell(s) not run: x")
    table = format_table([row])
    assert "learner's cells: 05-phases-017" in table and "not run: 1 added cell(s) not run: x" in table
    assert "UNSANDBOXED" not in table


def test_bubblewrap_leaves_only_the_scratch_folders_writable():
    argv = Sandbox("bwrap", memory=2**30).wrap(["python", "-c", "main"], ["/k", "/scratch"], "/scratch")
    assert argv[:5] == ["bwrap", "--ro-bind", "/", "/", "--dev"]
    for flag in ("--unshare-all", "--die-with-parent", "--new-session"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == ["/k", "/scratch"]
    assert f"--as={2**30}" in argv and argv[-3:] == ["python", "-c", "main"]


def test_the_probe_finds_every_course_check_as_on_disk_and_a_patched_one(monkeypatch):
    """The probe cell, run here on every lab's checks: no false alarm, and an in-memory patch named."""
    import IPython.display

    import labsupport.checks  # noqa: F401  (every lab's check module)
    import labsupport.checks.framework as fw
    from labsupport.course.probe import PROBE_MIME, probe_cell, verdict

    answers = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: answers.append(obj))
    source, nonce = probe_cell()
    exec(source, {})
    cell = {"outputs": [{"data": answers[-1]}]}
    assert answers[-1][PROBE_MIME]["nonce"] == nonce and verdict(cell, nonce, True) == []
    monkeypatch.setattr(fw, "_record", lambda result: None)
    monkeypatch.setattr(fw.Checker, "expect_number", lambda *a, **k: None)
    exec(source, {})
    flags = verdict({"outputs": [{"data": answers[-1]}]}, nonce, True)
    assert "framework._record comes from" in flags[0] and "Checker.expect_number comes from" in flags[0]
    assert "integrity probe: no single answer" in verdict({"outputs": []}, nonce, True)[0]
    assert verdict({"outputs": [{"data": answers[-1]}]}, "another run's nonce", True)[0].startswith("integrity probe")
