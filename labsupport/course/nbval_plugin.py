"""A pytest plugin that makes nbval strict enough to be the course's notebook test runner.

``make test`` runs every notebook under ``pytest --nbval-lax`` (see the README); the course's
``pyproject.toml`` loads this plugin (``-p labsupport.course.nbval_plugin``), and elsewhere
``pytest -p labsupport.course.nbval_plugin --nbval-lax FOLDER`` does. On top of nbval it makes sure that

* a cell that runs past ``--nbval-cell-timeout`` FAILS. nbval interrupts the kernel and usually
  fails the cell on the ``KeyboardInterrupt``, but a cell tagged ``raises-exception``, or one that
  catches the interrupt or finishes just after the limit, would pass;
* a learner's notebook runs up to the cell its metadata names (``labsupport.stops_at``, written by
  ``release``): that cell is expected to fail and every code cell after it is skipped. Release writes
  no ``raises-exception`` tag into learners' copies, because JupyterLab's Run All runs on past a cell
  so tagged; notebooks released before carry the tags, and nbval reads those itself;
* a cell expected to fail (``stops_at``, or tagged ``raises-exception``) really raises; in a
  learner's notebook it must fail because an exercise is not done (``NotImplementedError``, or a
  check saying so), not for another reason;
* a cell tagged ``nbval-check-output`` has a stored output to compare with (otherwise nbval
  silently compares nothing): record them with ``make record-outputs``;
* with pytest-xdist, all the cells of a notebook run on one worker (``--dist loadscope``), since
  they share one kernel;
* kernels draw figures off-screen (``MPLBACKEND=Agg``), as when outputs are recorded;
* the figures labs save to the class ledger (:mod:`labsupport.ledger`) go to a temporary folder,
  not to ``~/.labsupport/results``, unless ``LABSUPPORT_LEDGER`` names one.

Stored outputs are recorded in Triton's interpreter on a CPU; on a machine with a CUDA GPU the
problem sizes differ, so outputs are not compared there (``LABSUPPORT_NBVAL_COMPARE=1`` forces it).
``--nbval-all-cells`` ignores ``stops_at`` (and the ``raises-exception`` and ``nbval-skip`` tags), to
run a learner's finished notebook to its end.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from .stored_outputs import CHECK_OUTPUT, STOPS_AT

COMPARE_VAR = "LABSUPPORT_NBVAL_COMPARE"
LEDGER_VAR = "LABSUPPORT_LEDGER"  # labsupport.ledger.FOLDER_VAR (not imported: this plugin loads before torch)


def _nbval_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "options")


def _nbval_on(config) -> bool:
    return bool(getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False))


def pytest_addoption(parser):
    group = parser.getgroup("nbval")
    group.addoption("--nbval-all-cells", action="store_true",
                    help="run every cell of a learner notebook, past the cell where a fresh one stops "
                         "(its metadata's stops_at, or raises-exception and nbval-skip tags)")


def _compare_outputs() -> bool:
    if os.environ.get(COMPARE_VAR):
        return os.environ[COMPARE_VAR] not in ("0", "")
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


def pytest_configure(config):
    # every test run, notebooks or not: a lab's ledger.record() must not write to the user's folder
    if LEDGER_VAR not in os.environ:
        os.environ[LEDGER_VAR] = folder = tempfile.mkdtemp(prefix="labsupport-ledger-")
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    if not _nbval_on(config):
        return
    # nbval runs a notebook's cells in one kernel: they must not be spread over xdist workers
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadscope"
    # figures are not compared (nbval skips images) and the stored outputs were recorded without
    # them: kernels draw off-screen, so a figure cell's output is the same wherever this runs
    os.environ["MPLBACKEND"] = "Agg"
    config._labsupport_compare = _compare_outputs()


def pytest_report_header(config):
    if _nbval_on(config) and not getattr(config, "_labsupport_compare", True):
        return (f"nbval: stored outputs are not compared on a CUDA machine (they were recorded in Triton's "
                f"interpreter on a CPU); {COMPARE_VAR}=1 compares them anyway")
    return None


def _apply_stop(item) -> None:
    """In a learner notebook whose metadata names where a fresh copy stops (``stops_at``): expect
    that cell to fail and skip every code cell after it."""
    nb = getattr(item.parent, "nb", None)
    stop = nb.metadata.get("labsupport", {}).get(STOPS_AT) if nb is not None else None
    if not stop:
        return
    ids = [c.get("id") for c in nb.cells]
    if stop not in ids:
        raise pytest.UsageError(f"{item.parent.nodeid}: its metadata says it stops at cell {stop!r}, which it "
                                f"does not have: release the notebook again (make release)")
    here = next(i for i, c in enumerate(nb.cells) if c is item.cell)
    if here == ids.index(stop):
        item.options["check_exception"] = True
    elif here > ids.index(stop):
        item.options["skip"] = True


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _nbval_cell(item):
            continue
        item.add_marker(pytest.mark.notebook)
        _apply_stop(item)
        if config.getoption("nbval_all_cells", False):
            item.options["skip"] = False
            item.options["check_exception"] = False
        if item.options.get("skip"):
            item.add_marker(pytest.mark.skip(reason="after the cell where a fresh learner notebook stops (its "
                                                    "first exercise, which is not done)"))
        if not getattr(config, "_labsupport_compare", True):
            item.options["check"] = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = getattr(item.parent, "timed_out", False) if _nbval_cell(item) else False
    try:
        return (yield)
    finally:  # nbval sets timed_out on the notebook when this cell ran past its limit
        if _nbval_cell(item) and not before and getattr(item.parent, "timed_out", False):
            item._labsupport_timed_out = True


def _learner_notebook(item) -> bool:
    nb = getattr(item.parent, "nb", None)
    meta = nb.metadata.get("labsupport", {}) if nb is not None else {}
    return meta.get("version") == "student"


def _problem(item) -> str | None:
    """Why a cell nbval passed must fail after all, or None."""
    timeout = item.config.getoption("nbval_cell_timeout")
    if getattr(item, "_labsupport_timed_out", False):
        return (f"this cell ran past the {timeout:g} s cell timeout (--nbval-cell-timeout) and was "
                "interrupted: a timeout is a failure")
    errors = [o for o in (item.test_outputs or []) if o.get("output_type") == "error"]
    if item.options.get("check_exception"):
        if not errors:
            return ("this cell should fail (a fresh learner notebook stops here, or it is tagged raises-exception) "
                    "but ran without an error")
        if _learner_notebook(item):
            e = errors[0]
            not_done = e.get("ename") == "NotImplementedError" or (
                e.get("ename") == "CheckFailed" and "NotImplementedError" in e.get("evalue", ""))
            if not not_done:
                return (f"this learner notebook's first exercise should fail because it is not done, but it "
                        f"raised {e.get('ename')}: {e.get('evalue', '')[:500]}")
    tags = item.cell.get("metadata", {}).get("tags", [])
    if item.options.get("check") and CHECK_OUTPUT in tags and item.cell.get("execution_count") is None:
        return ("this cell is tagged nbval-check-output but the notebook stores no output for it, so nothing "
                "was compared: run `make record-outputs` (python -m labsupport release --record)")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and _nbval_cell(item) and report.passed:
        problem = _problem(item)
        if problem:
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid}: {problem}\n--- cell source ---\n{item.cell.source}"
    return report
