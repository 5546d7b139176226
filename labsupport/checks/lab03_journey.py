"""Checks for the request-journey lab: the latency metrics of one streamed request, and the
nearest-rank percentile used across many."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from ..latency import latency_metrics, percentile
from .framework import Case, graded

METRICS_RULE = (
    "measure everything from the send time: TTFT ends at the first token, E2E at the last; ITL holds the "
    "n - 1 gaps between consecutive tokens (the wait for the first token is TTFT, not a gap); TPOT is the "
    "mean of those gaps, which is the time after the first token over n - 1, and None for a single token (no "
    "gap to average). The first token comes from the prefill; the first decode step makes the second."
)
PERCENTILE_RULE = (
    "nearest rank: sort the values; the p-th percentile of n values is the ceil(p * n / 100)-th smallest "
    "(1-based; the smallest for p = 0). It is always one of the values, never an interpolation."
)
KEYS = ("ttft", "tpot", "itl", "e2e")


def _stream(rng: random.Random, sent: float, n: int, ttft: float, gap: float) -> list[float]:
    times, t = [], sent + ttft
    for _ in range(n):
        times.append(t)
        t += gap * rng.uniform(0.5, 2.5)
    return times


def _metric_cases():
    rng = random.Random(3)
    return [
        ("five tokens, uneven gaps", 100.0, [100.35, 100.37, 100.40, 100.46, 100.47]),
        ("one-token answer", 5.0, [5.2]),
        ("two tokens", 2.0, [2.5, 2.75]),
        ("a long queue wait, then fast tokens", 0.0, [3.0, 3.01, 3.02, 3.04]),
        ("two tokens in the same instant", 7.0, [7.1, 7.3, 7.3, 7.6]),
        ("monotonic-clock times, 40 tokens", 123456.0, _stream(rng, 123456.0, 40, 0.8, 0.02)),
    ]


def _tpot_mistakes(sent: float, times: list[float]) -> dict[str, float]:
    n, ttft, e2e = len(times), times[0] - sent, times[-1] - sent
    return {
        "(E2E - TTFT) is divided by n instead of n - 1 (n tokens have n - 1 gaps between them)": (e2e - ttft) / n,
        "TPOT is E2E / n, the whole request spread over every token (TTFT included)": e2e / n,
        "TPOT is E2E / (n - 1) (the time to the first token is not subtracted)": e2e / (n - 1),
        "TPOT is measured from the first decode step's token: (E2E - (t[1] - s)) / (n - 1)": (
            (e2e - (times[1] - sent)) / (n - 1)
        ),
    }


def _as_float(value):
    """A numpy or torch scalar as a plain number; anything else as it is."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple)):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # an array of several values: let the comparison say so
            return value
    return value


@graded(points=6, bans=(latency_metrics,))
def check_latency_metrics(fn, checker):
    """``fn(sent_s, token_times_s)`` must return ``{"ttft", "tpot", "itl", "e2e"}`` in seconds, with
    ``tpot`` None for a one-token answer."""
    for label, sent, times in _metric_cases():
        case = Case(stream=label, sent_s=sent, tokens=len(times))
        got = checker.call(fn, sent, list(times), case=case)
        want = latency_metrics(sent, times)
        if not isinstance(got, Mapping):
            checker.fail(case, f"your function returned a {type(got).__name__}, expected a dict with keys "
                               f"{', '.join(KEYS)}.", METRICS_RULE)
        missing = [k for k in KEYS if k not in got]
        if missing:
            checker.fail(case, f"the dict has no key {', '.join(repr(k) for k in missing)} (it has "
                               f"{', '.join(repr(k) for k in got) or 'none'}).", METRICS_RULE)
        n = len(times)
        ttft_mistakes = {"TTFT is measured at the second token, which the first decode step makes (the first "
                         "token comes from the prefill)": times[1] - sent} if n > 1 else {}
        ttft_mistakes["TTFT is measured from the first token itself (it is 0)"] = 0.0
        checker.expect_number(_as_float(got["ttft"]), want["ttft"], case=case, rel=1e-9, what="TTFT",
                              hint=METRICS_RULE, mistakes=ttft_mistakes)
        checker.expect_number(_as_float(got["e2e"]), want["e2e"], case=case, rel=1e-9, what="E2E", hint=METRICS_RULE,
                              mistakes={"E2E is measured from the first token, not from sending the request":
                                        times[-1] - times[0]})
        itl = got["itl"]
        if isinstance(itl, (str, bytes, Mapping)) or not hasattr(itl, "__len__"):
            checker.fail(case, f"ITL is a {type(itl).__name__}, expected a list of {n - 1} gaps.", METRICS_RULE)
        itl = [_as_float(x) for x in itl]
        if len(itl) != n - 1:
            extra = ""
            if len(itl) == n and itl and math.isclose(itl[0], want["ttft"], rel_tol=1e-9):
                extra = " Its first value is TTFT: the wait for the first token is not an inter-token gap."
            checker.fail(case, f"ITL has {len(itl)} values; {n} tokens have {n - 1} gaps between them.{extra}",
                         METRICS_RULE)
        for i, (g, w) in enumerate(zip(itl, want["itl"])):
            checker.expect_number(g, w, case=case, rel=1e-9, what=f"ITL[{i}]", hint=METRICS_RULE)
        tpot = _as_float(got["tpot"])
        if want["tpot"] is None:
            if tpot is not None:
                checker.fail(case, f"TPOT is {tpot!r}; with one token there is no gap to average, so TPOT is "
                                   f"None (0 would claim an infinitely fast decode).", METRICS_RULE)
        else:
            if tpot is None:
                checker.fail(case, f"TPOT is None; with {n} tokens it is (E2E - TTFT) / {n - 1}.", METRICS_RULE)
            checker.expect_number(tpot, want["tpot"], case=case, rel=1e-9, what="TPOT", hint=METRICS_RULE,
                                  mistakes={d: v for d, v in _tpot_mistakes(sent, times).items()
                                            if not math.isclose(v, want["tpot"], rel_tol=1e-9)})


def _percentile_mistakes(values: list[float], p: float) -> dict[str, float]:
    data, n = sorted(values), len(values)
    pos = p / 100 * (n - 1)
    lo = math.floor(pos)
    interpolated = data[lo] + (data[min(lo + 1, n - 1)] - data[lo]) * (pos - lo)
    return {
        "p / 100 is rounded before it is multiplied by n: ceil(p / 100 * n) lands one rank too high where "
        f"p * n / 100 is a whole number ({p} / 100 * {n} = {p / 100 * n!r} in floating point). Multiply first, "
        "ceil(p * n / 100), or stay in integers, -(-p * n // 100)":
            data[min(n, max(1, math.ceil(p / 100 * n))) - 1],
        "p = 0 gives rank 0, and ordered[0 - 1] is the LARGEST value (index -1): the rank must be at least 1, "
        "so p = 0 is the smallest value": data[math.ceil(p * n / 100) - 1],
        "the value is interpolated between two ranks (numpy's default), not the nearest rank": interpolated,
        "the rank is rounded down, not up (floor(p / 100 * n) as a 1-based rank)": data[max(0, math.floor(p / 100 * n) - 1)],
        "the rank ceil(p * n / 100) is used as a 0-based index (one rank too high)": data[min(n - 1, math.ceil(p / 100 * n))],
        "the values are not sorted first": values[max(1, math.ceil(p / 100 * n)) - 1],
        "the mean is returned": sum(values) / n,
    }


@graded(points=4, bans=(percentile,))
def check_percentile(fn, checker):
    """``fn(values, p)`` must return the ``p``-th percentile of ``values`` by nearest rank."""
    rng = random.Random(7)
    ttfts = [round(rng.lognormvariate(-2.5, 0.6), 4) for _ in range(37)] + [1.9, 2.4]  # a slow tail
    rng.shuffle(ttfts)
    cases = [
        ([0.30, 0.10, 0.50, 0.20, 0.40], 50),
        ([0.30, 0.10, 0.50, 0.20, 0.40], 90),
        ([4.0, 1.0, 3.0, 2.0], 25),  # p / 100 * n is a whole number: no rounding up
        ([4.0, 1.0, 3.0, 2.0], 75),
        (ttfts, 50),
        (ttfts, 99),
        (ttfts, 100),
        ([0.2, 0.2, 0.9, 0.2], 99),
        ([0.25], 99),
        ([0.3, 0.1, 0.5], 0),  # the largest value is not the first: a rank of 0 and unsorted values differ
        (list(range(100, 0, -1)), 7),  # 7 / 100 * 100 is 7.000000000000001 in floating point, 7 * 100 / 100 is 7
        ([float(v) for v in random.Random(28).sample(range(1, 26), 25)], 28),  # 0.28 * 25 = 7.000000000000001
    ]
    for values, p in cases:
        shown = f"{len(values)} values" if len(values) > 6 else values
        if len(values) > 6 and sorted(values) == list(range(1, len(values) + 1)):
            shown = f"1 to {len(values)} in some order"
        case = Case(values=shown, p=p)
        got = checker.call(fn, list(values), p, case=case)
        want = percentile(values, p)
        mistakes = {d: v for d, v in _percentile_mistakes(values, p).items() if not math.isclose(v, want)}
        checker.expect_number(_as_float(got), want, case=case, rel=1e-12, what=f"p{p}", hint=PERCENTILE_RULE,
                              mistakes=mistakes)
