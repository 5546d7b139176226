"""The cache-ops benchmark's dry run: the same code as the GPU run, on a CPU at tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from labsupport import bench_cache_ops

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_dry_run_writes_results_the_book_never_shows(tmp_path):
    out = tmp_path / "gpu_cache_ops.json"
    assert bench_cache_ops.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and len(data["rows"]) == len(bench_cache_ops.SHAPES[1])
    for row in data["rows"]:
        for key in ("paged", "paged_in_order", "sdpa"):
            assert row[key]["max_abs_error"] < 1e-4, (row["name"], key)
            assert row[key]["median_s"] > 0 and row[key]["bytes_formula"] > 0
    assert bench_cache_ops.load_results(out) is None  # a dry run is never a measurement


def test_without_a_gpu_the_real_run_refuses(capsys, monkeypatch):
    monkeypatch.setattr(bench_cache_ops.torch.cuda, "is_available", lambda: False)
    assert bench_cache_ops.main(["--out", "unused.json"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_load_results_reads_a_measured_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"dry_run": False, "device": "H200", "date": "2026-11-30", "rows": [{"name": "x"}]}))
    assert bench_cache_ops.load_results(path)["device"] == "H200"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a results file"):
        bench_cache_ops.load_results(path)
    assert bench_cache_ops.load_results(tmp_path / "missing.json") is None


def test_in_order_tables_are_consecutive():
    tables = bench_cache_ops.in_order_tables([5, 1, 9], 4, "cpu")
    assert tables.tolist() == [[0, 1, -1], [2, -1, -1], [3, 4, 5]]


def test_gpu_all_runs_the_cache_ops_steps(tmp_path):
    """scripts/gpu_cache_ops.sh (gpu_all.sh --only cache_ops), dry: the benchmark's results land in the archive."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GPU_DRY_RUN": "1", "PYTHON": sys.executable}
    subprocess.run(["bash", str(root / "scripts" / "gpu_cache_ops.sh"), str(tmp_path)],  # gpu_all.sh --only cache_ops
                   env=env, capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "gpu_summary.txt").read_text()
    assert "== cache ops benchmark: exit 0" in summary and "== lab 10 solution as a script" in summary, summary
    with tarfile.open(tmp_path / "gpu_results.tar.gz") as tar:
        results = json.loads(tar.extractfile("dry_run_results/gpu_cache_ops.json").read())
    assert results["dry_run"] is True and results["rows"]


def test_results_markdown_says_not_yet_measured_without_a_run():
    assert "not yet measured" in bench_cache_ops.results_markdown(None)
    row = {"name": "2 x 33", "tokens": 66, "paged_over_in_order": 1.1, "paged_over_sdpa": 0.9}
    for key in ("paged", "paged_in_order", "sdpa"):
        row[key] = {"median_s": 2e-5, "achieved_Bps": 5e11}
    text = bench_cache_ops.results_markdown({"device": "H200", "date": "2026-11-30", "torch": "2", "triton": "3",
                                             "rows": [row]})
    assert "H200, 2026-11-30" in text and "| 2 x 33 | 66 | 20 us, 500 GB/s" in text
