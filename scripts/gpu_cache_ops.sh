#!/usr/bin/env bash
# Chapter 10's GPU measurements alone: `bash scripts/gpu_all.sh --only cache_ops [OUTDIR]`, which
# writes OUTDIR/gpu_results.tar.gz (results/gpu_cache_ops.json and the logs: the paged-attention
# benchmark, lab 10 run as a script) and OUTDIR/gpu_summary.txt. scripts/gpu_all.sh says more.
# GPU_CACHE_OPS_DRY_RUN=1 runs it on a CPU through the Triton interpreter at tiny shapes (checks the
# script, measures nothing).
[ "${GPU_CACHE_OPS_DRY_RUN:-0}" = "1" ] && export GPU_DRY_RUN=1
exec bash "$(dirname "$0")/gpu_all.sh" --only cache_ops "$@"
