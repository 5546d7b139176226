"""Helpers the check modules share for naming a learner's mistake: which named mistakes a failing
number may be blamed on (the counting checks of labs 05 and 06, and later labs)."""

from __future__ import annotations

import math
import re


def merge_alike(mistakes: dict[str, float], rel: float = 1e-12) -> dict[str, float]:
    """Mistakes that give the same value on a case, named together: on a small case two different
    mistakes can agree, and the message should name both rather than pick one of them."""
    groups: list[tuple[float, list[str]]] = []
    for description, value in mistakes.items():
        for v, names in groups:
            if math.isclose(v, value, rel_tol=rel):
                names.append(description)
                break
        else:
            groups.append((value, [description]))
    return {"; or when ".join(names): v for v, names in groups}


def distinct(mistakes: dict[str, float], expected: float) -> dict[str, float]:
    """Drop mistakes that give the right answer for this case; join ones that give the same value with "or"."""
    merged: dict[float, list[str]] = {}
    for what, value in mistakes.items():
        if abs(value - expected) <= 1e-9 * abs(expected):
            continue
        key = next((v for v in merged if abs(v - value) <= 1e-9 * abs(value)), value)
        merged.setdefault(key, []).append(what)
    return {", or ".join(whats): value for value, whats in merged.items()}


class RuledOut:
    """Mistakes an earlier case has already ruled out: the learner's function gave the right answer there,
    where the mistake would not have, so a later failure is not that mistake (Qwen3-0.6B's derived head
    width halves the cache like a missing factor 2, but the factor 2 was right for every Llama before it).
    A mistake is known by its description with the numbers taken out (they change from case to case)."""

    def __init__(self):
        self.keys: set[str] = set()

    @staticmethod
    def _key(description: str) -> str:
        return re.sub(r"\d[\d,.]*", "#", description)

    def candidates(self, mistakes: dict[str, float], expected: float, merge: bool = True) -> dict[str, float]:
        """The mistakes still possible; with ``merge``, those giving the same value joined (:func:`distinct`),
        otherwise the first that matches is the one named."""
        left = {what: value for what, value in mistakes.items() if self._key(what) not in self.keys}
        if merge:
            return distinct(left, expected)
        return {what: value for what, value in left.items() if abs(value - expected) > 1e-9 * abs(expected)}

    def passed(self, mistakes: dict[str, float], expected: float) -> None:
        """Record a case the learner's function got right: every mistake that would have got it wrong is out."""
        self.keys |= {self._key(what) for what, value in mistakes.items()
                      if abs(value - expected) > 1e-9 * abs(expected)}
