"""Chapter 09's GPU measurement: the weight-only int8 matmul against a bf16 matmul at decode batches.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_precision --out results/gpu_precision.json
    python -m labsupport.bench_precision --dry-run --out /tmp/precision.json   # on a CPU, tiny shapes
                                                                              # through the interpreter:
                                                                              # checks the code, measures nothing
    python -m labsupport.bench_precision --configs --out /tmp/configs.md       # the kernel under other
                                                                              # launch configurations

For two projection shapes of Llama 3.1 8B (the feed-forward's up projection, N = 14,336 by
K = 4,096, and its down projection, 4,096 by 14,336), at batch 1 to 64, per channel and with
groups of 128, it records:

* the time of the course's kernel (:func:`labsupport.int8_matmul.int8_matmul_reference`: int8
  weights, bf16 activations, float32 scales) and of ``x @ w.T`` in bf16 (cuBLAS through torch);
* the bytes each must move at least (:func:`~labsupport.int8_matmul.int8_matmul_bytes`,
  :func:`~labsupport.int8_matmul.dense_matmul_bytes`), those bytes over the time (bytes per
  second), and the speedup of the int8 kernel over bf16 beside the ratio of bytes (the speedup a
  memory-bound kernel could reach at best);
* the copy bandwidth of the device (:func:`labsupport.roofline.measure_copy`) for scale, and the
  largest error of the kernel against the dequantised reference;
* the lab's graded check on the course's kernel with its GPU-only cases (bf16 included).

The results file is rewritten after every shape, so a run stopped early keeps what it measured.
Chapter 09 reads ``results/gpu_precision.json`` (:func:`load_results`); until a real run is
committed it says "not yet measured". Without a GPU (and without ``--dry-run``) the command exits
with status 2 and says why.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from . import bench_harness as H
from . import checks
from ._answers import course_checks_its_answers, unguarded
from .int8_matmul import (
    GEMV_ROWS,
    LaunchPlan,
    MatmulConfig,
    bytes_ratio,
    dense_matmul_bytes,
    int8_launch_plan,
    int8_linear,
    int8_matmul_bytes,
    int8_matmul_config,
    int8_matmul_kernel,
    int8_matmul_reference,
    int8_matmul_spec,
)
from .quantize import quantize_groupwise
from .roofline import measure_copy

GPU_RESULTS = "results/gpu_precision.json"  # what chapter 09 reads; scripts/gpu_all.sh writes it
NOT_MEASURED = "not yet measured"
# (name, N, K) for the GPU, and the dry run's stand-ins
SHAPES = ([("8B up projection", 14336, 4096), ("8B down projection", 4096, 14336)],
          [("tiny", 256, 512)])
BATCHES = ([1, 2, 4, 8, 16, 32, 64], [1, 4])
GROUPS = ([None, 128], [None, 128])  # None: per channel
BOOK_GROUP = 128  # ... with groups of 128, the scales its bytes ratio counts


def _row(name: str, n: int, k: int, group: int | None, batch: int, dtype, device: str, dry_run: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(batch)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.float32)
    w_q, scales = quantize_groupwise(w, 8, group or k)
    scales = scales.float().contiguous()
    w16 = w.to(dtype)
    del w
    x = torch.randn(batch, k, device=device, generator=gen).to(dtype)
    kernel, tuned = unguarded(int8_matmul_reference), unguarded(int8_linear)
    want = int8_matmul_spec(x, w_q, scales).float()
    groups = 1 if group is None else k // group
    b_int8 = int8_matmul_bytes(batch, n, k, groups, dtype.itemsize, scales.element_size())
    b_dense = dense_matmul_bytes(batch, n, k, dtype.itemsize)
    # copies of the weights (the bytes that matter) larger than twice the L2 cache together
    c8 = 1 if dry_run else H.copies_for(b_int8, device)
    c16 = 1 if dry_run else H.copies_for(b_dense, device)
    w8s = [w_q] + [w_q.clone() for _ in range(c8 - 1)]
    w16s = [w16] + [w16.clone() for _ in range(c16 - 1)]
    plan = int8_launch_plan(batch, n, k, group or k, interpreter=dry_run)
    got, t = H.check_and_time(lambda: kernel(x, w_q, scales), [lambda w=w: kernel(x, w, scales) for w in w8s],
                              dry_run=dry_run)
    err, t_int8 = float((got.float() - want).abs().max()), t.seconds
    got, t = H.check_and_time(lambda: tuned(x, w_q, scales, plan=plan),
                              [lambda w=w: tuned(x, w, scales, plan=plan, validate=False) for w in w8s], dry_run=dry_run)
    err_tuned, t_tuned = float((got.float() - want).abs().max()), t.seconds
    t_dense = H.time_calls([lambda w=w: x @ w.T for w in w16s], dry_run=dry_run).seconds
    del w8s, w16s
    row = dict(shape=name, N=n, K=k, group_size=group, batch=batch, int8_seconds=t_int8, dense_seconds=t_dense,
               int8_bytes=b_int8, dense_bytes=b_dense, int8_Bps=b_int8 / t_int8, dense_Bps=b_dense / t_dense,
               speedup=t_dense / t_int8, bytes_ratio=bytes_ratio(batch, n, k, groups, dtype.itemsize,
                                                                 scales.element_size()),
               max_error=err, tuned_seconds=t_tuned, tuned_Bps=b_int8 / t_tuned, tuned_speedup=t_dense / t_tuned,
               tuned_max_error=err_tuned, tuned_plan=f"{plan.kernel}, {plan.config.block_n} columns, K tiles of "
                                                  f"{plan.config.block_k}, split-K {plan.split_k}")
    print(f"{name} N={n} K={k} group={group or 'channel'} batch {batch}: int8 {t_int8 * 1e6:.1f} us "
          f"({row['int8_Bps'] / 1e12:.2f} TB/s), dense {t_dense * 1e6:.1f} us ({row['dense_Bps'] / 1e12:.2f} TB/s), "
          f"speedup {row['speedup']:.2f}x of {row['bytes_ratio']:.2f}x the bytes allow; tuned "
          f"{t_tuned * 1e6:.1f} us ({row['tuned_plan']}), {row['tuned_speedup']:.2f}x", flush=True)
    return row


def run_checks() -> str:
    """The lab's graded check on the course's kernel (GPU-only cases included): "PASSED" or the failure."""
    try:
        with course_checks_its_answers():
            checks.check_int8_matmul(unguarded(int8_matmul_reference))
    except AssertionError as exc:
        print(f"FAILED check_int8_matmul:\n{exc}", flush=True)
        return f"FAILED: {exc}"[:2000]
    return "PASSED"


def _plan_point(split: int, kernel: str, *, shape: tuple, x, ws, scales, dry_run: bool) -> dict | None:
    """One point of :func:`run_plans`: ``kernel`` (``"gemv"`` or ``"tiles"``) with ``split`` K ranges."""
    name, n, k = shape
    batch = x.shape[0]
    chosen = int8_launch_plan(batch, n, k, 128, interpreter=dry_run)
    if kernel == "gemv" and chosen.kernel != "gemv":
        return None
    cfg = chosen.config if kernel == chosen.kernel else int8_matmul_config(
        max(batch, GEMV_ROWS + 1), n, k, 128, interpreter=dry_run)  # the tiles a 5-row batch would get
    plan = LaunchPlan(kernel, cfg, split)
    tuned = unguarded(int8_linear)
    t = H.time_calls([lambda w=w: tuned(x, w, scales, plan=plan, validate=False) for w in ws], dry_run=dry_run).seconds
    return {"shape": name, "batch": batch, "kernel": kernel, "split_k": split, "seconds": t,
            "chosen": (kernel, split) == (chosen.kernel, chosen.split_k),
            "TBps": int8_matmul_bytes(batch, n, k, k // 128, x.element_size(), 4) / t / 1e12}


def run_plans(rec: H.Recorder, *, dry_run: bool) -> None:
    """The tuned path's choices against the others at groups of 128: the matrix-vector kernel and
    the tiles at batch 1 and 4, each split-K count, and the tiles' split-K at 16 and 64 rows."""
    device, dtype = ("cpu", torch.float16) if dry_run else ("cuda", torch.bfloat16)
    shapes, batches = (SHAPES[1], (1,)) if dry_run else (SHAPES[0], (1, 4, 16, 64))
    splits = (1, 2) if dry_run else (1, 2, 4, 8)
    for shape in shapes:
        n, k = shape[1], shape[2]
        gen = torch.Generator(device=device).manual_seed(0)
        w_q, scales = quantize_groupwise(torch.randn(n, k, device=device, generator=gen), 8, 128)
        scales = scales.float().contiguous()
        copies = 1 if dry_run else H.copies_for(n * k, device)
        ws = [w_q] + [w_q.clone() for _ in range(copies - 1)]
        for batch in batches:
            x = torch.randn(batch, k, device=device, generator=gen).to(dtype)
            kernels = ("gemv", "tiles") if batch <= GEMV_ROWS else ("tiles",)
            point = functools.partial(_plan_point, shape=shape, x=x, ws=ws, scales=scales, dry_run=dry_run)
            H.Sweep("plans", "split_k", splits, kernels,
                    describe=lambda r: f"{r['shape']} batch {r['batch']}: {r['seconds'] * 1e6:.1f} us, "
                                       f"{r['TBps']:.2f} TB/s{' (chosen)' if r['chosen'] else ''}").run(point, rec)
        del ws


def measure(args) -> None:
    """Measure everything, saving after each shape (module docstring)."""
    if args.configs:
        sweep_configs(args.out, dry_run=args.dry_run)
        return
    dry_run = args.dry_run
    if dry_run:
        torch.set_num_threads(1)  # steady on a shared machine; the numbers mean nothing anyway
    pick = (lambda gpu, dry: dry) if dry_run else (lambda gpu, dry: gpu)
    device = pick("cuda", "cpu")
    dtype = pick(torch.bfloat16, torch.float16)  # the interpreter cannot compute in bf16
    rec = H.Recorder(args.out, H.header(dry_run, dtype=str(dtype).replace("torch.", ""), timing=H.CLEAN_TIMING,
                                        weights="random (seeded) N(0, 1), quantised to int8; timing does not "
                                                "depend on values", rows=[]))
    data = rec.data
    data["checks"] = run_checks() if not dry_run else "not run in a dry run"
    quick = pick({"max_time_s": 1.0}, {"repeats": 1})
    data["copy_bandwidth_Bps"] = max(measure_copy(pick([2**30], [2**22]), device=device, progress=False, **quick))
    if not dry_run:
        data["harness_check"] = H.copy_check()
    rec.save("checks and copy bandwidth")
    for name, n, k in pick(*SHAPES):
        for group in pick(*GROUPS):
            for batch in pick(*BATCHES):
                data["rows"].append(_row(name, n, k, group, batch, dtype, device, dry_run))
        rec.save(name)
        if device == "cuda":
            torch.cuda.empty_cache()
    run_plans(rec, dry_run=dry_run)
    rec.save("all")


# --- other launch configurations ----------------------------------------------------------------

SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_BLOCK_K = (64, 128)
SWEEP_WARPS_STAGES = ((4, 4), (8, 4), (4, 6))


def sweep_configs(out_path: str, *, dry_run: bool) -> list[dict]:
    """Time the kernel under other tiles, warps and stages (groups of 128, batches 1, 16 and 64).

    The course's choice (:func:`~labsupport.int8_matmul.int8_matmul_config`) was made without a
    measurement; this table shows what others give on the device. A markdown table goes to
    ``out_path``, rewritten after every shape."""
    import triton

    device, dtype = ("cpu", torch.float16) if dry_run else ("cuda", torch.bfloat16)
    shapes = SHAPES[1] if dry_run else SHAPES[0]
    batches = (1,) if dry_run else (1, 16, 64)
    lines = ["| shape | batch | BLOCK_N | BLOCK_K | warps | stages | time | TB/s | vs course |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    for name, n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        w_q, scales = quantize_groupwise(torch.randn(n, k, device=device, generator=gen), 8, 128)
        scales = scales.float().contiguous()
        ws = [w_q] + [w_q.clone() for _ in range((1 if dry_run else H.copies_for(n * k, device)) - 1)]
        for batch in batches:
            x = torch.randn(batch, k, device=device, generator=gen).to(dtype)
            out = torch.empty((batch, n), dtype=dtype, device=device)
            course = int8_matmul_config(batch, n, k, 128, interpreter=dry_run)
            configs = [course] + [MatmulConfig(course.block_m, bn, bk, w, st) for bn in SWEEP_BLOCK_N
                                  for bk in SWEEP_BLOCK_K for w, st in SWEEP_WARPS_STAGES]
            base = None
            for cfg in (configs[:2] if dry_run else configs):
                grid = (triton.cdiv(batch, cfg.block_m), triton.cdiv(n, cfg.block_n))

                def launch(w, x=x, cfg=cfg, grid=grid, rest=(scales, out, batch, n, k, scales.shape[1], 128)):
                    int8_matmul_kernel[grid](x, w, *rest,
                                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                             IEEE=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                try:
                    t = H.time_calls([functools.partial(launch, w) for w in ws], dry_run=dry_run).seconds
                except Exception as exc:  # a configuration the device cannot run (shared memory): say so
                    lines.append(f"| {name} | {batch} | {cfg.block_n} | {cfg.block_k} | {cfg.num_warps} | "
                                 f"{cfg.num_stages} | failed: {type(exc).__name__} | | |")
                    continue
                base = base or t
                tbps = int8_matmul_bytes(batch, n, k, k // 128, dtype.itemsize, 4) / t / 1e12
                rows.append(dict(shape=name, batch=batch, block_n=cfg.block_n, block_k=cfg.block_k,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, seconds=t, TBps=tbps))
                label = " (course)" if cfg is course else ""
                lines.append(f"| {name} | {batch} | {cfg.block_n}{label} | {cfg.block_k} | {cfg.num_warps} | "
                             f"{cfg.num_stages} | {t * 1e6:.1f} us | {tbps:.2f} | {base / t:.2f}x |")
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
            Path(out_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
            best = min((r for r in rows if r["shape"] == name and r["batch"] == batch), key=lambda r: r["seconds"])
            print(f"{name} batch {batch}: course {base * 1e6:.1f} us, best {best['seconds'] * 1e6:.1f} us "
                  f"(BLOCK_N {best['block_n']}, BLOCK_K {best['block_k']}, {best['num_warps']} warps, "
                  f"{best['num_stages']} stages, {best['TBps']:.2f} TB/s)", flush=True)
    return rows


# --- results on disk, and in the book ------------------------------------------------------------


def load_results(path=None) -> dict | None:
    """The results :func:`measure` wrote, or None when there are none (or only a dry run)."""
    return H.load_results("precision", path)


def tuned(results: dict | None) -> bool:
    """Whether a run has the tuned path's rows (timed with the clean harness), not only the
    earlier run's reference kernel under ``do_bench``."""
    return bool(results) and "tuned_seconds" in results["rows"][0]


def results_markdown(results: dict | None) -> str:
    """Chapter 09's measured table with device and date, or a plain "not yet measured" (never an estimate)."""
    if results is None:
        return ("**Not yet measured.** No GPU has run `python -m labsupport.bench_precision` for this build of "
                "the book, so this page shows no GPU timings of the int8 kernel.")
    new = tuned(results)
    how = ("timed with the clean harness (CUDA-graph replays over weight copies larger than twice the L2 cache)"
           if new else "timed with the earlier harness (`do_bench`, whose L2 flush writes a buffer)")
    lines = [f"Measured on {results['device']}, {H.date_of(results)} (torch {results['torch']}, triton "
             f"{results['triton']}), activations in {results['dtype']}, {how}; the graded check on the course's "
             f"kernel: {results.get('checks', 'not run')[:80]}.", "",
             "| shape | scales | batch | int8 kernel | dense | int8 TB/s | dense TB/s | speedup | "
             + ("tuned int8 | tuned speedup | " if new else "") + "bytes ratio |",
             "| --- " * (11 if new else 9) + "|"]
    for r in results["rows"]:
        extra = f"{r['tuned_seconds'] * 1e6:.1f} us | {r['tuned_speedup']:.2f}x | " if new else ""
        lines.append(f"| {r['shape']} ({r['N']} x {r['K']}) | {'per channel' if r['group_size'] is None else 'groups of ' + str(r['group_size'])} "
                     f"| {r['batch']} | {r['int8_seconds'] * 1e6:.1f} us | {r['dense_seconds'] * 1e6:.1f} us "
                     f"| {r['int8_Bps'] / 1e12:.2f} | {r['dense_Bps'] / 1e12:.2f} | {r['speedup']:.2f}x | {extra}"
                     f"{r['bytes_ratio']:.2f}x |")
    return "\n".join(lines)


# --- what the chapter says about a run (every figure read from the files, or "not yet measured") ---

CONFIG_SWEEP = "results/gpu_logs/precision_configs.md"  # bench_precision --configs on the GPU
BEFORE_TUNING = "results/gpu_logs/precision_bench_before_tuning.log"  # the first run, earlier tiles
_LOG_LINE = re.compile(r"^(?P<shape>.+?) N=(?P<N>\d+) K=(?P<K>\d+) group=(?P<group>\w+) batch (?P<batch>\d+): "
                       r"int8 (?P<int8_us>[\d.]+) us \((?P<int8_TBps>[\d.]+) TB/s\), dense (?P<dense_us>[\d.]+) us "
                       r"\((?P<dense_TBps>[\d.]+) TB/s\), speedup (?P<speedup>[\d.]+)x of (?P<bytes_ratio>[\d.]+)x")


def _repo_path(path, default: str) -> Path:
    return Path(path) if path is not None else Path(__file__).resolve().parent.parent / default


def load_bench_log(path=None) -> list[dict] | None:
    """The rows a run printed (``BEFORE_TUNING`` by default: the run with the tiles chosen before
    the sweep), or None when the log is not there. Times in seconds, bandwidths in TB/s."""
    path = _repo_path(path, BEFORE_TUNING)
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _LOG_LINE.match(line.strip())
        if m:
            g = m.groupdict()
            rows.append(dict(shape=g["shape"], N=int(g["N"]), K=int(g["K"]),
                             group_size=None if g["group"] == "channel" else int(g["group"]), batch=int(g["batch"]),
                             int8_seconds=float(g["int8_us"]) * 1e-6, dense_seconds=float(g["dense_us"]) * 1e-6,
                             int8_TBps=float(g["int8_TBps"]), dense_TBps=float(g["dense_TBps"]),
                             speedup=float(g["speedup"]), bytes_ratio=float(g["bytes_ratio"])))
    return rows or None


def load_config_sweep(path=None) -> list[dict] | None:
    """The rows of the table :func:`sweep_configs` wrote (``CONFIG_SWEEP`` by default), or None when
    it is not there. ``course`` marks the configuration the course used when the sweep ran; rows
    of configurations that failed to run are left out."""
    path = _repo_path(path, CONFIG_SWEEP)
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not cells[6].endswith(" us"):
            continue
        shape, batch, block_n, block_k, warps, stages, t, tbps, vs = cells
        rows.append(dict(shape=shape, batch=int(batch), block_n=int(block_n.split()[0]), course="(course)" in block_n,
                         block_k=int(block_k), num_warps=int(warps), num_stages=int(stages),
                         seconds=float(t.split()[0]) * 1e-6, TBps=float(tbps), vs_course=float(vs.rstrip("x"))))
    return rows or None


def find_row(rows: list[dict] | None, shape: str, batch: int, group_size: int | None = BOOK_GROUP) -> dict | None:
    """The row of ``rows`` (a results file's or a log's) for the shape whose name starts with
    ``shape`` ("8B up", "8B down"), ``batch`` and ``group_size``, or None."""
    for r in rows or ():
        if r["shape"].startswith(shape) and r["batch"] == batch and r["group_size"] == group_size:
            return r
    return None


def _tbps(r: dict, key: str) -> float:
    """TB/s of a results row (bytes per second) or a log row (already TB/s)."""
    return r[f"{key}_Bps"] / 1e12 if f"{key}_Bps" in r else r[f"{key}_TBps"]


def gpu_figures(results: dict | None, before: list[dict] | None = None, sweep: list[dict] | None = None,
                earlier: dict | None = None) -> dict:
    """The figures chapter 09 quotes from a run, as text: each "not yet measured" without one.

    ``results``: :func:`load_results`; ``before``: :func:`load_bench_log` (the first run, tiles
    chosen before the sweep); ``sweep``: :func:`load_config_sweep`. Groups of 128 throughout;
    "up" is Llama 3.1 8B's up projection (N = 14,336, K = 4,096), "down" its down projection."""
    keys = ("status", "when", "device", "date", "copy_tbps", "up_b1", "up_b1_ratio", "up_b1_int8_tbps", "up_b1_dense_tbps",
            "up_small", "up_b32", "up_b64", "down_b1", "down_small", "down_b1_int8_tbps", "down_b32", "down_b64",
            "dense_tbps_range", "before_up_b1", "before_down_b1", "sweep_up_old", "sweep_up_best", "sweep_up_best_cfg",
            "sweep_down_old", "sweep_down_best", "sweep_down_gain", "sweep_down_best_cfg", "sweep_up_gain",
            "sweep_down64_old", "sweep_down64_best", "sweep_down64_gain", "sweep_down64_best_cfg",
            "sweep_up_old_cfg", "sweep_down_old_cfg", "sweep_down64_old_cfg", "sweep_batches",
            "sweep_up_spread", "sweep_down_spread", "sweep_down64_spread", "harness_note", "harness",
            "tuned_up_b1", "tuned_down_b1", "tuned_up_b64", "tuned_down_b64", "tuned_up_b1_tbps",
            "dense_b1_earlier_tbps", "dense_b1_clean_tbps", "int8_b1_earlier_tbps", "int8_b1_clean_tbps")
    out = dict.fromkeys(keys, NOT_MEASURED)
    out["status"] = ("No GPU has run it for this build of the book, so every "
                     "GPU figure below reads \"not yet measured\"")
    if results is not None:
        rows = results["rows"]
        out["status"] = (f"It ran on an {results['device']} on "
                         f"{H.date_of(results)} (torch {results['torch']}, triton {results['triton']})")
        out["when"] = (f"{results['device']}, {H.date_of(results)} (torch {results['torch']}, "
                       f"triton {results['triton']})")
        out["device"], out["date"] = results["device"], H.date_of(results)
        if results.get("copy_bandwidth_Bps"):
            out["copy_tbps"] = f"{results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s"

        def speedups(shape, batches):
            found = [r["speedup"] for b in batches if (r := find_row(rows, shape, b))]
            if not found:
                return NOT_MEASURED
            lo, hi = min(found), max(found)
            return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x to {hi:.2f}x"

        small = [b for b in BATCHES[0] if b <= 16]
        out["up_small"], out["down_small"] = speedups("8B up", small), speedups("8B down", small)
        for shape, key in (("8B up", "up"), ("8B down", "down")):
            for b in (1, 32, 64):
                out[f"{key}_b{b}"] = speedups(shape, [b])
        if up1 := find_row(rows, "8B up", 1):
            out["up_b1_ratio"] = f"{up1['bytes_ratio']:.2f}x"
            out["up_b1_int8_tbps"] = f"{_tbps(up1, 'int8'):.2f} TB/s"
            out["up_b1_dense_tbps"] = f"{_tbps(up1, 'dense'):.2f} TB/s"
        if down1 := find_row(rows, "8B down", 1):
            out["down_b1_int8_tbps"] = f"{_tbps(down1, 'int8'):.2f} TB/s"
        dense = [_tbps(r, "dense") for r in rows]
        if dense:
            out["dense_tbps_range"] = f"{min(dense):.2f} to {max(dense):.2f} TB/s"
        _tuned_figures(out, results, earlier)
    for shape, key in (("8B up", "up"), ("8B down", "down")):
        if r := find_row(before, shape, 1):
            out[f"before_{key}_b1"] = f"{r['speedup']:.2f}x"
    for shape, key, batch in (("8B up", "up", 1), ("8B down", "down", 1), ("8B down", "down64", 64)):
        picked = [r for r in sweep or () if r["shape"].startswith(shape) and r["batch"] == batch]
        if picked:
            old = next((r for r in picked if r["course"]), picked[0])
            best = min(picked, key=lambda r: r["seconds"])
            out[f"sweep_{key}_old"] = f"{old['seconds'] * 1e6:.1f} us"
            out[f"sweep_{key}_best"] = f"{best['seconds'] * 1e6:.1f} us"
            out[f"sweep_{key}_gain"] = f"{old['seconds'] / best['seconds']:.2f}x"
            out[f"sweep_{key}_spread"] = f"{max(r['seconds'] for r in picked) / best['seconds']:.1f}x"
            for name, r in (("best", best), ("old", old)):
                out[f"sweep_{key}_{name}_cfg"] = (f"{r['block_n']} columns, K tiles of {r['block_k']}, "
                                                  f"{r['num_warps']} warps, {r['num_stages']} stages")
    if sweep:
        out["sweep_batches"] = ", ".join(str(b) for b in sorted({r["batch"] for r in sweep}))
    return out


def _tuned_figures(out: dict, results: dict, earlier: dict | None) -> None:
    """The clean-harness run's figures: the tuned path's speedups, the harness's copy check, and
    the earlier run's figures beside the clean ones (what the harness moved)."""
    if earlier and (old := find_row(earlier["rows"], "8B up", 1)):  # the same shape under the earlier harness
        out["dense_b1_earlier_tbps"] = f"{_tbps(old, 'dense'):.2f} TB/s"
        out["int8_b1_earlier_tbps"] = f"{_tbps(old, 'int8'):.2f} TB/s"
    if not tuned(results):
        out["harness_note"] = ("measured with the earlier harness (`do_bench`, whose L2 flush writes a buffer that "
                               "can be written back while the timed kernel runs)")
        return
    out["harness_note"] = "timed with the clean harness (CUDA-graph replays, weight copies larger than the L2 cache)"
    rows = results["rows"]
    for shape, key in (("8B up", "up"), ("8B down", "down")):
        for b in (1, 64):
            if r := find_row(rows, shape, b):
                out[f"tuned_{key}_b{b}"] = f"{r['tuned_speedup']:.2f}x"
    if up1 := find_row(rows, "8B up", 1):
        out["tuned_up_b1_tbps"] = f"{up1['tuned_Bps'] / 1e12:.2f} TB/s"
        out["dense_b1_clean_tbps"] = f"{_tbps(up1, 'dense'):.2f} TB/s"
        out["int8_b1_clean_tbps"] = f"{_tbps(up1, 'int8'):.2f} TB/s"
    if check := results.get("harness_check"):
        out["harness"] = (f"a 100 MB copy ran at {check['clean_Bps'] / 1e12:.2f} TB/s, {check['fraction_of_big']:.0%} "
                          f"of a large copy's {check['big_copy_Bps'] / 1e12:.2f} TB/s "
                          f"({'passed' if check['passed'] else 'FAILED'}: the harness asks for 90%)")


EARLIER = "results/gpu_logs/precision_before_issue21.json"  # the run before the clean harness and tuned path


def load_earlier(path=None) -> dict | None:
    """The run this module's results replaced (kept under ``results/gpu_logs/``), or None."""
    return H.load_results("precision", _repo_path(path, EARLIER))


def sweep_markdown(sweep: list[dict] | None, shape: str = "8B up", batch: int = 1, best: int = 4) -> str:
    """A few rows of the launch-configuration sweep for one shape and batch: the configuration
    used before the sweep, the ``best`` fastest and the slowest, or "not yet measured"."""
    picked = [r for r in sweep or () if r["shape"].startswith(shape) and r["batch"] == batch]
    if not picked:
        return f"**Not yet measured.** No launch-configuration sweep (`{CONFIG_SWEEP}`) is in this build."
    by_time = sorted(picked, key=lambda r: r["seconds"])
    old = next((r for r in picked if r["course"]), None)
    chosen = ([old] if old else []) + [r for r in by_time[:best] if r is not old]
    chosen += [r for r in by_time[-1:] if r not in chosen]
    lines = ["| | BLOCK_N | BLOCK_K | warps | stages | time | TB/s | against the tiles before |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in chosen:
        label = ("before the sweep" if r is old else "fastest" if r is by_time[0]
                 else "slowest" if r is by_time[-1] else "")
        lines.append(f"| {label} | {r['block_n']} | {r['block_k']} | {r['num_warps']} | {r['num_stages']} "
                     f"| {r['seconds'] * 1e6:.1f} us | {r['TBps']:.2f} | {r['vs_course']:.2f}x |")
    return "\n".join(lines)


def _arguments(parser) -> None:
    parser.add_argument("--configs", action="store_true",
                        help="time the kernel under other launch configurations instead; --out gets a markdown table")


BENCH = H.Bench("precision", "09", measure, interpreter=True, add_arguments=_arguments,
                description=__doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
