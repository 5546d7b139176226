"""Launch overhead of one decode step at batch 1: how much of it is Python and dispatch (chapter 12).

At batch 1 a decode step of a small model does little arithmetic, and the time goes to issuing
it: Python runs each module's ``forward``, PyTorch's dispatcher picks a kernel for every operator,
and on a GPU each kernel is launched separately. Engines remove most of this by capturing the step
once and replaying it: CUDA graphs (vLLM, SGLang and TensorRT-LLM capture decode steps for a set of
batch sizes) and ``torch.compile``, which fuses operators and can capture graphs itself
(``mode="reduce-overhead"``).

:func:`profile_decode_step` measures the share on whatever device the model runs on, with
``torch.profiler``: each step is wrapped in a ``record_function`` range, and the operators called
directly inside it (the top-level ``aten::`` operators: a matrix multiply, an add, a softmax...) are
summed. Convention: ``op_share = (time inside top-level operators) / (step time)``, measured under
the profiler, and ``python_share = 1 - op_share``: the time between operators, spent in Python and
in getting to the operators (module calls, argument handling). The dispatcher's own work inside an
operator is counted as the operator's, which makes the Python share smaller than the whole
overhead; the profiler's own bookkeeping at every operator boundary falls between operators, which
makes it larger. Read it as an estimate for comparing models under the same profiler, not an exact
figure; the step time under the profiler is reported beside the plain one (``step_s``, the median
of unprofiled steps) to show how much the profiler adds. On a GPU the share is CPU time, and it
costs step time only where the GPU waits for the CPU (small batches); timing eager steps against a
replayed CUDA graph (:mod:`labsupport.bench_launch_overhead`) measures that directly.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ._validate import positive_int
from .transformer import Transformer

__all__ = ["profile_decode_step"]

STEP = "labsupport.decode_step"


@torch.no_grad()
def profile_decode_step(model: Transformer, context: int = 64, steps: int = 20, warmup: int = 3) -> dict:
    """Profile ``steps`` decode steps at batch 1 after a prompt of ``context`` tokens (module
    docstring). Returns the device, the median step time without and with the profiler, the
    top-level operators per step, and the operator and Python shares of the profiled step."""
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a labsupport.transformer.Transformer, got {type(model).__name__}")
    context, steps, warmup = positive_int("context", context), positive_int("steps", steps), positive_int(
        "warmup", warmup, allow_zero=True)
    total = warmup + 2 * steps
    cache = model.new_cache(1, context + total + 1)
    logits = model.prefill(model.random_prompt(1, context, seed=0), cache)
    token = logits.argmax(-1, keepdim=True)  # (1, 1)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        token = model.decode_step(token, cache).argmax(-1, keepdim=True)
    plain = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        token = model.decode_step(token, cache).argmax(-1, keepdim=True)
        sync()
        plain.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP):
                token = model.decode_step(token, cache).argmax(-1, keepdim=True)
            sync()
    events = prof.events()
    step_events = [e for e in events if e.name == STEP]
    walls, op_times, op_counts = [], [], []
    for step in step_events:
        children = [e for e in events if e.cpu_parent is step and e.name.startswith("aten::")]
        walls.append(step.time_range.elapsed_us() * 1e-6)
        op_times.append(sum(c.time_range.elapsed_us() for c in children) * 1e-6)
        op_counts.append(len(children))
    if not step_events:
        raise RuntimeError("the profiler recorded no decode step")
    profiled = statistics.median(walls)
    op_share = statistics.median(o / w for o, w in zip(op_times, walls))
    return {
        "device": str(model.device) if model.device.type != "cuda" else torch.cuda.get_device_name(model.device),
        "device_type": model.device.type,
        "model": model.cfg.name,
        "context": context,
        "steps": steps,
        "step_s": statistics.median(plain),
        "profiled_step_s": profiled,
        "ops_per_step": int(statistics.median(op_counts)),
        "op_share": op_share,
        "python_share": 1 - op_share,
        "convention": "CPU time inside top-level aten:: operators over the step's time, under torch.profiler",
    }
