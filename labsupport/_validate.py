"""Argument checks shared by the arithmetic modules: bad input fails early and says why.

One validator per kind of argument. Models and GPUs have their own converters,
:func:`labsupport.models.as_model` and :func:`labsupport.hardware.as_gpu`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable


def positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` and what is accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    lowest = 0 if allow_zero else 1
    if value < lowest:
        accepted = "0 or more" if allow_zero else "1 or more"
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return value


def positive_number(name: str, value) -> float:
    """Return ``value`` as a float > 0, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not value > 0:
        raise ValueError(f"{name} must be greater than 0, got {value}")
    return float(value)


def non_negative_number(name: str, value) -> float:
    """Return ``value`` as a finite float >= 0, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def int_list(name: str, values, *, allow_zero: bool = False) -> list[int]:
    """Return ``values`` (a non-empty list of counts, each >= 1, or >= 0 with ``allow_zero``) as ints."""
    accepted = "whole numbers >= 0" if allow_zero else "whole numbers >= 1"
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of {accepted}, got {values!r}")
    out = [positive_int(f"each of {name}", v, allow_zero=allow_zero) for v in values]
    if not out:
        raise ValueError(f"{name} must contain at least one value, got an empty list")
    return out


def renamed_parameters(**old_to_new: str):
    """Let a function still take a parameter under its old name (``weight_bytes`` for
    ``weight_dtype_bytes``), so notebooks written against an earlier release keep running.
    Giving both spellings is an error."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {new}= and its old name {old}=; give {new}= only")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        wrapper.renamed_parameters = dict(old_to_new)
        return wrapper

    return decorate
