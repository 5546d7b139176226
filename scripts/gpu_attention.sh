#!/usr/bin/env bash
# Chapter 07's GPU measurements alone: `bash scripts/gpu_all.sh --only attention [OUTDIR]`, which
# writes OUTDIR/gpu_results.tar.gz (results/gpu_attention.json and the logs: the benchmark table,
# the GPU-only checks, the launch-configuration sweep, lab 07 run as a script) and
# OUTDIR/gpu_summary.txt. scripts/gpu_all.sh says more. GPU_ATTENTION_DRY_RUN=1 runs it on a CPU
# through the Triton interpreter at tiny shapes (checks the script, measures nothing).
[ "${GPU_ATTENTION_DRY_RUN:-0}" = "1" ] && export GPU_DRY_RUN=1
exec bash "$(dirname "$0")/gpu_all.sh" --only attention "$@"
