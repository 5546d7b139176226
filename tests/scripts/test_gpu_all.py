"""scripts/gpu_all.sh's decode and engine steps, dry: the commands the next GPU session runs (the engine's
token-equality suite, split-KV
paged decode, the int8 tuned path, the engine benchmark, the launch-overhead benchmark), run on a CPU
through the interpreter at tiny sizes, their results landing in dry_run_results/, never results/.
(Chapter 05's step and the budget are tested in tests/test_phases.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_and_engine_steps_run_dry_and_pack_their_results(tmp_path):
    env = {**os.environ, "GPU_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_all.sh"), "--only", "decode,engines", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "gpu_summary.txt").read_text()
    for step in ("engine token equality", "cache ops benchmark", "precision benchmark", "engine benchmark", "launch overhead benchmark"):
        assert f"== {step}: exit 0" in summary, summary
    assert "phases" not in summary and "lab " not in summary  # only the groups asked for
    with tarfile.open(tmp_path / "gpu_results.tar.gz") as tar:
        names = set(tar.getnames())
        results = {topic: json.loads(tar.extractfile(f"dry_run_results/gpu_{topic}.json").read())
                   for topic in ("cache_ops", "precision", "engine", "launch_overhead")}
    assert not any(n.startswith("results/") for n in names)  # a dry run never unpacks over results/
    assert all(r["dry_run"] is True and r["completed"] == "all" for t, r in results.items() if t != "launch_overhead")
    assert results["cache_ops"]["rows"] and results["engine"]["models"] and results["precision"]["plans"]


def test_an_unknown_group_is_refused():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_all.sh"), "--only", "decode,nonsense"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not nonsense" in done.stderr
