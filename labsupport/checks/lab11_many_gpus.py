"""Checks for the many-GPUs lab: a ring all-reduce, a tensor-parallel split of the course model.

The ring all-reduce and the tensor-parallel forward run on several processes (gloo on the CPU,
started by :func:`labsupport.distributed.launch`); what each rank computed comes back to the
notebook, where it is compared. Every collective is watched while the learner's function runs:
the ring must be built from point-to-point ``send``/``recv`` (``isend``/``irecv``), sending only
to the right neighbour and at most 2(n - 1) chunks (so exchanging whole tensors and adding fails);
the tensor-parallel layer must call ``dist.all_reduce`` exactly twice, each time on the layer's
activation (so rebuilding whole weights with an all-reduce of zero-padded shards fails).

Tolerances: the ring sums integer-valued fp32 tensors, so every correct order of additions gives
the same bits, and results must be exactly equal to ``dist.all_reduce``'s. The tensor-parallel
layer adds its partial sums in another order than the single-process model: fp32 outputs must
be within ``atol = 1e-5`` and ``rtol = 1e-4`` of it (observed differences are below 1e-6).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .._answers import banning, course_checks_its_answers, course_is_checking
from ..collectives import ring_all_reduce, ring_chunk_bounds
from ..distributed import RankFailed, RankHung, launch
from ..models import ModelConfig
from ..tensor_parallel import (
    TensorParallelModel,
    check_divisible,
    shard_layer,
    shard_slices,
    tp_layer_forward,
)
from ..transformer import Transformer, rope_cos_sin
from .framework import Case, CheckFailed, ForbiddenCall, graded

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "reduce", "broadcast", "all_to_all", "all_to_all_single", "scatter", "gather",
               "_all_gather_base", "_reduce_scatter_base")
RING_WORLD_SIZES = (2, 3, 4)
TP_WORLD_SIZE = 2
CALL_TIMEOUT = 20.0  # seconds the learner's function may run on each rank (it needs milliseconds)
LAUNCH_TIMEOUT = 180.0  # the whole launch, process start-up included (seconds on a busy 2-core CI machine)
ATOL, RTOL = 1e-5, 1e-4

RING_RULE = (
    "cut the flattened tensor into world_size chunks with tensor_split (the first numel % n chunks are one "
    "element longer); reduce-scatter: n - 1 steps, at step s send chunk (rank - s) % n to rank + 1 and add "
    "the chunk received from rank - 1 into chunk (rank - s - 1) % n; then all-gather: n - 1 more steps "
    "passing the finished chunks on. Post the send with dist.isend before the blocking dist.recv."
)
TP_RULE = (
    "column-parallel layers (wq, wk, wv, w1, w3) keep this rank's rows; row-parallel layers (wo, w2) keep "
    "its columns; rank r owns query heads [r*H/n, (r+1)*H/n) and the KV heads they read, [r*Hkv/n, "
    "(r+1)*Hkv/n); norms and the output bias are copied whole."
)
FORWARD_RULE = (
    "attention and SwiGLU run on this rank's heads and features with no communication; the two row-parallel "
    "products (after wo, after w2) are partial sums: all-reduce each once, then add the output bias (if "
    "any) and the residual."
)


@contextlib.contextmanager
def watched_collectives(forbid: bool, numels: list | None = None):
    """Count (or, with ``forbid``, refuse) calls to torch.distributed's collectives while active.
    Yields a dict name -> calls. Patches ``torch.distributed`` and ``distributed_c10d`` alike.
    With ``numels``, appends the element count of each ``all_reduce``'s tensor to it."""
    counts: dict[str, int] = {}
    saved = []
    for name in COLLECTIVES:
        for module in (dist, distributed_c10d):
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(*args, __name=name, __original=original, **kwargs):
                counts[__name] = counts.get(__name, 0) + 1
                if numels is not None and __name == "all_reduce" and args and isinstance(args[0], torch.Tensor):
                    numels.append(int(args[0].numel()))
                if forbid:
                    raise ForbiddenCall(
                        f"your function called `dist.{__name}`, a collective this exercise asks you to build "
                        f"from point-to-point dist.send / dist.recv (or isend / irecv).")
                return __original(*args, **kwargs)

            saved.append((module, name, original))
            setattr(module, name, wrapper)
    try:
        yield counts
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


P2P_SENDS = ("send", "isend")


@contextlib.contextmanager
def watched_sends():
    """Record every point-to-point send while active: a list of (destination, elements) pairs.
    Patches ``torch.distributed`` and ``distributed_c10d`` alike (``P2POp(dist.isend, ...)`` built
    inside the block goes through the wrapper too)."""
    sent: list[tuple[int, int]] = []
    saved = []
    for name in P2P_SENDS:
        for module in (dist, distributed_c10d):
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(tensor, dst=None, *args, __original=original, **kwargs):
                sent.append((-1 if dst is None else int(dst), int(tensor.numel())))
                return __original(tensor, dst, *args, **kwargs)

            saved.append((module, name, original))
            setattr(module, name, wrapper)
    try:
        yield sent
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def ring_send_limit(numel: int, world_size: int) -> int:
    """The most elements one rank sends in a ring all-reduce: 2(n - 1) chunks of at most
    ceil(numel / n) elements (chapter 11: 2(n - 1)/n of the tensor)."""
    return 2 * (world_size - 1) * -(-numel // world_size)


def _plain(value):
    """A returned tensor as a plain CPU tensor (a subclass could fake comparisons), else its type."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor(value.detach().cpu()).clone() if type(value) is not torch.Tensor else value.detach().cpu()
    return type(value).__name__


# --- exercise 1: the ring all-reduce --------------------------------------------------------------


def ring_sizes(world_size: int) -> list[int]:
    """The tensor sizes checked at ``world_size``: divisible ones first, then ones that are not
    (remainders 1 and n - 1), one smaller than the world (empty chunks) and a larger one."""
    n = world_size
    return [4 * n, 64 * n, 4 * n + 1, 7 * n + n - 1, 1, 1000 * n + 1]


def _ring_worker(fn, sizes, self_check):
    """On every rank: the learner's ring on each size, and dist.all_reduce's answer."""
    rank = dist.get_rank()
    rows = []
    with course_checks_its_answers(self_check), banning((ring_all_reduce,)):
        for numel in sizes:
            gen = torch.Generator().manual_seed(7919 * rank + numel)
            x = torch.randint(-100, 100, (numel,), generator=gen).float()  # integers: sums are exact
            expected = x.clone()
            dist.all_reduce(expected)
            with watched_collectives(forbid=True), watched_sends() as sent:
                got = fn(x.clone())
            rows.append(dict(numel=numel, got=_plain(got), expected=expected, mine=x, sent=list(sent)))
    return rows


def _launch_failure(name: str, exc: Exception, case: Case, what: str):
    if isinstance(exc, RankHung):
        where = "".join(str(exc).partition("Where rank")[1:])
        raise CheckFailed(
            f"{name}: case [{case}]: deadlock: ranks {exc.ranks} were still inside your function after the "
            f"time limit, waiting for each other (every process was ended). With blocking calls, if every rank "
            f"calls dist.send before dist.recv, every rank waits for a receiver that never comes. Post the send "
            f"with `request = dist.isend(chunk, right)`, then `dist.recv(buffer, left)`, then `request.wait()`."
            f"\n{where}".rstrip()) from exc
    text = str(exc)
    if "NotImplementedError" in text.split("Its traceback", 1)[0]:
        raise CheckFailed(
            f"{name}: `{what}` still raises NotImplementedError. Replace the `raise NotImplementedError(...)` "
            f"line in the exercise cell with your code, run that cell, then run this check again.",
            reason="not done") from exc
    if "ForbiddenCall" in text or "AnswerUsed" in text:
        summary = text.split(". Every process was ended", 1)[0].partition("failed with ")[2]
        raise CheckFailed(f"{name}: case [{case}]: {summary.partition(': ')[2] or summary}") from exc
    if "size doesn't match" in text or "collective mismatch" in text:
        text += ("\nWhat it means: a rank received a message of a different size than the buffer it posted: "
                 "the chunk one rank sends is not the chunk its neighbour expects (check which chunk index "
                 "each step sends and receives, and that both sides cut the chunks the same way).")
    raise CheckFailed(f"{name}: case [{case}]: your function failed on one of the processes: {text}") from exc


@graded(points=10, bans=(ring_all_reduce,))
def check_ring_all_reduce(fn, checker):
    """``fn(x)``, run on every rank, must return the element-wise sum of every rank's ``x`` (a new
    tensor of ``x``'s shape and dtype), using only point-to-point sends and receives. Checked at
    world sizes 2, 3 and 4 on sizes divisible by the world size and not, against ``dist.all_reduce``."""
    name = checker.name
    for n in RING_WORLD_SIZES:
        sizes = ring_sizes(n)
        case = Case(world_size=n, sizes=sizes, backend="gloo")
        try:
            per_rank = launch(_ring_worker, n, args=(fn, sizes, course_is_checking()), backend="gloo",
                              timeout=LAUNCH_TIMEOUT, call_timeout=CALL_TIMEOUT)
        except (RankFailed, RankHung) as exc:
            _launch_failure(name, exc, case, getattr(fn, "__name__", "your function"))
        for index, numel in enumerate(sizes):
            checker.cases += 1
            case = Case(world_size=n, numel=numel, divisible=numel % n == 0)
            for rank in range(n):
                row = per_rank[rank][index]
                got, expected = row["got"], row["expected"]
                if not isinstance(got, torch.Tensor):
                    checker.fail(case, f"rank {rank} returned a {got}, expected a torch.Tensor.",
                                 "return the reduced tensor (a new one, shaped like x).")
                if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
                    checker.fail(case, f"rank {rank} returned shape {tuple(got.shape)} and dtype {got.dtype}, "
                                       f"expected {tuple(expected.shape)} and {expected.dtype}.",
                                 "return a tensor shaped like x (reshape the flat result back).")
                if torch.equal(got, expected):
                    _check_ring_traffic(checker, case, rank, n, numel, row["sent"])
                    continue
                bounds = ring_chunk_bounds(numel, n)
                done = [i for i, (a, b) in enumerate(bounds) if b > a and torch.equal(got[a:b], expected[a:b])]
                nonempty = [i for i, (a, b) in enumerate(bounds) if b > a]
                wrong = int((got != expected).sum())
                problem = (f"rank {rank}'s result differs from dist.all_reduce's at {wrong} of {numel} elements "
                           f"(first at index {int((got != expected).nonzero()[0])}).")
                if numel % n:  # the sizes n divides came first and were right
                    problem += (f"\nSizes divisible by {n} were right; this one is not: the chunk boundaries "
                                f"are wrong when n does not divide the size (elements left out, or chunks of "
                                f"different lengths on the two sides of a send).")
                elif len(nonempty) > 1 and len(done) == 1:
                    problem += (f"\nOnly chunk {done[0]} of {n} holds the full sum on rank {rank}: that is where "
                                f"a reduce-scatter ends. The all-gather half (n - 1 more steps passing the "
                                f"finished chunks around the ring) is missing.")
                checker.fail(case, problem, RING_RULE)


def _check_ring_traffic(checker, case, rank, n, numel, sent):
    """A right answer must also travel like a ring: sends only to the right neighbour, at most
    2(n - 1) chunks in all. Catches exchanging whole tensors with every rank, then summing (n - 1
    times the tensor per rank, instead of 2(n - 1)/n). Sends made through a function saved before
    the check started are not seen; then nothing is checked here."""
    right = (rank + 1) % n
    strangers = sorted({dst for dst, _ in sent if dst not in (right, -1)})
    if strangers:
        checker.fail(case, f"rank {rank} sent to rank(s) {strangers}; in a ring each rank sends only to its right "
                           f"neighbour, rank {right}, and receives only from its left one.", RING_RULE)
    total, limit = sum(k for _, k in sent), ring_send_limit(numel, n)
    if total > limit:
        checker.fail(case, f"the sum is right, but rank {rank} sent {total} elements for a tensor of {numel}; a "
                           f"ring all-reduce sends 2(n - 1) chunks of about 1/n of the tensor, at most {limit} "
                           f"here. Sending the whole tensor around the ring (or to every rank) and adding costs "
                           f"n - 1 times the tensor, which is what the ring exists to avoid.", RING_RULE)


# --- exercise 2: sharding one layer ------------------------------------------------------------------

SHARD_CONFIGS = (
    ModelConfig("tp-check", 1, 32, 8, 4, 48, 64, head_dim=8, qkv_bias=True, o_bias=True, qk_norm=True,
                source="lab 11 check"),
    "tiny-2m",
)


def unguarded_shard(layer, rank, n):
    """The course's shards (the course's own answer, which the checks compare with)."""
    return shard_layer.__wrapped__(layer, rank, n)


def _shard_mistakes(key, layer, cfg, rank, n) -> dict[str, torch.Tensor]:
    """What the planted mistakes give for weight ``key`` on this rank."""
    attn, ffn = layer.attention, layer.feed_forward
    weights = {"wq": attn.wq.weight, "wk": attn.wk.weight, "wv": attn.wv.weight, "wo": attn.wo.weight,
               "w1": ffn.w1.weight, "w3": ffn.w3.weight, "w2": ffn.w2.weight}
    if key not in weights:
        return {}
    w = weights[key].detach()
    dim, _ = shard_slices(cfg, rank, n)[key]
    other = 1 - dim
    wrong = {}
    if key in ("wk", "wv"):
        D, hkv = cfg.head_dim, cfg.n_kv_heads // n
        heads = w.view(cfg.n_kv_heads, D, -1)
        wrong["the KV heads are not split: every rank holds all of them (its query heads read only "
              f"{hkv} of them)"] = w
        wrong["the KV heads are dealt round-robin (rank r gets heads r, r + n, ...), so a rank's KV heads "
              "are not the ones its query heads read (query head h reads KV head h // G)"] = \
            heads[rank::n].reshape(-1, w.shape[1])
        q_rows = slice(rank * (cfg.n_heads // n) * D, (rank + 1) * (cfg.n_heads // n) * D)
        if q_rows.stop <= w.shape[0]:
            wrong["the KV projection was cut at the query heads' boundaries (H/n heads per rank), not at the KV "
                  "heads' (Hkv/n per rank)"] = w[q_rows]
    size = w.shape[other] // n
    swapped = w.narrow(other, rank * size, size)
    kind = "row-parallel" if key in ("wo", "w2") else "column-parallel"
    keep = "columns (its input features)" if kind == "row-parallel" else "rows (its output features)"
    wrong[f"{key} is split along the wrong dimension (row and column swapped): {key} is {kind}, so each rank "
          f"keeps its {keep}"] = swapped
    return wrong


@graded(points=10, bans=(shard_layer,))
def check_shard_layer(fn, checker):
    """``fn(layer, rank, world_size)`` must return this rank's shards of a decoder layer as a dict
    (keys as :func:`labsupport.tensor_parallel.shard_layer` documents), for every rank, at world
    sizes 2 and 4, on a grouped-query model with biases and q/k norms and on ``tiny-2m``."""
    for cfg_spec in SHARD_CONFIGS:
        model = Transformer(cfg_spec, seed=5)
        cfg = model.cfg
        for n in (2, 4):
            try:
                check_divisible(cfg, n)
            except ValueError:
                continue
            for rank in range(n):
                case = Case(model=cfg.name, world_size=n, rank=rank, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads)
                layer = model.layers[0]
                expected = unguarded_shard(layer, rank, n)
                got = checker.call(fn, layer, rank, n, case=case)
                if not isinstance(got, dict):
                    checker.fail(case, f"your function returned a {type(got).__name__}, expected a dict of "
                                       f"tensors.", TP_RULE)
                missing = [k for k in expected if k not in got]
                if missing:
                    checker.fail(case, f"the dict has no {', '.join(missing)}; this model needs {sorted(expected)}.",
                                 TP_RULE)
                for key, want in expected.items():
                    have = got[key]
                    if not isinstance(have, torch.Tensor):
                        checker.fail(case, f"{key} is a {type(have).__name__}, expected a tensor.", TP_RULE)
                    have = have.detach()
                    matched = None
                    if tuple(have.shape) != tuple(want.shape) or not torch.equal(have, want):
                        for desc, wrong in _shard_mistakes(key, layer, cfg, rank, n).items():
                            if tuple(wrong.shape) == tuple(have.shape) and torch.equal(have, wrong):
                                matched = desc
                                break
                        problem = (f"{key} on rank {rank} has shape {tuple(have.shape)}, expected "
                                   f"{tuple(want.shape)}." if tuple(have.shape) != tuple(want.shape) else
                                   f"{key} on rank {rank} holds the wrong part of the weight.")
                        if matched:
                            problem += f"\nYour {key} matches what we get when {matched}."
                        checker.fail(case, problem, TP_RULE)
                held = sum(t.numel() for t in got.values() if isinstance(t, torch.Tensor))
                share = sum(t.numel() for t in expected.values())
                if held > share:
                    checker.fail(case, f"the dict holds {held} numbers in all, but this rank's share of the "
                                       f"layer is {share}: tensor parallelism keeps only 1/{n} of each projection "
                                       f"on each rank.", "return only the keys listed, nothing more.")


# --- exercise 3: the tensor-parallel layer ------------------------------------------------------------

FORWARD_CONFIGS = (SHARD_CONFIGS[0], "tiny-2m")


def _tp_worker(fn, self_check):
    """On every rank: each layer of each model through the learner's layer, from the single-process
    model's input to that layer; then the whole model through it. Returns per-case results."""
    results = []
    with course_checks_its_answers(self_check), banning((tp_layer_forward,)):
        for spec in FORWARD_CONFIGS:
            model = Transformer(spec, seed=11)
            cfg = model.cfg
            tokens = model.random_prompt(2, 5, seed=3)
            cos, sin = rope_cos_sin(torch.arange(5), cfg.head_dim, model.dtype, cfg.rope_theta, cfg.rope_scaling)
            rank, n = dist.get_rank(), dist.get_world_size()
            with torch.no_grad():
                x = model.tok_embeddings(tokens)
                for i, layer in enumerate(model.layers):
                    expected = layer(x, cos, sin, model.contiguous_batch(None, 0, x.shape[1]), i)
                    shards = unguarded_shard(layer, rank, n)
                    numels: list[int] = []
                    with watched_collectives(forbid=False, numels=numels) as counts:
                        got = fn(shards, x.clone(), cos, sin, cfg)
                    results.append(dict(model=cfg.name, layer=i, got=_plain(got), expected=expected,
                                        counts=dict(counts), numels=numels, activation=x.numel()))
                    x = expected
                with watched_collectives(forbid=False) as counts:
                    logits = TensorParallelModel(model, layer_fn=fn).run(tokens)
                reference = model.forward_no_cache(tokens)
                results.append(dict(model=cfg.name, layer="whole model (logits)", got=_plain(logits),
                                    expected=reference, counts=dict(counts), layers=cfg.n_layers))
    return results


@graded(points=10, bans=(tp_layer_forward,))
def check_tp_layer_forward(fn, checker):
    """``fn(shards, x, cos, sin, cfg)``, run on every rank with that rank's shards, must return
    the layer's output (B, S, d), equal to the single-process layer's (fp32, atol 1e-5, rtol 1e-4),
    calling ``dist.all_reduce`` exactly twice; and the whole model built from it must give the
    single-process model's logits."""
    name = checker.name
    case = Case(world_size=TP_WORLD_SIZE, backend="gloo", models="tp-check (GQA, biases, q/k norms), tiny-2m")
    try:
        per_rank = launch(_tp_worker, TP_WORLD_SIZE, args=(fn, course_is_checking()), backend="gloo",
                          timeout=LAUNCH_TIMEOUT, call_timeout=CALL_TIMEOUT * 3)
    except (RankFailed, RankHung) as exc:
        _launch_failure(name, exc, case, getattr(fn, "__name__", "your function"))
    for index, row in enumerate(per_rank[0]):
        for rank in range(TP_WORLD_SIZE):
            row = per_rank[rank][index]
            case = Case(world_size=TP_WORLD_SIZE, rank=rank, model=row["model"], layer=row["layer"])
            calls = row["counts"].get("all_reduce", 0)
            wanted = 2 * row.get("layers", 1)
            if calls != wanted:
                per = "per layer " if "layers" not in row else f"for {row['layers']} layers "
                problem = f"your layer called dist.all_reduce {calls} times {per}; Megatron's split needs exactly {wanted}"
                if calls < wanted:
                    problem += (": an all-reduce is missing. The products of the row-parallel layers (wo after "
                                "attention, w2 after the feed-forward) are partial sums: each must be all-reduced.")
                else:
                    problem += (": one too many. An all-reduce after a column-parallel layer (q, k, v, gate, up) "
                                "adds together outputs that belong to different heads or features; they are "
                                "already complete on their rank and need no communication.")
                checker.fail(case, problem + ".", FORWARD_RULE)
            odd = [k for k in row.get("numels", ()) if k != row["activation"]]
            if odd:
                checker.fail(case, f"your layer all-reduced tensors of {row['numels']} elements; in Megatron's split "
                                   f"each all-reduce carries the layer's activation, batch x tokens x d = "
                                   f"{row['activation']} numbers. Summing anything else (weights padded with "
                                   f"zeros, to rebuild them whole on every rank) is not tensor parallelism.",
                             FORWARD_RULE)
            others = {k: v for k, v in row["counts"].items() if k != "all_reduce"}
            if others and "layers" not in row:
                checker.fail(case, f"your layer called {', '.join(f'dist.{k}' for k in others)}; the split needs "
                                   f"only the two all-reduces.", FORWARD_RULE)
        row = per_rank[0][index]
        checker.cases += 1
        for rank in range(TP_WORLD_SIZE):
            row = per_rank[rank][index]
            case = Case(world_size=TP_WORLD_SIZE, rank=rank, model=row["model"], layer=row["layer"])
            checker.expect_tensor(row["got"], row["expected"], case=case, atol=ATOL, rtol=RTOL,
                                  what="layer output" if "layers" not in row else "logits", hint=FORWARD_RULE)
