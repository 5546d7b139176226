"""release: one source, two notebooks, and a learner's work is never overwritten."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import nbformat
import pytest

from labsupport.course import stored_outputs
from labsupport.course.cli import main
from labsupport.course.release import ReleaseError, build_notebook, plan, release, stale

ROOT = Path(__file__).resolve().parents[2]

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


def test_a_long_stub_says_what_to_write_in_comments_above_one_short_raise():
    from labsupport.course.sources import STUB_SHORT, STUB_WIDTH, stub_lines

    what = "count pairs inside the chunks of pretokenize(text), merge the most frequent (ties: smallest), repeat"
    lines = stub_lines("        ", what)
    assert all(len(line) <= STUB_WIDTH for line in lines) and len(lines) >= 3
    assert lines[-1] == f'        raise NotImplementedError("{STUB_SHORT}")'
    assert all(line.startswith("        # ") for line in lines[:-1])
    assert " ".join(line.strip()[2:] for line in lines[:-1]) == f"Exercise: {what}"
    assert stub_lines("", "set answer") == ['raise NotImplementedError("Exercise: set answer")']


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
    # both notebooks, and lab_checks.json, which holds the learner notebook's code cells for the grader
    assert {p.name for p in stale(course)} == {"01_demo.ipynb", "lab_checks.json"} and len(stale(course)) == 3
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
    cells = {lab: entry.pop("cells") for lab, entry in manifest["labs"].items()}
    assert [(c["id"], c["exercise"], c.get("defines")) for c in cells["01_demo"]][:1] == [
        ("01-demo-001", True, ["double"])]  # the learner's notebook's code cells, the exercise marked
    assert [c["source"] for c in cells["02_checked"]] == [
        "from labsupport.checks import check_vector_add", "# check_arithmetic_intensity(f)\ncheck_vector_add(lambda x, y: x + y)"]
    assert manifest["labs"] == {
        "01_demo": {"source": "solutions/01_demo.py", "checks": []},
        "02_checked": {"source": "solutions/02_checked.py", "checks": [{"check": "check_vector_add", "points": 10}]},
    }
    monkeypatch.chdir(course)
    (course / "_toc.yml").write_text("root: x\n")
    # the check cell's output is compared by nbval: store one, as `release --record` would
    checked = build_notebook(course / "solutions" / "02_checked.py", student=False)
    for i in stored_outputs.compared_cells(checked):
        checked.cells[i].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASSED\n")]
    stored_outputs.path_for(course, "02_checked").parent.mkdir(parents=True)
    stored_outputs.path_for(course, "02_checked").write_text(stored_outputs.render(checked, {}))
    release(course, log=lambda *_: None)
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
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")  # the setup cell's repository address
    release(tmp_path, log=lambda *_: None)
    for nb in (tmp_path / "labs").glob("*.ipynb"):
        assert nb.read_text() == (ROOT / "labs" / nb.name).read_text()
    manifest = "labsupport/lab_checks.json"
    assert (tmp_path / manifest).read_text() == (ROOT / manifest).read_text()


def _setup_code(nb) -> str:
    return next(c.source for c in nb.cells if c.cell_type == "code")


def test_every_lab_installs_from_the_repository_the_book_names():
    """The Colab fallback in each lab's setup cell and the book's launch buttons must agree: the setup
    cell is written once (labsupport.course.sources.SETUP_CELL) and release puts _config.yml's
    repository.url into it."""
    import re

    import yaml

    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    sources = sorted((ROOT / "solutions").glob("[0-9]*.py"))
    assert sources
    for source in sources:
        assert source.read_text().count("\n# %% [setup]\nimport labsupport\n\nsettings = labsupport.setup()\n") == 1, \
            f"{source.name}: no single setup cell"
        assert "git+" not in source.read_text(), f"{source.name}: the setup cell is written by release, not by hand"
        for folder in ("labs", "solutions"):
            nb = nbformat.read(str(ROOT / folder / f"{source.stem}.ipynb"), as_version=4)
            found = re.findall(r'"git\+(https://[^"]+)"', _setup_code(nb))
            assert found == [url], f"{folder}/{source.stem}: setup cell installs from {found}, _config.yml says {url}"
            assert "labsupport.setup()" in _setup_code(nb)


def test_the_setup_cell_follows_the_repository_in_config(tmp_path):
    (tmp_path / "solutions").mkdir()
    source = tmp_path / "solutions" / "00_demo.py"
    source.write_text("# %% [markdown]\n# # Demo\n\n# %% [setup]\n\n# %%\nprint(settings)\n")
    (tmp_path / "_config.yml").write_text("title: x\nrepository:\n  url: https://github.com/someone/fork  # mine\n"
                                          "  branch: main\nlaunch_buttons:\n  colab_url: x\n")
    nb = build_notebook(source, student=True)
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code"]
    assert 'course = "git+https://github.com/someone/fork"' in nb.cells[1].source
    compile(nb.cells[1].source, "setup", "exec")
    (tmp_path / "_config.yml").write_text("title: x\n")
    with pytest.raises(ReleaseError, match="repository.url"):
        build_notebook(source, student=True)
    source.write_text("# %% [setup]\nimport os\n\n# %%\nx = 1\n")
    with pytest.raises(ReleaseError, match="must hold only"):
        build_notebook(source, student=True, repository="https://example.org/r")
    source.write_text("# %% [setup]\n\n# %% [setup]\n\n# %%\nx = 1\n")
    with pytest.raises(ReleaseError, match="second"):
        build_notebook(source, student=True, repository="https://example.org/r")


def test_commands_say_what_to_install_when_notebook_tools_are_missing(monkeypatch, capsys):
    import labsupport.course.cli as cli

    monkeypatch.setattr(cli, "_missing_tools", lambda: ["nbclient"])
    assert cli.main(["grade", "x.ipynb"]) == 2
    assert "pip install 'labsupport[grade]'" in capsys.readouterr().err
