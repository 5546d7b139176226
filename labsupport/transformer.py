"""A Llama-style decoder in one file, for measuring prefill and decode.

The architecture follows Llama 3 (Grattafiori et al., 2024, "The Llama 3 Herd of Models"):
RMSNorm before each block, rotary position embeddings, grouped-query attention and a SwiGLU
feed-forward. The details in which real models differ follow the config: the RMSNorm epsilon
(``rms_norm_eps``), an explicit head width
(``H * D`` need not be ``d``), biases on the q/k/v (and output) projections (Qwen2), q/k norms
(Qwen3), the rotary base ``rope_theta`` and the rotary frequency scaling ``rope_scaling`` (Llama
3.1's ``"llama3"`` rule, through :func:`labsupport.position.rope_inv_freq`, chapter 08), so a Llama
3.1 config computes what the real architecture computes past its original 8,192 positions. The weights are random (seeded): how long a forward pass takes does not depend on
their values, so a random model measures the same time as a trained one of the same shape.

Shapes used in comments:
    B batch, S tokens in this call, T tokens attended to (cache so far + S), d d_model,
    H query heads, Hkv key/value heads, G = H // Hkv (query heads per KV head), D head_dim,
    V vocab_size, L n_layers.

Use::

    from labsupport.models import get_model
    from labsupport.transformer import Transformer
    model = Transformer(get_model("tiny-2m"))               # fp32 on the CPU
    cache = model.new_cache(batch=1, max_len=64)
    prompt = model.random_prompt(batch=1, length=16)
    logits = model.prefill(prompt, cache)                    # (1, V), cache.length == 16
    logits = model.decode_step(logits.argmax(-1, keepdim=True), cache)   # cache.length == 17

``attention`` chooses how attention is computed: ``"sdpa"`` (torch's fused
``scaled_dot_product_attention``), ``"naive"`` (scores, mask, softmax, blend: written out), or any
callable ``attn(q, k, v, causal) -> out`` with ``q, k, v`` of shape ``(B, H, S or T, D)``; the keys
and values are already expanded to ``H`` heads. A callable may also return a tuple whose first
item is ``out``, as the course's own kernels do (``labsupport.attention.flash_attention_reference``
returns ``(out, lse)``), so they plug in directly. When ``causal`` is true and ``q`` is shorter
than ``k`` the queries are the *last* positions (query ``i`` sits at position ``T - S + i``).

**Where keys and values live** is not the model's business. Its forward pass,
``model(tokens, kv)``, takes a *KV batch* (:class:`KVBatch`): an object that gives the positions of
the tokens and, for each layer, stores that layer's new keys and values and returns the attention
output. :class:`ContiguousBatch` is the one ``prefill``, ``decode_step`` and ``generate`` use (the
preallocated :class:`KVCache`, or no cache at all); the serving engine (:mod:`labsupport.engine`,
chapter 13) passes a paged batch instead, whose metadata (slot mapping, block tables, sequence
lengths) it built once for the whole step, and every layer's own :class:`Attention` consumes it. One
forward pass serves both, as in nano-vllm (its attention layer reads a per-step context) and
tiny-llm (it hands a paged cache object to the model).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ._answers import answer
from ._validate import positive_int
from .models import DEFAULT_RMS_NORM_EPS, LLAMA3_ROPE_THETA, ModelConfig, as_model
from .position import rope_inv_freq

ROPE_THETA = LLAMA3_ROPE_THETA  # the default base; the model uses its config's rope_theta
NORM_EPS = DEFAULT_RMS_NORM_EPS  # the default; the model uses its config's rms_norm_eps
INIT_STD = 0.02  # nanoGPT/GPT-2 style initialisation; values do not matter for timing
ATTENTION_CHOICES = ("sdpa", "naive")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


# --- attention implementations ------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention written out: ``softmax(q k^T / sqrt(D) + mask) v``, softmax in fp32.

    q: (B, H, S, D); k, v: (B, H, T, D) with T >= S. Causal masks are aligned to the end:
    query i is at position T - S + i and sees keys 0..T - S + i.
    """
    S, T, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(D)  # (B, H, S, T)
    if causal:
        q_pos = torch.arange(T - S, T, device=q.device)[:, None]  # (S, 1)
        k_pos = torch.arange(T, device=q.device)[None, :]  # (1, T)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, S, T)
    return weights @ v  # (B, H, S, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch's fused attention with the same end-aligned causal convention as :func:`naive_attention`."""
    S, T = q.shape[-2], k.shape[-2]
    if not causal or S == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # A chunk of queries after cached keys: is_causal would align the mask to the start.
    q_pos = torch.arange(T - S, T, device=q.device)[:, None]  # (S, 1)
    k_pos = torch.arange(T, device=q.device)[None, :]  # (1, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos)


def _resolve_attention(attention) -> tuple[str, AttentionFn]:
    if isinstance(attention, str):
        key = attention.strip().lower()
        if key == "sdpa":
            return "sdpa", sdpa_attention
        if key == "naive":
            return "naive", naive_attention
    elif callable(attention):
        return getattr(attention, "__name__", "custom"), attention
    raise ValueError(
        f"attention must be 'sdpa', 'naive' or a callable attn(q, k, v, causal) -> out, got {attention!r}"
    )


# --- the KV cache -------------------------------------------------------------------------


class KVCache:
    """Keys and values of every layer, preallocated for ``max_len`` positions.

    ``k`` and ``v`` have shape ``(n_layers, batch, n_kv_heads, max_len, head_dim)``; positions
    ``0 .. length-1`` hold data. ``nbytes()`` is the memory reserved (both tensors, all of
    ``max_len``); ``used_nbytes()`` the part filled so far.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype: torch.dtype):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch = batch
        self.max_len = max_len
        self.length = 0

    def nbytes(self) -> int:
        """Bytes reserved by the cache (keys and values, all ``max_len`` positions)."""
        return self.k.nelement() * self.k.element_size() * 2

    def used_nbytes(self) -> int:
        """Bytes holding real positions: ``length / max_len`` of :meth:`nbytes`."""
        return self.nbytes() * self.length // self.max_len

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.length = 0

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v`` (B, Hkv, S, D) at positions ``start..start+S-1`` of ``layer``; return
        the layer's keys and values for positions ``0..start+S-1`` as views (B, Hkv, T, D)."""
        end = start + k.shape[-2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, length={self.length}/{self.max_len}, "
            f"{self.nbytes() / 2**20:.1f} MiB, dtype={self.k.dtype}, device={self.k.device})"
        )


class KVBatch(Protocol):
    """The KV interface of the model's forward pass: what ``model(tokens, kv)`` needs from wherever
    the keys and values live (the module docstring).

    * ``positions``: (S,) int64 on the model's device, the position of each of a row's S tokens
      (every row of the batch has the same positions; a flat batch of many sequences is one row);
    * ``attend(layer, q, k, v) -> out``: store layer ``layer``'s new keys and values and return the
      attention output. ``q`` is (B, H, S, D) and ``k``, ``v`` (B, Hkv, S, D), all after RoPE (and
      q/k norms); ``out`` is (B, H, S, D) in ``q``'s dtype. Grouped-query attention is the
      implementation's business: ``k`` and ``v`` come unexpanded.
    """

    positions: torch.Tensor

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class ContiguousBatch:
    """The KV batch of a contiguous :class:`KVCache`: ``B`` rows of ``length`` tokens at positions
    ``start .. start + length - 1``, or no cache at all (``cache=None``: the tokens attend only to
    each other, as ``forward_no_cache`` runs them).

    ``attention`` is an ``attn(q, k, v, causal)`` (the model's choice, ``"sdpa"``, ``"naive"`` or a
    callable); ``fold_gqa`` lets a one-token step fold the query heads of a group into the query
    axis so SDPA reads the cache once, unexpanded (only for SDPA, which needs no mask there).
    """

    def __init__(self, cache: KVCache | None, start: int, length: int, attention: AttentionFn, fold_gqa: bool,
                 device):
        self.cache, self.start = cache, start
        self.attention, self.fold_gqa = attention, fold_gqa
        self.positions = torch.arange(start, start + length, device=device)  # (S,)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, S, D = q.shape
        G = H // k.shape[1]
        if self.cache is not None:
            k, v = self.cache.update(layer, self.start, k, v)  # (B, Hkv, T, D), T = start + S
        if self.fold_gqa and S == 1 and G > 1:
            # One new token: it may see every cached key, so no mask is needed and the G query
            # heads of a group can sit in the "sequence" slot. The cache is read once, unexpanded.
            out = F.scaled_dot_product_attention(q.view(B, k.shape[1], G, D), k, v)  # (B, Hkv, G, D)
            return out.reshape(B, H, 1, D)
        if G > 1:
            k = k.repeat_interleave(G, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(G, dim=1)  # (B, H, T, D)
        out = self.attention(q, k, v, S > 1)  # (B, H, S, D)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out = out[0]  # the course's kernels return (out, lse)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"attention function returned {got}; expected a tensor of shape {tuple(q.shape)}")
        return out


# --- the building blocks ------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``: LayerNorm without the mean subtraction or bias (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float = NORM_EPS, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        inv_rms = (xf * xf).mean(-1, keepdim=True).add_(self.eps).rsqrt_()  # (..., 1); in place: two fewer temporaries
        return (xf * inv_rms).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = ROPE_THETA,
                 scaling: Mapping | None = None, inv_freq: torch.Tensor | None = None):
    """cos and sin of the rotary angles for ``positions`` (S,): each (S, D), in ``dtype``.

    The frequencies are :func:`labsupport.position.rope_inv_freq` of the base ``theta`` and the
    Hugging Face ``rope_scaling`` dict ``scaling`` (None: plain RoPE); angles in float32, as
    transformers computes them. ``inv_freq``, if given, is those frequencies already on
    ``positions``' device (the model keeps them there: a copy from the CPU inside a CUDA graph
    capture would fail).
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(positions.device)  # (D/2,) float32
    angles = positions.float()[:, None] * inv_freq[None, :]  # (S, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@answer
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) by the position's angle (Su et al., 2021, RoFormer).
    RoPE in the halves layout: banned inside lab 08's RoPE checks, like the course's answers there.

    x: (B, heads, S, D); cos, sin: (S, D).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, heads, S, D)
    return x * cos + rotated * sin


def _project(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual + linear(x)`` (just ``linear(x)`` without a residual). A layer packed for the CPU
    (:class:`labsupport.cpu_linear.PackedLinear`, which takes ``residual=``) adds it inside the matmul's
    kernel: one pass over the output instead of two."""
    if residual is None:
        return linear(x)
    if getattr(linear, "fuses_residual", False):
        return linear(x, residual=residual)
    return residual + linear(x)


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al., 2023): H query heads share Hkv key/value heads.

    ``rope`` is where the model rotates: None (the default) is the course's rotation
    (:func:`apply_rope` with the model's cos and sin); a function ``rope(q, k, positions) -> (q, k)``
    (q (B, H, S, D), k (B, Hkv, S, D), positions (S,) int64, every row at the same positions) rotates
    instead, as a learner's lab 08 part does when it serves (:mod:`labsupport.serve.stack_model`)."""

    rope = None  # set on a layer's instance to rotate another way (the class's None: the course's)

    def __init__(self, cfg: ModelConfig, **factory):
        super().__init__()
        d, D = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, D
        self.wq = nn.Linear(d, cfg.n_heads * D, bias=cfg.qkv_bias, **factory)
        self.wk = nn.Linear(d, cfg.n_kv_heads * D, bias=cfg.qkv_bias, **factory)
        self.wv = nn.Linear(d, cfg.n_kv_heads * D, bias=cfg.qkv_bias, **factory)
        self.wo = nn.Linear(cfg.n_heads * D, d, bias=cfg.o_bias, **factory)
        # Qwen3: an RMSNorm over each head's D elements of the queries and keys, before the rotation
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, **factory) if cfg.qk_norm else None
        self.wqkv = None  # fuse() stacks wq, wk, wv into one projection

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBatch, layer: int,
                residual: torch.Tensor | None = None):
        """The attention's output projection (B, S, d); plus ``residual`` (B, S, d) when given."""
        B, S, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if self.wqkv is not None and self.q_norm is None:  # fused (fuse()): one matmul, and one rotation
            qkv = self.wqkv(x).view(B, S, H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2 Hkv, S, D)
            if self.rope is None:
                qk = apply_rope(qkv[:, :H + Hkv], cos, sin)  # the queries' and keys' heads together (elementwise)
                q, k = qk[:, :H], qk[:, H:]  # (B, H, S, D), (B, Hkv, S, D)
            else:
                q, k = self.rope(qkv[:, :H], qkv[:, H:H + Hkv], kv.positions)
            v = qkv[:, H + Hkv:]  # (B, Hkv, S, D)
        else:
            if self.wqkv is not None:
                q, k, v = self.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            else:
                q, k, v = self.wq(x), self.wk(x), self.wv(x)
            q = q.view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
            k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
            v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)  # per head, over D
            if self.rope is None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:
                q, k = self.rope(q, k, kv.positions)
        out = kv.attend(layer, q, k, v)  # (B, H, S, D): the KV batch stores k, v and attends
        out = out.transpose(1, 2).reshape(B, S, H * D)  # (B, S, H*D)
        return _project(self.wo, out, residual)

    @torch.no_grad()
    def fuse(self) -> None:
        """Replace ``wq``, ``wk``, ``wv`` by one ``wqkv`` holding their weights stacked: one matmul
        reads the layer's input once instead of three times (engines fuse them; vLLM's
        ``QKVParallelLinear``). The result is the same up to float rounding."""
        if self.wqkv is not None:
            return
        wq, wk, wv = self.wq, self.wk, self.wv
        fused = nn.Linear(wq.in_features, wq.out_features + wk.out_features + wv.out_features,
                          bias=wq.bias is not None, device=wq.weight.device, dtype=wq.weight.dtype)
        fused.weight.copy_(torch.cat([wq.weight, wk.weight, wv.weight]))
        if wq.bias is not None:
            fused.bias.copy_(torch.cat([wq.bias, wk.bias, wv.bias]))
        self.wqkv, self.wq, self.wk, self.wv = fused, None, None, None


class FeedForward(nn.Module):
    """SwiGLU (Shazeer, 2020): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig, **factory):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False, **factory)  # up
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, **factory)  # down
        self.w13 = None  # fuse() stacks the gate and up projections into one

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S, d) in, (B, S, d) out (d_ff inside); plus ``residual`` (B, S, d) when given."""
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)  # (B, S, d_ff) each
            return _project(self.w2, F.silu(gate) * up, residual)
        return _project(self.w2, F.silu(self.w1(x)) * self.w3(x), residual)

    @torch.no_grad()
    def fuse(self) -> None:
        """Replace the gate ``w1`` and up ``w3`` projections by one ``w13`` (vLLM's
        ``MergedColumnParallelLinear``): one matmul instead of two, the same result up to rounding."""
        if self.w13 is not None:
            return
        w1, w3 = self.w1, self.w3
        fused = nn.Linear(w1.in_features, 2 * w1.out_features, bias=False, device=w1.weight.device,
                          dtype=w1.weight.dtype)
        fused.weight.copy_(torch.cat([w1.weight, w3.weight]))
        self.w13, self.w1, self.w3 = fused, None, None


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm feed-forward, each with a residual."""

    def __init__(self, cfg: ModelConfig, **factory):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **factory)
        self.attention = Attention(cfg, **factory)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **factory)
        self.feed_forward = FeedForward(cfg, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBatch, layer: int):
        if getattr(self.attention.wo, "fuses_residual", False):  # packed for the CPU: the add inside the matmul
            x = self.attention(self.attention_norm(x), cos, sin, kv, layer, residual=x)  # x + attention
            return self.feed_forward(self.ffn_norm(x), residual=x)  # x + feed-forward
        x = x + self.attention(self.attention_norm(x), cos, sin, kv, layer)
        return x + self.feed_forward(self.ffn_norm(x))


# --- the model ----------------------------------------------------------------------------


class Transformer(nn.Module):
    """A Llama-style decoder with random (seeded) weights, built from a :class:`ModelConfig`.

    The weights are created directly on ``device`` (first on torch's ``meta`` device, which
    allocates nothing), so an 8B shape in bf16 (about 16 GB) never passes through CPU memory.
    ``device="meta"`` builds the model with shapes only: enough to count its parameters.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        attention="sdpa",
    ):
        super().__init__()
        cfg = as_model(cfg)  # a ModelConfig, or a model name such as "tiny-2m"
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"dtype must be a floating torch.dtype (torch.float32, torch.bfloat16...), got {dtype!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be 'cpu', 'cuda' or a torch.device, got {device!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
        self.cfg = cfg
        self.attention = attention  # validated by the setter below

        factory = {"device": "meta", "dtype": dtype}
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, **factory)
        self.layers = nn.ModuleList(Block(cfg, **factory) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, **factory)
        self.output = (
            None if cfg.tied_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **factory)
        )
        self.to_empty(device=device)  # allocate on the target device; values filled next
        self.packed_head = None  # labsupport.cpu_linear.prepack: the output head on oneDNN-packed weights
        # RoPE's frequencies in float32 on the model's device (a plain attribute: model.to(dtype) leaves it)
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)  # (D/2,)
        if device.type != "meta":  # on "meta" only the shapes exist (counting an 8B's weights needs no memory)
            self._init_weights(seed)
        self.eval()

    # -- construction helpers --

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
                if name.endswith(("wo.weight", "w2.weight")):  # GPT-2's residual scaling
                    p.mul_(1 / math.sqrt(2 * self.cfg.n_layers))

    @property
    def attention(self):
        """The attention in use: ``'sdpa'``, ``'naive'`` or a callable. Assign to change it."""
        return self._attention

    @attention.setter
    def attention(self, value) -> None:
        self._attention_name, self._attn_fn = _resolve_attention(value)
        self._attention = value

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def param_bytes(self) -> int:
        """Bytes of all weights (a tied embedding counted once)."""
        return sum(p.nelement() * p.element_size() for p in self.parameters())

    def param_count(self) -> int:
        """Number of weights; equals :func:`labsupport.costs.param_count` for the same config."""
        return sum(p.nelement() for p in self.parameters())

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` positions."""
        batch = _positive("batch", batch)
        max_len = _positive("max_len", max_len)
        return KVCache(self.cfg, batch, max_len, self.device, self.dtype)

    def random_prompt(self, batch: int, length: int, seed: int = 0) -> torch.Tensor:
        """Random token ids, shape (batch, length), int64, on the model's device."""
        return random_prompt(self.cfg, batch, length, seed=seed, device=self.device)

    # -- the forward passes --

    def _tokens(self, tokens, what: str) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(
                f"{what}: tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}"
            )
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(
                f"{what}: tokens must hold integer token ids (torch.int64), got dtype {tokens.dtype}"
            )
        if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(
                f"{what}: tokens must have shape (batch, length) with both >= 1, got {tuple(tokens.shape)}"
            )
        if tokens.device.type == "cpu":  # checking on the GPU would force a sync every step
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(
                    f"{what}: token ids must be in [0, {self.cfg.vocab_size - 1}] (vocab_size of "
                    f"{self.cfg.name}), got values from {lo} to {hi}"
                )
        return tokens.to(self.device, torch.long)

    def forward(self, tokens: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """The forward pass: token ids (B, S) and a KV batch (:class:`KVBatch`) in, the final norm's
        hidden states (B, S, d) out; :meth:`logits` turns the rows wanted into logits. Every entry
        point (prefill, decode, the engine's batched steps, speculative verification) runs this."""
        if self._inv_freq.device != self.device:  # the model was moved; the next call (or capture) needs no copy
            self._inv_freq = self._inv_freq.to(self.device)
        if self.device.type == "cpu":  # rows of a table computed once (the same numbers): a lookup, not a computation
            cos, sin = self._rope_rows(kv.positions)  # (S, D) each
        else:  # a GPU computes them in the step (a table lookup sized on the host would sync inside a CUDA graph)
            cos, sin = rope_cos_sin(kv.positions, self.cfg.head_dim, self.dtype, self.cfg.rope_theta,
                                    self.cfg.rope_scaling, inv_freq=self._inv_freq)  # (S, D) each
        x = self.tok_embeddings(tokens)  # (B, S, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv, i)  # (B, S, d)
        return self.norm(x)  # (B, S, d)

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (S, D) of ``positions`` (S,), as rows of a table of :func:`rope_cos_sin` for
        positions 0 .. n-1, made again (twice as long) when a position is past it or the dtype changed
        (vLLM keeps such a ``cos_sin_cache``). Elementwise, so each row is the number computed alone."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need or table[0].dtype != self.dtype or table[0].device != self.device:
            n = max(256, 1 << (need - 1).bit_length())
            table = rope_cos_sin(torch.arange(n, device=self.device), self.cfg.head_dim, self.dtype,
                                 self.cfg.rope_theta, self.cfg.rope_scaling, inv_freq=self._inv_freq)  # (n, D) each
            self._rope_table = table
        positions = positions.long()
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on hidden states (..., d): (..., V) logits in float32."""
        if self.packed_head is not None:  # packed for the CPU (labsupport.cpu_linear.prepack)
            return self.packed_head(hidden).float()
        head = self.tok_embeddings.weight if self.output is None else self.output.weight  # (V, d)
        return (hidden @ head.T).float()

    def contiguous_batch(self, cache: KVCache | None, start: int, length: int) -> ContiguousBatch:
        """The KV batch of positions ``start .. start + length - 1`` of ``cache`` (None: no cache),
        attending with this model's attention choice."""
        return ContiguousBatch(cache, start, length, self._attn_fn, self._attention_name == "sdpa", self.device)

    def fuse_projections(self) -> Transformer:
        """Fuse every layer's q/k/v projections and its gate/up projections into one matmul each
        (:meth:`Attention.fuse`, :meth:`FeedForward.fuse`); returns the model. Do it after loading
        weights: the fused model's parameter names differ."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()
        return self

    def _run(self, tokens: torch.Tensor, cache: KVCache | None, start: int) -> torch.Tensor:
        """Run positions ``start .. start+S-1``; return the last position's logits (B, V) in fp32."""
        hidden = self(tokens, self.contiguous_batch(cache, start, tokens.shape[1]))  # (B, S, d)
        return self.logits(hidden[:, -1])  # (B, V): only the last position's logits are needed

    def _check_cache(self, cache, batch: int, start: int, new: int, what: str) -> None:
        if not isinstance(cache, KVCache):
            raise ValueError(
                f"{what}: cache must be a KVCache from model.new_cache(batch, max_len), got {type(cache).__name__}"
            )
        cfg = self.cfg
        expected = (cfg.n_layers, cache.batch, cfg.n_kv_heads, cache.max_len, cfg.head_dim)
        if cache.k.device != self.device or cache.k.dtype != self.dtype or tuple(cache.k.shape) != expected:
            raise ValueError(
                f"{what}: this cache was not made by this model ({cache!r}); use model.new_cache(batch, max_len)"
            )
        if cache.batch != batch:
            raise ValueError(
                f"{what}: tokens have batch {batch} but the cache was made for batch {cache.batch}"
            )
        if start + new > cache.max_len:
            raise ValueError(
                f"{what}: KV cache overflow: the cache holds max_len={cache.max_len} positions, "
                f"{start} are used and {new} more were asked for; make a bigger one with "
                f"model.new_cache(batch, max_len={start + new})"
            )

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Process a whole prompt (B, P) at once; write its keys and values to ``cache[start:start+P]``.

        Returns the logits of the last position, (B, V). With the default ``start=0`` the cache is
        refilled from the beginning; ``start=cache.length`` appends a chunk (chunked prefill).
        """
        tokens = self._tokens(tokens, "prefill")
        start = _positive("start", start, allow_zero=True)
        self._check_cache(cache, tokens.shape[0], start, tokens.shape[1], "prefill")
        if start > cache.length:
            raise ValueError(f"prefill: start={start} leaves a gap after the {cache.length} cached positions")
        logits = self._run(tokens, cache, start)
        cache.length = start + tokens.shape[1]
        return logits

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per sequence (B, 1), attending to everything cached; returns (B, V)."""
        tokens = self._tokens(tokens, "decode_step")
        if tokens.shape[1] != 1:
            raise ValueError(f"decode_step: tokens must have shape (batch, 1), got {tuple(tokens.shape)}")
        self._check_cache(cache, tokens.shape[0], getattr(cache, "length", 0), 1, "decode_step")
        if cache.length == 0:
            raise ValueError("decode_step: the cache is empty; call model.prefill(prompt, cache) first")
        logits = self._run(tokens, cache, cache.length)
        cache.length += 1
        return logits

    @torch.no_grad()
    def forward_no_cache(self, tokens: torch.Tensor) -> torch.Tensor:
        """Recompute every position from scratch (B, P), no cache; returns the last logits (B, V)."""
        return self._run(self._tokens(tokens, "forward_no_cache"), None, 0)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
        """Greedy decoding: returns (B, P + max_new_tokens) token ids, prompt included.

        ``use_cache=False`` is the naive baseline: every new token reruns the whole sequence.
        """
        prompt = self._tokens(prompt, "generate")
        n = _positive("max_new_tokens", max_new_tokens, allow_zero=True)
        tokens = prompt
        if n == 0:
            return tokens
        if use_cache:
            cache = self.new_cache(prompt.shape[0], prompt.shape[1] + n)
            logits = self.prefill(prompt, cache)
        else:
            logits = self.forward_no_cache(prompt)
        for step in range(n):
            next_token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            tokens = torch.cat([tokens, next_token], dim=1)  # (B, P + step + 1)
            if step + 1 < n:
                logits = self.decode_step(next_token, cache) if use_cache else self.forward_no_cache(tokens)
        return tokens

    def extra_repr(self) -> str:
        return f"{self.cfg.name}, attention={self._attention_name}, {self.param_count() / 1e6:.2f}M params"


def _positive(name: str, value, *, allow_zero: bool = False) -> int:
    return positive_int(name, value, allow_zero=allow_zero)


def random_prompt(cfg: ModelConfig, batch: int, length: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Random token ids in ``[0, cfg.vocab_size)``, shape (batch, length), int64, seeded."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    batch, length = _positive("batch", batch), _positive("length", length)
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=gen).to(device)
