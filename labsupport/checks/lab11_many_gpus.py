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
import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

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
from ..transformer import RMSNorm, Transformer, rope_cos_sin
from .framework import Case, CheckFailed, ForbiddenCall, graded

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
    "any) and the residual. Each norm has its own weights: attention_norm before attention, ffn_norm before "
    "the feed-forward, q_norm on the queries and k_norm on the keys, both before RoPE."
)


# The collectives as torch.distributed names them, by the ProcessGroup methods that carry them. The
# watchers patch the ProcessGroup class, which every path goes through once: ``dist.all_reduce``, a
# name imported with ``from torch.distributed import all_reduce`` before the check started, and the
# group object's own ``allreduce``; ``dist.send`` (which calls ``dist.isend``) is seen once, not twice.
PG_COLLECTIVES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor",
    "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor",
    "reduce": "reduce", "broadcast": "broadcast", "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single", "scatter": "scatter", "gather": "gather",
}


def _first_tensor(value):
    """The first tensor of a ProcessGroup method's tensor argument (a tensor or a list of them)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _first_tensor(value[0])
    return None


@contextlib.contextmanager
def _patched_process_group(wrap: dict):
    """Replace the ProcessGroup methods named in ``wrap`` (name -> function(original) -> method)
    while active."""
    saved = []
    for method, make in wrap.items():
        original = getattr(ProcessGroup, method, None)
        if original is None:
            continue
        # the class's own entry (pybind11's instancemethod), put back as it was: the function that
        # getattr returns does not bind self once stored on the class
        saved.append((method, ProcessGroup.__dict__.get(method)))
        setattr(ProcessGroup, method, make(original))
    try:
        yield
    finally:
        for method, entry in reversed(saved):
            if entry is None:
                delattr(ProcessGroup, method)
            else:
                setattr(ProcessGroup, method, entry)


@contextlib.contextmanager
def watched_collectives(forbid: bool, numels: list | None = None):
    """Count (or, with ``forbid``, refuse) collectives while active, however they are called.
    Yields a dict name -> calls (torch.distributed's names: ``all_reduce``, ``all_gather``, ...).
    With ``numels``, appends the element count of each all-reduce's tensor to it."""
    counts: dict[str, int] = {}

    def make(method):
        name = PG_COLLECTIVES[method]

        def factory(original):
            def wrapper(self, *args, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                tensor = _first_tensor(args[0]) if args else None
                if numels is not None and name == "all_reduce" and tensor is not None:
                    numels.append(int(tensor.numel()))
                if forbid:
                    raise ForbiddenCall(
                        f"your function called `dist.{name}` (or the process group's `{method}`), a collective "
                        f"this exercise asks you to build from point-to-point dist.send / dist.recv (or isend / "
                        f"irecv).")
                return original(self, *args, **kwargs)
            return wrapper
        return factory

    with _patched_process_group({method: make(method) for method in PG_COLLECTIVES}):
        yield counts


@contextlib.contextmanager
def watched_sends():
    """Record every point-to-point send while active: a list of (destination, elements) pairs,
    one per message, however it was sent (``dist.send``, ``dist.isend``, ``P2POp``, the group's own
    ``send``). The destination is the rank in the default group."""
    sent: list[tuple[int, int]] = []

    def factory(original):
        def wrapper(self, tensors, dst, *args, **kwargs):
            tensor = _first_tensor(tensors)
            sent.append((int(dst), 0 if tensor is None else int(tensor.numel())))
            return original(self, tensors, dst, *args, **kwargs)
        return wrapper

    with _patched_process_group({"send": factory}):
        yield sent


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


def ring_sizes(world_size: int) -> list[int | tuple[int, ...]]:
    """The tensor sizes checked at ``world_size``: divisible ones first, then ones that are not
    (remainders 1 and n - 1), one smaller than the world (empty chunks), a larger one, and a 2-D
    tensor (3, 2n + 1), whose result must keep its shape."""
    n = world_size
    return [4 * n, 64 * n, 4 * n + 1, 7 * n + n - 1, 1, 1000 * n + 1, (3, 2 * n + 1)]


def _shape(size) -> tuple[int, ...]:
    return tuple(size) if isinstance(size, tuple) else (size,)


def _ring_worker(fn, sizes, self_check):
    """On every rank: the learner's ring on each size, and dist.all_reduce's answer; whether the
    learner's function changed its input."""
    rank = dist.get_rank()
    rows = []
    with course_checks_its_answers(self_check), banning((ring_all_reduce,)):
        for size in sizes:
            shape = _shape(size)
            gen = torch.Generator().manual_seed(7919 * rank + math.prod(shape))
            x = torch.randint(-100, 100, shape, generator=gen).float()  # integers: sums are exact
            expected = x.clone()
            dist.all_reduce(expected)
            given = x.clone()
            with watched_collectives(forbid=True), watched_sends() as sent:
                got = fn(given)
            rows.append(dict(numel=x.numel(), got=_plain(got), expected=expected, mine=x, sent=list(sent),
                             input_changed=not torch.equal(given, x)))
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
        for index, size in enumerate(sizes):
            checker.cases += 1
            numel = math.prod(_shape(size))
            case = Case(world_size=n, shape=_shape(size), divisible=numel % n == 0)
            for rank in range(n):
                row = per_rank[rank][index]
                got, expected = row["got"], row["expected"]
                if not isinstance(got, torch.Tensor):
                    checker.fail(case, f"rank {rank} returned a {got}, expected a torch.Tensor.",
                                 "return the reduced tensor (a new one, shaped like x).")
                if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
                    flat = got.dim() == 1 and got.numel() == expected.numel() and expected.dim() > 1
                    checker.fail(case, f"rank {rank} returned shape {tuple(got.shape)} and dtype {got.dtype}, "
                                       f"expected {tuple(expected.shape)} and {expected.dtype}."
                                 + (" That is the flattened working buffer: reshape it back to x.shape before "
                                    "returning (`out.view(x.shape)`)." if flat else ""),
                                 "return a tensor shaped like x (reshape the flat result back).")
                got, expected = got.reshape(-1), expected.reshape(-1)
                if torch.equal(got, expected) and row["input_changed"]:
                    checker.fail(case, f"the sum is right, but your function changed x on rank {rank}: it "
                                       f"summed into the caller's tensor. Return a new tensor and leave x as it "
                                       f"was: work on `x.clone()` (x.view or x.reshape share x's memory).",
                                 RING_RULE)
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


def _varied_norms(model: Transformer, seed: int) -> Transformer:
    """Give every RMSNorm of ``model`` its own weights, 1 + 0.1 * randn (a new model's are all 1.0,
    so a norm swapped for another, used twice, or applied after RoPE, which keeps each pair's length,
    could not be seen)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=gen))
    return model


def unguarded_shard(layer, rank, n):
    """The course's shards (the course's own answer, which the checks compare with)."""
    return shard_layer.__wrapped__(layer, rank, n)


def _shard_mistakes(key, layer, cfg, rank, n) -> dict[str, torch.Tensor]:
    """What the planted mistakes give for weight ``key`` on this rank."""
    attn, ffn = layer.attention, layer.feed_forward
    weights = {"wq": attn.wq.weight, "wk": attn.wk.weight, "wv": attn.wv.weight, "wo": attn.wo.weight,
               "w1": ffn.w1.weight, "w3": ffn.w3.weight, "w2": ffn.w2.weight}
    norms = {"attention_norm": layer.attention_norm, "ffn_norm": layer.ffn_norm,
             "q_norm": layer.attention.q_norm, "k_norm": layer.attention.k_norm}
    if key in norms:
        return {f"{key} holds {other}'s weight (each norm has its own: attention_norm before attention, ffn_norm "
                f"before the feed-forward, q_norm on the queries, k_norm on the keys)": norm.weight.detach()
                for other, norm in norms.items() if other != key and norm is not None}
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


def _strided_ffn(layer, rank: int, n: int) -> dict[str, torch.Tensor]:
    """The SwiGLU features dealt round-robin (rank r: features r, r + n, ...): another partition
    that gives the same sums, since each feature's gate, up and down weights stay together."""
    ffn = layer.feed_forward
    return {"w1": ffn.w1.weight[rank::n].detach().clone(), "w3": ffn.w3.weight[rank::n].detach().clone(),
            "w2": ffn.w2.weight[:, rank::n].detach().clone()}


def _ffn_layout(got: dict, layer, rank: int, n: int) -> str:
    """"strided" when the learner's w1 holds the round-robin features, else "blocks" (Megatron's)."""
    have, strided = got.get("w1"), _strided_ffn(layer, rank, n)["w1"]
    if isinstance(have, torch.Tensor) and tuple(have.shape) == tuple(strided.shape) and \
            torch.equal(have.detach(), strided) and n > 1:
        return "strided"
    return "blocks"


@graded(points=10, bans=(shard_layer,))
def check_shard_layer(fn, checker):
    """``fn(layer, rank, world_size)`` must return this rank's shards of a decoder layer as a dict
    (keys as :func:`labsupport.tensor_parallel.shard_layer` documents), for every rank, at world
    sizes 2 and 4, on a grouped-query model with biases and q/k norms and on ``tiny-2m``. The SwiGLU
    features may be split in contiguous blocks (Megatron's) or dealt round-robin, the same way on
    every rank."""
    for cfg_spec in SHARD_CONFIGS:
        model = _varied_norms(Transformer(cfg_spec, seed=5), seed=6)
        cfg = model.cfg
        for n in (2, 4):
            try:
                check_divisible(cfg, n)
            except ValueError:
                continue
            ffn_layout = None  # rank 0's split of the SwiGLU features: every rank must use the same
            for rank in range(n):
                case = Case(model=cfg.name, world_size=n, rank=rank, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads)
                layer = model.layers[0]
                expected = unguarded_shard(layer, rank, n)
                got = checker.call(fn, layer, rank, n, case=case)
                if not isinstance(got, dict):
                    checker.fail(case, f"your function returned a {type(got).__name__}, expected a dict of "
                                       f"tensors.", TP_RULE)
                ffn_layout = _ffn_layout(got, layer, rank, n) if ffn_layout is None else ffn_layout
                if ffn_layout == "strided":
                    expected.update(_strided_ffn(layer, rank, n))
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
            model = _varied_norms(Transformer(spec, seed=11), seed=12)
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
