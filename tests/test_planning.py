"""The planner (chapter 14): each formula against a case worked by hand, the plan's consistency,
the calibration from chapter 05's H200 run, and clear messages for bad input."""

from __future__ import annotations

import math

import pytest

from labsupport import planning
from labsupport._answers import unguarded
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.hardware import get_gpu
from labsupport.models import get_model

concurrency = unguarded(planning.concurrency)
max_batch = unguarded(planning.max_batch)
replicas_for_rate = unguarded(planning.replicas_for_rate)
cost_per_million_tokens = unguarded(planning.cost_per_million_tokens)
decode_step_time = unguarded(planning.decode_step_time)
max_batch_for_tpot = unguarded(planning.max_batch_for_tpot)
max_batch_in_memory = unguarded(planning.max_batch_in_memory)
time_in_system = unguarded(planning.time_in_system)

M8, M70 = get_model("llama-3.1-8b"), get_model("llama-3.1-70b")
H200 = get_gpu("H200")
# round numbers so that the hand computations below stay readable
HW = dict(bandwidth_gb_s=4000, peak_tflops=1000, bandwidth_efficiency=0.5, compute_efficiency=0.5)


def test_littles_law_by_hand():
    # 0.5 s to the first token, then 99 more tokens at 20 ms: 0.5 + 99 * 0.02 = 2.48 s
    assert time_in_system(0.5, 0.02, 100) == pytest.approx(2.48)
    # 10 requests a second for 2.48 s each: 24.8 in the system on average
    assert concurrency(10, 0.5, 0.02, 100) == pytest.approx(24.8)
    assert concurrency(3, 1.0, 0.05, 1) == pytest.approx(3.0)  # one token: no decode step at all


def test_decode_step_by_hand():
    w = param_count(M8) * 2  # bf16 weights
    kv = kv_bytes_per_token(M8) * 2  # 128 KiB a token
    # batch 4 at 1,000 tokens: bytes over 4000 GB/s x 0.5, plus 1 ms of overhead
    expected_memory = (w + 4 * 1000 * kv / 2) / 2e12
    got = decode_step_time(M8, 4, 1000, step_overhead_s=1e-3, **HW)
    assert got == pytest.approx(expected_memory + 1e-3)
    # two GPUs of tensor parallelism halve the bytes each reads
    got_tp = decode_step_time(M8, 4, 1000, step_overhead_s=1e-3, tensor_parallel=2, **HW)
    assert got_tp == pytest.approx(expected_memory / 2 + 1e-3)
    # fp8 weights (1 byte each) read half the weight bytes
    assert decode_step_time(M8, 1, 0, weight_dtype_bytes=1, **HW) == pytest.approx(w / 2 / 2e12)


def test_decode_step_turns_compute_bound_at_large_batch():
    # with no context, a step reads only the weights; 2N FLOPs per sequence: compute time passes
    # memory time when batch * 2N / (1e15 * 0.5) > 2N / (4e12 * 0.5), at batch 250
    w = param_count(M8) * 2
    assert decode_step_time(M8, 200, 0, **HW) == pytest.approx(w / 2e12)
    assert decode_step_time(M8, 500, 0, **HW) == pytest.approx(500 * 2 * param_count(M8) / 5e14)


def test_max_batch_for_tpot_is_the_largest_meeting_the_target():
    for tpot in (0.015, 0.03, 0.1):
        b = max_batch_for_tpot(M8, 2000, tpot, step_overhead_s=2e-3, **HW)
        assert b >= 1
        assert decode_step_time(M8, b, 2000, step_overhead_s=2e-3, **HW) <= tpot
        assert decode_step_time(M8, b + 1, 2000, step_overhead_s=2e-3, **HW) > tpot
    # the 70B's weights alone take 141 GB / 2 TB/s = 70 ms: a 50 ms target is out of reach on one GPU
    assert max_batch_for_tpot(M70, 1000, 0.05, **HW) == 0
    assert max_batch_for_tpot(M70, 1000, 0.05, tensor_parallel=4, **HW) > 0


def test_max_batch_for_tpot_closed_form():
    # memory-bound, no overhead: (T * BW - W) / (context * kv), rounded down
    w, kv = param_count(M8) * 2, kv_bytes_per_token(M8)
    expected = math.floor((0.05 * 2e12 - w) / (4000 * kv))
    assert max_batch_for_tpot(M8, 4000, 0.05, **HW) == expected


def test_max_batch_in_memory_by_hand():
    # 80 GiB at 90%: (0.9 * 80 * 2**30 - W) / (8192 * 128 KiB)
    w, kv = param_count(M8) * 2, kv_bytes_per_token(M8)
    expected = math.floor((0.9 * 80 * 2**30 - w) / (8192 * kv))
    assert max_batch_in_memory(M8, 8192, memory_gib=80) == expected
    # GiB, not GB: 80e9 bytes would hold fewer sequences
    assert max_batch_in_memory(M8, 8192, memory_gib=80e9 / 2**30) < expected
    # fp8 cache holds twice the sequences (give or take the rounding)
    assert max_batch_in_memory(M8, 8192, memory_gib=80, kv_dtype_bytes=1) in (2 * expected, 2 * expected + 1)
    # the 70B (141 GB of weights) does not fit one 80 GiB GPU; four do
    assert max_batch_in_memory(M70, 8192, memory_gib=80) == 0
    assert max_batch_in_memory(M70, 8192, memory_gib=80, tensor_parallel=4) > 0


def test_max_batch_is_the_smaller_limit():
    kw = dict(memory_gib=80, step_overhead_s=1e-3, **HW)
    by_time = max_batch_for_tpot(M8, 8192, 0.2, step_overhead_s=1e-3, **HW)
    by_memory = max_batch_in_memory(M8, 8192, memory_gib=80)
    assert by_memory < by_time  # a loose target: memory binds
    assert max_batch(M8, 8192, 0.2, **kw) == by_memory
    assert max_batch(M8, 8192, 0.02, **kw) == max_batch_for_tpot(M8, 8192, 0.02, step_overhead_s=1e-3, **HW)


def test_replicas_by_hand():
    # 24.8 requests in flight, 8 a replica: ceil(3.1) = 4
    assert replicas_for_rate(10, 2.48, 8) == 4
    # 30% headroom: 32.24 / 8 = 4.03, so 5
    assert replicas_for_rate(10, 2.48, 8, headroom=0.3) == 5
    # exactly 3 replicas' worth is 3, not 4 (floating point must not round it up)
    assert replicas_for_rate(0.3, 10, 1) == 3
    assert replicas_for_rate(0.001, 1, 64) == 1  # at least one replica
    assert replicas_for_rate(0, 1, 64) == 1  # even with no traffic


def test_cost_by_hand():
    # 8 GPUs at 2.00 an hour serve 1,000 tokens a second: 16 / 3.6e6 tokens an hour = 4.44 per million
    assert cost_per_million_tokens(2.0, 8, 1000) == pytest.approx(16 / 3.6)
    assert cost_per_million_tokens(1.0, 1, 1e6 / 3600) == pytest.approx(1.0)


def test_poisson_quantile_and_headroom():
    # P(N <= 0) = e^-1 = 0.37, P(N <= 1) = 0.74, P(N <= 2) = 0.92, P(N <= 3) = 0.98 for mean 1
    assert [planning.poisson_quantile(1, p) for p in (30, 50, 90, 95, 99)] == [0, 1, 2, 3, 4]
    assert planning.poisson_quantile(1e6, 50) == pytest.approx(1e6, abs=1)
    assert planning.poisson_quantile(1e6, 99) == pytest.approx(1e6 + 2.326 * 1e3, abs=5)
    # the relative headroom shrinks as the concurrency grows (the spread grows as its square root)
    rooms = [planning.burst_headroom(m, 99) for m in (10, 100, 1000)]
    assert rooms[0] > rooms[1] > rooms[2] > 0


def test_prefill_time_by_hand():
    # 2,000 tokens of the 8B: causal FLOPs over 1e15 x 0.5 (compute-bound), plus the overhead
    from labsupport.costs import prefill_flops

    expected = prefill_flops(M8, 2000, causal=True) / 5e14
    assert planning.prefill_time(M8, 2000, step_overhead_s=1e-3, **HW) == pytest.approx(expected + 1e-3)
    # batched with decode steps, a prefill adds only its arithmetic
    assert planning.prefill_compute_time(M8, 2000, peak_tflops=1000, compute_efficiency=0.5) == pytest.approx(expected)
    assert planning.prefill_compute_time(M8, 2000, peak_tflops=1000, compute_efficiency=0.5,
                                         tensor_parallel=2) == pytest.approx(expected / 2)
    # one token is bound by reading the weights
    assert planning.prefill_time(M8, 1, **HW) == pytest.approx(param_count(M8) * 2 / 2e12)


def _plan(**kw):
    base = dict(arrival_rate=20, prompt_tokens=1000, output_tokens=250, ttft_target_s=1.0, tpot_target_s=0.05,
                bandwidth_efficiency=0.7, compute_efficiency=0.5, step_overhead_s=2e-3, gpu_hour_price=4.0)
    base.update(kw)
    return planning.plan(M8, "H200", **base)


def test_plan_is_consistent():
    p = _plan()
    assert p.feasible and p.meets_ttft
    assert p.batch == min(p.batch_for_tpot, p.batch_in_memory) >= 1
    assert p.tpot_s <= p.tpot_target_s  # the interference-inflated step meets the target
    assert p.tpot_s == pytest.approx(p.step_s / (1 - p.prefill_share))
    assert p.concurrency == pytest.approx(20 * p.time_in_system_s)
    assert p.time_in_system_s == pytest.approx(p.prefill_s + 249 * 0.05)
    # replicas carry the load in batches of p.batch; here prefill interference needs more than that
    assert p.replicas >= replicas_for_rate(20, p.time_in_system_s, p.batch, p.headroom)
    assert p.replicas >= 2  # at 20 requests a second, prefill needs a second replica
    fewer = p.replicas - 1  # one replica fewer would prefill so much that its batch could not carry the load
    share = 20 / fewer * p.prefill_compute_s
    assert share >= 1 or replicas_for_rate(20, p.time_in_system_s, max_batch_for_tpot(
        M8, 1125, 0.05 * (1 - share), bandwidth_gb_s=4800, peak_tflops=989.4, bandwidth_efficiency=0.7,
        compute_efficiency=0.5, step_overhead_s=2e-3), p.headroom) > fewer
    assert p.prefill_share == pytest.approx(20 / p.replicas * p.prefill_compute_s)
    assert p.prefill_compute_s < p.prefill_s
    assert p.gpus == p.replicas
    assert 0 < p.utilisation <= 1
    assert p.kv_cache_bytes <= p.memory_budget_bytes - p.weight_bytes
    assert p.memory_budget_bytes == pytest.approx(0.9 * H200.usable_bytes)
    assert p.cost_per_million_output_tokens == pytest.approx(cost_per_million_tokens(4.0, p.gpus, 20 * 250))
    assert p.cost_per_million_tokens == pytest.approx(cost_per_million_tokens(4.0, p.gpus, 20 * 1250))
    assert p.step_context_tokens == 1125 and p.memory_context_tokens == 1250


def test_plan_with_short_prompts_is_set_by_the_batch():
    p = _plan(arrival_rate=100, prompt_tokens=50, output_tokens=500)
    assert p.prefill_share < 0.2
    assert p.replicas == replicas_for_rate(100, p.time_in_system_s, p.batch, p.headroom)


def test_plan_scales_with_load_and_efficiency():
    low, high = _plan(arrival_rate=5), _plan(arrival_rate=200)
    assert high.replicas > low.replicas
    # a lower measured efficiency cannot need fewer GPUs
    assert _plan(arrival_rate=200, bandwidth_efficiency=0.3).gpus >= high.gpus
    # no price, no cost
    assert _plan(gpu_hour_price=None).cost_per_million_output_tokens is None


def test_plan_with_length_samples_uses_the_percentile_for_memory():
    prompts = [100] * 90 + [8000] * 10
    outputs = [200] * 100
    p = _plan(prompt_tokens=prompts, output_tokens=outputs, percentile=95)
    assert p.mean_prompt_tokens == pytest.approx(890)
    assert p.memory_context_tokens == 8200  # the 95th percentile request is a long one
    assert p.step_context_tokens == math.ceil(890 + 100)


def test_plan_weights_the_step_context_by_decode_steps():
    # long answers sit in many more decode steps than short ones: the mean context a step reads is
    # sum((o - 1) * (p + o / 2)) / sum(o - 1), not mean prompt + mean output / 2
    outputs = [10] * 90 + [1000] * 10
    p = _plan(prompt_tokens=100, output_tokens=outputs)
    weighted = (90 * 9 * (100 + 5) + 10 * 999 * (100 + 500)) / (90 * 9 + 10 * 999)
    assert p.step_context_tokens == math.ceil(weighted) == 563
    assert p.step_context_tokens > math.ceil(100 + sum(outputs) / len(outputs) / 2)
    # paired samples: a long prompt with a long answer weighs more
    paired = _plan(prompt_tokens=[100] * 90 + [4000] * 10, output_tokens=outputs)
    assert paired.step_context_tokens == math.ceil((90 * 9 * 105 + 10 * 999 * 4500) / (90 * 9 + 10 * 999))
    # one-token answers have no decode steps: the plain means
    assert _plan(prompt_tokens=100, output_tokens=[1, 1]).step_context_tokens == math.ceil(100 + 0.5)


def test_plan_with_an_explicit_headroom_and_tensor_parallelism():
    p = _plan(arrival_rate=50, headroom=0.5)
    assert p.headroom == 0.5 and not any("Poisson" in n for n in p.notes)
    assert p.replicas >= replicas_for_rate(50, p.time_in_system_s, p.batch, 0.5)
    tp2 = _plan(arrival_rate=50, headroom=0.5, tensor_parallel=2)
    assert tp2.gpus == 2 * tp2.replicas and tp2.memory_budget_bytes == pytest.approx(2 * p.memory_budget_bytes)
    assert tp2.batch_for_tpot > p.batch_for_tpot or tp2.batch_in_memory > p.batch_in_memory


def test_plan_ttft_miss_is_noted():
    p = _plan(prompt_tokens=100_000, output_tokens=10, ttft_target_s=0.05, tpot_target_s=0.5)
    assert not p.meets_ttft and any("TTFT" in n for n in p.notes)


def test_plan_infeasible_says_why():
    p = planning.plan(M70, "H100 SXM", arrival_rate=1, prompt_tokens=1000, output_tokens=100, ttft_target_s=1,
                      tpot_target_s=0.05, bandwidth_efficiency=0.7, compute_efficiency=0.5)
    assert not p.feasible and p.replicas == 0 and p.batch == 0
    assert any("do not fit" in n for n in p.notes)
    p4 = planning.plan(M70, "H100 SXM", arrival_rate=1, prompt_tokens=1000, output_tokens=100, ttft_target_s=1,
                       tpot_target_s=0.05, bandwidth_efficiency=0.7, compute_efficiency=0.5, tensor_parallel=4)
    assert p4.feasible and p4.gpus == 4 * p4.replicas


def test_fit_decode_steps_recovers_a_known_line():
    bytes_read = [1e9, 2e9, 4e9, 8e9]
    seconds = [b / 500e9 + 3e-3 for b in bytes_read]  # 500 GB/s achieved, 3 ms overhead
    cal = planning.fit_decode_steps(bytes_read, seconds, reference_bandwidth_gb_s=1000)
    assert cal.bandwidth_efficiency == pytest.approx(0.5)
    assert cal.step_overhead_s == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="at least two different"):
        planning.fit_decode_steps([1e9, 1e9], [0.1, 0.1], 1000)


def test_h200_calibration_reads_chapter_05():
    results = {
        "dry_run": False, "device": "NVIDIA H200", "date": "2026-11-30",
        "decode_by_batch": [{"batch": 64, "context": 8192, "bytes_read": 80e9, "seconds": 0.025}],
        "decode_by_context": [{"batch": 1, "context": 512, "bytes_read": 16e9, "seconds": 0.02}],
        "decode_batch1_short_cuda_graph": {"seconds": 0.007},
        "prefill": [{"prompt_tokens": p, "tflops_runbook_causal": t} for p, t in ((512, 300.0), (1024, 500.0),
                                                                                   (2048, 550.0))],
    }
    cal = planning.measured_h200_calibration(results)
    # one line through the CUDA-graph step (16 GB in 7 ms) and the largest batch (80 GB in 25 ms):
    # its slope is the achieved bandwidth, its intercept the overhead; nothing is counted twice
    achieved = (80e9 - 16e9) / (0.025 - 0.007)
    assert cal.bandwidth_efficiency == pytest.approx(achieved / 4.8e12)
    assert cal.step_overhead_s == pytest.approx(0.007 - 16e9 / achieved)
    assert 16e9 / achieved + cal.step_overhead_s == pytest.approx(0.007)
    assert 80e9 / achieved + cal.step_overhead_s == pytest.approx(0.025)
    assert cal.compute_efficiency == pytest.approx(500 / 989.4)  # the median prefill rate over the peak
    assert cal.device == "NVIDIA H200" and cal.date == "2026-11-30"
    assert "500.0" not in str(cal) and "51% of 989.4 TFLOP/s" in str(cal)
    assert planning.measured_h200_calibration({}) is None
    real = planning.measured_h200_calibration()  # the committed run, when there is one
    if real is not None:
        assert 0 < real.bandwidth_efficiency < 1 and real.step_overhead_s >= 0
        assert 0 < real.compute_efficiency < 1


def test_the_planner_reproduces_the_h200_steps_it_was_calibrated_on():
    """The committed H200 run: the plan's step (decode_step_time in the bytes a step reads, read_exact)
    at the calibration's efficiency and overhead gives back both measured steps the line was fitted
    through, within 1% (the fit is exact; 1% leaves room for rounding in the results file). The
    runbook's count, which charges the whole embedding table, would not."""
    results = planning.load_gpu_results()
    cal = planning.measured_h200_calibration(results)
    if cal is None:
        pytest.skip("no measured run in results/gpu_phases.json")
    hw = dict(bandwidth_gb_s=H200.hbm_bandwidth / 1e9, peak_tflops=H200.peak_flops / 1e12,
              bandwidth_efficiency=cal.bandwidth_efficiency, compute_efficiency=cal.compute_efficiency,
              step_overhead_s=cal.step_overhead_s)
    largest = max((r for r in results["decode_by_batch"] if r.get("seconds")), key=lambda r: r["batch"])
    graph = results["decode_batch1_short_cuda_graph"]
    short = next(r for r in results["decode_by_context"] if r["batch"] == 1)
    # the run's bytes are the planner's read_exact bytes: the two conventions are one
    for row in (largest, short):
        assert planning.decode_step_time(M8, row["batch"], row["context"], **{**hw, "bandwidth_efficiency": 1.0,
                                         "step_overhead_s": 0.0, "bandwidth_gb_s": 1e-9}, read_exact=True) \
            == pytest.approx(row["bytes_read"], rel=1e-12)
    assert graph["achieved_Bps"] * graph["seconds"] == pytest.approx(short["bytes_read"], rel=1e-9)
    settings = planning.PlanSettings.create(M8, H200, arrival_rate=1, prompt_tokens=100, output_tokens=10,
                                            ttft_target_s=1, tpot_target_s=0.05,
                                            bandwidth_efficiency=cal.bandwidth_efficiency,
                                            compute_efficiency=cal.compute_efficiency,
                                            step_overhead_s=cal.step_overhead_s)
    for row, measured in ((largest, largest["seconds"]), (short, graph["seconds"])):
        planned = planning.decode_step_time(M8, row["batch"], row["context"], **hw, read_exact=True)
        assert planned == pytest.approx(measured, rel=0.01)
        assert settings.step_time(row["batch"], row["context"]) == planned  # the step plan() prices
    assert planning.decode_step_time(M8, largest["batch"], largest["context"], **hw) > 1.005 * largest["seconds"]


def test_plan_averages_a_convex_prefill_over_sampled_prompts():
    prompts = [100] * 9 + [20_000]
    p = _plan(prompt_tokens=prompts, output_tokens=100)
    at_mean = _plan(prompt_tokens=sum(prompts) / len(prompts), output_tokens=100)
    each = [planning.prefill_compute_time(M8, n, peak_tflops=989.4, compute_efficiency=0.5) for n in prompts]
    assert p.prefill_compute_s == pytest.approx(sum(each) / len(each))
    assert p.prefill_compute_s > at_mean.prefill_compute_s  # attention's quadratic term: mean cost > cost of mean


def test_plan_notes_what_it_does_not_model():
    p = _plan()
    assert any("mean TPOT" in n for n in p.notes) and any("upper bound" in n for n in p.notes)
    assert not any("all-reduce" in n for n in p.notes)
    assert any("all-reduces between the 2 GPUs" in n for n in _plan(tensor_parallel=2).notes)


def test_plan_prices_the_fleet_at_saturation():
    p = _plan()
    assert p.cost_per_million_tokens_at_saturation == pytest.approx(p.cost_per_million_tokens * p.utilisation)
    assert p.cost_per_million_output_tokens_at_saturation == pytest.approx(
        p.cost_per_million_output_tokens * p.utilisation)
    assert p.cost_per_million_tokens_at_saturation < p.cost_per_million_tokens
    assert _plan(gpu_hour_price=None).cost_per_million_tokens_at_saturation is None


def test_fp8_matmuls_run_at_twice_the_bf16_peak_on_hopper():
    assert H200.fp8_peak_flops == pytest.approx(2 * H200.peak_flops, rel=1e-3)
    bf16 = _plan(weight_dtype_bytes=1)
    fp8 = _plan(weight_dtype_bytes=1, fp8_compute=True)
    assert fp8.matmul_peak_flops == H200.fp8_peak_flops and bf16.matmul_peak_flops == H200.peak_flops
    assert fp8.prefill_compute_s == pytest.approx(bf16.prefill_compute_s * H200.peak_flops / H200.fp8_peak_flops)
    with pytest.raises(ValueError, match="FP8 tensor cores"):
        planning.plan(M8, "A100 80GB", arrival_rate=1, prompt_tokens=100, output_tokens=10, ttft_target_s=1,
                      tpot_target_s=0.05, bandwidth_efficiency=0.5, compute_efficiency=0.5, fp8_compute=True)


def test_plan_settings_are_checked_once_and_frozen():
    s = planning.PlanSettings.create(M8, "h200", arrival_rate=20, prompt_tokens=[100, 300], output_tokens=250,
                                     ttft_target_s=1, tpot_target_s=0.05, bandwidth_efficiency=0.7,
                                     compute_efficiency=0.5)
    assert s.card is H200 and s.prompt_samples == (100, 300) and s.mean_prompt == 200
    with pytest.raises(AttributeError):
        s.arrival_rate = 5  # frozen
    assert planning.plan_from(s) == planning.plan(M8, H200, arrival_rate=20, prompt_tokens=[100, 300],
                                                  output_tokens=250, ttft_target_s=1, tpot_target_s=0.05,
                                                  bandwidth_efficiency=0.7, compute_efficiency=0.5)


@pytest.mark.parametrize("call, match", [
    (lambda: concurrency(-1, 0.5, 0.02, 10), "arrival_rate"),
    (lambda: concurrency(1, 0.5, 0.02, 0.5), "output_tokens must be at least 1"),
    (lambda: concurrency(1, "fast", 0.02, 10), "ttft_s must be a number"),
    (lambda: max_batch_for_tpot(M8, 100, 0.05, **{**HW, "bandwidth_efficiency": 70}), "fraction"),
    (lambda: max_batch_for_tpot(M8, 100, 0, **HW), "tpot_s"),
    (lambda: max_batch_in_memory(M8, 100, memory_gib=80, memory_utilization=1.5), "memory_utilization"),
    (lambda: max_batch_in_memory(M8, 100, memory_gib=80, tensor_parallel=0), "tensor_parallel"),
    (lambda: replicas_for_rate(1, 1, 0), "batch_per_replica"),
    (lambda: replicas_for_rate(1, 1, 4, headroom=-0.1), "headroom"),
    (lambda: cost_per_million_tokens(0, 1, 100), "gpu_hour_price"),
    (lambda: cost_per_million_tokens(2, 1.5, 100), "gpu_count must be an integer"),
    (lambda: _plan(prompt_tokens="long"), "prompt_tokens must be a mean length"),
    (lambda: _plan(percentile=100), "percentile"),
    (lambda: _plan(headroom=-1), "headroom"),
    (lambda: _plan(gpu_hour_price=0), "gpu_hour_price"),
    (lambda: _plan(output_tokens=[]), "output_tokens must be a mean length"),
    (lambda: _plan(fp8_compute="yes"), "fp8_compute must be True or False"),
    (lambda: planning.poisson_quantile(0, 50), "mean"),
    (lambda: planning.fit_decode_steps([1e9, 2e9], [0.1], 1000), "as many times"),
    (lambda: planning.plan(M8, "H900", arrival_rate=1, prompt_tokens=1, output_tokens=1, ttft_target_s=1,
                           tpot_target_s=1, bandwidth_efficiency=0.5, compute_efficiency=0.5), "unknown GPU"),
])
def test_bad_input_is_refused_with_a_clear_message(call, match):
    with pytest.raises(ValueError, match=match):
        call()
