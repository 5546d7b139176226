"""labsupport.bench_cpu_engine (python -m labsupport.bench_engine --cpu-real-model): the quick run on
the real model, the verdicts, the quiet-machine guard and how the book reads the file."""

from __future__ import annotations

import json
import os

import pytest

from labsupport import bench_cpu_engine as BC
from labsupport import bench_engine as BE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_quick_run_measures_every_row_and_is_never_shown(smollm2, tmp_path):
    results = BC.measure(quick=True, log=lambda *_: None, lm=smollm2)
    checks = results["checks"]
    assert all(v for k, v in checks.items() if k.startswith("engine equals"))  # greedy tokens: engine == generate
    assert checks["max logit difference, float32"] == 0 and checks["max logit difference, float32 packed"] < 1e-3
    assert checks["max logit difference, transformers float32"] < 1e-3  # transformers holds the same weights
    assert set(results["b1_tokens_per_s"]) >= {"engine float32 packed", "generate bfloat16 packed", "transformers float32"}
    assert results["weight_bytes"]["bfloat16 packed"] * 2 == results["weight_bytes"]["float32 packed"]
    assert {"engine int8 weight-only", "generate int8 weight-only"} <= set(results["b1_tokens_per_s"])
    assert results["weight_bytes"]["int8 weight-only"] < 0.3 * results["weight_bytes"]["float32"]  # codes + scales
    assert checks["engine equals generate, int8 weight-only"]
    assert checks["fused engine equals generate, float32 packed"] and checks["fused engine equals generate, float32"]
    assert checks["fused engine, 4 requests together, equals generate, float32 packed"]
    assert {f"fused engine {f}" for f in BC.FUSED} <= set(results["b1_tokens_per_s"])
    samples = results["read_bandwidth_samples_Bps"]  # before the runs and after each: the best is the bound's
    assert len(samples) == results["repeats"] + 1 and results["read_bandwidth_Bps"] == max(samples)
    rates, nbytes, bound = results["read_rate_Bps"], results["weight_bytes"], results["bound_tokens_per_s"]
    assert set(rates) == {"memory", "the GGUF file", *nbytes} and rates["memory"] == results["read_bandwidth_Bps"]
    for label, n in nbytes.items():  # each format's bound: its bytes over the best read of a buffer its size
        assert rates[label] == max(s[label] for s in results["read_rate_samples_Bps"]) > 0
        assert bound[label] == pytest.approx(rates[label] / n)
    assert bound["llama.cpp (the GGUF file)"] == pytest.approx(rates["the GGUF file"] / results["gguf_bytes"])
    tr = results["traces"]
    n, _, out = BC.QUICK["equal"]
    assert tr["equal engine"]["tokens"] == tr["equal static"]["tokens"] == n * out
    assert tr["varied engine"]["tokens"] == tr["varied static"]["tokens"]  # useful tokens, the same trace
    for label in ("float32 packed", "bfloat16 packed", "int8 weight-only"):
        prof = results["profile"][label]
        assert prof["ms"]["products"] > 0 and prof["ms"]["attention"] > 0 and prof["operator_calls"] > 100
        assert prof["wall_ms"] > 0 and prof["products_GBps"] > 0
    ppl = results["perplexity"]["values"]
    assert 1 < ppl["float32"] != ppl["bfloat16 packed"] and 1 < ppl["int8 weight-only"] != ppl["float32"]
    for label in ("bfloat16 packed", "int8 weight-only"):  # the C step's own predictions, near float32's
        assert ppl[f"fused {label}"] != ppl[label] and abs(ppl[f"fused {label}"] / ppl["float32"] - 1) < 0.1
    results.update(quiet=True, verdicts=BC.verdicts(results))
    assert all(v["met"] is not None for v in results["verdicts"].values())
    path = tmp_path / "cpu_engine.json"
    path.write_text(json.dumps(results))
    assert BC.load_results(path) is None  # quick: never figures
    path.write_text(json.dumps({**results, "quick": False, "quiet": False}))
    assert BC.load_results(path) is None  # not quiet: never figures
    path.write_text(json.dumps({**results, "quick": False}))
    shown = BC.load_results(path)
    table = BC.results_markdown(shown)
    assert "AMD" in table or shown["machine"]["cpu"] in table
    assert "engine bfloat16 packed" in table and f"{n} equal requests" in table and "Perplexity" in table
    assert "operator calls" in table and "| int8 weight-only |" in table and "read rate, GB/s" in table
    int8 = f"| fused engine int8 weight-only | {results['b1_tokens_per_s']['fused engine int8 weight-only']:,.1f} | "
    seen = [s["int8 weight-only"] / 1e9 for s in results["read_rate_samples_Bps"]]
    cell = f"{rates['int8 weight-only'] / 1e9:.1f} ({min(seen):.1f}-{max(seen):.1f}) |"
    assert int8 + cell in table  # the row's own read rate and its range, not the memory's
    assert "| fused engine int8 weight-only |" in table and "through the fused C step" in table
    assert "not yet measured" in BC.results_markdown(None).lower()


def test_verdicts_say_met_or_missed_against_each_target():
    b1 = {"engine float32 packed": 30.0, "generate float32 packed": 31.0, "engine bfloat16 packed": 60.0,
          "generate bfloat16 packed": 50.0}
    results = {"b1_tokens_per_s": b1, "bound_tokens_per_s": {"float32 packed": 40.0, "bfloat16 packed": 80.0},
               "traces": {"equal engine": {"tokens_per_s": 130}, "equal static": {"tokens_per_s": 100},
                          "varied engine": {"tokens_per_s": 160, "ttft_p50_s": 0.2},
                          "varied static": {"tokens_per_s": 100, "ttft_p50_s": 1.0}}}
    v = BC.verdicts(results)
    assert v["b1_engine_vs_generate_fp32"]["met"] is False and v["b1_engine_vs_generate_bf16"]["met"] is True
    assert v["b1_bound_fp32"]["ratio"] == pytest.approx(0.75) and v["b1_bound_fp32"]["met"] is True
    assert v["equal_vs_static"]["met"] is True and v["varied_vs_static"]["met"] is True
    assert v["varied_ttft_p50"]["ratio"] == pytest.approx(5.0)
    assert v["b1_bound_int8"]["met"] is None and v["b1_engine_vs_generate_int8"]["ratio"] is None  # a run before int8
    b1.update({"engine int8 weight-only": 90.0, "generate int8 weight-only": 100.0})
    results["bound_tokens_per_s"]["int8 weight-only"] = 160.0
    v = BC.verdicts(results)
    assert v["b1_engine_vs_generate_int8"]["ratio"] == pytest.approx(0.9) and v["b1_engine_vs_generate_int8"]["met"] is False
    assert v["b1_bound_int8"]["ratio"] == pytest.approx(90 / 160)
    b1.update({"fused engine float32 packed": 33.0, "fused engine bfloat16 packed": 40.0,
               "fused engine int8 weight-only": 130.0})  # a run with the C step: its verdicts are the fused rows'
    v = BC.verdicts(results)
    assert v["b1_engine_vs_generate_fp32"]["met"] is True and v["b1_engine_vs_generate_bf16"]["met"] is False
    assert v["b1_bound_int8"]["ratio"] == pytest.approx(130 / 160) and v["b1_bound_int8"]["met"] is True
    del results["traces"]["equal static"], results["traces"]["varied static"]
    assert BC.verdicts(results)["equal_vs_static"]["met"] is None  # transformers missing: not measured


def test_a_busy_machine_is_refused_and_a_busy_core_is_seen(monkeypatch, tmp_path):
    samples = iter([[(100, 1000), (900, 1000)], [(110, 1100), (1000, 1100)]])  # core 1 busy the whole time
    monkeypatch.setattr(BC, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(BC.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    load = BC.machine_load(0.0)
    assert load["core_busy"] == [0.1, 1.0] and load["quiet"] is False
    monkeypatch.setattr(BC, "machine_load", lambda seconds=2.0: {"load_average_1min": 1.2, "core_busy": [0, 1], "quiet": False})
    out = tmp_path / "cpu_engine.json"
    assert BE.main(["--cpu-real-model", "--out", str(out)]) == 2  # through the command the lead runs
    assert not out.exists()


def test_a_crash_inside_llama_cpp_is_recorded_not_fatal(tmp_path, monkeypatch):
    """llama.cpp runs in a child process: a llama_cpp that dies of a signal (as a build with AMX did on
    a VM that lists AMX but forbids it) gives a RuntimeError naming the signal, and the bench goes on."""
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os, signal\n"
                                      "class Llama:\n"
                                      "    def __init__(self, **kw):\n"
                                      "        os.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(RuntimeError, match="signal SIGILL"):
        BC.llama_cpp_decode("model.gguf", [1, 2, 3], 4, 1)
