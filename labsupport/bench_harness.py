"""What every ``labsupport.bench_<topic>`` module shares: its command line, its results file, and timing
that measures the kernel and nothing else.

A chapter's GPU measurement is a declaration, as in Triton's ``triton.testing.perf_report``: a
:class:`Bench` names the topic (``cache_ops`` writes ``results/gpu_cache_ops.json``, which chapter
10 reads), says what it needs (a GPU, two GPUs, or nothing) and gives the one function that
measures. This module does the rest once for all of them:

* :func:`main`: ``python -m labsupport.bench_<topic> [--out FILE] [--dry-run]``; without the
  hardware (and without ``--dry-run``) it exits with status 2 and says what to run instead;
* :func:`header` and :class:`Recorder`: every results file starts with the same fields (device,
  ``date`` in one format, :data:`DATE_FORMAT`, ``dry_run``, versions, the timing method) and is
  rewritten after every section, so a run cut short keeps what it measured;
* :func:`load_results`: the book's reader. No file: None. A dry run: None (a dry run is never a
  measurement). A file that is not one of these results (not JSON, not an object, no device or
  date, a required section missing): ValueError naming the file and what to do;
* :class:`Sweep`: the x values, the lines and one function per point, printed and recorded row
  by row (perf_report's shape).

**Timing short GPU work.** ``triton.testing.do_bench`` flushes the L2 cache before every call by
*writing* a 256 MB buffer; the dirty lines can be written back to memory while the timed kernel
runs, and a kernel that moves tens of megabytes is charged for that traffic too. It also times one
launch at a time, so a kernel of a few microseconds carries its launch. :func:`clean_time` avoids
both: it cycles through enough copies of the inputs that together they are larger than twice the
L2 cache (every call starts cold, nothing is flushed), records many calls into one CUDA graph and
times the replays with CUDA events, so there is no launch gap and no host work between calls.
Validation (a kernel's argument checks, reading lengths back to the host) stays out of the timed
function: a benchmark checks the result once, then times the call with ``validate=False``.
:func:`copy_check` is the harness's own test on a device: a 100 MB copy timed this way should reach
at least 90% of the rate of a copy of several gigabytes, which no cache can help.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .device import configure_triton, interpreter_mode
from .timing import benchmark

DATE_FORMAT = "%Y-%m-%d %H:%M UTC"  # every results file's "date"
REPO = Path(__file__).resolve().parent.parent
NOT_MEASURED = "not yet measured"
CLEAN_TIMING = ("CUDA-graph replay of many calls over input copies larger than twice the L2 cache, CUDA "
                "events; validation outside the timed calls (labsupport.bench_harness.clean_time)")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime(DATE_FORMAT)


def results_path(topic: str) -> Path:
    """``results/gpu_<topic>.json`` under the repository root: what the book reads."""
    return REPO / "results" / f"gpu_{topic}.json"


def header(dry_run: bool, device: str | None = None, **extra) -> dict:
    """The fields every results file starts with. ``device`` defaults to the GPU's name (or a dry
    run's label)."""
    import triton  # the bench modules need it; a plain import keeps this module light for the book

    if device is None:
        device = "CPU (dry run)" if dry_run else torch.cuda.get_device_name(0)
    return {"device": device, "date": utc_now(), "dry_run": bool(dry_run), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), **extra}


class Recorder:
    """The results dictionary, rewritten to ``path`` (atomically) after every section."""

    def __init__(self, path, base: dict):
        self.path = Path(path)
        self.data = dict(base)
        self._start = datetime.datetime.now(datetime.timezone.utc)

    def save(self, section: str) -> None:
        elapsed = (datetime.datetime.now(datetime.timezone.utc) - self._start).total_seconds()
        self.data["completed"], self.data["wall_seconds"] = section, round(elapsed, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps(self.data, indent=1, allow_nan=True) + "\n", encoding="utf-8")
        part.replace(self.path)
        print(f"[{elapsed:.0f} s] {section}: saved to {self.path}", flush=True)


def load_results(topic: str, path=None, *, required: Sequence[str] = ("rows",)) -> dict | None:
    """The measured results of ``python -m labsupport.bench_<topic>`` (module docstring), or None."""
    path = Path(path) if path is not None else results_path(topic)
    if not path.is_file():
        return None
    fix = f"run `python -m labsupport.bench_{topic}` on a GPU again (scripts/gpu_all.sh), or delete the file"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a results file from python -m labsupport.bench_{topic}: {exc}; {fix}") from exc
    if isinstance(data, dict) and data.get("dry_run", True) is True:
        return None  # a dry run (or a file that does not say it is not one) is never a measurement
    if not isinstance(data, dict) or not {"device", "date"} <= data.keys():
        raise ValueError(f"{path} is not a results file from python -m labsupport.bench_{topic} (no device and "
                         f"date); {fix}")
    missing = [key for key in required if not data.get(key)]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: the run stopped before it measured anything; {fix}")
    return data


def date_of(results: dict) -> str:
    """The day a results file was written (its ``date`` is :data:`DATE_FORMAT`, or a bare day in
    files written before the harness)."""
    return results["date"][:10]


# --- the command line --------------------------------------------------------------------------

NEEDS = ("gpu", "gpus", "none")


@dataclass(frozen=True)
class Bench:
    """A chapter's GPU measurement, declared (module docstring).

    ``measure(args)`` does the work (``args.out``, ``args.dry_run`` and any option
    ``add_arguments`` declared) and returns the exit status (None: 0). ``needs``: ``"gpu"`` (one
    CUDA GPU, kernels compiled for it), ``"gpus"`` (two or more) or ``"none"``. ``interpreter``: the
    dry run runs Triton kernels, so it needs the interpreter."""

    topic: str
    chapter: str
    measure: Callable[[argparse.Namespace], int | None]
    needs: str = "gpu"
    interpreter: bool = False
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str = ""

    def __post_init__(self):
        if self.needs not in NEEDS:
            raise ValueError(f"needs must be one of {NEEDS}, got {self.needs!r}")


def missing_hardware(bench: Bench) -> str | None:
    """Why this machine cannot take the measurement for real, or None when it can."""
    if bench.needs == "gpu" and not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if bench.needs == "gpu" and interpreter_mode():
        return "TRITON_INTERPRET is set (kernels would run in the interpreter, not on the GPU)"
    if bench.needs == "gpus" and torch.cuda.device_count() < 2:
        return f"it needs two or more CUDA GPUs (torch sees {torch.cuda.device_count()})"
    return None


def main(bench: Bench, argv: list[str] | None = None) -> int:
    """The command line of a bench module (module docstring)."""
    default = f"results/gpu_{bench.topic}.json"
    parser = argparse.ArgumentParser(prog=f"python -m labsupport.bench_{bench.topic}",
                                     description=bench.description or None)
    parser.add_argument("--out", default=default, help=f"results file (default {default}, which chapter "
                                                       f"{bench.chapter} reads)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same code on the CPU at tiny sizes: checks this command, measures nothing")
    if bench.add_arguments is not None:
        bench.add_arguments(parser)
    args = parser.parse_args(argv)
    configure_triton()
    if not args.dry_run and (reason := missing_hardware(bench)):
        print(f"bench_{bench.topic} measures a GPU ({reason}); --dry-run checks the command on a CPU.",
              file=sys.stderr)
        return 2
    if args.dry_run and bench.interpreter and not interpreter_mode():
        print(f"bench_{bench.topic} --dry-run runs its kernels in the Triton interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    status = bench.measure(args)
    return 0 if status is None else int(status)


# --- sweeps, perf_report style -------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    """A sweep declared as Triton's ``perf_report`` declares one: for every ``x`` in ``x_vals``
    and every line in ``lines``, ``point(x, line)`` measures and returns a row (a dict; ``None``
    leaves the point out, an exception is recorded as the row's ``error``). Rows are printed and
    kept in ``rec.data[key]``, and the file is rewritten after every ``x``."""

    key: str
    x_name: str
    x_vals: Sequence
    lines: Sequence[str]
    describe: Callable[[dict], str] = field(default=lambda row: "")

    def run(self, point: Callable[[object, str], dict | None], rec: Recorder) -> list[dict]:
        rows = rec.data.setdefault(self.key, [])
        for x in self.x_vals:
            for line in self.lines:
                try:
                    row = point(x, line)
                except Exception as exc:  # noqa: BLE001 - out of memory, a config the device cannot run: record it
                    row = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
                if row is None:
                    continue
                row = {self.x_name: x, "line": line, **row}
                rows.append(row)
                print(f"{self.key} {self.x_name}={x} {line}: {row.get('error') or self.describe(row)}", flush=True)
            rec.save(f"{self.key} {self.x_name}={x}")
        return rows


# --- clean GPU timing -----------------------------------------------------------------------------


def l2_bytes(device=None) -> int:
    """The L2 cache of the GPU (torch's device properties), or 50 MB where torch does not say."""
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def copies_for(bytes_per_call: int, device=None, at_least: int = 2) -> int:
    """How many copies of one call's inputs to cycle through so that together they exceed twice
    the L2 cache (every call then finds its inputs in memory, not in the cache)."""
    return max(at_least, math.ceil(2 * l2_bytes(device) / max(1, bytes_per_call)) + 1)


@dataclass(frozen=True)
class CleanTiming:
    """Per-call seconds from :func:`clean_time`: the median over replays and their spread."""

    seconds: float
    p20_s: float
    p80_s: float
    calls_per_replay: int
    replays: int
    method: str

    @property
    def median_s(self) -> float:
        return self.seconds


def clean_time(calls: Sequence[Callable[[], object]], *, min_calls: int = 64, min_graph_s: float = 2e-3,
               replays: int = 20, graph: bool = True) -> CleanTiming:
    """Time one call of ``calls`` (zero-argument functions doing the same work on different input
    copies: :func:`copies_for` says how many) on the current CUDA device (module docstring).

    With ``graph=True`` the calls are recorded, cycling through the copies, into one CUDA graph of
    at least ``min_calls`` calls and ``min_graph_s`` of work, and ``replays`` replays are timed with
    CUDA events; each replay's time over its calls is one sample. With ``graph=False`` (work that
    cannot be captured) the same cycle is launched eagerly between two events: launch gaps are then
    included, caches still cold."""
    if not calls:
        raise ValueError("clean_time needs at least one call")
    for fn in calls:  # warm-up: compilation, autotuning, workspaces
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3 / len(calls), 1e-7)  # seconds per call, roughly
    n = max(min_calls, len(calls), math.ceil(min_graph_s / once))
    n = math.ceil(n / len(calls)) * len(calls)  # whole cycles through the copies

    def cycle():
        for i in range(n):
            calls[i % len(calls)]()

    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # one more warm-up on the capture's side stream
            calls[0]()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            cycle()
        run = g.replay
        run()
    else:
        run = cycle
    samples = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    samples.sort()
    q = statistics.quantiles(samples, n=5) if len(samples) > 1 else [samples[0]] * 4
    return CleanTiming(statistics.median(samples), q[0], q[3], n, replays,
                       "cuda graph replay" if graph else "eager cycle, CUDA events")


def time_calls(calls: Sequence[Callable[[], object]], *, dry_run: bool, **kw) -> CleanTiming:
    """:func:`clean_time` on a GPU; in a dry run one call of the first, timed with ``perf_counter``
    (the number means nothing: it checks that the code runs)."""
    if dry_run:
        t = benchmark(calls[0], repeats=1, warmup=0).median_s
        return CleanTiming(t, t, t, 1, 1, "dry run: one call, perf_counter (measures nothing)")
    return clean_time(calls, **kw)


def check_and_time(checked: Callable[[], object], calls: Sequence[Callable[[], object]], *, dry_run: bool,
                   **kw) -> tuple[object, CleanTiming]:
    """``(checked(), timing of calls)``: the validated call's result (to compare with a reference)
    and :func:`clean_time` of the unvalidated ``calls``. In a dry run the checked call is the only
    one, timed once (interpreter calls are slow, and the number means nothing)."""
    if dry_run:
        start = time.perf_counter()
        out = checked()
        t = time.perf_counter() - start
        return out, CleanTiming(t, t, t, 1, 1, "dry run: one call, perf_counter (measures nothing)")
    return checked(), clean_time(calls, **kw)


def _copy_seconds(size_bytes: int, copies: int, dev, **kw) -> tuple[float, float]:
    """Per-call seconds of ``dst.copy_(src)`` on ``size_bytes`` buffers: clean (over ``copies``
    pairs) and under ``do_bench`` (one pair, as the harness before this one timed it)."""
    bufs = [(torch.empty(size_bytes, dtype=torch.uint8, device=dev), torch.empty(size_bytes, dtype=torch.uint8,
                                                                                 device=dev)) for _ in range(copies)]
    clean = clean_time([lambda s=s, d=d: d.copy_(s) for s, d in bufs], **kw).seconds
    src, dst = bufs[0]
    old = benchmark(lambda: dst.copy_(src), gpu=True).median_s
    return clean, old


def copy_check(device=None, size_bytes: int = 100 * 10**6, big_bytes: int = 4 * 2**30) -> dict:
    """The harness's own check (module docstring): the copy rate of ``size_bytes`` buffers timed
    with :func:`clean_time`, of a ``big_bytes`` copy (which no cache holds), of the same 100 MB
    copy under ``do_bench`` for comparison, and the verdict ``small / big >= 0.9``. Rates count
    the bytes read plus the bytes written."""
    dev = torch.device(device if device is not None else "cuda")
    copies = copies_for(2 * size_bytes, dev)
    small, old = _copy_seconds(size_bytes, copies, dev)
    big, _ = _copy_seconds(big_bytes, 1, dev, min_calls=4, replays=5)
    torch.cuda.empty_cache()
    rate, big_rate, old_rate = 2 * size_bytes / small, 2 * big_bytes / big, 2 * size_bytes / old
    return {"size_bytes": size_bytes, "big_bytes": big_bytes, "clean_Bps": rate, "big_copy_Bps": big_rate,
            "do_bench_Bps": old_rate, "fraction_of_big": rate / big_rate, "passed": rate / big_rate >= 0.9,
            "copies": copies}
