"""``python -m labsupport grade``: run submitted notebooks and score their checks.

What runs is the course's own notebook of the lab with the learner's exercise cells put in
(:mod:`labsupport.course.splice`), headlessly, in a fresh kernel, in a temporary folder, inside a
sandbox where there is one (:mod:`labsupport.course.sandbox`); the submission itself is never
modified. Every ``check_*`` call shows its result as an output of its cell, and only the outputs
of the course's check cells count (:func:`collect_results`).

A notebook is graded against one of the course's labs (``solutions/NN_name.py``), found from its
file name (``alice_07_attention.ipynb``) and its metadata (which ``release`` writes); when both
name a lab they must agree, and ``--lab`` decides for notebooks that name none or disagree. A
notebook whose lab is unknown is scored zero on its own row, never run. The lab's checks and
their points come from ``labsupport/lab_checks.json``, which ``release`` writes from the sources
and which ships with the package, so grading works where the package is installed without the
course's sources. Only the lab's own checks score: a check of the lab that never ran (the notebook
stopped earlier, or the call was deleted or commented out) scores zero, and checks of other labs
are listed as ``extra`` and score nothing. One notebook's problem (missing, not a notebook, setup
failing, a timeout) is reported on its own row and grading goes on with the rest.

Code that tampers with grading (the check machinery, patched ``labsupport`` names, the course's
reference implementations handed to a check) and results reported where no course check ran are
named in the ``flags`` column; a person should read those notebooks. Without a sandbox
(``--no-sandbox``, or no ``bwrap``) the submitted code runs with your permissions, and every row
says ``UNSANDBOXED``.
"""


from __future__ import annotations

import re
import time
import traceback
import unicodedata
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .._grading import GRADING_ENV
from ..checks.framework import RESULT_MIME
from .files import each_once
from .manifest import load_course_cells, load_manifest
from .notebooks import KernelStartError, execute, first_line, load
from .probe import probe_cell, reimport, verdict
from .report import Row, escape_surrogates
from .scan import calls_by_cell, check_calls, exercises_checked, names_used_and_bound, scan_flags
from .splice import needed, splice

NOTEBOOK_TIMEOUT = 3600  # seconds a whole notebook may run, by default


# -- the labs and their checks ----------------------------------------------------------------

def _name_pattern(lab: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(lab)}(?![A-Za-z0-9])", re.IGNORECASE)


def labs_in_name(path: Path, labs: Iterable[str]) -> list[str]:
    """The labs a file name names (``alice_07_attention.ipynb``: 07_attention), longest first."""
    stem = Path(path).stem
    found = [lab for lab in sorted(labs, key=len, reverse=True) if _name_pattern(lab).search(stem)]
    # a lab whose name is part of a longer lab's name found at the same place is not a second one
    return [lab for lab in found if not any(other != lab and lab in other for other in found)]


def identify_lab(nb, path: Path, labs: Iterable[str], forced: str | None = None) -> tuple[str | None, str]:
    """The lab to grade ``nb`` on, or None and why no lab could be chosen."""
    labs = list(labs)
    if forced:
        return forced, ""
    listed = ", ".join(labs)
    advice = "rename the file to include its lab, or grade it with --lab NAME"
    by_name = labs_in_name(path, labs)
    if len(by_name) > 1:
        return None, f"the file name names several labs ({', '.join(by_name)}); {advice}"
    meta = None
    recorded = nb.metadata.get("labsupport") if nb is not None else None
    if isinstance(recorded, dict):
        recorded = recorded.get("source")
    if recorded is not None:
        text = str(recorded)
        stem = Path(text).stem
        if stem not in labs or Path(text).as_posix() != f"solutions/{stem}.py":
            return None, (f"the notebook's metadata (labsupport.source) names {text!r}, which is not one of "
                          f"the course's labs ({listed}); {advice}")
        meta = stem
    if by_name and meta and by_name[0] != meta:
        return None, (f"the file name says {by_name[0]} but the notebook's metadata says {meta}; "
                      f"grade it with --lab NAME")
    lab = meta or (by_name[0] if by_name else None)
    if lab is None:
        return None, (f"neither the file name nor the notebook's metadata names one of the course's labs "
                      f"({listed}); {advice}")
    return lab, ""


def guess_lab(nb, path: Path, manifest: dict[str, list[tuple[str, float]]]) -> str | None:
    """For a notebook whose lab is unknown: the one lab it most likely is, or None.

    The candidates are the labs its file name and metadata name; the checks it calls decide
    between several, or name the lab when nothing else does.
    """
    labs = list(manifest)
    named = labs_in_name(path, labs)
    recorded = nb.metadata.get("labsupport") if nb is not None else None
    if isinstance(recorded, dict):
        stem = Path(str(recorded.get("source", ""))).stem
        if stem in labs and stem not in named:
            named.append(stem)
    called: list[str] = []
    if nb is not None:
        for check in calls_by_cell(nb):
            called += [lab for lab, checks in manifest.items() if any(c == check for c, _ in checks)]
    if len(named) == 1:
        return named[0]
    narrowed = [lab for lab in (named or labs) if lab in called]
    return narrowed[0] if len(set(narrowed)) == 1 else None


def _visible(text: str) -> str:
    """``text`` without invisible characters (zero-width, direction marks, controls), NFC-normalised."""
    text = unicodedata.normalize("NFC", text)
    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cf", "Cc", "Co", "Cn"))


def student_name(path: Path, lab: str | None) -> str:
    """The file name without its lab part (``alice_07_attention.ipynb``: alice), else the file name.

    Invisible characters are dropped, and a name that is not valid UTF-8 keeps its odd bytes as
    ``\\udcff`` escapes.
    """
    path = Path(escape_surrogates(_visible(str(path))))
    if lab:
        rest = _name_pattern(lab).sub(" ", path.stem)
        # a browser's "(1)", a file manager's "copy", Colab's "Copy of"
        rest = re.sub(r"\(\d+\)|\bcopy(\s+of)?\b", " ", rest, flags=re.IGNORECASE)
        rest = re.sub(r"[\s_\-.]+", " ", rest).strip()
        if rest:
            return rest.replace(" ", "_")
    return path.name


# -- grading ----------------------------------------------------------------------------------

def expand(paths: Iterable[str]) -> list[Path]:
    """Files as given; folders become every .ipynb below them (checkpoints skipped); no repeats."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(
                p for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts
            )
        else:
            found.append(path)
    return each_once(found)


def bad_paths(paths: Iterable[str]) -> list[str]:
    """Arguments that are neither a folder, a file, nor a (missing) notebook: likely typos."""
    return [raw for raw in paths if not Path(raw).exists() and not raw.endswith(".ipynb")]


def skip_what_hung(timeout: float) -> Callable[[str], Callable[[str], str] | None]:
    """For ``execute(after_timeout=...)``: once a cell checking ``f`` ran past its limit, later cells
    that use ``f`` are not run (they would hang again), until a cell defines ``f`` anew."""

    def after_timeout(source: str):
        hung = set(exercises_checked(source))
        if not hung:
            return None
        where = first_line(source)

        def test(later: str) -> str:
            used, bound = names_used_and_bound(later)
            again = sorted((hung & used) - bound)
            hung.difference_update(bound)
            return (f"`{again[0]}` already ran past {timeout:g} s in the cell starting `{where}`, so this cell "
                    f"was not run (it would hang again)") if again else ""

        return test

    return after_timeout


def _first_error(run, upto: int | None) -> str:
    errors = [e for e in run.errors if upto is None or e.index <= upto] or run.errors
    if not errors:
        return ""
    e = errors[0]
    return f"in the cell starting `{e.first_line}`: {e.ename}: {str(e.evalue).strip()[:300]}"


@dataclass
class _Notebook:
    """The submission being graded, as its rows name it."""

    name: str  # the path as given
    path: Path
    lab: str | None  # the lab it is graded on (None: unknown)
    sandbox: str  # the rows' sandbox column

    def row(self, check: str, points: float, max_points: float, status: str, detail: str = "") -> Row:
        return Row(self.name, check, points, max_points, status, detail, student_name(self.path, self.lab),
                   self.lab or "", sandbox=self.sandbox)


@dataclass
class _Prepared:
    """The notebook that will run, and what the rows say about the learner's cells in it."""

    notebook: nbformat.NotebookNode
    spliced: object | None  # the splice (labsupport.course.splice.Splice); None when run as submitted
    learner_cells: str
    ignored: str
    flags: list[str]


def _lab_points(manifest, lab: str | None) -> float:
    return sum(p for _, p in manifest.get(lab, [])) if lab else 0


def _prepare(nb, lab: str, known_checks: set[str], *, as_is: bool, all_cells: bool) -> _Prepared:
    """The course's notebook of ``lab`` with the learner's exercise cells put in (only the cells the
    checks need unless ``all_cells``), or the submission itself (``as_is``, or a lab list written
    before it held the course's cells). Flags come from the learner's code that will run."""
    course = None if as_is else load_course_cells(lab)
    if course is None:
        learner_cells = ("all: run as submitted (--as-is)" if as_is else
                         "all: run as submitted (lab_checks.json has no course cells; run `release`)")
        return _Prepared(nb, None, learner_cells, "", scan_flags(nb, known_checks))
    spliced = splice(nb, course)
    if not all_cells:
        spliced = needed(spliced)
    run_nb = spliced.notebook
    learner_cells = ", ".join(f"{cid} (found by name)" if cid in spliced.moved else cid for cid in spliced.learner)
    mine = nbformat.v4.new_notebook()
    mine.cells = [c for i, c in enumerate(run_nb.cells) if spliced.roles.get(i) == "learner"]
    # what ran of theirs (what did not run is in `ignored`)
    return _Prepared(run_nb, spliced, learner_cells, spliced.ignored(), scan_flags(mine, known_checks))


def _add_grader_cells(run_nb, spliced) -> str:
    """The grader's own cells in a spliced run: the checks imported before any learner code runs (so
    what they rely on is remembered untouched, :func:`labsupport.checks.framework.replaced`), imported
    afresh in each check cell, and the probe last. Returns the probe's nonce."""
    if spliced.roles.get(0) == "course":
        run_nb.cells[0].source = run_nb.cells[0].source.rstrip("\n") + \
            "\nimport labsupport.checks  # added by the grader: the checks, before any learner code\n"
    for i, cell in enumerate(run_nb.cells):
        if spliced.roles.get(i) == "course" and check_calls(cell.source):
            cell.source = reimport(cell.source)
    source, nonce = probe_cell()
    probe = nbformat.v4.new_code_cell(source)
    probe["id"] = "labsupport-grader-probe"
    spliced.roles[len(run_nb.cells)] = "probe"
    run_nb.cells.append(probe)
    return nonce


def _why_not_recorded(check: str, cell: int | None, run, setup_error: str, timeout: int) -> tuple[str, str]:
    """The status and detail of a check that reported no result; ``cell`` is the one calling it."""
    timeouts = [t for t in run.timeouts if cell is None or t.index <= cell]
    skipped = [s for s in run.skipped if s.index == cell]
    if cell is None:
        return "not run", f"the notebook does not call {check} (was the check cell deleted or commented out?)"
    if run.died:
        return "not run", run.died
    if skipped:
        return "timeout", skipped[0].evalue
    if timeouts:
        t = timeouts[-1]
        if t.ename == "NotebookTimeout":
            return "timeout", f"{run.notebook_timed_out}; it was stopped in the cell starting `{t.first_line}`"
        return "timeout", f"the cell starting `{t.first_line}` ran past {timeout} s and was interrupted"
    if run.notebook_timed_out:
        return "timeout", f"{run.notebook_timed_out} before this check ran"
    if setup_error:
        return "setup failed", setup_error
    first = _first_error(run, cell)
    return "not run", (f"the check did not run; the first error was {first}" if first else
                       f"the cell calling {check} ran without calling it")


def _score(entry: dict, max_points: float) -> tuple[float, str, str]:
    """Points, status and detail of a check's recorded result."""
    if entry.get("passed"):
        return max_points, "passed", ""
    if entry.get("reason") == "not done":
        return 0, "not done", "the exercise still raises NotImplementedError"
    return 0, "failed", str(entry.get("message", "")).strip()[:2000]  # the whole diagnosis, for the CSV


def _check_rows(sub: _Notebook, manifest, recorded: dict[str, dict], called: dict[str, int], run,
                timeout: int) -> list[Row]:
    """A row for each check of the lab (scored, or why it reported nothing), then a row for each
    result of another lab's check (not scored)."""
    expected = manifest[sub.lab]
    setup_error = _setup_error(run.notebook, run)
    rows = []
    for check, max_points in expected:
        entry = recorded.get(check)
        if entry is None:
            status, detail = _why_not_recorded(check, called.get(check), run, setup_error, timeout)
            rows.append(sub.row(check, 0, max_points, status, detail))
        else:
            points, status, detail = _score(entry, max_points)
            rows.append(sub.row(check, points, max_points, status, detail))
    own = {c for c, _ in expected}
    for check in recorded:
        if check not in own:
            home = next((lab for lab, checks in manifest.items() if any(c == check for c, _ in checks)), None)
            where = f"a check of lab {home}" if home else "not a check of any lab"
            rows.append(sub.row(check, 0, 0, "extra", f"{where}, not of {sub.lab}: not scored"))
    return rows


LABS_DIR_ENV = "LABSUPPORT_LABS_DIR"  # the capstone (lab 16) assembles the learner's stack from this folder


def labs_dir_env(path: Path) -> dict[str, str]:
    """The kernel's ``LABSUPPORT_LABS_DIR``: the folder of the graded notebook, which holds the learner's
    other notebooks (the capstone assembles their stack from it, read-only; every other lab ignores it)."""
    return {LABS_DIR_ENV: str(Path(path).resolve().parent)}


def grade_notebook(
    path: Path,
    timeout: int = 600,
    *,
    lab: str | None = None,
    manifest: dict[str, list[tuple[str, float]]] | None = None,
    notebook_timeout: float | None = NOTEBOOK_TIMEOUT,
    sandbox=None,
    unsandboxed: str = "no sandbox was asked for",
    as_is: bool = False,
    all_cells: bool = False,
) -> list[Row]:
    """Score one notebook on its lab's checks (``lab`` forces the lab). One row per check.

    The notebook run is the course's, with the learner's exercise cells put in
    (:mod:`labsupport.course.splice`); ``as_is`` runs the submitted notebook whole instead. ``sandbox``
    is where the kernel runs (:mod:`labsupport.course.sandbox`); without one, every row says
    ``UNSANDBOXED`` and why (``unsandboxed``). Only the course cells the checks need run, unless
    ``all_cells``.
    """
    manifest = manifest if manifest is not None else load_manifest()
    where = sandbox.label if sandbox is not None else f"UNSANDBOXED: {unsandboxed}"
    sub = _Notebook(str(path), Path(path), None, where)

    # 1. which lab: rows for a notebook that cannot be graded at all
    try:
        nb = load(sub.path)
    except (FileNotFoundError, ValueError) as exc:
        status = "missing" if isinstance(exc, FileNotFoundError) else "not a notebook"
        sub.lab = identify_lab(None, sub.path, manifest, lab)[0] or guess_lab(None, sub.path, manifest)
        return [sub.row("-", 0, _lab_points(manifest, sub.lab), status, str(exc))]
    known_checks = {c for checks in manifest.values() for c, _ in checks}
    sub.lab, problem = identify_lab(nb, sub.path, manifest, lab)
    if sub.lab is None:
        guessed = guess_lab(nb, sub.path, manifest)
        full = _lab_points(manifest, guessed)
        if guessed:
            problem += f" (it looks like lab {guessed}, whose {full:g} points count in its maximum)"
        row = Row(sub.name, "-", 0, full, "unknown lab", problem, student_name(sub.path, None), guessed or "",
                  sandbox=where)
        row.flags = "; ".join(scan_flags(nb, known_checks))
        return [row]
    expected = manifest[sub.lab]
    if not expected:
        row = sub.row("-", 0, 0, "no checks", f"lab {sub.lab} has no graded checks")
        row.flags = "; ".join(scan_flags(nb, known_checks))
        return [row]

    # 2. what runs: the course's notebook with the learner's cells in it, and the grader's cells
    prep = _prepare(nb, sub.lab, known_checks, as_is=as_is, all_cells=all_cells)
    run_nb, spliced, flags = prep.notebook, prep.spliced, prep.flags
    if spliced is not None and not spliced.matched:
        row = sub.row("-", 0, _lab_points(manifest, sub.lab), "unmatched",
                      "none of the lab's exercise cells was found in the notebook, so nothing of the "
                      f"learner's could be graded: {'; '.join(spliced.missing)}. Was it made from the "
                      f"course's labs/{sub.lab}.ipynb? Read it by hand, or grade it with --as-is")
        row.learner_cells, row.ignored, row.flags = "", prep.ignored, "; ".join(flags)
        return [row]
    nonce = _add_grader_cells(run_nb, spliced) if spliced is not None else None

    # 3. run it, and read what the checks reported
    called = calls_by_cell(run_nb)
    run = execute(run_nb, timeout=timeout, stop_on_error=False, quiet=True, notebook_timeout=notebook_timeout,
                  env={GRADING_ENV: "1", **labs_dir_env(sub.path)}, after_timeout=skip_what_hung(timeout),
                  sandbox=sandbox)
    recorded, forged = collect_results(run, spliced)
    flags += forged
    if nonce is not None:
        flags += verdict(run.notebook.cells[-1], nonce, kernel_alive=not (run.died or run.notebook_timed_out))

    # 4. one row per check of the lab, then the results of other labs' checks (not scored)
    rows = _check_rows(sub, manifest, recorded, called, run, timeout)
    for row in rows:
        row.flags = "; ".join(dict.fromkeys(flags))
        row.learner_cells, row.ignored = prep.learner_cells, prep.ignored
    return rows


def collect_results(run, spliced) -> tuple[dict[str, dict], list[str]]:
    """The check results the run reported, and flags for those not to be trusted.

    Results are outputs (MIME type ``RESULT_MIME``) of the cells that ran. One counts only when it
    comes from a cell that calls that check and that, when spliced, is the course's own cell (not
    the learner's); a result anywhere else was not written by a check the course called, so it is
    ignored and flagged. Several results in one cell (a check reports once) count as the worst of
    them, and a pass from a cell that then failed, or in which the kernel died or was stopped, counts
    as a failure: both are flagged.
    """
    recorded: dict[str, dict] = {}
    flags: list[str] = []
    stopped = {t.index for t in run.timeouts} | {s.index for s in run.skipped}
    errored = {e.index for e in run.errors}
    for index, cell in enumerate(run.notebook.cells):
        if cell.get("cell_type") != "code":
            continue
        results = []
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            if RESULT_MIME in data and isinstance(data[RESULT_MIME], dict):
                results.append(data[RESULT_MIME])
        if not results:
            continue
        calls = set(check_calls(cell.source))
        role = "course" if spliced is None else spliced.roles.get(index, "course")
        label = cell.get("id") or f"cell {index}"
        by_check: dict[str, list[dict]] = {}
        for entry in results:
            check = str(entry.get("check", ""))
            if check not in calls or role != "course":
                who = "the learner's cell" if role == "learner" else "a cell that does not call it"
                flags.append(f"forged result: {check or '?'} reported as "
                             f"{'passed' if entry.get('passed') else 'failed'} from {who} {label}; ignored")
                continue
            by_check.setdefault(check, []).append(entry)
        for check, entries in by_check.items():
            worst = next((e for e in entries if not e.get("passed")), entries[-1])
            if len(entries) > 1:
                flags.append(f"forged result: {check} reported {len(entries)} times in cell {label} (a check "
                             f"reports once); the worst counts")
            if worst.get("passed") and (index in errored or index in stopped or
                                        (run.died and index >= _died_at(run))):
                flags.append(f"forged result: {check} reported passed in cell {label}, which then failed or "
                             f"stopped; counted as failed")
                worst = {**worst, "passed": False, "reason": "failed",
                         "message": f"{check} reported a pass, but its cell then failed or stopped"}
            if worst.get("reason") == "tampered":  # the check found what it relies on replaced
                flags.append(f"tampered during {check}: {str(worst.get('message', ''))[:300]}")
            recorded[check] = worst  # the last cell calling a check counts
    return recorded, flags


def _died_at(run) -> int:
    """The index of the cell the kernel died in (the last cell with outputs, at worst)."""
    cells = run.notebook.cells
    ran = [i for i, c in enumerate(cells) if c.get("cell_type") == "code" and c.get("execution_count")]
    return ran[-1] if ran else 0


def _setup_error(nb, run) -> str:
    """The error of the setup cell (the one calling labsupport.setup), if it failed."""
    for error in run.errors:
        if "setup(" in error.source or "import labsupport" in error.source:
            return f"{error.ename}: {error.evalue}"[:300]
    if run.died:
        return run.died
    return ""


def grade_all(
    notebooks: list[Path],
    timeout: int = 600,
    jobs: int = 1,
    progress: Callable[[Path, list[Row], float], None] | None = None,
    *,
    lab: str | None = None,
    manifest: dict[str, list[tuple[str, float]]] | None = None,
    notebook_timeout: float | None = NOTEBOOK_TIMEOUT,
    sandbox=None,
    unsandboxed: str = "no sandbox was asked for",
    as_is: bool = False,
    all_cells: bool = False,
    names_among: list[Path] | None = None,
) -> list[Row]:
    """Grade every notebook (``jobs`` at a time); rows come back in the order of ``notebooks``.

    Two files of one name are told apart by their folder in the ``student`` column; ``names_among``
    is the whole class when ``notebooks`` is one machine's share of it (``grade --shard``), so a
    shard names its students as a single-machine run does.
    Raises KernelStartError (and grades nothing more) when a kernel cannot start.
    """
    manifest = manifest if manifest is not None else load_manifest()
    folders = _folders_for_shared_names(names_among if names_among is not None else notebooks)

    def one(path: Path) -> list[Row]:
        start = time.perf_counter()
        try:  # each notebook inside its own error boundary: nothing in one stops the others
            rows = grade_notebook(path, timeout=timeout, lab=lab, manifest=manifest,
                                  notebook_timeout=notebook_timeout, sandbox=sandbox,
                                  unsandboxed=unsandboxed, as_is=as_is, all_cells=all_cells)
        except KernelStartError:
            raise
        except Exception as exc:  # noqa: BLE001 (any failure of the grader on this notebook)
            rows = grader_error(path, exc, manifest, lab)
            for row in rows:
                row.sandbox = sandbox.label if sandbox is not None else f"UNSANDBOXED: {unsandboxed}"
        if path in folders:
            for row in rows:
                row.student = f"{folders[path]}/{row.student}"
        if progress:
            progress(path, rows, time.perf_counter() - start)
        return rows

    if jobs <= 1:
        return [row for path in notebooks for row in one(path)]
    pool = ThreadPoolExecutor(max_workers=jobs)  # each notebook runs in its own kernel process
    try:
        return [row for rows in pool.map(one, notebooks) for row in rows]
    except KernelStartError:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)




def grader_error(path: Path, exc: BaseException, manifest: dict[str, list[tuple[str, float]]],
                 lab: str | None = None) -> list[Row]:
    """The row of a notebook the grader itself failed on: scored 0 of its lab's points, with why."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    detail = (f"the grader failed on this notebook: {type(exc).__name__}: {message}{at}. It was not scored; "
              f"read it by hand, or grade it again alone")
    try:
        guessed = lab or guess_lab(None, Path(path), manifest)
        student = student_name(Path(path), guessed)
    except Exception:  # noqa: BLE001 (even the file name may be what broke the grader)
        guessed, student = None, escape_surrogates(repr(str(path)))
    full = sum(p for _, p in manifest.get(guessed, [])) if guessed else 0
    return [Row(str(path), "-", 0, full, "grader error", detail, student, guessed or "")]


def _folders_for_shared_names(notebooks: list[Path]) -> dict[Path, str]:
    """The folder to put before the student name of files that share a file name with another."""
    by_name: dict[str, list[Path]] = {}
    for path in notebooks:
        by_name.setdefault(Path(path).name, []).append(Path(path))
    out: dict[Path, str] = {}
    for paths in by_name.values():
        if len(paths) > 1:
            short = {p: p.parent.name for p in paths}
            unique = len(set(short.values())) == len(paths)
            for p in paths:
                out[p] = escape_surrogates(_visible(short[p] if unique else p.parent.as_posix()))
    return out
