"""What the grader adds to the notebook it runs, to catch checks tampered with in memory.

Learner code runs in the same Python process as the checks, so it could replace them there. Two
cells of the grader's narrow that:

* every course cell that calls a check first imports that check again from ``labsupport.checks``
  (:func:`reimport`), so a learner's own ``check_x`` in the notebook's namespace is not the one called;
* a last cell (:func:`probe_cell`) compares, once everything ran, the code of every function of the
  check framework and of every registered check with the code compiled from the files on disk (read
  only in the sandbox), and that the modules' ``check_*`` names are the registered checks, and looks
  for a trace or profile hook. It answers with a nonce drawn for this run only, which the learner's
  code cannot know before the cell runs.

This is detection, not prevention: code that patches the checks, lets them report a pass and puts
everything back before the last cell, or that hooks the probe itself, is not caught (the flag
scanner still reads the source); the README's trust model says so.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from ..checks.framework import RESULT_MIME
from .scan import check_calls

PROBE_MIME = RESULT_MIME.replace("check-result", "probe")

PROBE_SOURCE = Path(__file__).with_name("probe_cell.py")  # the last cell's function, a file of its own


def reimport(source: str) -> str:
    """A course check cell's source, importing its checks afresh first."""
    names = [n for n in check_calls(source) if n.startswith("check_")]
    if not names:
        return source
    return f"from labsupport.checks import {', '.join(names)}  # added by the grader\n{source}"


def probe_cell() -> tuple[str, str]:
    """The last cell's source, and the nonce its answer must carry."""
    nonce = secrets.token_hex(16)
    source = PROBE_SOURCE.read_text(encoding="utf-8")
    return f"{source}\n_labsupport_probe({nonce!r}, {PROBE_MIME!r})\n", nonce


def verdict(cell, nonce: str, kernel_alive: bool) -> list[str]:
    """Flags from the probe cell's outputs (none when it answered with the nonce and found nothing)."""
    answers = [o.get("data", {}).get(PROBE_MIME) for o in cell.get("outputs", [])
               if PROBE_MIME in (o.get("data") or {})]
    mine = [a for a in answers if isinstance(a, dict) and a.get("nonce") == nonce]
    if len(mine) != 1 or len(answers) != 1:
        if not kernel_alive:
            return []  # the kernel died or was stopped: the rows say so already
        return ["integrity probe: no single answer from the last cell (the check machinery may have been "
                "tampered with in memory); read this notebook"]
    problems = [str(p) for p in mine[0].get("problems") or []]
    return [f"tampered in memory: {'; '.join(problems)[:500]}"] if problems else []
