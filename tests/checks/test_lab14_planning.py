"""Lab 14's planner checks pass correct functions and reject each planted mistake with a message that
names it; a stub that still raises NotImplementedError fails as "not done"; the course's answers are
refused."""

from __future__ import annotations

import math

import pytest

from labsupport import planning
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_concurrency, check_cost, check_max_batch, check_replicas
from labsupport.checks import lab14_planning as lab
from labsupport.costs import param_count


def fails(check, fn, *needles, reason="failed"):
    with pytest.raises(CheckFailed) as info:
        check(fn)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert info.value.reason == reason
    return message


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


# --- Little's law ---------------------------------------------------------------------------------


def planted_concurrency(*, drop_output=False, drop_ttft=False, all_steps=False, tpot_scale=1.0, scale=1.0,
                        divide=False, whole=None):
    def concurrency(arrival_rate, ttft_s, tpot_s, output_tokens):
        steps = output_tokens if all_steps else output_tokens - 1
        t = (0 if drop_ttft else ttft_s) + (0 if drop_output else steps * tpot_s * tpot_scale)
        value = (t / arrival_rate if divide else arrival_rate * t) * scale
        return whole(value) if whole else value

    return concurrency


def test_concurrency_passes():
    check_concurrency(planted_concurrency())


@pytest.mark.parametrize("flags, needle", [
    (dict(drop_output=True), "output tokens are left out"),
    (dict(drop_ttft=True), "TTFT is left out"),
    (dict(all_steps=True), "output_tokens - 1"),
    (dict(tpot_scale=1e-3), "read as milliseconds"),
    (dict(scale=1e3), "converted to milliseconds"),
    (dict(divide=True), "divided by the arrival rate"),
    # a mean rounded to a whole number of requests (the red team's concurrency_wrong_ceil): its 25 for 24.8 is
    # also what counting every output token as a step gives, so the message names both
    (dict(whole=math.ceil), "rounded up to a whole number (Little's L is a mean"),
    (dict(whole=round), "rounded to a whole number"),
])
def test_concurrency_mistakes(flags, needle):
    fails(check_concurrency, planted_concurrency(**flags), needle)


def test_concurrency_counting_requests_as_tokens():
    fails(check_concurrency, lambda rate, ttft, tpot, out: rate * out, "each output token is counted as a request")


def test_concurrency_stub_and_answer():
    fails(check_concurrency, stub, "NotImplementedError", reason="not done")
    fails(check_concurrency, planning.concurrency, "the course's own answer")
    fails(check_concurrency, lambda *a: planning.concurrency(*a), "the course's own answer")
    # time_in_system is part of the answer too
    fails(check_concurrency, lambda rate, ttft, tpot, out: rate * planning.time_in_system(ttft, tpot, out),
          "the course's own answer")


# --- the largest batch ----------------------------------------------------------------------------


def planted_batch(*, heads=False, memory_unit=2**30, bandwidth_unit=1e9, kv_bytes=None, weight_bytes=None, bits=False,
                  kv_factor=2, overhead_scale=1.0, efficiency=True, compute=True, memory_limit=True, time_limit=True,
                  utilization=True, tp_time=True, tp_memory=True, first_miss=False, derived_head_dim=False):
    """max_batch written in closed form (the check's reference searches), one step optionally wrong."""

    def max_batch(cfg, context_tokens, tpot_s, *, memory_gib, bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
                  compute_efficiency, step_overhead_s=0.0, weight_dtype_bytes=2, kv_dtype_bytes=2,
                  memory_utilization=0.9, tensor_parallel=1):
        kvb = kv_bytes or kv_dtype_bytes * (8 if bits else 1)
        wb = weight_bytes or weight_dtype_bytes * (8 if bits else 1)
        head_dim = cfg.d_model // cfg.n_heads if derived_head_dim else cfg.head_dim
        per_token = kv_factor * cfg.n_layers * (cfg.n_heads if heads else cfg.n_kv_heads) * head_dim * kvb
        weights = param_count(cfg) * wb
        tp = tensor_parallel if tp_time else 1
        bw = tp * bandwidth_gb_s * bandwidth_unit * (bandwidth_efficiency if efficiency else 1)
        peak = tp * peak_tflops * 1e12 * (compute_efficiency if efficiency else 1)
        flops = 2 * param_count(cfg) + 4 * cfg.n_layers * context_tokens * cfg.n_heads * cfg.head_dim
        budget = tpot_s - step_overhead_s * overhead_scale
        limits = []
        if time_limit:
            by_bytes = (budget * bw - weights) / (context_tokens * per_token)
            by_flops = budget * peak / flops if compute else math.inf
            b = max(0, math.floor(min(by_bytes, by_flops)))
            limits.append(b + 1 if first_miss and b > 0 else b)
        if memory_limit:
            mem = (memory_utilization if utilization else 1) * (tensor_parallel if tp_memory else 1) * memory_gib
            limits.append(max(0, math.floor((mem * memory_unit - weights) / (context_tokens * per_token))))
        return int(min(limits))

    return max_batch


def test_max_batch_passes_and_agrees_with_the_closed_form():
    check_max_batch(planted_batch())
    for _, cfg, context, tpot, kw in lab.batch_cases():
        assert planning.max_batch.__wrapped__(cfg, context, tpot, **kw) == planted_batch()(cfg, context, tpot, **kw)


@pytest.mark.parametrize("flags, needle", [
    (dict(heads=True), "query heads (n_heads) instead of the KV heads"),
    (dict(memory_unit=1e9), "read as gigabytes (10**9 bytes) instead of GiB"),
    (dict(bandwidth_unit=2**30), "read as GiB/s"),
    (dict(kv_bytes=2), "kv_dtype_bytes is ignored"),
    (dict(weight_bytes=2), "weight_dtype_bytes is ignored"),
    (dict(bits=True), "bits per element"),
    (dict(kv_factor=1), "keys AND values"),
    (dict(overhead_scale=0.0), "step_overhead_s is left out"),
    (dict(overhead_scale=1e-3), "or divided by 1000, read as milliseconds"),
    (dict(efficiency=False), "efficiencies are ignored"),
    (dict(compute=False), "compute limit is ignored"),
    (dict(memory_limit=False), "memory limit is ignored"),
    (dict(time_limit=False), "TPOT target is ignored"),
    (dict(utilization=False), "memory_utilization is ignored"),
    (dict(tp_time=False), "tensor_parallel is ignored in the step time"),
    (dict(tp_memory=False), "tensor_parallel is ignored in the memory"),
    (dict(first_miss=True), "first batch that misses the target"),
    # right for Llama (4096 / 32 = 128), half the cache per token for Qwen3-0.6B (1024 / 16 = 64, head_dim 128)
    (dict(derived_head_dim=True), "the head width is derived as d_model // n_heads = 64"),
])
def test_max_batch_mistakes(flags, needle):
    fails(check_max_batch, planted_batch(**flags), needle)


def planted_batch_step(mode):
    """max_batch by bisection with the step time written wrong one way (review of chapter 14)."""

    def max_batch(cfg, context_tokens, tpot_s, *, memory_gib, bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
                  compute_efficiency, step_overhead_s=0.0, weight_dtype_bytes=2, kv_dtype_bytes=2,
                  memory_utilization=0.9, tensor_parallel=1):
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_dtype_bytes
        weights = param_count(cfg) * weight_dtype_bytes
        bw = tensor_parallel * bandwidth_gb_s * 1e9 * bandwidth_efficiency
        peak = tensor_parallel * peak_tflops * 1e12 * compute_efficiency
        attention = 0 if mode == "no attention" else 4 * cfg.n_layers * context_tokens * cfg.n_heads * cfg.head_dim

        def step(b):
            memory, compute = (weights + b * context_tokens * per_token) / bw, b * (2 * param_count(cfg) + attention) / peak
            return (memory + compute if mode == "sum" else max(memory, compute)) + step_overhead_s

        by_time = lab._largest(step, tpot_s)
        budget = memory_utilization * tensor_parallel * memory_gib * 2**30
        return min(by_time, max(0, math.floor((budget - weights) / (context_tokens * per_token))))

    return max_batch


@pytest.mark.parametrize("mode", ["sum", "no attention"])
def test_max_batch_rejects_a_wrong_step_time(mode):
    # the memory and compute times added instead of the larger taken; the attention FLOPs left out
    fails(check_max_batch, planted_batch_step(mode), "batch")


def test_max_batch_must_be_a_whole_number():
    right = planted_batch()
    fails(check_max_batch, lambda *a, **k: float(right(*a, **k)), "return a whole number")


def test_max_batch_stub_and_answers():
    fails(check_max_batch, stub, "NotImplementedError", reason="not done")
    fails(check_max_batch, planning.max_batch, "the course's own answer")

    def from_the_pieces(cfg, context_tokens, tpot_s, *, memory_gib, **kw):
        memory = {k: kw[k] for k in ("weight_dtype_bytes", "kv_dtype_bytes", "memory_utilization", "tensor_parallel")
                  if k in kw}
        time_kw = {k: v for k, v in kw.items() if k != "memory_utilization"}
        return min(planning.max_batch_for_tpot(cfg, context_tokens, tpot_s, **time_kw),
                   planning.max_batch_in_memory(cfg, context_tokens, memory_gib=memory_gib, **memory))

    fails(check_max_batch, from_the_pieces, "the course's own answer")


def test_max_batch_may_use_chapter_05s_functions():
    """The decode step's bytes and FLOPs from chapter 05 (labsupport.costs) are allowed: only the
    planner's own answers are banned."""
    from labsupport import costs

    def mine(cfg, context_tokens, tpot_s, *, memory_gib, bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
             compute_efficiency, step_overhead_s=0.0, weight_dtype_bytes=2, kv_dtype_bytes=2, memory_utilization=0.9,
             tensor_parallel=1):
        tp = tensor_parallel

        def step(b):
            read = costs.decode_step_bytes(cfg, b, context_tokens, weight_dtype_bytes, kv_dtype_bytes).total
            flops = costs.decode_step_flops(cfg, b, context_tokens)
            return max(read / (tp * bandwidth_gb_s * 1e9 * bandwidth_efficiency),
                       flops / (tp * peak_tflops * 1e12 * compute_efficiency)) + step_overhead_s

        b = 0
        step_size = 1 << 20
        while step_size:  # galloping search for the last b meeting the target
            if step(b + step_size) <= tpot_s:
                b += step_size
            else:
                step_size //= 2
        free = memory_utilization * tp * memory_gib * 2**30 - costs.param_count(cfg) * weight_dtype_bytes
        fit = max(0, int(free // (context_tokens * costs.kv_bytes_per_token(cfg, kv_dtype_bytes))))
        return min(b, fit)

    check_max_batch(mine)


# --- replicas -------------------------------------------------------------------------------------


def planted_replicas(*, rounding=math.ceil, headroom_mode="multiply", little=True, per_batch=True, floor_min=True):
    def replicas(arrival_rate, time_in_system_s, batch_per_replica, headroom=0.0):
        load = arrival_rate * (time_in_system_s if little else 1)
        if headroom_mode == "multiply":
            load *= 1 + headroom
        elif headroom_mode == "divide":
            load /= 1 + headroom
        n = rounding(load / (batch_per_replica if per_batch else 1))
        return max(1, n) if floor_min else n

    return replicas


def test_replicas_passes():
    check_replicas(planted_replicas())


@pytest.mark.parametrize("kwargs, needle", [
    (dict(rounding=math.floor, floor_min=False), "rounded down (or to the nearest whole number) instead of up"),
    (dict(rounding=round, floor_min=False), "rounded down (or to the nearest whole number) instead of up"),
    (dict(headroom_mode="ignore"), "headroom is ignored"),
    (dict(headroom_mode="divide"), "headroom divides the load"),
    (dict(little=False), "time in system is missing"),
    (dict(rounding=lambda x: int(x) + 1), "int(x) + 1"),
    (dict(per_batch=False), "not divided by the batch"),
    (dict(floor_min=False), "the floor of one replica is missing"),  # right for every positive rate
])
def test_replicas_mistakes(kwargs, needle):
    fails(check_replicas, planted_replicas(**kwargs), needle)


def test_replicas_default_headroom_and_type():
    def no_default(arrival_rate, time_in_system_s, batch_per_replica, headroom):
        return math.ceil(arrival_rate * time_in_system_s * (1 + headroom) / batch_per_replica)

    fails(check_replicas, no_default, "TypeError")
    fails(check_replicas, lambda *a: float(planted_replicas()(*a)), "return an int")


def test_replicas_stub_and_answer():
    fails(check_replicas, stub, "NotImplementedError", reason="not done")
    fails(check_replicas, planning.replicas_for_rate, "the course's own answer")


# --- cost -----------------------------------------------------------------------------------------


def planted_cost(*, per=3600, scale=1e6, gpus=True, invert=False):
    def cost(gpu_hour_price, gpu_count, tokens_per_second):
        value = gpu_hour_price * (gpu_count if gpus else 1) / per / tokens_per_second * scale
        return 1 / value if invert else value

    return cost


def test_cost_passes():
    check_cost(planted_cost())


@pytest.mark.parametrize("kwargs, needle", [
    (dict(per=1), "division by 3600 is missing"),
    (dict(per=1 / 3600), "multiplied by 3600"),
    (dict(per=60), "divided by 60"),
    (dict(scale=1), "per token, not per million"),
    (dict(scale=1e3), "per thousand tokens"),
    (dict(gpus=False), "gpu_count is ignored"),
    (dict(invert=True), "upside down"),
])
def test_cost_mistakes(kwargs, needle):
    fails(check_cost, planted_cost(**kwargs), needle)


def test_cost_stub_and_answer():
    fails(check_cost, stub, "NotImplementedError", reason="not done")
    fails(check_cost, planning.cost_per_million_tokens, "the course's own answer")


# --- check_size_fleet (issue 22) ------------------------------------------------------------------------------


def learner_fleet(s, **mistake):
    """A learner's replica search written from the lab's spec (a linear search over the replica count,
    the headroom from planning.poisson_quantile); ``mistake`` plants one mistake by name."""
    from labsupport.planning import poisson_quantile

    step_ctx, mem_ctx, prompt_p = s.contexts()

    def cached(p):
        if mistake.get("uncapped_cache"):
            return s.prefix_hit_rate * p
        return 0 if mistake.get("no_cache") else min(s.prefix_hit_rate * p, p - 1)

    alone = [s.prefill_alone_s(p, cached(p)) for p in s.prompts()]
    work = [s.prefill_work_s(p, cached(p)) for p in s.prompts()]
    if mistake.get("suffix_alone"):
        work = [s.prefill_work_s(max(1, p - math.floor(cached(p)))) for p in s.prompts()]
        alone = [s.prefill_alone_s(max(1, p - math.floor(cached(p)))) for p in s.prompts()]
    prefill, prefill_work = sum(alone) / len(alone), sum(work) / len(work)
    t = (s.ttft_target_s if mistake.get("ttft_in_little") else prefill) + (s.mean_output - 1) * s.tpot_target_s
    n = s.arrival_rate * t
    if s.headroom is not None and not (mistake.get("falsy_headroom") and not s.headroom):
        room = s.headroom
    else:
        room = 0.0 if mistake.get("no_headroom") else poisson_quantile(n, s.burst_percentile) / n - 1
        room = room if mistake.get("negative_headroom") else max(0.0, room)
    memory = 1 << 20 if mistake.get("no_memory") else s.batch_in_memory(mem_ctx)

    def share(r):
        if mistake.get("no_interference"):
            return 0.0
        return (s.arrival_rate if mistake.get("fleet_share") else s.arrival_rate / r) * prefill_work

    def batch(r):
        return min(s.batch_for_tpot(step_ctx, s.tpot_target_s * (1 - share(r))), memory) if share(r) < 1 else 0

    top = math.ceil(prompt_p if not mistake.get("mean_prompt_ttft") else s.mean_prompt)
    ttft = s.prefill_alone_s(top, cached(top))
    if min(s.batch_for_tpot(step_ctx, s.tpot_target_s), memory) < 1:
        return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
    r = 1
    if mistake.get("one_pass"):
        b = batch(1)
        if b == 0:  # one replica cannot prefill all the traffic: concluded infeasible
            return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
        r = max(1, math.ceil(n * (1 + room) / b - 1e-9))
    else:
        def enough(r):
            return batch(r) >= 1 and math.ceil(n * (1 + room) / batch(r) - 1e-9) <= r

        while not enough(r) and r < 64:  # one at a time for small fleets, ...
            r += 1
        if not enough(r):  # ... then double and bisect (a batch of 1 can need tens of thousands)
            low, r = r, 2 * r
            while not enough(r):
                low, r = r, 2 * r
                if r > 1 << 30:  # the fleet-wide share never falls with more replicas: a learner's loop would hang
                    return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
            while r - low > 1:
                low, r = (low, (low + r) // 2) if enough((low + r) // 2) else ((low + r) // 2, r)
        b = batch(r)
    step = 0.0 if mistake.get("ttft_without_step") else s.step_time(b, step_ctx)
    return {"replicas": r, "batch": b, "prefill_share": share(1 if mistake.get("one_pass") else r), "headroom": room,
            "ttft_s": ttft + step}


def test_size_fleet_reference_and_a_spec_version_pass(capsys):
    from labsupport.checks import check_size_fleet
    from labsupport.checks.framework import Checker

    check_size_fleet(learner_fleet)
    assert "PASSED check_size_fleet" in capsys.readouterr().out
    # the course's answer calls burst_headroom, which the check bans: run through the body unbanned
    check_size_fleet.__wrapped__(unguarded(planning.size_fleet), Checker("check_size_fleet"))


FLEET_MUTANTS = {
    "no_interference": "prefill interference is left out",
    "fleet_share": "whole fleet's arrival rate",
    "no_headroom": "burst headroom is left out",
    "one_pass": "never recomputed as replicas are added",
    "no_cache": "hit rate is ignored",
    "suffix_alone": "its attention to the cached prefix is left out",
    "ttft_in_little": "starts with the TTFT target",
    "ttft_without_step": "leaves out the decode step",
    "mean_prompt_ttft": "at the mean prompt instead of the percentile",
    "no_memory": "memory limit is left out",
    "uncapped_cache": "not capped at the prompt less one token",
    "negative_headroom": "not floored at 0",
    "falsy_headroom": "a headroom of 0 given in s.headroom is taken for no headroom given",
}


@pytest.mark.parametrize("mistake", list(FLEET_MUTANTS))
def test_size_fleet_mutants_fail(mistake):
    from labsupport.checks import check_size_fleet

    with pytest.raises(CheckFailed, match=FLEET_MUTANTS[mistake]):
        check_size_fleet(lambda s: learner_fleet(s, **{mistake: True}))


def test_a_size_fleet_on_numpy_and_bisection_passes(capsys):
    """Another correct search: numpy for the averages, a Poisson quantile summed in logs (math.lgamma), a plain
    bisection over r."""
    import numpy as np

    from labsupport.checks import check_size_fleet

    def quantile(mean, percent):
        k, total = 0, 0.0
        while True:
            total += math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))
            if total >= percent / 100:
                return k
            k += 1

    def fleet(s):
        step_ctx, mem_ctx, prompt_p = s.contexts()
        prompts = np.asarray(s.prompts(), dtype=float)
        cached = np.minimum(s.prefix_hit_rate * prompts, prompts - 1)
        alone = float(np.mean([s.prefill_alone_s(int(p), c) for p, c in zip(prompts, cached)]))
        work = float(np.mean([s.prefill_work_s(int(p), c) for p, c in zip(prompts, cached)]))
        t = alone + (s.mean_output - 1) * s.tpot_target_s
        n = s.arrival_rate * t
        room = s.headroom if s.headroom is not None else max(0.0, quantile(n, s.burst_percentile) / n - 1)
        memory = s.batch_in_memory(mem_ctx)
        top = math.ceil(prompt_p)
        ttft = s.prefill_alone_s(top, min(s.prefix_hit_rate * top, top - 1))
        if min(s.batch_for_tpot(step_ctx, s.tpot_target_s), memory) < 1:
            return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}

        def batch(r):
            share = s.arrival_rate / r * work
            return min(s.batch_for_tpot(step_ctx, s.tpot_target_s * (1 - share)), memory) if share < 1 else 0

        def ok(r):
            return batch(r) >= 1 and math.ceil(n * (1 + room) / batch(r)) <= r

        hi = 1
        while not ok(hi):
            hi *= 2
        lo = hi // 2
        while hi - lo > 1:
            lo, hi = (lo, (lo + hi) // 2) if ok((lo + hi) // 2) else ((lo + hi) // 2, hi)
        return {"replicas": hi, "batch": batch(hi), "prefill_share": s.arrival_rate / hi * work, "headroom": room,
                "ttft_s": ttft + s.step_time(batch(hi), step_ctx)}

    check_size_fleet(fleet)
    assert "PASSED check_size_fleet" in capsys.readouterr().out


def test_size_fleet_stub_shape_and_course_answer():
    from labsupport.checks import check_size_fleet

    def stub(s):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_size_fleet(stub)
    with pytest.raises(CheckFailed, match="return a dict with the keys"):
        check_size_fleet(lambda s: learner_fleet(s)["replicas"])
    with pytest.raises(CheckFailed, match="a whole number"):
        check_size_fleet(lambda s: {**learner_fleet(s), "replicas": float(learner_fleet(s)["replicas"])})
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_size_fleet(lambda s: planning.size_fleet(s))
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_size_fleet(lambda s: {k: getattr(planning.plan_from(s), k) for k in
                                        ("replicas", "batch", "prefill_share", "headroom")}
                             | {"ttft_s": planning.plan_from(s).ttft_s})


def test_size_fleet_cases_vary_and_each_mistake_shows():
    """Every fixed case is feasible but one; the random workloads differ from run to run."""
    from labsupport.checks.lab14_planning import _random_settings, fleet_cases

    plans = [planning.plan_from(s) for _, s in fleet_cases([])]
    assert sum(not p.feasible for p in plans) == 1
    assert max(p.prefill_share for p in plans) > 0.3 and any(p.batch == p.batch_in_memory for p in plans)
    assert len({str(_random_settings(seed)) for seed in range(10)}) == 10
