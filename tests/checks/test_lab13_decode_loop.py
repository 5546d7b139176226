"""Lab 13's checks pass the course's answers and reject each planted mistake, with a message that
names it; the statistical thresholds are what the module docstring says."""

from __future__ import annotations

import math
import random

import pytest
import torch

from labsupport._answers import unguarded
from labsupport.checks import CheckFailed, check_sample, check_schedule_step, check_speculative_accept
from labsupport.checks import lab13_decode_loop as lab
from labsupport.checks.lab13_decode_loop import (
    FALSE_FAIL,
    _sampling_cases,
    binomial_interval,
    chi2_sf,
    chi2_statistic,
    chi2_threshold,
)
from labsupport.phases import cpu_threads
from labsupport.sampling import sample, sampling_probs
from labsupport.scheduler import SeqView, blocks_for, schedule_step
from labsupport.speculative import residual_distribution, speculative_accept

sample_ref = unguarded(sample)
schedule_ref = unguarded(schedule_step)
accept_ref = unguarded(speculative_accept)


@pytest.fixture(autouse=True)
def _one_thread():
    with cpu_threads(1):
        yield


def fails(check, fn, *needles, reason="failed"):
    with pytest.raises(CheckFailed) as info:
        check(fn)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert info.value.reason == reason
    return message


# --- the statistics --------------------------------------------------------------------------------


def test_chi2_threshold_matches_tables():
    # textbook quantiles: 0.95 of df 1, 2, 5, 10 and 0.999 of df 3
    assert chi2_threshold(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert chi2_threshold(2, 0.05) == pytest.approx(5.991, abs=1e-3)
    assert chi2_threshold(5, 0.05) == pytest.approx(11.070, abs=1e-3)
    assert chi2_threshold(10, 0.05) == pytest.approx(18.307, abs=1e-3)
    assert chi2_threshold(3, 0.001) == pytest.approx(16.266, abs=1e-3)
    assert chi2_sf(chi2_threshold(4), 4) == pytest.approx(1e-6, rel=1e-6)


def test_chi2_statistic():
    p = torch.tensor([0.5, 0.5, 0.0])
    assert chi2_statistic(torch.tensor([50.0, 50.0, 0.0]), p) == (0.0, 1)
    assert chi2_statistic(torch.tensor([50.0, 49.0, 1.0]), p)[0] == math.inf
    assert chi2_statistic(torch.tensor([60.0, 40.0, 0.0]), p)[0] == pytest.approx(4.0)


# --- exercise 1: sampling --------------------------------------------------------------------------


def test_sample_reference_passes(capsys):
    check_sample(sample_ref)
    assert "PASSED check_sample" in capsys.readouterr().out


def test_sample_stub():
    def stub(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
        raise NotImplementedError("write sample")

    fails(check_sample, stub, "NotImplementedError", reason="not done")


def _binomial_tail_outside(n, p, lo, hi):
    k = torch.arange(n + 1, dtype=torch.float64)
    pmf = (math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
           + k * math.log(p) + (n - k) * math.log1p(-p)).exp()
    return float(pmf[:lo].sum()), float(pmf[hi + 1:].sum())


def test_binomial_interval_is_exact():
    # each tail at most false_fail / 2, and one step narrower would exceed it
    for n, p in ((20000, 0.25), (20000, 3e-5), (4000, 0.9), (50, 0.5)):
        lo, hi = binomial_interval(n, p, 1e-4)
        below, above = _binomial_tail_outside(n, p, lo, hi)
        assert below <= 5e-5 and above <= 5e-5
        assert _binomial_tail_outside(n, p, lo + 1, hi)[0] > 5e-5 or lo == 0
        assert _binomial_tail_outside(n, p, lo, hi - 1)[1] > 5e-5
    assert binomial_interval(100, 0.0, 1e-6) == (0, 0)
    assert binomial_interval(100, 1.0, 1e-6) == (100, 100)


def test_sample_false_failure_rate_is_as_stated():
    # the exact chance that a correct sampler fails a frequency case is at most FALSE_FAIL (the normal
    # approximation the check used before gave 3e-5 on the temperature-0.5 case, whose rarest token
    # has probability 3e-5)
    n = 20000
    for _, logits, kw in _sampling_cases():
        probs = sampling_probs(logits[None], **kw)[0].double()
        total = 0.0
        for p in probs.tolist():
            if 0 < p < 1:
                total += sum(_binomial_tail_outside(n, p, *binomial_interval(n, p, FALSE_FAIL / probs.numel())))
        assert total <= FALSE_FAIL


def test_sample_ignores_the_generator():
    inner = _sample_with(lambda cum, sp, p: cum - sp < p)

    def fn(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
        return inner(logits, temperature, top_k, top_p, generator=None)  # the global random state

    fails(check_sample, fn, "do not come from `generator`")


def _sample_with(keep_rule=None, temperature_after_softmax=False, top_p_first=False, temperature_last=False,
                 greedy_as=None, no_temperature=False):
    def fn(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
        if temperature == 0:
            if greedy_as is None:
                return logits.argmax(-1)
            temperature = greedy_as  # a tiny temperature still draws
        scale = 1.0 if temperature_after_softmax or temperature_last or no_temperature else temperature
        z = logits / scale
        probs = torch.softmax(z, -1)

        def top_k_filter(probs):
            if 0 < top_k < z.shape[-1]:
                kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
                probs = probs.masked_fill(z < kth, 0.0)
            return probs / probs.sum(-1, keepdim=True)

        def top_p_filter(probs):
            if top_p < 1.0:
                sp, order = torch.sort(probs, -1, descending=True)
                cum = torch.cumsum(sp, -1)
                keep = keep_rule(cum, sp, top_p)
                sp = torch.where(keep, sp, torch.zeros_like(sp))
                probs = torch.zeros_like(probs).scatter(-1, order, sp)
            return probs

        probs = top_k_filter(top_p_filter(probs)) if top_p_first else top_p_filter(top_k_filter(probs))
        if temperature_after_softmax:
            probs = probs / temperature
        if temperature_last:  # the kept tokens, reweighted by the temperature only now
            probs = torch.softmax((logits / temperature).masked_fill(probs == 0, float("-inf")), -1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return fn


def SPEC_KEEP(cum, sp, p):  # noqa: N802 - the spec's rule: the crossing token is kept, and the first always
    keep = cum - sp < p
    keep[..., 0] = True
    return keep


def test_sample_top_p_drops_the_most_likely_token_under_a_tiny_top_p():
    # the spec's cut without `keep[..., 0] = True`: right on every frequency case, but top_p=1e-300 is 0
    # in float32 and cuts every token, and torch.multinomial raises
    fails(check_sample, _sample_with(lambda cum, sp, p: cum - sp < p), "top_p=1e-300", "in float32 it is 0",
          "keep[..., 0] = True")


def test_sample_top_p_before_top_k():
    # the red team's sample_wrong_topp_before_topk and sample_wrong_topp_full_mass (the same distribution)
    fails(check_sample, _sample_with(SPEC_KEEP, top_p_first=True), "top-k 4 first", "top-p is applied before top-k")


def test_sample_temperature_after_the_filters():
    fails(check_sample, _sample_with(SPEC_KEEP, temperature_last=True), "temperature 0.5 first",
          "the temperature is applied after top-p chose its tokens")


def test_sample_greedy_as_a_tiny_temperature():
    # right on every frequency case and every argmax row; but it draws, and a near-tie comes out either way
    fails(check_sample, _sample_with(SPEC_KEEP, greedy_as=1e-6), "temperature=0.0", "drew from `generator`")


def test_sample_written_independently_passes():
    check_sample(_sample_with(SPEC_KEEP))


def test_sample_top_p_excludes_the_crossing_token():
    fails(check_sample, _sample_with(lambda cum, sp, p: cum < p), "top-p 0.6",
          "leaves out the token that crosses top_p")


def test_sample_top_p_keeps_one_too_many():
    def one_more(cum, sp, p):
        keep = cum - sp < p
        return keep | torch.roll(keep, 1, -1)  # the token after the crossing one as well

    fails(check_sample, _sample_with(one_more), "top-p 0.6", "should never be drawn", "one token too many")


def test_sample_temperature_after_softmax():
    fails(check_sample, _sample_with(lambda cum, sp, p: cum - sp < p, temperature_after_softmax=True),
          "temperature 0.5", "the temperature has no effect: it is not applied, or applied after the softmax")


def test_sample_without_temperature_is_told_the_temperature_has_no_effect():
    fails(check_sample, _sample_with(lambda cum, sp, p: cum - sp < p, no_temperature=True),
          "temperature 0.5", "the temperature has no effect: it is not applied")


def test_sample_temperature_zero_divides():
    inner = _sample_with(lambda cum, sp, p: cum - sp < p)

    def fn(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
        if temperature == 0:  # no special case: logits / 0 gives inf and NaN probabilities
            probs = torch.softmax(logits / temperature, -1).nan_to_num(0.0) + 1e-9
            return torch.multinomial(probs, 1, generator=generator)[:, 0]
        return inner(logits, temperature, top_k, top_p, generator)

    fails(check_sample, fn, "argmax", "temperature=0.0")


def test_sample_references_agree():
    z = torch.randn(3, 30, generator=torch.Generator().manual_seed(0))
    probs = sampling_probs(z, 0.8, 7, 0.9)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert int((probs > 0).sum(-1).max()) <= 7
    assert torch.equal(sample_ref(z, 0.0), z.argmax(-1))


# --- exercise 2: the scheduler -----------------------------------------------------------------------


def test_schedule_reference_passes(capsys):
    check_schedule_step(schedule_ref)
    assert "PASSED check_schedule_step" in capsys.readouterr().out


def test_schedule_stub():
    def stub(running, waiting, token_budget, free_blocks, block_size, max_running):
        raise NotImplementedError

    fails(check_schedule_step, stub, "NotImplementedError", reason="not done")


def test_schedule_admits_over_budget():
    def whole_prompts(running, waiting, token_budget, free_blocks, block_size, max_running):
        scheduled, preempted = schedule_ref(running, [], token_budget, free_blocks, block_size, max_running)
        if preempted:
            return scheduled, preempted
        free = free_blocks - sum(blocks_for(s.num_computed + scheduled.get(s.request_id, 0), block_size)
                                 - s.num_blocks for s in running)
        n = len(running)
        for seq in waiting:  # the whole prompt, whatever the budget left
            need = blocks_for(seq.num_tokens, block_size)
            if n >= max_running or need > free:
                break
            scheduled[seq.request_id] = seq.left
            free -= need
            n += 1
        return scheduled, preempted

    fails(check_schedule_step, whole_prompts, "over the budget")


def test_schedule_starves_long_prompts():
    def skip_long(running, waiting, token_budget, free_blocks, block_size, max_running):
        scheduled, preempted = schedule_ref(running, [], token_budget, free_blocks, block_size, max_running)
        if preempted:
            return scheduled, preempted
        budget = token_budget - sum(scheduled.values())
        free = free_blocks - sum(blocks_for(s.num_computed + scheduled.get(s.request_id, 0), block_size)
                                 - s.num_blocks for s in running)
        n = len(running)
        for seq in waiting:  # a prompt that does not fit whole is passed over, never chunked
            need = blocks_for(seq.num_tokens, block_size)
            if n < max_running and seq.left <= budget and need <= free:
                scheduled[seq.request_id] = seq.left
                budget -= seq.left
                free -= need
                n += 1
        return scheduled, preempted

    fails(check_schedule_step, skip_long, "long prompt", "starve")


def test_schedule_never_preempts():
    def no_preemption(running, waiting, token_budget, free_blocks, block_size, max_running):
        scheduled, budget, free = {}, token_budget, free_blocks
        for seq in list(running) + list(waiting):
            n = min(seq.left, budget)
            need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
            if n <= 0 or need > free or (seq in waiting and len(running) + len(scheduled) - sum(
                    1 for s in running if s.request_id in scheduled) >= max_running):
                continue
            scheduled[seq.request_id] = n
            budget -= n
            free -= need
        return scheduled, []

    fails(check_schedule_step, no_preemption, "too few blocks")


def planted_scheduler(mistake):
    """A learner's scheduler with one of results_b's mistakes, each of which kept every invariant."""
    def step(running, waiting, token_budget, free_blocks, block_size, max_running):
        scheduled, preempted, budget, free = {}, [], token_budget, free_blocks
        order = list(running)
        if mistake == "newest first":
            order = order[::-1]
        if mistake == "decodes first":
            order = [s for s in order if s.left == 1] + [s for s in order if s.left != 1]
        while order and budget > 0:
            seq = order.pop(0)
            n = min(seq.left, budget)
            need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
            room = (seq.num_blocks + free) * block_size - seq.num_computed
            if mistake == "shrink the chunk" and need > free and room > 0:
                n, need = min(n, room), blocks_for(seq.num_computed + min(n, room), block_size) - seq.num_blocks
            while need > free and order:
                victim = order.pop(0) if mistake == "victim from the front" else order.pop()
                if mistake != "freed blocks not credited":
                    free += victim.num_blocks
                preempted.append(victim.request_id)
            if need > free:
                preempted.append(seq.request_id)
                free += seq.num_blocks
                break
            scheduled[seq.request_id] = n
            budget, free = budget - n, free - need
        if preempted:
            return scheduled, preempted
        count = len(running)
        for seq in waiting:
            if budget <= 0 or count >= max_running:
                break
            n = min(seq.left, budget)
            need = blocks_for(seq.num_computed + n, block_size) - seq.num_blocks
            if need > free:
                if mistake == "skip a prompt that does not fit":
                    continue
                break
            scheduled[seq.request_id] = n
            budget, free, count = budget - n, free - need, count + 1
        return scheduled, preempted
    return step


SCHEDULER_MISTAKES = {  # results_b's fooled schedulers -> what the message must say
    "victim from the front": "victim taken from the wrong end",
    "freed blocks not credited": "blocks were not counted as free again",
    "newest first": "served newest first",
    "decodes first": "decodes served before older unfinished prefills",
    "shrink the chunk": "chunk shrunk to what the free blocks hold",
    "skip a prompt that does not fit": "starve a long prompt",
}


def test_schedule_planted_scheduler_without_mistakes_passes(capsys):
    check_schedule_step(planted_scheduler(None))
    assert "PASSED check_schedule_step" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", list(SCHEDULER_MISTAKES))
def test_schedule_decision_mistakes_are_named(mistake):
    fails(check_schedule_step, planted_scheduler(mistake), SCHEDULER_MISTAKES[mistake], "the rule gives")


# --- exercise 4: speculative acceptance ------------------------------------------------------------


def test_accept_reference_passes(capsys):
    check_speculative_accept(accept_ref)
    assert "PASSED check_speculative_accept" in capsys.readouterr().out


def test_accept_stub():
    def stub(draft_tokens, draft_probs, target_probs, generator=None):
        raise NotImplementedError

    fails(check_speculative_accept, stub, "NotImplementedError", reason="not done")


def _accept_with(ratio_test=True, residual=True, bonus=True, row=None, bonus_row=None, ratio="p/q",
                 one_uniform=False, stop=True, own_generator=False):
    """A rule written apart from the course's; ``row`` fixes the row of draft_probs/target_probs every
    position reads (a rule that is right only when all positions share one distribution), ``bonus_row``
    the row the bonus token is drawn from; ``ratio`` "q/p" turns the test upside down, "threshold"
    accepts exactly when p >= q; ``residual`` "abs" takes |p - q|, "position0" position 0's residual;
    ``one_uniform`` reuses one r for the step; ``stop=False`` goes on after a rejection;
    ``own_generator`` draws from the global random state."""
    def fn(draft_tokens, draft_probs, target_probs, generator=None):
        generator = None if own_generator else generator
        out = []
        r_step = float(torch.rand((), generator=generator))
        for i, x in enumerate(draft_tokens.tolist()):
            i = i if row is None else row
            p, q = float(target_probs[i, x]), float(draft_probs[i, x])
            if ratio == "threshold":
                r, limit = 0.0, 1.0 if p >= q else 0.0
            else:
                r = r_step if one_uniform else float(torch.rand((), generator=generator))
                limit = min(1.0, (q / p if p > 0 else 1.0) if ratio == "q/p" else p / q) if ratio_test else 1.0
            if r < limit:
                out.append(x)
                continue
            j = 0 if residual == "position0" else i
            if residual == "abs":
                dist = (target_probs[j] - draft_probs[j]).abs()
            elif residual:
                dist = residual_distribution(target_probs[j], draft_probs[j])
            else:
                dist = target_probs[j]
            out.append(int(torch.multinomial(dist / dist.sum(), 1, generator=generator)))
            if stop:
                return torch.tensor(out)
        if not stop and len(out) == draft_tokens.numel():
            out.append(int(torch.multinomial(target_probs[len(out)], 1, generator=generator)))
            return torch.tensor(out)
        if bonus:
            out.append(int(torch.multinomial(target_probs[len(out) if bonus_row is None else bonus_row], 1,
                                             generator=generator)))
        return torch.tensor(out)

    return fn


def test_accept_written_independently_passes():
    check_speculative_accept(_accept_with())


def test_accept_without_ratio_test():
    fails(check_speculative_accept, _accept_with(ratio_test=False), "does not follow the target's distribution")


def test_accept_wrong_residual():
    fails(check_speculative_accept, _accept_with(residual=False), "instead of the residual")


def test_accept_forgets_the_bonus_token():
    fails(check_speculative_accept, _accept_with(bonus=False), "bonus token")


def test_accept_reads_the_first_row_at_every_position():
    fails(check_speculative_accept, _accept_with(row=0), "position 1")


def test_accept_draws_the_bonus_from_the_wrong_row():
    fails(check_speculative_accept, _accept_with(bonus_row=0), "bonus token", "row 0 of target_probs")


@pytest.mark.parametrize("flags, needles", [
    # the red team's spec_wrong_ignores_generator: right in distribution, but a seed does not repeat a step
    (dict(own_generator=True), ("two runs with equally seeded generators", "not drawn from `generator`")),
    (dict(stop=False), ("yet 1 more token(s) follow it", "stops at its first rejection")),
    (dict(one_uniform=True), ("one uniform is drawn for the whole step",)),
    (dict(ratio="q/p"), ("the ratio test is upside down",)),
])
def test_accept_mistakes_named(flags, needles):
    fails(check_speculative_accept, _accept_with(**flags), *needles)


@pytest.mark.parametrize("case, position, flags, needle", [
    (0, 0, dict(ratio="threshold"), "accepted exactly when p(x) >= q(x)"),
    (0, 0, dict(residual="abs"), "the residual is |p - q|"),
    (2, 1, dict(residual="position0"), "built from position 0's distributions"),
    (1, 1, dict(one_uniform=True), "one uniform is drawn"),
    (0, 0, dict(ratio="inverted"), "upside down"),
])
def test_accept_diagnoses(case, position, flags, needle):
    """The message's diagnosis, from frequencies like a learner's 4,000 steps (a simulation of the
    mistake with other random numbers than the check's own), without running 4,000 steps."""
    _, k, p, q = lab._accept_cases()[case]
    freq = lab._emitted(k, p, q, n=4000, seed=1, **flags)[position]
    trials = 4000 if position == 0 else 2000
    assert needle in lab._accept_mistake(freq, trials, position, k, p, q)
    right = lab._emitted(k, p, q, n=4000, seed=1)[position]  # and a right rule's frequencies name nothing
    assert lab._accept_mistake(right, trials, position, k, p, q) is None


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)


def _random_state(rng: random.Random):
    """A random scheduling state: running sequences (some mid-prompt, some decoding, each holding the
    blocks of what it computed), waiting ones (some with cached prefixes), and the step's limits."""
    block_size = rng.choice([1, 2, 4, 8])
    running = []
    for i in range(rng.randint(0, 6)):
        tokens = rng.randint(1, 40)
        computed = rng.choice([tokens - 1, rng.randint(0, tokens - 1)])
        running.append(SeqView(f"r{i}", tokens, computed, blocks_for(computed, block_size)))
    waiting = []
    for i in range(rng.randint(0, 6)):
        tokens = rng.randint(1, 40)
        waiting.append(SeqView(f"w{i}", tokens, rng.choice([0, (tokens - 1) // block_size * block_size]), 0))
    return running, waiting, rng.randint(1, 48), rng.randint(0, 20), block_size, rng.randint(1, 8)


def test_the_checks_copy_of_the_rule_is_schedule_step():
    """The check names mistakes by flags on its own copy of the rule (_rule_variant); unflagged, that
    copy decides as labsupport.scheduler.schedule_step on many random states, and every flag changes
    some decision (a mistake the check names is one the copy can make)."""
    rng = random.Random(13)
    states = [_random_state(rng) for _ in range(3000)]
    for args in states:
        assert unguarded(schedule_step)(*args) == lab._rule_variant(*args), args
    for mistake, flags in lab.SCHEDULE_MISTAKES.items():
        assert any(lab._rule_variant(*args, **flags) != lab._rule_variant(*args) for args in states), mistake
