#!/usr/bin/env bash
# Chapter 07's GPU measurements, in one run. On a machine with an NVIDIA GPU (the course's targets
# are for an H100 or H200), from the repository root:
#
#     bash scripts/gpu_attention.sh [OUTDIR]        # OUTDIR defaults to $OUT, else gpu_results/
#
# It writes, in OUTDIR:
#   environment.txt        date, nvidia-smi, python, torch and triton versions
#   attention_checks.txt   the graded checks on the reference implementations, GPU cases included
#                          (bf16, S = 4096, and the peak-memory test that fails on an S x S tensor)
#   attention_bench.md     the table: reference kernel vs SDPA (flash backend) vs naive, bf16,
#                          head dim 128, S = 1k..16k, causal and not, TFLOP/s, ratios, PASS/FAIL
#   attention_bench.log    the benchmark's progress lines
#   gpu_attention.json     the same rows as JSON: copy it to results/gpu_attention.json, commit it
#                          and rebuild the book (`make clean book`): chapter 07 then shows the table
#                          with its device and date instead of "not yet measured"
#   attention_configs.md   the reference kernel under each candidate launch configuration (tile
#                          sizes, warps, pipeline stages) at S = 4096, fastest first: if a target
#                          is missed, this says what labsupport.attention.kernel_config should pick
#   lab.txt                the lab 07 solution source run as a plain script on the GPU (full
#                          preset): its checks with a learner-style kernel, the memory sweep and
#                          the naive / kernel / SDPA sweep. Needs only torch, triton, matplotlib, tqdm.
# and exits non-zero if any step failed or any target was missed. Each step has its own time
# limit (150 + 120 + 90 + 150 s at most, so the whole script stays under 9 minutes even if one
# step hangs); expect about 4 minutes, most of it Triton compiling kernels. The seconds each step
# took are printed. It never installs anything: it uses the torch and triton already on the
# machine (.venv/bin/python if that one sees the GPU, else python3; or $PYTHON).
#
# GPU_ATTENTION_DRY_RUN=1 runs every step on a CPU through the Triton interpreter at tiny shapes
# (the benchmark with --dry-run): it checks the script, measures nothing. The tests do this.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_results}}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg

sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY="${PYTHON:-}"
DRY=()
if [ "${GPU_ATTENTION_DRY_RUN:-0}" = "1" ]; then
    export TRITON_INTERPRET=1
    DRY=(--dry-run)
    if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
else
    unset TRITON_INTERPRET  # kernels must compile for the GPU, not run in the interpreter
    if [ -z "$PY" ]; then
        if [ -x .venv/bin/python ] && sees_gpu .venv/bin/python; then PY=.venv/bin/python; else PY=python3; fi
    fi
    if ! sees_gpu "$PY"; then
        echo "gpu_attention.sh: $PY sees no CUDA GPU; run this on a GPU machine." >&2
        exit 2
    fi
fi

{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi || true
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT_DIR/environment.txt" 2>&1

status=0
step() {  # step NAME LIMIT_S LOGFILE COMMAND...: run with a time limit, keep its log, time it
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    echo "== $name (at most ${limit} s) -> $log"
    start=$(date +%s)
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    [ "$rc" -eq 124 ] && echo "!! $name ran past ${limit} s and was stopped"
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
    [ "$rc" -eq 0 ] || status=1
}

step "GPU checks" 150 "$OUT_DIR/attention_checks.txt" "$PY" -m labsupport.bench_attention --check ${DRY[@]+"${DRY[@]}"}
step "benchmark" 120 "$OUT_DIR/attention_bench.log" \
    "$PY" -m labsupport.bench_attention ${DRY[@]+"${DRY[@]}"} --out "$OUT_DIR/attention_bench.md" \
    --json "$OUT_DIR/gpu_attention.json"
step "launch configurations" 90 "$OUT_DIR/attention_configs.log" \
    "$PY" -m labsupport.bench_attention ${DRY[@]+"${DRY[@]}"} --configs 4096 --out "$OUT_DIR/attention_configs.md"
step "lab 07 solution as a script" 150 "$OUT_DIR/lab.txt" "$PY" solutions/07_attention.py

echo "== done (status $status); results in $OUT_DIR"
exit "$status"
