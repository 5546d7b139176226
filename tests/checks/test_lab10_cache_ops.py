"""The cache-ops checks accept correct work and reject planted mistakes, one test each.

The allocator mutants are small classes with the lab's interface and one mistake each; the paged
attention mutants are real Triton kernels with one mistake each, as the issue names them
(logical block used as physical, tail not masked, GQA group mapped wrongly).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
import triton
import triton.language as tl

from labsupport import paged_attention as P
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_block_allocator, check_paged_attention, check_prefix_cache
from labsupport.checks import lab10_cache_ops as lab10
from labsupport.paged_cache import BlockAllocator

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

paged_decode_attention = unguarded(P.paged_decode_attention)
paged_decode_attention_triton = unguarded(P.paged_decode_attention_triton)


# --- allocator mutants ------------------------------------------------------------------------


class Allocator:
    """A plain correct allocator with the lab's interface; the flags plant one mistake each."""

    fork_refcount = True
    free_checks_refcount = True
    copy_on_write = True
    free_returns_blocks = True
    atomic_allocate = True
    copy_only_shared = True
    fork_shares = True
    atomic_copy_on_write = True
    free_forgets = True
    hands_out_copies = True

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_list = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables = {}
        self.lengths = {}

    def _take(self):
        if not self.free_list:
            raise MemoryError("no free block")
        b = self.free_list.pop()
        self.refs[b] = 1
        return b

    def allocate(self, seq_id, num_tokens):
        need = -(-num_tokens // self.block_size)
        if self.atomic_allocate and need > len(self.free_list):
            raise MemoryError(f"need {need} blocks")
        table = []
        for _ in range(need):
            table.append(self._take())  # the non-atomic mutant raises halfway, keeping what it took
        self.tables[seq_id] = table
        self.lengths[seq_id] = num_tokens
        return list(table) if self.hands_out_copies else table

    def append_token(self, seq_id):
        table, n = self.tables[seq_id], self.lengths[seq_id]
        offset = n % self.block_size
        copy = None
        if offset == 0:
            table.append(self._take())
        elif self.copy_on_write and (self.refs[table[-1]] > 1 or not self.copy_only_shared):
            if not self.atomic_copy_on_write:
                self.refs[table[-1]] -= 1  # dropped before _take, which may raise: the count is lost
            new = self._take()
            if self.atomic_copy_on_write:
                self.refs[table[-1]] -= 1
            copy = (table[-1], new)
            table[-1] = new
        self.lengths[seq_id] = n + 1
        return table[-1], offset, copy

    def fork(self, parent_id, child_id):
        if not self.fork_shares:  # a private copy of every block: correct data, no memory saved
            self.tables[child_id] = [self._take() for _ in self.tables[parent_id]]
            self.lengths[child_id] = self.lengths[parent_id]
            return
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        if self.fork_refcount:
            for b in self.tables[child_id]:
                self.refs[b] += 1

    def free(self, seq_id):
        for b in self.tables.pop(seq_id) if self.free_forgets else self.tables[seq_id]:
            self.refs[b] = max(0, self.refs[b] - 1)
            if self.free_returns_blocks and (self.refs[b] == 0 or not self.free_checks_refcount):
                if b not in self.free_list:
                    self.free_list.append(b)
        if self.free_forgets:
            del self.lengths[seq_id]

    def block_table(self, seq_id):
        return list(self.tables[seq_id]) if self.hands_out_copies else self.tables[seq_id]

    def ref_count(self, block):
        return self.refs[block]

    def free_blocks(self):
        return set(self.free_list)


def mutant(**flags):
    return type("BlockAllocator", (Allocator,), flags)


class Stub:
    def __init__(self, num_blocks, block_size):
        raise NotImplementedError("Exercise: write the block allocator")


ALLOCATOR_MUTANTS = {
    "fork_without_reference_count": (mutant(fork_refcount=False), "fork without a reference count"),
    "free_of_a_shared_block": (mutant(free_checks_refcount=False), "free of a shared block"),
    "no_copy_on_write": (mutant(copy_on_write=False), "no copy-on-write"),
    "free_leaks_blocks": (mutant(free_returns_blocks=False), "leaked"),
    "allocate_not_atomic": (mutant(atomic_allocate=False), "not atomic"),
    "copy_on_every_write": (mutant(copy_only_shared=False), "copies a block nobody else holds"),
    "fork_copies_instead_of_sharing": (mutant(fork_shares=False), "the child shares the parent's blocks"),
    "copy_on_write_not_atomic": (mutant(atomic_copy_on_write=False), "append_token raised MemoryError but had"),
    "free_keeps_the_table": (mutant(free_forgets=False), "block_table(0) still returns"),
    "tables_handed_out_are_the_internal_list": (mutant(hands_out_copies=False), "returned the allocator's own list"),
}


def test_the_courses_allocator_and_the_mutant_harness_pass(capsys):
    check_block_allocator(BlockAllocator)
    check_block_allocator(Allocator)
    assert capsys.readouterr().out.count("PASSED check_block_allocator") == 2


@pytest.mark.parametrize("name", ALLOCATOR_MUTANTS)
def test_allocator_check_rejects(name):
    cls, expected = ALLOCATOR_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_block_allocator(cls)
    assert expected in str(info.value), str(info.value)


def test_allocator_check_reports_the_stub():
    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_block_allocator(Stub)
    assert info.value.reason == "not done"


def test_allocator_check_refuses_the_courses_class_from_a_learner():
    class Mine(BlockAllocator):
        pass

    class Wrapper:
        def __init__(self, num_blocks, block_size):
            self.inner = BlockAllocator(num_blocks, block_size)

    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="derives from"):
            check_block_allocator(Mine)
        with pytest.raises(CheckFailed, match="block_allocator_answer"):
            check_block_allocator(Wrapper)


def test_allocator_check_names_a_wrong_offset():
    class WrongOffset(Allocator):
        def append_token(self, seq_id):
            block, offset, copy = super().append_token(seq_id)
            return block, offset + 1, copy

    with pytest.raises(CheckFailed, match="offset"):
        check_block_allocator(WrongOffset)


# --- paged attention mutants: Triton kernels -----------------------------------------------------


@triton.jit
def _mutant_paged_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, out_ptr, max_blocks, sm_scale,
                         H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         LOGICAL: tl.constexpr, TAIL_MASK: tl.constexpr, GQA_MOD: tl.constexpr,
                         ROW0: tl.constexpr, MASK_EVERY_BLOCK: tl.constexpr, UNSAFE: tl.constexpr,
                         MAX_FROM_ZERO: tl.constexpr, IN_DTYPE: tl.constexpr):
    """One program per (sequence, query head), contiguous inputs; the flags plant mistakes."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if GQA_MOD:
        kvh = h % HKV
    else:
        kvh = h // (H // HKV)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    q = tl.load(q_ptr + (b * H + h) * D + offs_d)
    if not IN_DTYPE:
        q = q.to(tl.float32)
    n = tl.load(len_ptr + b)
    m_i = 0.0 if MAX_FROM_ZERO else float("-inf")
    l_i = 0.0
    if IN_DTYPE:  # the arithmetic in the cache's dtype (float16 sums)
        acc = tl.zeros((D,), dtype=q_ptr.dtype.element_ty)
    else:
        acc = tl.zeros((D,), dtype=tl.float32)
    for i in range(0, tl.cdiv(n, BS)):
        if LOGICAL:
            phys = i
        elif ROW0:  # the table's row stride forgotten: every sequence reads sequence 0's table
            phys = tl.load(bt_ptr + i)
        else:
            phys = tl.load(bt_ptr + b * max_blocks + i)
        pos = i * BS + offs_t
        if MASK_EVERY_BLOCK:  # the last block's fill applied to every block
            valid = offs_t < n - (tl.cdiv(n, BS) - 1) * BS
        elif TAIL_MASK:
            valid = pos < n
        else:
            valid = pos >= 0
        base = (phys * BS + offs_t[:, None]) * HKV * D + kvh * D + offs_d[None, :]
        k = tl.load(k_ptr + base, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + base, mask=valid[:, None], other=0.0)
        if not IN_DTYPE:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * sm_scale
        s = tl.where(valid, s, float("-inf"))
        if UNSAFE:  # no running maximum: exp(s) straight
            m_new = 0.0
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        if IN_DTYPE:
            acc = acc.to(q_ptr.dtype.element_ty)
        m_i = m_new
    tl.store(out_ptr + (b * H + h) * D + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


def triton_paged(logical=False, tail_mask=True, gqa_mod=False, row0=False, mask_every_block=False, unsafe=False,
                 max_from_zero=False, in_dtype=False, table_as_given=False, v_as_given=False):
    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens):
        q, k_cache = q.contiguous(), k_cache.contiguous()
        v_cache = v_cache if v_as_given else v_cache.contiguous()  # read with k's layout
        tables = block_tables.to(torch.int32)
        tables = tables if table_as_given else tables.contiguous()  # its width taken as its row stride
        b, h, d = q.shape
        out = torch.empty_like(q)
        _mutant_paged_kernel[(b, h)](q, k_cache, v_cache, tables, seq_lens, out, tables.shape[1],
                                     1 / math.sqrt(d), H=h, HKV=k_cache.shape[2], D=d, BS=k_cache.shape[1],
                                     LOGICAL=logical, TAIL_MASK=tail_mask, GQA_MOD=gqa_mod, ROW0=row0,
                                     MASK_EVERY_BLOCK=mask_every_block, UNSAFE=unsafe, MAX_FROM_ZERO=max_from_zero,
                                     IN_DTYPE=in_dtype)
        return out

    return paged_attention


@triton.jit
def _idle_kernel(x_ptr):
    tl.load(x_ptr)


def torch_beside_an_idle_kernel(q, k_cache, v_cache, block_tables, seq_lens):
    out = torch.empty_like(q)
    for row, n in enumerate(seq_lens.tolist()):
        k = P.gather_contiguous(k_cache, block_tables, n, row).float()
        v = P.gather_contiguous(v_cache, block_tables, n, row).float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[row].float(), k) / math.sqrt(q.shape[-1]), -1)
        out[row] = torch.einsum("hn,nhd->hd", w, v).to(q.dtype)
    _idle_kernel[(1,)](out)
    return out


def stub_paged(q, k_cache, v_cache, block_tables, seq_lens):
    raise NotImplementedError("Exercise: write the paged attention kernel")


PAGED_MUTANTS = {
    "logical_block_used_as_physical": (lambda: triton_paged(logical=True), "logical block index is used"),
    "tail_not_masked": (lambda: triton_paged(tail_mask=False), "tail of the last block is not masked"),
    "gqa_group_mapped_wrongly": (lambda: triton_paged(gqa_mod=True), "GQA group mapped wrongly"),
    "every_sequence_reads_row_0": (lambda: triton_paged(row0=True), "seq_lens=[1, 5, 16]"),  # the first B > 1
    "last_block_mask_on_every_block": (lambda: triton_paged(mask_every_block=True), "output is wrong"),
    "torch_not_triton": (lambda: lambda *a: P.contiguous_decode_attention(*_contiguous(*a)), "no Triton kernel"),
    "torch_beside_an_idle_kernel": (lambda: torch_beside_an_idle_kernel, "the result is right, but your function "
                                                                         "called"),
}


HARD_CASE_MUTANTS = {  # results_b's kernels that passed every case of the plan
    "softmax_without_running_max": (dict(unsafe=True), "scores reach about +110"),
    "running_max_starts_at_zero": (dict(max_from_zero=True), "Start m at float('-inf')"),
    "float16_arithmetic": (dict(in_dtype=True), "passes float16's largest number"),
    "table_width_as_row_stride": (dict(table_as_given=True), "row stride (stride(0)) is not its width"),
    "v_read_with_k_strides": (dict(v_as_given=True), "strides differ from k_cache's"),
}


@pytest.mark.parametrize("name", HARD_CASE_MUTANTS)
def test_paged_check_rejects_on_its_hard_cases(name, monkeypatch):
    """Each fails one of the cases after the plan; the plan is cut to its first case here (time)."""
    monkeypatch.setattr(lab10, "PAGED_PLAN", lab10.PAGED_PLAN[:1])
    flags, expected = HARD_CASE_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_paged_attention(triton_paged(**flags))
    assert expected in str(info.value), str(info.value)


def _contiguous(q, k_cache, v_cache, block_tables, seq_lens):
    """Gather the paged cache into (B, S_max, Hkv, D) tensors (a torch-only route to the answer)."""
    s = int(seq_lens.max())
    k = torch.zeros(q.shape[0], s, *k_cache.shape[2:], dtype=k_cache.dtype)
    v = torch.zeros_like(k)
    for row, n in enumerate(seq_lens.tolist()):
        k[row, :n] = P.gather_contiguous(k_cache, block_tables, n, row)
        v[row, :n] = P.gather_contiguous(v_cache, block_tables, n, row)
    return q, k, v, seq_lens


def test_paged_reference_kernel_passes(capsys):
    check_paged_attention(paged_decode_attention_triton)
    assert "PASSED check_paged_attention" in capsys.readouterr().out


def test_paged_mutant_harness_without_mutation_passes(capsys):
    check_paged_attention(triton_paged())
    assert "PASSED check_paged_attention" in capsys.readouterr().out


@pytest.mark.parametrize("name", PAGED_MUTANTS)
def test_paged_check_rejects(name):
    make, expected = PAGED_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_paged_attention(make())
    assert expected in str(info.value), str(info.value)


def test_paged_check_reports_the_stub():
    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_paged_attention(stub_paged)
    assert info.value.reason == "not done"


def test_paged_check_refuses_the_courses_kernel_from_a_learner():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_paged_attention(P.paged_decode_attention_triton)
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_paged_attention(lambda *a: P.paged_decode_attention(*a))


# --- check_prefix_cache ------------------------------------------------------------------------------


class PrefixAllocator:
    """A correct prefix-caching allocator with the lab's interface; subclasses plant one mistake each."""

    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.empty = collections.deque(range(num_blocks))
        self.lru = collections.OrderedDict()  # cached, unreferenced: block -> hash, oldest release first
        self.where = {}  # hash -> block
        self.hashes = {}  # block -> hash
        self.refs = collections.Counter()
        self.tables, self.hits = {}, {}

    def block_hashes(self, ids):
        out, h = [], None
        for i in range(len(ids) // self.bs):
            h = hash((h, tuple(ids[i * self.bs:(i + 1) * self.bs])))
            out.append(h)
        return out

    def take(self):
        if self.empty:
            return self.empty.popleft()
        block, h = self.lru.popitem(last=False)
        del self.where[h], self.hashes[block]
        return block

    def capacity(self, hits):
        return len(self.empty) + len(self.lru) - sum(1 for b in hits if b in self.lru)

    def reuse(self, block):
        self.lru.pop(block, None)
        self.refs[block] += 1

    def allocate(self, seq_id, token_ids):
        hashes = self.block_hashes(token_ids)
        hits = []
        for h in hashes:
            if h not in self.where:
                break
            hits.append(self.where[h])
        need = -(-len(token_ids) // self.bs) - len(hits)
        if need > self.capacity(hits):
            raise MemoryError("out of blocks")
        for b in hits:
            self.reuse(b)
        table = list(hits)
        for i in range(len(hits), len(hits) + need):
            b = self.take()
            self.refs[b] = 1
            table.append(b)
            if i < len(hashes) and hashes[i] not in self.where:
                self.where[hashes[i]], self.hashes[b] = b, hashes[i]
        self.tables[seq_id], self.hits[seq_id] = table, len(hits) * self.bs
        return list(table)

    def cached_tokens(self, seq_id):
        return self.hits[seq_id]

    def fork(self, parent_id, child_id):
        self.tables[child_id] = list(self.tables[parent_id])
        self.hits[child_id] = self.hits[parent_id]
        for b in self.tables[child_id]:
            self.refs[b] += 1

    def release(self, block):
        self.refs[block] -= 1
        return self.refs[block] == 0

    def free(self, seq_id):
        for b in reversed(self.tables.pop(seq_id)):
            if self.release(b):
                if b in self.hashes:
                    self.lru[b] = self.hashes[b]
                else:
                    self.empty.append(b)

    def block_table(self, seq_id):
        return list(self.tables[seq_id])

    def ref_count(self, block):
        return self.refs[block]

    def free_blocks(self):
        return set(self.empty) | set(self.lru)


class HashWithoutPrefix(PrefixAllocator):
    def block_hashes(self, ids):
        return [hash(tuple(ids[i * self.bs:(i + 1) * self.bs])) for i in range(len(ids) // self.bs)]


class PartialBlockCached(PrefixAllocator):
    def block_hashes(self, ids):
        out, h = [], None
        for i in range(-(-len(ids) // self.bs)):  # the partial last block too
            h = hash((h, tuple(ids[i * self.bs:(i + 1) * self.bs])))
            out.append(h)
        return out

    def allocate(self, seq_id, token_ids):
        table = super().allocate(seq_id, token_ids)
        self.hits[seq_id] = min(self.hits[seq_id], len(token_ids))
        return table


class EvictsReferenced(PrefixAllocator):
    """Evicts from every cached block, referenced or not, oldest cached first."""

    def capacity(self, hits):
        return len(self.empty) + len(self.hashes) - len(hits)

    def take(self):
        if self.empty:
            return self.empty.popleft()
        block = next(b for b in self.hashes if b not in self.protected)
        self.lru.pop(block, None)
        del self.where[self.hashes.pop(block)]
        return block

    def allocate(self, seq_id, token_ids):
        self.protected = set()
        return super().allocate(seq_id, token_ids)

    def reuse(self, block):
        super().reuse(block)
        self.protected.add(block)


class Fifo(PrefixAllocator):
    """Evicts unreferenced cached blocks in the order they were first cached."""

    def take(self):
        if self.empty:
            return self.empty.popleft()
        block = next(b for b in self.hashes if b in self.lru)
        del self.lru[block]
        del self.where[self.hashes.pop(block)]
        return block


class NoReferenceOnHit(PrefixAllocator):
    def reuse(self, block):
        if block in self.lru:  # a cached block nobody held: it is held now
            del self.lru[block]
            self.refs[block] = 1


class FreesOnFirstRelease(PrefixAllocator):
    def release(self, block):
        self.refs[block] = 0
        return True

    def free(self, seq_id):
        for b in reversed(self.tables.pop(seq_id)):
            if self.release(b) and b not in self.lru and b not in self.empty:
                if b in self.hashes:
                    self.lru[b] = self.hashes[b]
                else:
                    self.empty.append(b)


class ForgetsOnFree(PrefixAllocator):
    def free(self, seq_id):
        for b in reversed(self.tables.pop(seq_id)):
            if self.release(b):
                if b in self.hashes:
                    del self.where[self.hashes.pop(b)]
                self.empty.append(b)


class EvictsBeforeFree(PrefixAllocator):
    def take(self):
        if self.lru:
            block, h = self.lru.popitem(last=False)
            del self.where[h], self.hashes[block]
            return block
        return self.empty.popleft()


class TakeRaises(PrefixAllocator):
    """Runs out inside take(): MemoryError when neither list has a block."""

    def take(self):
        if not self.empty and not self.lru:
            raise MemoryError("out of blocks")
        return super().take()


class HitsCountedAsFree(TakeRaises):
    """The out-of-memory test counts the hits' own evictable blocks as free for the rest of the prompt."""

    def capacity(self, hits):
        return len(self.empty) + len(self.lru)


class NoTestUpFront(TakeRaises):
    """Tests nothing before it starts: take() raising is the test, after the hits took references."""

    def capacity(self, hits):
        return len(self.empty) + len(self.lru) + len(self.where)


class PrefixByCount:
    """Another correct allocator: sets and a release counter for the LRU order, a dict of chains, and a trial
    that counts the blocks before anything changes."""

    def __init__(self, num_blocks, block_size):
        self.n, self.size, self.clock = num_blocks, block_size, 0
        self.free_set, self.cached = set(range(num_blocks)), {}  # cached: block -> release time (refs 0)
        self.chain_of, self.block_of = {}, {}  # block -> chain, chain -> block (full blocks only)
        self.count, self.seqs = {}, {}  # block -> references; seq -> (table, cached tokens)

    def allocate(self, seq_id, token_ids):
        chains = [tuple(token_ids[:(i + 1) * self.size]) for i in range(len(token_ids) // self.size)]
        hits = []
        while len(hits) < len(chains) and chains[len(hits)] in self.block_of:
            hits.append(self.block_of[chains[len(hits)]])
        fresh = -(-len(token_ids) // self.size) - len(hits)
        if fresh > len(self.free_set) + len(set(self.cached) - set(hits)):
            raise MemoryError(f"{fresh} blocks needed")
        for b in hits:
            self.cached.pop(b, None)
            self.count[b] = self.count.get(b, 0) + 1
        table = list(hits)
        for i in range(len(hits), len(hits) + fresh):
            if self.free_set:
                b = min(self.free_set)
                self.free_set.remove(b)
            else:
                b = min(self.cached, key=self.cached.get)
                del self.cached[b], self.block_of[self.chain_of.pop(b)]
            self.count[b] = 1
            if i < len(chains) and chains[i] not in self.block_of:
                self.chain_of[b], self.block_of[chains[i]] = chains[i], b
            table.append(b)
        self.seqs[seq_id] = (table, len(hits) * self.size)
        return list(table)

    def cached_tokens(self, seq_id):
        return self.seqs[seq_id][1]

    def fork(self, parent_id, child_id):
        self.seqs[child_id] = (list(self.seqs[parent_id][0]), self.seqs[parent_id][1])
        for b in self.seqs[child_id][0]:
            self.count[b] += 1

    def free(self, seq_id):
        for b in self.seqs.pop(seq_id)[0][::-1]:
            self.count[b] -= 1
            if self.count[b] == 0:
                self.clock += 1
                if b in self.chain_of:
                    self.cached[b] = self.clock
                else:
                    self.free_set.add(b)

    def block_table(self, seq_id):
        return list(self.seqs[seq_id][0])

    def ref_count(self, block):
        return self.count.get(block, 0)

    def free_blocks(self):
        return self.free_set | set(self.cached)


class PrefixStub:
    def __init__(self, num_blocks, block_size):
        raise NotImplementedError("Exercise 2")


class CoursePrefix(BlockAllocator):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size, prefix_caching=True)


PREFIX_MUTANTS = {
    "hash without its prefix": (HashWithoutPrefix, "the same tokens after a different prefix hashed alike"),
    "partial last block cached": (PartialBlockCached, "the last, partly filled block was cached"),
    "evicts a referenced block": (EvictsReferenced, "(evicting a referenced block)"),
    "FIFO instead of LRU": (Fifo, "(FIFO in the order of caching, not least recently used)"),
    "no reference on a hit": (NoReferenceOnHit, "a hit did not take a reference"),
    "frees on the first release": (FreesOnFirstRelease, "freed on the first release of a shared block"),
    "forgets hashes on free": (ForgetsOnFree, "free forgot the hashes of released blocks"),
    "evicts before using free blocks": (EvictsBeforeFree, "while plain free blocks remained"),
    "hits counted as free for the rest": (HitsCountedAsFree, "a refused allocation changed the allocator"),
    "no out-of-memory test before taking": (NoTestUpFront, "a refused allocation changed the allocator"),
}


def test_prefix_cache_references_pass(capsys):
    check_prefix_cache(PrefixAllocator)
    check_prefix_cache(CoursePrefix)  # the course's own allocator, which the check compares with
    check_prefix_cache(PrefixByCount)
    assert capsys.readouterr().out.count("PASSED check_prefix_cache") == 3


@pytest.mark.parametrize("name", PREFIX_MUTANTS)
def test_prefix_cache_check_rejects(name):
    cls, expected = PREFIX_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_prefix_cache(cls)
    assert expected in str(info.value), str(info.value)


def test_prefix_cache_check_reports_the_stub_and_refuses_the_course_class():
    with pytest.raises(CheckFailed, match="NotImplementedError") as info:
        check_prefix_cache(PrefixStub)
    assert info.value.reason == "not done"
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="derives from"):
            check_prefix_cache(CoursePrefix)
