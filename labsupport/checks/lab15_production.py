"""Checks for the production lab: an open-loop Poisson schedule, a sender that keeps to it against a
slow real service, and the goodput and percentiles of a run against an SLO."""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time

from ..bench_serving import arrival_times
from ..latency import percentile
from ..load_testing import SlowService, _nearest_rank, open_loop, poisson_arrivals, slo_report
from ..prometheus import bucket_quantile, counter_increase, histogram_quantile_between, parse_le
from ..retries import RetryAfterService, backoff_wait, send_with_backoff
from ._mistakes import merge_alike as _merge_alike
from .framework import Case, ForbiddenCall, graded

POISSON_RULE = (
    "the first send time is 0 and each next one is the previous plus one gap drawn from rng (the rng you "
    "are given, for every gap); Python's expovariate takes the rate, lambda, not the mean gap 1 / rate."
)
OPEN_LOOP_RULE = (
    "start every call at its scheduled time, each in its own thread (threading.Thread), sleeping until "
    "start + times_s[i]; never wait for an earlier call to return before starting the next; join all "
    "threads, then return the results indexed by i."
)
SLO_RULE = (
    "a request meets the SLO when it completed (not None), ttft <= ttft_s and (tpot is None or tpot <= "
    "tpot_s). goodput = met / duration_s; attainment = met / len(requests) (every request sent); ttft_p "
    "and tpot_p are nearest-rank percentiles over the completed requests: sort, take the "
    "ceil(p * n / 100)-th smallest (1-based)."
)


def _ks_exponential(gaps_times_rate: list[float]) -> float:
    """Kolmogorov-Smirnov distance between the sample and the exponential distribution of mean 1."""
    data, n = sorted(gaps_times_rate), len(gaps_times_rate)
    worst = 0.0
    for i, x in enumerate(data):
        cdf = 1 - math.exp(-x) if x > 0 else 0.0
        worst = max(worst, abs(cdf - i / n), abs(cdf - (i + 1) / n))
    return worst


def _as_float_list(checker, case, got, n, what="times") -> list[float]:
    if isinstance(got, (str, bytes)) or not hasattr(got, "__len__"):
        checker.fail(case, f"the function returned a {type(got).__name__}; return a list of {n} {what}.",
                     POISSON_RULE)
    values = []
    for x in list(got):
        x = x.item() if hasattr(x, "item") else x
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            checker.fail(case, f"the {what} must be finite numbers; one is {x!r}.", POISSON_RULE)
        values.append(float(x))
    if len(values) != n:
        checker.fail(case, f"{len(values)} {what} returned, expected {n}.", POISSON_RULE)
    return values


@graded(points=3, bans=(poisson_arrivals, arrival_times))
def check_poisson_arrivals(fn, checker):
    """``fn(n, rate, rng)`` must return ``n`` Poisson send times from 0, drawn from ``rng``."""
    for n, rate, seed in ((1, 3.0, 0), (2, 3.0, 1)):
        case = Case(n=n, rate=rate, rng=f"random.Random({seed})")
        got = _as_float_list(checker, case, checker.call(fn, n, rate, random.Random(seed), case=case), n)
        if got[0] != 0:
            checker.fail(case, f"the first send time is {got[0]:.4g}; the schedule starts at 0.", POISSON_RULE)
    for rate, seed in ((4.0, 11), (0.5, 12), (25.0, 13)):
        n = 3000
        case = Case(n=n, rate=rate, rng=f"random.Random({seed})")
        times = _as_float_list(checker, case, checker.call(fn, n, rate, random.Random(seed), case=case), n)
        if times[0] != 0:
            checker.fail(case, f"the first send time is {times[0]:.4g}; the schedule starts at 0.", POISSON_RULE)
        gaps = [b - a for a, b in zip(times, times[1:])]
        if any(g < 0 for g in gaps):
            checker.fail(case, "the times go backwards: return the running sum of the gaps (the send times), "
                               "not the gaps themselves.", POISSON_RULE)
        mean = sum(gaps) / len(gaps)
        # the mean of n - 1 exponential gaps has relative standard deviation 1 / sqrt(n - 1): 6 of them
        if abs(mean * rate - 1) > 6 / math.sqrt(len(gaps)):
            problem = f"the mean gap is {mean:.4g} s; at {rate:g} requests per second it should be {1 / rate:.4g} s."
            if abs(mean / rate - 1) < 0.2:
                problem += " Your gaps have mean `rate`: rng.expovariate takes the rate, not the mean gap."
            checker.fail(case, problem, POISSON_RULE)
        # a false rejection of a right answer: below 2 exp(-2 n D^2), about 1e-9 at this threshold
        threshold = math.sqrt(math.log(2 / 1e-9) / (2 * len(gaps)))
        distance = _ks_exponential([g * rate for g in gaps])
        if distance > threshold:
            spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
            checker.fail(case, f"the gaps are not exponential (Kolmogorov-Smirnov distance {distance:.3f}, more "
                               f"than {threshold:.3f}; their standard deviation is {spread:.2f} of their mean, "
                               f"where exponential gaps have 1.00). Evenly spaced or uniform gaps are not a "
                               f"Poisson process.", POISSON_RULE)
        # the gaps must also be independent and keep one rate from start to end (sorted gaps have the
        # right distribution but are not a Poisson process). For independent gaps the halves' means
        # differ by a normal with standard deviation sqrt(2 / m) (in units of the mean, m gaps a half),
        # and the lag-1 correlation is normal with standard deviation 1 / sqrt(n - 1): 6 of each
        # (probability 2e-9 each) and 8 for the correlation, whose tails are heavier than normal.
        half = len(gaps) // 2
        first, second = sum(gaps[:half]) / half / mean, sum(gaps[half:2 * half]) / half / mean
        if abs(first - second) > 6 * math.sqrt(2 / half):
            checker.fail(case, f"the gaps in the first half of the schedule average {first * mean:.4g} s and in the "
                               f"second half {second * mean:.4g} s: the rate must not drift. Draw every gap "
                               f"afresh, independent of the others (do not sort or reorder them).", POISSON_RULE)
        centred = [g / mean - 1 for g in gaps]
        lag1 = sum(a * b for a, b in zip(centred, centred[1:])) / sum(c * c for c in centred)
        if abs(lag1) > 8 / math.sqrt(len(gaps)):
            checker.fail(case, f"consecutive gaps are correlated (lag-1 correlation {lag1:.3f}, where independent "
                               f"gaps give 0 within {8 / math.sqrt(len(gaps)):.3f}): draw each gap independently "
                               f"of the previous one.", POISSON_RULE)
    case = Case(n=50, rate=2.0, rng="random.Random(5), twice, then random.Random(6)")
    first = _as_float_list(checker, case, checker.call(fn, 50, 2.0, random.Random(5), case=case), 50)
    again = _as_float_list(checker, case, checker.call(fn, 50, 2.0, random.Random(5), case=case), 50)
    other = _as_float_list(checker, case, checker.call(fn, 50, 2.0, random.Random(6), case=case), 50)
    if first != again or first == other:
        checker.fail(case, "the same generator seed must give the same schedule, and another seed another "
                           "one: draw every gap from the rng you are given (not the random module, nor numpy's "
                           "global generator).", POISSON_RULE)


# The schedule the open-loop check sends: 34 requests 5 ms apart, more than any default thread pool
# holds (``concurrent.futures.ThreadPoolExecutor`` makes at most 32 workers, 6 on a 2-core machine), then
# a straggler. The service holds every one of the 34 until 0.8 s (odd i) or 0.9 s (even i) after the
# check starts, so the answers come back out of order and all 34 must be in flight at once: a closed
# loop, or a pool of fewer than 34 threads, calls send(k) only after an answer is back, at 0.8 s or
# later, at least 0.8 - 0.165 = 0.635 s late. Once released, requests take 0.05 s, so those run fast.
# A send is judged by when the learner's thread called ``send`` (not when the service saw it: on a
# loaded machine the connection itself can take 0.4 s), and a late one fails only when it came after
# an earlier answer (waiting for completions), or when it is later than any machine's load explains.
OPEN_SCHEDULE = [round(0.005 * i, 3) for i in range(34)] + [1.0]
HELD = len(OPEN_SCHEDULE) - 1
LATE_S = 0.4  # how late a send after an earlier answer may be; too few threads: at least 0.635 s
LOST_S = 1.0  # how late any send may be (a busy 2-core machine delays a thread by tenths of a second)

# The pacing case: 6 sends 0.2 s apart to a plain function, while ``time.sleep`` oversleeps by
# OVERSLEEP_S and every ``threading.Thread.start`` takes START_S (what a loaded machine does, made
# certain). Aiming every send at start + times_s[i] keeps each one within about one oversleep
# (0.05 s; the first 0.15 s); relative sleeps between sends add both delays at every send (request 5:
# 0.9 s late), and sleeping times_s[i] from each thread's own start adds the start-up (0.65 s).
# Judged by the drift, the median lateness of the last three sends minus that of the first three:
# 0 for an absolute aim, 0.3 s or more for the two mistakes.
PACED_SCHEDULE = [round(0.2 * i, 3) for i in range(6)]
OVERSLEEP_S, START_S = 0.05, 0.1
DRIFT_S = 0.15


def _held_until(start: list[float]):
    """The service time of request ``i``: held until its release (0.8 s or 0.9 s after ``start[0]``),
    and at least 0.05 s."""
    def delay(i: int) -> float:
        release = start[0] + (0.8 if i % 2 else 0.9) if i < HELD else 0.0
        return max(0.05, release - time.perf_counter())
    return delay


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    parts, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(f"{indices[i]}" if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ", ".join(parts)


@contextlib.contextmanager
def _slowed_machine():
    """While active, ``time.sleep`` oversleeps by OVERSLEEP_S and ``threading.Thread.start`` takes
    START_S longer (both patched on their modules, restored after)."""
    sleep, start = time.sleep, threading.Thread.start

    def oversleep(seconds):
        sleep(seconds)
        sleep(OVERSLEEP_S)

    def slow_start(self, *args, **kwargs):
        sleep(START_S)
        return start(self, *args, **kwargs)

    time.sleep, threading.Thread.start = oversleep, slow_start
    try:
        yield
    finally:
        time.sleep, threading.Thread.start = sleep, start


def _check_pacing(fn, checker):
    """The pacing case (PACED_SCHEDULE): sends must not drift later and later."""
    n = len(PACED_SCHEDULE)
    case = Case(times_s=f"{n} sends 0.2 s apart", send="a plain function",
                machine=f"time.sleep oversleeps by {OVERSLEEP_S} s, Thread.start takes {START_S} s")
    called: dict[int, float] = {}

    def send(i):
        called[int(i)] = time.perf_counter()
        return {"i": i}

    with _slowed_machine():
        start = time.perf_counter()
        checker.call(fn, list(PACED_SCHEDULE), send, case=case)
    if sorted(called) != list(range(n)):
        checker.fail(case, f"send was called for i = {sorted(called)}, expected each of 0..{n - 1} once.",
                     OPEN_LOOP_RULE)
    late = [called[i] - start - at for i, at in enumerate(PACED_SCHEDULE)]
    half = n // 2
    drift = sorted(late[half:])[len(late[half:]) // 2] - sorted(late[:half])[half // 2]
    if drift > DRIFT_S:
        step = (late[-1] - late[1]) / (n - 2)
        likely = ("relative sleeps between sends (time.sleep(gap)), which add every oversleep and every thread's "
                  "start-up to all the sends after it" if step > 0.8 * (OVERSLEEP_S + START_S) else
                  "each thread waiting times_s[i] (or a delay computed before it started) from its own start, which "
                  "adds the time it took to start the threads before it started")
        checker.fail(case, f"the sends drift later and later: {', '.join(f'{x:.2f}' for x in late)} s late for "
                           f"requests 0-{n - 1}, on a machine where every sleep oversleeps by {OVERSLEEP_S} s and "
                           f"every thread takes {START_S} s to start (a loaded machine does both). An open loop "
                           f"aims each send at one start time plus times_s[i], so a delay never carries over. "
                           f"This drift is what we get from {likely}.", OPEN_LOOP_RULE)


@graded(points=3, bans=(open_loop,))
def check_open_loop(fn, checker):
    """``fn(times_s, send)`` must call ``send(i)`` at each scheduled time against a slow real service,
    without waiting for earlier calls, and return the results in order; and keep to a schedule on a
    machine where sleeps oversleep and threads start slowly (no drift)."""
    case = Case(times_s=f"{HELD} sends 5 ms apart, then one at 1.0 s",
                send=f"a GET to a real HTTP service that holds the first {HELD} until 0.8 or 0.9 s")
    started = [math.inf]
    called: dict[int, float] = {}
    with SlowService(_held_until(started)) as service:
        def send(i):
            called.setdefault(i, time.perf_counter())
            return service.send(i)

        start = started[0] = time.perf_counter()
        got = checker.call(fn, list(OPEN_SCHEDULE), send, case=case)
        returned = time.perf_counter()
        finished_then = dict(service.finished)
        deadline = returned + 3.0  # let stray calls end before the service closes
        while len(service.finished) < len(OPEN_SCHEDULE) and time.perf_counter() < deadline:
            time.sleep(0.02)
        arrived, finished = dict(service.arrived), dict(service.finished)
    n = len(OPEN_SCHEDULE)
    if len(finished_then) < n:
        checker.fail(case, f"your function returned when {len(finished_then)} of the {n} calls to send had "
                           f"returned: join the threads before returning the results.", OPEN_LOOP_RULE)
    missing = [i for i in range(n) if i not in arrived or i not in called]
    if missing:
        checker.fail(case, f"send was never called for i = {missing}.", OPEN_LOOP_RULE)
    for i, at in enumerate(OPEN_SCHEDULE):
        offset = called[i] - start
        if offset < at - 1e-3:
            checker.fail(case, f"send({i}) was called {offset:.3f} s after the start, before its scheduled time "
                               f"{at:.3f} s: sleep until start + times_s[i] before sending.", OPEN_LOOP_RULE)
    for i, at in enumerate(OPEN_SCHEDULE):
        offset = called[i] - start
        waited = [j for j in range(i) if finished.get(j, math.inf) <= called[i]]
        if offset > at + LOST_S or (offset > at + LATE_S and waited):
            problem = (f"send({i}), scheduled at {at:.3f} s, was called at {offset:.3f} s: "
                       f"{offset - at:.3f} s late.")
            if waited:
                problem += (f" It was sent only after the answers to requests {_ranges(waited)} had come back: "
                            f"a closed loop, or a pool of too few threads (ThreadPoolExecutor's default is at "
                            f"most 32), waits for completions, so a slow server slows the arrivals down and "
                            f"its queue never shows (coordinated omission). Start one thread per request.")
            checker.fail(case, problem, OPEN_LOOP_RULE)
    if isinstance(got, (str, bytes)) or not hasattr(got, "__len__") or len(got) != n:
        checker.fail(case, f"return a list of the {n} results of send, got {got!r:.200}.", OPEN_LOOP_RULE)
    want = [{"i": i} for i in range(n)]
    if list(got) != want:
        problem = f"the results are {list(got)!r:.300}; expected send(i)'s result at position i, {want!r:.120}..."
        if sorted(map(repr, got)) == sorted(map(repr, want)):
            problem += " They are in the order the answers came back, not the order of i."
        checker.fail(case, problem, OPEN_LOOP_RULE)
    _check_pacing(fn, checker)


def _slo_cases():
    rng = random.Random(15)
    run = []
    for _ in range(57):
        if rng.random() < 0.08:
            run.append(None)  # refused with a 429, or failed
        elif rng.random() < 0.05:
            run.append({"ttft": round(rng.lognormvariate(-1.2, 0.7), 4), "tpot": None})
        else:
            run.append({"ttft": round(rng.lognormvariate(-1.2, 0.7), 4), "tpot": round(rng.lognormvariate(-3.4, 0.4), 4)})
    small = [
        {"ttft": 0.5, "tpot": 0.05},     # exactly on both targets: meets them
        {"ttft": 0.5, "tpot": 0.01},     # exactly on the TTFT target
        {"ttft": 0.2, "tpot": 0.08},     # TPOT misses
        {"ttft": 0.9, "tpot": 0.01},     # TTFT misses
        {"ttft": 0.9, "tpot": 0.09},     # both miss
        {"ttft": 0.3, "tpot": None},     # a one-token answer: no TPOT to miss
        None,                            # refused
        {"ttft": 0.1, "tpot": 0.02},
        {"ttft": 0.25, "tpot": 0.04},
    ]
    # 100 completed requests at p = 7: the rank is ceil(7 * 100 / 100) = 7, but p / 100 * n is
    # 7.000000000000001 in floats, so dividing first (or numpy's inverted_cdf) takes the 8th
    hundred = [{"ttft": round(0.05 + 0.004 * i + 0.001 * rng.random(), 5), "tpot": round(0.01 + 0.0002 * (i * 37 % 100), 5)}
               for i in range(100)]
    rng.shuffle(hundred)
    return [
        ("nine requests, two on a target, one refused", small, {"ttft_s": 0.5, "tpot_s": 0.05, "p": 90}, 2.0),
        ("same, median", small, {"ttft_s": 0.5, "tpot_s": 0.05, "p": 50}, 4.0),
        ("57 requests of a run, some refused", run, {"ttft_s": 0.5, "tpot_s": 0.04, "p": 99}, 9.5),
        ("57 requests, p90", run, {"ttft_s": 0.25, "tpot_s": 0.03, "p": 90}, 9.5),
        ("four requests, p75 lands on a whole rank", [{"ttft": t, "tpot": 0.01} for t in (0.4, 0.1, 0.3, 0.2)],
         {"ttft_s": 0.35, "tpot_s": 0.05, "p": 75}, 1.0),
        ("100 requests, p7: the rank is exactly 7", hundred, {"ttft_s": 0.3, "tpot_s": 0.02, "p": 7}, 20.0),
    ]


def _percentile_mistakes(values: list[float], p: float) -> dict[str, float]:
    data, n = sorted(values), len(values)
    rank = max(1, math.ceil(p * n / 100))
    pos = p / 100 * (n - 1)
    lo = math.floor(pos)
    return {
        f"the rank is computed as ceil(p / 100 * n): p / 100 is rounded in floats first ({p:g} / 100 * {n} = "
        f"{p / 100 * n!r}, rank {math.ceil(p / 100 * n)}; numpy's percentile with method='inverted_cdf' does the "
        f"same). Multiply first: ceil(p * n / 100)": data[min(n, max(1, math.ceil(p / 100 * n))) - 1],
        "the percentile is interpolated between two ranks (numpy's default, np.percentile), not taken at the nearest rank":
            data[lo] + (data[min(lo + 1, n - 1)] - data[lo]) * (pos - lo),
        "the rank ceil(p * n / 100) is used as a 0-based index (one rank too high)": data[min(n - 1, rank)],
        "the rank is rounded down (floor(p * n / 100)) instead of up": data[max(0, math.floor(p * n / 100) - 1)],
        "the rank is rounded to the nearest whole number (round(p * n / 100)) instead of up":
            data[min(n, max(1, round(p * n / 100))) - 1],
        "the values are not sorted before the rank is taken": values[rank - 1],
    }


def _met(r, slo, strict=False, any_target=False, none_fails=False):
    if r is None:
        return False
    ttft_ok = r["ttft"] < slo["ttft_s"] if strict else r["ttft"] <= slo["ttft_s"]
    if r["tpot"] is None:
        tpot_ok = not none_fails
    else:
        tpot_ok = r["tpot"] < slo["tpot_s"] if strict else r["tpot"] <= slo["tpot_s"]
    return (ttft_ok or tpot_ok) if any_target else (ttft_ok and tpot_ok)


def _goodput_mistakes(requests, slo, duration_s) -> dict[str, float]:
    done = [r for r in requests if r is not None]
    met = sum(_met(r, slo) for r in requests)
    return {
        "a request counts when it meets any one target; goodput counts requests that meet every target":
            sum(_met(r, slo, any_target=True) for r in requests) / duration_s,
        "a latency equal to its target is counted as a miss (use <=: a target is met when not exceeded)":
            sum(_met(r, slo, strict=True) for r in requests) / duration_s,
        "a one-token answer (TPOT None) is counted as missing its TPOT target; it has none to miss":
            sum(_met(r, slo, none_fails=True) for r in requests) / duration_s,
        "it is divided by the number of requests (that is the attainment), not by the duration":
            met / len(requests),
        "completed requests are counted whatever their latency (that is throughput, not goodput)":
            len(done) / duration_s,
    }


def _attainment_mistakes(requests, slo) -> dict[str, float]:
    done = [r for r in requests if r is not None]
    met = sum(_met(r, slo) for r in requests)
    return {
        "it is over the completed requests only; refused and failed requests were sent too, and missed":
            met / len(done),
        "a request counts when it meets any one target; attainment counts requests that meet every target":
            sum(_met(r, slo, any_target=True) for r in requests) / len(requests),
    }


@graded(points=4, bans=(slo_report, percentile))
def check_slo_report(fn, checker):
    """``fn(requests, slo, duration_s)`` must return goodput, attainment and nearest-rank percentiles."""
    for name, requests, slo, duration in _slo_cases():
        case = Case(case=name, slo=slo, duration_s=duration)
        got = checker.call(fn, [dict(r) if r else None for r in requests], dict(slo), duration, case=case)
        want = slo_report(requests, slo, duration)
        if not isinstance(got, dict) or set(want) - set(got):
            checker.fail(case, f"return a dict with keys {sorted(want)}, got {got!r:.200}.", SLO_RULE)
        checker.expect_number(got["goodput"], want["goodput"], case=case, rel=1e-9, what="goodput (requests/s)",
                              hint=SLO_RULE, mistakes=_goodput_mistakes(requests, slo, duration))
        checker.expect_number(got["attainment"], want["attainment"], case=case, rel=1e-9, what="attainment",
                              hint=SLO_RULE, mistakes=_attainment_mistakes(requests, slo))
        done = [r for r in requests if r is not None]
        met = [r for r in done if _met(r, slo)]
        for key, values in (("ttft_p", [r["ttft"] for r in done]),
                            ("tpot_p", [r["tpot"] for r in done if r["tpot"] is not None])):
            mistakes = {}  # these first: on a small case one can give the same value as a rank mistake
            of_met = [r[key[:4]] for r in met if r[key[:4]] is not None]
            if of_met:
                mistakes["the percentile is over the requests that met the SLO only (it is over every completed "
                         "request, so that it shows the misses)"] = _nearest_rank(of_met, slo["p"])
            if key == "tpot_p":
                mistakes["one-token answers (TPOT None) are counted as a TPOT of 0 (leave them out of the TPOT "
                         "percentile)"] = _nearest_rank([r["tpot"] or 0.0 for r in done], slo["p"])
            mistakes.update(_percentile_mistakes(values, slo["p"]))
            mistakes = _merge_alike({d: v for d, v in mistakes.items()
                                     if want[key] is None or not math.isclose(v, want[key])})
            checker.expect_number(got[key], want[key], case=case, rel=1e-12, what=f"{key} (p{slo['p']})",
                                  hint=SLO_RULE, mistakes=mistakes)


# --- the server's percentile, as Prometheus computes it ----------------------------------------------

QUANTILE_RULE = (
    "each bucket's count is cumulative (observations at most its bound, so +Inf holds them all); take each "
    "bucket's increase between the scrapes, each bucket judged on its own (a count that went down was reset: "
    "its increase is its new value); order the buckets by their bound as numbers; the rank is q times the +Inf "
    "bucket's increase (q = 0 gives rank 0, which the lowest bucket reaches); the quantile lies in the first "
    "bucket whose increase reaches the rank, interpolated linearly from the bound below it (0 below the lowest "
    "bucket, when its bound is above 0; a lowest bound at or below 0 is itself the answer) to its own; in the "
    "+Inf bucket it is the largest finite bound; with nothing observed in between it is NaN (math.nan)."
)


def _wrong_quantiles(q: float, before: dict, after: dict) -> dict[str, float]:
    """What each planted mistake returns on a case (the course's arithmetic with one step done wrong)."""
    inc = {le: counter_increase(before[le], after[le]) for le in after}
    pairs = sorted(((parse_le(le), c) for le, c in inc.items()), key=lambda p: p[0])

    def per_bucket_as_cumulative(counts):  # the cumulative counts read as counts per bucket, then summed
        total, out = 0.0, []
        for upper, c in counts:
            total += c
            out.append((upper, total))
        return out

    def first_above(counts):  # the bucket whose count exceeds the rank (>), not reaches it (>=)
        total = counts[-1][1]
        if total <= 0:
            return math.nan
        rank = q * total
        b = next((i for i in range(len(counts) - 1) if counts[i][1] > rank), len(counts) - 1)
        if b == len(counts) - 1:
            return counts[-2][0]
        start, below = (counts[b - 1][0], counts[b - 1][1]) if b else (0.0, 0.0)
        return start + (counts[b][0] - start) * (rank - below) / (counts[b][1] - below)

    def located(counts):  # (bucket index, lower bound, count below, count in it) where the rank falls
        total = counts[-1][1]
        rank = q * total
        b = next((i for i in range(len(counts) - 1) if counts[i][1] >= rank), len(counts) - 1)
        lower, below = (counts[b - 1][0], counts[b - 1][1]) if b else (0.0, 0.0)
        return b, lower, below, counts[b][1] - below, rank

    def variant(kind):
        if not pairs or pairs[-1][1] <= 0:
            return math.nan
        b, lower, below, inside, rank = located(pairs)
        upper = pairs[b][0]
        if kind == "upper":
            return upper if not math.isinf(upper) else pairs[-2][0]
        if kind == "middle":
            return (lower + upper) / 2 if not math.isinf(upper) else pairs[-2][0]
        if kind == "inf":
            return math.inf if math.isinf(upper) else bucket_quantile(q, pairs)
        if kind == "lowest from its bound":
            return upper if b == 0 else bucket_quantile(q, pairs)
        if kind == "below zero from 0":
            return rank / inside * upper if b == 0 and upper <= 0 and inside else bucket_quantile(q, pairs)
        raise ValueError(kind)

    def reset_whole(by_total: bool) -> float:  # a reset judged once for the histogram, every bucket alike
        fell = after["+Inf"] < before["+Inf"] if by_total else any(after[le] < before[le] for le in after)
        return _naive(q, sorted(((parse_le(le), after[le] if fell else after[le] - before[le]) for le in after),
                                key=lambda p: p[0]))

    out = {
        "a rank in the lowest bucket is interpolated from 0 although its bound is at or below 0 (Prometheus then "
        "returns the bound itself)": variant("below zero from 0"),
        "a reset is judged for the whole histogram (by its +Inf count), not for each bucket on its own: a bucket "
        "whose count fell was reset even when the total grew": reset_whole(True),
        "a reset is judged for the whole histogram (every bucket's new count taken once any fell), not for each "
        "bucket on its own": reset_whole(False),
        "a count that went down (a restart) is subtracted anyway, not read as a reset":
            _naive(q, sorted(((parse_le(le), after[le] - before[le]) for le in after), key=lambda p: p[0])),
        "the counts since the server started are used (the after scrape alone), not their increase between "
        "the two scrapes": bucket_quantile(q, list(after.items())),
        "the bounds are sorted as strings ('+Inf' first, '10' before '2.5'), not as numbers": _string_sorted(q, inc),
        "the cumulative counts are read as counts per bucket (added up again)":
            bucket_quantile(q, per_bucket_as_cumulative(pairs)),
        "the bucket is the first whose count exceeds the rank (>), not the first that reaches it (>=)":
            first_above(pairs),
        "a rank in the lowest bucket gives its bound, not a value interpolated from 0": variant("lowest from its bound"),
        "the quantile is the upper bound of its bucket, not interpolated inside it": variant("upper"),
        "the quantile is the middle of its bucket, not interpolated linearly inside it": variant("middle"),
        "a rank in the +Inf bucket gives infinity, not the largest finite bound": variant("inf"),
        "a rank of 0 (q = 0) is read as an empty window (NaN); the window is empty when the +Inf bucket's increase "
        "is 0, and rank 0 lies in the lowest bucket": math.nan if q == 0 and pairs and pairs[-1][1] > 0 else
        bucket_quantile(q, pairs),
    }
    return out


def _naive(q: float, ordered: list[tuple[float, float]]) -> float:
    """The straightforward loop a learner writes, on buckets in the order given: the last bucket's
    count is the total (NaN when it is not positive), the first bucket reaching the rank holds the
    quantile, a rank in an infinite bucket gives the bound below it, and one in a lowest bucket whose
    bound is at or below 0 gives that bound."""
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    rank = q * ordered[-1][1]
    b = next((i for i, (_, c) in enumerate(ordered) if c >= rank), len(ordered) - 1)
    start, below = (ordered[b - 1][0], ordered[b - 1][1]) if b else (0.0, 0.0)
    if math.isinf(ordered[b][0]):
        return start
    if b == 0 and ordered[0][0] <= 0:  # no start to interpolate from: the bound itself
        return ordered[0][0]
    inside = ordered[b][1] - below
    return start + (ordered[b][0] - start) * (rank - below) / inside if inside > 0 else math.nan


def _string_sorted(q: float, inc: dict) -> float:
    """The loop on buckets ordered by their le strings ('+Inf' sorts first, '10' before '2.5')."""
    return _naive(q, [(parse_le(le), c) for le, c in sorted(inc.items(), key=lambda item: item[0])])


def _scrape(bounds: list[str], counts: list[float], order: list[int] | None = None) -> dict[str, float]:
    """``{le: count}`` in the given order of keys (a scrape need not list its buckets sorted)."""
    order = order if order is not None else list(range(len(bounds)))
    return {bounds[i]: float(counts[i]) for i in order}


_COURSE_LE = ["0.001", "0.005", "0.01", "0.02", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0",
              "60.0", "+Inf"]


def _cumulative(per_bucket: list[int], base: list[float] | None = None) -> list[float]:
    total, out = 0.0, []
    for i, c in enumerate(per_bucket):
        total += c
        out.append(total + (base[i] if base else 0.0))
    return out


def _quantile_cases(seed: int) -> list[tuple[str, float, dict, dict]]:
    """(label, q, before, after)."""
    le5 = ["0.1", "0.25", "0.5", "1", "+Inf"]
    before5 = _cumulative([4, 6, 10, 5, 1])
    window = [3, 9, 2, 4, 2]  # observations per bucket between the scrapes
    after5 = _cumulative(window, before5)
    cases = [
        ("the p50 of a window, the scrapes' counts differ", 0.5, _scrape(le5, before5), _scrape(le5, after5)),
        ("the p90 of the same window", 0.9, _scrape(le5, before5), _scrape(le5, after5)),
        ("the rank exactly on a bucket's count, empty buckets above it", 0.5,
         _scrape(le5, [0, 0, 0, 0, 0]), _scrape(le5, _cumulative([0, 6, 0, 0, 6]))),
        ("q = 1 when no observation is above 0.25: every count after that bucket equals the total", 1.0,
         _scrape(le5, [1, 2, 2, 2, 2]), _scrape(le5, [6, 12, 12, 12, 12])),
        ("every observation in the lowest bucket", 0.5, _scrape(le5, [2, 2, 2, 2, 2]), _scrape(le5, [10, 10, 10, 10, 10])),
        ("the rank in the +Inf bucket (slower than the largest finite bound)", 0.95,
         _scrape(le5, _cumulative([1, 1, 1, 1, 0])), _scrape(le5, _cumulative([2, 2, 1, 1, 8], _cumulative([1, 1, 1, 1, 0])))),
        ("bounds whose strings sort otherwise than their numbers, keys in no order", 0.75,
         _scrape(["2.5", "10", "5", "+Inf"], [1, 4, 3, 4], [2, 3, 0, 1]),
         _scrape(["2.5", "10", "5", "+Inf"], [3, 14, 9, 15], [1, 0, 3, 2])),
        ("the server restarted between the scrapes: every count went down", 0.9,
         _scrape(le5, _cumulative([40, 30, 20, 5, 5])), _scrape(le5, _cumulative([1, 5, 2, 1, 0]))),
        ("an empty window: nothing observed between the scrapes", 0.9,
         _scrape(le5, before5), _scrape(le5, before5)),
        ("a restart between the scrapes that the total outgrew: only some buckets' counts went down", 0.3,
         _scrape(le5, [40, 70, 90, 95, 100]), _scrape(le5, [50, 55, 58, 60, 200])),
        ("q = 0: the lowest bucket holds observations", 0.0, _scrape(le5, before5), _scrape(le5, after5)),
        ("a lowest bound below 0 (a histogram of differences), the rank inside it", 0.1,
         _scrape(["-0.5", "0.5", "2", "+Inf"], [0, 0, 0, 0]), _scrape(["-0.5", "0.5", "2", "+Inf"], [6, 20, 28, 30])),
    ]
    rng = random.Random(seed)
    base = _cumulative([rng.randrange(50) for _ in _COURSE_LE])
    grown = _cumulative([rng.randrange(30) if i < 9 else rng.randrange(3) for i in range(len(_COURSE_LE))], base)
    order = list(range(len(_COURSE_LE)))
    rng.shuffle(order)
    q = round(rng.uniform(0.5, 0.99), 2)
    cases.append((f"the course server's buckets, random counts, seed {seed}", q, _scrape(_COURSE_LE, base, order),
                  _scrape(_COURSE_LE, grown, order)))
    return cases


def _fresh_seed() -> int:
    """A seed drawn when the check runs (shown in the case, so a failure can be replayed)."""
    return random.SystemRandom().randrange(10**6)


def _same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or (math.isinf(got) and got == want) or \
        (math.isfinite(got) and math.isfinite(want) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12))


@graded(points=4, bans=(histogram_quantile_between, bucket_quantile))
def check_histogram_quantile(fn, checker):
    """``fn(q, before, after)`` must return the ``q`` quantile of the observations made between two
    scrapes of a histogram's buckets, as Prometheus's ``histogram_quantile`` over ``increase`` does."""
    for label, q, before, after in _quantile_cases(_fresh_seed()):
        case = Case(case=label, q=q, before=before if len(before) <= 5 else f"{len(before)} buckets",
                    after=after if len(after) <= 5 else f"{len(after)} buckets")
        got = checker.call(fn, q, dict(before), dict(after), case=case)
        want = histogram_quantile_between.__wrapped__(q, before, after)
        if hasattr(got, "item"):
            got = got.item()
        if got is None or isinstance(got, bool) or not isinstance(got, (int, float)):
            problem = f"your function returned {got!r}, expected a float ({want!r})."
            if got is None and math.isnan(want):
                problem += (" With nothing observed in the window Prometheus returns NaN (math.nan): a graph "
                            "shows a gap there, where None would break the arithmetic around it.")
            checker.fail(case, problem, QUANTILE_RULE)
        got = float(got)
        if _same(got, want):
            continue
        problem = f"the quantile is {got!r}, expected {want!r}."
        if math.isnan(want) and got == 0:
            problem += " An empty window has no quantile: 0 would read as a perfect latency on a dashboard."
        for description, wrong in _wrong_quantiles(q, before, after).items():
            if not _same(wrong, want) and _same(got, wrong):
                problem += f"\nYour quantile matches what we get when {description}."
                break
        checker.fail(case, problem, QUANTILE_RULE)


# --- a client that honours Retry-After -----------------------------------------------------------------

RETRY_RULE = (
    "retry only 429 and 503 answers, at most max_attempts attempts in all, and return the last answer "
    "(without waiting after it); before the k-th retry (k = 0 first) sleep, with the sleep you are given, "
    "the seconds Retry-After asks for (0 when it is absent) plus a random time drawn afresh from rng (the one "
    "handed in: a seed repeats the waits), uniform from 0 to min(cap_s, base_s * 2**k)."
)


class _Headers(dict):
    """Response headers looked up regardless of case, as HTTP's (and httpx's) are."""

    def __init__(self, items=()):
        super().__init__((k.lower(), v) for k, v in dict(items).items())

    def get(self, key, default=None):
        return super().get(key.lower(), default)

    def __getitem__(self, key):
        return super().__getitem__(key.lower())

    def __contains__(self, key):
        return super().__contains__(key.lower())


class _Response:
    def __init__(self, status_code: int, retry_after: str | None = None):
        self.status_code = status_code
        self.headers = _Headers({"Retry-After": retry_after} if retry_after is not None else {})

    def __repr__(self) -> str:
        after = self.headers.get("retry-after")
        return f"<{self.status_code}{f' Retry-After: {after}' if after is not None else ''}>"


class _Script:
    """A fake server that answers from a script, and a fake clock: ``sleep`` records the waits."""

    def __init__(self, answers: list[_Response]):
        self.answers = answers  # the last answer repeats
        self.calls: list[float] = []  # the fake clock at each call
        self.waits: list[float] = []
        self.now = 0.0

    def send(self):
        self.calls.append(self.now)
        if len(self.calls) > 64:
            raise RuntimeError("send was called more than 64 times: the loop does not stop after max_attempts")
        return self.answers[min(len(self.calls), len(self.answers)) - 1]

    def sleep(self, seconds):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"sleep was asked for {seconds!r} seconds")
        self.waits.append(float(seconds))
        self.now += float(seconds)


def _run_script(checker, fn, case, script: _Script, rng, **kw):
    real_sleep = time.sleep

    def watched(seconds):  # the learner must sleep with the sleep handed in, not time.sleep
        if seconds and seconds > 0.05:
            raise ForbiddenCall("your function called time.sleep itself: sleep with the `sleep` argument it is "
                                "given (the check passes a fake clock, so that it runs in no time).")
        real_sleep(seconds)

    time.sleep = watched
    start = time.perf_counter()
    try:
        got = checker.call(fn, script.send, rng, sleep=script.sleep, case=case, **kw)
    finally:
        time.sleep = real_sleep
    if not script.waits and len(script.calls) > 1 and time.perf_counter() - start > 0.5:
        checker.fail(case, f"your function took {time.perf_counter() - start:.1f} s and never called the `sleep` it "
                           f"was given: sleep with that argument (the check hands in a fake clock), not with a "
                           f"sleep imported from time.", RETRY_RULE)
    return got


def _check_waits(checker, case, script: _Script, asked: list[float | None], base: float, cap: float) -> None:
    """Each wait between Retry-After and Retry-After plus the capped exponential envelope."""
    for k, (wait, after) in enumerate(zip(script.waits, asked)):
        floor = after or 0.0
        envelope = min(cap, base * 2 ** k)
        if wait < floor - 1e-9:
            checker.fail(case, f"before retry {k} your function waited {wait:.3g} s, but the server's answer said "
                               f"Retry-After: {after:g}: a client must not come back sooner than it was asked to.",
                         RETRY_RULE)
        if wait > floor + envelope + 1e-9:
            problem = (f"before retry {k} your function waited {wait:.3g} s: more than Retry-After "
                       f"({floor:g} s) plus the backoff's envelope min(cap_s, base_s * 2**k) = {envelope:g} s.")
            if base * 2 ** k > cap and wait > floor + cap:
                problem += " Is the backoff capped at cap_s?"
            checker.fail(case, problem, RETRY_RULE)


@graded(points=4, bans=(send_with_backoff, backoff_wait))
def check_retry_after(fn, checker):
    """``fn(send, rng, *, max_attempts, base_s, cap_s, sleep)`` must retry 429 and 503 answers with
    ``Retry-After`` honoured and a jittered, capped exponential backoff on top; checked on a fake clock,
    then with ten clients against a real service with four slots, from its log of arrivals."""
    base, cap = 0.25, 2.0
    kw = dict(max_attempts=5, base_s=base, cap_s=cap)
    scripts = [
        ("429 (Retry-After 1), 429 (1), 429 (2), then 200",
         [_Response(429, "1"), _Response(429, "1"), _Response(429, "2"), _Response(200)], [1.0, 1.0, 2.0], 200),
        ("503 while draining (Retry-After 3), then 200", [_Response(503, "3"), _Response(200)], [3.0], 200),
        ("429 without a Retry-After header, twice, then 200",
         [_Response(429), _Response(429), _Response(200)], [None, None], 200),
        ("400 (a bad request is not retried)", [_Response(400)], [], 400),
        ("500 (neither 429 nor 503: returned as it is)", [_Response(500)], [], 500),
        ("200 at once", [_Response(200)], [], 200),
    ]
    for label, answers, asked, final in scripts:
        case = Case(answers=label, **kw)
        script = _Script(answers)
        got = _run_script(checker, fn, case, script, random.Random(1), **kw)
        if len(script.calls) != len(answers):
            problem = f"send was called {len(script.calls)} times, expected {len(answers)}."
            if len(script.calls) > len(answers) and final not in (429, 503):
                problem += f" A {final} is final: only 429 and 503 say 'try again later'."
            elif len(script.calls) < len(answers):
                problem += f" Your function stopped at the answer {answers[len(script.calls) - 1]!r}, which is retryable."
            checker.fail(case, problem, RETRY_RULE)
        if getattr(got, "status_code", None) != final:
            checker.fail(case, f"your function returned {got!r}; expected the last answer, the {final}.", RETRY_RULE)
        if len(script.waits) != len(asked):
            problem = f"your function slept {len(script.waits)} times, expected {len(asked)} (once before each retry)."
            if not script.waits and asked:
                problem += " It retried at once: a refused client that comes straight back is refused again."
            checker.fail(case, problem, RETRY_RULE)
        _check_waits(checker, case, script, asked, base, cap)

    case = Case(answers="429 (Retry-After 1) every time", **kw)
    script = _Script([_Response(429, "1")])
    got = _run_script(checker, fn, case, script, random.Random(2), **kw)
    if len(script.calls) != kw["max_attempts"]:
        checker.fail(case, f"send was called {len(script.calls)} times; with max_attempts={kw['max_attempts']} it must "
                           f"be called exactly that many times, then give up.", RETRY_RULE)
    if len(script.waits) != kw["max_attempts"] - 1:
        checker.fail(case, f"your function slept {len(script.waits)} times for {len(script.calls)} attempts: there is "
                           f"no wait after the last attempt (it only delays the caller's error).", RETRY_RULE)
    if getattr(got, "status_code", None) != 429:
        checker.fail(case, f"after the last attempt your function returned {got!r}; return the last answer, the 429.",
                     RETRY_RULE)
    _check_waits(checker, case, script, [1.0] * len(script.waits), base, cap)
    _check_jitter(checker, fn, base, cap)
    _check_against_a_real_service(checker, fn)


def _check_jitter(checker, fn, base: float, cap: float) -> None:
    """Forty clients, each with its own rng, refused seven times with Retry-After 1: at every retry
    their waits must spread over the envelope (jitter), which must double up to the cap."""
    attempts = 8
    kw = dict(max_attempts=attempts, base_s=base, cap_s=cap)
    case = Case(clients="40, rng = random.Random(seed) for seed 0 to 39", answers="429 (Retry-After 1) every time", **kw)
    waits = []
    for seed in range(40):
        script = _Script([_Response(429, "1")])
        _run_script(checker, fn, case, script, random.Random(seed), **kw)
        if len(script.waits) != attempts - 1:
            checker.fail(case, f"with seed {seed} your function slept {len(script.waits)} times in "
                               f"{len(script.calls)} attempts, expected {attempts - 1}.", RETRY_RULE)
        _check_waits(checker, case, script, [1.0] * len(script.waits), base, cap)
        waits.append([w - 1.0 for w in script.waits])
    for k in range(attempts - 1):
        at_k = [w[k] for w in waits]
        envelope = min(cap, base * 2 ** k)
        if max(at_k) - min(at_k) < 1e-9:
            checker.fail(case, f"before retry {k} all 40 clients waited exactly {at_k[0] + 1:.4g} s: no jitter. Clients "
                               f"refused in the same instant then all come back in the same instant, and are "
                               f"refused together again (a thundering herd). Draw the extra wait from rng.",
                         RETRY_RULE)
        # 40 draws spread over [0, envelope]: the largest is below 0.7 of it with probability 0.7**40, 6e-7
        if max(at_k) < 0.7 * envelope:
            checker.fail(case, f"before retry {k} the 40 clients' extra waits (beyond Retry-After) reach only "
                               f"{max(at_k):.3g} s, where the envelope min(cap_s, base_s * 2**k) is {envelope:g} s: the "
                               f"backoff grows too slowly (exponential: the envelope doubles at every retry).",
                         RETRY_RULE)
    _check_seeded(checker, fn, case, kw, waits[0])
    fractions = [[w / min(cap, base * 2 ** k) for k, w in enumerate(client)] for client in waits]
    if all(max(f) - min(f) < 1e-9 for f in fractions):
        checker.fail(case, f"each client waited the same fraction of the envelope at every retry (client 0: "
                           f"{fractions[0][0]:.3f} of it every time): one random number was drawn for the whole call. "
                           f"Draw a new one from rng before every retry.", RETRY_RULE)
    _check_uniform(checker, fn, kw, base, cap, [f for client in fractions for f in client])


def _check_seeded(checker, fn, case, kw, first: list[float]) -> None:
    """The jitter comes from the rng handed in: the same seed gives the same waits again."""
    script = _Script([_Response(429, "1")])
    _run_script(checker, fn, case, script, random.Random(0), **kw)
    again = [w - 1.0 for w in script.waits]
    if again != first:
        checker.fail(case, f"with rng = random.Random(0) twice, the same seed gave other waits: {_shown_waits(first)} "
                           f"then {_shown_waits(again)} (beyond Retry-After). Draw the jitter from the rng you are "
                           f"handed (rng.uniform(0, envelope)), not from the random module or a generator of your own: "
                           f"a caller seeds it to repeat a run.", RETRY_RULE)


def _shown_waits(waits: list[float]) -> str:
    return "[" + ", ".join(f"{w:.3f}" for w in waits[:4]) + (", ...]" if len(waits) > 4 else "]")


# Full jitter's shape is judged on the extra waits of JITTER_SHAPE_CLIENTS clients (seeds 0 up), each refused
# seven times, as fractions of their envelopes: they must look uniform on [0, 1]. For n uniform draws a
# Kolmogorov-Smirnov distance above sqrt(ln(2 / p) / (2 n)) has probability below p (the DKW bound); with
# p = 1e-9 and n = 2,800 the limit is 0.062, below the distance of a triangle (0.125), of Beta(2, 2) (0.096) or
# of a bell clipped to the envelope, which all stay inside it and spread every retry's waits. (40 clients,
# 280 draws, would allow 0.195 and pass all three.)
JITTER_SHAPE_CLIENTS = 400
JITTER_FALSE_ALARM = 1e-9


def _check_uniform(checker, fn, kw, base: float, cap: float, fractions: list[float]) -> None:
    """Full jitter: every extra wait uniform over its whole envelope, not only inside it, and not some other
    shape inside it (``fractions``: the first 40 clients' waits over their envelopes; more are drawn here)."""
    first = len(fractions) // (kw["max_attempts"] - 1)
    case = Case(clients=f"{JITTER_SHAPE_CLIENTS}, rng = random.Random(seed) for seed 0 to {JITTER_SHAPE_CLIENTS - 1}",
                answers="429 (Retry-After 1) every time", **kw)
    fractions = list(fractions)
    for seed in range(first, JITTER_SHAPE_CLIENTS):
        script = _Script([_Response(429, "1")])
        _run_script(checker, fn, case, script, random.Random(seed), **kw)
        _check_waits(checker, case, script, [1.0] * len(script.waits), base, cap)
        fractions += [(w - 1.0) / min(cap, base * 2 ** k) for k, w in enumerate(script.waits)]
    ordered, n = sorted(fractions), len(fractions)
    distance = max(max((i + 1) / n - f, f - i / n) for i, f in enumerate(ordered))
    limit = math.sqrt(math.log(2 / JITTER_FALSE_ALARM) / (2 * n))
    if distance > limit:
        lower = sum(f < 0.5 for f in fractions) / n
        quarter = sum(f < 0.25 for f in fractions) / n
        checker.fail(case, f"the {n} extra waits (beyond Retry-After) are not spread evenly over their envelopes "
                           f"[0, min(cap_s, base_s * 2**k)]: {lower:.0%} of them fall in the lower half of their "
                           f"envelope and {quarter:.0%} in its lowest quarter, where a uniform draw puts about 50% and "
                           f"25% (the largest gap between their distribution and a uniform one is {distance:.3f}; "
                           f"uniform draws stay below {limit:.3f}). Full jitter draws uniformly from 0 to the envelope "
                           f"(rng.uniform(0, envelope)): not half the envelope plus a random half (equal jitter), nor "
                           f"a product or power of draws, nor another shape inside the envelope (a triangle, a bell).",
                     RETRY_RULE)


def _check_against_a_real_service(checker, fn) -> None:
    """Ten clients at once against a real service of four slots that answers 429 with Retry-After 1.
    Only what load cannot cause is judged: a retry that reached the service sooner than the
    Retry-After it was given (load only makes things later), and a client that never got a 200
    within eight attempts (the slots free within a second)."""
    clients, kw = 10, dict(max_attempts=8, base_s=0.1, cap_s=1.0)
    case = Case(service="a real HTTP service on 127.0.0.1: 4 slots held 0.3 s each, 429 with Retry-After: 1 when full",
                clients=f"{clients} threads at once, rng = random.Random(client)", **kw)
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    with RetryAfterService(slots=4, service_s=0.3, retry_after_s=1) as service:
        def client(i: int) -> None:
            try:
                results[i] = checker.call(fn, lambda: service.send(f"c{i}"), random.Random(i), case=case, **kw)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the check's thread
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        log = service.by_client()
    if errors:
        raise errors[0]
    for i in range(clients):
        attempts = log.get(f"c{i}", [])
        for k, (refused, retry) in enumerate(zip(attempts, attempts[1:])):
            if refused.status == 429 and retry.arrived_s < refused.answered_s + refused.retry_after_s - 0.005:
                checker.fail(case, f"client {i}'s attempt {k + 2} reached the service "
                                   f"{retry.arrived_s - refused.answered_s:.3f} s after its attempt {k + 1} was refused "
                                   f"with Retry-After: {refused.retry_after_s:g}: sooner than the server asked.",
                             RETRY_RULE)
        status = getattr(results.get(i), "status_code", None)
        if status != 200:
            checker.fail(case, f"client {i} ended with {results.get(i)!r} after {len(attempts)} attempt(s) "
                               f"({[a.status for a in attempts]}); four slots held 0.3 s serve ten clients within "
                               f"three rounds of retries.", RETRY_RULE)
