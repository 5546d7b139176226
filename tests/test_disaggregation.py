"""Disaggregation arithmetic (chapters 11 and 14): the KV transfer, data-parallel attention, and the two
pools' sizes against the colocated plan."""

from __future__ import annotations

import pytest

from labsupport import disaggregation as dg
from labsupport import planning
from labsupport._answers import unguarded
from labsupport.costs import kv_bytes_per_token
from labsupport.models import get_model

M8 = get_model("llama-3.1-8b")


def test_transfer_is_the_prompts_cache():
    assert dg.kv_transfer_bytes(M8, 1000) == 1000 * kv_bytes_per_token(M8, 2) == 1000 * 128 * 1024
    assert dg.kv_transfer_time(M8, 1000, 50e9) == pytest.approx(1000 * 128 * 1024 / 50e9)
    assert dg.kv_transfer_bytes(M8, 1000, kv_dtype_bytes=1) == 500 * 128 * 1024


def test_data_parallel_attention_holds_each_token_once():
    # DeepSeek-V3's latent: 512 + 64 numbers per token per layer, 61 layers, one latent (no heads to split)
    mla_tp = dg.kv_bytes_per_gpu(576, 61, gpus=8, kv_heads=None)
    mla_dp = dg.kv_bytes_per_gpu(576, 61, gpus=8, kv_heads=None, data_parallel_attention=True)
    assert mla_tp == 576 * 61 * 2 and mla_tp == 8 * mla_dp
    # 8 KV heads over 16 GPUs: each head on two GPUs; over 8 GPUs, no repetition
    gqa = 2 * 8 * 128
    assert dg.kv_bytes_per_gpu(gqa, 80, gpus=16, kv_heads=8) == 2 * dg.kv_bytes_per_gpu(gqa, 80, gpus=16, kv_heads=8,
                                                                                         data_parallel_attention=True)
    assert dg.kv_bytes_per_gpu(gqa, 80, gpus=8, kv_heads=8) == dg.kv_bytes_per_gpu(gqa, 80, gpus=8, kv_heads=8,
                                                                                   data_parallel_attention=True)


def _settings(**kw):
    base = dict(arrival_rate=30, prompt_tokens=6000, output_tokens=200, ttft_target_s=1.0, tpot_target_s=0.03,
                bandwidth_efficiency=0.8, compute_efficiency=0.55, step_overhead_s=0.003)
    return planning.PlanSettings.create(M8, "H200", **{**base, **kw})


def test_the_decode_pool_gets_the_whole_tpot_budget():
    s = _settings()
    fleet = dg.disaggregated_fleet(s)
    colocated = unguarded(planning.size_fleet)(s)
    step_context, memory_context, _ = s.contexts()
    assert fleet["decode_batch"] == min(s.batch_for_tpot(step_context, s.tpot_target_s), s.batch_in_memory(memory_context))
    assert fleet["decode_batch"] > colocated["batch"]  # no prefill share to take out of the budget
    assert 0 < fleet["prefill_busy"] <= 0.7 and fleet["gpus"] == fleet["prefill_replicas"] + fleet["decode_replicas"]
    alone = s.mean_prefill(lambda p: s.prefill_alone_s(p))
    assert fleet["prefill_replicas"] * 0.7 >= s.arrival_rate * alone > (fleet["prefill_replicas"] - 1) * 0.7
    assert dg.disaggregated_fleet(_settings(prefix_hit_rate=0.8))["prefill_replicas"] < fleet["prefill_replicas"]


def test_no_pool_when_one_sequence_misses_the_target():
    fleet = dg.disaggregated_fleet(_settings(tpot_target_s=0.002))
    assert fleet["gpus"] == fleet["decode_batch"] == 0
    with pytest.raises(ValueError, match="prefill_utilization"):
        dg.disaggregated_fleet(_settings(), prefill_utilization=1.5)
