"""The production lab's checks pass the references and reject each planted mistake."""

from __future__ import annotations

import concurrent.futures
import math
import random
import re
import threading
import time

import numpy as np
import pytest

from labsupport import bench_serving
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_open_loop, check_poisson_arrivals, check_slo_report
from labsupport.checks.framework import Checker
from labsupport.load_testing import open_loop, poisson_arrivals, slo_report

# --- check_poisson_arrivals ------------------------------------------------------------------------


def ref_poisson(n, rate, rng):
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def ref_poisson_from_gaps(gaps):
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g)
    return times


def by_inverse_cdf(n, rate, rng):  # another right answer: -log(U) / rate, as numpy arrays
    gaps = -np.log(1.0 - np.array([rng.random() for _ in range(n - 1)])) / rate
    return np.concatenate([[0.0], np.cumsum(gaps)])


def test_poisson_references_pass(capsys):
    check_poisson_arrivals(ref_poisson)
    check_poisson_arrivals(by_inverse_cdf)
    check_poisson_arrivals(unguarded(poisson_arrivals))
    assert "PASSED check_poisson_arrivals" in capsys.readouterr().out


def _cumulative(gap):
    def fn(n, rate, rng):
        times, t = [], 0.0
        for _ in range(n):
            times.append(t)
            t += gap(rate, rng)
        return times
    return fn


POISSON_MUTANTS = {
    "expovariate given the mean gap": (_cumulative(lambda rate, rng: rng.expovariate(1 / rate)), "mean `rate`"),
    "evenly spaced (a fixed rate, not Poisson)": (_cumulative(lambda rate, rng: 1 / rate), "not exponential"),
    "uniform gaps of the right mean": (_cumulative(lambda rate, rng: rng.uniform(0, 2 / rate)), "not exponential"),
    "the random module, not rng": (_cumulative(lambda rate, rng: random.expovariate(rate)), "draw every gap from the rng"),
    "the gaps, not the times": (
        lambda n, rate, rng: [0.0] + [rng.expovariate(rate) for _ in range(n - 1)], "times go backwards"),
    "first request after a gap": (
        lambda n, rate, rng: ref_poisson(n + 1, rate, rng)[1:], "schedule starts at 0"),
    "one time too few": (lambda n, rate, rng: ref_poisson(n, rate, rng)[:-1] if n > 1 else [], "expected"),
    "sorted gaps (the right distribution, a drifting rate)": (
        lambda n, rate, rng: ref_poisson_from_gaps(sorted(rng.expovariate(rate) for _ in range(n - 1))),
        "rate must not drift"),
    "each gap used twice (gaps not independent)": (
        lambda n, rate, rng: ref_poisson_from_gaps([g for _ in range(n // 2) for g in [rng.expovariate(rate)] * 2]
                                                   [:n - 1]),
        "correlated"),
    "bench_serving's generator, reseeded from rng": (
        lambda n, rate, rng: bench_serving.arrival_times(n, rate, 1.0, seed=rng.random()), "course's own answer"),
}


@pytest.mark.parametrize("name", list(POISSON_MUTANTS))
def test_poisson_mutant_is_rejected(name):
    fn, message = POISSON_MUTANTS[name]
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match=message):
            check_poisson_arrivals(fn)


def test_poisson_stub_says_not_implemented():
    def stub(n, rate, rng):
        raise NotImplementedError("Exercise 1")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_poisson_arrivals(stub)
    assert info.value.reason == "not done"


def test_poisson_refuses_the_course_answer():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_poisson_arrivals(lambda n, rate, rng: poisson_arrivals(n, rate, rng))


# --- check_open_loop -------------------------------------------------------------------------------


def ref_open_loop(times_s, send):
    start = time.perf_counter()
    results = [None] * len(times_s)

    def worker(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        results[i] = send(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def with_timers(times_s, send):  # another right answer: a pool as large as the schedule
    start = time.perf_counter()

    def at(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        return send(i)

    with concurrent.futures.ThreadPoolExecutor(len(times_s)) as pool:
        return list(pool.map(at, range(len(times_s))))


def one_thread_held_up(times_s, send):  # a right answer on a loaded machine: one thread runs 0.45 s late
    start = time.perf_counter()
    results = [None] * len(times_s)

    def worker(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        if i == 28 and len(times_s) > 28:
            time.sleep(0.45)  # the scheduler ran this thread late (results_b: 0.41 s on a loaded machine)
        results[i] = send(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_open_loop_references_pass(capsys):
    check_open_loop(ref_open_loop)
    check_open_loop(with_timers)
    check_open_loop(unguarded(open_loop))
    assert "PASSED check_open_loop" in capsys.readouterr().out


def test_open_loop_passes_a_send_delayed_by_load():
    """A correct open loop whose thread the scheduler runs 0.45 s late (no answer back yet) passes: it
    is judged by waiting for completions, not by one late send (results_b's false reject under load)."""
    check_open_loop(one_thread_held_up)


def closed(times_s, send):
    start, results = time.perf_counter(), []
    for i, at in enumerate(times_s):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        results.append(send(i))  # waits for the answer before the next send
    return results


def small_pool(times_s, send):
    start = time.perf_counter()

    def at(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        return send(i)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(at, range(len(times_s))))


def all_at_once(times_s, send):
    with concurrent.futures.ThreadPoolExecutor(len(times_s)) as pool:
        return list(pool.map(send, range(len(times_s))))


def completion_order(times_s, send):
    start, results, lock = time.perf_counter(), [], threading.Lock()

    def worker(i):
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        r = send(i)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def fire_and_forget(times_s, send):
    start, results = time.perf_counter(), [None] * len(times_s)

    def worker(i):
        results[i] = send(i)

    for i, at in enumerate(times_s):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threading.Thread(target=worker, args=(i,), daemon=True).start()
    return results  # before the answers are back


def times_as_gaps(times_s, send):
    threads, results = [], [None] * len(times_s)

    def worker(i):
        results[i] = send(i)

    for i, gap in enumerate(times_s):
        time.sleep(gap)  # the schedule read as gaps: sends drift later and later
        threads.append(threading.Thread(target=worker, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results


def relative_sleeps(times_s, send):
    threads, results, previous = [], [None] * len(times_s), 0.0

    def call(i):
        results[i] = send(i)

    for i, at in enumerate(times_s):
        time.sleep(max(0.0, at - previous))  # the gap since the previous send: oversleeps add up
        previous = at
        threads.append(threading.Thread(target=call, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results


def sleep_from_thread_start(times_s, send):
    results = [None] * len(times_s)

    def worker(i):
        time.sleep(times_s[i])  # from this thread's own start, not open_loop's
        results[i] = send(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pool_of(workers):
    def fn(times_s, send):
        start = time.perf_counter()

        def at(i):
            time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
            return send(i)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(at, range(len(times_s))))
    return fn


OPEN_LOOP_MUTANTS = {
    "ThreadPoolExecutor's default size (at most 32 workers)": (pool_of(None), "too few threads"),
    "a pool of 32 threads": (pool_of(32), "too few threads"),
    "a closed loop (waits for each answer)": (closed, "closed\\s+loop"),
    "a pool of two threads": (small_pool, "late"),
    "all at once, ignoring the schedule": (all_at_once, "before its scheduled time"),
    "results in completion order": (completion_order, "order the answers came back"),
    "returns before the answers": (fire_and_forget, "join the threads before returning"),
    "times read as gaps": (times_as_gaps, "late"),
    "relative sleeps between sends": (relative_sleeps, "drift later and later.*relative sleeps"),
    "each thread sleeps times_s[i] from its own start": (sleep_from_thread_start, "drift.*its own start"),
}


@pytest.mark.parametrize("name", list(OPEN_LOOP_MUTANTS))
def test_open_loop_mutant_is_rejected(name):
    fn, message = OPEN_LOOP_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_open_loop(fn)


def test_open_loop_stub_says_not_implemented():
    def stub(times_s, send):
        raise NotImplementedError("Exercise 2")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_open_loop(stub)
    assert info.value.reason == "not done"


def test_open_loop_refuses_the_course_answer():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_open_loop(lambda times_s, send: open_loop(times_s, send))


# --- check_slo_report ------------------------------------------------------------------------------


def nearest_rank(values, p):
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1]


def ref_slo(requests, slo, duration_s, *, meets=None, pct=nearest_rank, per=None, attain_over=None):
    def ok(r):
        return r["ttft"] <= slo["ttft_s"] and (r["tpot"] is None or r["tpot"] <= slo["tpot_s"])

    meets = meets or (lambda r, slo: ok(r))
    done = [r for r in requests if r is not None]
    met = sum(1 for r in done if meets(r, slo))
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "goodput": met / (per(requests, done) if per else duration_s),
        "attainment": met / (attain_over(requests, done) if attain_over else len(requests)),
        "ttft_p": pct([r["ttft"] for r in done], slo["p"]),
        "tpot_p": pct(tpots, slo["p"]) if tpots else None,
    }


def variant(**kw):
    return lambda requests, slo, duration_s: ref_slo(requests, slo, duration_s, **kw)


def test_slo_references_pass(capsys):
    check_slo_report(ref_slo)
    check_slo_report(unguarded(slo_report))
    assert "PASSED check_slo_report" in capsys.readouterr().out


def _strict(r, slo):
    return r["ttft"] < slo["ttft_s"] and (r["tpot"] is None or r["tpot"] < slo["tpot_s"])


SLO_MUTANTS = {
    "percentile interpolated (numpy's default)": (variant(pct=lambda v, p: float(np.percentile(v, p))), "interpolated"),
    "percentile rank off by one (0-based)": (
        variant(pct=lambda v, p: sorted(v)[min(len(v) - 1, math.ceil(p * len(v) / 100))]), "0-based index"),
    "percentile rank rounded down": (
        variant(pct=lambda v, p: sorted(v)[max(0, math.floor(p * len(v) / 100) - 1)]), "rounded down"),
    # ceil(p / 100 * n): p / 100 first rounds 7 / 100 * 100 up to 7.000000000000001 (rank 8 of 100)
    "percentile rank from p / 100 first": (
        variant(pct=lambda v, p: sorted(v)[max(1, math.ceil(p / 100 * len(v))) - 1]), "p / 100 is rounded in floats"),
    # numpy's nearest rank divides first too: right on every case but n = 100, p = 7
    "numpy's inverted_cdf": (
        variant(pct=lambda v, p: float(np.percentile(v, p, method="inverted_cdf"))), "p / 100 is rounded in floats"),
    "percentile rank rounded to nearest": (
        variant(pct=lambda v, p: sorted(v)[max(1, round(p * len(v) / 100)) - 1]), "rounded to the nearest whole"),
    "percentile of unsorted values": (
        variant(pct=lambda v, p: v[max(1, math.ceil(p * len(v) / 100)) - 1]), "not sorted"),
    "any target met counts": (
        variant(meets=lambda r, slo: r["ttft"] <= slo["ttft_s"] or (r["tpot"] is None or r["tpot"] <= slo["tpot_s"])),
        "any one target"),
    "a latency on its target misses": (variant(meets=_strict), "equal to its target"),
    "a one-token answer misses TPOT": (
        variant(meets=lambda r, slo: r["ttft"] <= slo["ttft_s"] and r["tpot"] is not None and r["tpot"] <= slo["tpot_s"]),
        "one-token answer"),
    "goodput per request, not per second": (variant(per=lambda requests, done: len(requests)), "attainment"),
    "throughput, not goodput": (variant(meets=lambda r, slo: True), "throughput, not goodput"),
    "attainment over completed requests only": (
        variant(attain_over=lambda requests, done: len(done)), "completed requests only"),
    "percentiles over the requests that met the SLO only": (
        lambda requests, slo, d: {**ref_slo(requests, slo, d), "ttft_p": nearest_rank(
            [r["ttft"] for r in requests if r and r["ttft"] <= slo["ttft_s"]
             and (r["tpot"] is None or r["tpot"] <= slo["tpot_s"])], slo["p"])},
        "met the SLO only"),
    "one-token answers counted as TPOT 0": (
        lambda requests, slo, d: {**ref_slo(requests, slo, d), "tpot_p": nearest_rank(
            [r["tpot"] or 0.0 for r in requests if r], slo["p"])},
        "TPOT of 0"),
    "a list, not a dict": (lambda requests, slo, d: list(ref_slo(requests, slo, d).values()), "return a dict"),
}


@pytest.mark.parametrize("name", list(SLO_MUTANTS))
def test_slo_mutant_is_rejected(name):
    fn, message = SLO_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_slo_report(fn)


def test_slo_stub_says_not_implemented():
    def stub(requests, slo, duration_s):
        raise NotImplementedError("Exercise 3")

    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_slo_report(stub)
    assert info.value.reason == "not done"


def test_slo_refuses_the_course_answer_and_its_percentile():
    from labsupport.latency import percentile

    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_slo_report(lambda r, s, d: slo_report(r, s, d))
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_slo_report(variant(pct=percentile))


# --- check_histogram_quantile (issue 22) -------------------------------------------------------------------


def learner_quantile(q, before, after, *, use_after=False, string_sort=False, per_bucket=False, above=False,
                     no_interp=False, middle=False, inf=False, lowest_upper=False, no_reset=False, empty=math.nan,
                     reset="bucket", empty_by_rank=False, below_zero_from_0=False):
    """A learner's histogram_quantile over two scrapes, written from the lab's spec; each switch plants one
    mistake."""
    if use_after:
        inc = dict(after)
    elif reset != "bucket":  # one judgement for the whole histogram: by its +Inf count, or by any bucket
        fell = after["+Inf"] < before["+Inf"] if reset == "total" else any(after[le] < before[le] for le in after)
        inc = {le: after[le] if fell else after[le] - before[le] for le in after}
    else:
        inc = {le: (after[le] - before[le] if no_reset or after[le] >= before[le] else after[le]) for le in after}
    key = (lambda item: item[0]) if string_sort else (lambda item: float(item[0]))
    buckets = [(float(le), count) for le, count in sorted(inc.items(), key=key)]
    if per_bucket:
        total, summed = 0.0, []
        for upper, count in buckets:
            total += count
            summed.append((upper, total))
        buckets = summed
    total = buckets[-1][1]
    if total <= 0:
        return empty
    rank = q * total
    if empty_by_rank and rank == 0:  # "no rank, no observations"
        return empty
    i = next((j for j, (_, count) in enumerate(buckets) if (count > rank if above else count >= rank)),
             len(buckets) - 1)
    upper, count = buckets[i]
    lower, below = (buckets[i - 1][0], buckets[i - 1][1]) if i else (0.0, 0.0)
    if math.isinf(upper):
        return math.inf if inf else lower
    if no_interp or (lowest_upper and i == 0):
        return upper
    if i == 0 and upper <= 0 and not below_zero_from_0:  # no start to interpolate from
        return upper
    if middle:
        return (lower + upper) / 2
    return lower + (upper - lower) * (rank - below) / (count - below)


def test_histogram_quantile_references_pass(capsys):
    from labsupport.checks import check_histogram_quantile
    from labsupport.prometheus import histogram_quantile_between

    check_histogram_quantile(learner_quantile)
    assert capsys.readouterr().out.count("PASSED check_histogram_quantile") == 1
    # the course's answer is built on bucket_quantile, which the check bans: run through the body unbanned
    check_histogram_quantile.__wrapped__(unguarded(histogram_quantile_between), Checker("check_histogram_quantile"))


def numpy_quantile(q, before, after):
    """Another correct reading: numpy arrays, the increases by np.where, the bucket by np.searchsorted."""
    les = sorted(after, key=float)
    was, now = np.array([before[le] for le in les]), np.array([after[le] for le in les])
    inc, bounds = np.where(now < was, now, now - was), np.array([float(le) for le in les])
    if inc[-1] == 0:
        return float("nan")
    rank = q * inc[-1]
    i = int(np.searchsorted(inc, rank, side="left"))  # the first cumulative increase that reaches the rank
    if i >= len(les) - 1:
        return float(bounds[-2])
    if i == 0:
        return float(bounds[0] if bounds[0] <= 0 else bounds[0] * rank / inc[0])
    return float(bounds[i - 1] + (bounds[i] - bounds[i - 1]) * (rank - inc[i - 1]) / (inc[i] - inc[i - 1]))


def test_a_numpy_histogram_quantile_passes(capsys):
    from labsupport.checks import check_histogram_quantile

    check_histogram_quantile(numpy_quantile)
    assert "PASSED check_histogram_quantile" in capsys.readouterr().out


QUANTILE_MUTANTS = {
    "after alone": (dict(use_after=True), "counts since the server started"),
    "bounds sorted as strings": (dict(string_sort=True), "sorted as strings"),
    "cumulative read as per bucket": (dict(per_bucket=True), "read as counts per bucket"),
    "exceeds, not reaches": (dict(above=True), "exceeds the rank (>)"),
    "upper bound, no interpolation": (dict(no_interp=True), "upper bound of its bucket"),
    "middle of the bucket": (dict(middle=True), "middle of its bucket"),
    "+Inf gives infinity": (dict(inf=True), "gives infinity"),
    "lowest bucket gives its bound": (dict(lowest_upper=True), "lowest bucket gives its bound"),
    "reset subtracted": (dict(no_reset=True), "subtracted anyway"),
    "empty window gives 0": (dict(empty=0.0), "0 would read as a perfect latency"),
    "empty window gives None": (dict(empty=None), "Prometheus returns NaN"),
    "reset judged by the +Inf count": (dict(reset="total"), "judged for the whole histogram"),
    "reset judged by any bucket": (dict(reset="any"), "judged for the whole histogram"),
    "q = 0 read as an empty window": (dict(empty_by_rank=True), "a rank of 0 (q = 0) is read as an empty window"),
    "a bound at or below 0 interpolated from 0": (dict(below_zero_from_0=True), "interpolated from 0 although"),
}


@pytest.mark.parametrize("name", list(QUANTILE_MUTANTS))
def test_histogram_quantile_mutants_fail(name):
    from labsupport.checks import check_histogram_quantile

    flags, message = QUANTILE_MUTANTS[name]
    with pytest.raises(CheckFailed, match=re.escape(message)):
        check_histogram_quantile(lambda q, b, a: learner_quantile(q, b, a, **flags))


def test_histogram_quantile_stub_and_course_answers_are_refused():
    from labsupport.checks import check_histogram_quantile
    from labsupport.load_testing import histogram_quantile
    from labsupport.prometheus import bucket_quantile, histogram_quantile_between

    def stub(q, before, after):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_histogram_quantile(stub)
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_histogram_quantile(lambda q, b, a: histogram_quantile_between(q, b, a))
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_histogram_quantile(lambda q, b, a: bucket_quantile(q, [(le, a[le] - b[le]) for le in a]))
        with pytest.raises(CheckFailed, match="course's own answer"):  # the older helper is built on it
            check_histogram_quantile(lambda q, b, a: histogram_quantile(
                {("x_bucket", frozenset({"le": le}.items())): v for le, v in a.items()}, "x", q,
                {("x_bucket", frozenset({"le": le}.items())): v for le, v in b.items()}))


def test_bucket_quantile_gives_prometheus_own_expected_values():
    """`testhistogram` of Prometheus's promql/promqltest/testdata/histograms.test (commit d15adb9)
    at 50m: every bucket grew by its step ten times. Its expected values, and the special cases
    quantile.go documents."""
    from labsupport.prometheus import bucket_quantile

    positive = [("0.1", 50), (".2", 70), ("1e0", 110), ("+Inf", 120)]
    negative = [("-.2", 10), ("-0.1", 20), ("0.3", 20), ("+Inf", 30)]
    expected = {0: (0, -0.2), 0.2: (0.048, -0.2), 0.5: (0.15, -0.15), 0.8: (0.72, 0.3), 1: (1, 0.3)}
    for q, (pos, neg) in expected.items():
        assert bucket_quantile(q, positive) == pytest.approx(pos, abs=1e-12)
        assert bucket_quantile(q, negative) == pytest.approx(neg, abs=1e-12)
    assert bucket_quantile(-0.1, positive) == -math.inf and bucket_quantile(1.01, positive) == math.inf
    assert math.isnan(bucket_quantile(math.nan, positive))
    assert math.isnan(bucket_quantile(0.5, [("0.1", 0), ("+Inf", 0)]))  # no observations
    assert math.isnan(bucket_quantile(0.5, [("0.1", 3), ("1", 4)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.0, [("0.1", 0), ("+Inf", 5)]))  # 0/0 in an empty lowest bucket
    assert bucket_quantile(0.5, [("0.1", 5), ("0.2", 4), ("+Inf", 10)]) == pytest.approx(0.1)  # made monotonic
    assert bucket_quantile(0.5, [("0.1", 2), ("1e-1", 2), ("+Inf", 8)]) == pytest.approx(0.1)  # one bound, two spellings


# --- check_retry_after (issue 22) -------------------------------------------------------------------------


def learner_backoff(send, rng, *, max_attempts=6, base_s=0.25, cap_s=4.0, sleep=time.sleep, ignore_after=False,
                    no_jitter=False, no_cap=False, linear=False, larger_of=False, retry_all=False, forever=False,
                    wait_after_last=False, no_503=False, real_sleep=False, jitter="full"):
    """A learner's client written from the lab's spec; each switch plants one mistake."""
    attempt, fraction = 0, None
    while True:
        response = send()
        retryable = (429,) if no_503 else (429, 503)
        done = response.status_code == 200 if retry_all else response.status_code not in retryable
        last = attempt == max_attempts - 1 and not forever
        if done or (last and not wait_after_last):
            return response
        header = response.headers.get("retry-after")
        after = 0.0 if ignore_after or header is None else float(header)
        envelope = base_s * (attempt + 1) if linear else base_s * 2 ** attempt
        envelope = envelope if no_cap else min(cap_s, envelope)
        if no_jitter:
            extra = envelope
        elif jitter == "global":  # the random module's own generator, not the rng handed in
            extra = random.uniform(0, envelope)
        elif jitter == "equal":  # "equal jitter": half the envelope, plus a random half
            extra = envelope / 2 + rng.uniform(0, envelope / 2)
        elif jitter == "once":  # one fraction of the envelope drawn for the whole call
            fraction = rng.random() if fraction is None else fraction
            extra = fraction * envelope
        elif jitter == "triangle":  # inside the envelope, but more often near its middle
            extra = rng.triangular(0, envelope)
        elif jitter == "beta":  # inside the envelope, a gentler hump
            extra = envelope * rng.betavariate(2, 2)
        elif jitter == "bell":  # a bell around 0, folded and clipped to the envelope
            extra = min(envelope, abs(rng.gauss(0, envelope / 2)))
        else:
            extra = rng.uniform(0, envelope)
        wait = max(after, extra) if larger_of else after + extra
        (time.sleep if real_sleep else sleep)(wait)
        if last:
            return response
        attempt += 1


def test_retry_after_reference_passes(capsys, monkeypatch):
    from labsupport.checks import check_retry_after
    from labsupport.checks import lab15_production as checks
    from labsupport.retries import send_with_backoff

    check_retry_after(learner_backoff)
    assert capsys.readouterr().out.count("PASSED check_retry_after") == 1
    # the course's answer on the fake clock only: the real service's part (3 s of rounds) has just passed
    # the spec version, and the solution notebook runs it on the solution's client
    real = []
    monkeypatch.setattr(checks, "_check_against_a_real_service", lambda checker, fn: real.append(fn))
    check_retry_after.__wrapped__(unguarded(send_with_backoff), Checker("check_retry_after"))
    assert len(real) == 1  # the part is still reached: every fake-clock case passed


RETRY_MUTANTS = {
    "Retry-After ignored": (dict(ignore_after=True), "must not come back sooner"),
    "no jitter": (dict(no_jitter=True), "no jitter"),
    "the larger of Retry-After and the backoff": (dict(larger_of=True), "no jitter"),
    "backoff not capped": (dict(no_cap=True), "Is the backoff capped"),
    "linear backoff": (dict(linear=True), "grows too slowly"),
    "every error retried": (dict(retry_all=True), "A 400 is final"),
    "503 not retried": (dict(no_503=True), "stopped at the answer <503 Retry-After: 3>, which is retryable"),
    "retries forever": (dict(forever=True), "more than 64 times"),
    "a wait after the last attempt": (dict(wait_after_last=True), "no wait after the last attempt"),
    "the random module, not the rng handed in": (dict(jitter="global"), "the same seed gave other waits"),
    "equal jitter": (dict(jitter="equal"), "fall in the lower half of their envelope"),
    "one draw reused at every retry": (dict(jitter="once"), "the same fraction of the envelope at every retry"),
    "a triangle inside the envelope": (dict(jitter="triangle"), "another shape inside the envelope"),
    "Beta(2, 2) inside the envelope": (dict(jitter="beta"), "another shape inside the envelope"),
    "a clipped bell inside the envelope": (dict(jitter="bell"), "another shape inside the envelope"),
}


def for_loop_backoff(send, rng, *, max_attempts=6, base_s=0.25, cap_s=4.0, sleep=time.sleep):
    """Another correct client: a for loop over the attempts, the jitter as rng.random() times the envelope, the
    header read with a default."""
    for k in range(max_attempts):
        answer = send()
        if answer.status_code not in (429, 503) or k == max_attempts - 1:
            return answer
        sleep(float(answer.headers.get("Retry-After", 0)) + rng.random() * min(cap_s, base_s * 2 ** k))
    raise AssertionError("unreachable")


def test_a_for_loop_backoff_passes(capsys):
    from labsupport.checks import check_retry_after

    check_retry_after(for_loop_backoff)
    assert "PASSED check_retry_after" in capsys.readouterr().out


def randrange_backoff(send, rng, *, max_attempts=6, base_s=0.25, cap_s=4.0, sleep=time.sleep):
    """A correct client that draws its uniform jitter from rng another way (rng.randrange, another stream of
    numbers than rng.uniform's): the shape test must accept any uniform draw, not only the course's."""
    for k in range(max_attempts):
        answer = send()
        if answer.status_code not in (429, 503) or k == max_attempts - 1:
            return answer
        sleep(float(answer.headers.get("Retry-After", 0)) + rng.randrange(1 << 30) / (1 << 30) * min(cap_s, base_s * 2 ** k))
    raise AssertionError("unreachable")


def test_a_backoff_drawing_with_randrange_passes(capsys):
    from labsupport.checks import check_retry_after

    check_retry_after(randrange_backoff)
    assert "PASSED check_retry_after" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(RETRY_MUTANTS))
def test_retry_after_mutants_fail(name):
    from labsupport.checks import check_retry_after

    flags, message = RETRY_MUTANTS[name]
    with pytest.raises(CheckFailed, match=re.escape(message)):
        check_retry_after(lambda send, rng, **kw: learner_backoff(send, rng, **kw, **flags))


def test_retry_after_refuses_time_sleep_the_stub_and_the_course_answer():
    from labsupport.checks import check_retry_after
    from labsupport.retries import backoff_wait, send_with_backoff

    with pytest.raises(CheckFailed, match="called time.sleep itself"):
        check_retry_after(lambda send, rng, **kw: learner_backoff(send, rng, **kw, real_sleep=True))

    def stub(send, rng, **kw):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_retry_after(stub)
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_retry_after(lambda send, rng, **kw: send_with_backoff(send, rng, **kw))

        def with_the_course_wait(send, rng, *, max_attempts, base_s, cap_s, sleep):
            for k in range(max_attempts):
                r = send()
                if r.status_code not in (429, 503) or k == max_attempts - 1:
                    return r
                sleep(backoff_wait(k, rng, base_s=base_s, cap_s=cap_s, retry_after_s=1.0))

        with pytest.raises(CheckFailed, match="course's own answer"):
            check_retry_after(with_the_course_wait)


def test_the_real_service_part_judges_only_what_load_cannot_cause():
    """A client that comes back early is caught from the service's log, however loaded the machine."""
    from labsupport.checks import check_retry_after
    from labsupport.checks.framework import Checker
    from labsupport.checks.lab15_production import _check_against_a_real_service

    def early_on_the_real_service(send, rng, *, max_attempts, base_s, cap_s, sleep=None):
        """Right on a fake clock; on the real service (no sleep handed in) it waits a tenth of the time."""
        return learner_backoff(send, rng, max_attempts=max_attempts, base_s=base_s, cap_s=cap_s,
                               sleep=sleep or (lambda s: time.sleep(s / 10)))

    with pytest.raises(CheckFailed, match="sooner than the server asked"):
        _check_against_a_real_service(Checker("check_retry_after"), early_on_the_real_service)
    assert check_retry_after.points == 4
