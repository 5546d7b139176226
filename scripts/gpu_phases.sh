#!/usr/bin/env bash
# Chapter 05's GPU measurements alone (scripts/gpu_all.sh runs them with chapter 07's, which is
# what to use on a lent GPU). On a machine with an NVIDIA GPU, from the repository root:
#
#   bash scripts/gpu_phases.sh                 # writes results/gpu_phases.json (a few minutes)
#   bash scripts/gpu_phases.sh path/or/dir     # write there instead (a folder gets gpu_phases.json)
#   GPU_PHASES_DRY_RUN=1 bash scripts/gpu_phases.sh /tmp   # a CPU, tiny shapes: checks, measures nothing
#
# With no argument it also honours $OUT. What is measured: `python -m labsupport.bench_phases --help`.
# It never installs anything (.venv/bin/python if that one sees the GPU, else python3; or $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-${OUT:-results/gpu_phases.json}}"
if [ -d "$DEST" ] || [[ "$DEST" == */ ]]; then DEST="${DEST%/}/gpu_phases.json"; fi
mkdir -p "$(dirname "$DEST")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DRY=()
if [ "${GPU_PHASES_DRY_RUN:-0}" = "1" ]; then export TRITON_INTERPRET=1; DRY=(--dry-run); else unset TRITON_INTERPRET; fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && { [ ${#DRY[@]} -gt 0 ] || .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
fi
exec "$PY" -m labsupport.bench_phases ${DRY[@]+"${DRY[@]}"} --out "$DEST"
