"""release writes nbval's tags and the stored outputs nbval compares; --check notices when they go stale."""

from __future__ import annotations

import json
import textwrap

import nbformat
import pytest

from labsupport.__main__ import main
from labsupport.course import stored_outputs
from labsupport.course.release import (
    ReleaseError,
    build_notebook,
    plan,
    record_outputs,
    release,
    stale,
    unrecorded,
)

SOURCE = textwrap.dedent(
    '''\
    # %%
    from labsupport.checks import check_vector_add

    # %% tags=["nbval-check-output"]
    print(2 + 2)

    # %%
    def add(x, y):
        # BEGIN SOLUTION
        return x + y
        # END SOLUTION

    # %%
    check_vector_add(add)

    # %%
    print("after the first exercise")

    # %%
    # BEGIN SOLUTION: set answer
    answer = 42
    # END SOLUTION
    '''
)


def _tags(nb) -> list[list[str]]:
    return [c.metadata.get("tags", []) for c in nb.cells]


@pytest.fixture
def course(tmp_path, monkeypatch):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    (tmp_path / "_toc.yml").write_text("root: x\n")
    (tmp_path / "solutions" / "01_demo.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _record(course, outputs_by_line: dict[str, str]) -> None:
    """Write a recording as `release --record` would, with the given stdout per compared cell."""
    nb = build_notebook(course / "solutions" / "01_demo.py", student=False)
    for i in stored_outputs.compared_cells(nb):
        first = nb.cells[i].source.splitlines()[0]
        nb.cells[i].outputs = [nbformat.v4.new_output("stream", name="stdout", text=outputs_by_line[first])]
    path = stored_outputs.path_for(course, "01_demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stored_outputs.render(nb, {"where": "CPU, Triton interpreter (test)"}))


RECORDED = {"print(2 + 2)": "4\n", "check_vector_add(add)": "PASSED check_vector_add: 10 cases, 10/10 points\n"}


def test_solution_compares_check_cells_and_tagged_cells(course):
    nb = build_notebook(course / "solutions" / "01_demo.py", student=False)
    assert _tags(nb) == [[], ["nbval-check-output"], [], ["nbval-check-output"], [], []]


def test_learner_notebook_stops_at_the_first_check_after_the_first_exercise(course):
    nb = build_notebook(course / "solutions" / "01_demo.py", student=True)
    assert _tags(nb) == [[]] * 6  # no raises-exception: JupyterLab's Run All would run past it
    assert nb.metadata["labsupport"]["stops_at"] == nb.cells[3].id == "01-demo-003"


def test_an_exercise_that_raises_at_the_top_level_is_itself_the_expected_failure(course):
    (course / "solutions" / "01_demo.py").write_text(
        "# %%\nx = 1\n\n# %%\n# BEGIN SOLUTION\ny = 2\n# END SOLUTION\n\n# %%\nprint(y)\n")
    nb = build_notebook(course / "solutions" / "01_demo.py", student=True)
    assert _tags(nb) == [[], [], []] and nb.metadata["labsupport"]["stops_at"] == nb.cells[1].id


def test_malformed_tags_are_reported_with_their_line(course):
    (course / "solutions" / "01_demo.py").write_text("# %%\nx = 1\n\n# %% tags=[nbval-check-output]\ny = 2\n")
    with pytest.raises(ReleaseError, match=r"01_demo.py:4: write cell tags as a JSON list"):
        plan(course)


def test_recorded_outputs_land_in_the_solution_notebook_only(course):
    _record(course, RECORDED)
    release(course, log=lambda *_: None)
    solution = nbformat.read(str(course / "solutions" / "01_demo.ipynb"), as_version=4)
    assert [c.outputs[0].text if c.get("outputs") else None for c in solution.cells] == [
        None, "4\n", None, RECORDED["check_vector_add(add)"], None, None]
    assert [c.execution_count for c in solution.cells] == [None, 2, None, 4, None, None]
    learner = nbformat.read(str(course / "labs" / "01_demo.ipynb"), as_version=4)
    assert not any(c.get("outputs") for c in learner.cells)
    assert stale(course) == [] and unrecorded(course) == [] and main(["release", "--check"]) == 0


def test_editing_a_compared_cell_drops_its_output_until_recorded_again(course, capsys):
    _record(course, RECORDED)
    release(course, log=lambda *_: None)
    src = course / "solutions" / "01_demo.py"
    src.write_text(src.read_text().replace("print(2 + 2)", "print(2 + 3)"))
    assert [p.status for p in plan(course) if p.target.name == "01_demo.ipynb"] == ["update", "update"]
    assert len(unrecorded(course)) == 1 and "print(2 + 3)" in unrecorded(course)[0]
    capsys.readouterr()
    assert main(["release", "--check"]) == 1
    assert "no stored output: solutions/01_demo.py: the cell starting `print(2 + 3)`" in capsys.readouterr().out
    assert main(["release"]) == 0  # writes the notebooks, and warns
    assert "warning: no stored output" in capsys.readouterr().out
    assert main(["release", "--check"]) == 1  # still unrecorded


def test_moving_a_cell_keeps_its_recorded_output(course):
    _record(course, RECORDED)
    src = course / "solutions" / "01_demo.py"
    src.write_text("# %%\nz = 0\n\n" + src.read_text())
    assert unrecorded(course) == []


def test_a_run_solution_notebook_is_still_someones_work(course):
    _record(course, RECORDED)
    release(course, log=lambda *_: None)
    target = course / "solutions" / "01_demo.ipynb"
    nb = nbformat.read(str(target), as_version=4)
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stdout", text="after\n")]  # untagged cell run
    nbformat.write(nb, str(target))
    src = course / "solutions" / "01_demo.py"
    src.write_text(src.read_text() + "\n# %%\nx = 1\n")
    assert [p.status for p in plan(course) if p.target == target] == ["learner-edited"]


@pytest.mark.notebook
def test_record_runs_the_solution_and_stores_the_compared_outputs(course):
    (course / "solutions" / "01_demo.py").write_text(
        '# %%\nimport time\n\n# %% tags=["nbval-check-output"]\nprint(6 * 7)\n\n# %%\nprint(time.time())\n')
    written = record_outputs(course, log=lambda *_: None, timeout=60)
    data = json.loads(written[0].read_text())
    assert [c["outputs"] for c in data["cells"]] == [[{"output_type": "stream", "name": "stdout", "text": "42\n"}]]
    assert data["recorded_with"]["where"].startswith("CPU, Triton interpreter")


@pytest.mark.notebook
def test_record_refuses_a_failing_solution(course):
    (course / "solutions" / "01_demo.py").write_text('# %% tags=["nbval-check-output"]\n1 / 0\n')
    with pytest.raises(ReleaseError, match="ZeroDivisionError"):
        record_outputs(course, log=lambda *_: None, timeout=60)
    assert not stored_outputs.path_for(course, "01_demo").exists()
