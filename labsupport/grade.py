"""``python -m labsupport grade``: run submitted notebooks and score their checks.

Each notebook runs headlessly in a fresh kernel, in a temporary folder (nothing is written next
to the submission, and the submission itself is never modified). Every ``check_*`` call records
its result. The checks a notebook is graded on are those its lab calls in the course's source
(``solutions/NN_name.py``, found from the notebook's metadata or its file name) plus any other
check the notebook calls; a check that never ran (the notebook stopped earlier, or the call was
deleted) scores zero. One notebook's problem (missing, not a notebook, setup failing, a timeout)
is reported on its own row and grading goes on with the rest.

Grading runs the submitted code with your permissions: grade work you do not trust inside a
container or a throwaway machine.
"""

from __future__ import annotations

import csv
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .notebooks import execute, load

CHECK_CALL = re.compile(r"\b(check_[A-Za-z0-9_]+)\s*\(")
CSV_HEADER = ["notebook", "check", "points", "max_points", "status", "detail"]
COURSE_ROOT = Path(__file__).resolve().parent.parent  # the repository, for an editable install
STATUSES = ("passed", "failed", "not done", "not run", "timeout", "setup failed", "missing",
            "not a notebook", "no checks")


@dataclass
class Row:
    notebook: str
    check: str
    points: float
    max_points: float
    status: str  # one of STATUSES
    detail: str = ""


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


def _calls(sources: Iterable[str], registry) -> list[str]:
    names: list[str] = []
    for text in sources:
        for check in CHECK_CALL.findall(text):
            if check in registry and check not in names:
                names.append(check)
    return names


def lab_source(nb, path: Path, root: Path = COURSE_ROOT) -> Path | None:
    """The course source (``solutions/NN_name.py``) a submitted notebook was released from."""
    folder = root / "solutions"
    if not folder.is_dir():
        return None  # labsupport installed from a wheel: no sources to compare with
    recorded = nb.metadata.get("labsupport", {}).get("source", "")
    if recorded and (root / recorded).is_file():
        return root / recorded
    for source in sorted(folder.glob("[0-9]*.py"), key=lambda p: -len(p.stem)):
        if source.stem in path.stem:  # renamed copies: alice_07_attention.ipynb
            return source
    return None


def expected_checks(nb, path: Path, root: Path = COURSE_ROOT) -> tuple[list[str], set[str]]:
    """The checks to grade ``nb`` on, and those among them the notebook no longer calls."""
    from .checks import REGISTRY
    from .release import parse_source

    called = _calls((c.source for c in nb.cells if c.cell_type == "code"), REGISTRY)
    source = lab_source(nb, path, root)
    required: list[str] = []
    if source is not None:
        try:
            cells = parse_source(source)
        except Exception:
            cells = []
        required = _calls(("\n".join(c.lines) for c in cells if c.kind == "code"), REGISTRY)
    expected = required + [c for c in called if c not in required]
    return expected, {c for c in required if c not in called}


def grade_notebook(path: Path, timeout: int = 600) -> list[Row]:
    from .checks import REGISTRY

    name = str(path)
    try:
        nb = load(path)
    except FileNotFoundError as exc:
        return [Row(name, "-", 0, 0, "missing", str(exc))]
    except ValueError as exc:
        return [Row(name, "-", 0, 0, "not a notebook", str(exc))]

    expected, deleted = expected_checks(nb, Path(path))
    if not expected:
        return [Row(name, "-", 0, 0, "no checks", "the notebook calls no labsupport check")]

    with tempfile.TemporaryDirectory(prefix="labsupport-grade-") as tmp:
        results_file = Path(tmp) / "results.jsonl"
        run = execute(nb, timeout=timeout, stop_on_error=False, quiet=True,
                      env={"LABSUPPORT_RESULTS": str(results_file)})
        recorded = {}
        if results_file.exists():
            for line in results_file.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    recorded[entry["check"]] = entry  # the last call of a check counts
                except (ValueError, KeyError, TypeError):
                    continue  # a line that is not a check result (the notebook wrote to the file)

    setup_error = _setup_error(nb, run)
    rows = []
    for check in expected:
        max_points = REGISTRY[check].points
        entry = recorded.get(check)
        if entry is None:
            if check in deleted:
                status, detail = "not run", f"the notebook does not call {check} (the check cell was removed?)"
            elif run.died:
                status, detail = "not run", run.died
            elif run.timed_out:
                status, detail = "timeout", f"cell {run.timed_out.index} ran past {timeout} s"
            elif setup_error:
                status, detail = "setup failed", setup_error
            else:
                status, detail = "not run", "the check was not reached (an earlier cell failed?)"
            rows.append(Row(name, check, 0, max_points, status, detail))
        elif entry.get("passed"):
            rows.append(Row(name, check, max_points, max_points, "passed"))
        elif entry.get("reason") == "not done":
            rows.append(Row(name, check, 0, max_points, "not done", "the exercise still raises NotImplementedError"))
        else:
            detail = str(entry.get("message", "")).strip()[:2000]  # the whole diagnosis, for the CSV
            rows.append(Row(name, check, 0, max_points, "failed", detail))
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
    notebooks: list[Path], timeout: int = 600, jobs: int = 1, progress: Callable[[Path, list[Row], float], None] | None = None
) -> list[Row]:
    """Grade every notebook (``jobs`` at a time); rows come back in the order of ``notebooks``."""

    def one(path: Path) -> list[Row]:
        start = time.perf_counter()
        rows = grade_notebook(path, timeout=timeout)
        if progress:
            progress(path, rows, time.perf_counter() - start)
        return rows

    if jobs <= 1:
        return [row for path in notebooks for row in one(path)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each notebook runs in its own kernel process
        return [row for rows in pool.map(one, notebooks) for row in rows]


def check_csv_target(path: Path) -> None:
    """Refuse, before any grading, to replace a file that is not a grades file written here."""
    if path.is_dir():
        raise FileExistsError(f"{path} is a folder; give --csv a file name")
    if path.exists():
        with open(path, newline="", encoding="utf-8") as f:
            first = next(csv.reader(f), None)
        if first != CSV_HEADER:
            raise FileExistsError(
                f"{path} exists and is not a grades file written by this command; "
                f"choose another path with --csv"
            )


def write_csv(rows: list[Row], path: Path) -> None:
    check_csv_target(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in rows:
            writer.writerow([r.notebook, r.check, f"{r.points:g}", f"{r.max_points:g}", r.status, r.detail])


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
    return f"{got:g}/{out_of:g}  ({', '.join(parts)})"


def format_table(rows: list[Row], detail_width: int = 90) -> str:
    """Scores grouped by notebook: a total line, then one line per check (details in the CSV)."""
    if not rows:
        return "no notebooks graded"
    cwidth = max([len("check")] + [len(r.check) for r in rows])
    lines = []
    sums = totals(rows)
    for nb_name, (got, out_of) in sums.items():
        lines.append(f"{nb_name}  {got:g}/{out_of:g}")
        for r in (r for r in rows if r.notebook == nb_name):
            score = f"{r.points:g}/{r.max_points:g}"
            status = r.status + (f": {_short(r.detail, detail_width)}" if r.detail and r.status != "passed" else "")
            lines.append(f"    {r.check:<{cwidth}}  {score:>7}  {status}")
    full = sum(1 for got, out_of in sums.values() if out_of and got == out_of)
    counts = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines += ["", f"{len(sums)} notebook(s), {full} with full marks; checks: {tally}"]
    return "\n".join(lines)
