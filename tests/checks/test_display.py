"""What a learner sees when a check fails in a notebook: the message, the hint and one pointer into
their own cell (where their code raised, or the definition that returned a wrong result), not the
check framework's traceback; the full traceback one switch away, and said so where it helps."""

from __future__ import annotations

import functools
import re

import nbformat
import pytest

from labsupport.checks import CheckFailed
from labsupport.checks._display import FULL_TRACEBACK_VAR, learner_view
from labsupport.course.notebooks import execute

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _shown(cell) -> list[str]:
    """The lines the notebook shows for the cell's error, without colour codes."""
    (error,) = [o for o in cell.outputs if o.output_type == "error"]
    return ANSI.sub("", "\n".join(error.traceback)).splitlines()


@pytest.fixture(scope="module")
def failed_checks():
    cells = [
        "from labsupport.checks import check_arithmetic_intensity\n"
        "def arithmetic_intensity(m, k, n, dtype_bytes):\n"
        "    raise NotImplementedError('Exercise: return FLOPs per byte')",
        "check_arithmetic_intensity(arithmetic_intensity)",
        "def flops_only(m, k, n, dtype_bytes):\n    return 2.0 * m * k * n\n\n"
        "check_arithmetic_intensity(flops_only)",
        f"%env {FULL_TRACEBACK_VAR}=1",
        "check_arithmetic_intensity(arithmetic_intensity)",
        f"%env {FULL_TRACEBACK_VAR}=0",
        "def helper(m):\n    return m / 0\n\n"
        "def divides(m, k, n, dtype_bytes):\n    return helper(m)\n\n"
        "check_arithmetic_intensity(divides)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    run = execute(nb, timeout=120, stop_on_error=False, quiet=True)
    assert not run.died and not run.timed_out
    return nb.cells


@pytest.mark.notebook
def test_not_done_shows_the_message_and_the_learners_raise(failed_checks):
    shown = _shown(failed_checks[1])
    assert shown[0].startswith("CheckFailed: check_arithmetic_intensity: `arithmetic_intensity` still raises "
                               "NotImplementedError"), shown
    assert "Cell In[1], line 3, in arithmetic_intensity: raise NotImplementedError('Exercise: return FLOPs " \
           "per byte')" in shown
    assert len(shown) <= 8, "\n".join(shown)
    assert not any("framework.py" in line or "site-packages" in line for line in shown)
    assert not any(FULL_TRACEBACK_VAR in line for line in shown), "the whole traceback shows only the check's code"


@pytest.mark.notebook
def test_wrong_answer_points_at_the_learners_function_not_the_check_call(failed_checks):
    shown = _shown(failed_checks[2])
    assert shown[0].startswith("CheckFailed: check_arithmetic_intensity: case [")
    assert any(line.startswith("Cell In[3], line 1: def flops_only(m, k, n, dtype_bytes):") for line in shown), shown
    assert not any("check_arithmetic_intensity(flops_only)" in line for line in shown), shown
    assert len(shown) <= 12 and not any("framework.py" in line for line in shown), "\n".join(shown)
    assert not any(FULL_TRACEBACK_VAR in line for line in shown)


@pytest.mark.notebook
def test_where_the_learners_code_raised_it_is_shown_with_the_switch(failed_checks):
    shown = _shown(failed_checks[6])
    assert shown[0].startswith("CheckFailed: check_arithmetic_intensity: `divides` raised ZeroDivisionError")
    assert any(line.startswith("Cell In[7], line 2, in helper: return m / 0") for line in shown), shown
    assert shown[-1] == f"(the whole traceback: %env {FULL_TRACEBACK_VAR}=1, then run this cell again)", shown


@pytest.mark.notebook
def test_full_traceback_is_one_switch_away(failed_checks):
    shown = _shown(failed_checks[4])
    assert any("framework.py" in line for line in shown), "the switch did not bring the traceback back"
    assert len(shown) > 15


def test_learner_view_without_ipython_names_the_file_of_the_learners_code(tmp_path, monkeypatch):
    monkeypatch.delenv(FULL_TRACEBACK_VAR, raising=False)
    code = compile("def mine():\n    raise NotImplementedError('todo')\n", str(tmp_path / "mine.py"), "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        try:
            scope["mine"]()
        except NotImplementedError as exc:
            raise CheckFailed("check_x: not done") from exc
    except CheckFailed as exc:
        failure = exc
    lines = failure._render_traceback_()
    assert ANSI.sub("", lines[0]) == "CheckFailed: check_x: not done"
    assert ANSI.sub("", lines[1]).strip() == "mine.py, line 2, in mine"  # no source line: exec'd code
    assert len(lines) == 2  # not the learner's own error: no traceback switch
    failure.learner_raised = True
    assert learner_view(failure, lambda f: False)[-1].endswith("run this cell again)\x1b[0m")
    monkeypatch.setenv(FULL_TRACEBACK_VAR, "1")
    assert not hasattr(failure, "_render_traceback_")


def test_a_wrong_result_points_at_the_definition_of_a_function_class_or_instance(tmp_path):
    from labsupport.checks._display import definition

    source = "import functools\n\nclass Allocator:\n    x = 1\n\n    def allocate(self, n):\n        return n\n\n" \
             "def fn(a):\n    return a\n"
    path = tmp_path / "learner.py"
    path.write_text(source)
    scope: dict = {}
    exec(compile(source, str(path), "exec"), scope)
    mine = lambda filename: filename == str(path)
    assert definition(scope["fn"], mine).lineno == 9 and definition(scope["fn"], mine).line == "def fn(a):"
    assert definition(functools.partial(scope["fn"], 1), mine).lineno == 9
    assert (definition(scope["Allocator"], mine).lineno, definition(scope["Allocator"], mine).line) == (
        3, "class Allocator:")
    assert definition(scope["Allocator"](), mine).lineno == 3
    assert definition(scope["Allocator"]().allocate, mine).lineno == 6
    assert definition(len, mine) is None and definition(scope["fn"], lambda f: False) is None
