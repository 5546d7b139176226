"""The engine's cache blocks: chapter 10's allocator, driven with token ids (nano-vllm's ``BlockManager``).

The blocks themselves are :class:`labsupport.paged_cache.BlockAllocator`'s: block tables,
reference counts, full blocks identified by a hash of their tokens and of the block before
(prefix caching), freed blocks kept findable until they are evicted, least recently released
first. This class is what the engine asks of it:

* :meth:`hash_blocks`: the hashes of a request's full blocks, kept on the request
  (``Request.block_hashes``) and only ever extended: each block of its history is hashed once, when
  it arrives (its prompt) or when it is next looked up (what it generated), never once per step;
* :meth:`cached_prefix`: how many leading tokens of a waiting request are cached, whole blocks and
  never its last token (whose logits the step needs), without changing anything: dictionary
  look-ups of its kept hashes, so a step's cost does not grow with the waiting requests' lengths;
* :meth:`admit`: take those cached blocks for the request (a reference each);
* :meth:`append`: slots for the tokens a step computes, in order, each token's id passed along so a
  block that fills becomes findable by its hash;
* :meth:`truncate`: give back the slots of rejected draft tokens (speculative decoding);
* :meth:`free`: drop the request's references (preemption or retirement);
* counters of prefix-cache queries and hits, in tokens, for ``Engine.stats()``.

vLLM V1's ``KVCacheManager`` (``get_computed_blocks``, then ``allocate_slots``) and nano-vllm's
``BlockManager`` (``can_allocate``/``allocate``, ``hash_blocks``) play the same part.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..paged_cache import BlockAllocator, block_hash
from .sequence import Request


class BlockManager:
    """Cache blocks for the engine's requests (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        self.block_size = block_size
        self.query_tokens = 0  # tokens of the requests admitted (each admission counts)
        self.hit_tokens = 0  # of those, found in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, freed, or cached and unreferenced."""
        return self.allocator.num_free_blocks

    def holds(self, request_id: Hashable) -> bool:
        return request_id in self.allocator

    def num_blocks_of(self, request_id: Hashable) -> int:
        return self.allocator.num_blocks_of(request_id)

    def block_table(self, request_id: Hashable) -> list[int]:
        return self.allocator.block_table(request_id)

    def hash_blocks(self, req: Request) -> list[int]:
        """``req.block_hashes`` extended to every full block of its known tokens (prompt and output;
        never a draft): only blocks not hashed before are hashed, chained to the one before as the
        allocator chains them (:func:`~labsupport.paged_cache.block_hash`). Nothing without prefix caching."""
        hashes, bs = req.block_hashes, self.block_size
        full = req.num_tokens // bs if self.allocator.prefix_caching else 0
        if len(hashes) < full:
            first = len(hashes)
            tokens = req.token_ids(first * bs, full * bs)
            for i in range(full - first):
                hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def cached_prefix(self, req: Request) -> int:
        """Tokens of ``req`` (prompt and output so far) in the prefix cache, at most all but the last:
        look-ups of its kept block hashes (:meth:`hash_blocks`)."""
        hashes = self.hash_blocks(req)
        return self.allocator.cached_prefix_blocks(hashes, (req.num_tokens - 1) // self.block_size) * self.block_size

    def admit(self, req: Request, cached: int) -> None:
        """Give a request that holds no blocks the ``cached`` tokens :meth:`cached_prefix` found (a
        multiple of the block size): their blocks gain a reference, nothing is computed again."""
        blocks = cached // self.block_size
        self.allocator.allocate(req.request_id, req.token_ids(0, cached),
                                block_hashes=self.hash_blocks(req)[:blocks] if blocks else None)
        found = self.allocator.cached_tokens(req.request_id)
        if found != cached:  # cannot happen: nothing is allocated between the look-up and this
            raise RuntimeError(f"request {req.request_id!r}: {cached} cached tokens were found, {found} remain")
        req.cached_tokens = cached
        self.query_tokens += req.num_tokens
        self.hit_tokens += cached

    def append(self, req: Request, start: int, count: int) -> list[tuple[int, int]]:
        """Slots for positions ``start .. start + count - 1`` of ``req`` (the next ones after what it
        holds), each token's id passed so full blocks get hashed. Returns the copy-on-write copies
        to make first, ``(src, dst)`` blocks (none in this engine: it never shares a partly filled
        block, but the allocator's contract says what to do if it did)."""
        copies = []
        for token in req.token_ids(start, start + count):
            _, _, copy = self.allocator.append_token(req.request_id, token)
            if copy is not None:
                copies.append(copy)
        return copies

    def truncate(self, req: Request, length: int) -> None:
        """Give back the slots past ``length`` (rejected draft tokens; :meth:`BlockAllocator.truncate`)."""
        self.allocator.truncate(req.request_id, length)

    def blocks_to_grow(self, req: Request, extra: int) -> int:
        """New blocks ``req`` needs to hold its known tokens and ``extra`` more (a draft)."""
        return -(-(req.num_tokens + extra) // self.block_size) - self.num_blocks_of(req.request_id)

    def free(self, req: Request) -> None:
        if self.holds(req.request_id):
            self.allocator.free(req.request_id)

    def stats(self) -> dict:
        return {
            "prefix_cache_queries": self.query_tokens,
            "prefix_cache_hits": self.hit_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evictions": self.allocator.evictions,
        }
