"""The course's own answers to graded exercises, and a guard against handing them to a check.

Functions such as :func:`labsupport.costs.kv_bytes_per_token` or
:func:`labsupport.attention.flash_attention_reference` are what the checks compare learners'
work with. Decorated with :func:`answer`, each one refuses to run while a learner's function is
being checked by a check that bans it (``@graded(..., bans=...)``), so a submission cannot pass
by passing, wrapping or calling the course's answer. Outside a check they behave normally.

The decorator is also the registry of answers (:data:`ANSWERS`, :func:`answer_names`): a check
bans answers by handing the functions themselves to ``@graded(bans=...)``, and the grader's flag
scan (:mod:`labsupport.course.scan`) reads the names from here. A new chapter's answer needs only
``@answer`` where it is defined.
"""

from __future__ import annotations

import contextvars
import functools

# The qualified names of the answers the running check bans; empty outside a learner's call.
_banned: contextvars.ContextVar[frozenset] = contextvars.ContextVar("labsupport_banned_answers",
                                                                   default=frozenset())


# Every answer defined so far (modules register theirs when imported), by qualified name.
ANSWERS: dict[str, object] = {}


class AnswerUsed(Exception):
    """A learner's function called (or was) one of the course's own answers."""


def answer(fn):
    """Mark ``fn`` as the course's answer to an exercise (see the module docstring)."""
    qualified = f"{fn.__module__}.{fn.__name__}"

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if qualified in _banned.get():
            raise AnswerUsed(
                f"your function is, or calls, `{qualified}`, the course's own answer to this exercise. "
                f"Write it yourself; the check compares your version with that one."
            )
        return fn(*args, **kwargs)

    guarded.answer_name = qualified
    ANSWERS[qualified] = guarded
    return guarded


def answer_names() -> set[str]:
    """The plain names (``prefill_flops``) of every registered answer."""
    return {name.rpartition(".")[2] for name in ANSWERS}


def qualified_name(ban) -> str:
    """An answer (the decorated function) or its qualified name, as the qualified name."""
    name = getattr(ban, "answer_name", ban)
    if not isinstance(name, str):
        raise TypeError(f"bans takes functions decorated with @answer (or their qualified names), got {ban!r}")
    return name


class banning:
    """Context manager: while active, the answers named in ``names`` raise :class:`AnswerUsed`."""

    def __init__(self, names):
        self.names = frozenset(qualified_name(n) for n in names)
        self.token = None

    def __enter__(self):
        self.token = _banned.set(_banned.get() | self.names)
        return self

    def __exit__(self, *exc):
        _banned.reset(self.token)
        return False


def unguarded(fn):
    """The function under an :func:`answer` guard: for the course's own tests and GPU runs, which
    check the answers themselves."""
    return getattr(fn, "__wrapped__", fn)
