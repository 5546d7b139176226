"""The grader's output: rows of scores, the table printed at the end and the CSV file."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

CSV_HEADER = ["notebook", "student", "lab", "check", "points", "max_points", "status", "detail", "flags"]
OLD_CSV_HEADERS = (["notebook", "check", "points", "max_points", "status", "detail"],)  # earlier versions
STATUSES = ("passed", "failed", "not done", "not run", "timeout", "setup failed", "missing",
            "not a notebook", "unknown lab", "no checks", "extra")


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
