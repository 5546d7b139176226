"""The launch-overhead benchmark's dry run: the eager half on a CPU; never shown as a measurement."""

from __future__ import annotations

import json

from labsupport import bench_launch_overhead, ledger


def test_dry_run_writes_results_the_book_never_shows(tmp_path):
    out = tmp_path / "gpu_launch_overhead.json"
    assert bench_launch_overhead.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["batch"] == 1 and len(data["rows"]) == 1
    row = data["rows"][0]
    assert row["eager_s"] > 0 and row["captured_s"] is None and row["ops_per_step"] > 0
    assert bench_launch_overhead.load_results(out) is None
    run = ledger.load(out)  # the class ledger reads the book's results files too
    assert run.lab == "12_engines" and not run.timings_real and "dry run" in run.source
    assert len(run.figures) >= 1 and all(f.value > 0 for f in run.figures)
    assert "not yet measured" in bench_launch_overhead.results_markdown(out)


def test_without_a_gpu_the_real_run_refuses(capsys, monkeypatch):
    monkeypatch.setattr(bench_launch_overhead.torch.cuda, "is_available", lambda: False)
    assert bench_launch_overhead.main(["--out", "unused.json"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_a_measured_file_is_shown_with_device_and_date(tmp_path):
    path = tmp_path / "r.json"
    row = {"model": "tiny-2m", "context": 256, "eager_s": 2e-3, "captured_s": 5e-4, "saving_s": 1.5e-3}
    path.write_text(json.dumps({"dry_run": False, "device": "H200", "date": "2026-11-30", "torch": "2.x",
                                "dtype": "bfloat16", "rows": [row]}))
    text = bench_launch_overhead.results_markdown(path)
    assert "H200, 2026-11-30" in text and "| tiny-2m | 2.000 | 0.500 | 75% |" in text


def test_gpu_figures_of_a_run_and_without_one(tmp_path):
    f = bench_launch_overhead.gpu_figures(tmp_path / "missing.json")
    assert "No GPU has run it" in f["status"] and f["saving"] == bench_launch_overhead.NOT_MEASURED
    rows = [{"model": "tiny-2m", "context": 256, "eager_s": 2.5e-3, "captured_s": 2.0e-4, "saving_s": 2.3e-3,
             "ops_per_step": 74, "python_share_cpu_profile": 0.513},
            {"model": "tiny-20m", "context": 256, "eager_s": 5.8e-3, "captured_s": 4.0e-4, "saving_s": 5.4e-3,
             "ops_per_step": 136, "python_share_cpu_profile": 0.519}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"dry_run": False, "device": "NVIDIA H200", "date": "2026-11-30", "torch": "2.x",
                                "dtype": "bfloat16", "rows": rows}))
    f = bench_launch_overhead.gpu_figures(path)
    assert "NVIDIA H200 on 2026-11-30" in f["status"]
    assert (f["eager_ms"], f["replay_ms"], f["saving"]) == ("2.50 to 5.80 ms", "0.20 to 0.40 ms", "92 to 93%")
    assert (f["speedup"], f["python_share"], f["ops"], f["context"]) == ("12 to 14x", "51 to 52%", "74 to 136", "256")
