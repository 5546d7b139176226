"""Retrying a server that says "not now": Retry-After, capped exponential backoff and jitter (chapter 15).

A server that is full answers at once instead of queueing without bound: the course server sends
HTTP 429 with ``Retry-After: 1`` when its admission slots are taken, and 503 with ``Retry-After``
while it drains (chapter 15). What a client does next decides whether the overload passes or
grows. Retrying at once, in a loop, adds a refused request per turn and is served no sooner. The
rules this module follows:

* Retry only what says "try again later": 429 (too many requests) and 503 (unavailable). Any other
  answer, success or error, is returned as it is (:data:`RETRYABLE`).
* ``Retry-After`` (RFC 9110, section 10.2.3) is the earliest the server wants the client back, in
  seconds (it may also be an HTTP date; the course server sends seconds, and a value this module
  cannot read as a number is treated as absent). Never retry sooner.
* On top of it, wait a **jittered, capped exponential backoff**: before the ``k``-th retry
  (``k = 0`` for the first) a random time, uniform between 0 and ``min(cap_s, base_s * 2**k)``
  ("full jitter", Marc Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015).
  The exponential spaces the retries of one client out while the overload lasts; the cap bounds
  the wait; the jitter spreads the clients that were refused together, which would otherwise all
  come back in the same instant, ``Retry-After`` seconds later, and be refused together again (a
  thundering herd).
* Give up after ``max_attempts`` attempts in all and return the last answer: no wait after it.

:func:`send_with_backoff` is lab 15's exercise (the course's answer). :func:`backoff_wait` is one
wait. :class:`RetryAfterService` is a real HTTP service with a few slots that answers 429 with
``Retry-After`` when they are taken, and logs when each attempt arrived and what it was told: the
lab's check reads that log.

For comparison, OpenAI's Python client (``openai`` 2.54.0, ``openai/_base_client.py``) retries 408,
409, 429 and every 5xx, twice by default; it waits what ``retry-after-ms`` or ``Retry-After``
(seconds or an HTTP date) asks when that is more than 0 and at most two minutes, as it is, without
jitter (a longer one and it does not retry at all); otherwise ``min(0.5 * 2**retries, 8)`` seconds, less
up to a quarter at random.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from ._answers import answer
from ._loopback import LoopbackService, reply_json
from ._validate import non_negative_number, positive_int, positive_number

__all__ = ["RETRYABLE", "Attempt", "RetryAfterService", "backoff_wait", "retry_after_seconds", "send_with_backoff"]

RETRYABLE = (429, 503)  # too many requests; unavailable (a draining server)


def retry_after_seconds(value) -> float | None:
    """The seconds a ``Retry-After`` header asks for, or None when it is absent or not a number
    of seconds (negative values count as 0)."""
    if value is None:
        return None
    try:
        seconds = float(str(value).strip())
    except ValueError:
        return None
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


@answer
def backoff_wait(retry: int, rng: random.Random, *, base_s: float, cap_s: float, retry_after_s: float | None = None) -> float:
    """Seconds to wait before retry number ``retry`` (0 for the first): ``Retry-After`` (0 when
    absent) plus ``rng.uniform(0, min(cap_s, base_s * 2**retry))``."""
    envelope = min(cap_s, base_s * 2 ** retry)
    return (retry_after_s or 0.0) + rng.uniform(0, envelope)


@answer
def send_with_backoff(send: Callable[[], object], rng: random.Random, *, max_attempts: int = 6, base_s: float = 0.25,
                      cap_s: float = 4.0, sleep: Callable[[float], None] = time.sleep):
    """Call ``send()`` until it answers something other than 429 or 503, at most ``max_attempts``
    times, waiting :func:`backoff_wait` between attempts with ``sleep``; return the last answer
    (chapter 15). ``send()`` returns a response with ``status_code`` and ``headers`` (an
    ``httpx.Response``); ``rng`` draws the jitter."""
    max_attempts = positive_int("max_attempts", max_attempts)
    base_s, cap_s = positive_number("base_s", base_s), positive_number("cap_s", cap_s)
    for attempt in range(max_attempts):
        response = send()
        if response.status_code not in RETRYABLE or attempt == max_attempts - 1:
            return response
        asked = retry_after_seconds(response.headers.get("retry-after"))
        sleep(backoff_wait(attempt, rng, base_s=base_s, cap_s=cap_s, retry_after_s=asked))
    raise AssertionError("unreachable")  # the loop returns at its last attempt


@dataclass(frozen=True)
class Attempt:
    """One request as :class:`RetryAfterService` saw it (times in ``time.perf_counter`` seconds)."""

    client: str
    arrived_s: float
    status: int
    answered_s: float  # when the answer was about to be written (after the service time for a 200)
    retry_after_s: float | None  # what a 429 asked for


class RetryAfterService(LoopbackService):
    """A real HTTP service on 127.0.0.1 with ``slots`` slots: ``GET /work?client=NAME`` takes a free
    slot, holds it ``service_s`` seconds and answers 200 ``{"client": NAME}``; when every slot is
    taken it answers 429 at once with ``Retry-After: retry_after_s``. ``attempts`` is the log of
    every request (:class:`Attempt`), in the order they arrived. A context manager; :meth:`send` is
    a client for it that returns the ``httpx.Response``."""

    def __init__(self, slots: int = 4, service_s: float = 0.3, retry_after_s: int = 1):
        self.slots = positive_int("slots", slots)
        self.service_s = non_negative_number("service_s", service_s)
        self.retry_after_s = positive_int("retry_after_s", retry_after_s, allow_zero=True)
        self.attempts: list[Attempt] = []
        self._busy = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RetryAfterService:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the name http.server calls
                arrived = time.perf_counter()
                client = self.path.partition("client=")[2] or "?"
                with service._lock:
                    admitted = service._busy < service.slots
                    if admitted:
                        service._busy += 1
                if admitted:
                    time.sleep(service.service_s)
                    with service._lock:
                        service._busy -= 1
                    status, body, headers = 200, {"client": client}, {}
                else:
                    status = 429
                    body = {"error": {"message": "the service is full: retry later", "code": "server_full"}}
                    headers = {"Retry-After": str(service.retry_after_s)}
                with service._lock:  # logged before the answer leaves: a client holding it finds it here
                    service.attempts.append(Attempt(client, arrived, status, time.perf_counter(),
                                                    float(service.retry_after_s) if status == 429 else None))
                reply_json(self, status, body, headers)

            def log_message(self, *args):  # quiet
                pass

        self._start(Handler, "RetryAfterService")
        return self

    def send(self, client: str, timeout_s: float = 30.0):
        """One request as ``client``: the ``httpx.Response`` (200 or 429)."""
        import httpx  # the course server's client library, only needed once a request is sent

        return httpx.get(f"{self.url}/work", params={"client": client}, timeout=timeout_s)

    def by_client(self) -> dict[str, list[Attempt]]:
        """The log grouped by client, each client's attempts in the order they arrived."""
        with self._lock:
            log = list(self.attempts)
        out: dict[str, list[Attempt]] = {}
        for a in sorted(log, key=lambda a: a.arrived_s):
            out.setdefault(a.client, []).append(a)
        return out
