"""Turning logits into the next token: temperature, top-k, top-p, seeds and stop conditions.

Chapter 13 explains it. For one sequence's logits ``z`` (a vector of V values):

1. **Temperature** ``T``: the probabilities are ``softmax(z / T)``. ``T < 1`` sharpens the
   distribution, ``T > 1`` flattens it; ``T = 0`` means greedy decoding: always the argmax.
   Temperature divides the *logits*, before the softmax.
2. **Top-k** ``k``: only the ``k`` most likely tokens keep their probability; the rest get 0.
   ``k = 0`` (or ``k >= V``) keeps every token.
3. **Top-p** (nucleus sampling, Holtzman et al., ICLR 2020) ``p``: sort the tokens kept so far by
   probability, most likely first, and keep the shortest prefix whose probabilities sum to at
   least ``p``: the token that carries the sum across ``p`` is kept. ``p = 1.0`` keeps every
   token. Top-p is applied to the distribution left after top-k, renormalised, as vLLM and
   Hugging Face transformers do.
4. The kept probabilities are renormalised and one token is drawn.

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

__all__ = ["SamplingParams", "sampling_probs", "sample", "request_generator"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (chapter 13).

    ``temperature`` 0 is greedy. ``top_k`` 0 keeps every token; ``top_p`` 1.0 keeps every token.
    ``seed`` (an int) makes the request's draws reproducible; ``None`` draws a fresh seed.
    A request stops after ``max_tokens`` generated tokens, or when it generates one of
    ``stop_token_ids`` (that token is returned, and the finish reason is ``"stop"``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = field(default=())

    def __post_init__(self):
        _check_params(self.temperature, self.top_k, self.top_p)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_params(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1.0 keeps every token), got {top_p!r}")


def _check_logits(logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a float tensor of shape (batch, vocab), got {got}")
    return logits


@answer
def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution :func:`sample` draws from: ``(B, V)`` float32 probabilities, rows summing
    to 1, zero outside the kept tokens (module docstring). ``temperature=0`` puts all the mass on
    the argmax."""
    _check_params(temperature, top_k, top_p)
    logits = _check_logits(logits).float()
    B, V = logits.shape
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).float()  # (B, V)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (B, V) best first
    sorted_logits = torch.gather(logits / temperature, -1, order)  # (B, V)
    if 0 < top_k < V:
        sorted_logits[:, top_k:] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)  # (B, V), sorted
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        probs = probs.masked_fill(before >= top_p, 0.0)  # keep up to and including the crossing token
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)  # back to token order


@answer
def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): ``(B,)`` int64 token ids, drawn from
    :func:`sampling_probs` with ``generator``. ``temperature=0`` returns the argmax and draws
    nothing."""
    logits = _check_logits(logits)
    if temperature == 0:
        _check_params(temperature, top_k, top_p)
        return logits.argmax(-1)
    probs = unguarded(sampling_probs)(logits, temperature, top_k, top_p)  # one answer using another
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def request_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A request's own random stream: seeded with ``seed``, or from torch's global RNG when None."""
    gen = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return gen.manual_seed(int(seed))
