"""A paged KV cache's memory manager: blocks, block tables, copy-on-write, prefix caching.

Chapter 10 explains it. The cache is cut into ``num_blocks`` physical blocks of ``block_size``
token slots each. A sequence owns a *block table*: its logical block ``i`` (token positions
``i * block_size`` to ``(i + 1) * block_size - 1``) lives in physical block ``table[i]``, so token
position ``p`` is slot ``p % block_size`` of physical block ``table[p // block_size]``.

:class:`BlockAllocator` keeps, for every physical block, a *reference count*: how many sequences'
tables hold it. Forking a sequence (parallel sampling, beam search) copies the table and adds one
reference to every block, so parent and child share their prefix. A block is written only by a
sequence that holds it alone: appending to a shared, partly filled last block first copies it
(*copy-on-write*), and :meth:`BlockAllocator.append_token` returns the copy to make. Freeing drops
one reference per block; a block returns to the free list only when its count reaches zero.

With ``prefix_caching=True``, every *full* block is identified by a hash of its tokens and of
the hash of the block before it (so equal hashes mean equal prefixes, not merely equal blocks).
A new sequence whose first blocks hash like cached ones reuses them instead of computing them
again; :meth:`BlockAllocator.cached_tokens` says how many tokens hit. A freed block that holds a
hashed prefix is not wiped: it stays *cached* (reference count 0, still findable by its hash)
until a new allocation needs the space, and then the least recently released goes first (LRU).
An optional ``cache_salt`` per request (a tenant id) enters the first block's hash, so requests
with different salts never share blocks: the isolation chapter 10 discusses.

Conventions: sequence ids are any hashable values; block ids are ints in ``[0, num_blocks)``;
running out of blocks raises :class:`OutOfBlocks`, a ``MemoryError``, and leaves the allocator as
it was. :meth:`BlockAllocator.check_invariants` verifies the bookkeeping (tests call it after
every operation).

:class:`PagedKVStore` holds the keys and values themselves in that layout for the course model
(:mod:`labsupport.transformer`), and copies them between the paged store and a contiguous
:class:`~labsupport.transformer.KVCache`, which is how the lab reuses a cached prefix in prefill.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

import torch

from ._answers import answer, unguarded
from ._validate import positive_int

__all__ = ["OutOfBlocks", "BlockAllocator", "PagedKVStore", "block_hash", "blocks_needed", "prefix_cached_prefill"]


class OutOfBlocks(MemoryError):
    """Not enough free (or evictable) blocks for the request; nothing was changed."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-positive_int("num_tokens", num_tokens, allow_zero=True) // positive_int("block_size", block_size))


def block_hash(parent: int | None, tokens: Sequence[int], salt: Hashable = None) -> int:
    """The identity of a full block: its tokens and its parent's hash (``None`` for the first
    block, which takes the request's ``salt`` instead), as SHA-256 (an int of 256 bits).

    Not Python's ``hash``: its 64 bits for a tuple of ints are the same in every process and not
    built to resist collisions (``hash(-1) == hash(-2)``), so one can search offline for a prompt
    whose block collides with another user's, and the colliding request would be served the
    other user's keys and values (vLLM's advisory
    GHSA-rm76-4mrf-v9r8 was this case; its prefix cache has hashed with SHA-256 by default since
    v0.10.2). The salt enters through its ``repr``: give plain values (a tenant's id as a str)."""
    h = hashlib.sha256(b"first" + repr(salt).encode() if parent is None else b"after" + parent.to_bytes(32, "big"))
    h.update(struct.pack(f">{len(tokens)}q", *tokens))  # the ids as signed 64-bit ints, one call
    return int.from_bytes(h.digest(), "big")


@answer
def block_allocator_answer() -> None:
    """Marks the course's :class:`BlockAllocator` as lab 10's answer: the allocator's constructor
    calls it, so it refuses to be built inside the check that grades a learner's allocator."""


class BlockAllocator:
    """Physical blocks, block tables, reference counts, copy-on-write and (optionally) prefix caching.

    ``BlockAllocator(num_blocks, block_size, prefix_caching=False)``. The methods lab 10 asks a
    learner to write: :meth:`allocate`, :meth:`append_token`, :meth:`fork`, :meth:`free`,
    :meth:`block_table`, :meth:`ref_count`, :meth:`free_blocks`. The rest (token ids for prefix
    caching, :meth:`cached_tokens`, hit counters, :meth:`can_allocate`) is what an engine needs.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        unguarded(block_allocator_answer)()  # refuses inside lab 10's check, unless the course checks itself
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.prefix_caching = bool(prefix_caching)
        self._refs = [0] * self.num_blocks
        self._free: deque[int] = deque(range(self.num_blocks))  # empty blocks, taken first
        self._evictable: OrderedDict[int, int] = OrderedDict()  # block -> hash: cached, unreferenced, LRU first
        self._by_hash: dict[int, int] = {}  # hash -> block holding that prefix
        self._hash_of: dict[int, int] = {}  # block -> its hash (full, registered blocks only)
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._tokens: dict[Hashable, list[int] | None] = {}  # None: token ids unknown, not hashable
        self._salts: dict[Hashable, Hashable] = {}
        self._chains: dict[Hashable, list[int]] = {}  # the hash of each full block of a sequence, in order
        self._cached: dict[Hashable, int] = {}
        self.hit_tokens = 0  # prompt tokens found in the prefix cache, over all allocations
        self.query_tokens = 0  # prompt tokens allocated with token ids (what could have hit)
        self.evictions = 0  # cached blocks reclaimed for new data

    # -- what the lab's interface reads ---------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The physical blocks of ``seq_id``, logical block 0 first (a copy)."""
        return list(self._table(seq_id))

    def ref_count(self, block: int) -> int:
        """How many sequences' tables hold physical block ``block``."""
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        return self._refs[block]

    def free_blocks(self) -> set[int]:
        """Blocks a new allocation may take: empty ones and cached ones nobody references."""
        return set(self._free) | set(self._evictable)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds."""
        self._table(seq_id)
        return self._lengths[seq_id]

    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` holds blocks (is allocated)."""
        try:
            return seq_id in self._tables
        except TypeError:  # an unhashable id is no sequence
            return False

    def num_blocks_of(self, seq_id: Hashable) -> int:
        """Blocks ``seq_id``'s table holds (0 for a sequence that holds none)."""
        table = self._tables.get(seq_id) if seq_id in self else None
        return 0 if table is None else len(table)

    def cached_tokens(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id``'s prompt found in the prefix cache when it was allocated (whole blocks)."""
        self._table(seq_id)
        return self._cached[seq_id]

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens (allocated with token ids) served from the prefix cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits without any prefix hit."""
        return blocks_needed(num_tokens, self.block_size) <= self.num_free_blocks

    # -- the operations ---------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, tokens: int | Sequence[int], *, cache_salt: Hashable = None,
                 block_hashes: Sequence[int] | None = None) -> list[int]:
        """Give new sequence ``seq_id`` the blocks for its prompt; return its block table.

        ``tokens`` is the prompt's length, or its token ids (needed for prefix caching). With
        prefix caching, leading full blocks whose hash is cached are reused (their reference count
        grows) and :meth:`cached_tokens` reports them. Raises :class:`OutOfBlocks` when the free
        and evictable blocks do not suffice (nothing changes), ``ValueError`` for a known id.
        ``block_hashes``: the hashes of the full blocks of ``tokens`` (with ``cache_salt``), when the
        caller already keeps them (an engine's request does): they are not computed again.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or use another id")
        ids = None
        if isinstance(tokens, (int,)) and not isinstance(tokens, bool):
            length = positive_int("tokens", tokens, allow_zero=True)
        elif isinstance(tokens, torch.Tensor) or isinstance(tokens, Sequence):
            ids = [int(t) for t in (tokens.flatten().tolist() if isinstance(tokens, torch.Tensor) else tokens)]
            length = len(ids)
        else:
            raise ValueError(f"tokens must be a token count or a list of token ids, got {type(tokens).__name__}")
        need = blocks_needed(length, self.block_size)

        hits: list[int] = []  # cached blocks this prompt can reuse, in order
        hashes: list[int] = []  # the hash of every full block of the prompt
        if ids is not None and block_hashes is not None:
            if len(block_hashes) != length // self.block_size:
                raise ValueError(f"block_hashes has {len(block_hashes)} hashes; {length} tokens fill "
                                 f"{length // self.block_size} blocks of {self.block_size}")
            hashes = list(block_hashes)
        elif ids is not None:
            parent = None
            for i in range(length // self.block_size):
                parent = block_hash(parent, ids[i * self.block_size:(i + 1) * self.block_size],
                                    cache_salt if i == 0 else None)
                hashes.append(parent)
        if self.prefix_caching:
            for h in hashes:
                if h not in self._by_hash:
                    break
                hits.append(self._by_hash[h])
        revived = sum(1 for b in hits if self._refs[b] == 0)  # evictable now, referenced after
        if need - len(hits) > self.num_free_blocks - revived:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need - len(hits)} new blocks of {self.block_size} "
                              f"tokens; {self.num_free_blocks - revived} are free or evictable")
        table = []
        for b in hits:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
            table.append(b)
        for i in range(len(hits), need):
            b = self._take()
            table.append(b)
            if i < len(hashes):
                self._register(b, hashes[i])
        self._tables[seq_id] = table
        self._lengths[seq_id] = length
        self._tokens[seq_id] = ids
        self._salts[seq_id] = cache_salt
        self._chains[seq_id] = hashes
        self._cached[seq_id] = len(hits) * self.block_size
        if ids is not None:
            self.query_tokens += length
            self.hit_tokens += len(hits) * self.block_size
        return list(table)

    def append_token(self, seq_id: Hashable, token_id: int | None = None) -> tuple[int, int, tuple[int, int] | None]:
        """Make room for ``seq_id``'s next token; return ``(block, offset, copy)``.

        The token goes to slot ``offset`` of physical ``block``. ``copy`` is ``None``, or
        ``(src, dst)`` when the last block was shared and partly filled: copy block ``src``'s
        contents into ``dst`` before writing (copy-on-write; ``dst`` replaced ``src`` in this
        sequence's table). A full last block (or none) gets a new block. ``token_id`` keeps prefix
        hashing going: when the block fills, it becomes findable by its hash.
        """
        table = self._table(seq_id)
        length = self._lengths[seq_id]
        offset = length % self.block_size
        copy = None
        if offset == 0:
            block = self._take()
            table.append(block)
        else:
            block = table[-1]
            if self._refs[block] > 1:  # shared: this sequence gets its own copy first
                new = self._take()
                self._refs[block] -= 1
                table[-1] = new
                copy = (block, new)
                block = new
        self._lengths[seq_id] = length + 1
        ids = self._tokens[seq_id]
        if ids is not None:
            if token_id is None:
                self._tokens[seq_id] = None  # from here on this sequence's blocks cannot be hashed
            else:
                ids.append(int(token_id))
                if offset == self.block_size - 1:  # the block is now full: it can be found by its hash
                    self._register(block, self._next_hash(seq_id, len(table) - 1))
        return block, offset, copy

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """New sequence ``child_id`` sharing every block of ``parent_id``; returns its table."""
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already exists; fork into a new id")
        for b in parent:
            self._refs[b] += 1
        self._tables[child_id] = list(parent)
        self._lengths[child_id] = self._lengths[parent_id]
        ids = self._tokens[parent_id]
        self._tokens[child_id] = None if ids is None else list(ids)
        self._salts[child_id] = self._salts[parent_id]
        self._chains[child_id] = list(self._chains[parent_id])
        self._cached[child_id] = self._cached[parent_id]
        return list(parent)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Keep only the first ``length`` tokens of ``seq_id`` (speculative decoding's rollback: the
        slots of rejected draft tokens go back). The tokens past ``length`` were never part of the
        sequence: a block they alone fill, or that now holds fewer tokens, forgets its hash when this
        sequence is its only holder (the kept one's tail is about to be overwritten), and blocks
        past what ``length`` needs lose this sequence's reference, going back to the free list when
        nobody else holds them. Token ids after ``length`` are forgotten, so a block that fills
        again is hashed with the new ones."""
        table = self._table(seq_id)
        old = self._lengths[seq_id]
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= old:
            raise ValueError(f"sequence {seq_id!r} holds {old} tokens; truncate it to 0..{old}, not {length!r}")
        full, keep = length // self.block_size, blocks_needed(length, self.block_size)
        for b in table[full:]:  # the blocks no longer full of this sequence's tokens
            if self._refs[b] == 1 and b in self._hash_of:
                self._unregister(b)
        for b in reversed(table[keep:]):
            self._refs[b] -= 1
            if self._refs[b] == 0:  # held by this sequence alone: its hash went above
                self._free.append(b)
        del table[keep:]
        del self._chains[seq_id][full:]
        self._lengths[seq_id] = length
        if self._tokens[seq_id] is not None:
            del self._tokens[seq_id][length:]

    def free(self, seq_id: Hashable) -> None:
        """Drop ``seq_id``: one reference fewer on each of its blocks. A block nobody holds goes
        back to the free list, or, if it holds a hashed prefix, stays cached until evicted. Blocks
        are released last first, so a sequence's tail is evicted before its prefix."""
        table = self._table(seq_id)
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = self._hash_of[b]
                    self._evictable.move_to_end(b)
                else:
                    self._free.append(b)
        for store in (self._tables, self._lengths, self._tokens, self._salts, self._cached, self._chains):
            del store[seq_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: unreferenced cached blocks become plain free blocks."""
        for b in self._evictable:
            self._free.append(b)
        for b in list(self._hash_of):
            self._unregister(b)
        self._evictable.clear()

    # -- bookkeeping --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        counted = [0] * self.num_blocks
        for seq, table in self._tables.items():
            assert len(table) == blocks_needed(self._lengths[seq], self.block_size), f"{seq}: table length"
            assert len(set(table)) == len(table), f"{seq}: a block appears twice in one table"
            for b in table:
                counted[b] += 1
        assert counted == self._refs, "reference counts differ from the tables"
        used = {b for b in range(self.num_blocks) if counted[b]}
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not (free & set(self._evictable)), "a block is both free and cached"
        assert not (used & self.free_blocks()), "a block is both free and in use"
        assert used | self.free_blocks() == set(range(self.num_blocks)), "a block leaked"
        assert set(self._evictable) <= set(self._hash_of), "an evictable block has no hash"
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items()), "hash maps disagree"

    def _table(self, seq_id) -> list[int]:
        try:
            return self._tables[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"no sequence {seq_id!r}; allocate it first") from None

    def _take(self) -> int:
        """An empty block: from the free list, else the least recently released cached one."""
        if self._free:
            b = self._free.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._unregister(b)
            self.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self._refs[b] = 1
        return b

    def _register(self, block: int, h: int) -> None:
        if self.prefix_caching and h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._by_hash[h]

    def _next_hash(self, seq_id, index: int) -> int:
        """The hash of ``seq_id``'s full block ``index``, chained to the one before (kept per
        sequence, so filling a block costs one hash, however long the sequence)."""
        chain, bs = self._chains[seq_id], self.block_size
        while len(chain) <= index:  # normally exactly one step: the block that just filled
            i = len(chain)
            chain.append(block_hash(chain[-1] if chain else None, self._tokens[seq_id][i * bs:(i + 1) * bs],
                                    self._salts[seq_id] if i == 0 else None))
        return chain[index]

    def cached_prefix_tokens(self, tokens: Sequence[int], limit: int | None = None, *,
                             cache_salt: Hashable = None) -> int:
        """How many leading tokens of ``tokens`` (ids) the prefix cache holds, in whole blocks, at
        most ``limit``: a look-up that changes nothing (an engine asks before it schedules, and
        passes ``limit = len(tokens) - 1`` so that the last token is always computed, for its
        logits). 0 without prefix caching."""
        if not self.prefix_caching:
            return 0
        usable = len(tokens) if limit is None else min(len(tokens), limit)
        parent, hit, bs = None, 0, self.block_size
        for i in range(usable // bs):  # block by block: a miss stops it before the rest is read
            parent = block_hash(parent, [int(t) for t in tokens[i * bs:(i + 1) * bs]], cache_salt if i == 0 else None)
            if parent not in self._by_hash:
                break
            hit += self.block_size
        return hit

    def cached_prefix_blocks(self, block_hashes: Sequence[int], limit: int | None = None) -> int:
        """How many leading blocks of a sequence whose full blocks hash to ``block_hashes`` the prefix
        cache holds, at most ``limit``: dictionary look-ups only, nothing hashed (an engine keeps each
        request's hashes, :meth:`cached_prefix_tokens` computes them). 0 without prefix caching."""
        if not self.prefix_caching:
            return 0
        by_hash, hit = self._by_hash, 0
        for h in block_hashes if limit is None else block_hashes[:limit]:
            if h not in by_hash:
                break
            hit += 1
        return hit

    def __repr__(self) -> str:
        return (f"BlockAllocator({self.num_blocks} blocks of {self.block_size} tokens, "
                f"{self.num_free_blocks} free, {len(self._evictable)} of them cached, "
                f"{len(self._tables)} sequences, prefix_caching={self.prefix_caching})")


class PagedKVStore:
    """Keys and values of every layer in paged layout: ``k`` and ``v`` of shape
    ``(n_layers, num_blocks, block_size, n_kv_heads, head_dim)``; layer ``l`` of either is
    what :func:`labsupport.paged_attention.paged_decode_attention` takes as a cache."""

    def __init__(self, cfg, num_blocks: int, block_size: int, device="cpu", dtype=torch.float32):
        shape = (cfg.n_layers, positive_int("num_blocks", num_blocks), positive_int("block_size", block_size),
                 cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size

    def _slots(self, table: Sequence[int], start: int, end: int):
        pos = torch.arange(start, end)
        blocks = torch.as_tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks, pos % self.block_size

    def write(self, cache, table: Sequence[int], start: int, end: int, row: int = 0) -> None:
        """Copy positions ``start..end-1`` of batch row ``row`` of a contiguous ``KVCache`` (layout
        ``(L, B, Hkv, S, D)``) into the blocks of ``table``."""
        if end <= start:
            return
        blocks, offsets = self._slots(table, start, end)
        self.k[:, blocks, offsets] = cache.k[:, row, :, start:end].transpose(1, 2).to(self.k.dtype)
        self.v[:, blocks, offsets] = cache.v[:, row, :, start:end].transpose(1, 2).to(self.v.dtype)

    def read(self, cache, table: Sequence[int], start: int, end: int, row: int = 0) -> None:
        """Copy positions ``start..end-1`` from the blocks of ``table`` into batch row ``row`` of a
        contiguous ``KVCache``; the inverse of :meth:`write`."""
        if end <= start:
            return
        blocks, offsets = self._slots(table, start, end)
        cache.k[:, row, :, start:end] = self.k[:, blocks, offsets].transpose(1, 2).to(cache.k.dtype)
        cache.v[:, row, :, start:end] = self.v[:, blocks, offsets].transpose(1, 2).to(cache.v.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block ``src``'s keys and values into block ``dst`` in every layer."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]



def prefix_cached_prefill(model, allocator: BlockAllocator, store: PagedKVStore, seq_id: Hashable,
                          prompt: Sequence[int], *, cache_salt: Hashable = None) -> tuple[torch.Tensor, int]:
    """Prefill ``prompt`` (token ids) on the course model, reusing whatever prefix ``allocator``
    finds cached; returns ``(logits of the last position (1, V), cached tokens)``.

    The cached positions' keys and values are read from ``store`` into a contiguous cache, the
    model prefills only the rest (``model.prefill(..., start=cached)``), and the new positions are
    written back to the sequence's blocks. At least the last token always runs, for its logits.
    The sequence stays allocated: free it with ``allocator.free(seq_id)`` when it is done (its
    full blocks then stay cached for the next request).
    """
    ids = [int(t) for t in (prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    if not ids:
        raise ValueError("prompt must hold at least one token id")
    # a salt only when there is one: lab 10's allocator, the learner's, takes no salt
    table = allocator.allocate(seq_id, ids) if cache_salt is None else allocator.allocate(seq_id, ids, cache_salt=cache_salt)
    hit = allocator.cached_tokens(seq_id)
    start = min(hit, len(ids) - 1)
    cache = model.new_cache(1, len(ids))
    store.read(cache, table, 0, start)
    cache.length = start
    rest = torch.tensor(ids[start:], dtype=torch.long, device=model.device)[None]  # (1, P - start)
    logits = model.prefill(rest, cache, start=start)
    store.write(cache, table, hit, len(ids))  # positions before `hit` are already in their blocks
    return logits, hit
