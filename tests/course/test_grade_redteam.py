"""grade: cheats tried after issue 9 landed, each a planted lab 04 notebook graded end to end.

Each one made a wrong answer score full marks, unflagged, before the fix named beside it:

* ``isclose``: the exercise cell replaces ``math.isclose`` (what ``expect_number`` compares with) and
  an IPython ``post_run_cell`` callback puts it back after the check cell, before the grader's last
  cell looks. Fixed: the checks remember what they rely on when they are imported (before any
  learner code), and a check that finds any of it replaced fails (reason ``tampered``, flagged).
* ``checker``: the same with ``Checker.expect_number``, found through ``sys.modules`` and ``getattr``.
* ``reference``: replaces the lab's reference answer in the check module with one that agrees with
  the wrong answer. Fixed by the same memory (every global of the check modules).
* ``hidden``: rewrites failed results as passes in ``IPython.display.display`` and hides the check
  cell's error with ``set_custom_exc``. Fixed: a cell failed when the kernel's reply says so, whatever
  its outputs show; the probe also names a custom exception handler written in the notebook.
* ``transformer``: an input transformer replaces the check cell with a forged pass (and tries to
  blind the last cell). Inherent (code in the kernel can rewrite what the kernel runs): the probe
  names input transformers, AST transformers and event callbacks written in the notebook.
* ``modules``: a fake ``labsupport.checks`` in ``sys.modules`` (the key spelled in pieces), whose
  check reports a pass and puts the real module back. Inherent: flagged by the scanner, which names
  code that reaches into the interpreter however it spells the name.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labsupport.course.sandbox import Sandbox, bwrap_problem, bwrap_sizes_tmpfs

ROOT = Path(__file__).resolve().parents[2]
EXERCISE = "04-roofline-019"
SANDBOX = not bwrap_problem()
RIGHT = ("def arithmetic_intensity(m, k, n, dtype_bytes):\n"
         "    return 2 * m * k * n / (dtype_bytes * (m * k + k * n + m * n))\n")
WRONG = "def arithmetic_intensity(m, k, n, dtype_bytes):\n    return 1.0\n"
MIME = "'application/vnd.labsupport.' + 'check-result' + '+json'"
PASS = "{'check': 'check_arithmetic_intensity', 'passed': True, 'points': 5, 'max_points': 5, 'cases': 1, " \
       "'message': '', 'reason': ''}"
LATER = """ip = get_ipython()
runs = [0]
def later(*args):
    runs[0] += 1
    if runs[0] == 2:  # after the check cell: the grader's last cell sees everything as it was
        PUT_BACK
ip.events.register('post_run_cell', later)
"""
CHEATS = {
    "isclose": "import math\noriginal = math.isclose\nmath.isclose = lambda *a, **k: True\n"
               + LATER.replace("PUT_BACK", "math.isclose = original") + WRONG,
    "checker": """import sys
fw = sys.modules['labsupport.checks.' + 'frame' + 'work']
K = getattr(fw, 'Check' + 'er')
original = K.expect_number
setattr(K, 'expect_' + 'number', lambda *a, **k: None)
""" + LATER.replace("PUT_BACK", "setattr(K, 'expect_' + 'number', original)") + WRONG,
    "reference": """import sys
setattr(sys.modules['labsupport.checks.lab04_' + 'roofline'], 'reference_' + 'intensity', lambda *a: 1.0)
""" + WRONG,
    "hidden": """import IPython.display as d
shown = d.display
def display(*objs, **kw):
    out = []
    for o in objs:
        if isinstance(o, dict):
            o = {k: ({**v, 'passed': True, 'points': v['max_points'], 'reason': '', 'message': ''}
                     if 'check-result' in k else v) for k, v in o.items()}
        out.append(o)
    return shown(*out, **kw)
d.display = display
get_ipython().set_custom_exc((AssertionError,), lambda *a, **k: None)
""" + WRONG,
    "transformer": f"""FAKE = "from IPython.display import display as _d\\n_d({{{MIME}: {PASS}}}, raw=True)\\n"
def rewrite(lines):
    if 'check_arithmetic_intensity(arithmetic_intensity)' in ''.join(lines):
        return [FAKE]
    return [line.replace('problems.append(', '(lambda *a: None)(') for line in lines]
get_ipython().input_transformers_post.append(rewrite)
""" + WRONG,
    "modules": f"""import sys, types
from IPython.display import display
real = getattr(sys, 'mod' + 'ules')['labsupport.' + 'checks']
class Fake(types.ModuleType):
    def __getattr__(self, name):
        if name == 'check_' + 'arithmetic_intensity':
            def fake(fn):
                getattr(sys, 'mod' + 'ules')['labsupport.' + 'checks'] = real
                display({{{MIME}: {PASS}}}, raw=True)
            return fake
        return getattr(real, name)
getattr(sys, 'mod' + 'ules')['labsupport.' + 'checks'] = Fake('labsupport.checks')
""" + WRONG,
    "good": RIGHT,
}


def _submission(path: Path, exercise: str) -> None:
    nb = nbformat.read(str(ROOT / "labs" / "04_roofline.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.get("id") == EXERCISE:
            cell.source = exercise
    nbformat.write(nb, str(path))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    base = tmp_path_factory.mktemp("redteam")
    folder = base / "submissions"
    folder.mkdir()
    for name, source in CHEATS.items():
        _submission(folder / f"{name}_04_roofline.ipynb", source)
    csv_path = base / "grades.csv"
    done = subprocess.run([sys.executable, "-m", "labsupport", "grade", str(folder), "--csv", str(csv_path),
                           "-j", "2", "--timeout", "120"], cwd=base, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(csv_path, newline="", encoding="utf-8") as f:
        return {r["notebook"].rsplit("/", 1)[-1].split("_04_")[0]: r for r in csv.DictReader(f)}


pytestmark = pytest.mark.notebook


def test_honest_work_passes_unflagged_beside_the_new_guards(rows):
    assert (rows["good"]["status"], rows["good"]["points"], rows["good"]["flags"]) == ("passed", "5", "")


@pytest.mark.parametrize("name, replaced", [("isclose", "`math.isclose`"), ("checker", "`Checker.expect_number`"),
                                            ("reference", "`labsupport.checks.lab04_roofline.reference_intensity`")])
def test_what_a_check_compares_with_replaced_in_memory_fails_the_check(rows, name, replaced):
    row = rows[name]
    assert (row["status"], row["points"]) == ("failed", "0")
    assert replaced in row["detail"] and "tampered during check_arithmetic_intensity" in row["flags"]


def test_a_callback_that_puts_things_back_is_named(rows):
    assert "an IPython 'post_run_cell' event callback was installed by the notebook" in rows["isclose"]["flags"]


def test_a_hidden_error_still_fails_its_cell(rows):
    row = rows["hidden"]
    assert (row["status"], row["points"]) == ("failed", "0")
    assert "which then failed or stopped; counted as failed" in row["flags"]
    assert "a custom exception handler (set_custom_exc) was installed by the notebook" in row["flags"]


def test_an_input_transformer_is_flagged(rows):
    """Inherent (the kernel runs what its transformers make of a cell): flagged, not prevented."""
    assert "an input transformer was installed by the notebook" in rows["transformer"]["flags"]
    assert "reaches into the interpreter or the kernel (get_ipython" in rows["transformer"]["flags"], \
        rows["transformer"]["flags"]


def test_a_fake_checks_module_is_flagged_however_it_is_spelled(rows):
    """Inherent (the check cell imports through sys.modules): flagged by what the code reaches into."""
    flags = rows["modules"]["flags"]
    assert "reaches into the interpreter or the kernel (" in flags and "getattr on sys" in flags


# -- fast: the pieces, without a kernel -----------------------------------------------------------

def test_a_check_fails_when_what_it_compares_with_was_replaced(monkeypatch):
    import labsupport.checks as checks
    import labsupport.checks.framework as fw
    from labsupport.checks.framework import CheckFailed, replaced

    right = lambda m, k, n, b: 2 * m * k * n / (b * (m * k + k * n + m * n))  # noqa: E731
    monkeypatch.setattr(math, "isclose", lambda *a, **k: True)
    checks.check_arithmetic_intensity(lambda *a: 1.0)  # outside grading, no guard (tests patch as they like)
    monkeypatch.undo()
    monkeypatch.setattr(fw, "_GUARDING", True)  # as when the checks were imported by the grader
    assert replaced() == []
    checks.check_arithmetic_intensity(right)
    monkeypatch.setattr(math, "isclose", lambda *a, **k: True)
    with pytest.raises(CheckFailed, match="`math.isclose` had been replaced") as failure:
        checks.check_arithmetic_intensity(lambda *a: 1.0)
    assert failure.value.reason == "tampered"
    assert checks.RESULTS[-1].reason == "tampered" and not checks.RESULTS[-1].passed


def test_the_scanner_names_reaching_into_the_interpreter_but_not_the_course_solutions():
    import json

    from labsupport.course.scan import scan_flags

    def flags(source):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(source)]
        return "; ".join(scan_flags(nb))

    assert "getattr on sys" in flags("import sys\nm = getattr(sys, 'mod' + 'ules')")
    assert "sys.modules" in flags("import sys\nx = sys.modules")
    assert "get_ipython" in flags("get_ipython().events.register('post_run_cell', print)")
    assert "assigns math.isclose" in flags("import math\nmath.isclose = max")
    assert "reaches" not in flags("def f(model):\n    return len(list(model.modules()))\n")
    cells = json.loads((ROOT / "labsupport" / "lab_checks.json").read_text(encoding="utf-8"))["labs"]
    for lab, entry in cells.items():  # the course's own answers to every exercise raise no flag
        exercises = {c["id"] for c in entry["cells"] if c["exercise"]}
        nb = nbformat.read(str(ROOT / "solutions" / f"{lab}.ipynb"), as_version=4)
        for cell in nb.cells:
            if cell.get("id") in exercises:
                assert "reaches" not in flags(cell.source), (lab, cell["id"])


def test_the_sandbox_bounds_processes_file_sizes_and_its_tmp():
    argv = Sandbox("bwrap", memory=2**30).wrap(["python"], ["/k", "/scratch"], "/scratch")
    limits = argv[argv.index("prlimit") + 1:argv.index("prlimit") + 4]
    assert limits[0] == f"--as={2**30}" and limits[1].startswith("--fsize=") and limits[2].startswith("--nproc=")
    if bwrap_sizes_tmpfs():
        assert argv[argv.index("/tmp") - 3:argv.index("/tmp")] == ["--size", str(2 * 2**30), "--tmpfs"]


@pytest.mark.skipif(not SANDBOX, reason=f"no sandbox here: {bwrap_problem()}")
def test_a_sandboxed_tmp_cannot_fill_the_memory(tmp_path, monkeypatch):
    import labsupport.course.sandbox as sandbox_module

    if not bwrap_sizes_tmpfs():
        pytest.skip("this bwrap cannot size a tmpfs")
    monkeypatch.setattr(sandbox_module, "TMP_LIMIT", 8 * 2**20)
    argv = Sandbox("bwrap").wrap(["sh", "-c", "head -c 50000000 /dev/zero > /tmp/big; wc -c < /tmp/big"],
                                 [str(tmp_path)], str(tmp_path))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert 0 < int(done.stdout.strip()) <= 8 * 2**20, done.stderr  # stopped at the limit


def test_outputs_past_the_limit_are_dropped_but_check_results_kept(monkeypatch):
    import labsupport.course.notebooks as notebooks

    monkeypatch.setattr(notebooks, "MAX_OUTPUT_BYTES", 2**20)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("for i in range(40):\n    print('x' * 100_000)"),
                nbformat.v4.new_code_cell("from IPython.display import display\n"
                                          f"display({{{MIME}: {PASS}}}, raw=True)")]
    run = notebooks.execute(nb, timeout=60, stop_on_error=False, quiet=True)
    kept = sum(len(o.get("text", "")) for o in nb.cells[0].outputs)
    assert kept < 2 * 2**20 and "outputs past 1 MiB were dropped" in nb.cells[0].outputs[-1]["text"]
    assert any("check-result" in key for o in nb.cells[1].outputs for key in o.get("data", {})), run.errors


def test_a_cell_added_under_a_course_cells_id_is_still_listed_as_not_run():
    from labsupport.course.manifest import load_course_cells
    from labsupport.course.splice import splice

    nb = nbformat.read(str(ROOT / "labs" / "04_roofline.ipynb"), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if c.get("id") == EXERCISE)
    added = nbformat.v4.new_code_cell(RIGHT)
    added["id"] = "04-roofline-020"  # the check cell's id, on a cell the learner added at the end
    nb.cells.append(added)
    nb.cells[at].source = WRONG
    spliced = splice(nb, load_course_cells("04_roofline"))
    assert spliced.learner == [EXERCISE] and any(e.startswith("04-roofline-020") for e in spliced.extra)
    assert "1 added cell(s) not run" in spliced.ignored()
