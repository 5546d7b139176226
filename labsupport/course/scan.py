"""Reading the code of a notebook without running it: which checks it calls, and what in it a
person should read before trusting its score (the grader's flags).

The course's own answers are found from their registry (:func:`labsupport._answers.answer_names`),
filled by the ``@answer`` decorator where each answer is defined: no list of names is kept here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable

from .. import checks  # imports every check module, and with them every answer they ban
from .._answers import answer_names

# -- reading code -----------------------------------------------------------------------------

def python_source(text: str) -> str:
    """A cell's code as the kernel runs it: IPython syntax (``%magic``, ``!shell``) made Python."""
    if not re.search(r"^\s*[%!]|\?\s*$", text, re.MULTILINE):
        return text
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return text
    try:
        return TransformerManager().transform_cell(text)
    except Exception:
        return text


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    """The tokens of ``text`` up to where it stops being Python (comments excluded)."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.COMMENT:
                out.append(tok)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def _parse(text: str) -> ast.AST | None:
    try:
        return ast.parse(python_source(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # RecursionError: `x = 1+1+...+1`
        return None


def check_calls(text: str) -> list[str]:
    """Names of the ``check_*`` functions the code calls (not in comments or strings), in order."""
    names: list[str] = []
    tree = _parse(text)
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _func_name(node)
                if name.startswith("check_") and name not in names:
                    names.append(name)
        names.sort(key=lambda n: _position(tree, n))
        for node in ast.walk(tree):  # %time check_x(f), %%time: the code a magic runs
            if isinstance(node, ast.Call) and _func_name(node) in ("run_line_magic", "run_cell_magic"):
                for arg in node.args[1:]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        names += [n for n in check_calls(arg.value) if n not in names]
        return names
    toks = _tokens(text)  # a cell that does not parse: the calls it spells out
    for tok, nxt in zip(toks, toks[1:]):
        if tok.type == tokenize.NAME and tok.string.startswith("check_") and nxt.string == "(":
            if tok.string not in names:
                names.append(tok.string)
    return names


def exercises_checked(text: str) -> list[str]:
    """The names handed to ``check_*`` calls in the code (``check_x(my_fn)``: my_fn), in order."""
    tree = _parse(text)
    names: list[str] = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and _func_name(node).startswith("check_") and node.args:
            if isinstance(node.args[0], ast.Name) and node.args[0].id not in names:
                names.append(node.args[0].id)
    return names


def names_used_and_bound(text: str) -> tuple[set[str], set[str]]:
    """The names the code reads, and those it binds (``def f``, ``f = ...``, ``import f``)."""
    tree = _parse(text)
    if tree is None:  # does not parse: every name it spells, and nothing bound
        return {t.string for t in _tokens(text) if t.type == tokenize.NAME}, set()
    used, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return used, bound


def _position(tree: ast.AST, name: str) -> tuple[int, int]:
    found = [(n.lineno, n.col_offset) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]
    return min(found) if found else (0, 0)


def calls_by_cell(nb) -> dict[str, int]:
    """Each check the notebook calls, with the index of the first cell that calls it."""
    where: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for name in check_calls(cell.source):
                where.setdefault(name, index)
    return where


# -- things a person should look at -----------------------------------------------------------

SUSPECT_NAMES = {
    "LABSUPPORT_RESULTS": "LABSUPPORT_RESULTS (the grader's results file)",
    "RESULTS_ENV": "RESULTS_ENV (the grader's results file)",
    "Checker": "Checker (the check machinery)",
    "REGISTRY": "REGISTRY (the check registry)",
    "_record": "_record (writes check results)",
    "CheckResult": "CheckResult (check results)",
}
FRAMEWORK = "labsupport.checks.framework (the check machinery)"
# Names an exercise never needs, by which code reaches into the interpreter or the kernel to change
# what other code does (the imported modules, import hooks, IPython's hooks and displays, builtins,
# another function's code or globals, the calling frames, the environment). Found as names, so
# ``getattr(sys, "mod" + "ules")`` still shows ``getattr`` on ``sys``: see INTERPRETER_OBJECTS.
INTERPRETER_NAMES = {
    "meta_path", "path_hooks", "path_importer_cache", "settrace", "setprofile", "_getframe",
    "f_globals", "f_locals", "f_back", "set_custom_exc", "input_transformers_post", "input_transformers_cleanup",
    "input_transformer_manager", "ast_transformers", "display_pub", "displayhook", "excepthook",
    "builtins", "__builtins__", "ctypes", "get_referrers", "get_referents", "get_objects", "cell_contents",
    "__code__", "__closure__", "__globals__", "__defaults__", "__kwdefaults__", "setrecursionlimit",
    "__import__", "import_module", "get_ipython", "ipykernel", "IPython", "clear_output", "update_display",
    "publish_display_data",
}
# ... and attributes that are only suspect on a module (``model.modules()`` and ``allocator.fork`` are fine)
INTERPRETER_ATTRIBUTES = {"sys": {"modules"}, "os": {"environ", "fork", "forkpty", "kill", "killpg"},
                          "importlib": {"reload"}}
INTERPRETER_OBJECTS = {"sys", "builtins", "math", "torch", "gc", "importlib", "os", "inspect", "types"}
# The course's answers by name. Not the names of the labs' own exercises (kv_bytes_per_token,
def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def course_answers(trees: Iterable[ast.AST]) -> tuple[set[str], set[str]]:
    """The names that mean one of the course's registered answers in this notebook.

    Returns ``(bare, every)``: ``every`` is every registered answer's name, which as an attribute
    (``costs.kv_bytes_per_token``) always means the course's; ``bare`` leaves out the names the
    notebook defines itself, since an exercise often has the name of the course's answer and the
    function a learner writes under that name is theirs.
    """
    every = answer_names()
    own = {node.name for tree in trees for node in ast.walk(tree)
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return every - own, every


def _referenced(node: ast.AST, answers: tuple[set[str], set[str]]) -> list[str]:
    """The course's answers named anywhere inside ``node`` (``answers`` from :func:`course_answers`)."""
    bare, every = answers
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in bare or isinstance(sub, ast.Attribute) and sub.attr in every:
            name = sub.id if isinstance(sub, ast.Name) else sub.attr
            if name not in names:
                names.append(name)
    return names


def _func_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def scan_flags(nb, known_checks: Iterable[str] = ()) -> list[str]:
    """What in the notebook's code looks like tampering with grading (for a person to read)."""
    flags: list[str] = []

    def add(text: str) -> None:
        if text not in flags:
            flags.append(text)

    known_checks = set(known_checks)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    trees = [_parse(src) for src in cells]
    answers = course_answers(filter(None, trees))
    parsed = [tree for tree in trees if tree is not None]
    _flag_words(cells, trees, add)
    bound = _labsupport_names(parsed, add)
    exercises = _exercises(parsed, answers, add)
    _flag_patches(parsed, bound, exercises, known_checks, answers, add)
    return flags


def _flag_words(cells: list[str], trees: list, add) -> None:
    """Per cell, in its code without comments: the suspect names, the check framework, reaching into
    the interpreter, and a cell that mentions labsupport but does not parse."""
    for src, tree in zip(cells, trees):
        code = " ".join(t.string for t in _tokens(python_source(src)))  # comments left out
        if "LABSUPPORT_RESULTS" in code:  # in a name or a string
            add(SUSPECT_NAMES["LABSUPPORT_RESULTS"])
        for word, text in SUSPECT_NAMES.items():
            if re.search(rf"(?<![A-Za-z0-9_]){word}(?![A-Za-z0-9_])", code):
                add(text)
        if re.search(r"\bchecks \. framework\b|\bchecks import\b[^\n]*?\bframework\b", code):
            add(FRAMEWORK)
        reached = _reaches_into_interpreter(src, tree)
        if reached:
            add(f"reaches into the interpreter or the kernel ({', '.join(reached)}): read it")
        if tree is None and "labsupport" in code:
            add("a cell that does not parse mentions labsupport (read it)")


def _labsupport_names(trees: list[ast.AST], add) -> set[str]:
    """The names that refer to labsupport modules or what was imported from them; imports of the
    check modules are flagged on the way."""
    bound = {"labsupport"}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "labsupport":
                        bound.add((alias.asname or alias.name).split(".")[0])
                    if alias.name.startswith("labsupport.checks."):
                        add(FRAMEWORK if alias.name == "labsupport.checks.framework" else f"imports {alias.name}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labsupport":
                if (node.module or "").startswith("labsupport.checks."):
                    add(FRAMEWORK if node.module == "labsupport.checks.framework" else f"imports from {node.module}")
                bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def _exercises(trees: list[ast.AST], answers, add) -> dict[str, set[str]]:
    """The functions the notebook hands to checks, with those checks; a course answer handed to a
    check is flagged on the way."""
    exercises: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _func_name(node).startswith("check_") and node.args:
                if isinstance(node.args[0], ast.Name):
                    exercises.setdefault(node.args[0].id, set()).add(_func_name(node))
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    for name in _referenced(arg, answers):
                        add(f"passes the course's {name} to {_func_name(node)}")
    return exercises


def _flag_patches(trees: list[ast.AST], bound: set[str], exercises: dict[str, set[str]], known_checks: set[str],
                  answers, add) -> None:
    """Assignments and calls that patch labsupport, checks redefined, and exercises that are (or use)
    the course's answers."""
    for tree in trees:
        for node in ast.walk(tree):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, (ast.Attribute, ast.Subscript)) and (
                            _root_name(t) in bound or "labsupport" in ast.unparse(t)):
                        add(f"patches {ast.unparse(t)}")
                    elif isinstance(t, ast.Name) and t.id in known_checks:
                        add(f"redefines {t.id}")
                    elif isinstance(t, ast.Name) and t.id in exercises and getattr(node, "value", None) is not None:
                        for name in _referenced(node.value, answers):
                            add(f"{t.id} is the course's {name}")
            if isinstance(node, ast.Call) and _func_name(node) in ("setattr", "delattr", "patch", "object") \
                    and node.args:
                first = node.args[0]
                if _root_name(first) in bound or (
                        isinstance(first, ast.Constant) and str(first.value).startswith("labsupport")):
                    add(f"patches {ast.unparse(first)} ({ast.unparse(node.func)})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in known_checks:
                    add(f"redefines {node.name}")
                if node.name in exercises:
                    banned = _banned_by(exercises[node.name])
                    for name in _referenced(ast.Module(body=node.body, type_ignores=[]), answers):
                        if banned is None or name in banned:
                            add(f"{node.name} uses the course's {name}")


def _banned_by(check_names: Iterable[str]) -> set[str] | None:
    """The plain names of the answers these checks ban, or None when one of them is not a known check
    (then every answer counts). An exercise may build on another chapter's answer (chapter 11's
    tensor-parallel layer applies chapter 08's RoPE); only the answers its own checks ban are its own."""
    banned: set[str] = set()
    for name in check_names:
        check = checks.REGISTRY.get(name)
        if check is None:
            return None
        banned.update(q.rpartition(".")[2] for q in getattr(check, "bans", ()))
    return banned


def _reaches_into_interpreter(src: str, tree: ast.AST | None) -> list[str]:
    """What in a cell's code reaches into the interpreter or the kernel (see INTERPRETER_NAMES): the
    names it spells, and ``setattr``/``getattr``/``vars`` on a module like ``sys`` or ``math``."""
    found = [t.string for t in _tokens(python_source(src)) if t.type == tokenize.NAME and t.string in INTERPRETER_NAMES]
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and _func_name(node) in ("setattr", "getattr", "delattr", "vars") and node.args:
            root = _root_name(node.args[0])
            if root in INTERPRETER_OBJECTS:
                found.append(f"{_func_name(node)} on {root}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.attr in INTERPRETER_ATTRIBUTES.get(node.value.id, ()):
            found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _root_name(target) in INTERPRETER_OBJECTS:
                    found.append(f"assigns {ast.unparse(target)}")
    return list(dict.fromkeys(found))
