"""The course server's back end: the model, its tokenizer, a FIFO scheduler and the timelines.

The HTTP layer (:mod:`labsupport.serve.app`) talks to a back end only through :class:`Backend`:
``prepare`` (tokenise and validate a prompt), ``submit`` (queue it; returns a
:class:`RequestHandle` that yields :class:`TokenOut` as tokens are made and can be cancelled),
``stats`` and ``timeline``. This chapter's back end, :class:`FifoEngine`, is one asyncio task
that takes requests from a first-in, first-out queue and generates one request at a time;
chapter 12 replaces it with a continuous-batching engine behind the same interface.

Every request carries a :class:`Timeline`: timestamps (``time.monotonic()``, the clock every
process on the machine shares) of each stage it passes through, which the server exposes at
``GET /v1/requests/{id}/timeline`` (a course extension, not part of OpenAI's API).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..models import ModelConfig, get_model
from ..tokenizer import IncrementalDetokenizer, course_tokenizer  # the server's one tokenizer import
from ..transformer import Transformer

#: The model preset whose shape the course model takes (with the tokenizer's vocabulary size).
BASE_PRESET = "tiny-2m"
MODEL_NAME = "course-tiny"
WEIGHTS_NOTE = (
    "random weights (seed {seed}), not trained: the text it generates is meaningless. It serves to "
    "measure a request's journey, not to answer anything."
)
TIMELINES_KEPT = 256  # the most recent requests whose timelines stay available


class InvalidRequest(ValueError):
    """A request the back end refuses; the HTTP layer turns it into a 4xx error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class Timeline:
    """Timestamps of one request's stages, in seconds of ``time.monotonic()``."""

    def __init__(self, request_id: str, arrival: float | None = None):
        self.request_id = request_id
        self.arrival = time.monotonic() if arrival is None else arrival
        self.events: list[tuple[str, float, int | None]] = [("arrival", self.arrival, None)]
        self.outcome = "in progress"

    def mark(self, stage: str, token: int | None = None) -> float:
        now = time.monotonic()
        self.events.append((stage, now, token))  # list.append is atomic: safe from the model thread
        return now

    def to_json(self) -> dict:
        return {
            "id": self.request_id,
            "clock": "time.monotonic",
            "arrival": self.arrival,
            "outcome": self.outcome,
            "events": [
                {"stage": stage, "t": t - self.arrival, "token": token} for stage, t, token in list(self.events)
            ],
        }


@dataclass
class GenerationRequest:
    """A prompt, tokenised and validated, with its generation settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    timeline: Timeline = field(default_factory=lambda: Timeline(new_request_id()))

    @property
    def request_id(self) -> str:
        return self.timeline.request_id


@dataclass
class TokenOut:
    """One generated token as the client will see it: ``text`` may be empty while the
    detokenizer holds back the first bytes of a character that spans tokens."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (end of text), "length" (max_tokens) on the last token


class RequestHandle:
    """What ``submit`` returns: iterate it (``async for out in handle``) for the tokens;
    ``cancel()`` frees the request's slot, whether it is queued or generating."""

    def __init__(self, request: GenerationRequest, on_cancel=None):
        self.request = request
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.done = False  # the consumer has read the end of the stream
        self.finished = False  # the engine has finished with it (completed, cancelled or failed)
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        if not self.done and not self.finished:
            self.cancelled = True
            if self._on_cancel is not None:
                self._on_cancel(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenOut:
        if self.done and self.outputs.empty():
            raise StopAsyncIteration
        item = await self.outputs.get()
        if item is None:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item


class Backend(Protocol):
    """What the HTTP layer needs from a back end (see the module docstring)."""

    model_name: str
    context_tokens: int
    max_tokens_limit: int
    description: str

    def prepare(self, prompt, max_tokens: int, temperature: float, seed: int | None,
                timeline: Timeline) -> GenerationRequest: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def stats(self) -> dict: ...

    def timeline(self, request_id: str) -> Timeline | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def course_model_config(vocab_size: int, base: str = BASE_PRESET) -> ModelConfig:
    """The shape of the course model: the ``base`` preset with the tokenizer's vocabulary."""
    return dataclasses.replace(get_model(base), name=MODEL_NAME, vocab_size=vocab_size, source="course server")


class FifoEngine:
    """One request at a time, first in, first out: an asyncio queue and one worker task.

    The model runs in a worker thread (``asyncio.to_thread``), one forward pass at a time, so the
    event loop keeps accepting requests, streaming tokens and noticing disconnects meanwhile.
    ``max_requests`` slots are shared by queued and running requests; when they are all taken a
    new request is refused (HTTP 429) rather than queued without bound.
    """

    def __init__(self, *, context_tokens: int = 512, max_tokens_limit: int = 256, max_requests: int = 64,
                 seed: int = 0, base: str = BASE_PRESET, device: str = "cpu"):
        self.tokenizer = course_tokenizer()
        self.cfg = course_model_config(self.tokenizer.vocab_size, base)
        self.model = Transformer(self.cfg, device=device, seed=seed)
        self.model_name = MODEL_NAME
        self.context_tokens = context_tokens
        self.max_tokens_limit = min(max_tokens_limit, context_tokens - 1)
        self.max_requests = max_requests
        self.seed = seed
        self.description = WEIGHTS_NOTE.format(seed=seed)
        self.eot_id = _end_of_text_id(self.tokenizer)
        self._queue: asyncio.Queue[RequestHandle] | None = None  # made by start(), in the running loop
        self._active: set[RequestHandle] = set()  # queued or running
        self._running: RequestHandle | None = None
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        self._worker: asyncio.Task | None = None
        self.served = 0
        self.cancelled = 0
        self.step_delay_s = 0.0  # an added pause per forward pass (--step-delay): a slower model, for demos and tests

    # -- the interface the HTTP layer uses --

    def prepare(self, prompt, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                timeline: Timeline | None = None) -> GenerationRequest:
        """Tokenise ``prompt`` (a string, or a list of token ids) and check it fits the context."""
        timeline = timeline or Timeline(new_request_id())
        timeline.mark("tokenise_start")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size - 1}]", "prompt"
                )
        timeline.mark("tokenise_end")
        if not ids:
            raise InvalidRequest("the prompt is empty: give at least one character (or token id)", "prompt")
        if len(ids) >= self.context_tokens:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_tokens} tokens, and your prompt has "
                f"{len(ids)} tokens, which leaves no room for an answer. Shorten the prompt.",
                "prompt", "context_length_exceeded",
            )
        if len(ids) + max_tokens > self.context_tokens:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_tokens} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                f"Reduce max_tokens to at most {self.context_tokens - len(ids)} or shorten the prompt.",
                "max_tokens", "context_length_exceeded",
            )
        return GenerationRequest(ids, max_tokens, temperature, seed, timeline)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self._queue is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if len(self._active) >= self.max_requests:
            raise InvalidRequest(
                f"the server is full: {self.max_requests} requests are already queued or running. Retry later.",
                None, "server_full", status=429,
            )
        handle = RequestHandle(request, on_cancel=self._cancel)
        self._remember(request.timeline)
        self._active.add(handle)
        request.timeline.mark("queued")
        self._queue.put_nowait(handle)
        return handle

    def stats(self) -> dict:
        running = 1 if self._running is not None else 0
        return {
            "running": running,
            "queued": len(self._active) - running,
            "slots_total": self.max_requests,
            "slots_used": len(self._active),
            "served": self.served,
            "cancelled": self.cancelled,
        }

    def timeline(self, request_id: str) -> Timeline | None:
        return self._timelines.get(request_id)

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._active.clear()
        self._worker = asyncio.create_task(self._work(), name="labsupport.serve worker")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass

    # -- the scheduler and the model worker --

    def _cancel(self, handle: RequestHandle) -> None:
        """A queued request leaves at once, freeing its slot; a running one stops at its next step."""
        if handle is not self._running and handle in self._active:
            self._finish(handle, "cancelled while queued")

    def _remember(self, timeline: Timeline) -> None:
        self._timelines[timeline.request_id] = timeline
        while len(self._timelines) > TIMELINES_KEPT:
            self._timelines.popitem(last=False)

    async def _work(self) -> None:
        while True:
            handle = await self._queue.get()
            timeline = handle.request.timeline
            if handle.finished:  # cancelled while it waited: its slot is already free
                continue
            timeline.mark("scheduled")
            self._running = handle
            try:
                await self._generate(handle)
            except Exception as exc:  # a bug must not stop the server: fail this request only
                handle.outputs.put_nowait(exc)
                self._finish(handle, f"error: {type(exc).__name__}: {exc}")
            finally:
                self._running = None

    def _finish(self, handle: RequestHandle, outcome: str) -> None:
        handle.finished = True
        handle.request.timeline.outcome = outcome
        handle.request.timeline.mark("finished")
        self._active.discard(handle)
        if outcome == "completed":
            self.served += 1
        elif outcome.startswith("cancelled"):
            self.cancelled += 1
        handle.outputs.put_nowait(None)

    def _choose(self, logits: torch.Tensor, generator: torch.Generator | None, temperature: float) -> int:
        if temperature <= 0:
            return int(logits[0].argmax())
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    async def _generate(self, handle: RequestHandle) -> None:
        request, timeline, model = handle.request, handle.request.timeline, self.model
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None else self.seed)
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long)  # (1, P)
        cache = model.new_cache(1, len(request.prompt_ids) + request.max_tokens)
        detok = IncrementalDetokenizer(self.tokenizer)

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
        for index in range(request.max_tokens):
            if handle.cancelled:
                self._finish(handle, f"cancelled after {index} tokens")
                return
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            if handle.cancelled:
                self._finish(handle, f"cancelled after {index} tokens")
                return
            if index > 0:  # the first token comes from the prefill's logits; each later one from a step
                logits = await asyncio.to_thread(decode, token, index)
                if handle.cancelled:
                    self._finish(handle, f"cancelled after {index} tokens")
                    return
            token = self._choose(logits, generator, request.temperature)
            finish = "stop" if token == self.eot_id else ("length" if index + 1 == request.max_tokens else None)
            timeline.mark("detokenise_start", index)
            text = "" if token == self.eot_id else detok.push(token)
            if finish is not None:
                text += detok.flush()
            timeline.mark("detokenise_end", index)
            handle.outputs.put_nowait(TokenOut(index, token, text, finish))
            if finish is not None:
                break
        self._finish(handle, "completed")


def _end_of_text_id(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (generation stops there), or None."""
    for attr in ("eot_id", "end_of_text_id", "eos_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    specials = getattr(tokenizer, "special_tokens", None) or {}
    for name, value in dict(specials).items():
        if "endoftext" in str(name).replace("_", "").lower():
            return int(value)
    return None
