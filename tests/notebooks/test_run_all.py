"""A learner presses Run All, as JupyterLab runs it (``jupyterlab_run_all.py`` beside this file): where
it stops and what the learner sees there.

Lab 13 is the example: a measurement runs before its first exercise, and the cell after that
exercise's check uses the learner's function, so a Run All that ran past the check (as it did when
learners' copies tagged it ``raises-exception``) would stop there with a long NotImplementedError.
``test_lab_order.py`` checks the same arrangement in every lab without running them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from jupyterlab_run_all import RAISES, Kernel  # beside this file

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "labs" / "13_decode_loop.ipynb"
SOLUTION = ROOT / "solutions" / "13_decode_loop.ipynb"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
pytestmark = pytest.mark.notebook


def _shown(run) -> list[str]:
    """The lines JupyterLab shows for a cell's error, without colour codes."""
    return ANSI.sub("", "\n".join(run.error["traceback"])).splitlines()


def _stop(nb) -> int:
    return [c.id for c in nb.cells].index(nb.metadata["labsupport"]["stops_at"])


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(cwd=LAB.parent)
    yield k
    k.close()


@pytest.fixture(scope="module")
def fresh(kernel):
    nb = nbformat.read(str(LAB), as_version=4)
    return nb, {run.index: run for run in kernel.run_all(nb.cells)}


def test_run_all_stops_at_the_first_exercise_check(fresh):
    nb, runs = fresh
    stop = _stop(nb)
    assert "check_sample(sample)" in nb.cells[stop].source
    assert [i for i, r in runs.items() if r.status == "ok"] == [i for i in runs if i < stop], {
        i: (r.status, r.error and r.error["evalue"][:200]) for i, r in runs.items()}
    assert runs[stop].status == "error"
    after = [r for i, r in runs.items() if i > stop]
    assert after and all(r.status == "aborted" and not r.outputs for r in after)


def test_the_learner_sees_a_short_message_pointing_at_their_stub(fresh):
    nb, runs = fresh
    shown = _shown(runs[_stop(nb)])
    assert shown[0].startswith("CheckFailed: check_sample: `sample` still raises NotImplementedError"), shown
    assert re.search(r"^Cell In\[\d+\], line \d+, in sample: raise NotImplementedError\(", "\n".join(shown), re.M)
    assert len(shown) <= 5 and not any("framework.py" in line or "Traceback" in line for line in shown), shown
    assert not any("LABSUPPORT_FULL_TRACEBACK" in line for line in shown), "not done needs no traceback switch"


def test_the_failed_cell_brings_itself_back_into_view(fresh):
    """Run All leaves JupyterLab's view at the last cell; the failed cell's script scrolls back to it."""
    nb, runs = fresh
    html = [o["data"].get("text/html", "") for o in runs[_stop(nb)].outputs if o["output_type"] == "display_data"]
    assert len(html) == 1 and "<script>" in html[0] and "scrollIntoView" in html[0]
    assert runs[_stop(nb)].outputs[0]["output_type"] == "error"  # the message first, the script under it
    others = [o for i, r in runs.items() if i != _stop(nb) for o in r.outputs if o["output_type"] == "display_data"]
    assert not any("scrollIntoView" in o["data"].get("text/html", "") for o in others)


def test_once_the_exercise_is_written_run_all_stops_at_the_next(fresh, kernel):
    """The learner fills in exercise 1 and presses Run All again, in the same kernel."""
    nb, _ = fresh
    solution = {c.id: c.source for c in nbformat.read(str(SOLUTION), as_version=4).cells}
    written = nbformat.read(str(LAB), as_version=4)
    exercise = next(c for c in written.cells if c.cell_type == "code" and "def sample(" in c.source)
    exercise.source = solution[exercise.id]
    runs = {run.index: run for run in kernel.run_all(written.cells)}
    stop = _stop(nb)
    assert runs[stop].status == "ok" and runs[stop].text().startswith("PASSED check_sample")
    failed = [i for i, r in runs.items() if r.status == "error"]
    assert len(failed) == 1 and "check_schedule_step(schedule_step)" in written.cells[failed[0]].source
    assert _shown(runs[failed[0]])[0].startswith("CheckFailed: check_schedule_step: `schedule_step` still raises")
    assert all(r.status == "ok" for i, r in runs.items() if i < failed[0])
    assert all(r.status == "aborted" for i, r in runs.items() if i > failed[0])


def test_a_raises_exception_tag_lets_run_all_run_on(kernel):
    """Why learners' copies carry no such tag: JupyterLab sends that cell with stop_on_error false."""
    stub = "def f():\n    raise NotImplementedError('Exercise')"
    cells = [nbformat.v4.new_code_cell(s) for s in (stub, "f()", "print('ran on')", "f()", "print('never')")]
    cells[1].metadata["tags"] = [RAISES]
    assert [r.status for r in kernel.run_all(cells)] == ["ok", "error", "ok", "error", "aborted"]
