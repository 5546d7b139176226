"""Turning logits into the next token: temperature, top-k, top-p, seeds and stop conditions.

Chapter 13 explains it. For one sequence's logits ``z`` (a vector of V values):

1. **Temperature** ``T``: the probabilities are ``softmax(z / T)``. ``T < 1`` sharpens the
   distribution, ``T > 1`` flattens it; ``T = 0`` means greedy decoding: always the argmax.
   Temperature divides the *logits*, before the softmax.
2. **Top-k** ``k``: only the ``k`` most likely tokens keep their probability; the rest get 0.
   ``k = 0`` (or ``k >= V``) keeps every token.
3. **Top-p** (nucleus sampling, Holtzman et al., ICLR 2020) ``p``: sort the tokens kept so far by
   probability, most likely first, and keep the shortest prefix whose probabilities sum to at
   least ``p``: the token that carries the sum across ``p`` is kept, and so is the most likely
   token whatever ``p`` is (a tiny ``p`` is the argmax, never an empty set). ``p = 1.0`` keeps
   every token. Top-p is applied to the distribution left after top-k, renormalised, as vLLM and
   Hugging Face transformers do.
4. The kept probabilities are renormalised and one token is drawn.

Two more settings, off by default, follow vLLM's sampler (``vllm/v1/sample/sampler.py``: penalties,
then greedy, then temperature, then min-p, then top-k and top-p):

* **Repetition penalty** ``r`` (``repetition_penalty`` in vLLM and transformers): before the
  temperature, every token already in the sequence (prompt or output) has its logit divided by ``r``
  where it is positive and multiplied by ``r`` where it is not, so ``r > 1`` makes a repeat less
  likely either way. It changes the logits, so it changes greedy decoding too. (CTRL, Keskar et al.,
  2019, introduced the penalty as a division of the generated tokens' logits; the sign rule and the
  prompt's tokens are transformers' and vLLM's.) :func:`penalize_repetition`. The course takes ``r``
  from 0.01 to 100, where float32 logits stay finite (vLLM takes any ``r > 0``).
* **Min-p** ``m`` (Nguyen et al., 2024): after the temperature, a token is kept only if its
  probability is at least ``m`` times the most likely token's, a cut that tightens when the model is
  sure and loosens when it is not. ``m = 0`` keeps every token; the cut comes before top-k and top-p.

Ties (equal logits) are broken by token id, lowest first, through a stable sort.

A request's draws come from its own ``torch.Generator``, seeded from the request's ``seed``: a
seeded request gets the same tokens whatever else shares its batches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._answers import answer, unguarded

__all__ = ["SamplingParams", "sampling_probs", "sample", "min_p_filter", "top_p_cut", "penalize_repetition",
           "request_generator"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (chapter 13).

    ``temperature`` 0 is greedy. ``top_k`` 0 keeps every token; ``top_p`` 1.0 keeps every token.
    ``seed`` (an int) makes the request's draws reproducible; ``None`` draws a fresh seed.
    A request stops after ``max_tokens`` generated tokens, or when it generates one of
    ``stop_token_ids`` (that token is returned, and the finish reason is ``"stop"``).
    ``min_p`` 0 and ``repetition_penalty`` 1.0 change nothing (module docstring).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default=())
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        _check_params(self.temperature, self.top_k, self.top_p, self.min_p)
        _check_penalty(self.repetition_penalty)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PENALTY_RANGE = (0.01, 100.0)  # repetition penalties a float32 logit survives (divided or multiplied)


def _check_penalty(penalty) -> None:
    low, high = PENALTY_RANGE
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not low <= penalty <= high:
        raise ValueError(f"repetition_penalty must be a number from {low:g} to {high:g} (1.0 changes nothing), "
                         f"got {penalty!r}")


def _check_params(temperature, top_k, top_p, min_p=0.0) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1.0 keeps every token), got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 keeps every token), got {min_p!r}")


def _check_logits(logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a float tensor of shape (batch, vocab), got {got}")
    return logits


@answer
def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
                   min_p: float = 0.0) -> torch.Tensor:
    """The distribution :func:`sample` draws from: ``(B, V)`` float32 probabilities, rows summing
    to 1, zero outside the kept tokens (module docstring). ``temperature=0`` puts all the mass on
    the argmax."""
    _check_params(temperature, top_k, top_p, min_p)
    logits = _check_logits(logits).float()
    B, V = logits.shape
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).float()  # (B, V)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (B, V) best first
    sorted_logits = torch.gather(logits / temperature, -1, order)  # (B, V)
    if min_p > 0:
        sorted_logits = min_p_filter(sorted_logits, min_p)  # after the temperature, before top-k
    if 0 < top_k < V:
        sorted_logits[:, top_k:] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)  # (B, V), sorted
    if top_p < 1.0:
        probs = probs.masked_fill(top_p_cut(probs, top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)  # back to token order


@answer
def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, *, min_p: float = 0.0) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): ``(B,)`` int64 token ids, drawn from
    :func:`sampling_probs` with ``generator``. ``temperature=0`` returns the argmax and draws
    nothing. A repetition penalty, which needs the sequence so far, is applied to ``logits``
    before this call: :func:`penalize_repetition`."""
    logits = _check_logits(logits)
    if temperature == 0:
        _check_params(temperature, top_k, top_p, min_p)
        return logits.argmax(-1)
    probs = unguarded(sampling_probs)(logits, temperature, top_k, top_p, min_p=min_p)  # one answer using another
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def top_p_cut(sorted_probs: torch.Tensor, top_p) -> torch.Tensor:
    """Which tokens top-p removes: ``sorted_probs`` (..., V) in decreasing order, ``top_p`` a number
    or a tensor broadcasting against ``sorted_probs`` (one per row, shape (..., 1)). A token goes when
    the mass of the tokens ranked above it is already ``top_p`` or more, so the token that carries the
    sum across ``top_p`` stays; the first-ranked token always stays (its mass above is 0, and a
    ``top_p`` as tiny as 1e-300 rounds to 0 in float32, which would otherwise cut every token and
    leave nothing to draw). vLLM does the same: ``apply_top_k_top_p_pytorch`` in
    ``vllm/v1/sample/ops/topk_topp_sampler.py`` (at ``01fa3fe7``) never masks its most likely token."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    cut = before >= top_p
    cut[..., 0] = False  # the most likely token is never cut
    return cut


def min_p_filter(logits: torch.Tensor, min_p) -> torch.Tensor:
    """``logits`` (..., V) with every token whose probability is below ``min_p`` times the most
    likely token's set to -inf: ``min_p`` a number in [0, 1], or a tensor of one per row (shape
    ``logits.shape[:-1]``; its values are not read back to check them, which would cost a GPU step a
    sync: :class:`SamplingParams` checked them). Called on logits already divided by the
    temperature, as vLLM does."""
    if isinstance(min_p, torch.Tensor):
        if min_p.shape != logits.shape[:-1]:
            raise ValueError(f"min_p needs one value per row, shape {tuple(logits.shape[:-1])}, got {tuple(min_p.shape)}")
        min_p = min_p.unsqueeze(-1)
    elif isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p is a fraction of the most likely token's probability, from 0 to 1; got {min_p!r}")
    probs = torch.softmax(logits.float(), dim=-1)
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def penalize_repetition(logits: torch.Tensor, seen: Sequence[Sequence[int]], penalty: Sequence[float]) -> torch.Tensor:
    """The logits with each row's already-seen tokens penalised (module docstring): ``logits`` (B, V),
    ``seen[b]`` the token ids of row ``b``'s sequence so far (prompt and output; repeats count once),
    ``penalty[b]`` its repetition penalty (1.0 leaves the row as it is). Returns a new float32
    (B, V) tensor: where a seen token's logit is positive it is divided by the penalty, elsewhere
    multiplied by it, as vLLM's and transformers' repetition penalty do."""
    logits = _check_logits(logits).float()
    B, V = logits.shape
    if len(seen) != B or len(penalty) != B:
        raise ValueError(f"seen and penalty need one entry per row of logits ({B}), got {len(seen)} and {len(penalty)}")
    for p in penalty:
        _check_penalty(p)
    rows, ids = [], []  # one flat (row, token) index for every penalised row: one transfer, one write
    for b, row_ids in enumerate(seen):
        if penalty[b] != 1:
            rows += [b] * len(row_ids)
            ids += row_ids
    if ids and (min(ids) < 0 or max(ids) >= V):
        raise ValueError(f"seen holds token ids outside the vocabulary [0, {V - 1}]")
    mask = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    if ids:
        index = torch.tensor([rows, ids], dtype=torch.long).to(logits.device)  # (2, n)
        mask[index[0], index[1]] = True
    r = torch.tensor([float(p) for p in penalty], dtype=torch.float32).to(logits.device)[:, None]  # (B, 1)
    return torch.where(mask, torch.where(logits > 0, logits / r, logits * r), logits)


def request_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A request's own random stream: seeded with ``seed``, or from torch's global RNG when None."""
    gen = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return gen.manual_seed(int(seed))
