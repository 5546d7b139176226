#!/usr/bin/env bash
# Chapter 11's GPU measurements on a machine with two or more GPUs: NCCL all-reduce bus bandwidth
# and a tensor-parallel decode step, written to results/gpu_many_gpus.json (which chapter 11 reads).
# GPU_MANY_GPUS_DRY_RUN=1 runs the same code on CPU processes with gloo at tiny sizes (checks the
# script, measures nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ "${GPU_MANY_GPUS_DRY_RUN:-0}" = "1" ]; then
  exec "$PY" -m labsupport.bench_many_gpus --dry-run --out "${1:-/tmp/gpu_many_gpus.json}"
fi
exec "$PY" -m labsupport.bench_many_gpus --out results/gpu_many_gpus.json
