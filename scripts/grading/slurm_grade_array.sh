#!/usr/bin/env bash
# One task of a Slurm job array grading a class: task K grades shard K of N of the submissions and
# writes OUT/shards/shard-K-of-N.json. Submit the whole run (the array, then the merge once every
# task has succeeded) with slurm_submit.sh; to grade one shard again, `SHARDS=N sbatch --array=K ...`.
#
#   SHARDS=8 sbatch --array=0-7 --export=ALL scripts/grading/slurm_grade_array.sh SUBMISSIONS OUT
#
# Environment: SHARDS (the number of shards, N; default: the array's size), PYTHON (the Python with
# the course installed; default: python), GRADE_ARGS (more options for grade, such as
# "--timeout 300" or "--container IMAGE"; the same for every task, or grade-merge refuses the shards).
# Every task is given the same submissions: a folder on a file system all the nodes share.
#SBATCH --job-name=grade
#SBATCH --cpus-per-task=4
#SBATCH --mem=32G
#SBATCH --time=04:00:00
#SBATCH --output=grade-%A_%a.log
set -euo pipefail

if [ "$#" -ne 2 ]; then
    echo "usage: SHARDS=N sbatch --array=0-(N-1) $0 SUBMISSIONS OUT" >&2
    exit 2
fi
submissions=$1
out=$2
python=${PYTHON:-python}
shard=auto${SHARDS:+/$SHARDS}  # auto/N: the task id is the shard, so --array=K reruns shard K

# --overwrite: a task Slurm requeues (or one run again) replaces its shard file (the old one is kept as .bak);
# --jobs: one kernel per CPU Slurm gave this task; --require-sandbox: a node where bubblewrap cannot work
# fails its task instead of running learners' code with your account's permissions
# shellcheck disable=SC2086  # GRADE_ARGS is a list of options
exec "$python" -m labsupport grade "$submissions" --shard "$shard" --shard-dir "$out/shards" \
    --jobs "${SLURM_CPUS_PER_TASK:-1}" --overwrite --require-sandbox ${GRADE_ARGS:-}
