"""KV cache arithmetic: how big it is, how many sequences fit, and how much a naive allocator wastes.

Conventions (the same as :mod:`labsupport.costs`):

* one token adds ``2 * n_layers * n_kv_heads * head_dim * kv_dtype_bytes`` bytes of cache: a key
  and a value vector for every KV head of every layer (:func:`labsupport.costs.kv_bytes_per_token`);
* the weights take ``param_count(cfg) * weight_dtype_bytes`` bytes and are stored once, whatever the
  number of sequences (``*_dtype_bytes`` is bytes per element, ``*_bytes`` a total; the old
  parameter name ``weight_bytes=`` is still accepted);
* memory sizes are in bytes; the GPU table (:mod:`labsupport.hardware`) gives them in decimal GB,
  as datasheets do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from ._answers import answer
from ._validate import int_list, non_negative_number, positive_int, positive_number, renamed_parameters
from .costs import kv_bytes_per_token, param_count
from .models import as_model

__all__ = [
    "kv_bytes_per_token",
    "kv_bytes_per_sequence",
    "weight_bytes_total",
    "max_concurrency",
    "with_kv_heads",
    "reservation_waste",
    "paged_waste",
]


def kv_bytes_per_sequence(cfg, tokens: int, kv_dtype_bytes: float = 2) -> float:
    """Bytes of KV cache held by one sequence of ``tokens`` tokens."""
    tokens = positive_int("tokens", tokens, allow_zero=True)
    return kv_bytes_per_token(cfg, kv_dtype_bytes) * tokens


@renamed_parameters(weight_bytes="weight_dtype_bytes")
def weight_bytes_total(cfg, weight_dtype_bytes: float = 2) -> float:
    """Bytes the weights occupy: every parameter (:func:`labsupport.costs.param_count`) times
    ``weight_dtype_bytes``, the bytes per weight."""
    cfg = as_model(cfg)
    return param_count(cfg) * positive_number("weight_dtype_bytes", weight_dtype_bytes)


@answer
@renamed_parameters(weight_bytes="weight_dtype_bytes")
def max_concurrency(
    cfg,
    gpu_memory_bytes: float,
    context_tokens: int,
    weight_dtype_bytes: float = 2,
    kv_dtype_bytes: float = 2,
    reserve_bytes: float = 0,
) -> int:
    """How many sequences of ``context_tokens`` tokens each fit in memory next to the weights.

    Precisely::

        free = gpu_memory_bytes - param_count(cfg) * weight_dtype_bytes - reserve_bytes
        per_sequence = kv_bytes_per_token(cfg, kv_dtype_bytes) * context_tokens
        max_concurrency = floor(free / per_sequence), or 0 when free <= 0

    ``reserve_bytes`` stands for everything else that needs memory (activations, the CUDA
    context, fragmentation). Every sequence is assumed to hold its full ``context_tokens``;
    0 means the weights (plus the reserve) leave no room for even one sequence.
    For several GPUs, pass their total memory (for example ``get_gpu("H100").times(4).memory_bytes``).
    """
    cfg = as_model(cfg)
    memory = positive_number("gpu_memory_bytes", gpu_memory_bytes)
    context_tokens = positive_int("context_tokens", context_tokens)
    reserve = non_negative_number("reserve_bytes", reserve_bytes)
    free = memory - weight_bytes_total(cfg, weight_dtype_bytes) - reserve
    if free <= 0:
        return 0
    per_sequence = kv_bytes_per_token(cfg, kv_dtype_bytes) * context_tokens
    if all(float(v).is_integer() for v in (free, per_sequence)):
        return int(free) // int(per_sequence)  # exact when every size is a whole number of bytes
    return math.floor(free / per_sequence)


def with_kv_heads(cfg, n_kv_heads: int):
    """A copy of ``cfg`` with ``n_kv_heads`` key/value heads (``n_heads`` gives plain multi-head attention)."""
    cfg = as_model(cfg)
    n_kv_heads = positive_int("n_kv_heads", n_kv_heads)
    if cfg.n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads must divide n_heads ({cfg.n_heads}); accepted values: "
            f"{', '.join(str(h) for h in range(1, cfg.n_heads + 1) if cfg.n_heads % h == 0)}; got {n_kv_heads}"
        )
    kind = "MHA" if n_kv_heads == cfg.n_heads else f"{n_kv_heads} KV heads"
    return dataclasses.replace(cfg, name=f"{cfg.name} ({kind})", n_kv_heads=n_kv_heads)


def reservation_waste(lengths: Iterable[int], max_len: int) -> float:
    """Fraction of reserved cache left unused when every request reserves ``max_len`` tokens.

    ``lengths`` are the tokens each sequence actually holds (prompt plus generated so far). A
    contiguous per-request reservation must cover the longest sequence a request *might* reach,
    so the used share is ``sum(lengths) / (len(lengths) * max_len)`` and the rest is waste.
    """
    values = int_list("lengths", lengths, allow_zero=True)
    max_len = positive_int("max_len", max_len)
    longest = max(values)
    if longest > max_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit a reservation of max_len={max_len}")
    return 1 - sum(values) / (len(values) * max_len)


def paged_waste(lengths: Iterable[int], block_tokens: int = 16) -> float:
    """Fraction of allocated cache left unused when the cache is handed out in blocks of ``block_tokens``.

    Each sequence holds ``ceil(length / block_tokens)`` blocks, so only its last block can be
    partly empty (the scheme of PagedAttention, Kwon et al., SOSP 2023).
    """
    values = int_list("lengths", lengths, allow_zero=True)
    block_tokens = positive_int("block_tokens", block_tokens)
    allocated = sum(math.ceil(v / block_tokens) * block_tokens for v in values)
    if allocated == 0:
        return 0.0
    return 1 - sum(values) / allocated
