"""The class ledger: results files written, read back, rejected when malformed, and tabulated."""

import csv
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labsupport import ledger
from labsupport.device import settings as current_settings

ROOT = Path(__file__).resolve().parent.parent
FIGURES = [ledger.Figure("matmul_peak", 12.5, "TFLOP/s", "best square matmul; 2n^3 FLOPs over median time"),
           ledger.Figure("copy_bandwidth", 80.0, "GB/s", "bytes read + written over median time"),
           ledger.Figure("hit_rate", 0.75, "share", "blocks found cached", timing=False)]


def gpu(name="NVIDIA T4"):
    """Settings as a CUDA GPU named ``name`` would report them (no GPU needed)."""
    return replace(current_settings(), device="cuda", device_name=name, interpreter=False, preset="full")


def interpreter():
    return replace(current_settings(), device="cpu", device_name="CPU (x86_64, 2 cores)", interpreter=True)


def test_record_round_trip(tmp_path, capsys):
    path = ledger.record("04_roofline", FIGURES, folder=tmp_path, settings=gpu())
    assert path.parent == tmp_path and path.name.startswith("04_roofline_nvidia-t4_")
    assert str(path) in capsys.readouterr().out  # the learner is told where it went
    data = json.loads(path.read_text())
    assert data["schema"] == ledger.SCHEMA
    assert data["device"] == {"name": "NVIDIA T4", "kind": "cuda-gpu"}
    assert data["timings_real"] is True
    assert set(data["versions"]) == {"python", "torch", "triton", "labsupport"}
    run = ledger.load(path)
    assert run.lab == "04_roofline" and run.device == "NVIDIA T4" and run.kind == "cuda-gpu"
    assert [f.name for f in run.figures] == ["matmul_peak", "copy_bandwidth", "hit_rate"]
    assert run.figures[0] == FIGURES[0] and run.figures[2].timing is False
    assert run.utc.endswith("Z")


def test_interpreter_runs_say_their_timings_are_not_real(tmp_path):
    path = ledger.record("07_attention", FIGURES, folder=tmp_path, settings=interpreter(), quiet=True)
    run = ledger.load(path)
    assert run.kind == "cpu-interpreter" and run.timings_real is False
    assert ledger.NOT_REAL in run.column
    # a lab timing only torch code passes timings_real=True: real CPU timings, and no warning
    real = ledger.load(ledger.record("04_roofline", FIGURES, folder=tmp_path, settings=interpreter(),
                                     timings_real=True, quiet=True))
    assert real.timings_real and real.column == "CPU (x86_64, 2 cores)"
    # measured on the CPU beside a GPU: the file names the CPU, not the GPU
    cpu = ledger.load(ledger.record("13_decode_loop", FIGURES, folder=tmp_path, settings=gpu(), on_cpu=True,
                                    quiet=True))
    assert cpu.kind == "cpu" and cpu.device.startswith("CPU") and cpu.timings_real


def test_names_are_unique_and_nothing_is_overwritten(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger, "utc_now", lambda: "2026-11-30T12:00:00Z")  # the same second every time
    paths = [ledger.record("04_roofline", FIGURES, folder=tmp_path, settings=gpu(), quiet=True) for _ in range(5)]
    assert len(set(paths)) == 5 and len(list(tmp_path.iterdir())) == 5
    # even a name collision does not replace a file: write() picks another name
    first = paths[0].read_text()
    suffixes = iter(["aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(ledger.secrets, "token_hex", lambda n: next(suffixes))
    one = ledger.write(json.loads(first), tmp_path)
    two = ledger.write(json.loads(first), tmp_path)
    assert one.name.endswith("_aaaaaa.json") and two.name.endswith("_bbbbbb.json")
    assert paths[0].read_text() == first


def test_default_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ledger.FOLDER_VAR, str(tmp_path / "class"))
    assert ledger.results_folder() == tmp_path / "class"
    monkeypatch.delenv(ledger.FOLDER_VAR)
    assert ledger.results_folder() == Path.home() / ".labsupport" / "results"


def test_unwritable_folder_warns_and_the_lab_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert ledger.record("04_roofline", FIGURES, folder=blocker, settings=gpu()) is None
    assert ledger.FOLDER_VAR in capsys.readouterr().err


def test_figures_that_are_not_numbers_are_left_out_and_bad_ones_rejected(tmp_path):
    data = ledger.make_record("05_phases", [*FIGURES, ("oom_point", float("nan"), "ms", "out of memory")], s=gpu())
    assert [f["name"] for f in data["figures"]] == ["matmul_peak", "copy_bandwidth", "hit_rate"]
    tensor = ledger.make_record("05_phases", [("from_a_tensor", torch.tensor(2.5), "ms", "c")], s=gpu())
    assert tensor["figures"][0]["value"] == 2.5 and type(tensor["figures"][0]["value"]) is float
    with pytest.raises(TypeError, match="'bad': value 'fast' is not a number"):
        ledger.make_record("05_phases", [("bad", "fast", "ms", "c")], s=gpu())
    with pytest.raises(ledger.LedgerError, match="appears twice"):
        ledger.make_record("05_phases", [FIGURES[0], FIGURES[0]], s=gpu())
    with pytest.raises(ledger.LedgerError, match="lab key"):
        ledger.make_record("roofline", FIGURES, s=gpu())


def _good():
    return ledger.make_record("04_roofline", FIGURES, s=gpu())


MALFORMED = {
    "not json": ("{", "not valid JSON"),
    "a list": ([1, 2], "expected a JSON object"),
    "no schema": ({"lab": "04_roofline"}, 'no "schema" key'),
    "other schema": (dict(_good(), schema="labsupport-ledger/99"), "is not 'labsupport-ledger/1'"),
    "no figures": ({k: v for k, v in _good().items() if k != "figures"}, 'missing the "figures" key'),
    "bad kind": (dict(_good(), device={"name": "X", "kind": "tpu"}), '"device.kind" must be one of'),
    "bad date": (dict(_good(), utc="yesterday"), '"utc" must look like'),
    "string value": (dict(_good(), figures=[dict(FIGURES[0].as_dict(), value="12")]), "is not a finite number"),
    "no unit": (dict(_good(), figures=[{"name": "x", "value": 1, "convention": "c"}]), "figure 1 has no unit"),
    "timings flag": (dict(_good(), timings_real="yes"), '"timings_real" must be true or false'),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_are_rejected_naming_the_file_and_the_fault(tmp_path, case):
    content, message = MALFORMED[case]
    path = tmp_path / "sub" / "bad.json"
    path.parent.mkdir()
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ledger.LedgerError, match="bad.json") as err:
        ledger.load(path)
    assert message in str(err.value)
    runs, problems = ledger.collect(tmp_path)  # collect skips it with the same message
    assert runs == [] and len(problems) == 1 and message in problems[0] and str(path) in problems[0]


def _class_folder(tmp_path):
    """Three learners: two on T4s (different figures), one on an H100, and one interpreter run."""
    folder = tmp_path / "class"
    ledger.record("04_roofline", FIGURES, folder=folder / "alice", settings=gpu(), quiet=True)
    ledger.record("04_roofline", [replace(FIGURES[0], value=13.5)], folder=folder / "bob", settings=gpu(), quiet=True)
    ledger.record("04_roofline", [replace(FIGURES[0], value=700.0)], folder=folder, settings=gpu("NVIDIA H100"),
                  quiet=True)
    ledger.record("07_attention", [ledger.Figure("flash_tflops_len1024_full", 0.01, "TFLOP/s", "c")],
                  folder=folder, settings=interpreter(), quiet=True)
    return folder


def test_table_of_a_class_with_two_gpus(tmp_path):
    runs, problems = ledger.collect(_class_folder(tmp_path))  # recursive: alice/ and bob/ included
    assert len(runs) == 4 and problems == []
    table = ledger.table(runs)
    interp = "CPU (x86_64, 2 cores) (CPU interpreter, timings not real)"
    assert table.columns == ["NVIDIA H100", "NVIDIA T4", interp]  # real GPUs first
    peak = ("04_roofline", "matmul_peak", "TFLOP/s")
    assert table.cell(peak, "NVIDIA T4").values == [12.5, 13.5]
    assert table.cell(peak, "NVIDIA T4").text() == "13 (n=2)"  # the median, and how many runs
    assert table.cell(peak, "NVIDIA H100").text() == "700"
    assert table.cell(peak, interp).values == []
    assert table.not_real == {interp}
    text = ledger.format_text(table)
    assert "== 04_roofline" in text and "== 07_attention" in text and "timings not real" in text
    t4_line = next(line for line in text.splitlines() if line.startswith("matmul_peak"))
    assert "700" in t4_line and "13 (n=2)" in t4_line
    md = ledger.format_markdown(table)
    assert "| matmul_peak | TFLOP/s | 700 | 13 (n=2) | best square matmul" in md


def test_cli_runs_for_real(tmp_path):
    folder = _class_folder(tmp_path)
    (folder / "notes.json").write_text('{"hello": 1}')  # someone's stray file: skipped, named
    out = tmp_path / "out"
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "-m", "labsupport", "ledger", str(folder), "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "notes.json" in done.stderr and 'no "schema" key' in done.stderr
    assert "4 results file(s), 3 device(s)" in done.stdout and "NVIDIA H100" in done.stdout
    rows = list(csv.DictReader((out / "ledger.csv").open()))
    t4 = next(r for r in rows if r["device"] == "NVIDIA T4" and r["figure"] == "matmul_peak")
    assert (t4["runs"], float(t4["median"]), t4["timings_real"]) == ("2", 13.0, "True")
    assert (out / "ledger.md").read_text().startswith("## 04_roofline")
    assert (out / "ledger_04_roofline.png").stat().st_size > 1000 and (out / "ledger_07_attention.png").exists()
    missing = subprocess.run([sys.executable, "-m", "labsupport", "ledger", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr


def test_the_books_committed_gpu_results_load():
    # results/ also holds CPU-side measurements (guidellm beside bench_serving); the GPU ones are gpu_*.json
    gpu_files = sorted((ROOT / "results").glob("gpu_*.json"))
    assert len(gpu_files) >= 5
    runs, problems = [], []
    for path in gpu_files:
        found, skipped = ledger.collect(path)
        runs += found
        problems += skipped
    assert problems == []
    # every bench module's results file is read (a new one needs its reader in ledger.BENCH_READERS)
    assert sorted(r.path.name for r in runs) == [p.name for p in gpu_files]
    assert all(r.figures and r.timings_real and r.kind == "cuda-gpu" for r in runs)
    by_lab = {run.lab: run for run in runs}
    assert {"05_phases", "07_attention"} <= set(by_lab)
    phases = by_lab["05_phases"]
    assert phases.device == "NVIDIA H200" and phases.kind == "cuda-gpu" and phases.timings_real
    assert phases.utc == "2026-11-30T15:04:00Z" and phases.versions["torch"].startswith("2.")
    raw = json.loads((ROOT / "results" / "gpu_phases.json").read_text())
    figures = {f.name: f for f in phases.figures}
    assert figures["copy_bandwidth"].value == pytest.approx(raw["copy_bandwidth_Bps"] / 1e9)
    assert figures["matmul_peak"].unit == "TFLOP/s"
    attention = {f.name: f.value for f in by_lab["07_attention"].figures}
    row = json.loads((ROOT / "results" / "gpu_attention.json").read_text())["rows"][0]
    assert attention["flash_tflops_len1024_full"] == pytest.approx(row["flops"] / row["kernel_s"] / 1e12)
    assert ledger.table(runs).columns == ["NVIDIA H200"]


def test_bench_dry_runs_are_marked_not_real(tmp_path):
    raw = json.loads((ROOT / "results" / "gpu_phases.json").read_text())
    raw.update(dry_run=True, device="CPU (dry run)")
    path = tmp_path / "gpu_phases.json"
    path.write_text(json.dumps(raw))
    run = ledger.load(path)
    assert not run.timings_real and "dry run" in run.source
    unknown = tmp_path / "gpu_someday.json"
    unknown.write_text(json.dumps({"device": "X", "date": "2026-11-30"}))
    with pytest.raises(ledger.LedgerError, match='no "schema" key'):
        ledger.load(unknown)
    broken = tmp_path / "gpu_attention.json"
    broken.write_text(json.dumps({"device": "X", "date": "2026-11-30", "dry_run": False}))
    with pytest.raises(ledger.LedgerError, match="unexpected shape"):
        ledger.load(broken)


def test_test_runs_and_the_grader_keep_lab_figures_out_of_the_users_folder():
    from labsupport.course import nbval_plugin

    assert nbval_plugin.LEDGER_VAR == ledger.FOLDER_VAR
    assert os.environ[ledger.FOLDER_VAR] != str(Path.home() / ".labsupport" / "results")  # set by the plugin


def stack_figures(yours, course):
    return [ledger.Figure("stack_output_tokens_per_s", yours, "tokens/s", "your stack"),
            ledger.Figure("course_stack_output_tokens_per_s", course, "tokens/s", "the course's stack")]


def test_each_learners_stack_throughput_is_listed_against_the_reference(tmp_path, monkeypatch, capsys):
    cpu = replace(current_settings(), device="cpu", device_name="CPU (x86_64, 2 cores)", interpreter=False)
    # one learner names themselves; another's file is found in their folder of a class's results
    monkeypatch.setenv(ledger.LEARNER_VAR, "ada")
    ledger.record("16_capstone", stack_figures(20.0, 25.0), folder=tmp_path / "class", settings=cpu, quiet=True)
    monkeypatch.delenv(ledger.LEARNER_VAR)
    ledger.record("16_capstone", stack_figures(30.0, 24.0), folder=tmp_path / "class" / "bo", settings=cpu, quiet=True)
    ledger.record("04_roofline", FIGURES, folder=tmp_path / "class" / "bo", settings=gpu(), quiet=True)
    runs, problems = ledger.collect(tmp_path / "class")
    assert not problems and len(runs) == 3
    rows = ledger.stack_throughput(runs)
    assert [(r["learner"], r["stack_tokens_per_s"], r["reference_tokens_per_s"]) for r in rows] == [
        ("ada", 20.0, 25.0), ("bo", 30.0, 24.0)]
    assert rows[0]["ratio"] == pytest.approx(0.8) and rows[1]["ratio"] == pytest.approx(1.25)
    assert ledger.main(str(tmp_path / "class"), plots=False) == 0
    out = capsys.readouterr().out
    assert "each learner's stack against the course's" in out and "1.25" in out and "0.80" in out
    bad = ledger.make_record("16_capstone", stack_figures(1.0, 1.0), s=cpu) | {"learner": 7}
    with pytest.raises(ledger.LedgerError, match='"learner" must be text'):
        ledger.parse(bad, "f.json")
