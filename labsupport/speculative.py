"""Speculative decoding: a small draft proposes, the target verifies in one pass (chapter 13).

One step, for a sequence whose last token is known:

1. The draft model proposes ``k`` tokens one after another, ``x_i ~ q_i`` (its own distribution).
2. The target runs once over the last token and the ``k`` proposals (a ``k + 1``-token chunk, as
   in a chunked prefill) and gets ``k + 1`` distributions ``p_1 .. p_{k+1}``.
3. :func:`speculative_accept`: for ``i = 1 .. k``, accept ``x_i`` with probability
   ``min(1, p_i(x_i) / q_i(x_i))``. At the first rejection, emit instead a token drawn from the
   *residual* ``max(0, p_i - q_i)`` renormalised, and stop. If all ``k`` are accepted, emit a bonus
   token drawn from ``p_{k+1}``. A step emits 1 to ``k + 1`` tokens.

Every emitted token is distributed exactly as the target alone would sample it (Leviathan et al.,
ICML 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al., 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"): the draft changes the
speed, never the output distribution. Position ``i`` is accepted with probability
``alpha_i = sum_x min(p_i(x), q_i(x))``. If every position were accepted independently with the
same ``alpha``, a step would emit ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens on average
(:func:`expected_tokens_per_step`); real acceptance is correlated from one position to the next
(easy stretches of text are easy for the draft throughout), so the measured figure differs.

The draft used here (:func:`make_draft`): with random weights there is no trained small model,
so the draft is the target's first layers (its embeddings, output head and final norm kept) with
Gaussian noise added to its weights, and the noise sets how often the target agrees.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from ._answers import answer
from ._validate import positive_int
from .sampling import sampling_probs
from .transformer import INIT_STD, KVCache, Transformer

__all__ = ["expected_tokens_per_step", "expected_speedup", "acceptance_probability", "residual_distribution",
           "speculative_accept", "make_draft", "all_position_logits", "speculative_generate",
           "autoregressive_generate"]


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one speculative step emits on average when each of the ``k`` proposals is accepted
    independently with probability ``alpha``: ``1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)``
    (``k + 1`` when ``alpha = 1``)."""
    k = positive_int("k", k, allow_zero=True)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.'s walltime improvement: tokens per step over the cost of a step in target
    forward passes, ``k * cost_ratio + 1``, where ``cost_ratio`` is a draft step's time over a
    target step's. The target's verification pass over ``k + 1`` tokens is taken to cost one
    decode step, which holds while decode is memory-bound (chapter 05)."""
    if not cost_ratio >= 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio!r}")
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + 1)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the last dimension: the chance the ratio test accepts a token
    drawn from ``q`` (one minus the total variation distance between ``p`` and ``q``)."""
    return torch.minimum(p, q).sum(-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)``, renormalised over the last dimension: what a rejected position samples
    from. Where ``p == q`` (nothing left) it returns ``p``."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


@answer
def speculative_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The tokens one speculative step emits (module docstring): ``(m,)`` int64, ``1 <= m <= k + 1``.

    ``draft_tokens`` (k,) the proposals; ``draft_probs`` (k, V) the draft's distributions they were
    drawn from; ``target_probs`` (k + 1, V) the target's distributions at the same positions and
    one more. Random numbers come from ``generator``.
    """
    k = draft_tokens.shape[0]
    out = []
    for i in range(k):
        x = int(draft_tokens[i])
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        r = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q > 0 and r < min(1.0, p / q):
            out.append(x)
            continue
        residual = residual_distribution(target_probs[i].double(), draft_probs[i].double())
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return torch.tensor(out, dtype=torch.long)
    out.append(int(torch.multinomial(target_probs[k].double(), 1, generator=generator)))
    return torch.tensor(out, dtype=torch.long)


def make_draft(target: Transformer, n_layers: int, noise: float = 0.0, seed: int = 0) -> Transformer:
    """A draft for ``target``: its embeddings, its first ``n_layers`` layers, its final norm and
    output head, with Gaussian noise of ``noise * INIT_STD`` (the weights' own initial scale) added
    to every weight matrix. ``noise=0`` and all the layers give the target itself."""
    n = positive_int("n_layers", n_layers)
    if n > target.cfg.n_layers:
        raise ValueError(f"n_layers={n} is more than the target's {target.cfg.n_layers}")
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    cfg = dataclasses.replace(target.cfg, n_layers=n, name=f"{target.cfg.name}-draft{n}")
    draft = Transformer(cfg, device=target.device, dtype=target.dtype, attention=copy.copy(target.attention))
    state = {name: p for name, p in target.state_dict().items() if name in draft.state_dict()}
    draft.load_state_dict(state)
    if noise > 0:
        gen = torch.Generator(device=target.device).manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * noise * INIT_STD)
    return draft


@torch.no_grad()
def all_position_logits(model: Transformer, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """Run ``tokens`` (B, S) at positions ``start ..`` with ``cache`` (as ``model.prefill`` does) but
    return the logits of every position, (B, S, V) fp32: what the target needs to verify ``k``
    proposals in one pass. Sets ``cache.length = start + S``."""
    S = tokens.shape[1]
    if start + S > cache.max_len:
        raise ValueError(f"cache overflow: {start} + {S} positions > max_len={cache.max_len}")
    hidden = model(tokens.to(model.device), model.contiguous_batch(cache, start, S))  # (B, S, d)
    cache.length = start + S
    return model.logits(hidden)  # (B, S, V)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return sampling_probs(logits, temperature)  # (rows, V)


def speculative_generate(target: Transformer, draft: Transformer, prompt: Sequence[int], max_new_tokens: int,
                         k: int, temperature: float = 1.0, seed: int = 0,
                         accept: Callable = speculative_accept) -> dict:
    """Speculative decoding of one sequence: returns ``{"tokens": generated ids, "steps": target
    passes, "proposed": proposals tested, "accepted": proposals accepted, "emitted": tokens per
    step (list), "seconds": wall time}``. ``temperature=0`` is greedy (the target's argmax is
    then exactly what plain greedy decoding gives). ``accept`` is the acceptance rule
    (:func:`speculative_accept`'s interface)."""
    k = positive_int("k", k)
    n = positive_int("max_new_tokens", max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    seq = [int(t) for t in prompt]
    P = len(seq)
    t_cache = target.new_cache(1, P + n + k + 1)
    d_cache = draft.new_cache(1, P + n + k + 1)
    t_len = d_len = 0  # positions whose keys and values are valid in each cache
    dev = target.device
    # the prompt, all but its last token, is prefilled once in both models
    if P > 1:
        target.prefill(torch.tensor([seq[:-1]], device=dev), t_cache)
        draft.prefill(torch.tensor([seq[:-1]], device=dev), d_cache)
        t_len = d_len = P - 1
    steps = proposed = accepted = 0
    emitted = []
    started = time.perf_counter()
    while len(seq) - P < n:
        # 1. the draft proposes k tokens
        d_cache.length = d_len
        logits = draft.prefill(torch.tensor([seq[d_len:]], device=dev), d_cache, start=d_len)  # (1, V)
        props, qs = [], []
        for i in range(k):
            q = _probs(logits, temperature)[0]  # (V,)
            x = int(q.argmax()) if temperature == 0 else int(torch.multinomial(q, 1, generator=gen))
            props.append(x)
            qs.append(q)
            if i + 1 < k:
                logits = draft.decode_step(torch.tensor([[x]], device=dev), d_cache)
        # 2. the target checks them in one pass over the last token and the k proposals
        chunk = torch.tensor([seq[t_len:] + props], device=dev)  # (1, len(seq) - t_len + k)
        t_logits = all_position_logits(target, chunk, t_cache, t_len)[0, -(k + 1):]  # (k + 1, V)
        ps = _probs(t_logits, temperature)  # (k + 1, V)
        # 3. accept or reject
        out = accept(torch.tensor(props), torch.stack(qs), ps, generator=gen)
        out = [int(t) for t in out]
        j = len(out) - 1  # proposals accepted
        steps += 1
        accepted += j
        proposed += min(j + 1, k)  # positions actually tested: up to and including a rejection
        emitted.append(len(out))
        old = len(seq)
        seq += out
        t_len = old + j  # the cache is valid for the accepted proposals; the next step starts after them
        d_len = min(old + j, d_cache.length)
    return {"tokens": seq[P:P + n], "steps": steps, "proposed": proposed, "accepted": accepted,
            "emitted": emitted, "seconds": time.perf_counter() - started}


def autoregressive_generate(model: Transformer, prompt: Sequence[int], max_new_tokens: int,
                            temperature: float = 1.0, seed: int = 0) -> dict:
    """Plain decoding, one target pass per token, for comparison: ``{"tokens", "steps", "seconds"}``."""
    n = positive_int("max_new_tokens", max_new_tokens)
    gen = torch.Generator().manual_seed(seed)
    seq = [int(t) for t in prompt]
    cache = model.new_cache(1, len(seq) + n)
    started = time.perf_counter()
    logits = model.prefill(torch.tensor([seq], device=model.device), cache)
    out = []
    for i in range(n):
        p = _probs(logits, temperature)[0]
        x = int(p.argmax()) if temperature == 0 else int(torch.multinomial(p, 1, generator=gen))
        out.append(x)
        if i + 1 < n:
            logits = model.decode_step(torch.tensor([[x]], device=model.device), cache)
    return {"tokens": out, "steps": n, "seconds": time.perf_counter() - started}


def measured_alpha(result: dict) -> float:
    """The acceptance rate a run shows: accepted proposals over proposals tested."""
    return result["accepted"] / result["proposed"] if result["proposed"] else math.nan
