"""Checks for the engines lab: predict an engine's KV cache capacity from its settings, and build an
engine step's flat batch (the model runner's step assembly), checked field by field against the
engine's own and then by running the engine with it."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..costs import param_count
from ..engine import Engine, ScheduledSeq, StepMetadata, TraceRequest, run_trace
from ..engine.model_runner import prepare_step
from ..kv_capacity import GIB, kv_capacity
from ..models import ModelConfig, get_model
from ..phases import cpu_threads
from ..sampling import SamplingParams
from ..transformer import Transformer
from .framework import Case, graded

KEYS = ("num_blocks", "tokens", "max_requests")

CAPACITY_RULE = (
    "the budget is gpu_memory_utilization of the TOTAL memory, counted in GiB (2**30 bytes); the cache gets "
    "the budget less the weights and the reserve (GiB too); a block holds the keys and values of block_size "
    "tokens for every layer and KV head (not query head); count whole blocks (round down, never below 0); the "
    "tokens are those blocks' slots; a request of max_model_len tokens holds whole blocks, so max_requests "
    "counts the requests whose blocks all fit."
)


def _variant(cfg, gib, max_len, util, block, kvb, wb, reserve, *, heads=None, unit=GIB, floor_blocks=True,
             util_on_free=False, whole_request_blocks=True, subtract_weights=True, head_dim=None) -> dict:
    """The result with one step done wrong (the defaults give the right one)."""
    weights = param_count(cfg) * wb if subtract_weights else 0
    total, res = gib * unit, reserve * unit
    kv_bytes = (total - weights - res) * util if util_on_free else util * total - weights - res
    per_token = 2 * cfg.n_layers * (heads or cfg.n_kv_heads) * (head_dim or cfg.head_dim) * kvb
    if floor_blocks:
        blocks = max(0, math.floor(kv_bytes / (block * per_token)))
        tokens = blocks * block
    else:  # whole tokens, not whole blocks
        tokens = max(0, math.floor(kv_bytes / per_token))
        blocks = tokens / block
    per_request = -(-max_len // block) if whole_request_blocks else max_len / block
    return {"num_blocks": blocks, "tokens": tokens, "max_requests": math.floor(blocks / per_request)}


def _mistakes(cfg, *args) -> dict[str, dict]:
    return {
        "the cache is sized from the query heads (n_heads) instead of the KV heads (n_kv_heads)":
            _variant(cfg, *args, heads=cfg.n_heads),
        "gigabytes (10**9 bytes) are used instead of GiB (2**30 bytes)": _variant(cfg, *args, unit=1e9),
        "the cache is counted in whole tokens, not rounded down to whole blocks":
            _variant(cfg, *args, floor_blocks=False),
        "gpu_memory_utilization is applied to the memory left after the weights and reserve instead of to the "
        "total": _variant(cfg, *args, util_on_free=True),
        "a request's blocks are not rounded up (max_model_len / block_size instead of its ceiling)":
            _variant(cfg, *args, whole_request_blocks=False),
        "the weights are not subtracted": _variant(cfg, *args, subtract_weights=False),
        f"the head width is derived as d_model // n_heads = {cfg.d_model // cfg.n_heads} instead of read from "
        f"cfg.head_dim = {cfg.head_dim} (this model's heads are wider than d_model / n_heads)":
            _variant(cfg, *args, head_dim=cfg.d_model // cfg.n_heads),
    }


def capacity_cases() -> list[tuple]:
    """(cfg, label, gpu_memory_gib, max_model_len, utilization, block_size, kv_dtype_bytes,
    weight_dtype_bytes, reserve_gib); None means the default."""
    m8, qwen, small_qwen = get_model("llama-3.1-8b"), get_model("qwen3-8b"), get_model("qwen3-0.6b")
    mha = ModelConfig("mha-test", n_layers=6, d_model=512, n_heads=8, n_kv_heads=8, d_ff=1024, vocab_size=1000)
    return [
        (m8, "H100 80 GiB, defaults", 80, 8192, None, None, None, None, None),
        (m8, "H100 as torch reports it", 79.18, 8000, 0.9, 16, 2, 2, 2.5),  # 8000: not a multiple of 16
        (qwen, "L40S, fp8 cache", 44.4, 32768, 0.92, 32, 1, 2, 1.0),
        (m8, "24 GiB, 4100-token requests", 23.58, 4100, 0.85, 16, 2, 2, 0.5),
        (mha, "small model, block 7", 1.0, 100, 0.5, 7, 4, 4, 0.0),  # MHA: query and KV heads agree
        (m8, "weights do not fit", 16, 4096, 0.9, 16, 2, 2, 0.0),
        # head_dim 128 where d_model / n_heads is 64: deriving the head width halves the cache per token
        (small_qwen, "T4 16 GiB, explicit head width", 15.0, 4096, 0.9, 16, 2, 2, 0.5),
    ]


@graded(points=10, bans=(kv_capacity,))
def check_kv_capacity(fn, checker):
    """``fn(cfg, gpu_memory_gib, max_model_len, gpu_memory_utilization=0.9, block_size=16,
    kv_dtype_bytes=2, weight_dtype_bytes=2, reserve_gib=0.0)`` must return
    ``{"num_blocks", "tokens", "max_requests"}`` by the convention of :mod:`labsupport.kv_capacity`."""
    names = ("gpu_memory_utilization", "block_size", "kv_dtype_bytes", "weight_dtype_bytes", "reserve_gib")
    defaults = (0.9, 16, 2, 2, 0.0)
    for cfg, label, gib, max_len, *settings in capacity_cases():
        kwargs = {n: v for n, v in zip(names, settings) if v is not None}
        case = Case(model=cfg.name, gpu=label, gpu_memory_gib=gib, max_model_len=max_len,
                    **(kwargs or {"settings": "defaults"}))
        got = checker.call(fn, cfg, gib, max_len, case=case, **kwargs)
        if not isinstance(got, dict) or set(got) != set(KEYS):
            checker.fail(case, f"your function returned {type(got).__name__} "
                               f"{sorted(got) if isinstance(got, dict) else ''}, expected a dict with exactly the "
                               f"keys {', '.join(KEYS)}.", "return {'num_blocks': ..., 'tokens': ..., "
                                                           "'max_requests': ...}")
        full = [v if v is not None else d for v, d in zip(settings, defaults)]
        expected = kv_capacity(cfg, gib, max_len, **dict(zip(names, full)))
        mistakes = _mistakes(cfg, gib, max_len, *full)
        for key in KEYS:
            wrong = {d: m[key] for d, m in mistakes.items() if m[key] != expected[key]}
            checker.expect_number(got[key], expected[key], case=case, rel=1e-12, what=key,
                                  hint=CAPACITY_RULE, mistakes=wrong)
            if not isinstance(got[key], int) and float(got[key]) != int(got[key]):
                checker.fail(case, f"{key} is {got[key]!r}: count whole blocks, tokens and requests.",
                             CAPACITY_RULE)


# --- exercise 2: the step's flat batch (the model runner's step assembly) ---------------------------

# the fields compared, in this order (the first wrong one is reported), with the dtype each must have
FIELDS = (("input_ids", torch.long), ("positions", torch.long), ("seq_lens", torch.int32),
          ("cu_seqlens_q", torch.int32), ("slot_mapping", torch.long), ("block_tables", torch.int32),
          ("logits_indices", torch.long))

ASSEMBLY_RULE = {
    "input_ids": "sequence b runs tokens num_cached .. num_cached + num_new - 1 of its token_ids; lay the "
                 "sequences' tokens end to end, in batch order (a decode runs only its one new token).",
    "positions": "a token's position is its index in its own sequence: num_cached + i for the i-th token it runs "
                 "this step (a later chunk of a prompt continues where the cached tokens end).",
    "seq_lens": "seq_lens[b] = num_cached + num_new: the tokens sequence b holds in the cache once this step's "
                "are written.",
    "cu_seqlens_q": "cu_seqlens_q has B + 1 entries: 0, then the running total of num_new, so sequence b's "
                    "rows are cu[b] .. cu[b + 1] - 1.",
    "slot_mapping": "the token at position p goes to slot block_table[p // block_size] * block_size + "
                    "p % block_size: its block read through the table, times the block size, plus the offset.",
    "block_tables": "one row per sequence, its whole block_table in order (blocks allocated ahead of its tokens "
                    "too), padded with -1 to W columns, W the most blocks any sequence of the step holds (int32, "
                    "shape (B, W)).",
    "logits_indices": "one flat row per sequence that samples (num_cached + num_new == len(token_ids)), the row of "
                      "its LAST token in the step, in batch order; a prompt chunk that does not finish its prompt "
                      "has none.",
    "max_q_len": "max_q_len is the largest num_new of the step (a plain int).",
    "decode_only": "decode_only is True when every sequence runs exactly one token (a plain bool).",
}


def _assemble(seqs, bs, *, slot_from_prev=False, logical_slots=False, unscaled_block=False, restart=False,
              whole_context=False, cu_as_lengths=False, cu_no_zero=False, first_row=False,
              every_row=False, row_in_seq=False, pad=-1, flat_tables=False, lens_before=False,
              lens_known=False, max_q_total=False, tail_tokens=False, width_needed=False,
              decode_last_block=False) -> dict:
    """The step's metadata as plain lists, with the named mistakes (the defaults give the right one)."""
    ids, pos, slots, tables, lens, cu, rows = [], [], [], [], [], [0], []
    width = max(len(s.block_table) for s in seqs)
    if width_needed:
        width = max(-(-(s.num_cached + s.num_new) // bs) for s in seqs)
    q_lens = []
    for s in seqs:
        start, n = s.num_cached, s.num_new
        if whole_context and n == 1 and start > 0:
            start, n = 0, start + 1  # a decode runs every token it knows again
        p = list(range(start, start + n))
        if restart and s.num_new > 1:
            p = list(range(n))
        t = s.block_table[:width] if width_needed else s.block_table
        ids += s.token_ids[len(s.token_ids) - n:] if tail_tokens else s.token_ids[start:start + n]
        pos += p
        for q in p:
            j = (q - 1) // bs if slot_from_prev else -1 if decode_last_block and n == 1 else q // bs
            block = t[j] if -len(t) <= j < len(t) else -1  # past the table (a wrong count of tokens)
            if slot_from_prev:
                slots.append(block * bs + (q - 1) % bs + 1)
            elif logical_slots:
                slots.append(q)
            elif unscaled_block:
                slots.append(block + q % bs)
            else:
                slots.append(block * bs + q % bs)
        tables.append(list(t) if flat_tables else list(t) + [pad] * (width - len(t)))
        lens.append(s.num_cached if lens_before else len(s.token_ids) if lens_known else start + n)
        cu.append(cu[-1] + n)
        q_lens.append(n)
        if s.samples or every_row:
            rows.append(n - 1 if row_in_seq else cu[-2] if first_row else cu[-1] - 1)
    if cu_as_lengths:
        cu = [0, *q_lens]
    elif cu_no_zero:
        cu = cu[1:]
    flat = [b for t in tables for b in t] if flat_tables else tables
    return {"input_ids": ids, "positions": pos, "seq_lens": lens, "cu_seqlens_q": cu, "slot_mapping": slots,
            "block_tables": flat, "logits_indices": rows,
            "max_q_len": sum(q_lens) if max_q_total else max(q_lens), "decode_only": max(q_lens) == 1}


ASSEMBLY_MISTAKES = {
    "a token at the start of a block gets the slot one past the end of the block before it (its block found from "
    "position - 1)": dict(slot_from_prev=True),
    "the slot is the token's position, not read through the block table": dict(logical_slots=True),
    "the slot is block_table[p // block_size] + p % block_size: the block id is not multiplied by the block size":
        dict(unscaled_block=True),
    "a prefill chunk's positions restart at 0 instead of continuing after its cached tokens":
        dict(restart=True),
    "a decode sequence runs its whole context (every token it knows) as new tokens instead of its one new token":
        dict(whole_context=True),
    "the tokens are the last num_new of token_ids instead of those after the num_cached cached ones (a chunk "
    "that does not finish its prompt runs the prompt's end)": dict(tail_tokens=True),
    "cu_seqlens_q holds each sequence's query length, not the running total (cumulative) of them":
        dict(cu_as_lengths=True),
    "cu_seqlens_q has no leading 0 (B entries instead of B + 1)": dict(cu_no_zero=True),
    "logits_indices points at each sampling sequence's first token of the step instead of its last":
        dict(first_row=True),
    "logits_indices has a row for every sequence, also for prompt chunks that do not finish their prompt":
        dict(every_row=True),
    "logits_indices counts within the sequence (num_new - 1), not the flat row of the step": dict(row_in_seq=True),
    "the block tables are padded with 0, a real block id, instead of -1": dict(pad=0),
    "the block tables are not padded: every sequence's blocks laid end to end in one row": dict(flat_tables=True),
    "seq_lens is the cached length before the step (num_cached) instead of after it": dict(lens_before=True),
    "seq_lens counts every token the sequence knows (len(token_ids)), not num_cached + num_new":
        dict(lens_known=True),
    "max_q_len is the step's total number of tokens, not the largest num_new": dict(max_q_total=True),
    "each table is cut to the blocks its tokens fill, not the longest table: a table may hold blocks allocated "
    "ahead, and W is the most blocks any table holds": dict(width_needed=True),
    "a decode's slot is taken from the last block of its table, not from block_table[p // block_size] (a table "
    "may hold blocks past the one the new token goes to)": dict(decode_last_block=True),
}


def _seq(gen, pool, bs, cached, new, known, shared=(), ahead=0) -> ScheduledSeq:
    """A scheduled sequence with random tokens and distinct random blocks (the first from ``shared``:
    a prefix another sequence's blocks hold), ``ahead`` blocks more than its tokens fill (allocated
    ahead, as an engine may for the rest of a prompt or the next tokens)."""
    need = -(-(cached + new) // bs) + ahead
    table = list(shared[:need]) + [pool.pop() for _ in range(need - min(need, len(shared)))]
    return ScheduledSeq(torch.randint(0, 1000, (known,), generator=gen).tolist(), table, cached, new)


def _random_batch(gen, bs) -> list[ScheduledSeq]:
    """Four to six sequences of random kinds: decodes (some at a block boundary), whole prompts, first,
    middle and last chunks, and a prompt whose cached prefix is whole blocks."""
    pool = torch.randperm(400, generator=gen).tolist()
    out = []
    for _ in range(int(torch.randint(4, 7, (1,), generator=gen))):
        kind = int(torch.randint(0, 6, (1,), generator=gen))
        length = int(torch.randint(2, 40, (1,), generator=gen))
        if kind == 0:  # a decode
            out.append(_seq(gen, pool, bs, length - 1, 1, length))
        elif kind == 1:  # a decode whose new token starts a block
            k = -(-length // bs) * bs
            out.append(_seq(gen, pool, bs, k, 1, k + 1))
        elif kind == 2:  # a whole prompt
            out.append(_seq(gen, pool, bs, 0, length, length))
        elif kind == 3:  # a first chunk
            out.append(_seq(gen, pool, bs, 0, max(1, length // 3), length))
        elif kind == 4:  # a middle or last chunk
            c = int(torch.randint(1, length, (1,), generator=gen))
            out.append(_seq(gen, pool, bs, c, int(torch.randint(1, length - c + 1, (1,), generator=gen)), length))
        else:  # a prefix-cache hit: cached whole blocks, the rest computed
            k = bs * int(torch.randint(1, 4, (1,), generator=gen))
            out.append(_seq(gen, pool, bs, k, length, k + length))
    return out


def assembly_cases() -> list[tuple[str, int, list[ScheduledSeq]]]:
    """``(label, block_size, seqs)`` for :func:`check_prepare_step`: named batches, then random mixed ones."""
    gen = torch.Generator().manual_seed(12)
    pool = torch.randperm(200, generator=gen).tolist()
    one = [_seq(gen, pool, 4, 0, 11, 11)]
    decodes = [_seq(gen, pool, 4, 6, 1, 7), _seq(gen, pool, 4, 8, 1, 9), _seq(gen, pool, 4, 3, 1, 4),
               _seq(gen, pool, 4, 12, 1, 13)]  # 8 and 12 cached: the new token starts a block
    first = _seq(gen, pool, 4, 0, 6, 15)
    chunks = [first, _seq(gen, pool, 4, 6, 5, 15), _seq(gen, pool, 4, 12, 3, 15)]  # first, middle, last
    shared = _seq(gen, pool, 4, 9, 1, 10)  # decoding: its first two blocks are full (and hashed)
    prefix = [shared, _seq(gen, pool, 4, 8, 5, 13, shared=shared.block_table),  # 8 cached: two whole blocks
              _seq(gen, pool, 4, 4, 1, 5)]
    ahead = [_seq(gen, pool, 4, 8, 1, 9, ahead=2),  # a decode starting block 3 of a 5-block table
             _seq(gen, pool, 4, 0, 5, 15, ahead=2),  # a first chunk, the whole prompt's 4 blocks allocated
             _seq(gen, pool, 4, 5, 1, 6, ahead=1),
             _seq(gen, pool, 4, 0, 3, 3)]
    mixed = [_seq(gen, pool, 3, 9, 1, 10), _seq(gen, pool, 3, 0, 7, 20), _seq(gen, pool, 3, 5, 1, 6),
             _seq(gen, pool, 3, 6, 8, 14), _seq(gen, pool, 3, 0, 1, 1)]
    cases = [("one whole prompt", 4, one), ("decodes only, two at a block boundary", 4, decodes),
             ("one prompt's first chunk alone (nothing samples)", 4, [first]),
             ("a prompt's first, middle and last chunks", 4, chunks),
             ("a prefix-cache hit of two whole blocks beside the sequence it shares them with", 4, prefix),
             ("mixed, block size 3", 3, mixed),
             ("tables longer than their tokens need (blocks allocated ahead)", 4, ahead)]
    for i, bs in enumerate((2, 4, 8, 16)):
        cases.append((f"random mixed batch {i + 1}", bs, _random_batch(gen, bs)))
    return cases


def _describe(seqs) -> str:
    return "; ".join(f"[{i}] cached {s.num_cached}, new {s.num_new} of {len(s.token_ids)}, blocks "
                     f"{list(s.block_table)}" for i, s in enumerate(seqs))


def _shown(values) -> str:
    """A field's values, the first 24 of a longer one followed by how many there are."""
    values = list(values)
    return str(values) if len(values) <= 24 else str(values[:24]) + " ... (" + str(len(values)) + " entries)"


def _as_tensor(values, dtype) -> torch.Tensor:
    """A field's values (a list, or a list of equal rows for the block tables) as a tensor."""
    return torch.tensor(values, dtype=dtype)


def _expect_field(checker, case, name, dtype, got, want, mistakes) -> None:
    """Fail unless ``got`` is exactly the integer tensor ``want`` (lists); name a mistake it matches."""
    hint = ASSEMBLY_RULE[name]
    dtype_name = str(dtype).replace("torch.", "")
    if not isinstance(got, torch.Tensor):
        checker.fail(case, f"StepMetadata.{name} is a {type(got).__name__}, expected a torch.Tensor.",
                     f"build it with torch.tensor(values, dtype=torch.{dtype_name}). {hint}")
    if got.dtype != dtype:
        checker.fail(case, f"StepMetadata.{name} has dtype {str(got.dtype).replace('torch.', '')}, expected "
                           f"{dtype_name} (what the engine's embedding and attention read).",
                     f"torch.tensor(values, dtype=torch.{dtype_name}).")
    got = got.detach().cpu()
    expected = _as_tensor(want, dtype)
    if got.shape == expected.shape and torch.equal(got, expected):
        return
    if got.shape != expected.shape:
        problem = f"StepMetadata.{name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}."
    else:
        wrong = (got != expected).nonzero()
        idx = tuple(int(i) for i in wrong[0])
        problem = (f"StepMetadata.{name} is wrong at {len(wrong)} of {expected.numel()} entries, first at index "
                   f"{idx}: got {int(got[idx])}, expected {int(expected[idx])}.")
    if got.dim() == 1 and expected.dim() == 1:
        problem += f"\nGot      {_shown(got.tolist())}\nExpected {_shown(expected.tolist())}"
    for description, values in mistakes.items():
        wrong_t = _as_tensor(values, dtype)
        if wrong_t.shape == got.shape and not torch.equal(wrong_t, expected) and torch.equal(got, wrong_t):
            problem += f"\nYour {name} matches what we get when {description}."
            break
    checker.fail(case, problem, hint)


def _expect_host_value(checker, case, name, got, want, mistakes) -> None:
    kind = bool if name == "decode_only" else int
    if type(got) is not kind:
        checker.fail(case, f"StepMetadata.{name} is a {type(got).__name__} ({got!r}), expected a plain "
                           f"{kind.__name__}.", f"{ASSEMBLY_RULE[name]} Convert with {kind.__name__}(...).")
    if got != want:
        problem = f"StepMetadata.{name} is {got!r}, expected {want!r}."
        for description, value in mistakes.items():
            if value != want and value == got:
                problem += f"\nYour {name} matches what we get when {description}."
                break
        checker.fail(case, problem, ASSEMBLY_RULE[name])


def _compare_assembly(checker, fn, label, bs, seqs) -> None:
    case = Case(batch=label, block_size=bs, sequences=_describe(seqs))
    given = [ScheduledSeq(list(s.token_ids), list(s.block_table), s.num_cached, s.num_new) for s in seqs]
    got = checker.call(fn, given, bs, case=case)
    if not isinstance(got, StepMetadata):
        checker.fail(case, f"your function returned a {type(got).__name__}, expected a StepMetadata.",
                     "return StepMetadata(input_ids=..., positions=..., slot_mapping=..., block_tables=..., "
                     "seq_lens=..., cu_seqlens_q=..., logits_indices=..., max_q_len=..., decode_only=...).")
    engine = prepare_step(seqs, bs)  # the engine's own (model_runner.prepare_step), fresh CPU buffers
    want = _assemble(seqs, bs)
    for name, dtype in FIELDS:  # the engine's own tensors agree with the rule written out above
        if not torch.equal(getattr(engine, name), _as_tensor(want[name], dtype)):
            raise RuntimeError(f"the engine's prepare_step and the check's rule disagree on {name}")
    variants = {d: _assemble(seqs, bs, **flags) for d, flags in ASSEMBLY_MISTAKES.items()}
    for name, dtype in FIELDS:
        _expect_field(checker, case, name, dtype, getattr(got, name), want[name],
                      {d: v[name] for d, v in variants.items()})
    for name in ("max_q_len", "decode_only"):
        _expect_host_value(checker, case, name, getattr(got, name), want[name],
                           {d: v[name] for d, v in variants.items()})


# the course's tiny shape with its own output head (a tied head makes a random model's greedy text
# repeat its last token, a weak comparison)
ENGINE_CFG = dataclasses.replace(get_model("tiny-2m"), tied_embeddings=False, name="tiny-2m-untied")
ENGINE_SETTINGS = dict(num_blocks=24, block_size=4, token_budget=8, max_running=4)


def engine_trace() -> list[TraceRequest]:
    """Four greedy requests arriving at steps 0, 0, 2 and 5 (the engine's "steps" clock): prompts longer
    than the 8-token budget (chunked), and one that shares three whole blocks with the first (a
    prefix-cache hit of 12 tokens, a multiple of the block size)."""
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, ENGINE_CFG.vocab_size, (12,), generator=gen).tolist()
    other = torch.randint(0, ENGINE_CFG.vocab_size, (26,), generator=gen).tolist()
    prompts = [shared + other[:3], other[3:24], shared + other[24:25], other[:5]]
    return [TraceRequest(t, tuple(p), SamplingParams(temperature=0.0, max_tokens=m))
            for t, p, m in zip((0, 0, 2, 5), prompts, (6, 5, 7, 4))]


def _engine_with(fn, checker) -> None:
    """Run the engine with ``fn`` as its step assembly; every request must get the tokens
    ``Transformer.generate`` gives it alone."""
    trace = engine_trace()
    case = Case(engine=f"{ENGINE_CFG.name}, random weights, CPU", requests=len(trace),
                arrivals="steps 0, 0, 2, 5", **ENGINE_SETTINGS)
    with cpu_threads(1):
        model = Transformer(ENGINE_CFG, seed=3)
        alone = [model.generate(torch.tensor([list(t.prompt_ids)]), t.params.max_tokens)[0, len(t.prompt_ids):]
                 .tolist() for t in trace]
        engine = Engine(model, clock="steps", **ENGINE_SETTINGS)
        engine.runner.assemble = lambda seqs, block_size: checker.call(fn, seqs, block_size, case=case)
        try:
            requests = run_trace(engine, trace, max_steps=200)
        except Exception as exc:  # CheckFailed from the learner's call passes through
            if isinstance(exc, AssertionError):
                raise
            checker.fail(case, f"with your function as its step assembly the engine failed at step "
                               f"{len(engine.steps)}: {type(exc).__name__}: {str(exc)[:300]}",
                         "the tensors passed the comparisons above; look at what the engine gives your function "
                         "(engine.runner.scheduled(batch)) at that step.")
    for i, (t, r, want) in enumerate(zip(trace, requests, alone)):
        if r.output_ids != want:
            at = next(j for j, (a, b) in enumerate(zip(r.output_ids + [None] * len(want), want)) if a != b)
            checker.fail(case, f"request {i} (a prompt of {len(t.prompt_ids)} tokens arriving at step "
                               f"{t.arrival_s:g}) got the greedy tokens {r.output_ids} from the engine with your "
                               f"function, but {want} from generate alone (first difference at token {at}).",
                         "with greedy sampling every request must get the tokens it gets alone: a slot, a "
                         "position or a logits row taken from the wrong place changes them.")


@graded(points=15, bans=(prepare_step,))
def check_prepare_step(fn, checker):
    """``fn(seqs, block_size)`` turns a scheduled step (a list of
    :class:`~labsupport.engine.ScheduledSeq`) into its :class:`~labsupport.engine.StepMetadata`, as
    the engine's model runner does (:func:`labsupport.engine.model_runner.prepare_step`). Compared
    field by field with the engine's own on named and random mixed batches (prefills, chunks,
    decodes, block boundaries, prefix-cache hits), then plugged into the engine: greedy tokens must
    equal ``Transformer.generate`` for requests arriving at different steps."""
    for label, bs, seqs in assembly_cases():
        _compare_assembly(checker, fn, label, bs, seqs)
    _engine_with(fn, checker)
