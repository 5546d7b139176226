"""labsupport.gpu_prices: every range names a card the planner knows, is dated and sourced (chapter 14)."""

from __future__ import annotations

import re

import pytest

from labsupport import gpu_prices, hardware


@pytest.mark.parametrize("r", gpu_prices.PRICE_RANGES, ids=lambda r: f"{r.gpu} {r.tier[:20]}")
def test_each_range_is_a_known_card_dated_sourced_and_ordered(r):
    assert r.gpu in hardware.GPUS, f"{r.gpu!r} is not a labsupport.hardware name"
    assert 0 < r.low <= r.high < 100, "US dollars per GPU-hour"
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", r.as_of), r.as_of
    assert r.source.strip() and r.tier.strip()


def test_price_ranges_selects_by_card():
    h100 = gpu_prices.price_ranges("H100 SXM")
    assert h100 and all(r.gpu == "H100 SXM" for r in h100)
    assert len(h100) == sum(r.gpu == "H100 SXM" for r in gpu_prices.PRICE_RANGES)
    assert gpu_prices.price_ranges("no such card") == []
