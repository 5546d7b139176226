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
from ._mistakes import merge_alike as _merge_alike
from .framework import Case, graded

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
