"""Collective communication: the ring all-reduce, its cost, and how long all-reduce takes.

Chapter 11. An all-reduce leaves on every rank the element-wise sum of every rank's tensor. The
ring algorithm splits the tensor into ``n`` chunks (``n`` ranks) and passes them around a ring,
rank ``r`` sending to ``r + 1`` and receiving from ``r - 1``:

1. reduce-scatter, ``n - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s) mod n`` and adds
   what it receives into chunk ``(r - s - 1) mod n``; afterwards rank ``r`` holds the full sum of
   chunk ``(r + 1) mod n``;
2. all-gather, ``n - 1`` steps: the finished chunks travel once more around the ring, each rank
   overwriting the chunk it receives.

Each rank sends ``2 (n - 1)`` chunks of ``1/n`` of the tensor: ``2 (n - 1) / n`` of its bytes,
nearly twice the tensor whatever ``n`` is. That is why nccl-tests reports all-reduce *bus
bandwidth* as the algorithm bandwidth (bytes / time) times ``2 (n - 1) / n``
(NVIDIA nccl-tests, doc/PERFORMANCE.md): a number comparable with the link's speed at any ``n``.

Chunks follow ``torch.tensor_split``: when ``n`` does not divide the number of elements, the first
``numel mod n`` chunks hold one element more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._answers import answer
from ._validate import positive_int


def ring_chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each of the ``world_size`` chunks of a tensor of ``numel`` elements,
    as ``torch.tensor_split`` cuts them (the first ``numel % world_size`` one element longer)."""
    numel = positive_int("numel", numel, allow_zero=True)
    n = positive_int("world_size", world_size)
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_bytes_sent(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a ``nbytes`` tensor: ``2 (n - 1) / n * nbytes``."""
    n = positive_int("world_size", world_size)
    return 2 * (n - 1) / n * float(nbytes)


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth (bytes/s): ``nbytes / seconds * 2 (n - 1) / n``."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return ring_bytes_sent(nbytes, world_size) / seconds


@answer
def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over every rank of ``x``, by a ring of point-to-point sends (module docstring).

    Call it on every rank of the default process group with tensors of the same shape and dtype;
    returns a new tensor of ``x``'s shape, ``x`` is left as it was.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    out = x.detach().clone().reshape(-1)  # (numel,), our working copy
    if n == 1:
        return out.view(x.shape)
    chunks = list(out.tensor_split(n))  # n contiguous views of out
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):  # reduce-scatter
        send, recv = (rank - step) % n, (rank - step - 1) % n
        request = dist.isend(chunks[send], right)  # non-blocking: everyone sends and receives at once
        incoming = torch.empty_like(chunks[recv])
        dist.recv(incoming, left)
        request.wait()
        chunks[recv] += incoming
    for step in range(n - 1):  # all-gather: rank holds chunk (rank + 1) % n complete
        send, recv = (rank - step + 1) % n, (rank - step) % n
        request = dist.isend(chunks[send], right)
        dist.recv(chunks[recv], left)
        request.wait()
    return out.view(x.shape)


def time_all_reduce(sizes: Sequence[int], repeats: int = 5, dtype: torch.dtype = torch.float32,
                    use_ring: bool = False) -> list[dict]:
    """Run on every rank (under :func:`labsupport.distributed.launch`): the median seconds of
    ``dist.all_reduce`` (or the course's :func:`ring_all_reduce`) on tensors of each number of
    elements in ``sizes``, after one warm-up. Returns one dict per size: elements, bytes, seconds,
    and the bus bandwidth, the same on every rank's list (rank 0's timings)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for numel in sizes:
        x = torch.ones(int(numel), dtype=dtype, device=device)
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if use_ring:
                ring_all_reduce.__wrapped__(x)
            else:
                dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call is a warm-up (connections, allocations)
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        nbytes = x.numel() * x.element_size()
        rows.append(dict(world_size=n, elements=int(numel), bytes=nbytes, seconds=seconds,
                         bus_bandwidth=bus_bandwidth(nbytes, seconds, n) if n > 1 else 0.0, rank=rank))
    return rows
