"""A request's state inside the engine (nano-vllm's ``Sequence``)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..latency import latency_metrics
from ..sampling import SamplingParams


@dataclass(eq=False)  # a request is itself, whatever its fields hold
class Request:
    """One request's state and history inside the engine.

    ``num_computed`` counts the tokens whose keys and values are in the cache: the scheduler gives a
    step some of the ``num_tokens - num_computed`` still to compute (a prompt chunk, or the one
    token a decoding request sampled last step, followed by its draft ``draft_ids`` when the engine
    speculates). ``cached_tokens`` is how many of them its latest
    admission found in the prefix cache instead of computing them.
    """

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    token_times_s: list[float] = field(default_factory=list)
    first_scheduled_s: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (its step raised, or its sampling failed)
    error: str | None = None  # why its sampling failed (finish reason "error" from its own row)
    preemptions: int = 0
    steps_run: int = 0
    cached_tokens: int = 0  # prefix-cache hits of its latest admission
    draft_ids: list[int] = field(default_factory=list)  # this step's speculative draft (engine.speculative)
    draft_tokens: int = 0  # draft tokens verified over its life (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted
    block_hashes: list[int] = field(default_factory=list)  # of its full blocks of known tokens, in order (prefix cache)

    @property
    def all_ids(self) -> list[int]:
        """Its known tokens, a new list (it copies them all: the engine's per-step paths use
        :meth:`token_ids` or :meth:`view`)."""
        return self.prompt_ids + self.output_ids

    def view(self) -> TokenView:
        """Its known tokens followed by this step's draft, read only and not copied."""
        return TokenView(self.prompt_ids, self.output_ids, self.draft_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a step needs a few tokens of a long
        sequence: copying all of it for every request every step costs milliseconds at batch 128).
        Past the known tokens come this step's draft tokens (speculative decoding): the step
        computes them too."""
        p, known = len(self.prompt_ids), self.num_tokens
        if end > known:  # the draft follows the known tokens
            return self.token_ids(min(start, known), known) + self.draft_ids[max(start - known, 0):end - known]
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def samples_after(self, n: int) -> bool:
        """Whether a step that computes ``n`` more of its tokens computes all it knows and its draft:
        then the step samples it (its next token, or its verified draft and the token after)."""
        return self.num_computed + n == self.num_tokens + len(self.draft_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict | None:
        """Chapter 03's TTFT, TPOT, ITL and E2E of this request (None before its first token)."""
        if not self.token_times_s:
            return None
        return latency_metrics(self.arrival_s, self.token_times_s)


class TokenView(Sequence):
    """Lists laid end to end, read only, without copying them: ``len``, indexing (negative too),
    slicing (a new list of just the slice), iteration, ``+`` (a new list) and ``==`` with a list.
    The engine hands a step's sequences their tokens this way (``ScheduledSeq.token_ids``): building
    ``prompt + output + draft`` for every sequence every step costs time that grows with the
    sequences' lengths. Each part's length is fixed when it is made: tokens appended to the lists
    afterwards are not in it."""

    __slots__ = ("_parts", "_lens", "_len")

    def __init__(self, *parts: Sequence[int]):
        self._parts = parts
        self._lens = tuple(len(p) for p in parts)  # each part as long as it is now
        self._len = sum(self._lens)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            out, base = [], 0
            for part, n in zip(self._parts, self._lens):
                lo, hi = max(start - base, 0), min(stop - base, n)
                if lo < hi:
                    out.extend(part[lo:hi])
                base += n
            return out
        i = int(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"token index {index} out of range for {self._len} tokens")
        for part, n in zip(self._parts, self._lens):
            if i < n:
                return part[i]
            i -= n
        raise IndexError(index)  # unreachable: the parts hold _len tokens

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(itertools.islice(p, n) for p, n in zip(self._parts, self._lens))

    def __add__(self, other) -> list[int]:
        """A new list, as ``list + list`` gives (a learner's code may concatenate token lists)."""
        return list(self) + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        if isinstance(other, (TokenView, list, tuple)):
            return len(other) == self._len and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})"
