"""release: one source, two notebooks, and a learner's work is never overwritten."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import nbformat
import pytest

from labsupport.__main__ import main
from labsupport.release import ReleaseError, build_notebook, plan, release, stale

ROOT = Path(__file__).resolve().parent.parent

SOURCE = textwrap.dedent(
    '''\
    # header comment, not a cell

    # %% [markdown]
    # # Demo lab
    #
    # Some *prose*.
    # <!-- BEGIN SOLUTION -->
    # The answer is 42.
    # <!-- END SOLUTION -->

    # %%
    def double(x):
        # BEGIN SOLUTION: return twice x
        y = x * 2
        return y
        # END SOLUTION


    # %%
    print(double(2))
    '''
)


@pytest.fixture
def course(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    (tmp_path / "solutions" / "01_demo.py").write_text(SOURCE)
    return tmp_path


def test_student_and_solution_versions(course):
    student = build_notebook(course / "solutions" / "01_demo.py", student=True)
    solution = build_notebook(course / "solutions" / "01_demo.py", student=False)
    assert [c.cell_type for c in student.cells] == ["markdown", "code", "code"]
    assert student.cells[0].source == "# Demo lab\n\nSome *prose*."
    assert "42" in solution.cells[0].source and "BEGIN" not in solution.cells[0].source
    assert student.cells[1].source == 'def double(x):\n    raise NotImplementedError("Exercise: return twice x")'
    assert solution.cells[1].source == "def double(x):\n    y = x * 2\n    return y"
    assert student.metadata["labsupport"]["version"] == "student"


def test_release_writes_both_and_is_idempotent(course):
    release(course, log=lambda *_: None)
    assert (course / "labs" / "01_demo.ipynb").exists() and (course / "solutions" / "01_demo.ipynb").exists()
    assert stale(course) == []
    first = (course / "labs" / "01_demo.ipynb").read_text()
    release(course, log=lambda *_: None)
    assert (course / "labs" / "01_demo.ipynb").read_text() == first


def test_source_change_makes_notebooks_stale_and_release_updates_them(course):
    release(course, log=lambda *_: None)
    src = course / "solutions" / "01_demo.py"
    src.write_text(src.read_text().replace("print(double(2))", "print(double(3))"))
    assert {p.name for p in stale(course)} == {"01_demo.ipynb"} and len(stale(course)) == 2
    assert {p.status for p in plan(course) if p.target.suffix == ".ipynb"} == {"update"}
    release(course, log=lambda *_: None)
    assert stale(course) == []


def test_learner_work_is_not_overwritten(course):
    release(course, log=lambda *_: None)
    lab = course / "labs" / "01_demo.ipynb"
    nb = nbformat.read(str(lab), as_version=4)
    nb.cells[1].source = "def double(x):\n    return x + x  # my answer"
    nbformat.write(nb, str(lab))
    mine = lab.read_text()
    src = course / "solutions" / "01_demo.py"
    src.write_text(src.read_text() + "\n# %%\nprint('new cell')\n")
    with pytest.raises(ReleaseError, match="labs/01_demo.ipynb"):
        release(course, log=lambda *_: None)
    assert lab.read_text() == mine
    release(course, force=True, log=lambda *_: None)
    backups = list((course / "labs").glob("01_demo.ipynb.*.bak"))
    assert len(backups) == 1 and backups[0].read_text() == mine


def test_check_mode_tells_a_learner_their_notebook_is_safe(course, monkeypatch, capsys):
    monkeypatch.chdir(course)
    (course / "_toc.yml").write_text("root: x\n")
    release(course, log=lambda *_: None)
    lab = course / "labs" / "01_demo.ipynb"
    nb = nbformat.read(str(lab), as_version=4)
    nb.cells[1].source += "\n# my note"
    nbformat.write(nb, str(lab))
    mine = lab.read_text()
    assert main(["release", "--check"]) == 1
    out = capsys.readouterr().out
    assert "out of date: labs/01_demo.ipynb (learner-edited)" in out and "will not overwrite" in out
    assert "to regenerate them" not in out
    assert main(["release"]) == 2 and lab.read_text() == mine


def test_executed_notebook_counts_as_learner_work(course):
    release(course, log=lambda *_: None)
    lab = course / "labs" / "01_demo.ipynb"
    nb = nbformat.read(str(lab), as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="4\n")]
    nbformat.write(nb, str(lab))
    (course / "solutions" / "01_demo.py").write_text(SOURCE + "\n# %%\nx = 1\n")
    assert [p.status for p in plan(course) if p.target == lab] == ["learner-edited"]


@pytest.mark.parametrize(
    "body,message",
    [
        ("# %%\nx = 1\n# BEGIN SOLUTION\ny = 2\n", "never closed"),
        ("# %%\n# END SOLUTION\n", "without a BEGIN"),
        ("# %%\n# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "nested"),
        ("# %% [markdown]\nnot a comment\n", "must start with '#'"),
        ("print('no cells')\n", "no cells"),
    ],
)
def test_malformed_sources_are_reported_with_a_line(course, body, message):
    (course / "solutions" / "01_demo.py").write_text(body)
    with pytest.raises(ReleaseError, match=message):
        plan(course)


def test_release_writes_each_labs_checks_for_the_grader(course, monkeypatch, capsys):
    """labsupport/lab_checks.json (package data): what grade scores, even without solutions/."""
    (course / "solutions" / "02_checked.py").write_text(
        "# %%\nfrom labsupport.checks import check_vector_add\n\n# %%\n# check_arithmetic_intensity(f)\n"
        "check_vector_add(lambda x, y: x + y)\n"
    )
    release(course, log=lambda *_: None)
    manifest = json.loads((course / "labsupport" / "lab_checks.json").read_text())
    assert manifest["labs"] == {
        "01_demo": {"source": "solutions/01_demo.py", "checks": []},
        "02_checked": {"source": "solutions/02_checked.py", "checks": [{"check": "check_vector_add", "points": 10}]},
    }
    monkeypatch.chdir(course)
    (course / "_toc.yml").write_text("root: x\n")
    assert main(["release", "--check"]) == 0
    (course / "labsupport" / "lab_checks.json").write_text(json.dumps({"labs": {}}))
    assert main(["release", "--check"]) == 1
    assert "out of date: labsupport/lab_checks.json (update)" in capsys.readouterr().out
    assert main(["release"]) == 0 and stale(course) == []


@pytest.mark.parametrize(
    "body,version,line",
    [
        # a top-level marker indented: the learner's raise would start with indentation
        ("# %%\nx = 1\n    # BEGIN SOLUTION: set y\ny = 2\n    # END SOLUTION\n", "learner's", 3),
        ("# %%\ndef f(x):\n    # BEGIN SOLUTION\n    return x +\n    # END SOLUTION\n", "solution", 4),
    ],
)
def test_generated_cells_that_do_not_compile_stop_release(course, monkeypatch, capsys, body, version, line):
    (course / "solutions" / "01_demo.py").write_text(body)
    with pytest.raises(ReleaseError, match=rf"01_demo.py:{line}: the {version} version .* does not compile"):
        plan(course)
    monkeypatch.chdir(course)
    (course / "_toc.yml").write_text("root: x\n")
    assert main(["release"]) == 2 and main(["release", "--check"]) == 2
    assert "does not compile" in capsys.readouterr().err
    assert not (course / "labs" / "01_demo.ipynb").exists()


def test_cli_check_mode(course, monkeypatch, capsys):
    monkeypatch.chdir(course)
    (course / "_toc.yml").write_text("root: x\n")
    assert main(["release", "--check"]) == 1
    assert "out of date: labs/01_demo.ipynb" in capsys.readouterr().out
    assert main(["release"]) == 0
    assert main(["release", "--check"]) == 0
    assert main(["release", "99_nothing"]) == 2


def test_committed_notebooks_match_their_sources():
    """The drift test: labs/*.ipynb and solutions/*.ipynb are what release would write."""
    out_of_date = [str(p.relative_to(ROOT)) for p in stale(ROOT)]
    assert not out_of_date, f"run `python -m labsupport release`: {out_of_date}"


def test_every_learner_notebook_has_a_stub_and_no_solution_markers():
    for lab in sorted((ROOT / "labs").glob("[0-9]*.ipynb")):
        text = lab.read_text()
        assert "NotImplementedError" in text, lab.name
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, lab.name
        solution = ROOT / "solutions" / lab.name
        assert "BEGIN SOLUTION" not in solution.read_text(), solution.name


def test_released_copy_of_this_repo_round_trips(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions", ignore=shutil.ignore_patterns("*.ipynb"))
    release(tmp_path, log=lambda *_: None)
    for nb in (tmp_path / "labs").glob("*.ipynb"):
        assert nb.read_text() == (ROOT / "labs" / nb.name).read_text()
    manifest = "labsupport/lab_checks.json"
    assert (tmp_path / manifest).read_text() == (ROOT / manifest).read_text()


def test_every_lab_installs_from_the_repository_the_book_names():
    """The Colab fallback in each lab's setup cell and the book's launch buttons must agree."""
    import re

    import yaml

    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    for source in sorted((ROOT / "solutions").glob("[0-9]*.py")):
        found = re.findall(r'"git\+(https://[^"]+)"', source.read_text())
        assert found == [url], f"{source.name}: setup cell installs from {found}, _config.yml says {url}"


def test_commands_say_what_to_install_when_notebook_tools_are_missing(monkeypatch, capsys):
    import labsupport.__main__ as cli

    monkeypatch.setattr(cli, "_missing_tools", lambda: ["nbclient"])
    assert cli.main(["grade", "x.ipynb"]) == 2
    assert "pip install 'labsupport[grade]'" in capsys.readouterr().err
