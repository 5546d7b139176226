"""Benchmark the course's FlashAttention kernel against SDPA (flash backend) and naive attention.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_attention              # the table, with PASS/FAIL per target
    python -m labsupport.bench_attention --check      # the GPU-only correctness checks
    python -m labsupport.bench_attention --out results.md
    python -m labsupport.bench_attention --configs     # which launch configuration is fastest here
    TRITON_INTERPRET=1 python -m labsupport.bench_attention --dry-run [--configs]   # on a CPU:
                                                     # checks the command runs, measures nothing

Shapes follow the FlashAttention-2 paper's benchmark: bf16, head dim 128, 16 heads, and a batch
of ``16384 // S`` sequences, so every row processes the same number of tokens. FLOPs are
``4*B*H*S**2*D``, halved when causal (:func:`labsupport.costs.attention_flops`). Each kernel is
timed with :func:`labsupport.timing.benchmark` (``triton.testing.do_bench``: warm-up, L2 flush,
median). SDPA is pinned to its flash backend with ``torch.nn.attention.sdpa_kernel``. Naive
attention computes what :func:`labsupport.attention.naive_attention_reference` does (matmuls in
bf16, softmax in fp32) with its causal mask built once outside the timed call, as model code
caches it; if it runs out of memory the table says OOM.

The targets (``ANCHORS.md``): non-causal, S >= 2k, at least 0.9x SDPA; causal, S >= 4k, at least
0.8x SDPA; at S >= 4k at least 2.5x naive non-causal and 5x causal. Without a GPU the command
exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import attention, checks
from . import bench_harness as H
from ._answers import course_checks_its_answers, unguarded
from .attention import (
    GPU_CONFIGS,
    KernelConfig,
    attention_spec,
    config_name,
    flash_attention_reference,
    kernel_config,
    online_softmax_reference,
)
from .costs import attention_flops
from .device import configure_triton, interpreter_mode
from .hardware import match_device_name
from .timing import benchmark

SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HEADS = 16
HEAD_DIM = 128
# Agreement with SDPA, both in bf16: |kernel - SDPA| <= ATOL + RTOL * |SDPA| everywhere. RTOL is
# at least two bf16 steps relative to the value (a value's relative spacing is 2**-8 to 2**-7:
# both outputs are rounded to bf16 and their fp32 sums run in different orders); ATOL covers
# outputs near zero, and for this benchmark's outputs (|ref| below about 0.6) it is the larger
# part. An absolute bound alone would be one bf16 step for outputs between 4 and 8.
ATOL = 1e-2
RTOL = 2**-6
TOLERANCE = f"|err| <= {ATOL:g} + {RTOL:g} |ref|"


def error_ratio(out, ref) -> float:
    """``max |out - ref| / (ATOL + RTOL * |ref|)``: at most 1 when the outputs agree (NaN counts as not)."""

    out, ref = out.float(), ref.float()
    ratio = ((out - ref).abs() / (ATOL + RTOL * ref.abs())).max()
    return float("nan") if torch.isnan(out).any() else float(ratio)


@dataclass(frozen=True)
class Row:
    """One (S, causal) measurement; times in seconds, ``None`` when not measured."""

    seq_len: int
    causal: bool
    batch: int
    heads: int
    flops: float
    kernel_s: float
    sdpa_s: float | None
    naive_s: float | None
    max_err: float
    naive_oom: bool = False
    err_ratio: float = math.nan  # error_ratio(kernel, SDPA); NaN when SDPA did not run

    def tflops(self, which: str) -> float | None:
        seconds = getattr(self, f"{which}_s")
        return None if seconds is None else self.flops / seconds / 1e12

    def speedup(self, which: str) -> float | None:
        """How many times faster the kernel is than ``which`` ("sdpa" or "naive")."""
        seconds = getattr(self, f"{which}_s")
        return None if seconds is None else seconds / self.kernel_s


@dataclass(frozen=True)
class Target:
    name: str
    causal: bool
    min_seq: int
    against: str  # "sdpa" or "naive"
    ratio: float


TARGETS = (
    Target("non-causal, S >= 2k: kernel >= 0.9x SDPA", False, 2048, "sdpa", 0.9),
    Target("causal, S >= 4k: kernel >= 0.8x SDPA", True, 4096, "sdpa", 0.8),
    Target("non-causal, S >= 4k: kernel >= 2.5x naive", False, 4096, "naive", 2.5),
    Target("causal, S >= 4k: kernel >= 5x naive", True, 4096, "naive", 5.0),
)


@dataclass(frozen=True)
class Verdict:
    name: str
    passed: bool
    detail: str


def verdicts(rows: list[Row]) -> list[Verdict]:
    """PASS/FAIL for each target, and for agreement with SDPA, over the measured rows."""
    out = []
    for t in TARGETS:
        applicable = [r for r in rows if r.causal == t.causal and r.seq_len >= t.min_seq]
        if not applicable:
            out.append(Verdict(t.name, False, "no row measured at these lengths"))
            continue
        parts, ok, measured = [], True, 0
        for r in applicable:
            if t.against == "naive" and r.naive_oom:
                parts.append(f"S={r.seq_len}: naive OOM")
                continue
            ratio = r.speedup(t.against)
            if ratio is None:
                ok = False
                parts.append(f"S={r.seq_len}: not measured")
                continue
            measured += 1
            ok &= ratio >= t.ratio
            parts.append(f"S={r.seq_len}: {ratio:.2f}x")
        if not measured:  # a target is met by measurements, never by their absence
            ok = False
            parts.append("no length measured")
        out.append(Verdict(t.name, ok, ", ".join(parts)))
    ratios = [r.err_ratio for r in rows]
    worst = math.nan if any(math.isnan(e) for e in ratios) else max(ratios, default=math.inf)
    out.append(Verdict(f"kernel output matches SDPA ({TOLERANCE})", worst <= 1.0,
                       f"worst {worst:.2f} of the tolerance, max |err| {max((r.max_err for r in rows), default=math.nan):.1e}"))
    return out


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows: list[Row], device: str, date: str, extra: str = "", *, head_dim: int = HEAD_DIM,
                 heads: int = HEADS, tokens: int = TOKENS) -> str:
    """The results as a Markdown table, then one line per target."""
    lines = [
        f"FlashAttention forward, bf16, head dim {head_dim}, {heads} heads, batch = {tokens} // S",
        f"device: {device}    date: {date}{extra}",
        "FLOPs = 4*B*H*S^2*D, halved when causal. TFLOP/s from the median time.",
        "",
        "| S | causal | B | kernel TFLOP/s | SDPA (flash) TFLOP/s | naive TFLOP/s | kernel / SDPA | kernel / naive "
        "| max abs err vs SDPA | err / tolerance |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        naive = "OOM" if r.naive_oom else _fmt(r.tflops("naive"), ".1f")
        vs_naive = "naive OOM" if r.naive_oom else _fmt(r.speedup("naive"), ".2f")
        lines.append(
            f"| {r.seq_len} | {'yes' if r.causal else 'no'} | {r.batch} | {_fmt(r.tflops('kernel'), '.1f')} "
            f"| {_fmt(r.tflops('sdpa'), '.1f')} | {naive} | {_fmt(r.speedup('sdpa'), '.2f')} | {vs_naive} "
            f"| {r.max_err:.1e} | {r.err_ratio:.2f} |"
        )
    lines.append("")
    for v in verdicts(rows):
        lines.append(f"{'PASS' if v.passed else 'FAIL'}  {v.name}  ({v.detail})")
    return "\n".join(lines)


# --- results on disk, and in the book ------------------------------------------------------------

GPU_RESULTS = "results/gpu_attention.json"  # what chapter 07 reads; scripts/gpu_all.sh writes it


def save_results(path, rows: list[Row], *, device: str, date: str, versions: str, dry_run: bool,
                 shape: dict | None = None) -> None:
    """Write the measured rows as JSON (chapter 07 renders them with :func:`results_markdown`), with
    the harness's header (:func:`labsupport.bench_harness.header`)."""

    shape = {**dict(head_dim=HEAD_DIM, heads=HEADS, tokens=TOKENS), **(shape or {})}
    data = H.header(dry_run, device, versions=versions.strip(), shape=shape, rows=[asdict(r) for r in rows],
                    timing="labsupport.timing.benchmark (do_bench; compute-bound kernels of milliseconds)")
    data["date"] = date
    H.Recorder(path, data).save("all")


def load_results(path=None) -> dict | None:
    """The results :func:`save_results` wrote, or None when there are none (or only a dry run).

    ``path`` defaults to :data:`GPU_RESULTS` under the repository root. ``rows`` come back as
    :class:`Row` objects.
    """

    data = H.load_results("attention", path)
    if data is None:
        return None
    try:
        data["rows"] = [Row(**r) for r in data["rows"]]
    except (TypeError, KeyError) as exc:
        raise ValueError(f"{path or H.results_path('attention')} is not a results file from "
                         f"`python -m labsupport.bench_attention --json`: {exc}; run scripts/gpu_all.sh again or "
                         f"delete it") from exc
    return data


def results_markdown(results: dict | None) -> str:
    """Chapter 07's results section body: the measured table with device and date, or a plain
    statement that nothing has been measured (never an estimate)."""
    if results is None:
        return ("**Not yet measured.** No GPU has run the benchmark for this build of the book, so "
                "this page shows no GPU numbers.")
    shape = results["shape"]
    rows = results["rows"]
    table = format_table(rows, results["device"], results["date"], **shape).split("\n")
    body = [line for line in table if line.startswith("|")]
    marks = [f"- **{'PASS' if v.passed else 'FAIL'}** {v.name} ({v.detail})" for v in verdicts(rows)]
    return "\n".join([
        f"**Measured** on {results['device']}, {results['date']} ({results['versions']}): bf16, head dim "
        f"{shape['head_dim']}, {shape['heads']} heads, a batch of {shape['tokens']:,} // S sequences; "
        f"TFLOP/s from the median time.",
        "",
        *body,
        "",
        *[line + "\n" for line in _measured_intro(results)],
        "Against the targets:",
        "",
        *marks,
    ])


def _measured_intro(results: dict) -> list[str]:
    """What the measured rows say, in numbers computed from them (nothing typed by hand). The
    Hopper explanation is given only where it applies: an sm_90 GPU on which the kernel was
    faster than SDPA at every length."""

    rows = [r for r in results["rows"] if r.sdpa_s is not None]
    if not rows:
        return []
    ratios = [r.speedup("sdpa") for r in rows]
    best = max(rows, key=lambda r: r.tflops("kernel"))
    best_sdpa = max(r.tflops("sdpa") for r in rows)
    gpu = match_device_name(results["device"])
    share = (f" ({best.tflops('kernel') * 1e12 / gpu.peak_flops:.0%} of the {gpu.name}'s dense bf16 datasheet "
             f"peak; SDPA's best, {best_sdpa:.0f} TFLOP/s, is {best_sdpa * 1e12 / gpu.peak_flops:.0%})") if gpu else ""
    text = (f"On this device the course's kernel ran at {min(ratios):.2f}x to {max(ratios):.2f}x the speed of "
            f"SDPA's flash backend, and reached {best.tflops('kernel'):.0f} TFLOP/s at S = {best.seq_len:,}"
            f"{' causal' if best.causal else ''}{share}.")
    if gpu and gpu.compute_capability >= (9, 0) and min(ratios) > 1:
        text += (
            " That is not a sign that a short Triton kernel beats FlashAttention in general. PyTorch's flash "
            "backend is, by default, FlashAttention-2, written for Ampere's `mma.sync` tensor-core instructions, "
            "which Hopper runs below its full rate; Triton compiles this kernel's `tl.dot` for sm_90 to Hopper's "
            "asynchronous `wgmma` instructions (a test compiles it and checks). The instructions are not the whole "
            "story: the lab's simpler kernel (a mask on every block) ran below SDPA on the same GPU, and so did this "
            "kernel with 4 warps instead of 8 (the launch-configuration sweep in `results/gpu_logs/`). "
            "FlashAttention-3 (Shah et al., 2024, arXiv:2407.08608), written for Hopper, reports 1.5-2x "
            "FlashAttention-2's speed in FP16 on an H100: that is the comparison to make on Hopper.")
    return [text]


# --- measuring ----------------------------------------------------------------------------------
# On a GPU for real; with ``--dry-run`` the same code runs on the CPU through the Triton
# interpreter at tiny shapes, so a typo in this never-on-CI path surfaces before device time is
# spent on it.


def _naive_with_mask(q, k, v, mask):
    """Naive attention with a precomputed causal mask (True = hidden), as model code caches it."""

    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, S, S)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _inputs(seq_len: int, *, heads: int, head_dim: int, tokens: int, device: str):
    """bf16 q, k, v of shape ``(tokens // S, heads, S, head_dim)``, seeded by S."""

    b = max(1, tokens // seq_len)
    gen = torch.Generator(device=device).manual_seed(seq_len)
    return [torch.randn(b, heads, seq_len, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(3)]


def _sdpa(q, k, v, causal: bool):
    """SDPA with the flash backend pinned (it raises rather than fall back to another backend)."""

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def measure(seq_lens=SEQ_LENS, *, heads: int = HEADS, head_dim: int = HEAD_DIM, tokens: int = TOKENS,
            device: str = "cuda", timing: dict | None = None, log=print) -> list[Row]:
    """Time the three implementations at each S, causal and not. ``timing`` is passed to
    :func:`labsupport.timing.benchmark` (the dry run uses one call)."""

    rows = []
    for s in seq_lens:
        qkv = _inputs(s, heads=heads, head_dim=head_dim, tokens=tokens, device=device)
        for causal in (False, True):
            row = _measure_one(*qkv, causal, timing or {})
            rows.append(row)
            naive = "OOM" if row.naive_oom else _fmt(row.tflops("naive"), "6.1f")
            log(f"S={s:6d} causal={causal!s:5}: kernel {row.tflops('kernel'):6.1f}  "
                f"SDPA {_fmt(row.tflops('sdpa'), '6.1f')}  naive {naive} TFLOP/s  (max err {row.max_err:.1e})")
        qkv.clear()
        torch.cuda.empty_cache()
    return rows


def _measure_one(q, k, v, causal: bool, timing: dict) -> Row:


    b, h, s, d = q.shape

    def kernel():
        return attention.flash_attention_reference(q, k, v, causal)  # looked up at call time

    def sdpa():
        return _sdpa(q, k, v, causal)

    out = kernel()[0].float()
    try:
        want = sdpa().float()
        max_err, err_ratio = float((out - want).abs().max()), error_ratio(out, want)
        del want
        sdpa_s = benchmark(sdpa, **timing).median_s
    except RuntimeError as exc:  # no flash backend for this GPU (it needs compute capability 8.0+)
        print(f"SDPA's flash backend did not run ({str(exc).strip()[:200]}); its columns stay empty",
              file=sys.stderr)
        max_err, err_ratio, sdpa_s = math.nan, math.nan, None
    kernel_s = benchmark(kernel, uses_triton=True, **timing).median_s
    naive_s, oom = None, False
    try:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1) if causal else None
        naive_out = _naive_with_mask(q, k, v, mask)
        if math.isnan(max_err):  # agreement with naive instead
            max_err, err_ratio = float((out - naive_out.float()).abs().max()), error_ratio(out, naive_out)
        del naive_out
        naive_s = benchmark(lambda: _naive_with_mask(q, k, v, mask), **timing).median_s
    except torch.cuda.OutOfMemoryError:
        oom = True
    mask = out = None
    torch.cuda.empty_cache()
    flops = attention_flops(b, h, s, d, causal=causal)
    return Row(s, causal, b, h, flops, kernel_s, sdpa_s, naive_s, max_err, oom, err_ratio)


# --- which launch configuration is fastest on this GPU ------------------------------------------


def candidate_configs():
    """Launch configurations the ``--configs`` sweep times (what Triton's tutorial autotunes over,
    trimmed to the ones that fit a Hopper or Ampere datacenter GPU at head dim 128)."""

    return [KernelConfig(bm, bn, w, st) for bm, bn, w, st in (
        (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
        (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
    )]


@dataclass(frozen=True)
class ConfigRow:
    """One configuration timed at one (S, causal); ``seconds`` is None when it did not run."""

    seq_len: int
    causal: bool
    config: object  # labsupport.attention.KernelConfig
    is_default: bool
    flops: float
    seconds: float | None
    max_err: float
    error: str = ""

    @property
    def tflops(self) -> float | None:
        return None if self.seconds is None else self.flops / self.seconds / 1e12


def sweep_configs(seq_len: int = 4096, *, heads: int = HEADS, head_dim: int = HEAD_DIM, tokens: int = TOKENS,
                  device: str = "cuda", configs=None, timing: dict | None = None, log=print) -> list[ConfigRow]:
    """Time the reference kernel with each candidate configuration, causal and not.

    The configuration :func:`labsupport.attention.kernel_config` picks is always included and
    marked as the default. A configuration that does not compile (too much shared memory, say)
    or gives a wrong answer is recorded with its error, not raised.
    """


    qkv = _inputs(seq_len, heads=heads, head_dim=head_dim, tokens=tokens, device=device)
    b = qkv[0].shape[0]
    default = kernel_config(seq_len, seq_len, head_dim, qkv[0].dtype, interpreter=interpreter_mode())
    todo = [default] + [c for c in (configs or candidate_configs()) if c != default]
    rows = []
    for causal in (False, True):
        want = attention_spec(*qkv, causal)[0].float()  # fp32 arithmetic; works on any GPU
        flops = attention_flops(b, heads, seq_len, head_dim, causal=causal)
        for config in todo:
            def kernel(causal=causal, config=config):
                return attention.flash_attention_reference(*qkv, causal, config=config)

            try:
                got = kernel()[0].float()
                err, ratio = float((got - want).abs().max()), error_ratio(got, want)
                del got
            except Exception as exc:  # noqa: BLE001 - e.g. triton's OutOfResources: record, go on
                rows.append(ConfigRow(seq_len, causal, config, config == default, flops, None, math.nan,
                                      f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"))
                log(f"causal={causal!s:5} {_config_name(config)}: did not run ({rows[-1].error})")
                continue
            if not ratio <= 1.0:
                rows.append(ConfigRow(seq_len, causal, config, config == default, flops, None, err,
                                      f"wrong output (max |err| {err:.1e})"))
                log(f"causal={causal!s:5} {_config_name(config)}: wrong output, max |err| {err:.1e}")
                continue
            seconds = benchmark(kernel, uses_triton=True, **(timing or {})).median_s
            rows.append(ConfigRow(seq_len, causal, config, config == default, flops, seconds, err))
            log(f"causal={causal!s:5} {_config_name(config)}: {rows[-1].tflops:7.1f} TFLOP/s")
        torch.cuda.empty_cache()
    return rows


def _config_name(c) -> str:
    return f"{c.block_m}x{c.block_n}, warps {c.num_warps}, stages {c.num_stages}"


def format_sweep(rows: list[ConfigRow]) -> str:
    """The sweep as a Markdown table per (S, causal), fastest first, and the best against the default."""
    lines = []
    for causal in (False, True):
        group = [r for r in rows if r.causal == causal]
        if not group:
            continue
        default = next(r for r in group if r.is_default)
        ran = sorted((r for r in group if r.seconds is not None), key=lambda r: r.seconds)
        lines += [
            f"Launch configurations, S = {group[0].seq_len}, {'causal' if causal else 'non-causal'}, "
            f"output vs fp32 attention within {TOLERANCE}:",
            "",
            "| BLOCK_M x BLOCK_N, warps, stages | TFLOP/s | vs default | note |",
            "|:---|---:|---:|:---|",
        ]
        for r in ran + [r for r in group if r.seconds is None]:
            vs = "-" if r.seconds is None or default.seconds is None else f"{default.seconds / r.seconds:.2f}x"
            note = ("default (kernel_config); " if r.is_default else "") + r.error
            lines.append(f"| {_config_name(r.config)} | {_fmt(r.tflops, '.1f')} | {vs} | {note.strip('; ')} |")
        if ran and default.seconds is not None and ran[0] is not default:
            gain = default.seconds / ran[0].seconds
            lines.append(f"\nbest: {_config_name(ran[0].config)}, {gain:.2f}x the default "
                         f"({_config_name(default.config)}); kernel_config sets the default.")
        elif ran and ran[0] is default:
            lines.append("\nbest: the default (kernel_config's choice).")
        lines.append("")
    return "\n".join(lines)


def run_checks() -> bool:
    """The graded checks on the reference implementations, GPU-only cases included."""

    ok = check_launch_ladder()
    # The answers refuse to run inside the checks that ban them, and the checks refuse a function
    # that is or holds one (learners may not hand them in); here the course checks its own answers,
    # so it hands in the unguarded functions, in the sanctioned context that lets a check take them.
    # check_naive_attention takes the definition's output: the eager baseline (naive_attention_reference)
    # rounds its scores to the inputs' dtype, as model code does, and that check rejects it on purpose
    def spec_out(q, k, v, causal=False):
        return unguarded(attention_spec)(q, k, v, causal)[0]

    for check, fn in ((checks.check_naive_attention, spec_out),
                      (checks.check_online_softmax, unguarded(online_softmax_reference)),
                      (checks.check_flash_attention, unguarded(flash_attention_reference))):
        try:
            with course_checks_its_answers():
                check(fn)
        except AssertionError as exc:
            ok = False
            print(f"FAILED {check.__name__}:\n{exc}")
    return ok


def check_launch_ladder() -> bool:
    """Every configuration the kernel may step down to (``GPU_CONFIGS``) compiles, launches and
    is right on this device, causal and not, in fp16 and (where supported) bf16. A GPU whose
    shared memory is smaller than this one's would get one of the later entries."""


    kernel = unguarded(flash_attention_reference)
    dtypes = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = True
    for dtype in dtypes:
        q, k, v = (torch.randn(2, 3, 300, 128, device=device, dtype=dtype) for _ in range(3))
        for causal in (False, True):
            want = attention_spec(q, k, v, causal)[0]
            for config in GPU_CONFIGS:
                try:
                    ratio = error_ratio(kernel(q, k, v, causal, config=config)[0], want)
                    good = ratio <= 1.0
                    detail = f"{ratio:.2f} of the tolerance"
                except Exception as exc:  # noqa: BLE001 - record and go on
                    good, detail = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
                ok &= good
                print(f"ladder {'ok  ' if good else 'FAIL'} {str(dtype)[6:]:8} causal={causal!s:5} "
                      f"{config_name(config)}: {detail}", flush=True)
    return ok


DRY_RUN = dict(seq_lens=(64, 128), heads=2, head_dim=32, tokens=256)  # seconds in the interpreter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        help=f"sequence lengths (default {' '.join(map(str, SEQ_LENS))}; dry run 64 128)")
    parser.add_argument("--check", action="store_true", help="run the GPU correctness checks instead of timing")
    parser.add_argument("--configs", type=int, nargs="?", const=4096, metavar="S",
                        help="time the kernel's candidate launch configurations at S (default 4096) instead")
    parser.add_argument("--out", help="also write the table (Markdown) to this file")
    parser.add_argument("--json", help=f"also write the rows as JSON to this file (chapter 07 reads {GPU_RESULTS})")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the timing code on the CPU through the Triton interpreter at tiny shapes: "
                             "checks this command works, measures nothing")
    args = parser.parse_args(argv)
    if args.json and (args.check or args.configs is not None):
        parser.error("--json writes the benchmark table's rows; it does not go with --check or --configs")



    configure_triton()
    if args.dry_run:
        if not interpreter_mode():
            print("--dry-run runs kernels on the CPU through the Triton interpreter: set TRITON_INTERPRET=1",
                  file=sys.stderr)
            return 2
        device, shapes, timing = "cpu", dict(DRY_RUN), dict(repeats=1, warmup=0)
        name = "CPU (dry run: Triton interpreter, tiny shapes; these timings mean nothing)"
    elif not torch.cuda.is_available() or interpreter_mode():
        reason = "no CUDA GPU is visible" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
        print(f"bench_attention needs a CUDA GPU with Triton compiling for it ({reason}). Its numbers are "
              f"GPU measurements; on a CPU the Triton interpreter would time Python, not the kernel. "
              f"(--dry-run checks the command itself on a CPU.)", file=sys.stderr)
        return 2
    else:
        device, shapes, timing = "cuda", dict(seq_lens=SEQ_LENS), None
        name = torch.cuda.get_device_name(0)

    stamp = H.utc_now()
    versions = f"    torch {torch.__version__}, triton {triton.__version__}"
    print(f"device: {name}    date: {stamp}{versions}")
    if args.check:
        ok = run_checks()
        print("all GPU checks passed" if ok else "some GPU checks FAILED")
        return 0 if ok else 1
    seq_lens = shapes.pop("seq_lens")
    if args.seq_lens:
        seq_lens = tuple(args.seq_lens)
    if args.configs is not None:
        seq_len = seq_lens[-1] if args.dry_run else args.configs
        configs = candidate_configs()[:2] if args.dry_run else None  # two are enough to exercise it
        rows = sweep_configs(seq_len, device=device, configs=configs, timing=timing, **shapes)
        table = f"device: {name}    date: {stamp}{versions}\n\n" + format_sweep(rows)
        ok = any(r.is_default and r.seconds is not None for r in rows)  # the default runs and is right
    else:
        rows = measure(seq_lens, device=device, timing=timing, **shapes)
        table = format_table(rows, name, stamp, versions, **shapes)
        if args.json:
            save_results(args.json, rows, device=name, date=stamp, versions=versions, dry_run=args.dry_run,
                         shape=shapes)
        ok = args.dry_run or all(v.passed for v in verdicts(rows))
        if args.dry_run:
            table += "\n(dry run: the PASS/FAIL lines above judge interpreter timings and mean nothing)"
    print()
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
