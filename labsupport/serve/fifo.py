"""Chapter 03's back end: one request at a time, first in, first out.

:class:`FifoBackend` (``FifoEngine``, its old name, still works) is one asyncio task, the worker,
that takes requests from a first-in, first-out queue and generates each to its end before the
next: a prefill, then one decode step per token, each in a worker thread (``asyncio.to_thread``),
so the event loop keeps accepting requests, streaming tokens and noticing disconnects meanwhile. Chapter 12 puts chapter 13's
continuous-batching engine behind the same interface (:mod:`labsupport.serve.continuous`).

Timeline stages (``GET /v1/requests/{id}/timeline``): ``tokenise_start``/``tokenise_end``,
``queued``, ``scheduled``, ``prefill_start``/``prefill_end``, per token after the first
``decode_start``/``decode_end`` (``token``: its index), per token ``detokenise_start``/
``detokenise_end``, then ``finished``; the HTTP layer adds ``chunk_sent`` or ``response_sent``.
"""

from __future__ import annotations

import asyncio

import torch

from ..engine.sampler import row_failure
from ..sampling import SamplingParams, penalize_repetition, sample
from .backend import Backend, RequestHandle


class FifoBackend(Backend):
    """One request at a time, first in, first out: an asyncio queue and one worker task (see the
    module docstring; the constructor's arguments are :class:`~labsupport.serve.backend.Backend`'s)."""

    kind = "fifo"

    def __init__(self, served=None, **options):
        super().__init__(served, **options)
        self._queue: asyncio.Queue[RequestHandle] | None = None  # made by start(), in the running loop
        self._running: RequestHandle | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        await super().start()

    def _running_count(self) -> int:
        return 1 if self._running is not None else 0

    def _enqueue(self, handle: RequestHandle) -> None:
        self._queue.put_nowait(handle)

    def _on_cancel(self, handle: RequestHandle) -> None:
        """A queued request leaves at once, freeing its slot; a running one stops at its next step."""
        if handle is not self._running and handle.request.request_id in self._handles:
            self._finish(handle, "cancelled while queued")

    async def _work(self) -> None:
        while True:
            handle = await self._queue.get()
            if handle.finished:  # cancelled while it waited: its slot is already free
                continue
            handle.request.timeline.mark("scheduled")
            self._running = handle
            try:
                await self._generate(handle)
            except Exception as exc:  # fail this request only; the worker goes on
                self._fail(handle, exc)
            finally:
                self._running = None

    def _choose(self, logits: torch.Tensor, generator: torch.Generator | None, request, seen: list[int]) -> int:
        """The next token: ``seen`` is the sequence so far (prompt and output), read for a repetition penalty."""
        if request.repetition_penalty != 1:  # before everything, greedy included (vLLM's order)
            logits = penalize_repetition(logits, [seen], [request.repetition_penalty])
        if request.temperature <= 0:
            return int(logits[0].argmax())
        try:
            if request.top_p >= 1 and request.top_k == 0 and request.min_p == 0:
                # chapter 03's own draw, kept so its seeded samples stay
                probs = torch.softmax(logits[0] / request.temperature, dim=-1)
                return int(torch.multinomial(probs, 1, generator=generator))
            return int(sample(logits, request.temperature, request.top_k, request.top_p, generator=generator,
                              min_p=request.min_p)[0])
        except RuntimeError as exc:  # probabilities that are not a distribution: this request fails, clearly
            params = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                    min_p=request.min_p, repetition_penalty=request.repetition_penalty)
            raise row_failure(params, f"the draw raised {exc}") from exc

    async def _generate(self, handle: RequestHandle) -> None:
        request, timeline, model = handle.request, handle.request.timeline, self.model
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None else self.seed)
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long)  # (1, P)
        cache = model.new_cache(1, len(request.prompt_ids) + request.max_tokens)

        def prefill():
            timeline.mark("prefill_start")
            logits = model.prefill(prompt, cache)  # (1, V)
            timeline.mark("prefill_end")
            return logits

        def decode(token: int, index: int):
            timeline.mark("decode_start", index)
            logits = model.decode_step(torch.tensor([[token]]), cache)  # (1, V)
            timeline.mark("decode_end", index)
            return logits

        logits = await asyncio.to_thread(prefill)
        token = -1
        seen = list(request.prompt_ids) if request.repetition_penalty != 1 else []
        for index in range(request.max_tokens):
            if handle.cancelled:
                return self._finish(handle, f"cancelled after {index} tokens")
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            if handle.cancelled:
                return self._finish(handle, f"cancelled after {index} tokens")
            if index > 0:  # the first token comes from the prefill's logits; each later one from a step
                logits = await asyncio.to_thread(decode, token, index)
                if handle.cancelled:
                    return self._finish(handle, f"cancelled after {index} tokens")
            token = self._choose(logits, generator, request, seen)
            if request.repetition_penalty != 1:
                seen.append(token)
            if self._emit(handle, index, token, "length" if index + 1 == request.max_tokens else None):
                break
        self._finish(handle, "completed")


FifoEngine = FifoBackend  # the old name: "engine" in code now means chapter 13's labsupport.engine
