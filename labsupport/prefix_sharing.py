"""What a prefix cache shares across real multi-turn chats (chapter 10).

A chat server re-renders the whole conversation at every turn: the template's system turn, every
earlier user and assistant message, then the new user message and the assistant's opening. The
prefix cache of chapter 10 (:class:`labsupport.paged_cache.BlockAllocator` with
``prefix_caching=True``, blocks identified by a hash of their tokens and their parent's) can then
serve a turn's prompt from the blocks earlier requests left behind:

* across conversations, the blocks of the system turn they share;
* within a conversation, the previous turn's prompt and the answer generated to it, *if* the
  template renders that answer back as the very ids the model generated.

:func:`replay` runs requests through the allocator in the order they arrive, as a server would:
each prompt is allocated (what it finds cached is its hit), the answer's ids are appended one by
one (a block becomes findable once full), and the request is freed, its blocks left in the cache.
Only tokens whose keys and values were computed are cached: the prompt and every answer token but
the last (generation stops once the last is sampled, before it is run). As in vLLM, a request's
last prompt token is always computed, even when every block of its prompt is cached (its logits
are needed): the hit is capped at the whole blocks before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._validate import positive_int
from .paged_cache import BlockAllocator

__all__ = ["Request", "Replayed", "conversation_prompt", "replay", "hit_rate", "first_difference"]


@dataclass(frozen=True)
class Request:
    """One request of a replay: ``prompt`` ids, the ``answer`` ids generated to it (the last one, an
    end-of-turn id, is never cached), and labels for the report."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...] = ()
    conversation: int = 0
    turn: int = 0


@dataclass(frozen=True)
class Replayed:
    """A request after the replay: its prompt's length and how many of its tokens were cached."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int


def conversation_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The prompt ids a server builds for ``messages``: the model's own template with the
    assistant's opening (``tokenizer.apply_chat_template``, interface A)."""
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))


def replay(requests: Sequence[Request], block_size: int, cache_salt=None) -> list[Replayed]:
    """Run ``requests`` in order through a prefix-caching allocator with blocks of ``block_size``
    tokens and room for all of them (nothing is evicted); see the module docstring."""
    bs = positive_int("block_size", block_size)
    total = sum(len(r.prompt) + len(r.answer) for r in requests)
    allocator = BlockAllocator(total // bs + 2 * len(requests) + 1, bs, prefix_caching=True)
    out = []
    for i, request in enumerate(requests):
        prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise ValueError(f"request {i} has an empty prompt")
        allocator.allocate(i, prompt, cache_salt=cache_salt)
        cached = min(allocator.cached_tokens(i), (len(prompt) - 1) // bs * bs)
        for token in list(request.answer)[:-1]:  # the last answer token is sampled, never run
            allocator.append_token(i, int(token))
        allocator.free(i)
        out.append(Replayed(request.conversation, request.turn, len(prompt), cached))
    return out


def hit_rate(replayed: Sequence[Replayed]) -> float:
    """Cached prompt tokens over all prompt tokens."""
    prompts = sum(r.prompt_tokens for r in replayed)
    return sum(r.cached_tokens for r in replayed) / prompts if prompts else 0.0


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where the id sequences ``a`` and ``b`` differ (the shorter's length if one
    is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
