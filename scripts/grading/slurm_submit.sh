#!/usr/bin/env bash
# Grade a class on a Slurm cluster: an array of N tasks (one shard each), then one job that merges the
# shards into OUT/grades.csv once every task has succeeded (if one fails, the merge never starts:
# run that shard again with `SHARDS=N sbatch --array=K scripts/grading/slurm_grade_array.sh SUBMISSIONS OUT`,
# then merge by hand, `python -m labsupport grade-merge OUT/shards --csv OUT/grades.csv`).
#
#   bash scripts/grading/slurm_submit.sh N SUBMISSIONS OUT
#
# PYTHON and GRADE_ARGS are passed on to every task (see slurm_grade_array.sh).
set -euo pipefail

if [ "$#" -ne 3 ]; then
    echo "usage: $0 N SUBMISSIONS OUT   (N shards, one Slurm array task each)" >&2
    exit 2
fi
shards=$1
submissions=$2
out=$3
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python}
mkdir -p "$out"

array=$(SHARDS=$shards sbatch --parsable --export=ALL --array="0-$((shards - 1))" \
    --output="$out/grade-%A_%a.log" "$here/slurm_grade_array.sh" "$submissions" "$out")
array=${array%%;*}  # --parsable prints "jobid" or "jobid;cluster"
merge=$(sbatch --parsable --dependency="afterok:$array" --job-name=grade-merge --time=00:30:00 \
    --output="$out/grade-merge-%j.log" \
    --wrap "$(printf '%q ' "$python" -m labsupport grade-merge "$out/shards" --csv "$out/grades.csv" --overwrite)")
echo "grading array $array ($shards shards); merge job ${merge%%;*} writes $out/grades.csv when they all succeed"
