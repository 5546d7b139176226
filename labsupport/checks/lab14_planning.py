"""Checks for the planning lab: the planner's core (Little's law, the largest batch a TPOT target and
the memory allow, replicas for an arrival rate, cost per million tokens), each on configurations with
known answers and against the unit mistakes planners make."""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Mapping

from ..costs import param_count
from ..hardware import get_gpu
from ..models import get_model
from ..planning import (
    GB,
    GIB,
    SECONDS_PER_HOUR,
    PlanSettings,
    burst_headroom,
    concurrency,
    cost_per_million_tokens,
    decode_step_time,
    max_batch,
    max_batch_for_tpot,
    max_batch_in_memory,
    plan_from,
    poisson_quantile,
    replicas_for_rate,
    size_fleet,
    time_in_system,
)
from ._mistakes import merge_alike
from .framework import Case, graded

CONCURRENCY_RULE = (
    "Little's law: concurrency = arrival_rate * time_in_system, with time_in_system = ttft_s + "
    "(output_tokens - 1) * tpot_s (the prefill yields the first token; each other token is one decode step). "
    "Every time is already in seconds."
)
BATCH_RULE = (
    "step(b) = max(bytes(b) / (tensor_parallel * bandwidth_gb_s * 1e9 * bandwidth_efficiency), "
    "flops(b) / (tensor_parallel * peak_tflops * 1e12 * compute_efficiency)) + step_overhead_s, with "
    "bytes(b) = param_count * weight_dtype_bytes + b * context_tokens * kv_bytes_per_token (KV heads, not query "
    "heads, at kv_dtype_bytes) and flops(b) = costs.decode_step_flops(cfg, b, context_tokens); the largest b with "
    "step(b) <= tpot_s, and no larger than floor((memory_utilization * tensor_parallel * memory_gib * 2**30 - "
    "weights) / (context_tokens * kv_bytes_per_token)); 0 when even one sequence does not fit or misses the target."
)
REPLICAS_RULE = (
    "count the requests in flight (Little's law), add the headroom on top of them, and serve them "
    "batch_per_replica at a time: a fraction of a replica is a whole replica (round UP), and there is always "
    "at least one."
)
COST_RULE = (
    "cost per million tokens = gpu_hour_price * gpu_count / 3600 (the fleet's price per second) / "
    "tokens_per_second * 1e6."
)


# --- exercise 1a: Little's law -------------------------------------------------------------------


def _concurrency_mistakes(rate, ttft, tpot, out) -> dict[str, float]:
    mean = rate * (ttft + (out - 1) * tpot)
    return {
        "the mean number in the system is rounded up to a whole number (Little's L is a mean: 24.8 requests "
        "in flight on average is not 25)": math.ceil(mean),
        "the mean number in the system is rounded to a whole number (Little's L is a mean, not a count)":
            round(mean),
        "the output tokens are left out of the time in system (only the TTFT counted)": rate * ttft,
        "the TTFT is left out of the time in system": rate * (out - 1) * tpot,
        "output_tokens decode steps are counted instead of output_tokens - 1 (the prefill yields the first token)":
            rate * (ttft + out * tpot),
        "tpot_s is divided by 1000 (read as milliseconds, but it is already in seconds)":
            rate * (ttft + (out - 1) * tpot / 1000),
        "the times are multiplied by 1000 (converted to milliseconds)": rate * (ttft + (out - 1) * tpot) * 1000,
        "the time in system is divided by the arrival rate instead of multiplied": (ttft + (out - 1) * tpot) / rate,
        "each output token is counted as a request (arrival_rate * output_tokens)": rate * out,
    }


def concurrency_cases() -> list[tuple[float, float, float, int]]:
    """(arrival_rate, ttft_s, tpot_s, output_tokens)."""
    return [
        (10.0, 0.5, 0.02, 100),
        (2.5, 1.2, 0.045, 2),  # two tokens: a single decode step
        (0.2, 0.08, 0.011, 700),
        (37.0, 0.3, 0.03, 1),  # one token: no decode step at all
        (1000.0, 2.0, 0.1, 250.5),  # a mean length need not be whole
    ]


@graded(points=3, bans=(concurrency, time_in_system))
def check_concurrency(fn, checker):
    """``fn(arrival_rate, ttft_s, tpot_s, output_tokens)`` must return the mean number of requests in the
    system by Little's law (:func:`labsupport.planning.concurrency`)."""
    for rate, ttft, tpot, out in concurrency_cases():
        case = Case(arrival_rate=rate, ttft_s=ttft, tpot_s=tpot, output_tokens=out)
        got = checker.call(fn, rate, ttft, tpot, out, case=case)
        expected = concurrency(rate, ttft, tpot, out)
        mistakes = merge_alike({d: v for d, v in _concurrency_mistakes(rate, ttft, tpot, out).items()
                                if not math.isclose(v, expected, rel_tol=1e-9)}, rel=1e-9)
        checker.expect_number(got, expected, case=case, rel=1e-9, what="concurrency", hint=CONCURRENCY_RULE,
                              mistakes=mistakes)


# --- exercise 1b: the largest batch ------------------------------------------------------------


def _largest(step, tpot: float) -> int:
    """The largest b >= 1 with step(b) <= tpot (0 if none), for a step time growing with b."""
    if step(1) > tpot:
        return 0
    low, high = 1, 1 << 20
    if step(high) <= tpot:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if step(mid) <= tpot else (low, mid)
    return low


def batch_variant(cfg, context, tpot, *, memory_gib, bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
                  compute_efficiency, step_overhead_s=0.0, weight_dtype_bytes=2, kv_dtype_bytes=2,
                  memory_utilization=0.9, tensor_parallel=1, heads=None, memory_unit=GIB, bandwidth_unit=GB,
                  fixed_kv_bytes=None, fixed_weight_bytes=None, kv_factor=2, overhead_scale=1.0, efficiency=True,
                  compute=True, memory_limit=True, time_limit=True, utilization=True, tp_time=True, tp_memory=True,
                  first_miss=False, head_dim=None) -> int:
    """:func:`labsupport.planning.max_batch` written out, with one step optionally done wrong (the
    defaults give the right answer)."""
    kvb = fixed_kv_bytes or kv_dtype_bytes
    wb = fixed_weight_bytes or weight_dtype_bytes
    per_token = kv_factor * cfg.n_layers * (heads or cfg.n_kv_heads) * (head_dim or cfg.head_dim) * kvb
    weights = param_count(cfg) * wb
    tp_t = tensor_parallel if tp_time else 1
    bw = tp_t * bandwidth_gb_s * bandwidth_unit * (bandwidth_efficiency if efficiency else 1)
    peak = tp_t * peak_tflops * 1e12 * (compute_efficiency if efficiency else 1)
    per_seq_flops = 2 * param_count(cfg) + 4 * cfg.n_layers * context * cfg.q_width

    def step(b):
        memory_time = (weights + b * context * per_token) / bw
        compute_time = b * per_seq_flops / peak if compute else 0.0
        return max(memory_time, compute_time) + step_overhead_s * overhead_scale

    by_time = _largest(step, tpot) if time_limit else 1 << 20
    if first_miss and 0 < by_time < 1 << 20:
        by_time += 1
    budget = ((memory_utilization if utilization else 1.0) * (tensor_parallel if tp_memory else 1)
              * memory_gib * memory_unit)
    by_memory = max(0, math.floor((budget - weights) / (context * per_token))) if memory_limit else 1 << 20
    return min(by_time, by_memory)


def _batch_mistakes(cfg, context, tpot, kw) -> dict[str, int]:
    wrong = {
        "the KV cache is sized from the query heads (n_heads) instead of the KV heads (n_kv_heads)":
            dict(heads=cfg.n_heads),
        f"the head width is derived as d_model // n_heads = {cfg.d_model // cfg.n_heads} instead of read from "
        f"cfg.head_dim = {cfg.head_dim} (this model's heads are wider than d_model / n_heads)":
            dict(head_dim=cfg.d_model // cfg.n_heads),
        "memory_gib is read as gigabytes (10**9 bytes) instead of GiB (2**30 bytes)": dict(memory_unit=GB),
        "bandwidth_gb_s is read as GiB/s (2**30 bytes) instead of GB/s (10**9 bytes)": dict(bandwidth_unit=GIB),
        "kv_dtype_bytes is ignored (2 bytes per cached element assumed)": dict(fixed_kv_bytes=2),
        "weight_dtype_bytes is ignored (2 bytes per weight assumed)": dict(fixed_weight_bytes=2),
        "bits per element are used instead of bytes (16 for bf16, not 2)":
            dict(fixed_kv_bytes=kw.get("kv_dtype_bytes", 2) * 8, fixed_weight_bytes=kw.get("weight_dtype_bytes", 2) * 8),
        "the factor 2 for keys AND values is missing from the cache": dict(kv_factor=1),
        "step_overhead_s is left out of the step time (or divided by 1000, read as milliseconds, but it is "
        "already in seconds)": dict(overhead_scale=0.0),
        "the efficiencies are ignored (datasheet bandwidth and compute assumed)": dict(efficiency=False),
        "the compute limit is ignored (the step is taken as memory-bound at every batch)": dict(compute=False),
        "the memory limit is ignored (only the TPOT target limits the batch)": dict(memory_limit=False),
        "the TPOT target is ignored (only the memory limits the batch)": dict(time_limit=False),
        "memory_utilization is ignored (all of the memory given to the engine)": dict(utilization=False),
        "tensor_parallel is ignored in the step time (the GPUs of a replica read in parallel)": dict(tp_time=False),
        "tensor_parallel is ignored in the memory (a replica has the memory of all its GPUs)": dict(tp_memory=False),
        "the first batch that misses the target is returned instead of the last one that meets it":
            dict(first_miss=True),
    }
    return {d: batch_variant(cfg, context, tpot, **kw, **flags) for d, flags in wrong.items()}


def batch_cases() -> list[tuple]:
    """(label, cfg, context_tokens, tpot_s, keyword arguments): numbers as a planner would take them
    from :mod:`labsupport.hardware` (memory in GiB as reported, bandwidth in GB/s, TFLOP/s)."""
    m8, m70, qwen, tiny = (get_model(n) for n in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "tiny-20m"))
    small_qwen = get_model("qwen3-0.6b")
    h200, h100, l4 = get_gpu("H200"), get_gpu("H100 SXM"), get_gpu("L4")

    def card(gpu):
        return dict(memory_gib=gpu.usable_bytes / GIB, bandwidth_gb_s=gpu.hbm_bandwidth / GB,
                    peak_tflops=gpu.peak_flops / 1e12)

    return [
        ("8B on an H200, TPOT-bound", m8, 2048, 0.03,
         dict(**card(h200), bandwidth_efficiency=0.72, compute_efficiency=0.5, step_overhead_s=0.0027)),
        ("8B on an H100, long context, memory-bound", m8, 32768, 0.2,
         dict(**card(h100), bandwidth_efficiency=0.7, compute_efficiency=0.5, step_overhead_s=0.003)),
        ("Qwen3 8B, fp8 cache, 95% of memory", qwen, 8192, 0.05,
         dict(**card(h200), bandwidth_efficiency=0.65, compute_efficiency=0.45, step_overhead_s=0.002,
              kv_dtype_bytes=1, memory_utilization=0.95)),
        ("70B, fp8 weights, tensor-parallel over 4 H100s", m70, 4096, 0.04,
         dict(**card(h100), bandwidth_efficiency=0.6, compute_efficiency=0.4, step_overhead_s=0.004,
              weight_dtype_bytes=1, tensor_parallel=4)),
        ("8B, short context, compute-bound", m8, 128, 0.1,
         dict(**card(h200), bandwidth_efficiency=0.8, compute_efficiency=0.4, step_overhead_s=0.001)),
        ("a small model on a CPU-like machine, overhead-bound", tiny, 300, 0.02,
         dict(memory_gib=8.0, bandwidth_gb_s=20.0, peak_tflops=0.4, bandwidth_efficiency=0.5,
              compute_efficiency=0.3, step_overhead_s=0.006)),
        ("70B on one H100: the weights do not fit", m70, 1024, 0.5,
         dict(**card(h100), bandwidth_efficiency=0.7, compute_efficiency=0.5)),
        ("8B, a TPOT target no batch meets", m8, 1024, 0.004,
         dict(**card(h200), bandwidth_efficiency=0.72, compute_efficiency=0.5, step_overhead_s=0.0027)),
        # head_dim 128 where d_model / n_heads is 64: a derived head width halves the cache per token
        ("Qwen3-0.6B (head width 128, not d_model / n_heads) on an L4, long context", small_qwen, 16384, 0.05,
         dict(**card(l4), bandwidth_efficiency=0.7, compute_efficiency=0.5, step_overhead_s=0.002)),
    ]


@graded(points=6, bans=(max_batch, max_batch_for_tpot, max_batch_in_memory, decode_step_time))
def check_max_batch(fn, checker):
    """``fn(cfg, context_tokens, tpot_s, *, memory_gib, bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
    compute_efficiency, step_overhead_s=0.0, weight_dtype_bytes=2, kv_dtype_bytes=2, memory_utilization=0.9,
    tensor_parallel=1)`` must return the largest batch that meets the TPOT target and fits in memory
    (:func:`labsupport.planning.max_batch`)."""
    for label, cfg, context, tpot, kw in batch_cases():
        case = Case(configuration=label, model=cfg.name, context_tokens=context, tpot_s=tpot,
                    **{k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in kw.items()})
        got = checker.call(fn, cfg, context, tpot, case=case, **kw)
        expected = max_batch(cfg, context, tpot, **kw)
        if batch_variant(cfg, context, tpot, **kw) != expected:  # the check's own arithmetic must agree
            raise AssertionError(f"check_max_batch: its written-out reference disagrees on [{case}]")
        mistakes = merge_alike({d: v for d, v in _batch_mistakes(cfg, context, tpot, kw).items() if v != expected})
        checker.expect_number(got, expected, case=case, rel=1e-12, what="batch", hint=BATCH_RULE,
                              mistakes=mistakes)
        if not isinstance(got, int):
            checker.fail(case, f"the batch is {got!r}, a {type(got).__name__}: return a whole number of "
                               f"sequences (an int).", BATCH_RULE)


# --- exercise 1c: replicas ---------------------------------------------------------------------


def _replica_mistakes(rate, t, batch, headroom) -> dict[str, float]:
    load = rate * t
    return {
        "the floor of one replica is missing (max(1, ...)): with no traffic the service still keeps one replica up":
            math.ceil(load * (1 + headroom) / batch),
        "the count is rounded down (or to the nearest whole number) instead of up: some requests would have no "
        "replica": math.floor(load * (1 + headroom) / batch),
        "the headroom is ignored": max(1, math.ceil(load / batch)),
        "the headroom divides the load instead of multiplying it": max(1, math.ceil(load / (1 + headroom) / batch)),
        "the arrival rate alone is divided by the batch (the time in system is missing: Little's law)":
            max(1, math.ceil(rate * (1 + headroom) / batch)),
        "one is added after rounding down (int(x) + 1 instead of ceil(x))": int(load * (1 + headroom) / batch) + 1,
        "the load is not divided by the batch (one request per replica)": max(1, math.ceil(load * (1 + headroom))),
    }


def replica_cases() -> list[tuple[float, float, int, float | None]]:
    """(arrival_rate, time_in_system_s, batch_per_replica, headroom or None for the default)."""
    return [
        (3.0, 3.3, 2, 0.6),  # every mistake below gives a different count here
        (10.0, 2.48, 8, 0.3),
        (10.0, 2.48, 8, None),  # the default headroom is 0
        (50.0, 12.6, 256, 0.25),
        (2.0, 3.0, 2, 0.0),  # exactly 3 replicas' worth: 3, not 4
        (0.05, 4.0, 64, 0.1),  # a trickle still needs one replica
        (0.0, 4.0, 64, 0.1),  # and so does a quiet hour: ceil(0) is 0
        (400.0, 7.5, 96, 0.6),
    ]


@graded(points=3, bans=(replicas_for_rate, concurrency, time_in_system))
def check_replicas(fn, checker):
    """``fn(arrival_rate, time_in_system_s, batch_per_replica, headroom=0.0)`` must return the replicas
    that carry the load (:func:`labsupport.planning.replicas_for_rate`)."""
    for rate, t, batch, headroom in replica_cases():
        case = Case(arrival_rate=rate, time_in_system_s=t, batch_per_replica=batch,
                    headroom=headroom if headroom is not None else "default")
        if headroom is None:
            got = checker.call(fn, rate, t, batch, case=case)
        else:
            got = checker.call(fn, rate, t, batch, headroom, case=case)
        room = headroom or 0.0
        expected = replicas_for_rate(rate, t, batch, room)
        mistakes = merge_alike({d: v for d, v in _replica_mistakes(rate, t, batch, room).items() if v != expected})
        hint = REPLICAS_RULE + (" With no headroom given, use 0." if headroom is None else "")
        checker.expect_number(got, expected, case=case, rel=1e-12, what="replica count", hint=hint, mistakes=mistakes)
        if not isinstance(got, int):
            checker.fail(case, f"the replica count is {got!r}, a {type(got).__name__}: return an int.", hint)


# --- exercise 1d: cost -------------------------------------------------------------------------


def _cost_mistakes(price, gpus, tps) -> dict[str, float]:
    right = price * gpus / SECONDS_PER_HOUR / tps * 1e6
    return {
        "the hourly price is used as a price per second (the division by 3600 is missing)": price * gpus / tps * 1e6,
        "the hourly price is multiplied by 3600 instead of divided": price * gpus * SECONDS_PER_HOUR / tps * 1e6,
        "the hourly price is divided by 60 (per minute) instead of 3600 (per second)": price * gpus / 60 / tps * 1e6,
        "the result is per token, not per million tokens": right / 1e6,
        "the result is per thousand tokens, not per million": right / 1e3,
        "gpu_count is ignored (the price of one GPU)": price / SECONDS_PER_HOUR / tps * 1e6,
        "tokens per price is returned (the ratio is upside down)": 1 / right,
    }


def cost_cases() -> list[tuple[float, int, float]]:
    """(gpu_hour_price, gpu_count, tokens_per_second); prices are made up for the test, not quotes."""
    return [(2.0, 8, 1000.0), (3.5, 1, 2500.0), (1.1, 24, 40000.0), (7.0, 4, 12.5)]


@graded(points=3, bans=(cost_per_million_tokens,))
def check_cost(fn, checker):
    """``fn(gpu_hour_price, gpu_count, tokens_per_second)`` must return the price of a million tokens
    (:func:`labsupport.planning.cost_per_million_tokens`)."""
    for price, gpus, tps in cost_cases():
        case = Case(gpu_hour_price=price, gpu_count=gpus, tokens_per_second=tps)
        got = checker.call(fn, price, gpus, tps, case=case)
        expected = cost_per_million_tokens(price, gpus, tps)
        mistakes = {d: v for d, v in _cost_mistakes(price, gpus, tps).items()
                    if not math.isclose(v, expected, rel_tol=1e-9)}
        checker.expect_number(got, expected, case=case, rel=1e-9, what="cost per million tokens", hint=COST_RULE,
                              mistakes=mistakes)


# --- exercise 1e: the replica search ---------------------------------------------------------------------

FLEET_RULE = (
    "a prefill costs only its uncached tokens (cached = prefix_hit_rate * prompt, at most prompt - 1), "
    "averaged over s.prompts(); the requests in flight are the arrival rate times (the mean prefill alone plus "
    "mean output - 1 decode steps at the TPOT target), with the Poisson headroom at s.burst_percentile unless "
    "s.headroom is given; with r replicas each spends rate / r times the mean prefill work of its time "
    "prefilling, so its decode steps get the TPOT target times (1 - that share), and its batch is the largest "
    "that meets that and fits in memory (s.contexts(): step and memory contexts); the answer is the fewest r "
    "whose batches hold the requests in flight with the headroom (0 replicas and batch 0 when even one "
    "sequence cannot meet the target or fit); the TTFT is the percentile prompt's prefill alone plus one "
    "decode step at the batch."
)
FLEET_KEYS = ("replicas", "batch", "prefill_share", "headroom", "ttft_s")


def fleet_variant(s, *, interference=True, per_replica=True, headroom=True, search=True, cache=True,
                  cached_attention=True, little="prefill", ttft_step=True, ttft_percentile=True, memory=True,
                  cache_cap=True, headroom_floor=True, zero_headroom_given=True) -> dict:
    """:func:`labsupport.planning.size_fleet` written out, with one step optionally done wrong (the
    defaults give the right answer)."""
    step_ctx, mem_ctx, prompt_p = s.contexts()

    def cached(p):
        if not cache:
            return 0
        return min(s.prefix_hit_rate * p, p - 1) if cache_cap else s.prefix_hit_rate * p

    def work(p):
        if cached_attention:
            return s.prefill_work_s(p, cached(p))
        h = math.floor(cached(p))  # the uncached suffix priced as a prompt of its own: its attention to the prefix lost
        return s.prefill_work_s(max(1, p - h))

    def alone(p):
        if cached_attention:
            return s.prefill_alone_s(p, cached(p))
        return s.prefill_alone_s(max(1, p - math.floor(cached(p))))

    prompts = s.prompts()
    prefill_alone = sum(alone(p) for p in prompts) / len(prompts)
    prefill_work = sum(work(p) for p in prompts) / len(prompts)
    first = prefill_alone if little == "prefill" else s.ttft_target_s
    time_in_sys = first + (s.mean_output - 1) * s.tpot_target_s
    conc = s.arrival_rate * time_in_sys
    if s.headroom is not None and (s.headroom or zero_headroom_given):
        room = s.headroom
    else:
        room = poisson_quantile(conc, s.burst_percentile) / conc - 1 if headroom else 0.0
        room = max(0.0, room) if headroom_floor else room
    in_memory = s.batch_in_memory(mem_ctx) if memory else 1 << 20

    def replicas(b):  # replicas_for_rate, which refuses a negative headroom (one of the mistakes gives one)
        return max(1, math.ceil(s.arrival_rate * time_in_sys * (1 + room) / b)) if room < 0 else \
            replicas_for_rate(s.arrival_rate, time_in_sys, b, room)

    def share_of(r):
        if not interference:
            return 0.0
        return (s.arrival_rate / r if per_replica else s.arrival_rate) * prefill_work

    def batch(r):
        share = share_of(r)
        return min(s.batch_for_tpot(step_ctx, s.tpot_target_s * (1 - share)), in_memory) if share < 1 else 0

    p_ttft = math.ceil(prompt_p if ttft_percentile else s.mean_prompt)
    ttft = alone(p_ttft)
    if min(s.batch_for_tpot(step_ctx, s.tpot_target_s), in_memory) < 1:
        return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
    if search:  # more replicas only help: double, then bisect, for the fewest that carry the load
        def enough(r):
            b = batch(r)
            return b >= 1 and replicas(b) <= r

        low, high = 0, 1
        while not enough(high):
            low, high = high, high * 2
            if high > 1 << 30:  # a mistake that no replica count satisfies
                return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if enough(mid) else (mid, high)
        r, b = high, batch(high)
    else:  # one pass: the batch sized at one replica's prefill share, never recomputed for the fleet
        b = batch(1)
        if b < 1:
            return {"replicas": 0, "batch": 0, "prefill_share": 0.0, "headroom": room, "ttft_s": ttft}
        r = replicas(b)
    return {"replicas": r, "batch": b, "prefill_share": share_of(r) if search else share_of(1), "headroom": room,
            "ttft_s": ttft + (s.step_time(b, step_ctx) if ttft_step else 0.0)}


def _fleet_mistakes(s) -> dict[str, dict]:
    wrong = {
        "prefill interference is left out: the decode steps get the whole TPOT target": dict(interference=False),
        "the prefill share is taken over the whole fleet's arrival rate, not one replica's (rate / replicas)":
            dict(per_replica=False),
        "the burst headroom is left out (the mean number of requests in flight is provisioned)": dict(headroom=False),
        "the batch is sized at the prefill share of a single replica and never recomputed as replicas are added "
        "(the share, and so the batch, depend on the replica count: search for the fewest that carry the load)":
            dict(search=False),
        "the prefix-cache hit rate is ignored (every prompt token computed)": dict(cache=False),
        "the uncached part of a prompt is priced as a prompt of its own: its attention to the cached prefix is "
        "left out": dict(cached_attention=False),
        "the time in system starts with the TTFT target instead of the prefill (Little's law counts the time a "
        "request really spends)": dict(little="ttft target"),
        "the TTFT leaves out the decode step that follows the prefill": dict(ttft_step=False),
        "the TTFT is taken at the mean prompt instead of the percentile prompt": dict(ttft_percentile=False),
        "the memory limit is left out of the batch": dict(memory=False),
        "the cached tokens are not capped at the prompt less one token (an engine always computes a prompt's "
        "last token, whose logits it samples)": dict(cache_cap=False),
        "the headroom is not floored at 0 (a burst percentile whose quantile is below the mean gives a negative "
        "headroom: provision the mean, never less)": dict(headroom_floor=False),
        "a headroom of 0 given in s.headroom is taken for no headroom given (0.0 is false: `if s.headroom:` "
        "replaces it with the Poisson one; test `s.headroom is not None`)": dict(zero_headroom_given=False),
    }
    return {d: fleet_variant(s, **flags) for d, flags in wrong.items()}


_FLEET_DEPLOYMENTS = (  # (model, GPU, tensor-parallel degree)
    ("llama-3.1-8b", "H200", 1), ("llama-3.1-8b", "H100 SXM", 1), ("qwen3-8b", "H200", 1),
    ("mistral-7b-v0.1", "A100 80GB", 1), ("llama-3.1-70b", "H100 SXM", 4), ("llama-3.1-70b", "H200", 2),
)


def _settings(model, gpu, tp=1, **kw):
    base = dict(arrival_rate=20, prompt_tokens=1000, output_tokens=250, ttft_target_s=1.0, tpot_target_s=0.04,
                bandwidth_efficiency=0.8, compute_efficiency=0.55, step_overhead_s=0.003, tensor_parallel=tp)
    base.update(kw)
    return PlanSettings.create(get_model(model), get_gpu(gpu), **base)


def _random_settings(seed: int):
    """A workload and deployment drawn from ``seed``: the model, the GPU, the rate, the lengths (a mean
    or sampled lengths), the targets, the efficiencies, the hit rate and the headroom."""
    rng = random.Random(seed)
    model, gpu, tp = rng.choice(_FLEET_DEPLOYMENTS)
    prompt = rng.choice([rng.randint(1, 6000), [rng.randint(1, 8000) for _ in range(rng.randint(2, 6))],
                         [rng.randint(1, 20) for _ in range(rng.randint(2, 6))]])
    output = rng.choice([rng.randint(20, 800), [rng.randint(2, 900) for _ in range(rng.randint(2, 6))]])
    return _settings(
        model, gpu, tp, arrival_rate=round(rng.uniform(0.5, 150), 2), prompt_tokens=prompt, output_tokens=output,
        ttft_target_s=round(rng.uniform(0.3, 3), 2), tpot_target_s=round(rng.uniform(0.015, 0.08), 4),
        bandwidth_efficiency=round(rng.uniform(0.55, 0.9), 3), compute_efficiency=round(rng.uniform(0.3, 0.7), 3),
        step_overhead_s=round(rng.uniform(0.0005, 0.005), 5), prefix_hit_rate=rng.choice([0.0, 0.3, 0.75, 0.95, 0.999]),
        headroom=rng.choice([None, None, 0.25]), burst_percentile=rng.choice([99.0, 95.0, 99.9, 50.0, 20.0]))


def fleet_cases(seeds) -> list[tuple[str, object]]:
    """(label, PlanSettings): workloads chosen to expose one mistake each, then random ones."""
    return [
        ("long prompts at a high rate: prefill takes a large share of each replica", _settings(
            "llama-3.1-8b", "H200", arrival_rate=60, prompt_tokens=6000, output_tokens=150, tpot_target_s=0.03)),
        ("a system prompt shared by most requests: 85% of prompt tokens cached", _settings(
            "llama-3.1-8b", "H100 SXM", arrival_rate=40, prompt_tokens=[3000, 4000, 5000, 8000], output_tokens=120,
            tpot_target_s=0.025, prefix_hit_rate=0.85)),
        ("a chat workload with the Poisson headroom at p99, sampled lengths", _settings(
            "qwen3-8b", "H200", arrival_rate=12, prompt_tokens=[300, 900, 1500, 2400], output_tokens=[80, 300, 700, 250],
            tpot_target_s=0.05)),
        ("an explicit 25% headroom, 70B over 4 H100s", _settings(
            "llama-3.1-70b", "H100 SXM", 4, arrival_rate=8, prompt_tokens=2000, output_tokens=400, tpot_target_s=0.06,
            headroom=0.25)),
        ("memory binds: long contexts, a loose TPOT target", _settings(
            "llama-3.1-8b", "A100 80GB", arrival_rate=5, prompt_tokens=30000, output_tokens=2000, tpot_target_s=0.2)),
        ("no replica can meet the target (70B on one H100)", _settings(
            "llama-3.1-70b", "H100 SXM", arrival_rate=5, tpot_target_s=0.03)),
        ("short prompts at a 95% hit rate: at most prompt - 1 tokens are cached", _settings(
            "llama-3.1-8b", "H100 SXM", arrival_rate=200, prompt_tokens=[1, 3, 8, 12], output_tokens=40,
            tpot_target_s=0.02, prefix_hit_rate=0.95)),
        ("provisioned for the 45th-percentile burst: the Poisson quantile is below the mean, the headroom is 0", _settings(
            "qwen3-8b", "H200", arrival_rate=30, prompt_tokens=800, output_tokens=200, burst_percentile=45.0)),
        ("an explicit headroom of 0 (provision the mean): a given 0 is a headroom, not a missing one", _settings(
            "llama-3.1-8b", "H200", arrival_rate=20, prompt_tokens=1000, output_tokens=250, headroom=0.0)),
        *((f"random workload, seed {seed}", _random_settings(seed)) for seed in seeds),
    ]


def _describe(s) -> dict:
    prompts = s.prompt_samples if s.prompt_samples is not None else round(s.mean_prompt, 2)
    outputs = s.output_samples if s.output_samples is not None else round(s.mean_output, 2)
    return dict(model=s.cfg.name, gpu=s.card.name, tensor_parallel=s.tensor_parallel, arrival_rate=s.arrival_rate,
                prompt_tokens=prompts, output_tokens=outputs, tpot_target_s=s.tpot_target_s,
                prefix_hit_rate=s.prefix_hit_rate, headroom=s.headroom, burst_percentile=s.burst_percentile)


@graded(points=6, bans=(size_fleet, burst_headroom))
def check_size_fleet(fn, checker):
    """``fn(s)`` (``s`` a :class:`labsupport.planning.PlanSettings`) must return the fleet
    :func:`labsupport.planning.plan` sizes: ``{"replicas", "batch", "prefill_share", "headroom", "ttft_s"}``,
    on fixed workloads and on random ones drawn afresh at every run."""
    fresh = random.SystemRandom()
    for label, s in fleet_cases([1, 2, 3] + [fresh.randrange(10**6) for _ in range(3)]):
        case = Case(workload=label, **_describe(s))
        got = checker.call(fn, s, case=case)
        want = plan_from(s)
        expected = {"replicas": want.replicas, "batch": want.batch, "prefill_share": want.prefill_share,
                    "headroom": want.headroom, "ttft_s": want.ttft_s}
        if fleet_variant(s) != size_fleet.__wrapped__(s) or size_fleet.__wrapped__(s) != expected:
            raise AssertionError(f"check_size_fleet: its written-out reference disagrees with plan on [{case}]")
        if not isinstance(got, Mapping) or set(FLEET_KEYS) - set(got):
            checker.fail(case, f"your function returned {got!r:.200}; return a dict with the keys "
                               f"{', '.join(repr(k) for k in FLEET_KEYS)}.", FLEET_RULE)
        for key in ("replicas", "batch"):
            if not isinstance(got[key], numbers.Integral) or isinstance(got[key], bool):
                checker.fail(case, f"{key} is {got[key]!r}, a {type(got[key]).__name__}: return a whole number.",
                             FLEET_RULE)
        if all(isinstance(got[k], numbers.Real) and math.isclose(got[k], expected[k], rel_tol=1e-9, abs_tol=1e-12)
               for k in FLEET_KEYS):
            continue
        mistakes = _fleet_mistakes(s)  # only now: each one is a search of its own

        def same(a, b) -> bool:
            return isinstance(a, numbers.Real) and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)

        # a mistake that gives every value the learner's did names what went wrong, whichever key shows it
        # (several mistakes can give the same fleet on one workload: then all of them are named)
        whole = [d for d, v in mistakes.items() if all(same(got[k], v[k]) for k in FLEET_KEYS)]
        for key in FLEET_KEYS:
            if whole:
                named = {"; or when ".join(whole): float(mistakes[whole[0]][key])}
            else:
                named = {d: float(v[key]) for d, v in mistakes.items() if not same(v[key], expected[key])}
            if expected[key] == 0 and key in ("replicas", "batch", "prefill_share"):
                if got[key] != 0:
                    problem = (f"{key} is {got[key]!r}, expected 0: no replica can run even one sequence within the "
                               f"TPOT target and its memory, and the plan says so with 0 replicas.")
                    checker.fail(case, problem, FLEET_RULE)
                continue
            checker.expect_number(got[key], float(expected[key]), case=case, rel=1e-9, what=key, hint=FLEET_RULE,
                                  mistakes=named)
