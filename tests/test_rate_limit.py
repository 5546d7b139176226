"""Token buckets and the per-tenant limiter (chapter 15), on a simulated clock."""

from __future__ import annotations

import math
import random
import threading

import pytest

from labsupport.rate_limit import Decision, Limits, TenantLimiter, TokenBucket


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_bucket_starts_full_spends_its_burst_then_refills_at_its_rate():
    clock = Clock()
    bucket = TokenBucket(rate=2.0, capacity=5, clock=clock)
    assert [bucket.try_take() for _ in range(6)] == [True] * 5 + [False]
    assert bucket.wait_time(1) == pytest.approx(0.5) and bucket.wait_time(3) == pytest.approx(1.5)
    clock.now = 0.49
    assert not bucket.try_take()
    clock.now = 0.5
    assert bucket.try_take() and bucket.tokens == pytest.approx(0)
    clock.now = 100.0  # idle for long: full, never more
    assert bucket.tokens == 5 and bucket.wait_time(6) == math.inf


def test_over_any_window_a_bucket_admits_at_most_its_burst_plus_rate_times_the_window():
    rng = random.Random(0)
    clock = Clock()
    bucket = TokenBucket(rate=3.0, capacity=10, clock=clock)
    admitted = []  # (time, tokens)
    for _ in range(5000):
        clock.now += rng.expovariate(20.0)  # a greedy client, far above the rate
        n = rng.choice([1, 2, 3])
        if bucket.try_take(n):
            admitted.append((clock.now, n))
    for start in [t for t, _ in admitted][::50]:
        for window in (0.5, 2.0, 10.0, 60.0):
            spent = sum(n for t, n in admitted if start <= t < start + window)
            assert spent <= 10 + 3.0 * window + 1e-9
    assert sum(n for _, n in admitted) / clock.now == pytest.approx(3.0, rel=0.05)  # the long-run rate


def test_a_taken_token_can_be_given_back_but_not_beyond_the_capacity():
    clock = Clock()
    bucket = TokenBucket(rate=1.0, capacity=4, clock=clock)
    assert bucket.try_take(4) and not bucket.try_take(1)
    bucket.give_back(3)
    assert bucket.tokens == 3
    bucket.give_back(10)
    assert bucket.tokens == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0, capacity=1), "rate"), (dict(rate=1, capacity=-1), "capacity"),
    (dict(rate=1, capacity=2, tokens=3), "more than its capacity"),
])
def test_bad_buckets_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenBucket(**kwargs)


def test_a_clock_that_goes_backwards_is_an_error():
    clock = Clock()
    bucket = TokenBucket(rate=1.0, capacity=1, clock=clock)
    clock.now = -1.0
    with pytest.raises(ValueError, match="monotonic"):
        bucket.try_take()


def test_tenants_are_limited_separately_on_requests_and_tokens():
    clock = Clock()
    limiter = TenantLimiter({"small": Limits(requests_per_minute=6, tokens_per_minute=1200)},
                            default=Limits(requests_per_minute=60, tokens_per_minute=60_000), clock=clock)
    first = [limiter.admit("small", 100, 100) for _ in range(7)]
    assert [d.admitted for d in first] == [True] * 6 + [False]
    assert first[-1].limit == "requests" and first[-1].retry_after_s == 10 and first[-1].status == 429
    assert limiter.admit("big", 100, 100).admitted  # another tenant is untouched
    clock.now = 60.0
    d = limiter.admit("small", 500, 600)  # 1,100 tokens: the token bucket holds 1,200
    assert d.admitted and d.reserved_tokens == 1100
    refused = limiter.admit("small", 50, 100)  # 150 tokens, 100 left
    assert not refused.admitted and refused.limit == "tokens" and refused.retry_after_s == 3  # 50 / 20 per s = 2.5
    assert refused.reserved_tokens == 0 and limiter.admit("small", 50, 50).admitted  # a refusal took nothing


def test_a_request_no_bucket_can_hold_is_refused_for_good():
    limiter = TenantLimiter(Limits(requests_per_minute=60, tokens_per_minute=1000), clock=Clock())
    d = limiter.admit("anyone", 900, 200)
    assert not d.admitted and d.retry_after_s is None and d.limit == "too large" and d.status == 413


def test_settling_gives_back_what_a_request_reserved_and_did_not_use():
    clock = Clock()
    limiter = TenantLimiter(Limits(requests_per_minute=600, tokens_per_minute=1000), clock=clock)
    d = limiter.admit("a", 100, 800)
    assert d.admitted and not limiter.admit("a", 100, 50).admitted
    limiter.settle(d, used_tokens=100 + 20)  # stopped after 20 tokens
    assert limiter.admit("a", 100, 50).admitted
    with pytest.raises(ValueError, match="only an admitted request"):
        limiter.settle(Decision(False, "a", 0, 1, "tokens"), 0)
    with pytest.raises(KeyError, match="no limits"):
        TenantLimiter({"a": Limits(1, 1)}).admit("b", 1, 1)


def test_concurrent_admissions_never_overspend_a_bucket():
    limiter = TenantLimiter(Limits(requests_per_minute=1e-6, tokens_per_minute=1e9, request_burst=50))
    results = []

    def client():
        for _ in range(20):
            results.append(limiter.admit("t", 1, 1).admitted)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 50 and len(results) == 160
