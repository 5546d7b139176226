"""Capacity planning (chapter 14): from a workload and a deployment to replicas, utilisation and cost.

The public API. Every function takes plain numbers, a model (a name or
:class:`~labsupport.models.ModelConfig`, through :func:`labsupport.models.as_model`) or a GPU (a name
or :class:`~labsupport.hardware.GPU`, through :func:`labsupport.hardware.as_gpu`), validates its
arguments with :mod:`labsupport._validate`, and returns a number or a frozen dataclass.

* :func:`plan` (the whole planner) -> :class:`Plan`. It checks its arguments once into a frozen
  :class:`PlanSettings` and hands that to :func:`plan_from`, whose pieces (:func:`_contexts`,
  :func:`_fewest_replicas`, :func:`_notes`) each read it whole.
* The four exercises of lab 14 (course answers, ``@answer``): :func:`concurrency` (Little's law),
  :func:`max_batch` (the largest batch meeting the TPOT target that fits in memory),
  :func:`replicas_for_rate` and :func:`cost_per_million_tokens`.
* The pieces they are made of: :func:`time_in_system`, :func:`decode_step_time`,
  :func:`max_batch_for_tpot`, :func:`max_batch_in_memory`, :func:`prefill_time`,
  :func:`prefill_compute_time`,
  :func:`poisson_quantile`, :func:`burst_headroom`.
* Example::

      cal = measured_h200_calibration()  # chapter 05's H200 run (None without one)
      p = plan("llama-3.1-8b", "H200", arrival_rate=20, prompt_tokens=1000, output_tokens=250,
               ttft_target_s=1.0, tpot_target_s=0.03, bandwidth_efficiency=cal.bandwidth_efficiency,
               compute_efficiency=cal.compute_efficiency, step_overhead_s=cal.step_overhead_s,
               gpu_hour_price=3.0)  # the caller's price; 3.0 is an example, not a quote
      p.replicas, p.batch, p.utilisation, p.cost_per_million_output_tokens

* Calibration (where the efficiency comes from): :func:`fit_decode_steps` fits measured decode
  steps; :func:`measured_h200_calibration` reads chapter 05's H200 run (``results/gpu_phases.json``)
  and returns a :class:`Calibration`, or None when that file holds no real run.

Units and conventions (each in the parameter's name where it can be):

* Times are in **seconds** (``_s``), rates in **requests per second** (``arrival_rate``), token
  throughputs in tokens per second. A price is **per GPU-hour** (``gpu_hour_price``), in whatever
  currency the caller uses; the course never states a market price as a fact.
* Memory capacity is in **GiB** (``memory_gib``, ``2**30`` bytes, as nvidia-smi, ``torch.cuda`` and
  vLLM count it; :attr:`GPU.usable_bytes` / 2**30 for a table GPU). Bandwidth is in **GB/s**
  (``bandwidth_gb_s``, ``1e9`` bytes per second, as datasheets give it) and compute in **TFLOP/s**
  (``peak_tflops``, ``1e12``). Bytes per element are ``*_dtype_bytes`` (2 for bf16, 1 for fp8).
* **Time in system** of a request is ``TTFT + (output_tokens - 1) * TPOT``: prefill yields the first
  token, and each of the ``output_tokens - 1`` others takes one decode step (TPOT as vLLM's benchmark
  defines it, ``(latency - TTFT) / (output_tokens - 1)``).
* **Little's law**: requests in the system on average = arrival rate x mean time in system
  (:func:`concurrency`). It holds for any arrival pattern and any scheduler, in the long run.
* **A decode step** (chapter 05): it reads every weight once and every running sequence's KV cache
  (:func:`labsupport.costs.decode_step_bytes`), and performs
  :func:`labsupport.costs.decode_step_flops`. Its time is the larger of bytes over the *achieved*
  bandwidth and FLOPs over the *achieved* compute rate, plus a fixed per-step overhead::

      step = max(bytes / (tp * bandwidth_gb_s * 1e9 * bandwidth_efficiency),
                 flops / (tp * peak_tflops * 1e12 * compute_efficiency)) + step_overhead_s

  ``bandwidth_efficiency`` and ``compute_efficiency`` are fractions of the datasheet figures that
  were **measured** (:func:`fit_decode_steps`, :func:`measured_h200_calibration`), never assumed.
  Lab 14's formula (:func:`decode_step_time`, :func:`max_batch`) charges every weight to every step,
  the runbook's count; :func:`plan` prices the bytes a step really reads (``read_exact``: of an
  untied input embedding table, one row per sequence), the count its calibration is fitted in, so
  that the planner reproduces the steps it was calibrated on.
  With tensor parallelism (``tensor_parallel``, ``tp``) the bytes and FLOPs are split evenly over
  ``tp`` GPUs. The all-reduces between them are **not modelled** (two per layer per step, chapter
  11): the overhead was measured on one GPU, so a plan with ``tp > 1`` is optimistic by their
  time, and its notes say so.
* **Compute peak.** The dense bf16 peak, or with ``fp8_compute`` the GPU's dense FP8 peak (twice
  bf16's on Hopper and Ada; :attr:`labsupport.hardware.GPU.fp8_peak_flops`), for plans whose
  matmuls run in FP8. ``compute_efficiency`` is then a fraction of that peak, assumed to be the
  bf16 fraction measured (FP8 kernels often reach a smaller share: measure yours).
* **KV cache** (chapter 06): ``2 * n_layers * n_kv_heads * head_dim * kv_dtype_bytes`` bytes per
  token, **KV heads, not query heads** (:func:`labsupport.costs.kv_bytes_per_token`). (With a
  tensor-parallel degree above the number of KV heads, vLLM replicates KV heads across the GPUs,
  so the cache per token grows; the planner does not model that case.) A replica has
  ``memory_utilization * tp * memory_gib * 2**30`` bytes (vLLM's ``gpu_memory_utilization``, 0.9 by
  default: the fraction of each GPU's total memory the whole engine instance may use), of which the
  weights take ``param_count * weight_dtype_bytes`` and the cache gets the rest;
  :func:`max_batch_in_memory` fits ``batch`` sequences of ``context_tokens`` each in it. vLLM also
  takes out of that fraction the peak activation memory it profiles at startup (it grows with
  ``max_num_batched_tokens``), memory outside PyTorch's allocator (NCCL, the CUDA context) and, in
  recent versions, an estimate of its CUDA graphs, so its cache is smaller than this bound: read
  the engine's startup log ("Available KV cache memory") and lower ``memory_utilization`` to match.
* **The plan** (:func:`plan`) prices the decode step at the mean context of a running sequence,
  ``mean prompt + mean output / 2`` (with continuous batching the batch holds sequences at every
  stage; given samples of the output lengths, the mean is weighted by each request's decode steps,
  :func:`_running_context`, since long answers sit in more steps). It sizes memory for every batch
  slot holding a sequence at full length at the ``percentile``-th percentile of ``prompt + output``:
  a conservative bound, since a paged cache only holds what each sequence has reached (on average
  about the step's context) and an engine that runs out preempts a request rather than failing.
  It inflates the decode step by the share of GPU time spent prefilling
  (``step / (1 - prefill_share)``: prefill and decode take turns on the same GPU). That adds the two
  costs, an **upper bound** on the interference: an engine that folds prefill chunks into decode
  steps that are bound by memory, not compute (Sarathi-Serve's piggybacking), hides part of the
  prefill's arithmetic under the step's weight reads. A load test decides. The share is the
  arrival rate per replica times a prompt's prefill FLOPs over the achieved compute rate
  (:func:`prefill_compute_time`: batched with decode steps, a prefill adds its arithmetic, not
  another read of the weights), averaged over the sampled prompts when samples are given (the cost
  grows faster than the prompt, so the cost of the mean prompt would underprice it). TTFT is
  predicted as a prompt's prefill on its own (:func:`prefill_time`) plus one decode step;
  queueing is not modelled.
* **The planned TPOT is a mean.** The batch is the largest whose *mean* TPOT (prefill turns
  included) meets ``tpot_target_s``. Single gaps are longer where a step carries a prefill chunk,
  and the batch itself varies with the arrivals, so a target stated at a percentile (p90, p99) is
  met on the mean only: the margin a percentile needs is what a load test measures (lab 14 checks
  the rate at the target's percentile). The plan's notes say so.
* **Little's law in the plan** counts the requests holding a batch slot and a cache, so its time
  is the time in the running batch, ``prefill + (mean output - 1) * TPOT target``: a request
  waiting in the engine's queue holds neither (vLLM allocates its cache blocks when it is
  scheduled), so queueing delay adds to latency but not to the batch. The TPOT *target*, not the
  predicted TPOT, is used: a plan whose replicas run faster than the target holds fewer requests
  at a time than it sized for (conservative). **Utilisation** is that mean concurrency over the
  fleet's batch slots (``replicas x batch``): the share of slots in use on average, not the share
  of time the GPUs are busy.
* Replicas are sized for the ``burst_percentile``-th percentile of concurrency under Poisson
  arrivals (the number of requests in an M/G/infinity system is Poisson with mean
  ``arrival_rate * time_in_system``) unless a ``headroom`` fraction is given. That is the fleet's
  percentile, so it assumes a router that sends each request to a replica with a free slot; a
  router that spreads requests at random (or round robin) gives each replica its own stream of
  mean ``concurrency / replicas``, whose spread is relatively larger and needs more headroom.
* **Cost** is given per million output tokens and per million tokens counting prompts too
  (``Plan.cost_per_million_output_tokens``, ``Plan.cost_per_million_tokens``): the same fleet and
  price over two token counts, so the second is always the smaller; say which one you quote. The
  ``..._at_saturation`` figures price the same fleet with every batch slot busy (the tokens per
  second over the utilisation): the least a token can cost on it, and what a per-token price list
  implicitly assumes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import costs
from ._answers import answer
from ._validate import non_negative_number, positive_int, positive_number
from .hardware import GPU, as_gpu, match_device_name
from .latency import percentile as nearest_rank
from .models import ModelConfig, as_model
from .phases import GPU_RESULTS, load_gpu_results, unread_embedding_bytes

__all__ = [
    "DEFAULT_MEMORY_UTILIZATION",
    "GB",
    "GIB",
    "SECONDS_PER_HOUR",
    "Calibration",
    "Plan",
    "PlanSettings",
    "burst_headroom",
    "concurrency",
    "cost_per_million_tokens",
    "decode_step_time",
    "fit_decode_steps",
    "max_batch",
    "max_batch_for_tpot",
    "max_batch_in_memory",
    "measured_h200_calibration",
    "plan",
    "plan_from",
    "poisson_quantile",
    "prefill_compute_time",
    "prefill_time",
    "replicas_for_rate",
    "time_in_system",
]

GB = 1e9  # decimal gigabyte: bandwidths (GB/s) and datasheet prose
GIB = 2**30  # binary gibibyte: memory capacities
SECONDS_PER_HOUR = 3600
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
MAX_BATCH_SEARCH = 1 << 20  # the largest batch the planner considers


def _fraction(name: str, value, *, allow_one: bool = True) -> float:
    value = positive_number(name, value)
    if value > 1 or (value == 1 and not allow_one):
        raise ValueError(f"{name} is a fraction, greater than 0 and at most 1; got {value}")
    return value


def _percent(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 100:
        raise ValueError(f"{name} is a percentile, greater than 0 and less than 100 (for example 99); got {value!r}")
    return float(value)


# --- Little's law -------------------------------------------------------------------------------


@answer
def time_in_system(ttft_s: float, tpot_s: float, output_tokens: float) -> float:
    """Seconds a request spends in the system: ``ttft_s + (output_tokens - 1) * tpot_s``."""
    ttft_s = positive_number("ttft_s", ttft_s)
    tpot_s = positive_number("tpot_s", tpot_s)
    output_tokens = positive_number("output_tokens", output_tokens)
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be at least 1 (the first token), got {output_tokens}")
    return ttft_s + (output_tokens - 1) * tpot_s


@answer
def concurrency(arrival_rate: float, ttft_s: float, tpot_s: float, output_tokens: float) -> float:
    """Requests in the system on average (Little's law): ``arrival_rate * time_in_system``.

    ``arrival_rate`` in requests per second; ``ttft_s`` and ``tpot_s`` in seconds; ``output_tokens``
    the mean output length. Lab 14, exercise 1.
    """
    arrival_rate = positive_number("arrival_rate", arrival_rate)
    return arrival_rate * time_in_system(ttft_s, tpot_s, output_tokens)


# --- the decode step and the batch a TPOT target allows -----------------------------------------


def _hardware(bandwidth_gb_s, peak_tflops, bandwidth_efficiency, compute_efficiency, step_overhead_s,
              tensor_parallel):
    return (
        positive_number("bandwidth_gb_s", bandwidth_gb_s) * GB,
        positive_number("peak_tflops", peak_tflops) * 1e12,
        _fraction("bandwidth_efficiency", bandwidth_efficiency),
        _fraction("compute_efficiency", compute_efficiency),
        non_negative_number("step_overhead_s", step_overhead_s),
        positive_int("tensor_parallel", tensor_parallel),
    )


@answer
def decode_step_time(model, batch: int, context_tokens: int, *, bandwidth_gb_s: float, peak_tflops: float,
                     bandwidth_efficiency: float, compute_efficiency: float, step_overhead_s: float = 0.0,
                     weight_dtype_bytes: float = 2, kv_dtype_bytes: float = 2, tensor_parallel: int = 1,
                     read_exact: bool = False) -> float:
    """Seconds of one decode step of ``batch`` sequences with ``context_tokens`` each (module docstring).

    The bytes are :func:`labsupport.costs.decode_step_bytes` (every weight, the runbook's count and
    lab 14's formula); with ``read_exact`` the rows of an untied input embedding table the step
    never reads are left out (:func:`labsupport.phases.unread_embedding_bytes`): the bytes a step
    really streams, which is what :func:`measured_h200_calibration`'s efficiency is a fraction of
    and what :func:`plan` prices."""
    cfg = as_model(model)
    bw, peak, b_eff, c_eff, overhead, tp = _hardware(bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
                                                     compute_efficiency, step_overhead_s, tensor_parallel)
    read = costs.decode_step_bytes(cfg, batch, context_tokens, weight_dtype_bytes, kv_dtype_bytes).total
    if read_exact:
        read -= unread_embedding_bytes(cfg, batch, weight_dtype_bytes)
    flops = costs.decode_step_flops(cfg, batch, context_tokens)
    return max(read / (tp * bw * b_eff), flops / (tp * peak * c_eff)) + overhead


@answer
def max_batch_for_tpot(model, context_tokens: int, tpot_s: float, *, bandwidth_gb_s: float, peak_tflops: float,
                       bandwidth_efficiency: float, compute_efficiency: float, step_overhead_s: float = 0.0,
                       weight_dtype_bytes: float = 2, kv_dtype_bytes: float = 2, tensor_parallel: int = 1,
                       read_exact: bool = False) -> int:
    """The largest batch whose :func:`decode_step_time` at ``context_tokens`` is at most ``tpot_s``.

    0 when even one sequence misses the target. The step time grows with the batch, so the
    answer is found by bisection (capped at :data:`MAX_BATCH_SEARCH`). ``read_exact`` as in
    :func:`decode_step_time`.
    """
    tpot_s = positive_number("tpot_s", tpot_s)
    positive_int("context_tokens", context_tokens, allow_zero=True)

    def step(b):
        return decode_step_time(model, b, context_tokens, bandwidth_gb_s=bandwidth_gb_s, peak_tflops=peak_tflops,
                                bandwidth_efficiency=bandwidth_efficiency, compute_efficiency=compute_efficiency,
                                step_overhead_s=step_overhead_s, weight_dtype_bytes=weight_dtype_bytes,
                                kv_dtype_bytes=kv_dtype_bytes, tensor_parallel=tensor_parallel,
                                read_exact=read_exact)

    return _largest_batch(step, tpot_s)


def _largest_batch(step, tpot_s: float) -> int:
    """The largest ``b`` with ``step(b) <= tpot_s`` for a step time that grows with ``b`` (0 if none)."""
    if step(1) > tpot_s:
        return 0
    low, high = 1, MAX_BATCH_SEARCH  # step(low) meets the target
    if step(high) <= tpot_s:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if step(mid) <= tpot_s else (low, mid)
    return low


@answer
def max_batch_in_memory(model, context_tokens: int, *, memory_gib: float, weight_dtype_bytes: float = 2,
                        kv_dtype_bytes: float = 2, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
                        tensor_parallel: int = 1) -> int:
    """How many sequences of ``context_tokens`` fit in a replica's cache (0 if none)::

        budget = memory_utilization * tensor_parallel * memory_gib * 2**30
        floor((budget - param_count * weight_dtype_bytes) / (context_tokens * kv_bytes_per_token))
    """
    cfg = as_model(model)
    context_tokens = positive_int("context_tokens", context_tokens)
    budget = (_fraction("memory_utilization", memory_utilization) * positive_int("tensor_parallel", tensor_parallel)
              * positive_number("memory_gib", memory_gib) * GIB)
    free = budget - costs.param_count(cfg) * positive_number("weight_dtype_bytes", weight_dtype_bytes)
    per_sequence = context_tokens * costs.kv_bytes_per_token(cfg, kv_dtype_bytes)
    return max(0, math.floor(free / per_sequence))


@answer
def max_batch(model, context_tokens: int, tpot_s: float, *, memory_gib: float, bandwidth_gb_s: float,
              peak_tflops: float, bandwidth_efficiency: float, compute_efficiency: float,
              step_overhead_s: float = 0.0, weight_dtype_bytes: float = 2, kv_dtype_bytes: float = 2,
              memory_utilization: float = DEFAULT_MEMORY_UTILIZATION, tensor_parallel: int = 1) -> int:
    """The largest batch of sequences of ``context_tokens`` that meets ``tpot_s`` AND fits in memory:
    the smaller of :func:`max_batch_for_tpot` and :func:`max_batch_in_memory`. Lab 14, exercise 1."""
    by_time = max_batch_for_tpot(model, context_tokens, tpot_s, bandwidth_gb_s=bandwidth_gb_s,
                                 peak_tflops=peak_tflops, bandwidth_efficiency=bandwidth_efficiency,
                                 compute_efficiency=compute_efficiency, step_overhead_s=step_overhead_s,
                                 weight_dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
                                 tensor_parallel=tensor_parallel)
    by_memory = max_batch_in_memory(model, context_tokens, memory_gib=memory_gib,
                                    weight_dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
                                    memory_utilization=memory_utilization, tensor_parallel=tensor_parallel)
    return min(by_time, by_memory)


def prefill_time(model, prompt_tokens: int, *, bandwidth_gb_s: float, peak_tflops: float,
                 bandwidth_efficiency: float, compute_efficiency: float, step_overhead_s: float = 0.0,
                 weight_dtype_bytes: float = 2, tensor_parallel: int = 1) -> float:
    """Seconds to prefill one prompt: the larger of its FLOPs (:func:`labsupport.costs.prefill_flops`,
    causal) over the achieved compute rate and its weight reads over the achieved bandwidth, plus
    the per-step overhead."""
    cfg = as_model(model)
    bw, peak, b_eff, c_eff, overhead, tp = _hardware(bandwidth_gb_s, peak_tflops, bandwidth_efficiency,
                                                     compute_efficiency, step_overhead_s, tensor_parallel)
    flops = costs.prefill_flops(cfg, prompt_tokens, causal=True)
    weights = costs.param_count(cfg) * positive_number("weight_dtype_bytes", weight_dtype_bytes)
    return max(flops / (tp * peak * c_eff), weights / (tp * bw * b_eff)) + overhead


def prefill_compute_time(model, prompt_tokens: int, *, peak_tflops: float, compute_efficiency: float,
                         tensor_parallel: int = 1) -> float:
    """Seconds of GPU time one prompt's prefill adds when it is batched with decode steps (chunked
    prefill, as vLLM and SGLang schedule it): its causal FLOPs over the achieved compute rate. The
    weights are read by the decode step anyway, so only the arithmetic is extra."""
    cfg = as_model(model)
    peak = positive_number("peak_tflops", peak_tflops) * 1e12
    c_eff = _fraction("compute_efficiency", compute_efficiency)
    tp = positive_int("tensor_parallel", tensor_parallel)
    return costs.prefill_flops(cfg, prompt_tokens, causal=True) / (tp * peak * c_eff)


# --- replicas, bursts, cost ---------------------------------------------------------------------


@answer
def replicas_for_rate(arrival_rate: float, time_in_system_s: float, batch_per_replica: int,
                      headroom: float = 0.0) -> int:
    """Replicas needed so that ``arrival_rate * time_in_system_s * (1 + headroom)`` requests fit in
    batches of ``batch_per_replica``: the ceiling of their ratio, and at least 1 (a service with no
    traffic at the moment, ``arrival_rate`` 0, still keeps one replica up). Lab 14, exercise 1."""
    arrival_rate = non_negative_number("arrival_rate", arrival_rate)
    time_in_system_s = positive_number("time_in_system_s", time_in_system_s)
    batch_per_replica = positive_int("batch_per_replica", batch_per_replica)
    headroom = non_negative_number("headroom", headroom)
    needed = arrival_rate * time_in_system_s * (1 + headroom) / batch_per_replica
    return max(1, math.ceil(needed - 1e-9))  # 1e-9: 3.0000000000000004 is 3 replicas


@answer
def cost_per_million_tokens(gpu_hour_price: float, gpu_count: int, tokens_per_second: float) -> float:
    """What a million tokens cost: ``gpu_hour_price * gpu_count / 3600 / tokens_per_second * 1e6``.

    ``gpu_hour_price`` per GPU per hour (the caller's figure), ``gpu_count`` every GPU paid for
    (replicas x tensor-parallel degree), ``tokens_per_second`` the tokens served by all of them.
    Lab 14, exercise 1.
    """
    price = positive_number("gpu_hour_price", gpu_hour_price)
    gpu_count = positive_int("gpu_count", gpu_count)
    tokens_per_second = positive_number("tokens_per_second", tokens_per_second)
    return price * gpu_count / SECONDS_PER_HOUR / tokens_per_second * 1e6


def poisson_quantile(mean: float, percent: float) -> int:
    """The smallest ``k`` with P(N <= k) >= ``percent``/100 for N Poisson with ``mean``."""
    mean = positive_number("mean", mean)
    p = _percent("percent", percent) / 100
    if mean > 1e5:  # normal approximation (continuity-corrected), exact enough for planning there
        z = math.sqrt(2) * _erfinv(2 * p - 1)
        return max(0, math.ceil(mean + z * math.sqrt(mean) - 0.5))
    k, log_pmf = 0, -mean
    total = math.exp(log_pmf)
    while total < p:
        k += 1
        log_pmf += math.log(mean / k)
        total += math.exp(log_pmf)
    return k


def _erfinv(y: float) -> float:
    # bisection on math.erf: no scipy needed
    low, high = -6.0, 6.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if math.erf(mid) < y else (low, mid)
    return (low + high) / 2


def burst_headroom(mean_concurrency: float, percent: float = 99.0) -> float:
    """Extra capacity, as a fraction of the mean, that covers the ``percent``-th percentile of
    concurrency under Poisson arrivals: ``poisson_quantile(mean, percent) / mean - 1`` (at least 0)."""
    mean_concurrency = positive_number("mean_concurrency", mean_concurrency)
    return max(0.0, poisson_quantile(mean_concurrency, percent) / mean_concurrency - 1)


# --- calibration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Efficiencies and overhead measured on one device, with where they came from."""

    bandwidth_efficiency: float  # achieved bandwidth over the reference bandwidth
    step_overhead_s: float  # fixed seconds per decode step
    reference_bandwidth_gb_s: float  # what the efficiency is a fraction of (a datasheet, or a copy measured)
    device: str
    date: str
    source: str  # how it was measured
    compute_efficiency: float | None = None  # achieved FLOP/s over the reference peak, when measured
    reference_peak_tflops: float | None = None  # what compute_efficiency is a fraction of

    def __str__(self) -> str:
        compute = (f", {self.compute_efficiency:.0%} of {self.reference_peak_tflops:,.1f} TFLOP/s"
                   if self.compute_efficiency is not None else "")
        return (f"{self.bandwidth_efficiency:.0%} of {self.reference_bandwidth_gb_s:,.0f} GB/s{compute}, "
                f"{self.step_overhead_s * 1e3:.2f} ms per step ({self.device}, {self.date}; {self.source})")


def fit_decode_steps(bytes_read: Sequence[float], seconds: Sequence[float], reference_bandwidth_gb_s: float,
                     *, device: str = "this machine", date: str = "", source: str = "fitted decode steps"
                     ) -> Calibration:
    """Fit ``seconds = bytes_read / achieved_bandwidth + overhead`` to measured decode steps.

    Least squares on the points; the overhead is kept at 0 or more and the achieved bandwidth
    positive. ``bandwidth_efficiency`` is the achieved bandwidth over ``reference_bandwidth_gb_s``
    (a datasheet's figure, or a copy bandwidth measured on the same machine); it may exceed 1 when
    the reference is too low (caches), which the result reports as it is.
    """
    x = np.asarray([positive_number("each bytes_read", b) for b in bytes_read], dtype=float)
    y = np.asarray([positive_number("each of seconds", s) for s in seconds], dtype=float)
    if len(x) != len(y) or len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError("fit_decode_steps needs as many times as byte counts, at least two different byte counts; "
                         f"got {len(x)} byte counts and {len(y)} times")
    reference = positive_number("reference_bandwidth_gb_s", reference_bandwidth_gb_s) * GB
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # refit through the origin: overhead 0
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return Calibration(bandwidth_efficiency=float(1 / slope / reference), step_overhead_s=float(intercept),
                       reference_bandwidth_gb_s=reference / GB, device=device, date=date, source=source)


def measured_h200_calibration(results: dict | None = None) -> Calibration | None:
    """The book's worked example of efficiency from measurement: chapter 05's decode sweep.

    Reads ``results/gpu_phases.json`` (:data:`labsupport.phases.GPU_RESULTS`; pass ``results`` to
    use another run of :mod:`labsupport.bench_phases`). The planner's step is ``bytes / achieved
    bandwidth + overhead`` (:func:`decode_step_time` with ``read_exact``), so the calibration fits
    exactly that line, by :func:`fit_decode_steps`, through two measured steps: the batch-1 step
    replayed from a CUDA graph and the largest decode batch (eager, but long enough that its
    launches hide behind the GPU's work). Both are counted in the bytes a step really reads, the
    run's ``bytes_read``: every weight once except the untied input embedding table, of which a
    step reads one row per sequence. The line passes through both points, so the planner
    reproduces the steps it was fitted on (``tests/test_planning.py`` checks it). The other eager
    steps are launch-bound (chapter 05) and are not used. The **efficiency** is the fitted
    bandwidth over the datasheet bandwidth of the GPU the run names
    (:func:`labsupport.hardware.match_device_name`). Without a CUDA-graph step the efficiency is the
    largest batch's bytes over its time and the overhead 0. The **compute efficiency** is the median
    prefill rate of the sweep, under the runbook's FLOP count with the causal halving (what
    :func:`labsupport.costs.prefill_flops` counts, so the planner's prefill times use the same
    count), over the datasheet's dense bf16 peak. None when there is no real run, or when the
    device has no datasheet row.
    """
    results = load_gpu_results() if results is None else results
    if not results:
        return None
    gpu = match_device_name(results.get("device", ""))
    steps = [r for r in results.get("decode_by_batch", []) if r.get("seconds")]
    if gpu is None or not steps:
        return None
    largest = max(steps, key=lambda r: r["batch"])
    graph = _graph_step(results)
    reference_gb_s = gpu.hbm_bandwidth / GB
    where = f"decode batch {largest['batch']} at {largest['context']:,} tokens"
    if graph is not None and graph[0] != largest["bytes_read"]:
        line = fit_decode_steps([graph[0], largest["bytes_read"]], [graph[1], largest["seconds"]], reference_gb_s)
        efficiency, overhead = line.bandwidth_efficiency, line.step_overhead_s
        where = f"a line through the batch-1 CUDA-graph step and {where}, in the bytes a step reads"
    else:
        efficiency, overhead = largest["bytes_read"] / largest["seconds"] / gpu.hbm_bandwidth, 0.0
        where += ", no overhead (no CUDA-graph step in the run)"
    rates = sorted(r["tflops_runbook_causal"] for r in results.get("prefill", []) if r.get("tflops_runbook_causal"))
    compute = float(np.median(rates)) * 1e12 / gpu.peak_flops if rates else None
    return Calibration(
        compute_efficiency=compute, reference_peak_tflops=gpu.peak_flops / 1e12 if rates else None,
        bandwidth_efficiency=efficiency, step_overhead_s=overhead, reference_bandwidth_gb_s=reference_gb_s,
        device=results["device"], date=results.get("date", "undated"),
        source=(f"{GPU_RESULTS}: {where}, over the {gpu.name} datasheet bandwidth"
                + ("; compute from the median prefill rate of the sweep" if rates else "")))


def _graph_step(results: dict) -> tuple[float, float] | None:
    """(bytes read, seconds) of the run's batch-1 step replayed from a CUDA graph, or None.

    The bytes are what the benchmark divided by (its ``achieved_Bps`` times the time); a run that
    recorded only the time takes the bytes of its first batch-1 eager step, the same short context."""
    graph = results.get("decode_batch1_short_cuda_graph") or {}
    seconds = graph.get("seconds")
    if not seconds:
        return None
    if graph.get("achieved_Bps"):
        return graph["achieved_Bps"] * seconds, seconds
    b1 = next((r for r in results.get("decode_by_context", []) if r.get("seconds") and r.get("batch") == 1), None)
    return (b1["bytes_read"], seconds) if b1 else None


# --- the planner --------------------------------------------------------------------------------


def _lengths(name: str, value) -> tuple[float, tuple[int, ...] | None]:
    """(mean, samples-or-None) of a length given as a number or a list of samples."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return positive_number(name, value), None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a mean length in tokens (a number) or a non-empty list of lengths, "
                         f"got {value!r}")
    samples = tuple(positive_int(f"each of {name}", v) for v in value)
    return sum(samples) / len(samples), samples


def _running_context(mean_prompt: float, prompt_samples, output_samples, mean_output: float) -> float:
    """Mean context of a sequence in a decode step, over the steps (what a step's KV read averages).

    A request with prompt ``p`` and output ``o`` is in ``o - 1`` decode steps, at contexts ``p + 1`` to
    ``p + o - 1``: ``p + o / 2`` on average. A step samples requests in proportion to their steps (a
    long answer sits in many more steps than a short one), so over a workload the mean is
    ``sum((o - 1) * (p + o / 2)) / sum(o - 1)``. With every output of one length that is
    ``mean prompt + mean output / 2``; with a spread of output lengths it is larger, by about
    ``variance(o) / (2 * mean(o))``, and taking the plain means would underprice the step.
    """
    if output_samples is None:
        return mean_prompt + mean_output / 2
    if prompt_samples is not None and len(prompt_samples) == len(output_samples):
        pairs = list(zip(prompt_samples, output_samples))
    else:  # prompts and outputs not paired: the mean prompt for each
        pairs = [(mean_prompt, o) for o in output_samples]
    steps = sum(o - 1 for _, o in pairs)
    if steps == 0:  # every answer is one token: no decode steps at all
        return mean_prompt + mean_output / 2
    return sum((o - 1) * (p + o / 2) for p, o in pairs) / steps


@dataclass(frozen=True)
class PlanSettings:
    """Everything :func:`plan` takes, validated and normalised once (module docstring: units).

    Build it with :meth:`create` (plan's own keyword arguments); the planner's pieces read it whole.
    Lengths are kept as their mean and, when samples were given, the samples."""

    cfg: ModelConfig
    card: GPU
    arrival_rate: float
    mean_prompt: float
    prompt_samples: tuple[int, ...] | None
    mean_output: float
    output_samples: tuple[int, ...] | None
    ttft_target_s: float
    tpot_target_s: float
    percentile: float
    burst_percentile: float
    headroom: float | None  # None: from the spread of Poisson concurrency
    gpu_hour_price: float | None
    tensor_parallel: int
    weight_dtype_bytes: float
    kv_dtype_bytes: float
    memory_utilization: float
    bandwidth_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    fp8_compute: bool

    @classmethod
    def create(cls, model, gpu, *, arrival_rate: float, prompt_tokens, output_tokens, ttft_target_s: float,
               tpot_target_s: float, bandwidth_efficiency: float, compute_efficiency: float,
               step_overhead_s: float = 0.0, percentile: float = 99.0, weight_dtype_bytes: float = 2,
               kv_dtype_bytes: float = 2, tensor_parallel: int = 1,
               memory_utilization: float = DEFAULT_MEMORY_UTILIZATION, headroom: float | None = None,
               burst_percentile: float = 99.0, gpu_hour_price: float | None = None,
               fp8_compute: bool = False) -> "PlanSettings":
        """Check every argument of :func:`plan` (same names) and return them normalised."""
        card = as_gpu(gpu)
        mean_prompt, prompt_samples = _lengths("prompt_tokens", prompt_tokens)
        mean_output, output_samples = _lengths("output_tokens", output_tokens)
        if mean_output < 1:
            raise ValueError(f"output_tokens must be at least 1 on average, got {mean_output}")
        if not isinstance(fp8_compute, bool):
            raise ValueError(f"fp8_compute must be True or False, got {fp8_compute!r}")
        if fp8_compute and not card.fp8_peak_flops:
            raise ValueError(f"fp8_compute=True needs FP8 tensor cores, which the {card.name} does not have: "
                             f"plan its FP8 weights with fp8_compute=False (dequantised to 16 bits, as on Ampere)")
        _hardware(card.hbm_bandwidth / GB, card.peak_flops / 1e12, bandwidth_efficiency, compute_efficiency,
                  step_overhead_s, tensor_parallel)  # the same checks as every step-time function
        return cls(
            cfg=as_model(model), card=card, arrival_rate=positive_number("arrival_rate", arrival_rate),
            mean_prompt=mean_prompt, prompt_samples=prompt_samples, mean_output=mean_output,
            output_samples=output_samples, ttft_target_s=positive_number("ttft_target_s", ttft_target_s),
            tpot_target_s=positive_number("tpot_target_s", tpot_target_s),
            percentile=_percent("percentile", percentile),
            burst_percentile=_percent("burst_percentile", burst_percentile),
            headroom=None if headroom is None else non_negative_number("headroom", headroom),
            gpu_hour_price=None if gpu_hour_price is None else positive_number("gpu_hour_price", gpu_hour_price),
            tensor_parallel=positive_int("tensor_parallel", tensor_parallel),
            weight_dtype_bytes=positive_number("weight_dtype_bytes", weight_dtype_bytes),
            kv_dtype_bytes=positive_number("kv_dtype_bytes", kv_dtype_bytes),
            memory_utilization=_fraction("memory_utilization", memory_utilization),
            bandwidth_efficiency=bandwidth_efficiency, compute_efficiency=compute_efficiency,
            step_overhead_s=step_overhead_s, fp8_compute=fp8_compute)

    @property
    def peak_flops(self) -> float:
        """The matmuls' datasheet peak, FLOP/s: FP8's with ``fp8_compute``, else the dense bf16 one."""
        return self.card.fp8_peak_flops if self.fp8_compute else self.card.peak_flops

    @property
    def memory_gib(self) -> float:
        return self.card.usable_bytes / GIB

    def hardware(self) -> dict:
        """The keyword arguments the step- and prefill-time functions take for this deployment."""
        return dict(bandwidth_gb_s=self.card.hbm_bandwidth / GB, peak_tflops=self.peak_flops / 1e12,
                    bandwidth_efficiency=self.bandwidth_efficiency, compute_efficiency=self.compute_efficiency,
                    step_overhead_s=self.step_overhead_s, tensor_parallel=self.tensor_parallel)

    def step_time(self, batch: int, context_tokens: int) -> float:
        """The plan's decode step: :func:`decode_step_time` in the bytes a step reads (``read_exact``),
        the way :func:`measured_h200_calibration` fits its efficiency."""
        return decode_step_time(self.cfg, batch, context_tokens, weight_dtype_bytes=self.weight_dtype_bytes,
                                kv_dtype_bytes=self.kv_dtype_bytes, read_exact=True, **self.hardware())

    def batch_for_tpot(self, context_tokens: int, tpot_s: float) -> int:
        """The largest batch whose :meth:`step_time` meets ``tpot_s`` (0 if none does)."""
        return _largest_batch(lambda b: self.step_time(b, context_tokens), tpot_s)

    def batch_in_memory(self, context_tokens: int) -> int:
        return max_batch_in_memory(self.cfg, context_tokens, memory_gib=self.memory_gib,
                                   weight_dtype_bytes=self.weight_dtype_bytes, kv_dtype_bytes=self.kv_dtype_bytes,
                                   memory_utilization=self.memory_utilization, tensor_parallel=self.tensor_parallel)

    def mean_prefill(self, seconds_for) -> float:
        """``seconds_for(prompt_tokens)`` averaged over the prompts: over the samples when there are
        some (prefill's cost grows faster than linearly with the prompt, so the cost of the mean prompt
        would underprice it), else at the mean prompt."""
        if self.prompt_samples is None:
            return seconds_for(math.ceil(self.mean_prompt))
        return sum(seconds_for(p) for p in self.prompt_samples) / len(self.prompt_samples)


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` returns. Times in seconds, memory in bytes, rates per second."""

    # the workload as planned
    arrival_rate: float  # requests per second
    mean_prompt_tokens: float
    mean_output_tokens: float
    step_context_tokens: int  # context the decode step is priced at: a running sequence's mean (_running_context)
    memory_context_tokens: int  # context memory is sized for (percentile of prompt + output)
    # one replica
    gpus_per_replica: int  # the tensor-parallel degree
    weight_bytes: float  # per replica, all its GPUs together
    kv_bytes_per_token: float
    prefill_s: float  # a prompt's prefill on its own (weights read, FLOPs done, overhead), mean over the prompts
    prefill_compute_s: float  # GPU time a prefill adds batched with decode steps (its FLOPs only), mean over the prompts
    ttft_s: float  # predicted TTFT at the percentile: its prompt's prefill plus one decode step
    prefill_share: float  # fraction of a replica's time spent prefilling: rate per replica x prefill_compute_s
    batch_for_tpot: int  # largest batch meeting the TPOT target (prefill interference included)
    batch_in_memory: int  # largest batch whose cache fits
    batch: int  # the smaller: what one replica runs at most
    step_s: float  # decode step at that batch (before interference)
    tpot_s: float  # predicted MEAN TPOT at that batch, prefill interference included (not a percentile)
    kv_cache_bytes: float  # cache of `batch` sequences at memory_context_tokens
    memory_budget_bytes: float  # memory_utilization x the replica's memory
    # the fleet
    time_in_system_s: float  # mean prefill + (mean output - 1) x TPOT target
    concurrency: float  # Little's law: mean requests in the system
    headroom: float  # extra capacity as a fraction of the mean concurrency
    replicas: int
    gpus: int  # replicas x gpus_per_replica
    utilisation: float  # mean concurrency / (replicas x batch): share of batch slots in use on average
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt and output tokens
    cost_per_million_output_tokens: float | None  # None without a gpu_hour_price
    cost_per_million_tokens: float | None  # prompt and output tokens together
    # targets and whether they are met
    ttft_target_s: float
    tpot_target_s: float
    percentile: float
    meets_ttft: bool
    feasible: bool  # a replica can run at least one sequence within the TPOT target and its memory
    notes: tuple[str, ...] = ()  # why something is infeasible, and the assumptions taken
    # the same fleet at saturation: every batch slot busy, so the tokens per second divided by the
    # utilisation; the floor of what a token can cost on this fleet (None without a price)
    cost_per_million_output_tokens_at_saturation: float | None = None
    cost_per_million_tokens_at_saturation: float | None = None
    matmul_peak_flops: float = 0.0  # the datasheet peak the compute efficiency is a fraction of (bf16, or FP8)


def plan(model, gpu, *, arrival_rate: float, prompt_tokens, output_tokens, ttft_target_s: float,
         tpot_target_s: float, bandwidth_efficiency: float, compute_efficiency: float,
         step_overhead_s: float = 0.0, percentile: float = 99.0, weight_dtype_bytes: float = 2,
         kv_dtype_bytes: float = 2, tensor_parallel: int = 1,
         memory_utilization: float = DEFAULT_MEMORY_UTILIZATION, headroom: float | None = None,
         burst_percentile: float = 99.0, gpu_hour_price: float | None = None, fp8_compute: bool = False) -> Plan:
    """Plan a deployment of ``model`` on ``gpu`` for a workload (module docstring: conventions).

    ``prompt_tokens`` and ``output_tokens`` are mean lengths, or lists of sampled lengths (then the
    mean drives Little's law and the decode step, the ``percentile``-th percentile drives memory
    and TTFT, and a prefill's cost is averaged over the sampled prompts). ``bandwidth_efficiency``
    and ``compute_efficiency`` are measured fractions of the GPU's datasheet bandwidth and compute
    (:func:`measured_h200_calibration`, :func:`fit_decode_steps`). ``headroom`` None sizes for the
    ``burst_percentile``-th percentile of Poisson concurrency (:func:`burst_headroom`).
    ``gpu_hour_price`` is the caller's price of one GPU for one hour. ``fp8_compute`` runs the
    matmuls at the GPU's FP8 peak (weights and activations in FP8, W8A8, as vLLM's fp8
    quantisation runs on Hopper), twice the bf16 peak on Hopper; refused on a GPU without FP8
    tensor cores. The arguments are checked once, into a :class:`PlanSettings`.
    """
    return plan_from(PlanSettings.create(
        model, gpu, arrival_rate=arrival_rate, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        ttft_target_s=ttft_target_s, tpot_target_s=tpot_target_s, bandwidth_efficiency=bandwidth_efficiency,
        compute_efficiency=compute_efficiency, step_overhead_s=step_overhead_s, percentile=percentile,
        weight_dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, tensor_parallel=tensor_parallel,
        memory_utilization=memory_utilization, headroom=headroom, burst_percentile=burst_percentile,
        gpu_hour_price=gpu_hour_price, fp8_compute=fp8_compute))


def plan_from(s: PlanSettings) -> Plan:
    """:func:`plan` for settings already checked: size memory, prefill, the fleet, then price it."""
    step_context, memory_context, prompt_p = _contexts(s)
    prefill_mean = s.mean_prefill(lambda p: prefill_time(s.cfg, p, weight_dtype_bytes=s.weight_dtype_bytes,
                                                         **s.hardware()))
    prefill_work = s.mean_prefill(lambda p: prefill_compute_time(
        s.cfg, p, peak_tflops=s.peak_flops / 1e12, compute_efficiency=s.compute_efficiency,
        tensor_parallel=s.tensor_parallel))
    in_memory = s.batch_in_memory(memory_context)
    # Little's law over the running batch (module docstring): the TPOT target, not the prediction
    time_in_sys = prefill_mean + (s.mean_output - 1) * s.tpot_target_s
    mean_concurrency = s.arrival_rate * time_in_sys
    room = s.headroom if s.headroom is not None else burst_headroom(mean_concurrency, s.burst_percentile)
    replicas = _fewest_replicas(s, step_context, in_memory, prefill_work, time_in_sys, room)
    share = s.arrival_rate / replicas * prefill_work if replicas else 0.0
    by_time = s.batch_for_tpot(step_context, s.tpot_target_s * (1 - share)) if share < 1 else 0
    batch = min(by_time, in_memory)
    feasible = batch >= 1
    replicas = replicas if feasible else 0
    step = s.step_time(batch, step_context) if feasible else math.inf
    tpot = step / (1 - share) if feasible else math.inf
    prefill_p = prefill_time(s.cfg, math.ceil(prompt_p), weight_dtype_bytes=s.weight_dtype_bytes, **s.hardware())
    ttft = prefill_p + (step if feasible else 0.0)
    gpus = replicas * s.tensor_parallel
    out_rate = s.arrival_rate * s.mean_output
    all_rate = s.arrival_rate * (s.mean_output + s.mean_prompt)
    utilisation = mean_concurrency / (replicas * batch) if feasible else 0.0

    def price(tokens: float) -> float | None:
        if s.gpu_hour_price is None or not feasible:
            return None
        return cost_per_million_tokens(s.gpu_hour_price, gpus, tokens)

    kv_token = costs.kv_bytes_per_token(s.cfg, s.kv_dtype_bytes)
    return Plan(
        arrival_rate=s.arrival_rate, mean_prompt_tokens=s.mean_prompt, mean_output_tokens=s.mean_output,
        step_context_tokens=step_context, memory_context_tokens=memory_context, gpus_per_replica=s.tensor_parallel,
        weight_bytes=float(costs.param_count(s.cfg) * s.weight_dtype_bytes), kv_bytes_per_token=float(kv_token),
        prefill_s=prefill_mean, prefill_compute_s=prefill_work, ttft_s=ttft, prefill_share=share if feasible else 0.0,
        batch_for_tpot=by_time, batch_in_memory=in_memory, batch=batch, step_s=step, tpot_s=tpot,
        kv_cache_bytes=float(batch * memory_context * kv_token),
        memory_budget_bytes=s.memory_utilization * s.tensor_parallel * s.memory_gib * GIB,
        time_in_system_s=time_in_sys, concurrency=mean_concurrency, headroom=room, replicas=replicas, gpus=gpus,
        utilisation=utilisation, output_tokens_per_s=out_rate, total_tokens_per_s=all_rate,
        cost_per_million_output_tokens=price(out_rate), cost_per_million_tokens=price(all_rate),
        ttft_target_s=s.ttft_target_s, tpot_target_s=s.tpot_target_s, percentile=s.percentile,
        meets_ttft=ttft <= s.ttft_target_s, feasible=feasible,
        notes=_notes(s, memory_context, in_memory, by_time, feasible, ttft, room),
        cost_per_million_output_tokens_at_saturation=price(out_rate / utilisation) if feasible else None,
        cost_per_million_tokens_at_saturation=price(all_rate / utilisation) if feasible else None,
        matmul_peak_flops=s.peak_flops,
    )


def _contexts(s: PlanSettings) -> tuple[int, int, float]:
    """(the context the decode step is priced at, the context memory is sized for, the prompt at the
    percentile): the step at a running sequence's mean context, memory for every slot holding a
    sequence at full length at the ``percentile``-th percentile, TTFT at the percentile prompt."""
    prompt_p = nearest_rank(s.prompt_samples, s.percentile) if s.prompt_samples else s.mean_prompt
    if s.prompt_samples and s.output_samples and len(s.prompt_samples) == len(s.output_samples):
        full = [p + o for p, o in zip(s.prompt_samples, s.output_samples)]
        memory_context = math.ceil(nearest_rank(full, s.percentile))
    else:
        output_p = nearest_rank(s.output_samples, s.percentile) if s.output_samples else s.mean_output
        memory_context = math.ceil(prompt_p + output_p)
    step_context = math.ceil(_running_context(s.mean_prompt, s.prompt_samples, s.output_samples, s.mean_output))
    return step_context, memory_context, prompt_p


def _fewest_replicas(s: PlanSettings, step_context: int, in_memory: int, prefill_work: float,
                     time_in_sys: float, room: float) -> int:
    """The fewest replicas that carry the load each with its own batch, or 0 when no batch of one fits.

    Prefill share and batch depend on each other through the replica count: more replicas, less
    prefill each, a longer decode budget, a larger batch. The condition only gets easier as the
    count grows, so search by doubling, then bisection."""

    def enough(r: int) -> bool:
        share = s.arrival_rate / r * prefill_work
        if share >= 1:
            return False
        b = min(s.batch_for_tpot(step_context, s.tpot_target_s * (1 - share)), in_memory)
        return b >= 1 and replicas_for_rate(s.arrival_rate, time_in_sys, b, room) <= r

    if min(s.batch_for_tpot(step_context, s.tpot_target_s), in_memory) < 1:
        return 0
    low, high = 0, 1  # enough(high) is unknown until checked; enough(low) is False
    while not enough(high):
        low, high = high, high * 2
        if high > 1 << 40:
            raise ValueError("the planner found no replica count that carries this load; check the inputs")
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def _notes(s: PlanSettings, memory_context: int, in_memory: int, by_time: int, feasible: bool, ttft: float,
           room: float) -> tuple[str, ...]:
    """Why a plan is infeasible, which target it misses, and the assumptions it took."""
    notes = []
    if not feasible and in_memory == 0:
        notes.append(f"the weights and one sequence of {memory_context:,} tokens do not fit in "
                     f"{s.memory_utilization:.0%} of {s.tensor_parallel} x {s.memory_gib:.1f} GiB: use more GPUs per "
                     f"replica (tensor_parallel) or fewer bytes per element")
    if not feasible and by_time == 0:
        notes.append("even one sequence misses the TPOT target: a decode step reads every weight, so use more "
                     "GPUs per replica (tensor_parallel), fewer bytes per weight, or a looser target")
    if ttft > s.ttft_target_s:
        notes.append(f"the predicted TTFT at the {s.percentile:g}th percentile prompt ({ttft:.3f} s) misses the "
                     f"{s.ttft_target_s:.3f} s target: prefill needs more compute per replica (tensor_parallel)")
    if s.headroom is None:
        notes.append(f"headroom {room:.0%} covers the {s.burst_percentile:g}th percentile of Poisson concurrency; "
                     f"bursts beyond Poisson need more")
    if feasible:
        notes.append("the TPOT target is met by the mean TPOT (steps carrying a prefill chunk are longer than the "
                     "rest, and the batch varies): a target at a percentile needs the margin a load test measures")
        notes.append("prefill interference is added to the decode steps (an upper bound: an engine that folds "
                     "prefill chunks into memory-bound decode steps hides part of it); a load test decides")
    if s.tensor_parallel > 1:
        notes.append(f"the all-reduces between the {s.tensor_parallel} GPUs of a replica (two per layer per step) "
                     f"are not modelled: the step time is a lower bound by their cost")
    return tuple(notes)
