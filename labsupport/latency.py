"""Latency of one streamed request, and of many: the metrics chapter 03 defines.

A client sends a request at ``sent_s`` and receives the answer's tokens at ``token_times_s``
(one timestamp per token, in seconds on one clock, in the order they arrived). From those:

* **TTFT** (time to first token) ``= token_times_s[0] - sent_s``: queueing, tokenisation and
  prefill on the server, plus the network both ways.
* **E2E** (end-to-end latency) ``= token_times_s[-1] - sent_s``.
* **ITL** (inter-token latency) is the list of gaps between consecutive tokens,
  ``token_times_s[i] - token_times_s[i - 1]`` for ``i = 1 .. n - 1``: ``n - 1`` values, none for a
  one-token answer. The wait for the first token is TTFT, not an ITL.
* **TPOT** (time per output token) ``= (E2E - TTFT) / (n - 1)``: the mean of the ITL list, the
  decode rate one user sees. With one token there is no gap to average, and TPOT is ``None``
  (not 0, which would claim an infinitely fast decode).

Across requests, percentiles use the **nearest-rank** convention (:func:`percentile`): the p-th
percentile of ``n`` values is the smallest value that at least ``p`` % of them do not exceed, the
``ceil(p * n / 100)``-th smallest. It is always one of the measured values, never an
interpolation between two.

:func:`fifo_ttfts` is the arithmetic of a first-in, first-out queue served one request at a time:
what chapter 03's course server does, and why TTFT grows with the number of requests in flight.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from ._answers import answer
from ._validate import non_negative_number, positive_int

__all__ = [
    "LatencySummary",
    "fifo_ttfts",
    "latency_metrics",
    "percentile",
    "plot_waterfall",
    "summarize",
    "timeline_stages",
]


def _time(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


@answer
def latency_metrics(sent_s: float, token_times_s: Sequence[float]) -> dict:
    """TTFT, TPOT, the ITL list and E2E of one streamed request (seconds; chapter 03).

    ``sent_s`` is when the request was sent, ``token_times_s`` when each token arrived, on the same
    clock. Returns ``{"ttft": float, "tpot": float | None, "itl": list[float], "e2e": float}``;
    ``tpot`` is None for a one-token answer. No tokens, a token before the request was sent, or
    timestamps out of order are a ValueError.
    """
    sent = _time("sent_s", sent_s)
    if isinstance(token_times_s, (str, bytes)) or not isinstance(token_times_s, Sequence):
        raise ValueError(f"token_times_s must be a list of timestamps, got {type(token_times_s).__name__}")
    times = [_time(f"token_times_s[{i}]", t) for i, t in enumerate(token_times_s)]
    if not times:
        raise ValueError("token_times_s is empty: a request with no tokens has no TTFT, TPOT or ITL")
    if times[0] < sent:
        raise ValueError(f"the first token arrived ({times[0]}) before the request was sent ({sent_s})")
    for i in range(1, len(times)):
        if times[i] < times[i - 1]:
            raise ValueError(f"token_times_s must not decrease: token {i} at {times[i]} follows {times[i - 1]}")
    ttft = times[0] - sent
    e2e = times[-1] - sent
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (e2e - ttft) / (len(times) - 1) if len(times) > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}


@answer
def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` by nearest rank (chapter 03): the
    ``ceil(p * n / 100)``-th smallest value (the smallest for ``p = 0``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"values must be a non-empty list of numbers, got {values!r}")
    data = sorted(_time("each value", v) for v in values)
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 100:
        raise ValueError(f"p must be a number from 0 to 100, got {p!r}")
    rank = max(1, math.ceil(p * len(data) / 100))  # p * n first: 7 / 100 * 100 is 7.000000000000001
    return data[rank - 1]


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of one metric over a set of requests (nearest rank), with the mean beside them."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: Sequence[float]) -> LatencySummary:
    """Mean, p50, p90, p99 and maximum of ``values`` (nearest-rank percentiles)."""
    data = [_time("each value", v) for v in values] if isinstance(values, Sequence) else values
    if isinstance(data, (str, bytes)) or not isinstance(data, list) or not data:
        raise ValueError(f"values must be a non-empty list of numbers, got {values!r}")
    return LatencySummary(
        count=len(data),
        mean=sum(data) / len(data),
        p50=percentile(data, 50),
        p90=percentile(data, 90),
        p99=percentile(data, 99),
        max=max(data),
    )


def fifo_ttfts(n_requests: int, service_s: float, first_token_s: float) -> list[float]:
    """TTFT of each of ``n_requests`` that arrive together at a server that serves one request at
    a time, first in, first out (chapter 03's course server): request ``k`` (from 0) waits for the
    ``k`` whole requests before it (``service_s`` each), then takes ``first_token_s`` (tokenise and
    prefill) to its first token. Network time is left out."""
    n = positive_int("n_requests", n_requests)
    service = non_negative_number("service_s", service_s)
    first = non_negative_number("first_token_s", first_token_s)
    return [k * service + first for k in range(n)]


#: The stages of the course server's timeline, in the order a request passes through them, with
#: the events that open and close each (see ``labsupport.serve``).
STAGES = (
    ("tokenise", "tokenise_start", "tokenise_end"),
    ("queue", "queued", "scheduled"),
    ("prefill", "prefill_start", "prefill_end"),
    ("decode", "decode_start", "decode_end"),
    ("detokenise", "detokenise_start", "detokenise_end"),
)


def timeline_stages(timeline: dict) -> list[tuple[str, int | None, float, float]]:
    """The bars of a request's waterfall from a course-server timeline
    (``GET /v1/requests/{id}/timeline``): ``(stage, token index or None, start_s, end_s)``, times in
    seconds since the request arrived, in the order the stages started. Decode steps and
    detokenisation appear once per token."""
    if not isinstance(timeline, dict) or not isinstance(timeline.get("events"), list):
        raise ValueError("timeline must be the JSON of GET /v1/requests/{id}/timeline (a dict with 'events')")
    opened: dict[tuple[str, int | None], float] = {}
    bars = []
    openers = {start: stage for stage, start, _ in STAGES}
    closers = {end: stage for stage, _, end in STAGES}
    for event in timeline["events"]:
        name, t, token = event["stage"], float(event["t"]), event.get("token")
        if name in openers:
            opened[(openers[name], token)] = t
        elif name in closers and (closers[name], token) in opened:
            bars.append((closers[name], token, opened.pop((closers[name], token)), t))
    return sorted(bars, key=lambda bar: bar[2])



#: Colours of the waterfall's stages.
STAGE_COLOURS = {
    "network in": "#bbbbbb", "tokenise": "#8c564b", "queue": "#d62728", "prefill": "#1f77b4",
    "decode": "#2ca02c", "detokenise": "#9467bd",
}


def plot_waterfall(ax, timeline: dict, sent_s: float, token_times_s: Sequence[float], title: str = ""):
    """Draw one request's waterfall on the matplotlib axes ``ax``: a row per stage (the request on
    its way in, tokenise, queue, prefill, each decode step, each detokenisation) from the server's
    ``timeline``, and the client's row with every chunk's arrival. Times are milliseconds after
    ``sent_s``; the client and the server read the same ``time.monotonic()`` clock, which holds on
    one machine."""
    bars = timeline_stages(timeline)
    offset = timeline["arrival"] - sent_s  # server times are seconds after the request's arrival
    rows = ["network in", "tokenise", "queue", "prefill", "decode", "detokenise"]
    y = {name: len(rows) - i for i, name in enumerate(rows)}
    ax.broken_barh([(0, offset * 1e3)], (y["network in"] - 0.4, 0.8), color=STAGE_COLOURS["network in"])
    for stage, _, start, end in bars:
        width = max((end - start) * 1e3, 0.02)  # a stage too short to see still shows as a line
        ax.broken_barh([((offset + start) * 1e3, width)], (y[stage] - 0.4, 0.8), color=STAGE_COLOURS[stage],
                       edgecolor="white", linewidth=0.3)
    chunks = [(t - sent_s) * 1e3 for t in token_times_s]
    ax.plot(chunks, [0] * len(chunks), "|", color="black", markersize=14)
    ax.axvline(chunks[0], color="black", linestyle=":", linewidth=1)
    ax.annotate("first token (TTFT)", (chunks[0], 0.5), xytext=(4, 0), textcoords="offset points", fontsize=8)
    ax.set_yticks([0, *y.values()], ["client: chunks", *rows])
    ax.set_ylim(-0.7, len(rows) + 0.7)
    ax.set_xlabel("milliseconds after the client sent the request")
    if title:
        ax.set_title(title)
    return ax
