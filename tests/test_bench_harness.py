"""The harness every bench module shares: one reader that treats every results file alike, the
recorder, the perf_report-style sweep, the command line's refusals; the clean GPU timing's parts
that run without a GPU."""

from __future__ import annotations

import json

import pytest

from labsupport import bench_harness as H

BENCHES = ("attention", "cache_ops", "engine", "launch_overhead", "many_gpus", "phases", "precision")


@pytest.mark.parametrize("topic", BENCHES)
def test_every_bench_reads_results_the_same_way(topic, tmp_path):
    """The drift the harness removed: one module returned None for a corrupt file, the others raised."""
    import importlib

    from labsupport import phases

    load = phases.load_gpu_results if topic == "phases" else importlib.import_module(f"labsupport.bench_{topic}").load_results
    path = tmp_path / f"gpu_{topic}.json"
    assert load(path) is None  # no file
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"is not a results file from python -m labsupport.bench_{topic}"):
        load(path)
    path.write_text(json.dumps(["a", "list"]))
    with pytest.raises(ValueError, match="no device and date"):
        load(path)
    path.write_text(json.dumps({"device": "CPU (dry run)", "date": H.utc_now(), "dry_run": True, "rows": [1]}))
    assert load(path) is None  # a dry run is never a measurement


def test_a_measured_file_without_its_section_is_refused(tmp_path):
    path = tmp_path / "gpu_cache_ops.json"
    path.write_text(json.dumps({"device": "H200", "date": "2026-12-10 09:00 UTC", "dry_run": False, "rows": []}))
    with pytest.raises(ValueError, match="has no rows: the run stopped before it measured anything"):
        H.load_results("cache_ops", path)
    assert H.date_of({"date": "2026-12-10 09:00 UTC"}) == H.date_of({"date": "2026-12-10"}) == "2026-12-10"


def test_the_recorder_rewrites_its_file_after_every_section(tmp_path):
    rec = H.Recorder(tmp_path / "sub" / "r.json", H.header(True, rows=[]))
    rec.data["rows"].append({"x": 1})
    rec.save("first")
    data = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert data["completed"] == "first" and data["rows"] == [{"x": 1}] and data["device"] == "CPU (dry run)"
    assert data["date"].endswith(" UTC") and {"torch", "triton", "python"} <= data.keys()
    assert not list((tmp_path / "sub").glob("*.part"))  # written whole, then renamed


def test_a_sweep_records_rows_errors_and_skips(tmp_path, capsys):
    rec = H.Recorder(tmp_path / "r.json", {})

    def point(x, line):
        if line == "b" and x == 2:
            raise RuntimeError("out of memory\nmore")
        return None if line == "c" else {"seconds": x / 10}

    rows = H.Sweep("sweep", "batch", [1, 2], ["a", "b", "c"], describe=lambda r: f"{r['seconds']} s").run(point, rec)
    assert [(r["batch"], r["line"]) for r in rows] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert rows[-1] == {"batch": 2, "line": "b", "error": "RuntimeError: out of memory"}
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == "sweep batch=2"
    assert "sweep batch=1 a: 0.1 s" in capsys.readouterr().out


def test_the_command_line_refuses_without_the_hardware(capsys, monkeypatch):
    calls = []
    bench = H.Bench("demo", "99", lambda args: calls.append(args) or 3)
    monkeypatch.setattr(H.torch.cuda, "is_available", lambda: False)
    assert H.main(bench, ["--out", "x.json"]) == 2 and not calls
    assert "bench_demo measures a GPU (no CUDA GPU is visible); --dry-run" in capsys.readouterr().err
    assert H.main(bench, ["--dry-run", "--out", "x.json"]) == 3 and calls[0].out == "x.json"
    two = H.Bench("demo", "99", lambda args: None, needs="gpus")
    monkeypatch.setattr(H.torch.cuda, "device_count", lambda: 1)
    assert H.main(two, []) == 2 and "two or more CUDA GPUs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs must be one of"):
        H.Bench("demo", "99", print, needs="tpu")


def test_copies_cover_twice_the_l2_cache(monkeypatch):
    monkeypatch.setattr(H, "l2_bytes", lambda device=None: 60 * 2**20)
    assert H.copies_for(117 * 10**6) == 3  # 2 x 60 MiB of L2 over a 117 MB matrix, and one more
    assert H.copies_for(4 * 2**30) == 2
    assert H.copies_for(10**6) == 127
