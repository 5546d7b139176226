"""grade: the cheats of issue 9, each a planted submission graded end to end, sandbox on.

The grader runs as its own process (``python -m labsupport grade``), as an instructor runs it, over a
folder of lab 04 notebooks made from the course's released ``labs/04_roofline.ipynb``: the exercise
cell filled in by a learner, some of them cheating. Each cheat is either prevented (its score is
what the honest part of its answer earns, and nobody else's changes) or flagged; each test says which.
The cheats that would harm this machine without a sandbox (rewriting the course's checks on disk,
deleting files, signalling the grader) are only planted when bubblewrap works here.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from labsupport.course.sandbox import bwrap_problem

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "labsupport" / "checks" / "framework.py"
EXERCISE = "04-roofline-019"
CHECK_CELL = "04-roofline-020"
SANDBOX = not bwrap_problem()
needs_bwrap = pytest.mark.skipif(not SANDBOX, reason=f"no sandbox here: {bwrap_problem()}")
pytestmark = pytest.mark.notebook  # starts Jupyter kernels

RIGHT = ("def arithmetic_intensity(m, k, n, dtype_bytes):\n"
         "    return 2 * m * k * n / (dtype_bytes * (m * k + k * n + m * n))\n")
WRONG = "def arithmetic_intensity(m, k, n, dtype_bytes):\n    return 1.0\n"
PASS_LINE = ('{"check": "check_arithmetic_intensity", "passed": true, "points": 5, "max_points": 5, '
             '"cases": 1, "message": "", "reason": ""}')
MARKER = "grader-cmdline-marker"  # in the grader's command line (its --csv path)

CHEATS = {
    # the framework found through sys.modules, its recorder through getattr: a pass in the exercise cell
    "record": f"""import sys
fw = next(m for n, m in list(sys.modules.items()) if n.endswith('checks.framework'))
getattr(fw, '_rec' + 'ord')(fw.CheckResult('check_arithmetic_intensity', True, 5, 5, 1))
{WRONG}""",
    # ... and from inside the function the check calls, so the forged pass comes from the check cell
    "record_in_check": """import sys
def arithmetic_intensity(m, k, n, dtype_bytes):
    fw = next(m for n, m in list(sys.modules.items()) if n.endswith('checks.framework'))
    getattr(fw, '_rec' + 'ord')(fw.CheckResult('check_arithmetic_intensity', True, 5, 5, 1))
    return 1.0
""",
    # replaces the framework's recorder in memory, so that every result it records is a pass
    "patch": f"""import dataclasses, sys
fw = sys.modules['labsupport.checks.framework']
original = getattr(fw, '_rec' + 'ord')
def always(result):
    original(dataclasses.replace(result, passed=True, points=result.max_points, reason='', message=''))
setattr(fw, '_rec' + 'ord', always)
{WRONG}""",
    # rebinds the check's name in the notebook to a fake that reports a pass
    "rebind": f"""import json
from IPython.display import display
def fake(fn):
    display({{'application/vnd.labsupport.check-result+json': json.loads({PASS_LINE!r})}}, raw=True)
globals()['check_' + 'arithmetic_intensity'] = fake
{WRONG}""",
    # an edited check cell, and an added cell that redefines the answer after the exercise: neither runs
    "edited": WRONG,
    # reads the grader's command line from /proc: the right answer only if it saw the grader
    "proc": f"""import os
seen = b''
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            seen += open(f'/proc/{{pid}}/cmdline', 'rb').read()
        except OSError:
            pass
found = b'{MARKER}' in seen
def arithmetic_intensity(m, k, n, dtype_bytes):
    if found:
        return 2 * m * k * n / (dtype_bytes * (m * k + k * n + m * n))
    return 1.0
""",
}
HARMFUL = {  # only with a sandbox: without one they would do what they say
    # appends a passing line to every results file it can find: paths in os.environ, files in /tmp
    "env": f"""import glob, os
for value in list(os.environ.values()) + glob.glob('/tmp/**', recursive=True):
    if os.path.isfile(value) and (value.endswith('.jsonl') or 'result' in os.path.basename(value)):
        try:
            with open(value, 'a') as f:
                f.write({PASS_LINE!r} + '\\n')
        except OSError:
            pass
{WRONG}""",
    # appends failures to the other notebooks' results (any file below /tmp whose name says results)
    "other": """import glob
for path in glob.glob('/tmp/**/*result*', recursive=True):
    try:
        with open(path, 'a') as f:
            f.write('{"check": "check_arithmetic_intensity", "passed": false, "reason": "failed"}\\n')
    except OSError:
        pass
""" + RIGHT,
    # rewrites the course's checks on disk so that every check passes, in every later kernel too
    "disk": f"""import importlib, labsupport.checks.framework as fw
try:
    source = open(fw.__file__).read()
    with open(fw.__file__, 'w') as f:
        f.write(source.replace('body(fn, checker, *args, **kwargs)', 'pass'))
    importlib.reload(fw)
except OSError as exc:
    print('could not rewrite the checks:', exc)
{WRONG}""",
    # deletes the other students' submissions
    "delete": """import glob, os, shutil
for path in glob.glob(FOLDER + '/*'):
    if 'delete' not in path:
        try:
            os.remove(path)
        except OSError:
            pass
shutil.rmtree(FOLDER, ignore_errors=True)
""" + WRONG,
    # kills the grader (the processes whose command line names it, and its own parent)
    "kill": f"""import os, signal
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            if b'{MARKER}' in open(f'/proc/{{pid}}/cmdline', 'rb').read():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
try:
    os.kill(os.getppid(), signal.SIGKILL)
except OSError:
    pass
{WRONG}""",
    # leaves a process behind that rewrites grades.csv once the grader is done
    "leftover": """import subprocess, sys
later = 'import sys, time; time.sleep(3); open(sys.argv[1], "w").write("FORGED BY A LEFTOVER")'
subprocess.Popen([sys.executable, '-c', later, CSV], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
""" + WRONG,
}
HONEST = {"good": RIGHT, "wrong": WRONG}


def _submission(path: Path, exercise: str, **replace: str) -> None:
    nb = nbformat.read(str(ROOT / "labs" / "04_roofline.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.get("id") == EXERCISE:
            cell.source = exercise
        elif cell.get("id") in replace:
            cell.source = replace[cell["id"]]
    if path.stem.startswith("edited"):
        at = next(i for i, c in enumerate(nb.cells) if c.get("id") == EXERCISE)
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(RIGHT))  # a learner's added cell
    nbformat.write(nb, str(path))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("sandbox")
    folder = base / "submissions"
    folder.mkdir()
    csv_path = base / f"{MARKER}.csv"
    cheats = {**CHEATS, **(HARMFUL if SANDBOX else {}), **HONEST}
    for name, source in cheats.items():
        source = source.replace("FOLDER", repr(str(folder))).replace("CSV", repr(str(csv_path)))
        replace = {CHECK_CELL: "print('PASSED check_arithmetic_intensity')"} if name == "edited" else {}
        _submission(folder / f"{name}_04_roofline.ipynb", source, **replace)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    framework = FRAMEWORK.read_bytes()
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "labsupport", "grade", str(folder), "--csv", str(csv_path),
                               "-j", "2", "--timeout", "120"], cwd=base, capture_output=True, text=True,
                              timeout=900)
    finally:
        tampered = FRAMEWORK.read_bytes() != framework
        if tampered:  # never leave the checkout changed, even when the test fails
            FRAMEWORK.write_bytes(framework)
    seconds = time.perf_counter() - start
    time.sleep(5 if SANDBOX else 0)  # the leftover process would write by now
    text = csv_path.read_text(encoding="utf-8") if csv_path.exists() else ""
    rows = {r["notebook"].rsplit("/", 1)[-1].split("_04_")[0]: r for r in csv.DictReader(text.splitlines())}
    after = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}
    return {"done": done, "rows": rows, "before": before, "after": after, "tampered": tampered,
            "seconds": seconds, "text": text}


def _row(graded, name):
    assert name in graded["rows"], (graded["done"].stderr[-3000:], graded["text"][:2000])
    return graded["rows"][name]


def test_the_grader_finishes_and_scores_honest_work(graded):
    assert graded["done"].returncode == 0, graded["done"].stderr[-3000:]
    assert (_row(graded, "good")["status"], _row(graded, "good")["points"]) == ("passed", "5")
    assert (_row(graded, "wrong")["status"], _row(graded, "wrong")["points"]) == ("failed", "0")
    assert _row(graded, "good")["learner_cells"] == EXERCISE and _row(graded, "good")["flags"] == ""
    expected = "bwrap" if SANDBOX else "UNSANDBOXED"
    assert all(r["sandbox"].startswith(expected) for r in graded["rows"].values())


@needs_bwrap
def test_a_results_line_appended_through_os_environ_does_not_count(graded):
    """Prevented: there is no results file; results are the check cells' outputs."""
    row = _row(graded, "env")
    assert (row["status"], row["points"]) == ("failed", "0")


def test_a_result_recorded_through_sys_modules_is_flagged_and_ignored(graded):
    row = _row(graded, "record")
    assert (row["status"], row["points"]) == ("failed", "0")
    assert f"forged result: check_arithmetic_intensity reported as passed from the learner's cell {EXERCISE}" \
        in row["flags"]
    inside = _row(graded, "record_in_check")
    assert (inside["status"], inside["points"]) == ("failed", "0")
    assert f"check_arithmetic_intensity reported 2 times in cell {CHECK_CELL}" in inside["flags"]


def test_a_recorder_patched_in_memory_is_flagged_and_scores_nothing(graded):
    row = _row(graded, "patch")
    assert (row["status"], row["points"]) == ("failed", "0")
    assert "tampered in memory: labsupport.checks.framework._record comes from" in row["flags"]
    assert "reported passed in cell 04-roofline-020, which then failed" in row["flags"]


def test_a_check_rebound_in_the_notebook_is_not_the_one_called(graded):
    row = _row(graded, "rebind")
    assert (row["status"], row["points"]) == ("failed", "0")  # the check cell imports the check afresh


def test_an_edited_check_cell_and_an_added_cell_do_not_run_and_are_reported(graded):
    row = _row(graded, "edited")
    assert (row["status"], row["points"]) == ("failed", "0")  # the course's check ran on the exercise cell
    assert "1 added cell(s) not run" in row["ignored"]
    assert f"1 edited course cell(s) ignored (the course's version ran): {CHECK_CELL}" in row["ignored"]


@needs_bwrap
def test_failures_appended_for_another_notebook_change_nothing(graded):
    assert _row(graded, "other")["points"] == "5"
    assert _row(graded, "good")["points"] == "5"


@needs_bwrap
def test_the_graders_command_line_cannot_be_read_from_proc(graded):
    row = _row(graded, "proc")  # its answer is right only if it saw the grader's command line
    assert (row["status"], row["points"]) == ("failed", "0")


@needs_bwrap
def test_rewriting_the_checks_on_disk_fails_and_later_notebooks_grade_right(graded):
    assert not graded["tampered"]
    assert _row(graded, "disk")["points"] == "0"
    assert _row(graded, "wrong")["points"] == "0"  # graded after: the checks it ran were the course's


@needs_bwrap
def test_other_students_submissions_cannot_be_deleted(graded):
    assert graded["after"] == graded["before"]


@needs_bwrap
def test_the_grader_cannot_be_killed(graded):
    assert graded["done"].returncode == 0
    assert _row(graded, "kill")["points"] == "0"
    assert len(graded["rows"]) == len({**CHEATS, **HARMFUL, **HONEST})


@needs_bwrap
def test_no_process_outlives_the_grader_to_rewrite_the_grades(graded):
    assert "FORGED BY A LEFTOVER" not in graded["text"] and graded["text"].startswith("notebook,student,lab,")
    assert _row(graded, "leftover")["points"] == "0"


def test_every_planted_notebook_is_graded_once(graded):
    """One row per notebook (lab 04 has one check), none missing, none twice. The time is printed
    for the report, not checked (the CPU is shared)."""
    planted = {**CHEATS, **(HARMFUL if SANDBOX else {}), **HONEST}
    names = [r["notebook"].rsplit("/", 1)[-1].split("_04_")[0] for r in csv.DictReader(graded["text"].splitlines())]
    assert sorted(names) == sorted(planted), graded["done"].stderr[-3000:]
    print(json.dumps({"notebooks": len(graded["rows"]), "seconds": round(graded["seconds"], 1)}))
