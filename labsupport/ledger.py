"""The class ledger: every lab that measures something writes its figures to a small results file,
and ``python -m labsupport ledger FOLDER`` collects a folder of them into a per-GPU table and plots.

A results file is one small JSON object per lab run (schema :data:`SCHEMA`)::

    {"schema": "labsupport-ledger/1",
     "lab": "04_roofline",                       # the lab's key
     "device": {"name": "NVIDIA H200",           # as torch reports it
                "kind": "cuda-gpu"},             # cuda-gpu, cpu-interpreter or cpu (see KINDS)
     "utc": "2026-11-30T15:04:00Z",              # when the run wrote it
     "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "labsupport": "0.1.0"},
     "timings_real": true,                       # false in Triton's interpreter or a dry run
     "source": "lab",                            # or "bench: results/gpu_phases.json"
     "figures": [{"name": "matmul_peak", "value": 738.2, "unit": "TFLOP/s",
                  "convention": "best of the sweep; 2mnk FLOPs per matmul; median time"}]}

Each figure has a stable ``name`` (the same in every run of that lab, so runs line up), a
``value``, its ``unit`` and the ``convention`` behind it. A figure that is a count rather than a
timing (an acceptance rate, a hit rate) says ``"timing": false``: it stays meaningful when the
run's timings are not.

:func:`record` writes a file into :func:`results_folder` (``$LABSUPPORT_LEDGER`` if set, else
``~/.labsupport/results``) under a name no earlier file has (lab, device, UTC time and a random
suffix, created exclusively): a run never overwrites another. :func:`collect` reads a folder
recursively; the book's own GPU results (``results/gpu_<topic>.json``, written by
``labsupport.bench_<topic>``) are read too, through :data:`BENCH_READERS`, so ``ledger results/``
tabulates the book's figures beside a class's.

A file may say ``"learner"`` (``$LABSUPPORT_LEARNER`` when it was written); a file without it
collected from a class's folder of learners' folders is the learner's whose folder it is in. For
lab 16, :func:`stack_throughput` lists each learner's stack throughput against the course's stack
(the reference, measured in the same minute on the same machine), and ``ledger`` prints it.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os
import platform
import re
import secrets
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .device import LabSettings
from .device import settings as current_settings

SCHEMA = "labsupport-ledger/1"
FOLDER_VAR = "LABSUPPORT_LEDGER"
LEARNER_VAR = "LABSUPPORT_LEARNER"
KINDS = {"cuda-gpu": "CUDA GPU", "cpu-interpreter": "CPU interpreter", "cpu": "CPU"}
NOT_REAL = "timings not real"
_LAB_KEY = re.compile(r"^\d\d_[a-z0-9_]+$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class LedgerError(ValueError):
    """A results file that cannot be read: the message names the file and what was wrong."""


@dataclass(frozen=True)
class Figure:
    """One measured number: a stable ``name``, its ``value`` and ``unit``, and the ``convention``
    behind it. ``timing=False`` for a count or a ratio of counts, which timings do not affect."""

    name: str
    value: float
    unit: str
    convention: str
    timing: bool = True

    def as_dict(self) -> dict:
        out = {"name": self.name, "value": self.value, "unit": self.unit, "convention": self.convention}
        if not self.timing:
            out["timing"] = False
        return out


@dataclass
class Run:
    """One results file, read and checked."""

    path: Path
    lab: str
    device: str
    kind: str
    utc: str
    versions: dict
    timings_real: bool
    figures: list[Figure]
    source: str = "lab"
    learner: str = ""  # who ran it: the file's "learner", else the folder it was collected from (collect)

    @property
    def column(self) -> str:
        """How the table heads this run's device: its name, and where its timings are not real, its
        kind and a warning (a class's interpreter runs get their own column, apart from real ones)."""
        if self.timings_real:
            return self.device
        return f"{self.device} ({KINDS.get(self.kind, self.kind)}, {NOT_REAL})"


def results_folder(folder: str | os.PathLike | None = None) -> Path:
    """Where :func:`record` writes: ``folder`` if given, else ``$LABSUPPORT_LEDGER``, else
    ``~/.labsupport/results``."""
    if folder is not None:
        return Path(folder).expanduser()
    if os.environ.get(FOLDER_VAR):
        return Path(os.environ[FOLDER_VAR]).expanduser()
    return Path.home() / ".labsupport" / "results"


def device_kind(s: LabSettings) -> str:
    """``cuda-gpu``, ``cpu-interpreter`` (Triton kernels interpreted, whatever holds the tensors)
    or ``cpu``."""
    if s.interpreter:
        return "cpu-interpreter"
    return "cuda-gpu" if s.on_gpu else "cpu"


def versions(s: LabSettings | None = None) -> dict:
    s = s or current_settings()
    return {"python": platform.python_version(), "torch": s.torch_version, "triton": s.triton_version,
            "labsupport": __version__}


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _as_figure(item) -> Figure:
    if isinstance(item, Figure):
        return item
    if isinstance(item, dict):
        return Figure(**item)
    if isinstance(item, (tuple, list)):
        return Figure(*item)
    raise TypeError(f"a figure is a Figure, a dict or a (name, value, unit, convention) tuple, not {item!r}")


def cpu_name() -> str:
    """The CPU as the course's banner names it."""
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def make_record(lab: str, figures: Iterable, *, s: LabSettings | None = None, source: str = "lab",
                utc: str | None = None, timings_real: bool | None = None, on_cpu: bool = False,
                learner: str | None = None) -> dict:
    """The results-file object for ``figures`` measured by ``lab`` on the machine ``s`` describes
    (default: this one). Figures whose value is not a finite number (an out-of-memory point) are
    left out. ``timings_real`` defaults to whether Triton kernels are compiled for a GPU here; a
    lab that times only torch or Python code on a CPU passes True (those are real CPU timings).
    ``on_cpu=True`` says the figures were measured on the CPU even if a GPU is present (a lab that
    runs its model on the CPU): the file then names the CPU, and its timings are real. ``learner``
    (default ``$LABSUPPORT_LEARNER``, if set) names who ran it, for a class's ledger."""
    s = s or current_settings()
    learner = os.environ.get(LEARNER_VAR, "") if learner is None else learner
    name, kind = (cpu_name(), "cpu") if on_cpu else (s.device_name, device_kind(s))
    if timings_real is None:
        timings_real = True if on_cpu else s.timings_meaningful
    kept = []
    for f in map(_as_figure, figures):
        try:
            value = float(f.value)  # a numpy or 0-d torch number too
        except (TypeError, ValueError):
            raise TypeError(f"figure {f.name!r}: value {f.value!r} is not a number") from None
        if math.isfinite(value):
            kept.append(Figure(f.name, value, f.unit, f.convention, f.timing))
    data = {"schema": SCHEMA, "lab": lab, "device": {"name": name, "kind": kind},
            "utc": utc or utc_now(), "versions": versions(s), "timings_real": bool(timings_real),
            "source": source, "figures": [f.as_dict() for f in kept]}
    if learner:
        data["learner"] = learner
    parse(data, f"the record for {lab}")  # a lab's mistake fails here, not in the instructor's ledger
    return data


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "device"


def write(data: dict, folder: str | os.PathLike | None = None) -> Path:
    """Write ``data`` (checked) under a new, unique name in ``folder``; never replaces a file."""
    run = parse(data, "the record")
    where = results_folder(folder)
    where.mkdir(parents=True, exist_ok=True)
    stamp = run.utc.replace("-", "").replace(":", "")
    for _ in range(100):
        path = where / f"{run.lab}_{_slug(run.device)}_{stamp}_{secrets.token_hex(3)}.json"
        try:
            with open(path, "x", encoding="utf-8") as f:  # "x": fails rather than overwrite
                json.dump(data, f, indent=1)
                f.write("\n")
            return path
        except FileExistsError:
            continue
    raise OSError(f"could not find an unused file name in {where}")


def record(lab: str, figures: Iterable, *, folder: str | os.PathLike | None = None,
           settings: LabSettings | None = None, timings_real: bool | None = None, on_cpu: bool = False,
           quiet: bool = False) -> Path | None:
    """Write this run's ``figures`` for ``lab`` to a new results file and say where.

    A lab calls it after measuring; a folder that cannot be written prints why and returns None
    (the lab goes on: nothing measured is lost from the notebook itself).
    """
    data = make_record(lab, figures, s=settings, timings_real=timings_real, on_cpu=on_cpu)
    try:
        path = write(data, folder)
    except OSError as exc:
        print(f"ledger: could not save this run's figures ({exc}); set {FOLDER_VAR} to a folder you can "
              f"write to and run the cell again", file=sys.stderr)
        return None
    if not quiet:
        real = "timings real" if data["timings_real"] else f"{NOT_REAL}: {KINDS[data['device']['kind']]}"
        print(f"ledger: {len(data['figures'])} figure(s) of {lab} on {data['device']['name']} ({real}) "
              f"saved to {path}\n        (`python -m labsupport ledger {path.parent}` tabulates this folder)")
    return path


# --- reading -----------------------------------------------------------------------------------

def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise LedgerError(f"{where}: {what}")


def parse(data, where: str) -> Run:
    """Check ``data`` against the schema and return it as a :class:`Run`; :class:`LedgerError`
    says what is wrong, prefixed by ``where`` (the file name)."""
    _need(isinstance(data, dict), where, f"expected a JSON object, found {type(data).__name__}")
    _need("schema" in data, where, f'no "schema" key: not a ledger results file (expected "{SCHEMA}")')
    _need(data["schema"] == SCHEMA, where,
          f'schema {data["schema"]!r} is not {SCHEMA!r} (written by another labsupport version?)')
    for key in ("lab", "device", "utc", "versions", "timings_real", "figures"):
        _need(key in data, where, f'missing the "{key}" key')
    _need(isinstance(data["lab"], str) and bool(_LAB_KEY.match(data["lab"])), where,
          f'"lab" must be a lab key such as "04_roofline", found {data["lab"]!r}')
    dev = data["device"]
    _need(isinstance(dev, dict) and isinstance(dev.get("name"), str) and dev.get("name"), where,
          '"device" must be an object with a non-empty "name"')
    _need(dev.get("kind") in KINDS, where, f'"device.kind" must be one of {", ".join(KINDS)}, found {dev.get("kind")!r}')
    try:
        datetime.datetime.strptime(data["utc"], "%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError):
        raise LedgerError(f'{where}: "utc" must look like 2026-11-30T15:04:00Z, found {data["utc"]!r}') from None
    _need(isinstance(data["versions"], dict), where, '"versions" must be an object')
    _need(isinstance(data["timings_real"], bool), where, '"timings_real" must be true or false')
    _need(isinstance(data["figures"], list), where, '"figures" must be a list')
    figures, seen = [], set()
    for i, f in enumerate(data["figures"]):
        at = f"figure {i + 1}"
        _need(isinstance(f, dict), where, f"{at} is not an object")
        missing = [k for k in ("name", "value", "unit", "convention") if k not in f]
        _need(not missing, where, f"{at} has no {', '.join(missing)}")
        _need(isinstance(f["name"], str) and bool(_NAME.match(f["name"])), where,
              f"{at}: name {f['name']!r} must be letters, digits, '_', '.' or '-'")
        _need(f["name"] not in seen, where, f"figure {f['name']!r} appears twice")
        seen.add(f["name"])
        value = f["value"]
        _need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), where,
              f"figure {f['name']!r}: value {value!r} is not a finite number")
        _need(isinstance(f["unit"], str) and isinstance(f["convention"], str), where,
              f"figure {f['name']!r}: unit and convention must be text")
        figures.append(Figure(f["name"], float(value), f["unit"], f["convention"], bool(f.get("timing", True))))
    _need(isinstance(data.get("learner", ""), str), where, '"learner" must be text (a name or a folder)')
    return Run(Path(where), data["lab"], dev["name"], dev["kind"], data["utc"], data["versions"],
               data["timings_real"], figures, str(data.get("source", "lab")), data.get("learner", ""))


def load(path: str | os.PathLike) -> Run:
    """Read one results file: a ledger file, or a bench module's ``gpu_<topic>.json``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(f"{path}: cannot be read ({exc})") from None
    except ValueError as exc:
        raise LedgerError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "schema" not in data:
        if isinstance(data.get("ledger"), dict):  # a bench file that carries its ledger record
            data = data["ledger"]
        else:
            topic = re.fullmatch(r"gpu_(.+)\.json", path.name)
            if topic and topic.group(1) in BENCH_READERS:
                try:
                    data = from_bench(topic.group(1), data, path)
                except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                    raise LedgerError(f"{path}: a bench results file of an unexpected shape "
                                      f"({type(exc).__name__}: {exc})") from None
    run = parse(data, str(path))
    run.path = path
    return run


def collect(folder: str | os.PathLike) -> tuple[list[Run], list[str]]:
    """Every results file under ``folder`` (recursively), and one message per file skipped."""
    root = Path(folder)
    runs, problems = [], []
    # a bench's logs folder (results/gpu_logs/) holds logs and the runs the current results replaced
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*.json")
                                                 if p.is_file() and "gpu_logs" not in p.relative_to(root).parts)
    for path in files:
        try:
            run = load(path)
        except LedgerError as exc:
            problems.append(f"skipped {exc}")
            continue
        if not run.learner and path != root and len(path.relative_to(root).parts) > 1:
            run.learner = path.relative_to(root).parts[0]  # a class's folder of learners' folders
        runs.append(run)
    return runs, problems


# --- the capstone's stacks (lab 16) ----------------------------------------------------------------

STACK_LAB = "16_capstone"
STACK_FIGURES = ("stack_output_tokens_per_s", "course_stack_output_tokens_per_s")  # as lab 16 records them


def stack_throughput(runs: list[Run]) -> list[dict]:
    """One row per lab-16 run: the learner, the device, their stack's output throughput and the
    reference (the course's stack, measured in the same minute on the same machine), and the ratio;
    ordered by learner, then time."""
    rows = []
    for run in runs:
        found = {f.name: f.value for f in run.figures}
        if run.lab != STACK_LAB or not set(STACK_FIGURES) <= set(found):
            continue
        yours, course = (found[n] for n in STACK_FIGURES)
        rows.append({"learner": run.learner or "(unnamed)", "device": run.column, "utc": run.utc,
                     "stack_tokens_per_s": yours, "reference_tokens_per_s": course,
                     "ratio": yours / course if course else None})
    return sorted(rows, key=lambda r: (r["learner"], r["utc"]))


def format_stacks(rows: list[dict]) -> str:
    """:func:`stack_throughput`'s rows for a terminal."""
    head = ["learner", "device", "stack tokens/s", "reference tokens/s", "ratio"]
    body = [[r["learner"], r["device"], f"{r['stack_tokens_per_s']:.4g}", f"{r['reference_tokens_per_s']:.4g}",
             "" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [f"== {STACK_LAB}: each learner's stack against the course's (the reference)",
             "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    return "\n".join(lines + ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in body]) + "\n"


# --- the book's own GPU results ------------------------------------------------------------------

def _bench_utc(date: str) -> str:
    """The bench modules' dates ("2026-11-30 15:04 UTC" or "2026-11-30") in the ledger's form."""
    for fmt in ("%Y-%m-%d %H:%M UTC", "%Y-%m-%d %H:%M:%S UTC", "%Y-%m-%d"):
        try:
            return datetime.datetime.strptime(date, fmt).strftime("%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            continue
    raise ValueError(f"date {date!r} in an unknown format")


def _bench_versions(data: dict) -> dict:
    out = {"python": data.get("python", "not recorded"), "labsupport": data.get("labsupport", "not recorded")}
    if isinstance(data.get("versions"), str):  # "torch 2.11.0+cu130, triton 3.6.0"
        for part in data["versions"].split(","):
            name, _, version = part.strip().partition(" ")
            out[name] = version
    for name in ("torch", "triton"):
        if isinstance(data.get(name), str):
            out[name] = data[name]
    return out


def _phases(data: dict) -> list[Figure]:
    model = data.get("model", "the bench model")
    figs = [Figure("copy_bandwidth", data["copy_bandwidth_Bps"] / 1e9, "GB/s",
                   "best copy of 1 and 4 GiB buffers; bytes read + written over median time"),
            Figure("matmul_peak", data["matmul_flops"] / 1e12, "TFLOP/s",
                   "best bf16 square matmul of the sweep; 2n^3 FLOPs over median time")]
    for r in data.get("prefill", []):
        if r.get("tflops_performed") is not None:
            figs.append(Figure(f"prefill_tflops_len{r['prompt_tokens']}", r["tflops_performed"], "TFLOP/s",
                               f"{model} prefill, batch 1; FLOPs the model performs (causal attention) "
                               f"over median time"))
    for r in data.get("decode_by_batch", []) + data.get("decode_by_context", []):
        if r.get("seconds") is not None:
            name = f"decode_step_b{r['batch']}_ctx{r['context']}"
            if name not in {f.name for f in figs}:
                figs.append(Figure(name, r["seconds"] * 1e3, "ms",
                                   f"{model} decode step, batch {r['batch']}, {r['context']} tokens of context; "
                                   f"median time, eager"))
    return figs


def _attention(data: dict) -> list[Figure]:
    figs = []
    for r in data["rows"]:
        mask = "causal" if r["causal"] else "full"
        for impl, key in (("flash", "kernel_s"), ("sdpa", "sdpa_s")):
            if r.get(key):
                figs.append(Figure(f"{impl}_tflops_len{r['seq_len']}_{mask}", r["flops"] / r[key] / 1e12, "TFLOP/s",
                                   f"{'course Triton kernel' if impl == 'flash' else 'torch SDPA'}, {mask} "
                                   f"attention; 4*S^2*d FLOPs per head ({'halved' if r['causal'] else 'whole'}) "
                                   f"over median time"))
    return figs


def _name(text) -> str:
    return _slug(str(text).replace(",", "")).replace("-", "_")  # "32 x 1,024" -> 32_x_1024


def _cache_ops(data: dict) -> list[Figure]:
    figs = []
    labels = {"paged": "lab 10's paged-attention kernel, shuffled block table",
              "paged_in_order": "lab 10's paged-attention kernel, in-order block table",
              "split_kv": "course split-KV paged decode kernel, shuffled block table",
              "split_kv_in_order": "course split-KV paged decode kernel, in-order block table",
              "sdpa": "torch SDPA on a contiguous padded cache"}
    for r in data["rows"]:
        shape = f"{r['batch']} sequences, {r['tokens']} cached tokens, {r['dtype']}"
        for key, label in labels.items():
            if isinstance(r.get(key), dict) and r[key].get("median_s"):
                figs.append(Figure(f"{key}_us_{_name(r['name'])}", r[key]["median_s"] * 1e6, "us",
                                   f"{label}; {shape}; median time"))
                figs.append(Figure(f"{key}_bandwidth_{_name(r['name'])}", r[key]["achieved_Bps"] / 1e9, "GB/s",
                                   f"{label}; {shape}; formula bytes over median time"))
    return figs


def _launch_overhead(data: dict) -> list[Figure]:
    figs = []
    for r in data["rows"]:
        for key, how in (("eager_s", "eager"), ("captured_s", "replayed from a CUDA graph")):
            if r.get(key):
                figs.append(Figure(f"decode_{key[:-2]}_ms_{_name(r['model'])}", r[key] * 1e3, "ms",
                                   f"{r['model']} decode step, batch {data.get('batch', 1)}, context {r['context']}, "
                                   f"{how}; median time"))
    return figs


def _many_gpus(data: dict) -> list[Figure]:
    backend = data.get("backend", "")
    figs = [Figure(f"all_reduce_n{r['world_size']}_{r['bytes']}B", r["seconds"] * 1e6, "us",
                   f"{backend} all-reduce, {r['world_size']} processes; median time") for r in data["all_reduce"]]
    figs += [Figure(f"decode_tp{r['world_size']}_b{r['batch']}_{_name(r['model'])}", r["seconds"] * 1e3, "ms",
                    f"{r['model']} decode step, batch {r['batch']}, tensor parallel over {r['world_size']} "
                    f"({backend}); median time") for r in data["decode"] if r.get("seconds")]
    return figs


def _precision(data: dict) -> list[Figure]:
    figs = []
    for r in data["rows"]:
        group = "per channel" if r["group_size"] is None else f"groups of {r['group_size']}"
        figs.append(Figure(f"int8_speedup_{_name(r['shape'])}_g{r['group_size'] or 0}_m{r['batch']}", r["speedup"], "x",
                           f"({r['batch']}, {r['K']}) x ({r['K']}, {r['N']}), {group}: dense {data.get('dtype', '')} "
                           f"median time over the course's int8 kernel's"))
        if "tuned_speedup" in r:
            figs.append(Figure(f"int8_tuned_speedup_{_name(r['shape'])}_g{r['group_size'] or 0}_m{r['batch']}",
                               r["tuned_speedup"], "x", f"({r['batch']}, {r['K']}) x ({r['K']}, {r['N']}), {group}: "
                               f"dense median time over the tuned int8 path's ({r['tuned_plan']})"))
    if data.get("copy_bandwidth_Bps"):
        figs.append(Figure("copy_bandwidth", data["copy_bandwidth_Bps"] / 1e9, "GB/s",
                           "copy of a 1 GiB buffer; bytes read + written over median time"))
    return figs


def _engine(data: dict) -> list[Figure]:
    figs = []
    for m in data["models"]:
        name = _name(m["model"])
        figs.append(Figure(f"engine_tokens_per_s_{name}", m["engine"]["output_tokens_per_s"], "tokens/s",
                           f"course engine, {m['model']} bf16, {m['requests']} Poisson requests at "
                           f"{m['rate_per_s']:g}/s; output tokens from first arrival to last token"))
        static = m.get("static") or {}
        if static.get("output_tokens_per_s"):
            figs.append(Figure(f"static_tokens_per_s_{name}", static["output_tokens_per_s"], "tokens/s",
                               "transformers generate, static batches, same trace and shape"))
        if (roof := m.get("roofline", {}).get("all")) is not None:
            figs.append(Figure(f"engine_fraction_of_bound_{name}", roof["fraction_of_bound"], "x",
                               "the engine's steps' roofline bound (bytes / copy rate or FLOPs / matmul rate) "
                               "over their measured time"))
    for r in data.get("decode_sweep", []):
        if r.get("step_s"):
            how = "CUDA graphs" if r["cuda_graphs"] else "eager"
            figs.append(Figure(f"decode_step_ms_{_name(r['model'])}_b{r['batch']}_{'graph' if r['cuda_graphs'] else 'eager'}",
                               r["step_s"] * 1e3, "ms", f"engine decode step, {r['model']}, batch {r['batch']}, "
                               f"context {r['context']}, {how}; median wall time"))
    return figs


# topic -> (lab key, function from the bench's JSON to figures). A topic without a reader here is
# skipped by the ledger with a message saying so; add one when a bench module lands.
BENCH_READERS: dict[str, tuple[str, Callable[[dict], list[Figure]]]] = {
    "phases": ("05_phases", _phases),
    "attention": ("07_attention", _attention),
    "precision": ("09_precision", _precision),
    "cache_ops": ("10_cache_ops", _cache_ops),
    "many_gpus": ("11_many_gpus", _many_gpus),
    "launch_overhead": ("12_engines", _launch_overhead),
    "engine": ("13_decode_loop", _engine),
}


def from_bench(topic: str, data: dict, path: Path | None = None) -> dict:
    """The ledger record of a bench module's results (``results/gpu_<topic>.json``)."""
    lab, reader = BENCH_READERS[topic]
    dry = bool(data.get("dry_run", True))
    return {"schema": SCHEMA, "lab": lab,
            "device": {"name": data["device"], "kind": "cpu" if dry else "cuda-gpu"},
            "utc": _bench_utc(data["date"]), "versions": _bench_versions(data), "timings_real": not dry,
            "source": f"bench: {path.name if path else 'gpu_' + topic + '.json'}" + (" (dry run)" if dry else ""),
            "figures": [f.as_dict() for f in reader(data) if math.isfinite(f.value)]}


# --- the table ---------------------------------------------------------------------------------

@dataclass
class Cell:
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def text(self) -> str:
        if not self.values:
            return ""
        out = f"{self.median:.4g}"
        return out + (f" (n={len(self.values)})" if len(self.values) > 1 else "")


@dataclass
class Table:
    """Rows: (lab, figure, unit); columns: devices; each cell the median of the runs' values."""

    columns: list[str]
    rows: list[tuple[str, str, str]]
    conventions: dict[tuple[str, str, str], str]
    cells: dict[tuple[tuple[str, str, str], str], Cell]
    not_real: set[str]

    def cell(self, row, column) -> Cell:
        return self.cells.get((row, column), Cell())


def table(runs: list[Run]) -> Table:
    # columns: real GPU timings first, then the rest, each alphabetically
    columns = sorted({r.column for r in runs}, key=lambda c: (c.endswith(f"{NOT_REAL})"), c))
    cells: dict = {}
    conventions: dict = {}
    for run in runs:
        for f in run.figures:
            row = (run.lab, f.name, f.unit)
            conventions.setdefault(row, f.convention)
            cells.setdefault((row, run.column), Cell()).values.append(f.value)
    # rows: by lab, then in the order the figures first appear (a lab lists them in a sensible order)
    order = {row: i for i, row in enumerate(conventions)}
    rows = sorted(conventions, key=lambda row: (row[0], order[row]))
    not_real = {r.column for r in runs if not r.timings_real}
    return Table(columns, rows, conventions, cells, not_real)


def format_text(t: Table) -> str:
    """The table for a terminal: one block per lab, a column per device."""
    lines = []
    for lab in sorted({row[0] for row in t.rows}):
        rows = [row for row in t.rows if row[0] == lab]
        cols = [c for c in t.columns if any(t.cell(row, c).values for row in rows)]
        head = ["figure", "unit", *cols]
        body = [[row[1], row[2], *(t.cell(row, c).text() for c in cols)] for row in rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines.append(f"== {lab}")
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        lines.extend("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in body)
        lines.append("")
    if t.not_real:
        lines.append(f"Columns marked '{NOT_REAL}' ran in Triton's interpreter or a dry run: their figures "
                     "check the code, they do not measure the device.")
    return "\n".join(lines)


def format_markdown(t: Table) -> str:
    out = []
    for lab in sorted({row[0] for row in t.rows}):
        rows = [row for row in t.rows if row[0] == lab]
        cols = [c for c in t.columns if any(t.cell(row, c).values for row in rows)]
        out += [f"## {lab}", "", "| figure | unit | " + " | ".join(cols) + " | convention |",
                "|" + " --- |" * (len(cols) + 3)]
        out += [f"| {row[1]} | {row[2]} | " + " | ".join(t.cell(row, c).text() for c in cols)
                + f" | {t.conventions[row]} |" for row in rows]
        out.append("")
    return "\n".join(out)


def write_csv(t: Table, path: Path) -> None:
    """One line per lab, figure and device (long form, for a spreadsheet's pivot table)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["lab", "figure", "unit", "device", "timings_real", "runs", "median", "min", "max", "convention"])
    for row in t.rows:
        for c in t.columns:
            cell = t.cell(row, c)
            if cell.values:
                w.writerow([row[0], row[1], row[2], c, c not in t.not_real, len(cell.values), cell.median,
                            min(cell.values), max(cell.values), t.conventions[row]])
    path.write_text(buf.getvalue(), encoding="utf-8")


def plot(t: Table, out: Path) -> list[Path]:
    """One PNG per lab: a panel per figure, a bar per device (gray where timings are not real)."""
    import matplotlib  # optional for a learner who never plots: imported here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for lab in sorted({row[0] for row in t.rows}):
        rows = [row for row in t.rows if row[0] == lab]
        ncols = min(3, len(rows))
        nrows = math.ceil(len(rows) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 0.9 + 0.5 * len(t.columns) * nrows + nrows),
                                 squeeze=False)
        for ax, row in zip(axes.flat, rows):
            cols = [c for c in t.columns if t.cell(row, c).values]
            bars = ax.barh(range(len(cols)), [t.cell(row, c).median for c in cols],
                           color=["tab:gray" if c in t.not_real else "tab:blue" for c in cols])
            ax.bar_label(bars, labels=[t.cell(row, c).text() for c in cols], fontsize=7, padding=2)
            ax.margins(x=0.25)
            ax.set_yticks(range(len(cols)), [c if len(c) < 40 else c[:37] + "..." for c in cols], fontsize=7)
            ax.set_title(row[1], fontsize=9)
            ax.set_xlabel(row[2], fontsize=8)
            ax.invert_yaxis()
        for ax in list(axes.flat)[len(rows):]:
            ax.set_visible(False)
        fig.suptitle(f"{lab} (gray: {NOT_REAL})" if t.not_real else lab)
        fig.tight_layout()
        path = out / f"ledger_{lab}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def main(folder: str, out: str | None = None, plots: bool = True) -> int:
    """``python -m labsupport ledger FOLDER [--out DIR]``: print the table; write CSV, markdown and
    plots into ``DIR`` when given. Returns the exit status."""
    root = Path(folder)
    if not root.exists():
        print(f"ledger: {folder}: no such file or folder. Give the folder the results files are in "
              f"(a lab saves them to {results_folder()}).", file=sys.stderr)
        return 2
    runs, problems = collect(root)
    for line in problems:
        print(f"ledger: {line}", file=sys.stderr)
    if not runs:
        print(f"ledger: no results files in {folder}", file=sys.stderr)
        return 1
    t = table(runs)
    print(f"{len(runs)} results file(s), {len(t.columns)} device(s), {len(t.rows)} figure(s)"
          + (f"; {len(problems)} file(s) skipped" if problems else "") + "\n")
    print(format_text(t))
    stacks = stack_throughput(runs)
    if stacks:
        print(format_stacks(stacks))
    if out is not None:
        where = Path(out)
        where.mkdir(parents=True, exist_ok=True)
        write_csv(t, where / "ledger.csv")
        (where / "ledger.md").write_text(format_markdown(t), encoding="utf-8")
        written = [where / "ledger.csv", where / "ledger.md"] + (plot(t, where) if plots else [])
        print(f"\nwrote {len(written)} file(s) to {where}: " + ", ".join(p.name for p in written))
    return 0
