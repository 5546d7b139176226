"""Tensor parallelism for the course model, as in Megatron-LM (Shoeybi et al., 2019).

Chapter 11. Each of ``n`` ranks holds ``1/n`` of every projection of every layer:

* column-parallel (the output features are split): q, k, v and the feed-forward's gate (``w1``)
  and up (``w3``) projections. Rank ``r`` holds the rows of ``wq`` for its ``H/n`` query heads,
  the rows of ``wk`` and ``wv`` for its ``Hkv/n`` key/value heads (the ones its query heads use
  under grouped-query attention: query head ``h`` reads KV head ``h // G``, so contiguous blocks
  of query heads need contiguous blocks of KV heads), and ``d_ff/n`` rows of ``w1`` and ``w3``.
  Each rank then computes attention for its own heads and the SwiGLU for its own features, with
  no communication.
* row-parallel (the input features are split): the output projection ``wo`` and the down
  projection ``w2``. Rank ``r`` holds the columns matching its heads (its features); its product
  is a *partial sum* of the full output, and one all-reduce adds the ``n`` partial sums.

So a layer's forward pass needs exactly two all-reduces, one after attention and one after the
feed-forward. Norms, biases of row-parallel layers (added once, after the sum) and the
embedding are replicated. The output layer is vocabulary-parallel: each rank holds ``V/n`` rows
of the head and computes those logits; an all-gather assembles them.

:func:`shard_layer` and :func:`tp_layer_forward` are the course's answers to the lab's exercises;
:class:`TensorParallelModel` runs a whole :class:`~labsupport.transformer.Transformer` split over
the ranks of the default process group, with a per-rank KV cache of ``Hkv/n`` heads, to time a
decode step.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._answers import answer
from ._validate import positive_int
from .families import split_keys
from .models import ModelConfig, as_model
from .transformer import NORM_EPS, Block, KVCache, Transformer, apply_rope, rope_cos_sin

# How each weight of a layer is split, read from the one table of weights (labsupport.families.WEIGHTS)
COLUMN_PARALLEL = split_keys("column", biases=False)  # wq wk wv w1 w3: rows split, each rank some output features
ROW_PARALLEL = split_keys("row")  # wo w2: columns split, each rank's product is a partial sum
REPLICATED = split_keys("replicated")  # the norms, q/k norms and the output bias (added once, after the sum)


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    """Raise ValueError unless ``world_size`` divides the query heads, the KV heads, ``d_ff`` and the
    vocabulary, whose output head is split by rows. Engines pad the vocabulary instead (vLLM to a
    multiple of 64)."""
    cfg, n = as_model(cfg), positive_int("world_size", world_size)
    for field in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        if getattr(cfg, field) % n:
            raise ValueError(
                f"tensor parallelism over {n} ranks needs {field} ({getattr(cfg, field)}) of {cfg.name} to be a "
                f"multiple of {n}; pick a world size that divides it (engines replicate KV heads when "
                f"there are fewer KV heads than ranks; this course does not)"
            )


def shard_slices(cfg: ModelConfig, rank: int, world_size: int) -> dict[str, tuple[int, slice]]:
    """For each split weight: ``(dim, slice)`` of this rank's part (dim 0: rows, dim 1: columns)."""
    cfg = as_model(cfg)
    n, r, D = world_size, rank, cfg.head_dim
    hq, hkv, f = cfg.n_heads // n, cfg.n_kv_heads // n, cfg.d_ff // n
    q, kv, ff = slice(r * hq * D, (r + 1) * hq * D), slice(r * hkv * D, (r + 1) * hkv * D), slice(r * f, (r + 1) * f)
    return {"wq": (0, q), "wk": (0, kv), "wv": (0, kv), "bq": (0, q), "bk": (0, kv), "bv": (0, kv),
            "wo": (1, q), "w1": (0, ff), "w3": (0, ff), "w2": (1, ff)}


@answer
def shard_layer(layer: Block, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's part of one decoder layer, as a dict of tensors (copies).

    Keys: ``wq wk wv w1 w3`` (rows: column-parallel), ``wo w2`` (columns: row-parallel), ``bq bk
    bv`` when the model has q/k/v biases (split like their weights), and replicated in full:
    ``attention_norm ffn_norm`` (norm weights), ``q_norm k_norm`` (Qwen3-style, when present),
    ``bo`` (the output bias, when present).
    """
    attn, ffn = layer.attention, layer.feed_forward
    cfg = SimpleNamespace(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim,
                          d_ff=ffn.w1.out_features)
    n, r, D = world_size, rank, attn.head_dim
    hq, hkv, f = cfg.n_heads // n, cfg.n_kv_heads // n, cfg.d_ff // n
    q, kv, ff = slice(r * hq * D, (r + 1) * hq * D), slice(r * hkv * D, (r + 1) * hkv * D), slice(r * f, (r + 1) * f)
    shards = {
        "wq": attn.wq.weight[q], "wk": attn.wk.weight[kv], "wv": attn.wv.weight[kv],
        "wo": attn.wo.weight[:, q],
        "w1": ffn.w1.weight[ff], "w3": ffn.w3.weight[ff], "w2": ffn.w2.weight[:, ff],
        "attention_norm": layer.attention_norm.weight, "ffn_norm": layer.ffn_norm.weight,
    }
    if attn.wq.bias is not None:
        shards.update(bq=attn.wq.bias[q], bk=attn.wk.bias[kv], bv=attn.wv.bias[kv])
    if attn.wo.bias is not None:
        shards["bo"] = attn.wo.bias
    if attn.q_norm is not None:
        shards.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)
    return {k: v.detach().clone() for k, v in shards.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """RMSNorm as the course model computes it: ``x / rms(x) * weight``, statistics in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped-query causal attention, queries at the last positions: q (B, h, S, D), k and v
    (B, hkv, T, D) with ``hkv`` dividing ``h``; returns (B, h, S, D)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, h, T, D): query head i reads KV head i // group
    v = v.repeat_interleave(group, dim=1)
    S, T = q.shape[-2], k.shape[-2]
    if S == 1:
        return F.scaled_dot_product_attention(q, k, v)
    mask = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]  # (S, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))


@answer
def tp_layer_forward(shards: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
                     cache: KVCache | None = None, layer: int = 0, start: int = 0) -> torch.Tensor:
    """One decoder layer on this rank's ``shards`` (from :func:`shard_layer`): x (B, S, d) in,
    (B, S, d) out, the same on every rank; exactly two ``dist.all_reduce`` calls.

    ``cos, sin`` (S, D) are the rotary tables of positions ``start .. start+S-1``. With a ``cache``
    (this rank's, ``Hkv/n`` heads) the new keys and values are written there and attention reads
    every cached position.
    """
    n = dist.get_world_size()
    B, S, _ = x.shape
    D = cfg.head_dim
    hq, hkv = cfg.n_heads // n, cfg.n_kv_heads // n  # this rank's heads

    eps = cfg.rms_norm_eps
    h = rms_norm(x, shards["attention_norm"], eps)  # (B, S, d), replicated
    q = F.linear(h, shards["wq"], shards.get("bq")).view(B, S, hq, D).transpose(1, 2)  # (B, hq, S, D)
    k = F.linear(h, shards["wk"], shards.get("bk")).view(B, S, hkv, D).transpose(1, 2)  # (B, hkv, S, D)
    v = F.linear(h, shards["wv"], shards.get("bv")).view(B, S, hkv, D).transpose(1, 2)  # (B, hkv, S, D)
    if "q_norm" in shards:
        q, k = rms_norm(q, shards["q_norm"], eps), rms_norm(k, shards["k_norm"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k, v = cache.update(layer, start, k, v)  # (B, hkv, T, D)
    out = causal_attention(q, k, v).transpose(1, 2).reshape(B, S, hq * D)  # (B, S, hq*D)
    partial = F.linear(out, shards["wo"])  # (B, S, d): this rank's share of the sum
    dist.all_reduce(partial)  # all-reduce 1: the sum over every rank's heads
    if "bo" in shards:
        partial = partial + shards["bo"]  # added once, after the sum
    x = x + partial

    h = rms_norm(x, shards["ffn_norm"], eps)
    hidden = F.silu(F.linear(h, shards["w1"])) * F.linear(h, shards["w3"])  # (B, S, d_ff/n)
    partial = F.linear(hidden, shards["w2"])  # (B, S, d), partial sum
    dist.all_reduce(partial)  # all-reduce 2
    return x + partial


class TensorParallelModel:
    """A :class:`~labsupport.transformer.Transformer` split over the ranks of the default process
    group: layers through :func:`tp_layer_forward` (or ``layer_fn`` of the same signature), the
    embedding and final norm replicated, the output head vocabulary-parallel (all-gather).

    Built on every rank from the same ``model`` (same seed): each rank keeps only its shards.
    """

    def __init__(self, model: Transformer, layer_fn=None, shard_fn=None):
        self.cfg = cfg = model.cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        check_divisible(cfg, self.world_size)
        shard_fn = shard_fn or shard_layer.__wrapped__
        self.layer_fn = layer_fn or tp_layer_forward.__wrapped__
        self.layers = [shard_fn(layer, self.rank, self.world_size) for layer in model.layers]
        self.embedding = model.tok_embeddings.weight.detach().clone()  # (V, d), replicated
        self.norm = model.norm.weight.detach().clone()
        head = self.embedding if model.output is None else model.output.weight.detach()
        rows = cfg.vocab_size // self.world_size
        self.head = head[self.rank * rows:(self.rank + 1) * rows].clone()  # (V/n, d): vocabulary-parallel
        self.dtype, self.device = model.dtype, model.device

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """This rank's cache: ``Hkv / n`` KV heads per layer."""
        local = SimpleNamespace(n_layers=self.cfg.n_layers, n_kv_heads=self.cfg.n_kv_heads // self.world_size,
                                head_dim=self.cfg.head_dim)
        return KVCache(local, batch, max_len, self.device, self.dtype)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Positions ``cache.length ..`` (0 without a cache) of ``tokens`` (B, S); returns the last
        position's logits (B, V) in fp32, the same on every rank."""
        start = cache.length if cache is not None else 0
        S = tokens.shape[1]
        cos, sin = rope_cos_sin(torch.arange(start, start + S, device=self.device), self.cfg.head_dim,
                                self.dtype, self.cfg.rope_theta, self.cfg.rope_scaling)
        x = F.embedding(tokens, self.embedding)  # (B, S, d)
        for i, shards in enumerate(self.layers):
            x = self.layer_fn(shards, x, cos, sin, self.cfg, cache, i, start) if cache is not None else \
                self.layer_fn(shards, x, cos, sin, self.cfg)
        x = rms_norm(x[:, -1], self.norm, self.cfg.rms_norm_eps)  # (B, d)
        local = (x @ self.head.T).float().contiguous()  # (B, V/n): this rank's slice of the vocabulary
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(pieces, local)
        if cache is not None:
            cache.length = start + S
        return torch.cat(pieces, dim=-1)  # (B, V)


def time_decode_step(model_name: str, batch: int, context: int, steps: int = 5, seed: int = 0,
                     tensor_parallel: bool = True, device=None, dtype: torch.dtype = torch.float32) -> dict:
    """Run on every rank (under :func:`labsupport.distributed.launch`): median seconds of one decode
    step of ``model_name`` at ``batch`` sequences after a ``context``-token prefill, split over the
    group (``tensor_parallel=True``) or on this one process. Also returns the logits' largest
    difference from the single-process model's (the split must not change the answer). ``device``:
    the CPU by default; on a GPU rank, that rank's GPU (``"cuda"`` picks the current one)."""
    cfg = as_model(model_name)
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = Transformer(cfg, device=device, dtype=dtype, seed=seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompt = model.random_prompt(batch, context, seed=seed)
    if tensor_parallel:
        tp = TensorParallelModel(model)
        cache = tp.new_cache(batch, context + steps + 1)
        logits = tp.run(prompt, cache)
        step = lambda t: tp.run(t, cache)  # noqa: E731
    else:
        cache = model.new_cache(batch, context + steps + 1)
        logits = model.prefill(prompt, cache)
        step = lambda t: model.decode_step(t, cache)  # noqa: E731
    reference = model.prefill(prompt, model.new_cache(batch, context))
    difference = float((logits - reference).abs().max())
    times = []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
        if tensor_parallel:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        logits = step(token)
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return dict(model=cfg.name, batch=batch, context=context, world_size=dist.get_world_size() if tensor_parallel
                else 1, seconds=times[len(times) // 2], max_logit_difference=difference)
