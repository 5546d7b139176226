"""How a failed check looks in a notebook: the message and hint, not the framework's traceback.

IPython asks an exception for ``_render_traceback_()`` before formatting its traceback;
:class:`~labsupport.checks.framework.CheckFailed` answers with :func:`learner_view`: the check's
message (which names the case, the error and a hint) and one pointer into the learner's own code:
the line of theirs that raised, or, for a wrong result, the ``def`` of the function (or class)
that returned it, or else their line that called the check.

Where the learner's own code raised, a last line says how to see the whole traceback: set
``LABSUPPORT_FULL_TRACEBACK=1`` (in a notebook: ``%env LABSUPPORT_FULL_TRACEBACK=1``, then run the
cell again). For a wrong result or an exercise not yet written, the whole traceback would show
only the check's own code, so that line is left out.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

FULL_TRACEBACK_VAR = "LABSUPPORT_FULL_TRACEBACK"
RED, DIM, RESET = "\x1b[0;31m", "\x1b[2m", "\x1b[0m"
SWITCH = f"(the whole traceback: %env {FULL_TRACEBACK_VAR}=1, then run this cell again)"


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


@dataclass
class Pointer:
    """A line of the learner's code to show: where it is, the function it is in, and its text."""

    filename: str
    lineno: int
    name: str = "<module>"  # the function the line is in ("<module>": none to name)
    line: str = ""


def definition(obj, is_learner: Callable[[str], bool]) -> Pointer | None:
    """Where the learner defined ``obj`` (a function, a class, a method, a partial or an instance
    of their class): its ``def`` or ``class`` line. None if it is not in the learner's code."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # a bound method
    try:
        obj = inspect.unwrap(obj)
    except ValueError:  # a __wrapped__ cycle
        pass
    if not inspect.isfunction(obj) and not inspect.isclass(obj):
        obj = type(obj)  # an instance of the learner's class
    if inspect.isclass(obj):
        methods = [m for m in vars(obj).values() if inspect.isfunction(m) and is_learner(m.__code__.co_filename)]
        if not methods:
            return None
        first = min(methods, key=lambda m: m.__code__.co_firstlineno).__code__
        for lineno in range(first.co_firstlineno, 0, -1):  # up to the class statement
            text = linecache.getline(first.co_filename, lineno).strip()
            if text.startswith(f"class {obj.__name__}"):
                return Pointer(first.co_filename, lineno, line=text)
        return Pointer(first.co_filename, first.co_firstlineno, line=f"class {obj.__name__}")
    code = getattr(obj, "__code__", None)
    if code is None or not is_learner(code.co_filename):
        return None
    text = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return Pointer(code.co_filename, code.co_firstlineno, line=text)


def learner_frame(exc: BaseException, is_learner: Callable[[str], bool]) -> Pointer | None:
    """The line of the learner's code that matters most: where their code raised inside the check
    (the exception's cause); else, for a wrong result, the definition of what the check was given
    (``exc.checked``); else their line that called the check. None if there is none.
    ``is_learner(filename)`` tells the learner's code from libraries and the course's own."""
    cause = exc.__cause__
    if cause is not None and cause.__traceback__ is not None:
        inner = [f for f in traceback.extract_tb(cause.__traceback__) if is_learner(f.filename)]
        if inner:
            f = inner[-1]
            return Pointer(f.filename, f.lineno, f.name, (f.line or "").strip())
    checked = getattr(exc, "checked", None)
    if checked is not None:
        found = definition(checked, is_learner)
        if found is not None:
            return found
    outer = [f for f in traceback.extract_tb(exc.__traceback__) if is_learner(f.filename)]
    if outer:
        f = outer[0]
        return Pointer(f.filename, f.lineno, f.name, (f.line or "").strip())
    return None


def learner_view(exc: BaseException, is_learner: Callable[[str], bool]) -> list[str]:
    """The lines a notebook shows for a failed check (IPython's ``_render_traceback_`` contract)."""
    lines = [f"{RED}{type(exc).__name__}{RESET}: {str(exc).strip()}"]
    frame = learner_frame(exc, is_learner)
    if frame is not None:
        where = f"{_cell_name(frame.filename)}, line {frame.lineno}"
        if frame.name not in ("<module>", "<cell line: 0>"):
            where += f", in {frame.name}"
        lines.append(f"\n{where}: {frame.line}" if frame.line else f"\n{where}")
    if getattr(exc, "learner_raised", False):  # only then does the whole traceback show more of theirs
        lines.append(f"{DIM}{SWITCH}{RESET}")
    return lines
