"""Helpers the check modules share for naming a learner's mistake."""

from __future__ import annotations

import math


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
