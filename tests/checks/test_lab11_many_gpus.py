"""Lab 11's checks pass the course's answers and reject each planted mistake with a message that
names it. The planted functions live at module level: the checks run them on other processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_reduce

from labsupport.checks import CheckFailed, check_ring_all_reduce, check_shard_layer, check_tp_layer_forward
from labsupport.checks import lab11_many_gpus as lab
from labsupport.collectives import ring_all_reduce
from labsupport.tensor_parallel import causal_attention, rms_norm, shard_layer, tp_layer_forward
from labsupport.transformer import apply_rope


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setattr(lab, "CALL_TIMEOUT", 4.0)  # the deadlock test waits this long, not 20 s


def fails(check, fn, *needles, reason="failed"):
    with pytest.raises(CheckFailed) as info:
        check(fn)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert info.value.reason == reason
    return message


# --- exercise 1: the ring all-reduce -----------------------------------------------------------------


def _ring(x, bounds="split", phases=2, blocking=False, recv_offset=1, collective=False):
    if collective:
        y = x.clone()
        dist.all_reduce(y)
        return y
    rank, n = dist.get_rank(), dist.get_world_size()
    out = x.clone().reshape(-1)
    if bounds == "split":
        chunks = list(out.tensor_split(n))
    else:  # numel // n per chunk: the remainder is never reduced
        size = out.numel() // n
        chunks = [out[i * size:(i + 1) * size] for i in range(n)]
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv, add):
        incoming = torch.empty_like(chunks[recv])
        if blocking:
            dist.send(chunks[send].contiguous(), right)
            dist.recv(incoming, left)
        else:
            request = dist.isend(chunks[send].contiguous(), right)
            dist.recv(incoming, left)
            request.wait()
        if add:
            chunks[recv] += incoming
        else:
            chunks[recv].copy_(incoming)

    for step in range(n - 1):
        exchange((rank - step) % n, (rank - step - recv_offset) % n, True)
    if phases == 2:
        for step in range(n - 1):
            exchange((rank - step + 1) % n, (rank - step) % n, False)
    return out.view(x.shape)


def ring_reference(x):
    return _ring(x)


def ring_stub(x):
    raise NotImplementedError("write ring_all_reduce")


def ring_floor_chunks(x):
    return _ring(x, bounds="floor")


def ring_reduce_scatter_only(x):
    return _ring(x, phases=1)


def ring_blocking_send_first(x):
    return _ring(x, blocking=True)


def ring_wrong_bookkeeping(x):
    return _ring(x, recv_offset=0)


def ring_uses_all_reduce(x):
    return _ring(x, collective=True)


def ring_gather_then_sum(x):
    """Right sums the lazy way: every rank sends its whole tensor to every other rank, then adds."""
    rank, n = dist.get_rank(), dist.get_world_size()
    requests = [dist.isend(x.contiguous(), other) for other in range(n) if other != rank]
    total = x.clone()
    for other in range(n):
        if other != rank:
            incoming = torch.empty_like(x)
            dist.recv(incoming, other)
            total += incoming
    for request in requests:
        request.wait()
    return total


def ring_whole_tensor_around(x):
    """Right sums along a ring, but each step forwards a whole tensor, not a chunk."""
    rank, n = dist.get_rank(), dist.get_world_size()
    total, passing = x.clone(), x.clone()
    for _ in range(n - 1):
        request = dist.isend(passing, (rank + 1) % n)
        incoming = torch.empty_like(x)
        dist.recv(incoming, (rank - 1) % n)
        request.wait()
        total += incoming
        passing = incoming
    return total


def ring_calls_the_answer(x):
    return ring_all_reduce(x)


def ring_even_odd_blocking(x):
    """A right ring with blocking calls only, deadlock-free by parity: even ranks send, then receive."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = x.clone().reshape(-1)
    chunks = list(out.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv, add):
        incoming = torch.empty_like(chunks[recv])
        if rank % 2 == 0:
            dist.send(chunks[send].contiguous(), right)
            dist.recv(incoming, left)
        else:
            dist.recv(incoming, left)
            dist.send(chunks[send].contiguous(), right)
        if add:
            chunks[recv] += incoming
        else:
            chunks[recv].copy_(incoming)

    for step in range(n - 1):
        exchange((rank - step) % n, (rank - step - 1) % n, True)
    for step in range(n - 1):
        exchange((rank - step + 1) % n, (rank - step) % n, False)
    return out.view(x.shape)


def ring_in_place(x):
    """Right sums, but into the caller's tensor: x.view(-1) shares x's memory."""
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = x.view(-1)
    chunks = list(flat.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase, add in ((0, True), (1, False)):
        for step in range(n - 1):
            send, recv = (rank - step + phase) % n, (rank - step - 1 + phase) % n
            request = dist.isend(chunks[send].contiguous(), right)
            incoming = torch.empty_like(chunks[recv])
            dist.recv(incoming, left)
            request.wait()
            if add:
                chunks[recv] += incoming
            else:
                chunks[recv].copy_(incoming)
    return x


def ring_returns_flat(x):
    return _ring(x).reshape(-1)


def ring_process_group_allreduce(x):
    y = x.clone()
    dist.distributed_c10d._get_default_group().allreduce([y]).wait()  # what dist.all_reduce calls
    return y


def test_ring_reference_and_course_answer_pass(capsys):
    check_ring_all_reduce(ring_reference)
    assert "PASSED check_ring_all_reduce: 21 cases" in capsys.readouterr().out


def test_ring_blocking_send_recv_by_parity_passes(monkeypatch, capsys):
    """dist.send calls dist.isend inside torch: one message must be counted once (a false reject)."""
    monkeypatch.setattr(lab, "RING_WORLD_SIZES", (3,))  # an odd ring: the parity order matters most
    check_ring_all_reduce(ring_even_odd_blocking)
    assert "PASSED check_ring_all_reduce" in capsys.readouterr().out


def test_ring_mistakes_seen_on_two_ranks(monkeypatch):
    monkeypatch.setattr(lab, "RING_WORLD_SIZES", (2,))
    fails(check_ring_all_reduce, ring_in_place, "changed x on rank", "x.clone()")
    fails(check_ring_all_reduce, ring_returns_flat, "flattened working buffer", "x.shape")
    fails(check_ring_all_reduce, ring_process_group_allreduce, "process group's `allreduce`")


def test_ring_stub():
    fails(check_ring_all_reduce, ring_stub, "NotImplementedError", reason="not done")


def test_ring_chunk_boundaries():
    fails(check_ring_all_reduce, ring_floor_chunks, "chunk boundaries are wrong", "divisible=False")


def test_ring_reduce_scatter_only():
    fails(check_ring_all_reduce, ring_reduce_scatter_only, "all-gather half", "reduce-scatter")


def test_ring_deadlock_ends_with_a_message():
    message = fails(check_ring_all_reduce, ring_blocking_send_first, "deadlock", "dist.isend")
    assert "send" in message.partition("Where rank")[2]  # where it was stuck: in the send


def test_ring_wrong_chunk_bookkeeping():
    # sends chunk r and receives into chunk r: on uneven chunks gloo aborts the receiving process
    fails(check_ring_all_reduce, ring_wrong_bookkeeping, "a rank received a message of a different size",
          "Received data size")


def test_ring_collective_forbidden():
    fails(check_ring_all_reduce, ring_uses_all_reduce, "dist.all_reduce", "point-to-point")


def test_ring_gather_then_sum_is_not_a_ring():
    fails(check_ring_all_reduce, ring_gather_then_sum, "world_size=3", "only to its right neighbour")


def test_ring_whole_tensor_around_sends_too_much():
    fails(check_ring_all_reduce, ring_whole_tensor_around, "world_size=3", "the sum is right", "2(n - 1) chunks")


def test_ring_answer_banned_inside_the_learners_function():
    from labsupport._answers import course_checks_its_answers

    with course_checks_its_answers(False):
        fails(check_ring_all_reduce, ring_calls_the_answer, "course's own answer")


# --- exercise 2: sharding ----------------------------------------------------------------------------

shard_ref = shard_layer.__wrapped__


def _kv_heads(w, rank, n, layer, roundrobin):
    D = layer.attention.head_dim
    heads = w.view(layer.attention.n_kv_heads, D, -1)
    return heads[rank::n].reshape(-1, w.shape[1]).clone() if roundrobin else w.clone()


def shard_kv_not_split(layer, rank, world_size):
    s = shard_ref(layer, rank, world_size)
    s["wk"], s["wv"] = layer.attention.wk.weight.detach().clone(), layer.attention.wv.weight.detach().clone()
    return s


def shard_kv_round_robin(layer, rank, world_size):
    s = shard_ref(layer, rank, world_size)
    for key, lin in (("wk", layer.attention.wk), ("wv", layer.attention.wv)):
        s[key] = _kv_heads(lin.weight.detach(), rank, world_size, layer, True)
    return s


def shard_row_column_swapped(layer, rank, world_size):
    s = shard_ref(layer, rank, world_size)
    w = layer.attention.wo.weight.detach()
    rows = w.shape[0] // world_size
    s["wo"] = w[rank * rows:(rank + 1) * rows].clone()
    return s


def shard_keeps_everything(layer, rank, world_size):
    s = shard_ref(layer, rank, world_size)
    s["full_w1"] = layer.feed_forward.w1.weight.detach().clone()
    return s


def shard_norms_swapped(layer, rank, world_size):
    s = shard_ref(layer, rank, world_size)
    s["attention_norm"], s["ffn_norm"] = s["ffn_norm"], s["attention_norm"]
    return s


def shard_ffn_round_robin(layer, rank, world_size):
    """Another right split: the SwiGLU features dealt round-robin, gate, up and down kept together."""
    s, ffn = shard_ref(layer, rank, world_size), layer.feed_forward
    s["w1"], s["w3"] = ffn.w1.weight[rank::world_size].detach().clone(), ffn.w3.weight[rank::world_size].detach().clone()
    s["w2"] = ffn.w2.weight[:, rank::world_size].detach().clone()
    return s


def shard_ffn_round_robin_w2_blocks(layer, rank, world_size):
    s = shard_ffn_round_robin(layer, rank, world_size)
    s["w2"] = shard_ref(layer, rank, world_size)["w2"]  # not the same features as w1 and w3
    return s


def test_shard_reference_passes(capsys):
    check_shard_layer(shard_ref)
    check_shard_layer(shard_ffn_round_robin)
    assert capsys.readouterr().out.count("PASSED check_shard_layer") == 2


def test_shard_norms_swapped():
    fails(check_shard_layer, shard_norms_swapped, "attention_norm holds ffn_norm's weight")


def test_shard_ffn_features_split_two_ways():
    fails(check_shard_layer, shard_ffn_round_robin_w2_blocks, "w2 on rank 0 holds the wrong part")


def test_shard_stub():
    def stub(layer, rank, world_size):
        raise NotImplementedError

    fails(check_shard_layer, stub, "NotImplementedError", reason="not done")


def test_shard_kv_heads_not_split():
    fails(check_shard_layer, shard_kv_not_split, "KV heads are not split")


def test_shard_kv_heads_split_wrongly_under_gqa():
    fails(check_shard_layer, shard_kv_round_robin, "round-robin", "h // G")


def test_shard_row_column_swapped():
    fails(check_shard_layer, shard_row_column_swapped, "row and column swapped", "wo is row-parallel")


def test_shard_holding_more_than_its_share():
    fails(check_shard_layer, shard_keeps_everything, "only 1/2 of each projection")


# --- exercise 3: the tensor-parallel layer -----------------------------------------------------------


def _layer(shards, x, cos, sin, cfg, reduces=(True, True), reduce_up=False, norms="right", extra_pg=False):
    n = dist.get_world_size()
    B, S, _ = x.shape
    D, hq, hkv = cfg.head_dim, cfg.n_heads // n, cfg.n_kv_heads // n
    h = rms_norm(x, shards["attention_norm"])
    q = F.linear(h, shards["wq"], shards.get("bq")).view(B, S, hq, D).transpose(1, 2)
    k = F.linear(h, shards["wk"], shards.get("bk")).view(B, S, hkv, D).transpose(1, 2)
    v = F.linear(h, shards["wv"], shards.get("bv")).view(B, S, hkv, D).transpose(1, 2)
    if norms == "rope first":
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if "q_norm" in shards:
        q, k = rms_norm(q, shards["q_norm"]), rms_norm(k, shards["k_norm"])
    if norms != "rope first":
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = F.linear(causal_attention(q, k, v).transpose(1, 2).reshape(B, S, hq * D), shards["wo"])
    if reduces[0]:
        all_reduce(y)  # the name imported from torch.distributed: the watcher must see it too
    x = x + y + shards.get("bo", 0)
    h = rms_norm(x, shards["attention_norm" if norms == "one for both" else "ffn_norm"])
    if extra_pg:
        dist.group.WORLD.allreduce([torch.zeros(1)]).wait()  # a third all-reduce, by the group object
    up = F.linear(h, shards["w3"])
    if reduce_up:
        dist.all_reduce(up)  # the planted mistake: summing a column-parallel output
    y = F.linear(F.silu(F.linear(h, shards["w1"])) * up, shards["w2"])
    if reduces[1]:
        dist.all_reduce(y)
    return x + y


def layer_reference(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg)


def layer_stub(shards, x, cos, sin, cfg):
    raise NotImplementedError


def layer_missing_all_reduce(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg, reduces=(True, False))


def layer_all_reduce_after_column_parallel(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg, reduce_up=True)


def layer_rebuilds_the_weights(shards, x, cos, sin, cfg):
    """Two all-reduces, right outputs, no tensor parallelism: the first all-reduce sums zero-padded
    shards into whole weights on every rank, the second a dummy; then the layer runs unsplit."""
    rank, n = dist.get_rank(), dist.get_world_size()
    column, row = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")
    full = {}
    for key in column + row:
        w = shards[key]
        dim = 0 if key in column else 1
        shape = list(w.shape)
        shape[dim] *= n
        whole = torch.zeros(shape)
        whole.narrow(dim, rank * w.shape[dim], w.shape[dim]).copy_(w)
        full[key] = whole
    for key in ("bq", "bk", "bv"):
        if key in shards:
            whole = torch.zeros(shards[key].numel() * n)
            whole[rank * shards[key].numel():(rank + 1) * shards[key].numel()] = shards[key]
            full[key] = whole
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    dist.all_reduce(flat)
    dist.all_reduce(torch.zeros(1))
    offset = 0
    for key, t in full.items():
        full[key] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    B, S, _ = x.shape
    D, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    h = rms_norm(x, shards["attention_norm"])
    q = F.linear(h, full["wq"], full.get("bq")).view(B, S, hq, D).transpose(1, 2)
    k = F.linear(h, full["wk"], full.get("bk")).view(B, S, hkv, D).transpose(1, 2)
    v = F.linear(h, full["wv"], full.get("bv")).view(B, S, hkv, D).transpose(1, 2)
    if "q_norm" in shards:
        q, k = rms_norm(q, shards["q_norm"]), rms_norm(k, shards["k_norm"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    x = x + F.linear(causal_attention(q, k, v).transpose(1, 2).reshape(B, S, hq * D), full["wo"]) + shards.get("bo", 0)
    h = rms_norm(x, shards["ffn_norm"])
    return x + F.linear(F.silu(F.linear(h, full["w1"])) * F.linear(h, full["w3"]), full["w2"])


def test_layer_reference_passes(capsys):
    check_tp_layer_forward(layer_reference)
    assert "PASSED check_tp_layer_forward" in capsys.readouterr().out


def test_layer_course_answer_passes(capsys):
    check_tp_layer_forward(tp_layer_forward.__wrapped__)
    assert "PASSED check_tp_layer_forward" in capsys.readouterr().out


def test_layer_stub():
    fails(check_tp_layer_forward, layer_stub, "NotImplementedError", reason="not done")


def test_layer_missing_all_reduce():
    fails(check_tp_layer_forward, layer_missing_all_reduce, "1 times per layer", "all-reduce is missing")


def test_layer_rebuilding_whole_weights_by_all_reduce():
    fails(check_tp_layer_forward, layer_rebuilds_the_weights, "all-reduced tensors of", "not tensor parallelism")


def layer_one_norm_for_both(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg, norms="one for both")


def layer_rope_before_qk_norm(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg, norms="rope first")


def layer_extra_group_all_reduce(shards, x, cos, sin, cfg):
    return _layer(shards, x, cos, sin, cfg, extra_pg=True)


def test_layer_attention_norm_before_the_ffn_too():
    fails(check_tp_layer_forward, layer_one_norm_for_both, "layer output is wrong", "ffn_norm before the feed-forward")


def test_layer_rope_before_the_qk_norms():
    fails(check_tp_layer_forward, layer_rope_before_qk_norm, "layer output is wrong", "both before RoPE")


def test_layer_third_all_reduce_through_the_group_object():
    fails(check_tp_layer_forward, layer_extra_group_all_reduce, "3 times per layer")


def test_layer_all_reduce_after_column_parallel():
    fails(check_tp_layer_forward, layer_all_reduce_after_column_parallel, "3 times per layer",
          "after a column-parallel layer")
