"""Prefill and decode on separate GPUs, and attention split by requests: the arithmetic (chapters 11 and 14).

**The KV transfer.** A disaggregated deployment (DistServe, Zhong et al., OSDI 2024; Splitwise, Patel
et al., ISCA 2024) prefills a prompt on one pool of GPUs and decodes it on another, so the prompt's
whole KV cache crosses between them: ``prompt_tokens * kv_bytes_per_token`` bytes
(:func:`kv_transfer_bytes`). Whether that is cheap is a ratio: its time over the link against the
prefill that produced it (:func:`kv_transfer_time`). Both grow with the prompt, but the prefill
grows faster (its attention term is quadratic), and a large model's prefill is longer for the same
cache, so the ratio is worst for small models and short prompts.

**Sizing the two pools** (:func:`disaggregated_fleet`, chapter 14). The prefill pool must keep up
with the arrivals' prefill work: ``rate * mean prefill alone / utilisation`` GPUs' worth, where the
utilisation target leaves room for the queueing a busy pool builds. The decode pool runs steps that
carry no prefill, so a replica's whole TPOT budget goes to decoding: the batch is the largest that
meets the target and fits, with no interference term, and the replica count follows from Little's law
over the decode phase alone, with the same burst headroom as :func:`labsupport.planning.plan`.

**Data-parallel attention** (:func:`kv_bytes_per_gpu`). Tensor parallelism splits attention by KV
heads; a model with fewer KV heads than GPUs repeats each head on several of them, and one with a
single latent per token (DeepSeek's multi-head latent attention) repeats the whole cache on every
GPU. Data-parallel attention gives each GPU its own requests instead, so each token's cache is held
once, and the experts of the MoE layers are split across the same GPUs (expert parallelism), with
an all-to-all taking each token to its experts and back (SGLang's DP attention for DeepSeek models,
LMSYS blog, December 2024; the DeepSeek-V3 technical report, arXiv:2412.19437, section 3.4).
"""

from __future__ import annotations

import math

from . import costs
from ._validate import positive_int, positive_number
from .models import as_model
from .planning import PlanSettings, burst_headroom, replicas_for_rate

__all__ = ["disaggregated_fleet", "kv_bytes_per_gpu", "kv_transfer_bytes", "kv_transfer_time"]


def kv_transfer_bytes(model, prompt_tokens: int, kv_dtype_bytes: float = 2) -> float:
    """Bytes of a prompt's KV cache that a disaggregated deployment moves from prefill to decode."""
    return positive_int("prompt_tokens", prompt_tokens) * costs.kv_bytes_per_token(as_model(model), kv_dtype_bytes)


def kv_transfer_time(model, prompt_tokens: int, link_bytes_per_s: float, kv_dtype_bytes: float = 2) -> float:
    """Seconds to move that cache over a link of ``link_bytes_per_s`` (one direction), at the link's
    full rate: a lower bound (no protocol overhead, no per-block latency)."""
    return kv_transfer_bytes(model, prompt_tokens, kv_dtype_bytes) / positive_number("link_bytes_per_s",
                                                                                     link_bytes_per_s)


def kv_bytes_per_gpu(values_per_token_layer: int, layers: int, *, gpus: int, kv_heads: int | None,
                     dtype_bytes: float = 2, data_parallel_attention: bool = False) -> float:
    """Bytes one GPU holds per token of cache, for a token whose cache is ``values_per_token_layer``
    numbers per layer spread over ``kv_heads`` heads (None: one latent that cannot be split by heads,
    as in multi-head latent attention).

    Tensor-parallel attention over ``gpus`` GPUs: each holds ``max(1, kv_heads / gpus)`` heads' share,
    that is the whole latent when there are no heads to split. Data-parallel attention: the token lives
    on one GPU only, so its bytes averaged over the GPUs are the whole cache over ``gpus``."""
    values = positive_int("values_per_token_layer", values_per_token_layer)
    layers = positive_int("layers", layers)
    gpus = positive_int("gpus", gpus)
    total = values * layers * positive_number("dtype_bytes", dtype_bytes)
    if data_parallel_attention:
        return total / gpus
    if kv_heads is None:
        return total
    heads = positive_int("kv_heads", kv_heads)
    return total * max(1, math.ceil(heads / gpus)) / heads


def disaggregated_fleet(s: PlanSettings, *, prefill_utilization: float = 0.7) -> dict:
    """Prefill and decode pools for the workload of ``s`` (module docstring), each of ``s.tensor_parallel``
    GPUs per replica. Returns ``{"prefill_replicas", "decode_replicas", "decode_batch", "gpus",
    "prefill_busy", "ttft_s"}``: ``prefill_busy`` is the prefill pool's share of time busy, and the TTFT the
    percentile prompt's prefill alone plus one decode step (the transfer and any queue left out).
    No decode replica can serve when even one sequence misses the TPOT target or does not fit: then
    every count is 0."""
    if not 0 < prefill_utilization <= 1:
        raise ValueError(f"prefill_utilization is a fraction of the prefill pool's time, above 0 and at most 1; "
                         f"got {prefill_utilization!r}")
    step_context, memory_context, prompt_p = s.contexts()
    alone = s.mean_prefill(lambda p: s.prefill_alone_s(p, s.cached_tokens(p)))
    work = s.arrival_rate * alone  # prefill replicas' worth of busy time per second
    prefill_replicas = max(1, math.ceil(work / prefill_utilization - 1e-9))
    batch = min(s.batch_for_tpot(step_context, s.tpot_target_s), s.batch_in_memory(memory_context))
    first = math.ceil(prompt_p)
    ttft = s.prefill_alone_s(first, s.cached_tokens(first))
    if batch < 1:
        return {"prefill_replicas": 0, "decode_replicas": 0, "decode_batch": 0, "gpus": 0, "prefill_busy": 0.0,
                "ttft_s": ttft}
    decoding_s = max(1.0, s.mean_output - 1) * s.tpot_target_s  # the prefill made the first token; one step at least
    in_flight = s.arrival_rate * decoding_s
    room = s.headroom if s.headroom is not None else burst_headroom(in_flight, s.burst_percentile)
    decode_replicas = replicas_for_rate(s.arrival_rate, decoding_s, batch, room)
    return {"prefill_replicas": prefill_replicas, "decode_replicas": decode_replicas, "decode_batch": batch,
            "gpus": (prefill_replicas + decode_replicas) * s.tensor_parallel, "prefill_busy": work / prefill_replicas,
            "ttft_s": ttft + s.step_time(batch, step_context)}
