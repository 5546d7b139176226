"""Graded checks. Each ``check_*`` takes the learner's function, raises AssertionError with a
diagnosis when something is wrong, and prints one pass line when everything is right.

One module per lab, named like the lab (``lab07_attention.py`` for ``solutions/07_attention.py``),
on the shared core in ``framework.py``. Every module in this package is imported here and its
``check_*`` functions re-exported, so a new lab's checks only need a new module
(``labsupport/checks/labNN_topic.py``; see CONTRIBUTING.md).
"""

import importlib as _importlib
import pkgutil as _pkgutil

from .framework import REGISTRY, RESULTS, CheckFailed, CheckResult

__all__ = ["CheckFailed", "CheckResult", "REGISTRY", "RESULTS"]

for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if _module == "framework" or _module.startswith("_"):
        continue
    _mod = _importlib.import_module(f".{_module}", __name__)
    for _name in dir(_mod):
        if _name.startswith("check_") and callable(getattr(_mod, _name)):
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)

from .framework import remember as _remember  # noqa: E402

_remember()  # what the checks rely on, as imported (see framework.replaced)
