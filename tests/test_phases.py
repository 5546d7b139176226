"""Fitting prefill times and the measurement sweeps of the phases lab."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from labsupport import phases
from labsupport.models import get_model
from labsupport.phases import cpu_threads, fit_prefill_times, measure_decode, measure_prefill
from labsupport.timing import progress as progress_bar
from labsupport.transformer import Transformer

LENGTHS = [128, 256, 512, 1024, 2048, 4096]


def synthetic(a, b, c, lengths=LENGTHS, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [(a * p + b * p * p + c) * (1 + noise * rng.standard_normal()) for p in lengths]


def test_fit_recovers_exact_coefficients():
    fit = fit_prefill_times(LENGTHS, synthetic(2e-6, 1e-9, 3e-4))
    assert fit.linear == pytest.approx(2e-6, rel=1e-6)
    assert fit.quadratic == pytest.approx(1e-9, rel=1e-6)
    assert fit.constant == pytest.approx(3e-4, rel=1e-6)
    assert fit.crossover == pytest.approx(2000, rel=1e-6)
    assert fit.predict(2000) == pytest.approx(2e-6 * 2000 * 2 + 3e-4)
    assert fit.quadratic_share(2000) == pytest.approx(4e-3 / (8e-3 + 3e-4))
    assert fit.max_relative_error < 1e-9
    assert "crossover 2,000 tokens" in str(fit)


def test_fit_without_constant():
    fit = fit_prefill_times([100, 1000], synthetic(1e-5, 1e-8, 0.0, lengths=[100, 1000]), constant=False)
    assert (fit.linear, fit.quadratic, fit.constant) == pytest.approx((1e-5, 1e-8, 0.0), rel=1e-6)
    assert fit.crossover == pytest.approx(1000, rel=1e-6)


def test_fit_is_robust_to_a_few_percent_of_noise():
    for seed in range(5):
        fit = fit_prefill_times(LENGTHS, synthetic(2e-6, 1e-9, 3e-4, noise=0.03, seed=seed))
        assert 1400 < fit.crossover < 2800, fit


def test_purely_linear_times_give_no_crossover():
    # Times that bend *down* would need a negative quadratic term: it is held at zero instead.
    times = [1e-5 * p**0.9 for p in LENGTHS]
    fit = fit_prefill_times(LENGTHS, times)
    assert fit.quadratic == 0 and math.isinf(fit.crossover)
    assert min(fit.linear, fit.quadratic, fit.constant) >= 0
    assert "none detected" in str(fit)


@pytest.mark.parametrize(
    "lengths,seconds,match",
    [
        ([1, 2], [1.0], "same length"),
        ([1, 2, 3], [1.0, -1.0, 2.0], "finite number of seconds > 0"),
        ([1, 2, 3], [1.0, float("nan"), 2.0], "finite number"),
        ([0, 2, 3], [1.0, 1.0, 2.0], "1 or more"),
        ([8, 8, 16], [1.0, 1.0, 2.0], "at least 3 different prompt lengths"),
        (5, [1.0], "sequences"),
    ],
)
def test_fit_rejects_bad_input(lengths, seconds, match):
    with pytest.raises(ValueError, match=match):
        fit_prefill_times(lengths, seconds)


def test_cpu_threads_restores_the_setting():
    original = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1: under make test a worker runs one thread, and restoring 1 would prove nothing
    try:
        before = torch.get_num_threads()
        with cpu_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == before == 2
        with cpu_threads(None):
            assert torch.get_num_threads() == before
        with pytest.raises(ValueError, match="threads"):
            with cpu_threads(0):
                pass
    finally:
        torch.set_num_threads(original)


@pytest.fixture(scope="module")
def tiny():
    return Transformer(get_model("tiny-2m"))


def test_measure_prefill_and_decode_return_points(tiny):
    pre = measure_prefill(tiny, [8, 16], threads=1, progress=False, repeats=2)
    assert [p.prompt_tokens for p in pre] == [8, 16]
    assert all(p.seconds > 0 and not p.oom for p in pre)
    dec = measure_decode(tiny, [1, 2], [4, 32], threads=1, progress=False, repeats=2)
    assert [(d.batch, d.context) for d in dec] == [(1, 4), (1, 32), (2, 4), (2, 32)]
    assert all(d.seconds > 0 and not d.oom for d in dec)
    per_token = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, fp32
    assert dec[-1].cache_bytes == per_token * 2 * 33


def test_out_of_memory_is_a_result_not_a_crash(tiny, monkeypatch):
    real_new_cache = Transformer.new_cache

    def new_cache(self, batch, max_len):
        if batch * max_len > 100:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 68.7 GiB")
        return real_new_cache(self, batch, max_len)

    monkeypatch.setattr(Transformer, "new_cache", new_cache)
    dec = measure_decode(tiny, [1, 8], [16], progress=False, repeats=1)
    assert not dec[0].oom and dec[1].oom and dec[1].seconds is None
    assert dec[1].cache_bytes == 2 * 2 * 8 * 2 * 17 * 32 * 4
    pre = measure_prefill(tiny, [16, 200], progress=False, repeats=1)
    assert [p.oom for p in pre] == [False, True]


def test_other_errors_are_not_swallowed(tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something else went wrong")

    monkeypatch.setattr(phases, "is_out_of_memory", lambda exc: False)
    monkeypatch.setattr(Transformer, "new_cache", broken)
    with pytest.raises(RuntimeError, match="something else"):
        measure_decode(tiny, [1], [4], progress=False)


def test_is_out_of_memory():
    assert phases.is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert phases.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not phases.is_out_of_memory(RuntimeError("shape mismatch"))


def test_measure_rejects_bad_arguments(tiny):
    with pytest.raises(ValueError, match="Transformer"):
        measure_prefill("tiny-2m", [8])
    with pytest.raises(ValueError, match="lengths"):
        measure_prefill(tiny, [])
    with pytest.raises(ValueError, match="contexts"):
        measure_decode(tiny, [1], [0])


def test_request_phase_times_reproduce_the_planning_figures():
    from labsupport import costs
    from labsupport.hardware import get_gpu
    from labsupport.phases import request_phase_times

    cfg, h100 = get_model("llama-3.1-8b"), get_gpu("H100 SXM")
    # One 2,048-token prefill at 40% of dense peak: about 89 ms.
    t = request_phase_times(cfg, 2048, 1, peak_flops=h100.peak_flops, bandwidth=h100.hbm_bandwidth)
    assert t.decode == 0 and t.prefill == pytest.approx(costs.prefill_flops(cfg, 2048) / (0.4 * 989.4e12))
    assert round(t.prefill * 1e3) == 89
    chat = request_phase_times(cfg, 2000, 300, peak_flops=h100.peak_flops, bandwidth=h100.hbm_bandwidth)
    assert chat.decode_share > 0.9 and chat.prefill_share + chat.decode_share == pytest.approx(1)
    # Batching makes the prefill of a classification job the larger phase.
    one = request_phase_times(cfg, 1000, 20, peak_flops=h100.peak_flops, bandwidth=h100.hbm_bandwidth)
    many = request_phase_times(
        cfg, 1000, 20, peak_flops=h100.peak_flops, bandwidth=h100.hbm_bandwidth, batch=32
    )
    assert many.prefill_share > 0.5 > one.prefill_share
    with pytest.raises(ValueError, match="mfu"):
        request_phase_times(cfg, 10, 10, peak_flops=1e15, bandwidth=1e12, mfu=40)


def test_static_and_continuous_batching():
    from labsupport.phases import completed_by, simulate_batching

    lengths = [8, 2, 3, 4, 2, 5, 3]
    static = simulate_batching(lengths, 4, "static")
    assert [(s.slot, s.start, s.end) for s in static[:4]] == [(0, 0, 8), (1, 0, 2), (2, 0, 3), (3, 0, 4)]
    assert [(s.slot, s.start) for s in static[4:]] == [(0, 8), (1, 8), (2, 8)]  # waits for the longest
    cont = simulate_batching(lengths, 4)
    assert [(s.slot, s.start) for s in cont[4:]] == [(1, 2), (2, 3), (1, 4)]  # refilled at once
    assert completed_by(static, 8) == 4 and completed_by(cont, 8) == 7
    with pytest.raises(ValueError, match="policy"):
        simulate_batching(lengths, 4, "dynamic")
    with pytest.raises(ValueError, match="slots"):
        simulate_batching(lengths, 0)


def test_unread_embedding_bytes():
    from labsupport import costs
    from labsupport.phases import unread_embedding_bytes

    m8 = get_model("llama-3.1-8b")
    # Untied: all but one row per sequence of the 128,256 x 4,096 input table stays unread.
    assert unread_embedding_bytes(m8, 1) == (128256 - 1) * 4096 * 2
    assert unread_embedding_bytes(m8, 64, element_bytes=1) == (128256 - 64) * 4096
    really_read = costs.decode_step_bytes(m8, 1, 0).total - unread_embedding_bytes(m8, 1)
    assert 14.9e9 < really_read < 15.1e9  # about 15.0 GB, not the runbook's 16.06 GB
    # Tied: the table is the output head, read in full every step.
    assert unread_embedding_bytes(get_model("small-63m"), 1, 4) == 0
    with pytest.raises(ValueError, match="batch"):
        unread_embedding_bytes(m8, 0)


def test_gpu_results_are_not_yet_measured_until_recorded(tmp_path):
    import json

    from labsupport.phases import NOT_MEASURED, gpu_summary, load_gpu_results

    assert load_gpu_results(tmp_path / "missing.json") is None
    assert set(gpu_summary(None).values()) == {NOT_MEASURED}
    dry = tmp_path / "dry.json"
    dry.write_text(json.dumps({"dry_run": True, "device": "CPU", "prefill_ratio_32768_over_2048": 9.0}))
    assert load_gpu_results(dry) is None  # a dry run measures nothing
    real = tmp_path / "real.json"
    real.write_text(
        json.dumps(
            {
                "dry_run": False,
                "device": "NVIDIA H200",
                "date": "2030-01-02",
                "prefill_ratio_32768_over_2048": 27.31,
                "prefill_fit": {"measured_crossover_tokens": 41234.4},
                "decode_batch1_short_fraction_of_copy": 0.514,
                "decode_batch64_ctx8192_fraction_of_copy": None,  # that point ran out of memory
                "prefill": [
                    {"prompt_tokens": 2048, "tflops_performed": 300.0, "tflops_runbook_causal": 350.0},
                    {"prompt_tokens": 32768, "tflops_performed": 412.4, "tflops_runbook_causal": 455.6},
                    {"prompt_tokens": 65536, "oom": True, "seconds": None},
                ],
                "decode_batch1_short_cuda_graph": {"error": "RuntimeError: capture failed"},
            }
        )
    )
    summary = gpu_summary(load_gpu_results(real))
    assert summary == {
        "device": "NVIDIA H200, 2030-01-02",
        "prefill_ratio": "27.3x",
        "prefill_tflops": "412 TFLOP/s at 32,768 tokens (456 under the runbook's count, 2NP plus causal attention)",
        "crossover": "41,234 tokens (extrapolated past the longest prompt)",
        "decode_b1": "51%",
        "decode_b64": NOT_MEASURED,
        "decode_b1_graph": NOT_MEASURED,
    }
    skipped = json.loads(real.read_text())
    skipped["decode_book_point_skipped"] = "needs 87.9 GB (...), the GPU has 85.5 GB"
    skipped["decode_batch1_short_cuda_graph"] = {"fraction_of_copy": 0.83}
    real.write_text(json.dumps(skipped))
    summary = gpu_summary(load_gpu_results(real))
    assert summary["decode_b64"] == "not measured on this GPU: needs 87.9 GB (...), the GPU has 85.5 GB"
    assert summary["decode_b1_graph"] == "83%"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not a results file"):  # the harness's one message for every bench
        load_gpu_results(broken)


def test_progress_without_tqdm_prints_plain_lines(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    assert list(progress_bar([3, 4], "decode")) == [3, 4]
    assert capsys.readouterr().out == "decode: 1/2\ndecode: 2/2\n"


def test_gpu_script_dry_run_writes_results(tmp_path):
    # The GPU script's code path, on the CPU with tiny shapes: catches a broken import or API.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GPU_PHASES_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_phases.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_phases.json").read_text())
    assert results["dry_run"] is True and results["completed"] == "all"
    assert {r["batch"] for r in results["decode_by_batch"]} == {1, 8, 32, 64, 128}
    assert results["prefill_fit"]["predicted_crossover_N_over_2Ld"] > 0
    assert "error" in results["decode_batch1_short_cuda_graph"]  # no CUDA graph without a GPU
    assert phases.load_gpu_results(tmp_path / "gpu_phases.json") is None
    fit = results["prefill_fit"]
    assert fit["predicted_crossover_performed_causal"] < fit["predicted_crossover_causal"]
    for row in results["prefill"]:  # the course model performs fewer FLOPs than the runbook's 2NP counts
        assert row["flops_performed"] < row["flops_runbook_causal"]
        assert row["tflops_performed"] < row["tflops_runbook_causal"]


def test_gpu_all_packs_one_archive_and_keeps_to_its_budget(tmp_path):
    """The one command for a lent GPU: a dry run of chapter 05's step writes the archive and the
    summary; a spent budget skips steps (and says so) instead of running past it."""
    import subprocess
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GPU_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_all.sh"), "--only", "phases", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_results.tar.gz", "gpu_summary.txt"]
    with tarfile.open(tmp_path / "gpu_results.tar.gz") as tar:
        names = set(tar.getnames())
        results = json.loads(tar.extractfile("dry_run_results/gpu_phases.json").read())
        environment = tar.extractfile("dry_run_results/gpu_logs/environment.txt").read().decode()
    assert {"dry_run_results/gpu_logs/phases.log", "dry_run_results/gpu_logs/environment.txt"} <= names
    assert not any(n.startswith("results/") for n in names)  # a dry run never unpacks over results/
    assert results["dry_run"] is True and "DRY RUN" in environment
    assert "== phases: exit 0" in (tmp_path / "gpu_summary.txt").read_text()

    spent = tmp_path / "spent"
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_all.sh"), str(spent)],
                          env={**env, "GPU_BUDGET_S": "10"}, capture_output=True, text=True, timeout=120)
    summary = (spent / "gpu_summary.txt").read_text()
    steps = (root / "scripts" / "gpu_all.sh").read_text().count('\n    step "')  # every step the script has
    assert steps >= 10 and done.returncode == 1, summary
    assert summary.count("skipped, the 10 s budget is spent") == steps, summary
    assert (spent / "gpu_results.tar.gz").is_file()


def test_decode_points_are_planned_against_each_cards_memory():
    """The book's batch 64 x 8,192 point of the 8B needs 16.1 GB of weights and 68.7 GB of cache:
    it fits an H200 and is skipped, with its reason, on an 80 GB H100 (85.5e9 bytes)."""
    from labsupport.hardware import GPUS

    cfg = get_model("llama-3.1-8b")
    pairs = [(1, 512), (64, 8192), (128, 8192), (1, 131072)]
    fits = {name: [p.fits for p in phases.plan_decode_points(cfg, pairs, gpu.reported_bytes)]
            for name, gpu in GPUS.items()}
    assert fits["H200"] == [True, True, False, True]
    assert fits["H100 SXM"] == [True, False, False, True]
    assert fits["A100 40GB"] == [True, False, False, True]  # 16.1 GB + 17.2 GB of cache at 131,072
    assert fits["T4"] == [False, False, False, False]  # 16.1 GB of bf16 weights alone exceed 16 GB
    h100 = phases.plan_decode_points(cfg, [(64, 8192)], GPUS["H100 SXM"].reported_bytes)[0]
    assert "cache 68.7 GB" in h100.reason and "weights 16.1 GB" in h100.reason and "85.5 GB" in h100.reason
    for gpu in GPUS.values():  # whatever is planned to fit leaves the reserve free
        for p in phases.plan_decode_points(cfg, pairs, gpu.reported_bytes):
            assert p.fits == (p.needs_bytes <= gpu.reported_bytes)


def test_prefill_flops_the_model_performs():
    """No multiplies for the embedding lookup and the output layer on the last position only:
    about 6.98e9 matmul weights per token on the 8B shape against N = 8.03e9."""
    from labsupport import costs

    cfg = get_model("llama-3.1-8b")
    assert round(phases.layer_matmul_weights(cfg) / 1e9, 2) == 6.98
    p = 4096
    performed = phases.model_prefill_flops(cfg, p)
    expected = (2 * phases.layer_matmul_weights(cfg) * p + 2 * cfg.vocab_size * cfg.d_model
                + 2 * cfg.n_layers * p * p * cfg.n_heads * cfg.head_dim)
    assert performed == expected < costs.prefill_flops(cfg, p, causal=True)
    assert phases.model_prefill_flops(cfg, p, batch=3) == 3 * performed
    assert phases.model_prefill_flops(cfg, p, causal=False) > performed
    # the crossover under this count: per-token matmul FLOPs equal causal attention's per-token FLOPs
    x = phases.model_prefill_crossover(cfg)
    assert math.isclose(2 * phases.layer_matmul_weights(cfg) * x, 2 * cfg.n_layers * x * x * cfg.d_model)
    tiny = Transformer(get_model("tiny-2m"))
    assert phases.layer_matmul_weights(tiny.cfg) == sum(
        p.numel() for n, p in tiny.named_parameters() if n.startswith("layers.") and "norm" not in n)


def _findings_results(**changes):
    results = {
        "device": "NVIDIA H200", "date": "2030-01-02", "torch": "9.9", "dtype": "bfloat16",
        "copy_bandwidth_Bps": 4.0e12, "matmul_flops": 700e12,
        "prefill": [{"prompt_tokens": 32768, "seconds": 1.5, "tflops_performed": 490.0}],
        "prefill_fit": {"measured_crossover_tokens": 60000.0, "predicted_crossover_performed_causal": 53248.0,
                        "max_relative_error": 0.05},
        "decode_by_context": [
            {"batch": 1, "context": 512, "seconds": 0.02, "bytes_read": 15e9, "fraction_of_copy": 0.19,
             "cache_share": 0.01},
            {"batch": 1, "context": 131072, "seconds": 0.06, "bytes_read": 32e9, "fraction_of_copy": 0.13,
             "cache_share": 0.53}],
        "decode_by_batch": [
            {"batch": 1, "context": 8192, "seconds": 0.0201, "bytes_read": 16e9},
            {"batch": 32, "context": 8192, "seconds": 0.0209, "bytes_read": 49e9},
            {"batch": 64, "context": 8192, "seconds": 0.025, "bytes_read": 84e9, "fraction_of_copy": 0.84},
            {"batch": 128, "context": 8192, "seconds": None, "skipped": "needs 156.7 GB, the GPU has 149.3 GB"},
        ],
        "decode_batch1_short_cuda_graph": {"seconds": 0.007, "fraction_of_copy": 0.54},
    }
    results.update(changes)
    return results


def test_gpu_findings_say_not_yet_measured_or_read_every_number_from_the_run():
    assert phases.gpu_findings_markdown(None).startswith("**Not yet measured.**")
    text = phases.gpu_findings_markdown(_findings_results())
    assert "**Measured** on NVIDIA H200, 2030-01-02 (torch 9.9)" in text
    assert "**Prefill is compute-bound.**" in text and "490 TFLOP/s" in text
    assert "70% of the matmul rate" in text and "50% of the datasheet's dense bf16 peak" in text
    assert "an extrapolation past the longest prompt" in text  # 60,000 > 32,768 measured
    assert "beyond the 53,248" in text and "leaves out" in text  # direction follows the data
    assert "copy rate moves in 3.8 ms" in text and "It was launch-bound" in text and "20.1-20.9 ms" in text
    assert "7.0 ms (54%" in text and "131,072 tokens of context" in text and "split-KV" in text
    assert "Batch 128 at 8,192 tokens was not measured: it needs 156.7 GB" in text


def test_gpu_findings_draw_no_conclusion_the_data_does_not_support():
    """A slower GPU's run: prefill far from the matmul rate, decode times that grow with the batch,
    a CUDA graph that gains little, a crossover short of the prediction and inside the sweep."""
    slow = _findings_results(
        prefill=[{"prompt_tokens": 32768, "seconds": 9.0, "tflops_performed": 90.0}],
        prefill_fit={"measured_crossover_tokens": 20000.0, "predicted_crossover_performed_causal": 53248.0,
                     "max_relative_error": 0.05},
        decode_by_batch=[{"batch": 1, "context": 8192, "seconds": 0.05, "bytes_read": 16e9},
                         {"batch": 32, "context": 8192, "seconds": 0.09, "bytes_read": 49e9},
                         {"batch": 64, "context": 8192, "seconds": 0.2, "bytes_read": 84e9, "fraction_of_copy": 0.4}],
        decode_batch1_short_cuda_graph={"seconds": 0.019, "fraction_of_copy": 0.2},
        device="NVIDIA T4")
    text = phases.gpu_findings_markdown(slow)
    assert "compute-bound" not in text and "**Prefill.**" in text
    assert "extrapolation" not in text and "falls short of the crossover" in text
    assert "launch-bound" not in text and "Replayed from a CUDA graph the step took 19.0 ms" in text
    assert "comes close to the memory's speed" not in text
