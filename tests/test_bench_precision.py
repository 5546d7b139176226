"""The chapter 09 benchmark's dry run (the same code on a CPU, tiny shapes, the interpreter) and how
the book reads its results: a dry run never reaches the book, and without a run the book says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from labsupport import bench_precision as B
from labsupport.int8_matmul import int8_matmul_config

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_dry_run_writes_marked_results(tmp_path):
    out = tmp_path / "precision.json"
    assert B.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["completed"] == "all"
    assert data["device"] == "CPU (dry run)" and data["date"].endswith("UTC")
    rows = data["rows"]
    assert {r["batch"] for r in rows} == set(B.BATCHES[1])
    assert {r["group_size"] for r in rows} == {None, 128}
    for r in rows:
        assert r["int8_bytes"] < r["dense_bytes"]  # one byte per weight against two
        assert 1.0 < r["bytes_ratio"] < 2.0
        assert r["max_error"] < 0.1  # the kernel agrees with the dequantised reference (fp16)
        assert r["int8_seconds"] > 0 and r["dense_seconds"] > 0
    assert B.load_results(out) is None  # a dry run never reaches the book


def test_configs_dry_run_writes_a_table_with_the_course_row_first(tmp_path):
    out = tmp_path / "configs.md"
    assert B.main(["--configs", "--dry-run", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("| shape | batch | BLOCK_N")
    rows = lines[2:]
    assert len(rows) == 2 and "(course)" in rows[0] and "(course)" not in rows[1]
    assert rows[0].rstrip().endswith("| 1.00x |")  # the course's own row is the baseline


def test_small_gpu_batches_get_the_measured_tiles_and_fit_a_t4():
    for m, group in [(1, 128), (16, 128), (1, 4096), (64, 128)]:
        cfg = int8_matmul_config(m, 14336, 4096, group, interpreter=False)
        assert group % cfg.block_k == 0
        stage = cfg.block_m * cfg.block_k * 2 + cfg.block_k * cfg.block_n  # x in 16 bits, W in int8
        assert stage * cfg.num_stages <= 64 * 1024, (m, group, cfg)  # a T4's shared memory
    cfg = int8_matmul_config(1, 14336, 4096, 128, interpreter=False)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (32, 128, 4, 6)  # measured best


def test_without_a_gpu_it_refuses(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert B.main(["--out", "/dev/null"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_book_says_not_yet_measured_without_a_run(tmp_path):
    assert B.load_results(tmp_path / "missing.json") is None
    assert "Not yet measured" in B.results_markdown(None)
    assert B.batch1_speedup(None) == B.NOT_MEASURED


def test_a_real_run_renders_with_device_and_date(tmp_path):
    row = dict(shape="8B up projection", N=14336, K=4096, group_size=None, batch=1, int8_seconds=2e-5,
               dense_seconds=3.5e-5, int8_bytes=58_785_792, dense_bytes=117_473_280, int8_Bps=2.9e12,
               dense_Bps=3.4e12, speedup=1.75, bytes_ratio=1.998, max_error=0.0)
    grouped = {**row, "group_size": 128, "speedup": 1.70, "bytes_ratio": 1.94}
    path = tmp_path / "gpu_precision.json"
    path.write_text(json.dumps(dict(dry_run=False, device="NVIDIA H200", date="2026-12-01 10:00 UTC",
                                    torch="2.11", triton="3.6.0", dtype="bfloat16", checks="PASSED",
                                    rows=[row, grouped])))
    results = B.load_results(path)
    text = B.results_markdown(results)
    assert "NVIDIA H200" in text and "2026-12-01" in text and "1.75x" in text
    # the book quotes groups of 128, the case its bytes ratio is computed for
    assert B.batch1_speedup(results).startswith("1.70x of the 1.94x the bytes allow")
    assert "on NVIDIA H200" in B.batch1_speedup(results)
    assert B.batch1_speedup(results, group_size=None).startswith("1.75x")


def test_a_broken_results_file_says_what_to_do(tmp_path):
    path = tmp_path / "gpu_precision.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="gpu_all.sh"):
        B.load_results(path)


def test_gpu_all_runs_the_precision_step_in_a_dry_run(tmp_path):
    """scripts/gpu_all.sh --only precision: the bench's dry run lands in dry_run_results/, never results/."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GPU_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_all.sh"), "--only", "precision", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with tarfile.open(tmp_path / "gpu_results.tar.gz") as tar:
        names = set(tar.getnames())
        results = json.loads(tar.extractfile("dry_run_results/gpu_precision.json").read())
    assert results["dry_run"] is True and not any(n.startswith("results/") for n in names)
    summary = (tmp_path / "gpu_summary.txt").read_text()
    assert "== precision benchmark: exit 0" in summary and "phases" not in summary
