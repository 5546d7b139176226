"""The fused CPU decode step (labsupport.cpu_decode): one C call per decode step of 1 to 16
sequences gives the torch path's logits (float32: up to the order of sums), writes the same keys and
values into the paged cache, serves through the engine with greedy tokens equal to ``generate``'s,
and refuses, with a reason, what it cannot run."""

from __future__ import annotations

import copy
import ctypes
import platform
import subprocess

import pytest
import torch

from labsupport import cpu_decode, cpu_linear
from labsupport.engine import Engine
from labsupport.models import ModelConfig
from labsupport.paged_cache import PagedKVStore
from labsupport.sampling import SamplingParams
from labsupport.transformer import Transformer

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64, "rope_type": "llama3"}


def small(dtype=torch.float32, seed=0, **shape) -> Transformer:
    kw = dict(n_layers=2, d_model=96, n_heads=6, n_kv_heads=2, d_ff=128, vocab_size=300)
    kw.update(shape)
    return Transformer(ModelConfig("fused-test", **kw), dtype=dtype, seed=seed)


def engine_tokens(model, prompts, cpu_decode_mode, max_tokens=12, **kw):
    """Greedy outputs of the engine for ``prompts`` (added together, so their decode steps share)."""
    eng = Engine(model, num_blocks=40, block_size=kw.pop("block_size", 4), cpu_decode=cpu_decode_mode,
                 prefix_caching=False, **kw)
    return eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens)), eng


def prompt(n, seed=0, vocab=300):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("shape", [
    dict(),  # grouped-query attention, 3 query heads per key/value head
    dict(n_heads=4, n_kv_heads=4, d_model=128, tied_embeddings=True),  # multi-head attention, a tied head
    dict(qkv_bias=True, o_bias=True, rope_scaling=LLAMA3_SCALING),  # Qwen2's biases, Llama 3.1's rotation
])
def test_logits_equal_the_torch_step_and_the_cache_gets_the_same_keys(shape):
    """At every fused step of a request (9 prompt tokens, decode steps across block boundaries), the
    torch path's forward pass on the same metadata and cache gives the same logits and keys/values."""
    model = small(**shape)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    runner, store, fused_step, checked = eng.runner, eng.store, eng.runner.fused_step, []

    def compare(meta):
        k0, v0 = store.k.clone(), store.v.clone()
        want = model.logits(runner.forward(meta))  # (1, V): the torch path, which writes the token's keys
        k_want, v_want = store.k.clone(), store.v.clone()
        store.k.copy_(k0), store.v.copy_(v0)
        got = fused_step(meta)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert not torch.equal(store.k, k0)
        torch.testing.assert_close(store.k, k_want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(store.v, v_want, atol=1e-6, rtol=1e-5)
        checked.append(int(meta.positions[0]))
        return got

    runner.fused_step = compare
    eng.generate([prompt(9)], SamplingParams(temperature=0, max_tokens=10))
    assert checked == list(range(9, 18))  # every decode step after the prompt's


def test_the_engine_serves_generates_tokens_on_scattered_blocks_and_mixed_steps():
    """Three requests of different lengths: their prompt steps run torch, their decode steps the C
    step, three, then two, then one at a time, on blocks handed out while they interleaved: every
    output equals generate's."""
    model = small(seed=3)
    prompts, lengths = [prompt(n, seed=n) for n in (5, 11, 3)], (4, 14, 9)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(prompts, lengths)]
    fused_step, fused_tables = eng.runner.fused_step, []
    eng.runner.fused_step = lambda meta: (fused_tables.append(meta.block_tables.tolist()), fused_step(meta))[1]
    while eng.has_unfinished():
        eng.step()
    sizes = [len(t) for t in fused_tables]
    assert {1, 2, 3} <= set(sizes) and len(sizes) >= 10  # decode steps of three, two and one request ran in C
    assert any(row[:3] != list(range(row[0], row[0] + 3)) for t in fused_tables for row in t if len(row) >= 3)
    for rid, p, n in zip(ids, prompts, lengths):
        assert eng.requests[rid].output_ids == model.generate(torch.tensor([p]), n)[0, len(p):].tolist()


def test_decode_steps_larger_than_the_c_steps_batch_run_torch():
    """With the decoder's max_batch lowered to 2, steps of three decodes run torch and steps of two or
    one run C; the outputs are generate's either way."""
    model = small(seed=4)
    prompts, lengths = [prompt(n, seed=n + 1) for n in (4, 6, 5)], (8, 12, 5)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    eng.runner.fused.max_batch = 2
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(prompts, lengths)]
    fused_step, sizes, torch_decodes = eng.runner.fused_step, [], []
    eng.runner.fused_step = lambda meta: (sizes.append(len(meta.positions)), fused_step(meta))[1]
    forward = model.forward  # the torch path's forward pass (the runner's own, if replaced, would turn C off)
    model.forward = lambda ids, kv: (torch_decodes.append(hasattr(kv, "meta") and kv.meta.decode_only
                                                          and len(kv.meta.positions)), forward(ids, kv))[1]
    while eng.has_unfinished():
        eng.step()
    assert set(sizes) == {1, 2} and 3 in torch_decodes  # three decodes: torch; two and one: C
    for rid, p, n in zip(ids, prompts, lengths):
        assert eng.requests[rid].output_ids == model.generate(torch.tensor([p]), n)[0, len(p):].tolist()


def lockstep(decoder, seqs, offsets, table_of):
    """Decode ``seqs`` (token lists) together through ``decoder.step_batch``, sequence b starting at
    step ``offsets[b]`` (so the rows of a step sit at different positions): the logits of each (b, pos)."""
    out = {}
    for i in range(max(o + len(t) for o, t in zip(offsets, seqs))):
        rows = [b for b, (o, t) in enumerate(zip(offsets, seqs)) if 0 <= i - o < len(t)]
        tokens = torch.tensor([seqs[b][i - offsets[b]] for b in rows])
        positions = torch.tensor([i - offsets[b] for b in rows])
        logits = decoder.step_batch(tokens, positions, torch.stack([table_of[b] for b in rows]))
        out.update({(b, int(p)): row for b, p, row in zip(rows, positions, logits)})
    return out


def test_a_batch_of_sequences_at_different_positions_gives_each_its_own_logits():
    """Five sequences of 9 to 70 tokens decoded together, one to five rows a step, each row at its own
    position on its own scattered blocks (attention over one to three chunks): every row's logits are
    the model's own for that sequence's prefix."""
    model = small(seed=12, vocab_size=301)
    seqs = [prompt(n, seed=20 + n, vocab=301) for n in (40, 70, 9, 33, 50)]
    store = PagedKVStore(model.cfg, 60, 4, dtype=torch.float32)
    blocks = torch.randperm(60, generator=torch.Generator().manual_seed(3)).to(torch.int32).tolist()
    table_of, start = [], 0
    for seq in seqs:  # each its own scattered blocks, the table's unused entries -1 (never read)
        need = -(-len(seq) // 4)
        table_of.append(torch.tensor(blocks[start:start + need] + [-1] * (18 - need), dtype=torch.int32))  # (18,)
        start += need
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 72, threads=3)
    got = lockstep(decoder, seqs, (0, 3, 30, 7, 20), table_of)
    for b, seq in enumerate(seqs):
        want = full_logits(model, seq)  # (S, V)
        torch.testing.assert_close(torch.stack([got[b, p] for p in range(len(seq))]), want, atol=2e-5, rtol=1e-4)
    unused = set(range(60)) - set(blocks[:start])  # the 7 blocks no table holds: never written
    assert len(unused) == 7 and all(store.k[:, b].abs().sum() == 0 and store.v[:, b].abs().sum() == 0 for b in unused)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_full_batch_of_sixteen_on_odd_widths_to_the_last_position(fmt):
    """16 sequences (with AVX-512, three groups of inputs in the batched products, the last one short),
    widths that leave 8 columns past the last 16-wide step of AVX-512 (d_model 104, d_ff 136), 13 query heads on one KV head,
    max_batch = 16, 3 threads and positions up to the rotation table's last: every row's logits are the
    model's (int8: its dequantised float32 twin's, within the activations' and the bfloat16 cache's
    rounding), nothing is written past the workspace (int8: 16 rows of int16 codes of the widest input in
    each thread's scratch) or outside the sequences' blocks."""
    model = small(seed=15, vocab_size=301, d_model=104, n_heads=13, n_kv_heads=1, d_ff=136)
    ref, dtype, tol = model, torch.float32, dict(atol=2e-5, rtol=1e-4)
    if fmt == "int8":
        model = cpu_linear.prepack(model.to(torch.bfloat16), "int8")
        ref, dtype, tol = dequantised_twin(model), torch.bfloat16, dict(atol=3e-2, rtol=0)
    lengths = [40, 33, 32, 1, 17, 40, 8, 39, 25, 31, 2, 40, 16, 9, 38, 24]
    seqs = [prompt(n, seed=60 + i, vocab=301) for i, n in enumerate(lengths)]
    store = PagedKVStore(model.cfg, 170, 4, dtype=dtype)  # 160 blocks used, 10 never
    table_of = [torch.arange(160, dtype=torch.int32).view(16, 10)[b].flip(0) for b in range(16)]  # (10,): 40 positions
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 40, threads=3, max_batch=16)
    got = lockstep(decoder, seqs, [40 - n for n in lengths], table_of)  # all end together: the last step holds 16
    for b, seq in enumerate(seqs):
        torch.testing.assert_close(torch.stack([got[b, p] for p in range(len(seq))]), full_logits(ref, seq), **tol)
    assert torch.equal(decoder._work[-cpu_decode._GUARD:], torch.full((cpu_decode._GUARD,), cpu_decode._GUARD_VALUE))
    assert store.k[:, 160:].abs().sum() == 0 and store.v[:, 160:].abs().sum() == 0


@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, None), (torch.bfloat16, "int8")])
def test_bf16_and_int8_batches_match_their_one_row_steps(dtype, fmt):
    """The batched products (each weight converted once, summed in another order) give bf16 and int8
    models the logits of their one-row steps; the bf16 cache is written the same. Widths of 104 and 136
    leave 8 columns past the last 16-wide step of both kernels on AVX-512 (and past the last 32-wide
    step of the int8 kernels). Int8 products are exact integer sums: there the batch gives the same bits."""
    base = small(seed=13, d_model=104, n_heads=13, n_kv_heads=1, d_ff=136).to(dtype)
    model = base if fmt is None else cpu_linear.prepack(base, fmt)
    seqs = [prompt(n, seed=40 + n) for n in (20, 36, 27)]
    tables = [torch.arange(10 * b, 10 * b + 10, dtype=torch.int32) for b in range(3)]
    stores = [PagedKVStore(model.cfg, 30, 4, dtype=dtype) for _ in range(2)]
    together = lockstep(cpu_decode.FusedDecoder(model, stores[0].k, stores[0].v, 40), seqs, (0, 2, 5), tables)
    alone = cpu_decode.FusedDecoder(model, stores[1].k, stores[1].v, 40)
    for b, seq in enumerate(seqs):
        one = torch.cat([alone.step(t, i, tables[b]) for i, t in enumerate(seq)])  # (S, V)
        torch.testing.assert_close(torch.stack([together[b, p] for p in range(len(seq))]), one, atol=1e-4, rtol=1e-4)
        if fmt == "int8":
            assert torch.equal(torch.stack([together[b, p] for p in range(len(seq))]), one)
    if fmt == "int8":
        assert torch.equal(stores[0].k, stores[1].k) and torch.equal(stores[0].v, stores[1].v)
    torch.testing.assert_close(stores[0].k.float(), stores[1].k.float(), atol=0.02, rtol=0.01)
    assert (stores[0].k != 0).any() and (stores[0].k == stores[1].k).float().mean() > 0.9


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_batched_steps_give_the_same_bits_on_any_thread_count(fmt):
    model = small(seed=14, n_layers=2)
    if fmt == "int8":
        model = cpu_linear.prepack(model.to(torch.bfloat16), "int8")
    seqs = [prompt(n, seed=50 + n) for n in (38, 12, 25, 40)]
    tables = [torch.arange(10 * b, 10 * b + 10, dtype=torch.int32) for b in range(4)]
    outs = []
    for threads in (1, 2, 3):
        store = PagedKVStore(model.cfg, 40, 4, dtype=model.dtype)
        got = lockstep(cpu_decode.FusedDecoder(model, store.k, store.v, 40, threads=threads), seqs, (0, 1, 9, 2), tables)
        outs.append(torch.stack([got[k] for k in sorted(got)]))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_batches_are_refused_before_the_cache_is_touched():
    model = small()
    store = PagedKVStore(model.cfg, 8, 4, dtype=torch.float32)
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 16, max_batch=3)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"1 <= B <= 3"):
        decoder.step_batch(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 0, 0]), tables)
    with pytest.raises(ValueError, match="must cover its sequence"):
        decoder.step_batch(torch.tensor([1, 2]), torch.tensor([3, 8]), tables[:2])
    bad = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)  # row 1's second block is not one of the 8
    with pytest.raises(ValueError, match="ids of the cache's 8 blocks"):
        decoder.step_batch(torch.tensor([1, 2]), torch.tensor([3, 5]), bad)
    with pytest.raises(ValueError, match="token id"):
        decoder.step_batch(torch.tensor([1, 300]), torch.tensor([3, 5]), tables[:2])
    assert store.k.abs().sum() == 0 and store.v.abs().sum() == 0
    with pytest.raises(ValueError, match="max_batch"):
        cpu_decode.FusedDecoder(model, store.k, store.v, 16, max_batch=0)


def test_a_scattered_block_table_reads_and_writes_only_its_blocks():
    """Teacher-forced through blocks 5, 2, 7, 0, 9, 11, 3, 8, 10 of a 12-block cache (70 positions:
    attention's chunks of 32 positions end at 31 and 63, so the partial results of three chunks are
    combined): each position's logits are the model's own for that prefix, and the blocks outside the
    table are never written."""
    model = small(seed=11, vocab_size=301)  # 301 rows: a head whose rows are not a multiple of 4
    tokens = prompt(70, seed=11, vocab=301)
    store = PagedKVStore(model.cfg, 12, 8, dtype=torch.float32)
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 96)
    table = torch.tensor([5, 2, 7, 0, 9, 11, 3, 8, 10], dtype=torch.int32)
    got = torch.cat([decoder.step(t, i, table) for i, t in enumerate(tokens)])  # (70, V)
    want = model.logits(model(torch.tensor([tokens]), model.contiguous_batch(None, 0, len(tokens))))[0]  # (70, V)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    written = {b for b in range(12) if store.k[:, b].abs().sum() > 0}
    assert written == {5, 2, 7, 0, 9, 11, 3, 8, 10} and all(store.v[:, b].abs().sum() == 0 for b in (1, 4, 6))


def test_bad_positions_blocks_and_caches_are_refused_before_the_cache_is_touched():
    model = small()
    store = PagedKVStore(model.cfg, 4, 4, dtype=torch.float32)
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 16)
    for position, table, says in ((-1, [1], "outside"), (16, [0, 1, 2, 3, 0], "outside"),
                                  (5, [0, 4], "ids of the cache's 4 blocks"), (1, [-1], "ids of the cache's"),
                                  (9, [0, 1], "must cover its sequence")):
        with pytest.raises(ValueError, match=says):
            decoder.step(3, position, torch.tensor(table, dtype=torch.int32))
    assert store.k.abs().sum() == 0 and store.v.abs().sum() == 0
    contiguous = model.new_cache(1, 16)  # (L, B, Hkv, S, D): not a paged cache
    with pytest.raises(ValueError, match="must be paged"):
        cpu_decode.FusedDecoder(model, contiguous.k, contiguous.v, 16)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_every_thread_count_gives_the_same_bits(fmt):
    """The threads split rows and attention's fixed chunks of positions, never a sum: 1, 2, 3 and 5
    threads give bit-identical logits over 70 positions (three chunks; the suite runs with one thread
    per worker, so this is where the split is checked)."""
    model = small(seed=2, vocab_size=301, n_layers=3)
    if fmt == "int8":
        model = cpu_linear.prepack(model.to(torch.bfloat16), "int8")
    tokens = prompt(70, seed=2, vocab=301)
    outs = []
    for threads in (1, 2, 3, 5):
        store = PagedKVStore(model.cfg, 20, 4, dtype=model.dtype)
        decoder = cpu_decode.FusedDecoder(model, store.k, store.v, 80, threads=threads)
        table = torch.tensor([3, 1, 0, *range(19, 3, -1)], dtype=torch.int32)
        outs.append(torch.cat([decoder.step(t, i, table) for i, t in enumerate(tokens)]))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_read_floats_sums_and_refuses_what_it_cannot_read():
    """The bench's read loop (labsupport.cpu_decode.read_floats) reads every element: small integers
    sum exactly, one changed element changes the sum, and tensors it cannot read are refused."""
    x = torch.arange(64 * 300, dtype=torch.float32) % 7  # (19200,)
    assert cpu_decode.read_floats(x) == float(x.sum()) == cpu_decode.read_floats(x, threads=3)
    x[-1] += 5
    assert cpu_decode.read_floats(x) == float(x.sum())
    for bad in (x[:100], x.double(), x.view(2, -1).t()):
        with pytest.raises(ValueError, match="multiple of 64"):
            cpu_decode.read_floats(bad)


def full_logits(model, tokens):
    """The torch model's logits (S, V) at every position of ``tokens`` (one forward pass, float32)."""
    return model.logits(model(torch.tensor([tokens]), model.contiguous_batch(None, 0, len(tokens))))[0]


def through_c(model, tokens, block_size=4):
    """The C step's logits at every position, and the paged cache it wrote."""
    blocks = -(-len(tokens) // block_size)
    store = PagedKVStore(model.cfg, blocks, block_size, dtype=model.dtype)
    decoder = cpu_decode.FusedDecoder(model, store.k, store.v, blocks * block_size)
    table = torch.arange(blocks, dtype=torch.int32)
    return torch.cat([decoder.step(t, i, table) for i, t in enumerate(tokens)]), store


def test_bf16_weights_compute_as_their_float32_twin_and_the_cache_rounds_to_nearest_even():
    """bfloat16 weights are read exactly (their float32 twin gives layer 0's keys and values bit for
    bit, which the bfloat16 cache holds rounded to nearest even, as torch rounds); the logits stay
    closer to the twin's than torch's bfloat16 path, which rounds every activation."""
    model = small(seed=5, n_layers=3).to(torch.bfloat16)
    twin = copy.deepcopy(model).float()  # the same weights, exactly, in float32
    tokens = prompt(11, seed=5)
    got, store = through_c(model, tokens)
    want, twin_store = through_c(twin, tokens)
    assert torch.equal(store.k[0], twin_store.k[0].to(torch.bfloat16))  # layer 0: the same float32 keys, rounded
    assert torch.equal(store.v[0], twin_store.v[0].to(torch.bfloat16))
    torch_bf16 = full_logits(model, tokens)
    assert (got - want).abs().max() < 0.5 * (torch_bf16 - want).abs().max()


def dequantised_twin(model):
    """A float32 copy of an int8 model (prepack "int8") holding ``codes * scales`` in float32."""
    twin = copy.deepcopy(model)
    for parent in [m for b in twin.layers for m in (b.attention, b.feed_forward)]:
        for name, layer in list(parent.named_children()):
            if isinstance(layer, cpu_linear.Int8Linear):
                dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
                with torch.no_grad():
                    dense.weight.copy_(layer.codes.float() * layer.scales.float()[:, None])
                    if layer.bias is not None:
                        dense.bias.copy_(layer.bias.float())
                setattr(parent, name, dense)
    head = twin.packed_head
    twin.packed_head = None
    with torch.no_grad():
        twin.output.weight.copy_(head.codes.float() * head.scales.float()[:, None])
    return twin.float()


def test_int8_weights_with_biases_compute_as_their_dequantised_twin():
    """Int8 codes times their row's scale, plus the biases: the C step's logits are those of a float32
    model holding ``codes * scales`` (up to the bfloat16 cache), and a twin missing one layer's output
    bias is far outside that tolerance (the comparison can fail)."""
    model = small(seed=6, vocab_size=301, qkv_bias=True, o_bias=True).to(torch.bfloat16)
    cpu_linear.prepack(model, "int8")
    twin = dequantised_twin(model)
    tokens = prompt(10, seed=6, vocab=301)
    got, _ = through_c(model, tokens)
    want = full_logits(twin, tokens)
    gap = (got - want).abs().max()
    assert gap < 2e-2
    with torch.no_grad():
        twin.layers[1].attention.wo.bias.zero_()
    assert (got - full_logits(twin, tokens)).abs().max() > 10 * gap


def test_bf16_and_int8_engines_give_the_float32_greedy_tokens():
    ref = small(seed=5, n_layers=3)
    p = prompt(7, seed=5)
    want, _ = engine_tokens(ref, [p], "fused", max_tokens=10)
    for fmt in ("bf16", "int8"):
        model = small(seed=5, n_layers=3).to(torch.bfloat16)
        if fmt == "int8":
            cpu_linear.prepack(model, "int8")
        got, eng = engine_tokens(model, [p], "fused", max_tokens=10)
        assert got == want, fmt


def test_packed_models_and_unfused_projections_give_the_torch_logits():
    """wq, wk, wv and w1, w3 apart, or fused by prepack with the packed head: the C step's logits are
    the unpacked torch model's."""
    base = small(seed=7, qkv_bias=True)
    packed = cpu_linear.prepack(small(seed=7, qkv_bias=True), plain_rows=0)
    assert base.layers[0].attention.wqkv is None and packed.layers[0].attention.wqkv is not None
    tokens = prompt(10, seed=7)
    want = base.logits(base(torch.tensor([tokens]), base.contiguous_batch(None, 0, len(tokens))))[0]  # (S, V)
    for model in (base, packed):
        torch.testing.assert_close(cpu_decode.teacher_forced_logits(model, tokens, block_size=4), want,
                                   atol=2e-5, rtol=1e-4)


def test_refusals_say_why():
    assert "qk_norm" in cpu_decode.unsupported(small(qk_norm=True))
    assert "multiple of 8" in cpu_decode.unsupported(small(d_model=60, n_heads=6, n_kv_heads=2))
    hooked = small()
    hooked.layers[1].attention.rope = lambda q, k, positions: (q, k)
    assert "layer 1" in cpu_decode.unsupported(hooked)
    assert cpu_decode.unsupported(small()) is None
    with pytest.raises(ValueError, match="qk_norm.*cpu_decode='torch'"):
        Engine(small(qk_norm=True), num_blocks=8, block_size=4, cpu_decode="fused")
    with pytest.raises(ValueError, match="cpu_decode must be one of"):
        Engine(small(), num_blocks=8, block_size=4, cpu_decode="c")
    eng = Engine(small(), num_blocks=8, block_size=4, max_model_len=16, cpu_decode="fused")
    with pytest.raises(ValueError, match=r"position of \[16\] is outside \[0, 15\]"):
        eng.runner.fused.step(1, 16, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="token id"):
        eng.runner.fused.step(300, 3, torch.zeros(4, dtype=torch.int32))


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_decode, "_library", None)
    monkeypatch.setenv("LABSUPPORT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no C compiler.*cpu_decode='torch'"):
        cpu_decode.build()
    bad = tmp_path / "bad-cc"
    bad.write_text("#!/bin/sh\necho 'cc: error: planted failure' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with pytest.raises(RuntimeError, match="planted failure"):
        cpu_decode.build()
    assert not list((tmp_path / "cpu_decode").iterdir())  # nothing half-built left behind


def test_real_model_fused_greedy_equals_generate(smollm2):
    """SmolLM2-135M in float32: the fused engine's greedy tokens are generate's, for a request alone
    (one-row steps) and for three together (batched steps, then two, then one)."""
    p = [1, 9690, 42, 2114, 314, 253, 4587, 30]
    model = smollm2.model
    out, _ = engine_tokens(model, [p], "fused", max_tokens=24, block_size=16)
    assert out[0] == model.generate(torch.tensor([p]), 24)[0, len(p):].tolist()
    prompts = [p, p[:5] + [2114, 314], [1, 4587, 30, 253]]
    eng = Engine(model, num_blocks=40, block_size=16, cpu_decode="fused", prefix_caching=False)
    ids = [eng.add_request(q, SamplingParams(temperature=0, max_tokens=n)) for q, n in zip(prompts, (20, 14, 9))]
    batched = []
    fused_step = eng.runner.fused_step
    eng.runner.fused_step = lambda meta: (batched.append(len(meta.positions)), fused_step(meta))[1]
    while eng.has_unfinished():
        eng.step()
    assert max(batched) == 3
    for rid, q, n in zip(ids, prompts, (20, 14, 9)):
        assert eng.requests[rid].output_ids == model.generate(torch.tensor([q]), n)[0, len(q):].tolist()


def test_a_started_server_with_int8_weights_and_the_fused_step_answers(smollm2):
    """``--dtype bfloat16 --prepack int8 --cpu-decode fused``: the official client gets the answer,
    streamed and whole alike, and the server says how it decodes."""
    import openai

    from labsupport.serve import ServerProcess

    args = ["--model", "smollm2-135m-instruct", "--context", 256, "--engine", "continuous", "--max-running", "2",
            "--dtype", "bfloat16", "--prepack", "int8", "--cpu-decode", "fused"]
    with ServerProcess(args, threads=2) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=chat, max_tokens=16,
                                               temperature=0).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2-135m-instruct", messages=chat, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert "Paris" in whole and streamed == whole


def test_the_server_refuses_fused_without_the_engine_or_with_a_stack(capsys):
    from labsupport.serve import cli

    for argv, says in ((["--cpu-decode", "fused"], "needs --engine continuous"),
                       (["--engine", "continuous", "--cpu-decode", "fused", "--stack", "labs"], "past your parts")):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert says in capsys.readouterr().err


def counting(eng):
    """Count the engine's fused steps."""
    calls, step = [], eng.runner.fused_step
    eng.runner.fused_step = lambda meta: (calls.append(1), step(meta))[1]
    return calls


def test_parts_plugged_in_after_the_engine_take_the_torch_path(monkeypatch):
    """A rotation (on a layer or on the class) or a step assembly plugged in after the engine was
    built: one-request decode steps run torch, which uses them."""
    model = small(seed=8)
    p = prompt(6, seed=8)
    for plug in ("layer rope", "class rope", "assemble"):
        eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
        calls, seen = counting(eng), []

        def rope(q, k, positions, seen=seen):
            seen.append(1)
            return q, k  # a (wrong) rotation that does nothing: visible in the output if it runs

        if plug == "layer rope":
            model.layers[0].attention.rope = rope
        elif plug == "class rope":
            monkeypatch.setattr(type(model.layers[0].attention), "rope", staticmethod(rope))
        else:
            from labsupport.engine.model_runner import prepare_step
            eng.runner.assemble = lambda seqs, bs, seen=seen: (seen.append(1), prepare_step(seqs, bs))[1]
        eng.generate([p], SamplingParams(temperature=0, max_tokens=5))
        assert calls == [] and len(seen) >= 5, plug
        if plug == "layer rope":
            del model.layers[0].attention.rope
        monkeypatch.undo()


def test_changed_weights_get_a_new_decoder_and_prompt_steps_never_reach_it():
    model = small(seed=9)
    p = prompt(5, seed=9)
    eng = Engine(model, num_blocks=40, block_size=4, cpu_decode="fused", prefix_caching=False)
    first = eng.runner.fused
    eng.generate([p], SamplingParams(temperature=0, max_tokens=3))
    assert not first.stale()
    with torch.no_grad():
        model.norm.weight.mul_(-1.5)  # in place: the C step reads the model's own tensor
        model.layers[0].attention.wq.weight.mul_(3.0)
    assert not first.stale()
    (out,) = eng.generate([p], SamplingParams(temperature=0, max_tokens=6))
    assert eng.runner.fused is first and out == model.generate(torch.tensor([p]), 6)[0, len(p):].tolist()
    cpu_linear.prepack(model, plain_rows=0)  # every weight replaced: the engine makes a new decoder
    assert first.stale() and first.repacked()
    (out,) = eng.generate([p], SamplingParams(temperature=0, max_tokens=6))
    assert eng.runner.fused is not first and not eng.runner.fused.stale()
    assert out == model.generate(torch.tensor([p]), 6)[0, len(p):].tolist()
    second = eng.runner.fused
    model.layers[1].feed_forward.w2.weight = torch.nn.Parameter(model.layers[1].feed_forward.w2.weight * -2)
    assert second.stale() and not second.repacked()  # one parameter swapped: stale() sees it
    one = Engine(model, num_blocks=40, block_size=4, token_budget=1, cpu_decode="fused", prefix_caching=False)
    calls = counting(one)  # a budget of one token: prompt steps of one token that sample nothing stay on torch
    (out,) = one.generate([p], SamplingParams(temperature=0, max_tokens=6))
    assert out == model.generate(torch.tensor([p]), 6)[0, len(p):].tolist()
    assert len(calls) == 6  # the prompt's last token (it samples the first output) and 5 decodes; 4 prompt steps not


def _exact(codes, x):
    return x.double() @ codes.double().T  # (B, R): the product without any rounding of x


def _int16_model(codes, x):
    """What the C file says it computes, step by step in torch: each row's scale big / 32767 and codes
    round(x * (32767 / big)) in float32 (half to even; rows below 2^-60 scaled by 2^64 first), exact
    integer sums, one multiply."""
    big = x.abs().amax(1, keepdim=True)  # (B, 1) float32
    k = torch.where(big < 2.0**-60, 2.0**64, 1.0)  # (B, 1): powers of two, exact
    q = torch.round((x * k) * (torch.tensor(32767.0) / (big * k))).nan_to_num(0.0)  # (B, C): zeros give 0 / 0
    sums = (q.to(torch.int64)[:, None, :] * codes.to(torch.int64)[None]).sum(-1)  # (B, R), exact
    return (big / 32767.0) * sums.to(torch.float32)


@pytest.mark.parametrize("rows,cols", [(37, 104), (64, 576), (9, 1536), (5, 8), (4, 40)])
def test_int8_products_round_each_row_to_int16_and_sum_exactly(rows, cols):
    """cpu_decode.int8_product, the step's int8 product: each row of x rounded to int16 codes within its
    own largest |x| / 65534, then exact integer sums: the error stays under what that rounding allows, far
    below int8 weights' own; rows of very different sizes each keep their precision; one row and a batch
    give the same bits."""
    g = torch.Generator().manual_seed(rows * cols)
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    x = torch.randn(7, cols, generator=g) * torch.logspace(-4, 4, 7)[:, None]  # (7, C): sizes from 1e-4 to 1e4
    got = cpu_decode.int8_product(codes, x)
    step = x.abs().amax(1, keepdim=True).double() / 32767  # (7, 1): one code of each row
    allowed = 0.5 * step * codes.double().abs().sum(1) + 1e-6 * (x.double().abs() @ codes.double().abs().T)
    err = (got.double() - _exact(codes, x)).abs()
    assert (err <= allowed).all(), (err / allowed).max()
    assert (err > 0).any()  # the activations really were rounded (the check can tell)
    assert torch.equal(got, _int16_model(codes, x))  # and rounded to nearest, as the C file says
    one_by_one = torch.cat([cpu_decode.int8_product(codes, x[i:i + 1]) for i in range(7)])
    assert torch.equal(got, one_by_one)


@pytest.mark.parametrize("cols", [576, 1536, 8192, 20000])
def test_int8_products_do_not_overflow_at_the_worst_codes(cols):
    """Every code at its extreme and every activation at the row's largest (+-32767): the sum of cols
    products of 128 and 32767 passes 2^31 from 513 columns on, and the result is still the exact
    product (each lane sums in int32 over at most 2048 columns, the blocks in int64; a row summed in
    int32 would wrap)."""
    for w, v in ((127, 1.0), (-128, -2.5), (-127, 3.0)):
        codes = torch.full((6, cols), w, dtype=torch.int8)
        x = torch.full((3, cols), v)
        for rows in (x, x[:1]):  # the batched kernel and the one-row one
            got = cpu_decode.int8_product(codes, rows)
            torch.testing.assert_close(got, torch.full((len(rows), 6), float(w * v * cols)), rtol=1e-6, atol=0)


def test_int8_products_of_tiny_rows_keep_their_codes():
    """Rows whose largest |x| is 1e-30, 1e-38 or 1e-44: 32767 / max would overflow below about 1e-34,
    so the C file scales such rows by 2^64 first (no undefined conversion of an infinity). The products
    are the model's bit for bit and finite; where the scale max / 32767 is a normal float they are as
    close to the exact product as any row's; 1e-38 gives a subnormal scale (fewer bits, still the
    products' signs); below about 2e-41 the scale underflows and the row gives zeros."""
    codes = torch.randint(-127, 128, (10, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    x = x / x.abs().amax(1, keepdim=True) * torch.tensor([[1e-30], [1e-38], [1e-44]])
    got = cpu_decode.int8_product(codes, x)
    assert torch.equal(got, _int16_model(codes, x)) and got.isfinite().all()
    exact = _exact(codes, x)
    assert ((got[0].double() - exact[0]).abs() <= 0.5 * 1e-30 / 32767 * codes.double().abs().sum(1) * 1.01).all()
    assert torch.equal(got[1].sign(), exact[1].sign().float()) and (got[1] != 0).all()
    assert torch.equal(got[2], torch.zeros(10))


def test_int8_products_of_zero_and_non_finite_rows():
    """A row of zeros gives zeros; a NaN or an infinity in a row makes that row's products NaN (as float
    products would not be finite either), the other rows untouched."""
    codes = torch.randint(-127, 128, (12, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    got = cpu_decode.int8_product(codes, x)
    assert torch.equal(got[0], torch.zeros(12))
    assert got[1].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[3], cpu_decode.int8_product(codes, x[3:4])[0]) and got[3].isfinite().all()
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_decode.int8_product(codes[:, :60], x[:, :60])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or cpu_decode._compiler() is None,
                    reason="x86 instruction-set flags and a C compiler")
def test_int8_products_have_the_same_bits_on_every_instruction_set(tmp_path):
    """The C file built for AVX2 without VNNI (vpmaddwd) and for no AVX at all (GCC's generic vectors)
    gives the machine's own build's int8 products bit for bit, as do AVX-512 without VNNI and AVX2 with
    AVX-VNNI where the CPU has them: the sums are exact integers (here across two blocks of columns) and
    the activations' codes involve no add that FMA could fuse. A flag the compiler does not know (GCC
    before 11: -mno-avxvnni) skips its variant; the plain build always runs."""
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(-127, 128, (45, 2568), dtype=torch.int8, generator=g)
    x = torch.randn(5, 2568, generator=g)
    x[2, 7] = 300.0  # an outlier: the other activations of its row get codes of a few units
    want = cpu_decode.int8_product(codes, x), cpu_decode.int8_product(codes, x[:1])
    variants = (["-mno-avx", "-mno-avx2", "-mno-avx512f", "-mno-fma"], ["-mno-avx512f", "-mno-avxvnni"],
                ["-mno-avx512f"], ["-mno-avx512vnni"])
    for i, flags in enumerate(variants):
        out = tmp_path / f"variant{i}.so"
        done = subprocess.run([*cpu_decode._compiler(), *cpu_decode.FLAGS, *flags, "-o", str(out),
                               str(cpu_decode.SOURCE), "-lm"], capture_output=True, text=True)
        if i > 0 and done.returncode and "unrecognized" in done.stderr:
            continue
        assert done.returncode == 0, done.stderr
        lib = ctypes.CDLL(str(out))
        assert torch.equal(cpu_decode.int8_product(codes, x, lib), want[0]), flags
        assert torch.equal(cpu_decode.int8_product(codes, x[:1], lib), want[1]), flags
