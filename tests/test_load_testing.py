"""labsupport.load_testing: the arithmetic exactly, and the load-test helpers against a real server."""

from __future__ import annotations

import math
import random
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from labsupport.load_testing import (
    SlowService,
    burst,
    closed_loop,
    closed_loop_latencies,
    diurnal_rate,
    fifo_latencies,
    histogram_quantile,
    knee_rate,
    load_sweep,
    metric,
    open_loop,
    poisson_arrivals,
    request_latencies,
    scrape_metrics,
    slo_report,
)
from labsupport.serve import ServerProcess


def test_poisson_arrivals_start_at_zero_and_have_the_rate():
    times = poisson_arrivals(20001, 5.0, random.Random(0))
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 20000 == pytest.approx(0.2, rel=0.03)
    assert poisson_arrivals(5, 5.0, random.Random(1)) == poisson_arrivals(5, 5.0, random.Random(1))
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0, random.Random(0))


def test_fifo_latencies_with_and_without_a_stall():
    assert fifo_latencies([0, 0, 0], 1.0) == [1.0, 2.0, 3.0]
    assert fifo_latencies([0, 5, 10], 1.0) == [1.0, 1.0, 1.0]
    # a request that would be served during the stall (2 to 4 s) waits for its end
    assert fifo_latencies([0, 2.5, 3.0], 1.0, stall=(2.0, 2.0)) == [1.0, 2.5, 3.0]


def test_a_closed_loop_records_a_stall_once():
    lat = closed_loop_latencies(10.0, 0.1, stall=(3.0, 2.0))
    slow = [x for x in lat if x > 0.1 + 1e-9]
    assert len(slow) == 1 and 2.0 < slow[0] <= 2.1 + 0.1 + 1e-9  # the stall, and at most one service time before it
    opened = fifo_latencies([i * 0.05 for i in range(200)], 0.01, stall=(3.0, 2.0))
    assert sum(x > 0.011 for x in opened) >= 40  # every arrival in the stall waits


def test_diurnal_rate_mean_and_peak():
    hours = [h / 10 for h in range(240)]
    assert sum(diurnal_rate(h, 10.0) for h in hours) / len(hours) == pytest.approx(10.0)
    assert diurnal_rate(14, 10.0, 1.5) == pytest.approx(15.0) and diurnal_rate(2, 10.0, 1.5) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        diurnal_rate(0, 1.0, 3.0)


def test_histogram_quantile_interpolates_like_prometheus():
    registry = CollectorRegistry()
    h = Histogram("x_seconds", "test", buckets=(0.1, 0.2, 0.4), registry=registry)
    for v in (0.05, 0.15, 0.15, 0.3):
        h.observe(v)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    # rank 0.5 * 4 = 2 falls in (0.1, 0.2], which holds observations 2 and 3: 0.1 + 0.1 * (2 - 1) / 2
    assert histogram_quantile(samples, "x_seconds", 0.5) == pytest.approx(0.15)
    assert histogram_quantile(samples, "x_seconds", 1.0) == pytest.approx(0.4)
    h.observe(5.0)  # beyond the last bound: Prometheus answers the largest finite bound
    samples2 = {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert histogram_quantile(samples2, "x_seconds", 0.99) == pytest.approx(0.4)
    assert histogram_quantile(samples2, "x_seconds", 0.5, before=samples2) is None  # nothing since


def test_knee_rate_and_slo_report():
    assert knee_rate([4, 1, 2, 3], [0.9, 0.1, 0.2, 0.5], limit=0.3) == 3
    assert knee_rate([1, 2], [0.1, 0.2], limit=1.0) is None
    requests = [{"ttft": 0.1, "tpot": 0.01}, {"ttft": 0.5, "tpot": None}, None, {"ttft": 0.2, "tpot": 0.09}]
    report = slo_report(requests, {"ttft_s": 0.5, "tpot_s": 0.05, "p": 50}, 2.0)
    assert report == {"goodput": 1.0, "attainment": 0.5, "ttft_p": 0.2, "tpot_p": 0.01}


def test_slo_report_edge_cases():
    requests = [{"ttft": t, "tpot": None} for t in (0.3, 0.1, 0.2)] + [None]
    lowest = slo_report(requests, {"ttft_s": 0.25, "tpot_s": 0.05, "p": 0}, 1.0)
    assert lowest["ttft_p"] == 0.1 and lowest["tpot_p"] is None  # p0: the smallest; no TPOT at all
    assert slo_report(requests, {"ttft_s": 0.25, "tpot_s": 0.05, "p": 100}, 1.0)["ttft_p"] == 0.3  # the largest
    refused = slo_report([None, None], {"ttft_s": 1, "tpot_s": 1, "p": 90}, 1.0)
    assert refused == {"goodput": 0.0, "attainment": 0.0, "ttft_p": None, "tpot_p": None}
    with pytest.raises(ValueError, match="non-empty list"):
        slo_report([], {"ttft_s": 1, "tpot_s": 1, "p": 90}, 1.0)
    with pytest.raises(ValueError, match="missing"):
        slo_report(requests, {"ttft_s": 1, "p": 90}, 1.0)
    with pytest.raises(ValueError, match="from 0 to 100"):
        slo_report(requests, {"ttft_s": 1, "tpot_s": 1, "p": 0.9e3}, 1.0)


def test_slow_service_takes_dozens_of_connections_at_once():
    # http.server's default listen backlog (5) drops connections that arrive together on a busy
    # machine, and the client retries a second later; SlowService listens with a deeper one
    with SlowService(0.3) as service:
        start = time.perf_counter()
        open_loop([0.0] * 40, service.send)
        latest = max(service.arrived.values()) - start
    assert len(service.arrived) == 40 and latest < 0.9  # a dropped connection would come back after 1 s


def test_open_and_closed_loops_against_a_slow_service():
    with SlowService(0.3) as service:
        start = time.perf_counter()
        assert open_loop([0.0, 0.05, 0.1, 0.15], service.send) == [{"i": i} for i in range(4)]
        took = time.perf_counter() - start
        assert took < 0.9 and service.max_in_flight >= 3  # overlapping, not one after another
    with SlowService(0.1) as service:
        assert closed_loop(4, service.send, clients=1) == [{"i": i} for i in range(4)]
        assert service.max_in_flight == 1


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--context", "128", "--max-tokens-limit", "32", "--step-delay", "0.01",
                        "--max-requests", "3"], threads=1) as srv:
        yield srv


def test_load_sweep_scrapes_the_server_during_each_run(server):
    before = scrape_metrics(server.url)
    rows = load_sweep(server, [5.0, 40.0], num_prompts=6, output_tokens=4, interval_s=0.05)
    after = scrape_metrics(server.url)
    assert [r["rate"] for r in rows] == [5.0, 40.0]
    for r in rows:
        assert r["scrapes"] >= 2 and r["summary"]["completed"] + r["summary"]["failed"] == 6
        assert len(r["latencies"]) == 6 and r["server_ttft_p90"] is not None
    # 40 per second into 3 slots at about 50 ms a request: the queue filled (seen by the scrapes) or
    # the surplus was refused; every request is accounted for by the server's counters
    fast = rows[1]
    assert fast["peak_running"] + fast["peak_waiting"] >= 2 or fast["summary"]["failed"] > 0
    served = sum(r["summary"]["completed"] for r in rows)
    refused = sum(r["summary"]["failed"] for r in rows)
    delta = {name: metric(after, name, **labels) - metric(before, name, **labels) for name, labels in (
        ("course:request_success_total", {"finished_reason": "length"}),
        ("course:request_rejected_total", {"reason": "server_full"}))}
    stopped = metric(after, "course:request_success_total", finished_reason="stop") - \
        metric(before, "course:request_success_total", finished_reason="stop")
    assert delta["course:request_success_total"] + stopped == served
    assert delta["course:request_rejected_total"] == refused
    assert all(x is None or x["ttft"] > 0 for x in request_latencies(rows[0]["summary"]))


def test_a_burst_beyond_the_slots_gets_fast_429s_and_every_admitted_request_finishes(server):
    answers = burst(server.base_url, 12, max_tokens=8)
    admitted = [a for a in answers if a["status"] == 200]
    refused = [a for a in answers if a["status"] == 429]
    assert len(admitted) + len(refused) == 12 and 1 <= len(admitted) <= 3 + 2  # slots, plus any freed meanwhile
    assert len(refused) >= 12 - 5
    assert all(a["retry_after"] == "1" for a in refused)
    assert all(a["done"] and a["finish_reason"] in ("length", "stop") for a in admitted)
    slowest_refusal = max(a["answered_s"] for a in refused)
    last_done = max(a["finished_s"] for a in admitted)
    assert slowest_refusal < last_done  # a refusal comes back before the admitted work is done
    assert math.isfinite(last_done)
