"""The engine's loop: add requests, step, stream tokens (nano-vllm's ``LLMEngine``; the package docstring
explains the design)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .._validate import positive_int
from ..sampling import SamplingParams, request_generator
from ..scheduler import schedule_step
from ..transformer import Transformer
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sampler import BatchedSampler, PerRowSampler
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Request
from .speculative import SpeculativeConfig, draft_room, propose

CLOCKS = ("wall", "virtual", "steps")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as a stream sends it."""

    request_id: Hashable
    index: int  # 0 for the first generated token
    token_id: int
    time_s: float
    finish_reason: str | None = None  # set on a request's last token


@dataclass(frozen=True)
class StepRecord:
    """What one step did: for plots of the batch's make-up over time."""

    step: int
    time_s: float  # clock time at the end of the step
    duration_s: float  # measured wall time of the step (schedule, forward, sample)
    num_seqs: int
    prefill_tokens: int  # tokens of prompts (or of recomputation after a preemption)
    decode_tokens: int  # one per decoding sequence
    preempted: int
    free_blocks: int
    waiting: int
    kv_tokens: int = 0  # tokens of cache the step's attention read (each sequence's length after it)
    attention_pairs: int = 0  # query-key pairs its attention scored (causal: a token sees itself and earlier)
    sampled: int = 0  # sequences that sampled a token
    draft_tokens: int = 0  # speculative draft tokens verified (their rows ran the output head too)
    accepted_tokens: int = 0  # of those, accepted (each sampled sequence emits 1 + its accepted, unless it stops)


class _Clock:
    def __init__(self, kind: str):
        if kind not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(map(repr, CLOCKS))}, got {kind!r}")
        self.kind = kind
        self._t0 = time.perf_counter()
        self._now = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0 if self.kind == "wall" else self._now

    def tick(self, duration_s: float) -> None:
        if self.kind == "virtual":
            self._now += duration_s
        elif self.kind == "steps":
            self._now += 1.0

    def advance_to(self, t: float) -> None:
        if self.kind == "wall":
            raise ValueError("a wall clock cannot be moved; use clock='virtual' to replay a trace")
        self._now = max(self._now, float(t))


Decision = Callable[..., tuple[dict, list]]
SampleFn = Callable[..., torch.Tensor]


class Engine:
    """Continuous batching with chunked prefill and prefix caching on a paged cache, for the course model.

    ``Engine(model, num_blocks=256, block_size=16, token_budget=256, max_running=32)``: the cache
    holds ``num_blocks * block_size`` token positions; one step runs at most ``token_budget``
    tokens and ``max_running`` sequences. ``scheduler`` is a step decision with the interface of
    :func:`labsupport.scheduler.schedule_step` (lab 13 plugs a learner's in, or
    :func:`~labsupport.scheduler.static_batch_step`, for which ``token_budget=None``);
    ``sampler`` one with the interface of :func:`labsupport.sampling.sample`, called once per row
    (default: the batched sampler, which gives every request the same tokens).
    ``max_model_len`` (default: what the cache holds) stops a request whose sequence reaches it.
    ``prefix_caching`` (default on, as in vLLM) reuses the cached blocks of prompts that share a
    prefix. ``attention``: ``"auto"`` (Triton kernels on a GPU, torch on a CPU), ``"torch"`` or
    ``"triton"``; ``cuda_graphs`` (default: on a GPU with the Triton kernels) captures decode steps.
    ``speculative`` (a :class:`~labsupport.engine.speculative.SpeculativeConfig`, default None: off)
    drafts tokens by prompt lookup and verifies them in the step's forward pass (:mod:`.speculative`).
    ``cpu_decode``: ``"torch"`` (default) or ``"fused"``, which runs a step that only decodes (up to
    16 sequences, every one sampling, no draft tokens) on a CPU as one C call
    (:class:`labsupport.cpu_decode.FusedDecoder`: float32 activations, rounded to int16 for int8
    weights' products, the same cache; every other step runs torch).

    After construction ``engine.scheduler`` is the :class:`~labsupport.engine.scheduler.Scheduler`
    (its ``decide`` is the step decision), ``engine.runner`` the
    :class:`~labsupport.engine.model_runner.ModelRunner` and ``engine.allocator`` the
    :class:`~labsupport.paged_cache.BlockAllocator` of the blocks.
    """

    def __init__(self, model: Transformer, *, num_blocks: int = 256, block_size: int = 16,
                 token_budget: int | None = 256, max_running: int = 32, scheduler: Decision = schedule_step,
                 sampler: SampleFn | None = None, max_model_len: int | None = None, clock: str = "wall",
                 prefix_caching: bool = True, attention: str = "auto", cuda_graphs: bool | None = None,
                 speculative: SpeculativeConfig | None = None, cpu_decode: str = "torch"):
        if not isinstance(model, Transformer):
            raise ValueError(f"model must be a labsupport.transformer.Transformer, got {type(model).__name__}")
        self.model = model
        self.block_size = positive_int("block_size", block_size)
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.token_budget = None if token_budget is None else positive_int("token_budget", token_budget)
        self.max_running = positive_int("max_running", max_running)
        capacity = self.num_blocks * self.block_size
        self.max_model_len = capacity if max_model_len is None else positive_int("max_model_len", max_model_len)
        if self.max_model_len > capacity:
            raise ValueError(f"max_model_len={self.max_model_len} is more than the cache holds "
                             f"({self.num_blocks} blocks of {self.block_size} = {capacity} tokens)")
        if not callable(scheduler) or (sampler is not None and not callable(sampler)):
            raise ValueError("scheduler and sampler must be functions (see labsupport.scheduler, labsupport.sampling)")
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a labsupport.engine.SpeculativeConfig or None, got "
                             f"{type(speculative).__name__}")
        if speculative is not None and sampler is not None:
            raise ValueError("speculative decoding verifies drafts with the engine's own sampler: leave sampler=None")
        self.speculative = speculative
        self.sampler = BatchedSampler() if sampler is None else PerRowSampler(sampler)
        self.clock = _Clock(clock)
        self.block_manager = BlockManager(self.num_blocks, self.block_size, prefix_caching)
        self.allocator = self.block_manager.allocator
        self.scheduler = Scheduler(self.block_manager, scheduler, self.token_budget, self.max_running, self.clock,
                                   self.max_model_len)
        self.runner = ModelRunner(model, self.block_manager, self.num_blocks, self.block_size, self.max_running,
                                  self.max_model_len, attention, cuda_graphs, cpu_decode=cpu_decode)
        self.requests: dict[Hashable, Request] = {}
        self.steps: list[StepRecord] = []  # a server trims it: the totals below are kept apart
        self.totals = {"steps": 0, "preemptions": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self._ids = itertools.count()

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def store(self):
        """The keys and values (:class:`~labsupport.paged_cache.PagedKVStore`)."""
        return self.runner.store

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, params: SamplingParams | None = None,
                    request_id: Hashable | None = None, arrival_s: float | None = None) -> Hashable:
        """Queue a request; returns its id. ``prompt_ids``: token ids (a list, or a 1-D tensor).
        ``arrival_s`` defaults to the clock's time now."""
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
                prompt_ids = prompt_ids[0]
            prompt_ids = prompt_ids.tolist()
        ids = [int(t) for t in prompt_ids]
        vocab = self.model.cfg.vocab_size
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_ids must be a non-empty list of token ids in [0, {vocab - 1}]")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        refused = self.sampler.refuses(params) if isinstance(self.sampler, PerRowSampler) else None
        if refused:
            raise ValueError(refused)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the engine holds at most {self.max_model_len} per "
                             f"sequence, prompt and output together")
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, self.clock.now() if arrival_s is None else float(arrival_s),
                      request_generator(params.seed, self.model.device))
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: Hashable) -> bool:
        """Cancel a queued or running request and free its blocks; False if it had already finished."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"no request {request_id!r}")
        if req.finished:
            return False
        self._retire(req, "abort")
        return True

    def release(self, request_id: Hashable) -> None:
        """Forget a request: drop ``requests[request_id]``, so a server running for days does not keep
        every request it served. One not yet finished is aborted first (its blocks go back to the
        allocator). Releasing an id twice, or one never added, does nothing."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.finished:
            self._retire(req, "abort")
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Counts for metrics: requests waiting and running, free blocks, steps, preemptions, and the
        prefix cache's queries and hits in prompt tokens (each admission counts, a readmission after
        preemption too) with their ratio, as vLLM reports ``prefix_cache_queries``/``_hits``."""
        return {"waiting": len(self.waiting), "running": len(self.running), "requests": len(self.requests),
                "num_blocks": self.num_blocks, "free_blocks": self.allocator.num_free_blocks,
                "cuda_graph_sizes": list(self.runner.graph_sizes), **self.block_manager.stats(), **self.totals}

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One iteration: schedule, run (one forward pass and the sampler), postprocess. Returns the
        tokens made. A request whose own sampling fails (its probabilities are not a distribution)
        finishes alone with reason ``"error"`` and the message in ``Request.error``; the others in the
        step keep their tokens. If the forward pass or the sampler itself raises, the step's requests
        finish with reason ``"error"``, the prefix cache is cleared, and the exception propagates; the
        other requests carry on at the next step."""
        started = time.perf_counter()
        if self.speculative is not None:
            self._propose()
        batch = self.scheduler.schedule()
        try:
            tokens = self.runner.run(batch.seqs, self.sampler, batch.copies) if batch.seqs else []
        except BaseException:
            self._fail_step(batch)
            raise
        return self._postprocess(batch, tokens, started)

    def stream(self) -> Iterator[TokenEvent]:
        """Step until every request has finished, yielding each token as it is made."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run ``prompts`` together to completion; returns each one's generated token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        for _ in self.stream():
            pass
        return [self.requests[i].output_ids for i in ids]

    # -- internals -------------------------------------------------------------------------------

    def _propose(self) -> None:
        """Draft tokens for every running request that is decoding (:mod:`.speculative`), while the
        blocks they need are free beyond those every running request's known tokens need: a draft
        never makes the scheduler preempt anyone."""
        spare = self.allocator.num_free_blocks - sum(self.block_manager.blocks_to_grow(r, 0) for r in self.running)
        k = self.speculative.num_speculative_tokens
        for req in self.running:
            req.draft_ids = []
            if not req.output_ids or req.num_computed != req.num_tokens - 1:
                continue  # still in its prompt
            room = draft_room(req.num_tokens, len(req.output_ids), req.params.max_tokens, self.max_model_len, k)
            draft = propose(req.all_ids, room, self.speculative)
            need = self.block_manager.blocks_to_grow(req, len(draft)) - self.block_manager.blocks_to_grow(req, 0)
            if draft and need <= spare:
                req.draft_ids, spare = draft, spare - need

    def _postprocess(self, batch: ScheduledBatch, tokens: list[list[int]], started: float) -> list[TokenEvent]:
        """The step's request state moves in the scheduler (:meth:`Scheduler.postprocess`: counts,
        rolled-back drafts, emitted tokens up to a stop, retirement); here the clock moves, the
        tokens become timestamped events, and the step is recorded."""
        decode, kv, pairs = _step_counts(batch)  # read before the requests' counts move
        done = self.scheduler.postprocess(batch, tokens)
        duration = time.perf_counter() - started
        self.clock.tick(duration)
        now = self.clock.now()
        events = []
        for req, reason in zip(done.sampled, done.reasons):
            made = len(req.output_ids) - len(req.token_times_s)  # this step's tokens (fewer than emitted at a stop)
            for j in range(made):
                index = len(req.token_times_s)
                req.token_times_s.append(now)
                events.append(TokenEvent(req.request_id, index, req.output_ids[index], now,
                                         reason if j == made - 1 else None))
        prefill = sum(n for _, n in batch.seqs) - decode - done.drafted
        for key, count in (("steps", 1), ("preemptions", batch.preempted), ("spec_draft_tokens", done.drafted),
                           ("spec_accepted_tokens", done.accepted)):
            self.totals[key] += count
        self.steps.append(StepRecord(len(self.steps), now, duration, len(batch.seqs), prefill, decode,
                                     batch.preempted, self.allocator.num_free_blocks, len(self.waiting), kv, pairs,
                                     len(done.sampled), done.drafted, done.accepted))
        return events

    def _fail_step(self, batch: ScheduledBatch) -> None:
        """The forward pass or the sampler raised. The step's requests end with finish reason
        ``"error"`` (their blocks go back; the cache slots the step gave them were never filled
        for sure, so they cannot simply run again), and the prefix cache forgets every hash: a block
        that filled in this step was made findable when its slots were handed out, before any
        layer wrote its keys and values, and a later request with the same prefix (a client's
        retry) would otherwise read whatever the block held."""
        for req, _ in batch.seqs:
            if not req.finished:
                self._retire(req, "error")
        self.allocator.reset_prefix_cache()

    def _retire(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.scheduler.finish(req)


def _step_counts(batch: ScheduledBatch) -> tuple[int, int, int]:
    """A step's decode tokens (one per plain decode; a verified draft counts apart), the cache tokens
    its attention read (each sequence's length after it) and the query-key pairs it scored (causal:
    a token sees itself and earlier), read before the step moves the requests' counts."""
    decode = kv = pairs = 0
    for req, n in batch.seqs:
        d = len(req.draft_ids)
        decode += bool(req.output_ids) and n == 1 + d and req.num_computed == req.num_tokens - 1
        pairs += n * req.num_computed + n * (n + 1) // 2
        kv += req.num_computed + n
    return decode, kv, pairs
