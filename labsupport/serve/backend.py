"""What every back end of the course server shares: requests, their handles and timelines, slots,
the worker's life, and turning generated ids into the text a client receives.

The HTTP layer (:mod:`labsupport.serve.app`) talks to a back end only through :class:`Backend`:
``reserve`` a slot, ``prepare`` (tokenise and validate a prompt, or ``prepare_chat`` for a
conversation), ``submit`` (queue it; returns a :class:`RequestHandle` that yields
:class:`TokenOut` as tokens are made and can be cancelled), ``stats`` and ``timeline``. Two back
ends implement the scheduling: :class:`~labsupport.serve.fifo.FifoBackend` (chapter 03: one request
at a time) and :class:`~labsupport.serve.continuous.ContinuousBackend` (chapter 13's engine:
continuous batching; ``FifoEngine`` and ``ContinuousEngine`` are their old names).

**One request fails alone.** An exception while one request is admitted or generated fails that
request (its client gets an error, its slot is freed) and the worker goes on. Should the worker
itself stop, :attr:`Backend.failure` says why, the server's ``/health`` and ``/ready`` answer 503,
every request in flight fails, and the traceback is logged (logger ``labsupport.serve``).

**What a client receives.** Each generated id goes through :class:`_Output`: the model's
end-of-sequence ids and ``stop_token_ids`` end the request (``finish_reason: "stop"``) and are not
shown; with ``skip_special_tokens`` (the default, as in vLLM) the tokenizer's special tokens
(``<|im_start|>``, ``<|im_end|>`` with ``ignore_eos``) add no text, streamed or whole; the incremental detokenizer never emits half a character; and ``stop`` strings are held
back while the text could still become one, never sent, and end the request (``"stop"``). A
request that is cancelled (``POST /v1/requests/{id}/cancel``, the drain timeout) ends with
``"abort"``, as in vLLM.

Every request carries a :class:`Timeline`: timestamps (``time.monotonic()``, the clock every
process on the machine shares) of each stage it passes through, which the server exposes at
``GET /v1/requests/{id}/timeline`` (a course extension, not part of OpenAI's API).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..stop_strings import split_at_stop
from .served_model import BASE_PRESET, ServedModel, course_model

TIMELINES_KEPT = 256  # the most recent requests whose timelines stay available
log = logging.getLogger("labsupport.serve")


class InvalidRequest(ValueError):
    """A request the server refuses; the HTTP layer turns it into an OpenAI error body with
    ``status`` (400 unless said). ``close`` asks for the connection to be closed after the answer
    (the body was not read to its end)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 close: bool = False):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.close = message, param, code, status, close


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


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class GenerationRequest:
    """A prompt, tokenised and validated, with its generation settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    timeline: Timeline = field(default_factory=lambda: Timeline(new_request_id()))
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # the prompt's tokens and the output's count as seen
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: tuple[int, ...] = ()  # ids that end the request besides the model's end of sequence
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # special tokens (<|im_end|>, ...) are left out of the text, as in vLLM

    @property
    def request_id(self) -> str:
        return self.timeline.request_id


@dataclass
class TokenOut:
    """One generated token as the client will see it: ``text`` may be empty while the
    detokenizer holds back the first bytes of a character that spans tokens, or while the text
    could still become a stop string."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (end of sequence, a stop string) or "length", on the last token


@dataclass
class _End:
    """The end of a handle's stream: text still held back, and why it ended early (or None)."""

    text: str = ""
    reason: str | None = None


class RequestHandle:
    """What ``submit`` returns: iterate it (``async for out in handle``) for the tokens;
    ``cancel()`` frees the request's slot, whether it is queued or generating. After the
    iteration, ``end_reason`` is ``"abort"`` for a request stopped early (``end_text``: the text
    it still held back), None for one that finished."""

    def __init__(self, request: GenerationRequest, on_cancel=None):
        self.request = request
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.done = False  # the consumer has read the end of the stream
        self.finished = False  # the back end has finished with it (completed, cancelled or failed)
        self.end_text, self.end_reason = "", None
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
        if isinstance(item, _End):
            self.done = True
            self.end_text, self.end_reason = item.text, item.reason
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item


class _StopStrings:
    """Holds back text that could still become one of ``stops``; finds the first that completes."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """The text that can be sent now, and whether a stop string completed (the text before
        it is sent; the stop string and what follows are dropped)."""
        if not self.stops:
            return text, False
        send, self.held, stopped = split_at_stop(self.held + text, self.stops)
        return send, stopped

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class _Output:
    """One request's way from ids to text: end ids, the detokenizer, stop strings."""

    def __init__(self, request: GenerationRequest, tokenizer, eos_ids: frozenset[int], stop_filter=None,
                 detokenizer=None):
        self.end_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else eos_ids)
        self.skipped = frozenset(getattr(tokenizer, "special_token_ids", ())) if request.skip_special_tokens \
            else frozenset()
        self.detok = tokenizer.detokenizer() if detokenizer is None else detokenizer()  # lab 01's, with --stack
        # a request with stop strings uses ``stop_filter`` where one is given (lab 01's StopStringFilter, --stack)
        self.stops = (stop_filter or _StopStrings)(request.stop) if request.stop else _StopStrings(request.stop)
        self.produced = 0

    def token(self, token_id: int, finish: str | None) -> tuple[str, str | None]:
        """The text of one more id and the request's finish reason after it (None: it goes on)."""
        self.produced += 1
        if token_id in self.end_ids:
            finish = "stop"
            text = ""  # an end-of-sequence id is not shown
        elif token_id in self.skipped:
            text = ""  # skip_special_tokens: as Hugging Face's decode, the id is left out before decoding
        else:
            text = self.detok.push(token_id)
        text, stopped = self.stops.push(text)
        if stopped:
            return text, "stop"
        if finish is not None:
            tail, stopped = self.stops.push(self.detok.flush())
            text += tail + ("" if stopped else self.stops.flush())
        return text, finish

    def leftover(self) -> str:
        """What was held back, for a request that ends early."""
        tail, stopped = self.stops.push(self.detok.flush())
        return tail + ("" if stopped else self.stops.flush())


class Backend:
    """The state and the lifecycle both back ends share (see the module docstring).

    ``served`` is the :class:`~labsupport.serve.served_model.ServedModel` to serve (default: the
    course model with random weights of ``seed`` and the ``base`` preset's shape). ``max_requests``
    slots are shared by requests being tokenised, queued, running, and (submitted ``until_sent``)
    finished but with their HTTP response still being sent: a slot lasts until the response's last
    byte has been handed to the connection, or its client is gone. When they are all taken, a new request is refused (HTTP 429) rather
    than queued without bound. Subclasses implement
    ``_enqueue``, ``_on_cancel`` and the worker, ``_work``."""

    kind = "base"

    def __init__(self, served: ServedModel | None = None, *, context_tokens: int = 512,
                 max_tokens_limit: int = 256, max_requests: int = 64, seed: int = 0, base: str = BASE_PRESET,
                 device: str = "cpu"):
        self.served_model = course_model(seed, base, device) if served is None else served
        self.model, self.tokenizer = self.served_model.model, self.served_model.tokenizer
        self.cfg = self.model.cfg
        self.model_name = self.served_model.name
        self.description = self.served_model.description
        self.context_tokens = context_tokens
        self.max_tokens_limit = min(max_tokens_limit, context_tokens - 1)
        self.max_requests = max_requests
        self.seed = seed
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self.tokenizer_dir: str | None = None  # where the server wrote the tokenizer's files (cli)
        self.failure: str | None = None  # why the worker stopped, once it has
        self.detokenizer = None  # makes a request's detokenizer instead of tokenizer.detokenizer() (--stack)
        self.stop_filter = None  # a class like _StopStrings for requests with stop strings (--stack); None: the server's
        self.step_delay_s = 0.0  # an added pause per forward pass (--step-delay): a slower model, for demos and tests
        self.served = 0
        self.cancelled = 0
        self.failed = 0
        self._handles: dict[str, RequestHandle] = {}  # submitted, not yet finished (queued or running)
        self._outputs: dict[str, _Output] = {}
        self._reserved = 0  # slots held by requests being tokenised
        self._unsent: set[str] = set()  # submitted until_sent: their slot is held until sent() is called
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        self._worker: asyncio.Task | None = None
        self._tokenise_pool: ThreadPoolExecutor | None = None  # made by start()

    # -- limits ----------------------------------------------------------------------------------

    @property
    def max_prompt_bytes(self) -> int | None:
        """A prompt of more UTF-8 bytes than this cannot fit the context, whatever its tokens (each
        token stands for at most the tokenizer's ``max_token_bytes``): refused before tokenising."""
        per_token = getattr(self.tokenizer, "max_token_bytes", None)
        return None if per_token is None else self.context_tokens * per_token

    def check_size(self, prompt=None, messages: list[dict] | None = None) -> None:
        """HTTP 400 for a text prompt (or a conversation's contents) of more bytes than can fit the
        context: cheap, so the HTTP layer calls it before taking a slot; ``prepare`` checks again."""
        if isinstance(prompt, str):
            self._check_bytes(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
        if messages is not None:
            self._check_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), "messages")

    def _check_bytes(self, n_bytes: int, param: str) -> None:
        limit = self.max_prompt_bytes
        if limit is not None and n_bytes > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_tokens} tokens, and your prompt has "
                f"{n_bytes} bytes of text: at most {self.tokenizer.max_token_bytes} bytes per token, that is more "
                f"than {self.context_tokens} tokens. Shorten the prompt.", param, "context_length_exceeded")

    # -- slots -----------------------------------------------------------------------------------

    def reserve(self) -> None:
        """Take a slot for a request about to be prepared (HTTP 429 when none is free, 503 when the
        worker has stopped); ``submit`` uses it, ``unreserve`` gives it back."""
        if self.failure is not None:
            raise InvalidRequest(f"the server's model worker has stopped ({self.failure}); restart the server",
                                 None, "worker_failed", status=503)
        if self._worker is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if self._slots_used() >= self.max_requests:
            raise InvalidRequest(
                f"the server is full: {self.max_requests} requests are already queued, running or being sent. "
                f"Retry later.",
                None, "server_full", status=429)
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    def sent(self, handle: RequestHandle) -> None:
        """The HTTP response of a request submitted ``until_sent`` has ended (its last byte handed to
        the client, or the client gone): its slot is free."""
        self._unsent.discard(handle.request.request_id)

    def _slots_used(self) -> int:
        return len(self._handles.keys() | self._unsent) + self._reserved

    # -- preparing a request -----------------------------------------------------------------------

    def prepare(self, prompt, max_tokens: int | None = 16, temperature: float = 0.0, seed: int | None = None,
                timeline: Timeline | None = None, **options) -> GenerationRequest:
        """Tokenise ``prompt`` (a string, or a list of token ids) and check it fits the context.
        ``max_tokens`` None means the rest of the context (at most ``max_tokens_limit``);
        ``options``: ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
        ``skip_special_tokens``, ``add_special_tokens`` (default True: a text prompt gets what the
        tokenizer's own configuration adds around a text, as the tokenizer the server publishes does;
        nothing for SmolLM2). A list of token ids is the prompt exactly as given (OpenAI's and vLLM's rule)."""
        timeline = timeline or Timeline(new_request_id())
        add_special_tokens = options.pop("add_special_tokens", True)
        self.check_size(prompt=prompt)
        timeline.mark("tokenise_start")
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt", add_special_tokens)
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size - 1}]",
                                     "prompt")
        timeline.mark("tokenise_end")
        if not ids:
            raise InvalidRequest("the prompt is empty: give at least one character (or token id)", "prompt")
        return self._fit(ids, max_tokens, temperature, seed, timeline, options)

    def prepare_chat(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.0,
                     seed: int | None = None, timeline: Timeline | None = None, add_generation_prompt: bool = True,
                     **options) -> GenerationRequest:
        """The prompt of a conversation through the tokenizer's chat template (its ids are what
        ``usage.prompt_tokens`` counts), then as :meth:`prepare`."""
        timeline = timeline or Timeline(new_request_id("chatcmpl"))
        self.check_size(messages=messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest(f"the model {self.model_name} has no chat template, so it cannot take messages: "
                                 f"send a prompt to /v1/completions instead", "messages", "no_chat_template")
        timeline.mark("tokenise_start")
        try:
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
        except ValueError as error:
            raise InvalidRequest(str(error), "messages") from None
        timeline.mark("tokenise_end")
        return self._fit(ids, max_tokens, temperature, seed, timeline, options)

    async def prepare_async(self, chat: bool, *args, **kwargs) -> GenerationRequest:
        """:meth:`prepare` (or :meth:`prepare_chat`) in the tokenising threads, off the event loop."""
        method = self.prepare_chat if chat else self.prepare
        return await asyncio.get_running_loop().run_in_executor(self._tokenise_pool, lambda: method(*args, **kwargs))

    def _encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        try:
            if add_special_tokens and hasattr(self.tokenizer, "encode_prompt"):
                return list(self.tokenizer.encode_prompt(text))
            return list(self.tokenizer.encode(text))
        except ValueError as error:  # text that is not valid Unicode (a lone surrogate)
            raise InvalidRequest(str(error), param) from None

    def _fit(self, ids: list[int], max_tokens: int | None, temperature: float, seed: int | None,
             timeline: Timeline, options: dict) -> GenerationRequest:
        if len(ids) >= self.context_tokens:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_tokens} tokens, and your prompt has "
                f"{len(ids)} tokens, which leaves no room for an answer. Shorten the prompt.",
                "prompt", "context_length_exceeded")
        if max_tokens is None:  # the rest of the context, up to the server's limit
            max_tokens = min(self.context_tokens - len(ids), self.max_tokens_limit)
        if len(ids) + max_tokens > self.context_tokens:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_tokens} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                f"Reduce max_tokens to at most {self.context_tokens - len(ids)} or shorten the prompt.",
                "max_tokens", "context_length_exceeded")
        return GenerationRequest(ids, max_tokens, temperature, seed, timeline, **options)

    # -- submitting ------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, reserved: bool = False, until_sent: bool = False) -> RequestHandle:
        """Queue ``request`` (in the slot ``reserve`` took, if ``reserved``); returns its handle. With
        ``until_sent`` the slot outlives the generation until :meth:`sent` (the HTTP layer's answer)."""
        if not reserved:
            self.reserve()
        self.unreserve()
        if until_sent:
            self._unsent.add(request.request_id)
        handle = RequestHandle(request, on_cancel=self._on_cancel)
        self._remember(request.timeline)
        self._handles[request.request_id] = handle
        self._outputs[request.request_id] = _Output(request, self.tokenizer, self.eos_ids, self.stop_filter, self.detokenizer)
        request.timeline.mark("queued")
        self._enqueue(handle)
        return handle

    def stats(self) -> dict:
        running = self._running_count()
        return {
            "running": running,
            "queued": len(self._handles) - running,
            "slots_total": self.max_requests,
            "slots_used": self._slots_used(),
            "served": self.served,
            "cancelled": self.cancelled,
            "failed": self.failed,
        }

    def timeline(self, request_id: str) -> Timeline | None:
        return self._timelines.get(request_id)

    # -- the worker's life -------------------------------------------------------------------------

    async def start(self) -> None:
        self.failure = None
        self._tokenise_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="labsupport.serve tokenise")
        self._worker = asyncio.create_task(self._run_worker(), name=f"labsupport.serve {self.kind} worker")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        if self._tokenise_pool is not None:
            self._tokenise_pool.shutdown(wait=False, cancel_futures=True)

    async def _run_worker(self) -> None:
        try:
            await self._work()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug the per-request guards missed: say so loudly, fail what is left
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("labsupport.serve: the model worker stopped; /health and /ready now answer 503 and every "
                      "request in flight fails. Restart the server.", exc_info=exc)
            for handle in list(self._handles.values()):
                self._fail(handle, exc, log_it=False)

    def _fail(self, handle: RequestHandle, exc: BaseException, log_it: bool = True) -> None:
        """Fail one request: its client gets the error, its slot is freed; the worker goes on."""
        if log_it:
            log.error("labsupport.serve: request %s failed", handle.request.request_id, exc_info=exc)
        if handle.finished:
            return
        handle.outputs.put_nowait(exc)
        self._finish(handle, f"error: {type(exc).__name__}: {exc}")

    # -- what subclasses share -------------------------------------------------------------------

    def _remember(self, timeline: Timeline) -> None:
        self._timelines[timeline.request_id] = timeline
        while len(self._timelines) > TIMELINES_KEPT:
            self._timelines.popitem(last=False)

    def _emit(self, handle: RequestHandle, index: int, token_id: int, finish: str | None) -> str | None:
        """Send one generated id to ``handle``'s client; returns the finish reason (None: go on)."""
        timeline = handle.request.timeline
        timeline.mark("detokenise_start", index)
        text, finish = self._outputs[handle.request.request_id].token(token_id, finish)
        timeline.mark("detokenise_end", index)
        handle.outputs.put_nowait(TokenOut(index, token_id, text, finish))
        return finish

    def _finish(self, handle: RequestHandle, outcome: str) -> None:
        """The end of a request, whatever it was (``completed``, ``cancelled ...``, ``error: ...``)."""
        if handle.finished:
            return
        rid = handle.request.request_id
        handle.finished = True
        handle.request.timeline.outcome = outcome
        handle.request.timeline.mark("finished")
        self._handles.pop(rid, None)
        output = self._outputs.pop(rid, None)
        self._forget(rid)
        if outcome == "completed":
            self.served += 1
            handle.outputs.put_nowait(_End())
        elif outcome.startswith("cancelled"):
            self.cancelled += 1
            try:
                rest = output.leftover() if output else ""
            except Exception as exc:  # a learner's detokenizer or stop filter (--stack) raised on the rest
                log.error("labsupport.serve: request %s: its held-back text was lost", rid, exc_info=exc)
                rest = ""
            handle.outputs.put_nowait(_End(rest, "abort"))
        else:
            self.failed += 1
            handle.outputs.put_nowait(_End())

    def _forget(self, request_id: str) -> None:
        """Drop a back end's own state of a finished request (the continuous engine releases it)."""

    def _running_count(self) -> int:
        raise NotImplementedError

    def _enqueue(self, handle: RequestHandle) -> None:
        raise NotImplementedError

    def _on_cancel(self, handle: RequestHandle) -> None:
        raise NotImplementedError

    async def _work(self) -> None:
        raise NotImplementedError
