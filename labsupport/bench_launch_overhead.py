"""Launch overhead on a GPU: a batch-1 decode step eager against replayed from a CUDA graph (chapter 12).

    python -m labsupport.bench_launch_overhead --out results/gpu_launch_overhead.json   # on a GPU
    python -m labsupport.bench_launch_overhead --dry-run --out /tmp/x.json              # anywhere

For each model shape (the course's presets, bf16 on the GPU), a cache is filled to ``context``
positions, and the same decode step (batch 1, the token at position ``context``) is timed two
ways: **eager**, ``model.decode_step`` as the course runs it (Python, the dispatcher and one launch
per kernel), and **captured**, the same call recorded once into a ``torch.cuda.CUDAGraph`` and
replayed (one launch for the whole step). The cache's length is reset before every eager call, so
both do exactly the same work: write position ``context``, attend over ``context + 1`` positions.
Times are medians of ``repeats`` steps after a warm-up, with ``torch.cuda.synchronize`` around
each. The saving, ``eager - captured``, is the step's launch and Python overhead.

A dry run (``--dry-run``) runs the eager half on the CPU at the smallest shape, with the profile of
:func:`labsupport.launch_overhead.profile_decode_step`; its file says ``dry_run: true`` and
chapter 12 never shows it (:func:`load_results`). Until a real run's file is committed, the
chapter says "not yet measured".
"""

from __future__ import annotations

import statistics
import time

import torch

from . import bench_harness as H
from .launch_overhead import profile_decode_step
from .models import get_model
from .transformer import Transformer

GPU_RESULTS = "results/gpu_launch_overhead.json"
SHAPES = ("tiny-2m", "tiny-20m", "small-63m")
CONTEXT = 256


def _median_time(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure(name: str, device: str, dtype: torch.dtype, repeats: int, context: int = CONTEXT) -> dict:
    model = Transformer(get_model(name), device=device, dtype=dtype, seed=0)
    cache = model.new_cache(1, context + 1)
    model.prefill(model.random_prompt(1, context, seed=0), cache)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def eager():
        cache.length = context  # the same step every time: position `context`
        return model.decode_step(token, cache)

    for _ in range(3):
        eager()
    row = {"model": name, "context": context, "eager_s": _median_time(eager, repeats, sync)}
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as CUDA graph capture requires
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        cache.length = context
        with torch.cuda.graph(graph):
            captured_logits = model.decode_step(token, cache)
        graph.replay()
        row["captured_s"] = _median_time(graph.replay, repeats, sync)
        row["saving_s"] = row["eager_s"] - row["captured_s"]
        row["max_abs_diff"] = float((captured_logits - eager()).abs().max())  # same step, same logits
    else:
        row["captured_s"] = None  # CUDA graphs need a GPU
    prof = profile_decode_step(model, context=min(context, 32), steps=5)
    row["ops_per_step"] = prof["ops_per_step"]
    row["python_share_cpu_profile"] = prof["python_share"]
    return row


def measure_all(args) -> None:
    dry_run = args.dry_run
    device = "cpu" if dry_run else "cuda"
    rec = H.Recorder(args.out, H.header(dry_run, dtype="float32" if dry_run else "bfloat16", batch=1,
                                        timing="median of wall-clock steps with torch.cuda.synchronize around each",
                                        rows=[]))
    for name in (SHAPES[:1] if dry_run else SHAPES):
        rec.data["rows"].append(measure(name, device, torch.float32 if dry_run else torch.bfloat16,
                                        5 if dry_run else 200, context=16 if dry_run else CONTEXT))
        rec.save(name)


def load_results(path=None) -> dict | None:
    """The committed GPU run, or None (no file, or a dry run: never shown as a measurement)."""
    return H.load_results("launch_overhead", path)


def results_markdown(path=None) -> str:
    """Chapter 12's table of eager against captured steps, with device and date, or "not yet measured"."""
    results = load_results(path)
    if results is None:
        return ("GPU figures: not yet measured. Running `python -m labsupport.bench_launch_overhead` on a GPU "
                "writes `results/gpu_launch_overhead.json`, and this page shows it.")
    lines = [f"Measured on {results['device']}, {H.date_of(results)} (torch {results['torch']}, "
             f"{results['dtype']}, batch 1, context {results['rows'][0]['context']}):", "",
             "| model | eager step (ms) | CUDA graph replay (ms) | saved |", "| --- | --- | --- | --- |"]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['eager_s'] * 1e3:.3f} | {r['captured_s'] * 1e3:.3f} | "
                     f"{r['saving_s'] / r['eager_s']:.0%} |")
    return "\n".join(lines)


NOT_MEASURED = "not yet measured"


def gpu_figures(path=None) -> dict:
    """The figures chapter 12 quotes from a run, as text (each "not yet measured" without one):
    eager and replayed step times, the share of the eager step a CUDA graph saved, and the CPU
    profiler's between-operator share of the same step, across the run's model shapes."""
    keys = ("status", "when", "models", "eager_ms", "replay_ms", "saving", "speedup", "python_share", "ops", "context")
    out = dict.fromkeys(keys, NOT_MEASURED)
    out["status"] = ("No GPU has run it for this build of the book, so "
                     "every GPU figure below reads \"not yet measured\"")
    results = load_results(path)
    if results is None:
        return out
    out["status"] = (f"It ran on an {results['device']} on "
                     f"{H.date_of(results)} (torch {results['torch']}, {results['dtype']})")
    rows = results["rows"]

    def span(values, fmt):
        lo, hi = fmt.format(min(values)), fmt.format(max(values))
        return lo if lo == hi else f"{lo} to {hi}"

    out["when"] = f"{results['device']}, {H.date_of(results)} (torch {results['torch']}, {results['dtype']})"
    out["models"] = ", ".join(r["model"] for r in rows)
    out["eager_ms"] = span([r["eager_s"] * 1e3 for r in rows], "{:.2f}") + " ms"
    out["replay_ms"] = span([r["captured_s"] * 1e3 for r in rows], "{:.2f}") + " ms"
    out["saving"] = span([100 * r["saving_s"] / r["eager_s"] for r in rows], "{:.0f}") + "%"
    out["speedup"] = span([r["eager_s"] / r["captured_s"] for r in rows], "{:.0f}") + "x"
    if all(r.get("python_share_cpu_profile") is not None for r in rows):
        out["python_share"] = span([100 * r["python_share_cpu_profile"] for r in rows], "{:.0f}") + "%"
    out["ops"] = span([r["ops_per_step"] for r in rows], "{:,}")
    out["context"] = f"{rows[0]['context']:,}"
    return out


BENCH = H.Bench("launch_overhead", "12", measure_all, description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
