"""The routing simulation of chapter 14: prefix-aware routing hits more, a popular prefix unbalances it,
and the load bound trades some hits back for balance."""

from __future__ import annotations

import pytest

from labsupport.routing import POLICIES, simulate_routing, zipf_prefixes

KW = dict(replicas=8, cache_prefixes=6, prefix_tokens=2000, suffix_tokens=200, service_ticks=64)


@pytest.fixture(scope="module")
def results():
    prefixes = zipf_prefixes(4000, 64, exponent=1.1, seed=3)
    return {p: simulate_routing(p, prefixes, **KW) for p in POLICIES}


def test_prefix_aware_hits_most_and_round_robin_balances(results):
    rr, ll, pa, bounded = (results[p] for p in POLICIES)
    assert pa.hit_rate > 1.5 * rr.hit_rate and pa.hit_rate > 1.5 * ll.hit_rate
    assert pa.peak_load_ratio > bounded.peak_load_ratio >= ll.peak_load_ratio
    assert rr.hit_rate < bounded.hit_rate <= pa.hit_rate
    assert sum(rr.served) == 4000 and max(rr.served) - min(rr.served) <= 1
    assert all(0 <= r.hit_rate <= 2000 / 2200 for r in results.values())


def test_one_prefix_always_hits_after_its_first_request_on_a_prefix_router():
    result = simulate_routing("prefix-aware", [7] * 100, **KW)
    assert result.hit_rate == pytest.approx(99 * 2000 / (100 * 2200))
    with pytest.raises(ValueError, match="unknown routing policy"):
        simulate_routing("random", [1], **KW)
