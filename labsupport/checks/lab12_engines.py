"""Checks for the engines lab: predict an engine's KV cache capacity from its settings."""

from __future__ import annotations

import math

from ..costs import param_count
from ..kv_capacity import GIB, kv_capacity
from ..models import ModelConfig, get_model
from .framework import Case, graded

KEYS = ("num_blocks", "tokens", "max_requests")

CAPACITY_RULE = (
    "the budget is gpu_memory_utilization of the TOTAL memory, counted in GiB (2**30 bytes); the cache gets "
    "the budget less the weights and the reserve (GiB too); a block holds the keys and values of block_size "
    "tokens for every layer and KV head (not query head); count whole blocks (round down, never below 0); the "
    "tokens are those blocks' slots; a request of max_model_len tokens holds whole blocks, so max_requests "
    "counts the requests whose blocks all fit."
)


def _variant(cfg, gib, max_len, util, block, kvb, wb, reserve, *, heads=None, unit=GIB, floor_blocks=True,
             util_on_free=False, whole_request_blocks=True, subtract_weights=True) -> dict:
    """The result with one step done wrong (the defaults give the right one)."""
    weights = param_count(cfg) * wb if subtract_weights else 0
    total, res = gib * unit, reserve * unit
    kv_bytes = (total - weights - res) * util if util_on_free else util * total - weights - res
    per_token = 2 * cfg.n_layers * (heads or cfg.n_kv_heads) * cfg.head_dim * kvb
    if floor_blocks:
        blocks = max(0, math.floor(kv_bytes / (block * per_token)))
        tokens = blocks * block
    else:  # whole tokens, not whole blocks
        tokens = max(0, math.floor(kv_bytes / per_token))
        blocks = tokens / block
    per_request = -(-max_len // block) if whole_request_blocks else max_len / block
    return {"num_blocks": blocks, "tokens": tokens, "max_requests": math.floor(blocks / per_request)}


def _mistakes(cfg, *args) -> dict[str, dict]:
    return {
        "the cache is sized from the query heads (n_heads) instead of the KV heads (n_kv_heads)":
            _variant(cfg, *args, heads=cfg.n_heads),
        "gigabytes (10**9 bytes) are used instead of GiB (2**30 bytes)": _variant(cfg, *args, unit=1e9),
        "the cache is counted in whole tokens, not rounded down to whole blocks":
            _variant(cfg, *args, floor_blocks=False),
        "gpu_memory_utilization is applied to the memory left after the weights and reserve instead of to the "
        "total": _variant(cfg, *args, util_on_free=True),
        "a request's blocks are not rounded up (max_model_len / block_size instead of its ceiling)":
            _variant(cfg, *args, whole_request_blocks=False),
        "the weights are not subtracted": _variant(cfg, *args, subtract_weights=False),
    }


def capacity_cases() -> list[tuple]:
    """(cfg, label, gpu_memory_gib, max_model_len, utilization, block_size, kv_dtype_bytes,
    weight_dtype_bytes, reserve_gib); None means the default."""
    m8, qwen = get_model("llama-3.1-8b"), get_model("qwen3-8b")
    mha = ModelConfig("mha-test", n_layers=6, d_model=512, n_heads=8, n_kv_heads=8, d_ff=1024, vocab_size=1000)
    return [
        (m8, "H100 80 GiB, defaults", 80, 8192, None, None, None, None, None),
        (m8, "H100 as torch reports it", 79.18, 8000, 0.9, 16, 2, 2, 2.5),  # 8000: not a multiple of 16
        (qwen, "L40S, fp8 cache", 44.4, 32768, 0.92, 32, 1, 2, 1.0),
        (m8, "24 GiB, 4100-token requests", 23.58, 4100, 0.85, 16, 2, 2, 0.5),
        (mha, "small model, block 7", 1.0, 100, 0.5, 7, 4, 4, 0.0),  # MHA: query and KV heads agree
        (m8, "weights do not fit", 16, 4096, 0.9, 16, 2, 2, 0.0),
    ]


@graded(points=10, bans=(kv_capacity,))
def check_kv_capacity(fn, checker):
    """``fn(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
    kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0)`` must return
    ``{"num_blocks", "tokens", "max_requests"}`` by the convention of :mod:`labsupport.kv_capacity`."""
    names = ("gpu_memory_utilization", "block_size", "kv_dtype_bytes", "weight_dtype_bytes", "reserve_gib")
    defaults = (0.9, 16, 2, 2, 0.0)
    for cfg, label, gib, max_len, *settings in capacity_cases():
        kwargs = {n: v for n, v in zip(names, settings) if v is not None}
        case = Case(model=cfg.name, gpu=label, gpu_memory_gib=gib, max_model_len=max_len,
                    **(kwargs or {"settings": "defaults"}))
        got = checker.call(fn, cfg, gib, max_len, case=case, **kwargs)
        if not isinstance(got, dict) or set(got) != set(KEYS):
            checker.fail(case, f"your function returned {type(got).__name__} "
                               f"{sorted(got) if isinstance(got, dict) else ''}, expected a dict with exactly the "
                               f"keys {', '.join(KEYS)}.", "return {'num_blocks': ..., 'tokens': ..., "
                                                           "'max_requests': ...}")
        full = [v if v is not None else d for v, d in zip(settings, defaults)]
        expected = kv_capacity(cfg, gib, max_len, **dict(zip(names, full)))
        mistakes = _mistakes(cfg, gib, max_len, *full)
        for key in KEYS:
            wrong = {d: m[key] for d, m in mistakes.items() if m[key] != expected[key]}
            checker.expect_number(got[key], expected[key], case=case, rel=1e-12, what=key,
                                  hint=CAPACITY_RULE, mistakes=wrong)
            if not isinstance(got[key], int) and float(got[key]) != int(got[key]):
                checker.fail(case, f"{key} is {got[key]!r}: count whole blocks, tokens and requests.",
                             CAPACITY_RULE)
