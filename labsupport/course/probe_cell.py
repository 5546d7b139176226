"""The grader's last cell (see :mod:`labsupport.course.probe`): its text is read from this file and
run in the graded notebook's kernel, never imported by the course. Everything it needs is imported
inside the function, so the cell stands alone."""


def _labsupport_probe(nonce, mime):
    # imports inside: the cell runs in the learner's namespace and leaves only this function there
    import inspect
    import os
    import sys
    import sysconfig
    import types

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
    display({mime: {"nonce": nonce, "problems": problems}}, raw=True)
