"""Which requests run in the next step, and how many tokens each (nano-vllm's ``Scheduler``).

The decision itself is pluggable: any function with the interface of
:func:`labsupport.scheduler.schedule_step` (chapter 13's rule, lab 13's exercise) or
:func:`~labsupport.scheduler.static_batch_step`. This class turns the engine's requests into the
:class:`~labsupport.scheduler.SeqView` rows such a function reads, checks its answer
(:func:`~labsupport.scheduler.check_decision`), and carries it out: preempted requests give their
blocks back and go to the front of the queue, admitted ones move to the running list, and every
scheduled request gets the cache slots of the tokens it will compute. After the model ran,
:meth:`Scheduler.postprocess` moves the requests on (as nano-vllm's does): computed counts, rejected
drafts rolled back, emitted tokens appended up to a stop, finished requests retired.

**A long queue costs a step nothing.** The waiting requests reach the decision as
:class:`WaitingViews`: a request's view, and its prefix-cache look-up, are built only when the
decision reads it, and :func:`~labsupport.scheduler.check_decision` looks up only the ids a decision
names. ``schedule_step`` stops at the first waiting request that does not fit, so a step's host
work does not grow with the queue (``bench_engine`` measures it). A decision plugged in from
elsewhere (lab 13's) gets the queue as a plain list, as before: its code may treat it as one.

**Prefix hits.** A waiting request is shown with ``num_computed`` set to the tokens the prefix cache
already holds for it (:meth:`BlockManager.cached_prefix`), so a decision gives it only the rest to
compute; its ``num_blocks`` stays 0, so a decision counts the cached blocks among those it needs
(an overestimate: they cost no free block when another request holds them, or one evictable block
when none does). Cached blocks are claimed for every admitted request before any new block is
taken in the step, so no allocation of the step can evict a prefix a decision counted on.

**Preempting a request that shares blocks.** A decision counts a preempted request's
``num_blocks`` as given back, but with prefix caching some of them may be shared with requests
that keep running: those stay referenced and free nothing. So after carrying out a decision's
preemptions the scheduler checks that the blocks its scheduled requests need are really free;
when they are not, it asks the decision again, on the counts as they now are and with no waiting
request (a step that preempts admits nobody, as in :func:`~labsupport.scheduler.schedule_step`),
until a decision fits. Each round preempts at least one more request, so this ends. vLLM's and
nano-vllm's schedulers avoid the miscount by asking the block pool itself, one allocation at a time.

**Drafts.** With speculative decoding (:mod:`.speculative`) a running request's draft tokens count
as tokens still to compute: a decision sees ``num_tokens`` with the draft included and gives the
request up to ``1 + len(draft)`` tokens; what it gives less cuts the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..scheduler import SeqView, blocks_for, check_decision, schedule_step, static_batch_step
from .block_manager import BlockManager
from .sampler import RowSamplingError
from .sequence import Request

Decision = Callable[..., tuple[dict, list]]
LAZY_DECISIONS = (schedule_step, static_batch_step)  # read the waiting queue only as a Sequence, in order


@dataclass
class StepDone:
    """What a step did to its requests (:meth:`Scheduler.postprocess`): those that sampled, in batch
    order, each one's finish reason (None while it runs on), and the draft tokens verified and accepted."""

    sampled: list[Request]
    reasons: list[str | None]
    drafted: int
    accepted: int


@dataclass
class ScheduledBatch:
    """One step's work: each request with its token count, in the decision's order."""

    seqs: list[tuple[Request, int]]
    preempted: int
    copies: list[tuple[int, int]]  # copy-on-write copies to make before the step writes


class WaitingViews(Sequence):
    """The waiting queue as a step decision reads it: each request's :class:`SeqView`, its prefix-cache
    look-up included, is built only when the decision reads it (by position, or by id through
    :meth:`view_of`, as :func:`~labsupport.scheduler.check_decision` asks). A decision that stops at
    the first request that does not fit (first come, first served, as ``schedule_step``) then costs
    the same whatever the queue's length. It reads the queue as it was when it was made."""

    def __init__(self, requests: Sequence[Request], block_manager: BlockManager):
        self.requests = list(requests)  # a snapshot: preemptions put requests back in the queue meanwhile
        self.block_manager = block_manager
        self._views: dict[int, SeqView] = {}
        self._index: dict | None = None  # request id -> position, built the first time an id is asked

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self.requests))[i]  # negative indices; IndexError past the end (ends iteration)
        view = self._views.get(i)
        if view is None:
            r = self.requests[i]
            view = self._views[i] = SeqView(r.request_id, r.num_tokens, self.block_manager.cached_prefix(r), 0)
        return view

    def _position(self, request_id) -> int | None:
        if self._index is None:
            self._index = {r.request_id: i for i, r in enumerate(self.requests)}
        return self._index.get(request_id)

    def view_of(self, request_id) -> SeqView | None:
        """The view of the waiting request ``request_id``, or None when none waits with that id."""
        i = self._position(request_id)
        return None if i is None else self[i]

    def request_of(self, request_id) -> Request:
        return self.requests[self._position(request_id)]


class Scheduler:
    """Waiting and running queues, and the step decision applied to them (module docstring)."""

    def __init__(self, block_manager: BlockManager, decide: Decision, token_budget: int | None, max_running: int,
                 clock, max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len  # a request whose sequence reaches it stops (None: no limit)
        self.decide = decide
        self.token_budget, self.max_running = token_budget, max_running
        self.clock = clock
        self.waiting: list[Request] = []  # in admission order: preempted ones at the front
        self.running: list[Request] = []  # oldest admitted first

    def add(self, req: Request) -> None:
        """Queue a new request; its prompt's blocks are hashed now, once (prefix caching)."""
        self.block_manager.hash_blocks(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Decide the step, check the decision, preempt, admit and allocate; return the work."""
        bm = self.block_manager
        queue = WaitingViews(self.waiting, bm)
        waiting = queue if self.decide in LAZY_DECISIONS else list(queue)  # another decision gets a plain list
        preempted_all: list = []
        while True:
            running = [SeqView(r.request_id, r.num_tokens + len(r.draft_ids), r.num_computed,
                               bm.num_blocks_of(r.request_id)) for r in self.running]  # a draft is work to do
            args = (running, waiting, self.token_budget, bm.num_free_blocks, bm.block_size, self.max_running)
            scheduled, preempted = check_decision(self.decide(*args), *args)
            views = {v.request_id: v for v in running}
            by_id = {r.request_id: r for r in self.running}
            for rid in preempted:  # the newest first: each goes back to the front of the queue
                self._preempt(by_id[rid])
            preempted_all += preempted
            for rid in scheduled:  # admitted from the queue
                if rid not in views:
                    views[rid], by_id[rid] = queue.view_of(rid), queue.request_of(rid)
            need = sum(blocks_for(views[rid].num_computed + n, bm.block_size) - views[rid].num_blocks
                       for rid, n in scheduled.items())
            if need <= bm.num_free_blocks:  # always so unless a preempted request shared blocks
                break
            waiting = []  # decide again on the real counts (module docstring)
        if not scheduled and not preempted_all and self.has_unfinished():
            raise RuntimeError(f"the scheduler ran nothing although {len(self.running)} sequences run and "
                               f"{len(self.waiting)} wait, with {bm.num_free_blocks} free blocks: the engine "
                               f"would loop forever")
        batch = [(by_id[rid], n) for rid, n in scheduled.items()]
        for req in self.running:  # a draft the decision cut short keeps what fits; an unscheduled one goes
            given = scheduled.get(req.request_id, 0)
            req.draft_ids = req.draft_ids[:max(0, given - (req.num_tokens - req.num_computed))]
        for req, _ in batch:  # admitted: claim its cached prefix before any block is taken
            if req in self.waiting:
                self._admit(req, queue.view_of(req.request_id).num_computed)
        copies = [c for req, n in batch for c in bm.append(req, req.num_computed, n)]
        return ScheduledBatch(batch, len(preempted_all), copies)

    def postprocess(self, batch: ScheduledBatch, tokens: list[list[int]]) -> StepDone:
        """Move the step's requests on once the model ran (nano-vllm's ``Scheduler.postprocess``):
        each computed what it was given; those that sampled roll back their rejected draft tokens
        (``num_computed`` moves back, their slots go back to the allocator; the next step overwrites
        them) and append the tokens they emitted, ``tokens[i]`` for the ``i``-th to sample, up to the
        first that stops them (:meth:`stop_reason`); those that stopped are retired."""
        sampled = [req for req, n in batch.seqs if req.samples_after(n)]  # before the counts move
        for req, n in batch.seqs:
            req.num_computed += n
            req.steps_run += 1
        reasons, drafted, accepted = [], 0, 0
        for req, emitted in zip(sampled, tokens):
            if isinstance(emitted, RowSamplingError):  # its own sampling failed: it ends alone, with no token
                req.draft_ids, req.error, req.finish_reason = [], str(emitted), "error"
                reasons.append("error")
                self.finish(req)
                continue
            d, a = len(req.draft_ids), len(emitted) - 1  # drafted, accepted
            if d > a:
                req.num_computed -= d - a
                self.block_manager.truncate(req, req.num_computed)
            drafted, accepted = drafted + d, accepted + a
            req.draft_tokens, req.accepted_tokens = req.draft_tokens + d, req.accepted_tokens + a
            req.draft_ids = []
            reason = None
            for token in emitted:  # up to the first that stops it
                req.output_ids.append(token)
                reason = self.stop_reason(req)
                if reason:
                    break
            reasons.append(reason)
            if reason:
                req.finish_reason = reason
                self.finish(req)
        return StepDone(sampled, reasons, drafted, accepted)

    def stop_reason(self, req: Request) -> str | None:
        """``"stop"`` after a stop token, ``"length"`` at ``max_tokens`` or ``max_model_len``, else None."""
        p = req.params
        if req.output_ids[-1] in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or (self.max_model_len is not None
                                                   and req.num_tokens >= self.max_model_len):
            return "length"
        return None

    def finish(self, req: Request) -> None:
        """Take a finished (or aborted) request out of the queues; its blocks go back."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed = 0
        req.draft_ids = []
        req.preemptions += 1
        self.waiting.insert(0, req)

    def _admit(self, req: Request, cached: int) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        self.block_manager.admit(req, cached)
        req.num_computed = cached
        if req.first_scheduled_s is None:
            req.first_scheduled_s = self.clock.now()
