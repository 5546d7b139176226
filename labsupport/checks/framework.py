"""The machinery behind every graded check.

A check is a function ``check_something(fn)`` decorated with :func:`graded`. It runs the
learner's ``fn`` on chosen cases through :meth:`Checker.call`, compares what comes back with
:meth:`Checker.expect_tensor` or :meth:`Checker.expect_number`, and either

* raises :class:`CheckFailed` (an ``AssertionError``) whose message names the case, the largest
  error and where it is, and a hint; or
* prints one short pass line.

Either way the result (points earned out of points possible) is recorded in
:data:`RESULTS`, appended as one JSON line to the file named by ``LABSUPPORT_RESULTS`` when that
variable is set, and, when ``LABSUPPORT_GRADING`` is set, shown as an output of the cell running
the check (MIME type :data:`RESULT_MIME`): that is how ``python -m labsupport grade`` collects
scores, from the outputs of the course's own check cells only (see :mod:`labsupport.course.grade`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .._answers import AnswerUsed, banning, qualified_name, reached_answer
from .._grading import GRADING_ENV
from . import _display

RESULTS_ENV = "LABSUPPORT_RESULTS"
RESULT_MIME = "application/vnd.labsupport.check-result+json"


class CheckFailed(AssertionError):
    """A graded check found a problem with the learner's code. The message says what to fix.

    ``reason`` says what kind of problem it is, for the grader's table: ``"not done"`` (the
    exercise still raises NotImplementedError) or ``"failed"`` (anything else). ``learner_raised``
    says the learner's own code raised (then the notebook says how to see the whole traceback);
    ``checked`` is what the check was given (the notebook points at its ``def`` for a wrong result).
    """

    def __init__(self, message: str = "", reason: str = "failed", learner_raised: bool = False):
        super().__init__(message)
        self.reason = reason
        self.learner_raised = learner_raised
        self.checked = None

    @property
    def _render_traceback_(self):
        """How IPython shows this failure: the message, the hint and one line of the learner's own
        code (where it raised, or the definition that returned a wrong result), without the
        framework's traceback. With ``LABSUPPORT_FULL_TRACEBACK=1`` the attribute
        is missing, so IPython prints the full traceback (see :mod:`labsupport.checks._display`)."""
        if _display.full_traceback_wanted():
            raise AttributeError("_render_traceback_")
        return lambda: _display.learner_view(self, _is_learner_frame)


class ForbiddenCall(RuntimeError):
    """Raised inside the learner's function when it calls a library function the exercise replaces."""


@dataclass
class CheckResult:
    check: str
    passed: bool
    points: float
    max_points: float
    cases: int
    message: str = ""
    reason: str = ""  # "" when passed; "not done", "failed" or "error" (the check itself broke)


RESULTS: list[CheckResult] = []
REGISTRY: dict[str, Callable] = {}


# -- what a check relies on, as it was when the checks were imported ------------------------------
# Learner code runs in the same process as the checks, so it could make a comparison lie by
# replacing what the checks compare and report with (``math.isclose``, ``torch.Tensor.__eq__``, a
# method of Checker, a lab's reference answer, ``sys.modules["torch"]``, IPython's ``display``). The
# checks are imported before any learner code runs (the grader imports them in the notebook's first
# cell), so what they rely on is remembered then, and a check that finds any of it replaced while it
# runs fails (reason "tampered") instead of passing. Code in the same process can still replace the
# memory itself; this makes the cheat deliberate and visible, not impossible (see the README).
_TENSOR_METHODS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__sub__", "__add__", "__mul__",
                   "__truediv__", "__or__", "__and__", "__invert__", "__bool__", "__float__", "__int__",
                   "__index__", "__getitem__", "abs", "any", "all", "sum", "to", "detach", "item", "nonzero",
                   "masked_fill", "numel", "untyped_storage", "data_ptr", "is_floating_point", "float", "double",
                   "shape", "dtype", "device", "__class__", "__torch_function__")
_TORCH_FUNCTIONS = ("allclose", "isclose", "isfinite", "isnan", "where", "argmax", "unravel_index", "zeros_like",
                    "tensor", "equal", "as_tensor")
_BUILTINS = ("isinstance", "issubclass", "type", "len", "abs", "bool", "float", "int", "tuple", "list", "dict",
             "getattr", "hasattr", "setattr", "callable", "any", "all", "max", "min", "sum", "print", "str",
             "repr", "id", "iter", "next", "zip", "range", "round", "__import__")


def _watched() -> dict[str, object]:
    """Every object a check's verdict depends on, by a name that says where it lives."""
    import builtins
    import sys

    out: dict[str, object] = {}
    for name in _BUILTINS:
        out[f"builtins.{name}"] = getattr(builtins, name, None)
    out["math"] = sys.modules.get("math")
    for name in ("isclose", "isfinite", "isnan", "isinf", "fabs"):
        out[f"math.{name}"] = getattr(math, name, None)
    for key, module in list(sys.modules.items()):
        if key == "labsupport.checks" or key.startswith("labsupport.checks.") or key in ("torch", "json",
                                                                                          "IPython.display"):
            out[f"sys.modules[{key!r}]"] = module
            if key.startswith("labsupport.checks"):  # every global of the checks: functions, references
                for name, value in list(vars(module).items()):
                    if not name.startswith("__") and name not in ("_GUARDING", "_REMEMBERED"):
                        out[f"{key}.{name}"] = value
    for cls in (Checker, CheckResult, Case, CheckFailed, torch_calls, _forbid, triton_launches):
        for name, value in list(vars(cls).items()):
            if not name.startswith("__") or name in ("__init__", "__enter__", "__exit__", "__call__", "__str__"):
                out[f"{cls.__qualname__}.{name}"] = value
    torch = sys.modules.get("torch")
    if torch is not None:
        for name in _TORCH_FUNCTIONS:
            out[f"torch.{name}"] = getattr(torch, name, None)
        for name in _TENSOR_METHODS:  # as stored on the class (getattr would make a new bound method)
            out[f"torch.Tensor.{name}"] = next((vars(c)[name] for c in torch.Tensor.__mro__ if name in vars(c)), None)
        out["torch.Tensor"] = getattr(torch, "Tensor", None)
        overrides = sys.modules.get("torch.overrides")
        if overrides is not None:
            out["torch.overrides.TorchFunctionMode"] = getattr(overrides, "TorchFunctionMode", None)
    display_mod = sys.modules.get("IPython.display")
    if display_mod is not None:
        out["IPython.display.display"] = getattr(display_mod, "display", None)
    return out


_REMEMBERED: dict[str, object] = {}
_GUARDING = False  # whether the checks were imported to be graded (LABSUPPORT_GRADING set then)


def remember() -> None:
    """Remember what the checks rely on (``labsupport.checks`` calls this once it imported every check).

    The guard (:func:`_intact`) works only in a graded run, as it was when the checks were imported
    (so unsetting the variable later does not turn it off); outside grading, a learner's debugger
    or the course's tests may change what they like."""
    global _GUARDING
    _GUARDING = bool(os.environ.get(GRADING_ENV))
    _REMEMBERED.clear()
    _REMEMBERED.update(_watched())


def replaced() -> list[str]:
    """What the checks rely on that is no longer what it was when they were imported."""
    if not _REMEMBERED:
        return []
    now = _watched()
    return [name for name, value in _REMEMBERED.items() if now.get(name, _REMEMBERED) is not value]


def _intact(check_name: str) -> None:
    import sys

    if not _GUARDING:
        return
    changed = replaced()
    if sys.gettrace() is not None or sys.getprofile() is not None:
        changed.append("sys.settrace or sys.setprofile (a hook that can rewrite a check's variables)")
    if changed:
        shown = ", ".join(f"`{n}`" for n in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise CheckFailed(
            f"{check_name}: while it ran, {shown} had been replaced since the checks were imported. A check "
            f"only passes with the course's own comparisons; put them back (restart the kernel) and run "
            f"the exercise and this check again.", reason="tampered")


def _record(result: CheckResult) -> None:
    RESULTS.append(result)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(result)) + "\n")
    if os.environ.get(GRADING_ENV) or _GUARDING:  # as when the checks were imported, too
        try:
            from IPython.display import display
        except ImportError:
            return
        display({RESULT_MIME: asdict(result)}, raw=True)


class Case:
    """A named test case; ``str(case)`` is what failure messages print."""

    def __init__(self, **fields):
        self.fields = fields

    def __str__(self) -> str:
        parts = []
        for key, value in self.fields.items():
            if hasattr(value, "is_floating_point") or type(value).__module__ == "torch":
                value = str(value).replace("torch.", "")
            parts.append(f"{key}={value}")
        return ", ".join(parts)

    def __getitem__(self, key):
        return self.fields[key]


def _is_learner_frame(filename: str) -> bool:
    """A frame in the learner's code: a notebook cell or a file of theirs, not a library."""
    if filename.startswith("<"):
        return True  # an interactive prompt or exec'd code
    path = os.path.abspath(filename)
    libraries = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # labsupport itself
    libraries |= {p for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "purelib", "platlib")) if p}
    return "site-packages" not in path and "dist-packages" not in path and not any(
        path.startswith(lib + os.sep) for lib in libraries
    )


def _describe_call_site(exc: BaseException) -> str:
    """Where in the learner's code an exception was raised (the innermost frame of theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_learner_frame(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    if f.filename.startswith("<") or "ipykernel_" in f.filename:
        where = f"line {f.lineno} of the cell that defines `{f.name}`" if f.name != "<module>" else f"line {f.lineno}"
    else:
        where = f"{os.path.basename(f.filename)}:{f.lineno}"
    code = f"  `{f.line.strip()}`" if f.line else ""
    return f" (at {where}{code})"


class Checker:
    """Helpers a check body uses; one per check run."""

    def __init__(self, name: str, bans: Sequence[str] = ()):
        self.name = name
        self.cases = 0
        self.bans = tuple(qualified_name(b) for b in bans)  # the answers the learner's function may not call

    # -- running the learner's function -------------------------------------------------------
    def call(self, fn: Callable, *args, case: Case, forbid: Sequence[str] = (), **kwargs):
        """Call ``fn(*args, **kwargs)``, turning every way it can go wrong into a clear failure."""
        from ..device import explain_error

        self.cases += 1
        fname = getattr(fn, "__name__", "your function")
        try:
            with banning(self.bans):
                if forbid:
                    with _forbid(forbid):
                        result = fn(*args, **kwargs)
                else:
                    result = fn(*args, **kwargs)
        except AnswerUsed as exc:
            raise CheckFailed(f"{self.name}: on case [{case}] {exc}") from exc
        except NotImplementedError as exc:
            raise CheckFailed(
                f"{self.name}: `{fname}` still raises NotImplementedError. Replace the "
                f"`raise NotImplementedError(...)` line in the exercise cell with your code, run that "
                f"cell, then run this check again.",
                reason="not done",
            ) from exc
        except ForbiddenCall as exc:
            raise CheckFailed(f"{self.name}: on case [{case}] {exc}") from exc
        except CheckFailed:
            raise
        except Exception as exc:
            advice = explain_error(exc)
            message = (
                f"{self.name}: `{fname}` raised {type(exc).__name__}: {str(exc).strip()[:500]}"
                f"{_describe_call_site(exc)} on case [{case}]."
            )
            message += f"\nWhat to do: {advice}" if advice else (
                "\nHint: run your function on that case yourself to see the full traceback."
            )
            raise CheckFailed(message, learner_raised=True) from exc
        _intact(self.name)
        _refuse_tensor_subclass(self.name, result, case)
        return result

    # -- comparing results --------------------------------------------------------------------
    def expect_kernel_work(self, case: Case, launches: "triton_launches", calls: "torch_calls | None",
                           returned: dict[str, object], hint: str) -> None:
        """For a Triton exercise whose result was right: fail unless every tensor in ``returned``
        (name -> tensor) shares storage with a tensor passed to a kernel launched during the call,
        and no torch function that computes the answer (``calls``) was called."""
        import torch

        _intact(self.name)
        unwritten = [name for name, t in returned.items() if isinstance(t, torch.Tensor) and not launches.wrote(t)]
        if unwritten:
            self.fail(case, f"your function returned a tensor that no Triton kernel you launched wrote to: "
                            f"{', '.join(unwritten)} (its storage was not passed to any launch).", hint)
        if calls is not None and calls.used:
            names = ", ".join(f"`{n}`" for n in calls.used)
            self.fail(case, f"the result is right, but your function called {names} in torch: in this exercise "
                            f"the Triton kernel computes the answer.", hint)

    def fail(self, case: Case, problem: str, hint: str = "") -> None:
        message = f"{self.name}: case [{case}]: {problem}"
        if hint:
            message += f"\nHint: {hint}"
        raise CheckFailed(message)

    def _expect_like(self, actual, expected, case: Case, what: str, hint: str, check_dtype: bool) -> None:
        """Fail unless ``actual`` is a tensor of ``expected``'s shape, dtype (when checked) and device."""
        import torch

        if not isinstance(actual, torch.Tensor):
            self.fail(
                case,
                f"the {what} is a {type(actual).__name__}, expected a torch.Tensor of shape "
                f"{tuple(expected.shape)}.",
                "return the tensor itself (not a tuple, list or number).",
            )
        if tuple(actual.shape) != tuple(expected.shape):
            self.fail(
                case,
                f"the {what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}.",
                hint or "check which dimensions you reduce over and that you did not drop or transpose one.",
            )
        if check_dtype and actual.dtype != expected.dtype:
            self.fail(
                case,
                f"the {what} has dtype {str(actual.dtype).replace('torch.', '')}, expected "
                f"{str(expected.dtype).replace('torch.', '')} (the dtype of the inputs).",
                "compute in whatever precision you like, but return the inputs' dtype "
                "(convert at the end with `.to(dtype)`).",
            )
        if actual.device != expected.device:
            self.fail(case, f"the {what} is on {actual.device}, expected {expected.device}.",
                      "allocate outputs on the inputs' device (`device=x.device`).")

    def expect_tensor(
        self,
        actual,
        expected,
        *,
        case: Case,
        atol: float,
        rtol: float,
        what: str = "output",
        hint: str = "",
        mistakes: dict[str, object] | None = None,
        check_dtype: bool = True,
    ) -> None:
        """Fail unless ``actual`` is a tensor like ``expected`` and close to it.

        ``mistakes`` maps a description of a common mistake to the tensor that mistake produces;
        when the learner's output matches one, the message names it.
        """
        import torch

        _intact(self.name)
        self._expect_like(actual, expected, case, what, hint, check_dtype)
        got = actual.detach().to(torch.float64)
        want = expected.detach().to(torch.float64)
        # where the reference itself is inf or NaN, the output must be the same inf or NaN
        special = ~torch.isfinite(want)
        if bool(special.any()):
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            differs = special & ~same
            if bool(differs.any()):
                idx = tuple(int(i) for i in differs.nonzero()[0])
                self.fail(
                    case,
                    f"the {what} differs from the reference at {int(differs.sum())} element(s) where the "
                    f"reference is inf or NaN, first at index {idx}: got {got[idx].item()}, expected "
                    f"{want[idx].item()}.",
                    hint,
                )
            got, want = got.masked_fill(special, 0.0), want.masked_fill(special, 0.0)
        bad_values = ~torch.isfinite(got) & torch.isfinite(want)
        if bool(bad_values.any()):
            idx = tuple(int(i) for i in bad_values.nonzero()[0])
            self.fail(
                case,
                f"the {what} has {int(bad_values.sum())} non-finite value(s) (NaN or inf) where the "
                f"reference is finite, first at index {idx}: got {got[idx].item()}, expected "
                f"{want[idx].item():.6g}.",
                hint or "NaN or inf usually means an overflow (exp of a large number: subtract the "
                "maximum first), a division by zero, or reading memory outside the tensor (a missing mask).",
            )
        diff = (got - want).abs()
        allowed = atol + rtol * want.abs()
        outside = diff > allowed
        if bool(outside.any()):
            flat = int(torch.argmax(torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))))
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
            problem = (
                f"the {what} is wrong at {int(outside.sum())} of {diff.numel()} elements. Largest "
                f"error {diff[idx].item():.4g} at index {idx}: got {got[idx].item():.6g}, expected "
                f"{want[idx].item():.6g} (tolerance atol={atol:g}, rtol={rtol:g})."
            )
            matched = self._match_mistake(got, mistakes, atol, rtol)
            if matched:
                problem += f"\nYour {what} matches what we get when {matched}."
            self.fail(case, problem, hint)

    @staticmethod
    def _match_mistake(got, mistakes, atol, rtol) -> str | None:
        import torch

        for description, wrong in (mistakes or {}).items():
            wrong = wrong.detach().to(torch.float64)
            if wrong.shape == got.shape and torch.allclose(got, wrong, atol=atol, rtol=rtol, equal_nan=True):
                return description
        return None

    def expect_number(self, actual, expected: float, *, case: Case, rel: float = 1e-6, what: str = "result",
                      hint: str = "", mistakes: dict[str, float] | None = None) -> None:
        """Fail unless ``actual`` is a real number within ``rel`` (relative) of ``expected``."""
        _intact(self.name)
        if hasattr(actual, "item") and getattr(actual, "numel", lambda: 1)() == 1:
            actual = actual.item()
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            self.fail(case, f"the {what} is a {type(actual).__name__}, expected a number.",
                      "return a plain int or float.")
        if not math.isfinite(actual):
            self.fail(case, f"the {what} is {actual}, expected {expected:.6g}.", hint)
        if not math.isclose(actual, expected, rel_tol=rel, abs_tol=0.0 if expected else 1e-12):
            problem = f"the {what} is {actual:.6g}, expected {expected:.6g} (ratio {actual / expected:.4g})." \
                if expected else f"the {what} is {actual:.6g}, expected 0."
            for description, wrong in (mistakes or {}).items():
                if math.isclose(actual, wrong, rel_tol=rel):
                    problem += f"\nYour {what} matches what we get when {description}."
                    break
            self.fail(case, problem, hint)


def _refuse_tensor_subclass(check: str, result, case: Case, depth: int = 0) -> None:
    """Fail when ``result`` (or a tuple or list in it) holds a subclass of torch.Tensor: a subclass
    can redefine the very operations (comparisons, ``allclose``) a check compares with."""
    import torch

    if isinstance(result, torch.Tensor) and type(result) not in (torch.Tensor, torch.nn.Parameter):
        raise CheckFailed(
            f"{check}: on case [{case}] your function returned a {type(result).__name__}, a subclass of "
            f"torch.Tensor (or an object posing as one). Return a plain torch.Tensor: the result itself, "
            f"not wrapped in a class of your own."
        )
    if depth < 3 and isinstance(result, (tuple, list)):
        for item in result:
            _refuse_tensor_subclass(check, item, case, depth + 1)


class torch_calls:
    """Context manager recording which of the torch functions named in ``names`` (exact names:
    ``"matmul"``, ``"__add__"``) were called while it was active: ``with torch_calls(names) as
    calls: ...; calls.used``. Unlike :class:`_forbid` it does not stop the call, so a check can
    first say what is wrong with the result, and only then that the answer was computed in torch.
    """

    def __init__(self, names: Sequence[str]):
        from torch.overrides import TorchFunctionMode

        watched, used = frozenset(names), []
        self.used = used

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in watched and name not in used:
                    used.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


class _forbid:
    """Context manager: calling any torch function named in ``names`` raises ForbiddenCall.

    It works through ``TorchFunctionMode``, so it catches the call however the function was
    imported (``F.scaled_dot_product_attention`` or a name imported from the module).
    """

    def __init__(self, names: Sequence[str]):
        from torch.overrides import TorchFunctionMode

        forbidden = set(names)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                # a substring, so the private variants (torch.ops.aten._scaled_dot_product_...) count
                if any(f in name for f in forbidden):
                    raise ForbiddenCall(
                        f"your function called `{name}`, which this exercise asks you to replace. "
                        f"Write it yourself from matmuls, elementwise operations and reductions."
                    )
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


class triton_launches:
    """Context manager counting Triton kernel launches, compiled or run by the interpreter:
    ``with triton_launches() as launches: ...; launches.count``.

    It wraps the places every launch passes through, whichever way it was written
    (``kernel[grid](...)``, ``kernel.run(..., grid=...)``, through ``triton.autotune``):
    ``JITFunction.run`` for compiled kernels, and the interpreter's ``GridExecutor.__call__`` (and
    ``InterpretedFunction.run``) for interpreted ones. A launch may be counted more than once;
    only zero matters. ``count`` is None when none of these exist in this Triton (then nothing
    is required of the learner's function).

    It also records the storage of every tensor passed to a launch: :meth:`wrote` says whether a
    returned tensor shares storage with one of them (a tensor some launched kernel could write).
    """

    HOOKS = (
        ("triton.runtime.jit", "JITFunction", "run"),
        ("triton.runtime.interpreter", "InterpretedFunction", "run"),
        ("triton.runtime.interpreter", "GridExecutor", "__call__"),
    )

    def __init__(self):
        self.count: int | None = None
        self.storages: set[int] = set()
        self._patched: list[tuple[type, str, object]] = []

    def wrote(self, t) -> bool:
        """Whether tensor ``t`` shares storage with a tensor argument of a launch seen so far
        (True when launches cannot be watched in this Triton)."""
        return self.count is None or _storage(t) in self.storages

    def __enter__(self):
        import importlib

        import torch

        counter = self

        def remember(values):
            for value in values:
                if isinstance(value, torch.Tensor):
                    try:
                        counter.storages.add(_storage(value))
                    except RuntimeError:  # a tensor without storage (a fake or meta tensor)
                        pass

        for module_name, class_name, method in self.HOOKS:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
                original = cls.__dict__[method]
            except (ImportError, AttributeError, KeyError):
                continue

            def counted(*args, __original=original, **kwargs):
                counter.count += 1
                remember(args)
                remember(kwargs.values())
                return __original(*args, **kwargs)

            setattr(cls, method, counted)
            self._patched.append((cls, method, original))
        if self._patched:
            self.count = 0
        return self

    def __exit__(self, *exc):
        for cls, method, original in reversed(self._patched):
            setattr(cls, method, original)
        self._patched.clear()
        return False


def graded(points: float, name: str | None = None, bans: Sequence[str] = ()):
    """Register a check worth ``points``; the decorated body is ``body(fn, checker, *args)``.

    ``bans`` are the course's own answers (functions decorated with
    :func:`labsupport._answers.answer`, or their qualified names ``"module.function"``) that the
    learner's function may not be, wrap or call while it is checked.
    """

    def decorate(body: Callable) -> Callable:
        check_name = name or body.__name__

        @functools.wraps(body)
        def check(fn, *args, **kwargs):
            checker = Checker(check_name, bans)
            if not callable(fn):
                message = (
                    f"{check_name} takes your function itself, got a {type(fn).__name__}. "
                    f"Pass the function without calling it: {check_name}(my_function)."
                )
                _record(CheckResult(check_name, False, 0, points, 0, message, "failed"))
                raise CheckFailed(message)
            held = reached_answer(fn, bans)
            if held:
                message = (
                    f"{check_name}: your function is, wraps or holds `{held}`, the course's own answer "
                    f"(reached through __wrapped__, functools.partial, a closure, a default argument or "
                    f"an attribute). Write the exercise yourself; the check compares your version with "
                    f"that one."
                )
                _record(CheckResult(check_name, False, 0, points, 0, message, "failed"))
                raise CheckFailed(message)
            try:
                body(fn, checker, *args, **kwargs)
            except CheckFailed as exc:
                _record(CheckResult(check_name, False, 0, points, checker.cases, str(exc), exc.reason))
                if exc.checked is None:
                    exc.checked = fn  # a wrong result: the notebook points at the function's definition
                raise
            except NotImplementedError as exc:
                # the body called the learner's stub directly (not through checker.call)
                failure = CheckFailed(
                    f"{check_name}: your code still raises NotImplementedError ({exc}). Replace the "
                    f"`raise NotImplementedError(...)` line in the exercise cell with your code, run that "
                    f"cell, then run this check again.",
                    reason="not done",
                )
                _record(CheckResult(check_name, False, 0, points, checker.cases, str(failure), failure.reason))
                raise failure from exc
            except Exception as exc:
                message = f"{check_name} itself failed with {type(exc).__name__}: {exc}"
                _record(CheckResult(check_name, False, 0, points, checker.cases, message, "error"))
                raise
            try:
                _intact(check_name)
            except CheckFailed as exc:
                _record(CheckResult(check_name, False, 0, points, checker.cases, str(exc), exc.reason))
                raise
            _record(CheckResult(check_name, True, points, points, checker.cases))
            print(f"PASSED {check_name}: {checker.cases} cases, {points:g}/{points:g} points")

        check.points = points
        check.check_name = check_name
        check.bans = tuple(qualified_name(b) for b in bans)  # read by the grader's flag scan
        REGISTRY[check_name] = check
        return check

    return decorate
