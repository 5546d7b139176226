"""One timing helper for every lab, on a GPU or a CPU.

On a GPU it uses ``triton.testing.do_bench``: warm-up, CUDA synchronisation and an L2 flush
before every repetition. On a CPU (where ``do_bench`` cannot run) it uses ``time.perf_counter``
with a warm-up call, and keeps calling for at least ``min_time_s`` (0.2 s) so that one point is
never a handful of calls. Either way it reports the median and the 20th/80th percentiles.

A shared CPU (other processes, a notebook kernel beside a test run) can slow some calls many
times over. So the calls are also split into :data:`ROUNDS` consecutive rounds, and ``spread``
is the largest of the rounds' medians over the smallest. Above :data:`SPREAD_LIMIT` the timing
is ``unstable``, and printing it says so: the median is then not a number to build on. It
catches a machine busy for part of a point, not one busy throughout (that looks stable but slow:
measure twice). On a GPU ``spread`` stays 1 and nothing is judged: ``do_bench``'s repetitions,
or the ``repeats`` wall-clock calls, are reported as they are.

A Triton kernel timed in the interpreter measures Python, not the kernel: pass
``uses_triton=True`` and the result says so wherever it is printed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._grading import GRADING_ENV
from .device import cuda_available, interpreter_mode

NOT_MEANINGFUL = "Triton interpreter: not meaningful for performance"
ROUNDS = 5  # consecutive rounds the CPU calls are split into to judge their stability
SPREAD_LIMIT = 1.5  # slowest round's median over the fastest's above which a timing is unstable


@dataclass(frozen=True)
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    repeats: int  # timed calls; 0 when do_bench chose the count itself
    method: str  # "cuda (do_bench)" or "cpu (perf_counter)"
    meaningful: bool = True
    spread: float = 1.0  # CPU: slowest round's median over the fastest's; 1 on a GPU

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def unstable(self) -> bool:
        """True when the rounds disagree by more than :data:`SPREAD_LIMIT`: do not trust the median."""
        return self.spread > SPREAD_LIMIT

    def warning(self) -> str:
        """A sentence for the screen when the timing is unstable; empty otherwise."""
        if not self.unstable:
            return ""
        return (
            f"timings spread {self.spread:.1f}x between rounds (limit {SPREAD_LIMIT}x): too wide to trust; "
            f"something else is using this machine's cores, so rerun the cell when it is idle"
        )

    def label(self) -> str:
        text = "" if self.meaningful else f" [{NOT_MEANINGFUL}]"
        return text + (f" [UNSTABLE: {self.warning()}]" if self.unstable else "")

    def __str__(self) -> str:
        runs = f"{self.repeats} runs, " if self.repeats > 0 else ""
        return (
            f"{self.median_ms:.3f} ms median (p20 {self.p20_s * 1e3:.3f}, p80 {self.p80_s * 1e3:.3f}; "
            f"{runs}{self.method}){self.label()}"
        )


def _cuda_sync() -> None:
    torch.cuda.synchronize()


def _quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1]


GRADING_MAX_TIME_S = 0.2  # the most a benchmark takes in a notebook the grader runs (CPU path)


def _grading() -> bool:
    """Whether this is a kernel the grader started (its outputs are discarded; only checks count)."""
    return bool(os.environ.get(GRADING_ENV))


def benchmark(
    fn: Callable[[], object],
    *,
    uses_triton: bool = False,
    repeats: int | None = None,
    warmup: int = 1,
    min_time_s: float = 0.2,
    max_time_s: float = 2.0,
    gpu: bool | None = None,
    min_gpu_repeats: int = 5,
) -> Timing:
    """Time ``fn()`` and return its median and p20/p80 in seconds.

    ``repeats`` fixes the number of timed calls (after ``warmup`` untimed ones), on a CPU or a
    GPU: a long call such as a whole ``generate`` loop is timed that many times with the wall
    clock, synchronising the GPU around each call. Without it the CPU path repeats until
    ``min_time_s`` has passed (at least :data:`ROUNDS` calls, at most ``max_time_s`` in total),
    and the GPU path uses ``do_bench``, which sizes its repetitions from a 100 ms budget: a call longer than
    that (a long prefill) would be timed once, so the budget is raised to cover at least
    ``min_gpu_repeats`` calls.
    ``spread`` (CPU only) compares the medians of :data:`ROUNDS` consecutive rounds of calls (see
    the module docstring); with fewer calls than rounds, each call is its own round.
    In a notebook the grader runs (``LABSUPPORT_GRADING`` set), where no timing is scored, shown or
    kept, the CPU path makes :data:`ROUNDS` calls (at most :data:`GRADING_MAX_TIME_S` seconds)
    instead of filling ``min_time_s``: a class's notebooks grade faster.
    """
    if not callable(fn):
        raise ValueError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    meaningful = not (uses_triton and interpreter_mode())
    use_gpu = cuda_available() if gpu is None else gpu
    if use_gpu and not interpreter_mode() and repeats is None:
        import triton.testing

        # do_bench picks its own repetition count from a time budget (``repeats`` asks for wall-clock calls instead).
        # One call, timed after a warm-up one, says whether the default 100 ms budget would cover
        # at least ``min_gpu_repeats`` calls; if not, the budget grows to cover them.
        fn()
        _cuda_sync()
        t0 = time.perf_counter()
        fn()
        _cuda_sync()
        once_ms = max((time.perf_counter() - t0) * 1e3, 1e-6)
        rep_ms = max(100.0, min_gpu_repeats * once_ms)
        median, p20, p80 = triton.testing.do_bench(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(median / 1e3, p20 / 1e3, p80 / 1e3, 0, "cuda (do_bench)", meaningful)

    # Wall clock. On a GPU with the interpreter forced on, synchronise so CUDA work is counted.
    sync = _cuda_sync if use_gpu else (lambda: None)
    if _grading():  # a graded run's timings are never scored or kept: the fewest calls that still time
        min_time_s, max_time_s = 0.0, min(max_time_s, GRADING_MAX_TIME_S)
    for _ in range(max(0, warmup)):
        fn()
    sync()
    times: list[float] = []
    start_all = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start_all
        if repeats is not None:
            if len(times) >= repeats:
                break
        elif (len(times) >= ROUNDS and elapsed >= min_time_s) or elapsed >= max_time_s:
            break
    spread = 1.0 if use_gpu else round_spread(times)  # judged on a CPU only (see the module docstring)
    times.sort()
    method = "cuda (perf_counter + synchronize)" if use_gpu else "cpu (perf_counter)"
    return Timing(
        statistics.median(times),
        _quantile(times, 0.2),
        _quantile(times, 0.8),
        len(times),
        method,
        meaningful,
        spread,
    )


def round_spread(times: list[float], rounds: int = ROUNDS) -> float:
    """Largest over smallest median of ``rounds`` consecutive rounds of ``times`` (in call order).

    A machine that is busy for part of a measurement makes some rounds slower than others even
    when the overall median looks plausible; this is what catches it.
    """
    if len(times) < 2:
        return 1.0
    rounds = min(rounds, len(times))
    size = len(times) / rounds
    medians = [statistics.median(times[round(i * size) : round((i + 1) * size)]) for i in range(rounds)]
    low = min(medians)
    return max(medians) / low if low > 0 else float("inf")


def progress(items, desc: str, enabled: bool = True):
    """A tqdm progress bar over ``items`` for a sweep; plain lines where tqdm is not installed
    (a bare GPU box); ``items`` unchanged when ``enabled`` is False."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _plain_progress(items, desc)
    return tqdm(items, desc=desc)


def _plain_progress(items, desc: str):
    items = list(items)
    for i, item in enumerate(items, 1):
        print(f"{desc}: {i}/{len(items)}", flush=True)
        yield item
