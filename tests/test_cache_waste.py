"""labsupport.cache_waste: the day of requests and the waste of each way of reserving the cache."""

import numpy as np
import pytest

from labsupport.cache_waste import _diurnal_rate, concurrent_usage, day_of_requests, waste_over_life


def _requests(prompt, output):
    return {"prompt": np.array(prompt), "output": np.array(output), "arrival_s": np.zeros(len(prompt))}


def test_waste_by_hand():
    # One request: a 10-token prompt, 2 output tokens, so its two decode steps hold 11 and 12 tokens.
    w = waste_over_life(_requests([10], [2]), max_len=100, max_tokens=5, block_sizes=(1, 4))
    assert w["max_len"] == pytest.approx(1 - 23 / 200)
    assert w["prompt+max_tokens"] == pytest.approx(1 - 23 / 30)
    assert w["paged_1"] == pytest.approx(0.0)
    assert w["paged_4"] == pytest.approx(1 - 23 / 24)  # 3 blocks of 4 at both steps


def test_the_output_limit_reservation_is_capped_at_the_context_limit():
    # prompt 98 + max_tokens 5 would pass max_len 100: the slab is 100 tokens, not 103.
    w = waste_over_life(_requests([98], [2]), max_len=100, max_tokens=5, block_sizes=())
    assert w["prompt+max_tokens"] == pytest.approx(1 - (99 + 100) / 200)
    assert w["prompt+max_tokens"] == pytest.approx(w["max_len"])


def test_day_of_requests_respects_the_limits_and_the_seed():
    a = day_of_requests(2000, max_len=4096, max_tokens=512, seed=3)
    b = day_of_requests(2000, max_len=4096, max_tokens=512, seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["prompt"].min() >= 1 and a["output"].min() >= 1
    assert a["output"].max() <= 512
    assert (a["prompt"] + a["output"]).max() <= 4096
    assert np.all(np.diff(a["arrival_s"]) >= 0) and a["arrival_s"].max() < 24 * 3600


def test_the_daily_cycle_peaks_at_four_times_its_trough():
    assert _diurnal_rate(np.array(16.0)) / _diurnal_rate(np.array(4.0)) == pytest.approx(4.0)


def test_waste_orders_the_schemes():
    w = waste_over_life(day_of_requests(500, seed=1), block_sizes=(1, 16, 256))
    assert w["max_len"] > w["prompt+max_tokens"] > w["paged_256"] > w["paged_16"] > w["paged_1"] == 0


def test_concurrent_usage_paged_never_below_held_nor_above_reserved():
    u = concurrent_usage(day_of_requests(300, seed=2), sample_s=600.0)
    assert np.all(u["paged"] >= u["held"]) and np.all(u["paged"] <= u["reserved"])
