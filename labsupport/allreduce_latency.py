"""How long an all-reduce of a decode step's size takes, by algorithm: latency, not bandwidth (chapter 11).

A decode step of a tensor-parallel model makes two all-reduces per layer, each of ``batch * d_model``
numbers: for Llama 3.1 70B at batch 8 in bf16, 128 KiB. At that size the time is set by how many
times the GPUs must wait for each other, not by the bytes. The course models each algorithm with
the usual two terms (Hockney's alpha-beta model): ``rounds * alpha + bytes_through_a_link / beta``,
where ``alpha`` is one synchronisation between the GPUs (a flag written to a peer's memory and seen
there, a few microseconds over NVLink) and ``beta`` the link's rate in one direction. For ``n`` GPUs
and a message of ``S`` bytes:

* **ring** (NCCL's bandwidth-optimal algorithm, chapter 11): ``2 (n - 1)`` rounds, each GPU sends
  ``2 (n - 1) / n * S``;
* **one-shot** (vLLM's ``cross_device_reduce_1stage``, csrc/custom_all_reduce.cuh): every GPU reads
  the whole message of every other GPU through NVLink and adds them itself: 1 round, ``(n - 1) * S``
  read by each GPU;
* **two-shot** (``cross_device_reduce_2stage``): a reduce-scatter (each GPU adds its ``1/n`` of
  everyone's message) and an all-gather (each reads the others' finished parts), both by direct
  reads: 2 rounds, ``2 (n - 1) / n * S``;
* **NVLS** (NVLink SHARP, multimem instructions on NVSwitch systems): each GPU pushes its message
  into the switch, which adds, and reads the sum back: 1 round, ``S`` each way.

vLLM chooses between one-shot and two-shot by size: one-shot always for 2 GPUs, below 512 KiB for
up to 4 and below 256 KiB for up to 8 (``CustomAllreduce::allreduce``), NCCL above its buffer.

These are models with stated inputs, not measurements: the course has no multi-GPU measurement of
them (chapter 11 says "not yet measured").
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import positive_int, positive_number

__all__ = ["ALGORITHMS", "AllReduceCost", "allreduce_cost", "cheapest", "decode_allreduce_bytes",
           "vllm_custom_choice"]

ALGORITHMS = ("ring", "one-shot", "two-shot", "nvls")


@dataclass(frozen=True)
class AllReduceCost:
    """One all-reduce under the alpha-beta model: its rounds, the bytes through one GPU's link in one
    direction, and the two terms of its time."""

    algorithm: str
    rounds: int
    link_bytes: float
    latency_s: float  # rounds * alpha
    transfer_s: float  # link_bytes / beta

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s

    @property
    def latency_share(self) -> float:
        """The part of the time spent waiting, not moving bytes."""
        return self.latency_s / self.seconds


def allreduce_cost(algorithm: str, message_bytes: float, world_size: int, *, alpha_s: float,
                   link_bytes_per_s: float) -> AllReduceCost:
    """The modelled cost of one all-reduce of ``message_bytes`` over ``world_size`` GPUs (module
    docstring): ``alpha_s`` per round, ``link_bytes_per_s`` each way."""
    s = positive_number("message_bytes", message_bytes)
    n = positive_int("world_size", world_size)
    alpha, beta = positive_number("alpha_s", alpha_s), positive_number("link_bytes_per_s", link_bytes_per_s)
    if n < 2:
        raise ValueError("an all-reduce needs at least 2 GPUs")
    rounds, moved = {
        "ring": (2 * (n - 1), 2 * (n - 1) / n * s),
        "one-shot": (1, (n - 1) * s),
        "two-shot": (2, 2 * (n - 1) / n * s),
        "nvls": (1, s),
    }.get(algorithm, (None, None))
    if rounds is None:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    return AllReduceCost(algorithm, rounds, moved, rounds * alpha, moved / beta)


def cheapest(message_bytes: float, world_size: int, *, alpha_s: float, link_bytes_per_s: float,
             algorithms=("ring", "one-shot", "two-shot")) -> AllReduceCost:
    """The algorithm of least modelled time among ``algorithms`` (NVLS left out by default: it needs
    an NVSwitch system)."""
    return min((allreduce_cost(a, message_bytes, world_size, alpha_s=alpha_s, link_bytes_per_s=link_bytes_per_s)
                for a in algorithms), key=lambda c: c.seconds)


def vllm_custom_choice(message_bytes: float, world_size: int) -> str:
    """What vLLM's custom all-reduce launches on fully NVLink-connected GPUs (csrc/custom_all_reduce.cuh):
    one-shot for 2 GPUs, and for up to 4 below 512 KiB, for up to 8 below 256 KiB; two-shot otherwise."""
    s = positive_number("message_bytes", message_bytes)
    n = positive_int("world_size", world_size)
    if n == 2 or (n <= 4 and s < 512 * 1024) or (n <= 8 and s < 256 * 1024):
        return "one-shot"
    return "two-shot"


def decode_allreduce_bytes(d_model: int, batch: int, dtype_bytes: float = 2) -> float:
    """Bytes of one tensor-parallel all-reduce in a decode step: one ``d_model`` vector per sequence."""
    return positive_int("d_model", d_model) * positive_int("batch", batch) * positive_number("dtype_bytes", dtype_bytes)
