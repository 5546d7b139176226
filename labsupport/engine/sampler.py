"""Turning a step's logits into tokens: the batched sampler, and a per-row adapter (chapter 13).

:class:`BatchedSampler` samples every row of a step at once on the logits' device. Rows with a
repetition penalty first have their seen tokens penalised (one masked ``where`` over the batch,
:func:`labsupport.sampling.penalize_repetition`); then greedy rows (temperature 0) take one
``argmax``, and the others go through :func:`batched_sampling_probs`, which applies each row's own
temperature, min-p, top-k and top-p held in per-row tensors, then one draw per row from the
request's own seeded generator. The sampled ids come back to the host in one transfer, the step's
only device-to-host sync. The order is vLLM's (penalties, greedy, temperature, min-p, top-k and top-p).

Each request still gets exactly the tokens :func:`labsupport.sampling.sample` gives it with its own
generator (after :func:`~labsupport.sampling.penalize_repetition` where it has a penalty): the
probabilities are computed with the same operations in the same order (a sort, the division by the
temperature, the min-p cut, the top-k cut on the sorted row, a softmax, the top-p cut with a
renormalisation only where ``top_p < 1``), row by row the same numbers, and the draw is the same
``torch.multinomial`` call on the same row with the same generator (the tests compare both
bit for bit on the CPU). What is batched is everything but the draw: a generator per request
means one ``multinomial`` per sampled row. Engines that drop per-request generators draw the
whole batch at once instead (nano-vllm's sampler divides the probabilities by exponential noise and
takes the argmax, the Gumbel-max trick; vLLM does the same in ``vllm/v1/sample/ops/topk_topp_sampler.py``
and keeps per-request generators only for requests that set a seed).

:class:`PerRowSampler` wraps a function with :func:`~labsupport.sampling.sample`'s interface (lab 13
plugs a learner's in): one call per row, as the engine always did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._answers import answer
from ..sampling import SamplingParams, min_p_filter, penalize_repetition, top_p_cut


@answer
def batched_sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`labsupport.sampling.sampling_probs` for a batch whose rows have their own settings:
    ``logits`` (R, V); ``temperature`` (R,) float32, every one > 0; ``top_k`` (R,) int64, ``V``
    where a row keeps every token; ``top_p`` (R,) float32; ``min_p`` (R,) float32 or None (no row
    cut). Returns (R, V) float32 probabilities."""
    logits = logits.float()
    V = logits.shape[-1]
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (R, V) best first
    sorted_logits = torch.gather(logits / temperature[:, None], -1, order)  # (R, V)
    if min_p is not None:  # a row with min_p 0 loses nothing: no probability is below 0
        sorted_logits = min_p_filter(sorted_logits, min_p)  # (R, V)
    ranks = torch.arange(V, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # (R, V), sorted
    cut = probs.masked_fill(top_p_cut(probs, top_p[:, None]), 0.0)  # keeps the crossing token and the first
    cut = cut / cut.sum(-1, keepdim=True)
    probs = torch.where((top_p < 1.0)[:, None], cut, probs)  # only rows with top_p < 1 are cut and renormalised
    return torch.zeros_like(probs).scatter_(-1, order, probs)  # back to token order


def drawable(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (R, V) safe to hand to ``torch.multinomial``, and which were a distribution: a row with a NaN
    or infinite entry, or no mass, is replaced by a uniform stand-in (on a GPU an invalid row would stop
    the device, not raise) and marked False in ``valid`` (R,), on the device: no sync."""
    valid = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    return torch.where(valid[:, None], probs, torch.ones_like(probs)), valid


class RowSamplingError(RuntimeError):
    """One row's sampling failed (its probabilities were not a distribution, or the draw raised). A
    sampler returns it in that row's place instead of a token: the engine fails that request alone,
    and the other rows of the step keep their tokens."""


def row_failure(params: SamplingParams, why: str) -> RowSamplingError:
    """The error a request whose row could not be sampled gets, with its settings, so its client
    can tell what was asked."""
    return RowSamplingError(f"sampling failed for this request ({why}) with temperature={params.temperature:g}, "
                            f"top_k={params.top_k}, top_p={params.top_p:g}, min_p={params.min_p:g}, "
                            f"repetition_penalty={params.repetition_penalty:g}; the other requests go on. "
                            f"Retry, or report it with these settings.")


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as ints: the first maximum, a NaN counting as the largest (torch's rule). On
    the CPU through numpy, whose argmax follows the same rule: torch's CPU argmax over SmolLM2's 49,152
    logits took 64 us a row on the course's Xeon VM (torch 2.13, 2026-12-07), numpy's 3 us, where a
    fused decode step takes under 3 ms."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().resolve_neg().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class BatchedSampler:
    """Sample every row of a step in one pass (module docstring)."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                 histories: Sequence[Sequence[int]] | None = None) -> list[int | RowSamplingError]:
        """One token per row. ``histories[i]``, row ``i``'s token ids so far (prompt and output), is
        read only for rows with a repetition penalty; the others may give ``()``. A sampled row whose
        probabilities are not a distribution (NaN, inf, all zero), or whose draw raises, gets a
        :class:`RowSamplingError` in its place: the draw is made from a harmless stand-in (on a GPU an
        invalid distribution would stop the device, not raise) and the row is marked on the device,
        so the step still has one device-to-host sync."""
        logits = _penalized(logits, params, histories)
        if all(p.temperature == 0 for p in params):  # every row greedy (a common decode step): no copies, one sync
            return greedy_ids(logits)
        rows, V = logits.shape
        dev = logits.device
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        raised: dict[int, str] = {}
        if greedy:  # the fast path: no probabilities, no draw
            idx = torch.tensor(greedy, device=dev)
            tokens[idx] = logits[idx].argmax(-1)
        if drawn:
            idx = torch.tensor(drawn, device=dev)
            probs = batched_sampling_probs(logits[idx], *row_settings([params[i] for i in drawn], V, dev))  # (R', V)
            probs, valid = drawable(probs)  # a failed row draws from a stand-in, marked in valid
            for j, i in enumerate(drawn):  # each request's own generator: one draw per row
                try:
                    tokens[i] = torch.multinomial(probs[j:j + 1], 1, generator=generators[i])[0, 0]
                except RuntimeError as exc:  # this row alone
                    tokens[i], raised[i] = -1, f"the draw raised {exc}"
            tokens[idx] = torch.where(valid, tokens[idx], -1)
        out: list = tokens.tolist()  # the step's one device-to-host sync
        for i, t in enumerate(out):
            if t < 0:
                out[i] = row_failure(params[i], raised.get(i, "its probabilities were NaN, infinite or all zero"))
        return out


def row_settings(ps: Sequence[SamplingParams], V: int, device) -> tuple:
    """:func:`batched_sampling_probs`'s per-row settings for rows sampled with ``ps``: temperature,
    top-k (``V`` where a row keeps every token), top-p, and min-p (None when no row cuts)."""
    temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in ps], device=device)
    top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device)
    min_p = (torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
             if any(p.min_p > 0 for p in ps) else None)
    return temperature, top_k, top_p, min_p


def _penalized(logits: torch.Tensor, params: Sequence[SamplingParams],
               histories: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """The logits with each penalised row's seen tokens penalised; the same tensor when no row has one."""
    if all(p.repetition_penalty == 1 for p in params):
        return logits
    if histories is None or len(histories) != len(params):
        raise ValueError("a request has a repetition_penalty: pass histories, one sequence of token ids per row")
    return penalize_repetition(logits, histories, [p.repetition_penalty for p in params])


class PerRowSampler:
    """A function with :func:`labsupport.sampling.sample`'s interface, called once per row (after the
    repetition penalty, which needs the sequence). Lab 13's ``sample`` has no ``min_p``: the engine
    refuses a sampled request with one when it is added (:meth:`refuses`), rather than sample it
    without."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn

    @staticmethod
    def refuses(params: SamplingParams) -> str | None:
        """Why a request cannot be sampled by a learner's ``sample``, or None."""
        if params.min_p > 0 and params.temperature > 0:
            return ("this engine samples with your own sample(), which takes no min_p: send min_p=0, or use "
                    "the engine's own sampler (Engine(..., sampler=None))")
        return None

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                 histories: Sequence[Sequence[int]] | None = None) -> list[int]:
        """One token per row. A function that raises stops the step, loudly, as it always did: in
        the lab that is the learner's own code, whose traceback they need to see."""
        logits = _penalized(logits, params, histories)
        return [int(self.fn(logits[i:i + 1], p.temperature, p.top_k, p.top_p, generator=generators[i])[0])
                for i, p in enumerate(params)]
