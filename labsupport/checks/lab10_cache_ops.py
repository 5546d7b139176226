"""Checks for the cache-ops lab: a block allocator, and paged decode attention in Triton.

``check_block_allocator(BlockAllocator)`` takes the learner's *class*. Its interface, as the lab
states it (sequence ids are ints here; blocks are ints in ``[0, num_blocks)``):

* ``BlockAllocator(num_blocks, block_size)``
* ``allocate(seq_id, num_tokens) -> list[int]``: blocks for a new sequence's ``num_tokens`` tokens
  (``ceil(num_tokens / block_size)`` of them); raises ``MemoryError`` and changes nothing when
  too few blocks are free;
* ``append_token(seq_id) -> (block, offset, copy)``: where the next token goes; ``copy`` is
  ``None`` or ``(src, dst)`` when a shared, partly filled last block was copied (copy-on-write,
  only then); raises ``MemoryError`` and changes nothing when it needs a block and none is free;
* ``fork(parent_id, child_id)``: the child shares every block of the parent;
* ``free(seq_id)``: one reference fewer on each of its blocks; a block nobody holds is free;
* ``block_table(seq_id) -> list[int]``, ``ref_count(block) -> int``, ``free_blocks() -> set[int]``.

The check runs directed scenarios (each aimed at one classic mistake, which it names) and then
seeded random sequences of operations, after each of which: every table has the right length
and only valid, distinct blocks; every reference count equals the number of tables holding the
block; no block is both free and used; every block is one or the other (nothing leaked); and the
tokens written through the tables read back intact for every sequence (so a shared block written
in place, or a block freed while shared and handed to someone else, shows up as corrupted data).

``check_paged_attention(fn)`` takes the learner's wrapper ``fn(q, k_cache, v_cache, block_tables,
seq_lens) -> out`` (shapes in :mod:`labsupport.paged_attention`) and compares it with the course's
torch spec on block tables whose physical blocks are shuffled, partly filled last blocks (whose
unused slots hold random values), sequences of length 1, grouped-query heads (groups of 1, 2, 3
and 4) and float32 and float16 (bfloat16 too on a GPU that computes in it); then five cases that
each change one thing (scores near +110, every score -120, 1,200 float16 values near 64, a block
table that is a slice of a wider one, a v_cache whose strides differ from k_cache's), so a softmax
without a running maximum, a maximum started at 0, float16 arithmetic and strides taken from the
wrong tensor fail with a message naming them. The result must be written by a Triton kernel the
function launched, with no torch matmul, softmax or exp. Not checked: block ids multiplied by a
stride in 32 bits (the overflow needs a cache of more than 2**31 elements).
"""

from __future__ import annotations

import math
import random

import torch

from .._answers import course_is_checking
from ..device import cuda_available, device, gpu_has_bf16, interpreter_mode
from ..paged_attention import paged_decode_attention, paged_decode_attention_triton, random_paged_cache
from ..paged_cache import BlockAllocator as CourseAllocator
from ..paged_cache import block_allocator_answer
from .framework import Case, graded, torch_calls, triton_launches

# --- the block allocator -------------------------------------------------------------------------

ALLOCATOR_HINT = ("keep a reference count per block: fork adds one to every block of the parent, free "
                  "subtracts one and returns a block to the free list only when its count reaches 0.")
FORK_REFCOUNT = ("fork does not add a reference to the shared blocks (fork without a reference count)",
                 "in fork, increment the reference count of every block in the parent's table: the child "
                 "holds them too.")
FREE_SHARED = ("free returns a block to the free list while another sequence still holds it (free of a "
               "shared block)",
               "in free, decrement each block's reference count and put the block back on the free list "
               "only if the count reached 0.")
NOT_ATOMIC = ("allocate raised MemoryError but kept the blocks it had taken so far (not atomic)",
              "count the free blocks first and raise MemoryError before taking any; a failed allocate changes "
              "nothing.")
NO_COW = ("append_token writes into a shared block in place (no copy-on-write)",
          "when the last block is shared (reference count > 1) and partly filled, take a new block, "
          "return (new_block, offset, (old_block, new_block)), put new_block in this sequence's table and "
          "drop one reference from old_block.")
COPY_ALWAYS = ("append_token copies a block nobody else holds (copy on every write, not only on a shared one)",
               "copy only when the last block is partly filled and its reference count is above 1; a block this "
               "sequence holds alone is written in place, and a full last block just gets a new empty block.")
APPEND_NOT_ATOMIC = ("append_token raised MemoryError but had already changed the table or a reference count "
                     "(not atomic)",
                     "take the new block first (raising MemoryError if there is none), and only then change the "
                     "table and drop the old block's reference.")


_OUT_OF_BLOCKS = object()


class _Model:
    """What the allocator's state must be, kept from the operations and the answers it gave."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tokens: dict[int, list[int]] = {}  # seq -> the token values it holds
        self.data: dict[int, list] = {}  # block -> its block_size slots
        self.next_value = 1

    def fresh(self, n: int) -> list[int]:
        values = list(range(self.next_value, self.next_value + n))
        self.next_value += n
        return values


def _ints(checker, value, case, what: str) -> list[int]:
    try:
        out = [int(x) for x in value]
    except (TypeError, ValueError):
        checker.fail(case, f"{what} returned {value!r}, expected a list of block ids (ints).")
    return out


class _Driver:
    """Runs operations on the learner's allocator through the checker and verifies the state."""

    def __init__(self, checker, cls, num_blocks: int, block_size: int, scenario: str):
        self.checker, self.scenario = checker, scenario
        self.model = _Model(num_blocks, block_size)
        self.history: list[str] = []
        self.refused = False  # the last allocate raised MemoryError
        self.alloc = self.call(cls, num_blocks, block_size, op=f"BlockAllocator({num_blocks}, {block_size})")

    def case(self) -> Case:
        ops = self.history[-6:]
        return Case(scenario=self.scenario, num_blocks=self.model.num_blocks, block_size=self.model.block_size,
                    operations=("..., " if len(self.history) > 6 else "") + "; ".join(ops))

    def call(self, fn, *args, op: str):
        self.history.append(op)
        return self.checker.call(fn, *args, case=self.case())

    def fail(self, problem: str, hint: str = ALLOCATOR_HINT):
        if self.refused and self.history[-1].endswith("MemoryError"):
            mistake = NOT_ATOMIC if self.history[-1].startswith("allocate") else APPEND_NOT_ATOMIC
            problem, hint = problem + f"\nThis matches what happens when {mistake[0]}.", mistake[1]
        self.checker.fail(self.case(), problem, hint)

    # -- operations ------------------------------------------------------------------------------

    def table(self, seq: int) -> list[int]:
        return _ints(self.checker, self.checker.call(self.alloc.block_table, seq, case=self.case()),
                     self.case(), f"block_table({seq})")

    def allocate(self, seq: int, n: int, expect_oom: bool = False) -> None:
        m = self.model

        def allocate(seq_id, num_tokens):  # MemoryError is an answer here, not a crash
            try:
                return self.alloc.allocate(seq_id, num_tokens)
            except MemoryError:
                return _OUT_OF_BLOCKS

        table = self.call(allocate, seq, n, op=f"allocate({seq}, {n})")
        self.refused = table is _OUT_OF_BLOCKS
        if table is _OUT_OF_BLOCKS:
            self.history[-1] += " -> MemoryError"
            if expect_oom:
                return
            self.fail(f"allocate({seq}, {n}) raised MemoryError although {self._expected_free()} blocks were "
                      f"free and it needs {-(-n // m.block_size)}.",
                      "a sequence of num_tokens tokens needs ceil(num_tokens / block_size) blocks.")
        if expect_oom:
            self.fail(f"allocate({seq}, {n}) needs {-(-n // m.block_size)} blocks but only "
                      f"{self._expected_free()} are free, and it did not raise MemoryError.",
                      "check that enough blocks are free before taking any, and raise MemoryError otherwise "
                      "(leaving the allocator unchanged).")
        self.returned = table  # what allocate handed back, as it was (the check edits it later)
        table = _ints(self.checker, table, self.case(), f"allocate({seq}, {n})")
        m.tokens[seq] = m.fresh(n)
        self._write_prompt(seq, table)

    def append(self, seq: int, expect_oom: bool = False) -> None:
        m = self.model
        held = len(m.tokens[seq])
        last = self.table(seq)[-1] if held % m.block_size else None  # the partly filled last block, if any
        holders = sum(last in self.table(s) for s in m.tokens) if last is not None else 0

        def append_token(seq_id):  # MemoryError is an answer here, not a crash
            try:
                return self.alloc.append_token(seq_id)
            except MemoryError:
                return _OUT_OF_BLOCKS

        result = self.call(append_token, seq, op=f"append_token({seq})")
        self.refused = result is _OUT_OF_BLOCKS
        if result is _OUT_OF_BLOCKS:
            self.history[-1] += " -> MemoryError"
            if expect_oom:
                return
            self.fail(f"append_token({seq}) raised MemoryError although a block was free or none was needed.",
                      "append_token needs a new block only when the last one is full or shared.")
        if expect_oom:
            why = "the last block is shared" if holders > 1 else "the last block is full"
            self.fail(f"append_token({seq}) needed a new block ({why}) and none was free, but it did not raise "
                      f"MemoryError.",
                      "raise MemoryError when append_token needs a block and none is free, changing nothing.")
        if not (isinstance(result, (tuple, list)) and len(result) == 3):
            self.fail(f"append_token({seq}) returned {result!r}, expected (block, offset, copy).",
                      "return a tuple of three: the block the token goes to, its slot in that block, and None "
                      "or (src, dst) for a copy-on-write.")
        block, offset, copy = result
        if offset != held % m.block_size:
            self.fail(f"append_token({seq}) returned offset {offset} for the sequence's token number {held} "
                      f"(counting from 0), expected {held % m.block_size} = {held} % block_size.")
        table = self.table(seq)
        if not table or table[-1] != block:
            self.fail(f"append_token({seq}) returned block {block}, but the sequence's table is now {table}: the "
                      f"token must go to the last block of the table.")
        if copy is None and holders > 1:
            self.fail(f"append_token({seq}) wrote into block {last}, partly filled and held by {holders} sequences, "
                      f"without a copy.\nThis matches what happens when {NO_COW[0]}.", NO_COW[1])
        if copy is not None:
            try:
                src, dst = (int(x) for x in copy)
            except (TypeError, ValueError):
                self.fail(f"append_token({seq}) returned copy={copy!r}, expected None or (src, dst).")
            if holders <= 1:
                where = (f"block {last} is held by this sequence alone" if last is not None else
                         f"the token starts a new block (token number {held} is a multiple of the block size)")
                self.fail(f"append_token({seq}) returned copy {copy!r}, but {where}: there is nothing to copy.\n"
                          f"This matches what happens when {COPY_ALWAYS[0]}.", COPY_ALWAYS[1])
            if src != last:
                self.fail(f"append_token({seq}) returned copy {copy!r}, but the shared last block was {last}: the "
                          f"copy's source is the block being replaced.", NO_COW[1])
            if dst != block:
                self.fail(f"append_token({seq}) returned copy {copy!r} into a block other than the one the token "
                          f"goes to ({block}).", NO_COW[1])
            m.data[dst] = list(m.data.get(src, [None] * m.block_size))
        if offset == 0 or block not in m.data:
            m.data.setdefault(block, [None] * m.block_size)
        value = m.fresh(1)[0]
        m.tokens[seq].append(value)
        m.data[block][offset] = value

    def fork(self, parent: int, child: int) -> None:
        self.call(self.alloc.fork, parent, child, op=f"fork({parent}, {child})")
        self.model.tokens[child] = list(self.model.tokens[parent])

    def free(self, seq: int) -> None:
        self.call(self.alloc.free, seq, op=f"free({seq})")
        del self.model.tokens[seq]

    def _write_prompt(self, seq: int, table: list[int]) -> None:
        m = self.model
        for pos, value in enumerate(m.tokens[seq]):
            block = table[pos // m.block_size] if pos // m.block_size < len(table) else None
            if block is None:
                self.fail(f"allocate returned {len(table)} blocks for {len(m.tokens[seq])} tokens, expected "
                          f"{-(-len(m.tokens[seq]) // m.block_size)} (ceil(num_tokens / block_size)).")
            m.data.setdefault(block, [None] * m.block_size)[pos % m.block_size] = value

    def _expected_free(self) -> int:
        used = set()
        for seq in self.model.tokens:
            used |= set(self.table(seq))
        return self.model.num_blocks - len(used)

    # -- the invariants ----------------------------------------------------------------------

    def verify(self, last_op: str = "") -> None:
        m, c = self.model, self.checker
        tables = {}
        counts = [0] * m.num_blocks
        for seq, tokens in m.tokens.items():
            table = self.table(seq)
            want = -(-len(tokens) // m.block_size)
            if len(table) != want:
                self.fail(f"sequence {seq} holds {len(tokens)} tokens, so its table needs {want} blocks "
                          f"(ceil(tokens / block_size)); block_table({seq}) has {len(table)}: {table}.")
            bad = [b for b in table if not 0 <= b < m.num_blocks]
            if bad:
                self.fail(f"block_table({seq}) holds block ids {bad} outside [0, {m.num_blocks}).")
            if len(set(table)) != len(table):
                self.fail(f"block_table({seq}) = {table} holds a block twice.")
            tables[seq] = table
            for b in table:
                counts[b] += 1
        used = {b for b in range(m.num_blocks) if counts[b]}
        for b in range(m.num_blocks):
            got = c.call(self.alloc.ref_count, b, case=self.case())
            if got != counts[b]:
                holders = [s for s, t in tables.items() if b in t]
                problem = (f"ref_count({b}) is {got!r}, but {counts[b]} sequence table(s) hold block {b}"
                           f"{' (sequences ' + ', '.join(map(str, holders)) + ')' if holders else ''}.")
                if last_op == "fork" and got == 1 and counts[b] == 2:
                    self.fail(problem + f"\nThis matches what happens when {FORK_REFCOUNT[0]}.", FORK_REFCOUNT[1])
                self.fail(problem, "the reference count of a block is the number of sequences whose table "
                                   "holds it: allocate sets 1, fork adds 1, copy-on-write and free take 1 off.")
        free = c.call(self.alloc.free_blocks, case=self.case())
        try:
            free = {int(b) for b in free}
        except (TypeError, ValueError):
            self.fail(f"free_blocks() returned {free!r}, expected a set of block ids.")
        both = sorted(free & used)
        if both:
            holders = [s for s, t in tables.items() if both[0] in t]
            problem = (f"block(s) {both} are in free_blocks() and also in use (block {both[0]} is in the table "
                       f"of sequence {holders[0]}).")
            if last_op == "free":
                self.fail(problem + f"\nThis matches what happens when {FREE_SHARED[0]}.", FREE_SHARED[1])
            self.fail(problem, ALLOCATOR_HINT)
        leaked = sorted(set(range(m.num_blocks)) - free - used)
        if leaked:
            self.fail(f"block(s) {leaked} are neither free nor in any sequence's table: they leaked.",
                      "when a block's reference count drops to 0 (free, or the shared block copy-on-write left), "
                      "it must return to the free list.")
        extra = sorted(b for b in free if not 0 <= b < m.num_blocks)
        if extra:
            self.fail(f"free_blocks() holds ids {extra} outside [0, {m.num_blocks}).")
        for seq, tokens in m.tokens.items():
            table = tables[seq]
            read = [m.data.get(table[p // m.block_size], [None] * m.block_size)[p % m.block_size]
                    for p in range(len(tokens))]
            if read != tokens:
                p = next(i for i, (a, b) in enumerate(zip(read, tokens)) if a != b)
                owner = [s for s, ts in m.tokens.items() if s != seq and read[p] in ts]
                problem = (f"sequence {seq}'s token at position {p} (block {table[p // m.block_size]}, slot "
                           f"{p % m.block_size}) reads back as another write"
                           f"{' (by sequence ' + str(owner[0]) + ')' if owner else ''}: its data was overwritten.")
                if last_op == "append":
                    self.fail(problem + f"\nThis matches what happens when {NO_COW[0]}.", NO_COW[1])
                self.fail(problem, "a block may be written only by the one sequence that holds it: copy-on-write "
                                   "for shared blocks, and never hand out a block that is still held.")


def _directed(checker, cls) -> None:
    """Short scenarios, each aimed at one mistake, so the message can name it."""
    d = _Driver(checker, cls, 16, 4, "allocate")
    d.allocate(0, 10)  # 3 blocks, the last holding 2 tokens
    d.verify("allocate")
    d.allocate(1, 4)  # exactly one block
    d.verify("allocate")
    d.append(1)  # the block is full: a new one, no copy
    d.verify("append")

    d = _Driver(checker, cls, 16, 4, "fork shares blocks")
    d.allocate(0, 6)
    d.fork(0, 1)
    if d.table(1) != d.table(0):
        d.fail(f"after fork(0, 1) the child's table is {d.table(1)}, expected the parent's {d.table(0)}: the child "
               f"shares the parent's blocks (nothing is copied until someone writes).",
               "fork copies the parent's block table (the list), not the blocks.")
    d.verify("fork")
    d.free(0)  # the child still holds every block
    d.verify("free")

    d = _Driver(checker, cls, 16, 4, "copy-on-write")
    d.allocate(0, 6)
    d.fork(0, 1)
    d.verify("fork")
    d.append(1)  # the shared last block is partly filled: it must be copied first
    d.verify("append")
    d.append(0)  # the parent now holds its last block alone: write in place
    d.verify("append")
    d.free(1)
    d.verify("free")
    d.free(0)
    d.verify("free")

    d = _Driver(checker, cls, 4, 4, "out of blocks")
    d.allocate(0, 12)
    d.allocate(1, 8, expect_oom=True)  # needs 2 blocks, 1 is free
    d.verify("allocate")
    d.allocate(1, 4)
    d.verify("allocate")
    d.append(1, expect_oom=True)  # block 1's only block is full, and no block is free
    d.verify("append")

    d = _Driver(checker, cls, 2, 4, "copy-on-write with no free block")
    d.allocate(0, 6)
    d.fork(0, 1)
    d.append(1, expect_oom=True)  # the shared last block must be copied, and there is nowhere to copy it
    d.verify("append")
    d.free(0)
    d.verify("free")
    d.append(1)  # now held alone: written in place, no block needed
    d.verify("append")


def _copies_and_forgetting(checker, cls) -> None:
    """The lists handed out are copies, and free forgets the sequence (so a second free(0), or a
    lookup of it, cannot touch blocks that now belong to others)."""
    d = _Driver(checker, cls, 8, 4, "tables handed out are copies; free forgets the sequence")
    d.allocate(0, 6)
    d.verify("allocate")
    before = d.table(0)
    for what, handed in (("allocate", d.returned), ("block_table", checker.call(d.alloc.block_table, 0, case=d.case()))):
        if isinstance(handed, list):
            handed.append(handed[0])  # the caller edits the list it was given
            if d.table(0) != before:
                d.fail(f"{what} returned the allocator's own list: when the caller appended to it, block_table(0) "
                       f"changed too ({before} became {d.table(0)}).",
                       "return a copy of the table (`list(table)`), as the interface says, so no caller can edit "
                       "the allocator's state.")
    d.fork(0, 1)
    d.free(0)
    d.verify("free")

    def lookup(seq_id):  # raising is an answer here: the id is unknown
        try:
            return d.alloc.block_table(seq_id)
        except Exception:  # noqa: BLE001 - any error means the id is gone
            return None

    stale = d.call(lookup, 0, op="block_table(0)")
    if stale is not None and (not hasattr(stale, "__len__") or len(stale)):
        d.fail(f"after free(0), block_table(0) still returns {stale!r}: free kept the sequence's table.",
               "free must forget the sequence (drop its table and length): a later free(0) or fork(0, ...) "
               "would otherwise act on blocks that now belong to other sequences.")
    counts = [checker.call(d.alloc.ref_count, b, case=d.case()) for b in range(d.model.num_blocks)]

    def free_again(seq_id):  # raising is an answer here too
        try:
            d.alloc.free(seq_id)
        except Exception:  # noqa: BLE001
            pass

    d.call(free_again, 0, op="free(0) again")
    after = [checker.call(d.alloc.ref_count, b, case=d.case()) for b in range(d.model.num_blocks)]
    changed = [b for b in range(d.model.num_blocks) if after[b] != counts[b]]
    if changed:
        d.fail(f"a second free(0), of a sequence already freed, changed the reference counts of block(s) "
               f"{changed}, which sequence 1 holds ({counts} became {after}).",
               "free must forget the sequence, so that freeing it again changes nothing (raising KeyError is "
               "fine).")
    d.verify("free")


def _random(checker, cls, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(24, 4), (20, 3), (32, 2)])
    d = _Driver(checker, cls, num_blocks, block_size, f"random operations, seed {seed}")
    next_id = 0
    for _ in range(steps):
        live = list(d.model.tokens)
        free_now = num_blocks - len({b for s in live for b in d.table(s)})
        roll = rng.random()
        if not live or roll < 0.25:
            n = rng.randint(1, 3 * block_size)
            need = -(-n // block_size)
            d.allocate(next_id, n, expect_oom=need > free_now)
            next_id += 1
            d.verify("allocate")
        elif roll < 0.4 and len(live) < 8:
            d.fork(rng.choice(live), next_id)
            next_id += 1
            d.verify("fork")
        elif roll < 0.8:
            seq = rng.choice(live)
            table = d.table(seq)
            needs_block = len(d.model.tokens[seq]) % block_size == 0 or \
                checker.call(d.alloc.ref_count, table[-1], case=d.case()) > 1
            if needs_block and free_now == 0:
                d.free(rng.choice(live))
                d.verify("free")
                continue
            d.append(seq)
            d.verify("append")
        else:
            d.free(rng.choice(live))
            d.verify("free")
    for seq in list(d.model.tokens):  # drain: everything must come back
        d.free(seq)
        d.verify("free")
    free = {int(b) for b in checker.call(d.alloc.free_blocks, case=d.case())}
    if free != set(range(num_blocks)):
        d.fail(f"after every sequence was freed, free_blocks() has {len(free)} of {num_blocks} blocks.")


@graded(points=20, bans=(block_allocator_answer,))
def check_block_allocator(cls, checker):
    """``cls`` is the learner's ``BlockAllocator`` class (interface in this module's docstring)."""
    if isinstance(cls, type) and issubclass(cls, CourseAllocator) and not course_is_checking():
        checker.fail(Case(scenario="the class itself"),
                     "your class is, or derives from, labsupport.paged_cache.BlockAllocator, the course's answer.",
                     "write your own class; the check compares its behaviour with what the interface promises.")
    _directed(checker, cls)
    _copies_and_forgetting(checker, cls)
    for seed in range(3):
        _random(checker, cls, seed, steps=120)
    checker.cases = 6 + 3  # scenarios, not the thousands of calls they make


# --- paged decode attention ----------------------------------------------------------------------

FORBID = ["scaled_dot_product_attention"]
COMPUTES = ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "einsum", "tensordot",
            "softmax", "log_softmax", "_softmax", "exp", "exp_", "exp2", "logsumexp")
TRITON_HINT = ("this exercise is the Triton kernel: launch paged_decode_attention_kernel[grid](...) from your "
               "wrapper, let it write the output, and return that tensor.")
ATTENTION_HINT = ("for logical block i of sequence b, load physical = block_tables[b, i] and read keys at "
                  "physical * stride_block + slot * stride_slot + kv_head * stride_head; mask slots at positions "
                  ">= seq_lens[b]; query head h reads KV head h // (H // Hkv).")

PAGED_PLAN = [  # B rows of seq_lens, H, Hkv, D, block size
    dict(lens=[1], H=2, Hkv=2, D=16, bs=4),
    dict(lens=[1, 5, 16], H=4, Hkv=2, D=32, bs=4),
    dict(lens=[37, 9], H=8, Hkv=2, D=32, bs=8),
    dict(lens=[20, 3], H=6, Hkv=2, D=32, bs=8),
    dict(lens=[33, 64], H=4, Hkv=1, D=64, bs=16),
]


def _paged_dtypes():
    dtypes = [torch.float32, torch.float16]
    if cuda_available() and not interpreter_mode() and gpu_has_bf16():
        dtypes.append(torch.bfloat16)  # bf16 arithmetic is broken in the Triton interpreter
    return dtypes


def _paged_cases():
    cases, seed = [], 0
    for dtype in _paged_dtypes():
        for fields in PAGED_PLAN:
            cases.append(dict(fields, dtype=dtype, seed=seed))
            seed += 1
    return cases


def _paged_variant(q, k_cache, v_cache, tables, lens, *, logical=False, unmasked=False, gqa="div"):
    """Paged decode attention in float64 with one deliberate change."""
    b, h, d = q.shape
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h // h_kv
    heads = torch.arange(h)
    kv_of = heads // group if gqa == "div" else heads % h_kv
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, n in enumerate(lens.tolist()):
        used = -(-n // bs)
        blocks = torch.arange(used) if logical else tables[row, :used].long()
        keep = used * bs if unmasked else n
        k = k_cache[blocks].double().reshape(used * bs, h_kv, d)[:keep][:, kv_of]  # (n, H, D)
        v = v_cache[blocks].double().reshape(used * bs, h_kv, d)[:keep][:, kv_of]
        scores = torch.einsum("hd,nhd->hn", q[row].double(), k) / math.sqrt(d)
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)
    return out.to(q.dtype)


def _tolerance(dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3)}.get(dtype, (2e-2, 2e-2))


def _paged_queries(fields, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(len(fields["lens"]), fields["H"], fields["D"], generator=gen)).to(dtype)


def _paged_cache(fields, seed: int, dtype=torch.float32):
    return random_paged_cache(fields["lens"], fields["Hkv"], fields["D"], fields["bs"], dtype=dtype, seed=seed)


def _large_scores(f):
    k, v, t, n = _paged_cache(f, 90)
    return _paged_queries(f, 91, scale=50.0), k, v, t, n  # scores up to about 110: exp overflows float32


def _negative_scores(f):
    k, v, t, n = _paged_cache(f, 92)
    return torch.full((len(f["lens"]), f["H"], f["D"]), -30.0), torch.ones_like(k), v, t, n  # every score -120


def _long_fp16(f):
    k, v, t, n = _paged_cache(f, 93, dtype=torch.float16)
    v = (64 + v.float()).to(torch.float16)  # values about 64: 1,200 of them sum past 65,504
    return torch.zeros(len(f["lens"]), f["H"], f["D"], dtype=torch.float16), k, v, t, n  # every weight exp(0)


def _sliced_table(f):
    k, v, t, n = _paged_cache(f, 95)
    wide = torch.full((t.shape[0], t.shape[1] + 3), -1, dtype=t.dtype)
    wide[:, :t.shape[1]] = t
    return _paged_queries(f, 96), k, v, wide[:, :t.shape[1]], n  # row stride: width + 3, not the width


def _padded_v(f):
    k, v, t, n = _paged_cache(f, 97)
    buf = torch.zeros(*v.shape[:-1], v.shape[-1] + 8)
    buf[..., :v.shape[-1]] = v
    return _paged_queries(f, 98), k, buf[..., :v.shape[-1]], t, n  # v's strides differ from k's


# Cases after the plan, each aimed at one mistake the plan's random caches cannot show: (fields,
# what the case changes, how to make its inputs, the hint naming the mistake). The plan's cases
# passed first, so what fails here is what the case changes.
HARD_PAGED_CASES = [
    (dict(lens=[40, 7], H=4, Hkv=2, D=16, bs=8, dtype=torch.float32), "scores up to about +110", _large_scores,
     "this case's scores reach about +110, where exp overflows float32: keep a running maximum m and compute "
     "exp(s - m) (the online softmax), rescaling l and acc by exp(m_old - m_new)."),
    (dict(lens=[21, 3], H=2, Hkv=2, D=16, bs=8, dtype=torch.float32), "every score -120", _negative_scores,
     "every score in this case is -120: a running maximum that starts at 0 (instead of -inf) makes every "
     "exp(s - m) underflow to 0, and 0 / 0 is NaN. Start m at float('-inf')."),
    (dict(lens=[1200], H=2, Hkv=1, D=16, bs=64, dtype=torch.float16), "1,200 values about 64", _long_fp16,
     "this case's 1,200 float16 values average about 64, so their weighted sum passes float16's largest number, "
     "65,504: do the arithmetic in float32 (`.to(tl.float32)` after loading; float32 m, l and acc) and convert "
     "only when storing."),
    (dict(lens=[9, 20, 5], H=4, Hkv=2, D=16, bs=4, dtype=torch.float32), "block_tables a column slice",
     _sliced_table,
     "this case's block_tables is a slice of a wider tensor, so its row stride (stride(0)) is not its width "
     "(shape[1]): pass block_tables.stride(0) to the kernel, or make the table contiguous first."),
    (dict(lens=[13, 6], H=4, Hkv=2, D=16, bs=4, dtype=torch.float32), "v_cache a view of a wider buffer",
     _padded_v,
     "this case's v_cache is a view of a wider buffer, so its strides differ from k_cache's: pass v_cache's own "
     "strides (or make both caches contiguous first)."),
]


def _run_paged_case(fn, checker, case, inputs, mistakes, dtype, hint):
    """One case: the learner's function, its inputs untouched, the output against the spec."""
    q, k_cache, v_cache, tables, lens = inputs
    before = [t.clone() for t in inputs]
    with triton_launches() as launches, torch_calls(COMPUTES) as calls:
        out = checker.call(fn, *inputs, case=case, forbid=FORBID)
    if not all(torch.equal(t, b) for t, b in zip(inputs, before)):
        checker.fail(case, "your function changed one of its inputs.", "never write into q, the caches or tables.")
    want = _paged_variant(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu()).to(q.device)
    if isinstance(out, torch.Tensor) and out.shape == want.shape and not torch.isfinite(out).all():
        bad = int((~torch.isfinite(out)).sum())
        checker.fail(case, f"the output holds {bad} NaN or infinite values of {out.numel()}; the spec's are all "
                           f"finite.", hint)
    atol, rtol = _tolerance(dtype)
    checker.expect_tensor(out, want, case=case, atol=atol, rtol=rtol, what="output",
                          mistakes={k: v.to(q.device) for k, v in mistakes.items()}, hint=hint)
    if launches.count == 0:
        checker.fail(case, "the result is right, but no Triton kernel was launched: it was computed some other "
                           "way (in torch?).", TRITON_HINT)
    checker.expect_kernel_work(case, launches, calls, {"output": out}, TRITON_HINT)


@graded(points=25, bans=(paged_decode_attention, paged_decode_attention_triton))
def check_paged_attention(fn, checker):
    """``fn(q, k_cache, v_cache, block_tables, seq_lens)`` must return ``(B, H, D)`` decode attention
    over the paged cache, computed by a Triton kernel it launched."""
    dev = device()
    for fields in _paged_cases():
        k_cache, v_cache, tables, lens = random_paged_cache(fields["lens"], fields["Hkv"], fields["D"], fields["bs"],
                                                            dtype=fields["dtype"], device=dev, seed=fields["seed"])
        gen = torch.Generator().manual_seed(fields["seed"] + 1000)
        q = torch.randn(len(fields["lens"]), fields["H"], fields["D"], generator=gen).to(fields["dtype"]).to(dev)
        case = Case(seq_lens=fields["lens"], H=fields["H"], Hkv=fields["Hkv"], D=fields["D"],
                    block_size=fields["bs"], dtype=fields["dtype"], num_blocks=k_cache.shape[0])
        inputs = (q, k_cache, v_cache, tables, lens)
        mistakes = {
            "the logical block index is used as the physical block (block_tables not read)":
                _paged_variant(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), logical=True),
            "the tail of the last block is not masked (slots at positions >= seq_lens count as keys)":
                _paged_variant(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), unmasked=True),
        }
        if fields["H"] != fields["Hkv"] and fields["Hkv"] > 1:
            mistakes["query head h reads KV head h % Hkv instead of h // (H // Hkv) (GQA group mapped wrongly)"] = \
                _paged_variant(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), lens.cpu(), gqa="mod")
        _run_paged_case(fn, checker, case, inputs, mistakes, fields["dtype"], ATTENTION_HINT)
    for fields, what, make, hint in HARD_PAGED_CASES:
        inputs = tuple(t.to(dev) for t in make(fields))
        case = Case(seq_lens=fields["lens"], H=fields["H"], Hkv=fields["Hkv"], D=fields["D"], block_size=fields["bs"],
                    dtype=fields["dtype"], inputs=what)
        _run_paged_case(fn, checker, case, inputs, {}, fields["dtype"], hint)


# --- the prefix cache ------------------------------------------------------------------------------

PREFIX_RULE = (
    "a full block's hash is hash((the previous full block's hash, or None for the first, tuple(its tokens))); "
    "allocate reuses the longest run of leading full blocks whose hashes are cached (each hit takes a "
    "reference, and an unreferenced cached block leaves the evictable list), then takes new blocks, plain free "
    "ones first, else evicting the least recently released cached block (its hash forgotten); free drops one "
    "reference per block, last block first, and a block left with none stays cached (most recently released) "
    "if it has a hash, else returns to the free list. Only full blocks are hashed."
)
# The prefix cache's named mistakes: (what went wrong, how to fix it)
P_HASH_ALONE = (
    "a block was found by its tokens alone: the same tokens after a different prefix hashed alike (the "
    "hash does not chain the previous block's hash)",
    "hash each full block together with the hash of the block before it, so equal hashes mean equal "
    "prefixes, not merely equal blocks."
)
P_PARTIAL = (
    "the last, partly filled block was cached and found (only full blocks have a hash)",
    "hash only the len(token_ids) // block_size full blocks; the partial last block is never cached."
)
P_NO_REF_ON_HIT = (
    "a hit did not take a reference (the reference count of a reused block was not incremented)",
    "every block allocate reuses gains one reference, and an unreferenced cached block leaves the "
    "evictable list when it is reused."
)
P_FREE_SHARED = (
    "free released a block that another sequence still holds (freed on the first release of a shared "
    "block)",
    "decrement the reference count; a block becomes free or evictable only when it reaches 0."
)
P_EVICT_HELD = (
    "a block still referenced was evicted and handed to a new sequence (evicting a referenced block)",
    "only blocks with reference count 0 are evictable: keep them in their own list, and take a referenced"
    " block off it when a hit reuses it."
)
P_FIFO = (
    "a cached block was evicted first although another had been released longer ago (FIFO in the order of"
    " caching, not least recently used)",
    "when free releases a cached block, it becomes the most recently used: evict from the other end; a "
    "hit takes it off the list, so its next release puts it at the recent end again."
)
P_FORGETS = (
    "free forgot the hashes of released blocks (nothing stays cached after its sequence is freed)",
    "a released full block keeps its hash and stays findable until it is evicted for new data."
)
P_REFUSED = (
    "a refused allocation changed the allocator (it took references, blocks or cached blocks before it "
    "raised MemoryError)",
    "decide before changing anything: the new blocks a prompt needs (its blocks less its hits) must fit in the "
    "free blocks plus the evictable ones that are not among its own hits (a hit on an evictable block stops "
    "being evictable); otherwise raise MemoryError with the allocator exactly as it was."
)
P_EVICT_FIRST = (
    "new blocks were taken by evicting cached ones while plain free blocks remained",
    "take never-cached free blocks first; evict a cached block only when there are none."
)


def _kv_of(ids: list[int]) -> list[int]:
    """What position p of a sequence holds in the simulated cache: a value that depends on the
    whole prefix ids[:p + 1], as a real key or value vector does."""
    out, h = [], 17
    for t in ids:
        h = hash((h, t))
        out.append(h)
    return out


class _PrefixDriver:
    """Runs a trace on the learner's prefix-caching allocator and on the course's, comparing them
    after every operation and reading every live sequence back through its table."""

    def __init__(self, checker, cls, num_blocks: int, block_size: int, scenario: str):
        self.checker, self.scenario, self.num_blocks, self.block_size = checker, scenario, num_blocks, block_size
        self.history: list[str] = []
        self.ref = CourseAllocator(num_blocks, block_size, prefix_caching=True)
        self.ids: dict[int, list[int]] = {}  # live sequence -> its token ids
        self.last = ""  # the last operation: allocate, fork or free
        self.data: dict[int, list] = {}  # block -> the values written in its slots
        self.alloc = self.call(cls, num_blocks, block_size, op=f"PrefixCachingAllocator({num_blocks}, {block_size})")

    def case(self) -> Case:
        ops = self.history[-6:]
        return Case(scenario=self.scenario, num_blocks=self.num_blocks, block_size=self.block_size,
                    operations=("..., " if len(self.history) > 6 else "") + "; ".join(ops))

    def call(self, fn, *args, op: str | None = None):
        if op is not None:
            self.history.append(op)
            self.last = op.partition("(")[0]
        return self.checker.call(fn, *args, case=self.case())

    def fail(self, problem: str, named: tuple[str, str] | None = None):
        """Fail with ``problem``; ``named`` is the mistake it matches, (what went wrong, how to fix it)."""
        if named is None:
            self.checker.fail(self.case(), problem, PREFIX_RULE)
        self.checker.fail(self.case(), f"{problem}\nThis matches: {named[0]}.", f"{named[1]}\n{PREFIX_RULE}")

    def table(self, seq: int) -> list[int]:
        got = self.call(self.alloc.block_table, seq)
        try:
            return [int(b) for b in got]
        except (TypeError, ValueError):
            self.fail(f"block_table({seq}) returned {got!r}, expected a list of block ids.")

    # -- operations ------------------------------------------------------------------------------

    def allocate(self, seq: int, ids: list[int], why: str | None = None) -> None:
        short = f"[{', '.join(map(str, ids[:3]))}, ... {len(ids)} tokens]" if len(ids) > 4 else str(ids)
        try:
            self.ref.allocate(seq, ids)
            want_hit, refused = self.ref.cached_tokens(seq), False
        except MemoryError:
            want_hit, refused = None, True

        def allocate(seq_id, token_ids):  # MemoryError is an answer here, not a crash
            try:
                return self.alloc.allocate(seq_id, token_ids)
            except MemoryError:
                return None

        got = self.call(allocate, seq, list(ids), op=f"allocate({seq}, {short})")
        if refused:
            if got is not None:
                self.fail(f"allocate({seq}, ...) succeeded, but every block was held by a live sequence: it needed "
                          f"{-(-len(ids) // self.block_size)} blocks and none was free or evictable; it should raise "
                          f"MemoryError.", named=P_EVICT_HELD)
            self.history[-1] += " -> MemoryError"
            self.verify(why or P_REFUSED)
            return
        if got is None:
            self.fail(f"allocate({seq}, ...) raised MemoryError, but the blocks free or evictable sufficed (the "
                      f"course's allocator found {self.ref.cached_tokens(seq)} cached tokens and enough blocks for "
                      f"the rest).", named=why)
        self.ids[seq] = list(ids)
        hit = self.call(self.alloc.cached_tokens, seq)
        if hit != want_hit:
            named = why if hit < want_hit else (
                P_PARTIAL if hit > len(ids) // self.block_size * self.block_size else P_HASH_ALONE)
            self.fail(f"cached_tokens({seq}) is {hit!r}; {want_hit} of its {len(ids)} tokens are in cached blocks.",
                      named=named)
        table = self.table(seq)
        kv = _kv_of(ids)
        for p in range(hit if isinstance(hit, int) else 0, len(ids)):  # the engine computes the uncached rest
            if p // self.block_size < len(table):
                self.data.setdefault(table[p // self.block_size], [None] * self.block_size)[p % self.block_size] = kv[p]
        self.verify()

    def fork(self, parent: int, child: int) -> None:
        self.ref.fork(parent, child)
        self.call(self.alloc.fork, parent, child, op=f"fork({parent}, {child})")
        self.ids[child] = list(self.ids[parent])
        self.verify()

    def free(self, seq: int, why: str | None = None) -> None:
        self.ref.free(seq)
        self.call(self.alloc.free, seq, op=f"free({seq})")
        del self.ids[seq]
        self.verify(why)

    # -- the comparison --------------------------------------------------------------------------

    def verify(self, why: str | None = None) -> None:
        tables, counts = {}, {}
        for seq, ids in self.ids.items():
            table = self.table(seq)
            if len(table) != -(-len(ids) // self.block_size):
                self.fail(f"sequence {seq} holds {len(ids)} tokens, so its table needs "
                          f"{-(-len(ids) // self.block_size)} blocks; block_table({seq}) has {len(table)}: {table}.")
            if any(not 0 <= b < self.num_blocks for b in table) or len(set(table)) != len(table):
                self.fail(f"block_table({seq}) = {table}: block ids must be distinct ints in [0, {self.num_blocks}).")
            tables[seq] = table
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        # who shares what, and each block's count, against the course's allocator
        for seq, table in tables.items():
            ref_table = self.ref.block_table(seq)
            for i, (b, rb) in enumerate(zip(table, ref_table)):
                got, want = self.call(self.alloc.ref_count, b), self.ref.ref_count(rb)
                if got != want:
                    named = None
                    if isinstance(got, int) and got < want and self.last == "free":
                        named = P_FREE_SHARED
                    elif isinstance(got, int) and got < want and self.last == "allocate":
                        named = P_NO_REF_ON_HIT
                    self.fail(f"ref_count({b}) is {got!r} for block {i} of sequence {seq}; {want} live sequences hold "
                              f"that block.", named=named)
            for other, other_table in tables.items():
                if other == seq:
                    continue
                ref_other = self.ref.block_table(other)
                for i, (b, rb) in enumerate(zip(table, ref_table)):
                    shared, ref_shared = b in other_table, rb in ref_other
                    if shared != ref_shared:
                        what = "shares" if shared else "does not share"
                        self.fail(f"block {i} of sequence {seq} (block {b}) {what} its block with sequence {other}; "
                                  f"in the course's allocator it {'does not' if shared else 'does'}.", named=why)
        free = self.call(self.alloc.free_blocks)
        try:
            free = {int(b) for b in free}
        except (TypeError, ValueError):
            self.fail(f"free_blocks() returned {free!r}, expected a set of block ids.")
        held = sorted(set(counts) & free)
        if held:
            self.fail(f"block {held[0]} is in free_blocks() (free or evictable) but sequence "
                      f"{next(s for s, t in tables.items() if held[0] in t)} still holds it.",
                      named=P_FREE_SHARED)
        if len(free) != self.ref.num_free_blocks:
            self.fail(f"free_blocks() holds {len(free)} blocks (free or cached and unreferenced); it should hold "
                      f"{self.ref.num_free_blocks}.", named=why)
        leaked = sorted(set(range(self.num_blocks)) - free - set(counts))
        if leaked:
            self.fail(f"block(s) {leaked} are neither held nor in free_blocks(): they leaked.")
        for seq, ids in self.ids.items():  # every position reads back the KV of its own prefix
            kv, table = _kv_of(ids), tables[seq]
            for p in range(len(ids)):
                b = table[p // self.block_size]
                if self.data.get(b, [None] * self.block_size)[p % self.block_size] != kv[p]:
                    self.fail(f"sequence {seq}'s position {p} (block {b}, slot {p % self.block_size}) reads back the "
                              f"keys and values of another prefix: block {b} was handed to another sequence, or "
                              f"reused for different tokens, while sequence {seq} held it.",
                              named=why or P_EVICT_HELD)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def _prefix_directed(checker, cls) -> None:
    rng = random.Random(10)
    system = _tokens(rng, 8)  # two full blocks of 4
    q0, q1 = _tokens(rng, 5), _tokens(rng, 6)

    d = _PrefixDriver(checker, cls, 16, 4, "a shared system prompt")
    d.allocate(0, system + q0)  # 13 tokens: three full blocks and one of 1
    d.allocate(1, system + q1, why=P_FORGETS)
    d.free(0)
    d.allocate(2, system + q0, why=P_FORGETS)  # the same prompt again: 12 tokens cached, not 13
    d.free(1)
    d.free(2)

    x, y, z = _tokens(rng, 4), _tokens(rng, 4), _tokens(rng, 4)
    d = _PrefixDriver(checker, cls, 16, 4, "the same block after a different prefix")
    d.allocate(0, x + y + z)
    d.allocate(1, y + z + x)  # y and z at other positions, after another prefix: nothing is cached
    d.allocate(2, x + y + x)  # x, y hit; the third block differs
    d.free(0)
    d.free(1)
    d.free(2)

    d = _PrefixDriver(checker, cls, 12, 4, "forks of one prompt")
    d.allocate(0, system + q1)  # 14 tokens, 4 blocks
    d.fork(0, 1)
    d.fork(0, 2)
    d.free(0, why=P_FREE_SHARED)
    d.allocate(3, _tokens(rng, 30))  # needs 8 blocks: only never-used and truly free ones may be taken
    d.free(1)
    d.free(3)
    d.free(2)

    p, q, r = _tokens(rng, 8), _tokens(rng, 8), _tokens(rng, 16)
    d = _PrefixDriver(checker, cls, 4, 4, "every block referenced")
    d.allocate(0, p)
    d.free(0)
    d.allocate(1, p)  # a hit: p's blocks are referenced again
    d.allocate(2, q)  # the two never-used blocks
    d.allocate(3, _tokens(rng, 3))  # nothing free, nothing evictable: MemoryError
    d.free(1)
    d.allocate(4, _tokens(rng, 3))  # now p's blocks are evictable
    d.free(2)
    d.free(4)

    d = _PrefixDriver(checker, cls, 6, 4, "least recently used first")
    d.allocate(0, p)
    d.free(0)  # p cached
    d.allocate(1, q, why=P_EVICT_FIRST)
    d.free(1)  # q cached after p
    d.allocate(2, p, why=P_EVICT_FIRST)
    # p used again: now more recent than q
    d.free(2)
    d.allocate(3, r)  # two free blocks and two evicted: q's, the least recently used
    d.free(3)
    d.allocate(4, p, why=P_FIFO)  # still cached
    d.allocate(5, q)
    d.free(4)
    d.free(5)

    rng = random.Random(11)  # its own numbers: the scenarios above keep theirs
    p, extra = _tokens(rng, 8), _tokens(rng, 8)
    d = _PrefixDriver(checker, cls, 4, 4, "hits on evictable blocks, too few other blocks free")
    d.allocate(0, p)
    d.free(0)  # p's two blocks cached, evictable
    d.allocate(1, _tokens(rng, 4))  # one of the two never-used blocks
    d.allocate(2, p + extra, why=P_REFUSED)  # 2 hits (evictable) + 2 new blocks; 1 other block free: MemoryError
    d.allocate(3, p, why=P_REFUSED)  # the refusal changed nothing: p still cached, its 8 tokens hit
    d.allocate(4, _tokens(rng, 8), why=P_REFUSED)  # 2 blocks needed, 1 free and none evictable: MemoryError
    d.allocate(5, _tokens(rng, 3), why=P_REFUSED)  # the last free block
    for seq in (1, 3, 5):
        d.free(seq)


def _prefix_random(checker, cls, seed: int, steps: int = 70) -> None:
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (8, 12, 6)]
    d = _PrefixDriver(checker, cls, 20, 4, f"random trace, seed {seed}")
    next_id, seen = 0, []
    for _ in range(steps):
        live = list(d.ids)
        roll = rng.random()
        if roll < 0.45 or not live:
            if seen and rng.random() < 0.2:
                ids = list(rng.choice(seen))  # a repeat (a retry, a regenerated answer)
            else:
                ids = rng.choice(systems) + _tokens(rng, rng.randrange(1, 11))
            seen.append(ids)
            d.allocate(next_id, ids)
            next_id += 1
        elif roll < 0.6:
            d.fork(rng.choice(live), next_id)
            next_id += 1
        else:
            d.free(rng.choice(live))
    for seq in list(d.ids):
        d.free(seq)


@graded(points=8, bans=(block_allocator_answer,))
def check_prefix_cache(cls, checker):
    """``cls(num_blocks, block_size)`` must give a prefix-caching allocator with ``allocate(seq_id,
    token_ids) -> table``, ``cached_tokens(seq_id)``, ``fork``, ``free``, ``block_table``, ``ref_count``
    and ``free_blocks`` (free or cached and unreferenced), compared with the course's
    ``BlockAllocator(..., prefix_caching=True)`` after every operation of directed and seeded random
    traces, with every live sequence read back through its table."""
    if not isinstance(cls, type):
        checker.fail(Case(argument=repr(cls)[:60]), "pass the class itself: check_prefix_cache(PrefixCachingAllocator).")
    if issubclass(cls, CourseAllocator) and not course_is_checking():
        checker.fail(Case(scenario="the class itself"),
                     "your class is, or derives from, labsupport.paged_cache.BlockAllocator, the course's answer.",
                     "write your own class; the check compares its behaviour with the course's.")
    _prefix_directed(checker, cls)
    for seed in (1, 2, 3):
        _prefix_random(checker, cls, seed)
