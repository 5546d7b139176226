"""Checks for the phases lab: the FLOPs of a prefill and the bytes a decode step reads."""

from __future__ import annotations

import inspect

from ..costs import decode_step_bytes, param_count, prefill_flops
from ..models import ModelConfig, get_model
from ._mistakes import RuledOut
from .framework import Case, graded

PREFILL_CONVENTION = (
    "prefill FLOPs = 2*N*P + 4*L*P**2*d_q, with N = param_count(cfg), L = cfg.n_layers and d_q = "
    "cfg.n_heads * cfg.head_dim, the width of the queries the scores multiply (cfg.d_model in Llama, not "
    "in every model); when causal is True the attention term is halved (each query only scores the "
    "keys before it)."
)
HEAD_DIM_GIVEN = ("use cfg.head_dim as it is given: Qwen3-0.6B has 16 heads of 128 on a width of 1,024, so "
                  "d_model // n_heads (64) is not its head width")


def decode_convention(dtype_bytes: float = 2) -> str:
    """The decode-bytes convention, as the check's hint states it."""
    return (
        f"bytes per decode step = N * {dtype_bytes:g} (every weight, read once for the whole batch) + "
        f"batch * context * kv_bytes_per_token, with kv_bytes_per_token = 2 (K and V) * n_layers * "
        f"n_kv_heads * head_dim * {dtype_bytes:g} bytes."
    )


def _configs():
    return [
        get_model("llama-3.1-8b"),
        get_model("llama-3.1-70b"),
        get_model("llama-3.1-405b"),
        get_model("tiny-2m"),
        # Plain multi-head attention, untied embeddings: n_kv_heads == n_heads.
        ModelConfig("mha-test", 3, 96, 4, 4, 200, 500),
        # A deep, narrow shape with 8 query heads per KV head.
        ModelConfig("gqa8-test", 7, 256, 16, 2, 704, 3000, tied_embeddings=True),
        # Heads wider than d_model / n_heads: n_heads * head_dim = 2,048 on a width of 1,024.
        get_model("qwen3-0.6b"),
    ]


def _param_count(cfg, mha: bool = False, embeddings: bool = True) -> int:
    """param_count with optional planted mistakes (all heads for K/V; embeddings left out)."""
    if mha:
        fields = {k: getattr(cfg, k) for k in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size")}
        cfg = ModelConfig(cfg.name, n_kv_heads=cfg.n_heads, tied_embeddings=cfg.tied_embeddings, **fields)
    n = param_count(cfg)
    if not embeddings:
        n -= cfg.vocab_size * cfg.d_model * (1 if cfg.tied_embeddings else 2)
    return n


# --- prefill FLOPs -------------------------------------------------------------------------------

_PREFILL_LENGTHS = {
    "llama-3.1-8b": (2000, 2048, 32768),
    "llama-3.1-70b": (8192,),
    "llama-3.1-405b": (131072,),
    "tiny-2m": (1, 1121, 4096),
    "mha-test": (2, 7),
    "gqa8-test": (333,),
    "qwen3-0.6b": (8192,),
}


def _prefill_mistakes(cfg, p: int, causal: bool) -> dict[str, float]:
    n, L, d = _param_count(cfg), cfg.n_layers, cfg.n_heads * cfg.head_dim
    halve = 2 if causal else 1
    attn = 4 * L * p * p * d / halve
    mistakes = {
        f"attention uses d_model ({cfg.d_model:,}) instead of the query width n_heads * head_dim ({d:,}): the "
        f"scores multiply queries of n_heads heads of head_dim each, which is d_model only when n_heads * "
        f"head_dim = d_model (in every Llama, not in every model). Lab 05 notebooks released before this check "
        f"counted with the query width said d = cfg.d_model": 2 * n * p + 4 * L * p * p * cfg.d_model / halve,
        f"the head width is derived as d_model // n_heads ({cfg.d_model // cfg.n_heads}) instead of cfg.head_dim "
        f"({cfg.head_dim}); {HEAD_DIM_GIVEN}": 2 * n * p + 4 * L * p * p * cfg.n_heads * (
            cfg.d_model // cfg.n_heads) / halve,
        "the attention term 4*L*P**2*d_q is left out (only the linear 2*N*P remains)": 2 * n * p,
        "the factor 2 is missing from the linear term (N*P instead of 2*N*P)": n * p + attn,
        "the factor 2 is missing everywhere (a multiply-add counted as one operation)": (n * p + attn / 2),
        "causal=True did not halve the attention term": 2 * n * p + 4 * L * p * p * d,
        (
            "the attention term is half its size: either it was halved although causal=False, or only "
            "the scores (Q K^T) were counted and not the blend with V"
            if not causal
            else "attention counts only the scores (Q K^T) and forgets the blend with V"
        ): 2 * n * p + attn / 2,
        "attention is linear in P (4*L*P*d_q) instead of quadratic": 2 * n * p + 4 * L * p * d / halve,
        "attention uses the width of one head (head_dim) instead of all of them (n_heads * head_dim)": 2 * n * p
        + 4 * L * p * p * cfg.head_dim / halve,
        "attention is counted for one layer only (L missing)": 2 * n * p + 4 * p * p * d / halve,
        "N leaves the embedding tables out (param_count(cfg) counts them)": 2
        * _param_count(cfg, embeddings=False)
        * p
        + attn,
        "N counts K and V projections for every query head (n_heads instead of n_kv_heads)": 2
        * _param_count(cfg, mha=True)
        * p
        + attn,
    }
    if causal:  # mistakes only causal=True shows (with causal=False the count is right)
        mistakes["causal=True halved the whole count, the weights' 2*N*P as well: only the attention term is "
                 "halved (a causal mask removes scores, not weights)"] = (2 * n * p + 4 * L * p * p * d) / 2
        mistakes[f"causal attention counts the exact triangle, P*(P+1)/2 scores per head, where the convention "
                 f"halves the square, P**2/2: the two differ by {4 * L * d * p / 2:,.0f} FLOPs here"] = (
            2 * n * p + 4 * L * d * p * (p + 1) / 2)
    return mistakes


@graded(points=5, bans=(prefill_flops,))
def check_prefill_flops(fn, checker):
    """``fn(cfg, prompt_tokens, causal=False)`` must return the FLOPs of prefilling the prompt."""
    ruled_out = RuledOut()
    for cfg in _configs():
        for p in _PREFILL_LENGTHS[cfg.name]:
            for causal in (False, True):
                case = Case(model=cfg.name, prompt_tokens=p, causal=causal)
                got = checker.call(fn, cfg, p, causal=causal, case=case)
                expected = prefill_flops(cfg, p, causal=causal)
                wrong = _prefill_mistakes(cfg, p, causal)
                checker.expect_number(
                    got,
                    expected,
                    case=case,
                    rel=1e-6,
                    what="prefill FLOP count",
                    hint=PREFILL_CONVENTION,
                    mistakes=ruled_out.candidates(wrong, expected),
                )
                ruled_out.passed(wrong, expected)


# --- decode bytes --------------------------------------------------------------------------------

_DECODE_POINTS = {
    "llama-3.1-8b": ((1, 2000), (64, 8192), (1, 0), (7, 131072)),
    "llama-3.1-70b": ((32, 8000),),
    "llama-3.1-405b": ((1, 1),),
    "tiny-2m": ((3, 5),),
    "mha-test": ((2, 11),),
    "gqa8-test": ((16, 300),),
    "qwen3-0.6b": ((8, 4096),),
}


def _kv_per_token(cfg, heads: int, element: float) -> float:
    return 2 * cfg.n_layers * heads * cfg.head_dim * element


def _decode_mistakes(cfg, batch: int, context: int, b: float) -> dict[str, float]:
    n = _param_count(cfg)
    weights = n * b
    per_token = _kv_per_token(cfg, cfg.n_kv_heads, b)
    cache = per_token * batch * context
    return {
        "the KV cache is left out (only the weights are counted)": weights,
        "the cache is counted once, not once per sequence in the batch (batch missing)": weights
        + per_token * context,
        "the weights are left out (only the cache is counted)": cache,
        "the weights are counted once per sequence (each step reads them once for the whole batch)": weights
        * batch
        + cache,
        "the cache uses n_heads instead of n_kv_heads (grouped-query attention shares K/V heads)": weights
        + _kv_per_token(cfg, cfg.n_heads, b) * batch * context,
        "the factor 2 for keys AND values is missing from the cache": weights + cache / 2,
        "the cache is counted for one layer only (n_layers missing)": weights + cache / cfg.n_layers,
        "elements are counted, not bytes (the 2 bytes per bf16 value are missing)": (weights + cache) / b,
        "4 bytes (fp32) per value are used instead of 2 (bf16)": (weights + cache) * 4 / b,
        f"the head width is derived as d_model // n_heads ({cfg.d_model // cfg.n_heads}) instead of cfg.head_dim "
        f"({cfg.head_dim}); {HEAD_DIM_GIVEN}": weights + 2 * cfg.n_layers * cfg.n_kv_heads * (
            cfg.d_model // cfg.n_heads) * b * batch * context,
        f"context + 1 tokens of cache are counted per sequence: the step reads the keys and values of the "
        f"{context:,} earlier tokens; the new token's own key and value are computed by this step, not read from "
        f"the cache (a difference of {per_token * batch:,.0f} bytes here)": weights + per_token * batch * (context + 1),
    }


def _bytes_parameters(fn) -> list[str]:
    """The parameters after ``(cfg, batch, context)`` that take bytes per value: any whose name
    mentions bytes or dtype (``dtype_bytes``, ``element_bytes``, ``weight_bytes`` and
    ``kv_dtype_bytes`` together, ...). Empty when there are none, or no signature to read."""
    try:
        params = list(inspect.signature(fn).parameters.values())[3:]
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and ("byte" in p.name.lower() or "dtype" in p.name.lower())]


@graded(points=5, bans=(decode_step_bytes,))
def check_decode_bytes(fn, checker):
    """``fn(cfg, batch, context)`` must return the bytes one decode step reads: weights + every cache, bf16.

    If ``fn`` takes the bytes per value (any parameter whose name mentions bytes or dtype), it is
    checked with 4 (fp32) as well, every such parameter set to 4.
    """
    byte_params = _bytes_parameters(fn)
    element_sizes = (2, 4) if byte_params else (2,)
    ruled_out = RuledOut()
    for cfg in _configs():
        for batch, context in _DECODE_POINTS[cfg.name]:
            for b in element_sizes:
                extra = {} if b == 2 else {name: b for name in byte_params}
                case = Case(model=cfg.name, batch=batch, context=context, **extra)
                got = checker.call(fn, cfg, batch, context, case=case, **extra)
                expected = decode_step_bytes(cfg, batch, context, weight_dtype_bytes=b, kv_dtype_bytes=b).total
                wrong = _decode_mistakes(cfg, batch, context, b)
                if b != 2:
                    wrong["dtype_bytes is ignored (2 bytes per value are always used)"] = decode_step_bytes(
                        cfg, batch, context
                    ).total
                checker.expect_number(
                    got,
                    expected,
                    case=case,
                    rel=1e-6,
                    what="bytes read per decode step",
                    hint=decode_convention(b),
                    mistakes=ruled_out.candidates(wrong, expected),
                )
                ruled_out.passed(wrong, expected)
