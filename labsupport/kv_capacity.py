"""How many tokens of KV cache an engine gets, and how many requests that serves (chapter 12).

An engine such as vLLM takes a fraction of the GPU's memory (``gpu_memory_utilization``, 0.9 by
default in vLLM) and splits it between the weights, a reserve for everything else (activations of
the largest forward pass, workspaces, the CUDA context and library buffers, CUDA graphs), and the
KV cache, which gets what is left, in whole blocks of ``block_size`` tokens. The course's
convention, :func:`kv_capacity` (lab 12's exercise):

* ``budget = gpu_memory_utilization * total``: the fraction applies to the GPU's **total** memory
  (GiB, ``2**30`` bytes, as ``torch.cuda.mem_get_info`` and vLLM's logs count), not to what is
  free after the weights;
* ``kv_bytes = budget - weights - reserve``, with ``weights = param_count(cfg) *
  weight_dtype_bytes`` and ``reserve`` given (vLLM measures it: below);
* one block holds ``block_size`` tokens of every layer's keys and values:
  ``block_bytes = block_size * 2 * n_layers * n_kv_heads * head_dim * kv_dtype_bytes`` (KV heads,
  not query heads);
* ``num_blocks = floor(kv_bytes / block_bytes)`` (0 when nothing is left), ``tokens = num_blocks *
  block_size``;
* a request of ``max_model_len`` tokens holds ``ceil(max_model_len / block_size)`` blocks, so
  ``max_requests = floor(num_blocks / ceil(max_model_len / block_size))`` requests fit at full
  length at once.

**What vLLM really does.** It does not take the reserve as a setting: at start-up it loads the
weights, runs a profiling forward pass of the largest batch it will schedule
(``max_num_batched_tokens``), records the peak memory PyTorch allocated and the memory used outside
PyTorch, and gives the KV cache ``gpu_memory_utilization * total`` minus all of that (recent
versions also subtract the memory of the CUDA graphs they capture). It logs the result as
``GPU KV cache size: N tokens`` and ``Maximum concurrency for L tokens per request: X.XXx``, where
``X`` is a ratio (``N / L`` in the version that introduced the line), not rounded down to whole
requests as :func:`kv_capacity` does.
"""

from __future__ import annotations

import math

from ._answers import answer
from ._validate import non_negative_number, positive_int, positive_number
from .costs import kv_bytes_per_token, param_count
from .models import as_model

__all__ = ["GIB", "kv_capacity"]

GIB = 2**30


@answer
def kv_capacity(cfg, gpu_memory_gib: float, max_model_len: int, *, gpu_memory_utilization: float = 0.9,
                block_size: int = 16, kv_dtype_bytes: float = 2, weight_dtype_bytes: float = 2,
                reserve_gib: float = 0.0) -> dict:
    """The KV cache an engine gets on one GPU of ``gpu_memory_gib`` GiB, by the module's convention.

    Returns ``{"num_blocks": int, "tokens": int, "max_requests": int}``: cache blocks, token
    positions they hold, and requests of ``max_model_len`` tokens that fit at once.
    """
    cfg = as_model(cfg)
    total = positive_number("gpu_memory_gib", gpu_memory_gib) * GIB
    utilization = positive_number("gpu_memory_utilization", gpu_memory_utilization)
    if utilization > 1:
        raise ValueError(f"gpu_memory_utilization is a fraction of the GPU's memory, from 0 to 1; got {utilization}")
    max_model_len = positive_int("max_model_len", max_model_len)
    block_size = positive_int("block_size", block_size)
    reserve = non_negative_number("reserve_gib", reserve_gib) * GIB
    weights = param_count(cfg) * positive_number("weight_dtype_bytes", weight_dtype_bytes)
    kv_bytes = utilization * total - weights - reserve
    block_bytes = block_size * kv_bytes_per_token(cfg, kv_dtype_bytes)
    num_blocks = max(0, math.floor(kv_bytes / block_bytes))
    blocks_per_request = -(-max_model_len // block_size)
    return {"num_blocks": num_blocks, "tokens": num_blocks * block_size,
            "max_requests": num_blocks // blocks_per_request}
