"""The model runner's reused host buffers and their guard (chapter 13): a buffer is never refilled
before the copy out of it from the previous step has completed.

On a GPU the copies are queued without blocking and read the host buffer when they run, later.
These tests give the buffers a copier whose copies run only when the test (or the runner's wait)
lets them: a queue, in the order a CUDA stream would run them. Each queued copy keeps what its
source held when it was queued; a copy whose source changed before it ran is the race (the device
would receive the next step's tokens, slots or tables)."""

from __future__ import annotations

import torch

from labsupport._answers import unguarded
from labsupport.engine import ScheduledSeq
from labsupport.engine.model_runner import StepBuffers, prepare_step


class DeferredCopier:
    """A copier whose copies complete only when :meth:`run` (or the runner's :meth:`wait`) runs them,
    in the order they were queued, as a stream runs them."""

    separate_host = True

    def __init__(self):
        self.queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (dst, src, src when queued)
        self.queued = 0  # copies queued so far
        self.done = 0  # copies completed so far
        self.raced: list[int] = []  # the copies whose source changed between queueing and running
        self.waits = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append((dst, src, src.clone()))
        self.queued += 1

    def record(self) -> int:
        return self.queued  # complete once every copy queued so far has run

    def wait(self, mark: int) -> None:
        self.waits += 1
        self.run(mark)

    def run(self, upto: int | None = None) -> None:
        upto = self.queued if upto is None else upto
        while self.done < upto:
            dst, src, queued = self.queue.pop(0)
            if not torch.equal(src, queued):
                self.raced.append(self.done)
            dst.copy_(src)
            self.done += 1


def _chunks(prompt_len: int, chunk: int, block_size: int) -> list[list[ScheduledSeq]]:
    """The steps of one long prompt chunked at an idle engine: no step samples until the last, so
    nothing but the buffers' guard orders one step's refill after the previous step's copies."""
    tokens = list(range(100, 100 + prompt_len))
    table = list(range(-(-prompt_len // block_size)))[::-1]  # blocks in a scrambled order
    return [[ScheduledSeq(tokens, table[:-(-(start + min(chunk, prompt_len - start)) // block_size)], start,
                          min(chunk, prompt_len - start))] for start in range(0, prompt_len, chunk)]


def test_prepare_step_never_refills_a_buffer_before_its_copy_completed():
    prepare = unguarded(prepare_step)
    copier = DeferredCopier()
    buffers = StepBuffers(torch.device("cpu"), max_blocks=8, tokens=16, seqs=2, copier=copier)
    steps = _chunks(prompt_len=40, chunk=16, block_size=8)
    expected = [prepare(seqs, 8) for seqs in steps]  # fresh buffers each: what each step must send
    sent = []
    for seqs in steps:
        meta = prepare(seqs, 8, buffers)  # the GPU is behind: nothing of the previous step has run
        sent.append(meta)
    copier.run()
    assert not copier.raced, (f"{len(copier.raced)} of {copier.queued} queued copies read a host buffer that the "
                              f"next step had already refilled")
    assert copier.waits > 0
    last = sent[-1]
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q", "logits_indices"):
        assert torch.equal(getattr(last, name), getattr(expected[-1], name)), name


def test_the_prefill_tiles_are_guarded_too():
    copier = DeferredCopier()
    buffers = StepBuffers(torch.device("cpu"), max_blocks=4, tokens=8, seqs=2, copier=copier)
    first = buffers.tiles([0, 0, 1], [0, 4, 0], 4)
    buffers.tiles([1, 1, 0], [8, 12, 0], 4)  # the next step's tiles, before the first step's copies ran
    copier.run()
    assert not copier.raced
    assert first[0].tolist() == [1, 1, 0]  # the device buffer now holds the latest step's tiles


def test_a_cpu_engine_copies_nothing():
    """On a CPU the host buffer is the device tensor: no copier, no copy, no wait."""
    buffers = StepBuffers(torch.device("cpu"), max_blocks=4)
    assert buffers.copier is None
    assert all(b.host is b.device_t for b in buffers.b.values())
