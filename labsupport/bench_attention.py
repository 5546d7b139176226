"""Benchmark the course's FlashAttention kernel against SDPA (flash backend) and naive attention.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_attention              # the table, with PASS/FAIL per target
    python -m labsupport.bench_attention --check      # the GPU-only correctness checks
    python -m labsupport.bench_attention --out results.md

Shapes follow the FlashAttention-2 paper's benchmark: bf16, head dim 128, 16 heads, and a batch
of ``16384 // S`` sequences, so every row processes the same number of tokens. FLOPs are
``4*B*H*S**2*D``, halved when causal (:func:`labsupport.costs.attention_flops`). Each kernel is
timed with :func:`labsupport.timing.benchmark` (``triton.testing.do_bench``: warm-up, L2 flush,
median). SDPA is pinned to its flash backend with ``torch.nn.attention.sdpa_kernel``. Naive
attention is :func:`labsupport.attention.naive_attention_reference` with its causal mask built
once outside the timed call; if it runs out of memory the table says OOM.

The targets (``ANCHORS.md``): non-causal, S >= 2k, at least 0.9x SDPA; causal, S >= 4k, at least
0.8x SDPA; at S >= 4k at least 2.5x naive non-causal and 5x causal. Without a GPU the command
exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import dataclass

SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HEADS = 16
HEAD_DIM = 128
MAX_ERR = 3e-2  # largest |kernel - SDPA| accepted in bf16


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
        parts, ok = [], True
        for r in applicable:
            if t.against == "naive" and r.naive_oom:
                parts.append(f"S={r.seq_len}: naive OOM")
                continue
            ratio = r.speedup(t.against)
            if ratio is None:
                ok = False
                parts.append(f"S={r.seq_len}: not measured")
                continue
            ok &= ratio >= t.ratio
            parts.append(f"S={r.seq_len}: {ratio:.2f}x")
        out.append(Verdict(t.name, ok, ", ".join(parts)))
    errors = [r.max_err for r in rows]
    worst = math.nan if any(math.isnan(e) for e in errors) else max(errors, default=math.inf)
    out.append(Verdict(f"kernel output matches SDPA (max |err| <= {MAX_ERR:g})", worst <= MAX_ERR,
                       f"worst {worst:.2e}"))
    return out


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows: list[Row], device: str, date: str, extra: str = "") -> str:
    """The results as a Markdown table, then one line per target."""
    lines = [
        f"FlashAttention forward, bf16, head dim {HEAD_DIM}, {HEADS} heads, batch = {TOKENS} // S",
        f"device: {device}    date: {date}{extra}",
        "FLOPs = 4*B*H*S^2*D, halved when causal. TFLOP/s from the median time.",
        "",
        "| S | causal | B | kernel TFLOP/s | SDPA (flash) TFLOP/s | naive TFLOP/s | kernel / SDPA | kernel / naive "
        "| max abs err vs SDPA |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        naive = "OOM" if r.naive_oom else _fmt(r.tflops("naive"), ".1f")
        vs_naive = "naive OOM" if r.naive_oom else _fmt(r.speedup("naive"), ".2f")
        lines.append(
            f"| {r.seq_len} | {'yes' if r.causal else 'no'} | {r.batch} | {_fmt(r.tflops('kernel'), '.1f')} "
            f"| {_fmt(r.tflops('sdpa'), '.1f')} | {naive} | {_fmt(r.speedup('sdpa'), '.2f')} | {vs_naive} "
            f"| {r.max_err:.1e} |"
        )
    lines.append("")
    for v in verdicts(rows):
        lines.append(f"{'PASS' if v.passed else 'FAIL'}  {v.name}  ({v.detail})")
    return "\n".join(lines)


# --- measuring (GPU only) ----------------------------------------------------------------------


def _naive_with_mask(q, k, v, mask):
    """Naive attention with a precomputed causal mask (True = hidden), as model code caches it."""
    import torch

    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, S, S)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def measure(seq_lens=SEQ_LENS, *, heads: int = HEADS, head_dim: int = HEAD_DIM, tokens: int = TOKENS,
            log=print) -> list[Row]:
    """Time the three implementations at each S, causal and not. Needs a CUDA GPU."""
    import torch

    rows = []
    for s in seq_lens:
        b = max(1, tokens // s)
        gen = torch.Generator(device="cuda").manual_seed(s)
        qkv = [torch.randn(b, heads, s, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3)]
        for causal in (False, True):
            row = _measure_one(*qkv, causal)
            rows.append(row)
            naive = "OOM" if row.naive_oom else _fmt(row.tflops("naive"), "6.1f")
            log(f"S={s:6d} causal={causal!s:5}: kernel {row.tflops('kernel'):6.1f}  "
                f"SDPA {_fmt(row.tflops('sdpa'), '6.1f')}  naive {naive} TFLOP/s  (max err {row.max_err:.1e})")
        qkv.clear()
        torch.cuda.empty_cache()
    return rows


def _measure_one(q, k, v, causal: bool) -> Row:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .attention import flash_attention_reference
    from .costs import attention_flops
    from .timing import benchmark

    b, h, s, d = q.shape

    def kernel():
        return flash_attention_reference(q, k, v, causal)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = kernel()[0].float()
    try:
        max_err = float((out - sdpa().float()).abs().max())
        sdpa_s = benchmark(sdpa).median_s
    except RuntimeError as exc:  # no flash backend for this GPU (it needs compute capability 8.0+)
        print(f"SDPA's flash backend did not run ({str(exc).strip()[:200]}); its columns stay empty",
              file=sys.stderr)
        max_err, sdpa_s = math.nan, None
    kernel_s = benchmark(kernel, uses_triton=True).median_s
    naive_s, oom = None, False
    try:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1) if causal else None
        naive_out = _naive_with_mask(q, k, v, mask)
        if math.isnan(max_err):
            max_err = float((out - naive_out.float()).abs().max())  # agreement with naive instead
        del naive_out
        naive_s = benchmark(lambda: _naive_with_mask(q, k, v, mask)).median_s
    except torch.cuda.OutOfMemoryError:
        oom = True
    mask = out = None
    torch.cuda.empty_cache()
    flops = attention_flops(b, h, s, d, causal=causal)
    return Row(s, causal, b, h, flops, kernel_s, sdpa_s, naive_s, max_err, oom)


def run_checks() -> bool:
    """The graded checks on the reference implementations, GPU-only cases included."""
    from . import checks
    from .attention import flash_attention_reference, naive_attention_reference, online_softmax_reference

    ok = True
    for check, fn in ((checks.check_naive_attention, naive_attention_reference),
                      (checks.check_online_softmax, online_softmax_reference),
                      (checks.check_flash_attention, flash_attention_reference)):
        try:
            check(fn)
        except AssertionError as exc:
            ok = False
            print(f"FAILED {check.__name__}:\n{exc}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS), help="sequence lengths")
    parser.add_argument("--check", action="store_true", help="run the GPU correctness checks instead of timing")
    parser.add_argument("--out", help="also write the table (Markdown) to this file")
    args = parser.parse_args(argv)

    import torch

    from .device import configure_triton, interpreter_mode

    configure_triton()
    if not torch.cuda.is_available() or interpreter_mode():
        reason = "no CUDA GPU is visible" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
        print(f"bench_attention needs a CUDA GPU with Triton compiling for it ({reason}). Its numbers are "
              f"GPU measurements; on a CPU the Triton interpreter would time Python, not the kernel.",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    import triton

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"    torch {torch.__version__}, triton {triton.__version__}"
    print(f"device: {device}    date: {stamp}{versions}")
    if args.check:
        ok = run_checks()
        print("all GPU checks passed" if ok else "some GPU checks FAILED")
        return 0 if ok else 1
    rows = measure(args.seq_lens)
    table = format_table(rows, device, stamp, versions)
    print()
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0 if all(v.passed for v in verdicts(rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
