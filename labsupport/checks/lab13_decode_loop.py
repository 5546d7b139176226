"""Checks for the decode-loop lab: sampling, the scheduler's step decision, speculative acceptance.

Two of the three are statistical. They are seeded, so a given function always gets the same
verdict, and their tolerances come from the sample size: each test is set so that a correct
implementation fails it with probability at most :data:`FALSE_FAIL` (one in a million) per case,
whatever the seed.

* Frequencies (:func:`check_sample`): ``N`` draws of a token of probability ``p`` give a
  binomial count ``Binomial(N, p)``. Each token's count must lie in the exact binomial interval
  that leaves at most ``FALSE_FAIL / (2 V)`` in each tail (:func:`binomial_interval`; a Bonferroni
  split over the ``V`` tokens and both tails). The normal approximation, ``N p`` plus or minus
  ``z sqrt(N p (1 - p))``, is not used: for a token with ``N p`` below 1 its upper tail is far
  heavier than the normal's (a token of probability 3e-5 in 20,000 draws would fail a correct
  sampler about once in 30,000 runs, not once in a million). A token of probability 0 must never
  appear, and two calls with equally seeded generators must return the same tokens whatever the
  global random state (the draws come from ``generator``).
* Distributions (:func:`check_speculative_accept`): Pearson's chi-squared statistic over the
  tokens of non-zero probability, against the ``1 - FALSE_FAIL`` quantile of the chi-squared
  distribution with ``V' - 1`` degrees of freedom (computed exactly, :func:`chi2_threshold`).
  Every expected count is at least 20, so the chi-squared approximation of the statistic holds.
  Each case is judged twice, after 1,000 steps and after all 4,000, at half of ``FALSE_FAIL`` each
  (so a clearly wrong rule fails after a quarter of the work), and the two runs of 64 steps with
  equally seeded generators must agree whatever the global random state.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from ..engine.sampler import batched_sampling_probs
from ..sampling import sample, sampling_probs
from ..scheduler import SeqView, SimStep, TraceItem, blocks_for, schedule_step, simulate
from ..speculative import speculative_accept
from .framework import Case, CheckFailed, graded

FALSE_FAIL = 1e-6  # the chance a correct implementation fails one statistical case

SAMPLING_RULE = (
    "divide the logits by the temperature BEFORE the softmax (temperature 0: return the argmax); "
    "top-k keeps the k largest (0 keeps all); top-p sorts the remaining probabilities, largest first, "
    "and keeps the shortest prefix whose sum reaches top_p, the token that crosses it included, and "
    "always at least the most likely token (1.0 keeps all); renormalise and draw one token per row with torch.multinomial(probs, 1, generator=generator)."
)
SCHEDULER_RULE = (
    "running sequences first, oldest first, each min(left, budget left) tokens; if one needs more blocks "
    "than are free, preempt the newest running sequence (itself if it is the newest); if nothing was "
    "preempted, admit waiting sequences in order with min(left, budget left) tokens while budget, slots "
    "(max_running) and blocks last, and stop at the first one that does not fit."
)
ACCEPT_RULE = (
    "for each proposal i: accept with probability min(1, p_i(x) / q_i(x)) (draw r = torch.rand((), "
    "generator=generator) and accept if r < ratio); at the first rejection emit a token drawn from "
    "max(0, p_i - q_i) renormalised and stop; if all k are accepted, emit a bonus token drawn from "
    "target_probs[k]."
)


def binomial_interval(n: int, p: float, false_fail: float) -> tuple[int, int]:
    """The smallest ``lo`` and largest ``hi`` with ``P(X < lo) <= false_fail / 2`` and
    ``P(X > hi) <= false_fail / 2`` for ``X ~ Binomial(n, p)``, from the exact probabilities (in
    float64, through ``lgamma``)."""
    if p <= 0:
        return 0, 0
    if p >= 1:
        return n, n
    k = torch.arange(n + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
               + k * math.log(p) + (n - k) * math.log1p(-p))
    pmf = log_pmf.exp()
    below = torch.cumsum(pmf, 0) - pmf  # P(X < k)
    above = torch.flip(torch.cumsum(torch.flip(pmf, (0,)), 0), (0,)) - pmf  # P(X > k)
    lo = int((below <= false_fail / 2).nonzero().max())
    hi = int((above <= false_fail / 2).nonzero().min())
    return lo, hi


def chi2_sf(x: float, df: int) -> float:
    """``P(X > x)`` for a chi-squared variable with ``df`` (a positive integer) degrees of freedom,
    exactly, by the recursion ``Q(x; k + 2) = Q(x; k) + (x/2)^(k/2) e^(-x/2) / Gamma(k/2 + 1)`` from
    ``Q(x; 1) = 2 (1 - Phi(sqrt(x)))`` and ``Q(x; 2) = e^(-x/2)``."""
    if x <= 0:
        return 1.0
    k = 2 if df % 2 == 0 else 1
    q = math.exp(-x / 2) if k == 2 else 2 * (1 - NormalDist().cdf(math.sqrt(x)))
    while k < df:
        q += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1))
        k += 2
    return q


def chi2_threshold(df: int, false_fail: float = FALSE_FAIL) -> float:
    """The ``1 - false_fail`` quantile of the chi-squared distribution with ``df`` degrees of
    freedom (bisection on :func:`chi2_sf`)."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > false_fail else (lo, mid)
    return hi


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` over the tokens with ``probs > 0``, and
    its degrees of freedom; ``inf`` if a token of probability 0 was counted."""
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, int((probs > 0).sum()) - 1
    n = counts.sum()
    keep = probs > 0
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


# --- exercise 1: sampling -----------------------------------------------------------------------------


def _sampling_cases():
    base = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, -3.0])  # distinct, no ties
    gaps = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))  # top-p 0.6 crosses at the 2nd token
    flat = torch.linspace(1.0, -1.0, 40)
    # top-k 4 then top-p 0.6 keeps 2 tokens; the other order, or top-p measured on the whole
    # distribution, keeps 3. Temperature 0.5 before top-p 0.6 keeps 2; top-p at T = 1 keeps 3.
    order = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]))
    return [
        ("plain softmax", base, dict(temperature=1.0)),
        ("temperature 0.5", base, dict(temperature=0.5)),
        ("temperature 2", base, dict(temperature=2.0)),
        ("top-k 3", base, dict(temperature=1.0, top_k=3)),
        ("top-p 0.6", gaps, dict(temperature=1.0, top_p=0.6)),
        ("top-p 0.75", gaps, dict(temperature=1.0, top_p=0.75)),
        ("top-p 1.0 keeps every token", flat, dict(temperature=1.0, top_p=1.0)),
        ("top-k 5, top-p 0.8, temperature 0.7", base, dict(temperature=0.7, top_k=5, top_p=0.8)),
        ("top-k 4 first, then top-p 0.6 on what is left", order, dict(temperature=1.0, top_k=4, top_p=0.6)),
        ("temperature 0.5 first, then top-p 0.6", order, dict(temperature=0.5, top_p=0.6)),
    ]


def _filtered(z, temperature, top_k, top_p, *, top_p_first=False, temperature_last=False):
    """One row's distribution with the steps in another order: top-p before top-k (or, the same thing,
    top-p measured on the distribution before top-k), or the temperature applied only after the
    filters chose the tokens."""
    V = z.numel()
    scaled = z / (1.0 if temperature_last else temperature)
    full = torch.softmax(scaled, -1)
    top_k_keep = torch.ones(V, dtype=torch.bool)
    if 0 < top_k < V:
        top_k_keep = scaled >= torch.topk(scaled, top_k).values[-1]

    def top_p_keep(probs):
        order = torch.argsort(probs, descending=True)
        sorted_p = probs[order]
        keep = (torch.cumsum(sorted_p, 0) - sorted_p) < top_p
        return torch.zeros(V, dtype=torch.bool).scatter(0, order, keep)

    if top_p_first:
        keep = top_p_keep(full) & top_k_keep
    else:
        keep = top_k_keep & top_p_keep(torch.softmax(scaled.masked_fill(~top_k_keep, float("-inf")), -1))
    final = (z / temperature).masked_fill(~keep, float("-inf"))
    return torch.softmax(final, -1)


def _sampling_mistakes(logits, temperature, top_k=0, top_p=1.0) -> dict[str, torch.Tensor]:
    """The distributions the planted mistakes produce (one row)."""
    z = logits[None].float()
    wrong = {}
    if top_p < 1.0 and 0 < top_k < logits.numel():
        wrong["top-p is applied before top-k, or measured on the whole distribution: top-k comes first and "
              "top-p measures the mass of the tokens top-k kept (renormalised)"] = _filtered(
            z[0], temperature, top_k, top_p, top_p_first=True)
    if top_p < 1.0 and temperature not in (0, 1):
        wrong["the temperature is applied after top-p chose its tokens (top-p measured on the T = 1 "
              "distribution): divide the logits by T first, then filter"] = _filtered(
            z[0], temperature, top_k, top_p, temperature_last=True)
    if temperature not in (0, 1):
        wrong["the temperature has no effect: it is not applied, or applied after the softmax (probabilities "
              "divided by T and renormalised, which undoes it)"] = sampling_probs(z, 1.0, top_k, top_p)[0]
    if top_p < 1.0:
        probs = torch.softmax(z[0] / temperature, -1)
        order = torch.argsort(probs, descending=True)
        sorted_p = probs[order]
        cum = torch.cumsum(sorted_p, 0)
        exact = (cum - sorted_p) < top_p  # the right set
        one_more = exact.clone()
        last = int(exact.nonzero().max())
        if last + 1 < one_more.numel():
            one_more[last + 1] = True
        for desc, keep in (("top-p leaves out the token that crosses top_p", cum < top_p),
                           ("top-p keeps one token too many (the one after the crossing token)", one_more)):
            kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            wrong[desc] = torch.zeros_like(probs).scatter(0, order, kept / kept.sum())
    return wrong


@graded(points=10, bans=(sample, sampling_probs, batched_sampling_probs))
def check_sample(fn, checker):
    """``fn(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None)`` must return one token id
    per row of ``logits`` (B, V), ``(B,)`` int64, drawn from the distribution temperature, top-k and
    top-p define; ``temperature=0`` is greedy."""
    n = 20000
    for label, logits, kw in _sampling_cases():
        V = logits.numel()
        case = Case(case=label, vocab=V, draws=n, **kw)
        gen = torch.Generator().manual_seed(1234)
        batch = logits[None].expand(n, V).contiguous()  # n copies of one distribution: n draws in one call
        got = checker.call(fn, batch.clone(), generator=gen, case=case, **kw)
        _expect_ids(checker, got, n, V, case)
        counts = torch.bincount(got, minlength=V).double()
        probs = sampling_probs(logits[None], **kw)[0].double()
        expected = n * probs
        zero = (probs == 0) & (counts > 0)
        problem = None
        if bool(zero.any()):
            t = int(zero.nonzero()[0])
            problem = (f"token {t} should never be drawn (its probability is 0 after top-k/top-p) but was drawn "
                       f"{int(counts[t])} times in {n} draws.")
        else:
            bounds = [binomial_interval(n, float(pt), FALSE_FAIL / V) for pt in probs]
            bad = [t for t, (lo, hi) in enumerate(bounds) if not lo <= int(counts[t]) <= hi]
            if bad:
                t = max(bad, key=lambda i: abs(float(counts[i] - expected[i])) / max(1.0, float(
                    (n * probs[i] * (1 - probs[i])).sqrt())))
                lo, hi = bounds[t]
                problem = (f"token {t} was drawn {int(counts[t])} times in {n} draws; its probability "
                           f"{float(probs[t]):.4g} gives {float(expected[t]):.0f} on average and between {lo} "
                           f"and {hi} for a correct sampler in all but one run in a million.")
        if problem:
            freq = counts / n
            for desc, wrong in _sampling_mistakes(logits, **kw).items():
                if float((freq - wrong.double()).abs().max()) < 0.02:
                    problem += f"\nYour frequencies match what we get when {desc}."
                    break
            checker.fail(case, problem, SAMPLING_RULE)

    # the draws come from the generator: equal seeds give equal tokens, whatever the global state
    logits, kw = _sampling_cases()[-1][1:]
    case = Case(case="two calls with equally seeded generators", vocab=logits.numel(), rows=256, **kw)
    batch = logits[None].expand(256, logits.numel()).contiguous()
    runs = []
    for global_seed in (11, 12):
        torch.manual_seed(global_seed)
        got = checker.call(fn, batch.clone(), generator=torch.Generator().manual_seed(5), case=case, **kw)
        _expect_ids(checker, got, 256, logits.numel(), case)
        runs.append(got)
    if not torch.equal(runs[0], runs[1]):
        checker.fail(case, f"{int((runs[0] != runs[1]).sum())} of 256 tokens differ between two calls whose "
                           f"generators had the same seed: the draws do not come from `generator` (the global "
                           f"random state, or a new generator, was used), so a seeded request would not repeat.",
                     "pass generator=generator to torch.multinomial (or whatever draws).")

    # the edges: top-k 1, temperature 0 and a top_p too small for float32 are the argmax, row by row
    rows = torch.randn(64, 50, generator=torch.Generator().manual_seed(7)) * 3
    argmax = rows.argmax(-1)
    for kw in (dict(temperature=1.0, top_k=1), dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5),
               dict(temperature=1e-4), dict(temperature=1.0, top_p=1e-300)):
        case = Case(case="the argmax, row by row", rows=64, vocab=50, **kw)
        gen = torch.Generator().manual_seed(3)
        state = gen.get_state()
        got = _call_tiny_top_p(checker, fn, rows.clone(), gen, case, kw)
        _expect_ids(checker, got, 64, 50, case)
        if kw["temperature"] == 0 and not torch.equal(gen.get_state(), state):
            checker.fail(case, "with temperature 0 your function drew from `generator` (its state changed): "
                               "temperature 0 is greedy, the argmax with no draw at all. A tiny temperature "
                               "instead of 0 still draws, and two logits that nearly tie come out either way.",
                         "if temperature == 0: return logits.argmax(-1), before any division or draw.")
        if not torch.equal(got, argmax):
            wrong = int((got != argmax).sum())
            checker.fail(case, f"{wrong} of 64 rows did not return their argmax; with these settings every "
                               f"row must be its most likely token.",
                         "temperature 0 means greedy (return logits.argmax(-1), draw nothing: no division by "
                         "zero); top_k=1 keeps only the largest logit; top-p always keeps the most likely token.")


TINY_TOP_P_HINT = ("keep the most likely token whatever top_p is: after `keep = torch.cumsum(probs_sorted, -1) - "
                   "probs_sorted < top_p`, set `keep[..., 0] = True` (vLLM keeps at least one token too).")


def _call_tiny_top_p(checker, fn, rows, gen, case, kw):
    """``fn`` on an argmax edge; for a tiny ``top_p``, a function that raises is told why: 1e-300 is a
    valid top_p, but it rounds to 0 in float32, so a cut of "mass above >= top_p" removes every token
    and leaves nothing to draw."""
    if kw.get("top_p", 1.0) >= 1e-30:
        return checker.call(fn, rows, generator=gen, case=case, **kw)
    try:
        return checker.call(fn, rows, generator=gen, case=case, **kw)
    except CheckFailed as exc:
        if not exc.learner_raised:
            raise
        checker.fail(case, f"with top_p={kw['top_p']:g} your function raised ({str(exc).splitlines()[0]}). Such a "
                           f"top_p is valid, but in float32 it is 0, so a top-p cut removed every token, even the "
                           f"most likely one, and there was nothing left to draw from.", TINY_TOP_P_HINT)


def _expect_ids(checker, got, n, V, case):
    if not isinstance(got, torch.Tensor) or got.shape != (n,):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        checker.fail(case, f"expected a tensor of shape ({n},) (one token id per row), got {shape}.",
                     "torch.multinomial(probs, 1) returns (B, 1): take [:, 0] or .squeeze(-1).")
    if got.dtype != torch.long:
        checker.fail(case, f"token ids must be int64 (torch.long), got {got.dtype}.", "")
    if bool(((got < 0) | (got >= V)).any()):
        checker.fail(case, f"token ids must be in [0, {V - 1}]", "")


# --- exercise 2: the scheduler's step decision --------------------------------------------------------


def scheduler_traces() -> list[tuple[str, list[TraceItem], dict]]:
    """The traces :func:`check_schedule_step` replays: ``(name, trace, engine settings)``."""
    burst = [TraceItem(0, 5 + 3 * i, 4 + i % 3) for i in range(6)]
    long_among_short = [TraceItem(0, 3, 6), TraceItem(1, 50, 3)] + [TraceItem(s, 3, 3) for s in range(1, 40)]
    tight = [TraceItem(0, 14, 10), TraceItem(0, 10, 12), TraceItem(1, 12, 9), TraceItem(2, 6, 14),
             TraceItem(3, 9, 6), TraceItem(6, 20, 4)]
    mixed = [TraceItem(s, [7, 30, 2, 16, 45, 9][s % 6], [5, 2, 9, 1, 4, 7][s % 6]) for s in range(0, 36, 2)]
    return [
        ("a long prompt among a stream of short ones", long_among_short,
         dict(token_budget=8, num_blocks=64, block_size=4, max_running=8)),
        ("a burst of six prompts", burst, dict(token_budget=16, num_blocks=64, block_size=4, max_running=4)),
        ("too few blocks for everyone (preemption)", tight,
         dict(token_budget=12, num_blocks=14, block_size=4, max_running=6)),
        ("mixed arrivals", mixed, dict(token_budget=24, num_blocks=40, block_size=8, max_running=5)),
    ]


def _invariants(step: SimStep, settings: dict) -> str | None:
    """What is wrong with one step's decision, or None."""
    budget, bs, max_running = settings["token_budget"], settings["block_size"], settings["max_running"]
    scheduled, preempted = step.scheduled, step.preempted
    total = sum(scheduled.values())
    left = budget - total
    running_ids = [s.request_id for s in step.running]
    skipped = [rid for rid in running_ids if rid not in scheduled and rid not in preempted]
    if skipped and left > 0:
        return (f"running sequence {skipped[0]!r} got no tokens although {left} of the budget's {budget} "
                f"tokens were left (a slot idle while there is budget).")
    waiting_ids = [s.request_id for s in step.waiting]
    admitted = [i for i, rid in enumerate(waiting_ids) if rid in scheduled]
    if admitted and admitted != list(range(len(admitted))):
        first_left = next(i for i in range(len(waiting_ids)) if i not in admitted)
        return (f"waiting sequence {waiting_ids[admitted[-1]]!r} was admitted ahead of {waiting_ids[first_left]!r}, "
                f"which was waiting before it: admitting out of order lets a stream of short requests starve a "
                f"long one.")
    if preempted and admitted:
        return "a waiting sequence was admitted in a step that preempted a running one (its blocks were needed)."
    if not preempted and left > 0 and len(admitted) < len(waiting_ids):
        n_running = len(running_ids) + len(admitted)
        seq = step.waiting[len(admitted)]
        need_tokens = min(seq.left, left)
        used = sum(blocks_for(s.num_computed + scheduled.get(s.request_id, 0), bs) - s.num_blocks
                   for s in step.running + tuple(step.waiting[:len(admitted)]))
        need = blocks_for(seq.num_computed + need_tokens, bs) - seq.num_blocks
        if n_running < max_running and need <= step.free_blocks - used:
            return (f"waiting sequence {seq.request_id!r} was not admitted although {left} tokens of budget, a "
                    f"free slot and {step.free_blocks - used} free blocks remained (it needed {need} for "
                    f"{need_tokens} tokens): an idle slot while requests wait. A prompt longer than the budget "
                    f"left runs a chunk of it.")
    return None


def _rule_variant(running, waiting, token_budget, free_blocks, block_size, max_running, *, victim="newest",
                  credit=True, order="oldest", shrink=False, skip_ahead=False):
    """The rule of :func:`schedule_step`, or (with a flag) one of the usual mistakes, to name what a
    learner's different decision matches."""
    scheduled, preempted = {}, []
    budget, free = token_budget, free_blocks
    queue = list(running)
    if order == "newest":
        queue.reverse()
    elif order == "decodes":
        queue.sort(key=lambda q: q.left != 1)  # stable: decodes first, each group oldest first
    while queue and budget > 0:
        seq = queue.pop(0)
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        fits = (seq.num_blocks + free) * block_size - seq.num_computed  # tokens the free blocks hold
        if shrink and need > free and fits >= 1:
            n = min(n, fits)
            need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        while need > free and queue:
            out = queue.pop(0 if victim == "oldest" else -1)
            free += out.num_blocks if credit else 0
            preempted.append(out.request_id)
        if need > free:
            free += seq.num_blocks if credit else 0
            preempted.append(seq.request_id)
            break
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
    if preempted:
        return scheduled, preempted
    n_running = len(running)
    for seq in waiting:
        if budget <= 0 or n_running >= max_running:
            break
        n = min(seq.left, budget)
        need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
        if need > free:
            if skip_ahead:
                continue
            break
        scheduled[seq.request_id] = n
        budget -= n
        free -= need
        n_running += 1
    return scheduled, preempted


SCHEDULE_MISTAKES = {  # what the decision matches -> the flags of _rule_variant
    "the victim taken from the wrong end: the oldest running sequence not yet given tokens was preempted; "
    "preempt the newest (the last of running)": dict(victim="oldest"),
    "a preempted sequence's blocks were not counted as free again, so more sequences were preempted than "
    "needed: add the victim's num_blocks to the free blocks before deciding whether to preempt another":
        dict(credit=False),
    "the running sequences served newest first; serve them oldest first (running[0] first)": dict(order="newest"),
    "decodes served before older unfinished prefills; the rule serves running sequences oldest first, "
    "whatever their phase": dict(order="decodes"),
    "a chunk shrunk to what the free blocks hold instead of preempting; a running sequence gets "
    "min(left, budget left) tokens, and when its blocks do not fit, the newest sequence is preempted":
        dict(shrink=True),
    "admission going on past a waiting sequence that did not fit, so a stream of short requests can starve a "
    "long prompt; the first one that does not fit stops admission (first come, first served: nobody "
    "overtakes it)": dict(skip_ahead=True),
}


def _decision_problem(got, running, waiting, settings, free_blocks) -> str | None:
    """How the learner's decision differs from the rule's on this state, naming the mistake it
    matches; None when it is the rule's."""
    args = (running, waiting, settings["token_budget"], free_blocks, settings["block_size"], settings["max_running"])
    scheduled, preempted = dict(got[0]), list(got[1])
    want = _rule_variant(*args)
    if (scheduled, preempted) == (want[0], want[1]):
        return None
    state = (f"running {[(q.request_id, q.num_tokens, q.num_computed, q.num_blocks) for q in running]}, waiting "
             f"{[(q.request_id, q.num_tokens, q.num_computed, q.num_blocks) for q in waiting]} (id, tokens, computed, "
             f"blocks), token_budget {args[2]}, free_blocks {free_blocks}, block_size {args[4]}, "
             f"max_running {args[5]}")
    problem = (f"on {state}, your decision was ({scheduled}, {preempted}); the rule gives ({want[0]}, {want[1]}).")
    if scheduled == want[0] and sorted(map(repr, preempted)) == sorted(map(repr, want[1])):
        return problem + " The same sequences, preempted in another order: list them in the order they were preempted."
    named = [desc for desc, flags in SCHEDULE_MISTAKES.items()
             if _rule_variant(*args, **flags) == (scheduled, preempted)]
    if named:
        problem += " It matches what we get with " + "; or with ".join(named) + "."
    elif want[1] and not preempted:
        problem += (" Nothing was preempted, but too few blocks are free for the running sequences' tokens: "
                    "preempt the newest running sequence (it gives back all its blocks) until they suffice.")
    return problem


def _decision_states():
    """Small hand-made states (``(what it tests, running, waiting, settings, free_blocks)``) on which
    each usual mistake decides differently from the rule."""
    v = SeqView
    return [
        ("running served oldest first, newest preempted, its blocks freed",
         [v("r0", 13, 4, 2), v("r1", 9, 5, 3), v("r2", 13, 12, 6)], [],
         dict(token_budget=11, block_size=2, max_running=4), 0),
        ("a decode and an older prefill, blocks short",
         [v("r0", 16, 12, 6), v("r1", 8, 7, 4)], [], dict(token_budget=1, block_size=2, max_running=4), 0),
        ("two prefills, the budget shared oldest first",
         [v("r0", 13, 8, 2), v("r1", 14, 9, 3)], [], dict(token_budget=6, block_size=4, max_running=4), 2),
        ("one prefill whose chunk needs a block", [v("r0", 14, 6, 2)], [],
         dict(token_budget=4, block_size=4, max_running=4), 0),
        ("a long prompt waits before a short one", [], [v("w0", 7), v("w1", 3)],
         dict(token_budget=11, block_size=2, max_running=4), 3),
    ]


@graded(points=10, bans=(schedule_step,))
def check_schedule_step(fn, checker):
    """``fn(running, waiting, token_budget, free_blocks, block_size, max_running)`` must return
    ``(scheduled, preempted)``: a dict ``{request_id: tokens}`` and a list of preempted ids, by the
    rule of ``labsupport.scheduler``. Checked on traces, step by step, against invariants: the
    decision is possible (budget, blocks, slots, 1 to ``left`` tokens each), no running sequence or
    waiting request is left idle while budget, a slot and blocks remain, admission is first come first
    served, and every request finishes; and each decision, on hand-made states and at every step of
    the traces, must be the rule's."""
    for what, running, waiting, settings, free in _decision_states():
        case = Case(state=what, running=len(running), waiting=len(waiting), free_blocks=free, **settings)
        got = checker.call(fn, list(running), list(waiting), settings["token_budget"], free, settings["block_size"],
                           settings["max_running"], case=case)
        if not (isinstance(got, tuple | list) and len(got) == 2 and isinstance(got[0], dict)):
            checker.fail(case, f"your function returned {got!r:.200}; return (scheduled, preempted): a dict "
                               f"{{request_id: tokens}} and a list of ids.", SCHEDULER_RULE)
        problem = _decision_problem(got, running, waiting, settings, free)
        if problem:
            checker.fail(case, problem, SCHEDULER_RULE)
    for name, trace, settings in scheduler_traces():
        case = Case(trace=name, requests=len(trace), **settings)
        state = {"step": None}

        def decide(*args, _case=case):
            return checker.call(fn, *args, case=_case)

        def observe(step, _settings=settings, _case=case, _state=state):
            _state["step"] = step.step
            problem = _invariants(step, _settings) or _decision_problem(
                (step.scheduled, step.preempted), list(step.running), list(step.waiting), _settings, step.free_blocks)
            if problem:
                checker.fail(_case, f"at step {step.step}: {problem}", SCHEDULER_RULE)

        bound = 4 * (sum(t.prompt_len + t.output_len for t in trace) + max(t.arrival_step for t in trace) + 10)
        try:
            result = simulate(decide, trace, max_steps=bound, observe=observe, **settings)
        except ValueError as exc:
            checker.fail(case, f"at step {state['step'] if state['step'] is not None else 0}, the decision is "
                               f"impossible: {exc}", SCHEDULER_RULE)
        except RuntimeError:
            checker.fail(case, f"after {bound} steps some request had still not finished: it is starved.",
                         SCHEDULER_RULE)
        unfinished = [i for i, r in enumerate(result["requests"]) if r["finish"] is None]
        if unfinished:
            checker.fail(case, f"request {unfinished[0]} never finished.", SCHEDULER_RULE)
        if name.startswith("too few") and not any(r["preemptions"] for r in result["requests"]):
            checker.fail(case, "the cache cannot hold every sequence at once, yet nothing was preempted.",
                         SCHEDULER_RULE)


# --- exercise 4: speculative acceptance -------------------------------------------------------------


def _dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


def _accept_cases():
    p1 = _dist([0.35, 0.25, 0.2, 0.1, 0.1, 0.0])
    q1 = _dist([0.1, 0.4, 0.1, 0.3, 0.0, 0.1])  # the draft favours tokens the target does not
    p2 = _dist([0.5, 0.3, 0.15, 0.05])
    q2 = _dist([0.25, 0.25, 0.25, 0.25])
    # k=2 with a different target and draft at each position: a rule that reads row 0 everywhere, or
    # draws the bonus from the wrong row, is right for the cases above and wrong here
    p3 = torch.stack([_dist([0.1, 0.6, 0.2, 0.1]), _dist([0.45, 0.05, 0.1, 0.4]), _dist([0.1, 0.1, 0.2, 0.6])])
    q3 = torch.stack([_dist([0.4, 0.2, 0.2, 0.2]), _dist([0.1, 0.5, 0.3, 0.1])])
    return [("k=1, the draft puts mass where the target has none", 1, p1[None].expand(2, -1), q1[None]),
            ("k=3, the same distributions at every position", 3, p2[None].expand(4, -1), q2[None].expand(3, -1)),
            ("k=2, a different target and draft at each position", 2, p3, q3)]


@graded(points=10, bans=(speculative_accept,))
def check_speculative_accept(fn, checker):
    """``fn(draft_tokens, draft_probs, target_probs, generator=None)`` must return the tokens one
    speculative step emits, ``(m,)`` int64 with ``1 <= m <= k + 1``. Checked statistically: the
    ``j``-th emitted token (when there is one) follows ``target_probs[j]`` (chi-squared), including a
    case whose target and draft differ from one position to the next, and the mean number emitted
    matches ``1 + a_1 + a_1 a_2 + ...``, which is ``(1 - a^(k+1)) / (1 - a)`` when every position's
    acceptance ``a_i`` is ``a``."""
    # the draws come from the generator: equal seeds give equal steps, whatever the global random state
    label, k, p, q = _accept_cases()[-1]
    case = Case(case="two runs with equally seeded generators", k=k, vocab=p.shape[-1], steps=64)
    proposals = torch.multinomial(q.contiguous(), 64, replacement=True, generator=torch.Generator().manual_seed(4)).T
    runs = []
    for global_seed in (21, 22):
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(8)
        steps = [checker.call(fn, row.clone(), q.clone(), p.clone(), generator=gen, case=case) for row in proposals]
        runs.append([t.tolist() if isinstance(t, torch.Tensor) else repr(t) for t in steps])
    differ = sum(a != b for a, b in zip(*runs))
    if differ:
        checker.fail(case, f"{differ} of 64 steps differ between two runs whose generators had the same seed: the "
                           f"uniforms or the tokens are not drawn from `generator` (the global random state, or a "
                           f"new generator, was used), so a seeded request would not repeat.",
                     "pass generator=generator to every torch.rand and torch.multinomial.")

    n, early = 4000, 1000  # judged after 1,000 steps too (half the false-failure chance at each look)
    for label, k, p, q in _accept_cases():
        V = p.shape[-1]
        case = Case(case=label, k=k, vocab=V, trials=n)
        gen = torch.Generator().manual_seed(2024)
        draws = torch.Generator().manual_seed(99)  # the check's own draws of the draft's proposals
        draft_probs, target_probs = q.contiguous(), p.contiguous()  # (k, V), (k + 1, V)
        counts, lengths = torch.zeros(k + 1, V), []  # counts[j]: the j-th emitted token, when there is one
        for trial in range(1, n + 1):
            proposals = torch.multinomial(draft_probs, 1, generator=draws)[:, 0]  # (k,)
            got = checker.call(fn, proposals, draft_probs.clone(), target_probs.clone(), generator=gen, case=case)
            if not isinstance(got, torch.Tensor) or got.dim() != 1 or not 1 <= got.numel() <= k + 1:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                checker.fail(case, f"expected a 1-D tensor of 1 to {k + 1} token ids, got {shape}.", ACCEPT_RULE)
            if got.dtype != torch.long or bool(((got < 0) | (got >= V)).any()):
                checker.fail(case, f"expected int64 token ids in [0, {V - 1}], got {got.tolist()} ({got.dtype}).",
                             ACCEPT_RULE)
            accepted = got.numel() - 1
            if not torch.equal(got[:accepted], proposals[:accepted]):
                j = int((got[:accepted] != proposals[:accepted]).nonzero()[0])
                checker.fail(case, f"the proposals were {proposals.tolist()} and your step emitted {got.tolist()}: "
                                   f"its token {j} is not proposal {j}, so proposal {j} was rejected (that token is "
                                   f"the residual's draw), yet {accepted - j} more token(s) follow it. A step stops "
                                   f"at its first rejection: the residual's draw is its last token.", ACCEPT_RULE)
            counts[torch.arange(got.numel()), got] += 1
            lengths.append(got.numel())
            if trial in (early, n):
                _judge_accept(checker, case, k, p, q, counts, lengths, FALSE_FAIL / 2)


def _judge_accept(checker, case, k, p, q, counts, lengths, false_fail):
    """After ``len(lengths)`` steps: each position's emitted token against its row of target_probs
    (chi-squared) and the mean number emitted against ``1 + a_1 + a_1 a_2 + ...``, each wrong for a
    correct rule with probability at most ``false_fail``."""
    n = len(lengths)
    alphas = [float(torch.minimum(p[i], q[i]).sum()) for i in range(k)]
    for j in range(k + 1):
        # the j-th emitted token (reached after j acceptances) follows target_probs[j], whatever came before
        what = "bonus token" if j == k else f"emitted token at position {j}"
        pj = p[j]
        if counts[j].sum() < 20 / float(pj[pj > 0].min()):
            continue  # too few to test (the chi-squared approximation wants 20 per category)
        stat, df = chi2_statistic(counts[j], pj)
        limit = chi2_threshold(df, false_fail)
        if stat > limit:
            freq = counts[j] / counts[j].sum()
            problem = (f"after {n} steps, the {what} does not follow the target's distribution at that position "
                       f"(row {j} of target_probs): chi-squared {stat:.1f} with {df} degrees of freedom (a correct "
                       f"rule stays under {limit:.1f} but once in two million runs). Frequencies "
                       f"{[round(float(f), 3) for f in freq]}, target {[round(float(x), 3) for x in pj]}.")
            named = _accept_mistake(freq, int(counts[j].sum()), j, k, p, q)
            if named:
                problem += f"\nYour frequencies match {named}."
            checker.fail(case, problem, ACCEPT_RULE)
    mean = sum(lengths) / n
    # 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k: (1 - a^(k+1)) / (1 - a) when every a_i is a
    expected = sum(math.prod(alphas[:i]) for i in range(k + 1))
    var = sum((x - mean) ** 2 for x in lengths) / (n - 1)
    slack = NormalDist().inv_cdf(1 - false_fail / 2) * math.sqrt(var / n) + 1e-9
    if abs(mean - expected) > slack:
        same = len(set(round(a, 12) for a in alphas)) == 1
        formula = (f"(1 - a^(k+1)) / (1 - a) with a = {alphas[0]:.3f}" if same else
                   "1 + a_1 + a_1 a_2 + ... with a_i = " + ", ".join(f"{a:.3f}" for a in alphas))
        checker.fail(case, f"over {n} steps, a step emitted {mean:.3f} tokens on average; with k = {k} it should be "
                           f"{formula} = {expected:.3f} (+- {slack:.3f}).",
                     ACCEPT_RULE + " Remember the bonus token when all k are accepted.")


ACCEPT_MISTAKES = {  # description -> the variant of the rule (flags of _emitted)
    "the draft's: proposals are accepted without the ratio test": dict(ratio="none"),
    "what we get when the ratio test is upside down (accept with probability min(1, q(x) / p(x)) instead of "
    "min(1, p(x) / q(x)))": dict(ratio="inverted"),
    "what we get when a proposal is accepted exactly when p(x) >= q(x) (a threshold) instead of with probability "
    "min(1, p(x) / q(x))": dict(ratio="threshold"),
    "what we get when one uniform is drawn for the whole step and reused at every position (draw a fresh r for "
    "each proposal)": dict(one_uniform=True),
    "what we get when a rejected position samples from the target's distribution instead of the residual "
    "max(0, p - q)": dict(residual="target"),
    "what we get when the residual is |p - q| (abs) instead of max(0, p - q): where the draft has too much, the "
    "excess comes back as target mass": dict(residual="abs"),
    "what we get when every position's residual is built from position 0's distributions instead of its own":
        dict(residual="position0"),
    "another row of target_probs: position i must use draft_probs[i] and target_probs[i], and the bonus token "
    "target_probs[k]": dict(row=0),
    "another row of target_probs: the bonus token (all k accepted) is drawn from target_probs[k], the row after "
    "the last proposal's": dict(bonus_row=-2),
}


_SIMULATED: dict = {}


def _emitted(k, p, q, n=50_000, *, ratio="spec", one_uniform=False, residual="spec", row=None, bonus_row=-1,
             seed=0):
    """The frequencies of the token emitted at each position 0..k (None where none is), by a rule with
    one deliberate change, from ``n`` simulated steps (a fixed seed: the same every time, so the
    result is kept for the next call)."""
    key = (k, tuple(p.flatten().tolist()), tuple(q.flatten().tolist()), n, ratio, one_uniform, residual, row,
           bonus_row, seed)
    if key not in _SIMULATED:
        _SIMULATED[key] = _simulate(k, p, q, n, ratio, one_uniform, residual, row, bonus_row, seed)
    return _SIMULATED[key]


def _simulate(k, p, q, n, ratio, one_uniform, residual, row, bonus_row, seed):
    gen = torch.Generator().manual_seed(seed)
    p, q = p.double(), q.double()
    rows = [i if row is None else row for i in range(k)]
    x = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)  # (n, k)
    pi = torch.stack([p[rows[i]][x[:, i]] for i in range(k)], 1)
    qi = torch.stack([q[rows[i]][x[:, i]] for i in range(k)], 1)
    if ratio == "spec":
        a = (pi / qi).clamp(max=1)
    elif ratio == "inverted":
        a = torch.where(pi > 0, (qi / pi.clamp(min=1e-300)).clamp(max=1), torch.ones_like(pi))
    elif ratio == "threshold":
        a = (pi >= qi).double()
    else:
        a = torch.ones_like(pi)
    r = torch.rand(n, 1 if one_uniform else k, generator=gen, dtype=torch.float64).expand(n, k)
    accepted = r < a
    first = torch.where(accepted.all(1), k, (~accepted).int().argmax(1))  # the first rejection, or k
    out = []
    for j in range(k + 1):
        counts = torch.zeros(p.shape[-1], dtype=torch.float64)
        if j < k:
            counts += torch.bincount(x[first > j, j], minlength=p.shape[-1]).double()
            src = 0 if residual == "position0" else rows[j]
            left = {"target": p[src], "abs": (p[src] - q[src]).abs()}.get(residual, (p[src] - q[src]).clamp(min=0))
            m = int((first == j).sum())
            if m and float(left.sum()) > 0:
                counts += torch.bincount(torch.multinomial(left, m, replacement=True, generator=gen),
                                         minlength=p.shape[-1]).double()
        else:
            m = int((first == k).sum())
            if m:
                counts += torch.bincount(torch.multinomial(p[bonus_row % (k + 1) if bonus_row != -1 else k], m,
                                                           replacement=True, generator=gen),
                                         minlength=p.shape[-1]).double()
        out.append(counts / counts.sum() if counts.sum() > 0 else None)
    return out


def _accept_mistake(freq, trials, j, k, p, q) -> str | None:
    """The mistake whose emitted-token frequencies at position ``j`` match the learner's (within the
    sampling noise of ``trials`` draws), among those that differ there from the right rule's."""
    right = p[j].double()
    noise = 4 * math.sqrt(0.25 / max(trials, 1)) + 0.01
    off = float((freq.double() - right).abs().max())  # how far the learner's are from the right ones
    best = None
    for description, flags in ACCEPT_MISTAKES.items():
        if "row" in flags and all(torch.allclose(p[i], p[0]) for i in range(k + 1)) and \
                all(torch.allclose(q[i], q[0]) for i in range(k)):
            continue  # every row is the same: reading another row changes nothing
        wrong = _emitted(k, p, q, **flags)[j]
        if wrong is None or float((wrong - right).abs().max()) < 0.015:
            continue  # this mistake gives the right frequencies here (50,000 simulated steps: noise 0.005)
        distance = float((freq.double() - wrong).abs().max())
        if distance < min(noise, off) and (best is None or distance < best[0]):
            best = (distance, description)
    for i in range(k + 1):  # any other row of target_probs, read where row j should be
        distance = float((freq.double() - p[i].double()).abs().max())
        if i != j and float((p[i] - p[j]).abs().max()) >= 0.015 and distance < min(noise, off) and \
                (best is None or distance < best[0]):
            best = (distance, f"row {i} of target_probs: position i must use draft_probs[i] and target_probs[i], and "
                              f"the bonus token target_probs[k]")
    return best[1] if best else None
