"""Helpers for the book's pages: format numbers and glue them into the prose.

Every number a chapter states is computed by labsupport and glued with :func:`glue`; the page
then writes ``{glue:text}`name``` where the number goes. Nothing is typed by hand.
"""

from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30


def count(value: float, digits: int = 0) -> str:
    """1234567 -> '1,234,567' (or with ``digits`` decimals)."""
    return f"{value:,.{digits}f}"


def si(value: float, unit: str = "", digits: int = 1) -> str:
    """Decimal prefixes: 3.42e13 FLOP -> '34.2 TFLOP'; 1.606e10 B -> '16.1 GB'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:,.{digits}f} {prefix}{unit}"
    return f"{value:,.{digits}f} {unit}".rstrip()


def binary_bytes(value: float, digits: int = 1, unit: str | None = None) -> str:
    """Binary prefixes: 131072 -> '128 KiB' (trailing .0 dropped); ``unit`` forces one ("GiB")."""
    units = ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"))
    if unit is not None:
        factors = dict((p, f) for f, p in units)
        if unit not in factors:
            raise ValueError(f"unit must be one of {', '.join(factors)}, got {unit!r}")
        units = ((factors[unit], unit),)
    for factor, prefix in units:
        if abs(value) >= factor or unit is not None:
            text = f"{value / factor:,.{digits}f}"
            if "." in text:
                text = text.rstrip("0").rstrip(".")
            return f"{text} {prefix}"
    return f"{value:,.0f} B"


def percent(fraction: float, digits: int = 0) -> str:
    return f"{100 * fraction:.{digits}f}%"


def glue_markdown(name: str, text: str) -> str:
    """Glue Markdown (a table, a paragraph) under ``name`` for a ``{glue:md}`` directive with
    ``:format: myst``, and return it."""
    from IPython.display import Markdown
    from myst_nb import glue as _glue

    _glue(name, Markdown(text), display=False)
    return text


def glue(name: str, text: str) -> str:
    """Glue ``text`` under ``name`` for ``{glue:text}`` in the page, and return it."""
    from myst_nb import glue as _glue

    _glue(name, text, display=False)
    return text


def _figures_at_twice_the_pixels() -> None:
    """Matplotlib figures a page shows inline are stored at twice their pixels (sharp on high-density
    screens, shown at their size): the inline backend's retina format. Outside IPython, nothing."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


_figures_at_twice_the_pixels()  # a page imports this module in its first cell
