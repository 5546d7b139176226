"""Each graded check's diagnosis table, read from the check modules' own source.

A check names the mistakes it recognises (``mistakes={"what went wrong": wrong_value}`` in
:meth:`~labsupport.checks.framework.Checker.expect_number` and ``expect_tensor``, or a helper such
as ``_kv_mistakes`` that builds that dict), the hints it gives (``hint=...``, the third argument
of ``checker.fail``) and the other failures it reports (``checker.fail``'s problem text). The
instructors' session plans list them so an instructor knows, before the session, what learners
will see when they go wrong.

The table is extracted statically, with :mod:`ast`, from ``labsupport/checks/labNN_*.py``: no check
runs, nothing is imported (no torch, no Triton), so the book build reads every lab's table in
milliseconds and it can never drift from the checks: change a mistake's wording in a check and
the next build of the book shows the new wording. For each ``@graded`` check it follows the module's
own functions and constants that the check reaches by name (the check calls ``_kv_mistakes``,
which returns a dict of descriptions), and collects

* **mistakes**: string keys (sentences, with a space) of dict literals, of ``d["..."] = ...``
  assignments and of ``for description, ... in (("...", ...), ...)`` loops; where the value is a
  tuple ``(wrong, "how to fix it")``, the fix is kept with the mistake;
* **hints**: ``hint=`` arguments, ``checker.fail(case, problem, hint)``'s third argument and
  ``expect_kernel_work``'s ``hint``, with module constants (``LLAMA3_HINT``) resolved;
* **failures**: ``checker.fail``'s problem text.

Parts of an f-string that are computed at run time show as the expression in angle brackets
(``f"... {n} heads"`` reads ``... ⟨n⟩ heads``), or as ``…`` where the expression is too long to
help a reader (more than :data:`_SHOWN_EXPRESSION` characters). A hint
computed by a function call (``hint=_block_hint(...)``) is not a literal and is left out; its
function's own literals are still read when the check reaches it. ``tests/course/test_diagnoses.py``
compares the table with what the checks actually pass to the :class:`Checker` at run time for
the labs that run quickly on a CPU.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

CHECKS_DIR = Path(__file__).resolve().parent.parent / "checks"
# the loop variables that name a mistake's description in ``for description, ... in (...)``
_DESCRIPTION_NAMES = {"description", "desc", "mistake", "why"}
_RUNTIME = "…"
_SHOWN_EXPRESSION = 24  # longer run-time expressions show as … (a call's arguments help no reader)
_MAX_CHOICES = 3  # a local name given this many literal strings or fewer is shown as each of them


@dataclass
class CheckDiagnosis:
    """What one graded check says when a learner's function is wrong."""

    name: str
    points: float | None
    doc: str
    mistakes: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def lab_key(module_name: str) -> str:
    """``lab06_kv_cache`` -> ``06_kv_cache`` (the key of the lab's source and notebook)."""
    if not re.fullmatch(r"lab\d\d_\w+", module_name):
        raise ValueError(f"a check module is named labNN_topic, got {module_name!r}")
    return module_name[3:]


def check_modules(checks_dir: Path | str = CHECKS_DIR) -> dict[str, Path]:
    """Lab key -> its check module, for every ``labNN_*.py`` in ``checks_dir``."""
    return {lab_key(p.stem): p for p in sorted(Path(checks_dir).glob("lab[0-9][0-9]_*.py"))}


def text_of(node: ast.AST | None, constants: dict[str, ast.AST] | None = None, depth: int = 0) -> list[str]:
    """The strings ``node`` evaluates to when that can be read from the source: a literal, an
    f-string (run-time parts shown as ``⟨expression⟩`` or ``…``, see :func:`_placeholder`), ``a + b``, ``x if c else y`` (both), a module
    constant by name. Anything else gives no string."""
    constants = constants or {}
    if node is None or depth > 8:
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        texts = [""]
        for value in node.values:
            choices = [str(value.value)] if isinstance(value, ast.Constant) else _choices(value, constants, depth)
            texts = [t + c for t in texts for c in choices]
        return texts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = text_of(node.left, constants, depth + 1), text_of(node.right, constants, depth + 1)
        return [a + b for a in left for b in right]
    if isinstance(node, ast.IfExp):
        return text_of(node.body, constants, depth + 1) + text_of(node.orelse, constants, depth + 1)
    if isinstance(node, ast.Name) and node.id in constants:
        values = constants[node.id]
        values = values if isinstance(values, list) else [values]
        return [t for value in values for t in text_of(value, constants, depth + 1)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in constants:
        # a module function that returns text (``hint=decode_convention(b)``): what it returns
        fn = constants[node.func.id]
        if isinstance(fn, ast.FunctionDef):
            scope = _scope(fn, constants)
            return [t for sub in ast.walk(fn) if isinstance(sub, ast.Return)
                    for t in text_of(sub.value, scope, depth + 1)]
    return []


def _choices(value: ast.FormattedValue, constants: dict[str, ast.AST], depth: int) -> list[str]:
    """What a part of an f-string can show: the texts of a local name given only a few literal
    strings (``extra = ""``, then ``extra = " Its first value is TTFT..."``: the message with and
    without that sentence), else the one text :func:`_placeholder` gives."""
    node = value.value
    if isinstance(node, ast.Name) and isinstance(constants.get(node.id), list):
        values = constants[node.id]
        if 1 < len(values) <= _MAX_CHOICES and all(
                isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values):
            return list(dict.fromkeys(v.value for v in values))
    return [_placeholder(value, constants, depth)]


def _placeholder(value: ast.FormattedValue, constants: dict[str, ast.AST], depth: int) -> str:
    """What a part of an f-string shows: a module constant's text where it is one (``{RULE}``,
    ``{NO_COPY[0]}`` of a tuple of strings); else the run-time expression, ``{n}`` -> ``⟨n⟩``,
    ``{first - 1}`` -> ``⟨first - 1⟩`` (format spec and conversion dropped), or ``…`` if long."""
    node = value.value
    if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int) and isinstance(node.value, ast.Name)
            and isinstance(constants.get(node.value.id), (ast.Tuple, ast.List))):
        items = constants[node.value.id].elts
        node = items[node.slice.value] if -len(items) <= node.slice.value < len(items) else node
    if isinstance(node, (ast.Name, ast.Constant)) or node is not value.value:
        known = text_of(node, constants, depth + 1)
        if len(known) == 1:
            return known[0]
    expression = ast.unparse(value.value)
    return f"⟨{expression}⟩" if len(expression) <= _SHOWN_EXPRESSION else _RUNTIME


def _scope(fn: ast.AST, constants: dict) -> dict:
    """``constants`` with the names ``fn`` assigns locally (each name: every value it is given)."""
    scope = dict(constants)
    local: dict[str, list] = {}
    for sub in ast.walk(fn):
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
            local.setdefault(sub.targets[0].id, []).append(sub.value)
        elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name):
            local.setdefault(sub.target.id, []).append(sub.value)
    scope.update(local)
    return scope


def _sentence(text: str) -> bool:
    """Text that reads as a sentence: three words or more (not a field name or a fragment)."""
    return len(text.split()) >= 3


def _graded_points(fn: ast.FunctionDef) -> tuple[bool, float | None, str | None]:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "id", getattr(deco.func, "attr", None)) == "graded":
            points = name = None
            for kw in deco.keywords:
                if kw.arg == "points" and isinstance(kw.value, ast.Constant):
                    points = kw.value.value
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    name = kw.value.value
            if points is None and deco.args and isinstance(deco.args[0], ast.Constant):
                points = deco.args[0].value
            return True, points, name
    return False, None, None


def _add(items: list[str], texts: list[str]) -> None:
    for text in texts:
        text = " ".join(text.split())
        if text and _sentence(text) and text not in items:
            items.append(text)


def _mistake_entry(key: ast.AST, value: ast.AST | None, constants) -> list[str]:
    """The description (with its fix, for a ``(wrong, "fix")`` value) of one dict entry."""
    descriptions = [t for t in text_of(key, constants) if _sentence(t)]
    fixes = []
    if isinstance(value, ast.Tuple) and len(value.elts) == 2:
        fixes = text_of(value.elts[1], constants)
    if fixes:
        return [f"{d} (fix: {fixes[0]})" for d in descriptions]
    return descriptions


def _scan(node: ast.AST, constants, found: CheckDiagnosis) -> None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        constants = _scope(node, constants)
    if isinstance(node, ast.Tuple) and len(node.elts) == 2:
        # a module constant ``NAME = ("what went wrong", "how to fix it")``
        description, fix = (text_of(e, constants) for e in node.elts)
        if description and fix and _sentence(description[0]) and _sentence(fix[0]):
            _add(found.mistakes, [f"{description[0]} (fix: {fix[0]})"])
            return
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = sub.args.args + sub.args.kwonlyargs
            defaults = [None] * (len(sub.args.args) - len(sub.args.defaults)) + sub.args.defaults + sub.args.kw_defaults
            for arg, default in zip(args, defaults):
                if arg.arg == "hint":
                    _add(found.hints, text_of(default, constants))
        if isinstance(sub, ast.Return):
            _add(found.failures, text_of(sub.value, constants))
        if isinstance(sub, ast.AugAssign) and isinstance(sub.op, ast.Add):
            _add(found.failures, [t.strip() for t in text_of(sub.value, constants)])
        if isinstance(sub, ast.Dict):
            for key, value in zip(sub.keys, sub.values):
                if key is not None:
                    _add(found.mistakes, _mistake_entry(key, value, constants))
        elif isinstance(sub, ast.Assign):
            for target in sub.targets:
                if isinstance(target, ast.Subscript):
                    _add(found.mistakes, _mistake_entry(target.slice, sub.value, constants))
        elif isinstance(sub, ast.For):
            target = sub.target
            if (isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)
                    and target.elts[0].id in _DESCRIPTION_NAMES and isinstance(sub.iter, (ast.Tuple, ast.List))):
                for row in sub.iter.elts:
                    if isinstance(row, ast.Tuple) and row.elts:
                        _add(found.mistakes, text_of(row.elts[0], constants))
        elif isinstance(sub, ast.Call):
            attr = getattr(sub.func, "attr", None)
            for kw in sub.keywords:
                if kw.arg == "hint":
                    _add(found.hints, text_of(kw.value, constants))
            if attr == "fail":
                # checker.fail(case, problem, hint); a helper object's own fail(problem, hint)
                on_checker = ast.unparse(sub.func.value).rpartition(".")[2] == "checker"
                problem, hint = (1, 2) if on_checker else (0, 1)
                if len(sub.args) > problem:
                    _add(found.failures, text_of(sub.args[problem], constants))
                if len(sub.args) > hint:
                    _add(found.hints, text_of(sub.args[hint], constants))
            if attr == "expect_kernel_work" and len(sub.args) >= 5:
                _add(found.hints, text_of(sub.args[4], constants))


def diagnose_source(source: str, filename: str = "<check module>") -> list[CheckDiagnosis]:
    """The diagnosis table of every ``@graded`` check in one check module's source, in order."""
    tree = ast.parse(source, filename)
    functions: dict[str, ast.AST] = {}
    constants: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[stmt.name] = stmt
        elif isinstance(stmt, ast.ClassDef):
            functions[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            constants[stmt.targets[0].id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            constants[stmt.target.id] = stmt.value
    table = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.FunctionDef):
            continue
        is_check, points, name = _graded_points(stmt)
        if not is_check:
            continue
        found = CheckDiagnosis(name or stmt.name, points, " ".join((ast.get_docstring(stmt) or "").split()))
        seen, todo = set(), [stmt.name]
        while todo:
            current = todo.pop(0)
            if current in seen:
                continue
            seen.add(current)
            node = functions.get(current, constants.get(current))
            _scan(node, {**constants, **functions}, found)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and (sub.id in functions or sub.id in constants) and sub.id not in seen:
                    todo.append(sub.id)
        # a hint or failure text is not also a mistake (the same sentence in two roles)
        found.hints = _longest(found.hints)
        found.failures = _longest([f for f in found.failures if f not in found.hints])
        found.mistakes = [m for m in found.mistakes if m not in found.hints and m not in found.failures]
        table.append(found)
    return table


def _longest(items: list[str]) -> list[str]:
    """Drop an item that another one starts with (``RULE`` beside ``RULE + " With no dtype ..."``)."""
    return [a for a in items if not any(b != a and b.startswith(a) for b in items)]


def diagnose_lab(key: str, checks_dir: Path | str = CHECKS_DIR) -> list[CheckDiagnosis]:
    """The diagnosis table of lab ``key`` (``"06_kv_cache"``)."""
    modules = check_modules(checks_dir)
    if key not in modules:
        raise ValueError(f"no check module for lab {key!r}; the labs with checks are: {', '.join(modules)}")
    path = modules[key]
    return diagnose_source(path.read_text(encoding="utf-8"), str(path))


def _escape(text: str) -> str:
    """Text safe in a MyST paragraph: outside code spans (````x```` or ```x```, left as they are),
    ``$`` would start maths and ``*``, ``_``, ``<``, ``[`` could start markup."""
    parts = re.split(r"(``.+?``|`[^`]+`)", text)
    for i in range(0, len(parts), 2):
        part = parts[i].replace("\\", "\\\\")
        for char in "$*_[]|":
            part = part.replace(char, "\\" + char)
        parts[i] = part.replace("<", "&lt;")
    return "".join(parts)


def _plain_roles(text: str) -> str:
    """A docstring's Sphinx cross-references as plain code: ``:mod:`~a.b``` -> ```a.b```."""
    return re.sub(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`", r"`\1`", text)


def markdown(key: str, checks_dir: Path | str = CHECKS_DIR) -> str:
    """The lab's checks as Markdown: for each, its points and docstring, then the mistakes it
    names, its hints and the other failures it reports. A note says how run-time values show."""
    lines = []
    table = diagnose_lab(key, checks_dir)
    total = sum(c.points or 0 for c in table)
    lines.append(f"The lab has {len(table)} graded check{'s' if len(table) != 1 else ''}, "
                 f"{total:g} points in all. In the messages below, ⟨n⟩ stands for a value the check fills "
                 f"in when it runs (here, the expression that computes it) and … for a longer one.\n")
    for check in table:
        points = f"{check.points:g} points" if check.points is not None else "points not a literal"
        lines.append(f"**`{check.name}`** ({points}). {_escape(_plain_roles(check.doc))}\n")
        for title, items in (("Mistakes it recognises and names", check.mistakes),
                             ("Hints it gives", check.hints),
                             ("Other failures it reports", check.failures)):
            if items:
                lines.append(f"*{title}:*\n")
                lines.extend(f"- {_escape(item)}" for item in items)
                lines.append("")
    return "\n".join(lines)
