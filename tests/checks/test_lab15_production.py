"""The production lab's checks pass the references and reject each planted mistake."""

from __future__ import annotations

import concurrent.futures
import math
import random
import threading
import time

import numpy as np
import pytest

from labsupport import bench_serving
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_open_loop, check_poisson_arrivals, check_slo_report
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
