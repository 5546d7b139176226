"""A request's state inside the engine (nano-vllm's ``Sequence``)."""

from __future__ import annotations

from collections.abc import Hashable
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

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

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
