"""Reading a learner's function's parameter names, for checks that pass arguments by keyword."""

from __future__ import annotations

import inspect


def spelling(fn, *names: str) -> str:
    """The first of ``names`` (the current spelling first, then older ones) that ``fn`` has as a
    parameter; the current spelling when it has none of them or its signature cannot be read.

    A learner's notebook released before a parameter was renamed (``weight_bytes`` before
    ``weight_dtype_bytes``) keeps the old name, and its checks must still pass it.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return names[0]
    return next((name for name in names if name in params), names[0])
