"""Chapter 05's GPU measurements: prefill against prompt length, decode against batch and context.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_phases --out results/gpu_phases.json
    python -m labsupport.bench_phases --dry-run --out /tmp/phases.json   # on a CPU, tiny shapes:
                                                                        # checks the code, measures nothing

On the Llama 3.1 8B shape with random (seeded) weights in bf16, it records:

* the device's copy bandwidth and bf16 matmul FLOP/s (:mod:`labsupport.roofline`);
* prefill time against prompt length up to 32,768 tokens, the FLOP/s achieved under two counts
  (the runbook's ``2*N*P`` plus causal attention, and what the course model performs,
  :func:`labsupport.phases.model_prefill_flops`), the fit ``a*P + b*P**2 + c`` with its crossover
  ``a/b`` beside both predictions, and the measured 32,768 / 2,048 time ratio;
* decode step time against batch (context 8,192) and against context (batch 1), with the bytes a
  step really reads over its time as a fraction of the copy bandwidth; at batch 1 also with the
  step captured in a CUDA graph (no launch overhead). Points whose weights and cache would not fit
  the GPU are skipped before their cache is allocated, and the results say which and why
  (:func:`labsupport.phases.plan_decode_points`).

The results file is rewritten after every section, so a run stopped early keeps what it measured.
Chapter 05 reads ``results/gpu_phases.json`` (:func:`labsupport.phases.load_gpu_results`).
Without a GPU (and without ``--dry-run``) the command exits with status 2 and says why.
"""

from __future__ import annotations

import torch

from . import bench_harness as H
from . import costs
from .models import get_model
from .phases import (
    fit_prefill_times,
    is_out_of_memory,
    measure_decode,
    measure_prefill,
    model_prefill_crossover,
    model_prefill_flops,
    plan_decode_points,
    unread_embedding_bytes,
)
from .roofline import measure_copy, measure_matmul
from .timing import benchmark
from .transformer import Transformer

# The sweeps: (GPU, dry run). The dry run uses a tiny model on the CPU and measures nothing.
MODEL = ("llama-3.1-8b", "tiny-2m")
PREFILL_LENGTHS = ([512, 1024, 2048, 4096, 8192, 16384, 32768], [32, 64, 128, 256, 512])
DECODE_BATCHES = ([1, 8, 32, 64, 128], [1, 8, 32, 64, 128])
DECODE_BATCH_CONTEXT = (8192, 64)
DECODE_CONTEXTS = ([512, 2048, 8192, 32768, 131072], [128, 512])
SHORT_CONTEXT = 512  # "batch 1, short context" in the book
BOOK_BATCH = 64  # the book's "batch 64 at 8,192 tokens" point


def prefill_rows(cfg, points) -> list[dict]:
    """One row per measured prompt length, FLOP/s under both counts."""
    rows = []
    for p in points:
        row = {"prompt_tokens": p.prompt_tokens, "seconds": p.seconds, "oom": p.oom}
        if not p.oom:
            runbook = costs.prefill_flops(cfg, p.prompt_tokens, causal=True)
            performed = model_prefill_flops(cfg, p.prompt_tokens, causal=True)
            row.update(flops_runbook_causal=runbook, flops_performed=performed,
                       tflops_runbook_causal=runbook / p.seconds / 1e12,
                       tflops_performed=performed / p.seconds / 1e12)
        rows.append(row)
    return rows


def decode_rows(cfg, points, planned, copy_bw: float, element: int) -> list[dict]:
    """One row per planned decode point: measured, out of memory, or skipped with its reason."""
    measured = {(p.batch, p.context): p for p in points}
    rows = []
    for plan in planned:
        row = {"batch": plan.batch, "context": plan.context, "needs_bytes": plan.needs_bytes}
        p = measured.get((plan.batch, plan.context))
        if p is None:
            row.update(skipped=plan.reason or "not run", oom=False, seconds=None)
            print(f"decode batch {plan.batch} x context {plan.context}: skipped, {row['skipped']}", flush=True)
            rows.append(row)
            continue
        runbook = costs.decode_step_bytes(cfg, p.batch, p.context, element, element)
        read = runbook.total - unread_embedding_bytes(cfg, p.batch, element)
        row.update(oom=p.oom, cache_bytes=p.cache_bytes, bytes_read=read, bytes_runbook_count=runbook.total,
                   cache_share=runbook.cache / read, seconds=p.seconds)
        if not p.oom:
            row["achieved_Bps"] = read / p.seconds
            row["fraction_of_copy"] = read / p.seconds / copy_bw
        state = "out of memory" if p.oom else (
            f"{p.seconds * 1e3:.2f} ms, {row['achieved_Bps'] / 1e12:.2f} TB/s = {row['fraction_of_copy']:.0%} of copy")
        print(f"decode batch {p.batch} x context {p.context}: {state}", flush=True)
        rows.append(row)
    return rows


def graphed_decode_seconds(model, context: int) -> float:
    """Median time of one batch-1 decode step replayed from a CUDA graph (no launch overhead)."""
    cache = model.new_cache(1, context + 1)
    tokens = model.random_prompt(1, 1)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the capture (kernel selection, workspaces)
                model._run(tokens, cache, context)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model._run(tokens, cache, context)  # reads `context` cached positions, writes one
    return benchmark(graph.replay).median_s


def prefill_section(r: dict, cfg, model, lengths, quick: dict) -> None:
    """Prefill against prompt length: the rows, the long-over-short ratio and the quadratic fit."""
    points = measure_prefill(model, lengths, **quick)
    r["prefill"] = prefill_rows(cfg, points)
    ok = [p for p in points if not p.oom]
    by_len = {p.prompt_tokens: p.seconds for p in ok}
    long, short = lengths[-1], lengths[-1] // 16
    if short in by_len and long in by_len:
        r[f"prefill_ratio_{long}_over_{short}"] = by_len[long] / by_len[short]
    r["prefill_flop_ratio"] = costs.prefill_flops(cfg, long) / costs.prefill_flops(cfg, short)
    r["prefill_flop_ratio_causal"] = costs.prefill_flops(cfg, long, True) / costs.prefill_flops(cfg, short, True)
    r["prefill_flop_ratio_performed"] = model_prefill_flops(cfg, long) / model_prefill_flops(cfg, short)
    try:
        fit = fit_prefill_times([p.prompt_tokens for p in ok], [p.seconds for p in ok])
        r["prefill_fit"] = {
            "linear_s_per_token": fit.linear,
            "quadratic_s_per_token2": fit.quadratic,
            "constant_s": fit.constant,
            "measured_crossover_tokens": fit.crossover,
            "predicted_crossover_N_over_2Ld": costs.quadratic_crossover(cfg),
            "predicted_crossover_causal": costs.quadratic_crossover(cfg, causal=True),
            "predicted_crossover_performed_causal": model_prefill_crossover(cfg, causal=True),
            "max_relative_error": fit.max_relative_error,
        }
        print(fit, flush=True)
    except ValueError as exc:  # too few points fitted (out of memory): keep the raw times
        r["prefill_fit"] = {"error": str(exc)}


def graph_section(r: dict, cfg, model, copy_bw: float, element: int, dry_run: bool) -> None:
    """Decode at batch 1 from a CUDA graph (an error is recorded, never raised: the eager results stay)."""
    try:
        if dry_run:
            raise RuntimeError("dry run: CUDA graphs need a GPU")
        t = graphed_decode_seconds(model, SHORT_CONTEXT)
        read = (costs.decode_step_bytes(cfg, 1, SHORT_CONTEXT, element, element).total
                - unread_embedding_bytes(cfg, 1, element))
        r["decode_batch1_short_cuda_graph"] = {"seconds": t, "achieved_Bps": read / t,
                                               "fraction_of_copy": read / t / copy_bw}
        print(f"decode batch 1 x {SHORT_CONTEXT}, CUDA graph: {t * 1e3:.2f} ms = {read / t / copy_bw:.0%} of copy",
              flush=True)
    except Exception as exc:  # a capture failure must not lose the eager results
        r["decode_batch1_short_cuda_graph"] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                               "oom": is_out_of_memory(exc)}
        print("CUDA graph capture did not run:", str(exc)[:200], flush=True)


def run(out_path: str, *, dry_run: bool) -> dict:
    """Measure everything, saving to ``out_path`` after each section; return the results."""
    pick = (lambda gpu, dry: dry) if dry_run else (lambda gpu, dry: gpu)
    device, dtype = pick("cuda", "cpu"), pick(torch.bfloat16, torch.float32)
    element = dtype.itemsize
    cfg = get_model(pick(*MODEL))
    quick = pick({}, {"repeats": 1})  # the dry run times each point once; on a GPU do_bench decides
    if dry_run:
        torch.set_num_threads(1)  # steady on a shared machine; the numbers mean nothing anyway
    rec = H.Recorder(out_path, H.header(dry_run, model=cfg.name, dtype=str(dtype).replace("torch.", ""),
                                        weights="random (seeded); timing does not depend on values"))
    r = rec.data

    copy_bw = max(measure_copy(pick([2**30, 4 * 2**30], [2**22]), device=device, **quick))
    peak = max(measure_matmul(pick([4096, 8192], [128]), dtype=dtype, device=device, **quick))
    r.update(copy_bandwidth_Bps=copy_bw, matmul_flops=peak)
    print(f"copy {copy_bw / 1e12:.2f} TB/s, matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    model = Transformer(cfg, device=device, dtype=dtype)
    print(model.extra_repr(), f"{model.param_bytes() / 1e9:.2f} GB of weights", flush=True)
    rec.save("ceilings")

    prefill_section(r, cfg, model, pick(*PREFILL_LENGTHS), quick)
    rec.save("prefill")

    # --- decode: points that do not fit the card are skipped before their cache is allocated ---
    if device == "cuda":
        torch.cuda.empty_cache()  # what the prefill sweep left cached counts as free
        free, total = torch.cuda.mem_get_info()
    else:
        free, total = None, None
    r["decode_memory"] = {"free_bytes_after_weights": free, "total_bytes": total}

    def sweep(batches, contexts):
        planned = plan_decode_points(cfg, [(b, c) for b in batches for c in contexts],
                                     memory_bytes=float("inf") if free is None else free + model.param_bytes(),
                                     dtype_bytes=element)
        measured = []
        for p in planned:
            if p.fits:
                measured += measure_decode(model, [p.batch], [p.context], progress=False, **quick)
        return decode_rows(cfg, measured, planned, copy_bw, element)

    r["decode_by_batch"] = sweep(pick(*DECODE_BATCHES), [pick(*DECODE_BATCH_CONTEXT)])
    book_point = next(row for row in r["decode_by_batch"] if row["batch"] == BOOK_BATCH)
    r[f"decode_batch{BOOK_BATCH}_ctx{pick(*DECODE_BATCH_CONTEXT)}_fraction_of_copy"] = book_point.get("fraction_of_copy")
    if "skipped" in book_point:
        r["decode_book_point_skipped"] = book_point["skipped"]
    rec.save("decode against batch")
    r["decode_by_context"] = sweep([1], pick(*DECODE_CONTEXTS))
    short_row = next(row for row in r["decode_by_context"] if row["context"] == SHORT_CONTEXT)
    r["decode_batch1_short_fraction_of_copy"] = short_row.get("fraction_of_copy")
    rec.save("decode against context")

    graph_section(r, cfg, model, copy_bw, element, dry_run)
    rec.save("all")
    return r


def _measure(args) -> None:
    run(args.out, dry_run=args.dry_run)


BENCH = H.Bench("phases", "05", _measure, description=__doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
