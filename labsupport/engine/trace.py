"""Replaying a trace of requests through the engine, and its throughput and latency (chapter 13)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .._validate import positive_int
from ..latency import summarize
from ..sampling import SamplingParams
from .llm_engine import Engine
from .sequence import Request


@dataclass(frozen=True)
class TraceRequest:
    """A request of a trace: when it arrives (seconds, or steps with ``clock="steps"``), its
    prompt and how it is sampled."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def poisson_trace(n: int, rate: float, prompt_lens: Sequence[int], output_lens: Sequence[int], vocab_size: int,
                  seed: int = 0, temperature: float = 0.0) -> list[TraceRequest]:
    """``n`` requests with exponential gaps between arrivals (a Poisson process at ``rate`` per
    unit of time), prompt and output lengths drawn uniformly from the lists given, random prompt
    tokens; all seeded."""
    gen = torch.Generator().manual_seed(seed)
    t, out = 0.0, []
    for i in range(positive_int("n", n)):
        t += float(torch.empty(1).exponential_(rate, generator=gen)) if rate > 0 else 0.0
        p = prompt_lens[int(torch.randint(len(prompt_lens), (1,), generator=gen))]
        o = output_lens[int(torch.randint(len(output_lens), (1,), generator=gen))]
        prompt = tuple(torch.randint(0, vocab_size, (p,), generator=gen).tolist())
        out.append(TraceRequest(t, prompt, SamplingParams(temperature=temperature, max_tokens=o, seed=seed + i)))
    return out


def run_trace(engine: Engine, trace: Sequence[TraceRequest], max_steps: int = 100_000) -> list[Request]:
    """Replay ``trace`` through ``engine`` (clock ``"virtual"`` or ``"steps"``): each request is
    added once the clock reaches its arrival; when nothing runs, the clock jumps to the next
    arrival. Returns the requests in trace order, finished."""
    if engine.clock.kind == "wall":
        raise ValueError("run_trace needs an engine with clock='virtual' or clock='steps'")
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    ids: dict[int, Hashable] = {}
    for _ in range(max_steps):
        while pending and trace[pending[0]].arrival_s <= engine.clock.now():
            i = pending.pop(0)
            ids[i] = engine.add_request(list(trace[i].prompt_ids), trace[i].params, arrival_s=trace[i].arrival_s)
        if not engine.has_unfinished():
            if not pending:
                return [engine.requests[ids[i]] for i in range(len(trace))]
            engine.clock.advance_to(trace[pending[0]].arrival_s)
            continue
        engine.step()
    raise RuntimeError(f"the trace did not finish in {max_steps} steps")


def trace_summary(requests: Sequence[Request]) -> dict:
    """Throughput and latency of a replayed trace: output tokens per unit of time from the first
    arrival to the last token, and TTFT, TPOT and E2E summaries (nearest-rank percentiles,
    :func:`labsupport.latency.summarize`) over the requests. TPOT leaves out one-token requests."""
    metrics = [r.metrics() for r in requests]
    if any(m is None for m in metrics):
        raise ValueError("every request must have finished with at least one token")
    start = min(r.arrival_s for r in requests)
    end = max(r.token_times_s[-1] for r in requests)
    tokens = sum(len(r.output_ids) for r in requests)
    tpots = [m["tpot"] for m in metrics if m["tpot"] is not None]
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "makespan": end - start,
        "throughput": tokens / (end - start) if end > start else float("inf"),
        "ttft": summarize([m["ttft"] for m in metrics]),
        "tpot": summarize(tpots) if tpots else None,
        "e2e": summarize([m["e2e"] for m in metrics]),
        "preemptions": sum(r.preemptions for r in requests),
    }
