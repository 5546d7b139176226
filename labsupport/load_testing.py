"""Load testing a serving engine: arrivals, open and closed loops, SLOs and goodput (chapter 15).

**Arrivals.** :func:`poisson_arrivals` is the open-loop schedule of chapter 15's lab: ``n`` send
times starting at 0 whose gaps are exponential with mean ``1 / rate`` (a Poisson process), drawn
from the generator it is given. (:func:`labsupport.bench_serving.arrival_times` draws the same
gaps with a gamma shape for bursts.) :func:`diurnal_rate` is a daily cycle of the rate.

**Open and closed loops.** :func:`open_loop` starts each call at its scheduled time whether or
not earlier calls have returned, as independent users do; :func:`closed_loop` sends the next
request only when an answer has come back, as a fixed set of clients does. A closed loop slows its
own arrivals down when the server slows down, so it never sees the queue a stall builds: the
*coordinated omission* of Gil Tene's talk "How NOT to Measure Latency". :func:`fifo_latencies`
computes, exactly, what a one-at-a-time server with a stall does to either kind of load, and
:class:`SlowService` is a real HTTP service with a fixed service time (the check of the open-loop
exercise sends to it and looks at when requests arrived).

**SLOs and goodput.** :func:`slo_report` takes per-request latencies (``None`` for a request that
failed or was refused) and a service-level objective ``{"ttft_s", "tpot_s", "p"}`` and returns the
goodput (requests per second that met *every* target: TTFT at most ``ttft_s`` and TPOT at most
``tpot_s``; a one-token answer has no TPOT and meets that target), the attainment (the fraction
of all requests sent that met every target) and the nearest-rank ``p``-th percentiles of TTFT and
TPOT over the requests that completed (:func:`labsupport.latency.percentile`: the
``ceil(p * n / 100)``-th smallest).

**A running server.** :func:`scrape_metrics` reads a Prometheus ``/metrics`` page with
``prometheus_client``'s own parser; :func:`histogram_quantile` estimates a quantile from a
histogram's buckets as Prometheus's ``histogram_quantile`` does (linear within the bucket: a
different convention from the nearest rank). :func:`load_sweep` runs the benchmark client of
chapter 12 at rising rates while :class:`MetricsSampler` scrapes the server, and :func:`knee_rate`
finds where latency takes off. :func:`burst` sends many requests at once to see 429s and the queue.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler

from ._answers import answer
from ._loopback import LoopbackService, reply_json
from ._optional import OptionalModule
from ._validate import positive_int, positive_number
from .bench_serving import _run_sync, random_prompts, run_benchmark
from .prometheus import bucket_counts, bucket_quantile, counter_increase

# the course server's packages, imported at first use (a lab's checks import this module without them)
httpx = OptionalModule("httpx", "httpx", "talking to a running server (labsupport.load_testing)")
prometheus_parser = OptionalModule("prometheus_client.parser", "prometheus-client",
                                   "reading a server's /metrics (labsupport.load_testing)")

__all__ = [
    "MetricsSampler",
    "SlowService",
    "burst",
    "closed_loop",
    "closed_loop_latencies",
    "diurnal_rate",
    "fifo_latencies",
    "histogram_quantile",
    "knee_rate",
    "load_sweep",
    "metric",
    "open_loop",
    "poisson_arrivals",
    "request_latencies",
    "scrape_metrics",
    "slo_report",
]


# --- arrivals --------------------------------------------------------------------------------------


@answer
def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` send times of a Poisson process of ``rate`` requests per second: the first at 0, then
    exponential gaps of mean ``1 / rate`` drawn from ``rng`` (a ``random.Random``). Chapter 15."""
    n = positive_int("n", n)
    rate = positive_number("rate", rate)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)  # expovariate takes the rate (lambda), not the mean
    return times


def diurnal_rate(hour: float, mean_rate: float, peak_to_mean: float = 2.0, peak_hour: float = 14.0) -> float:
    """A daily cycle: ``mean_rate * (1 + (peak_to_mean - 1) * cos(2 pi (hour - peak_hour) / 24))``,
    requests per second at ``hour`` (0 to 24). The mean over a day is ``mean_rate``; the peak,
    at ``peak_hour``, is ``peak_to_mean`` times it (at most 2, so the rate never goes negative)."""
    if not 1 <= peak_to_mean <= 2:
        raise ValueError(f"peak_to_mean must be from 1 to 2 (a cosine cycle), got {peak_to_mean}")
    return mean_rate * (1 + (peak_to_mean - 1) * math.cos(2 * math.pi * (hour - peak_hour) / 24))


# --- open and closed loops -------------------------------------------------------------------------


@answer
def open_loop(times_s: Sequence[float], send: Callable[[int], object]) -> list:
    """Call ``send(i)`` at ``times_s[i]`` seconds after the start, each in its own thread, whether or
    not earlier calls have returned; return every call's result in the order of ``i`` once all have
    returned (an exception in a call is raised after all have finished). Chapter 15."""
    start = time.perf_counter()
    results: list = [None] * len(times_s)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        time.sleep(max(0.0, start + times_s[i] - time.perf_counter()))
        try:
            results[i] = send(i)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(times_s))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def closed_loop(n: int, send: Callable[[int], object], clients: int = 1) -> list:
    """The closed loop, for comparison: ``clients`` threads each send their next request as soon as
    their previous answer is back, until ``n`` requests have been sent; results in the order of ``i``."""
    n, clients = positive_int("n", n), positive_int("clients", clients)
    results: list = [None] * n
    counter, lock = iter(range(n)), threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            results[i] = send(i)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def fifo_latencies(arrivals_s: Sequence[float], service_s: float, stall: tuple[float, float] | None = None) -> list[float]:
    """Latency (arrival to answer) of each request at a server that serves one request at a time,
    first in first out, each in ``service_s``, and stops for ``stall = (start_s, length_s)``: a
    request that would be in service during the stall waits it out. Exact arithmetic, no clock."""
    service_s = positive_number("service_s", service_s)
    free, out = 0.0, []
    for a in sorted(arrivals_s):
        begin = max(a, free)
        if stall is not None and begin < stall[0] + stall[1] and begin + service_s > stall[0]:
            begin = max(begin, stall[0] + stall[1])
        free = begin + service_s
        out.append(free - a)
    return out


def closed_loop_latencies(duration_s: float, service_s: float, stall: tuple[float, float] | None = None) -> list[float]:
    """What one closed-loop client records in ``duration_s`` against the server of
    :func:`fifo_latencies`: it sends, waits for the answer, and sends again at once."""
    t, out = 0.0, []
    while t < duration_s:
        latency = fifo_latencies([t], service_s, stall)[0]  # alone in the system: only the stall delays it
        out.append(latency)
        t += latency
    return out


class SlowService(LoopbackService):
    """A real HTTP service on 127.0.0.1 that answers ``GET /work?i=I`` after ``delay_s(i)`` seconds
    (a number, or a function of ``i``) with ``{"i": I}``, from a thread per request, and records when
    each request arrived and finished (``time.perf_counter``; "finished" is taken just before the answer
    is written, so a client that has its answer always finds it recorded). A context manager;
    :meth:`send` is a client for it."""

    def __init__(self, delay_s: float | Callable[[int], float] = 0.5):
        self.delay = delay_s if callable(delay_s) else (lambda i: delay_s)
        self.arrived: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def __enter__(self) -> SlowService:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the name http.server calls
                now = time.perf_counter()
                try:
                    i = int(self.path.split("i=", 1)[1])
                except (IndexError, ValueError):
                    self.send_error(400, "ask for /work?i=<integer>")
                    return
                with service._lock:
                    service.arrived[i] = now
                    service.max_in_flight = max(service.max_in_flight, len(service.arrived) - len(service.finished))
                time.sleep(service.delay(i))
                with service._lock:  # before the answer leaves: a client holding it always sees this
                    service.finished[i] = time.perf_counter()
                reply_json(self, 200, {"i": i})

            def log_message(self, *args):  # quiet
                pass

        self._start(Handler, "SlowService")
        return self

    def send(self, i: int) -> dict:
        """One request for ``i``, blocking until its answer: ``{"i": i}``."""
        with urllib.request.urlopen(f"{self.url}/work?i={i}", timeout=30) as response:
            return json.loads(response.read())


# --- SLOs and goodput ------------------------------------------------------------------------------


def _nearest_rank(values: Sequence[float], p: float) -> float:
    """:func:`labsupport.latency.percentile`'s convention, kept here so that this answer does not call
    the percentile answer that lab 15's check bans: the ``ceil(p * n / 100)``-th smallest."""
    data = sorted(values)
    return data[max(1, math.ceil(p * len(data) / 100)) - 1]


@answer
def slo_report(requests: Sequence[dict | None], slo: dict, duration_s: float) -> dict:
    """Goodput, attainment and nearest-rank percentiles of ``requests`` against ``slo`` (chapter 15).

    ``requests``: one item per request sent, ``None`` when it failed or was refused, else
    ``{"ttft": seconds, "tpot": seconds or None}`` (None: a one-token answer). ``slo``:
    ``{"ttft_s": target, "tpot_s": target, "p": percentile}``. A request meets the SLO when it
    completed, its TTFT is at most ``ttft_s`` and its TPOT is None or at most ``tpot_s``.
    Returns ``{"goodput": met / duration_s, "attainment": met / len(requests),
    "ttft_p": p-th percentile of the completed requests' TTFTs, "tpot_p": ... of their TPOTs (None
    if none has one)}``."""
    duration_s = positive_number("duration_s", duration_s)
    if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, Sequence) or not requests:
        raise ValueError(f"requests must be a non-empty list (one item per request sent), got {requests!r:.100}")
    missing = {"ttft_s", "tpot_s", "p"} - set(slo) if isinstance(slo, dict) else {"ttft_s", "tpot_s", "p"}
    if missing:
        raise ValueError(f"slo must be a dict with keys ttft_s, tpot_s and p; missing {sorted(missing)}")
    if not 0 <= slo["p"] <= 100:
        raise ValueError(f"slo['p'] is a percentile, from 0 to 100; got {slo['p']!r}")
    done = [r for r in requests if r is not None]
    met = [r for r in done if r["ttft"] <= slo["ttft_s"] and (r["tpot"] is None or r["tpot"] <= slo["tpot_s"])]
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "goodput": len(met) / duration_s,
        "attainment": len(met) / len(requests),
        "ttft_p": _nearest_rank([r["ttft"] for r in done], slo["p"]) if done else None,
        "tpot_p": _nearest_rank(tpots, slo["p"]) if tpots else None,
    }


def request_latencies(summary: dict) -> list[dict | None]:
    """The per-request input of :func:`slo_report` from a :func:`labsupport.bench_serving.run_benchmark`
    summary: ``None`` for a failed request, else its TTFT and TPOT (chapter 03's definitions)."""
    out = []
    for r in summary["requests"]:
        times = r["chunk_times_s"]
        if r["error"] is not None or not times:
            out.append(None)
            continue
        n = r["output_tokens"]
        tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
        out.append({"ttft": times[0] - r["sent_s"], "tpot": tpot})
    return out


# --- a running server: metrics, sweeps, bursts -----------------------------------------------------


def scrape_metrics(url: str, timeout_s: float = 10.0) -> dict:
    """Every sample of ``url``'s ``/metrics`` page (``url`` without ``/v1``), parsed with
    ``prometheus_client.parser``: ``{(sample name, frozenset of labels): value}``."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """One sample's value from :func:`scrape_metrics` (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def histogram_quantile(samples: dict, name: str, q: float, before: dict | None = None) -> float | None:
    """The ``q`` quantile (0 to 1) of histogram ``name`` as Prometheus's ``histogram_quantile``
    estimates it (:func:`labsupport.prometheus.bucket_quantile`): find the bucket where the cumulative
    count reaches ``q`` of the total and interpolate linearly inside it (the lowest bucket from 0; in
    the ``+Inf`` bucket, the largest finite bound). With ``before``, of the observations made since
    that scrape (:func:`labsupport.prometheus.histogram_quantile_between`). None if empty."""
    after = bucket_counts(samples, name)
    if not after:
        return None
    start = bucket_counts(before, name) if before is not None else dict.fromkeys(after, 0.0)
    start = {le: start.get(le, 0.0) for le in after}
    value = bucket_quantile(q, [(le, counter_increase(start[le], after[le])) for le in after])
    return None if math.isnan(value) else value


class MetricsSampler:
    """Scrape ``url``'s ``/metrics`` every ``interval_s`` in a background thread while in a ``with``
    block; ``series`` is a list of ``(seconds since start, samples)``."""

    def __init__(self, url: str, interval_s: float = 0.2):
        self.url, self.interval_s = url, interval_s
        self.series: list[tuple[float, dict]] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.series.append((time.perf_counter() - start, scrape_metrics(self.url)))
            except httpx.HTTPError:
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MetricsSampler:
        self._thread = threading.Thread(target=self._run, daemon=True, name="MetricsSampler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, name: str) -> float:
        """The largest value of gauge ``name`` seen."""
        return max((metric(s, name) for _, s in self.series), default=0.0)


def load_sweep(server, rates: Sequence[float], *, num_prompts: int = 16, input_words: int = 8,
               output_tokens: int = 8, seed: int = 0, interval_s: float = 0.1) -> list[dict]:
    """Run :func:`labsupport.bench_serving.run_benchmark` at each rate (Poisson arrivals) against
    ``server`` (a :class:`labsupport.serve.ServerProcess`) while scraping its ``/metrics``. One row
    per rate: the rate, the benchmark's summary, the per-request latencies (:func:`request_latencies`),
    the peak running and waiting requests the scrapes saw, and the server's own TTFT p90 from its
    histogram over the run (:func:`histogram_quantile`)."""
    rows = []
    for rate in rates:
        before = scrape_metrics(server.url)
        with MetricsSampler(server.url, interval_s) as sampler:
            summary = run_benchmark(server.base_url, "course-tiny", num_prompts=num_prompts, request_rate=rate,
                                    input_words=input_words, output_tokens=output_tokens, seed=seed)
        after = scrape_metrics(server.url)
        rows.append({
            "rate": rate, "summary": summary, "latencies": request_latencies(summary),
            "peak_running": sampler.peak("course:num_requests_running"),
            "peak_waiting": sampler.peak("course:num_requests_waiting"),
            "server_ttft_p90": histogram_quantile(after, "course:time_to_first_token_seconds", 0.9, before),
            "scrapes": len(sampler.series),
        })
    return rows


def knee_rate(rates: Sequence[float], latencies: Sequence[float], limit: float) -> float | None:
    """The knee of a latency-against-load curve, by this convention: the lowest rate whose latency is
    above ``limit`` (chapter 15's lab takes the unloaded TTFT plus one whole service time: the
    request at that percentile waited behind at least one other). None if no rate gets there."""
    if len(rates) != len(latencies) or not rates:
        raise ValueError("rates and latencies must be non-empty lists of the same length")
    return next((r for r, lat in sorted(zip(rates, latencies)) if lat > limit), None)


async def _burst(base_url: str, n: int, max_tokens: int, timeout_s: float) -> list[dict]:
    url = base_url.rstrip("/") + "/completions"
    prompts = random_prompts(n, 8, seed=1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(prompt: str) -> dict:
            out = {"status": None, "retry_after": None, "answered_s": None, "tokens": 0, "finish_reason": None,
                   "done": False}
            body = {"model": "course-tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            async with client.stream("POST", url, json=body) as response:
                out["status"] = response.status_code
                out["answered_s"] = time.perf_counter() - start
                out["retry_after"] = response.headers.get("retry-after")
                if response.status_code != 200:
                    await response.aread()
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out["done"] = True
                        break
                    choice = json.loads(line[6:])["choices"][0]
                    out["tokens"] += 1
                    out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
            out["finished_s"] = time.perf_counter() - start
            return out

        return await asyncio.gather(*(one(p) for p in prompts))


def burst(base_url: str, n: int, max_tokens: int = 16, timeout_s: float = 60.0) -> list[dict]:
    """Send ``n`` streamed completions at once (no retries) and return, for each: the HTTP
    ``status``, the ``retry_after`` header, ``answered_s`` (seconds from the burst to the response's
    headers), and for admitted ones the ``tokens`` received, the ``finish_reason`` and ``done``
    (the stream ended with ``[DONE]``)."""
    n = positive_int("n", n)
    return _run_sync(_burst(base_url, n, max_tokens, timeout_s))
