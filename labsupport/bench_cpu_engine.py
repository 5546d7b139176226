"""Chapters 12 and 13 on a CPU with the real model: the engine at its bound, against static batching.

``python -m labsupport.bench_engine --cpu-real-model`` (about 5-11 minutes on a quiet 2-core machine)
loads SmolLM2-135M-Instruct (:func:`labsupport.checkpoints.load`, the Q4_1 GGUF dequantised to
float32) and measures, in one process, with torch's threads on every core, greedy, end-of-text
ignored, each figure the median of :data:`REPEATS` runs taken in turn (run 1 of every
configuration, then run 2, ...):

* **each format's bandwidth bound** of batch-1 decode: the weights' bytes a decode step reads
  (:func:`labsupport.cpu_linear.step_weight_bytes`: a tied embedding once, as the output head reads it;
  int8: the codes and scales) over the fastest read of a buffer of that many bytes, again and again
  (:func:`read_rates`: the faster of ``torch.sum`` and the C library's read loop,
  :func:`labsupport.cpu_decode.read_floats`, which software-prefetches 8 KiB ahead), and the memory's
  read bandwidth the same way over 1 GiB. Both are measured before the runs and after each, the best
  taken: a virtual machine's neighbours lower some measurements (on the course's AMD EPYC VM three
  runs of 2026-12-07 measured 33.2, 29.4 and 23.3 GB/s with ``torch.sum``). The size matters where the
  last-level cache is large: on an Intel Xeon VM with a 300 MiB L3 (a run of 2026-12-07 04:42 UTC), the
  135 MB of int8 weights were read at 67-69 GB/s and 1 GiB at 36-38, so a bound set by the memory's
  bandwidth alone would have put the fused bfloat16 step at 124% of it. Where the weights about fill the
  cache (269 MB of bfloat16: read at 49-65 GB/s in that run, at 36-38 in one of 06:08 UTC and 41-48 in
  the committed one of 06:31 UTC) the bound moves with how much of the cache the neighbours leave, and
  the file keeps every sample (``read_rate_samples_Bps``);
* **batch-1 decode** (tokens per second after the first token): the course engine
  (:class:`labsupport.engine.Engine`, one request), the course's ``generate`` loop
  (:meth:`~labsupport.transformer.Transformer.prefill`, then one
  :meth:`~labsupport.transformer.Transformer.decode_step` per token), each in float32 as loaded,
  in float32 packed for the CPU, in bfloat16 packed (:func:`labsupport.cpu_linear.prepack`) and in chapter 09's
  weight-only int8 (``prepack(model, "int8")``, bfloat16 activations), the engine again with its
  fused C step (``cpu_decode="fused"``, :mod:`labsupport.cpu_decode`: float32 activations, int16
  into int8 products) in the
  three packed formats, and
  ``transformers``' ``generate`` (float32, the same weights copied into ``LlamaForCausalLM``);
  llama.cpp on the GGUF file only where ``llama_cpp`` is importable (it is not a dependency);
* **16 equal requests** (random prompts of :data:`EQUAL_PROMPT` tokens, :data:`EQUAL_OUTPUT` tokens
  each, all at time 0): the engine (float32 packed; a step that only decodes, up to 16 requests, runs
  the fused C step, on both traces) against ``transformers``' static batching (one left-padded
  batch), output tokens per second and TTFT;
* **a varied trace** (:data:`VARIED`: Poisson arrivals, outputs from 16 to 256 tokens): the engine
  (continuous batching, at most :data:`STATIC_BATCH` requests at once) against static batching that
  waits until its batch of :data:`STATIC_BATCH` has arrived (or no request is left to come) and
  runs it to its longest request; only each request's own tokens count (useful tokens). Both on a virtual clock that
  advances by measured compute time (the engine's steps; each ``generate`` call), so waiting for an
  arrival costs no wall time;
* **a profile of one batch-1 decode step** of the engine in each packed format (:func:`profile_decode`,
  torch's profiler): the matrix products' time and read rate, attention's, and every other operator's,
  with the operator calls per step (where a step stands far from its bound, this says why);
* **perplexity** of float32, bfloat16 and int8 on the course's held-out text
  (:func:`labsupport.perplexity.token_nll`, windows of 512), and of bfloat16 and int8 through the
  fused C step (every position decoded in turn: :func:`labsupport.cpu_decode.teacher_forced_logits`).

Torch's two threads on a 2-core machine collapse when another process is busy (decode measured
24 -> 2 tokens/s), so :func:`machine_load` looks first (load average, and each core's busy share
over two seconds of ``/proc/stat``) and the run refuses a busy machine unless ``--anyway`` is
given; the CPU time other processes took during the run is measured too, and the file says
``"quiet": true`` only when both were quiet. Results: ``results/cpu_engine.json`` (machine, date,
versions), read by chapters 12 and 13 through :func:`load_results`; ``--quick`` runs toy sizes in
seconds (the test) and writes a file marked ``"quick": true`` that the book never shows.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import cpu_decode, cpu_linear, perplexity
from .checkpoints import hf_names, load
from .engine import Engine, TraceRequest, poisson_trace, run_trace, trace_summary
from .models import to_hf_config
from .real_model_figures import cpu_name
from .sampling import SamplingParams

__all__ = ["RESULTS_PATH", "TARGETS", "machine_load", "read_bandwidth", "measure", "load_results", "verdicts",
           "results_markdown", "main"]

RESULTS_PATH = Path(__file__).resolve().parent.parent / "results" / "cpu_engine.json"
MODEL = "smollm2-135m-instruct"
REPEATS = 3
B1_PROMPT, B1_TOKENS = 64, 64  # batch-1 decode: prompt tokens, generated tokens
EQUAL_REQUESTS, EQUAL_PROMPT, EQUAL_OUTPUT = 16, 64, 128
VARIED = dict(n=16, rate=4.0, prompt_lens=(32, 48, 64, 96, 128), output_lens=tuple(range(16, 257, 16)))
STATIC_BATCH = 8  # static batching's batch on the varied trace
ENGINE = dict(block_size=16, token_budget=512)  # the engine's cache blocks and tokens per step
PPL_TOKENS, PPL_WINDOW = 2048, 512
QUICK = dict(b1_tokens=4, equal=(3, 8, 4), varied=dict(n=4, rate=50.0, prompt_lens=(8, 12), output_lens=(2, 6)),
             static_batch=2, ppl=(64, 32), repeats=1, bandwidth_bytes=2**24, profile_steps=2)
QUIET_LOAD, QUIET_BUSY, QUIET_OTHERS = 1.5, 0.15, 0.05  # load average, a core's busy share, others' CPU share
FUSED = ("float32 packed", "bfloat16 packed", "int8 weight-only")  # formats timed with the fused C step too
TARGETS = {  # name: (what, threshold); the engine at batch 1: its fused C step (labsupport.cpu_decode)
    "b1_engine_vs_generate_fp32": ("batch-1 decode, fused engine / generate, float32 packed", 1.0),
    "b1_bound_fp32": ("batch-1 decode, fused engine / bandwidth bound, float32 packed", 0.75),
    "b1_engine_vs_generate_bf16": ("batch-1 decode, fused engine / generate, bfloat16 packed", 1.0),
    "b1_bound_bf16": ("batch-1 decode, fused engine / bandwidth bound, bfloat16 packed", 0.75),
    "b1_engine_vs_generate_int8": ("batch-1 decode, fused engine / generate, int8 weight-only", 1.0),
    "b1_bound_int8": ("batch-1 decode, fused engine / bandwidth bound, int8 weight-only", 0.75),
    "equal_vs_static": ("16 equal requests, engine (decode steps fused) / transformers static batching "
                        "(float32)", 1.2),
    "varied_vs_static": ("varied trace, engine (decode steps fused) / transformers static batching (float32), "
                         "useful tokens", 1.5),
    "varied_ttft_p50": ("varied trace, TTFT p50, static / engine (at least 1: no worse)", 1.0),
}


# --- the machine -----------------------------------------------------------------------------------


def _cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core, from /proc/stat."""
    rows = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:]]
                idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
                rows.append((sum(v) - idle, sum(v)))
    return rows


def _self_jiffies() -> int:
    """This process's CPU time (all its threads), in jiffies."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def machine_load(seconds: float = 2.0) -> dict:
    """Whether the machine is quiet: the 1-minute load average and each core's busy share over
    ``seconds`` (this process idle meanwhile)."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    busy = [round((a[0] - b[0]) / max(1, a[1] - b[1]), 3) for a, b in zip(after, before)]
    load1 = os.getloadavg()[0]
    return {"load_average_1min": round(load1, 2), "core_busy": busy,
            "quiet": load1 < QUIET_LOAD and max(busy, default=0) < QUIET_BUSY}


class OthersMeter:
    """The share of the machine's CPU time that other processes used between :meth:`start` and
    :meth:`share` (every core's busy jiffies, less this process's own)."""

    def start(self) -> OthersMeter:
        self.cores, self.own, self.t = _cpu_times(), _self_jiffies(), time.time()
        return self

    def share(self) -> float:
        cores, own = _cpu_times(), _self_jiffies()
        busy = sum(a[0] - b[0] for a, b in zip(cores, self.cores))
        total = sum(a[1] - b[1] for a, b in zip(cores, self.cores))
        return max(0.0, busy - (own - self.own)) / max(1, total)


def read_bandwidth(nbytes: int = 2**30, repeats: int = 5, reader: str = "torch") -> float:
    """Bytes per second read from a float32 tensor of ``nbytes`` (median of ``repeats`` after one
    warm-up) by ``torch.sum`` with torch's threads (``reader="torch"``) or by the C library's plain read
    loop (``"c"``: :func:`labsupport.cpu_decode.read_floats`, same threads, software-prefetching 8 KiB ahead)."""
    x = torch.ones(nbytes // 256 * 64)
    read = x.sum if reader == "torch" else (lambda: cpu_decode.read_floats(x))
    read()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def _c_reader() -> bool:
    try:
        cpu_decode.build()
        return True
    except RuntimeError:  # no C compiler: torch.sum alone
        return False


def read_rates(sizes: dict[str, int], repeats: int = 5) -> dict[str, float]:
    """For each label, the fastest read of a buffer of that many bytes, again and again as a decode
    step reads its weights (the best of ``torch.sum`` and the C read loop, where it builds): a weight
    set that fits in the last-level cache is read faster than one that streams from memory."""
    readers = ("torch", "c") if _c_reader() else ("torch",)
    return {label: max(read_bandwidth(n, repeats, r) for r in readers) for label, n in sizes.items()}


def _flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "hypervisor")
                            if f in have]
    except OSError:
        pass
    return []


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- the runs --------------------------------------------------------------------------------------


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, max_running: int, need_tokens: int, clock: str = "virtual", cpu_decode: str = "torch") -> Engine:
    blocks = max_running * -(-need_tokens // ENGINE["block_size"]) + 8
    return Engine(model, num_blocks=blocks, block_size=ENGINE["block_size"], token_budget=ENGINE["token_budget"],
                  max_running=max_running, clock=clock, prefix_caching=False, cpu_decode=cpu_decode)


def engine_decode(model, prompt: list[int], tokens: int, cpu_decode: str = "torch") -> float:
    """Batch-1 decode tokens per second of the engine: one request, timed from its first token.
    ``cpu_decode="fused"``: its decode steps are the C step (:mod:`labsupport.cpu_decode`)."""
    engine = _engine(model, 1, len(prompt) + tokens, clock="wall", cpu_decode=cpu_decode)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens))
    engine.step()  # the prompt: the first token
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (tokens - 1) / (time.perf_counter() - t0)


PRODUCT_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


def profile_decode(model, prompt: list[int], steps: int = 5) -> dict:
    """Where a batch-1 decode step of the engine spends its time, from torch's profiler over ``steps``
    steps (after a warm-up): milliseconds per step of the matrix products (:data:`PRODUCT_OPS`), of
    attention (:data:`ATTENTION_OPS`) and of every other operator's own time, the operator calls per step,
    and the weights' read rate of the products (the bytes a step reads over their time). Under the
    profiler a step runs slower than without it; the wall time per step is measured without it (the
    median of three timings). ``plain_rows``: what :func:`labsupport.cpu_linear.prepack` chose for a oneDNN
    model (1: batch-1 rows on the plain weight)."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model, 1, len(prompt) + 6 * steps + 8, clock="wall")
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6 * steps + 4))
    for _ in range(steps + 1):  # the prompt, then warm decode steps
        engine.step()
    walls = []
    for _ in range(3):  # the median of three timings of `steps` steps
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        walls.append((time.perf_counter() - t0) / steps)
    wall = statistics.median(walls)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    ms = {"products": 0.0, "attention": 0.0, "other operators": 0.0}
    for e in events:
        kind = "products" if e.key in PRODUCT_OPS else "attention" if e.key in ATTENTION_OPS else "other operators"
        ms[kind] += e.self_cpu_time_total / 1e3 / steps
    plain = {m.plain_rows for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)}
    return {"wall_ms": wall * 1e3, "ms": ms, "operator_calls": sum(e.count for e in events) / steps,
            "plain_rows": max(plain) if plain and cpu_linear.packed_format(model) == "onednn" else None,
            "products_GBps": cpu_linear.step_weight_bytes(model) / (ms["products"] / 1e3) / 1e9}


@torch.no_grad()
def generate_decode(model, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode tokens per second of the course's ``generate`` loop, timed after the prefill."""
    cache = model.new_cache(1, len(prompt) + tokens)
    logits = model.prefill(torch.tensor([prompt]), cache)
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        logits = model.decode_step(logits.argmax(-1, keepdim=True), cache)
    return (tokens - 1) / (time.perf_counter() - t0)


def transformers_model(model):
    """``transformers``' ``LlamaForCausalLM`` holding ``model``'s float32 weights (the same numbers, its
    own code), or None where transformers is missing."""
    try:
        from .anatomy import hf_model  # imports transformers, an optional dependency of this measurement
        hf = hf_model(to_hf_config(model.cfg), device="cpu")
    except ImportError:
        return None
    state = model.state_dict()
    missing, unexpected = hf.load_state_dict(
        {hf_name: state[name].float() for hf_name, name in hf_names(model.cfg).items()}, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"the course's weights do not fill LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def _first_token_timer():
    """A transformers logits processor that notes the time of its first call: the first token's logits."""
    seen: list[float] = []

    def processor(input_ids, scores):
        if not seen:
            seen.append(time.perf_counter())
        return scores

    return processor, seen


@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """One left-padded static batch through ``generate``, every row to ``tokens``: (seconds to the
    first token, seconds in all)."""
    from transformers import LogitsProcessorList  # optional dependency (see transformers_model)

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    processor, seen = _first_token_timer()
    t0 = time.perf_counter()
    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([processor]))
    end = time.perf_counter()
    return seen[0] - t0, end - t0


def hf_decode(hf, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode tokens per second of transformers' ``generate``, timed after the first token."""
    first, total = hf_generate(hf, [prompt], tokens)
    return (tokens - 1) / (total - first)


def llama_cpp_decode(path: str, prompt: list[int], tokens: int, threads: int, timeout: float = 900) -> float | None:
    """Batch-1 decode tokens per second of llama.cpp on the GGUF file (None where ``llama_cpp`` is
    not importable), in a child process: a crash inside llama.cpp ends the child, not the bench (seen:
    a llama-cpp-python 0.3.36 built with ``-march=native`` on a Xeon VM that lists AMX but does not let
    a process use it died of SIGILL in its AMX kernels). Raises RuntimeError with the child's end."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    code = "import json, sys; from labsupport.bench_cpu_engine import _llama_cpp_run; print(_llama_cpp_run(*json.load(sys.stdin)))"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps([path, prompt, tokens, threads]),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        end = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise RuntimeError(f"llama.cpp's process ended with {end}: {proc.stderr.strip()[-300:]}")
    return float(proc.stdout.split()[-1])


def _llama_cpp_run(path: str, prompt: list[int], tokens: int, threads: int) -> float:
    """llama_cpp_decode's child: the first token's time from a one-token run, subtracted."""
    import llama_cpp  # optional: not a course dependency

    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + tokens + 8, n_threads=threads, n_batch=512,
                          verbose=False, use_extra_bufts=False)  # AMX repacking of Q4_1 crashes (TOOLCHAIN.md)

    def run(n):
        llm.reset()
        t0 = time.perf_counter()
        out = 0
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            out += 1
            if out == n:
                break
        return time.perf_counter() - t0

    run(2)
    first = run(1)
    return (tokens - 1) / (run(tokens) - first)


def engine_trace(model, trace: list[TraceRequest], max_running: int, cpu_decode: str = "fused") -> dict:
    """The engine replaying ``trace`` on a virtual clock, at most ``max_running`` requests at once
    (a step that only decodes as the fused C step by default): useful tokens per second and TTFT p50."""
    need = max(len(t.prompt_ids) + t.params.max_tokens for t in trace)
    engine = _engine(model, max_running, need, cpu_decode=cpu_decode)
    s = trace_summary(run_trace(engine, trace))
    return {"tokens": s["output_tokens"], "seconds": s["makespan"], "tokens_per_s": s["throughput"],
            "ttft_p50_s": s["ttft"].p50}


def static_trace(hf, trace: list[TraceRequest], batch: int) -> dict:
    """Static batching on a virtual clock: a batch waits until ``batch`` requests have arrived (or
    none is left to come), runs to its longest request; useful tokens per second and TTFT p50."""
    pending = sorted(trace, key=lambda t: t.arrival_s)
    clock, tokens, ttfts = 0.0, 0, []
    start = pending[0].arrival_s
    while pending:
        group = pending[:batch]
        pending = pending[batch:]
        clock = max(clock, group[-1].arrival_s)  # the batch is full (or the trace has ended)
        first, total = hf_generate(hf, [list(t.prompt_ids) for t in group], max(t.params.max_tokens for t in group))
        ttfts += [clock + first - t.arrival_s for t in group]
        clock += total
        tokens += sum(t.params.max_tokens for t in group)
    return {"tokens": tokens, "seconds": clock - start, "tokens_per_s": tokens / (clock - start),
            "ttft_p50_s": statistics.median(ttfts)}


@torch.no_grad()
def same_answers(models: dict, hf, prompt: list[int], tokens: int) -> dict:
    """What makes the comparison fair, checked before timing: the engine's greedy tokens equal the
    course's ``generate`` on each model, and the largest logit difference of the packed models and
    of transformers' copy from the float32 model as loaded, on ``prompt``."""
    out = {}
    want = models["float32"].prefill(torch.tensor([prompt]), models["float32"].new_cache(1, len(prompt)))
    for label, model in models.items():
        engine = _engine(model, 1, len(prompt) + tokens, clock="steps")
        (got,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens))
        alone = model.generate(torch.tensor([prompt]), tokens)[0, len(prompt):].tolist()
        out[f"engine equals generate, {label}"] = got == alone
        if model.dtype == torch.float32:  # the C step computes in float32: the same greedy tokens, up to ties
            engine = _engine(model, 1, len(prompt) + tokens, clock="steps", cpu_decode="fused")
            (got,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens))
            out[f"fused engine equals generate, {label}"] = got == alone
            # four requests together: the traces' batched C steps
            prompts = [prompt] + [_prompt(len(prompt) - 8 * i, 10 + i, model.cfg.vocab_size) for i in (1, 2, 3)]
            engine = _engine(model, 4, len(prompt) + tokens, clock="steps", cpu_decode="fused")
            got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens))
            alone_each = [model.generate(torch.tensor([q]), tokens)[0, len(q):].tolist() for q in prompts]
            out[f"fused engine, 4 requests together, equals generate, {label}"] = got == alone_each
        logits = model.prefill(torch.tensor([prompt]), model.new_cache(1, len(prompt)))
        out[f"max logit difference, {label}"] = float((logits - want).abs().max())
    if hf is not None:
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        out["max logit difference, transformers float32"] = float((logits - want[0]).abs().max())
    return out


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure(quick: bool = False, log=print, lm=None) -> dict:
    """Every figure of the module docstring, as the results dictionary; ``lm``: the model already
    loaded (:func:`labsupport.checkpoints.load` of :data:`MODEL`), else it is loaded here."""
    sizes = QUICK if quick else {}
    repeats = sizes.get("repeats", REPEATS)
    started = time.time()
    others = OthersMeter().start()
    bandwidth_bytes = sizes.get("bandwidth_bytes", 2**30)
    lm = load(MODEL, verbose=False) if lm is None else lm
    ref = lm.model
    vocab = ref.cfg.vocab_size
    models = {"float32": ref, "float32 packed": cpu_linear.prepack(copy.deepcopy(ref)),
              "bfloat16 packed": cpu_linear.prepack(copy.deepcopy(ref).to(torch.bfloat16)),
              "int8 weight-only": cpu_linear.prepack(copy.deepcopy(ref).to(torch.bfloat16), "int8")}
    hf = transformers_model(ref)
    weight_bytes = {label: cpu_linear.step_weight_bytes(m) for label, m in models.items()}
    gguf_bytes = Path(lm.source).stat().st_size
    read_sizes = {"memory": bandwidth_bytes, **weight_bytes, "the GGUF file": gguf_bytes}
    if quick:  # toy sizes: the formats' rates at a fraction of their bytes
        read_sizes = {k: max(2**16, v // 64) for k, v in read_sizes.items()}
    samples = [read_rates(read_sizes)]  # again after each run: the best of each is the machine's
    log(f"read bandwidth: {samples[0]['memory'] / 1e9:.1f} GB/s")
    prompt = _prompt(B1_PROMPT, 0, vocab)
    b1_tokens = sizes.get("b1_tokens", B1_TOKENS)
    n_eq, p_eq, o_eq = sizes.get("equal", (EQUAL_REQUESTS, EQUAL_PROMPT, EQUAL_OUTPUT))
    equal = [TraceRequest(0.0, tuple(_prompt(p_eq, 100 + i, vocab)), SamplingParams(temperature=0, max_tokens=o_eq))
             for i in range(n_eq)]
    varied = poisson_trace(vocab_size=vocab, seed=1, temperature=0.0, **sizes.get("varied", VARIED))
    static_batch = sizes.get("static_batch", STATIC_BATCH)
    checks = same_answers(models, hf, prompt, b1_tokens)
    log(f"checks: {checks}")
    runs: dict[str, list] = {}
    spent: dict[str, float] = {}  # wall seconds of each configuration, all runs (says where the time goes)

    def note(key, fn, *args):
        t0 = time.perf_counter()
        runs.setdefault(key, []).append(fn(*args))
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

    for r in range(repeats):  # interleaved: run r of every configuration, then run r + 1
        for label, model in models.items():
            note(f"b1 engine {label}", engine_decode, model, prompt, b1_tokens)
            if label in FUSED:
                note(f"b1 fused engine {label}", engine_decode, model, prompt, b1_tokens, "fused")
            note(f"b1 generate {label}", generate_decode, model, prompt, b1_tokens)
        if hf is not None:
            note("b1 transformers float32", hf_decode, hf, prompt, b1_tokens)
        note("equal engine", engine_trace, models["float32 packed"], equal, n_eq)
        note("varied engine", engine_trace, models["float32 packed"], varied, static_batch)
        if hf is not None:
            note("equal static", static_trace, hf, equal, n_eq)
            note("varied static", static_trace, hf, varied, static_batch)
        samples.append(read_rates(read_sizes))
        log(f"run {r + 1} of {repeats} done ({time.time() - started:.0f} s; read bandwidth {samples[-1]['memory'] / 1e9:.1f} GB/s)")
    rates = {k: max(sample[k] for sample in samples) for k in read_sizes}
    bandwidth = rates["memory"]
    llama_error = None
    try:  # optional, never installed by the course: a failure is recorded, not fatal
        llama = llama_cpp_decode(str(lm.source), prompt, b1_tokens, torch.get_num_threads())
    except Exception as exc:  # llama_cpp raises its own errors (a model it cannot load, a crash in decode)
        llama, llama_error = None, f"{type(exc).__name__}: {exc}"
    profiles = {label: profile_decode(models[label], prompt, sizes.get("profile_steps", 5))
                for label in ("float32 packed", "bfloat16 packed", "int8 weight-only")}
    share = others.share()
    ppl_tokens, window = sizes.get("ppl", (PPL_TOKENS, PPL_WINDOW))
    ids = lm.tokenizer.encode(perplexity.heldout_text())[:ppl_tokens]
    ppl = {label: perplexity.perplexity(perplexity.token_nll(models[label], ids, window))
           for label in ("float32", "bfloat16 packed", "int8 weight-only")}
    for label in ("bfloat16 packed", "int8 weight-only"):  # the C step's own activations (float32; int16 into int8 products): its own quality
        nll = perplexity.token_nll(models[label], ids, window, logits_of=cpu_decode.teacher_forced_logits)
        ppl[f"fused {label}"] = perplexity.perplexity(nll)
    b1 = {key[3:]: statistics.median(v) for key, v in runs.items() if key.startswith("b1 ")}
    if llama is not None:
        b1["llama.cpp (the GGUF file)"] = llama
    bounds = {label: rates[label] / nbytes for label, nbytes in weight_bytes.items()}
    bounds["transformers float32"] = bounds["float32"]
    bounds["llama.cpp (the GGUF file)"] = rates["the GGUF file"] / gguf_bytes
    traces = {key: _median(v) for key, v in runs.items() if not key.startswith("b1 ")}
    return {
        "format": "labsupport-cpu-engine", "quick": quick, "model": MODEL,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "flags": _flags(),
                    "torch_threads": torch.get_num_threads(), "os": platform.platform(terse=True),
                    "python": platform.python_version()},
        "versions": {p: _version(p) for p in ("torch", "transformers", "numpy", "llama_cpp_python")},
        "read_bandwidth_Bps": bandwidth, "read_bandwidth_samples_Bps": [x["memory"] for x in samples],
        "read_rate_Bps": rates, "read_rate_samples_Bps": samples, "weight_bytes": weight_bytes,
        "gguf_bytes": gguf_bytes,
        "bound_tokens_per_s": bounds, "b1_tokens_per_s": b1, "traces": traces,
        "perplexity": {"values": ppl, "tokens": len(ids), "window": window, "text": perplexity.heldout_identity()},
        "profile": profiles, "llama_cpp_error": llama_error, "checks": checks, "part_seconds": {k: round(v, 1) for k, v in spent.items()}, "repeats": repeats, "others_cpu_share": round(share, 4), "seconds": round(time.time() - started, 1),
        "sizes": {"b1": [B1_PROMPT, b1_tokens], "equal": [n_eq, p_eq, o_eq],
                  "varied": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.get("varied", VARIED).items()},
                  "static_batch": static_batch, "engine": ENGINE},
        "conventions": "greedy, end-of-text ignored; medians of `repeats` runs taken in turn; batch-1 tokens/s "
                       "after the first token; traces on a virtual clock advanced by measured compute; useful "
                       "tokens only (static batching's padding and the tokens past a request's own length are "
                       "not counted); bound: the weights' bytes a decode step reads (a tied embedding once; int8: "
                       "codes and scales, cpu_linear.step_weight_bytes) over the read rate of a float32 buffer of "
                       "the same bytes (the faster of torch.sum and the C read loop, cpu_decode.read_floats, median "
                       "of 5; measured before the runs and after each, the best taken); read bandwidth: the same "
                       "over 1 GiB",
    }


def _ratio(b1: dict, num: str, den: str | None, value: float | None = None) -> float | None:
    """``b1[num] / b1[den]`` (or ``/ value``); None where a run before int8 weights has no such row."""
    top, bottom = b1.get(num), (b1.get(den) if den is not None else value)
    return None if top is None or not bottom else top / bottom


def verdicts(results: dict) -> dict:
    """Each target of :data:`TARGETS`: its ratio and whether it is met (None where not measured)."""
    b1, bound, tr = results["b1_tokens_per_s"], results["bound_tokens_per_s"], results["traces"]
    engine = "fused engine" if "fused engine float32 packed" in b1 else "engine"  # a run before the C step: torch's
    ratios = {
        "b1_engine_vs_generate_fp32": b1[f"{engine} float32 packed"] / b1["generate float32 packed"],
        "b1_bound_fp32": b1[f"{engine} float32 packed"] / bound["float32 packed"],
        "b1_engine_vs_generate_bf16": b1[f"{engine} bfloat16 packed"] / b1["generate bfloat16 packed"],
        "b1_bound_bf16": b1[f"{engine} bfloat16 packed"] / bound["bfloat16 packed"],
        "b1_engine_vs_generate_int8": _ratio(b1, f"{engine} int8 weight-only", "generate int8 weight-only"),
        "b1_bound_int8": _ratio(b1, f"{engine} int8 weight-only", None, bound.get("int8 weight-only")),
        "equal_vs_static": None, "varied_vs_static": None, "varied_ttft_p50": None,
    }
    if "equal static" in tr:
        ratios["equal_vs_static"] = tr["equal engine"]["tokens_per_s"] / tr["equal static"]["tokens_per_s"]
        ratios["varied_vs_static"] = tr["varied engine"]["tokens_per_s"] / tr["varied static"]["tokens_per_s"]
        ratios["varied_ttft_p50"] = tr["varied static"]["ttft_p50_s"] / tr["varied engine"]["ttft_p50_s"]
    return {k: {"what": TARGETS[k][0], "target": TARGETS[k][1], "ratio": v,
                "met": None if v is None else v >= TARGETS[k][1]} for k, v in ratios.items()}


# --- the book's view -------------------------------------------------------------------------------


def load_results(path: Path | str = RESULTS_PATH) -> dict | None:
    """The committed results, or None: no file, a quick run, or a run on a busy machine (its
    timings are not the machine's)."""
    path = Path(path)
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != "labsupport-cpu-engine":
        raise ValueError(f"{path} is not a results file of python -m labsupport.bench_engine --cpu-real-model; "
                         f"run it again or delete the file")
    return None if data.get("quick") or not data.get("quiet") else data


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _rate_cell(results: dict, key: str | None) -> str:
    """A bound's read rate in GB/s, the best and the range of the run's measurements ("35.6 (35.2-35.6)");
    a run before per-size rates: the memory's bandwidth."""
    if key is None:
        return "-"
    if "read_rate_Bps" not in results:
        return f"{results['read_bandwidth_Bps'] / 1e9:.1f}"
    seen = [sample[key] / 1e9 for sample in results["read_rate_samples_Bps"]]
    return f"{results['read_rate_Bps'][key] / 1e9:.1f} ({min(seen):.1f}-{max(seen):.1f})"


def results_markdown(results: dict | None) -> str:
    """The table of the issue (batch-1 decode and its bound; the two traces; the profile of a batch-1
    step per packed format, where the run has one), with machine and date, or "not yet measured"."""
    if not results:
        return ("**Not yet measured** on a quiet machine: `python -m labsupport.bench_engine --cpu-real-model` "
                "writes `results/cpu_engine.json`.")
    b1, bound, tr, m = results["b1_tokens_per_s"], results["bound_tokens_per_s"], results["traces"], results["machine"]
    vm = ", a virtual machine" if "hypervisor" in m.get("flags", ()) else ""
    samples = results.get("read_bandwidth_samples_Bps") or [results["read_bandwidth_Bps"]]
    best = f", the best of {len(samples)} measurements" if len(samples) > 1 else ""
    how = ("; each format's bound: its weights' bytes per token over the fastest read of that many bytes, the "
           "read rate column" if "read_rate_Bps" in results else "; bound: the weights' bytes per token over that bandwidth")
    versions = results["versions"]
    llama = f", llama-cpp-python {versions['llama_cpp_python']}" if versions.get("llama_cpp_python") else ""
    lines = [f"Measured on {m['cpu']} ({m['cores']} cores{vm}, {m['torch_threads']} torch threads, memory read bandwidth "
             f"{results['read_bandwidth_Bps'] / 1e9:.1f} GB/s over 1 GiB{best}{how}), {results['date']}, torch "
             f"{versions['torch']}, transformers {versions['transformers']}{llama}; {results['model']}, greedy, "
             f"end-of-text ignored, medians of {results['repeats']} runs.", "",
             "| batch-1 decode | tokens/s | read rate, GB/s: best (all measurements) | bandwidth bound | share of the bound |",
             "| --- | --- | --- | --- | --- |"]
    size_of = {"transformers float32": "float32", "llama.cpp (the GGUF file)": "the GGUF file"}
    for label, tps in b1.items():
        fmt = next((f for f in bound if label.endswith(f)), None)
        share = f"{tps / bound[fmt]:.0%}" if fmt else "-"
        lines.append(f"| {label} | {_tps(tps)} | {_rate_cell(results, size_of.get(fmt, fmt))} | "
                     f"{_tps(bound.get(fmt))} | {share} |")
    lines += ["", "| trace (useful tokens) | engine, float32 packed, fused decode steps (tokens/s) | transformers static batching, "
              "float32 (tokens/s) | engine / static | TTFT p50 engine / static (s) |", "| --- | --- | --- | --- | --- |"]
    n_equal, out_lens = results["sizes"]["equal"][0], results["sizes"]["varied"]["output_lens"]
    for key, name in (("equal", f"{n_equal} equal requests"),
                      ("varied", f"varied (Poisson, outputs {min(out_lens)}-{max(out_lens)})")):
        e, s = tr[f"{key} engine"], tr.get(f"{key} static")
        if s:
            lines.append(f"| {name} | {_tps(e['tokens_per_s'])} | {_tps(s['tokens_per_s'])} | "
                         f"{e['tokens_per_s'] / s['tokens_per_s']:.2f}x | {e['ttft_p50_s']:.2f} / {s['ttft_p50_s']:.2f} |")
        else:
            lines.append(f"| {name} | {_tps(e['tokens_per_s'])} | not measured | - | - |")
    ppl = results["perplexity"]["values"]
    if results.get("profile"):
        lines += ["", "| batch-1 decode step, engine (torch's profiler) | wall ms | matrix products ms (read rate) | "
                  "attention ms | other operators ms | operator calls |", "| --- | --- | --- | --- | --- | --- |"]
        for label, prof in results["profile"].items():
            ms = prof["ms"]
            row = " (batch-1 rows on the plain weight)" if prof.get("plain_rows") == 1 else ""
            lines.append(f"| {label}{row} | {prof['wall_ms']:.1f} | {ms['products']:.1f} ({prof['products_GBps']:.1f} GB/s) | "
                         f"{ms['attention']:.1f} | {ms['other operators']:.1f} | {prof['operator_calls']:,.0f} |")
    int8 = f", int8 weight-only {ppl['int8 weight-only']:.3f}" if "int8 weight-only" in ppl else ""
    fused = "".join(f", {label} through the fused C step {ppl[f'fused {label}']:.3f}"
                    for label in ("bfloat16 packed", "int8 weight-only") if f"fused {label}" in ppl)
    lines += ["", f"Perplexity on the held-out text ({results['perplexity']['tokens']:,} tokens, windows of "
              f"{results['perplexity']['window']}): float32 {ppl['float32']:.3f}, bfloat16 {ppl['bfloat16 packed']:.3f}"
              f"{int8}{fused} (the fused step computes in float32 between the weights, an int8 product's input "
              f"rounded to int16; torch's bfloat16 and int8 paths in bfloat16)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.bench_engine --cpu-real-model",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(RESULTS_PATH), help=f"results file ({RESULTS_PATH.name} in results/)")
    p.add_argument("--quick", action="store_true", help="toy sizes in seconds (a test); the book never shows it")
    p.add_argument("--anyway", action="store_true", help="measure on a busy machine too (the file says quiet: false)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core; --quick: one)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or (1 if args.quick else os.cpu_count() or 1))
    before = machine_load(0.5 if args.quick else 2.0)
    print(f"machine: {cpu_name()}, load average {before['load_average_1min']}, cores busy {before['core_busy']}",
          flush=True)
    if not before["quiet"] and not (args.anyway or args.quick):
        print("the machine is busy (another process uses a core): torch's threads would collapse and the figures "
              "would not be this machine's. Wait until it is quiet, or pass --anyway to measure and mark the file "
              "\"quiet\": false.", file=sys.stderr)
        return 2
    results = measure(quick=args.quick)
    results["load_before"] = before
    results["quiet"] = bool(before["quiet"] and results["others_cpu_share"] < QUIET_OTHERS)
    results["verdicts"] = verdicts(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(results_markdown({**results, "quick": False, "quiet": True}))
    print(f"\nquiet: {results['quiet']} (other processes took {results['others_cpu_share']:.1%} of the CPU during "
          f"the run); {results['seconds']:.0f} s; written to {out}")
    for name, ok in results["checks"].items():
        if name.startswith("engine equals") and not ok:
            print(f"  WARNING: {name} is False: the engine's greedy tokens differ from generate's", flush=True)
    for v in results["verdicts"].values():
        status = "not measured" if v["met"] is None else ("met" if v["met"] else "MISSED")
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.2f}"
        print(f"  {status:>12}: {v['what']}: {ratio} (target >= {v['target']})")
    return 0
