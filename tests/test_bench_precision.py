"""The chapter 09 benchmark's dry run (the same code on a CPU, tiny shapes, the interpreter) and how
the book reads its results: a dry run never reaches the book, and without a run the book says so."""

from __future__ import annotations

import json

import pytest
import torch

from labsupport import bench_precision as B
from labsupport import ledger
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
        assert r["tuned_max_error"] < 0.1 and r["tuned_seconds"] > 0  # the tuned path agrees too
        assert r["tuned_plan"].startswith("gemv" if r["batch"] <= 4 else "tiles")
    plans = data["plans"]
    assert {(p["kernel"], p["split_k"]) for p in plans} == {("gemv", 1), ("gemv", 2), ("tiles", 1), ("tiles", 2)}
    assert sum(p["chosen"] for p in plans) == 1
    assert B.load_results(out) is None  # a dry run never reaches the book
    run = ledger.parse(ledger.from_bench("precision", data, out), str(out))  # the class ledger reads the book's results files too
    assert run.lab == "09_precision" and not run.timings_real and "dry run" in run.source
    assert len(run.figures) >= 2 and all(f.value > 0 for f in run.figures)


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


def test_a_broken_results_file_says_what_to_do(tmp_path):
    path = tmp_path / "gpu_precision.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="gpu_all.sh"):
        B.load_results(path)


# --- the figures chapter 09 quotes ---------------------------------------------------------------

LOG = """PASSED check_int8_matmul: 12 cases, 25/25 points
8B up projection N=14336 K=4096 group=channel batch 1: int8 45.6 us (1.29 TB/s), dense 41.3 us (2.84 TB/s), speedup 0.91x of 2.00x the bytes allow
8B up projection N=14336 K=4096 group=128 batch 1: int8 54.4 us (1.11 TB/s), dense 41.4 us (2.84 TB/s), speedup 0.76x of 1.94x the bytes allow
8B down projection N=4096 K=14336 group=128 batch 1: int8 80.6 us (0.75 TB/s), dense 41.7 us (2.82 TB/s), speedup 0.52x of 1.94x the bytes allow
"""  # noqa: E501 (the benchmark's own lines)
SWEEP = """| shape | batch | BLOCK_N | BLOCK_K | warps | stages | time | TB/s | vs course |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 8B up projection | 1 | 32 (course) | 64 | 4 | 4 | 42.0 us | 1.44 | 1.00x |
| 8B up projection | 1 | 16 | 64 | 8 | 4 | 107.1 us | 0.57 | 0.39x |
| 8B up projection | 1 | 32 | 128 | 4 | 6 | 32.6 us | 1.86 | 1.29x |
| 8B up projection | 1 | 128 | 128 | 8 | 6 | failed: OutOfResources | | |
| 8B down projection | 1 | 32 (course) | 64 | 4 | 4 | 79.6 us | 0.76 | 1.00x |
| 8B down projection | 1 | 32 | 128 | 4 | 6 | 41.4 us | 1.46 | 1.92x |
"""


def _results(rows):
    return dict(dry_run=False, device="NVIDIA H200", date="2026-11-30 20:28 UTC", torch="2.11", triton="3.6.0",
                dtype="bfloat16", checks="PASSED", copy_bandwidth_Bps=4.25e12, rows=rows)


def _row(shape, batch, speedup, group=128, int8_Bps=1.82e12, dense_Bps=2.87e12):
    n, k = (14336, 4096) if shape.startswith("8B up") else (4096, 14336)
    return dict(shape=shape, N=n, K=k, group_size=group, batch=batch, int8_seconds=3.3e-5, dense_seconds=4.1e-5,
                int8_bytes=1, dense_bytes=2, int8_Bps=int8_Bps, dense_Bps=dense_Bps, speedup=speedup,
                bytes_ratio=1.94, max_error=0.0)


def test_logs_of_a_run_and_of_the_sweep_are_read(tmp_path):
    (tmp_path / "log").write_text(LOG)
    (tmp_path / "sweep.md").write_text(SWEEP)
    rows = B.load_bench_log(tmp_path / "log")
    assert len(rows) == 3 and rows[0]["group_size"] is None and rows[1]["group_size"] == 128
    assert B.find_row(rows, "8B up", 1)["speedup"] == 0.76
    assert abs(B.find_row(rows, "8B down", 1)["int8_seconds"] - 80.6e-6) < 1e-12
    sweep = B.load_config_sweep(tmp_path / "sweep.md")
    assert len(sweep) == 5  # the failed configuration is left out
    assert sweep[0]["course"] and not sweep[1]["course"] and sweep[2]["num_stages"] == 6
    table = B.sweep_markdown(sweep, "8B up", 1, best=1)
    lines = table.splitlines()[2:]
    assert lines[0].startswith("| before the sweep | 32 | 64 |") and lines[1].startswith("| fastest | 32 | 128 |")
    assert lines[2].startswith("| slowest | 16 | 64 | 8 |") and len(lines) == 3
    assert B.load_bench_log(tmp_path / "missing") is None and B.load_config_sweep(tmp_path / "missing") is None


def test_figures_of_a_run_with_device_and_date(tmp_path):
    (tmp_path / "log").write_text(LOG)
    (tmp_path / "sweep.md").write_text(SWEEP)
    rows = [_row("8B up projection", b, s) for b, s in ((1, 1.23), (16, 1.22), (32, 0.92), (64, 0.73))]
    rows += [_row("8B down projection", b, s, int8_Bps=1.47e12) for b, s in ((1, 1.02), (16, 1.04), (64, 0.30))]
    rows.append(_row("8B up projection", 1, 1.21, group=None))  # per channel: not what the chapter quotes
    f = B.gpu_figures(_results(rows), B.load_bench_log(tmp_path / "log"), B.load_config_sweep(tmp_path / "sweep.md"))
    assert "NVIDIA H200 on 2026-11-30" in f["status"] and f["when"].startswith("NVIDIA H200, 2026-11-30 (")
    assert (f["up_b1"], f["up_b1_ratio"], f["up_b64"], f["down_b1"], f["down_b64"]) == (
        "1.23x", "1.94x", "0.73x", "1.02x", "0.30x")
    assert f["up_small"] == "1.22x to 1.23x" and f["down_small"] == "1.02x to 1.04x"
    assert f["up_b1_int8_tbps"] == "1.82 TB/s" and f["up_b1_dense_tbps"] == "2.87 TB/s"
    assert f["down_b1_int8_tbps"] == "1.47 TB/s" and f["copy_tbps"] == "4.25 TB/s"
    assert f["before_up_b1"] == "0.76x" and f["before_down_b1"] == "0.52x"
    assert (f["sweep_up_old"], f["sweep_up_best"], f["sweep_up_gain"]) == ("42.0 us", "32.6 us", "1.29x")
    assert f["sweep_up_best_cfg"] == "32 columns, K tiles of 128, 4 warps, 6 stages"
    assert f["sweep_up_old_cfg"] == "32 columns, K tiles of 64, 4 warps, 4 stages"
    assert f["sweep_down_gain"] == "1.92x" and f["sweep_up_spread"] == "3.3x" and f["sweep_batches"] == "1"
    assert f["up_b32"] == "0.92x" and f["down_b32"] == B.NOT_MEASURED  # a row the run lacks


def test_figures_without_a_run_are_not_yet_measured():
    f = B.gpu_figures(None)
    assert "No GPU has run it" in f["status"]
    assert all(v == B.NOT_MEASURED for k, v in f.items() if k != "status")
    assert "Not yet measured" in B.sweep_markdown(None)


def test_the_committed_run_reads_if_present():
    """Whatever results/ holds, the chapter's readers accept it (a file they cannot parse fails here)."""
    results, before, sweep = B.load_results(), B.load_bench_log(), B.load_config_sweep()
    f = B.gpu_figures(results, before, sweep)
    if results is not None:
        assert f["up_b1"].endswith("x") and f["date"] == results["date"][:10]
    if sweep is not None:
        assert "before the sweep" in B.sweep_markdown(sweep)
