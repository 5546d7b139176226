"""The course's block allocator: paging, copy-on-write, prefix caching with LRU eviction, and the
paged K/V store, with its invariants checked after every operation of long random runs."""

from __future__ import annotations

import random

import pytest
import torch

from labsupport.models import get_model
from labsupport.paged_cache import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVStore,
    block_hash,
    blocks_needed,
    prefix_cached_prefill,
)
from labsupport.transformer import Transformer


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(3, 0)


def test_allocate_append_and_free():
    a = BlockAllocator(8, 4)
    table = a.allocate("s", 6)
    assert len(table) == 2 and a.num_free_blocks == 6
    assert a.append_token("s") == (table[1], 2, None)
    a.append_token("s")
    block, offset, copy = a.append_token("s")  # position 8: a third block
    assert offset == 0 and copy is None and a.block_table("s") == table + [block]
    a.free("s")
    assert a.num_free_blocks == 8
    a.check_invariants()


def test_fork_shares_and_copy_on_write_copies():
    a = BlockAllocator(8, 4)
    parent = a.allocate(0, 6)
    assert a.fork(0, 1) == parent
    assert [a.ref_count(b) for b in parent] == [2, 2]
    block, offset, copy = a.append_token(1)
    assert copy == (parent[1], block) and offset == 2 and block not in parent
    assert a.block_table(1) == [parent[0], block] and a.ref_count(parent[1]) == 1
    assert a.append_token(0) == (parent[1], 2, None)  # the parent now writes in place
    a.free(0)
    assert a.ref_count(parent[0]) == 1 and parent[1] in a.free_blocks()
    a.check_invariants()


def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(4, 4)
    a.allocate(0, 12)
    with pytest.raises(OutOfBlocks, match="needs 2 new blocks"):
        a.allocate(1, 8)
    assert isinstance(OutOfBlocks("x"), MemoryError)
    assert a.num_free_blocks == 1 and a.sequences() == [0]
    a.check_invariants()


def test_bad_arguments_say_what_is_wrong():
    a = BlockAllocator(4, 4)
    with pytest.raises(ValueError, match="no sequence 7"):
        a.free(7)
    a.allocate(1, 3)
    with pytest.raises(ValueError, match="already exists"):
        a.allocate(1, 3)
    with pytest.raises(ValueError, match="already exists"):
        a.fork(1, 1)
    with pytest.raises(ValueError, match=r"block must be an int in \[0, 4\)"):
        a.ref_count(4)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 4)


def test_prefix_caching_reuses_full_blocks_only():
    a = BlockAllocator(16, 4, prefix_caching=True)
    system = list(range(100, 110))  # 10 tokens: 2 full blocks and 2 tokens of a third
    t0 = a.allocate("a", system + [1, 2, 3])
    assert a.cached_tokens("a") == 0
    t1 = a.allocate("b", system + [7, 8, 9])
    assert a.cached_tokens("b") == 8 and t1[:2] == t0[:2] and t1[2] != t0[2]
    assert a.ref_count(t0[0]) == 2
    assert a.hit_tokens == 8 and a.query_tokens == 26 and a.hit_rate == pytest.approx(8 / 26)
    a.check_invariants()


def test_the_hash_covers_the_parent():
    """Equal blocks after different prefixes are different blocks."""
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [9, 9]), [1, 2])
    # SHA-256, not Python's hash, under which these two blocks collide (hash(-1) == hash(-2))
    assert hash(("block", None, (-1,))) == hash(("block", None, (-2,)))
    assert block_hash(None, [-1]) != block_hash(None, [-2]) and block_hash(None, [1, 2]).bit_length() > 64
    assert block_hash(None, [1, 2], salt="tenant-a") != block_hash(None, [1, 2], salt="tenant-b")
    assert block_hash(None, [1, 2]) == block_hash(None, (1, 2))  # the same in every process and call
    a = BlockAllocator(16, 2, prefix_caching=True)
    a.allocate("a", [1, 2, 3, 4])
    a.allocate("b", [5, 6, 3, 4])
    assert a.cached_tokens("b") == 0


def test_cache_salt_isolates_tenants():
    a = BlockAllocator(16, 2, prefix_caching=True)
    a.allocate("a", [1, 2, 3, 4], cache_salt="tenant-1")
    a.allocate("b", [1, 2, 3, 4], cache_salt="tenant-2")
    a.allocate("c", [1, 2, 3, 4], cache_salt="tenant-1")
    assert (a.cached_tokens("b"), a.cached_tokens("c")) == (0, 4)


def test_freed_prefixes_stay_cached_and_are_evicted_lru_first():
    a = BlockAllocator(4, 2, prefix_caching=True)
    a.allocate("old", [1, 2])
    a.free("old")
    a.allocate("new", [3, 4])
    a.free("new")
    assert a.num_free_blocks == 4  # cached blocks still count as free
    a.allocate("x", [9, 9, 8, 8, 7, 7])  # needs 3 blocks: 2 empty ones, then the oldest cached
    assert a.evictions == 1
    a.allocate("again-old", [1, 2])  # evicted: a miss
    assert a.cached_tokens("again-old") == 0
    a.free("again-old")
    a.free("x")
    a.allocate("again-new", [3, 4])  # evicted too: "again-old" needed a block
    assert a.cached_tokens("again-new") == 0 and a.evictions == 3  # the least recent, "again-old", went
    a.check_invariants()


def test_a_cached_block_comes_back_to_life():
    a = BlockAllocator(4, 2, prefix_caching=True)
    first = a.allocate("a", [1, 2, 3])
    a.free("a")
    again = a.allocate("b", [1, 2, 5])
    assert again[0] == first[0] and a.cached_tokens("b") == 2 and a.ref_count(first[0]) == 1
    a.check_invariants()


def test_appended_tokens_become_cacheable_when_their_block_fills():
    a = BlockAllocator(8, 2, prefix_caching=True)
    a.allocate("a", [1])
    a.append_token("a", 2)  # block 0 is now full: [1, 2]
    a.append_token("a", 3)
    a.allocate("b", [1, 2, 3])
    assert a.cached_tokens("b") == 2


def test_reset_prefix_cache():
    a = BlockAllocator(4, 2, prefix_caching=True)
    a.allocate("a", [1, 2])
    a.free("a")
    a.reset_prefix_cache()
    a.allocate("b", [1, 2])
    assert a.cached_tokens("b") == 0
    a.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_invariant(seed):
    rng = random.Random(seed)
    a = BlockAllocator(40, rng.choice([1, 3, 4]), prefix_caching=bool(seed % 2))
    vocab = [1, 2, 3]  # a tiny vocabulary: many equal prefixes, many hits
    next_id = 0
    for _ in range(600):
        live = a.sequences()
        roll = rng.random()
        try:
            if not live or roll < 0.3:
                a.allocate(next_id, [rng.choice(vocab) for _ in range(rng.randint(1, 12))])
                next_id += 1
            elif roll < 0.45:
                a.fork(rng.choice(live), next_id)
                next_id += 1
            elif roll < 0.85:
                a.append_token(rng.choice(live), rng.choice(vocab))
            else:
                a.free(rng.choice(live))
        except OutOfBlocks:
            a.free(rng.choice(live))
        a.check_invariants()
    for seq in a.sequences():
        a.free(seq)
    a.check_invariants()
    assert a.num_free_blocks == 40
    if seed % 2:
        assert a.hit_tokens > 0


def test_paged_store_round_trips_a_model_cache():
    cfg = get_model("tiny-2m")
    model = Transformer(cfg)
    cache = model.new_cache(1, 11)
    model.prefill(model.random_prompt(1, 11), cache)
    store = PagedKVStore(cfg, num_blocks=6, block_size=4)
    table = [5, 0, 3]
    store.write(cache, table, 0, 11)
    assert torch.equal(store.k[:, 0, 1], cache.k[:, 0, :, 5])  # position 5: block table[1] = 0, slot 1
    back = model.new_cache(1, 11)
    store.read(back, table, 0, 11)
    assert torch.equal(back.k, cache.k) and torch.equal(back.v, cache.v)
    store.copy_block(3, 1)
    assert torch.equal(store.v[:, 1], store.v[:, 3])


def test_prefix_cached_prefill_gives_the_same_logits():
    cfg = get_model("tiny-2m")
    model = Transformer(cfg)
    allocator = BlockAllocator(32, 8, prefix_caching=True)
    store = PagedKVStore(cfg, 32, 8)
    system = model.random_prompt(1, 20, seed=1)[0].tolist()
    prompts = [system + model.random_prompt(1, 5, seed=s)[0].tolist() for s in (2, 3)] + [system[:16]]
    hits = []
    for i, prompt in enumerate(prompts):
        logits, hit = prefix_cached_prefill(model, allocator, store, i, prompt)
        want = model.prefill(torch.tensor([prompt]), model.new_cache(1, len(prompt)))
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        hits.append(hit)
        allocator.free(i)
    assert hits == [0, 16, 16]  # two full blocks of the shared prompt; the third prompt is all cached
    allocator.check_invariants()


def test_the_cached_prefix_lookup_stops_at_the_first_miss():
    """An engine asks for every waiting request every step, so the look-up reads a prompt only up
    to its first uncached block (here, what follows the miss is not even a token id)."""
    a = BlockAllocator(8, 4, prefix_caching=True)
    a.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert a.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert a.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8], limit=7) == 4  # the last token is computed
    assert a.cached_prefix_tokens([1, 2, 3, 4, 0, 0, 0, 0] + [object()] * 1000) == 4
