"""A day of requests, and how much KV-cache memory each way of reserving it wastes.

Chapter 10 explains it. Requests come from a seeded mix of three kinds, each with lognormal
prompt and output lengths (positive, right-skewed, with a long tail: the shape public chat traces
show; the medians are the course's choice, stated in :data:`REQUEST_MIX`), arriving through a
day whose rate peaks in the afternoon. Every request is prefilled at once and then generates one
token per decode step of ``step_s`` seconds.

Three ways of holding a request's cache, compared over its whole life:

* ``"max_len"``: one contiguous slab of ``max_len`` tokens per request, the context limit (what an
  engine must reserve when it cannot know how long a request will run);
* ``"prompt+max_tokens"``: a slab of the prompt plus the request's output limit ``max_tokens``,
  capped at ``max_len`` (what it can reserve when every request states a limit);
* paging with blocks of ``block_size`` tokens: ``ceil(held / block_size)`` blocks at each step.

Waste is ``1 - tokens held / tokens reserved``, both integrated over time (token-seconds), so a
request that lives twice as long counts twice. A request that finishes frees everything at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import positive_int, positive_number

__all__ = ["RequestKind", "REQUEST_MIX", "day_of_requests", "waste_over_life", "concurrent_usage"]


@dataclass(frozen=True)
class RequestKind:
    """One kind of request: its share of traffic and lognormal lengths (median, sigma of the log)."""

    name: str
    share: float
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float


REQUEST_MIX = (
    RequestKind("chat", 0.6, 800, 1.0, 250, 0.8),  # a conversation so far, and a reply
    RequestKind("retrieval", 0.3, 4000, 0.5, 150, 0.6),  # long retrieved context, short answer
    RequestKind("writing", 0.1, 200, 0.8, 1000, 0.6),  # short instruction, long output
)


def _diurnal_rate(hour: np.ndarray) -> np.ndarray:
    """Relative arrival rate by hour of day: a trough at 04:00, a peak at 16:00 (4x the trough)."""
    return 1.0 + 0.6 * np.cos((hour - 16.0) / 24.0 * 2 * np.pi)


def day_of_requests(n_requests: int = 20_000, *, max_len: int = 8192, max_tokens: int = 2048, seed: int = 0,
                    mix=REQUEST_MIX) -> dict[str, np.ndarray]:
    """``n_requests`` requests over 24 hours: arrays ``arrival_s``, ``prompt``, ``output`` and
    ``kind`` (index into ``mix``). Prompts are capped so that a request fits ``max_len``; outputs
    at ``max_tokens`` and at what is left of ``max_len``."""
    n = positive_int("n_requests", n_requests)
    max_len = positive_int("max_len", max_len)
    max_tokens = positive_int("max_tokens", max_tokens)
    rng = np.random.default_rng(seed)
    shares = np.array([k.share for k in mix], dtype=float)
    kind = rng.choice(len(mix), size=n, p=shares / shares.sum())
    prompt = np.empty(n)
    output = np.empty(n)
    for i, k in enumerate(mix):
        sel = kind == i
        prompt[sel] = rng.lognormal(np.log(k.prompt_median), k.prompt_sigma, sel.sum())
        output[sel] = rng.lognormal(np.log(k.output_median), k.output_sigma, sel.sum())
    prompt = np.clip(np.round(prompt), 1, max_len - 1).astype(np.int64)
    output = np.clip(np.round(output), 1, np.minimum(max_tokens, max_len - prompt)).astype(np.int64)
    # Arrival times by rejection sampling from the diurnal rate.
    arrivals = []
    while len(arrivals) < n:
        hours = rng.uniform(0, 24, 2 * n)
        keep = rng.uniform(0, 1.6, 2 * n) < _diurnal_rate(hours)
        arrivals.extend(hours[keep].tolist())
    arrival_s = np.sort(np.array(arrivals[:n])) * 3600
    return {"arrival_s": arrival_s, "prompt": prompt, "output": output, "kind": kind}


def _held_token_steps(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Per request, tokens held summed over its decode steps: step j (1..output) holds prompt + j."""
    return output * prompt + output * (output + 1) // 2


def _paged_token_steps(prompt: np.ndarray, output: np.ndarray, block_size: int) -> np.ndarray:
    """Per request, slots allocated summed over its steps: ceil((prompt + j) / bs) * bs."""
    total = np.zeros(len(prompt), dtype=np.int64)
    for i, (p, o) in enumerate(zip(prompt.tolist(), output.tolist())):
        held = np.arange(p + 1, p + o + 1)
        total[i] = int(((held + block_size - 1) // block_size).sum()) * block_size
    return total


def waste_over_life(requests: dict, *, max_len: int = 8192, max_tokens: int = 2048,
                    block_sizes=(1, 8, 16, 32, 64, 128, 256)) -> dict[str, float]:
    """Share of reserved cache that holds no token, integrated over every request's life.

    Keys: ``"max_len"``, ``"prompt+max_tokens"`` and ``"paged_<block_size>"``. Every step lasts
    the same time, so token-steps stand for token-seconds.
    """
    prompt, output = requests["prompt"].astype(np.int64), requests["output"].astype(np.int64)
    held = _held_token_steps(prompt, output).sum()
    result = {
        "max_len": 1 - held / (output * positive_int("max_len", max_len)).sum(),
        "prompt+max_tokens": 1 - held / (output * np.minimum(prompt + positive_int("max_tokens", max_tokens),
                                                             max_len)).sum(),
    }
    for bs in block_sizes:
        result[f"paged_{bs}"] = 1 - held / _paged_token_steps(prompt, output, positive_int("block_size", bs)).sum()
    return result


def concurrent_usage(requests: dict, *, step_s: float = 0.03, sample_s: float = 60.0, max_len: int = 8192,
                     block_size: int = 16) -> dict[str, np.ndarray]:
    """Tokens held, paged slots and contiguous ``max_len`` slots in use across the day, sampled
    every ``sample_s`` seconds (a request lives ``output * step_s`` seconds after arriving).

    Returns arrays ``time_s``, ``held``, ``paged`` and ``reserved`` (tokens, summed over the
    requests alive at each sample).
    """
    step_s = positive_number("step_s", step_s)
    sample_s = positive_number("sample_s", sample_s)
    times = np.arange(0, 24 * 3600, sample_s)
    held = np.zeros(len(times))
    paged = np.zeros(len(times))
    reserved = np.zeros(len(times))
    for t0, p, o in zip(requests["arrival_s"], requests["prompt"], requests["output"]):
        first = int(np.ceil(t0 / sample_s))
        last = int(np.floor((t0 + o * step_s) / sample_s))
        if last < first:
            continue
        idx = np.arange(first, min(last, len(times) - 1) + 1)
        tokens = p + np.minimum(o, np.floor((times[idx] - t0) / step_s).astype(np.int64) + 1)
        held[idx] += tokens
        paged[idx] += -(-tokens // block_size) * block_size
        reserved[idx] += max_len
    return {"time_s": times, "held": held, "paged": paged, "reserved": reserved}
