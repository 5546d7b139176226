"""A small serving engine: continuous batching over a paged KV cache (chapter 13).

Every engine people deploy runs the same loop, one iteration per forward pass:

1. **schedule**: the scheduler (:mod:`labsupport.scheduler`) picks which sequences run and how
   many tokens each, under a per-step token budget, the free cache blocks and ``max_running``;
2. **run** one forward pass over all of them at once: prefill chunks and decode tokens are laid
   end to end in one flat batch, every linear layer reads its weights once for all of them, and
   each sequence's attention reads its own keys and values from the paged cache;
3. **sample** a token for every sequence whose known tokens are now all computed;
4. **append** it, **stream** it out with a timestamp, and **retire** the sequences that stopped,
   whose blocks go back to the allocator.

Requests can arrive before any step (:meth:`Engine.add_request`). The keys and values live in
chapter 10's paged cache: :class:`~labsupport.paged_cache.BlockAllocator` keeps the block tables
and :class:`~labsupport.paged_cache.PagedKVStore` the tensors. When blocks run out the scheduler
preempts the newest sequence, which gives back its blocks and later recomputes its prompt and the
tokens it had generated (recompute preemption).

The invariant the tests check: with greedy sampling, every request gets exactly the tokens
``Transformer.generate`` gives it alone (fp32, CPU), whatever shares its batches, however its
prompt is chunked and however often it is preempted.

**Interface for a server** (chapter 12 puts the engine behind the course server): call
:meth:`Engine.add_request` (returns the request id), call :meth:`Engine.step` in a loop (in a
worker thread): it returns the :class:`TokenEvent` of every token made in that step, each with its
request id, index, time and finish reason; :meth:`Engine.abort` cancels a request, queued or
running. :meth:`Engine.stream` is the same loop as a Python generator.

**Clocks.** Timestamps come from the engine's clock: ``"wall"`` (``time.perf_counter``),
``"virtual"`` (starts at 0 and advances by each step's measured duration; a trace driver jumps it
forward over idle gaps, so replaying a trace never sleeps) or ``"steps"`` (one unit per step:
machine-independent, for figures that must not depend on the CPU).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ._validate import positive_int
from .latency import latency_metrics, summarize
from .paged_attention import gather_contiguous
from .paged_cache import BlockAllocator, PagedKVStore
from .sampling import SamplingParams, request_generator, sample
from .scheduler import SeqView, check_decision, schedule_step
from .transformer import Transformer, apply_rope, rope_cos_sin, sdpa_attention

__all__ = ["Engine", "Request", "TokenEvent", "StepRecord", "TraceRequest", "run_trace", "trace_summary",
           "poisson_trace"]

CLOCKS = ("wall", "virtual", "steps")


@dataclass
class Request:
    """One request's state and history inside the engine."""

    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    token_times_s: list[float] = field(default_factory=list)
    first_scheduled_s: float | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    preemptions: int = 0
    steps_run: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict | None:
        """Chapter 03's TTFT, TPOT, ITL and E2E of this request (None before its first token)."""
        if not self.token_times_s:
            return None
        return latency_metrics(self.arrival_s, self.token_times_s)


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


Scheduler = Callable[..., tuple[dict, list]]
Sampler = Callable[..., torch.Tensor]


class Engine:
    """Continuous batching with chunked prefill on a paged cache, for the course model.

    ``Engine(model, num_blocks=256, block_size=16, token_budget=256, max_running=32)``: the cache
    holds ``num_blocks * block_size`` token positions; one step runs at most ``token_budget``
    tokens and ``max_running`` sequences. ``scheduler`` is a step decision with the interface of
    :func:`labsupport.scheduler.schedule_step` (lab 13 plugs a learner's in, or
    :func:`~labsupport.scheduler.static_batch_step`, for which ``token_budget=None``);
    ``sampler`` one with the interface of :func:`labsupport.sampling.sample`. ``max_model_len``
    (default: what the cache holds) stops a request whose sequence reaches it.
    """

    def __init__(self, model: Transformer, *, num_blocks: int = 256, block_size: int = 16,
                 token_budget: int | None = 256, max_running: int = 32, scheduler: Scheduler = schedule_step,
                 sampler: Sampler = sample, max_model_len: int | None = None, clock: str = "wall"):
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
        if not callable(scheduler) or not callable(sampler):
            raise ValueError("scheduler and sampler must be functions (see labsupport.scheduler, labsupport.sampling)")
        self.scheduler, self.sampler = scheduler, sampler
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
        self.store = PagedKVStore(model.cfg, self.num_blocks, self.block_size, device=model.device, dtype=model.dtype)
        self.clock = _Clock(clock)
        self.waiting: list[Request] = []  # in admission order: preempted ones at the front
        self.running: list[Request] = []  # oldest admitted first
        self.requests: dict[Hashable, Request] = {}
        self.steps: list[StepRecord] = []
        self._ids = itertools.count()

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
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the engine holds at most {self.max_model_len} per "
                             f"sequence, prompt and output together")
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, self.clock.now() if arrival_s is None else float(arrival_s),
                      request_generator(params.seed, self.model.device))
        self.requests[rid] = req
        self.waiting.append(req)
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
        """Forget a request: drop ``requests[request_id]``, so a server running for days does not
        keep every request it served. One not yet finished is aborted first (its blocks go back to
        the allocator). Releasing an id twice, or one never added, does nothing."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.finished:
            self._retire(req, "abort")
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One iteration: schedule, one forward pass, sample, append, retire. Returns the tokens made."""
        started = time.perf_counter()
        running_views = [self._view(r) for r in self.running]
        waiting_views = [self._view(r) for r in self.waiting]
        free = self.allocator.num_free_blocks
        args = (running_views, waiting_views, self.token_budget, free, self.block_size, self.max_running)
        scheduled, preempted = check_decision(self.scheduler(*args), *args)
        if not scheduled and not preempted and self.has_unfinished():
            raise RuntimeError(f"the scheduler ran nothing although {len(self.running)} sequences run and "
                               f"{len(self.waiting)} wait, with {free} free blocks: the engine would loop forever")

        for rid in preempted:  # the newest first: each goes back to the front of the queue
            req = self.requests[rid]
            self.running.remove(req)
            self.allocator.free(rid)
            req.num_computed = 0
            req.preemptions += 1
            self.waiting.insert(0, req)
        for rid in scheduled:  # admitted: from the queue to the end of the running list
            req = self.requests[rid]
            if req in self.waiting:
                self.waiting.remove(req)
                self.running.append(req)
                if req.first_scheduled_s is None:
                    req.first_scheduled_s = self.clock.now()

        batch = [(self.requests[rid], n) for rid, n in scheduled.items()]
        for req, n in batch:
            if req.request_id in self.allocator.sequences():
                for _ in range(n):
                    self.allocator.append_token(req.request_id)
            else:
                self.allocator.allocate(req.request_id, n)
        logits = self._forward(batch) if batch else None  # (len(batch), V): each sequence's last position

        # a decode token: the one token a sequence sampled last step (everything before it is cached)
        decode = sum(1 for req, n in batch if req.output_ids and n == 1 and req.num_computed == req.num_tokens - 1)
        events, done = [], []
        sampled = []
        for i, (req, n) in enumerate(batch):
            req.num_computed += n
            req.steps_run += 1
            if req.num_computed == req.num_tokens:  # all known tokens computed: sample the next one
                sampled.append((i, req))
        for i, req in sampled:
            p = req.params
            token = int(self.sampler(logits[i:i + 1], p.temperature, p.top_k, p.top_p, generator=req.generator)[0])
            req.output_ids.append(token)
            reason = None
            if token in p.stop_token_ids:
                reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                done.append((req, reason))
            events.append((req, token, reason))
        duration = time.perf_counter() - started
        self.clock.tick(duration)
        now = self.clock.now()
        out = []
        for req, token, reason in events:
            req.token_times_s.append(now)
            out.append(TokenEvent(req.request_id, len(req.output_ids) - 1, token, now, reason))
        for req, reason in done:
            self._retire(req, reason)
        prefill = sum(n for _, n in batch) - decode
        self.steps.append(StepRecord(len(self.steps), now, duration, len(batch), prefill, decode, len(preempted),
                                     self.allocator.num_free_blocks, len(self.waiting)))
        return out

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

    def _view(self, req: Request) -> SeqView:
        blocks = len(self.allocator.block_table(req.request_id)) if req.request_id in self.allocator.sequences() else 0
        return SeqView(req.request_id, req.num_tokens, req.num_computed, blocks)

    def _retire(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self.allocator.sequences():
            self.allocator.free(req.request_id)

    @torch.no_grad()
    def _forward(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        """One forward pass over every scheduled token, laid end to end: (len(batch), V) logits,
        one row per sequence, at its last scheduled position."""
        model, cfg, store = self.model, self.model.cfg, self.store
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // Hkv
        dev = model.device
        tokens, positions, blocks, offsets, spans = [], [], [], [], []
        for req, n in batch:
            start = req.num_computed
            ids = req.all_ids[start:start + n]
            table = self.allocator.block_table(req.request_id)
            pos = list(range(start, start + n))
            tokens += ids
            positions += pos
            blocks += [table[p // self.block_size] for p in pos]
            offsets += [p % self.block_size for p in pos]
            spans.append((len(tokens) - n, len(tokens), start + n, table))
        N = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)[None]  # (1, N)
        pos = torch.tensor(positions, device=dev)  # (N,)
        blk = torch.tensor(blocks, dtype=torch.long, device=dev)
        off = torch.tensor(offsets, dtype=torch.long, device=dev)
        cos, sin = rope_cos_sin(pos, D, model.dtype, cfg.rope_theta, cfg.rope_scaling)  # (N, D) each
        x = model.tok_embeddings(tok)  # (1, N, d)
        for li, layer in enumerate(model.layers):
            att = layer.attention
            h = layer.attention_norm(x)
            q = att.wq(h).view(1, N, H, D).transpose(1, 2)  # (1, H, N, D)
            k = att.wk(h).view(1, N, Hkv, D).transpose(1, 2)  # (1, Hkv, N, D)
            v = att.wv(h).view(1, N, Hkv, D).transpose(1, 2)
            if att.q_norm is not None:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            store.k[li, blk, off] = k[0].transpose(0, 1)  # (N, Hkv, D) into their slots
            store.v[li, blk, off] = v[0].transpose(0, 1)
            outs = []
            for a, b, length, table in spans:
                tables = torch.tensor([table], dtype=torch.long, device=dev)
                kk = gather_contiguous(store.k[li], tables, length, 0).transpose(0, 1)[None]  # (1, Hkv, T, D)
                vv = gather_contiguous(store.v[li], tables, length, 0).transpose(0, 1)[None]
                if G > 1:
                    kk, vv = kk.repeat_interleave(G, dim=1), vv.repeat_interleave(G, dim=1)  # (1, H, T, D)
                outs.append(sdpa_attention(q[:, :, a:b], kk, vv, b - a > 1))  # (1, H, n, D)
            out = torch.cat(outs, dim=2).transpose(1, 2).reshape(1, N, H * D)  # (1, N, H*D)
            x = x + att.wo(out)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        last = torch.tensor([b - 1 for _, b, _, _ in spans], device=dev)
        xs = model.norm(x[0, last])  # (len(batch), d)
        head = model.tok_embeddings.weight if model.output is None else model.output.weight  # (V, d)
        return (xs @ head.T).float()  # (len(batch), V)


# --- traces -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """A request of a trace: when it arrives (seconds, or steps with ``clock="steps"``), its
    prompt and how it is sampled."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def poisson_trace(n: int, rate: float, prompt_lens: Sequence[int], output_lens: Sequence[int], vocab_size: int,
                  seed: int = 0, temperature: float = 0.0) -> list[TraceRequest]:
    """``n`` requests with exponential gaps between arrivals (a Poisson process at ``rate`` per
    unit of time), prompt and output lengths drawn uniformly from the lists given, random prompt
    tokens; all seeded."""
    gen = torch.Generator().manual_seed(seed)
    t, out = 0.0, []
    for i in range(positive_int("n", n)):
        t += float(torch.empty(1).exponential_(rate, generator=gen)) if rate > 0 else 0.0
        p = prompt_lens[int(torch.randint(len(prompt_lens), (1,), generator=gen))]
        o = output_lens[int(torch.randint(len(output_lens), (1,), generator=gen))]
        prompt = tuple(torch.randint(0, vocab_size, (p,), generator=gen).tolist())
        out.append(TraceRequest(t, prompt, SamplingParams(temperature=temperature, max_tokens=o, seed=seed + i)))
    return out


def run_trace(engine: Engine, trace: Sequence[TraceRequest], max_steps: int = 100_000) -> list[Request]:
    """Replay ``trace`` through ``engine`` (clock ``"virtual"`` or ``"steps"``): each request is
    added once the clock reaches its arrival; when nothing runs, the clock jumps to the next
    arrival. Returns the requests in trace order, finished."""
    if engine.clock.kind == "wall":
        raise ValueError("run_trace needs an engine with clock='virtual' or clock='steps'")
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    ids: dict[int, Hashable] = {}
    for _ in range(max_steps):
        while pending and trace[pending[0]].arrival_s <= engine.clock.now():
            i = pending.pop(0)
            ids[i] = engine.add_request(list(trace[i].prompt_ids), trace[i].params, arrival_s=trace[i].arrival_s)
        if not engine.has_unfinished():
            if not pending:
                return [engine.requests[ids[i]] for i in range(len(trace))]
            engine.clock.advance_to(trace[pending[0]].arrival_s)
            continue
        engine.step()
    raise RuntimeError(f"the trace did not finish in {max_steps} steps")


def trace_summary(requests: Sequence[Request]) -> dict:
    """Throughput and latency of a replayed trace: output tokens per unit of time from the first
    arrival to the last token, and TTFT, TPOT and E2E summaries (nearest-rank percentiles,
    :func:`labsupport.latency.summarize`) over the requests. TPOT leaves out one-token requests."""
    metrics = [r.metrics() for r in requests]
    if any(m is None for m in metrics):
        raise ValueError("every request must have finished with at least one token")
    start = min(r.arrival_s for r in requests)
    end = max(r.token_times_s[-1] for r in requests)
    tokens = sum(len(r.output_ids) for r in requests)
    tpots = [m["tpot"] for m in metrics if m["tpot"] is not None]
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "makespan": end - start,
        "throughput": tokens / (end - start) if end > start else float("inf"),
        "ttft": summarize([m["ttft"] for m in metrics]),
        "tpot": summarize(tpots) if tpots else None,
        "e2e": summarize([m["e2e"] for m in metrics]),
        "preemptions": sum(r.preemptions for r in requests),
    }
