"""The cache-ops benchmark's dry run: the same code as the GPU run, on a CPU at tiny shapes."""

from __future__ import annotations

import json

import pytest

from labsupport import bench_cache_ops, ledger

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_dry_run_writes_results_the_book_never_shows(tmp_path):
    out = tmp_path / "gpu_cache_ops.json"
    assert bench_cache_ops.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and len(data["rows"]) == len(bench_cache_ops.SHAPES[1])
    for row in data["rows"]:
        for key in bench_cache_ops.KERNELS:  # split-KV, lab 10's kernel, each on two layouts, and SDPA
            assert row[key]["max_abs_error"] < 1e-4, (row["name"], key)
            assert row[key]["median_s"] > 0 and row[key]["bytes_formula"] > 0
    assert [r["num_splits"] for r in data["split_sweep"]] == list(bench_cache_ops.SPLIT_SWEEP[1])
    assert data["date"].endswith(" UTC") and "clean_time" in data["timing"]
    assert bench_cache_ops.load_results(out) is None  # a dry run is never a measurement
    run = ledger.load(out)  # the class ledger reads the book's results files too
    assert run.lab == "10_cache_ops" and not run.timings_real and "dry run" in run.source
    assert len(run.figures) >= 6 and all(f.value > 0 for f in run.figures)


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


def test_results_markdown_says_not_yet_measured_without_a_run():
    assert "not yet measured" in bench_cache_ops.results_markdown(None)
    row = {"name": "2 x 33", "tokens": 66, "paged_over_in_order": 1.1, "paged_over_sdpa": 0.9}
    for key in ("paged", "paged_in_order", "sdpa"):
        row[key] = {"median_s": 2e-5, "achieved_Bps": 5e11}
    text = bench_cache_ops.results_markdown({"device": "H200", "date": "2026-11-30", "torch": "2", "triton": "3",
                                             "rows": [row]})
    assert "H200, 2026-11-30" in text and "| 2 x 33 | 66 | 20 us, 500 GB/s" in text


def _cache_row(name, batch, max_len, paged_s, in_order_s, sdpa_s, paged_bytes, sdpa_bytes):
    row = {"name": name, "batch": batch, "tokens": batch * max_len, "max_len": max_len, "kv_heads": 8,
           "block_size": 16, "paged_over_in_order": paged_s / in_order_s, "paged_over_sdpa": paged_s / sdpa_s}
    for key, t, nbytes in (("paged", paged_s, paged_bytes), ("paged_in_order", in_order_s, paged_bytes),
                           ("sdpa", sdpa_s, sdpa_bytes)):
        row[key] = {"median_s": t, "bytes_formula": nbytes, "achieved_Bps": nbytes / t}
    return row


def test_gpu_figures_of_a_run_and_without_one():
    f = bench_cache_ops.gpu_figures(None)
    assert "No GPU has run it" in f["status"] and f["paged_over_sdpa"] == bench_cache_ops.NOT_MEASURED
    rows = [_cache_row("32 x 1,024", 32, 1024, 4.7e-4, 4.6e-4, 5.5e-5, 1.35e8, 1.35e8),
            _cache_row("16 x 4,096", 16, 4096, 1.2e-3, 1.4e-3, 8.5e-5, 2.7e8, 2.7e8),
            _cache_row("mixed", 64, 8092, 3.3e-3, 3.3e-3, 4.9e-4, 4.5e8, 2.1e9)]
    f = bench_cache_ops.gpu_figures({"device": "NVIDIA H200", "date": "2026-11-30", "torch": "2", "triton": "3",
                                     "rows": rows})
    assert "NVIDIA H200 on 2026-11-30" in f["status"]
    assert f["paged_over_sdpa"] == "6.7x to 14.1x" and f["paged_over_in_order"] == "0.86 to 1.02"
    assert (f["worst_name"], f["worst_programs"], f["worst_blocks"]) == ("16 x 4,096", "128", "256")
    assert (f["pad_name"], f["pad_ratio"], f["pad_speed"]) == ("mixed", "4.7x", "6.7x")
    assert f["programs"] == "128 to 512"


def test_gpu_figures_of_a_clean_harness_run():
    rows = [_cache_row("32 x 1,024", 32, 1024, 4.7e-4, 4.6e-4, 5.5e-5, 1.35e8, 1.35e8),
            _cache_row("16 x 4,096", 16, 4096, 1.2e-3, 1.4e-3, 8.5e-5, 2.7e8, 2.7e8)]
    for r, (split, in_order) in zip(rows, [(6e-5, 5.9e-5), (9e-5, 8.8e-5)]):
        r["split_kv"] = {"median_s": split, "bytes_formula": r["paged"]["bytes_formula"],
                         "achieved_Bps": r["paged"]["bytes_formula"] / split}
        r["split_kv_in_order"] = {"median_s": in_order, "bytes_formula": r["paged"]["bytes_formula"],
                                  "achieved_Bps": r["paged"]["bytes_formula"] / in_order}
        r["split_kv_over_sdpa"] = split / r["sdpa"]["median_s"]
        r["split_kv_over_in_order"] = split / in_order
        r["paged_over_split_kv"] = r["paged"]["median_s"] / split
    results = {"device": "NVIDIA H200", "date": "2026-12-10 09:00 UTC", "torch": "2", "triton": "3", "rows": rows,
               "split_sweep": [{"num_splits": 1, "median_s": 3e-4}, {"num_splits": 8, "median_s": 9e-5}],
               "harness_check": {"clean_Bps": 4.0e12, "big_copy_Bps": 4.3e12, "do_bench_Bps": 3.1e12,
                                 "fraction_of_big": 4.0 / 4.3, "passed": True, "big_bytes": 4 * 2**30}}
    f = bench_cache_ops.gpu_figures(results)
    assert "2026-12-10" in f["status"] and "clean harness" in f["harness_note"]
    assert (f["split_over_sdpa_16x4096"], f["best_splits"], f["best_splits_speedup"]) == ("1.06x", "8", "3.3x")
    assert f["split_over_sdpa"] == "1.06x to 1.09x" and f["paged_over_split"] == "7.8x to 13.3x"
    assert "93% of a 4 GiB copy" in f["harness"] and "passed" in f["harness"]
    table = bench_cache_ops.results_markdown(results)
    assert "split-KV (shuffled)" in table and "clean harness" in table
    old = bench_cache_ops.gpu_figures({**results, "rows": [{k: v for k, v in r.items() if "split" not in k}
                                                           for r in rows]})
    assert "earlier harness" in old["harness_note"] and old["split_over_sdpa"] == bench_cache_ops.NOT_MEASURED


LAB10_LOG = """device : cuda - NVIDIA H200 (139.8 GiB)
small-63m, 32 requests of 2040 shared + 128 own tokens, 16-token blocks
prefix-cache hit rate: 90.8% of prompt tokens (62,992 of 69,376)
prefill of one 2168-token request on the GPU:
  miss (no prefix caching):    10.94 ms
  hit  (prefix cached):         8.24 ms
"""


def test_prefix_cache_figures_from_the_lab_log(tmp_path):
    path = tmp_path / "lab10.txt"
    path.write_text(LAB10_LOG)
    log = bench_cache_ops.load_prefix_cache_log(path)
    assert log["device"] == "NVIDIA H200" and log["shared"] == 2040 and log["block"] == 16
    f = bench_cache_ops.prefix_cache_figures(log, {"date": "2026-11-30"})
    assert f["when"] == "NVIDIA H200, 2026-11-30" and f["hit_rate"] == "90.8%"
    assert (f["miss"], f["hit"], f["hit_share"], f["skipped"]) == ("10.94 ms", "8.24 ms", "75%", "94%")
    path.write_text(LAB10_LOG.replace("on the GPU", "on the CPU (plain torch)"))  # a CPU run is no GPU figure
    assert bench_cache_ops.load_prefix_cache_log(path) is None
    assert bench_cache_ops.load_prefix_cache_log(tmp_path / "missing.txt") is None
    assert set(bench_cache_ops.prefix_cache_figures(None).values()) == {bench_cache_ops.NOT_MEASURED}
