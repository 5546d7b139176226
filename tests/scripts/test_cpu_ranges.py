"""scripts/cpu_ranges.py: the instructors' table of each CPU figure's range over runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from labsupport.ledger import Figure, Run

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_ranges.py"
spec = importlib.util.spec_from_file_location("cpu_ranges", SCRIPT)
cpu_ranges = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_ranges)


def run(lab, kind, real, figures, utc="2026-12-02T03:00:00Z"):
    return Run(Path("x.json"), lab, "CPU (x86_64, 2 cores)", kind, utc, {}, real, figures)


def test_ranges_keep_real_cpu_figures_and_drop_interpreter_timings_and_gpus():
    t = lambda v: Figure("copy_bandwidth", v, "GB/s", "best copy")  # a timing
    c = lambda v: Figure("max_error", v, "abs", "largest | difference", timing=False)  # a count
    runs = [run("05_phases", "cpu-interpreter", True, [t(17.0), c(1e-7)]),
            run("05_phases", "cpu-interpreter", True, [t(12.5), c(2e-7)]),
            run("07_attention", "cpu-interpreter", False, [Figure("kernel_ms", 900.0, "ms", "interpreted"), c(3e-7)]),
            run("12_engines", "cpu", True, [Figure("tokens_per_s", 40.0, "tokens/s", "engine")]),
            run("12_engines", "cuda-gpu", True, [Figure("tokens_per_s", 9000.0, "tokens/s", "engine")])]
    text = cpu_ranges.ranges_markdown(runs, "quiet machine")
    assert "| `copy_bandwidth` | 12.5 | 17 | GB/s |" in text
    assert "**05_phases** (2 runs)" in text and "**07_attention** (1 run)" in text
    assert "kernel_ms" not in text and "| `max_error` | 3e-07 | 3e-07 |" in text  # interpreter: counts only
    assert "9000" not in text and "| `tokens_per_s` | 40 | 40 |" in text  # the GPU run is not a CPU figure
    assert "largest / difference" in text  # a | in a convention would break the table
    assert cpu_ranges.ranges_markdown([runs[-1]], "") == "No CPU runs were found in the ledger folder.\n"


def test_grading_table_reads_the_timing_lines():
    table = cpu_ranges.grading_markdown(["10_cache_ops grade rc=0 48.5 s load=0.99", "not a line"])
    assert "| 10_cache_ops | 0.8 min | 0 | 0.99 |" in table and "not a line" not in table
