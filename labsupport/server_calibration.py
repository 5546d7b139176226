"""The planner calibrated on a running server, and the request rate it predicts (chapters 14 and 15).

Lab 14 fits the course server's decode step, ``step = overhead + batch * per_sequence``, from
closed-loop runs (``B`` clients keep about ``B`` requests decoding, so the median TPOT is the step at
batch ``B``), reads it in the planner's terms (the overhead is ``step_overhead_s``; the per-sequence
cost, against this machine's measured matmul rate, is a ``compute_efficiency``), measures the time a
request costs the server outside its decode steps (``admission_s``, with one client), and predicts
the highest arrival rate whose requests in flight (Little's law) fit the batch the TPOT target
allows once admissions have taken their share of the server's time. Lab 14 does it with the
learner's own functions; :func:`calibrate` and :func:`predicted_rate` do the same with the course's,
so that lab 15 can test the plan again without repeating lab 14.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import costs
from .bench_serving import run_benchmark
from .models import ModelConfig
from .planning import GB, GIB, concurrency, max_batch

__all__ = ["ServerCalibration", "calibrate", "predicted_rate"]


@dataclass(frozen=True)
class ServerCalibration:
    """A server's decode step fitted on this machine, in the planner's terms (times in seconds)."""

    batches: tuple[int, ...]
    step_s: tuple[float, ...]  # median TPOT of a closed loop of each batch's clients
    overhead_s: float  # the fit's fixed part: the planner's step_overhead_s
    per_sequence_s: float  # the fit's slope
    compute_efficiency: float  # one sequence's decode FLOPs over (matmul rate x per_sequence_s), at most 1
    admission_s: float  # time per request outside decode steps, one request at a time (an upper bound)
    context_tokens: int  # a running sequence's mean context in the runs
    copy_bandwidth: float  # bytes/s measured on this machine (the planner's "datasheet" bandwidth)
    matmul_rate: float  # FLOP/s measured on this machine (its "datasheet" compute)


def calibrate(base_url: str, model: str, cfg: ModelConfig, *, copy_bandwidth: float, matmul_rate: float,
              batches: tuple[int, ...] = (1, 4), output_tokens: int = 32, input_words: int = 16) -> ServerCalibration:
    """Closed-loop runs at each batch against the server at ``base_url`` (its model ``cfg``), fitted
    as lab 14 fits them (module docstring)."""
    if len(set(batches)) < 2 or 1 not in batches:
        raise ValueError(f"calibrate needs batch 1 and at least one other batch to fit a line, got {batches}")
    steps, admission, prompt_tokens = [], None, input_words
    for b in batches:
        s = run_benchmark(base_url, model, num_prompts=max(6, 3 * b), max_concurrency=b, input_words=input_words,
                          output_tokens=output_tokens, ignore_eos=True, seed=b)
        steps.append(s["tpot_s"]["p50"])
        if b == 1:
            decode = s["completed"] * (output_tokens - 1) * s["tpot_s"]["p50"]
            admission = max((s["duration_s"] - decode) / s["completed"], 1e-4)  # noise cannot make it negative
            prompt_tokens = s["requests"][0]["prompt_tokens"] or input_words
    context = prompt_tokens + output_tokens // 2
    per_seq, fixed = np.polyfit(batches, steps, 1)
    per_seq, fixed = max(float(per_seq), 1e-6), max(float(fixed), 0.0)
    efficiency = min(1.0, costs.decode_step_flops(cfg, 1, context) / (matmul_rate * per_seq))
    return ServerCalibration(tuple(batches), tuple(steps), fixed, per_seq, efficiency, admission, context,
                             copy_bandwidth, matmul_rate)


def predicted_rate(cal: ServerCalibration, cfg: ModelConfig, tpot_target_s: float, output_tokens: int, *,
                   memory_bytes: float, dtype_bytes: int = 4, rates=None) -> float:
    """The highest rate (of ``rates``, 0.5 to 400 per second by default) whose requests in flight,
    ``concurrency(rate, admission_s, target, output_tokens)``, fit the batch the TPOT target allows
    once admissions take ``rate * admission_s`` of the server's time (lab 14, part 2); 0 if none."""
    machine = dict(memory_gib=memory_bytes / GIB, bandwidth_gb_s=cal.copy_bandwidth / GB,
                   peak_tflops=cal.matmul_rate / 1e12, bandwidth_efficiency=1.0,
                   compute_efficiency=cal.compute_efficiency, step_overhead_s=cal.overhead_s,
                   weight_dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes, memory_utilization=1.0)
    rates = rates if rates is not None else [r / 2 for r in range(1, 801)]

    def fits(rate: float) -> bool:
        share = rate * cal.admission_s
        if share >= 1:
            return False
        batch = max_batch(cfg, cal.context_tokens, tpot_target_s * (1 - share), **machine)
        return concurrency(rate, cal.admission_s, tpot_target_s, output_tokens) <= batch

    ok = [r for r in rates if fits(r)]
    return max(ok) if ok else 0.0
