#!/usr/bin/env bash
# Chapter 07's GPU measurements, in one run. On a machine with an NVIDIA GPU (the course's targets
# are for an H100 or H200), from the repository root:
#
#     bash scripts/gpu_attention.sh [OUTDIR]        # OUTDIR defaults to $OUT, else gpu_results/
#
# It writes, in OUTDIR:
#   environment.txt        nvidia-smi, python, torch and triton versions
#   attention_checks.txt   the graded checks on the reference implementations, GPU cases included
#                          (bf16, S = 4096, and the peak-memory test that fails on an S x S tensor)
#   attention_bench.md     the table: reference kernel vs SDPA (flash backend) vs naive, bf16,
#                          head dim 128, S = 1k..16k, causal and not, TFLOP/s, ratios, PASS/FAIL
#   attention_bench.log    the benchmark's progress lines
#   notebook.txt           the solution notebook of lab 07 run on the GPU (only if pytest, nbclient
#                          and ipykernel are importable)
# and exits non-zero if any step failed or any target was missed. Takes about 3-5 minutes,
# most of it Triton compiling kernels. It never installs anything: it uses the torch and triton
# already on the machine (.venv/bin/python if that one sees the GPU, else python3; or $PYTHON).
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_results}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET  # kernels must compile for the GPU, not run in the interpreter
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && sees_gpu .venv/bin/python; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! sees_gpu "$PY"; then
    echo "gpu_attention.sh: $PY sees no CUDA GPU; run this on a GPU machine." >&2
    exit 2
fi

{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi || true
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT_DIR/environment.txt" 2>&1

status=0
echo "== GPU checks -> $OUT_DIR/attention_checks.txt"
timeout 600 "$PY" -m labsupport.bench_attention --check 2>&1 | tee "$OUT_DIR/attention_checks.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmark -> $OUT_DIR/attention_bench.md"
timeout 900 "$PY" -m labsupport.bench_attention --out "$OUT_DIR/attention_bench.md" 2>&1 | tee "$OUT_DIR/attention_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if "$PY" -c 'import pytest, nbclient, ipykernel' 2>/dev/null && [ -f solutions/07_attention.ipynb ]; then
    echo "== lab 07 solution notebook on the GPU -> $OUT_DIR/notebook.txt"
    timeout 600 "$PY" -m pytest tests/test_notebooks.py -k "solution and 07_attention" -q -p no:cacheprovider \
        > "$OUT_DIR/notebook.txt" 2>&1 || status=1
    tail -n 3 "$OUT_DIR/notebook.txt"
else
    echo "== notebook run skipped (needs pytest, nbclient and ipykernel)" | tee "$OUT_DIR/notebook.txt"
fi

echo "== done (status $status); results in $OUT_DIR"
exit "$status"
