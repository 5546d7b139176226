"""The runbook's arithmetic as plain functions.

Conventions (stated once, used everywhere):

* ``N`` is :func:`param_count`: every weight, embeddings included, as the runbook counts it.
* A matmul of an ``(m, k)`` by a ``(k, n)`` matrix costs ``2*m*k*n`` FLOPs (a multiply and an add).
* Prefill attention costs ``4*L*P**2*d``: ``2*L*P**2*d`` to score every query against every key,
  the same again to blend the values. Here ``d`` is the width of all query heads together,
  ``n_heads * head_dim`` (:attr:`ModelConfig.q_width`), which is ``d_model`` except in models with
  an explicit head width (Qwen3-0.6B: 2048 on a model width of 1024). The runbook counts it *without* the causal mask;
  ``causal=True`` halves it, since a causal model scores each query only against earlier keys.
* A decode step reads every weight once and the whole KV cache of every sequence in the batch.
* Bytes: a name ending in ``_dtype_bytes`` is bytes per element (2 for bf16), one ending in
  ``_bytes`` a total.
* A model is a :class:`~labsupport.models.ModelConfig` or its name (:func:`labsupport.models.as_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._answers import answer
from ._validate import positive_int, positive_number, renamed_parameters
from .models import ModelConfig, as_model

# The fraction of the dense tensor-core peak a prefill is planned at: the runbook's planning
# convention for a well-tuned server, an assumption to replace with a measurement (lab 05 measures
# prefill on the learner's own device), never a measurement itself.
PLANNING_MFU = 0.4


def param_count(cfg: ModelConfig) -> int:
    """Number of weights in a Llama-style decoder, embeddings and output head included.

    Per layer: the query and output projections (``d * n_heads * head_dim`` each; ``d*d`` when the
    head width is ``d / n_heads``), the key and value projections (``d * n_kv_heads * head_dim``
    each), their biases where the model has them (``qkv_bias``: ``(n_heads + 2*n_kv_heads) *
    head_dim``; ``o_bias``: ``d``), the SwiGLU feed-forward (``3*d*d_ff``), two RMSNorm weight vectors
    and, with ``qk_norm`` (Qwen3), two more of ``head_dim``. Then the embedding table, a final norm
    and, unless tied, the output head. Chapter 02 splits this by component.
    """
    cfg = as_model(cfg)
    d, q_width, kv_width = cfg.d_model, cfg.q_width, cfg.kv_width
    attention = 2 * d * q_width + 2 * d * kv_width
    if cfg.qkv_bias:
        attention += q_width + 2 * kv_width
    if cfg.o_bias:
        attention += d
    feed_forward = 3 * d * cfg.d_ff
    norms = 2 * d + (2 * cfg.head_dim if cfg.qk_norm else 0)
    per_layer = attention + feed_forward + norms
    embeddings = cfg.vocab_size * d * (1 if cfg.tied_embeddings else 2)
    return cfg.n_layers * per_layer + embeddings + d


@answer
def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: float = 2) -> float:
    """Bytes of KV cache one token adds: keys and values, every layer, every KV head."""
    cfg = as_model(cfg)
    dtype_bytes = positive_number("dtype_bytes", dtype_bytes)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return int(per_token) if per_token == int(per_token) else per_token


@answer
def prefill_flops(cfg: ModelConfig, prompt_tokens: int, causal: bool = False) -> float:
    """FLOPs to prefill ``prompt_tokens`` positions: ``2*N*P + 4*L*P**2*d_q`` (attention halved if causal),
    ``d_q = n_heads * head_dim`` the width of the queries (``d_model`` in Llama; the runbook writes ``d``)."""
    cfg = as_model(cfg)
    p = positive_int("prompt_tokens", prompt_tokens)
    linear = 2 * param_count(cfg) * p
    return float(linear + prefill_attention_flops(cfg, p, causal=causal))


def prefill_attention_flops(cfg: ModelConfig, prompt_tokens: int, causal: bool = False) -> float:
    """The quadratic part of :func:`prefill_flops`: ``4*L*P**2*d_q``, halved when ``causal``."""
    cfg = as_model(cfg)
    p = positive_int("prompt_tokens", prompt_tokens)
    attention = 4 * cfg.n_layers * p * p * cfg.q_width
    return float(attention / 2 if causal else attention)


def attention_share(cfg: ModelConfig, prompt_tokens: int, causal: bool = False) -> float:
    """Fraction of prefill FLOPs spent in attention's quadratic term."""
    return prefill_attention_flops(cfg, prompt_tokens, causal) / prefill_flops(cfg, prompt_tokens, causal)


def quadratic_crossover(cfg: ModelConfig, causal: bool = False) -> float:
    """Prompt length where attention FLOPs equal the linear FLOPs: ``N / (2*L*d_q)`` (``N / 2Ld`` in Llama).

    With the causal halving the attention term is half as large, so the crossover doubles.
    """
    cfg = as_model(cfg)
    crossover = param_count(cfg) / (2 * cfg.n_layers * cfg.q_width)
    return crossover * 2 if causal else crossover


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step reads from memory, split by what they are."""

    weights: float
    cache: float

    @property
    def total(self) -> float:
        return self.weights + self.cache

    @property
    def cache_share(self) -> float:
        """Fraction of the read that is KV cache."""
        return self.cache / self.total


@answer
@renamed_parameters(weight_bytes="weight_dtype_bytes")
def decode_step_bytes(
    cfg: ModelConfig,
    batch: int,
    context: int,
    weight_dtype_bytes: float = 2,
    kv_dtype_bytes: float = 2,
) -> DecodeBytes:
    """Bytes read by one decode step: all weights once, plus ``batch`` caches of ``context`` tokens.

    ``weight_dtype_bytes`` and ``kv_dtype_bytes`` are bytes per element (2 for bf16). The old name
    ``weight_bytes=`` is still accepted.
    """
    cfg = as_model(cfg)
    batch = positive_int("batch", batch)
    context = positive_int("context", context, allow_zero=True)
    weight_dtype_bytes = positive_number("weight_dtype_bytes", weight_dtype_bytes)
    kv_dtype_bytes = positive_number("kv_dtype_bytes", kv_dtype_bytes)
    weights = param_count(cfg) * weight_dtype_bytes
    cache = kv_bytes_per_token(cfg, kv_dtype_bytes) * context * batch
    return DecodeBytes(weights=float(weights), cache=float(cache))


def decode_step_flops(cfg: ModelConfig, batch: int, context: int = 0) -> float:
    """FLOPs of one decode step: ``2*N`` per sequence plus attention over its ``context``."""
    cfg = as_model(cfg)
    batch = positive_int("batch", batch)
    context = positive_int("context", context, allow_zero=True)
    return float(batch * (2 * param_count(cfg) + 4 * cfg.n_layers * context * cfg.q_width))


def matmul_flops(m: int, k: int, n: int) -> float:
    """FLOPs of an ``(m, k) @ (k, n)`` matmul: ``2*m*k*n``."""
    m, k, n = (positive_int(name, v) for name, v in (("m", m), ("k", k), ("n", n)))
    return float(2 * m * k * n)


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = False) -> float:
    """FLOPs of an attention forward pass, ``4*B*H*S**2*D``, halved when ``causal``."""
    b, h, s, d = (
        positive_int(name, v)
        for name, v in (("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim))
    )
    flops = 4 * b * h * s * s * d
    return float(flops / 2 if causal else flops)
