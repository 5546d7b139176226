"""guidellm (the vLLM project's benchmark tool) against the course server, beside the course's own
``labsupport.bench_serving`` at the same offered load: a manual check, with results for chapter 15.

guidellm installs about 1.5 GB (torch, transformers, datasets) in its own venv, more than the test
suite's budget allows, so this runs by hand and its output is committed as
``results/guidellm_course_server.json``, which chapter 15 reads::

    python3 -m venv /tmp/guidellm-venv
    /tmp/guidellm-venv/bin/pip install torch==2.13.0 guidellm   # the CPU torch first: no CUDA wheels
    .venv/bin/python scripts/guidellm_check.py --guidellm /tmp/guidellm-venv/bin/guidellm

It starts the course server (chapter 15's FIFO settings: a 10 ms pause per forward pass), then for
each offered rate sends the same number of Poisson-timed, streamed requests of the same sizes with
``bench_serving``, with guidellm in one worker process, and with guidellm's default workers (whose
Poisson profile repeats each gap in every worker process: bursts), and writes each run's TTFT, ITL,
TPOT and E2E with the date, the machine and every version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

import httpx
import torch

from labsupport.bench_serving import run_benchmark
from labsupport.serve import ServerProcess
from labsupport.serve.guidellm import RESULTS_PATH, guidellm_command
from labsupport.serve.served_model import MODEL_NAME

SERVER_OPTIONS = ["--context", "128", "--max-tokens-limit", "32", "--step-delay", "0.01", "--max-requests", "256"]
ROOT = Path(__file__).resolve().parents[1]


def _gaps(benchmark: dict) -> dict:
    """How Poisson the arrivals guidellm aimed for were: the share of gaps equal to the one before
    (0 for a Poisson process) and the gaps' coefficient of variation (1 for a Poisson process)."""
    starts = sorted(r["info"]["timings"]["targeted_start"] for r in benchmark["requests"]["successful"])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    repeated = sum(abs(b - a) < 1e-9 for a, b in zip(gaps, gaps[1:])) / max(1, len(gaps) - 1)
    m = mean(gaps)
    cv = (sum((g - m) ** 2 for g in gaps) / len(gaps)) ** 0.5 / m
    return {"repeated_gap_share": repeated, "gap_cv": cv}


def _guidellm_figures(path: str) -> dict:
    benchmark = json.loads(Path(path).read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]

    def stats(name: str, scale: float = 1.0) -> dict:
        s = metrics[name]["successful"]
        return {"mean": s["mean"] * scale, "p50": s["percentiles"]["p50"] * scale,
                "p90": s["percentiles"]["p90"] * scale}

    return {"completed": metrics["request_totals"]["successful"], "failed": metrics["request_totals"]["errored"],
            "ttft_ms": stats("time_to_first_token_ms"), "itl_ms": stats("inter_token_latency_ms"),
            "tpot_ms": stats("time_per_output_token_ms"), "e2e_ms": stats("request_latency", 1e3),
            "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"], **_gaps(benchmark)}


def _bench_figures(summary: dict) -> dict:
    def ms(key: str) -> dict:
        return {k: summary[key][k] * 1e3 for k in ("mean", "p50", "p90")}

    starts = sorted(r["sent_s"] for r in summary["requests"])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    m = mean(gaps)
    cv = (sum((g - m) ** 2 for g in gaps) / len(gaps)) ** 0.5 / m
    repeated = sum(abs(b - a) < 1e-9 for a, b in zip(gaps, gaps[1:])) / max(1, len(gaps) - 1)

    return {"completed": summary["completed"], "failed": summary["failed"], "ttft_ms": ms("ttft_s"),
            "itl_ms": ms("itl_s"), "tpot_ms": ms("tpot_s"), "e2e_ms": ms("e2e_s"),
            "output_tokens_per_s": summary["output_throughput"], "repeated_gap_share": repeated, "gap_cv": cv}


def _versions(guidellm: str) -> dict:
    import fastapi
    import uvicorn

    shown = subprocess.run([guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {"guidellm": shown.split()[-1] if shown else None, "python": platform.python_version(),
            "torch": torch.__version__, "fastapi": fastapi.__version__, "uvicorn": uvicorn.__version__,
            "labsupport_commit": commit.strip() or None}


def _server_sums(url: str) -> dict:
    """The server's own TTFT and inter-token latency histograms: sums and counts (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"course:{m}_seconds_{k}" for m in ("time_to_first_token", "inter_token_latency") for k in ("sum", "count")}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


def _server_means(before: dict, after: dict) -> dict:
    """Mean TTFT and ITL as the server measured them over one run, in ms (a slow client cannot inflate them)."""
    def mean_ms(metric: str) -> float:
        n = after[f"course:{metric}_seconds_count"] - before[f"course:{metric}_seconds_count"]
        return 1e3 * (after[f"course:{metric}_seconds_sum"] - before[f"course:{metric}_seconds_sum"]) / n

    return {"server_ttft_ms_mean": mean_ms("time_to_first_token"), "server_itl_ms_mean": mean_ms("inter_token_latency")}


def _tokenizer_dir(url: str) -> str:
    """Where the server wrote its tokenizer: ``root`` of its model card."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["root"]


def run(guidellm: str, rates: list[float], requests: int, input_words: int, output_tokens: int) -> dict:
    runs = []
    with ServerProcess(SERVER_OPTIONS, threads=1) as server, tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = _tokenizer_dir(server.url)
        for rate in rates:
            before = _server_sums(server.url)
            bench = run_benchmark(server.base_url, MODEL_NAME, num_prompts=requests, request_rate=rate,
                                  input_words=input_words, output_tokens=output_tokens, ignore_eos=True, seed=0)
            prompt_tokens = round(mean(r["prompt_tokens"] for r in bench["requests"] if r["prompt_tokens"]))
            runs.append({"client": "bench_serving", "rate": rate, "workers": None, **_bench_figures(bench),
                         **_server_means(before, _server_sums(server.url))})
            for workers in (1, None):
                out = os.path.join(tmp, f"guidellm-{rate}-{workers}.json")
                env = dict(os.environ, **({"GUIDELLM__MAX_WORKER_PROCESSES": str(workers)} if workers else {}))
                command = guidellm_command(guidellm, server.url, MODEL_NAME, tokenizer_dir, rate, requests,
                                           prompt_tokens, output_tokens, out)
                before = _server_sums(server.url)
                subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=600)
                runs.append({"client": "guidellm", "rate": rate, "workers": workers, **_guidellm_figures(out),
                             **_server_means(before, _server_sums(server.url))})
    return {"runs": runs, "prompt_tokens": prompt_tokens, "tokenizer_dir": tokenizer_dir}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm", help="guidellm's executable")
    p.add_argument("--rates", default="1,2.5", help="offered loads, requests per second, comma-separated (1,2.5)")
    p.add_argument("--requests", type=int, default=40, help="requests per run (40)")
    p.add_argument("--input-words", type=int, default=8, help="bench_serving's prompt words (8)")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (16, with ignore_eos)")
    p.add_argument("--out", default=str(RESULTS_PATH))
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    measured = run(args.guidellm, rates, args.requests, args.input_words, args.output_tokens)
    result = {
        "what": "guidellm beside labsupport.bench_serving against the course server, the same offered load",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "load_average_1min": round(os.getloadavg()[0], 1)},
        "versions": _versions(args.guidellm),
        "server": {"command": ["python", "-m", "labsupport.serve", *SERVER_OPTIONS, "--threads", "1"], "engine": "fifo",
                   "model": MODEL_NAME},
        "load": {"requests": args.requests, "arrivals": "Poisson", "rates": rates, "output_tokens": args.output_tokens,
                 "input_words": args.input_words, "prompt_tokens": measured["prompt_tokens"], "streamed": True},
        "guidellm_command": "GUIDELLM__MAX_WORKER_PROCESSES=1 " + " ".join(guidellm_command(
            "guidellm", "http://127.0.0.1:8000", MODEL_NAME, "TOKENIZER_DIR", rates[0], args.requests,
            measured["prompt_tokens"], args.output_tokens)),
        "conventions": "times in ms; bench_serving: nearest-rank percentiles over the requests; guidellm: its own "
                       "percentiles; TPOT = (E2E - TTFT) / (tokens - 1) in both; workers=1 sets "
                       "GUIDELLM__MAX_WORKER_PROCESSES=1, workers=null is guidellm's default (10 processes)",
        "runs": measured["runs"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    for r in result["runs"]:
        print(f"{r['client']:<14} rate {r['rate']:g} workers {r['workers']}: TTFT p50 {r['ttft_ms']['p50']:.1f} ms, "
              f"p90 {r['ttft_ms']['p90']:.1f} ms; TPOT p50 {r['tpot_ms']['p50']:.2f} ms; "
              f"{r['output_tokens_per_s']:.0f} tokens/s; server: TTFT {r['server_ttft_ms_mean']:.1f} ms, ITL "
              f"{r['server_itl_ms_mean']:.2f} ms (means); gaps: CV {r['gap_cv']:.2f}, repeated {r['repeated_gap_share']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
