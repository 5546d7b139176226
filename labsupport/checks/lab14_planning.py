"""Checks for the planning lab: the planner's core (Little's law, the largest batch a TPOT target and
the memory allow, replicas for an arrival rate, cost per million tokens), each on configurations with
known answers and against the unit mistakes planners make."""

from __future__ import annotations

import math

from ..costs import param_count
from ..hardware import get_gpu
from ..models import get_model
from ..planning import (
    GB,
    GIB,
    SECONDS_PER_HOUR,
    concurrency,
    cost_per_million_tokens,
    decode_step_time,
    max_batch,
    max_batch_for_tpot,
    max_batch_in_memory,
    replicas_for_rate,
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
