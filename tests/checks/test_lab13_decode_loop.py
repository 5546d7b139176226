"""Lab 13's checks pass the course's answers and reject each planted mistake, with a message that
names it; the statistical thresholds are what the module docstring says."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport._answers import unguarded
from labsupport.checks import CheckFailed, check_sample, check_schedule_step, check_speculative_accept
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
from labsupport.scheduler import blocks_for, schedule_step
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


def _sample_with(keep_rule=None, temperature_after_softmax=False, no_temperature=False):
    def fn(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None):
        if temperature == 0:
            return logits.argmax(-1)
        z = logits if temperature_after_softmax or no_temperature else logits / temperature
        if 0 < top_k < z.shape[-1]:
            kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, -1)
        if temperature_after_softmax:
            probs = probs / temperature
        if top_p < 1.0:
            sp, order = torch.sort(probs, -1, descending=True)
            cum = torch.cumsum(sp, -1)
            keep = keep_rule(cum, sp, top_p)
            sp = torch.where(keep, sp, torch.zeros_like(sp))
            probs = torch.zeros_like(probs).scatter(-1, order, sp)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return fn


def test_sample_written_independently_passes():
    check_sample(_sample_with(lambda cum, sp, p: cum - sp < p))


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


# --- exercise 4: speculative acceptance ------------------------------------------------------------


def test_accept_reference_passes(capsys):
    check_speculative_accept(accept_ref)
    assert "PASSED check_speculative_accept" in capsys.readouterr().out


def test_accept_stub():
    def stub(draft_tokens, draft_probs, target_probs, generator=None):
        raise NotImplementedError

    fails(check_speculative_accept, stub, "NotImplementedError", reason="not done")


def _accept_with(ratio_test=True, residual=True, bonus=True, row=None, bonus_row=None):
    """A rule written apart from the course's; ``row`` fixes the row of draft_probs/target_probs every
    position reads (a rule that is right only when all positions share one distribution), ``bonus_row``
    the row the bonus token is drawn from."""
    def fn(draft_tokens, draft_probs, target_probs, generator=None):
        out = []
        for i, x in enumerate(draft_tokens.tolist()):
            i = i if row is None else row
            ratio = float(target_probs[i, x] / draft_probs[i, x]) if ratio_test else 1.0
            if float(torch.rand((), generator=generator)) < min(1.0, ratio):
                out.append(x)
                continue
            dist = residual_distribution(target_probs[i], draft_probs[i]) if residual else target_probs[i]
            out.append(int(torch.multinomial(dist, 1, generator=generator)))
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
    fails(check_speculative_accept, _accept_with(bonus_row=0), "bonus token", "another row of target_probs")


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)
