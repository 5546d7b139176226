"""The learner's serving stack as data: every lab exercise whose answer is a part of a serving stack,
as a named slot (issue 31).

Each :class:`Slot` names the lab, the names the lab's exercise cell defines (the first is the part the
stack takes), the graded check that decides whether the learner's part is used, and its **mode**:

* ``"serves"``: the learner's part runs on every request once it is plugged in;
* ``"checked"``: the part's shape cannot serve (or it belongs to the client side that drives and
  reports a run), so it is only run against its check, on the check's inputs.

``wired`` says whether the server plugs the part in today (:func:`serving_slots`; a checked slot may
be wired too, run beside the engine's part while serving, as ``prefix_cache`` is); a slot meant to
serve that is not wired yet keeps the course's part and is reported as not serving, never claimed.
``how`` is one line on how it plugs in, or why it is only checked.

This module imports nothing from ``labsupport.course`` (assembly, which needs the grader's splice and
the checks, lives in :mod:`labsupport.course.stack`); the server imports only this and the assembled
parts.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("serves", "checked")


@dataclass(frozen=True)
class Slot:
    name: str  # the slot's name in the table and in --json
    lab: str  # the lab's key in lab_checks.json, e.g. "13_decode_loop"
    names: tuple[str, ...]  # what the lab's exercise cell defines; names[0] is the part the stack takes
    check: str  # the graded check (labsupport.checks) that decides whether the learner's part is used
    mode: str  # "serves" or "checked" (module docstring)
    how: str  # how it plugs in, or why it is only checked
    wired: bool = False  # the server plugs the learner's part in today
    gpu_only: bool = False  # a Triton kernel: serves where Triton compiles (a GPU); on a CPU checked on one forward pass

    @property
    def part(self) -> str:
        """The name of the part the stack takes from the lab's module."""
        return self.names[0]

    @property
    def serves(self) -> bool:
        """True when the learner's part, once it passes its check, runs on every request today (on this
        machine: a :attr:`gpu_only` slot serves only where Triton compiles for a GPU)."""
        return self.mode == "serves" and self.wired and (not self.gpu_only or _triton_compiles())


SLOTS: tuple[Slot, ...] = (
    # lab 01: text out of the engine
    Slot("stop_strings", "01_tokens", ("StopStringFilter",), "check_stop_strings", "serves",
         "per request: the server's stop-string filter (Backend.stop_filter) is the learner's class; its "
         "push(text) -> (send, stopped) and flush() are the server's own interface", wired=True),
    Slot("detokenizer", "01_tokens", ("StreamDetokenizer",), "check_incremental_detokenizer", "serves",
         "per request, behind an adapter: reads the model tokenizer's token bytes (byte-level BPE's "
         "characters turned back into bytes; special tokens as their UTF-8 string)", wired=True),
    # lab 02: names of the weights
    Slot("weight_names", "02_anatomy", ("course_state_dict",), "check_hf_weight_names", "checked",
         "checked only: the real model loads by GGUF tensor names (labsupport.checkpoints), not by the "
         "Hugging Face names this exercise maps"),
    # lab 03: the client
    Slot("sse_client", "03_journey", ("stream_events",), "check_sse_client", "checked",
         "client side: streams the capstone's requests; its check starts a course server of its own"),
    Slot("latency_metrics", "03_journey", ("latency_metrics",), "check_latency_metrics", "checked",
         "client side: TTFT and TPOT of the capstone's requests"),
    # lab 06 and 12: how many KV blocks
    Slot("kv_bytes_per_token", "06_kv_cache", ("kv_bytes_per_token",), "check_kv_bytes_per_token", "checked",
         "checked: the bytes per token that kv_capacity's budget divides by (lab 12's kv_capacity sizes the blocks)"),
    Slot("kv_capacity", "12_engines", ("kv_capacity",), "check_kv_capacity", "serves",
         "at start-up: sizes the engine's number of KV blocks (--engine continuous, no --num-blocks); the "
         "server budgets --kv-memory-gib for the weights and the cache at utilisation 1.0 (default: the "
         "weights plus the course's default cache), since a CPU has no GPU memory to read", wired=True),
    # lab 07: attention
    Slot("flash_attention", "07_attention", ("flash_attention", "flash_attention_kernel"), "check_flash_attention",
         "serves", "step-wide, on a GPU: steps of whole prompts with no cache hit; its interface is equal-length "
         "sequences without grouped-query heads, so an adapter groups the step's prompts by length and repeats "
         "the KV heads; other steps run the course's kernel. On a CPU: checked against the course's attention "
         "on one forward pass at start-up", wired=True, gpu_only=True),
    # lab 08: position
    Slot("rope", "08_position", ("apply_rope",), "check_apply_rope", "serves",
         "step-wide: every layer's Attention.rope hook rotates queries and keys with it (halves layout, the "
         "model's rope_theta); a model with scaled frequencies (rope_scaling) keeps the course's rotation",
         wired=True),
    Slot("fused_rope", "08_position", ("fused_rope", "fused_rope_kernel"), "check_fused_rope", "serves",
         "step-wide, on a GPU: the Triton kernel behind the same rope hook (the model's own frequencies, "
         "scaled ones included). On a CPU: checked against the course's rotation on one forward pass at "
         "start-up", wired=True, gpu_only=True),
    # lab 09: GGUF dequantisation
    Slot("dequantize_q8_0", "09_precision", ("dequantize_q8_0",), "check_dequantize_q8_0", "serves",
         "at load time: reads the GGUF file's Q8_0 blocks inside the loader (--model a GGUF file), its "
         "conversion cached in the course's cache folder under a key of its own (a hash of your module file)",
         wired=True),
    Slot("dequantize_q4_1", "09_precision", ("dequantize_q4_1",), "check_dequantize_q4_1", "serves",
         "as dequantize_q8_0, for the Q4_1 blocks", wired=True),
    # lab 10: the paged cache
    Slot("block_allocator", "10_cache_ops", ("BlockAllocator",), "check_block_allocator", "serves",
         "step-wide, behind an adapter: the engine's block pool, with prefix caching off (its interface counts "
         "tokens, it never sees their ids, so no block can be found by its prefix)", wired=True),
    Slot("prefix_cache", "10_cache_ops", ("PrefixCachingAllocator",), "check_prefix_cache", "checked",
         "checked while serving: its interface cannot grow a sequence, so it cannot be the engine's pool; the "
         "engine's admissions are replayed on it beside the engine's pool and its hits compared with the "
         "engine's (GET /health: stack_prefix_cache)", wired=True),
    Slot("paged_attention", "10_cache_ops", ("paged_attention", "paged_decode_attention_kernel"),
         "check_paged_attention", "serves",
         "step-wide, on a GPU: steps of decodes only, on the engine's own block tables and cache; other "
         "steps run the course's kernel. On a CPU: checked against the course's attention on one decode "
         "step at start-up", wired=True, gpu_only=True),
    # lab 11: tensor parallelism
    Slot("ring_all_reduce", "11_many_gpus", ("ring_all_reduce",), "check_ring_all_reduce", "checked",
         "checked only: the engine has no tensor parallelism"),
    Slot("shard_layer", "11_many_gpus", ("shard_layer",), "check_shard_layer", "checked",
         "checked only: the engine has no tensor parallelism"),
    Slot("tp_layer_forward", "11_many_gpus", ("tp_layer_forward",), "check_tp_layer_forward", "checked",
         "checked only: the engine has no tensor parallelism"),
    # lab 12 and 13: the engine's step
    Slot("prepare_step", "12_engines", ("prepare_step",), "check_prepare_step", "serves",
         "step-wide: the model runner's step assembly (engine.runner.assemble)", wired=True),
    Slot("scheduler", "13_decode_loop", ("schedule_step",), "check_schedule_step", "serves",
         "step-wide: the engine's step decision (Engine(scheduler=...))", wired=True),
    Slot("sampler", "13_decode_loop", ("sample",), "check_sample", "serves",
         "step-wide: called once per row (Engine(sampler=...), the engine's PerRowSampler)", wired=True),
    Slot("speculative_accept", "13_decode_loop", ("speculative_accept",), "check_speculative_accept", "serves",
         "step-wide, with --num-speculative-tokens: the engine's draft verification (engine.runner.verify), "
         "one-hot draft probabilities for the prompt-lookup drafts; your sampler is left out meanwhile", wired=True),
    # lab 15: the load generator and the report
    Slot("poisson_arrivals", "15_production", ("poisson_arrivals",), "check_poisson_arrivals", "checked",
         "client side: the capstone trace's arrival times"),
    Slot("open_loop", "15_production", ("open_loop",), "check_open_loop", "checked",
         "client side: drives the capstone's trace open-loop"),
    Slot("histogram_quantile", "15_production", ("histogram_quantile_between",), "check_histogram_quantile",
         "checked", "client side: quantiles of the server's Prometheus histograms in the capstone's report"),
    Slot("slo_report", "15_production", ("slo_report",), "check_slo_report", "checked",
         "client side: the capstone's SLO report"),
)

BY_NAME = {slot.name: slot for slot in SLOTS}


def _triton_compiles() -> bool:
    """Whether Triton kernels compile for a GPU here (a CUDA device, not the interpreter)."""
    import os

    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in (
        "1", "true", "yes", "on")


def slot(name: str) -> Slot:
    """The slot called ``name`` (a ValueError naming the known slots otherwise)."""
    if name not in BY_NAME:
        raise ValueError(f"no stack slot {name!r}; the slots are {', '.join(BY_NAME)}")
    return BY_NAME[name]


def serving_slots() -> list[Slot]:
    """The slots the server plugs a learner's part into today."""
    return [s for s in SLOTS if s.serves]


def labs() -> list[str]:
    """The labs that have a slot, in course order."""
    return sorted({s.lab for s in SLOTS})
