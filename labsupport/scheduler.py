"""The scheduler's step decision: which sequences run in the next forward pass, and how many tokens.

Chapter 13 explains it. The engine (:mod:`labsupport.engine`) asks the scheduler once per step.
Like vLLM's V1 scheduler, it does not separate "prefill" from "decode": every sequence has
``num_tokens`` tokens known so far (its prompt plus what it has generated) of which
``num_computed`` have their keys and values in the cache. A sequence in prefill has many tokens
left to compute; a decoding sequence has exactly one (the token it sampled last step).
Running ``n`` of its tokens needs ``blocks_needed(num_computed + n) - num_blocks`` new blocks.

**The rule** (:func:`schedule_step`, the course's answer to lab 13's exercise 2):

1. Running sequences first, oldest first. Each gets ``min(left, budget left)`` tokens, where
   ``left = num_tokens - num_computed``: a decode gets 1, an unfinished prefill its next chunk.
   When the budget is spent, the remaining running sequences wait for the next step.
2. If a running sequence needs blocks and too few are free, the *newest* running sequence is
   preempted (recompute, as vLLM does by default): it gives back all its blocks and goes to the
   front of the waiting queue. This repeats until the blocks suffice; if the sequence that needs
   them is itself the newest, it is the one preempted.
3. Then, if nothing was preempted this step, waiting sequences are admitted in arrival order
   (first come, first served), each with ``min(left, budget left)`` tokens (a chunk of its
   prompt when the budget is short: chunked prefill), while the budget lasts, fewer than
   ``max_running`` sequences run, and the blocks it needs are free. The first waiting sequence
   that does not fit stops admission: no later, smaller request jumps ahead of it, so a long
   prompt is never starved by a stream of short ones.

The decision is ``(scheduled, preempted)``: ``scheduled`` maps each sequence that runs to its
number of tokens (running ones first, in order, then admitted ones), ``preempted`` lists the ids
preempted this step, in the order they were preempted.

:func:`static_batch_step` is the decision of static batching, for comparison: a new batch is
formed only when the previous one has entirely finished, and every prompt runs whole.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ._answers import answer

__all__ = ["SeqView", "blocks_for", "schedule_step", "static_batch_step", "check_decision", "TraceItem", "SimStep",
           "simulate"]


@dataclass(frozen=True)
class SeqView:
    """What the scheduler sees of one sequence.

    ``num_tokens``: prompt plus generated tokens known so far. ``num_computed``: how many of them
    have keys and values in the cache (0 for a sequence that has never run or was preempted).
    ``num_blocks``: cache blocks it holds now (``ceil(num_computed / block_size)``).
    """

    request_id: Hashable
    num_tokens: int
    num_computed: int = 0
    num_blocks: int = 0

    @property
    def left(self) -> int:
        """Tokens still to compute before the sequence can sample its next token."""
        return self.num_tokens - self.num_computed


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


@answer
def schedule_step(running: Sequence[SeqView], waiting: Sequence[SeqView], token_budget: int,
                  free_blocks: int, block_size: int, max_running: int) -> tuple[dict, list]:
    """One step's decision (module docstring): returns ``(scheduled, preempted)``.

    ``running``: the running sequences, oldest admitted first. ``waiting``: the waiting ones, in
    the order they should be admitted (arrival order, preempted ones at the front).
    ``token_budget``: the most tokens the step may run. ``free_blocks``: cache blocks free now.
    ``max_running``: the most sequences that may run at once.
    """
    scheduled: dict = {}
    preempted: list = []
    budget, free = token_budget, free_blocks
    queue = list(running)  # those still candidates this step; the newest is last
    while queue and budget > 0:
        seq = queue.pop(0)
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free and queue:
            victim = queue.pop()  # the newest running sequence gives back its blocks
            free += victim.num_blocks
            preempted.append(victim.request_id)
        if need > free:  # it is itself the newest: preempt it
            free += seq.num_blocks
            preempted.append(seq.request_id)
            break
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
    if preempted:
        return scheduled, preempted
    n_running = len(running)
    for seq in waiting:
        if budget <= 0 or n_running >= max_running:
            break
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        if need > free:
            break  # first come, first served: nobody overtakes it
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
        n_running += 1
    return scheduled, preempted


def static_batch_step(running: Sequence[SeqView], waiting: Sequence[SeqView], token_budget: int,
                      free_blocks: int, block_size: int, max_running: int) -> tuple[dict, list]:
    """Static batching, with :func:`schedule_step`'s interface: while any sequence of the current
    batch runs, only the batch runs (each its whole remaining work, so a prompt in one pass and
    then one token per step); a new batch of up to ``max_running`` waiting sequences (whole
    prompts, ignoring ``token_budget``) starts only when the old one has finished. Sequences that
    finish early leave their slots empty until the whole batch is done."""
    if running:
        return {s.request_id: s.left for s in running}, []
    scheduled, free = {}, free_blocks
    for seq in waiting[:max_running]:
        need = blocks_for(seq.num_tokens, block_size) - seq.num_blocks
        if need > free:
            break
        scheduled[seq.request_id] = seq.left
        free -= need
    return scheduled, []


def check_decision(decision, running: Sequence[SeqView], waiting: Sequence[SeqView], token_budget: int | None,
                   free_blocks: int, block_size: int, max_running: int) -> tuple[dict, list]:
    """Validate a scheduler's ``(scheduled, preempted)`` against the state it was given; return it
    as a plain ``(dict, list)``. Raises ValueError saying what is impossible: an unknown id, a
    sequence both run and preempted, a token count outside ``1..left``, more sequences than
    ``max_running``, more tokens than ``token_budget`` (None: no budget), more blocks than are free
    (after the preempted ones gave theirs back)."""
    if not (isinstance(decision, tuple) and len(decision) == 2):
        raise ValueError(f"a scheduler returns (scheduled, preempted): a dict and a list; got {decision!r:.200}")
    scheduled, preempted = decision
    if not isinstance(scheduled, dict) or not isinstance(preempted, (list, tuple)):
        raise ValueError("a scheduler returns (scheduled, preempted): a dict {request_id: tokens} and a list of ids")
    scheduled, preempted = dict(scheduled), list(preempted)
    by_id = {s.request_id: s for s in running}
    waiting_view = getattr(waiting, "view_of", None)  # the engine's queue builds a view only when it is named
    if waiting_view is None:
        by_id |= {s.request_id: s for s in waiting}
    running_ids = {s.request_id for s in running}
    for rid in preempted:
        if rid not in running_ids:
            raise ValueError(f"preempted {rid!r}, which is not running")
    if len(set(preempted)) != len(preempted):
        raise ValueError("a sequence was preempted twice")
    freed = sum(by_id[rid].num_blocks for rid in preempted)
    need = 0
    for rid, n in scheduled.items():
        seq = by_id.get(rid) if waiting_view is None or rid in by_id else waiting_view(rid)
        if seq is None:
            raise ValueError(f"scheduled {rid!r}, which is neither running nor waiting")
        if rid in preempted:
            raise ValueError(f"{rid!r} is both scheduled and preempted")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= seq.left:
            raise ValueError(f"{rid!r} is given {n!r} tokens; it has {seq.left} left to compute (give 1 to {seq.left})")
        need += blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
    total = sum(scheduled.values())
    if token_budget is not None and total > token_budget:
        raise ValueError(f"the step runs {total} tokens, over the budget of {token_budget}")
    still_running = len(running_ids) - len(preempted) + sum(1 for rid in scheduled if rid not in running_ids)
    if still_running > max_running:
        raise ValueError(f"{still_running} sequences would run, more than max_running={max_running}")
    if need > free_blocks + freed:
        raise ValueError(f"the step needs {need} new blocks; only {free_blocks + freed} are free "
                         f"({free_blocks} plus {freed} from preempted sequences)")
    return scheduled, preempted


# --- a model-free simulation, for traces -------------------------------------------------------


@dataclass(frozen=True)
class TraceItem:
    """A request of a scheduling trace: the step it arrives at, its prompt length and how many
    tokens it generates."""

    arrival_step: int
    prompt_len: int
    output_len: int


@dataclass
class _SimSeq:
    request_id: int
    prompt_len: int
    output_len: int
    arrival_step: int
    generated: int = 0
    num_computed: int = 0
    first_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    def view(self, block_size: int) -> SeqView:
        return SeqView(self.request_id, self.num_tokens, self.num_computed, blocks_for(self.num_computed, block_size))


@dataclass(frozen=True)
class SimStep:
    """One simulated step: the state the scheduler saw and what it decided."""

    step: int
    running: tuple[SeqView, ...]
    waiting: tuple[SeqView, ...]
    free_blocks: int
    scheduled: dict
    preempted: list


def simulate(decide: Callable, trace: Sequence[TraceItem], *, token_budget: int | None, num_blocks: int,
             block_size: int, max_running: int, max_steps: int = 10_000,
             observe: Callable[[SimStep], None] | None = None) -> dict:
    """Run a scheduler on a trace without a model: each step it decides, the decision is validated
    (:func:`check_decision`), scheduled sequences advance, a sequence that has computed all its
    known tokens generates one more, finished ones free their blocks, preempted ones lose theirs
    and go to the front of the queue. ``decide`` has :func:`schedule_step`'s interface;
    ``observe(step)`` sees every step (the lab's check tests invariants there). Returns
    ``{"steps": number of steps, "requests": [{"arrival", "first", "first_token", "finish",
    "preemptions"}, ...]}``: the step it arrived at, first ran, made its first token, made its last
    token, and how often it was preempted (in trace order). A token made in step ``s`` is out at
    the end of that step, so the time to first token in steps is ``first_token - arrival + 1``. Raises RuntimeError when nothing finishes within ``max_steps``."""
    seqs = [_SimSeq(i, t.prompt_len, t.output_len, t.arrival_step) for i, t in enumerate(trace)]
    pending = sorted(seqs, key=lambda s: (s.arrival_step, s.request_id))
    running: list[_SimSeq] = []
    waiting: list[_SimSeq] = []
    for step in range(max_steps):
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.pop(0))
        if not running and not waiting:
            if not pending:
                return {"steps": step, "requests": [
                    {"arrival": s.arrival_step, "first": s.first_step, "first_token": s.first_token_step,
                     "finish": s.finish_step,
                     "preemptions": s.preemptions} for s in seqs]}
            continue
        used = sum(blocks_for(s.num_computed, block_size) for s in running)
        free = num_blocks - used
        rv = tuple(s.view(block_size) for s in running)
        wv = tuple(s.view(block_size) for s in waiting)
        decision = decide(list(rv), list(wv), token_budget, free, block_size, max_running)
        scheduled, preempted = check_decision(decision, rv, wv, token_budget, free, block_size, max_running)
        if observe is not None:
            observe(SimStep(step, rv, wv, free, scheduled, preempted))
        by_id = {s.request_id: s for s in running + waiting}
        for rid in preempted:
            s = by_id[rid]
            running.remove(s)
            s.num_computed = 0
            s.preemptions += 1
            waiting.insert(0, s)
        for rid, n in scheduled.items():
            s = by_id[rid]
            if s in waiting:
                waiting.remove(s)
                running.append(s)
            if s.first_step is None:
                s.first_step = step
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.generated += 1
                if s.first_token_step is None:
                    s.first_token_step = step
                if s.generated == s.output_len:
                    s.finish_step = step
                    running.remove(s)
    raise RuntimeError(f"the trace did not finish in {max_steps} steps: some request never completes")
