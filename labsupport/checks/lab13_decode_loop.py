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
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from ..engine.sampler import batched_sampling_probs
from ..sampling import sample, sampling_probs
from ..scheduler import SimStep, TraceItem, blocks_for, schedule_step, simulate
from ..speculative import speculative_accept
from .framework import Case, graded

FALSE_FAIL = 1e-6  # the chance a correct implementation fails one statistical case

SAMPLING_RULE = (
    "divide the logits by the temperature BEFORE the softmax (temperature 0: return the argmax); "
    "top-k keeps the k largest (0 keeps all); top-p sorts the remaining probabilities, largest first, "
    "and keeps the shortest prefix whose sum reaches top_p, the token that crosses it included (1.0 "
    "keeps all); renormalise and draw one token per row with torch.multinomial(probs, 1, generator=generator)."
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


def _z(categories: int) -> float:
    return NormalDist().inv_cdf(1 - FALSE_FAIL / (2 * categories))


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
    return [
        ("plain softmax", base, dict(temperature=1.0)),
        ("temperature 0.5", base, dict(temperature=0.5)),
        ("temperature 2", base, dict(temperature=2.0)),
        ("top-k 3", base, dict(temperature=1.0, top_k=3)),
        ("top-p 0.6", gaps, dict(temperature=1.0, top_p=0.6)),
        ("top-p 0.75", gaps, dict(temperature=1.0, top_p=0.75)),
        ("top-p 1.0 keeps every token", flat, dict(temperature=1.0, top_p=1.0)),
        ("top-k 5, top-p 0.8, temperature 0.7", base, dict(temperature=0.7, top_k=5, top_p=0.8)),
    ]


def _sampling_mistakes(logits, temperature, top_k=0, top_p=1.0) -> dict[str, torch.Tensor]:
    """The distributions the planted mistakes produce (one row)."""
    z = logits[None].float()
    wrong = {}
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

    # the edges: top-k 1 and temperature 0 are the argmax, row by row
    rows = torch.randn(64, 50, generator=torch.Generator().manual_seed(7)) * 3
    argmax = rows.argmax(-1)
    for kw in (dict(temperature=1.0, top_k=1), dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5),
               dict(temperature=1e-4)):
        case = Case(case="the argmax, row by row", rows=64, vocab=50, **kw)
        got = checker.call(fn, rows.clone(), generator=torch.Generator().manual_seed(3), case=case, **kw)
        _expect_ids(checker, got, 64, 50, case)
        if not torch.equal(got, argmax):
            wrong = int((got != argmax).sum())
            checker.fail(case, f"{wrong} of 64 rows did not return their argmax; with these settings every "
                               f"row must be its most likely token.",
                         "temperature 0 means greedy (return logits.argmax(-1), draw nothing: no division by "
                         "zero); top_k=1 keeps only the largest logit.")


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


@graded(points=10, bans=(schedule_step,))
def check_schedule_step(fn, checker):
    """``fn(running, waiting, token_budget, free_blocks, block_size, max_running)`` must return
    ``(scheduled, preempted)``: a dict ``{request_id: tokens}`` and a list of preempted ids, by the
    rule of ``labsupport.scheduler``. Checked on traces, step by step, against invariants: the
    decision is possible (budget, blocks, slots, 1 to ``left`` tokens each), no running sequence or
    waiting request is left idle while budget, a slot and blocks remain, admission is first come first
    served, and every request finishes."""
    for name, trace, settings in scheduler_traces():
        case = Case(trace=name, requests=len(trace), **settings)
        state = {"step": None}

        def decide(*args, _case=case):
            return checker.call(fn, *args, case=_case)

        def observe(step, _settings=settings, _case=case, _state=state):
            _state["step"] = step.step
            problem = _invariants(step, _settings)
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
    n = 4000
    for label, k, p, q in _accept_cases():
        V = p.shape[-1]
        case = Case(case=label, k=k, vocab=V, trials=n)
        gen = torch.Generator().manual_seed(2024)
        draws = torch.Generator().manual_seed(99)  # the check's own draws of the draft's proposals
        draft_probs, target_probs = q.contiguous(), p.contiguous()  # (k, V), (k + 1, V)
        counts, lengths = torch.zeros(k + 1, V), []  # counts[j]: the j-th emitted token, when there is one
        for _ in range(n):
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
                checker.fail(case, f"the emitted tokens {got.tolist()} do not start with the accepted proposals "
                                   f"{proposals[:accepted].tolist()}.", ACCEPT_RULE)
            counts[torch.arange(got.numel()), got] += 1
            lengths.append(got.numel())
        alphas = [float(torch.minimum(p[i], q[i]).sum()) for i in range(k)]
        for j in range(k + 1):
            # the j-th emitted token (reached after j acceptances) follows target_probs[j], whatever came before
            what = "bonus token" if j == k else f"emitted token at position {j}"
            pj = p[j]
            if counts[j].sum() < 20 / float(pj[pj > 0].min()):
                continue  # too few to test (the chi-squared approximation wants 20 per category)
            stat, df = chi2_statistic(counts[j], pj)
            limit = chi2_threshold(df)
            if stat > limit:
                freq = counts[j] / counts[j].sum()
                problem = (f"the {what} does not follow the target's distribution at that position (row {j} of "
                           f"target_probs): chi-squared {stat:.1f} with {df} degrees of freedom (a correct rule "
                           f"stays under {limit:.1f} but once in a million runs). Frequencies "
                           f"{[round(float(f), 3) for f in freq]}, target {[round(float(x), 3) for x in pj]}.")
                if j < k and float((freq - q[j]).abs().max()) < 0.03:
                    problem += "\nYour frequencies match the draft's: proposals are accepted without the ratio test."
                elif j < k and _is_resample_from_p(freq, pj, q[j]):
                    problem += ("\nYour frequencies match what we get when a rejected position samples from the target's "
                                "distribution instead of the residual max(0, p - q).")
                elif any(float((freq - p[i]).abs().max()) < 0.03 for i in range(k + 1) if i != j):
                    problem += ("\nYour frequencies match another row of target_probs: position i must use "
                                "draft_probs[i] and target_probs[i], and the bonus token target_probs[k].")
                checker.fail(case, problem, ACCEPT_RULE)
        mean = sum(lengths) / n
        # 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k: (1 - a^(k+1)) / (1 - a) when every a_i is a
        expected = sum(math.prod(alphas[:i]) for i in range(k + 1))
        var = sum((x - mean) ** 2 for x in lengths) / (n - 1)
        slack = _z(1) * math.sqrt(var / n) + 1e-9
        if abs(mean - expected) > slack:
            same = len(set(round(a, 12) for a in alphas)) == 1
            formula = (f"(1 - a^(k+1)) / (1 - a) with a = {alphas[0]:.3f}" if same else
                       "1 + a_1 + a_1 a_2 + ... with a_i = " + ", ".join(f"{a:.3f}" for a in alphas))
            checker.fail(case, f"a step emitted {mean:.3f} tokens on average; with k = {k} it should be "
                               f"{formula} = {expected:.3f} (+- {slack:.3f}).",
                         ACCEPT_RULE + " Remember the bonus token when all k are accepted.")


def _is_resample_from_p(freq, p, q) -> bool:
    """Whether ``freq`` is what drawing from ``p`` (not the residual) on rejection gives: accepted
    tokens ``min(p, q)``, plus ``(1 - alpha) p``."""
    alpha = float(torch.minimum(p, q).sum())
    wrong = torch.minimum(p, q) + (1 - alpha) * p
    return float((freq - wrong).abs().max()) < 0.03
