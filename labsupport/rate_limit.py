"""Per-tenant rate limits with token buckets (chapter 15).

A **token bucket** holds up to ``capacity`` tokens and gains ``rate`` tokens per second, never more
than it holds. A request that costs ``n`` tokens is admitted when the bucket has ``n``, and takes
them; otherwise it is refused, and the bucket says how long until it would have them. Over any
window of ``T`` seconds a bucket admits at most ``capacity + rate * T`` tokens' worth: ``rate`` is the
long-run limit, ``capacity`` the burst a quiet client may spend at once.

An LLM service limits each tenant (an API key, an organisation) on two measures at once, as the
hosted APIs publish them: **requests per minute** and **tokens per minute** (OpenAI's RPM and TPM).
A request's tokens are not known when it arrives, only its prompt and its ``max_tokens``, so
:class:`TenantLimiter` reserves ``prompt_tokens + max_tokens`` on admission and, once the request
has finished, :meth:`TenantLimiter.settle` gives back what it did not use. A request larger than a
bucket can ever hold is refused for good (``retry_after_s`` is None): retrying cannot help, so the
server should answer 400 or 413, not 429.

The limiter is independent of the server: :meth:`TenantLimiter.admit` returns a :class:`Decision`
whose ``retry_after_s`` is the ``Retry-After`` a 429 would carry (whole seconds, rounded up).
Wiring it into the course server (a tenant from the API key, a 429 with its ``Retry-After``, a
settle when the request ends) is a follow-up; the clock is injectable so that the tests, and
chapter 15's demonstration, run on a simulated one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._validate import non_negative_number, positive_number

__all__ = ["Decision", "Limits", "TenantLimiter", "TokenBucket"]


class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` tokens per second (module docstring). It starts
    full, or with ``tokens``. ``clock`` returns seconds (``time.monotonic`` by default)."""

    def __init__(self, rate: float, capacity: float, *, tokens: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rate = positive_number("rate", rate)
        self.capacity = positive_number("capacity", capacity)
        start = self.capacity if tokens is None else non_negative_number("tokens", tokens)
        if start > self.capacity:
            raise ValueError(f"a bucket cannot start with {start} tokens, more than its capacity {self.capacity}")
        self._clock = clock
        self._tokens = start
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        if now < self._at:
            raise ValueError(f"the clock went backwards ({self._at} then {now}): use a monotonic clock")
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    @property
    def tokens(self) -> float:
        """Tokens in the bucket now."""
        with self._lock:
            self._refill()
            return self._tokens

    def wait_time(self, n: float = 1) -> float:
        """Seconds until ``n`` tokens are there (0 if they are now); ``inf`` when ``n`` exceeds the
        capacity (the bucket never holds that many)."""
        n = non_negative_number("n", n)
        with self._lock:
            self._refill()
            if n > self.capacity:
                return math.inf
            return max(0.0, (n - self._tokens) / self.rate)

    def try_take(self, n: float = 1) -> bool:
        """Take ``n`` tokens if the bucket has them (True), else take nothing (False)."""
        n = non_negative_number("n", n)
        with self._lock:
            self._refill()
            if n <= self._tokens:
                self._tokens -= n
                return True
            return False

    def give_back(self, n: float) -> None:
        """Return ``n`` tokens taken earlier and not used (never beyond the capacity)."""
        n = non_negative_number("n", n)
        with self._lock:
            self._refill()
            self._tokens = min(self.capacity, self._tokens + n)


@dataclass(frozen=True)
class Limits:
    """One tenant's limits, per minute as hosted APIs state them, and the bursts allowed (by default a
    minute's worth: a client idle for a minute may spend a minute's allowance at once)."""

    requests_per_minute: float
    tokens_per_minute: float
    request_burst: float | None = None
    token_burst: float | None = None

    def buckets(self, clock: Callable[[], float]) -> tuple[TokenBucket, TokenBucket]:
        rpm = positive_number("requests_per_minute", self.requests_per_minute)
        tpm = positive_number("tokens_per_minute", self.tokens_per_minute)
        return (TokenBucket(rpm / 60, self.request_burst or rpm, clock=clock),
                TokenBucket(tpm / 60, self.token_burst or tpm, clock=clock))


@dataclass(frozen=True)
class Decision:
    """What :meth:`TenantLimiter.admit` decided."""

    admitted: bool
    tenant: str
    reserved_tokens: float  # taken from the token bucket (0 when refused)
    retry_after_s: int | None  # when refused: whole seconds until both buckets would admit it; None: never
    limit: str | None  # which limit refused it: "requests", "tokens", or "too large"

    @property
    def status(self) -> int:
        """The HTTP status a server answers: 200 to go ahead, 429 to retry later, 413 for never."""
        return 200 if self.admitted else (413 if self.retry_after_s is None else 429)


class TenantLimiter:
    """Requests-per-minute and tokens-per-minute buckets, one pair per tenant (module docstring).
    ``limits``: a :class:`Limits` for every tenant, or a dict tenant -> Limits with ``default`` for the
    others."""

    def __init__(self, limits: Limits | Mapping[str, Limits], *, default: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(limits, Limits):
            self._limits, self._default = {}, limits
        else:
            self._limits, self._default = dict(limits), default
        self._clock = clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._lock = threading.Lock()

    def _pair(self, tenant: str) -> tuple[TokenBucket, TokenBucket]:
        with self._lock:
            if tenant not in self._buckets:
                limits = self._limits.get(tenant, self._default)
                if limits is None:
                    raise KeyError(f"tenant {tenant!r} has no limits and there is no default")
                self._buckets[tenant] = limits.buckets(self._clock)
            return self._buckets[tenant]

    def admit(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Decision:
        """Admit one request of ``tenant`` reserving ``prompt_tokens + max_tokens`` tokens, or refuse it,
        taking nothing. Both buckets must admit it; a refusal says which one and when to retry."""
        cost = non_negative_number("prompt_tokens", prompt_tokens) + non_negative_number("max_tokens", max_tokens)
        requests, tokens = self._pair(tenant)
        with self._lock:  # both buckets or neither
            if cost > tokens.capacity:
                return Decision(False, tenant, 0.0, None, "too large")
            wait_r, wait_t = requests.wait_time(1), tokens.wait_time(cost)
            if wait_r == 0 and wait_t == 0:
                requests.try_take(1)
                tokens.try_take(cost)
                return Decision(True, tenant, cost, None, None)
            limit = "requests" if wait_r >= wait_t else "tokens"
            return Decision(False, tenant, 0.0, max(1, math.ceil(max(wait_r, wait_t))), limit)

    def settle(self, decision: Decision, used_tokens: float) -> None:
        """A request admitted by ``decision`` has finished having used ``used_tokens`` (prompt and
        output): give back what it reserved and did not use."""
        if not decision.admitted:
            raise ValueError("only an admitted request can be settled")
        used = non_negative_number("used_tokens", used_tokens)
        _, tokens = self._pair(decision.tenant)
        tokens.give_back(max(0.0, decision.reserved_tokens - used))
