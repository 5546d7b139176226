"""Graded checks. Each ``check_*`` takes the learner's function, raises AssertionError with a
diagnosis when something is wrong, and prints one pass line when everything is right."""

from .basics import check_vector_add
from .framework import REGISTRY, RESULTS, CheckFailed, CheckResult

__all__ = ["check_vector_add", "CheckFailed", "CheckResult", "REGISTRY", "RESULTS"]
