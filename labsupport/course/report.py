"""The grader's output: rows of scores, the table printed at the end and the CSV file."""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .files import write_atomically

CSV_HEADER = ["notebook", "student", "lab", "check", "points", "max_points", "status", "detail", "flags",
              "sandbox", "learner_cells", "ignored"]  # new columns go at the end: spreadsheets keep working
OLD_CSV_HEADERS = (["notebook", "check", "points", "max_points", "status", "detail"],  # earlier versions
                   CSV_HEADER[:9])
STATUSES = ("passed", "failed", "not done", "not run", "timeout", "setup failed", "missing",
            "not a notebook", "unknown lab", "no checks", "grader error", "unmatched", "extra")


def escape_surrogates(text: str) -> str:
    """``text`` with lone surrogates (a non-UTF-8 file name, a crafted message) as ``\\udcff`` escapes,
    so it can be printed and written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    sandbox: str = ""  # "bwrap", "container IMAGE (engine)", or "UNSANDBOXED: why"
    learner_cells: str = ""  # the course's exercise cells that ran the learner's version
    ignored: str = ""  # what of the learner's notebook did not run (added cells, edited course cells)

    def __setattr__(self, name, value):  # every text a row holds can be printed and written
        super().__setattr__(name, escape_surrogates(value) if isinstance(value, str) else value)


def check_csv_target(path: Path, overwrite: bool = False) -> None:
    """Refuse, before any grading, a path the scores could not be written to, a foreign file, or
    (without ``overwrite``) an existing grades file."""
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
        if not overwrite:
            raise FileExistsError(f"{path} already exists (earlier grades?); choose another path with --csv, "
                                  f"or give --overwrite to replace it (the old file is kept as {path.name}.bak)")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write {path}: it is not writable; choose another path with --csv")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable; choose another "
                              f"path with --csv")


def write_csv(rows: list[Row], path: Path, *, checked: bool = True, overwrite: bool = True) -> None:
    """Write the scores atomically (a reader sees the old file or the new one, never half of one);
    ``checked=False`` skips :func:`check_csv_target` (for a fresh temp file)."""
    path = Path(path)
    if checked:
        check_csv_target(path, overwrite=overwrite)
    def write(f) -> None:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in rows:
            writer.writerow([escape_surrogates(str(x)) for x in (
                r.notebook, r.student, r.lab, r.check, f"{r.points:g}", f"{r.max_points:g}", r.status,
                r.detail, r.flags, r.sandbox, r.learner_cells, r.ignored)])

    write_atomically(path, write, newline="", encoding="utf-8", errors="backslashreplace")


class GradesFile:
    """The CSV, rewritten (atomically) after every notebook, so a crash keeps the rows graded so far.

    ``start`` refuses an existing file unless ``overwrite`` (then the old one is kept as ``.bak``).
    If the file cannot be written mid-way (the disk filled, the folder went away), the rows go on to
    a fresh temporary file, named in ``fallback``. Safe to call from several threads.
    """

    def __init__(self, path: Path, overwrite: bool = False):
        self.path = Path(path)
        self.overwrite = overwrite
        self.rows: list[Row] = []
        self.fallback: Path | None = None
        self.error: OSError | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise OSError if the file could not or should not be written (before any grading)."""
        check_csv_target(self.path, overwrite=self.overwrite)

    def start(self) -> None:
        """Check again, and keep a copy of the file about to be replaced (only with ``overwrite``)."""
        self.check()
        if self.path.exists():
            shutil.copy2(self.path, self.path.with_name(self.path.name + ".bak"))

    def add(self, rows: list[Row]) -> None:
        with self._lock:
            self.rows.extend(rows)
            self._write(self.rows)

    def finish(self, rows: list[Row]) -> Path:
        """Write ``rows`` (every notebook's, in order) as the final file; returns where they went."""
        with self._lock:
            self.rows = list(rows)
            self._write(self.rows)
            return self.fallback or self.path

    def _write(self, rows: list[Row]) -> None:
        if self.fallback is None:
            try:
                write_csv(rows, self.path, checked=False)
                return
            except OSError as exc:
                self.error = exc
                fd, name = tempfile.mkstemp(prefix="grades-", suffix=".csv")
                os.close(fd)
                self.fallback = Path(name)
        write_csv(rows, self.fallback, checked=False)


def totals(rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Points earned and possible per notebook, in first-seen order."""
    out: dict[str, list[float]] = {}
    for r in rows:
        t = out.setdefault(r.notebook, [0.0, 0.0])
        t[0] += r.points
        t[1] += r.max_points
    return {k: (v[0], v[1]) for k, v in out.items()}


def unplaced(rows: list[Row]) -> list[str]:
    """Notebooks on no lab at all (the lab is unknown and could not be guessed), listed apart."""
    names: dict[str, bool] = {}
    for r in rows:
        names[r.notebook] = names.get(r.notebook, True) and not r.lab and r.check == "-"
    return [n for n, apart in names.items() if apart]


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
    flagged += "  UNSANDBOXED" if rows and rows[0].sandbox.startswith("UNSANDBOXED") else ""
    return f"{got:g}/{out_of:g}  ({', '.join(parts)}){flagged}"


def format_table(rows: list[Row], detail_width: int = 90) -> str:
    """Scores grouped by notebook: a total line, then one line per check (details in the CSV)."""
    if not rows:
        return "no notebooks graded"
    cwidth = max([len("check")] + [len(r.check) for r in rows])
    lines = []
    sums = totals(rows)
    flagged = []
    apart = unplaced(rows)
    for nb_name, (got, out_of) in sums.items():
        mine = [r for r in rows if r.notebook == nb_name]
        if nb_name in apart:
            if mine[0].flags:
                flagged.append(nb_name)
            continue
        lab = f"  [{mine[0].lab}]" if mine[0].lab else ""
        loud = "  UNSANDBOXED" if mine[0].sandbox.startswith("UNSANDBOXED") else ""
        lines.append(f"{nb_name}  {got:g}/{out_of:g}{lab}{loud}")
        for r in mine:
            score = f"{r.points:g}/{r.max_points:g}"
            status = r.status + (f": {_short(r.detail, detail_width)}" if r.detail and r.status != "passed" else "")
            lines.append(f"    {r.check:<{cwidth}}  {score:>7}  {status}")
        if mine[0].learner_cells:
            lines.append(f"    learner's cells: {_short(mine[0].learner_cells, detail_width + 10)}")
        if mine[0].ignored:
            lines.append(f"    not run: {_short(mine[0].ignored, detail_width + 20)}")
        if mine[0].flags:
            flagged.append(nb_name)
            lines.append(f"    flags: {_short(mine[0].flags, detail_width + 20)}")
    if apart:
        lines += ["", f"{len(apart)} notebook(s) whose lab could not be guessed (in no lab's totals; grade "
                      f"them with --lab NAME):"]
        for nb_name in apart:
            r = next(r for r in rows if r.notebook == nb_name)
            lines.append(f"    {nb_name}: {_short(r.detail, detail_width)}")
            if r.flags:
                lines.append(f"        flags: {_short(r.flags, detail_width + 20)}")
    full = sum(1 for got, out_of in sums.values() if out_of and got == out_of)
    counts = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines += ["", f"{len(sums)} notebook(s), {full} with full marks; checks: {tally}"]
    bare = sorted({r.sandbox for r in rows if r.sandbox.startswith("UNSANDBOXED")})
    if bare:
        lines.append(f"UNSANDBOXED: {sum(1 for n in sums if next(r for r in rows if r.notebook == n).sandbox in bare)} "
                     f"notebook(s) ran with the grader's own permissions ({'; '.join(s[len('UNSANDBOXED: '):] for s in bare)})")
    if flagged:
        lines.append(f"{len(flagged)} notebook(s) flagged: read them before trusting their scores "
                     f"(the flags column of the CSV says what was found)")
    return "\n".join(lines)
