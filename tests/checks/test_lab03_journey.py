"""The request-journey checks pass the references and reject each planted mistake."""

from __future__ import annotations

import math

import numpy as np
import pytest

from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_latency_metrics, check_percentile
from labsupport.latency import latency_metrics, percentile

# --- check_latency_metrics -------------------------------------------------------------------------


def ref_metrics(sent_s, token_times_s):
    t = token_times_s
    ttft, e2e = t[0] - sent_s, t[-1] - sent_s
    return {
        "ttft": ttft,
        "e2e": e2e,
        "itl": [b - a for a, b in zip(t, t[1:])],
        "tpot": (e2e - ttft) / (len(t) - 1) if len(t) > 1 else None,
    }


def mutant(**changes):
    """The reference with some values replaced: ``changes[key](sent, times, reference)``."""

    def fn(sent_s, token_times_s):
        out = ref_metrics(sent_s, token_times_s)
        for key, change in changes.items():
            out[key] = change(sent_s, token_times_s, out)
        return out

    return fn


def test_metrics_references_pass(capsys):
    check_latency_metrics(ref_metrics)
    check_latency_metrics(unguarded(latency_metrics))
    assert "PASSED check_latency_metrics" in capsys.readouterr().out


def test_numpy_results_are_accepted(capsys):
    def with_numpy(sent_s, token_times_s):
        t = np.asarray(token_times_s)
        gaps = np.diff(t)
        return {"ttft": t[0] - sent_s, "e2e": t[-1] - sent_s, "itl": gaps,
                "tpot": float(gaps.mean()) if len(gaps) else None}

    check_latency_metrics(with_numpy)
    assert "PASSED" in capsys.readouterr().out


METRIC_MUTANTS = {
    "TPOT divided by n": (
        mutant(tpot=lambda s, t, o: (o["e2e"] - o["ttft"]) / len(t) if len(t) > 1 else None),
        "divided by n instead of n - 1",
    ),
    "TTFT from the first decode step": (
        mutant(ttft=lambda s, t, o: (t[1] if len(t) > 1 else t[0]) - s),
        "second token, which the first decode step makes",
    ),
    "TPOT 0 for one token": (
        mutant(tpot=lambda s, t, o: 0.0 if len(t) == 1 else o["tpot"]),
        "TPOT is None",
    ),
    "TPOT is E2E / n": (
        mutant(tpot=lambda s, t, o: o["e2e"] / len(t) if len(t) > 1 else None),
        "spread over every token",
    ),
    "ITL includes TTFT": (
        mutant(itl=lambda s, t, o: [o["ttft"], *o["itl"]]),
        "Its first value is TTFT",
    ),
    "E2E from the first token": (
        mutant(e2e=lambda s, t, o: t[-1] - t[0]),
        "E2E is measured from the first token",
    ),
    "TTFT is zero": (mutant(ttft=lambda s, t, o: 0.0), "measured from the first token itself"),
    "a tuple, not a dict": (lambda s, t: tuple(ref_metrics(s, t).values()), "expected a dict"),
    "a key missing": (lambda s, t: {k: v for k, v in ref_metrics(s, t).items() if k != "itl"}, "no key 'itl'"),
    "milliseconds": (mutant(ttft=lambda s, t, o: o["ttft"] * 1000), "TTFT is"),
}


@pytest.mark.parametrize("name", list(METRIC_MUTANTS))
def test_metrics_mutant_is_rejected(name):
    fn, message = METRIC_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_latency_metrics(fn)


def test_metrics_stub_says_not_implemented():
    def stub(sent_s, token_times_s):
        raise NotImplementedError("Exercise 1")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_latency_metrics(stub)
    assert info.value.reason == "not done"


def test_metrics_refuses_the_course_answer():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_latency_metrics(lambda s, t: latency_metrics(s, t))


# --- check_percentile --------------------------------------------------------------------------------


def ref_percentile(values, p):
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1]


def test_percentile_references_pass(capsys):
    check_percentile(ref_percentile)
    check_percentile(unguarded(percentile))
    check_percentile(lambda v, p: sorted(v)[max(1, -(-p * len(v) // 100)) - 1])  # in integers
    assert "PASSED check_percentile" in capsys.readouterr().out


PERCENTILE_MUTANTS = {
    "numpy's default interpolation": (lambda v, p: float(np.percentile(v, p)), "interpolated"),
    "rank rounded down": (
        lambda v, p: sorted(v)[max(0, math.floor(p / 100 * len(v)) - 1)], "rounded down"),
    "0-based rank": (lambda v, p: sorted(v)[min(len(v) - 1, math.ceil(p / 100 * len(v)))], "0-based index"),
    "unsorted": (lambda v, p: v[max(1, math.ceil(p / 100 * len(v))) - 1], "not sorted"),
    "the mean": (lambda v, p: sum(v) / len(v), "mean"),
    "p = 0 not handled": (lambda v, p: sorted(v)[math.ceil(p * len(v) / 100) - 1],
                          "(?s)p0 is 0.5, expected 0.1.*p = 0 gives rank 0.*LARGEST"),
    # p / 100 rounded first: 7 / 100 * 100 = 7.000000000000001, one rank too high (red team, issue 26)
    # numpy's nearest-rank method computes p / 100 * n in floating point too (issue 26)
    "numpy's inverted_cdf": (lambda v, p: float(np.percentile(v, p, method="inverted_cdf")),
                             r"(?s)p7 is 8, expected 7.*p / 100 is rounded before"),
    "p / 100 before n": (lambda v, p: sorted(v)[max(1, math.ceil(p / 100 * len(v))) - 1],
                         r"(?s)p7 is 8, expected 7.*p / 100 is rounded before it is multiplied by n"),
    "numpy's nearest method (rounds half to even)": (
        lambda v, p: float(np.percentile(v, p, method="nearest")), r"the p\d+ is .*, expected"),
}


@pytest.mark.parametrize("name", list(PERCENTILE_MUTANTS))
def test_percentile_mutant_is_rejected(name):
    fn, message = PERCENTILE_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_percentile(fn)


def test_percentile_stub_says_not_implemented():
    def stub(values, p):
        raise NotImplementedError("Exercise 2")

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_percentile(stub)
