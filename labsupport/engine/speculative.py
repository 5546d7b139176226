"""Speculative decoding inside the batched engine: n-gram drafts, verified in the step's forward pass (chapter 13).

With ``Engine(model, speculative=SpeculativeConfig(num_speculative_tokens=k))`` every step does, for
each running request that is decoding:

1. **propose** (:func:`propose`): up to ``k`` draft tokens by prompt lookup
   (:func:`labsupport.drafts.ngram_proposal`, vLLM's ``ngram`` method): no second model, no
   forward pass. The draft is capped so that the request can neither pass ``max_tokens`` nor the
   engine's ``max_model_len``, and it is dropped when its cache blocks are not free (a draft never
   makes the scheduler preempt anyone);
2. **schedule**: the scheduler sees the draft as tokens still to compute, so the step runs the
   request's last sampled token and its draft, ``1 + d`` tokens, in the same flat batch as every
   prefill chunk and plain decode. A decision that gives it fewer (the token budget ran out) cuts
   the draft to fit. Their keys and values go into cache slots like any other token's;
3. **verify** (:func:`verify_drafts`): the output head runs on all ``1 + d`` rows, and the drafts are
   accepted left to right. A greedy request accepts a draft token while it equals the target's
   argmax there; a sampled one accepts draft token ``x`` with probability ``p(x)`` (the target's
   probability after the request's own temperature, penalties, min-p, top-k and top-p) and on a
   rejection draws from ``p`` with ``x`` removed, renormalised. That is the rejection rule of
   Leviathan et al. (2023) for a draft distribution that puts all its mass on ``x``, and it leaves
   each token distributed exactly as plain sampling would. It is carried out by drawing ``y`` from
   ``p`` with the request's own generator, row by row: ``y = x`` is the acceptance, any other ``y``
   the residual's draw, so a seeded request makes the same draws in the same order as without a
   draft. Every row is drawn ahead on the device and all the step's draws (and the greedy rows'
   argmaxes) come back to the host in one transfer; a request whose draft is rejected early has its
   generator reset and only the draws it keeps made again, so it ends where plain sampling leaves
   it. Either way the target's own token comes after the last accepted one (the correction, or
   the bonus token when all ``d`` were accepted), so a step emits ``1 .. d + 1`` tokens;
4. **roll back**: the rejected drafts' keys and values are in the cache, at positions past the
   request's accepted tokens. ``num_computed`` moves back over them, and the allocator gives back
   their slots (:meth:`labsupport.paged_cache.BlockAllocator.truncate`): a block holding only
   rejected tokens is freed, and every block the draft filled, made findable by its hash when its
   slots were handed out, forgets that hash (the one kept is overwritten from the first rejected
   position). The next step writes the correct tokens over the stale slots.

With greedy sampling a request gets exactly the tokens it gets without speculation (the tests check
it against ``Transformer.generate`` alone), and a seeded sampled one the same tokens as without
speculation wherever the verification pass's logits equal the plain decode's (on the CPU in fp32
the tests find them equal, alone and in a batch).

vLLM does the same with ``speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": ..., "prompt_lookup_max": ...}`` (its ``vllm/v1/spec_decode/ngram_proposer.py``
and the rejection sampler in ``vllm/v1/sample/rejection_sampler.py``; it uses 5 for both lookup
lengths when neither is given, the course 1 to 3). vLLM's scheduler rolls back the same count
(``num_computed_tokens -= num_rejected``) but leaves the slots with the request for its next
tokens, and never hashes a block holding an unverified draft token (``allocate_slots`` in
``vllm/v1/core/kv_cache_manager.py`` at ``003df296`` hashes a block only once all its tokens are verified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._validate import positive_int
from ..drafts import ngram_proposal
from ..sampling import SamplingParams
from .sampler import RowSamplingError, _penalized, batched_sampling_probs, drawable, row_failure, row_settings

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings, named as vLLM's ``speculative_config`` names them: the most
    draft tokens per request and step, and the n-gram lengths prompt lookup tries (longest first)."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    method: str = "ngram"

    def __post_init__(self):
        positive_int("num_speculative_tokens", self.num_speculative_tokens)
        positive_int("prompt_lookup_min", self.prompt_lookup_min)
        positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min = {self.prompt_lookup_min} must not exceed "
                             f"prompt_lookup_max = {self.prompt_lookup_max}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS} (drafts that need no second model), "
                             f"got {self.method!r}")


def draft_room(num_tokens: int, num_output: int, max_tokens: int, max_model_len: int, k: int) -> int:
    """How many draft tokens a decoding request may be offered: at most ``k``; the step then emits
    at most one more than its draft, which must fit both ``max_tokens`` (``num_output`` made so far)
    and ``max_model_len`` (``num_tokens`` known now)."""
    return max(0, min(k, max_tokens - num_output - 1, max_model_len - 1 - num_tokens))


def propose(token_ids: Sequence[int], room: int, config: SpeculativeConfig) -> list[int]:
    """The draft for a request whose known tokens are ``token_ids``: prompt lookup, at most ``room`` tokens."""
    if room <= 0:
        return []
    return ngram_proposal(token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max)


def accepted_greedy(targets: Sequence[int], draft: Sequence[int]) -> int:
    """How many leading draft tokens equal the target's argmax at their position (``targets`` has one
    more entry than ``draft``: the target's token after the last draft)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a


@torch.no_grad()
def verify_drafts(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                  drafts: Sequence[Sequence[int]],
                  histories: Sequence[Sequence[int]] | None = None) -> list[list[int] | RowSamplingError]:
    """The tokens each request emits: ``logits`` (sum of ``len(draft) + 1``, V) holds each request's rows
    in order, row ``j`` the target's prediction after its ``j`` first draft tokens. ``histories[i]``
    (read only with a repetition penalty) is request ``i``'s known tokens; a row after ``j`` draft
    tokens is penalised with those drafts seen too. Returns, per request, its accepted draft tokens
    followed by the target's own token (module docstring)."""
    sizes = [len(d) + 1 for d in drafts]
    if sum(sizes) != logits.shape[0] or len(params) != len(drafts) or len(generators) != len(drafts):
        raise ValueError(f"verify_drafts: {logits.shape[0]} rows of logits for drafts of lengths "
                         f"{[len(d) for d in drafts]} ({len(params)} params, {len(generators)} generators)")
    row_params = [p for p, n in zip(params, sizes) for _ in range(n)]
    row_histories = None
    if histories is not None:
        row_histories = [list(h) + list(d[:j]) if p.repetition_penalty != 1 else ()
                         for h, d, p in zip(histories, drafts, params) for j in range(len(d) + 1)]
    logits = _penalized(logits, row_params, row_histories)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    picks = []  # on the device: every greedy row's argmax, then every sampled row's draw
    if greedy:  # one argmax over every greedy row
        rows = [starts[i] + j for i in greedy for j in range(sizes[i])]
        picks.append(logits[torch.tensor(rows, device=logits.device)].argmax(-1))
    if drawn:
        probs, draws, states, first, raised = _draw_ahead(logits, [(starts[i], sizes[i]) for i in drawn],
                                                          [params[i] for i in drawn], [generators[i] for i in drawn])
        picks.append(draws)
    chosen = torch.cat(picks).tolist() if picks else []  # the step's one device-to-host transfer
    out: list[list[int]] = [[] for _ in drafts]
    at = 0
    for i in greedy:
        targets = chosen[at:at + sizes[i]]
        at += sizes[i]
        a = accepted_greedy(targets, drafts[i])
        out[i] = [*drafts[i][:a], targets[a]]
    for k, i in enumerate(drawn):
        ys = chosen[at:at + sizes[i]]
        at += sizes[i]
        kept = ys[:1 + accepted_greedy(ys, drafts[i])]  # up to the first draw that is not the draft's token
        if min(kept) < 0:  # a row plain sampling draws could not be sampled: it fails alone (the sampler's rule);
            # a row past the first rejection is never drawn by plain sampling, so it fails nothing
            out[i] = row_failure(params[i], raised.get(k, "its probabilities were NaN, infinite or all zero"))
            continue
        out[i] = kept
        if len(out[i]) < sizes[i]:  # it drew rows plain sampling never draws: replay only the draws it keeps
            generators[i].set_state(states[k])
            for j in range(first[k], first[k] + len(out[i])):
                torch.multinomial(probs[j:j + 1], 1, generator=generators[i])
    return out


def _draw_ahead(logits: torch.Tensor, spans: Sequence[tuple[int, int]], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator]) -> tuple:
    """Rejection sampling of one-hot drafts, drawn ahead on the device. For each sampled request
    (``spans``: its rows ``start .. start + n - 1`` of ``logits``) a token ``y`` is drawn from every
    row's ``p`` (its own temperature and filters) with the request's generator, without looking at
    the results: the caller brings every draw back at once. ``y`` equal to the draft token accepts it
    (probability ``p(x)``); any other ``y`` is the residual's draw (``p`` without ``x``, renormalised)
    and ends the request's step; the last row's draw is the bonus token. Each draw is the call plain
    sampling makes, row by row, so a seeded request gets the tokens it gets without a draft; a request
    that stops early has drawn rows plain sampling never draws, so its generator's state before the
    draws is returned too, for the caller to reset it and make again only the draws it keeps.

    A row whose probabilities are not a distribution (NaN, infinite, all zero) is drawn from a
    harmless stand-in and its draw is -1 (marked on the device: on a GPU an invalid distribution
    would stop the device, not raise); a request whose draw raises gets -1 on all its rows and the
    message in ``raised``. Either way the caller fails that request alone, when the row is one plain
    sampling draws (at or before the request's first rejection).

    Returns ``(probs, draws, states, first, raised)``: the rows' probabilities (R', V), the draws (R',)
    on the device, each generator's state before its draws (a host copy: no device sync), each
    request's first row in ``probs``, and the messages of the requests whose draw raised (by index)."""
    rows = [start + j for start, n in spans for j in range(n)]
    row_params = [p for p, (_, n) in zip(params, spans) for _ in range(n)]
    probs = batched_sampling_probs(logits[torch.tensor(rows, device=logits.device)],
                                   *row_settings(row_params, logits.shape[-1], logits.device))  # (R', V)
    probs, valid = drawable(probs)  # a failed row draws from a stand-in, marked in valid (R',)
    states, draws, first, raised = [], [], [], {}
    for k, ((_, n), g) in enumerate(zip(spans, generators)):
        states.append(g.get_state())
        first.append(len(draws))
        try:
            mine = [torch.multinomial(probs[j:j + 1], 1, generator=g)[0] for j in range(len(draws), len(draws) + n)]
        except RuntimeError as exc:  # this request alone
            mine, raised[k] = [torch.full((1,), -1, device=probs.device) for _ in range(n)], f"the draw raised {exc}"
        draws.extend(mine)  # each (1,)
    return probs, torch.where(valid, torch.cat(draws), -1), states, first, raised
