"""``python -m labsupport grade``: run submitted notebooks and score their checks.

Each notebook runs headlessly in a fresh kernel, in a temporary folder (nothing is written next
to the submission, and the submission itself is never modified). Every ``check_*`` call records
its result.

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

Code that tampers with grading (the results file, the check machinery, patched ``labsupport``
names, the course's reference implementations handed to a check) is named in the ``flags`` column;
the score is left alone, and a person should read those notebooks.

Grading runs the submitted code with your permissions: grade work you do not trust inside a
container or a throwaway machine.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import re
import tempfile
import time
import tokenize
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .notebooks import KernelStartError, execute, load

CSV_HEADER = ["notebook", "student", "lab", "check", "points", "max_points", "status", "detail", "flags"]
OLD_CSV_HEADERS = (["notebook", "check", "points", "max_points", "status", "detail"],)  # earlier versions
COURSE_ROOT = Path(__file__).resolve().parent.parent  # the repository, for an editable install
MANIFEST = Path(__file__).resolve().parent / "lab_checks.json"
STATUSES = ("passed", "failed", "not done", "not run", "timeout", "setup failed", "missing",
            "not a notebook", "unknown lab", "no checks", "extra")
NOTEBOOK_TIMEOUT = 3600  # seconds a whole notebook may run, by default


class ManifestError(Exception):
    """labsupport/lab_checks.json is missing or unreadable: grading would not know the labs' checks."""


@dataclass
class Row:
    notebook: str
    check: str
    points: float
    max_points: float
    status: str  # one of STATUSES
    detail: str = ""
    student: str = ""
    lab: str = ""
    flags: str = ""


# -- the labs and their checks ----------------------------------------------------------------

def load_manifest(path: Path | None = None) -> dict[str, list[tuple[str, float]]]:
    """Each lab's checks and points, from ``lab_checks.json`` (written by ``release``)."""
    path = Path(path or MANIFEST)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {lab: [(c["check"], float(c["points"])) for c in entry["checks"]]
                for lab, entry in data["labs"].items()}
    except FileNotFoundError:
        raise ManifestError(
            f"{path} is missing, so the grader does not know which checks each lab has. In the course "
            f"repository run `python -m labsupport release` (it writes the file; commit it); elsewhere "
            f"reinstall the package from a commit that has it."
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}). In the course repository run "
            f"`python -m labsupport release` to write it again."
        ) from None


def manifest_drift(manifest: dict, root: Path = COURSE_ROOT) -> str:
    """In a course checkout, a warning when lab_checks.json no longer matches solutions/*.py."""
    sources = sorted((root / "solutions").glob("[0-9]*.py"))
    if not sources:
        return ""  # installed without the sources: the manifest is all there is
    from .release import lab_checks

    try:
        current = {lab: [(c["check"], float(c["points"])) for c in entry["checks"]]
                   for lab, entry in lab_checks(sources)["labs"].items()}
    except Exception as exc:  # a source that does not parse: release --check says more
        return f"could not compare lab_checks.json with solutions/*.py ({type(exc).__name__}: {exc})"
    if current != manifest:
        return ("labsupport/lab_checks.json does not match solutions/*.py (a lab's checks changed): "
                "grading uses lab_checks.json; run `python -m labsupport release` to update it")
    return ""


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


def student_name(path: Path, lab: str | None) -> str:
    """The file name without its lab part (``alice_07_attention.ipynb``: alice), else the file name."""
    path = Path(path)
    if lab:
        rest = _name_pattern(lab).sub(" ", path.stem)
        # a browser's "(1)", a file manager's "copy", Colab's "Copy of"
        rest = re.sub(r"\(\d+\)|\bcopy(\s+of)?\b", " ", rest, flags=re.IGNORECASE)
        rest = re.sub(r"[\s_\-.]+", " ", rest).strip()
        if rest:
            return rest.replace(" ", "_")
    return path.name


# -- reading code -----------------------------------------------------------------------------

def python_source(text: str) -> str:
    """A cell's code as the kernel runs it: IPython syntax (``%magic``, ``!shell``) made Python."""
    if not re.search(r"^\s*[%!]|\?\s*$", text, re.MULTILINE):
        return text
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return text
    try:
        return TransformerManager().transform_cell(text)
    except Exception:
        return text


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    """The tokens of ``text`` up to where it stops being Python (comments excluded)."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.COMMENT:
                out.append(tok)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def _parse(text: str) -> ast.AST | None:
    try:
        return ast.parse(python_source(text))
    except (SyntaxError, ValueError):
        return None


def check_calls(text: str) -> list[str]:
    """Names of the ``check_*`` functions the code calls (not in comments or strings), in order."""
    names: list[str] = []
    tree = _parse(text)
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _func_name(node)
                if name.startswith("check_") and name not in names:
                    names.append(name)
        names.sort(key=lambda n: _position(tree, n))
        for node in ast.walk(tree):  # %time check_x(f), %%time: the code a magic runs
            if isinstance(node, ast.Call) and _func_name(node) in ("run_line_magic", "run_cell_magic"):
                for arg in node.args[1:]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        names += [n for n in check_calls(arg.value) if n not in names]
        return names
    toks = _tokens(text)  # a cell that does not parse: the calls it spells out
    for tok, nxt in zip(toks, toks[1:]):
        if tok.type == tokenize.NAME and tok.string.startswith("check_") and nxt.string == "(":
            if tok.string not in names:
                names.append(tok.string)
    return names


def _position(tree: ast.AST, name: str) -> tuple[int, int]:
    found = [(n.lineno, n.col_offset) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]
    return min(found) if found else (0, 0)


def calls_by_cell(nb) -> dict[str, int]:
    """Each check the notebook calls, with the index of the first cell that calls it."""
    where: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for name in check_calls(cell.source):
                where.setdefault(name, index)
    return where


# -- things a person should look at -----------------------------------------------------------

SUSPECT_NAMES = {
    "LABSUPPORT_RESULTS": "LABSUPPORT_RESULTS (the grader's results file)",
    "RESULTS_ENV": "RESULTS_ENV (the grader's results file)",
    "Checker": "Checker (the check machinery)",
    "REGISTRY": "REGISTRY (the check registry)",
    "_record": "_record (writes check results)",
    "CheckResult": "CheckResult (check results)",
}
FRAMEWORK = "labsupport.checks.framework (the check machinery)"
# The course's answers by name. Not the names of the labs' own exercises (kv_bytes_per_token,
# max_concurrency, prefill_flops, ...): learners define functions with those names themselves.
REFERENCE = re.compile(r"(_reference|^attention_spec|^reference_intensity|^matmul_intensity)$")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _referenced(node: ast.AST) -> list[str]:
    """Course reference implementations named anywhere inside ``node``."""
    names = []
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if name and REFERENCE.search(name) and name not in names:
            names.append(name)
    return names


def _func_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def scan_flags(nb, known_checks: Iterable[str] = ()) -> list[str]:
    """What in the notebook's code looks like tampering with grading (for a person to read)."""
    flags: list[str] = []

    def add(text: str) -> None:
        if text not in flags:
            flags.append(text)

    known_checks = set(known_checks)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    trees = [_parse(src) for src in cells]
    for src, tree in zip(cells, trees):
        code = " ".join(t.string for t in _tokens(python_source(src)))  # comments left out
        if "LABSUPPORT_RESULTS" in code:  # in a name or a string
            add(SUSPECT_NAMES["LABSUPPORT_RESULTS"])
        for word, text in SUSPECT_NAMES.items():
            if re.search(rf"(?<![A-Za-z0-9_]){word}(?![A-Za-z0-9_])", code):
                add(text)
        if re.search(r"\bchecks \. framework\b|\bchecks import\b[^\n]*?\bframework\b", code):
            add(FRAMEWORK)
        if tree is None and "labsupport" in code:
            add("a cell that does not parse mentions labsupport (read it)")

    bound = {"labsupport"}  # names that refer to labsupport modules or what was imported from them
    for tree in filter(None, trees):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "labsupport":
                        bound.add((alias.asname or alias.name).split(".")[0])
                    if alias.name.startswith("labsupport.checks."):
                        add(FRAMEWORK if alias.name == "labsupport.checks.framework" else f"imports {alias.name}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labsupport":
                if (node.module or "").startswith("labsupport.checks."):
                    add(FRAMEWORK if node.module == "labsupport.checks.framework" else f"imports from {node.module}")
                bound.update(alias.asname or alias.name for alias in node.names)

    exercises: set[str] = set()  # the functions the notebook hands to checks
    for tree in filter(None, trees):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _func_name(node).startswith("check_") and node.args:
                if isinstance(node.args[0], ast.Name):
                    exercises.add(node.args[0].id)
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    for name in _referenced(arg):
                        add(f"passes the course's {name} to {_func_name(node)}")
    for tree in filter(None, trees):
        for node in ast.walk(tree):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, (ast.Attribute, ast.Subscript)) and (
                            _root_name(t) in bound or "labsupport" in ast.unparse(t)):
                        add(f"patches {ast.unparse(t)}")
                    elif isinstance(t, ast.Name) and t.id in known_checks:
                        add(f"redefines {t.id}")
                    elif isinstance(t, ast.Name) and t.id in exercises and getattr(node, "value", None) is not None:
                        for name in _referenced(node.value):
                            add(f"{t.id} is the course's {name}")
            if isinstance(node, ast.Call) and _func_name(node) in ("setattr", "delattr", "patch", "object") \
                    and node.args:
                first = node.args[0]
                if _root_name(first) in bound or (
                        isinstance(first, ast.Constant) and str(first.value).startswith("labsupport")):
                    add(f"patches {ast.unparse(first)} ({ast.unparse(node.func)})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in known_checks:
                    add(f"redefines {node.name}")
                if node.name in exercises:
                    for name in _referenced(ast.Module(body=node.body, type_ignores=[])):
                        add(f"{node.name} uses the course's {name}")
    return flags


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
    unique, seen = [], set()
    for path in found:
        key = path.resolve() if path.exists() else path
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def bad_paths(paths: Iterable[str]) -> list[str]:
    """Arguments that are neither a folder, a file, nor a (missing) notebook: likely typos."""
    return [raw for raw in paths if not Path(raw).exists() and not raw.endswith(".ipynb")]


def _first_error(run, upto: int | None) -> str:
    errors = [e for e in run.errors if upto is None or e.index <= upto] or run.errors
    if not errors:
        return ""
    e = errors[0]
    return f"in the cell starting `{e.first_line}`: {e.ename}: {str(e.evalue).strip()[:300]}"


def grade_notebook(
    path: Path,
    timeout: int = 600,
    *,
    lab: str | None = None,
    manifest: dict[str, list[tuple[str, float]]] | None = None,
    notebook_timeout: float | None = NOTEBOOK_TIMEOUT,
) -> list[Row]:
    """Score one notebook on its lab's checks (``lab`` forces the lab). One row per check."""
    manifest = manifest if manifest is not None else load_manifest()
    name = str(path)
    path = Path(path)

    def rows_for(check: str, points: float, max_points: float, status: str, detail: str = "") -> Row:
        return Row(name, check, points, max_points, status, detail, student_name(path, chosen), chosen or "")

    try:
        nb = load(path)
    except (FileNotFoundError, ValueError) as exc:
        status = "missing" if isinstance(exc, FileNotFoundError) else "not a notebook"
        chosen, _ = identify_lab(None, path, manifest, lab)
        full = sum(p for _, p in manifest.get(chosen, [])) if chosen else 0
        return [rows_for("-", 0, full, status, str(exc))]

    flags = "; ".join(scan_flags(nb, {c for checks in manifest.values() for c, _ in checks}))
    chosen, problem = identify_lab(nb, path, manifest, lab)
    if chosen is None:
        row = rows_for("-", 0, 0, "unknown lab", problem)
        row.flags = flags
        return [row]
    expected = manifest[chosen]
    if not expected:
        row = rows_for("-", 0, 0, "no checks", f"lab {chosen} has no graded checks")
        row.flags = flags
        return [row]

    called = calls_by_cell(nb)
    with tempfile.TemporaryDirectory(prefix="labsupport-grade-") as tmp:
        results_file = Path(tmp) / "results.jsonl"
        run = execute(nb, timeout=timeout, stop_on_error=False, quiet=True, notebook_timeout=notebook_timeout,
                      env={"LABSUPPORT_RESULTS": str(results_file)})
        recorded: dict[str, dict] = {}
        if results_file.exists():
            for line in results_file.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    recorded[str(entry["check"])] = entry  # the last call of a check counts
                except (ValueError, KeyError, TypeError):
                    continue  # a line that is not a check result (the notebook wrote to the file)

    setup_error = _setup_error(nb, run)
    rows = []
    for check, max_points in expected:
        entry = recorded.get(check)
        cell = called.get(check)
        if entry is None:
            timeouts = [t for t in run.timeouts if cell is None or t.index <= cell]
            if check not in called:
                status, detail = "not run", (f"the notebook does not call {check} (was the check cell "
                                             f"deleted or commented out?)")
            elif run.died:
                status, detail = "not run", run.died
            elif timeouts:
                t = timeouts[-1]
                status = "timeout"
                if t.ename == "NotebookTimeout":
                    detail = f"{run.notebook_timed_out}; it was stopped in the cell starting `{t.first_line}`"
                else:
                    detail = f"the cell starting `{t.first_line}` ran past {timeout} s and was interrupted"
            elif run.notebook_timed_out:
                status, detail = "timeout", f"{run.notebook_timed_out} before this check ran"
            elif setup_error:
                status, detail = "setup failed", setup_error
            else:
                first = _first_error(run, cell)
                status = "not run"
                detail = (f"the check did not run; the first error was {first}" if first else
                          f"the cell calling {check} ran without calling it")
            rows.append(rows_for(check, 0, max_points, status, detail))
        elif entry.get("passed"):
            rows.append(rows_for(check, max_points, max_points, "passed"))
        elif entry.get("reason") == "not done":
            rows.append(rows_for(check, 0, max_points, "not done", "the exercise still raises NotImplementedError"))
        else:
            detail = str(entry.get("message", "")).strip()[:2000]  # the whole diagnosis, for the CSV
            rows.append(rows_for(check, 0, max_points, "failed", detail))
    own = {c for c, _ in expected}
    for check in recorded:
        if check not in own:
            home = next((lab_ for lab_, checks in manifest.items() if any(c == check for c, _ in checks)), None)
            where = f"a check of lab {home}" if home else "not a check of any lab"
            rows.append(rows_for(check, 0, 0, "extra", f"{where}, not of {chosen}: not scored"))
    for row in rows:
        row.flags = flags
    return rows


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
) -> list[Row]:
    """Grade every notebook (``jobs`` at a time); rows come back in the order of ``notebooks``.

    Raises KernelStartError (and grades nothing more) when a kernel cannot start.
    """
    manifest = manifest if manifest is not None else load_manifest()

    def one(path: Path) -> list[Row]:
        start = time.perf_counter()
        rows = grade_notebook(path, timeout=timeout, lab=lab, manifest=manifest, notebook_timeout=notebook_timeout)
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


def check_csv_target(path: Path) -> None:
    """Refuse, before any grading, a path the scores could not be written to, or a foreign file."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give --csv a file name")
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist; create it or "
                                f"choose another path with --csv")
    if path.exists():
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            first = next(csv.reader(f), None)
        if first != CSV_HEADER and first not in OLD_CSV_HEADERS:
            raise FileExistsError(
                f"{path} exists and is not a grades file written by this command; "
                f"choose another path with --csv"
            )
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write {path}: it is not writable; choose another path with --csv")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable; choose another "
                              f"path with --csv")


def write_csv(rows: list[Row], path: Path, *, checked: bool = True) -> None:
    """Write the scores; ``checked=False`` skips :func:`check_csv_target` (for a fresh temp file)."""
    if checked:
        check_csv_target(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in rows:
            writer.writerow([r.notebook, r.student, r.lab, r.check, f"{r.points:g}", f"{r.max_points:g}",
                             r.status, r.detail, r.flags])


def totals(rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Points earned and possible per notebook, in first-seen order."""
    out: dict[str, list[float]] = {}
    for r in rows:
        t = out.setdefault(r.notebook, [0.0, 0.0])
        t[0] += r.points
        t[1] += r.max_points
    return {k: (v[0], v[1]) for k, v in out.items()}


def _short(text: str, width: int) -> str:
    """The first line of ``text``, cut to ``width`` characters."""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= width and len(lines) <= 1 else first[: width - 3].rstrip() + "..."


def summary_line(rows: list[Row]) -> str:
    """One notebook's result in a line: total and what happened to each check."""
    got, out_of = totals(rows)[rows[0].notebook] if rows else (0, 0)
    parts = [f"{r.check} {r.status}" if r.check != "-" else r.status for r in rows]
    flagged = "  FLAGGED" if rows and rows[0].flags else ""
    return f"{got:g}/{out_of:g}  ({', '.join(parts)}){flagged}"


def format_table(rows: list[Row], detail_width: int = 90) -> str:
    """Scores grouped by notebook: a total line, then one line per check (details in the CSV)."""
    if not rows:
        return "no notebooks graded"
    cwidth = max([len("check")] + [len(r.check) for r in rows])
    lines = []
    sums = totals(rows)
    flagged = []
    for nb_name, (got, out_of) in sums.items():
        mine = [r for r in rows if r.notebook == nb_name]
        lab = f"  [{mine[0].lab}]" if mine[0].lab else ""
        lines.append(f"{nb_name}  {got:g}/{out_of:g}{lab}")
        for r in mine:
            score = f"{r.points:g}/{r.max_points:g}"
            status = r.status + (f": {_short(r.detail, detail_width)}" if r.detail and r.status != "passed" else "")
            lines.append(f"    {r.check:<{cwidth}}  {score:>7}  {status}")
        if mine[0].flags:
            flagged.append(nb_name)
            lines.append(f"    flags: {_short(mine[0].flags, detail_width + 20)}")
    full = sum(1 for got, out_of in sums.values() if out_of and got == out_of)
    counts = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines += ["", f"{len(sums)} notebook(s), {full} with full marks; checks: {tally}"]
    if flagged:
        lines.append(f"{len(flagged)} notebook(s) flagged: read them before trusting their scores "
                     f"(the flags column of the CSV says what was found)")
    return "\n".join(lines)
