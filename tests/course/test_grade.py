"""grade: scores per check, one row per problem, and submissions are never modified."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import nbformat
import pytest

import labsupport.course.grade
import labsupport.course.manifest
import labsupport.course.notebooks
import labsupport.course.report
from labsupport.course.cli import main
from labsupport.course.grade import expand, grade_notebook, identify_lab, student_name
from labsupport.course.manifest import load_manifest
from labsupport.course.notebooks import execute
from labsupport.course.report import CSV_HEADER, Row, format_table
from labsupport.course.scan import check_calls, scan_flags

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.notebook  # starts Jupyter kernels
LABS = load_manifest()


def _nb(*cells: str, lab: str | None = None) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if lab:
        nb.metadata["labsupport"] = {"source": f"solutions/{lab}.py", "version": "student"}
    return nb


def _notebook(path: Path, *cells: str, lab: str | None = None) -> Path:
    nbformat.write(_nb(*cells, lab=lab), str(path))
    return path


SETUP = "import labsupport\nsettings = labsupport.setup()"
IMPORT_CHECK = "from labsupport.checks import check_vector_add"
RIGHT_INTENSITY = "lambda m, k, n, b: 2 * m * k * n / (b * (m * k + k * n + m * n))"
TRITON_ADD = """import torch, triton, triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(out_ptr + o, tl.load(x_ptr + o, mask=m) + tl.load(y_ptr + o, mask=m), mask=m)

def add(x, y):
    assert x.shape == y.shape, "x and y must have the same length"
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), 128),)](x, y, out, x.numel(), BLOCK=128)
    return out"""


def _submissions(folder: Path) -> Path:
    folder.mkdir()
    _notebook(folder / "alice_00_first_kernel.ipynb", SETUP, IMPORT_CHECK, TRITON_ADD, "check_vector_add(add)")
    _notebook(  # a failing check, and a passing check of another lab that must not add points
        folder / "bob_00_first_kernel.ipynb", SETUP, IMPORT_CHECK, "check_vector_add(lambda x, y: x - y)",
        "print('after')",
        f"from labsupport.checks import check_arithmetic_intensity\ncheck_arithmetic_intensity({RIGHT_INTENSITY})",
        "import os\nprint(os.environ.get('LABSUPPORT_RESULTS'))",
    )
    _notebook(
        folder / "carol_00_first_kernel.ipynb",
        "raise ModuleNotFoundError(\"No module named 'labsupport'\")  # stands for: import labsupport",
        "settings = labsupport.setup()",
        "check_vector_add(lambda x, y: x + y)",
    )
    (folder / "dave_00_first_kernel.ipynb").write_text("this is not json")
    _notebook(  # the first check hangs; the next one must still run
        folder / "erin_06_kv_cache.ipynb", SETUP,
        "import time\nfrom labsupport.checks import check_kv_bytes_per_token, check_max_concurrency",
        "check_kv_bytes_per_token(lambda *a, **k: time.sleep(120))",
        "def stub(*a, **k):\n    raise NotImplementedError\n\ncheck_max_concurrency(stub)",
    )
    _notebook(  # a syntax error in an exercise, and a check call commented out
        folder / "grace_05_phases.ipynb", SETUP, "from labsupport.checks import check_prefill_flops",
        "def prefill_flops((n):\n    return 0", "check_prefill_flops(prefill_flops)",
        "# check_decode_bytes(decode_bytes_per_step)",
    )
    _notebook(folder / "judy_submission.ipynb", SETUP, IMPORT_CHECK, "check_vector_add(lambda x, y: x + y)")
    return folder


def _grade_submissions(shared: Path) -> dict:
    folder = _submissions(shared / "submissions")
    before = {p.name: p.read_bytes().hex() for p in folder.iterdir()}
    out = shared / "grades.csv"
    paths = [str(folder), str(folder / "missing.ipynb")]
    # A user-level `python3` kernelspec that cannot start: the grader must not use it.
    data_dir = shared / "jupyter-data"
    (data_dir / "kernels" / "python3").mkdir(parents=True)
    (data_dir / "kernels" / "python3" / "kernel.json").write_text(
        json.dumps({"argv": ["/bin/sh", "-c", "exit 3"], "display_name": "hijack", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(data_dir))
        mp.setenv("JUPYTER_PATH", str(data_dir))
        mp.setenv("JUPYTER_PREFER_ENV_PATH", "0")  # as for a grader installed outside a virtual environment
        # 20 s per cell: ample for the setup cell on a loaded 2-core CI machine, short for erin's sleep
        # --as-is: these notebooks are not made from the course's labs; they test the grader itself
        code = main(["grade", *paths, "--csv", str(out), "--timeout", "20", "--jobs", "2", "--as-is"])
    after = {p.name: p.read_bytes().hex() for p in folder.iterdir()}
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    return {"code": code, "rows": rows, "before": before, "after": after}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade the submissions once per test run, however many xdist workers ask (they wait for it)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one folder per run
    with open(shared / "graded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = shared / "graded.json"
        if not result.exists():
            result.write_text(json.dumps(_grade_submissions(Path(tempfile.mkdtemp(prefix="graded-", dir=shared)))))
        data = json.loads(result.read_text())
    return data["code"], data["rows"], data["before"], data["after"]


def _row(rows, name, check=None):
    return next(r for r in rows if r["notebook"].endswith(name) and check in (None, r["check"]))


def test_grading_goes_on_and_writes_csv(graded):
    code, rows, _, _ = graded
    assert code == 0
    assert len({r["notebook"] for r in rows}) == 8


def test_passing_and_failing_checks_are_scored(graded):
    _, rows, _, _ = graded
    alice, bob = _row(rows, "alice_00_first_kernel.ipynb"), _row(rows, "bob_00_first_kernel.ipynb")
    assert (alice["check"], alice["points"], alice["max_points"], alice["status"]) == ("check_vector_add", "10", "10", "passed")
    assert (bob["points"], bob["status"]) == ("0", "failed")
    assert "case [n=1000" in bob["detail"] and "x - y is computed instead of x + y" in bob["detail"]


def test_csv_names_the_lab_and_the_student(graded):
    _, rows, _, _ = graded
    assert list(rows[0]) == CSV_HEADER
    alice = _row(rows, "alice_00_first_kernel.ipynb")
    assert (alice["student"], alice["lab"]) == ("alice", "00_first_kernel")
    assert _row(rows, "judy_submission.ipynb")["student"] == "judy_submission.ipynb"


def test_only_the_labs_own_checks_score(graded):
    _, rows, _, _ = graded
    bob = [r for r in rows if r["notebook"].endswith("bob_00_first_kernel.ipynb")]
    extra = _row(rows, "bob_00_first_kernel.ipynb", "check_arithmetic_intensity")
    assert (extra["points"], extra["max_points"], extra["status"]) == ("0", "0", "extra")
    assert "04_roofline" in extra["detail"]
    assert sum(float(r["points"]) for r in bob) == 0 and sum(float(r["max_points"]) for r in bob) == 10


def test_a_notebook_without_a_known_lab_scores_zero_on_its_own_row(graded):
    _, rows, _, _ = graded
    judy = [r for r in rows if r["notebook"].endswith("judy_submission.ipynb")]
    assert [(r["check"], r["points"], r["status"]) for r in judy] == [("-", "0", "unknown lab")]
    assert "--lab" in judy[0]["detail"]


def test_problems_are_reported_per_file(graded):
    _, rows, _, _ = graded
    carol = _row(rows, "carol_00_first_kernel.ipynb")
    assert carol["status"] == "setup failed" and "labsupport" in carol["detail"] and carol["points"] == "0"
    dave = _row(rows, "dave_00_first_kernel.ipynb")
    assert (dave["status"], dave["points"], dave["max_points"], dave["lab"]) == ("not a notebook", "0", "10",
                                                                               "00_first_kernel")
    assert _row(rows, "missing.ipynb")["status"] == "missing"


def test_a_hung_check_is_interrupted_and_later_checks_still_run(graded):
    _, rows, _, _ = graded
    hung = _row(rows, "erin_06_kv_cache.ipynb", "check_kv_bytes_per_token")
    assert (hung["status"], hung["points"]) == ("timeout", "0")
    assert "`check_kv_bytes_per_token(lambda *a, **k: time.sleep(120))` ran past 20 s" in hung["detail"]
    assert _row(rows, "erin_06_kv_cache.ipynb", "check_max_concurrency")["status"] == "not done"


def test_a_syntax_error_and_a_commented_out_check_say_what_happened(graded):
    _, rows, _, _ = graded
    broken = _row(rows, "grace_05_phases.ipynb", "check_prefill_flops")
    assert broken["status"] == "not run"
    assert "the first error was in the cell starting `def prefill_flops((n):`: SyntaxError" in broken["detail"]
    commented = _row(rows, "grace_05_phases.ipynb", "check_decode_bytes")
    assert commented["status"] == "not run" and "does not call check_decode_bytes" in commented["detail"]


def test_tampering_is_flagged_and_the_score_left_alone(graded):
    _, rows, _, _ = graded
    assert "LABSUPPORT_RESULTS" in _row(rows, "bob_00_first_kernel.ipynb")["flags"]
    assert _row(rows, "alice_00_first_kernel.ipynb")["flags"] == ""
    assert _row(rows, "alice_00_first_kernel.ipynb")["points"] == "10"


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
    assert solved[0].flags == fresh[0].flags == ""


def test_grading_works_installed_from_a_wheel_without_the_sources(tmp_path):
    """pip install "labsupport[grade] @ git+...": no solutions/ folder, yet a deleted check scores zero."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "labsupport", src / "labsupport", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("labsupport-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        assert "labsupport/lab_checks.json" in z.namelist()
        z.extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    _notebook(work / "tidy_00_first_kernel.ipynb", "print('my work, no check cell')")
    script = ("import sys, labsupport\nassert labsupport.__file__.startswith(sys.argv[1]), labsupport.__file__\n"
              "from labsupport.__main__ import main\nsys.exit(main(['grade', 'tidy_00_first_kernel.ipynb']))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", script, str(site)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(work / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["check"], r["points"], r["max_points"], r["status"]) for r in rows] == [
        ("-", "0", "10", "unmatched")]  # the course's cells come with the package: nothing of theirs to grade
    assert "exercise cell 00-first-kernel-015 missing (no cell defines add_kernel, vector_add" in rows[0]["detail"]


def test_grading_refuses_without_the_lab_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(labsupport.course.manifest, "MANIFEST", tmp_path / "lab_checks.json")
    monkeypatch.setattr(labsupport.course.grade, "grade_all", lambda *a, **k: pytest.fail("graded without lab_checks.json"))
    _notebook(tmp_path / "x_00_first_kernel.ipynb", "print(1)")
    assert main(["grade", str(tmp_path / "x_00_first_kernel.ipynb"), "--csv", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert "lab_checks.json is missing" in err and "python -m labsupport release" in err
    assert not (tmp_path / "g.csv").exists()


def test_the_committed_lab_list_ships_with_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_data = next(line for line in pyproject.splitlines() if line.startswith("labsupport = ["))
    assert '"lab_checks.json"' in package_data
    assert set(LABS) == {p.stem for p in (ROOT / "solutions").glob("[0-9]*.py")}
    assert LABS["00_first_kernel"] == [("check_vector_add", 10.0)]


def _never_run(monkeypatch):
    monkeypatch.setattr(labsupport.course.grade, "execute", lambda *a, **k: pytest.fail("a notebook was run"))


def test_the_lab_comes_from_the_file_name_and_the_metadata_and_they_must_agree(tmp_path, monkeypatch):
    labs = list(LABS)
    plain = _nb("print(1)")
    marked = _nb("print(1)", lab="07_attention")
    assert identify_lab(plain, tmp_path / "alice_00_first_kernel.ipynb", labs) == ("00_first_kernel", "")
    assert identify_lab(marked, tmp_path / "whatever.ipynb", labs) == ("07_attention", "")
    assert identify_lab(marked, tmp_path / "07_attention (1).ipynb", labs) == ("07_attention", "")
    assert identify_lab(marked, tmp_path / "x_07_attention_v2.ipynb", labs)[0] == "07_attention"
    lab, why = identify_lab(marked, tmp_path / "bob_00_first_kernel.ipynb", labs)
    assert lab is None and "00_first_kernel" in why and "07_attention" in why
    lab, why = identify_lab(plain, tmp_path / "submission.ipynb", labs)
    assert lab is None and "neither the file name nor" in why
    lab, why = identify_lab(plain, tmp_path / "00_first_kernel+04_roofline.ipynb", labs)
    assert lab is None and "several labs" in why
    assert identify_lab(plain, tmp_path / "a700_first_kernels.ipynb", labs)[0] is None  # not a lab name
    assert identify_lab(plain, tmp_path / "submission.ipynb", labs, forced="04_roofline") == ("04_roofline", "")

    # metadata pointing at some other file of the course is not a lab, whatever the file name says
    _never_run(monkeypatch)
    readme = _nb("check_naive_attention(naive_attention_reference)")
    readme.metadata["labsupport"] = {"source": "README.md"}
    nbformat.write(readme, str(tmp_path / "ivan_07_attention.ipynb"))
    rows = grade_notebook(tmp_path / "ivan_07_attention.ipynb")
    assert [(r.check, r.points, r.status) for r in rows] == [("-", 0, "unknown lab")]
    assert "'README.md'" in rows[0].detail and "naive_attention_reference" in rows[0].flags


def test_lab_option_forces_the_lab(tmp_path, monkeypatch, capsys):
    from labsupport.course.notebooks import Execution

    monkeypatch.setattr(labsupport.course.grade, "execute", lambda nb, **k: Execution(nb))
    _notebook(tmp_path / "submission.ipynb", "print(1)")
    rows = grade_notebook(tmp_path / "submission.ipynb", lab="06_kv_cache", as_is=True)
    assert [(r.lab, r.check, r.max_points) for r in rows] == [
        ("06_kv_cache", "check_kv_bytes_per_token", 5), ("06_kv_cache", "check_max_concurrency", 5)]
    assert main(["grade", str(tmp_path), "--lab", "99_nothing", "--csv", str(tmp_path / "g.csv")]) == 2
    assert "no such lab" in capsys.readouterr().err


def test_student_names():
    assert student_name(Path("s/alice_07_attention.ipynb"), "07_attention") == "alice"
    assert student_name(Path("s/07_attention-bob smith.ipynb"), "07_attention") == "bob_smith"
    assert student_name(Path("s/alice_07_attention (2).ipynb"), "07_attention") == "alice"
    assert student_name(Path("s/07_attention.ipynb"), "07_attention") == "07_attention.ipynb"
    assert student_name(Path("s/judy.ipynb"), None) == "judy.ipynb"
    assert student_name(Path("s/Copy of 07_attention.ipynb"), "07_attention") == "Copy of 07_attention.ipynb"
    assert student_name(Path("s/alice - Copy of 07_attention (1).ipynb"), "07_attention") == "alice"


def test_scores_survive_a_csv_that_cannot_be_written_at_the_end(tmp_path, monkeypatch, capsys):
    """If the CSV cannot be written after grading, the scores go to a fresh temporary file."""
    bad = tmp_path / "mia_04_roofline.ipynb"
    bad.write_text("not a notebook")  # graded without a kernel: an unreadable file
    real = labsupport.course.report.write_csv
    target = tmp_path / "grades.csv"

    def flaky(rows, path, **kw):
        if Path(path) == target:
            raise OSError("disk full")
        return real(rows, path, **kw)

    monkeypatch.setattr(labsupport.course.report, "write_csv", flaky)  # the CLI imports it when it runs
    assert main(["grade", str(bad), "--csv", str(tmp_path / "grades.csv")]) == 1
    err = capsys.readouterr().err
    fallback = Path(err.split("the scores are in ")[1].split()[0])
    rows = list(csv.DictReader(fallback.open()))
    assert rows[0]["student"] == "mia" and rows[0]["max_points"] == "5"
    fallback.unlink()


def test_check_calls_are_found_in_code_not_in_comments_or_strings():
    assert check_calls("check_a(f)\nx = labsupport.checks.check_b(g)") == ["check_a", "check_b"]
    assert check_calls("# check_a(f)\nprint('check_b(g)')") == []
    assert check_calls("%time check_a(f)") == ["check_a"]
    assert check_calls("def f((x):\n    pass\ncheck_a(f)  # check_b(f)") == ["check_a"]  # does not parse


def test_tampering_is_named():
    clean = [nbformat.read(str(p), as_version=4) for p in sorted(ROOT.glob("*/[0-9]*.ipynb"))]
    assert clean and all(scan_flags(nb, {"check_vector_add"}) == [] for nb in clean)
    cases = {
        "import os, json\nopen(os.environ['LABSUPPORT_RESULTS'], 'a').write('{}')": "LABSUPPORT_RESULTS",
        "from labsupport.checks.framework import Checker\nChecker.expect_number = lambda *a, **k: None": "patches Checker.expect_number",
        "import labsupport.checks.framework as fw\nfw._record = print": "labsupport.checks.framework",
        "from labsupport.checks import REGISTRY\nREGISTRY.clear()": "REGISTRY",
        "import labsupport\nsetattr(labsupport.checks, 'check_x', print)": "patches labsupport.checks (setattr)",
        "def check_vector_add(fn):\n    print('PASSED')": "redefines check_vector_add",
        "check_naive_attention(naive_attention_reference)": "passes the course's naive_attention_reference",
        "def naive_attention(q, k, v, causal):\n    return attention_spec(q, k, v, causal)[0]\n"
        "check_naive_attention(naive_attention)": "naive_attention uses the course's attention_spec",
        "from labsupport.checks.lab04_roofline import reference_intensity": "imports from labsupport.checks.lab04_roofline",
    }
    for code, flag in cases.items():
        found = scan_flags(_nb(code), {"check_vector_add"})
        assert any(flag in f for f in found), (code, found)
    assert scan_flags(_nb("# LABSUPPORT_RESULTS and Checker, in a comment\nx = 1")) == []


def test_the_course_answers_are_flagged_from_their_registry():
    """No list of names in the scan: every function decorated with @answer is the course's, wherever it
    is defined, and a learner's own function of the same name is not."""
    import labsupport.course.scan as scan
    from labsupport._answers import ANSWERS, answer

    assert not any(isinstance(v, re.Pattern) for v in vars(scan).values())  # no regex of names
    cases = {
        "from labsupport import costs\ncheck_decode_bytes(costs.decode_step_bytes)":
            "passes the course's decode_step_bytes to check_decode_bytes",
        "from labsupport.kvcache import max_concurrency\ncheck_max_concurrency(max_concurrency)":
            "passes the course's max_concurrency",
        "import labsupport.costs as c\ndef kv_bytes_per_token(cfg, dtype_bytes=2):\n"
        "    return c.kv_bytes_per_token(cfg, dtype_bytes)\ncheck_kv_bytes_per_token(kv_bytes_per_token)":
            "kv_bytes_per_token uses the course's kv_bytes_per_token",
    }
    for code, flag in cases.items():
        found = scan_flags(_nb(code))
        assert any(flag in f for f in found), (code, found)
    own = "def kv_bytes_per_token(cfg, dtype_bytes=2):\n    return 2 * cfg.n_layers\ncheck_kv_bytes_per_token(kv_bytes_per_token)"
    assert scan_flags(_nb(own)) == []

    @answer
    def chapter_16_answer_for_this_test():
        return 1

    try:
        found = scan_flags(_nb("check_something(chapter_16_answer_for_this_test)"))
        assert found == ["passes the course's chapter_16_answer_for_this_test to check_something"]
    finally:
        ANSWERS.pop(chapter_16_answer_for_this_test.answer_name)
    assert scan_flags(_nb("check_something(chapter_16_answer_for_this_test)")) == []


def test_a_notebook_that_hangs_is_stopped_at_its_time_limit():
    run = execute(_nb("print('first')", "import time\ntime.sleep(120)", "print('never')"), timeout=100,
                  stop_on_error=False, quiet=True, notebook_timeout=4)
    assert run.notebook_timed_out and "4 s limit" in run.notebook_timed_out
    assert run.timed_out is not None and run.timed_out.index == 1 and not run.ok
    assert run.notebook.cells[0].outputs and not run.notebook.cells[2].get("outputs")


def test_grading_stops_with_a_message_when_no_kernel_starts(tmp_path, monkeypatch, capsys):
    _notebook(tmp_path / "a_00_first_kernel.ipynb", "print(1)")
    for python in ("/nonexistent/python", "/bin/false"):  # cannot start; starts and dies at once
        monkeypatch.setattr(labsupport.course.notebooks, "KERNEL_PYTHON", python)
        assert main(["grade", str(tmp_path), "--csv", str(tmp_path / "g.csv"), "--as-is"]) == 2
        err = capsys.readouterr().err
        assert f"could not start a Python kernel with {python}" in err and "Grading stopped" in err
        assert not (tmp_path / "g.csv").exists()


def test_the_table_groups_checks_under_each_notebook_with_totals():
    rows = [
        Row("a.ipynb", "check_x", 5, 5, "passed"),
        Row("a.ipynb", "check_y", 0, 10, "failed", "case [n=3]: the output is wrong " + "x" * 200),
        Row("b.ipynb", "check_x", 0, 5, "not done", "the exercise still raises NotImplementedError", flags="Checker"),
        Row("c.ipynb", "-", 0, 0, "missing", "c.ipynb: no such file"),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0] == "a.ipynb  5/15"
    assert lines[1].split() == ["check_x", "5/5", "passed"]
    assert lines[2].startswith("    check_y") and lines[2].endswith("...") and len(lines[2]) < 140
    assert "b.ipynb  0/5" in lines and any("not done: the exercise" in line for line in lines)
    assert "    flags: Checker" in lines
    assert lines[-2] == "3 notebook(s), 0 with full marks; checks: 1 passed, 1 failed, 1 not done, 1 missing"
    assert lines[-1].startswith("1 notebook(s) flagged: read them")


def test_csv_is_checked_before_any_notebook_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(labsupport.course.grade, "grade_all", lambda *a, **k: pytest.fail("graded before checking --csv"))
    (tmp_path / "notes.csv").write_text("name,mark\n")
    _notebook(tmp_path / "x.ipynb", "print(1)")
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(tmp_path / "notes.csv")]) == 2
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(tmp_path)]) == 2
    assert "not a grades file" in capsys.readouterr().err
    assert main(["grade", str(tmp_path / "x.ipynb"), "--csv", str(tmp_path / "no" / "dir" / "g.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_path_that_is_not_there_stops_grading_before_it_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(labsupport.course.grade, "grade_all", lambda *a, **k: pytest.fail("graded a typo"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grades.csv").write_text(",".join(CSV_HEADER) + "\nlast week's grades\n")
    assert main(["grade", "nothing_here"]) == 2
    assert "nothing_here: no such file or folder" in capsys.readouterr().err
    assert "last week's grades" in (tmp_path / "grades.csv").read_text()


def test_an_older_grades_file_may_be_replaced_with_overwrite(tmp_path):
    old = tmp_path / "grades.csv"
    old.write_text("notebook,check,points,max_points,status,detail\n")
    labsupport.course.report.check_csv_target(old, overwrite=True)  # no error
    with pytest.raises(FileExistsError, match="--overwrite"):
        labsupport.course.report.check_csv_target(old)


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


def test_no_notebooks_found(tmp_path, capsys):
    assert main(["grade", str(tmp_path)]) == 2
    assert "no notebooks found" in capsys.readouterr().err
