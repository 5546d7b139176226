"""The course server's continuous-batching back end: chapter 13's engine behind chapter 03's server.

``python -m labsupport.serve --engine continuous`` serves with :class:`ContinuousBackend` instead of
chapter 03's :class:`~labsupport.serve.fifo.FifoBackend` (still the default, so chapter 03's lab
is unchanged). Both are :class:`~labsupport.serve.backend.Backend`\\ s, named as back ends: in the
code "engine" means chapter 13's :class:`labsupport.engine.Engine`, which this back end drives
(``ContinuousEngine``, the class's old name, still works; the command line's ``--engine`` flag
keeps its name and values).

One asyncio task, the **worker**, owns the :class:`labsupport.engine.Engine`. Between steps, on the
event loop, it admits the requests submitted since the last step (``Engine.add_request``) and
aborts the cancelled ones (``Engine.abort``, which frees their cache blocks); then it runs one
``Engine.step`` in a thread (``asyncio.to_thread``), so the event loop keeps accepting requests and
streaming tokens while the model runs. Only the worker touches the engine, and never while a step
runs: no lock is needed. Each step's tokens go to their requests' queues, which the HTTP layer
turns into server-sent events; every request that shared a step sees the same step number. A
request the server is done with is released from the engine (``Engine.release``).

Failures stay small: a request the engine refuses to admit fails alone; a request whose own row
cannot be sampled fails alone, its neighbours in the step keep their tokens; a step that raises
fails the requests running in it (their blocks are freed; the cause is logged) and the next step
goes on with the others.

Timeline stages (``GET /v1/requests/{id}/timeline``): ``queued`` (submitted), ``scheduled`` (added
to the engine), one ``engine_step`` per step the request took part in (its ``token`` field is the
step's number, counted from 0 since the server started), ``sampled`` per token (``token``: the
token id), ``detokenise_start``/``detokenise_end`` (``token``: the index), then ``finished``.
"""

from __future__ import annotations

import asyncio

from ..engine import Engine, SpeculativeConfig
from ..engine.sampler import RowSamplingError
from ..sampling import SamplingParams
from ..scheduler import blocks_for
from .backend import Backend, RequestHandle

STEPS_KEPT = 256  # the engine's step records kept (a server runs for days)


class ContinuousBackend(Backend):
    """Continuous batching (chapter 13's :class:`~labsupport.engine.Engine`) behind the server.

    ``num_blocks`` cache blocks of ``block_size`` token positions hold every running request's keys
    and values (default: enough for ``max_running`` requests at the full context); ``token_budget``
    caps the tokens of one step and ``max_running`` the requests in it. ``speculative_tokens`` > 0
    turns on the engine's n-gram speculative decoding with drafts of at most that many tokens
    (:mod:`labsupport.engine.speculative`). The other arguments are
    :class:`~labsupport.serve.backend.Backend`'s.
    """

    kind = "continuous"

    def __init__(self, served=None, *, block_size: int = 16, num_blocks: int | None = None,
                 token_budget: int = 256, max_running: int = 16, speculative_tokens: int = 0,
                 cpu_decode: str = "torch", **options):
        super().__init__(served, **options)
        if num_blocks is None:
            num_blocks = max_running * blocks_for(self.context_tokens, block_size)
        if num_blocks * block_size < self.context_tokens:
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens hold {num_blocks * block_size} tokens, "
                             f"fewer than one request at the full context ({self.context_tokens}): raise --num-blocks")
        spec = SpeculativeConfig(num_speculative_tokens=speculative_tokens) if speculative_tokens else None
        self.engine = Engine(self.model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget,
                             max_running=max_running, max_model_len=self.context_tokens, speculative=spec,
                             cpu_decode=cpu_decode)
        self.description += (f" Continuous batching: {num_blocks} KV blocks of {block_size} tokens, at most "
                             f"{token_budget} tokens and {max_running} requests per step.")
        if spec:
            self.description += f" Speculative decoding: prompt-lookup drafts of up to {speculative_tokens} tokens."
        if cpu_decode == "fused":
            self.description += " One-request decode steps run as one C call (labsupport.cpu_decode)."
        self._new: list[RequestHandle] = []  # submitted since the last step
        self._wake: asyncio.Event | None = None
        self.steps_run = 0  # the engine's own step records are trimmed

    async def start(self) -> None:
        self._wake = asyncio.Event()
        await super().start()

    def stats(self) -> dict:
        eng = self.engine
        return {**super().stats(), "engine": "continuous", "steps": self.steps_run,
                "kv_blocks_total": eng.num_blocks, "kv_blocks_free": eng.allocator.num_free_blocks,
                "block_size": eng.block_size, "spec_draft_tokens": eng.totals["spec_draft_tokens"],
                "spec_accepted_tokens": eng.totals["spec_accepted_tokens"]}

    def _running_count(self) -> int:
        return len(self.engine.running)

    def _enqueue(self, handle: RequestHandle) -> None:
        self._new.append(handle)
        self._wake.set()

    def _on_cancel(self, handle: RequestHandle) -> None:
        self._wake.set()  # an idle worker wakes to abort it

    def _forget(self, request_id: str) -> None:
        self.engine.release(request_id)  # its blocks go back to the allocator, its state is dropped

    # -- the worker --

    async def _work(self) -> None:
        eng = self.engine
        while True:
            self._admit()
            self._abort_cancelled()
            if not eng.has_unfinished():
                self._wake.clear()
                if not self._new:
                    await self._wake.wait()
                continue
            await self._step()

    def _admit(self) -> None:
        """Between steps: add the new requests to the engine; one the engine refuses fails alone."""
        new, self._new = self._new, []
        for handle in new:
            req = handle.request
            if handle.cancelled:
                self._finish(handle, "cancelled while queued")
                continue
            try:
                stops = req.stop_token_ids + (() if req.ignore_eos else tuple(sorted(self.eos_ids)))
                params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                        min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                                        max_tokens=req.max_tokens, stop_token_ids=stops,
                                        seed=req.seed if req.seed is not None else self.seed)
                self.engine.add_request(req.prompt_ids, params, request_id=req.request_id)
            except Exception as exc:
                self._fail(handle, exc)
                continue
            req.timeline.mark("scheduled")

    def _abort_cancelled(self) -> None:
        for rid, handle in list(self._handles.items()):
            if handle.cancelled and rid in self.engine.requests:
                made = len(self.engine.requests[rid].output_ids)
                self._finish(handle, f"cancelled after {made} tokens")  # releases it: its blocks are free now

    async def _step(self) -> None:
        eng = self.engine
        before = {rid: eng.requests[rid].steps_run for rid in self._handles if rid in eng.requests}
        step_index = self.steps_run
        try:
            events = await asyncio.to_thread(eng.step)
        except Exception as exc:  # fail the requests of this step (all in the engine if none ran); go on
            blamed = [rid for rid in self._handles if rid in eng.requests and eng.requests[rid].finish_reason == "error"]
            blamed = blamed or [r.request_id for r in eng.running] or [rid for rid in self._handles if rid in eng.requests]
            for rid in blamed:
                if rid in self._handles:
                    self._fail(self._handles[rid], exc, log_it=rid == blamed[0])
            return
        self.steps_run += 1
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        if len(eng.steps) > 4 * STEPS_KEPT:
            del eng.steps[:-STEPS_KEPT]
        for rid, steps in before.items():
            if rid in eng.requests and eng.requests[rid].steps_run > steps:
                self._handles[rid].request.timeline.mark("engine_step", step_index)
        for rid in list(self._handles):  # a request whose own sampling failed ends alone, with the reason
            req = eng.requests.get(rid)
            if req is not None and req.finish_reason == "error" and req.error is not None:
                self._fail(self._handles[rid], RowSamplingError(req.error))
        for ev in events:
            handle = self._handles.get(ev.request_id)
            if handle is None:
                continue
            handle.request.timeline.mark("sampled", ev.token_id)
            try:
                finish = self._emit(handle, ev.index, ev.token_id, ev.finish_reason)
            except Exception as exc:
                self._fail(handle, exc)
                continue
            if finish is not None:
                self._finish(handle, "completed")  # a stop string ends it before the engine would: released


ContinuousEngine = ContinuousBackend  # the old name: "engine" in code now means labsupport.engine
