"""What Prometheus computes from a server's histograms, in Python (chapter 15).

A Prometheus histogram is exported as one counter per bucket, ``NAME_bucket{le="0.1"}``: how many
observations so far were at most 0.1 (cumulative, so the ``le="+Inf"`` bucket holds them all),
plus ``NAME_sum`` and ``NAME_count``. Prometheus never sees an observation, only these counts, so
every percentile it reports is an estimate from them. This module reproduces its arithmetic, read
from Prometheus's own code (prometheus/prometheus at commit ``d15adb9``, version 3.14.0:
``promql/quantile.go`` and ``promql/functions.go``):

* :func:`counter_increase`: what ``increase()`` (and ``rate()``, divided by the window) takes from a
  counter between two samples: the difference, except that a counter that went *down* was reset
  (the process restarted and counts from 0 again), and then the increase is its new value. It is
  decided for each series on its own, so for each bucket of a histogram.
* :func:`bucket_quantile`: ``histogram_quantile(q, ...)`` for classic buckets (``BucketQuantile``):
  sort the buckets by their upper bound, require a ``+Inf`` bucket, make the counts monotonic,
  take the rank ``q * total``, find the first bucket whose cumulative count reaches it (``>=``) and
  interpolate linearly inside it, from the bucket below's bound (0 for the lowest bucket when its
  bound is positive) to its own. A rank that falls in the ``+Inf`` bucket gives the largest finite
  bound; no observations give NaN; ``q`` below 0 gives minus infinity and above 1 plus infinity.
* :func:`histogram_quantile_between`: the quantile of the observations made *between* two scrapes,
  ``histogram_quantile(q, increase(NAME_bucket[window]))``: lab 15's exercise.
* :func:`bucket_counts` reads one histogram's cumulative bucket counts out of a scrape parsed by
  :func:`labsupport.load_testing.scrape_metrics`.

Bounds are the exposition format's strings (``"0.005"``, ``"+Inf"``); :func:`parse_le` reads one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ._answers import answer

__all__ = [
    "SMALL_DELTA_TOLERANCE",
    "bucket_counts",
    "bucket_quantile",
    "counter_increase",
    "histogram_quantile_between",
    "parse_le",
]

# promql/quantile.go's smallDeltaTolerance: relative differences this small between neighbouring
# cumulative counts are taken as floating-point noise and removed (either direction).
SMALL_DELTA_TOLERANCE = 1e-12


def parse_le(le) -> float:
    """A bucket's upper bound from its ``le`` label: ``"0.25"`` -> 0.25, ``"+Inf"`` -> inf."""
    if isinstance(le, bool):
        raise ValueError(f"a bucket bound is a number or its le label, got {le!r}")
    if isinstance(le, (int, float)):
        return float(le)
    if not isinstance(le, str):
        raise ValueError(f"a bucket bound is a number or its le label such as '0.25' or '+Inf', got {le!r}")
    try:
        value = float(le)  # float() reads "+Inf", "inf" and "Infinity" alike
    except ValueError:
        raise ValueError(f"bucket bound {le!r} is not a number (le labels look like '0.25' or '+Inf')") from None
    if math.isnan(value):
        raise ValueError("a bucket bound cannot be NaN")
    return value


def counter_increase(before: float, after: float) -> float:
    """The increase of one counter between two samples, as Prometheus's ``increase()`` counts it
    (without extrapolating to the window's edges): ``after - before``, or ``after`` when the counter
    went down (it was reset: the process restarted and counted again from 0)."""
    for name, value in (("before", before), ("after", after)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"a counter's {name} value must be a finite number, 0 or more; got {value!r}")
    return float(after) if after < before else float(after - before)


def _almost_equal(a: float, b: float, tolerance: float) -> bool:
    """util/almost.Equal: equal, or differing by less than ``tolerance`` times their summed magnitude
    (near zero, by less than ``tolerance`` times the smallest normal float)."""
    if a == b:
        return True
    min_normal = 2.2250738585072014e-308
    total, diff = abs(a) + abs(b), abs(a - b)
    if a == 0 or b == 0 or total < min_normal:
        return diff < tolerance * min_normal
    return diff / min(total, 1.7976931348623157e308) < tolerance


@answer
def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus's ``histogram_quantile(q, ...)`` of classic histogram buckets (module docstring).

    ``buckets``: ``(upper bound, cumulative count)`` pairs in any order (a bound may be an ``le``
    string). Returns NaN when there are no observations, fewer than two buckets, no ``+Inf``
    bucket, or ``q`` is NaN; ``-inf`` for ``q < 0`` and ``inf`` for ``q > 1``."""
    if isinstance(q, bool) or not isinstance(q, (int, float)):
        raise ValueError(f"q is a quantile, a number from 0 to 1 (0.9 for the 90th percentile), got {q!r}")
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    pairs = sorted(((parse_le(le), float(count)) for le, count in buckets), key=lambda b: b[0])
    if not pairs or not math.isinf(pairs[-1][0]) or pairs[-1][0] < 0:
        return math.nan
    coalesced: list[list[float]] = []  # buckets with the same bound are one bucket (their counts added)
    for upper, count in pairs:
        if coalesced and coalesced[-1][0] == upper:
            coalesced[-1][1] += count
        else:
            coalesced.append([upper, count])
    prev = coalesced[0][1]  # ensureMonotonicAndIgnoreSmallDeltas
    for bucket in coalesced[1:]:
        if bucket[1] == prev:
            continue
        if _almost_equal(prev, bucket[1], SMALL_DELTA_TOLERANCE) or bucket[1] < prev:
            bucket[1] = prev  # floating-point noise, or a decrease: removed, and prev kept
            continue
        prev = bucket[1]
    if len(coalesced) < 2:
        return math.nan
    observations = coalesced[-1][1]
    if observations == 0:
        return math.nan
    rank = q * observations
    # sort.Search over every bucket but the last: the first whose count reaches the rank
    b = next((i for i in range(len(coalesced) - 1) if coalesced[i][1] >= rank), len(coalesced) - 1)
    if b == len(coalesced) - 1:
        return coalesced[-2][0]  # the +Inf bucket: the largest finite bound
    if b == 0 and coalesced[0][0] <= 0:
        return coalesced[0][0]
    start, end, count = 0.0, coalesced[b][0], coalesced[b][1]
    if b > 0:
        start = coalesced[b - 1][0]
        count -= coalesced[b - 1][1]
        rank -= coalesced[b - 1][1]
    if count == 0:  # only q == 0 over an empty lowest bucket: Go's 0/0 is NaN
        return math.nan
    return start + (end - start) * (rank / count)


@answer
def histogram_quantile_between(q: float, before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """The ``q`` quantile (0 to 1) of the observations a histogram received between two scrapes,
    as Prometheus computes ``histogram_quantile(q, increase(NAME_bucket[window]))`` (chapter 15).

    ``before`` and ``after``: ``{le: cumulative count}`` of the same buckets (:func:`bucket_counts`),
    the ``le`` labels as strings (``"0.1"``, ``"+Inf"``). Each bucket's increase is taken on its own
    (:func:`counter_increase`: a count that fell was reset), then :func:`bucket_quantile`. NaN when
    nothing was observed in between."""
    for name, scrape in (("before", before), ("after", after)):
        if not isinstance(scrape, Mapping):
            raise ValueError(f"{name} must be a dict {{le: cumulative count}}, got {type(scrape).__name__}")
    if set(before) != set(after):
        raise ValueError(f"the two scrapes hold different buckets: {sorted(set(before) ^ set(after))}")
    return bucket_quantile(q, [(le, counter_increase(before[le], after[le])) for le in after])


def bucket_counts(samples: Mapping, name: str, **labels) -> dict[str, float]:
    """``{le: cumulative count}`` of histogram ``name`` in a scrape parsed by
    :func:`labsupport.load_testing.scrape_metrics` (``{(sample, frozenset(labels)): value}``), for
    the series whose other labels are ``labels``. Empty when the scrape has no such histogram."""
    out = {}
    for (sample, sample_labels), value in samples.items():
        if sample != name + "_bucket":
            continue
        found = dict(sample_labels)
        le = found.pop("le", None)
        if le is not None and found == labels:
            out[le] = float(value)
    return out
