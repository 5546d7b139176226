"""One source of truth per lab, two notebooks out.

Each lab is written once, as a percent-format Python file in ``solutions/`` (cells start with
``# %%`` for code or ``# %% [markdown]`` for prose; markdown lines start with ``# ``). Solution
regions are marked inside code cells::

    def vector_add(x, y):
        # BEGIN SOLUTION
        out = torch.empty_like(x)
        ...
        # END SOLUTION

``release`` writes two notebooks from it, both committed (and, for the grader, the checks each lab
calls with their points, in ``labsupport/lab_checks.json``):

* ``solutions/NAME.ipynb``: the markers removed, everything kept (for instructors and CI);
* ``labs/NAME.ipynb``: each region replaced by ``raise NotImplementedError(...)`` at the
  marker's indentation (for learners). In markdown, ``<!-- BEGIN SOLUTION -->`` ...
  ``<!-- END SOLUTION -->`` is dropped from the learner's copy.

The lab sources' format is described in :mod:`labsupport.course.sources`; the setup cell (a line
``# %% [setup]`` in the source) is written there once and filled in here with the repository address
from ``_config.yml``.

Every generated code cell, in both versions, must compile; one that does not stops ``release`` (and
``release --check``) with its source line.

``pytest --nbval-lax`` runs both notebooks as tests (``make test``). In the solution notebook,
every cell that calls a graded check, and every cell whose marker line tags it
(``# %% tags=["nbval-check-output"]``), carries nbval's tag and has its output compared with the
one recorded in ``solutions/outputs/NN_name.json`` (see :mod:`labsupport.course.stored_outputs`;
``release --record`` records them). The learner's notebook carries no nbval tags: its metadata
names the first cell that fails because an exercise is not done (the first check after the first
exercise, or the exercise itself when it raises at the top level), ``labsupport.stops_at``, and
the course's nbval plugin (:mod:`labsupport.course.nbval_plugin`) expects that cell to fail and
skips every code cell after it, so nbval runs a fresh learner notebook up to its first exercise.
A ``raises-exception`` tag would do the same for nbval, but JupyterLab reads it too and lets Run
All run on past that cell (it sends the cell with ``stop_on_error`` false), to the next cell that
uses the unwritten function; without it, Run All stops where the labs say.

A learner's edits are never overwritten: every released notebook records a digest of its cells,
and ``release`` refuses to replace a notebook whose cells no longer match it (unless ``force``,
which first saves a timestamped backup).
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ..checks import REGISTRY
from . import stored_outputs
from .manifest import MANIFEST_IN_REPO, lab_checks, render_manifest, top_level_names
from .notebooks import execute
from .scan import check_calls, python_source
from .sources import (
    BEGIN,
    ReleaseError,
    SourceCell,
    course_repository,
    parse_source,
    setup_cell,
    strip_code_lines,
    strip_markdown,
)

__all__ = ["ReleaseError", "SourceCell", "build_notebook", "cells_digest", "plan", "record_outputs", "release",
           "stale", "unrecorded"]


def _check_compiles(lines: list[tuple[str, int]], path: Path, student: bool) -> None:
    """Fail (ReleaseError, with the source line) unless the generated code cell compiles."""
    text = "\n".join(line for line, _ in lines)
    code = python_source(text)  # IPython syntax (%magic, !shell) becomes plain Python, as in a kernel
    try:
        compile(code, f"{path.name} cell", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        version = "learner's" if student else "solution"
        row = exc.lineno or 1
        where = lines[row - 1][1] if code == text and 0 < row <= len(lines) else lines[0][1] if lines else 0
        shown = lines[row - 1][0] if code == text and 0 < row <= len(lines) else (exc.text or "").rstrip()
        hint = ""
        if student and isinstance(exc, IndentationError):
            hint = (" A '# BEGIN SOLUTION' marker is replaced by a raise at the marker's own indentation: "
                    "indent the marker like the code it replaces.")
        raise ReleaseError(
            f"{path}:{where}: the {version} version of the cell starting at line "
            f"{lines[0][1] if lines else '?'} does not compile: {type(exc).__name__}: {exc.msg} "
            f"(line {row} of the cell: {shown!r}).{hint}"
        ) from None


def _raises_at_top_level(text: str) -> bool:
    """True if a cell has a ``raise`` that runs with the cell (an exercise's stub at the top level),
    not only inside a function or class it defines."""
    try:
        tree = ast.parse(python_source(text))
    except SyntaxError:
        return False
    inside_defs = {id(node) for outer in ast.walk(tree)
                   if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
                   for node in ast.walk(outer) if node is not outer}
    return any(isinstance(node, ast.Raise) and id(node) not in inside_defs for node in ast.walk(tree))


def build_notebook(source: Path, student: bool, repository: str | None = None,
                   recording: dict | None = None) -> nbformat.NotebookNode:
    """The learner's (``student=True``) or the instructor's notebook for one source file.

    A ``# %% [setup]`` cell becomes :data:`~labsupport.course.sources.SETUP_CELL`, installing the
    course from ``repository`` (default: ``repository.url`` in the ``_config.yml`` of the course the
    source belongs to, ``solutions/..``). ``recording`` (:func:`labsupport.course.stored_outputs.load`)
    fills the solution notebook's compared cells with their stored outputs.
    """
    nb = nbformat.v4.new_notebook()
    stops_at = None  # learner's version: the id of the first cell that fails until an exercise is done
    seen_exercise = False
    for index, cell in enumerate(parse_source(source)):
        tags = list(cell.tags)
        if cell.kind == "setup":
            if repository is None:
                repository = course_repository(Path(source).resolve().parent.parent)
            new = nbformat.v4.new_code_cell(setup_cell(repository))
        elif cell.kind == "code":
            lines = strip_code_lines(cell, source, student)
            _check_compiles(lines, source, student)
            text = "\n".join(line for line, _ in lines)
            new = nbformat.v4.new_code_cell(text)
            calls_check = any(name in REGISTRY for name in check_calls(text))  # a graded check
            if student:
                tags = [t for t in tags if t != stored_outputs.CHECK_OUTPUT]  # learners' copies store nothing
                seen_exercise = seen_exercise or any(BEGIN.match(line) for line in cell.lines)
                if stops_at is None and seen_exercise and (calls_check or _raises_at_top_level(text)):
                    stops_at = index
            elif calls_check and stored_outputs.CHECK_OUTPUT not in tags:
                tags.append(stored_outputs.CHECK_OUTPUT)
        else:
            text = "\n".join(strip_markdown(cell, source, student))
            new = nbformat.v4.new_markdown_cell(text)
        if tags:
            new.metadata["tags"] = tags
        new["id"] = cell_id(source, index)
        nb.cells.append(new)
    if not student and recording:
        stored_outputs.apply(nb, recording)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",  # Colab opens the notebook on a GPU runtime
        "labsupport": {
            "source": f"solutions/{source.name}",
            "version": "student" if student else "solution",
            "digest": cells_digest(nb),
        },
    }
    if student and stops_at is not None:
        nb.metadata["labsupport"][stored_outputs.STOPS_AT] = cell_id(source, stops_at)
    return nb


def cell_id(source: Path, index: int) -> str:
    """The id of a lab's cell number ``index`` (the same in both notebooks): ``05-phases-015``."""
    return f"{source.stem[:40]}-{index:03d}".replace("_", "-")


def cells_digest(nb) -> str:
    """A digest of the cells' types and sources: what a learner changes when they work."""
    payload = json.dumps([[c["cell_type"], c["source"]] for c in nb["cells"]])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def render(nb) -> str:
    return nbformat.writes(nb, version=4) + "\n"


@dataclass
class Planned:
    target: Path
    text: str
    status: str  # "unchanged", "new", "update", "learner-edited"


def plan(root: Path, names: list[str] | None = None) -> list[Planned]:
    """What ``release`` would write, without writing anything (only labs in ``names``, if given).

    Besides the notebooks, that is ``labsupport/lab_checks.json`` (always for every lab), from which
    the grader learns each lab's checks and points.
    """
    sources = sorted((root / "solutions").glob("[0-9]*.py"))
    if not sources:
        raise ReleaseError(f"no lab sources found in {root / 'solutions'} (expected files like 00_name.py)")
    every = sources
    if names:
        unknown = [n for n in names if n not in {s.stem for s in sources}]
        if unknown:
            raise ReleaseError(f"no source for {', '.join(unknown)}; labs: {', '.join(s.stem for s in sources)}")
        sources = [s for s in sources if s.stem in names]
    planned = []
    for source in sources:
        recording = stored_outputs.load(stored_outputs.path_for(root, source.stem))
        for student, folder in ((True, "labs"), (False, "solutions")):
            target = root / folder / f"{source.stem}.ipynb"
            text = render(build_notebook(source, student, recording=recording))
            planned.append(Planned(target, text, _status(target, text)))
    manifest = root / MANIFEST_IN_REPO
    text = render_manifest(lab_checks(every, course_cells))
    if not manifest.exists():
        status = "new"
    else:
        status = "unchanged" if manifest.read_text(encoding="utf-8") == text else "update"
    planned.append(Planned(manifest, text, status))
    return planned


def _status(target: Path, text: str) -> str:
    if not target.exists():
        return "new"
    current = target.read_text(encoding="utf-8")
    if current == text:
        return "unchanged"
    try:
        nb = nbformat.reads(current, as_version=4)
        recorded = nb.metadata.get("labsupport", {}).get("digest")
    except Exception:
        return "learner-edited"
    if recorded is None or recorded != cells_digest(nb):
        return "learner-edited"
    # outputs someone ran into it (not the stored ones release writes into compared cells)
    has_outputs = any(c.get("outputs") for c in nb.cells if c.cell_type == "code" and not stored_outputs.is_recorded(c))
    return "learner-edited" if has_outputs else "update"


def release(root: Path, force: bool = False, log=print, names: list[str] | None = None) -> list[Planned]:
    """Write every notebook that changed. Refuses (ReleaseError) to replace edited notebooks."""
    planned = plan(root, names)
    edited = [p for p in planned if p.status == "learner-edited"]
    if edited and not force:
        names = "\n  ".join(str(p.target.relative_to(root)) for p in edited)
        raise ReleaseError(
            "these notebooks were changed since they were released (someone's work may be in them), "
            f"so release will not overwrite them:\n  {names}\nMove them somewhere safe, or run "
            "`python -m labsupport release --force`, which saves a .bak copy of each first."
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for p in planned:
        if p.status == "unchanged":
            continue
        if p.status == "learner-edited":
            backup = p.target.with_name(f"{p.target.name}.{stamp}.bak")
            shutil.copy2(p.target, backup)
            log(f"saved {backup.relative_to(root)}")
        p.target.parent.mkdir(parents=True, exist_ok=True)
        p.target.write_text(p.text, encoding="utf-8")
        log(f"wrote {p.target.relative_to(root)} ({p.status})")
    return planned


def stale(root: Path) -> list[Path]:
    """Notebooks (and lab_checks.json) that differ from what the sources produce (the drift test)."""
    return [p.target for p in plan(root) if p.status != "unchanged"]


def unrecorded(root: Path, names: list[str] | None = None) -> list[str]:
    """Compared cells of the solution notebooks that have no stored output (``release --check``)."""
    problems = []
    for source in sorted((root / "solutions").glob("[0-9]*.py")):
        if names and source.stem not in names:
            continue
        recording = stored_outputs.load(stored_outputs.path_for(root, source.stem))
        nb = build_notebook(source, student=False)
        for i in stored_outputs.apply(nb, recording):
            first = next((line for line in nb.cells[i].source.splitlines() if line.strip()), "")
            problems.append(f"{source.relative_to(root)}: the cell starting `{first[:60]}` (cell {i}) has its "
                            "output compared but none is recorded")
    return problems


def record_outputs(root: Path, names: list[str] | None = None, log=print, timeout: int = 240) -> list[Path]:
    """Run each solution notebook and store the outputs of its compared cells (``release --record``).

    The kernels run Triton's interpreter on the CPU (so the small preset), whatever this machine
    has, because that is where ``make test`` compares them. A notebook that fails records nothing.
    """
    import platform

    import numpy
    import torch
    import triton

    sources = sorted((root / "solutions").glob("[0-9]*.py"))
    if names:
        sources = [s for s in sources if s.stem in names]
    environment = {"python": platform.python_version(), "torch": torch.__version__,
                   "triton": triton.__version__, "numpy": numpy.__version__,
                   "where": "CPU, Triton interpreter, small preset"}
    cpu = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg"}
    written = []
    for source in sources:
        nb = build_notebook(source, student=False)
        log(f"running {source.stem} ...")
        run = execute(nb, cwd=source.parent, timeout=timeout, env=cpu, quiet=True)
        if not run.ok:
            what = run.timed_out or (run.errors[0] if run.errors else None)
            detail = run.died or (f"{what.ename}: {what.evalue} in the cell starting `{what.first_line}`"
                                  if what else "unknown")
            raise ReleaseError(f"{source.name}: the solution notebook failed, nothing recorded ({detail})")
        target = stored_outputs.path_for(root, source.stem)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stored_outputs.render(nb, environment), encoding="utf-8")
        log(f"wrote {target.relative_to(root)} ({len(stored_outputs.compared_cells(nb))} compared cells)")
        written.append(target)
    return written


def course_cells(source: Path) -> list[dict]:
    """The code cells of the released learner notebook of ``source``, as the grader rebuilds it.

    Each is ``{"id", "source", "exercise"}``; an exercise cell (one with a solution region) also
    lists the names it defines at the top level (``"defines"``), by which a learner's copy is found
    when its cell id changed (a notebook released before the course inserted a cell). The grader
    runs these cells, with the learner's version of each exercise cell in its place.
    """
    exercises = set()
    for index, cell in enumerate(parse_source(source)):
        if cell.kind == "code" and any(BEGIN.match(line) for line in cell.lines):
            exercises.add(index)
    nb = build_notebook(source, student=True)
    out = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        entry = {"id": cell["id"], "source": cell.source, "exercise": index in exercises}
        if entry["exercise"]:
            entry["defines"] = top_level_names(cell.source)
        out.append(entry)
    return out
