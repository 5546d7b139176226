"""Chapters 12 and 13's GPU measurement: the course engine against static batching and the roofline.

Run on a machine with an NVIDIA GPU, from the repository root::

    python -m labsupport.bench_engine --out results/gpu_engine.json
    python -m labsupport.bench_engine --dry-run --out /tmp/engine.json   # on a CPU, the tiny model:
                                                                        # checks the code, measures nothing

For each model shape (Qwen3-0.6B, Llama-3.2-1B, Llama-3.1-8B; random, seeded weights in bf16:
timing does not depend on their values) it records:

* **the trace** (the course model with its q/k/v and gate/up projections fused): ``requests`` requests arriving as a Poisson process at ``rate`` per second, prompt
  lengths drawn uniformly from :data:`PROMPT_LENS` and output lengths from :data:`OUTPUT_LENS`,
  every request generating exactly its output length (end-of-text ignored). The course engine
  (:class:`labsupport.engine.Engine`: continuous batching, chunked prefill, CUDA graphs for decode)
  replays it on a virtual clock that advances by each step's measured time: output tokens per
  second from the first arrival to the last token, and TTFT/TPOT percentiles;
* **static batching** in ``transformers`` on the same trace and a model of the same shape: a batch
  of up to ``max_running`` requests that have arrived is padded and generated to its longest
  output, the next batch formed when it has finished (the clock again advanced by measured time);
  skipped, and said so, where ``transformers`` is not installed;
* **the roofline bound of the engine's own steps**: each step's bytes (the weights once, of an
  untied input embedding only its tokens' rows; the cache its attention read and the keys and
  values it wrote) over the measured copy rate, or its FLOPs (two per weight of the layers per
  token, two per weight of the output head per sampled row, and the attention's four per
  query-key pair per head dimension) over
  the measured bf16 matmul rate, whichever is longer; the engine's measured time over the same
  steps against the sum of those bounds, for all steps and for those with a decode batch of 64 or
  more;
* **a decode-step sweep**: the engine's step time against the batch (every sequence at 512
  tokens of context), with its CUDA graphs and without, and the bytes a step reads over its time as
  a fraction of the copy rate;
* **the host time per step against the waiting queue** (the first model only; the dry run too):
  a step's wall time less its forward pass's, with 16, 64 and 256 requests waiting behind two
  decoding ones, every prompt sharing a 1,024-token cached prefix (:func:`host_time_per_step`).
  Work per waiting request per step (hashing its blocks, copying its history) makes it grow with
  the queue; the target is at most 1.5 times as long at 256 as at 16.

On a CPU, ``python -m labsupport.bench_engine --cpu-real-model`` measures the real model instead
(:mod:`labsupport.bench_cpu_engine`: the engine against the course's ``generate``, transformers'
static batching and the bandwidth bound; ``results/cpu_engine.json``).

Chapters 12 and 13 read ``results/gpu_engine.json`` (:func:`load_results`); until a real run is
committed every figure reads "not yet measured".
"""

from __future__ import annotations

import sys
import time

import torch

from . import bench_cpu_engine
from . import bench_harness as H
from .costs import kv_bytes_per_token
from .engine import Engine, TraceRequest, poisson_trace, run_trace, trace_summary
from .models import ModelConfig, from_hf_config, get_model, to_hf_config
from .roofline import measure_copy, measure_matmul
from .sampling import SamplingParams
from .transformer import Transformer

# Llama 3.2 1B (config.json of meta-llama/Llama-3.2-1B on the Hugging Face Hub): the shape only
LLAMA_32_1B = from_hf_config({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "num_hidden_layers": 16,
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}, name="llama-3.2-1b", source="config.json of meta-llama/Llama-3.2-1B on the Hugging Face Hub")

GPU_MODELS = ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b")
PROMPT_LENS = (128, 256, 384, 512, 640, 768, 896, 1024)
OUTPUT_LENS = (64, 128, 192, 256)
# (requests, arrivals per second, max_running, token_budget) on a GPU: a load that keeps the decode batch large
TRACES = {"qwen3-0.6b": (256, 64.0, 128, 2048), "llama-3.2-1b": (256, 64.0, 128, 2048),
          "llama-3.1-8b": (96, 32.0, 96, 2048), "tiny-2m": (6, 4.0, 4, 64)}
DRY = dict(prompt_lens=(8, 24), output_lens=(3, 5))
SWEEP_BATCHES = {"llama-3.2-1b": (1, 4, 16, 64, 128, 256), "llama-3.1-8b": (1, 4, 16, 64, 128),
                 "tiny-2m": (1, 2)}
SWEEP_CONTEXT, SWEEP_STEPS = 512, 20
BIG_DECODE = 64  # the target's "decode batch >= 64"
HOST_WAITING, HOST_PREFIX, HOST_STEPS = (16, 64, 256), 1024, 8  # host time per step against the waiting queue
HOST_RATIO_TARGET = 1.5  # the host time at 256 waiting over that at 16: at most this


def model_config(name: str) -> ModelConfig:
    return LLAMA_32_1B if name == LLAMA_32_1B.name else get_model(name)


# --- the roofline bound of a step ------------------------------------------------------------------


def weight_bytes_read(cfg: ModelConfig, weight_bytes: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of weights a step of ``tokens`` tokens reads: every matrix once, but of an input
    embedding table that is not also the output head only its tokens' rows (a lookup)."""
    if cfg.tied_embeddings:
        return weight_bytes
    row = cfg.d_model * dtype_bytes
    return weight_bytes - cfg.vocab_size * row + min(tokens, cfg.vocab_size) * row


def step_bound_seconds(cfg: ModelConfig, weight_bytes: int, step, copy_Bps: float, matmul_flops: float,
                       dtype_bytes: int = 2) -> float:
    """The shortest a step (a :class:`labsupport.engine.StepRecord`) could take on this device: its
    bytes over the copy rate or its FLOPs over the matmul rate, whichever is longer. Bytes: the
    weights once (:func:`weight_bytes_read`), the cache its attention read (``kv_tokens``) and the
    keys and values of its new tokens. FLOPs: two per weight of the layers per token, two per weight
    of the output head per row it ran on (each *sampled* sequence's last row, and with speculative
    decoding each draft token's row too; the input embedding is a lookup), and four per query-key pair per head dimension per head per layer
    (scores and the weighted sum)."""
    tokens = step.prefill_tokens + step.decode_tokens + step.draft_tokens
    kv = kv_bytes_per_token(cfg, dtype_bytes)
    nbytes = weight_bytes_read(cfg, weight_bytes, tokens, dtype_bytes) + (step.kv_tokens + tokens) * kv
    head = cfg.vocab_size * cfg.d_model  # the output head's weights (the input table too, if untied)
    layer_params = weight_bytes / dtype_bytes - head * (1 if cfg.tied_embeddings else 2)
    flops = (2 * layer_params * tokens + 2 * head * (step.sampled + step.draft_tokens)
             + 4 * step.attention_pairs * cfg.head_dim * cfg.n_heads * cfg.n_layers)
    return max(nbytes / copy_Bps, flops / matmul_flops)


def roofline_rows(cfg: ModelConfig, weight_bytes: int, steps, copy_Bps: float, matmul_flops: float) -> dict:
    """The engine's measured time over its steps against the sum of their bounds (all steps, and
    the steps with a decode batch of at least :data:`BIG_DECODE`)."""
    out = {}
    for key, chosen in (("all", list(steps)), ("decode_batch_64", [s for s in steps if s.decode_tokens >= BIG_DECODE])):
        if not chosen:
            out[key] = None
            continue
        measured = sum(s.duration_s for s in chosen)
        bound = sum(step_bound_seconds(cfg, weight_bytes, s, copy_Bps, matmul_flops) for s in chosen)
        out[key] = {"steps": len(chosen), "measured_s": measured, "bound_s": bound, "fraction_of_bound": bound / measured,
                    "tokens": sum(s.prefill_tokens + s.decode_tokens for s in chosen)}
    return out


# --- the three measurements ------------------------------------------------------------------------


def make_trace(cfg: ModelConfig, n: int, rate: float, dry_run: bool) -> list[TraceRequest]:
    lens = DRY if dry_run else dict(prompt_lens=PROMPT_LENS, output_lens=OUTPUT_LENS)
    trace = poisson_trace(n, rate, vocab_size=cfg.vocab_size, seed=0, temperature=0.0, **lens)
    return trace  # every request runs to its max_tokens: no stop token is set (end-of-text ignored)


def engine_run(model: Transformer, trace: list[TraceRequest], max_running: int, token_budget: int) -> dict:
    need = max(len(t.prompt_ids) + t.params.max_tokens for t in trace)
    block = 16
    num_blocks = max_running * -(-need // block) + 64
    engine = Engine(model, num_blocks=num_blocks, block_size=block, token_budget=token_budget,
                    max_running=max_running, max_model_len=num_blocks * block, clock="virtual")
    warm = engine.add_request(list(trace[0].prompt_ids), SamplingParams(temperature=0, max_tokens=4))
    list(engine.stream())  # warm-up: compile the kernels for a prefill and a decode
    engine.release(warm)
    engine.allocator.reset_prefix_cache()  # else the trace's first request finds the warm-up's blocks cached
    engine.block_manager.query_tokens = engine.block_manager.hit_tokens = 0
    engine.steps.clear()
    start = engine.clock.now()  # the trace's clock starts after the warm-up
    requests = run_trace(engine, [TraceRequest(t.arrival_s + start, t.prompt_ids, t.params) for t in trace])
    summary = trace_summary(requests)
    return {"engine": engine, "summary": summary, "num_blocks": num_blocks}


def summary_row(summary: dict) -> dict:
    def stats(s):
        return None if s is None else {"p50": s.p50, "p90": s.p90, "p99": s.p99, "mean": s.mean}

    return {"output_tokens": summary["output_tokens"], "makespan_s": summary["makespan"],
            "output_tokens_per_s": summary["throughput"], "ttft_s": stats(summary["ttft"]),
            "tpot_s": stats(summary["tpot"]), "preemptions": summary["preemptions"]}


def transformers_static(cfg: ModelConfig, trace: list[TraceRequest], max_running: int, device, dtype) -> dict:
    """Static batching with ``transformers``' ``generate`` on a model of the same shape (module docstring)."""
    try:
        from .anatomy import hf_model  # imports transformers, which a bare GPU machine may lack
        hf = hf_model(to_hf_config(cfg), device="meta")
    except ImportError as exc:
        return {"skipped": f"transformers is not installed here ({exc}); not measured"}
    hf = hf.to_empty(device=device).to(dtype).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    pending = sorted(trace, key=lambda t: t.arrival_s)
    clock, first, tokens = 0.0, pending[0].arrival_s, 0
    batches = 0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def generate(batch):
        width = max(len(t.prompt_ids) for t in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(batch):  # left padding, as generation with a batch needs
            ids[i, width - len(t.prompt_ids):] = torch.tensor(t.prompt_ids, device=device)
            mask[i, width - len(t.prompt_ids):] = 1
        longest = max(t.params.max_tokens for t in batch)
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=0, eos_token_id=None)

    generate(pending[:1])  # warm-up
    while pending:
        clock = max(clock, pending[0].arrival_s)
        batch = [t for t in pending if t.arrival_s <= clock][:max_running]
        pending = [t for t in pending if t not in batch]
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            generate(batch)
        sync()
        clock += time.perf_counter() - t0
        tokens += sum(t.params.max_tokens for t in batch)  # each request's own tokens count, not the padding
        batches += 1
    return {"output_tokens": tokens, "makespan_s": clock - first, "output_tokens_per_s": tokens / (clock - first),
            "batches": batches, "transformers": __import__("transformers").__version__}


def decode_sweep(model: Transformer, name: str, batches, graphs: bool, copy_Bps: float, dry_run: bool) -> list[dict]:
    """The engine's decode step time against the batch, all sequences at :data:`SWEEP_CONTEXT` tokens."""
    cfg, rows = model.cfg, []
    context = 16 if dry_run else SWEEP_CONTEXT
    steps = 3 if dry_run else SWEEP_STEPS
    for batch in batches:
        block = 16
        per_seq = -(-(context + steps + 4) // block)
        try:
            engine = Engine(model, num_blocks=batch * per_seq + 8, block_size=block, token_budget=batch * context,
                            max_running=batch, clock="steps", cuda_graphs=graphs if not dry_run else None,
                            prefix_caching=False)
            for b in range(batch):
                prompt = torch.randint(0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(b))
                engine.add_request(prompt.tolist(), SamplingParams(temperature=0, max_tokens=steps + 3))
            engine.step()  # every prompt in one step
            engine.step()  # a first decode step (warm)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()  # ends with the sampled tokens on the host: the step is done
                times.append(time.perf_counter() - t0)
        except torch.cuda.OutOfMemoryError:
            rows.append({"model": name, "batch": batch, "cuda_graphs": graphs, "oom": True})
            torch.cuda.empty_cache()
            continue
        times.sort()
        step_s = times[len(times) // 2]
        nbytes = (weight_bytes_read(cfg, model.param_bytes(), batch, model.dtype.itemsize)
                  + batch * (context + 2) * kv_bytes_per_token(cfg, model.dtype.itemsize))
        rows.append({"model": name, "batch": batch, "cuda_graphs": graphs, "context": context, "step_s": step_s,
                     "tokens_per_s": batch / step_s, "bytes_per_step": nbytes, "fraction_of_copy": nbytes / step_s / copy_Bps})
        print(f"{name} decode batch {batch} {'graphs' if graphs else 'eager'}: {step_s * 1e3:.2f} ms, "
              f"{nbytes / step_s / copy_Bps:.0%} of the copy rate", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def host_time_per_step(model: Transformer, waiting: int, steps: int = HOST_STEPS, prefix: int = HOST_PREFIX) -> dict:
    """The engine's host time per step (its wall time less its forward pass's) with ``waiting``
    requests queued behind two decoding ones that fill ``max_running``: every prompt is a shared
    prefix of ``prefix`` tokens (in the prefix cache once the first runs) and 8 tokens of its own.
    Each step looks every waiting request up in the prefix cache; work that grows with the queue
    shows here. On a GPU the forward pass is timed between two synchronisations (its GPU time is
    not host time)."""
    cfg, bs = model.cfg, 16
    per_seq = -(-(prefix + 8 + steps + 4) // bs)
    engine = Engine(model, num_blocks=2 * per_seq + 8, block_size=bs, token_budget=2 * (prefix + 8),
                    max_running=2, clock="steps")
    gen = torch.Generator().manual_seed(waiting)
    shared = torch.randint(0, cfg.vocab_size, (prefix,), generator=gen).tolist()
    for _ in range(2 + waiting):
        own = torch.randint(0, cfg.vocab_size, (8,), generator=gen).tolist()
        engine.add_request(shared + own, SamplingParams(temperature=0, max_tokens=steps + 3))
    forward, spent = engine.runner.forward, []
    cuda = model.device.type == "cuda"

    def timed_forward(meta):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(meta)
        if cuda:
            torch.cuda.synchronize()
        spent.append(time.perf_counter() - t0)
        return out

    engine.runner.forward = timed_forward  # this engine's only: the bench builds it for this measurement
    engine.step()  # both prompts
    engine.step()  # a first decode step (warm)
    host = []
    for _ in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t0 - sum(spent))
    assert len(engine.waiting) == waiting, "the queue must stay full while the steps are timed"
    host.sort()
    return {"waiting": waiting, "prefix": prefix, "host_s": host[len(host) // 2], "steps": steps}


def host_time_sweep(model: Transformer, name: str) -> dict:
    """:func:`host_time_per_step` at :data:`HOST_WAITING` waiting requests, and the ratio of the
    longest queue's host time to the shortest's (flat: near 1)."""
    rows = [host_time_per_step(model, w) for w in HOST_WAITING]
    ratio = rows[-1]["host_s"] / rows[0]["host_s"]
    print(f"{name} host time per step: " + ", ".join(f"{r['waiting']} waiting {r['host_s'] * 1e3:.2f} ms" for r in rows)
          + f"; {HOST_WAITING[-1]} over {HOST_WAITING[0]}: {ratio:.2f}x (target: at most {HOST_RATIO_TARGET}x)",
          flush=True)
    return {"model": name, "rows": rows, "ratio": ratio, "target": HOST_RATIO_TARGET}


def measure_model(name: str, rec: H.Recorder, copy_Bps: float, matmul_flops: float, dry_run: bool) -> None:
    cfg = model_config(name)
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    n, rate, max_running, budget = TRACES[name]
    trace = make_trace(cfg, n, rate, dry_run)
    model = Transformer(cfg, device=device, dtype=dtype, seed=0).fuse_projections()  # q/k/v and gate/up: one matmul each
    run = engine_run(model, trace, max_running, budget)
    row = {"model": name, "params": model.param_count(), "requests": n, "rate_per_s": rate,
           "max_running": max_running, "token_budget": budget, "engine": summary_row(run["summary"]),
           "engine_stats": {k: v for k, v in run["engine"].stats().items() if k != "cuda_graph_sizes"},
           "cuda_graph_sizes": run["engine"].runner.graph_sizes,
           "roofline": roofline_rows(cfg, model.param_bytes(), run["engine"].steps, copy_Bps, matmul_flops),
           "max_decode_batch": max((s.decode_tokens for s in run["engine"].steps), default=0)}
    print(f"{name}: engine {row['engine']['output_tokens_per_s']:,.0f} output tok/s, "
          f"{row['roofline']['all']['fraction_of_bound']:.0%} of its steps' roofline bound", flush=True)
    del run
    rec.data["models"].append(row)
    rec.save(f"{name}: engine")
    row["static"] = transformers_static(cfg, trace, max_running, device, dtype)
    if "output_tokens_per_s" in row["static"]:
        row["engine_over_static"] = row["engine"]["output_tokens_per_s"] / row["static"]["output_tokens_per_s"]
    rec.save(f"{name}: static batching")
    if name in SWEEP_BATCHES and (dry_run or name != "qwen3-0.6b"):
        for graphs in ((False,) if dry_run else (True, False)):
            rec.data["decode_sweep"] += decode_sweep(model, name, SWEEP_BATCHES[name], graphs, copy_Bps, dry_run)
        rec.save(f"{name}: decode sweep")
    if name == (["tiny-2m"] if dry_run else list(GPU_MODELS))[0]:  # one model is enough: it is host work
        rec.data["host_time"] = host_time_sweep(model, name)
        rec.save(f"{name}: host time per step")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args) -> None:
    dry_run = args.dry_run
    device = "cpu" if dry_run else "cuda"
    if dry_run:
        torch.set_num_threads(1)
    quick = {"repeats": 1} if dry_run else {}
    copy_Bps = max(measure_copy([2**22] if dry_run else [2**30, 4 * 2**30], device=device, progress=False, **quick))
    matmul = max(measure_matmul([128] if dry_run else [8192], dtype=torch.float32 if dry_run else torch.bfloat16,
                                device=device, progress=False, **quick))
    rec = H.Recorder(args.out, H.header(dry_run, dtype="float32" if dry_run else "bfloat16",
                                        copy_bandwidth_Bps=copy_Bps, matmul_flops=matmul,
                                        trace={"prompt_lens": list(DRY["prompt_lens"] if dry_run else PROMPT_LENS),
                                               "output_lens": list(DRY["output_lens"] if dry_run else OUTPUT_LENS),
                                               "arrivals": "Poisson", "end_of_text": "ignored"},
                                        timing="engine: each step's wall time (ends with the sampled tokens on the "
                                               "host); static batching: each generate call's wall time",
                                        models=[], decode_sweep=[]))
    rec.save("copy and matmul rates")
    for name in (["tiny-2m"] if dry_run else list(GPU_MODELS)):
        measure_model(name, rec, copy_Bps, matmul, dry_run)
    rec.save("all")


def load_results(path=None) -> dict | None:
    """The measured results, or None (no file, or a dry run)."""
    return H.load_results("engine", path, required=("models",))


def gpu_figures(results: dict | None) -> dict:
    """The figures chapters 12 and 13 quote from a run, as text: each "not yet measured" without one.

    ``engine_tps`` and ``static_tps``: output tokens per second on the trace, per model;
    ``engine_over_static``: their ratio; ``bound_all`` and ``bound_b64``: the engine's steps'
    roofline bound over their measured time, all steps and decode batches of 64 or more (Llama 3.2
    1B, the target's model); ``graph_b1_8b``: the 8B's batch-1 decode step from CUDA graphs as a
    fraction of the copy rate; ``graph_speedup``: eager step time over graph step time, across the
    sweep's batches; ``max_decode``: the largest decode batch the trace reached."""
    keys = ("status", "when", "engine_tps", "static_tps", "engine_over_static", "bound_all", "bound_b64",
            "graph_b1_8b", "eager_b1_8b", "graph_speedup", "max_decode")
    out = dict.fromkeys(keys, NOT_MEASURED)
    out["status"] = "No GPU has run it for this build of the book, so every GPU figure below reads \"not yet measured\""
    if not results:
        return out
    date = H.date_of(results)
    out["status"] = f"It ran on an {results['device']} on {date} (torch {results['torch']}, triton {results['triton']})"
    out["when"] = f"{results['device']}, {date}"
    models = results["models"]
    out["engine_tps"] = "; ".join(f"{m['model']} {m['engine']['output_tokens_per_s']:,.0f}" for m in models)
    static = [m for m in models if "output_tokens_per_s" in (m.get("static") or {})]
    if static:
        out["static_tps"] = "; ".join(f"{m['model']} {m['static']['output_tokens_per_s']:,.0f}" for m in static)
        ratios = [m["engine_over_static"] for m in static]
        out["engine_over_static"] = f"{min(ratios):.1f}x to {max(ratios):.1f}x"
    elif models and models[0].get("static", {}).get("skipped"):
        out["static_tps"] = out["engine_over_static"] = "not measured (transformers was not installed on the GPU machine)"
    one_b = next((m for m in models if m["model"] == "llama-3.2-1b"), None)
    if one_b:
        out["bound_all"] = f"{one_b['roofline']['all']['fraction_of_bound']:.0%}"
        if one_b["roofline"].get("decode_batch_64"):
            out["bound_b64"] = f"{one_b['roofline']['decode_batch_64']['fraction_of_bound']:.0%}"
        out["max_decode"] = f"{one_b['max_decode_batch']:,}"
    sweep = [r for r in results.get("decode_sweep", []) if r.get("step_s")]
    by = {(r["model"], r["batch"], r["cuda_graphs"]): r for r in sweep}
    if (g := by.get(("llama-3.1-8b", 1, True))) is not None:
        out["graph_b1_8b"] = f"{g['fraction_of_copy']:.0%}"
    if (e := by.get(("llama-3.1-8b", 1, False))) is not None:
        out["eager_b1_8b"] = f"{e['fraction_of_copy']:.0%}"
    speedups = [by[(m, b, False)]["step_s"] / r["step_s"] for (m, b, graphs), r in by.items()
                if graphs and (m, b, False) in by]
    if speedups:
        out["graph_speedup"] = f"{min(speedups):.2f}x to {max(speedups):.2f}x"
    return out


def results_markdown(results: dict | None) -> str:
    """The engine's table (one row per model) with device and date, or "not yet measured"."""
    if not results:
        return ("**Not yet measured.** No GPU has run `python -m labsupport.bench_engine` for this build of the "
                "book (`bash scripts/gpu_all.sh --only decode` runs it).")
    lines = [f"Measured on {results['device']}, {H.date_of(results)} (torch {results['torch']}, triton "
             f"{results['triton']}), {results['dtype']}, random weights; {results['trace']['arrivals']} arrivals, prompts of "
             f"{min(results['trace']['prompt_lens'])}-{max(results['trace']['prompt_lens'])} tokens, outputs of "
             f"{min(results['trace']['output_lens'])}-{max(results['trace']['output_lens'])}, end-of-text ignored.", "",
             "| model | requests | engine (tok/s) | static batching (tok/s) | engine / static | engine steps' bound / "
             "measured | largest decode batch |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in results["models"]:
        static = m.get("static") or {}
        st = f"{static['output_tokens_per_s']:,.0f}" if "output_tokens_per_s" in static else "not measured"
        ratio = f"{m['engine_over_static']:.1f}x" if "engine_over_static" in m else "-"
        lines.append(f"| {m['model']} | {m['requests']} | {m['engine']['output_tokens_per_s']:,.0f} | {st} | {ratio} "
                     f"| {m['roofline']['all']['fraction_of_bound']:.0%} | {m['max_decode_batch']} |")
    return "\n".join(lines)


NOT_MEASURED = H.NOT_MEASURED
BENCH = H.Bench("engine", "12 and 13", measure, description=__doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--cpu-real-model" in argv:  # the real model on this machine's CPU (labsupport.bench_cpu_engine)
        return bench_cpu_engine.main([a for a in argv if a != "--cpu-real-model"])
    return H.main(BENCH, argv)


if __name__ == "__main__":
    raise SystemExit(main())
