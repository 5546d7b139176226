"""Device mode, the banner, launch-error advice, timing, number formatting, notebook execution."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest

import labsupport
from labsupport.course import book
from labsupport.course.notebooks import execute, load
from labsupport.device import banner, explain_error, interpreter_mode, settings
from labsupport.timing import NOT_MEANINGFUL, Timing, benchmark


def test_interpreter_is_on_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert os.environ["TRITON_INTERPRET"] == "1" and interpreter_mode()
    s = settings()
    assert (s.device, s.interpreter, s.preset, s.timings_meaningful) == ("cpu", True, "small", False)
    assert s.pick(small=1, full=2) == 1


def test_setup_prints_one_banner(capsys):
    s = labsupport.setup()
    out = capsys.readouterr().out
    assert out.count("device :") == 1 and s.torch_version in out and "triton" in out
    if s.interpreter:
        assert "interpreter" in out and "not meaningful" in out


def test_preset_can_be_forced(monkeypatch):
    monkeypatch.setenv("LABSUPPORT_PRESET", "full")
    assert settings().preset == "full"
    assert "full preset, real sizes (LABSUPPORT_PRESET)" in banner(settings())
    monkeypatch.setenv("LABSUPPORT_PRESET", "nonsense")
    assert settings().preset in ("small", "full")
    assert "LABSUPPORT_PRESET='nonsense' ignored" in banner(settings())


def test_banner_says_when_no_kernel_can_run(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    text = banner(settings())
    assert "kernels: NONE" in text and "fail to launch" in text and "compiled for the GPU" not in text
    monkeypatch.setitem(sys.modules, "triton", None)  # as on a machine without Triton (macOS)
    assert "triton: not importable" in banner(settings()) and "Triton is missing" in banner(settings())


def test_import_without_torch_says_what_to_do_instead_of_pip_installing_the_course():
    """The setup cell pip-installs the course on ModuleNotFoundError; a missing torch must not look like one."""
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "try:\n    import labsupport\n"
        "except ModuleNotFoundError:\n    print('WOULD PIP INSTALL')\n"
        "except ImportError as e:\n    print('MESSAGE:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "WOULD PIP INSTALL" not in out and "MESSAGE: labsupport needs PyTorch" in out and "make lab" in out


def test_launch_without_driver_or_interpreter_explains_what_to_do(tmp_path):
    """A kernel defined with the interpreter off and no GPU: the check says what to do."""
    code = textwrap.dedent(
        """
        import torch, triton, triton.language as tl
        import labsupport
        from labsupport.checks import check_vector_add, CheckFailed

        @triton.jit
        def k(x_ptr, y_ptr, o_ptr, n, B: tl.constexpr):
            o = tl.program_id(0) * B + tl.arange(0, B)
            tl.store(o_ptr + o, tl.load(x_ptr + o, mask=o < n) + tl.load(y_ptr + o, mask=o < n), mask=o < n)

        def add(x, y):
            out = torch.empty_like(x)
            k[(triton.cdiv(x.numel(), 64),)](x, y, out, x.numel(), B=64)
            return out

        try:
            check_vector_add(add)
        except CheckFailed as e:
            print("MESSAGE:", e)
        """
    )
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = tmp_path / "launch.py"  # triton reads the kernel's source from a file
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert "MESSAGE:" in out.stdout, out.stderr[-2000:]
    assert "What to do" in out.stdout and "TRITON_INTERPRET is set to '0'" in out.stdout and "Unset it" in out.stdout


def test_explain_error_recognises_known_failures(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in explain_error(RuntimeError("0 active drivers ([]). There should only be one."))
    assert "to('cuda')" in explain_error(ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)"))
    assert "cannot compile a `raise`" in explain_error(
        RuntimeError("at 10:4: unsupported AST node type: Raise")
    )
    assert "import labsupport` before" in explain_error(
        RuntimeError("Cannot call @triton.jit'd outside of the scope of a kernel")
    )
    assert explain_error(RuntimeError("something else")) is None


def test_benchmark_reports_median_and_percentiles():
    calls = []
    t = benchmark(lambda: calls.append(1), repeats=7, warmup=2, gpu=False)
    assert t.repeats == 7 and len(calls) == 9
    assert t.p20_s <= t.median_s <= t.p80_s
    assert t.meaningful and NOT_MEANINGFUL not in str(t)


def test_benchmark_labels_interpreted_triton_timings(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = benchmark(lambda: None, uses_triton=True, repeats=3, gpu=False)
    assert not t.meaningful and NOT_MEANINGFUL in str(t)


def test_a_gpu_timing_prints_no_run_count_it_does_not_know():
    text = str(Timing(1e-3, 0.9e-3, 1.1e-3, 0, "cuda (do_bench)"))
    assert text == "1.000 ms median (p20 0.900, p80 1.100; cuda (do_bench))"
    assert "5 runs" in str(Timing(1e-3, 0.9e-3, 1.1e-3, 5, "cpu (perf_counter)"))


def test_gpu_timing_repeats_calls_longer_than_do_bench_budget(monkeypatch):
    """do_bench sizes its repetitions from a 100 ms budget: a 60 ms call (a long prefill) would be
    timed about once. The GPU path raises the budget to cover at least five calls."""
    import triton.testing

    from labsupport import timing

    budgets = []

    def fake_do_bench(fn, rep=100, quantiles=None, **kwargs):
        budgets.append(rep)
        return 60.0, 59.0, 61.0

    monkeypatch.setattr(timing, "interpreter_mode", lambda: False)
    monkeypatch.setattr(timing, "_cuda_sync", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    result = timing.benchmark(lambda: time.sleep(0.06), gpu=True)
    assert budgets[0] >= 5 * 60 and result.median_s == 0.06 and result.method == "cuda (do_bench)"
    timing.benchmark(lambda: None, gpu=True)  # a fast call keeps do_bench's default budget
    assert budgets[1] == 100.0
    calls = []
    fixed = timing.benchmark(lambda: calls.append(1), gpu=True, repeats=2, warmup=0)  # a whole generate loop
    assert len(budgets) == 2 and len(calls) == 2 and fixed.repeats == 2 and "synchronize" in fixed.method


def test_benchmark_rejects_non_callables():
    with pytest.raises(ValueError, match="callable"):
        benchmark(42)


def test_number_formatting():
    assert book.count(30633.015) == "30,633"
    assert book.si(34.2e12, "FLOP") == "34.2 TFLOP"
    assert book.si(16.06e9, "B", 2) == "16.06 GB"
    assert book.binary_bytes(131072) == "128 KiB"
    assert book.binary_bytes(0.24 * 2**30, 2, unit="GiB") == "0.24 GiB"
    assert book.binary_bytes(0.24 * 2**30) == "245.8 MiB"
    assert book.percent(0.8098) == "81%"


def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


@pytest.mark.notebook
def test_a_hung_cell_fails_instead_of_passing():
    run = execute(_nb("x = 1", "import time\ntime.sleep(30)", "y = 2"), timeout=3)
    assert not run.ok and run.timed_out is not None and run.timed_out.index == 1


@pytest.mark.notebook
def test_kernel_gets_extra_environment_without_changing_ours():
    nb = _nb("import os\nprint(os.environ['LABSUPPORT_DEMO'])")
    run = execute(nb, env={"LABSUPPORT_DEMO": "seen"}, quiet=True, timeout=30)
    assert run.ok and nb.cells[0].outputs[0]["text"] == "seen\n"
    assert "LABSUPPORT_DEMO" not in os.environ


@pytest.mark.notebook
def test_errors_are_reported_by_cell():
    run = execute(_nb("x = 1", "1 / 0", "y = 2"), stop_on_error=True, timeout=30)
    assert [(e.index, e.ename) for e in run.errors] == [(1, "ZeroDivisionError")]


def test_load_reports_missing_and_malformed(tmp_path):
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.ipynb")
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable Jupyter notebook"):
        load(bad)
    with pytest.raises(ValueError, match="folder"):
        load(tmp_path)


def test_lab_dtype_follows_the_hardware(monkeypatch):
    import torch

    from labsupport import device as dev

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert dev.lab_dtype() == torch.float32 and not dev.gpu_has_bf16()
    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    for capability, want in (((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=capability: c)
        assert dev.lab_dtype() == want, capability
        assert dev.gpu_has_bf16() == (want == torch.bfloat16)


def test_round_spread_compares_consecutive_rounds():
    from labsupport.timing import round_spread

    steady = [1.0, 1.1, 0.9, 1.0, 1.05] * 20
    assert round_spread(steady) < 1.1
    # the machine got busy for the last fifth of the measurement: that round is 4x slower
    busy = [1.0] * 80 + [4.0] * 20
    assert round_spread(busy) == pytest.approx(4.0)
    assert round_spread([2.0]) == 1.0 and round_spread([1.0, 3.0]) == pytest.approx(3.0)


def test_an_unstable_timing_says_so_on_screen():
    from labsupport.timing import SPREAD_LIMIT

    calm = Timing(1e-3, 0.9e-3, 1.1e-3, 50, "cpu (perf_counter)", spread=1.1)
    assert not calm.unstable and calm.warning() == "" and "UNSTABLE" not in str(calm)
    noisy = Timing(1e-3, 0.9e-3, 9e-3, 50, "cpu (perf_counter)", spread=SPREAD_LIMIT * 2)
    assert noisy.unstable and "too wide to trust" in noisy.warning() and "UNSTABLE" in str(noisy)


def test_benchmark_flags_a_machine_that_gets_busy_mid_measurement():
    import time as _time

    calls = []

    def fn():  # the last rounds of calls are ten times slower, as when another job starts
        calls.append(1)
        _time.sleep(0.0002 if len(calls) <= 30 else 0.002)

    t = benchmark(fn, repeats=60, warmup=0, gpu=False)
    assert t.unstable and t.spread > 3


def test_cpu_benchmark_times_each_point_long_enough():
    t = benchmark(lambda: None, gpu=False)
    assert t.repeats >= 5  # at least one call per round, and at least min_time_s of calls


def test_a_graded_run_times_the_fewest_calls(monkeypatch):
    """Under the grader (its outputs are discarded) the CPU path makes ROUNDS calls, not 0.2 s of them."""
    import time as _time

    from labsupport.checks.framework import GRADING_ENV
    from labsupport.timing import ROUNDS, benchmark

    def nap():
        _time.sleep(0.005)

    monkeypatch.delenv(GRADING_ENV, raising=False)
    assert benchmark(nap, gpu=False, warmup=0).repeats >= 0.2 / 0.006  # filled min_time_s
    monkeypatch.setenv(GRADING_ENV, "1")
    assert benchmark(nap, gpu=False, warmup=0).repeats == ROUNDS
    assert benchmark(nap, gpu=False, warmup=0, repeats=7).repeats == 7  # a count asked for is kept
