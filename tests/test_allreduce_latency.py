"""The all-reduce cost model of chapter 11: each algorithm's rounds and bytes, by hand, and where the
small-message regime ends."""

from __future__ import annotations

import pytest

from labsupport import allreduce_latency as ar

ALPHA, BETA = 3e-6, 450e9  # a synchronisation, NVLink's rate each way on an H100 SXM


@pytest.mark.parametrize("algorithm, rounds, moved", [("ring", 14, 2 * 7 / 8), ("one-shot", 1, 7), ("two-shot", 2, 2 * 7 / 8),
                                                      ("nvls", 1, 1)])
def test_rounds_and_bytes_by_hand(algorithm, rounds, moved):
    cost = ar.allreduce_cost(algorithm, 1e6, 8, alpha_s=ALPHA, link_bytes_per_s=BETA)
    assert cost.rounds == rounds and cost.link_bytes == pytest.approx(moved * 1e6)
    assert cost.seconds == pytest.approx(rounds * ALPHA + moved * 1e6 / BETA)


def test_decode_messages_are_latency_bound_and_large_ones_bandwidth_bound():
    small = ar.decode_allreduce_bytes(8192, 8)  # Llama 3.1 70B, batch 8, bf16: 128 KiB
    assert small == 128 * 1024
    ring = ar.allreduce_cost("ring", small, 8, alpha_s=ALPHA, link_bytes_per_s=BETA)
    assert ring.latency_share > 0.9
    assert ar.cheapest(small, 8, alpha_s=ALPHA, link_bytes_per_s=BETA).algorithm == "one-shot"
    big = ar.cheapest(256 * 2**20, 8, alpha_s=ALPHA, link_bytes_per_s=BETA)
    assert big.algorithm in ("ring", "two-shot") and big.latency_share < 0.01


def test_vllm_thresholds():
    assert ar.vllm_custom_choice(10**7, 2) == "one-shot"
    assert ar.vllm_custom_choice(500 * 1024, 4) == "one-shot" and ar.vllm_custom_choice(512 * 1024, 4) == "two-shot"
    assert ar.vllm_custom_choice(255 * 1024, 8) == "one-shot" and ar.vllm_custom_choice(256 * 1024, 8) == "two-shot"


@pytest.mark.parametrize("kw, match", [(dict(algorithm="tree"), "unknown all-reduce"), (dict(world_size=1), "at least 2"),
                                       (dict(message_bytes=0), "message_bytes")])
def test_bad_input(kw, match):
    args = {"algorithm": "ring", "message_bytes": 1e3, "world_size": 4, **kw}
    with pytest.raises(ValueError, match=match):
        ar.allreduce_cost(args["algorithm"], args["message_bytes"], args["world_size"], alpha_s=ALPHA,
                          link_bytes_per_s=BETA)
