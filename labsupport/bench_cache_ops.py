"""Chapter 10's GPU measurement: paged decode attention against contiguous attention.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_cache_ops --out results/gpu_cache_ops.json
    python -m labsupport.bench_cache_ops --dry-run --out /tmp/cache_ops.json   # on a CPU, tiny
                                                                             # shapes: checks the
                                                                             # code, measures nothing

At one layer of the Llama 3.1 8B attention shape (32 query heads, 8 KV heads, head dim 128,
16-bit cache, blocks of 16 tokens) and a few batches, it times three ways of running the same
decode attention:

* ``paged``: the course's Triton kernel
  (:func:`labsupport.paged_attention.paged_decode_attention_triton`) on block tables whose
  physical blocks are shuffled, as they are after a server has run for a while;
* ``paged_in_order``: the same kernel with every sequence's blocks consecutive in memory (the
  layout a contiguous cache has), so the difference is the cost of scattered blocks;
* ``sdpa``: PyTorch's ``scaled_dot_product_attention`` on a contiguous, padded ``(B, Hkv, S, D)``
  cache with a length mask, the contiguous baseline.

Each is checked against the torch spec first, then timed with :func:`labsupport.timing.benchmark`.
Bytes are the formula's (:func:`labsupport.paged_attention.paged_decode_bytes`, and
``contiguous_decode_bytes`` for the padded SDPA cache it reads in full), over the measured time.
Chapter 10 reads ``results/gpu_cache_ops.json`` (:func:`load_results`); a dry run's file is never
shown. Without a GPU (and without ``--dry-run``) the command exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from ._answers import unguarded
from .device import configure_triton, interpreter_mode
from .paged_attention import (
    contiguous_decode_bytes,
    gather_contiguous,
    paged_decode_attention,
    paged_decode_attention_triton,
    paged_decode_bytes,
    random_paged_cache,
)
from .timing import benchmark

GPU_RESULTS = "results/gpu_cache_ops.json"
# (name, sequence lengths): GPU shapes, then the dry run's.
SHAPES = (
    [("32 x 1,024", [1024] * 32), ("16 x 4,096", [4096] * 16), ("64 mixed, 128-8,192", None)],
    [("2 x 33", [33, 33]), ("3 mixed", [5, 40, 17])],
)
HEADS = ((32, 8, 128, 16), (4, 2, 32, 8))  # H, Hkv, D, block size: GPU, dry run


def mixed_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` lengths spread log-uniformly between ``low`` and ``high`` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.exp(torch.empty(n).uniform_(float(torch.log(torch.tensor(low))), float(torch.log(torch.tensor(high))),
                                             generator=gen)).long().tolist()


def in_order_tables(lens: list[int], block_size: int, device) -> torch.Tensor:
    """Block tables where sequence b's blocks are consecutive: the contiguous layout."""
    used = [-(-n // block_size) for n in lens]
    tables = torch.full((len(lens), max(used)), -1, dtype=torch.int32)
    start = 0
    for row, count in enumerate(used):
        tables[row, :count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    return tables.to(device)


def measure_shape(name: str, lens: list[int], heads, dtype, device, dry_run: bool) -> dict:
    h, h_kv, d, bs = heads
    kernel = unguarded(paged_decode_attention_triton)
    spec = unguarded(paged_decode_attention)
    k_cache, v_cache, tables, seq_lens = random_paged_cache(lens, h_kv, d, bs, spare_blocks=0, dtype=dtype,
                                                            device=device, seed=0)
    q = torch.randn(len(lens), h, d, device=device, dtype=dtype)
    # The same tokens with each sequence's blocks laid out in order.
    ordered = in_order_tables(lens, bs, device)
    k_ord, v_ord = torch.empty_like(k_cache), torch.empty_like(v_cache)
    s_max = max(lens)
    k_pad = torch.zeros(len(lens), h_kv, s_max, d, device=device, dtype=dtype)  # (B, Hkv, S, D)
    v_pad = torch.zeros_like(k_pad)
    for row, n in enumerate(lens):
        used = -(-n // bs)
        k_ord[ordered[row, :used].long()] = k_cache[tables[row, :used].long()]
        v_ord[ordered[row, :used].long()] = v_cache[tables[row, :used].long()]
        k_pad[row, :, :n] = gather_contiguous(k_cache, tables, n, row).transpose(0, 1)
        v_pad[row, :, :n] = gather_contiguous(v_cache, tables, n, row).transpose(0, 1)
    mask = (torch.arange(s_max, device=device)[None, :] < seq_lens[:, None].long())[:, None, None, :]  # (B,1,1,S)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], k_pad, v_pad, attn_mask=mask,
                                              enable_gqa=True)[:, :, 0]

    want = spec(q, k_cache, v_cache, tables, seq_lens).float()
    runs = {
        "paged": (lambda: kernel(q, k_cache, v_cache, tables, seq_lens), True,
                  paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=q.element_size())),
        "paged_in_order": (lambda: kernel(q, k_ord, v_ord, ordered, seq_lens), True,
                           paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=q.element_size())),
        "sdpa": (sdpa, False, contiguous_decode_bytes([s_max] * len(lens), h, h_kv, d, dtype_bytes=q.element_size())),
    }
    row = {"name": name, "batch": len(lens), "tokens": sum(lens), "max_len": s_max, "heads": h, "kv_heads": h_kv,
           "head_dim": d, "block_size": bs, "dtype": str(dtype).replace("torch.", "")}
    for key, (fn, uses_triton, nbytes) in runs.items():
        err = (fn().float() - want).abs().max().item()
        t = benchmark(fn, uses_triton=uses_triton, max_time_s=0.5 if dry_run else 2.0)
        row[key] = {"max_abs_error": err, "median_s": t.median_s, "p20_s": t.p20_s, "p80_s": t.p80_s,
                    "bytes_formula": nbytes, "achieved_Bps": nbytes / t.median_s}
        print(f"{name:>22} {key:>15}: {t.median_ms:8.3f} ms{t.label()}  {nbytes / t.median_s / 1e9:8.1f} GB/s "
              f"(formula bytes / time)  max error {err:.1e}", flush=True)
    row["paged_over_in_order"] = row["paged"]["median_s"] / row["paged_in_order"]["median_s"]
    row["paged_over_sdpa"] = row["paged"]["median_s"] / row["sdpa"]["median_s"]
    return row


def run(out: str, dry_run: bool) -> dict:
    device = "cpu" if dry_run else "cuda"
    pick = 1 if dry_run else 0
    dtype = torch.float32 if dry_run else torch.bfloat16
    name = "CPU (dry run, Triton interpreter)" if dry_run else torch.cuda.get_device_name(0)
    results = {
        "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "dry_run": dry_run,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timing": "labsupport.timing.benchmark (do_bench on a GPU); bytes from the formula over the median time",
        "rows": [],
    }
    for label, lens in SHAPES[pick]:
        lens = lens if lens is not None else mixed_lengths(64, 128, 8192)
        results["rows"].append(measure_shape(label, lens, HEADS[pick], dtype, device, dry_run))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"saved to {out}")
    return results


def load_results(path=None) -> dict | None:
    """The results a GPU run of this module wrote, or None when there are none (or a dry run)."""
    path = Path(path) if path is not None else Path(__file__).resolve().parent.parent / GPU_RESULTS
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a results file from python -m labsupport.bench_cache_ops: {exc}") from exc
    if not isinstance(data, dict) or data.get("dry_run", True) or not data.get("rows"):
        return None
    return data


def results_markdown(results: dict | None) -> str:
    """Chapter 10's measured table, with device and date, or "not yet measured"."""
    if not results:
        return ("GPU results: not yet measured. `python -m labsupport.bench_cache_ops` (or "
                "`scripts/gpu_all.sh`) on a GPU writes `results/gpu_cache_ops.json`, and this page shows it.")
    lines = [f"Measured on {results['device']}, {results['date']} (torch {results['torch']}, triton "
             f"{results['triton']}); bytes are the formula's over the median time.", "",
             "| batch | tokens | paged (shuffled) | paged (in order) | SDPA, contiguous | paged / in order | "
             "paged / SDPA |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["rows"]:
        cells = [f"{r[k]['median_s'] * 1e6:,.0f} us, {r[k]['achieved_Bps'] / 1e9:,.0f} GB/s"
                 for k in ("paged", "paged_in_order", "sdpa")]
        lines.append(f"| {r['name']} | {r['tokens']:,} | " + " | ".join(cells)
                     + f" | {r['paged_over_in_order']:.2f} | {r['paged_over_sdpa']:.2f} |")
    return "\n".join(lines)


NOT_MEASURED = "not yet measured"
LAB_LOG = "results/gpu_logs/lab10.txt"  # lab 10's solution run as a script on the GPU
_PREFIX = (re.compile(r"^(?P<model>\S+), (?P<n>\d+) requests of (?P<shared>\d+) shared \+ (?P<own>\d+) own tokens, "
                      r"(?P<block>\d+)-token blocks"),
           re.compile(r"^prefix-cache hit rate: (?P<hit_rate>[\d.]+)% of prompt tokens"),
           re.compile(r"^prefill of one (?P<tokens>\d+)-token request on the (?P<where>\w+)"),
           re.compile(r"^miss \(no prefix caching\):\s+(?P<miss_ms>[\d.]+) ms"),
           re.compile(r"^hit\s+\(prefix cached\):\s+(?P<hit_ms>[\d.]+) ms"))


def _span(values: list[float], fmt: str, unit: str = "") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}{unit} to {hi}{unit}"


def gpu_figures(results: dict | None) -> dict:
    """The figures chapter 10 quotes from a run, as text (each "not yet measured" without one):
    paged (shuffled tables) over SDPA and over in-order tables, as time ratios, and the bytes per
    second of the formula over the median time, across the run's shapes."""
    keys = ("status", "when", "paged_over_sdpa", "paged_over_in_order", "paged_gbps", "sdpa_tbps", "programs",
            "worst_name", "worst_ratio", "worst_programs", "worst_blocks", "pad_name", "pad_ratio", "pad_speed")
    out = dict.fromkeys(keys, NOT_MEASURED)
    out["status"] = ("No GPU has run it for this build of the book, so every "
                     "GPU figure below reads \"not yet measured\"")
    if not results:
        return out
    rows = results["rows"]
    out["status"] = (f"It ran on an {results['device']} on {results['date']} "
                     f"(torch {results['torch']}, triton {results['triton']})")
    out["when"] = f"{results['device']}, {results['date']} (torch {results['torch']}, triton {results['triton']})"
    out["paged_over_sdpa"] = _span([r["paged_over_sdpa"] for r in rows], "{:.1f}", "x")
    out["paged_over_in_order"] = _span([r["paged_over_in_order"] for r in rows], "{:.2f}")
    out["paged_gbps"] = _span([r["paged"]["achieved_Bps"] / 1e9 for r in rows], "{:,.0f}", " GB/s")
    out["sdpa_tbps"] = _span([r["sdpa"]["achieved_Bps"] / 1e12 for r in rows], "{:.2f}", " TB/s")
    # the course's kernel runs one program per (sequence, KV head)
    out["programs"] = _span([r["batch"] * r["kv_heads"] for r in rows], "{:,}")
    worst = max(rows, key=lambda r: r["paged_over_sdpa"])
    out["worst_name"], out["worst_ratio"] = worst["name"], f"{worst['paged_over_sdpa']:.1f}x"
    out["worst_programs"] = f"{worst['batch'] * worst['kv_heads']:,}"
    out["worst_blocks"] = f"{-(-worst['max_len'] // worst['block_size']):,}"  # the longest walk, one program
    # SDPA reads a padded cache: where the padding is largest, how many more bytes it moved
    pad = max(rows, key=lambda r: r["sdpa"]["bytes_formula"] / r["paged"]["bytes_formula"])
    out["pad_name"] = pad["name"]
    out["pad_ratio"] = f"{pad['sdpa']['bytes_formula'] / pad['paged']['bytes_formula']:.1f}x"
    out["pad_speed"] = f"{pad['paged_over_sdpa']:.1f}x"
    return out


def load_prefix_cache_log(path=None) -> dict | None:
    """Lab 10's prefix-cache figures from its run on a GPU (``LAB_LOG``: the solution run as a
    script), or None when the log is not there or holds no such run."""
    path = Path(path) if path is not None else Path(__file__).resolve().parent.parent / LAB_LOG
    if not path.is_file():
        return None
    found = {}
    text = path.read_text(encoding="utf-8")
    device = re.search(r"^device\s*:\s*cuda - (?P<device>[^(\n]+?)\s*(\(|$)", text, re.M)
    for line in path.read_text(encoding="utf-8").splitlines():
        for pattern in _PREFIX:
            if m := pattern.match(line.strip()):
                found.update(m.groupdict())
    if not {"miss_ms", "hit_ms", "hit_rate", "model"} <= found.keys() or found.get("where") != "GPU":
        return None
    return dict(device=device["device"] if device else "a GPU", model=found["model"], requests=int(found["n"]), shared=int(found["shared"]), own=int(found["own"]),
                block=int(found["block"]), hit_rate=float(found["hit_rate"]) / 100, tokens=int(found["tokens"]),
                miss_s=float(found["miss_ms"]) * 1e-3, hit_s=float(found["hit_ms"]) * 1e-3)


def prefix_cache_figures(log: dict | None, results: dict | None = None) -> dict:
    """Lab 10's prefix-cache run on a GPU as text for the chapter, each "not yet measured" without
    one; ``results`` (:func:`load_results`, the same session's benchmark) gives the date."""
    keys = ("when", "model", "requests", "shared", "own", "hit_rate", "miss", "hit", "hit_share", "skipped")
    if log is None:
        return dict.fromkeys(keys, NOT_MEASURED)
    when = log["device"] + (f", {results['date']}" if results else "")
    return dict(when=when, model=log["model"], requests=f"{log['requests']:,}", shared=f"{log['shared']:,}", own=f"{log['own']:,}",
                hit_rate=f"{log['hit_rate']:.1%}", miss=f"{log['miss_s'] * 1e3:.2f} ms",
                hit=f"{log['hit_s'] * 1e3:.2f} ms", hit_share=f"{log['hit_s'] / log['miss_s']:.0%}",
                skipped=f"{(log['shared'] // log['block'] * log['block']) / (log['shared'] + log['own']):.0%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench_cache_ops", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=GPU_RESULTS, help=f"results file (default {GPU_RESULTS}, which chapter 10 reads)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same code on the CPU at tiny shapes: checks this command, measures nothing")
    args = parser.parse_args(argv)
    configure_triton()
    if not args.dry_run and (not torch.cuda.is_available() or interpreter_mode()):
        reason = "no CUDA GPU is visible" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
        print(f"bench_cache_ops measures a GPU ({reason}); --dry-run checks the command on a CPU.", file=sys.stderr)
        return 2
    if args.dry_run and not interpreter_mode():
        print("bench_cache_ops --dry-run runs the kernel in the Triton interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    run(args.out, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
