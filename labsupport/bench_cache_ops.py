"""Chapter 10's GPU measurement: paged decode attention against contiguous attention.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_cache_ops --out results/gpu_cache_ops.json
    python -m labsupport.bench_cache_ops --dry-run --out /tmp/cache_ops.json   # on a CPU, tiny
                                                                             # shapes: checks the
                                                                             # code, measures nothing

At one layer of the Llama 3.1 8B attention shape (32 query heads, 8 KV heads, head dim 128,
16-bit cache, blocks of 16 tokens) and a few batches (equal lengths, and 64 sequences of mixed
lengths, for which a contiguous cache must be padded), it times the same decode attention five ways:

* ``split_kv``: the course's reference kernel, split-KV paged decode
  (:func:`labsupport.flash_decoding.split_kv_decode_attention`: Flash-Decoding), on block tables
  whose physical blocks are shuffled, as they are after a server has run for a while;
* ``split_kv_in_order``: the same with every sequence's blocks consecutive in memory;
* ``paged`` and ``paged_in_order``: lab 10's kernel
  (:func:`labsupport.paged_attention.paged_decode_attention_triton`, one program per sequence and
  KV head, one 16-token block per step, each table entry loaded just before its block) on the
  same two layouts;
* ``sdpa``: PyTorch's ``scaled_dot_product_attention`` on a contiguous, padded ``(B, Hkv, S, D)``
  cache with a length mask, the contiguous baseline.

Each is checked against the torch spec once, then timed with
:func:`labsupport.bench_harness.clean_time` (CUDA-graph replays over copies of the inputs larger
than twice the L2 cache; no argument checks inside the timed call). A second section times the
split-KV kernel at each split count on the batch of 16 sequences of 4,096 tokens. Bytes are the
formula's (:func:`labsupport.paged_attention.paged_decode_bytes`, and ``contiguous_decode_bytes``
for the padded SDPA cache, which it reads in full), over the median time. Chapter 10 reads
``results/gpu_cache_ops.json`` (:func:`load_results`); a dry run's file is never shown. Without a
GPU (and without ``--dry-run``) the command exits with status 2 and says why.

The results committed before this version (``timing`` says ``do_bench``) timed lab 10's kernel
with its argument checks (a device-to-host copy of the lengths) inside the timed call, under
``do_bench``'s writing L2 flush; they have no split-KV rows. The chapter says which it shows.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from . import bench_harness as H
from ._answers import unguarded
from .flash_decoding import split_kv_decode_attention
from .paged_attention import (
    contiguous_decode_bytes,
    gather_contiguous,
    paged_decode_attention,
    paged_decode_attention_triton,
    paged_decode_bytes,
    random_paged_cache,
)

GPU_RESULTS = "results/gpu_cache_ops.json"
# (name, sequence lengths): GPU shapes, then the dry run's.
SHAPES = (
    [("32 x 1,024", [1024] * 32), ("16 x 4,096", [4096] * 16), ("64 mixed, 128-8,192", None)],
    [("2 x 33", [33, 33]), ("3 mixed", [5, 40, 17])],
)
HEADS = ((32, 8, 128, 16), (4, 2, 32, 8))  # H, Hkv, D, block size: GPU, dry run
SPLIT_SWEEP = ((1, 2, 4, 8, 16, 32), (1, 2))  # split counts timed on the batch of 16 x 4,096 (dry run: 2 x 33)
KERNELS = ("split_kv", "split_kv_in_order", "paged", "paged_in_order", "sdpa")


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


def _layouts(lens: list[int], heads, dtype, device):
    """The same keys and values three ways: paged with shuffled tables, paged in order, and a padded
    contiguous cache (with its length mask)."""
    h, h_kv, d, bs = heads
    k_cache, v_cache, tables, seq_lens = random_paged_cache(lens, h_kv, d, bs, spare_blocks=0, dtype=dtype,
                                                            device=device, seed=0)
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
    return dict(shuffled=(k_cache, v_cache, tables), in_order=(k_ord, v_ord, ordered), padded=(k_pad, v_pad, mask),
                seq_lens=seq_lens)


def _calls(name: str, layouts: dict, q: torch.Tensor, copies: int, num_splits=None):
    """``copies`` zero-argument calls of kernel ``name``, each on its own copy of the inputs (the
    timed calls: no argument checks), and one checked call for the result."""
    lab = unguarded(paged_decode_attention_triton)
    lens = layouts["seq_lens"]
    layout = "in_order" if name.endswith("in_order") else "padded" if name == "sdpa" else "shuffled"
    sets = [tuple(t.clone() if t.is_floating_point() else t for t in (q, *layouts[layout])) for _ in range(copies)]

    def one(qq, k, v, extra, checked=False):
        if name == "sdpa":
            return F.scaled_dot_product_attention(qq[:, :, None], k, v, attn_mask=extra, enable_gqa=True)[:, :, 0]
        if name.startswith("split_kv"):
            return split_kv_decode_attention(qq, k, v, extra, lens, num_splits=num_splits, validate=checked)
        return lab(qq, k, v, extra, lens, validate=checked)

    return [lambda s=s: one(*s) for s in sets], lambda: one(q, *layouts[layout], checked=True)


def measure_shape(name: str, lens: list[int], heads, dtype, device, dry_run: bool) -> dict:
    h, h_kv, d, bs = heads
    layouts = _layouts(lens, heads, dtype, device)
    q = torch.randn(len(lens), h, d, device=device, dtype=dtype)
    k_cache, v_cache, tables = layouts["shuffled"]
    want = unguarded(paged_decode_attention)(q, k_cache, v_cache, tables, layouts["seq_lens"]).float()
    paged_bytes = paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=q.element_size())
    sdpa_bytes = contiguous_decode_bytes([max(lens)] * len(lens), h, h_kv, d, dtype_bytes=q.element_size())
    copies = 1 if dry_run else H.copies_for(paged_bytes, device)
    row = {"name": name, "batch": len(lens), "tokens": sum(lens), "max_len": max(lens), "heads": h, "kv_heads": h_kv,
           "head_dim": d, "block_size": bs, "dtype": str(dtype).replace("torch.", ""), "input_copies": copies}
    for key in KERNELS:
        calls, checked = _calls(key, layouts, q, copies)
        got, t = H.check_and_time(checked, calls, dry_run=dry_run)
        err = (got.float() - want).abs().max().item()
        nbytes = sdpa_bytes if key == "sdpa" else paged_bytes
        row[key] = {"max_abs_error": err, "median_s": t.seconds, "p20_s": t.p20_s, "p80_s": t.p80_s,
                    "bytes_formula": nbytes, "achieved_Bps": nbytes / t.seconds}
        print(f"{name:>22} {key:>18}: {t.seconds * 1e6:9.1f} us  {nbytes / t.seconds / 1e9:8.1f} GB/s "
              f"(formula bytes / time)  max error {err:.1e}", flush=True)
        del calls
    row["paged_over_in_order"] = row["paged"]["median_s"] / row["paged_in_order"]["median_s"]
    row["paged_over_sdpa"] = row["paged"]["median_s"] / row["sdpa"]["median_s"]
    row["split_kv_over_sdpa"] = row["split_kv"]["median_s"] / row["sdpa"]["median_s"]
    row["split_kv_over_in_order"] = row["split_kv"]["median_s"] / row["split_kv_in_order"]["median_s"]
    row["paged_over_split_kv"] = row["paged"]["median_s"] / row["split_kv"]["median_s"]
    return row


def split_sweep(lens: list[int], heads, dtype, device, dry_run: bool, rec: H.Recorder) -> None:
    """The split-KV kernel at each split count of :data:`SPLIT_SWEEP` (shuffled tables)."""
    h, h_kv, d, bs = heads
    layouts = _layouts(lens, heads, dtype, device)
    q = torch.randn(len(lens), h, d, device=device, dtype=dtype)
    nbytes = paged_decode_bytes(lens, h, h_kv, d, bs, dtype_bytes=q.element_size())
    copies = 1 if dry_run else H.copies_for(nbytes, device)

    def point(splits, line):
        calls, _ = _calls("split_kv", layouts, q, copies, num_splits=splits)
        t = H.time_calls(calls, dry_run=dry_run)
        return {"median_s": t.seconds, "achieved_Bps": nbytes / t.seconds, "batch": len(lens), "max_len": max(lens)}

    H.Sweep("split_sweep", "num_splits", SPLIT_SWEEP[1 if dry_run else 0], ["split_kv"],
            describe=lambda r: f"{r['median_s'] * 1e6:.1f} us, {r['achieved_Bps'] / 1e9:.0f} GB/s").run(point, rec)


def measure(args) -> None:
    dry_run = args.dry_run
    device = "cpu" if dry_run else "cuda"
    pick = 1 if dry_run else 0
    dtype = torch.float32 if dry_run else torch.bfloat16
    rec = H.Recorder(args.out, H.header(dry_run, "CPU (dry run, Triton interpreter)" if dry_run else None,
                                        timing=H.CLEAN_TIMING + "; bytes from the formula over the median time",
                                        rows=[]))
    if not dry_run:
        rec.data["harness_check"] = H.copy_check()
        rec.save("the harness's copy check")
    for label, lens in SHAPES[pick]:
        lens = lens if lens is not None else mixed_lengths(64, 128, 8192)
        rec.data["rows"].append(measure_shape(label, lens, HEADS[pick], dtype, device, dry_run))
        rec.save(label)
    split_sweep(SHAPES[pick][1 if not dry_run else 0][1], HEADS[pick], dtype, device, dry_run, rec)
    rec.save("all")


def load_results(path=None) -> dict | None:
    """The results a GPU run of this module wrote, or None when there are none (or a dry run)."""
    return H.load_results("cache_ops", path)


def clean_harness(results: dict | None) -> bool:
    """Whether a run was timed with :func:`labsupport.bench_harness.clean_time` (and so has the
    split-KV rows), rather than with the harness before it."""
    return bool(results) and "split_kv" in results["rows"][0]


def results_markdown(results: dict | None) -> str:
    """Chapter 10's measured table, with device, date and harness, or "not yet measured"."""
    if not results:
        return ("GPU results: not yet measured. `python -m labsupport.bench_cache_ops` (or "
                "`scripts/gpu_all.sh`) on a GPU writes `results/gpu_cache_ops.json`, and this page shows it.")
    clean = clean_harness(results)
    how = ("timed with the clean harness (CUDA-graph replays, cold caches, no argument checks in the timed call)"
           if clean else "timed with the earlier harness (`do_bench`, lab 10's kernel with its argument checks "
           "inside the timed call)")
    keys = KERNELS if clean else ("paged", "paged_in_order", "sdpa")
    names = {"split_kv": "split-KV (shuffled)", "split_kv_in_order": "split-KV (in order)",
             "paged": "lab 10's kernel (shuffled)", "paged_in_order": "lab 10's kernel (in order)",
             "sdpa": "SDPA, contiguous"}
    ratios = ("split_kv_over_sdpa", "paged_over_sdpa") if clean else ("paged_over_in_order", "paged_over_sdpa")
    ratio_names = {"split_kv_over_sdpa": "split-KV / SDPA", "paged_over_sdpa": "lab kernel / SDPA",
                   "paged_over_in_order": "paged / in order"}
    lines = [f"Measured on {results['device']}, {H.date_of(results)} (torch {results['torch']}, triton "
             f"{results['triton']}), {how}; bytes are the formula's over the median time.", "",
             "| batch | tokens | " + " | ".join(names[k] for k in keys) + " | "
             + " | ".join(ratio_names[k] for k in ratios) + " |",
             "| --- " * (2 + len(keys) + len(ratios)) + "|"]
    for r in results["rows"]:
        cells = [f"{r[k]['median_s'] * 1e6:,.0f} us, {r[k]['achieved_Bps'] / 1e9:,.0f} GB/s" for k in keys]
        lines.append(f"| {r['name']} | {r['tokens']:,} | " + " | ".join(cells) + " | "
                     + " | ".join(f"{r[k]:.2f}" for k in ratios) + " |")
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


EARLIER = "results/gpu_logs/cache_ops_before_issue21.json"  # the run before the clean harness and split-KV


def load_earlier(path=None) -> dict | None:
    """The run this module's results replaced (kept under ``results/gpu_logs/``), or None."""
    return H.load_results("cache_ops", Path(path) if path is not None else H.REPO / EARLIER)


def gpu_figures(results: dict | None, earlier: dict | None = None) -> dict:
    """The figures chapter 10 quotes from a run, as text (each "not yet measured" without one;
    ``earlier``: :func:`load_earlier`, for the same shape under both harnesses):
    lab 10's kernel (shuffled tables) over SDPA and over in-order tables, as time ratios, and the
    bytes per second of the formula over the median time, across the run's shapes; with the clean
    harness also the split-KV kernel's (``split_*``), the best split count at 16 x 4,096
    (``best_splits``) and the harness's own copy check (``harness``). ``harness_note`` says which
    harness timed the run."""
    keys = ("status", "when", "paged_over_sdpa", "paged_over_in_order", "paged_gbps", "sdpa_tbps", "programs",
            "worst_name", "worst_ratio", "worst_programs", "worst_blocks", "pad_name", "pad_ratio", "pad_speed",
            "split_over_sdpa", "split_over_sdpa_16x4096", "split_over_sdpa_mixed", "split_over_in_order",
            "split_tbps", "paged_over_split", "best_splits", "best_splits_speedup", "harness", "harness_note",
            "paged_clean_us", "paged_earlier_us", "sdpa_clean_us", "sdpa_earlier_us")
    out = dict.fromkeys(keys, NOT_MEASURED)
    out["status"] = ("No GPU has run it for this build of the book, so every "
                     "GPU figure below reads \"not yet measured\"")
    if not results:
        return out
    rows = results["rows"]
    date = H.date_of(results)
    out["status"] = (f"It ran on an {results['device']} on {date} "
                     f"(torch {results['torch']}, triton {results['triton']})")
    out["when"] = f"{results['device']}, {date} (torch {results['torch']}, triton {results['triton']})"
    out["paged_over_sdpa"] = _span([r["paged_over_sdpa"] for r in rows], "{:.1f}", "x")
    out["paged_over_in_order"] = _span([r["paged_over_in_order"] for r in rows], "{:.2f}")
    out["paged_gbps"] = _span([r["paged"]["achieved_Bps"] / 1e9 for r in rows], "{:,.0f}", " GB/s")
    out["sdpa_tbps"] = _span([r["sdpa"]["achieved_Bps"] / 1e12 for r in rows], "{:.2f}", " TB/s")
    # lab 10's kernel runs one program per (sequence, KV head)
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
    old = {r["name"]: r for r in (earlier or {}).get("rows", [])}
    if "16 x 4,096" in old:  # the same shape under the earlier harness
        for key in ("paged", "sdpa"):
            out[f"{key}_earlier_us"] = f"{old['16 x 4,096'][key]['median_s'] * 1e6:,.0f} us"
    if not clean_harness(results):
        out["harness_note"] = ("measured with the earlier harness (`do_bench`, whose L2 flush writes a buffer) and "
                               "with lab 10's kernel checking its arguments, a device-to-host copy, inside every "
                               "timed call")
        return out
    out["harness_note"] = "timed with the clean harness: CUDA-graph replays, cold caches, nothing but the kernel"
    out["split_over_sdpa"] = _span([r["split_kv_over_sdpa"] for r in rows], "{:.2f}", "x")
    by_name = {r["name"]: r for r in rows}
    if "16 x 4,096" in by_name:
        out["split_over_sdpa_16x4096"] = f"{by_name['16 x 4,096']['split_kv_over_sdpa']:.2f}x"
    out["split_over_sdpa_mixed"] = f"{pad['split_kv_over_sdpa']:.2f}x"
    out["split_over_in_order"] = _span([r["split_kv_over_in_order"] for r in rows], "{:.2f}")
    out["split_tbps"] = _span([r["split_kv"]["achieved_Bps"] / 1e12 for r in rows], "{:.2f}", " TB/s")
    out["paged_over_split"] = _span([r["paged_over_split_kv"] for r in rows], "{:.1f}", "x")
    sweep = [r for r in results.get("split_sweep", []) if "median_s" in r]
    if sweep:
        best, one = min(sweep, key=lambda r: r["median_s"]), next((r for r in sweep if r["num_splits"] == 1), None)
        out["best_splits"] = f"{best['num_splits']}"
        if one is not None:
            out["best_splits_speedup"] = f"{one['median_s'] / best['median_s']:.1f}x"
    if "16 x 4,096" in by_name:  # the same shape under both harnesses
        for key in ("paged", "sdpa"):
            out[f"{key}_clean_us"] = f"{by_name['16 x 4,096'][key]['median_s'] * 1e6:,.0f} us"
    check = results.get("harness_check")
    if check:
        out["harness"] = (f"a 100 MB copy ran at {check['clean_Bps'] / 1e12:.2f} TB/s, "
                          f"{check['fraction_of_big']:.0%} of a {check['big_bytes'] / 2**30:.0f} GiB copy's "
                          f"{check['big_copy_Bps'] / 1e12:.2f} TB/s ({'passed' if check['passed'] else 'FAILED'}: "
                          f"the harness asks for 90%); `do_bench` timed the same copy at "
                          f"{check['do_bench_Bps'] / 1e12:.2f} TB/s")
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


BENCH = H.Bench("cache_ops", "10", measure, interpreter=True, description=__doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
