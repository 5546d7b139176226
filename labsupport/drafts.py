"""Where speculative decoding's drafts come from, measured on a trained model (chapter 13).

Two drafts that need no second model:

* **Prompt lookup** (n-gram drafting; Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``
  method): the last ``n`` tokens of the sequence are looked for earlier in it, and the ``k``
  tokens that followed the match are proposed. :func:`ngram_proposal` follows vLLM's rule
  (``vllm/v1/spec_decode/ngram_proposer.py`` at ``016e8ed``): the longest ``n`` from ``max_n``
  down to ``min_n`` that matches, its earliest occurrence, and fewer than ``k`` tokens when fewer
  follow it. It costs no forward pass, and it pays off when the answer copies its prompt
  (editing, extraction, code).
* **A self-draft**: the target's own first layers, with its embeddings, final norm and output head
  (:func:`labsupport.speculative.make_draft` with no noise), run by
  :func:`labsupport.speculative.speculative_generate`.

:func:`greedy_speculative` verifies any proposer's tokens with the target in one pass over the
last token and the proposals (:func:`labsupport.speculative.all_position_logits`), greedily: a
proposal is accepted while it equals the target's argmax, then the target's own token is emitted.
That is :func:`labsupport.speculative.speculative_accept` at temperature 0 (the draft's and the
target's distributions are then one-hot), and the output is exactly plain greedy decoding's.

:func:`acceptance` turns a run into the figures chapter 13 shows: the acceptance rate ``a``
(proposals accepted over proposals tested, a rejected one included), tokens per target pass, and
the formula ``(1 - a^(k+1)) / (1 - a)`` (:func:`labsupport.speculative.expected_tokens_per_step`)
at the measured ``a`` beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._validate import positive_int
from .speculative import all_position_logits, expected_tokens_per_step, make_draft, speculative_generate

__all__ = ["ngram_proposal", "greedy_speculative", "layer_draft_speculative", "acceptance", "truncate_at_stop"]


def ngram_proposal(context: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens proposed by prompt lookup: the tokens that followed the earliest earlier
    occurrence of the longest suffix of ``context`` of ``min_n .. max_n`` tokens ([] if none)."""
    k, min_n, max_n = positive_int("k", k), positive_int("min_n", min_n), positive_int("max_n", max_n)
    if min_n > max_n:
        raise ValueError(f"min_n = {min_n} must not exceed max_n = {max_n}")
    ids = [int(t) for t in context]
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n):  # earliest first; the suffix itself is excluded
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


@torch.no_grad()
def greedy_speculative(target, prompt: Sequence[int], max_new_tokens: int, k: int,
                       propose: Callable[[list[int], int], Sequence[int]],
                       stop_ids: Sequence[int] = ()) -> dict:
    """Greedy speculative decoding of one sequence with the proposer ``propose(sequence, k)`` (at
    most ``k`` ids; fewer or none is allowed). Stops after ``max_new_tokens`` or a token of
    ``stop_ids``. Returns ``{"tokens", "steps", "proposed", "accepted", "emitted", "offered"}``:
    target passes, proposals tested (up to and including the first rejected one), proposals
    accepted, and for each pass the tokens it emitted and the proposals it was offered."""
    n = positive_int("max_new_tokens", max_new_tokens)
    k = positive_int("k", k)
    seq = [int(t) for t in prompt]
    if not seq:
        raise ValueError("greedy_speculative: the prompt is empty")
    P, stop = len(seq), {int(s) for s in stop_ids}
    cache = target.new_cache(1, P + n + k + 1)
    cached = 0  # positions whose keys and values in the cache are the sequence's
    steps = proposed = accepted = 0
    emitted: list[int] = []
    offered: list[int] = []
    while len(seq) - P < n:
        props = [int(t) for t in propose(seq, k)][:k]
        chunk = torch.tensor([seq[cached:] + props], device=target.device)  # (1, new + len(props))
        logits = all_position_logits(target, chunk, cache, cached)[0, -(len(props) + 1):]  # (len(props) + 1, V)
        best = logits.argmax(-1).tolist()
        out = []
        for i, x in enumerate(props):
            if x != best[i]:
                break
            out.append(x)
        proposed += min(len(out) + 1, len(props))
        accepted += len(out)
        out.append(best[len(out)])  # the target's own token: the correction, or the bonus after all k
        cached = len(seq) + len(out) - 1  # the last emitted token is not in the cache yet
        steps += 1
        emitted.append(len(out))
        offered.append(len(props))
        seq += out
        hit = next((i for i, t in enumerate(out) if t in stop), None)
        if hit is not None:
            del seq[len(seq) - len(out) + hit + 1:]
            break
    return {"tokens": seq[P:P + n], "steps": steps, "proposed": proposed, "accepted": accepted, "emitted": emitted,
            "offered": offered}


def truncate_at_stop(result: dict, k: int, stop_ids: Sequence[int]) -> dict:
    """A run of :func:`labsupport.speculative.speculative_generate` (which always makes
    ``max_new_tokens``) cut after the first token of ``stop_ids``: the steps up to and including
    the one that emitted it, with their proposals tested and accepted (from ``emitted``)."""
    stop = {int(s) for s in stop_ids}
    end = next((i + 1 for i, t in enumerate(result["tokens"]) if t in stop), len(result["tokens"]))
    steps = proposed = accepted = made = 0
    emitted = []
    for m in result["emitted"]:
        if made >= end:
            break
        steps += 1
        accepted += m - 1
        proposed += min(m, k)
        made += m
        emitted.append(m)
    return {"tokens": result["tokens"][:end], "steps": steps, "proposed": proposed, "accepted": accepted,
            "emitted": emitted, "offered": [k] * steps}


def layer_draft_speculative(target, prompt: Sequence[int], max_new_tokens: int, k: int, n_layers: int,
                            stop_ids: Sequence[int] = ()) -> dict:
    """Greedy speculative decoding with the target's first ``n_layers`` layers as the draft
    (:func:`labsupport.speculative.make_draft`, no noise), cut at the first stop id."""
    draft = make_draft(target, n_layers)
    result = speculative_generate(target, draft, list(prompt), max_new_tokens, k, temperature=0.0)
    return truncate_at_stop(result, k, stop_ids)


def acceptance(result: dict, k: int) -> dict:
    """The figures of one or more runs (``result`` may also be a list of them, summed): the
    acceptance rate ``a``, tokens per target pass over all passes and over the passes that were
    offered a full ``k`` proposals, and the independent-acceptance formula at ``a`` (which assumes
    ``k`` proposals every pass)."""
    runs = result if isinstance(result, list) else [result]
    steps = sum(r["steps"] for r in runs)
    proposed = sum(r["proposed"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    tokens = sum(sum(r["emitted"]) for r in runs)
    pairs = [(m, o) for r in runs for m, o in zip(r["emitted"], r["offered"])]
    full = [m for m, o in pairs if o == k]
    a = accepted / proposed if proposed else 0.0
    return {"k": k, "steps": steps, "tokens": tokens, "proposed": proposed, "accepted": accepted,
            "acceptance": a, "tokens_per_pass": tokens / steps if steps else 0.0,
            "passes_offered_k": len(full), "passes_offered_none": sum(o == 0 for _, o in pairs),
            "tokens_per_pass_offered_k": sum(full) / len(full) if full else None,
            "formula_tokens_per_pass": expected_tokens_per_step(min(a, 1.0), k),
            "longest_step": max((m for m, _ in pairs), default=0)}
