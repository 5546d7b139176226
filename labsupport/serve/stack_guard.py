"""A learner's part, guarded while it serves (issue 31): an exception it raises becomes a
:class:`PartFailed` whose message names the slot, the lab and the learner's line. Used by
:mod:`labsupport.serve.stack` and the adapters of the engine-side slots (:mod:`.stack_engine`)."""

from __future__ import annotations

import functools
import linecache
import os
import threading
import time
import traceback

from ..stack import Slot

PER_REQUEST = ("stop_strings", "detokenizer")  # the other serving slots are step-wide


class PartFailed(RuntimeError):
    """A learner's part raised while serving; the message names the slot and the learner's line."""


def learner_line(exc: BaseException, file: str) -> str:
    """``file:line: source`` of the deepest frame of ``exc``'s traceback in the learner's module file."""
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(file):
            line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            where = f"{frame.filename}:{frame.lineno}: {line}"
    return where or f"{file} (no line of it in the traceback)"


def _failed(slot: Slot, exc: BaseException, file: str) -> PartFailed:
    scope = "its request fails" if slot.name in PER_REQUEST else "the step's requests fail"
    return PartFailed(f"your {slot.name} part (lab {slot.lab[:2]}, {slot.part}) raised {type(exc).__name__}: {exc} "
                      f"at {learner_line(exc, file)}; {scope}, the server goes on with your part")


class SlotProfile:
    """Calls and seconds (``time.perf_counter``, the call's whole time, its exceptions included) of
    each slot's part, and of the engine's steps under ``"step"``; the capstone's profile by slot (lab 16)."""

    def __init__(self):
        self._lock = threading.Lock()  # per-request parts run on the event loop, step-wide ones in the step's thread
        self.totals: dict[str, list] = {}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            calls, total = self.totals.get(name, (0, 0.0))
            self.totals[name] = [calls + 1, total + seconds]

    def timed(self, name: str, fn):
        """``fn`` with its time added under ``name``."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - started)
        return call

    def snapshot(self) -> dict[str, dict]:
        """``{name: {"calls": n, "seconds": s}}``."""
        with self._lock:
            return {name: {"calls": c, "seconds": s} for name, (c, s) in self.totals.items()}


PROFILE = SlotProfile()  # this server's; one server per process


def guarded(slot: Slot, fn, file: str, profile: SlotProfile | None = None):
    """``fn`` (a learner's function) with its exceptions (``SystemExit`` and ``KeyboardInterrupt`` too: a
    learner's part never stops the server) turned into :class:`PartFailed`, and its time
    added to ``profile`` (default :data:`PROFILE`) under the slot's name."""
    profile = PROFILE if profile is None else profile

    @functools.wraps(fn)
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except GeneratorExit:
            raise
        except BaseException as exc:  # sys.exit() or a KeyboardInterrupt left in a cell must not stop the server
            raise _failed(slot, exc, file) from exc
        finally:
            profile.add(slot.name, time.perf_counter() - started)
    return call
