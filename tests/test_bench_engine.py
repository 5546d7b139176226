"""The engine benchmark's dry run (the tiny model on the CPU, the same code as the GPU run), the
roofline bound of a step, and how the book reads the results."""

from __future__ import annotations

import json

import pytest

from labsupport import bench_engine as BE
from labsupport import ledger
from labsupport.costs import kv_bytes_per_token
from labsupport.engine import StepRecord
from labsupport.models import get_model


def test_dry_run_runs_the_engine_static_batching_and_the_sweep(tmp_path):
    out = tmp_path / "gpu_engine.json"
    assert BE.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["completed"] == "all" and data["trace"]["end_of_text"] == "ignored"
    (m,) = data["models"]
    n = BE.TRACES["tiny-2m"][0]
    assert m["model"] == "tiny-2m" and m["requests"] == n
    assert m["engine"]["output_tokens"] == m["static"]["output_tokens"]  # the same trace, every token generated
    assert m["engine_over_static"] > 0 and 0 < m["roofline"]["all"]["fraction_of_bound"]
    assert m["engine_stats"]["free_blocks"] == m["engine_stats"]["num_blocks"]  # every block came back
    # random prompts share no prefix: the warm-up request (the trace's first prompt) left nothing cached
    assert m["engine_stats"]["prefix_cache_hits"] == 0 and m["engine_stats"]["prefix_cache_queries"] > 0
    assert [r["batch"] for r in data["decode_sweep"]] == list(BE.SWEEP_BATCHES["tiny-2m"])
    assert all(r["step_s"] > 0 and not r["cuda_graphs"] for r in data["decode_sweep"])
    host = data["host_time"]  # the host time per step against the waiting queue (the run prints it)
    assert [r["waiting"] for r in host["rows"]] == [16, 64, 256] and all(r["host_s"] > 0 for r in host["rows"])
    # flat in the queue (1.0x measured here); loose, as timings on a shared machine vary: work per waiting
    # request per step made it 16x before (tests/test_engine_host_costs.py counts the hashes exactly)
    assert host["ratio"] < 3
    assert BE.load_results(out) is None  # a dry run never reaches the book
    run = ledger.load(out)
    assert run.lab == "13_decode_loop" and not run.timings_real and len(run.figures) == 5


def test_a_steps_bound_is_its_bytes_or_its_flops_whichever_is_longer():
    cfg = get_model("llama-3.1-8b")  # untied: its input table is a lookup, its output head a matmul
    weights = 16_060_522_496  # bytes of the bf16 weights
    table = cfg.vocab_size * cfg.d_model * 2
    decode = StepRecord(0, 0, 0.01, 1, 0, 1, 0, 0, 0, kv_tokens=1000, attention_pairs=1000, sampled=1)
    t = BE.step_bound_seconds(cfg, weights, decode, copy_Bps=4e12, matmul_flops=8e14)
    # one token: the bytes bind, and of the input table only its row is read
    assert t == pytest.approx((weights - table + cfg.d_model * 2 + 1001 * kv_bytes_per_token(cfg)) / 4e12)
    prefill = StepRecord(0, 0, 0.5, 1, 4096, 0, 0, 0, 0, kv_tokens=4096, attention_pairs=4096 * 4097 // 2, sampled=1)
    head = cfg.vocab_size * cfg.d_model
    flops = 2 * (weights / 2 - 2 * head) * 4096 + 2 * head * 1 \
        + 4 * prefill.attention_pairs * cfg.head_dim * cfg.n_heads * cfg.n_layers  # the head runs on one row
    assert BE.step_bound_seconds(cfg, weights, prefill, 4e12, 8e14) == pytest.approx(flops / 8e14)  # FLOPs bind
    rows = BE.roofline_rows(cfg, weights, [decode, prefill], 4e12, 8e14)
    assert rows["all"]["steps"] == 2 and rows["decode_batch_64"] is None
    tied = BE.model_config("llama-3.2-1b")  # a tied table is the output head: read whole, once
    assert tied.tied_embeddings and BE.weight_bytes_read(tied, 10**9, 7) == 10**9


def test_the_llama_32_1b_shape_is_its_config():
    cfg = BE.model_config("llama-3.2-1b")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (16, 2048, 32, 8, 64, 8192)
    assert cfg.tied_embeddings and cfg.rope_scaling["factor"] == 32.0


def test_a_measured_file_needs_its_models(tmp_path):
    path = tmp_path / "gpu_engine.json"
    path.write_text(json.dumps({"device": "H200", "date": "2026-12-10 09:00 UTC", "dry_run": False, "models": []}))
    with pytest.raises(ValueError, match="has no models"):
        BE.load_results(path)
    assert BE.load_results(tmp_path / "missing.json") is None
