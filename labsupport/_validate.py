"""Argument checks shared by the arithmetic modules: bad input fails early and says why."""

from __future__ import annotations

import numbers


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
