"""The serving benchmark client: arrival times, the summary's arithmetic, and a real run against
the course server with the continuous engine."""

from __future__ import annotations

import math
import statistics

import httpx
import pytest

from labsupport.bench_serving import (
    RequestResult,
    _one,
    _run_sync,
    arrival_times,
    format_summary,
    main,
    random_prompts,
    run_benchmark,
    summarize_results,
)
from labsupport.serve import ServerProcess


def test_poisson_arrivals_have_the_rate_asked_and_burstiness_sets_the_spread():
    n, rate = 4000, 4.0
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_times(n, rate, burstiness, seed=3)
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean, cv = statistics.fmean(gaps), statistics.pstdev(gaps) / statistics.fmean(gaps)
        sigma = (1 / rate) / math.sqrt(burstiness) / math.sqrt(len(gaps))  # std of the mean gap
        assert abs(mean - 1 / rate) < 6 * sigma
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)  # gamma: CV = 1/sqrt(shape)
    assert t[0] == 0 and arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(50, 2.0, seed=1) == arrival_times(50, 2.0, seed=1) != arrival_times(50, 2.0, seed=2)
    for bad in ((0, 1.0), (5, 0.0), (5, -1.0)):
        with pytest.raises(ValueError):
            arrival_times(*bad)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(5, 1.0, 0.0)


def test_prompts_are_seeded_and_of_the_length_asked():
    a = random_prompts(3, 7, seed=0)
    assert a == random_prompts(3, 7, seed=0) and len(set(a)) == 3
    assert all(len(p.split()) == 7 for p in a)


def test_summary_arithmetic():
    results = [
        RequestResult(0.0, [1.0, 1.5, 2.0], output_tokens=3),  # TTFT 1, TPOT 0.5, E2E 2
        RequestResult(1.0, [1.5, 3.5], output_tokens=5),  # chunks of several tokens: TPOT = 2 / 4
        RequestResult(2.0, [2.25], output_tokens=1),  # one token: no TPOT, no ITL
        RequestResult(2.0, error="HTTP 429: full"),
    ]
    s = summarize_results(results)
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == ["HTTP 429: full"]
    assert s["duration_s"] == 3.5 and s["output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(3 / 3.5) and s["output_throughput"] == pytest.approx(9 / 3.5)
    assert s["ttft_s"]["p50"] == 0.5 and s["ttft_s"]["p99"] == 1.0  # values 1, 0.5, 0.25: nearest rank
    assert sorted([s["tpot_s"]["p50"], s["tpot_s"]["p99"]]) == [0.5, 0.5]
    assert s["itl_s"]["p99"] == 2.0 and s["itl_s"]["p50"] == 0.5  # gaps 0.5, 0.5, 2.0
    assert s["e2e_s"]["mean"] == pytest.approx((2.0 + 2.5 + 0.25) / 3)
    assert "TTFT (ms)" in format_summary(s)
    with pytest.raises(RuntimeError, match="no request succeeded"):
        summarize_results([RequestResult(0.0, error="boom")])


def test_against_the_course_server(capsys):
    with ServerProcess(["--engine", "continuous", "--context", "128", "--max-tokens-limit", "16",
                        "--num-blocks", "64", "--block-size", "8"], threads=1) as server:
        s = run_benchmark(server.base_url, "course-tiny", num_prompts=8, request_rate=50.0, input_words=12,
                          output_tokens=8, seed=1)
        assert s["completed"] == 8 and s["failed"] == 0
        assert all(0 < r["output_tokens"] <= 8 for r in s["requests"])
        assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
        assert s["output_throughput"] > 0 and s["settings"]["request_rate"] == 50.0
        assert server.health()["served"] == 8
        assert main(["--base-url", server.base_url, "--model", "no-such-model", "--num-prompts", "2"]) == 2
        assert "no request succeeded" in capsys.readouterr().err and "model_not_found" in s_err(server)


def s_err(server) -> str:
    """The error a wrong model name gets, as the benchmark records it."""

    async def go():
        result = RequestResult(0.0)
        async with httpx.AsyncClient() as client:
            body = {"model": "nope", "prompt": "a", "stream": True}
            await _one(client, server.base_url + "/completions", body, result)
        return result.error

    return _run_sync(go())  # a fresh thread where this worker's thread has an event loop marked running
