"""A serving benchmark client in the style of vLLM's ``benchmark_serving`` (chapter 12).

It sends ``num_prompts`` streamed completions to any OpenAI-compatible ``/v1/completions`` endpoint
(the course server, vLLM, SGLang, TGI's OpenAI layer...) and reports the latency each request saw
and the throughput of the whole run::

    python -m labsupport.bench_serving --base-url http://127.0.0.1:8000/v1 --model course-tiny \\
        --num-prompts 20 --request-rate 4 --input-words 32 --output-tokens 32

**Open loop.** Arrival times are drawn before the run starts and requests go out at those times
whether or not earlier ones have been answered, as users do (a closed loop, which waits for an
answer before sending the next request, hides queueing). Gaps between arrivals are drawn from a
gamma distribution of mean ``1 / request_rate`` and shape ``burstiness`` (vLLM's convention):
``burstiness = 1`` is a Poisson process (exponential gaps); below 1 the arrivals come in bursts,
above 1 more evenly. ``request_rate = inf`` sends everything at once. ``--max-concurrency`` caps
requests in flight (the rest wait in the client, as in vLLM's benchmark).

**Metrics** (chapter 03's definitions, :mod:`labsupport.latency`): each chunk's arrival time is
taken when its ``data:`` line is read; TTFT is the first chunk that carries text, E2E the last.
ITL is the gaps between chunks that carry text. TPOT is ``(E2E - TTFT) / (n - 1)`` with ``n`` the
output tokens as the server counts them (``usage.completion_tokens`` from the last chunk, asked for
with ``stream_options.include_usage``; the number of chunks with text when the server sends no
usage). An engine that sends several tokens in one chunk has fewer ITL gaps than tokens: TPOT is
then the fairer figure. Percentiles are nearest-rank (:func:`labsupport.latency.percentile`).
Throughput is over the benchmark's duration, from the first request sent to the last answer
received: requests per second and output tokens per second.

Prompts are random words from a fixed list (seeded), so one prompt does not share a prefix with
another and the same command sends the same prompts to every server. ``--ignore-eos`` asks the
server to generate exactly ``--output-tokens`` (vLLM's and SGLang's extension; the course server
ignores the field, so its answers may end earlier at an end-of-text token).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ._answers import answer
from ._optional import OptionalModule
from .latency import percentile

httpx = OptionalModule("httpx", "httpx", "the serving benchmark (labsupport.bench_serving)")  # imported at first use

__all__ = ["RequestResult", "arrival_times", "random_prompts", "run_benchmark", "summarize_results", "main"]

WORDS = (
    "the cache holds keys and values for every layer while the scheduler picks which requests run next "
    "a block of tokens fills before the next one is taken and memory is shared between many users "
    "prefill reads the whole prompt at once decode adds one token per step and waits on memory bandwidth "
    "engines batch requests together so each weight is read once for all of them"
).split()

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds of ``time.perf_counter``)."""

    sent_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # chunks that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times_s)


@answer
def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of ``n`` requests, from 0: gamma gaps of mean ``1/request_rate`` and shape
    ``burstiness`` (1 is Poisson); all zero when ``request_rate`` is infinite."""
    if n < 1:
        raise ValueError(f"num_prompts must be at least 1, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return out


def random_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` prompts of ``words`` random words each (seeded)."""
    rng = random.Random(seed + 1)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult) -> None:
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            usage = None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    result.chunk_times_s.append(now)
            result.output_tokens = usage["completion_tokens"] if usage else len(result.chunk_times_s)
            result.prompt_tokens = usage.get("prompt_tokens") if usage else None
            if not result.chunk_times_s:
                result.error = "the stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def _run(base_url: str, model: str, prompts: Sequence[str], output_tokens: int, times: Sequence[float],
               max_concurrency: int | None, ignore_eos: bool, timeout_s: float, api_key: str | None):
    url = base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def send(prompt: str, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True
            if gate is not None:
                async with gate:
                    result = RequestResult(time.perf_counter())
                    results.append(result)
                    await _one(client, url, body, result)
            else:
                result = RequestResult(time.perf_counter())
                results.append(result)
                await _one(client, url, body, result)

        await asyncio.gather(*(send(p, t) for p, t in zip(prompts, times)))
    return results


def _run_sync(coro):
    """``asyncio.run(coro)``, also from inside a running event loop (a Jupyter kernel has one): there
    it runs in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_benchmark(base_url: str, model: str, *, num_prompts: int = 20, request_rate: float = math.inf,
                  burstiness: float = 1.0, input_words: int = 32, output_tokens: int = 32,
                  max_concurrency: int | None = None, ignore_eos: bool = False, seed: int = 0,
                  timeout_s: float = 600.0, api_key: str | None = None) -> dict:
    """Run the benchmark (module docstring) and return :func:`summarize_results` of it, with the
    settings and the per-request results (``"requests"``)."""
    if output_tokens < 1 or input_words < 1:
        raise ValueError("output_tokens and input_words must be at least 1")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1 (or None), got {max_concurrency}")
    times = arrival_times(num_prompts, request_rate, burstiness, seed)
    prompts = random_prompts(num_prompts, input_words, seed)
    results = _run_sync(_run(base_url, model, prompts, output_tokens, times, max_concurrency, ignore_eos,
                             timeout_s, api_key))
    summary = summarize_results(results)
    summary["settings"] = {"base_url": base_url, "model": model, "num_prompts": num_prompts,
                           "request_rate": request_rate, "burstiness": burstiness, "input_words": input_words,
                           "output_tokens": output_tokens, "max_concurrency": max_concurrency,
                           "ignore_eos": ignore_eos, "seed": seed}
    summary["requests"] = [asdict(r) for r in results]
    return summary


def _stats(values: Sequence[float]) -> dict | None:
    if not values:
        return None
    out = {"mean": sum(values) / len(values)}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return out


def summarize_results(results: Sequence[RequestResult]) -> dict:
    """Counts, throughputs and TTFT/TPOT/ITL/E2E statistics (mean and nearest-rank p50/p90/p99,
    in seconds) over the successful requests."""
    ok = [r for r in results if r.ok]
    if not ok:
        errors = sorted({r.error or "no text" for r in results})
        raise RuntimeError(f"no request succeeded; errors: {errors[:3]}")
    start = min(r.sent_s for r in results)
    end = max(r.chunk_times_s[-1] for r in ok)
    duration = end - start
    ttft = [r.chunk_times_s[0] - r.sent_s for r in ok]
    e2e = [r.chunk_times_s[-1] - r.sent_s for r in ok]
    tpot = [(r.chunk_times_s[-1] - r.chunk_times_s[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": tokens / duration,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(tpot),
        "itl_s": _stats(itl),
        "e2e_s": _stats(e2e),
    }


def format_summary(summary: dict) -> str:
    """The summary as a table, times in milliseconds."""
    lines = [
        f"{'successful requests':<34}{summary['completed']}",
        f"{'failed requests':<34}{summary['failed']}",
        f"{'benchmark duration (s)':<34}{summary['duration_s']:.2f}",
        f"{'output tokens':<34}{summary['output_tokens']}",
        f"{'request throughput (req/s)':<34}{summary['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34}{summary['output_throughput']:.1f}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        stats = summary[key]
        if stats is None:
            lines.append(f"{label + ' (ms)':<34}n/a")
            continue
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in stats.items())
        lines.append(f"{label + ' (ms)':<34}{parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the server serves (GET /v1/models)")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--input-words", type=int, default=32, help="random words per prompt")
    p.add_argument("--output-tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="ask vLLM or SGLang to generate all output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--save", default=None, help="write the summary and per-request results to this JSON file")
    args = p.parse_args(argv)
    try:
        summary = run_benchmark(args.base_url, args.model, num_prompts=args.num_prompts,
                                request_rate=args.request_rate, burstiness=args.burstiness,
                                input_words=args.input_words, output_tokens=args.output_tokens,
                                max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, seed=args.seed,
                                api_key=args.api_key)
    except (ValueError, RuntimeError) as exc:
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
