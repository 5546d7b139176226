"""The instructors' part of the book: a session's timed outline and the course's table of labs.

The session plans (``book/instructors/``) write their outline as rows of ``minutes | activity`` in a
``{session-outline}`` directive; :func:`outline_markdown` checks the minutes add up to the session's
length (:data:`SESSION_MINUTES`) and computes each row's start and end. :func:`labs_markdown` is the
overview's table of labs, checks and points, read from the checks (:mod:`.diagnoses`). The
directives themselves live in ``book/_ext/instructors.py``; nothing here imports torch or runs a check.
"""

from __future__ import annotations

from .diagnoses import check_modules, diagnose_lab

SESSION_MINUTES = 90


def parse_outline(lines: list[str]) -> list[tuple[int, str]]:
    """``["10 | Recap", ...]`` -> ``[(10, "Recap"), ...]``; a malformed row is named."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        minutes, sep, activity = line.partition("|")
        if not sep or not minutes.strip().isdigit() or not activity.strip():
            raise ValueError(f"outline row {number} is {line!r}; write it as `minutes | what happens`.")
        rows.append((int(minutes), activity.strip()))
    return rows


def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


def outline_markdown(rows: list[tuple[int, str]], total: int = SESSION_MINUTES) -> str:
    """A Markdown table of the outline, each row with its start and end (``0:10-0:25``)."""
    spent = sum(m for m, _ in rows)
    if spent != total:
        raise ValueError(f"the outline's rows add up to {spent} minutes, not the session's {total}: "
                         f"{', '.join(str(m) for m, _ in rows)}.")
    lines = ["| when | minutes | what happens |", "| --- | --- | --- |"]
    start = 0
    for minutes, activity in rows:
        lines.append(f"| {_clock(start)}–{_clock(start + minutes)} | {minutes} | {activity} |")
        start += minutes
    return "\n".join(lines)


def labs_markdown() -> str:
    """Every lab with checks: its graded checks and their points (from the check modules)."""
    lines = ["| lab | graded checks | points |", "| --- | --- | --- |"]
    for key in check_modules():
        table = diagnose_lab(key)
        names = ", ".join(f"`{c.name}` ({c.points:g})" for c in table)
        lines.append(f"| {key} | {names} | {sum(c.points or 0 for c in table):g} |")
    return "\n".join(lines)
