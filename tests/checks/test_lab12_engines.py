"""Lab 12's checks (the KV capacity, the step assembly) pass the course's answers and reject each
planted mistake with a message that names it; the answers follow their stated conventions."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_kv_capacity, check_prepare_step
from labsupport.checks import lab12_engines as lab12
from labsupport.costs import kv_bytes_per_token, param_count
from labsupport.engine import Engine, ScheduledSeq, StepMetadata, run_trace
from labsupport.engine.model_runner import StepBuffers
from labsupport.engine.model_runner import prepare_step as prepare_step_answer
from labsupport.kv_capacity import GIB, kv_capacity
from labsupport.models import get_model
from labsupport.phases import cpu_threads
from labsupport.transformer import Transformer

capacity_ref = unguarded(kv_capacity)
M8 = get_model("llama-3.1-8b")


def fails(fn, *needles, reason="failed", check=check_kv_capacity):
    with pytest.raises(CheckFailed) as info:
        check(fn)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert info.value.reason == reason
    return message


def _planted(*, heads=False, unit=GIB, floor_blocks=True, util_on_free=False, derived_head_dim=False):
    """kv_capacity written out, with one step optionally done wrong."""

    def capacity(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
                 kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0):
        total, reserve = gpu_memory_gib * unit, reserve_gib * unit
        weights = param_count(cfg) * weight_dtype_bytes
        if util_on_free:
            kv = (total - weights - reserve) * gpu_memory_utilization
        else:
            kv = gpu_memory_utilization * total - weights - reserve
        head_dim = cfg.d_model // cfg.n_heads if derived_head_dim else cfg.head_dim
        per_token = 2 * cfg.n_layers * (cfg.n_heads if heads else cfg.n_kv_heads) * head_dim * kv_dtype_bytes
        if floor_blocks:
            blocks = max(0, math.floor(kv / (per_token * block_size)))
            tokens = blocks * block_size
        else:
            tokens = max(0, math.floor(kv / per_token))
            blocks = tokens / block_size
        per_request = -(-max_model_len // block_size)
        return {"num_blocks": blocks, "tokens": tokens, "max_requests": math.floor(blocks / per_request)}

    return capacity


def test_a_correct_function_passes():
    check_kv_capacity(_planted())


def test_the_answer_follows_its_convention():
    got = capacity_ref(M8, 80, 8192)
    kv = 0.9 * 80 * GIB - param_count(M8) * 2
    blocks = math.floor(kv / (16 * kv_bytes_per_token(M8)))
    assert got == {"num_blocks": blocks, "tokens": 16 * blocks, "max_requests": blocks // 512}
    assert capacity_ref(M8, 16, 4096) == {"num_blocks": 0, "tokens": 0, "max_requests": 0}  # weights do not fit
    assert capacity_ref(M8, 80, 8192, kv_dtype_bytes=1)["num_blocks"] in (2 * blocks, 2 * blocks + 1)
    for bad, match in ((dict(gpu_memory_utilization=1.5), "fraction"), (dict(block_size=0), "block_size"),
                       (dict(reserve_gib=-1), "reserve_gib")):
        with pytest.raises(ValueError, match=match):
            capacity_ref(M8, 80, 8192, **bad)


def test_kv_sized_from_query_heads():
    fails(_planted(heads=True), "query heads")


def test_head_width_derived_from_d_model():
    """d_model // n_heads instead of cfg.head_dim: the same for Llama, half of it for Qwen3-0.6B."""
    fails(_planted(derived_head_dim=True), "qwen3-0.6b", "d_model // n_heads = 64", "cfg.head_dim = 128")


def test_gigabytes_instead_of_gib():
    fails(_planted(unit=1e9), "10**9")


def test_blocks_not_rounded_down():
    fails(_planted(floor_blocks=False), "whole tokens, not rounded down to whole blocks")


def test_utilisation_applied_to_free_memory():
    fails(_planted(util_on_free=True), "applied to the memory left after the weights")


def test_request_blocks_not_rounded_up():
    def wrong(cfg, gpu_memory_gib, max_model_len, **kw):
        out = capacity_ref(cfg, gpu_memory_gib, max_model_len, **kw)
        return out | {"max_requests": out["tokens"] // max_model_len}

    fails(wrong, "max_requests", "not rounded up")


def test_wrong_shape_of_result():
    fails(lambda *a, **k: (1, 2, 3), "expected a dict with exactly the keys")


def test_the_stub():
    def stub(cfg, gpu_memory_gib, max_model_len, **kw):
        raise NotImplementedError("exercise 2")

    fails(stub, "NotImplementedError", reason="not done")


def test_the_answer_itself_is_refused():
    fails(kv_capacity, "course's own answer")


def test_blocks_rounded_to_nearest():
    """round() instead of floor: a cache cannot hold a block it has no bytes for."""
    def wrong(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16, kv_dtype_bytes=2,
              weight_dtype_bytes=2, reserve_gib=0.0):
        kv = gpu_memory_utilization * gpu_memory_gib * GIB - param_count(cfg) * weight_dtype_bytes - reserve_gib * GIB
        blocks = max(0, round(kv / (block_size * kv_bytes_per_token(cfg, kv_dtype_bytes))))
        return {"num_blocks": blocks, "tokens": blocks * block_size,
                "max_requests": blocks // -(-max_model_len // block_size)}

    fails(wrong, "num_blocks")


def test_cache_sized_with_the_weights_dtype():
    """The cache's bytes per value taken from weight_dtype_bytes (an fp8 cache under bf16 weights)."""
    def wrong(cfg, gpu_memory_gib, max_model_len, *, kv_dtype_bytes=2, weight_dtype_bytes=2, **kw):
        return capacity_ref(cfg, gpu_memory_gib, max_model_len, kv_dtype_bytes=weight_dtype_bytes,
                            weight_dtype_bytes=weight_dtype_bytes, **kw)

    fails(wrong, "num_blocks")


def test_reserve_ignored():
    def wrong(cfg, gpu_memory_gib, max_model_len, *, reserve_gib=0.0, **kw):
        return capacity_ref(cfg, gpu_memory_gib, max_model_len, **kw)

    fails(wrong, "num_blocks")


def test_the_unguarded_answer_is_refused_too():
    def sneaky(cfg, gpu_memory_gib, max_model_len, **kw):
        return unguarded(kv_capacity)(cfg, gpu_memory_gib, max_model_len, **kw)

    with course_checks_its_answers(False):  # as a learner's notebook runs it
        fails(sneaky, "course's own answer")


# --- check_prepare_step: the engine's step assembly -------------------------------------------------

def _step(*, slot_from_prev=False, restart=False, cu_lengths=False, first_row=False, whole_context=False,
          pad=-1, unpadded=False, lens_before=False, every_row=False, max_total=False, int64_tables=False,
          tail=False, logical=False, unscaled=False, every_left=False, no_zero=False, row_in_seq=False,
          lens_known=False, width_needed=False, decode_last_block=False):
    """prepare_step written as a learner would, with one step optionally done wrong."""

    def prepare_step(seqs, block_size):
        ids, pos, slots, rows, cu, lens = [], [], [], [], [0], []
        width = max(len(s.block_table) for s in seqs)
        if width_needed:  # the blocks the tokens fill, the tables cut to them
            width = max(-(-(s.num_cached + s.num_new) // block_size) for s in seqs)
        for s in seqs:
            start, n = s.num_cached, s.num_new
            if whole_context and n == 1:
                start, n = 0, len(s.token_ids)
            if every_left:
                n = len(s.token_ids) - start
            first = 0 if restart and n > 1 else start
            for i in range(n):
                p = first + i
                ids.append(s.token_ids[len(s.token_ids) - n + i] if tail else s.token_ids[start + i])
                pos.append(p)
                if slot_from_prev:  # 1-based thinking: the k-th token is in block (k - 1) // bs
                    slots.append(s.block_table[(p - 1) // block_size] * block_size + (p - 1) % block_size + 1)
                elif logical:
                    slots.append(p)
                elif unscaled:
                    slots.append(s.block_table[p // block_size] + p % block_size)
                elif decode_last_block and n == 1:  # a decode writes into "its last block"
                    slots.append(s.block_table[-1] * block_size + p % block_size)
                else:
                    slots.append(s.block_table[p // block_size] * block_size + p % block_size)
            cu.append(n if cu_lengths else cu[-1] + n)
            lens.append(s.num_cached if lens_before else len(s.token_ids) if lens_known else start + n)
            if every_row or s.num_cached + s.num_new == len(s.token_ids):
                rows.append(n - 1 if row_in_seq else (sum(cu) - n if cu_lengths else cu[-2]) if first_row else
                            (sum(cu) - 1 if cu_lengths else cu[-1] - 1))
        if unpadded:
            tables = torch.tensor([b for s in seqs for b in s.block_table], dtype=torch.int32)
        else:
            tables = torch.tensor([list(s.block_table)[:width] + [pad] * (width - len(s.block_table[:width]))
                                   for s in seqs],
                                  dtype=torch.int64 if int64_tables else torch.int32)
        q = [s.num_new for s in seqs]
        cu = cu[1:] if no_zero else cu
        return StepMetadata(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), tables,
                            torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                            torch.tensor(rows, dtype=torch.long), sum(q) if max_total else max(q), max(q) == 1)

    return prepare_step


def step_fails(fn, *needles, reason="failed"):
    return fails(fn, *needles, reason=reason, check=check_prepare_step)


def test_a_correct_step_assembly_passes(capsys):
    check_prepare_step(_step())
    assert "PASSED check_prepare_step" in capsys.readouterr().out


def _numpy_step(seqs, block_size):
    """Another correct assembly: numpy arrays, slots computed for all tokens at once, the tables padded by
    np.full."""
    import numpy as np

    news = np.array([s.num_new for s in seqs])
    cu = np.concatenate([[0], np.cumsum(news)])
    pos = np.concatenate([np.arange(s.num_cached, s.num_cached + s.num_new) for s in seqs])
    owner = np.repeat(np.arange(len(seqs)), news)
    tables = np.full((len(seqs), max(len(s.block_table) for s in seqs)), -1, dtype=np.int32)
    for b, s in enumerate(seqs):
        tables[b, :len(s.block_table)] = s.block_table
    slots = tables[owner, pos // block_size].astype(np.int64) * block_size + pos % block_size
    ids = np.concatenate([np.asarray(s.token_ids[s.num_cached:s.num_cached + s.num_new]) for s in seqs])
    samples = np.array([s.num_cached + s.num_new == len(s.token_ids) for s in seqs])
    return StepMetadata(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(pos.astype(np.int64)),
                        torch.from_numpy(slots), torch.from_numpy(tables),
                        torch.from_numpy((cu[1:] - cu[:-1] + [s.num_cached for s in seqs]).astype(np.int32)),
                        torch.from_numpy(cu.astype(np.int32)), torch.from_numpy((cu[1:] - 1)[samples].astype(np.int64)),
                        int(news.max()), bool((news == 1).all()))


def test_a_numpy_step_assembly_passes(capsys):
    check_prepare_step(_numpy_step)
    assert "PASSED check_prepare_step" in capsys.readouterr().out


def test_the_engines_own_assembly_is_what_the_rule_says():
    """prepare_step into reused buffers pads with -1 every step (a shorter table after a longer one)."""
    buffers = StepBuffers(torch.device("cpu"), max_blocks=8, tokens=4, seqs=1)
    long = [ScheduledSeq(list(range(20)), [3, 1, 4, 0, 5], 19, 1), ScheduledSeq(list(range(9)), [6, 2, 7], 0, 9)]
    short = [ScheduledSeq(list(range(6)), [2, 7], 5, 1), ScheduledSeq(list(range(21)), [3, 1, 4, 0, 5, 9], 20, 1)]
    first = unguarded(prepare_step_answer)(long, 4, buffers)
    assert first.slot_mapping.tolist() == [5 * 4 + 3, *range(24, 28), *range(8, 12), 28]
    assert first.logits_indices.tolist() == [0, 9] and first.cu_seqlens_q.tolist() == [0, 1, 10]
    second = unguarded(prepare_step_answer)(short, 4, buffers)
    assert second.block_tables.tolist() == [[2, 7, -1, -1, -1, -1], [3, 1, 4, 0, 5, 9]]
    assert second.decode_only and second.max_q_len == 1 and second.seq_lens.tolist() == [6, 21]


@pytest.mark.parametrize("flags, needles", [
    (dict(slot_from_prev=True), ("slot_mapping", "one past the end of the block before it")),
    (dict(restart=True), ("positions", "positions restart at 0")),
    (dict(cu_lengths=True), ("cu_seqlens_q", "not the running total")),
    (dict(first_row=True), ("logits_indices", "first token of the step instead of its last")),
    (dict(whole_context=True), ("input_ids", "runs its whole context")),
    (dict(pad=0), ("block_tables", "padded with 0, a real block id")),
    (dict(unpadded=True), ("block_tables", "laid end to end in one row")),
    (dict(lens_before=True), ("seq_lens", "before the step")),
    (dict(every_row=True), ("logits_indices", "also for prompt chunks that do not finish")),
    (dict(max_total=True), ("max_q_len", "total number of tokens")),
    (dict(int64_tables=True), ("block_tables", "dtype int64, expected int32")),
    (dict(tail=True), ("input_ids", "the last num_new of token_ids")),
    (dict(logical=True), ("slot_mapping", "not read through the block table")),
    (dict(unscaled=True), ("slot_mapping", "not multiplied by the block size")),
    # the rest of the prompt in one chunk: its slots run past the block table, the learner's IndexError is shown
    (dict(every_left=True), ("raised IndexError", "test_lab12_engines.py", "first chunk alone")),
    (dict(no_zero=True), ("cu_seqlens_q", "no leading 0")),
    (dict(row_in_seq=True), ("logits_indices", "counts within the sequence")),
    (dict(lens_known=True), ("seq_lens", "counts every token the sequence knows")),
    (dict(width_needed=True), ("block_tables", "the blocks its tokens fill, not the longest table")),
    (dict(decode_last_block=True), ("slot_mapping", "the last block of its table")),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_step_assembly_mistakes_are_named(flags, needles):
    step_fails(_step(**flags), *needles)


def test_the_engine_run_alone_rejects_wrong_assemblies(monkeypatch):
    """Part 2 alone (no batch compared first): wrong slots or positions change the greedy tokens."""
    monkeypatch.setattr(lab12, "assembly_cases", lambda: [])
    for flags in (dict(slot_from_prev=True), dict(restart=True)):
        step_fails(_step(**flags), "got the greedy tokens", "from generate alone")


def test_the_engine_trace_chunks_decodes_and_hits_the_prefix_cache():
    """What part 2 runs exercises what it says: chunked prompts beside decodes, and a 12-token
    (three whole blocks) prefix-cache hit."""
    with cpu_threads(1):
        engine = Engine(Transformer(lab12.ENGINE_CFG, seed=3), clock="steps", **lab12.ENGINE_SETTINGS)
        requests = run_trace(engine, lab12.engine_trace())
    assert [r.cached_tokens for r in requests] == [0, 0, 12, 0]
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.steps)
    assert max(len(r.prompt_ids) for r in requests) > lab12.ENGINE_SETTINGS["token_budget"]


def test_step_assembly_stub_and_bad_returns():
    def stub(seqs, block_size):
        raise NotImplementedError("exercise 4")

    step_fails(stub, "NotImplementedError", reason="not done")
    step_fails(lambda seqs, block_size: {"input_ids": []}, "returned a dict, expected a StepMetadata")
    step_fails(prepare_step_answer, "course's own answer")
    with course_checks_its_answers(False):  # as a learner's notebook runs it
        step_fails(lambda seqs, block_size: unguarded(prepare_step_answer)(seqs, block_size), "course's own answer")
