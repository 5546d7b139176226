#!/usr/bin/env bash
# Measure chapter 05's GPU figures on the Llama 3.1 8B shape (random weights, bf16) and write
# them to results/gpu_phases.json (override with OUT=path). Needs one CUDA GPU with at least
# 40 GB of memory; large batch x context decode points that do not fit are recorded as "oom".
#
#   bash scripts/gpu_phases.sh            # about 3-5 minutes on an H100/H200
#   GPU_PHASES_DRY_RUN=1 bash scripts/gpu_phases.sh   # the same code path on a CPU with tiny
#                                                     # shapes (checks the script, measures nothing)
#
# What it records:
#   * copy bandwidth and bf16 matmul FLOP/s of the device (labsupport.roofline);
#   * prefill time against prompt length up to 32,768 tokens, the fit a*P + b*P^2 + c and its
#     crossover a/b, and the measured 32,768 / 2,048 ratio (FLOP-count ratio: 31.0, 23.8 causal);
#   * decode step time against batch (context 8,192) and against context (batch 1), the achieved
#     bandwidth (labsupport.costs.decode_step_bytes / step time) and its fraction of the copy
#     bandwidth, eager and, at batch 1, with the step captured in a CUDA graph.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${OUT:-results/gpu_phases.json}"
mkdir -p "$(dirname "$OUT")"

"$PY" - "$OUT" <<'PYEOF'
import datetime
import json
import os
import sys
import time

import torch

import labsupport
from labsupport import costs
from labsupport.model import Transformer
from labsupport.models import get_model
from labsupport.phases import fit_prefill_times, is_out_of_memory, measure_decode, measure_prefill
from labsupport.roofline import measure_copy, measure_matmul
from labsupport.timing import benchmark

out_path = sys.argv[1]
DRY = os.environ.get("GPU_PHASES_DRY_RUN") == "1"
if not DRY and not torch.cuda.is_available():
    sys.exit("gpu_phases.sh: no CUDA GPU visible to torch; run it on a GPU machine")
settings = labsupport.setup()
if not DRY and settings.interpreter:
    sys.exit("gpu_phases.sh: TRITON_INTERPRET is set; unset it so timings use the GPU")


def pick(gpu, dry):
    return dry if DRY else gpu


start = time.time()
DEVICE, DTYPE = pick("cuda", "cpu"), pick(torch.bfloat16, torch.float32)
ELEMENT = 2 if DTYPE == torch.bfloat16 else 4
cfg = get_model(pick("llama-3.1-8b", "tiny-2m"))
results = {
    "dry_run": DRY,
    "device": settings.device_name,
    "date": datetime.date.today().isoformat(),
    "torch": torch.__version__,
    "model": cfg.name,
    "dtype": str(DTYPE).replace("torch.", ""),
    "weights": "random (seeded); timing does not depend on values",
}

copy_bw = max(measure_copy(pick([2**30, 4 * 2**30], [2**26]), device=DEVICE))
peak = max(measure_matmul(pick([4096, 8192], [512]), dtype=DTYPE, device=DEVICE))
results["copy_bandwidth_Bps"] = copy_bw
results["matmul_flops"] = peak
print(f"copy {copy_bw / 1e12:.2f} TB/s, matmul {peak / 1e12:.0f} TFLOP/s", flush=True)

model = Transformer(cfg, device=DEVICE, dtype=DTYPE)
print(model, f"{model.param_bytes() / 1e9:.2f} GB of weights", flush=True)

# --- prefill ---------------------------------------------------------------------------------
lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768]
prefill = measure_prefill(model, pick(lengths, lengths[:5]), **pick({}, {"repeats": 1}))
ok = [p for p in prefill if not p.oom]
results["prefill"] = [
    {
        "prompt_tokens": p.prompt_tokens,
        "seconds": p.seconds,
        "oom": p.oom,
        "tflops_achieved_causal": None if p.oom else costs.prefill_flops(cfg, p.prompt_tokens, causal=True) / p.seconds / 1e12,
    }
    for p in prefill
]
fit = fit_prefill_times([p.prompt_tokens for p in ok], [p.seconds for p in ok])
by_len = {p.prompt_tokens: p.seconds for p in ok}
results["prefill_fit"] = {
    "linear_s_per_token": fit.linear,
    "quadratic_s_per_token2": fit.quadratic,
    "constant_s": fit.constant,
    "measured_crossover_tokens": fit.crossover,
    "predicted_crossover_N_over_2Ld": costs.quadratic_crossover(cfg),
    "predicted_crossover_causal": costs.quadratic_crossover(cfg, causal=True),
    "max_relative_error": fit.max_relative_error,
}
long = pick(32768, 8192)
if 2048 in by_len and long in by_len:
    results[f"prefill_ratio_{long}_over_2048"] = by_len[long] / by_len[2048]
results["prefill_flop_ratio_32k_over_2k"] = costs.prefill_flops(cfg, 32768) / costs.prefill_flops(cfg, 2048)
results["prefill_flop_ratio_32k_over_2k_causal"] = costs.prefill_flops(cfg, 32768, True) / costs.prefill_flops(cfg, 2048, True)
print(fit, flush=True)


# --- decode ----------------------------------------------------------------------------------
def decode_rows(points):
    rows = []
    for p in points:
        read = costs.decode_step_bytes(cfg, p.batch, p.context, ELEMENT, ELEMENT)
        row = {"batch": p.batch, "context": p.context, "oom": p.oom, "cache_bytes": p.cache_bytes,
               "bytes_read": read.total, "cache_share": read.cache_share, "seconds": p.seconds}
        if not p.oom:
            row["achieved_Bps"] = read.total / p.seconds
            row["fraction_of_copy"] = read.total / p.seconds / copy_bw
        rows.append(row)
        state = "out of memory (the cache wall)" if p.oom else (
            f"{p.seconds * 1e3:.2f} ms, {row['achieved_Bps'] / 1e12:.2f} TB/s = {row['fraction_of_copy']:.0%} of copy")
        print(f"decode batch {p.batch} x context {p.context}: {state}", flush=True)
    return rows


quick = pick({}, {"repeats": 1})
results["decode_by_batch"] = decode_rows(measure_decode(model, [1, 8, 32, 64, 128], [pick(8192, 64)], **quick))
contexts = pick([512, 2048, 8192, 32768, 131072], [512, 2048])
results["decode_by_context"] = decode_rows(measure_decode(model, [1], contexts, **quick))
short = decode_rows(measure_decode(model, [1], [512], progress=False, **quick))[0]
results["decode_batch1_short_fraction_of_copy"] = short.get("fraction_of_copy")
b64 = next(r for r in results["decode_by_batch"] if r["batch"] == 64)
results["decode_batch64_ctx8192_fraction_of_copy"] = b64.get("fraction_of_copy")


# --- decode at batch 1 with the step captured in a CUDA graph (no launch overhead) ----------
def graphed_step_seconds(context):
    cache = model.new_cache(1, context + 1)
    tokens = model.random_prompt(1, 1)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model._run(tokens, cache, context)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model._run(tokens, cache, context)
    return benchmark(graph.replay).median_s


try:
    if DRY:
        raise RuntimeError("dry run: CUDA graphs need a GPU")
    t = graphed_step_seconds(512)
    read = costs.decode_step_bytes(cfg, 1, 512).total
    results["decode_batch1_short_cuda_graph"] = {"seconds": t, "achieved_Bps": read / t,
                                                 "fraction_of_copy": read / t / copy_bw}
    print(f"decode batch 1 x 512, CUDA graph: {t * 1e3:.2f} ms = {read / t / copy_bw:.0%} of copy", flush=True)
except Exception as exc:  # a capture failure must not lose the eager results
    results["decode_batch1_short_cuda_graph"] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                                 "oom": is_out_of_memory(exc)}
    print("CUDA graph capture failed:", exc, flush=True)

results["wall_seconds"] = time.time() - start
with open(out_path, "w") as f:
    json.dump(results, f, indent=2)
print(f"wrote {out_path} in {results['wall_seconds']:.0f} s")
PYEOF
