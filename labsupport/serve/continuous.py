"""The course server's continuous-batching back end: chapter 13's engine behind chapter 03's server.

``python -m labsupport.serve --engine continuous`` serves with :class:`ContinuousEngine` instead of
chapter 03's :class:`~labsupport.serve.engine.FifoEngine` (still the default, so chapter 03's lab
is unchanged). Both implement the same :class:`~labsupport.serve.engine.Backend` interface.

One asyncio task, the **worker**, owns the :class:`labsupport.engine.Engine`. Between steps, on the
event loop, it admits the requests submitted since the last step (``Engine.add_request``) and
aborts the cancelled ones (``Engine.abort``, which frees their cache blocks); then it runs one
``Engine.step`` in a thread (``asyncio.to_thread``), so the event loop keeps accepting requests and
streaming tokens while the model runs. Only the worker touches the engine, and never while a step
runs: no lock is needed. Each step's tokens go to their requests' queues, which the HTTP layer
turns into server-sent events; every request that shared a step sees the same step number.

Timeline stages (``GET /v1/requests/{id}/timeline``): ``queued`` (submitted), ``scheduled`` (added
to the engine), one ``engine_step`` per step the request took part in (its ``token`` field is the
step's number, counted from 0 since the server started), ``sampled`` per token (``token``: the
token id), ``detokenise_start``/``detokenise_end`` (``token``: the index), then ``finished``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from ..engine import Engine
from ..sampling import SamplingParams
from ..scheduler import blocks_for
from ..tokenizer import IncrementalDetokenizer, course_tokenizer
from ..transformer import Transformer
from .engine import (
    BASE_PRESET,
    MODEL_NAME,
    TIMELINES_KEPT,
    WEIGHTS_NOTE,
    FifoEngine,
    GenerationRequest,
    InvalidRequest,
    RequestHandle,
    Timeline,
    TokenOut,
    _end_of_text_id,
    course_model_config,
)


class ContinuousEngine:
    """Continuous batching (chapter 13's :class:`~labsupport.engine.Engine`) behind the server.

    ``num_blocks`` cache blocks of ``block_size`` token positions hold every running request's keys
    and values (default: enough for ``max_running`` requests at the full context); ``token_budget``
    caps the tokens of one step and ``max_running`` the requests in it. ``max_requests`` slots are
    shared by requests queued and running; when all are taken, a new request gets HTTP 429.
    """

    prepare = FifoEngine.prepare  # the same tokenisation and the same refusals as chapter 03

    def __init__(self, *, context_tokens: int = 512, max_tokens_limit: int = 256, max_requests: int = 64,
                 seed: int = 0, base: str = BASE_PRESET, device: str = "cpu", block_size: int = 16,
                 num_blocks: int | None = None, token_budget: int = 256, max_running: int = 16):
        self.tokenizer = course_tokenizer()
        self.cfg = course_model_config(self.tokenizer.vocab_size, base)
        self.model = Transformer(self.cfg, device=device, seed=seed)
        self.model_name = MODEL_NAME
        self.context_tokens = context_tokens
        self.max_tokens_limit = min(max_tokens_limit, context_tokens - 1)
        self.max_requests = max_requests
        self.seed = seed
        self.eot_id = _end_of_text_id(self.tokenizer)
        if num_blocks is None:
            num_blocks = max_running * blocks_for(context_tokens, block_size)
        if num_blocks * block_size < context_tokens:
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens hold {num_blocks * block_size} tokens, "
                             f"fewer than one request at the full context ({context_tokens}): raise --num-blocks")
        self.engine = Engine(self.model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget,
                             max_running=max_running, max_model_len=context_tokens)
        self.description = WEIGHTS_NOTE.format(seed=seed) + (
            f" Continuous batching: {num_blocks} KV blocks of {block_size} tokens, at most {token_budget} tokens "
            f"and {max_running} requests per step.")
        self._handles: dict[str, RequestHandle] = {}  # submitted, not yet finished
        self._new: list[RequestHandle] = []  # submitted since the last step
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self.served = 0
        self.cancelled = 0
        self.step_delay_s = 0.0  # an added pause per step (--step-delay): a slower model, for demos and tests
        self.steps_run = 0  # the engine's own step records are trimmed: a server runs for days

    # -- the interface the HTTP layer uses --

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self._wake is None:
            raise RuntimeError("the engine is not started: await engine.start() first")
        if len(self._handles) >= self.max_requests:
            raise InvalidRequest(
                f"the server is full: {self.max_requests} requests are already queued or running. Retry later.",
                None, "server_full", status=429,
            )
        handle = RequestHandle(request, on_cancel=lambda _: self._wake.set())  # an idle worker wakes to abort it
        self._remember(request.timeline)
        self._handles[request.request_id] = handle
        self._new.append(handle)
        request.timeline.mark("queued")
        self._wake.set()
        return handle

    def stats(self) -> dict:
        eng = self.engine
        return {
            "running": len(eng.running),
            "queued": len(self._handles) - len(eng.running),
            "slots_total": self.max_requests,
            "slots_used": len(self._handles),
            "served": self.served,
            "cancelled": self.cancelled,
            "engine": "continuous",
            "steps": self.steps_run,
            "kv_blocks_total": eng.num_blocks,
            "kv_blocks_free": eng.allocator.num_free_blocks,
            "block_size": eng.block_size,
        }

    def timeline(self, request_id: str) -> Timeline | None:
        return self._timelines.get(request_id)

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._worker = asyncio.create_task(self._work(), name="labsupport.serve continuous worker")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass

    # -- the worker --

    def _remember(self, timeline: Timeline) -> None:
        self._timelines[timeline.request_id] = timeline
        while len(self._timelines) > TIMELINES_KEPT:
            self._timelines.popitem(last=False)

    def _admit_and_abort(self) -> None:
        """Between steps: add new requests to the engine, abort the cancelled ones."""
        for handle in self._new:
            req = handle.request
            if handle.cancelled:
                self._finish(handle, "cancelled while queued")
                continue
            params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                    seed=req.seed if req.seed is not None else self.seed,
                                    stop_token_ids=() if self.eot_id is None else (self.eot_id,))
            self.engine.add_request(req.prompt_ids, params, request_id=req.request_id)
            self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer)
            req.timeline.mark("scheduled")
        self._new.clear()
        for rid, handle in list(self._handles.items()):
            if handle.cancelled and rid in self.engine.requests:
                made = len(self.engine.requests[rid].output_ids)
                self.engine.abort(rid)  # its blocks go back to the allocator now
                self._finish(handle, f"cancelled after {made} tokens")

    def _finish(self, handle: RequestHandle, outcome: str) -> None:
        rid = handle.request.request_id
        handle.request.timeline.outcome = outcome
        handle.request.timeline.mark("finished")
        self._handles.pop(rid, None)
        self._detok.pop(rid, None)
        self.engine.requests.pop(rid, None)  # the engine keeps finished requests; a server must not
        if outcome == "completed":
            self.served += 1
        elif outcome.startswith("cancelled"):
            self.cancelled += 1
        handle.outputs.put_nowait(None)

    async def _work(self) -> None:
        eng = self.engine
        while True:
            self._admit_and_abort()
            if not eng.has_unfinished():
                self._wake.clear()
                if not self._new:
                    await self._wake.wait()
                continue
            before = {rid: eng.requests[rid].steps_run for rid in self._handles if rid in eng.requests}
            step_index = self.steps_run
            try:
                events = await asyncio.to_thread(eng.step)
            except Exception as exc:  # a bug must not stop the server: fail the requests in flight
                for rid, handle in list(self._handles.items()):
                    if rid in eng.requests and not eng.requests[rid].finished:
                        eng.abort(rid)
                    handle.outputs.put_nowait(exc)
                    self._finish(handle, f"error: {type(exc).__name__}: {exc}")
                continue
            self.steps_run += 1
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            if len(eng.steps) > 1024:
                del eng.steps[:-256]
            for rid, steps in before.items():
                if eng.requests[rid].steps_run > steps:
                    self._handles[rid].request.timeline.mark("engine_step", step_index)
            for ev in events:
                self._deliver(ev)

    def _deliver(self, ev) -> None:
        handle = self._handles.get(ev.request_id)
        if handle is None:
            return
        timeline, detok = handle.request.timeline, self._detok[ev.request_id]
        timeline.mark("sampled", ev.token_id)
        finish = ev.finish_reason
        timeline.mark("detokenise_start", ev.index)
        text = "" if ev.token_id == self.eot_id else detok.push(ev.token_id)
        if finish is not None:
            text += detok.flush()
        timeline.mark("detokenise_end", ev.index)
        handle.outputs.put_nowait(TokenOut(ev.index, ev.token_id, text, finish))
        if finish is not None:
            self._finish(handle, "completed")
