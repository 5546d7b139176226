"""The many-GPUs benchmark's dry run: the same code as the GPU run, on CPU processes with gloo."""

from __future__ import annotations

import json

from labsupport import bench_many_gpus, ledger


def test_dry_run_writes_results_the_book_never_shows(tmp_path):
    out = tmp_path / "gpu_many_gpus.json"
    assert bench_many_gpus.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["backend"] == "gloo"
    assert [r["elements"] for r in data["all_reduce"]] == bench_many_gpus.SIZES["dry"]
    assert all(r["seconds"] > 0 and r["bus_bandwidth"] > 0 for r in data["all_reduce"])
    assert [r["world_size"] for r in data["decode"]] == [1, 2]
    assert all(r["max_logit_difference"] < 1e-4 for r in data["decode"])
    assert bench_many_gpus.load_results(out) is None  # a dry run is never a measurement
    run = ledger.load(out)  # the class ledger reads the book's results files too
    assert run.lab == "11_many_gpus" and not run.timings_real and "dry run" in run.source
    assert len(run.figures) == 4 and all(f.value > 0 for f in run.figures)  # 2 all-reduces, 2 decode steps
    assert "not yet measured" in bench_many_gpus.results_markdown(None)


def test_without_gpus_the_real_run_refuses(capsys):
    assert bench_many_gpus.main(["--out", "unused.json"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_a_measured_file_is_shown_with_device_and_date(tmp_path):
    path = tmp_path / "r.json"
    row = dict(world_size=2, bytes=8192, seconds=1e-5, bus_bandwidth=8.2e8)
    decode = dict(model="llama-3.1-8b", batch=1, world_size=2, seconds=0.004)
    path.write_text(json.dumps({"dry_run": False, "device": "NVIDIA H200", "gpus": 8, "date": "2026-11-30",
                                "torch": "2.x", "backend": "nccl", "timing": "median", "all_reduce": [row],
                                "decode": [decode]}))
    text = bench_many_gpus.results_markdown(bench_many_gpus.load_results(path))
    assert "8 x NVIDIA H200, 2026-11-30" in text and "0.8 GB/s" in text and "4.00 ms" in text
