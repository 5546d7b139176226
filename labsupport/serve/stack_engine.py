"""The engine-side slots of a learner's stack (issue 31; chapters 10 and 13), plugged in by
:func:`labsupport.serve.stack.plug_in`:

* ``block_allocator`` (lab 10's ``BlockAllocator``) **serves** as the engine's block pool behind
  :class:`LearnerBlockPool`, with prefix caching off: lab 10's interface knows token counts, not
  token ids, so no block can be found by its prefix. Step-wide: a method of it that raises fails the
  step's requests (:class:`~labsupport.serve.stack.PartFailed`, naming the slot and the learner's line).
* ``prefix_cache`` (lab 10's ``PrefixCachingAllocator``) is **checked while serving** by
  :class:`PrefixCacheReplay`: the engine's admissions are replayed on it beside the engine's own
  pool, and the prompt tokens it finds cached are compared with the engine's; the count of
  agreements is in ``GET /health`` (``stack_prefix_cache``) and ``/metrics``. Its interface has no
  ``append_token`` (a sequence cannot grow), so it cannot be the pool itself.
* ``speculative_accept`` (lab 13) **serves** with ``--num-speculative-tokens``: the engine's draft
  verification (``engine.runner.verify``) applies the learner's acceptance rule, :class:`LearnerVerifier`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Sequence

import torch

from ..engine.sampler import _penalized, batched_sampling_probs, drawable, row_failure, row_settings
from ..paged_cache import BlockAllocator
from ..stack import Slot
from .stack_guard import PartFailed, guarded

log = logging.getLogger("labsupport.serve")

ENGINE_SLOTS = ("block_allocator", "prefix_cache", "speculative_accept")


# --- block_allocator: lab 10's allocator as the engine's block pool ------------------------------


class LearnerBlockPool:
    """Lab 10's ``BlockAllocator`` (``allocate(seq_id, num_tokens)``, ``append_token(seq_id)``,
    ``free``, ``block_table``, ``free_blocks``; int sequence ids) with the methods the engine's
    :class:`~labsupport.engine.block_manager.BlockManager` calls on the course's pool.

    * Request ids become ints (lab 10's sequence ids), numbered as they arrive.
    * Prefix caching is off (:attr:`prefix_caching` False): no look-up ever hits, nothing is hashed.
    * A request's first slot is ``allocate(seq_id, 1)``; every later one ``append_token(seq_id)``.
    * :meth:`truncate` (speculative decoding gives back rejected draft tokens): lab 10's interface has
      no truncate, so the request keeps the slots past its new length and its next tokens are written
      over them (vLLM's scheduler does the same with its slots); they go back when it is freed.
    * :meth:`free` never raises: it is called where a request ends, also when its step has already
      failed. If the learner's ``free`` raises, the message is logged with the slot and the line, the
      request is forgotten here, and its blocks may be lost to the pool (the server then has fewer).
    """

    prefix_caching = False
    evictions = 0  # nothing is cached, so nothing is evicted

    def __init__(self, slot: Slot, cls, file: str, num_blocks: int, block_size: int):
        self.slot, self.file = slot, file
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = guarded(slot, cls, file)(num_blocks, block_size)
        self._call = {name: guarded(slot, getattr(self.pool, name), file)
                      for name in ("allocate", "append_token", "free", "block_table", "free_blocks")}
        self._ids = itertools.count()
        self._seq: dict[Hashable, int] = {}  # request id -> the learner's sequence id
        self._held: dict[Hashable, int] = {}  # tokens the learner's sequence holds (0: not allocated yet)
        self._length: dict[Hashable, int] = {}  # tokens the engine's request holds (at most _held)
        self.free_failures = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._call["free_blocks"]())

    def __contains__(self, request_id: Hashable) -> bool:
        try:
            return request_id in self._seq
        except TypeError:
            return False

    def num_blocks_of(self, request_id: Hashable) -> int:
        return len(self.block_table(request_id)) if request_id in self else 0

    def block_table(self, request_id: Hashable) -> list[int]:
        if not self._held.get(request_id):
            return []
        return list(self._call["block_table"](self._seq[request_id]))

    def cached_prefix_blocks(self, block_hashes: Sequence[int], limit: int | None = None) -> int:
        return 0  # prefix caching is off

    def cached_tokens(self, request_id: Hashable) -> int:
        return 0

    def allocate(self, request_id: Hashable, tokens, *, cache_salt: Hashable = None,
                 block_hashes: Sequence[int] | None = None) -> list[int]:
        """A new request (``tokens``: its cached prefix, empty with prefix caching off). Its blocks
        are taken slot by slot as :meth:`append_token` asks."""
        if request_id in self._seq:
            raise ValueError(f"request {request_id!r} already holds blocks")
        n = tokens if isinstance(tokens, int) else len(tokens)
        self._seq[request_id] = next(self._ids)
        self._held[request_id] = self._length[request_id] = 0
        if n:  # not with prefix caching off; kept general
            self._call["allocate"](self._seq[request_id], n)
            self._held[request_id] = self._length[request_id] = n
        return self.block_table(request_id)

    def append_token(self, request_id: Hashable, token_id: int | None = None):
        """The slot of the request's next token: ``(block, offset, copy)``."""
        sid, length, held = self._seq[request_id], self._length[request_id], self._held[request_id]
        if length < held:  # a slot kept after a truncate: written over
            self._length[request_id] = length + 1
            return self.block_table(request_id)[length // self.block_size], length % self.block_size, None
        if held == 0:
            table = self._call["allocate"](sid, 1)
            got = (list(table)[0], 0, None)
        else:
            got = self._call["append_token"](sid)
        self._held[request_id] = self._length[request_id] = length + 1
        block, offset, copy = got
        return block, offset, copy

    def truncate(self, request_id: Hashable, length: int) -> None:
        """Keep only ``length`` tokens; the slots past it stay the request's (class docstring)."""
        if not 0 <= length <= self._length[request_id]:
            raise ValueError(f"request {request_id!r} holds {self._length[request_id]} tokens, not {length}")
        self._length[request_id] = length

    def free(self, request_id: Hashable) -> None:
        sid = self._seq.pop(request_id, None)
        held = self._held.pop(request_id, 0)
        self._length.pop(request_id, None)
        if sid is None or not held:
            return
        try:
            self._call["free"](sid)
        except PartFailed as exc:
            self.free_failures += 1
            log.error("labsupport.serve: %s; request %r is forgotten, its blocks may be lost to the pool",
                      exc, request_id)

    def reset_prefix_cache(self) -> None:
        """Nothing is cached (prefix caching is off)."""


def serve_block_allocator(backend, slot: Slot, cls, file: str) -> None:
    """Make the learner's allocator the engine's block pool, with prefix caching off (said in the
    back end's description). A ValueError if it cannot be made, or the engine already holds blocks."""
    engine = backend.engine
    if engine.requests:
        raise ValueError("--stack: the block pool can only be replaced before the engine takes requests")
    try:
        pool = LearnerBlockPool(slot, cls, file, engine.num_blocks, engine.block_size)
    except PartFailed as exc:
        raise ValueError(f"--stack: {exc}") from exc
    engine.block_manager.allocator = engine.allocator = pool
    backend.description += (f" Prefix caching is off: your block_allocator (lab 10) is the engine's block pool, "
                            f"and its interface has token counts, not token ids, so no block can be found by "
                            f"its prefix ({engine.num_blocks} blocks of {engine.block_size} tokens).")


# --- prefix_cache: lab 10's prefix cache, replayed beside the engine's pool ---------------------


class PrefixCacheReplay:
    """The engine's admissions replayed on the learner's ``PrefixCachingAllocator`` and, on the same
    calls, on the course's pool (``BlockAllocator(..., prefix_caching=True)``, the reference of lab
    10's check), each with the engine's number of blocks and block size:

    * an admission (``BlockManager.admit``) allocates the request's known tokens (its prompt, and
      what it generated before a preemption): the tokens found cached, at most all but the last
      (the engine always computes the last, for its logits), are compared with the engine's;
    * where the engine frees a request, the replay first allocates and frees everything the request
      computed, so its generated blocks are cached too, as in the engine, then frees the request;
    * where the engine forgets its cache (a failed step), the replay starts again, empty.

    Each admission's three numbers, yours, the course's replay and the engine's, are counted: your
    cache **agrees** where it found what the engine found. Where it does not, the course's replay
    says whose the difference is: equal to yours, the replay differs from the engine (its blocks are
    cached when a request is admitted, the engine's as they are computed, so two requests admitted
    in one step, or a cache under eviction pressure, can differ), not your part; else your part
    found what the course's allocator does not. With prefix caching off in the engine (your
    block_allocator serves) yours is compared with the course's replay alone. A part that raises
    stops the replay (the message says where); requests never depend on it."""

    def __init__(self, slot: Slot, cls, file: str, engine):
        self.slot, self.file, self.cls, self.engine = slot, file, cls, engine
        self.counts = {"admissions": 0, "agreed": 0, "disagreed": 0, "yours_wrong": 0, "replay_differs": 0,
                       "hit_tokens_yours": 0, "hit_tokens_engine": 0, "replay_restarts": 0}
        self.last_disagreement = ""
        self.stopped = ""
        self._ids = itertools.count()
        self._start()

    def _start(self) -> None:
        bm = self.engine.block_manager
        self.yours = guarded(self.slot, self.cls, self.file)(self.engine.num_blocks, bm.block_size)
        self.course = BlockAllocator(self.engine.num_blocks, bm.block_size, prefix_caching=True)
        self.live: dict[Hashable, tuple[int, int]] = {}  # request id -> (sequence id, tokens allocated)

    def install(self) -> None:
        """Watch the engine's block manager: its ``admit`` and ``free``, and its pool's ``reset_prefix_cache``."""
        bm = self.engine.block_manager
        admit, free = bm.admit, bm.free

        def admitted(req, cached):
            admit(req, cached)
            self.admitted(req, cached)

        def freed(req):
            self.freed(req)
            free(req)

        bm.admit, bm.free = admitted, freed
        pool = bm.allocator
        reset = pool.reset_prefix_cache

        def forgotten():
            reset()
            self.restart()

        pool.reset_prefix_cache = forgotten

    def _both(self, method: str, *args):
        """``method`` on your allocator and the course's: (yours, the course's), a MemoryError as None."""
        out = []
        for pool in (self.yours, self.course):
            try:
                out.append(guarded(self.slot, getattr(pool, method), self.file)(*args)
                           if pool is self.yours else getattr(pool, method)(*args))
            except PartFailed as exc:
                if not isinstance(exc.__cause__, MemoryError):
                    raise
                out.append(None)
            except MemoryError:
                out.append(None)
        return out

    def _guard(self, work) -> None:
        if self.stopped:
            return
        try:
            work()
        except PartFailed as exc:
            said = str(exc).split("; the step's requests fail")[0]  # a checked part fails no request
            self.stopped = f"{said}; the replay stopped, the requests go on"
            log.error("labsupport.serve: the prefix_cache replay stopped: %s", exc)

    def admitted(self, req, cached: int) -> None:
        self._guard(lambda: self._admit(req, cached))

    def _admit(self, req, cached: int) -> None:
        n, bs = req.num_tokens, self.engine.block_size
        tokens = req.token_ids(0, n)
        sid = next(self._ids)
        tables = self._both("allocate", sid, tokens)
        if None in tables:  # out of blocks in one of them (the replay holds no more than the engine does)
            for pool, table in zip((self.yours, self.course), tables):
                if table is not None:
                    guarded(self.slot, pool.free, self.file)(sid)
            self._count(req, None, None, cached, "out of blocks in the replay")
            return
        self.live[req.request_id] = (sid, n)
        cap = (n - 1) // bs * bs
        yours, course = (min(int(c), cap) for c in self._both("cached_tokens", sid))
        self._count(req, yours, course, cached)

    def _count(self, req, yours, course, engine_hit, why: str = "") -> None:
        c = self.counts
        c["admissions"] += 1
        on = self.engine.block_manager.allocator.prefix_caching
        reference = engine_hit if on else course
        if yours is not None and yours == reference:
            c["agreed"] += 1
            c["hit_tokens_yours"] += yours
            c["hit_tokens_engine"] += engine_hit
            return
        c["disagreed"] += 1
        c["hit_tokens_yours"] += yours or 0
        c["hit_tokens_engine"] += engine_hit
        if why:
            c["yours_wrong" if yours is None and course is not None else "replay_differs"] += 1
        elif yours != course:
            c["yours_wrong"] += 1
        else:
            c["replay_differs"] += 1
        self.last_disagreement = (f"request {req.request_id}: {req.num_tokens} tokens, your prefix cache found "
                                  f"{yours} cached, the course's on the same replay {course}, the engine "
                                  f"{engine_hit if on else 'nothing (prefix caching is off)'}{': ' + why if why else ''}")

    def freed(self, req) -> None:
        self._guard(lambda: self._free(req))

    def _free(self, req) -> None:
        got = self.live.pop(req.request_id, None)
        if got is None:
            return
        sid, n = got
        bs, computed = self.engine.block_size, min(req.num_computed, req.num_tokens)
        if computed // bs > n // bs:  # it computed more full blocks than it was admitted with: cache them
            ghost = next(self._ids)
            tables = self._both("allocate", ghost, req.token_ids(0, computed))
            for pool, table in zip((self.yours, self.course), tables):
                if table is not None:
                    (guarded(self.slot, pool.free, self.file) if pool is self.yours else pool.free)(ghost)
        guarded(self.slot, self.yours.free, self.file)(sid)
        self.course.free(sid)

    def restart(self) -> None:
        """The engine forgot its cache: the replay starts again, empty."""
        if self.stopped:
            return
        self.counts["replay_restarts"] += 1
        self._guard(self._start)

    def report(self) -> dict:
        """What ``GET /health`` shows as ``stack_prefix_cache``."""
        c = self.counts
        if self.stopped:
            status = "stopped"
        else:
            status = "agrees" if not c["disagreed"] else "disagrees"
        against = ("the engine's hits" if self.engine.block_manager.allocator.prefix_caching
                   else "the course's pool on the same replay (the engine's prefix caching is off)")
        return {"status": status, "compared_with": against, **c, "last_disagreement": self.last_disagreement,
                "stopped": self.stopped}


def check_prefix_cache(backend, slot: Slot, cls, file: str) -> PrefixCacheReplay:
    """Replay the engine's admissions on the learner's prefix cache (:class:`PrefixCacheReplay`); its
    report is added to the back end's ``stats()`` (``GET /health``, ``/metrics``)."""
    try:
        replay = PrefixCacheReplay(slot, cls, file, backend.engine)
    except PartFailed as exc:
        raise ValueError(f"--stack: {exc}") from exc
    replay.install()
    stats = backend.stats

    def with_replay() -> dict:
        return {**stats(), "stack_prefix_cache": replay.report()}

    backend.stats = with_replay
    backend.description += (" Your prefix_cache (lab 10) is checked beside the engine's pool: each admission "
                            "is replayed on it and its hits compared (GET /health: stack_prefix_cache).")
    return replay


# --- speculative_accept: lab 13's acceptance rule verifies the engine's drafts ------------------


class LearnerVerifier:
    """``verify_drafts``'s interface (:func:`labsupport.engine.speculative.verify_drafts`) with the
    learner's ``speculative_accept(draft_tokens, draft_probs, target_probs, generator)`` deciding.

    For each request with a draft of ``d`` tokens: ``target_probs`` (d + 1, V) are the target's
    probabilities at its ``1 + d`` rows, after the request's own repetition penalty, temperature,
    min-p, top-k and top-p (the engine's :func:`batched_sampling_probs`); a greedy request's are
    one-hot on the argmax. The drafts are prompt lookups, not samples of a draft model, so
    ``draft_probs`` (d, V) are one-hot on each draft token. Under that rule a greedy request gets
    exactly the engine's tokens (a one-hot target accepts a draft token only where it is the argmax,
    and its residual and bonus are the argmax), and a sampled one tokens distributed as plain
    sampling's, though not the same draws as the engine's (its uniforms come from the same
    generator). A request without a draft in the step samples as plain sampling does. Draws use the
    request's generator on a CPU; on a GPU a CPU generator seeded from it (``torch.rand`` on the host).

    What the learner's function returns is checked: 1 to ``d + 1`` token ids, the first ones equal
    to the draft's; otherwise the step fails with a :class:`PartFailed` naming the slot."""

    def __init__(self, slot: Slot, fn, file: str):
        self.slot, self.file = slot, file
        self.accept = guarded(slot, fn, file)

    def __call__(self, logits: torch.Tensor, params, generators, drafts, histories=None):
        sizes = [len(d) + 1 for d in drafts]
        row_params = [p for p, n in zip(params, sizes) for _ in range(n)]
        row_histories = None
        if histories is not None:
            row_histories = [list(h) + list(d[:j]) if p.repetition_penalty != 1 else ()
                             for h, d, p in zip(histories, drafts, params) for j in range(len(d) + 1)]
        logits = _penalized(logits, row_params, row_histories).float()
        V, out, start = logits.shape[-1], [], 0
        for draft, p, g, n in zip(drafts, params, generators, sizes):
            rows = logits[start:start + n]
            start += n
            if p.temperature == 0:
                target = torch.nn.functional.one_hot(rows.argmax(-1), V).float().cpu()
            else:
                target = batched_sampling_probs(rows, *row_settings([p] * n, V, rows.device)).cpu()
                target, valid = drawable(target)
                if not bool(valid.all()):
                    out.append(row_failure(p, "its probabilities were NaN, infinite or all zero"))
                    continue
            gen = g if g.device.type == "cpu" else torch.Generator().manual_seed(
                int(torch.randint(2**62, (1,), generator=g, device=g.device)))
            if not draft:  # nothing to accept: plain sampling
                token = int(target[0].argmax()) if p.temperature == 0 else int(
                    torch.multinomial(target[0:1], 1, generator=gen)[0, 0])
                out.append([token])
                continue
            drafted = torch.tensor(draft, dtype=torch.long)
            q = torch.nn.functional.one_hot(drafted, V).float()
            got = self.accept(drafted.clone(), q, target.clone(), generator=gen)
            out.append(self._tokens(got, draft, V))
        return out

    def _tokens(self, got, draft, V: int) -> list[int]:
        d = len(draft)
        ok = (isinstance(got, torch.Tensor) and got.dim() == 1 and 1 <= got.numel() <= d + 1
              and not got.is_floating_point() and bool(((got >= 0) & (got < V)).all()))
        tokens = got.tolist() if ok else None
        if not ok or tokens[:-1] != list(draft[:len(tokens) - 1]):
            shown = got.tolist() if isinstance(got, torch.Tensor) else repr(got)[:80]
            raise PartFailed(f"your speculative_accept part (lab {self.slot.lab[:2]}, {self.slot.part}) returned "
                             f"{shown} for the draft {list(draft)}: expected 1 to {d + 1} token ids, all but the last "
                             f"equal to the draft's first ones ({self.file}); the step's requests fail, the server "
                             f"goes on with your part")
        return tokens


def serve_speculative_accept(backend, slot: Slot, fn, file: str) -> str | None:
    """The learner's acceptance rule as the engine's verifier; the reason it is left out, or None."""
    if backend.engine.speculative is None:
        return "speculative decoding is off: add --num-speculative-tokens K to serve it"
    backend.engine.runner.verify = LearnerVerifier(slot, fn, file)
    return None


def plug_engine_part(backend, slot: Slot, part, file: str) -> str | None:
    """Plug an engine-side part (:data:`ENGINE_SLOTS`) into ``backend``'s engine; returns why it is
    left out, or None when it is in."""
    if slot.name == "block_allocator":
        serve_block_allocator(backend, slot, part, file)
    elif slot.name == "prefix_cache":
        check_prefix_cache(backend, slot, part, file)
    elif slot.name == "speculative_accept":
        return serve_speculative_accept(backend, slot, part, file)
    else:
        raise ValueError(f"{slot.name} is not an engine-side slot ({', '.join(ENGINE_SLOTS)})")
    return None
