"""The grader's last cell (see :mod:`labsupport.course.probe`): its text is read from this file and
run in the graded notebook's kernel, never imported by the course. Everything it needs is imported
inside the function, so the cell stands alone."""


def _labsupport_probe(nonce, mime):
    # One long function on purpose: this function is the whole cell the grader appends (probe.py runs
    # this file's text in the learner's kernel), and that cell must leave one name behind in the learner's
    # namespace, so its parts (codes, same, foreign) are nested here rather than defined beside it.
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
                # top-level functions and classes only: <module>, <listcomp>, <genexpr>, <lambda>... have no name
                if "." not in qualname and not qualname.startswith("<") and not callable(vars(module).get(qualname)):
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
        if os.environ.get("LABSUPPORT_GRADING") and not getattr(fw, "_GUARDING", False):
            problems.append("the checks' guard is off (labsupport.checks.framework._GUARDING)")
        problems += [f"{name} was replaced" for name in fw.replaced()[:5]]
        paths = sysconfig.get_paths()
        libraries = (root, stdlib, paths["purelib"] + os.sep, paths["platlib"] + os.sep)
        def foreign(hook):  # written in the notebook (a cell), not by a library
            for fn in (hook, getattr(hook, "__func__", None), vars(type(hook)).get("__call__"),
                       getattr(type(hook), "visit", None)):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    return not os.path.abspath(code.co_filename).startswith(libraries)
            return False
        from IPython import get_ipython
        shell = get_ipython()
        hooks = []  # IPython's hooks that run code of the notebook's around or instead of a cell
        if shell is not None:
            hooks += [f"an IPython {event!r} event callback" for event, fns in shell.events.callbacks.items()
                      for fn in fns if foreign(fn)]
            manager = shell.input_transformer_manager
            hooks += ["an input transformer" for fn in [*shell.input_transformers_post, *manager.cleanup_transforms,
                                                        *manager.line_transforms] if foreign(fn)]
            hooks += ["an AST transformer" for fn in shell.ast_transformers if foreign(fn)]
            wrapped = getattr(getattr(shell, "CustomTB", None), "__func__", None)  # IPython wraps the handler
            handlers = [c.cell_contents for c in getattr(wrapped, "__closure__", None) or ()
                        if inspect.isfunction(c.cell_contents)]
            if shell.custom_exceptions and (not handlers or any(foreign(h) for h in handlers)):
                hooks.append("a custom exception handler (set_custom_exc)")
        problems += [f"{hook} was installed by the notebook" for hook in dict.fromkeys(hooks)]
    except Exception as exc:
        problems.append(f"the probe failed: {type(exc).__name__}: {exc}")
    display({mime: {"nonce": nonce, "problems": problems}}, raw=True)
