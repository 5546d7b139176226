"""What a sampler does to the logits besides temperature, top-k and top-p (chapter 13).

* :func:`min_p_filter` (defined in :mod:`labsupport.sampling`, where the engine's sampler applies it
  after the temperature), **min-p** (Nguyen et al., "Turning Up the Heat: Min-p Sampling for Creative and
  Coherent LLM Outputs", arXiv:2407.01082, ICLR 2025): keep the tokens whose probability is at least
  ``min_p`` times the most likely token's. The cut follows the model's confidence: one dominant token
  leaves few candidates, a flat distribution many, where top-p keeps a fixed mass whatever the shape.
* :func:`apply_penalties`, the three **repetition penalties** as vLLM defines them
  (``vllm/model_executor/layers/utils.py``, ``apply_penalties``): the *repetition* penalty of CTRL
  (Keskar et al., arXiv:1909.05858, 2019) divides the positive logits and multiplies the negative ones
  of every token already in the prompt or the output, so it always makes them less likely; the
  *frequency* penalty subtracts ``penalty * count`` for each token generated so far, the *presence*
  penalty subtracts ``penalty`` once for any token generated at all (OpenAI's two parameters).
  Prompt tokens count for the first only. The repetition part is
  :func:`labsupport.sampling.penalize_repetition`, the rule the engine's batched sampler applies.
* :func:`regex_token_mask` and :func:`constrained_sample`, **structured output**: a token is allowed
  only if the text so far followed by the token's text can still be completed into a match of a
  pattern; every other logit is set to minus infinity before sampling. Engines compile the grammar to
  an automaton once and precompute, for each of its states, which tokens are allowed (outlines:
  Willard and Louf, arXiv:2307.09702, 2023; XGrammar, Dong et al., arXiv:2411.15100, 2024, which
  vLLM and SGLang use by default, for context-free grammars such as JSON schemas); the course tests
  every token against a partial regex match at every step, which computes the same mask slowly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._validate import non_negative_number, positive_int, positive_number
from .sampling import min_p_filter, penalize_repetition

__all__ = ["apply_penalties", "constrained_sample", "min_p_filter", "regex_token_mask"]


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                    repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                    presence_penalty: float = 0.0) -> torch.Tensor:
    """One sequence's logits (V,) with vLLM's three penalties applied (module docstring)."""
    repetition_penalty = positive_number("repetition_penalty", repetition_penalty)
    out = logits.clone().float()
    vocab = out.shape[-1]
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
    if repetition_penalty != 1.0:  # the engine's own rule: prompt and output tokens count as seen
        out = penalize_repetition(out[None], [[*prompt_ids, *output_ids]], [repetition_penalty])[0]
    out = out - frequency_penalty * counts - presence_penalty * (counts > 0)
    return out


def regex_token_mask(pattern: str, text_so_far: str, token_texts: Sequence[str | None]) -> torch.Tensor:
    """(V,) bool: the tokens after which ``text_so_far`` can still become a full match of ``pattern``.
    A token whose text is None (not valid text on its own: part of a multi-byte character, a special
    token) is never allowed."""
    import regex  # partial matching, which the standard library's re lacks; installed with transformers

    compiled = regex.compile(pattern)
    allowed = [text is not None and text != "" and compiled.fullmatch(text_so_far + text, partial=True) is not None
               for text in token_texts]
    return torch.tensor(allowed, dtype=torch.bool)


def constrained_sample(next_logits: Callable[[list[int]], torch.Tensor], token_texts: Sequence[str | None],
                       pattern: str, *, max_tokens: int, seed: int = 0, temperature: float = 1.0) -> dict:
    """Sample up to ``max_tokens`` tokens whose text stays a prefix of a match of ``pattern``, and stop at
    the first full match (an engine would instead allow the end-of-sequence token there and let the model
    choose). ``next_logits(ids)`` gives the (V,) logits after the tokens ``ids``. Returns ``{"ids", "text", "complete", "masked_share"}``: ``masked_share`` is
    the mean fraction of the vocabulary the mask removed at each step."""
    import regex  # see regex_token_mask

    max_tokens = positive_int("max_tokens", max_tokens)
    temperature = positive_number("temperature", temperature)
    non_negative_number("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    text, masked = "", []
    compiled = regex.compile(pattern)
    for _ in range(max_tokens):
        mask = regex_token_mask(pattern, text, token_texts)
        if not bool(mask.any()):
            break
        masked.append(1 - float(mask.float().mean()))
        logits = next_logits(ids).float().masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen))
        ids.append(token)
        text += token_texts[token]
        if compiled.fullmatch(text) is not None:
            break
    return {"ids": ids, "text": text, "complete": compiled.fullmatch(text) is not None,
            "masked_share": sum(masked) / len(masked) if masked else 0.0}
