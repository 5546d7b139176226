"""How a failed check looks in a notebook: the message and hint, not the framework's traceback.

IPython asks an exception for ``_render_traceback_()`` before formatting its traceback;
:class:`~labsupport.checks.framework.CheckFailed` answers with :func:`learner_view`: the check's
message (which names the case, the error and a hint) and one pointer into the learner's own code.
Instructors who want the whole traceback set ``LABSUPPORT_FULL_TRACEBACK=1`` (in a notebook:
``%env LABSUPPORT_FULL_TRACEBACK=1``, then run the cell again).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

FULL_TRACEBACK_VAR = "LABSUPPORT_FULL_TRACEBACK"
RED, DIM, RESET = "\x1b[0;31m", "\x1b[2m", "\x1b[0m"


def full_traceback_wanted() -> bool:
    return os.environ.get(FULL_TRACEBACK_VAR, "").strip().lower() not in ("", "0", "false", "no")


def _cell_name(filename: str) -> str:
    """IPython's name for a cell's code ("Cell In[7]"), or the file's name."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        number = shell.compile._filename_map.get(filename) if shell is not None else None
    except Exception:  # not in IPython, or an IPython without the map
        number = None
    if number is not None:
        return f"Cell In[{number}]"
    return os.path.basename(filename) if not filename.startswith("<") else filename


def learner_frame(exc: BaseException, is_learner: Callable[[str], bool]):
    """The frame of the learner's code that matters most: where their code raised inside the check
    (the exception's cause), else the line of theirs that called the check. None if there is none.
    ``is_learner(filename)`` tells the learner's code from libraries and the course's own."""
    cause = exc.__cause__
    if cause is not None and cause.__traceback__ is not None:
        inner = [f for f in traceback.extract_tb(cause.__traceback__) if is_learner(f.filename)]
        if inner:
            return inner[-1]
    outer = [f for f in traceback.extract_tb(exc.__traceback__) if is_learner(f.filename)]
    return outer[0] if outer else None


def learner_view(exc: BaseException, is_learner: Callable[[str], bool]) -> list[str]:
    """The lines a notebook shows for a failed check (IPython's ``_render_traceback_`` contract)."""
    lines = [f"{RED}{type(exc).__name__}{RESET}: {str(exc).strip()}"]
    frame = learner_frame(exc, is_learner)
    if frame is not None:
        where = f"{_cell_name(frame.filename)}, line {frame.lineno}"
        if frame.name not in ("<module>", "<cell line: 0>"):
            where += f", in {frame.name}"
        lines.append(f"\n{where}: {frame.line.strip()}" if frame.line else f"\n{where}")
    lines.append(f"{DIM}(the full traceback: %env {FULL_TRACEBACK_VAR}=1, then run the cell again){RESET}")
    return lines
