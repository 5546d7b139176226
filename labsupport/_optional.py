"""Packages only some labs need, imported when first used.

A lab's setup cell installs the course with its declared dependencies only (numpy, matplotlib,
tqdm; torch and Triton are the machine's), so every module a lab imports must import without the
course server's packages. Modules that talk to a server (:mod:`labsupport.bench_serving`,
:mod:`labsupport.load_testing`) name them with :class:`OptionalModule`: the real import happens at
the first use, and a missing package is a ``ModuleNotFoundError`` that says what to install.
"""

from __future__ import annotations

import importlib
import sys

SERVE_HINT = ('in a notebook, run `from labsupport.serve import install_missing; install_missing()` (labs 03 '
              'and 15 do it in their first cells), or install the course with its server: '
              'pip install "labsupport[serve] @ git+<the course repository>"')


class OptionalModule:
    """Stands for module ``name`` until an attribute is read: ``httpx = OptionalModule("httpx", ...)``,
    then ``httpx.get(...)`` imports httpx (once) or raises saying what to install."""

    def __init__(self, name: str, package: str, purpose: str, hint: str = SERVE_HINT):
        self._name, self._package, self._purpose, self._hint = name, package, purpose, hint

    def _load(self):
        try:
            return importlib.import_module(self._name)
        except ModuleNotFoundError as exc:
            if exc.name != self._name.split(".")[0]:
                raise
            raise ModuleNotFoundError(
                f"{self._purpose} needs the package {self._package}, which this Python ({sys.executable}) "
                f"does not have: {self._hint}.", name=exc.name) from None

    def __getattr__(self, attr: str):
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<optional module {self._name!r}>"
