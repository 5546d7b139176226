# Lab 10 source of truth. Edit this file, then run `python -m labsupport release 10_cache_ops` to
# regenerate labs/10_cache_ops.ipynb (learners) and solutions/10_cache_ops.ipynb (instructors).

# %% [markdown]
# # Lab 10: cache ops, the KV cache as managed memory
#
# Chapter 06 measured how big the KV cache is. This lab manages it. You will
#
# 1. simulate a day of requests and measure how much cache memory a contiguous reservation per
#    request wastes, against paging with several block sizes;
# 2. cache a shared system prompt's blocks on the course model and measure the hit rate and the
#    prefill time saved;
# 3. write a block allocator with block tables, forking with copy-on-write, and freeing, and have
#    it checked against a randomised sequence of operations;
# 4. write the prefix cache itself (block hashes chained with their prefix, lookup on admission,
#    reference counts, least-recently-used eviction), checked against the course's on traces with
#    shared system prompts and forks, and use it in section 2's place;
# 5. write paged decode attention as a Triton kernel that reads keys and values through a block
#    table, checked against contiguous attention.
#
# Chapter 10 of the book explains the ideas. Cells marked **Exercise** are yours; the check after
# each one says precisely what is wrong.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. Sections 1 and 2 need
# none of your code and come before the first exercise, so a first Run All already simulates the
# day and measures prefix caching on your device (section 2 uses the course's allocator, which you
# then write yourself: its blocks and tables in section 3, its prefix cache in section 4).

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import math
from collections import OrderedDict

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl

from labsupport import ledger
from labsupport.cache_waste import REQUEST_MIX, concurrent_usage, day_of_requests, waste_over_life
from labsupport.checks import check_block_allocator, check_paged_attention, check_prefix_cache
from labsupport.device import device
from labsupport.interpreter_bytes import count_bytes
from labsupport.models import get_model
from labsupport.paged_attention import (
    contiguous_decode_attention,
    contiguous_decode_bytes,
    gather_contiguous,
    paged_decode_attention,
    paged_decode_bytes,
    random_paged_cache,
)
from labsupport.paged_cache import BlockAllocator as CourseAllocator
from labsupport.paged_cache import PagedKVStore, prefix_cached_prefill
from labsupport.timing import benchmark
from labsupport.transformer import Transformer

DEVICE = device()

# %% [markdown]
# ## 1. A day of requests: what a contiguous reservation wastes
#
# An engine that gives each request one contiguous slab of cache must size the slab before it
# knows how long the request will run. Two common choices: the model's context limit (`max_len`),
# or the prompt plus the request's output limit (`max_tokens`). Paging instead hands out blocks
# of `block_size` tokens as the sequence grows, so only the last block of each sequence is partly
# empty.
#
# The requests come from `labsupport.cache_waste.day_of_requests`: a seeded mix of three kinds,
# each with **lognormal** prompt and output lengths. Lengths are positive and right-skewed with a
# long tail (most replies are short, a few are very long), which is the shape public chat traces
# show; a lognormal has exactly that shape and two parameters per length (median and spread) that
# are easy to state. The medians below are the course's choice, not a measurement of any
# service: change them and see what moves. Arrivals follow a daily cycle (a trough at 04:00, a
# peak at 16:00), which changes how many requests are alive at once but not the waste ratios.
#
# Waste is `1 - tokens held / tokens reserved`, both summed over every decode step of every
# request's life (a request holds its prompt plus the tokens generated so far).

# %% tags=["nbval-check-output"]
MAX_LEN, MAX_TOKENS = 8192, 2048
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
requests = day_of_requests(20_000, max_len=MAX_LEN, max_tokens=MAX_TOKENS, seed=0)
for kind in REQUEST_MIX:
    print(f"{kind.name:>9}: {kind.share:4.0%} of requests, prompt median {kind.prompt_median:5,.0f} "
          f"(sigma {kind.prompt_sigma}), output median {kind.output_median:5,.0f} (sigma {kind.output_sigma})")
print(f"{len(requests['prompt']):,} requests; prompt median {np.median(requests['prompt']):,.0f}, "
      f"output median {np.median(requests['output']):,.0f} tokens")

waste = waste_over_life(requests, max_len=MAX_LEN, max_tokens=MAX_TOKENS, block_sizes=BLOCK_SIZES)
print(f"\n{'how the cache is held':>34}  {'waste':>6}")
print(f"{'contiguous, max_len = ' + format(MAX_LEN, ','):>34}  {waste['max_len']:6.1%}")
print(f"{'contiguous, prompt + ' + format(MAX_TOKENS, ','):>34}  {waste['prompt+max_tokens']:6.1%}")
for bs in BLOCK_SIZES:
    print(f"{'paged, block_size = ' + str(bs):>34}  {waste[f'paged_{bs}']:6.1%}")

# %% [markdown]
# The same day as memory in use: tokens the live requests hold, slots paging allocates with
# 16-token blocks, and slots contiguous `max_len` reservations take. A generated token every
# 30 ms is assumed for how long each request lives.

# %%
usage = concurrent_usage(requests, step_s=0.03, sample_s=60.0, max_len=MAX_LEN, block_size=16)
hours = usage["time_s"] / 3600
fig, ax = plt.subplots(figsize=(9, 3.5))
ax.plot(hours, usage["reserved"] / 1e3, label=f"contiguous, {MAX_LEN:,} per request", lw=1)
ax.plot(hours, usage["paged"] / 1e3, label="paged, 16-token blocks", lw=1)
ax.plot(hours, usage["held"] / 1e3, label="tokens held", lw=1, ls=":")
ax.set(xlabel="hour of the day", ylabel="thousand token slots", xlim=(0, 24),
       title="KV cache slots in use over a simulated day (seeded)")
ax.legend(fontsize=8)
fig.tight_layout()
print(f"peak slots: contiguous {usage['reserved'].max():,.0f}, paged {usage['paged'].max():,.0f}, "
      f"held {usage['held'].max():,.0f}")

# %% [markdown]
# The contiguous reservation's waste is most of the cache, paging's a few percent or less, and
# paging's waste grows with the block size: half a block per sequence on average. Smaller blocks
# waste less but mean longer block tables and smaller, less efficient reads for the attention
# kernel; engines settle on 16 tokens or so (vLLM's default block size is 16).

# %% [markdown]
# ## 2. Prefix caching on the course model
#
# Many requests start the same way: a system prompt, a few-shot preamble, a shared document.
# With prefix caching, each full block is known by a hash of its tokens and of its parent's hash,
# so a new request whose first blocks hash the same reuses them: their keys and values are read
# from the cache, and prefill runs only on the rest (section 4 has you write this cache). Here the course's allocator
# (`labsupport.paged_cache.BlockAllocator(..., prefix_caching=True)`) keeps the block tables and
# hashes, and `PagedKVStore` holds the keys and values of every layer in blocks.
# `prefix_cached_prefill` does one request: allocate (finding the cached prefix), copy the cached
# keys and values into a contiguous cache, prefill the rest with `model.prefill(..., start=hit)`,
# and write the new positions back to their blocks.
#
# Every request below shares one system prompt and adds its own question. Prefill time is
# measured with and without the cache, and the logits are compared: reusing keys and values must
# not change the answer.

# %%
model_name = settings.pick(small="tiny-20m", full="small-63m")
cfg = get_model(model_name)
model = Transformer(cfg, device=DEVICE, dtype=torch.float32)
system_len, question_len, n_requests, block = settings.pick(small=(440, 32, 8, 16), full=(2040, 128, 32, 16))
system_prompt = model.random_prompt(1, system_len, seed=1)[0].tolist()
prompts = [system_prompt + model.random_prompt(1, question_len, seed=100 + i)[0].tolist() for i in range(n_requests)]
blocks_total = n_requests * -(-(system_len + question_len) // block) + 8


def serve(prefix_caching: bool):
    """Prefill every request in turn, as a server would; returns (logits per request, allocator)."""
    allocator = CourseAllocator(blocks_total, block, prefix_caching=prefix_caching)
    store = PagedKVStore(cfg, blocks_total, block, device=DEVICE, dtype=torch.float32)
    logits = []
    for i, prompt in enumerate(prompts):
        out, _ = prefix_cached_prefill(model, allocator, store, i, prompt)
        logits.append(out)
        allocator.free(i)  # the request is done; its full blocks stay cached
    return logits, allocator


cold_logits, _ = serve(False)
warm_logits, allocator = serve(True)
agree = max((a - b).abs().max().item() for a, b in zip(cold_logits, warm_logits))
print(f"{model_name}, {n_requests} requests of {system_len} shared + {question_len} own tokens, {block}-token blocks")
print(f"prefix-cache hit rate: {allocator.hit_rate:.1%} of prompt tokens "
      f"({allocator.hit_tokens:,} of {allocator.query_tokens:,})")
print(f"largest logit difference, cached vs not: {agree:.2e}")

# %% [markdown]
# Now the time of one request's prefill, a miss against a hit. Each timed call uses a fresh
# allocator and store, and for the hit they already hold the system prompt from an earlier
# request, as they would on a server that has seen it.

# %%
def one_request(prefix_caching: bool):
    """A function that prefills request 1 (and frees it), after request 0 went through."""
    allocator = CourseAllocator(blocks_total, block, prefix_caching=prefix_caching)
    store = PagedKVStore(cfg, blocks_total, block, device=DEVICE, dtype=torch.float32)
    prefix_cached_prefill(model, allocator, store, "earlier", prompts[0])  # leaves the prefix cached
    allocator.free("earlier")

    def run():
        prefix_cached_prefill(model, allocator, store, "timed", prompts[1])
        allocator.free("timed")

    return run


t_miss = benchmark(one_request(False), max_time_s=1.0)
t_hit = benchmark(one_request(True), max_time_s=1.0)
where = "GPU" if DEVICE.type == "cuda" else "CPU (plain torch, no Triton: a real timing of this small model on a CPU)"
print(f"prefill of one {system_len + question_len}-token request on the {where}:")
print(f"  miss (no prefix caching): {t_miss.median_ms:8.2f} ms{t_miss.label()}")
print(f"  hit  (prefix cached):     {t_hit.median_ms:8.2f} ms{t_hit.label()}")
print(f"  the hit takes {t_hit.median_s / t_miss.median_s:.0%} of the miss's time")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# %%
request = f"prefill of one {system_len + question_len}-token request ({system_len} shared) on the course model"
ledger.record("10_cache_ops", [
    ledger.Figure("prefill_miss_ms", t_miss.median_ms, "ms", f"{request}, no prefix caching; median time"),
    ledger.Figure("prefill_hit_ms", t_hit.median_ms, "ms", f"{request}, prefix cached; median time"),
    ledger.Figure("hit_over_miss", t_hit.median_s / t_miss.median_s, "ratio", f"{request}: hit time over miss time"),
], timings_real=True)  # plain torch: real timings on a CPU too

# %% [markdown]
# The hit rate falls short of the shared share of each prompt for two reasons: the first request
# finds nothing cached, and the system prompt here is not a whole number of blocks. Only full
# blocks are hashed, and the block that mixes the last system tokens with a request's own question
# is different for every request, so those few system tokens are computed again each time.
# A hit saves less time than its share of the tokens: the uncached tokens still attend to all the cached ones, copying the cached keys and
# values costs something, and the model's fixed costs per call remain.

# %% [markdown]
# ## 3. A block allocator
#
# The cache is `num_blocks` physical blocks of `block_size` token slots. Each sequence has a
# **block table**: a list whose entry `i` is the physical block holding its tokens
# `i * block_size` to `(i + 1) * block_size - 1`. Token position `p` lives in slot
# `p % block_size` of block `table[p // block_size]`.
#
# Sequences can share blocks. Parallel sampling (`n` answers to one prompt) and beam search
# **fork** a sequence: the child gets a copy of the parent's table, so both point at the same
# blocks, and every shared block's **reference count** (how many tables hold it) goes up by one.
# A shared block must never be written in place, or the other sequence would see the write: when
# a sequence appends a token to a shared, partly filled last block, it first takes a new block,
# copies the old block's contents into it, and points its own table there (**copy-on-write**).
# **Freeing** a sequence drops one reference from each of its blocks; a block goes back to the
# free list only when nobody holds it. (This is the vLLM paper's design and vLLM V0's; the V1
# engine splits a request for several samples into independent requests that share only full
# blocks, through prefix caching, so it needs no copy-on-write. Chapter 10 compares the two.)
#
# ### Exercise 1: `BlockAllocator`
#
# Write a class with exactly this interface (sequence ids are ints; blocks are ints in
# `[0, num_blocks)`):
#
# | method | does | returns |
# | --- | --- | --- |
# | `BlockAllocator(num_blocks, block_size)` | all blocks free | |
# | `allocate(seq_id, num_tokens)` | new sequence holding `num_tokens` tokens (1 or more): `ceil(num_tokens / block_size)` blocks, each with reference count 1. If fewer blocks are free, raise `MemoryError` **and change nothing** | its block table, a list |
# | `append_token(seq_id)` | room for the sequence's next token (see below) | `(block, offset, copy)` |
# | `fork(parent_id, child_id)` | the child shares every block of the parent (one more reference each) | anything |
# | `free(seq_id)` | one reference fewer on each of its blocks; a block at 0 is free again; the id is forgotten | anything |
# | `block_table(seq_id)` | | the sequence's blocks, logical block 0 first |
# | `ref_count(block)` | | how many tables hold `block` |
# | `free_blocks()` | | the set of free block ids |
#
# `append_token` for a sequence that holds `n` tokens: the new token is number `n` (from 0), so it
# goes to `offset = n % block_size` of the last block.
#
# * If `offset == 0` the last block is full (or there is none): take a free block, append it to
#   the table, return `(new_block, 0, None)`.
# * Else, if the last block is held by this sequence alone, return `(last_block, offset, None)`.
# * Else the last block is shared: take a free block `new`, put it in place of the last block in
#   this table, drop one reference from the old one, and return `(new, offset, (old, new))`: the
#   caller copies block `old`'s contents into `new` before writing the token.
#
# Copy only in that last case: a block this sequence holds alone is written in place. Raise
# `MemoryError` when `append_token` needs a block and none is free, and change nothing (take the
# new block before touching the table or a count). The check runs short scenarios aimed at the
# classic mistakes, then three seeded random sequences of 120 operations.
# After every operation it checks that each table has the right length and valid, distinct
# blocks; each reference count equals the number of tables that hold the block; no block is both
# free and in use; every block is one or the other (nothing leaked). It also writes a token value
# into each slot you hand out and reads every sequence back through its table, so a shared block
# written in place, or a block handed out while someone still holds it, shows up as corrupted data.

# %%
class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        # BEGIN SOLUTION: keep block_size, a free list of every block, a reference count per block, each sequence's table and length
        self.block_size = block_size
        self.free_list = list(range(num_blocks))  # blocks nobody holds
        self.refs = [0] * num_blocks  # how many tables hold each block
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens each sequence holds
        # END SOLUTION

    def _take(self) -> int:
        """A helper: take one free block and give it reference count 1 (MemoryError if none)."""
        # BEGIN SOLUTION: pop a block from the free list (MemoryError if it is empty) and set its count to 1
        if not self.free_list:
            raise MemoryError("no free block")
        block = self.free_list.pop()
        self.refs[block] = 1
        return block
        # END SOLUTION

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        # BEGIN SOLUTION: ceil(num_tokens / block_size) blocks, MemoryError before taking any if too few are free
        need = -(-num_tokens // self.block_size)  # ceil
        if need > len(self.free_list):
            raise MemoryError(f"sequence {seq_id} needs {need} blocks, {len(self.free_list)} are free")
        self.tables[seq_id] = [self._take() for _ in range(need)]
        self.lengths[seq_id] = num_tokens
        return list(self.tables[seq_id])
        # END SOLUTION

    def append_token(self, seq_id: int):
        # BEGIN SOLUTION: a new block when the last is full; copy-on-write when it is shared; return (block, offset, copy)
        table, n = self.tables[seq_id], self.lengths[seq_id]
        offset = n % self.block_size
        copy = None
        if offset == 0:  # the last block is full (or there is none)
            table.append(self._take())
        elif self.refs[table[-1]] > 1:  # shared and partly filled: copy on write
            old, new = table[-1], self._take()
            self.refs[old] -= 1
            table[-1] = new
            copy = (old, new)
        self.lengths[seq_id] = n + 1
        return table[-1], offset, copy
        # END SOLUTION

    def fork(self, parent_id: int, child_id: int) -> None:
        # BEGIN SOLUTION: the child gets a copy of the parent's table and length; one more reference on each block
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        for block in self.tables[child_id]:
            self.refs[block] += 1
        # END SOLUTION

    def free(self, seq_id: int) -> None:
        # BEGIN SOLUTION: one reference fewer on each block; back to the free list at 0; forget the sequence
        for block in self.tables.pop(seq_id):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_list.append(block)
        del self.lengths[seq_id]
        # END SOLUTION

    def block_table(self, seq_id: int) -> list[int]:
        # BEGIN SOLUTION: a copy of the sequence's table
        return list(self.tables[seq_id])
        # END SOLUTION

    def ref_count(self, block: int) -> int:
        # BEGIN SOLUTION: how many tables hold the block
        return self.refs[block]
        # END SOLUTION

    def free_blocks(self) -> set[int]:
        # BEGIN SOLUTION: the free blocks, as a set
        return set(self.free_list)
        # END SOLUTION


# %%
check_block_allocator(BlockAllocator)

# %% [markdown]
# What sharing buys: four samples of one 1,000-token prompt, each generating 200 tokens, with
# 16-token blocks. Without forking, every sample holds its own copy of the prompt.

# %% tags=["nbval-check-output"]
shared = BlockAllocator(1000, 16)
shared.allocate(0, 1000)
for child in (1, 2, 3):
    shared.fork(0, child)
for seq in range(4):
    for _ in range(200):
        shared.append_token(seq)
separate = BlockAllocator(1000, 16)
for seq in range(4):
    separate.allocate(seq, 1000)
    for _ in range(200):
        separate.append_token(seq)
used_shared = 1000 - len(shared.free_blocks())
used_separate = 1000 - len(separate.free_blocks())
print(f"blocks in use: forked {used_shared}, separate {used_separate} "
      f"({1 - used_shared / used_separate:.0%} fewer with copy-on-write)")

# %% [markdown]
# ## 4. A prefix cache of your own
#
# Section 2 used the course's allocator to cache a shared system prompt. Now you write that part.
# The idea, as vLLM's automatic prefix caching and nano-vllm's block manager both have it:
#
# * **A full block is known by its prefix.** Its keys and values depend on every token before
#   it, not only its own, so its identity is a hash of its tokens *and* of the previous block's
#   hash: `h_i = hash((h_{i-1}, tuple(tokens of block i)))`, with `h_{-1} = None`. Equal hashes
#   then mean equal prefixes (up to a collision of Python's hash; engines that share caches
#   between processes use SHA-256). A partly filled last block has no hash: more tokens will be
#   written into it.
# * **Lookup on admission.** A new sequence's full blocks are hashed in order; the longest run of
#   leading hashes already cached is reused (the first miss ends the run: a block after a miss has
#   a prefix nobody computed), and only the rest gets new blocks and is computed.
# * **Reference counts.** A reused block gains a reference, like a forked one. Freeing a sequence
#   drops one reference from each of its blocks.
# * **Cached, not freed.** A full block whose count falls to 0 keeps its contents and its hash:
#   it is *evictable*, still findable, until a new block is needed and no plain free block is
#   left. Then the **least recently released** evictable block is reused for new data and its
#   hash forgotten. A sequence releases its blocks from the last to the first, so its tail is
#   evicted before its head (the head is the prefix others are likelier to share). A hit on an
#   evictable block takes it off the evictable list; its next release puts it at the recent end.
#
# (vLLM V1 keeps the evictable blocks in one doubly linked free queue, appended in that reverse
# order on release; nano-vllm keeps freed blocks in a deque with their hashes until reused.)
#
# ### Exercise 2: `PrefixCachingAllocator`
#
# A standalone class (sequence ids are ints; blocks are ints in `[0, num_blocks)`):
#
# | method | does | returns |
# | --- | --- | --- |
# | `PrefixCachingAllocator(num_blocks, block_size)` | all blocks free, nothing cached | |
# | `allocate(seq_id, token_ids)` | hashes the `len(token_ids) // block_size` full blocks as above; reuses the longest cached run (one more reference each); takes `ceil(len / block_size)` minus the hits new blocks, each with count 1, and caches each new full block's hash (unless that hash is already cached). If the plain free and evictable blocks (not counting the evictable ones this allocation reuses) are too few, raise `MemoryError` **and change nothing** | its block table |
# | `cached_tokens(seq_id)` | | tokens found cached at `allocate`: `block_size` times the hits |
# | `fork(parent_id, child_id)` | the child shares every block of the parent (one more reference each) | anything |
# | `free(seq_id)` | one reference fewer on each block, last block first; a block at 0 becomes the most recently released evictable block if it has a hash, else a plain free block | anything |
# | `block_table(seq_id)`, `ref_count(block)` | as in exercise 1 | |
# | `free_blocks()` | | the set of blocks a new allocation may take: plain free and evictable |
#
# A new block comes from the plain free blocks first; only when there are none is the least
# recently released evictable block taken (its hash forgotten).
#
# The check runs the same operations on your class and on the course's allocator
# (`BlockAllocator(..., prefix_caching=True)`): short traces aimed at the classic mistakes (a
# shared system prompt, the same block after a different prefix, forks, a cache where every block
# is held, eviction order, a prompt whose hits are evictable blocks when too few others are free),
# then three seeded random traces. After every operation it compares the
# cached tokens, each block's reference count, which sequences share which blocks and how many
# blocks are free, and, as for exercise 1, reads every live sequence back through its table:
# each slot holds a value that stands for the keys and values of its whole prefix, written when
# that position was computed, so a block reused for the wrong prefix, or evicted while held,
# reads back wrong.

# %%
class PrefixCachingAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        # BEGIN SOLUTION: a free list, the evictable cached blocks in release order, hash <-> block maps, reference counts, tables, hits
        self.block_size = block_size
        self.free_list = list(range(num_blocks))  # blocks that hold nothing cached
        self.evictable = OrderedDict()  # cached blocks nobody holds: block -> hash, least recently released first
        self.by_hash = {}  # hash -> the block holding that prefix
        self.hash_of = {}  # block -> its hash (full, cached blocks only)
        self.refs = [0] * num_blocks
        self.tables = {}
        self.cached = {}  # seq -> tokens found in the cache when it was allocated
        # END SOLUTION

    def _take(self) -> int:
        """A helper: a block for new data, reference count 1: a free one, else evict the least recently released."""
        # BEGIN SOLUTION: pop a free block; else pop the oldest evictable one and forget its hash
        if self.free_list:
            block = self.free_list.pop()
        else:
            block, h = self.evictable.popitem(last=False)  # the least recently released
            del self.by_hash[h], self.hash_of[block]
        self.refs[block] = 1
        return block
        # END SOLUTION

    def allocate(self, seq_id, token_ids) -> list[int]:
        # BEGIN SOLUTION: chain the full blocks' hashes, reuse the longest cached run, MemoryError before changing anything, new blocks for the rest
        bs = self.block_size
        hashes, parent = [], None
        for i in range(len(token_ids) // bs):  # full blocks only
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        hits = []
        for h in hashes:
            if h not in self.by_hash:
                break
            hits.append(self.by_hash[h])
        need = -(-len(token_ids) // bs) - len(hits)
        revived = sum(1 for b in hits if self.refs[b] == 0)  # evictable now, held once reused
        if need > len(self.free_list) + len(self.evictable) - revived:
            raise MemoryError(f"sequence {seq_id} needs {need} new blocks")
        table = []
        for b in hits:
            if self.refs[b] == 0:
                del self.evictable[b]
            self.refs[b] += 1
            table.append(b)
        for i in range(len(hits), len(hits) + need):
            b = self._take()
            table.append(b)
            if i < len(hashes) and hashes[i] not in self.by_hash:  # a new full block: findable from now on
                self.by_hash[hashes[i]] = b
                self.hash_of[b] = hashes[i]
        self.tables[seq_id] = table
        self.cached[seq_id] = len(hits) * bs
        return list(table)
        # END SOLUTION

    def cached_tokens(self, seq_id) -> int:
        # BEGIN SOLUTION: the tokens found cached when the sequence was allocated
        return self.cached[seq_id]
        # END SOLUTION

    def fork(self, parent_id, child_id) -> None:
        # BEGIN SOLUTION: the child shares the parent's table; one more reference on each block
        self.tables[child_id] = list(self.tables[parent_id])
        self.cached[child_id] = self.cached[parent_id]
        for b in self.tables[child_id]:
            self.refs[b] += 1
        # END SOLUTION

    def free(self, seq_id) -> None:
        # BEGIN SOLUTION: last block first, one reference fewer; at 0 a hashed block becomes the most recent evictable, another one free
        for b in reversed(self.tables.pop(seq_id)):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = self.hash_of[b]
                else:
                    self.free_list.append(b)
        del self.cached[seq_id]
        # END SOLUTION

    def block_table(self, seq_id) -> list[int]:
        # BEGIN SOLUTION: a copy of the table
        return list(self.tables[seq_id])
        # END SOLUTION

    def ref_count(self, block: int) -> int:
        # BEGIN SOLUTION: how many tables hold the block
        return self.refs[block]
        # END SOLUTION

    def free_blocks(self) -> set[int]:
        # BEGIN SOLUTION: free blocks and cached blocks nobody holds
        return set(self.free_list) | set(self.evictable)
        # END SOLUTION


# %%
check_prefix_cache(PrefixCachingAllocator)

# %% [markdown]
# Your allocator in section 2's place, on its first three requests (the first finds nothing, the
# next two the system prompt): the course model's prefill reusing the keys and values your
# allocator finds must give the logits of a prefill without any cache.

# %%
def serve_with(allocator_cls, count: int):
    """Section 2's first ``count`` requests, prefilled in turn through ``allocator_cls``; (logits, cached tokens)."""
    allocator = allocator_cls(blocks_total, block)
    store = PagedKVStore(cfg, blocks_total, block, device=DEVICE, dtype=torch.float32)
    logits, hits = [], []
    for i, prompt in enumerate(prompts[:count]):
        out, hit = prefix_cached_prefill(model, allocator, store, i, prompt)
        logits.append(out)
        hits.append(hit)
        allocator.free(i)
    return logits, hits


my_logits, my_hits = serve_with(PrefixCachingAllocator, 3)
print(f"cached tokens per request, your allocator: {my_hits} (of {[len(p) for p in prompts[:3]]} prompt tokens)")
print(f"largest logit difference against no caching: "
      f"{max((a - b).abs().max().item() for a, b in zip(cold_logits, my_logits)):.2e}")

# %% [markdown]
# ## 5. Paged decode attention in Triton
#
# In decode, each sequence brings one new query per head and attends to all the tokens in its
# cache. With a paged cache those keys and values are scattered over physical blocks in any
# order, and the kernel finds them through the block table. The arguments (the same as the
# course's `labsupport.paged_attention.paged_decode_attention`):
#
# | argument | shape | |
# | --- | --- | --- |
# | `q` | `(B, H, D)` | one query per sequence and query head |
# | `k_cache`, `v_cache` | `(num_blocks, block_size, Hkv, D)` | the paged cache of one layer |
# | `block_tables` | `(B, max_blocks)` int32 | entry `[b, i]`: physical block of sequence `b`'s logical block `i`; entries past its blocks are padding |
# | `seq_lens` | `(B,)` int32 | tokens in each sequence's cache, 1 or more |
#
# It returns `(B, H, D)` in `q`'s dtype: `softmax(q . k / sqrt(D)) @ v` over the sequence's
# `seq_lens[b]` tokens. With grouped-query attention (`H` a multiple of `Hkv`), query head `h`
# reads KV head `h // (H // Hkv)`. Here is the spec on a small case, and a contiguous cache
# holding the same tokens giving the same answer:

# %%
k_demo, v_demo, tables_demo, lens_demo = random_paged_cache([5, 1, 9], n_kv_heads=2, head_dim=16, block_size=4, seed=0)
print("block tables (physical blocks in random order, -1 = padding):\n", tables_demo)
q_demo = torch.randn(3, 4, 16)
paged_out = paged_decode_attention(q_demo, k_demo, v_demo, tables_demo, lens_demo)
k_flat = torch.zeros(3, 9, 2, 16)
v_flat = torch.zeros(3, 9, 2, 16)
for row, n in enumerate(lens_demo.tolist()):
    k_flat[row, :n] = gather_contiguous(k_demo, tables_demo, n, row)
    v_flat[row, :n] = gather_contiguous(v_demo, tables_demo, n, row)
print("same as contiguous attention:",
      torch.allclose(paged_out, contiguous_decode_attention(q_demo, k_flat, v_flat, lens_demo), atol=1e-6))

# %% [markdown]
# ### Exercise 3: the kernel and its wrapper
#
# Use one program per (sequence, KV head): grid `(B, Hkv)`. A program loads the `GROUP = H // Hkv`
# queries that share its KV head as a `(GROUP_PAD, D)` tile (`GROUP_PAD`, a power of two, with
# a mask for the rows past `GROUP`), so each key and value block is read once for the whole
# group. Then it walks the sequence's logical blocks `i = 0 .. cdiv(seq_len, BLOCK_SIZE) - 1`:
#
# 1. load the physical block id from the block table: `block_tables[b, i]`;
# 2. load that block's `(BLOCK_SIZE, D)` keys and values for this KV head (use the strides of
#    `k_cache`), masking slots at positions `>= seq_len`: the last block may be partly filled, and
#    what lies past the end is garbage (the check fills it with random numbers);
# 3. scores `(GROUP_PAD, BLOCK_SIZE)` as `tl.sum(q[:, None, :] * k[None, :, :], axis=2)` times
#    `1/sqrt(D)` (a `tl.dot` would need every side at least 16 on a GPU, and groups and blocks
#    can be smaller), masked positions set to `-inf`;
# 4. the online softmax you wrote in lab 07: running max `m`, sum `l`, accumulator `acc`, all
#    float32.
#
# Write `out = acc / l` for the group's heads. Do the arithmetic in float32 (`.to(tl.float32)`
# after loading) and store in the output's dtype. Convert the physical block id to 64 bits before
# multiplying by a stride (`.to(tl.int64)`): a large cache passes 2**31 elements. Block sizes and
# head dims are powers of two here (`tl.arange` needs one; the course's kernel also takes others,
# such as 12-token blocks or head dim 80, by padding the tile to a power of two and masking).
# The check runs block tables in shuffled physical order, partly filled last blocks, sequences of length 1, groups of 1, 2, 3 and 4 query heads per KV
# head, float32 and float16 (bfloat16 too on a GPU), and it wants the output written by your
# kernel, with no torch matmul or softmax. On a GPU, Triton compiles the kernel when the wrapper
# first launches it: a kernel that still contains its `raise NotImplementedError` line fails there
# with `unsupported AST node type: Raise`, which only means the body is not written yet.

# %%
@triton.jit
def paged_decode_attention_kernel(
    q_ptr,  # (B, H, D)
    k_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D)
    v_ptr,  # (num_blocks, BLOCK_SIZE, Hkv, D)
    tables_ptr,  # (B, max_blocks) int32
    lens_ptr,  # (B,) int32
    out_ptr,  # (B, H, D)
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    sm_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # BEGIN SOLUTION: one program per (sequence, KV head): walk the block table with an online softmax
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + offs_g  # the query heads that read this KV head
    head_ok = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)  # (GROUP_PAD, D)
    seq_len = tl.load(lens_ptr + b)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        physical = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
        valid = i * BLOCK_SIZE + offs_t < seq_len  # (BLOCK_SIZE,)
        k = tl.load(k_ptr + physical * stride_kn + offs_t[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)  # (BLOCK_SIZE, D)
        v = tl.load(v_ptr + physical * stride_vn + offs_t[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # (GROUP_PAD, BLOCK_SIZE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (GROUP_PAD, D)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    # END SOLUTION


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens):
    # BEGIN SOLUTION: make the last dims contiguous, allocate out, launch grid (B, Hkv)
    b, h, d = q.shape
    h_kv, block_size = k_cache.shape[2], k_cache.shape[1]
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    group = h // h_kv
    paged_decode_attention_kernel[(b, h_kv)](
        q, k_cache, v_cache, tables, lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        1.0 / math.sqrt(d),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=d, BLOCK_SIZE=block_size,
    )
    return out
    # END SOLUTION


# %%
check_paged_attention(paged_attention)

# %% [markdown]
# ### Paged against contiguous
#
# Paging adds one table lookup per block and reads each block from wherever it lies. What it
# costs in bytes is small: the table entries, against the keys and values themselves. The formula
# is `labsupport.paged_attention.paged_decode_bytes`, counted the way the course's kernel works:
# one program per sequence and KV head, each reading its group's queries once, its sequence's
# keys and values (masked slots not read), one table entry per block and its length, and writing
# its group's outputs. Contiguous attention moves the same minus the table.
#
# In the Triton interpreter the bytes your kernel really loads and stores can be **counted**:
# `labsupport.interpreter_bytes.count_bytes` watches every `tl.load` and `tl.store` and adds up
# the lanes that are not masked off. If your count differs from the formula, your kernel moves
# something the formula does not (a query reloaded in every iteration, a tail slot read and then
# discarded): the per-argument line says where. On a GPU nothing passes through Python, so the
# cell shows the formula and times both; in the interpreter its timings (labelled) are of Python
# emulating the kernel.

# %%
bench_lens = settings.pick(small=[[40, 7, 100]], full=[[512] * 32, [4096] * 16, [1000, 3000, 17, 8000] * 4])
bench_heads, bench_kv_heads, bench_dim, bench_block = settings.pick(small=(8, 2, 64, 16), full=(32, 8, 128, 16))
bench_dtype = settings.pick(small=torch.float32, full=torch.float16)
for lens in bench_lens:
    k_cache, v_cache, tables, seq_lens = random_paged_cache(lens, bench_kv_heads, bench_dim, bench_block,
                                                            dtype=bench_dtype, device=DEVICE, seed=1)
    q = torch.randn(len(lens), bench_heads, bench_dim, device=DEVICE, dtype=bench_dtype)
    s_max = max(lens)
    k_flat = torch.zeros(len(lens), s_max, bench_kv_heads, bench_dim, device=DEVICE, dtype=bench_dtype)
    v_flat = torch.zeros_like(k_flat)
    for row, n in enumerate(lens):
        k_flat[row, :n] = gather_contiguous(k_cache, tables, n, row)
        v_flat[row, :n] = gather_contiguous(v_cache, tables, n, row)
    flat = contiguous_decode_attention(q, k_flat, v_flat, seq_lens)
    paged_b = paged_decode_bytes(lens, bench_heads, bench_kv_heads, bench_dim, bench_block, dtype_bytes=q.element_size())
    flat_b = contiguous_decode_bytes(lens, bench_heads, bench_kv_heads, bench_dim, dtype_bytes=q.element_size())
    if settings.interpreter:
        with count_bytes() as counted:
            mine = paged_attention(q, k_cache, v_cache, tables, seq_lens)
    else:
        mine = paged_attention(q, k_cache, v_cache, tables, seq_lens)
    print(f"B={len(lens)}, {sum(lens):,} cached tokens, {str(bench_dtype)[6:]}: largest difference from contiguous "
          f"{(mine.float() - flat.float()).abs().max():.2e}")
    print(f"    bytes, formula: paged {paged_b:,}, contiguous {flat_b:,} (paging adds {paged_b / flat_b - 1:.2%})")
    if settings.interpreter:
        print(f"    bytes your kernel moved, counted in the interpreter: {counted.total:,} "
              f"({counted.total / paged_b:.3f}x the formula)")
        print("    by argument (loaded + stored): " + ", ".join(
            f"{name} {t.total:,}" for name, t in counted.by_argument.items()))
    t_mine = benchmark(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens), uses_triton=True, max_time_s=0.5)
    t_flat = benchmark(lambda: contiguous_decode_attention(q, k_flat, v_flat, seq_lens), max_time_s=0.5)
    print(f"    your paged kernel {t_mine.median_ms:.3f} ms{t_mine.label()}; contiguous in torch "
          f"{t_flat.median_ms:.3f} ms")

# %% [markdown]
# On a GPU, `python -m labsupport.bench_cache_ops` times the course's kernel on shuffled and
# in-order block tables against PyTorch's SDPA on a contiguous cache. Chapter 10 shows what it
# measured on an H200: the course's kernel (one program per sequence and KV head, walking 16-token
# blocks one by one) was several times slower than SDPA on a contiguous cache, while the shuffled
# tables cost it nothing measurable, so what a paged kernel needs is parallelism over the
# sequence and larger tiles, not contiguous blocks. The comparison printed above, against plain
# torch attention, is not that benchmark.

# %% [markdown]
# ## What you built
#
# * Contiguous reservations waste most of the cache; paging leaves only each sequence's last
#   block partly empty.
# * An allocator with block tables, reference counts and copy-on-write, so sequences share what
#   they have in common and never see each other's writes.
# * A decode attention kernel that reads the cache through a block table: the same answer as a
#   contiguous cache, for a few table reads more.
# * Prefix caching: the keys and values of a shared prompt computed once and reused, found by
#   hashes chained through the prefix, held by reference counts and evicted least recently used.
