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
import inspect

# The qualified names of the answers the running check bans; empty outside a learner's call.
_banned: contextvars.ContextVar[frozenset] = contextvars.ContextVar("labsupport_banned_answers",
                                                                   default=frozenset())


# Every answer defined so far (modules register theirs when imported), by qualified name.
ANSWERS: dict[str, object] = {}
# The undecorated functions under those guards (what ``__wrapped__`` reaches), by id.
_RAW: dict[int, tuple[object, str]] = {}

# True while the course checks its own answers (the GPU bench, the course's tests): then a check
# accepts a function that is, or holds, an answer. Set only through :class:`course_checks_its_answers`.
_course_self_check: contextvars.ContextVar[bool] = contextvars.ContextVar("labsupport_course_self_check",
                                                                         default=False)


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

    def under_the_guard(*args, **kwargs):
        # what ``__wrapped__`` and :func:`unguarded` hand out: banned inside a check as well, unless
        # the course is checking its own answers (course_checks_its_answers)
        if qualified in _banned.get() and not _course_self_check.get():
            raise AnswerUsed(
                f"your function calls `{qualified}` unguarded (through `__wrapped__`), the course's own "
                f"answer to this exercise. Write it yourself; the check compares your version with that one."
            )
        return fn(*args, **kwargs)

    functools.update_wrapper(under_the_guard, fn)
    del under_the_guard.__wrapped__  # the raw function stays out of reach by attribute
    under_the_guard.__signature__ = inspect.signature(fn)
    guarded.__wrapped__ = under_the_guard
    guarded.answer_name = qualified
    ANSWERS[qualified] = guarded
    for raw in (fn, under_the_guard):
        _RAW[id(raw)] = (raw, qualified)
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
    check the answers themselves. Outside a check it runs freely; inside a check that bans it, only
    within :class:`course_checks_its_answers`."""
    return getattr(fn, "__wrapped__", fn)


class course_checks_its_answers:
    """Context manager: the sanctioned way for the course to hand its own answers to a check
    (``labsupport.bench_attention.run_checks`` on a GPU, the course's tests). While active,
    :func:`reached_answer` finds nothing. ``course_checks_its_answers(False)`` turns it off again."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.token = None

    def __enter__(self):
        self.token = _course_self_check.set(self.enabled)
        return self

    def __exit__(self, *exc):
        _course_self_check.reset(self.token)
        return False


def course_is_checking() -> bool:
    """Whether :class:`course_checks_its_answers` is active (for checks that refuse an answer by
    something other than a function, such as the course's class in lab 10)."""
    return _course_self_check.get()


def _answer_of(obj) -> str | None:
    """The answer's qualified name if ``obj`` is an answer, guarded or not; else None."""
    try:
        name = obj.__dict__.get("answer_name") if hasattr(obj, "__dict__") else None
    except Exception:
        name = None
    if isinstance(name, str) and name in ANSWERS:
        return name
    raw = _RAW.get(id(obj))
    return raw[1] if raw is not None and raw[0] is obj else None


def _children(obj):
    """What a callable holds that could itself be, or hold, an answer."""
    import functools as _ft

    out = []
    if isinstance(obj, (tuple, list, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, _ft.partial):
        out += [obj.func, *obj.args, *obj.keywords.values()]
    for attr in ("__wrapped__", "__func__", "__self__", "__defaults__", "__kwdefaults__"):
        try:
            value = object.__getattribute__(obj, attr) if not isinstance(obj, type) else None
        except Exception:
            continue
        if value is not None:
            out.append(value)
    closure = getattr(obj, "__closure__", None) if callable(obj) else None
    for cell in closure or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    if callable(obj) and not isinstance(obj, type) and not hasattr(obj, "__code__"):
        try:  # a callable object: what its instance attributes hold
            out += list(vars(obj).values())
        except TypeError:
            pass
    return out


def reached_answer(fn, names, max_nodes: int = 500) -> str | None:
    """The qualified name of an answer among ``names`` that ``fn`` is or reaches through ``__wrapped__``,
    ``functools.partial``, a bound method, closure cells, default arguments or a callable object's
    attributes; None if it reaches none, or while :class:`course_checks_its_answers` is active."""
    names = frozenset(qualified_name(n) for n in names)
    if _course_self_check.get() or not names:
        return None
    seen: set[int] = set()
    todo = [fn]
    while todo and len(seen) < max_nodes:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        name = _answer_of(obj)
        if name in names:
            return name
        if isinstance(obj, (tuple, list, set, frozenset, dict)) or callable(obj):
            todo.extend(_children(obj))
    return None
