"""Measuring the two phases on :class:`labsupport.transformer.Transformer`, and fitting what was measured.

* :func:`fit_prefill_times` fits ``time = a*P + b*P**2 + c`` to prefill times measured at prompt
  lengths ``P`` and returns the *measured* crossover ``a / b``: the prompt length at which the
  quadratic (attention) part of the time equals the linear part. Compare it with the FLOP-count
  crossover ``N / (2*L*d)`` from :func:`labsupport.costs.quadratic_crossover`.
* :func:`measure_prefill` and :func:`measure_decode` run sweeps with a progress bar. On a GPU a
  point that runs out of memory is recorded as such (``oom=True``) instead of ending the sweep:
  that is the KV-cache wall, and it is a result.
* :func:`cpu_threads` pins the number of CPU threads while timing. On a small shared machine
  (two cores, tests running beside the notebook) OpenMP threads waiting for a busy core make
  single timings tens of times slower; one thread gives steadier numbers.

Decode steps are timed at a fixed context without running a real prefill first: the cache is
allocated and its ``length`` set to the context. Its contents are zeros, and how long a step
takes does not depend on the values in the cache, only on how many there are.
"""

from __future__ import annotations

import gc
import itertools
import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from . import bench_harness, costs
from ._validate import int_list, positive_int, positive_number, renamed_parameters
from .hardware import match_device_name
from .models import as_model
from .timing import benchmark
from .timing import progress as progress_bar
from .transformer import Transformer

# --- fitting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillFit:
    """``time(P) = linear * P + quadratic * P**2 + constant``, fitted to measured prefill times (seconds)."""

    linear: float  # seconds per token: the weights applied to each position
    quadratic: float  # seconds per token squared: every position against every other
    constant: float  # seconds: fixed overhead per call (launches, Python)
    lengths: tuple[int, ...] = field(repr=False)
    seconds: tuple[float, ...] = field(repr=False)

    @property
    def crossover(self) -> float:
        """Prompt length where the quadratic part equals the linear part, ``linear / quadratic``.

        ``math.inf`` when no quadratic term was detected (the fit set it to zero).
        """
        return self.linear / self.quadratic if self.quadratic > 0 else math.inf

    def predict(self, prompt_tokens: float) -> float:
        """Fitted time in seconds at ``prompt_tokens``."""
        p = float(prompt_tokens)
        return self.linear * p + self.quadratic * p * p + self.constant

    def quadratic_share(self, prompt_tokens: float) -> float:
        """Fraction of the fitted time at ``prompt_tokens`` that is the quadratic term."""
        p = float(prompt_tokens)
        return self.quadratic * p * p / self.predict(p)

    @property
    def max_relative_error(self) -> float:
        """Largest ``|fit - measured| / measured`` over the measured points."""
        return max(abs(self.predict(p) - t) / t for p, t in zip(self.lengths, self.seconds))

    def __str__(self) -> str:
        cross = "none detected" if math.isinf(self.crossover) else f"{self.crossover:,.0f} tokens"
        return (
            f"time = {self.linear:.3e} s * P + {self.quadratic:.3e} s * P^2 + {self.constant:.3e} s; "
            f"crossover {cross}; worst fit error {100 * self.max_relative_error:.0f}%"
        )


def _as_points(lengths, seconds) -> tuple[tuple[int, ...], tuple[float, ...]]:
    try:
        lengths, seconds = list(lengths), list(seconds)
    except TypeError as exc:
        raise ValueError("lengths and seconds must be sequences of numbers") from exc
    if len(lengths) != len(seconds):
        raise ValueError(
            f"lengths and seconds must have the same length, got {len(lengths)} and {len(seconds)}"
        )
    lengths = tuple(positive_int("each prompt length", p) for p in lengths)
    out = []
    for t in seconds:
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"each time must be a finite number of seconds > 0, got {t!r}")
        out.append(float(t))
    return lengths, tuple(out)


def fit_prefill_times(lengths, seconds, *, constant: bool = True) -> PrefillFit:
    """Fit ``seconds = a*P + b*P**2 (+ c)`` to measured prefill times, all coefficients >= 0.

    The fit minimises *relative* error (each point weighted by ``1 / seconds``), so short prompts
    count as much as long ones although their times are far smaller. Coefficients are kept
    non-negative: a time cannot shrink with the prompt, so a negative term would only be
    fitting noise. Needs at least as many distinct lengths as terms (3 with ``constant``, else 2).
    """
    lengths, secs = _as_points(lengths, seconds)
    terms = 3 if constant else 2
    if len(set(lengths)) < terms:
        raise ValueError(
            f"fitting {terms} terms needs at least {terms} different prompt lengths, got {sorted(set(lengths))}"
        )
    p = np.asarray(lengths, dtype=float)
    t = np.asarray(secs, dtype=float)
    columns = [p, p * p, np.ones_like(p)][:terms]
    best = None
    # Least squares with every subset of the terms; keep the best fit whose coefficients are all
    # >= 0 (an exact non-negative least squares for three unknowns).
    for k in range(terms, 0, -1):
        for subset in itertools.combinations(range(terms), k):
            a = np.stack([columns[i] for i in subset], axis=1) / t[:, None]
            coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(subset)] = coef
            err = float(np.sum((a @ coef - 1.0) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, full)
    coef = best[1]
    return PrefillFit(float(coef[0]), float(coef[1]), float(coef[2]), lengths, secs)


# --- measuring ----------------------------------------------------------------------------------


@contextmanager
def cpu_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)``, then restore the previous count.

    ``None`` leaves the setting alone. Has no effect on GPU work.
    """

    if n is None:
        yield
        return
    n = positive_int("threads", n)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a GPU (or CPU allocator) out-of-memory error."""

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "can't allocate" in text
    )


def _free_memory() -> None:


    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _lengths(values, what: str) -> list[int]:
    return int_list(what, values)


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    batch: int
    seconds: float | None  # None when it ran out of memory
    oom: bool = False


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    seconds: float | None  # median time of one decode step; None when it ran out of memory
    cache_bytes: int = 0  # bytes reserved for the cache at this point
    oom: bool = False


def _cache_bytes(model, batch: int, max_len: int) -> int:
    """Bytes a cache for ``batch`` sequences of ``max_len`` positions reserves (keys and values)."""

    cfg = model.cfg
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * max_len * cfg.head_dim * element


def _check_model(model):
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a labsupport.transformer.Transformer, got {type(model).__name__}")
    return model


def measure_prefill(
    model, lengths, *, batch: int = 1, threads: int | None = None, progress: bool = True, **bench
) -> list[PrefillPoint]:
    """Median time of ``model.prefill`` for each prompt length (a fresh cache of exactly that length).

    ``threads`` pins CPU threads while timing (see :func:`cpu_threads`). Extra keyword arguments go
    to :func:`labsupport.timing.benchmark` (for example ``repeats=3``: three timed calls, on a GPU too).
    """

    model = _check_model(model)
    lengths = _lengths(lengths, "lengths")
    batch = positive_int("batch", batch)
    gpu = model.device.type == "cuda"
    points = []
    with cpu_threads(threads):
        for p in progress_bar(lengths, "prefill", progress):
            try:
                prompt = model.random_prompt(batch, p, seed=p)
                cache = model.new_cache(batch, p)
                timing = benchmark(lambda: model.prefill(prompt, cache), gpu=gpu, **bench)  # noqa: B023
                points.append(PrefillPoint(p, batch, timing.median_s))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                points.append(PrefillPoint(p, batch, None, oom=True))
            finally:
                prompt = cache = None
                _free_memory()
    return points


def measure_decode(
    model, batches, contexts, *, threads: int | None = None, progress: bool = True, **bench
) -> list[DecodePoint]:
    """Median time of one ``model.decode_step`` for every (batch, context) pair.

    ``batches`` and ``contexts`` are lists; every combination is measured, batches outermost.
    The cache is allocated for ``context + 1`` positions and declared filled up to ``context``
    (see the module docstring), so each timed call attends to exactly ``context`` earlier tokens.
    """

    model = _check_model(model)
    batches = _lengths(batches, "batches")
    contexts = _lengths(contexts, "contexts")
    gpu = model.device.type == "cuda"
    points = []
    pairs = [(b, c) for b in batches for c in contexts]
    with cpu_threads(threads):
        for b, ctx in progress_bar(pairs, "decode", progress):
            cache = tokens = None
            try:
                cache = model.new_cache(b, ctx + 1)
                tokens = model.random_prompt(b, 1, seed=b)

                def step():
                    cache.length = ctx  # noqa: B023 (used at once)
                    model.decode_step(tokens, cache)  # noqa: B023

                timing = benchmark(step, gpu=gpu, **bench)
                points.append(DecodePoint(b, ctx, timing.median_s, _cache_bytes(model, b, ctx + 1)))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                points.append(DecodePoint(b, ctx, None, _cache_bytes(model, b, ctx + 1), oom=True))
            finally:
                cache = tokens = None
                _free_memory()
    return points


@renamed_parameters(element_bytes="dtype_bytes")
def unread_embedding_bytes(cfg, batch: int, dtype_bytes: float = 2) -> float:
    """Bytes of the input embedding table that a decode step of ``batch`` sequences never reads.

    :func:`labsupport.costs.decode_step_bytes` follows the runbook and charges every weight to
    every step. A step only looks up one row of the input embedding table per sequence, so when
    that table is separate from the output head (``tied_embeddings=False``, as in Llama 3.1 8B:
    about 1 GB in bf16) the other rows stay in memory untouched. Subtract this from the runbook's
    count to get the bytes a step really streams, before dividing by a measured step time. Zero
    for tied embeddings: the shared table is read in full as the output head. ``dtype_bytes`` is
    bytes per weight (the old name ``element_bytes=`` is still accepted).
    """
    cfg = as_model(cfg)
    batch = positive_int("batch", batch)
    dtype_bytes = positive_number("dtype_bytes", dtype_bytes)
    if cfg.tied_embeddings:
        return 0.0
    return float(max(cfg.vocab_size - batch, 0) * cfg.d_model * dtype_bytes)


def model_prefill_flops(cfg, prompt_tokens: int, batch: int = 1, causal: bool = True) -> float:
    """FLOPs one :meth:`Transformer.prefill` call really performs, to divide measured times by.

    :func:`labsupport.costs.prefill_flops` follows the runbook: ``2*N*P`` for every weight plus
    the attention term. The course model does less than that in a prefill. The input embedding
    is a table lookup (no multiplies), and the output layer runs on the last position only (the
    next token needs nothing else), so the matmuls are the layers' projections for every token,
    ``2 * W * P`` with ``W`` the weights of the decoder layers' matrices, plus ``2 * vocab * d``
    once per sequence. Attention is ``4 * L * P**2 * H * D``, halved when ``causal`` (the fused
    kernel skips the masked half). For Llama 3.1 8B, ``W`` is about 6.98e9 against ``N`` = 8.03e9.
    Chapter 05 quotes both counts; measured FLOP/s use this one.
    """
    cfg = as_model(cfg)
    p = positive_int("prompt_tokens", prompt_tokens)
    batch = positive_int("batch", batch)
    width = cfg.n_heads * cfg.head_dim
    matmuls = layer_matmul_weights(cfg) * p + cfg.vocab_size * cfg.d_model  # last position's logits
    attention = 4 * cfg.n_layers * p * p * width / (2 if causal else 1)
    return float(batch * (2 * matmuls + attention))


def layer_matmul_weights(cfg) -> int:
    """Weights of the decoder layers' matrices: q, k, v, o projections and the SwiGLU feed-forward,
    every layer (no norms, embeddings or output layer)."""
    cfg = as_model(cfg)
    d, q_width, kv_width = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return cfg.n_layers * (2 * d * q_width + 2 * d * kv_width + 3 * d * cfg.d_ff)


def model_prefill_crossover(cfg, causal: bool = True) -> float:
    """Prompt length where the attention FLOPs of :func:`model_prefill_flops` equal its per-token
    matmul FLOPs: ``W / (2 * L * H * D)``, doubled when ``causal``. The runbook's count,
    :func:`labsupport.costs.quadratic_crossover`, uses every weight ``N`` instead (with the same
    query width ``d_q = H * D``, which the runbook writes ``d``)."""
    cfg = as_model(cfg)
    crossover = layer_matmul_weights(cfg) / (2 * cfg.n_layers * cfg.n_heads * cfg.head_dim)
    return crossover * 2 if causal else crossover


# Memory a decode point needs beyond its weights and cache: the CUDA context is outside what
# torch can allocate, but the benchmark's L2-flush buffer (256 MB), the logits, the allocator's
# rounding and the attention kernel's workspace are not. Generous on purpose: a point planned to
# fit must not run out of memory halfway through a device run.
DECODE_RESERVE_BYTES = 3 * 2**30


@dataclass(frozen=True)
class PlannedPoint:
    batch: int
    context: int
    needs_bytes: int  # weights + cache + reserve
    fits: bool
    reason: str = ""  # why it was skipped, when it does not fit


def plan_decode_points(cfg, pairs, memory_bytes: float, dtype_bytes: int = 2,
                       reserve_bytes: int = DECODE_RESERVE_BYTES) -> list[PlannedPoint]:
    """Which (batch, context) decode points fit a GPU with ``memory_bytes`` that torch can use.

    A point needs the weights, a cache of ``context + 1`` positions per sequence (what
    :func:`measure_decode` allocates) and ``reserve_bytes``. Points that do not fit are kept in
    the list with ``fits=False`` and the reason, so a results file says what was skipped and why
    (on an 80 GB H100, batch 64 at 8,192 tokens of the 8B needs 16.1 GB of weights and 68.7 GB
    of cache: more than the card's 85.5e9 bytes).
    """
    cfg = as_model(cfg)
    weights = costs.param_count(cfg) * dtype_bytes
    per_position = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    planned = []
    for batch, context in pairs:
        needs = int(weights + batch * (context + 1) * per_position + reserve_bytes)
        fits = needs <= memory_bytes
        reason = "" if fits else (
            f"needs {needs / 1e9:.1f} GB (weights {weights / 1e9:.1f} GB, cache "
            f"{batch * (context + 1) * per_position / 1e9:.1f} GB, reserve {reserve_bytes / 1e9:.1f} GB), "
            f"{memory_bytes / 1e9:.1f} GB are available")
        planned.append(PlannedPoint(batch, context, needs, fits, reason))
    return planned


# --- GPU results recorded by python -m labsupport.bench_phases (scripts/gpu_all.sh) -----------------------------------------------

GPU_RESULTS = "results/gpu_phases.json"
NOT_MEASURED = "not yet measured"


def load_gpu_results(path=None) -> dict | None:
    """The results ``python -m labsupport.bench_phases`` wrote, or None when there are none (or a dry run).

    ``path`` defaults to :data:`GPU_RESULTS` under the repository root (the bench harness's reader,
    :func:`labsupport.bench_harness.load_results`).
    """
    return bench_harness.load_results("phases", path, required=())


def gpu_summary(results: dict | None) -> dict[str, str]:
    """The book's GPU figures as text, each "not yet measured" when it is missing.

    Keys: ``device`` (name and date), ``prefill_ratio`` (32,768 over 2,048 tokens),
    ``prefill_tflops`` (achieved at 32,768 tokens under the FLOPs the model performs, the
    runbook's count beside it), ``crossover`` (the fitted ``a/b``), ``decode_b1`` and
    ``decode_b64`` (achieved over copy bandwidth, eager, at batch 1 and at batch 64 with 8,192
    tokens of context; a point skipped because it does not fit the GPU says so), and
    ``decode_b1_graph`` (batch 1 with the step replayed from a CUDA graph).
    """
    results = results or {}

    def finite(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def number(key, fmt):
        value = results.get(key)
        return fmt(value) if finite(value) else NOT_MEASURED

    fit = results.get("prefill_fit") or {}
    crossover = fit.get("measured_crossover_tokens")
    device = results.get("device")
    longest = max((r for r in results.get("prefill") or [] if finite(r.get("tflops_performed"))),
                  key=lambda r: r["prompt_tokens"], default=None)
    graph = (results.get("decode_batch1_short_cuda_graph") or {}).get("fraction_of_copy")
    b64 = number("decode_batch64_ctx8192_fraction_of_copy", lambda v: f"{v:.0%}")
    if b64 == NOT_MEASURED and results.get("decode_book_point_skipped"):
        b64 = f"not measured on this GPU: {results['decode_book_point_skipped']}"
    return {
        "device": f"{device}, {results.get('date', 'undated')}" if device else NOT_MEASURED,
        "prefill_ratio": number("prefill_ratio_32768_over_2048", lambda v: f"{v:.1f}x"),
        "prefill_tflops": (
            f"{longest['tflops_performed']:.0f} TFLOP/s at {longest['prompt_tokens']:,} tokens "
            f"({longest['tflops_runbook_causal']:.0f} under the runbook's count, 2NP plus causal attention)"
            if longest else NOT_MEASURED
        ),
        "crossover": (f"{crossover:,.0f} tokens" + (" (extrapolated past the longest prompt)" if longest and
                                                     crossover > longest["prompt_tokens"] else "")
                      if finite(crossover) else NOT_MEASURED),
        "decode_b1": number("decode_batch1_short_fraction_of_copy", lambda v: f"{v:.0%}"),
        "decode_b64": b64,
        "decode_b1_graph": f"{graph:.0%}" if finite(graph) else NOT_MEASURED,
    }


def gpu_findings_markdown(results: dict | None) -> str:
    """What chapter 05's GPU run showed, in sentences whose numbers all come from ``results``;
    a plain "not yet measured" statement when there is no run. Each conclusion is drawn only when
    the data supports it (a slower GPU's run gets a plain description instead)."""

    if not results:
        return ("**Not yet measured.** No GPU run has been recorded for this build of the book, so no "
                "GPU figure is shown and none is estimated in its place.")
    copy_bw, matmul = results["copy_bandwidth_Bps"], results["matmul_flops"]
    lines = [f"**Measured** on {results['device']}, {results.get('date', 'undated')} "
             f"(torch {results.get('torch', '?')}): the Llama 3.1 8B shape, random weights, {results.get('dtype')}, "
             f"eager PyTorch. At the start of the run the device copied {copy_bw / 1e12:.2f} TB/s and multiplied "
             f"bf16 matrices at {matmul / 1e12:.0f} TFLOP/s: its own ceilings, against which the rest is read."]
    lines += _prefill_findings(results)
    lines += _decode_findings(results)
    for r in results.get("decode_by_batch", []) + results.get("decode_by_context", []):
        if r.get("skipped"):
            lines.append(f"\nBatch {r['batch']} at {r['context']:,} tokens was not measured: it {r['skipped']}.")
    return "\n".join(lines)


def _prefill_findings(results: dict) -> list[str]:
    """Prefill's achieved rate at the longest prompt, and where the fitted crossover lies and why."""
    prefill = [r for r in results.get("prefill", []) if r.get("tflops_performed")]
    if not prefill:
        return []
    matmul = results["matmul_flops"]
    longest = max(prefill, key=lambda r: r["prompt_tokens"])
    rate = longest["tflops_performed"] * 1e12
    gpu = match_device_name(results["device"])
    datasheet = f", {rate / gpu.peak_flops:.0%} of the datasheet's dense bf16 peak" if gpu else ""
    verdict = "**Prefill is compute-bound.** " if rate >= 0.5 * matmul else "**Prefill.** "
    lines = [
        f"\n{verdict}At {longest['prompt_tokens']:,} tokens a prefill took {longest['seconds']:.2f} s: "
        f"{longest['tflops_performed']:.0f} TFLOP/s of the FLOPs the model performs, {rate / matmul:.0%} of the "
        f"matmul rate measured at the start of the run{datasheet}."]
    fit = results.get("prefill_fit") or {}
    measured, predicted = fit.get("measured_crossover_tokens"), fit.get("predicted_crossover_performed_causal")
    if measured and predicted:
        beyond = measured > longest["prompt_tokens"]
        where = (f"That is an extrapolation past the longest prompt measured ({longest['prompt_tokens']:,} "
                 f"tokens), and with the worst point {fit['max_relative_error']:.0%} off the fit it could move by "
                 f"thousands of tokens. " if beyond else
                 f"The worst point is {fit['max_relative_error']:.0%} off the fit. ")
        if measured < predicted:
            why = ("Either way it falls short of the crossover the performed FLOPs predict "
                   f"({predicted:,.0f}): attention ran at fewer FLOP/s than the layers' weight matmuls, so its "
                   "share of the time grew faster than its share of the FLOPs (chapter 07 measures the attention "
                   "kernel on its own).")
        else:
            why = (f"It lies beyond the {predicted:,.0f} the performed FLOPs predict: the per-token work (the "
                   "matmuls, and the norms, rotary embeddings and activations the FLOP count leaves out) took "
                   "longer relative to attention than the FLOP counts suggest.")
        lines.append(f"The fitted time $aP + bP^2 + c$ puts the crossover near {measured:,.0f} tokens. {where}{why}")
    return lines


def _decode_findings(results: dict) -> list[str]:
    """Decode at batch 1 (launch-bound or not, with the CUDA graph beside it), at the largest batch,
    and at the longest context."""
    b1 = next((r for r in results.get("decode_by_context", []) if r.get("seconds") and r.get("batch") == 1), None)
    if not b1:
        return []
    copy_bw = results["copy_bandwidth_Bps"]
    graph = results.get("decode_batch1_short_cuda_graph") or {}
    by_batch = [r for r in results.get("decode_by_batch", []) if r.get("seconds")]
    floor = b1["bytes_read"] / copy_bw
    lines = [
        f"\n**Decode.** A batch-1 step at {b1['context']:,} tokens of context reads {b1['bytes_read'] / 1e9:.1f} GB, "
        f"which the copy rate moves in {floor * 1e3:.1f} ms; the eager step took {b1['seconds'] * 1e3:.1f} ms "
        f"({b1['fraction_of_copy']:.0%} of the copy rate)."]
    small = [r for r in by_batch if r["batch"] <= 32]
    flat = len(small) >= 2 and max(r["seconds"] for r in small) < 1.15 * min(r["seconds"] for r in small)
    graphed = graph.get("seconds") and b1["seconds"] > 1.5 * graph["seconds"]
    if flat and graphed:
        lines.append(
            f"It was launch-bound, not bandwidth-bound: batches of {', '.join(str(r['batch']) for r in small)} at "
            f"{small[0]['context']:,} tokens all took {min(r['seconds'] for r in small) * 1e3:.1f}-"
            f"{max(r['seconds'] for r in small) * 1e3:.1f} ms although they read "
            f"{small[0]['bytes_read'] / 1e9:.0f} to {small[-1]['bytes_read'] / 1e9:.0f} GB, so the time was set by "
            f"Python and the CPU launching each layer's many small kernels one after another, not by the bytes. "
            f"Replaying the same step from a CUDA graph, with no CPU work between kernels, took "
            f"{graph['seconds'] * 1e3:.1f} ms ({graph['fraction_of_copy']:.0%} of the copy rate). Much of the "
            f"remaining gap is likely the matrix-vector products themselves, which at batch 1 reach only part of "
            f"the copy rate (lab 04 measures one such product on your device). This is one reason serving engines "
            f"such as vLLM and SGLang capture their decode steps in CUDA graphs.")
    elif graph.get("seconds"):
        lines.append(f"Replayed from a CUDA graph the step took {graph['seconds'] * 1e3:.1f} ms "
                     f"({graph['fraction_of_copy']:.0%} of the copy rate).")
    if by_batch:
        big = max(by_batch, key=lambda r: r["batch"])
        lines.append(
            f"At batch {big['batch']} and {big['context']:,} tokens the step streamed {big['bytes_read'] / 1e9:.0f} GB "
            f"in {big['seconds'] * 1e3:.1f} ms, {big['fraction_of_copy']:.0%} of the copy rate"
            + (": with enough bytes per kernel, decode comes close to the memory's speed."
               if big["fraction_of_copy"] >= 0.7 else "."))
    longest_ctx = max((r for r in results.get("decode_by_context", []) if r.get("seconds")),
                      key=lambda r: r["context"])
    if longest_ctx["context"] > b1["context"] and longest_ctx["fraction_of_copy"] < 0.5 * (
            big["fraction_of_copy"] if by_batch else 1):
        lines.append(
            f"At batch 1 and {longest_ctx['context']:,} tokens of context the cache is "
            f"{longest_ctx['cache_share']:.0%} of the read, and the step reached only "
            f"{longest_ctx['fraction_of_copy']:.0%} of the copy rate: one sequence gives the attention kernel few "
            f"independent pieces of work (one per KV head), most likely too few to keep the whole GPU reading. Decode kernels "
            f"that also split the keys across thread blocks (split-KV, or flash-decoding) exist for this case.")
    return lines


# --- planning arithmetic ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTimes:
    """Estimated GPU time of one batch of requests, split into its two phases (seconds)."""

    prefill: float  # every prompt in the batch, prefilled at ``mfu`` of peak
    decode: float  # the decode steps after the first token, each at the roofline's limit

    @property
    def total(self) -> float:
        return self.prefill + self.decode

    @property
    def prefill_share(self) -> float:
        return self.prefill / self.total

    @property
    def decode_share(self) -> float:
        return self.decode / self.total


def request_phase_times(
    cfg,
    prompt_tokens: int,
    output_tokens: int,
    *,
    peak_flops: float,
    bandwidth: float,
    batch: int = 1,
    mfu: float = 0.4,
    bandwidth_efficiency: float = 0.75,
    causal: bool = False,
) -> RequestTimes:
    """How long a batch of identical requests spends in prefill and in decode.

    Conventions (the runbook's planning ones, stated so they can be changed):

    * prefill runs at ``mfu`` of ``peak_flops`` (40% is the usual planning figure for a tuned
      server) and the batch's prompts are prefilled one after another: ``batch *
      prefill_flops(cfg, prompt_tokens, causal) / (mfu * peak_flops)``;
    * the prefill pass yields the first token, then ``output_tokens - 1`` decode steps follow;
      the step at context ``c`` takes the longer of its memory time, bf16 weights plus every
      cache (:func:`labsupport.costs.decode_step_bytes`) over ``bandwidth_efficiency *
      bandwidth``, and its arithmetic time at ``mfu`` of peak.
    """
    prompt_tokens = positive_int("prompt_tokens", prompt_tokens)
    output_tokens = positive_int("output_tokens", output_tokens)
    batch = positive_int("batch", batch)
    peak_flops = positive_number("peak_flops", peak_flops)
    bandwidth = positive_number("bandwidth", bandwidth)
    for name, value in (("mfu", mfu), ("bandwidth_efficiency", bandwidth_efficiency)):
        if positive_number(name, value) > 1:
            raise ValueError(f"{name} is a fraction of the peak and must be at most 1, got {value}")
    flops_rate, bytes_rate = mfu * peak_flops, bandwidth_efficiency * bandwidth
    prefill = batch * costs.prefill_flops(cfg, prompt_tokens, causal=causal) / flops_rate
    decode = 0.0
    for context in range(prompt_tokens, prompt_tokens + output_tokens - 1):
        memory = costs.decode_step_bytes(cfg, batch, context).total / bytes_rate
        compute = costs.decode_step_flops(cfg, batch, context) / flops_rate
        decode += max(memory, compute)
    return RequestTimes(prefill=prefill, decode=decode)


# --- batching -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheduled:
    """One request's place in a batch schedule: decode steps ``start`` to ``end - 1`` in ``slot``."""

    request: int
    slot: int
    start: int
    end: int


def simulate_batching(output_lengths, slots: int, policy: str = "continuous") -> list[Scheduled]:
    """Schedule a backlog of requests (all waiting at step 0) onto ``slots`` batch slots.

    Each request needs ``output_lengths[i]`` decode steps; every step serves one token to each
    busy slot. ``policy="static"`` starts a batch of ``slots`` requests and admits nobody until
    the longest of them has finished; ``"continuous"`` (iteration-level scheduling, Yu et al.,
    OSDI 2022) refills a slot at the step after its request finishes. Requests are admitted in
    order. Returns one :class:`Scheduled` per request, in request order.
    """
    lengths = _lengths(output_lengths, "output_lengths")
    slots = positive_int("slots", slots)
    if policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
    out: list[Scheduled] = []
    if policy == "static":
        start = 0
        for first in range(0, len(lengths), slots):
            group = lengths[first : first + slots]
            out += [Scheduled(first + i, i, start, start + n) for i, n in enumerate(group)]
            start += max(group)
        return out
    free_at = [0] * slots  # step at which each slot becomes free
    for i, n in enumerate(lengths):
        slot = min(range(slots), key=lambda s: (free_at[s], s))
        out.append(Scheduled(i, slot, free_at[slot], free_at[slot] + n))
        free_at[slot] += n
    return out


def completed_by(schedule: list[Scheduled], step: int) -> int:
    """How many requests of ``schedule`` have finished by ``step``."""
    return sum(1 for s in schedule if s.end <= step)
