"""Assemble a learner's serving stack from their lab notebooks (issue 31): ``python -m labsupport
stack my-labs/`` or :func:`assemble`.

For each lab with a slot (:data:`labsupport.stack.SLOTS`) whose notebook is in the folder, the
learner's exercise cells are taken as the grader takes them (:func:`labsupport.course.splice.splice`)
and written, with what the course's earlier cells define, as one module file per lab in the cache
folder (never in the learner's folder: Triton reads a kernel's source from a real file). Each slot's
check then runs against the learner's part in a process of its own with a time limit, so a part that
hangs or crashes cannot take the assembly down (:mod:`labsupport.course.stack_checks`: on a machine
without a GPU, forked from one process that imported the checks once); several labs' processes run
at once (``--jobs N``, default the CPU cores up to four), each with its own time limit and its share
of the cores. A slot keeps the learner's part where its check passes and the
course's where it fails, raises, times out or the exercise is not done.

**The namespace rule.** A learner's exercise cell often uses names an earlier course cell of the lab
binds (imports, helper functions, ``settings``). The module file therefore holds, in the notebook's
order up to the lab's last exercise cell: the lab's first cell (its setup, ``settings =
labsupport.setup()``) whole; from every other course cell, only its top-level ``import`` statements and its
``def`` and ``class`` statements (what defines names without measuring anything); every exercise cell
whole (the learner's version, or the course's stub where theirs is missing). Assignments, loops,
calls and plots of course cells are left out, so the lab's measurements never run; an exercise cell
that needs a value a course cell computed fails its check and keeps the course's part (the message
names the missing name). Lines of IPython syntax (``%magic``, ``!shell``) are commented out.

**The cache.** A lab's check results are stored under a hash of its module file's text (the learner's
cells and the course's definitions), the source of the lab's checks and the course's version, so a second assembly of unchanged
notebooks runs no check. :attr:`Assembly.checks_run` counts the checks that ran.

What the server needs is written to ``<cache>/stack.json``: for each slot served by the learner, the
module file and the name to take from it. The server reads only that (:mod:`labsupport.serve.stack`),
so it imports nothing of the instructors' tooling.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from .. import __version__
from ..stack import SLOTS, Slot
from .manifest import load_course_cells
from .splice import splice
from .stack_checks import CHECK_TIMEOUT_S, RESULTS_PREFIX, CheckProcess, run_checks  # noqa: F401 (re-exported)

_PARSING = threading.Lock()  # the labs are assembled in threads (--jobs); their cells are parsed one at a time

CHECKS_DIR = Path(__file__).resolve().parents[1] / "checks"  # a lab's checks' source is part of its cache key
LONGEST = ("11_many_gpus",)  # its checks spawn rank processes (about 13 s on a CPU): started first, not last
MAX_JOBS = 4  # labs checked at once by default (each check process takes a few hundred MB)
MANIFEST_NAME = "stack.json"


@dataclass
class Row:
    slot: str
    lab: str
    source: str  # "learner" or "course"
    serves: bool  # the part in this slot runs on every request today
    check: str  # "passed", "failed" or "not done"
    mode: str = "checked"  # the slot's mode (labsupport.stack.MODES)
    message: str = ""  # the check's message where it did not pass
    file: str = ""  # the module file of the learner's part ("" for the course's)
    part: str = ""  # the name taken from it

    def to_json(self) -> dict:
        """The row as ``--json`` prints it: exactly slot, lab, source, serves, check."""
        return {"slot": self.slot, "lab": self.lab, "source": self.source, "serves": self.serves, "check": self.check}


@dataclass
class Assembly:
    rows: list[Row]
    cache_dir: Path
    checks_run: int = 0  # checks run by this assembly (0 when every result came from the cache)
    notes: list[str] = field(default_factory=list)  # labs whose notebook is missing or unreadable

    def row(self, slot: str) -> Row:
        for r in self.rows:
            if r.slot == slot:
                return r
        raise KeyError(slot)

    def learner_parts(self) -> dict[str, dict]:
        """slot -> {"lab", "file", "name"} for every slot whose part is the learner's."""
        return {r.slot: {"lab": r.lab, "file": r.file, "name": r.part} for r in self.rows if r.source == "learner"}

    def table(self) -> str:
        """The table ``python -m labsupport stack`` prints."""
        head = ("slot", "lab", "part", "mode", "check")
        lines = []
        for r in self.rows:
            mode = "serves" if r.serves else ("checked" if r.mode == "checked" else "not wired yet (the course's serves)")
            lines.append((r.slot, r.lab, "yours" if r.source == "learner" else "course's", mode, r.check))
        widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
        out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
        for r in self.rows:
            if r.check == "failed" and r.message:
                out.append(f"{r.slot}: {r.message.splitlines()[0][:300]}")
        return "\n".join(out + self.notes)


def default_cache_dir() -> Path:
    """``$LABSUPPORT_CACHE/stack`` (default ``~/.cache/labsupport/stack``)."""
    return Path(os.environ.get("LABSUPPORT_CACHE") or Path.home() / ".cache" / "labsupport").expanduser() / "stack"


def find_notebook(labs_dir: Path, lab: str) -> Path | None:
    """The learner's notebook of ``lab``: ``<lab>.ipynb``, else the one ``NN_*.ipynb``."""
    exact = labs_dir / f"{lab}.ipynb"
    if exact.exists():
        return exact
    found = sorted(labs_dir.glob(f"{lab[:2]}_*.ipynb"))
    return found[0] if len(found) == 1 else None


def _definitions(source: str) -> str:
    """A course cell's top-level imports, functions and classes (the namespace rule)."""
    text = _python(source)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return ""
    lines = text.splitlines()
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    out = []
    for node in tree.body:
        if isinstance(node, kept):  # whole lines, decorators included (a @triton.jit helper stays a kernel)
            first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            out.append("\n".join(lines[first - 1:node.end_lineno]))
    return "\n".join(out)


def _python(source: str) -> str:
    """A cell's text with IPython-only lines (``%magic``, ``!shell``) commented out."""
    return "\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def module_text(lab: str, course: list[dict], learner_nb) -> tuple[str, list[str]]:
    """The lab's module file (the namespace rule) and the ids of the exercise cells that are the learner's."""
    spliced = splice(learner_nb, course)
    last = max((i for i, e in enumerate(course) if e.get("exercise")), default=-1)
    parts = [f"# {lab}: the learner's exercise cells with the course's earlier definitions "
             f"(written by python -m labsupport stack; edits here are overwritten)"]
    for i, cell in enumerate(spliced.notebook.cells[:last + 1]):
        entry = course[i]
        if i == 0:  # the setup cell, whole: ``settings`` (labsupport.setup()) is used by exercise cells
            parts.append(f"# --- setup cell {entry['id']}\n{_python(cell.source)}")
        elif entry.get("exercise"):
            who = "yours" if entry["id"] in spliced.learner else "the course's stub"
            parts.append(f"# --- exercise cell {entry['id']} ({who})\n{_python(cell.source)}")
        else:
            defs = _definitions(cell.source)
            if defs.strip():
                parts.append(f"# --- definitions of course cell {entry['id']}\n{defs}")
    return "\n\n".join(parts) + "\n", list(spliced.learner)


def _exercise_of(slot: Slot, course: list[dict]) -> str | None:
    for entry in course:
        if entry.get("exercise") and slot.part in (entry.get("defines") or []):
            return entry["id"]
    return None


def _lab_rows(lab: str, slots: list[Slot], labs_dir: Path, cache: Path, notes: list[str],
             threads: int | None = None, runner=None) -> tuple[list[Row], int]:
    """The rows of one lab's slots, and how many checks ran (by ``runner``, :func:`run_checks`'s
    interface; default :func:`run_checks`)."""
    def course_rows(check: str, message: str = "") -> list[Row]:
        return [Row(s.name, lab, "course", s.serves, check, s.mode, message) for s in slots]

    nb_path = find_notebook(labs_dir, lab)
    course = load_course_cells(lab)
    if nb_path is None or course is None:
        notes.append(f"{lab}: no notebook {lab}.ipynb in {labs_dir}: the course's parts" if course is not None
                     else f"{lab}: the course's cells are not in lab_checks.json: the course's parts")
        return course_rows("not done"), 0
    try:
        learner_nb = nbformat.read(nb_path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - an unreadable notebook is reported, not fatal
        notes.append(f"{lab}: {nb_path.name} could not be read ({type(exc).__name__}: {exc}): the course's parts")
        return course_rows("not done"), 0
    with _PARSING:  # CPython 3.11's parser is not thread-safe (SystemError: AST constructor recursion depth mismatch)
        text, theirs = module_text(lab, course, learner_nb)
    checks_source = "".join(f.read_text(encoding="utf-8") for f in sorted(CHECKS_DIR.glob(f"lab{lab[:2]}_*.py")))
    key = hashlib.sha256(f"{__version__}\n{sys.version_info[:2]}\n{checks_source}\n{text}".encode()).hexdigest()[:16]
    module = cache / "parts" / f"lab{lab}_{key}.py"  # an importable name: lab 11's ranks import it
    results_file = cache / "results" / f"{lab}_{key}.json"
    pairs = [(s.check, s.part) for s in slots if _exercise_of(s, course) in theirs]
    ran = 0
    if not module.exists():  # the server imports it, also where the results come from the cache
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(text, encoding="utf-8")
    results = {}
    if results_file.exists():
        results = {k: tuple(v) for k, v in json.loads(results_file.read_text(encoding="utf-8")).items()}
    todo = [p for p in pairs if p[0] not in results]  # an earlier --slot run may have checked only some
    if todo:
        results.update((runner or run_checks)(module, lab, todo, threads=threads))
        ran = len(todo)
        results_file.parent.mkdir(parents=True, exist_ok=True)
        results_file.write_text(json.dumps(results), encoding="utf-8")
    rows = []
    for s in slots:
        result, message = results.get(s.check, ("not done", "the exercise cell is not in the notebook"))
        mine = result == "passed"
        rows.append(Row(s.name, lab, "learner" if mine else "course", s.serves, result, s.mode, message,
                        str(module) if mine else "", s.part if mine else ""))
    return rows, ran


def default_jobs() -> int:
    """Labs checked at once by default: the CPU cores, at most :data:`MAX_JOBS`."""
    return max(1, min(MAX_JOBS, os.cpu_count() or 1))


def assemble(labs_dir, cache_dir=None, only: list[str] | None = None, jobs: int | None = None) -> Assembly:
    """Assemble the stack from the notebooks in ``labs_dir`` (module docstring); ``only``: slot names
    to assemble (default: every slot); ``jobs``: labs checked at once, each in its own process with
    its own time limit and its share of the cores (default :func:`default_jobs`). Writes
    ``<cache_dir>/stack.json`` for the server."""
    labs_dir = Path(labs_dir).expanduser()
    if not labs_dir.is_dir():
        raise ValueError(f"{labs_dir} is not a folder: give the folder that holds your lab notebooks")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    slots = [s for s in SLOTS if only is None or s.name in only]
    unknown = set(only or ()) - {s.name for s in SLOTS}
    if unknown:
        raise ValueError(f"no stack slot {', '.join(sorted(unknown))}; the slots are {', '.join(s.name for s in SLOTS)}")
    jobs = default_jobs() if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be 1 or more (labs checked at once), got {jobs!r}")
    labs = sorted({s.lab for s in slots})  # course order; a lab's slots in SLOTS's order
    threads = max(1, (os.cpu_count() or 1) // min(jobs, len(labs) or 1)) if jobs > 1 else None

    forker, lock = [], threading.Lock()

    def runner(*args, **kwargs) -> dict:  # the forking check process, started when a lab has checks to run
        with lock:
            if not forker:
                forker.append(CheckProcess())
        return forker[0].run_checks(*args, **kwargs)

    def one(lab: str) -> tuple[list[Row], int, list[str]]:
        lab_notes: list[str] = []
        lab_rows, n = _lab_rows(lab, [s for s in slots if s.lab == lab], labs_dir, cache, lab_notes, threads,
                                runner)
        return lab_rows, n, lab_notes

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # each lab's checks run in a process of their own
            started = {lab: pool.submit(one, lab) for lab in sorted(labs, key=lambda lab: lab not in LONGEST)}
            done = [started[lab].result() for lab in labs]  # rows in course order
    finally:
        for f in forker:
            f.close()
    rows, ran, notes = [], 0, []
    for lab_rows, n, lab_notes in done:
        rows += lab_rows
        ran += n
        notes += lab_notes
    assembly = Assembly(rows, cache, ran, notes)
    cache.mkdir(parents=True, exist_ok=True)
    manifest = {"course_version": __version__, "labs_dir": str(labs_dir.resolve()), "written": time.time(),
                "parts": assembly.learner_parts(), "rows": [asdict(r) for r in rows]}
    (cache / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return assembly


def main(labs_dir: str, cache_dir: str | None = None, as_json: bool = False, only: list[str] | None = None,
         jobs: int | None = None) -> int:
    """``python -m labsupport stack``: assemble and print the table (or ``--json``)."""
    try:
        assembly = assemble(labs_dir, cache_dir, only, jobs)
    except ValueError as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([r.to_json() for r in assembly.rows], indent=1))
    else:
        print(assembly.table())
        print(f"({assembly.checks_run} checks run; the server's parts are listed in "
              f"{assembly.cache_dir / MANIFEST_NAME})")
    return 0
