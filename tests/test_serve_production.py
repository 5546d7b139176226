"""Chapter 15's server features, against a real server in a subprocess, for both engines: the
Prometheus ``/metrics`` endpoint (scraped and parsed with ``prometheus_client.parser``, counts
checked exactly before and after), HTTP 429 with ``Retry-After`` when the slots are full, explicit
cancellation (counted), and a graceful drain on SIGTERM: the admitted stream ends with
``[DONE]``, a new request gets 503, and the process exits 0."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from labsupport.serve import ServerProcess
from labsupport.serve.served_model import MODEL_NAME

SLOTS, DELAY = 2, 0.02  # seconds added per forward pass: a long request stays long on any machine
ENGINES = {"fifo": [], "continuous": ["--engine", "continuous", "--num-blocks", "64", "--block-size", "16"]}


def scrape(url: str) -> dict:
    """``{(sample name, frozenset(labels)): value}`` of every sample ``/metrics`` shows."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get(("course:" + name, frozenset(labels.items())), 0.0)


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.02)


@pytest.fixture(scope="module", params=list(ENGINES))
def server(request):
    with ServerProcess(["--context", "512", "--max-tokens-limit", "400", "--max-requests", SLOTS,
                        "--step-delay", DELAY, *ENGINES[request.param]], threads=1) as srv:
        srv.engine = request.param
        yield srv


def test_metrics_count_one_request_exactly(server):
    wait_for(lambda: server.health()["slots_used"] == 0)
    before = scrape(server.url)
    assert value(before, "slots_total") == SLOTS and value(before, "draining") == 0
    assert value(before, "num_requests_running") == 0 and value(before, "num_requests_waiting") == 0
    if server.engine == "continuous":
        assert value(before, "kv_cache_usage_perc") == 0
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "count me", "max_tokens": 6})
    assert r.status_code == 200
    usage, finish = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    after = scrape(server.url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("generation_tokens_total") == usage["completion_tokens"]
    assert delta("request_success_total", finished_reason=finish) == 1
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert delta("e2e_request_latency_seconds_count") == 1
    # the request took at least its (completion_tokens - 1) delayed steps
    assert delta("e2e_request_latency_seconds_sum") >= DELAY * (usage["completion_tokens"] - 1)
    assert sum(v for (n, _), v in after.items() if n == "course:request_aborted_total") == \
        sum(v for (n, _), v in before.items() if n == "course:request_aborted_total")


def _open_stream(url, max_tokens=400):
    client = httpx.Client(base_url=url, timeout=60)
    response = client.send(client.build_request("POST", "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "hold a slot", "max_tokens": max_tokens, "stream": True}), stream=True)
    assert response.status_code == 200
    return client, response


def test_a_full_server_answers_429_with_retry_after_and_cancel_frees_the_slots(server):
    wait_for(lambda: server.health()["slots_used"] == 0)
    before = scrape(server.url)
    streams = [_open_stream(server.url) for _ in range(SLOTS)]  # 400 tokens at 20 ms: 8 s at least
    try:
        health = server.health()
        assert health["slots_used"] == SLOTS
        busy = scrape(server.url)
        assert value(busy, "slots_used") == SLOTS
        assert value(busy, "num_requests_running") + value(busy, "num_requests_waiting") == SLOTS
        full = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL_NAME, "prompt": "one more", "max_tokens": 2})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        error = full.json()["error"]
        assert error["code"] == "server_full" and error["type"] == "rate_limit_error" and error["message"]
        bad = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": ""})
        assert bad.status_code == 400
        for _, response in streams:  # explicit cancellation, by id, while they run or wait
            rid = response.headers["x-request-id"]
            cancelled = httpx.post(f"{server.url}/v1/requests/{rid}/cancel", timeout=30)
            assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        for _, response in streams:  # each stream still ends properly, early, with vLLM's "abort"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) - 2 < 400
            reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
            assert reasons[-1] == "abort" and reasons[:-1] == [None] * (len(reasons) - 1)
        wait_for(lambda: server.health()["slots_used"] == 0)
    finally:
        for client, response in streams:
            response.close()
            client.close()
    after = scrape(server.url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("request_rejected_total", reason="server_full") == 1
    assert delta("request_rejected_total", reason="400") == 1
    assert delta("request_aborted_total", reason="cancel") == SLOTS
    assert delta("request_aborted_total", reason="client_disconnect") == 0
    assert sum(v for (n, _), v in after.items() if n == "course:request_success_total") == \
        sum(v for (n, _), v in before.items() if n == "course:request_success_total")
    missing = httpx.post(f"{server.url}/v1/requests/cmpl-nosuch/cancel", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_a_dropped_stream_is_counted_as_a_client_disconnect(server):
    wait_for(lambda: server.health()["slots_used"] == 0)
    before = scrape(server.url)
    client, response = _open_stream(server.url)
    next(line for line in response.iter_lines() if line.startswith("data: "))
    response.close()
    client.close()
    wait_for(lambda: server.health()["slots_used"] == 0 and server.health()["in_flight"] == 0)
    after = scrape(server.url)
    assert value(after, "request_aborted_total", reason="client_disconnect") == \
        value(before, "request_aborted_total", reason="client_disconnect") + 1


@pytest.mark.parametrize("engine", list(ENGINES))
def test_sigterm_drains_admitted_streams_refuses_new_ones_and_exits_0(engine):
    srv = ServerProcess(["--max-requests", SLOTS, "--step-delay", DELAY, *ENGINES[engine]], threads=1).start()
    try:
        client, response = _open_stream(srv.url, max_tokens=60)  # about 1.2 s of steps
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        srv.process.send_signal(signal.SIGTERM)
        wait_for(lambda: srv.health()["status"] == "draining")
        refused = httpx.post(srv.url + "/v1/completions", timeout=30,
                             json={"model": MODEL_NAME, "prompt": "too late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        assert httpx.get(srv.url + "/ready", timeout=30).status_code == 503
        metrics = scrape(srv.url)
        assert value(metrics, "draining") == 1 and value(metrics, "request_rejected_total", reason="draining") == 1
        events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")  # it ran to its end
        response.close()
        client.close()
        assert srv.process.wait(30) == 0
    finally:
        srv.stop()


def test_a_drain_timeout_aborts_what_is_left_and_the_server_still_exits_0():
    srv = ServerProcess(["--drain-timeout", "0.5", "--step-delay", DELAY], threads=1).start()
    try:
        assert httpx.get(srv.url + "/ready", timeout=30).json() == {"status": "ready"}
        client, response = _open_stream(srv.url, max_tokens=250)  # 250 tokens at 20 ms: far beyond the timeout
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        r = httpx.post(srv.url + "/admin/drain", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "draining" and r.json()["in_flight"] == 1
        assert httpx.get(srv.url + "/ready", timeout=30).status_code == 503
        events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) - 2 < 250  # aborted, yet the stream ends properly
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"  # and says so, as vLLM does
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        response.close()
        client.close()
        assert srv.process.wait(30) == 0
    finally:
        srv.stop()
