#!/usr/bin/env bash
# Measure chapter 05's GPU figures on the Llama 3.1 8B shape (random weights, bf16) and write them
# to results/gpu_phases.json. Needs one CUDA GPU with at least 40 GB of memory; large
# batch x context decode points that do not fit are recorded as "oom" (the cache wall).
#
#   bash scripts/gpu_phases.sh                 # about 2-4 minutes on an H100/H200
#   bash scripts/gpu_phases.sh path/or/dir     # write there instead (a folder gets gpu_phases.json)
#   GPU_PHASES_DRY_RUN=1 bash scripts/gpu_phases.sh /tmp   # the same code path on a CPU with tiny
#                                                          # shapes: checks the script, measures nothing
#
# With no argument it also honours $OUT (a file, or a folder to write gpu_phases.json into). The
# results are rewritten after every section, so a run cut short keeps what it had measured.
# Commit results/gpu_phases.json and rebuild the book from scratch (`make clean book`: pages are
# cached by their code, not by the files they read): chapter 05 then shows the measured figures
# with the device and date instead of "not yet measured".
#
# What it records:
#   * copy bandwidth and bf16 matmul FLOP/s of the device (labsupport.roofline);
#   * prefill time against prompt length up to 32,768 tokens, the fit a*P + b*P^2 + c and its
#     crossover a/b, and the measured 32,768 / 2,048 ratio (FLOP-count ratio: 31.0, 23.8 causal);
#   * decode step time against batch (context 8,192) and against context (batch 1), the achieved
#     bandwidth (bytes really read / step time) and its fraction of the copy bandwidth, eager
#     and, at batch 1, with the step captured in a CUDA graph (no launch overhead).
#     Bytes really read = labsupport.costs.decode_step_bytes minus the rows of the 8B's separate
#     input embedding table that a step never touches (labsupport.phases.unread_embedding_bytes);
#     the runbook's count, every weight, is recorded beside it.
# It never installs anything: it uses the torch already on the machine (.venv/bin/python if that
# one sees the GPU, else python3; or $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-${OUT:-results/gpu_phases.json}}"
if [ -d "$DEST" ] || [[ "$DEST" == */ ]]; then DEST="${DEST%/}/gpu_phases.json"; fi
mkdir -p "$(dirname "$DEST")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${GPU_PHASES_DRY_RUN:-0}" != "1" ]; then
    unset TRITON_INTERPRET  # timings must run on the GPU
fi
sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && { [ "${GPU_PHASES_DRY_RUN:-0}" = "1" ] || sees_gpu .venv/bin/python; }; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
fi

"$PY" - "$DEST" <<'PYEOF'
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
from labsupport.phases import (
    fit_prefill_times,
    is_out_of_memory,
    measure_decode,
    measure_prefill,
    unread_embedding_bytes,
)
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
QUICK = pick({}, {"repeats": 1})  # extra benchmark arguments (CPU only: do_bench sets its own)
if DRY:
    torch.set_num_threads(1)  # steady CPU timings on a shared machine; the numbers mean nothing anyway
results = {
    "dry_run": DRY,
    "device": settings.device_name,
    "date": datetime.date.today().isoformat(),
    "torch": torch.__version__,
    "model": cfg.name,
    "dtype": str(DTYPE).replace("torch.", ""),
    "weights": "random (seeded); timing does not depend on values",
}


def save(section):
    results["wall_seconds"] = time.time() - start
    results["completed"] = section
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[{results['wall_seconds']:.0f} s] {section} done, saved to {out_path}", flush=True)


copy_bw = max(measure_copy(pick([2**30, 4 * 2**30], [2**22]), device=DEVICE, **QUICK))
peak = max(measure_matmul(pick([4096, 8192], [128]), dtype=DTYPE, device=DEVICE, **QUICK))
results["copy_bandwidth_Bps"] = copy_bw
results["matmul_flops"] = peak
print(f"copy {copy_bw / 1e12:.2f} TB/s, matmul {peak / 1e12:.0f} TFLOP/s", flush=True)

model = Transformer(cfg, device=DEVICE, dtype=DTYPE)
print(model.extra_repr(), f"{model.param_bytes() / 1e9:.2f} GB of weights", flush=True)
save("ceilings")

# --- prefill ---------------------------------------------------------------------------------
lengths = pick([512, 1024, 2048, 4096, 8192, 16384, 32768], [32, 64, 128, 256, 512])
prefill = measure_prefill(model, lengths, **QUICK)
ok = [p for p in prefill if not p.oom]
results["prefill"] = [
    {
        "prompt_tokens": p.prompt_tokens,
        "seconds": p.seconds,
        "oom": p.oom,
        "tflops_achieved_causal": None
        if p.oom
        else costs.prefill_flops(cfg, p.prompt_tokens, causal=True) / p.seconds / 1e12,
    }
    for p in prefill
]
by_len = {p.prompt_tokens: p.seconds for p in ok}
long = pick(32768, 512)
short = long // 16
if short in by_len and long in by_len:
    results[f"prefill_ratio_{long}_over_{short}"] = by_len[long] / by_len[short]
results["prefill_flop_ratio"] = costs.prefill_flops(cfg, long) / costs.prefill_flops(cfg, short)
results["prefill_flop_ratio_causal"] = costs.prefill_flops(cfg, long, True) / costs.prefill_flops(cfg, short, True)
try:
    fit = fit_prefill_times([p.prompt_tokens for p in ok], [p.seconds for p in ok])
    results["prefill_fit"] = {
        "linear_s_per_token": fit.linear,
        "quadratic_s_per_token2": fit.quadratic,
        "constant_s": fit.constant,
        "measured_crossover_tokens": fit.crossover,
        "predicted_crossover_N_over_2Ld": costs.quadratic_crossover(cfg),
        "predicted_crossover_causal": costs.quadratic_crossover(cfg, causal=True),
        "max_relative_error": fit.max_relative_error,
    }
    print(fit, flush=True)
except ValueError as exc:  # too few points fitted (out of memory): keep the raw times
    results["prefill_fit"] = {"error": str(exc)}
save("prefill")


# --- decode ----------------------------------------------------------------------------------
def decode_rows(points):
    rows = []
    for p in points:
        runbook = costs.decode_step_bytes(cfg, p.batch, p.context, ELEMENT, ELEMENT)
        read = runbook.total - unread_embedding_bytes(cfg, p.batch, ELEMENT)
        row = {"batch": p.batch, "context": p.context, "oom": p.oom, "cache_bytes": p.cache_bytes,
               "bytes_read": read, "bytes_runbook_count": runbook.total,
               "cache_share": runbook.cache / read, "seconds": p.seconds}
        if not p.oom:
            row["achieved_Bps"] = read / p.seconds
            row["fraction_of_copy"] = read / p.seconds / copy_bw
        rows.append(row)
        state = "out of memory (the cache wall)" if p.oom else (
            f"{p.seconds * 1e3:.2f} ms, {row['achieved_Bps'] / 1e12:.2f} TB/s = {row['fraction_of_copy']:.0%} of copy")
        print(f"decode batch {p.batch} x context {p.context}: {state}", flush=True)
    return rows


results["decode_by_batch"] = decode_rows(measure_decode(model, [1, 8, 32, 64, 128], [pick(8192, 64)], **QUICK))
b64 = next(r for r in results["decode_by_batch"] if r["batch"] == 64)
results["decode_batch64_ctx8192_fraction_of_copy"] = b64.get("fraction_of_copy")
save("decode against batch")
contexts = pick([512, 2048, 8192, 32768, 131072], [128, 512])
results["decode_by_context"] = decode_rows(measure_decode(model, [1], contexts, **QUICK))
b1 = next(r for r in results["decode_by_context"] if r["context"] == 512)
results["decode_batch1_short_fraction_of_copy"] = b1.get("fraction_of_copy")
save("decode against context")


# --- decode at batch 1 with the step captured in a CUDA graph (no launch overhead) ----------
def graphed_step_seconds(context):
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


try:
    if DRY:
        raise RuntimeError("dry run: CUDA graphs need a GPU")
    t = graphed_step_seconds(512)
    read = costs.decode_step_bytes(cfg, 1, 512, ELEMENT, ELEMENT).total - unread_embedding_bytes(cfg, 1, ELEMENT)
    results["decode_batch1_short_cuda_graph"] = {"seconds": t, "achieved_Bps": read / t,
                                                 "fraction_of_copy": read / t / copy_bw}
    print(f"decode batch 1 x 512, CUDA graph: {t * 1e3:.2f} ms = {read / t / copy_bw:.0%} of copy", flush=True)
except Exception as exc:  # a capture failure must not lose the eager results
    results["decode_batch1_short_cuda_graph"] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                                 "oom": is_out_of_memory(exc)}
    print("CUDA graph capture failed:", exc, flush=True)

save("all")
PYEOF
