"""The latency metrics of chapter 03 (labsupport.latency): definitions, edge cases, bad input."""

from __future__ import annotations

import pytest

from labsupport._answers import unguarded
from labsupport.latency import fifo_ttfts, latency_metrics, percentile, summarize, timeline_stages

metrics = unguarded(latency_metrics)


def test_metrics_of_a_stream():
    m = metrics(10.0, [10.5, 10.6, 10.8, 11.1])
    assert m["ttft"] == pytest.approx(0.5)
    assert m["e2e"] == pytest.approx(1.1)
    assert m["itl"] == pytest.approx([0.1, 0.2, 0.3])
    assert m["tpot"] == pytest.approx(0.6 / 3)  # (E2E - TTFT) / (n - 1), the mean ITL
    assert m["tpot"] == pytest.approx(sum(m["itl"]) / len(m["itl"]))


def test_one_token_answer_has_no_tpot_and_no_itl():
    m = metrics(0.0, [0.25])
    assert m == {"ttft": 0.25, "tpot": None, "itl": [], "e2e": 0.25}


@pytest.mark.parametrize("sent, times, match", [
    (0.0, [], "empty"),
    (1.0, [0.5], "before the request was sent"),
    (0.0, [0.2, 0.1], "must not decrease"),
    ("now", [1.0], "sent_s"),
    (0.0, "1,2", "list of timestamps"),
    (0.0, [0.1, float("nan")], r"token_times_s\[1\]"),
])
def test_metrics_refuse_bad_input(sent, times, match):
    with pytest.raises(ValueError, match=match):
        metrics(sent, times)


def test_nearest_rank_percentile():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3, 1, 2], 50) == 2  # ceil(1.5) = 2nd smallest
    assert percentile([5.0], 99) == 5.0 and percentile([4, 8], 0) == 4
    assert percentile([1, 2, 3, 4, 1000], 99) == 1000  # always a measured value, never interpolated
    for bad, match in (([], "non-empty"), ([1], "p must")):
        with pytest.raises(ValueError, match=match):
            percentile(bad, 50 if bad == [] else 101)


def test_summary_shows_the_tail_the_mean_hides():
    s = summarize([0.1] * 98 + [2.0, 3.0])
    assert s.p50 == 0.1 and s.p99 == 2.0 and s.max == 3.0 and s.count == 100
    assert s.mean == pytest.approx((9.8 + 5.0) / 100)


def test_fifo_ttfts_grow_with_the_queue():
    assert fifo_ttfts(3, 1.0, 0.1) == pytest.approx([0.1, 1.1, 2.1])
    with pytest.raises(ValueError, match="n_requests"):
        fifo_ttfts(0, 1.0, 0.1)


def test_timeline_stages_pairs_events_per_token():
    timeline = {"events": [
        {"stage": "arrival", "t": 0.0, "token": None},
        {"stage": "tokenise_start", "t": 0.001, "token": None},
        {"stage": "tokenise_end", "t": 0.002, "token": None},
        {"stage": "queued", "t": 0.002, "token": None},
        {"stage": "scheduled", "t": 0.01, "token": None},
        {"stage": "prefill_start", "t": 0.01, "token": None},
        {"stage": "prefill_end", "t": 0.02, "token": None},
        {"stage": "detokenise_start", "t": 0.021, "token": 0},
        {"stage": "detokenise_end", "t": 0.022, "token": 0},
        {"stage": "decode_start", "t": 0.023, "token": 1},
        {"stage": "decode_end", "t": 0.03, "token": 1},
    ]}
    bars = timeline_stages(timeline)
    assert [(b[0], b[1]) for b in bars] == [("tokenise", None), ("queue", None), ("prefill", None),
                                            ("detokenise", 0), ("decode", 1)]
    assert bars[1][2:] == (0.002, 0.01)
    with pytest.raises(ValueError, match="timeline"):
        timeline_stages({"stages": []})


def test_percentile_rank_has_no_rounding_trap():
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (7, 14, 28, 29, 57, 99)] == [7, 14, 28, 29, 57, 99]
