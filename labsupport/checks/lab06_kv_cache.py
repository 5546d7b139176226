"""Checks for the KV cache lab: bytes per token, and how many sequences fit."""

from __future__ import annotations

import math

from ..costs import kv_bytes_per_token, param_count
from ..hardware import get_gpu
from ..kvcache import max_concurrency, with_kv_heads
from ..models import ModelConfig, get_model
from ._mistakes import RuledOut
from ._parameters import spelling
from .framework import Case, graded

KV_FORMULA = (
    "one token stores a key AND a value vector (x2) for every KV head (n_kv_heads, not n_heads) of "
    "every layer (n_layers), each head_dim elements of dtype_bytes bytes: "
    "2 * n_layers * n_kv_heads * head_dim * dtype_bytes."
)
CONCURRENCY_RULE = (
    "the cache gets what the GPU's memory leaves after the weights (every parameter at weight_dtype_bytes) "
    "and the reserve; each sequence needs the KV of all its context_tokens at kv_dtype_bytes; count the "
    "whole sequences that fit (round down), and none when nothing is left."
)


HEAD_DIM_GIVEN = ("use cfg.head_dim as the model gives it: Qwen3-0.6B has 16 heads of 128 on a width of 1,024, so "
                  "d_model // n_heads (64) is not its head width")


def _configs():
    odd = ModelConfig("odd-test", n_layers=3, d_model=96, n_heads=6, n_kv_heads=3, d_ff=256, vocab_size=100)
    return get_model, with_kv_heads, odd


def _kv_mistakes(cfg, b) -> dict[str, float]:
    L, kv, h, hd = cfg.n_layers, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    return {
        "n_heads is used instead of n_kv_heads (grouped-query attention shares each KV head)": 2
        * L
        * h
        * hd
        * b,
        "the factor 2 for keys and values is missing": L * kv * hd * b,
        "the number of layers is missing (every layer has its own cache)": 2 * kv * hd * b,
        "dtype_bytes is ignored (elements, not bytes)": 2 * L * kv * hd,
        "a fixed 2 bytes per element is used instead of dtype_bytes": 2 * L * kv * hd * 2,
        "head_dim is missing": 2 * L * kv * b,
        "d_model is used instead of head_dim": 2 * L * kv * cfg.d_model * b,
        "the result is in bits, not bytes": 2 * L * kv * hd * b * 8,
        f"the head width is derived as d_model // n_heads ({cfg.d_model // h}) instead of cfg.head_dim ({hd}): "
        f"{HEAD_DIM_GIVEN}": 2 * L * kv * (cfg.d_model // h) * b,
        f"dtype_bytes is rounded to a whole number (int({b:g}) = {int(b)}): a 4-bit cache takes half a byte per "
        f"element, so dtype_bytes = 0.5 (keep it as it is given)": 2 * L * kv * hd * int(b),
    }


@graded(points=5, bans=(kv_bytes_per_token,))
def check_kv_bytes_per_token(fn, checker):
    """``fn(cfg, dtype_bytes=2)`` must return the bytes of KV cache one token adds."""
    get_model, with_kv_heads, odd = _configs()
    cases = [
        (get_model("llama-3.1-8b"), None),  # the default dtype_bytes must be 2 (bf16)
        (get_model("llama-3.1-70b"), 2),
        (get_model("llama-3.1-405b"), 1),
        (get_model("tiny-20m"), 4),
        (with_kv_heads(get_model("llama-3.1-8b"), 32), 2),  # plain multi-head attention
        (odd, 4),
        (get_model("qwen3-0.6b"), 2),  # head_dim 128, not d_model // n_heads = 64
        (get_model("llama-3.1-8b"), 0.5),  # a 4-bit cache: half a byte per element
    ]
    ruled_out = RuledOut()
    for cfg, b in cases:
        case = Case(
            model=cfg.name,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype_bytes=b if b is not None else "default",
        )
        got = (
            checker.call(fn, cfg, case=case) if b is None else checker.call(fn, cfg, dtype_bytes=b, case=case)
        )
        expected = kv_bytes_per_token(cfg, 2 if b is None else b)
        wrong = _kv_mistakes(cfg, 2 if b is None else b)
        hint = KV_FORMULA + (" With no dtype_bytes given, use 2 (bf16)." if b is None else "")
        checker.expect_number(
            got, expected, case=case, rel=1e-9, what="bytes per token", hint=hint,
            mistakes=ruled_out.candidates(wrong, expected, merge=False),
        )
        ruled_out.passed(wrong, expected)


def _concurrency_mistakes(cfg, memory, context, wb, kb, reserve) -> dict[str, float]:
    weights = param_count(cfg) * wb
    per_seq = kv_bytes_per_token(cfg, kb) * context
    free = memory - weights - reserve
    mha_per_seq = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * kb * context

    def clamp(x):
        return max(0, math.floor(x))

    return {
        "the weights are not subtracted from the memory": clamp((memory - reserve) / per_seq),
        "reserve_bytes is not subtracted": clamp((memory - weights) / per_seq),
        "n_heads is used instead of n_kv_heads in the cache size": clamp(free / mha_per_seq),
        "the result is not clamped at 0 when the weights (and reserve) do not fit": math.floor(
            free / per_seq
        ),
        "the result is not rounded down (a fraction of a sequence cannot be served)": free / per_seq,
        "the result is rounded up instead of down": max(0, math.ceil(free / per_seq)),
        "the result is rounded to the nearest integer instead of down": max(0, round(free / per_seq)),
        "weight_dtype_bytes and kv_dtype_bytes are swapped": clamp(
            (memory - param_count(cfg) * kb - reserve) / (kv_bytes_per_token(cfg, wb) * context)
        ),
        "context_tokens is ignored (one token per sequence)": clamp(free / kv_bytes_per_token(cfg, kb)),
        f"the cache size uses a head width derived as d_model // n_heads ({cfg.d_model // cfg.n_heads}) instead "
        f"of cfg.head_dim ({cfg.head_dim}): {HEAD_DIM_GIVEN}": clamp(
            free / (2 * cfg.n_layers * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * kb * context)),
    }


@graded(points=5, bans=(max_concurrency,))
def check_max_concurrency(fn, checker):
    """``fn(cfg, gpu_memory_bytes, context_tokens, weight_dtype_bytes=2, kv_dtype_bytes=2, reserve_bytes=0)``
    must return how many full-length sequences fit next to the weights and the reserve.

    A function written before the bytes parameters were renamed (``weight_bytes=2``) is called with
    that name."""
    get_model, _, odd = _configs()
    m8, m70 = get_model("llama-3.1-8b"), get_model("llama-3.1-70b")
    h100, h200, a100, l4 = get_gpu("H100 SXM"), get_gpu("H200"), get_gpu("A100 40GB"), get_gpu("L4")
    odd_weights = param_count(odd) * 4
    odd_seq = kv_bytes_per_token(odd, 4) * 100
    weight_name = spelling(fn, "weight_dtype_bytes", "weight_bytes")  # the name before the bytes naming rule
    # (cfg, gpu label, memory, context, weight_dtype_bytes, kv_dtype_bytes, reserve) ; None = use the default
    cases = [
        (m8, "H100 SXM", h100.memory_bytes, 8192, None, None, None),
        (m70, "H100 SXM", h100.memory_bytes, 8192, 2, 2, 0),  # the weights alone do not fit
        (m70, "4x H100 SXM", h100.times(4).memory_bytes, 8192, 2, 2, 0),
        (m8, "A100 40GB", a100.memory_bytes, 32768, 2, 2, 4e9),
        (m8, "L4", l4.memory_bytes, 4096, 1, 2, 0),  # fp8/int8 weights, bf16 cache
        (m8, "H100 SXM", h100.memory_bytes, 8192, 2, 1, 0),  # fp8 cache
        (m70, "2x H200", h200.times(2).memory_bytes, 131072, 1, 1, 2e9),
        (odd, "exact fit", odd_weights + 3 * odd_seq, 100, 4, 4, 0),  # room for exactly 3
        (odd, "one byte short", odd_weights + odd_seq - 1, 100, 4, 4, 0),  # weights fit, no sequence does
        (odd, "reserve too large", odd_weights + 10 * odd_seq, 100, 4, 4, 11 * odd_seq),
        (get_model("qwen3-0.6b"), "24 GiB", 24 * 2**30, 8192, 2, 2, 0),  # head_dim 128 on d_model 1,024
    ]
    ruled_out = RuledOut()
    for cfg, label, memory, context, wb, kb, reserve in cases:
        kwargs = {
            k: v
            for k, v in ((weight_name, wb), ("kv_dtype_bytes", kb), ("reserve_bytes", reserve))
            if v is not None
        }
        case = Case(
            model=cfg.name,
            gpu=label,
            gpu_memory_bytes=f"{memory:,.0f}",
            context_tokens=context,
            **({k: f"{v:g}" for k, v in kwargs.items()} if kwargs else {"defaults": "2, 2, 0"}),
        )
        got = checker.call(fn, cfg, memory, context, case=case, **kwargs)
        wb_, kb_, res_ = wb or 2, kb or 2, reserve or 0
        expected = max_concurrency(cfg, memory, context, wb_, kb_, res_)
        wrong = _concurrency_mistakes(cfg, memory, context, wb_, kb_, res_)
        hint = CONCURRENCY_RULE + (
            f" Defaults: {weight_name}=2, kv_dtype_bytes=2, reserve_bytes=0." if not kwargs else ""
        )
        checker.expect_number(
            got, expected, case=case, rel=1e-12, what="number of sequences", hint=hint,
            mistakes=ruled_out.candidates(wrong, expected, merge=False),
        )
        ruled_out.passed(wrong, expected)
