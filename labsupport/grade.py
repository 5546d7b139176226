"""``python -m labsupport grade``: run submitted notebooks and score their checks.

Each notebook runs headlessly in a fresh kernel, in a temporary folder (nothing is written next
to the submission, and the submission itself is never modified). Every ``check_*`` call records
its result; a check that never ran (the notebook stopped earlier, or the call was deleted) scores
zero. One notebook's problem (missing, not a notebook, setup failing, a timeout) is reported on
its own row and grading goes on with the rest.
"""

from __future__ import annotations

import csv
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .notebooks import execute, load

CHECK_CALL = re.compile(r"\b(check_[A-Za-z0-9_]+)\s*\(")
CSV_HEADER = ["notebook", "check", "points", "max_points", "status", "detail"]


@dataclass
class Row:
    notebook: str
    check: str
    points: float
    max_points: float
    status: str  # passed, failed, not run, missing, not a notebook, setup failed, timeout
    detail: str = ""


def expand(paths: list[str]) -> list[Path]:
    """Files as given; folders become every .ipynb below them (checkpoints skipped)."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(
                p for p in sorted(path.rglob("*.ipynb")) if ".ipynb_checkpoints" not in p.parts
            )
        else:
            found.append(path)
    return found


def grade_notebook(path: Path, timeout: int = 600) -> list[Row]:
    from .checks import REGISTRY

    name = str(path)
    try:
        nb = load(path)
    except FileNotFoundError as exc:
        return [Row(name, "-", 0, 0, "missing", str(exc))]
    except ValueError as exc:
        return [Row(name, "-", 0, 0, "not a notebook", str(exc))]

    expected: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            for check in CHECK_CALL.findall(cell.source):
                if check in REGISTRY and check not in expected:
                    expected.append(check)
    if not expected:
        return [Row(name, "-", 0, 0, "no checks", "the notebook calls no labsupport check")]

    with tempfile.TemporaryDirectory(prefix="labsupport-grade-") as tmp:
        results_file = Path(tmp) / "results.jsonl"
        run = execute(nb, timeout=timeout, stop_on_error=False, env={"LABSUPPORT_RESULTS": str(results_file)})
        recorded = {}
        if results_file.exists():
            for line in results_file.read_text(encoding="utf-8").splitlines():
                entry = json.loads(line)
                recorded[entry["check"]] = entry  # the last call of a check counts

    setup_error = _setup_error(nb, run)
    rows = []
    for check in expected:
        max_points = REGISTRY[check].points
        entry = recorded.get(check)
        if entry is None:
            if run.died:
                status, detail = "not run", run.died
            elif run.timed_out:
                status, detail = "timeout", f"cell {run.timed_out.index} ran past {timeout} s"
            elif setup_error:
                status, detail = "setup failed", setup_error
            else:
                status, detail = "not run", "the check was not reached (an earlier cell failed?)"
            rows.append(Row(name, check, 0, max_points, status, detail))
        else:
            passed = entry["passed"]
            detail = "" if passed else entry["message"].splitlines()[0][:300]
            rows.append(Row(name, check, entry["points"], max_points, "passed" if passed else "failed", detail))
    return rows


def _setup_error(nb, run) -> str:
    """The error of the setup cell (the one calling labsupport.setup), if it failed."""
    for error in run.errors:
        if "setup(" in error.source or "import labsupport" in error.source:
            return f"{error.ename}: {error.evalue}"[:300]
    if run.died:
        return run.died
    return ""


def write_csv(rows: list[Row], path: Path) -> None:
    if path.exists():
        with open(path, newline="", encoding="utf-8") as f:
            first = next(csv.reader(f), None)
        if first != CSV_HEADER:
            raise FileExistsError(
                f"{path} exists and is not a grades file written by this command; "
                f"choose another path with --csv"
            )
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in rows:
            writer.writerow([r.notebook, r.check, f"{r.points:g}", f"{r.max_points:g}", r.status, r.detail])


def format_table(rows: list[Row]) -> str:
    width = max([len("notebook")] + [len(r.notebook) for r in rows])
    cwidth = max([len("check")] + [len(r.check) for r in rows])
    lines = [f"{'notebook':<{width}}  {'check':<{cwidth}}  {'score':>9}  status"]
    for r in rows:
        score = f"{r.points:g}/{r.max_points:g}"
        lines.append(f"{r.notebook:<{width}}  {r.check:<{cwidth}}  {score:>9}  {r.status}"
                     + (f": {r.detail}" if r.detail else ""))
    totals: dict[str, list[float]] = {}
    for r in rows:
        t = totals.setdefault(r.notebook, [0, 0])
        t[0] += r.points
        t[1] += r.max_points
    lines.append("")
    for nb_name, (got, out_of) in totals.items():
        lines.append(f"{nb_name:<{width}}  {'TOTAL':<{cwidth}}  {f'{got:g}/{out_of:g}':>9}")
    return "\n".join(lines)
