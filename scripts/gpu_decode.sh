#!/usr/bin/env bash
# The decode measurements chapters 09, 10, 12 and 13 show as "not yet measured", alone:
# `bash scripts/gpu_all.sh --only decode [OUTDIR]` (split-KV paged decode against SDPA, the int8
# kernels tuned per device, the engine against static batching and its steps' roofline, decode steps
# with and without CUDA graphs; about 450 s). scripts/gpu_all.sh says more.
# GPU_DECODE_DRY_RUN=1 runs it on a CPU through the Triton interpreter at tiny shapes (checks the
# script, measures nothing).
[ "${GPU_DECODE_DRY_RUN:-0}" = "1" ] && export GPU_DRY_RUN=1
exec bash "$(dirname "$0")/gpu_all.sh" --only decode "$@"
