"""The notebook tests themselves run under nbval (``make test`` passes ``--nbval-lax`` with the
solutions/ and labs/ folders). This file tests that arrangement: the tags release writes, the
stored outputs, and that labsupport.course.nbval_plugin turns every way a cell can go wrong into a
failure (a timeout above all, which nbval alone can let pass).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from labsupport.course import stored_outputs
from labsupport.course.scan import check_calls

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9]*.ipynb"))
LABS = sorted((ROOT / "labs").glob("[0-9]*.ipynb"))


def _tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def test_there_are_labs():
    assert SOLUTIONS, "no solution notebooks found"
    assert [p.name for p in SOLUTIONS] == [p.name for p in LABS], "every solution needs a learner notebook"


def test_make_test_runs_the_notebooks_under_nbval():
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(NBVAL)" in test_recipe and "solutions labs" in test_recipe
    assert "--nbval-lax" in makefile and "--nbval-cell-timeout=" in makefile and "--dist loadscope" in test_recipe


def test_make_test_runs_every_book_test_once_the_book_is_built():
    """make test runs the tests that need no built book beside the book's build, then those marked
    ``book``, collected from $(BOOK_TESTS) only: a ``book`` test anywhere else would never run."""
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert '-m "not book" tests solutions labs' in test_recipe and "-m book $(BOOK_TESTS)" in test_recipe
    folders = next(line for line in makefile.splitlines() if line.startswith("BOOK_TESTS :=")).split(":=")[1].split()
    marked = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
              if re.search(r"pytest\.mark\.book\b", p.read_text(encoding="utf-8"))]
    assert marked, "no test is marked book"
    outside = [p for p in marked if not any(p == f or p.startswith(f.rstrip("/") + "/") for f in folders)]
    assert not outside, f"marked book but not under BOOK_TESTS ({' '.join(folders)}) in the Makefile: {outside}"


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_learner_notebook_names_where_it_stops_and_carries_no_nbval_tags(path):
    """nbval learns where a fresh learner notebook stops from its metadata; the cells carry no
    ``raises-exception`` tag, which JupyterLab's Run All would run past (see tests/notebooks/test_run_all.py)."""
    nb = nbformat.read(str(path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    first_stub = next(i for i, c in enumerate(code) if "raise NotImplementedError" in c.source)
    first_check = next(i for i, c in enumerate(code) if i >= first_stub and check_calls(c.source))
    assert nb.metadata["labsupport"][stored_outputs.STOPS_AT] == code[first_check].id, path.name
    tagged = [i for i, c in enumerate(code) if {stored_outputs.RAISES, stored_outputs.SKIP} & set(_tags(c))]
    assert not tagged, f"{path.name}: nbval tags on code cells {tagged}"
    assert not any(c.get("outputs") for c in code), f"{path.name}: a learner notebook carries outputs"
    assert not any(stored_outputs.CHECK_OUTPUT in _tags(c) for c in code)


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_notebook_compares_every_check_against_a_stored_pass_line(path):
    nb = nbformat.read(str(path), as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and check_calls(c.source)]
    assert checks, f"{path.name}: no check cells"
    for cell in checks:
        assert stored_outputs.CHECK_OUTPUT in _tags(cell), f"{path.name}: `{cell.source[:40]}` is not compared"
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert cell.execution_count is not None and text.startswith("PASSED check_"), (
            f"{path.name}: `{cell.source[:40]}` has no stored PASSED line: run `make record-outputs`")
    # only compared cells carry outputs; nothing that varies (timings) is stored
    for cell in nb.cells:
        if cell.cell_type == "code" and stored_outputs.CHECK_OUTPUT not in _tags(cell):
            assert not cell.outputs and cell.execution_count is None


# --- the plugin, on small notebooks run by nbval in a pytest of their own ----------------------

def _notebook(path: Path, cells: list[tuple[str, list[str], list[dict] | None]], student=False,
              stops_at: int | None = None) -> None:
    nb = nbformat.v4.new_notebook()
    for number, (source, tags, outputs) in enumerate(cells, start=1):
        cell = nbformat.v4.new_code_cell(source)
        cell.id = f"cell-{number - 1}"
        if tags:
            cell.metadata["tags"] = tags
        if outputs is not None:
            cell.outputs = [nbformat.from_dict(o) for o in outputs]
            cell.execution_count = number
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if student:
        nb.metadata["labsupport"] = {"version": "student"}
        if stops_at is not None:
            nb.metadata["labsupport"][stored_outputs.STOPS_AT] = f"cell-{stops_at}"
    nbformat.write(nb, str(path))


class _NbvalRun:
    """``pytest --nbval-lax`` on ``folder`` in a fresh process, started at once; :meth:`outcomes`
    waits for it and returns {test id: outcome}, with ``_output`` its stdout and stderr."""

    def __init__(self, folder: Path, name: str, *extra: str, plugin: bool = True) -> None:
        self.report = folder / f"report-{name}.xml"
        self.log = folder / f"output-{name}.txt"
        cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=3",
               "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", f"--junitxml={self.report}",
               "--rootdir", str(folder), *extra, str(folder)]
        if plugin:
            cmd[3:3] = ["-p", "labsupport.course.nbval_plugin"]
        with open(self.log, "w") as log:  # a file, not a pipe: nothing blocks while no one reads it
            self.process = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, text=True)
        self._outcomes: dict[str, str] | None = None

    def outcomes(self) -> dict[str, str]:
        if self._outcomes is None:
            self.process.wait(timeout=300)
            outcomes = {}
            for case in ET.parse(self.report).getroot().iter("testcase"):
                kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
                outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind  # rootdir is the folder
            outcomes["_output"] = self.log.read_text()
            self._outcomes = outcomes
        return self._outcomes

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


HANG = "import time\ntime.sleep(60)"
SWALLOW = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass  # a loop that 'handles' Ctrl+C"


@pytest.fixture(scope="module")
def plugin_cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nbval_cases")
    _notebook(folder / "hang.ipynb", [("x = 1", [], None), (HANG, [], None)])
    _notebook(folder / "swallow.ipynb", [(SWALLOW, [], None)])
    _notebook(folder / "hang_tagged.ipynb", [(HANG, ["raises-exception"], None)])
    stored = [{"output_type": "stream", "name": "stdout", "text": "4\n"}]
    _notebook(folder / "outputs.ipynb", [
        ("print(2 + 2)", ["nbval-check-output"], stored),  # same as stored: passes
        ("print(2 + 3)", ["nbval-check-output"], stored),  # differs: fails
        ("print(7)", ["nbval-check-output"], None),  # tagged, nothing stored: fails
        ("import time; print(time.time())", [], None),  # untagged: never compared
    ])
    _notebook(folder / "learner.ipynb", [
        ("def f():\n    raise NotImplementedError('Exercise')", [], None),
        ("f()", ["raises-exception"], None),  # not done: the expected failure
        ("print('after')", ["nbval-skip"], None),
    ], student=True)
    _notebook(folder / "learner_stops.ipynb", [
        ("def f():\n    raise NotImplementedError('Exercise')", [], None),
        ("f()", [], None),  # not done: the expected failure, named by the metadata
        ("print('after')", [], None),
    ], student=True, stops_at=1)
    _notebook(folder / "learner_stops_no_error.ipynb", [("x = 1", [], None), ("y = 2", [], None)],
              student=True, stops_at=0)
    _notebook(folder / "learner_other_error.ipynb", [("1 / 0", ["raises-exception"], None)], student=True)
    _notebook(folder / "learner_no_error.ipynb", [("x = 1", ["raises-exception"], None)], student=True)
    return folder


@pytest.fixture(scope="module")
def nbval_runs(plugin_cases):
    """The three nbval runs the tests below read, started together: most of each is cells sleeping
    until their 3 s timeout, so side by side they take about as long as the longest one alone."""
    runs = {
        "plugin": _NbvalRun(plugin_cases, "plugin"),
        "bare": _NbvalRun(plugin_cases, "bare", "-k", "swallow or hang_tagged", plugin=False),
        "all_cells": _NbvalRun(plugin_cases, "all_cells", "--nbval-all-cells", "-k",
                               "learner and not other and not no_error"),
    }
    yield runs
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="module")
def with_plugin(nbval_runs):
    return nbval_runs["plugin"].outcomes()


def _outcome(results, name):
    found = {k: v for k, v in results.items() if k.startswith(name)}
    assert found, f"{name} not in the report: {sorted(results)}\n{results['_output'][-3000:]}"
    return found


@pytest.mark.notebook
def test_a_hung_cell_fails(with_plugin):
    assert _outcome(with_plugin, "hang.ipynb::Cell 1") == {"hang.ipynb::Cell 1": "failure"}
    assert "Timeout of 3 seconds exceeded" in with_plugin["_output"] or "cell timeout" in with_plugin["_output"]


@pytest.mark.notebook
def test_a_cell_that_swallows_the_interrupt_still_fails_on_timeout(with_plugin):
    assert _outcome(with_plugin, "swallow.ipynb::Cell 0") == {"swallow.ipynb::Cell 0": "failure"}
    assert "ran past the 3 s cell timeout" in with_plugin["_output"]


@pytest.mark.notebook
def test_a_hung_cell_tagged_raises_exception_fails(with_plugin):
    assert _outcome(with_plugin, "hang_tagged.ipynb::Cell 0") == {"hang_tagged.ipynb::Cell 0": "failure"}


@pytest.mark.notebook
def test_without_the_plugin_nbval_lets_timeouts_pass(nbval_runs):
    """Why the plugin exists. If this starts failing, nbval fixed it and the guard may go."""
    bare = nbval_runs["bare"].outcomes()
    assert _outcome(bare, "swallow.ipynb::Cell 0") == {"swallow.ipynb::Cell 0": "passed"}
    assert _outcome(bare, "hang_tagged.ipynb::Cell 0") == {"hang_tagged.ipynb::Cell 0": "passed"}


@pytest.mark.notebook
def test_stored_outputs_are_compared(with_plugin):
    assert _outcome(with_plugin, "outputs.ipynb") == {
        "outputs.ipynb::Cell 0": "passed",
        "outputs.ipynb::Cell 1": "failure",
        "outputs.ipynb::Cell 2": "failure",
        "outputs.ipynb::Cell 3": "passed",
    }
    assert "Cell outputs differ" in with_plugin["_output"]
    assert "stores no output for it" in with_plugin["_output"]


@pytest.mark.notebook
def test_learner_notebook_must_stop_because_the_exercise_is_not_done(with_plugin):
    assert _outcome(with_plugin, "learner.ipynb") == {
        "learner.ipynb::Cell 0": "passed", "learner.ipynb::Cell 1": "passed", "learner.ipynb::Cell 2": "skipped"}
    assert _outcome(with_plugin, "learner_other_error.ipynb") == {"learner_other_error.ipynb::Cell 0": "failure"}
    assert "raised ZeroDivisionError" in with_plugin["_output"]
    assert _outcome(with_plugin, "learner_no_error.ipynb") == {"learner_no_error.ipynb::Cell 0": "failure"}


@pytest.mark.notebook
def test_learner_notebook_stops_where_its_metadata_says(with_plugin):
    assert _outcome(with_plugin, "learner_stops.ipynb") == {
        "learner_stops.ipynb::Cell 0": "passed", "learner_stops.ipynb::Cell 1": "passed",
        "learner_stops.ipynb::Cell 2": "skipped"}
    assert _outcome(with_plugin, "learner_stops_no_error") == {
        "learner_stops_no_error.ipynb::Cell 0": "failure", "learner_stops_no_error.ipynb::Cell 1": "skipped"}


@pytest.mark.notebook
def test_all_cells_switch_runs_past_the_first_exercise(nbval_runs):
    results = nbval_runs["all_cells"].outcomes()
    assert _outcome(results, "learner.ipynb") == {
        "learner.ipynb::Cell 0": "passed", "learner.ipynb::Cell 1": "failure", "learner.ipynb::Cell 2": "passed"}
    assert _outcome(results, "learner_stops.ipynb") == {
        "learner_stops.ipynb::Cell 0": "passed", "learner_stops.ipynb::Cell 1": "failure",
        "learner_stops.ipynb::Cell 2": "passed"}


def test_recorded_outputs_file_matches_the_solution_notebooks():
    for path in SOLUTIONS:
        recording = json.loads(stored_outputs.path_for(ROOT, path.stem).read_text())
        assert recording["recorded_with"]["where"].startswith("CPU, Triton interpreter")
        nb = nbformat.read(str(path), as_version=4)
        assert len(recording["cells"]) == len(stored_outputs.compared_cells(nb)), path.name
