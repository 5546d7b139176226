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

from ..checks.framework import RESULT_MIME
from .scan import check_calls

PROBE_MIME = RESULT_MIME.replace("check-result", "probe")

PROBE = '''\
def _labsupport_probe(nonce):
    import inspect, os, sys, sysconfig, types
    from IPython.display import display
    problems = []
    cache = {}
    def codes(path):
        if path in cache:
            return cache[path]
        found = cache[path] = {}
        stack = [compile(open(path, encoding="utf-8").read(), path, "exec")]
        while stack:
            code = stack.pop()
            found.setdefault(code.co_qualname, []).append(code.co_code)
            stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        return found
    try:
        import labsupport.checks as checks
        fw = sys.modules["labsupport.checks.framework"]
        root = os.path.dirname(os.path.dirname(os.path.abspath(checks.__file__))) + os.sep  # labsupport/
        stdlib = sysconfig.get_paths()["stdlib"] + os.sep
        def same(value, where):
            path = value.__code__.co_filename
            while path.startswith(stdlib) and inspect.isfunction(getattr(value, "__wrapped__", None)):
                value = value.__wrapped__  # a contextmanager's or functools.wraps' wrapper: what it wraps
                path = value.__code__.co_filename
            if not os.path.abspath(path).startswith(root):
                problems.append(f"{where} comes from {path}")
            elif value.__code__.co_code not in codes(path).get(value.__code__.co_qualname, []):
                problems.append(f"{where} differs from its file")
        for module in [fw] + [m for n, m in list(sys.modules.items()) if n.startswith("labsupport.checks.lab")]:
            disk = codes(module.__file__)
            for name, value in list(vars(module).items()):
                if inspect.isfunction(value) and (value.__module__ == module.__name__ or name in disk):
                    same(value, f"{module.__name__}.{name}")
                elif inspect.isclass(value) and value.__module__ == module.__name__:
                    for attr, member in list(vars(value).items()):  # the methods its file defines
                        if inspect.isfunction(member) and f"{value.__qualname__}.{attr}" in disk:
                            same(member, f"{module.__name__}.{name}.{attr}")
            for qualname in disk:
                if "." not in qualname and qualname != "<module>" and not callable(vars(module).get(qualname)):
                    problems.append(f"{module.__name__}.{qualname} was replaced")
        fw_codes = codes(fw.__file__)
        for name, check in list(fw.REGISTRY.items()):
            if getattr(check, "__code__", None) is None or check.__code__.co_code not in fw_codes.get(
                    "graded.<locals>.decorate.<locals>.check", []):
                problems.append(f"the registered {name} is not the course's")
            if getattr(checks, name, check) is not check:
                problems.append(f"labsupport.checks.{name} is not the registered check")
        if sys.gettrace() is not None or sys.getprofile() is not None:
            problems.append("a trace or profile hook is set")
    except Exception as exc:
        problems.append(f"the probe failed: {type(exc).__name__}: {exc}")
    display({MIME: {"nonce": nonce, "problems": problems}}, raw=True)
_labsupport_probe(NONCE)
'''


def reimport(source: str) -> str:
    """A course check cell's source, importing its checks afresh first."""
    names = [n for n in check_calls(source) if n.startswith("check_")]
    if not names:
        return source
    return f"from labsupport.checks import {', '.join(names)}  # added by the grader\n{source}"


def probe_cell() -> tuple[str, str]:
    """The last cell's source, and the nonce its answer must carry."""
    nonce = secrets.token_hex(16)
    return PROBE.replace("MIME", repr(PROBE_MIME)).replace("NONCE", repr(nonce)), nonce


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
