"""A trained model's quality, measured: perplexity, KL divergence to a reference, loss by position.

Chapter 09 uses :func:`compare_to_reference` to say what quantisation does to a real model
(SmolLM2-135M-Instruct, :func:`labsupport.checkpoints.load`); chapter 08 uses
:func:`loss_by_position` to show how much of its context the model uses. Both run on
:func:`heldout_text`, a text written for the course that neither the course tokenizer nor the model
was trained on (``labsupport/data/heldout/README.md``: where it comes from, its licence).

Conventions (the pages state them beside every figure):

* **Windows.** The token ids are cut into windows of ``window`` tokens starting every ``stride``
  tokens (:func:`window_starts`; ``stride = window`` gives disjoint windows, the convention of
  chapter 09). Each window is run from an empty cache: it sees nothing of the text before it. In a
  window of ``W`` tokens the model makes ``W - 1`` predictions, token ``i + 1`` from tokens
  ``0 .. i``; its *position* ``i + 1`` is the number of tokens it was given.
* **Perplexity** is ``exp`` of the mean negative log-likelihood (natural log) of every prediction
  scored, all windows together.
* **KL divergence** ``KL(reference || other) = sum_v p_v (log p_v - log q_v)``, in nats, at every
  prediction position, in float64; reported as the mean over positions (and its 99th percentile).
  **Top-1 agreement** is the share of positions whose most likely token is the same.
* **No special tokens.** The text is encoded as plain text (no BOS, no chat template): what is
  measured is the model on prose, not on a conversation.

The model's forward is reached only through :func:`labsupport.speculative.all_position_logits`
(every position's logits from a cache), so this module depends on nothing inside the model.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ._validate import positive_int
from .quantize import fake_quantize
from .speculative import all_position_logits
from .transformer import sdpa_attention

__all__ = ["HELDOUT_PATH", "heldout_text", "heldout_identity", "window_starts", "window_logits", "token_nll",
           "perplexity", "Quality", "compare_to_reference", "PositionCurve", "loss_by_position",
           "int8_kv_attention", "with_int8_kv_cache"]

HELDOUT_PATH = Path(__file__).parent / "data" / "heldout" / "harwick_reach.txt"


def heldout_text() -> str:
    """The course's held-out text (about 6,900 words of English prose; see the module docstring)."""
    return HELDOUT_PATH.read_text(encoding="utf-8")


def heldout_identity() -> dict:
    """What a results file records of the held-out text: its file name, characters and SHA-256."""
    text = heldout_text()
    return {"file": f"labsupport/data/heldout/{HELDOUT_PATH.name}", "characters": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def window_starts(n_tokens: int, window: int, stride: int | None = None) -> list[int]:
    """The first token of every window of ``window`` tokens, one every ``stride`` (default: the
    window, so windows are disjoint), that fits in ``n_tokens``. ValueError if none fits."""
    n = positive_int("n_tokens", n_tokens)
    w = positive_int("window", window)
    s = w if stride is None else positive_int("stride", stride)
    if w < 2:
        raise ValueError(f"window must hold at least 2 tokens (one prediction), got {w}")
    if w > n:
        raise ValueError(f"a window of {w} tokens does not fit in {n} tokens; use a shorter window")
    return list(range(0, n - w + 1, s))


@torch.no_grad()
def window_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` (one window), ``(len(ids), V)`` float32, from an empty cache."""
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=model.device)  # (1, W)
    cache = model.new_cache(1, tokens.shape[1])
    return all_position_logits(model, tokens, cache, 0)[0]  # (W, V)


def _windows(ids: Sequence[int], window: int, stride: int | None) -> list[list[int]]:
    ids = [int(i) for i in ids]
    return [ids[s:s + window] for s in window_starts(len(ids), window, stride)]


@torch.no_grad()
def token_nll(model, ids: Sequence[int], window: int, stride: int | None = None,
              logits_of: Callable | None = None) -> torch.Tensor:
    """Negative log-likelihood (nats) of every prediction in every window: ``(n_windows, window - 1)``
    float64; column ``j`` is the prediction made from ``j + 1`` tokens. ``logits_of(model, chunk)``
    gives a window's logits (W, V): :func:`window_logits` (one forward pass) unless another is given
    (the fused CPU decode step's, :func:`labsupport.cpu_decode.teacher_forced_logits`)."""
    logits_of = window_logits if logits_of is None else logits_of
    rows = []
    for chunk in _windows(ids, window, stride):
        logits = logits_of(model, chunk)  # (W, V)
        targets = torch.tensor(chunk[1:], device=logits.device)
        rows.append(F.cross_entropy(logits[:-1], targets, reduction="none").double().cpu())  # (W - 1,)
    return torch.stack(rows)


def perplexity(nll: torch.Tensor) -> float:
    """``exp(mean(nll))``: the perplexity of the predictions whose losses ``nll`` holds."""
    return math.exp(float(nll.double().mean()))


@dataclass(frozen=True)
class Quality:
    """One model against the reference on the same windows (see the module docstring)."""

    perplexity: float
    kl_mean: float  # nats per position, KL(reference || this model)
    kl_p99: float  # the 99th percentile over positions (nearest rank)
    top1: float  # share of positions whose argmax equals the reference's
    positions: int  # predictions scored

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "kl_mean": self.kl_mean, "kl_p99": self.kl_p99, "top1": self.top1,
                "positions": self.positions}


def _nearest_rank(values: torch.Tensor, p: float) -> float:
    ordered = values.sort().values
    rank = max(1, math.ceil(p / 100 * ordered.numel()))
    return float(ordered[rank - 1])


@torch.no_grad()
def compare_to_reference(reference, others: Mapping[str, object | Callable[[], object]], ids: Sequence[int],
                         window: int, stride: int | None = None) -> dict[str, Quality]:
    """Perplexity of ``reference`` and of each model of ``others`` on the windows of ``ids``, with
    KL divergence and top-1 agreement to the reference at every prediction.

    ``others`` maps a label to a model, or to a function of no arguments that builds it (so a
    quantised copy exists only while it is measured). The result has ``"reference"`` first, then
    the labels in order.
    """
    chunks = _windows(ids, window, stride)
    ref_logp, ref_nll, ref_top = [], [], []
    for chunk in chunks:
        logits = window_logits(reference, chunk)[:-1].double()  # (W - 1, V)
        logp = torch.log_softmax(logits, -1)
        targets = torch.tensor(chunk[1:], device=logp.device)
        ref_logp.append(logp.float().cpu())  # float32 copies: the reference is kept for every comparison
        ref_nll.append(-logp.gather(-1, targets[:, None])[:, 0].cpu())
        ref_top.append(logits.argmax(-1).cpu())
    nll = torch.cat(ref_nll)
    out = {"reference": Quality(perplexity(nll), 0.0, 0.0, 1.0, nll.numel())}
    for label, other in others.items():
        model = other() if callable(other) and not isinstance(other, torch.nn.Module) else other
        kls, nlls, agree = [], [], []
        for chunk, p_log, top in zip(chunks, ref_logp, ref_top):
            logits = window_logits(model, chunk)[:-1].double().cpu()  # (W - 1, V)
            q_log = torch.log_softmax(logits, -1)
            p_log64 = p_log.double()
            kls.append((p_log64.exp() * (p_log64 - q_log)).sum(-1))  # (W - 1,)
            targets = torch.tensor(chunk[1:])
            nlls.append(-q_log.gather(-1, targets[:, None])[:, 0])
            agree.append(logits.argmax(-1) == top)
        kl, nll_q = torch.cat(kls).clamp(min=0.0), torch.cat(nlls)  # a KL below 0 is float64 rounding
        out[label] = Quality(perplexity(nll_q), float(kl.mean()), _nearest_rank(kl, 99),
                             float(torch.cat(agree).double().mean()), nll_q.numel())
        del model
    return out


@dataclass(frozen=True)
class PositionCurve:
    """Mean loss by position (chapter 08): ``bins[i] = (first, last)`` positions (tokens given),
    ``nll[i]`` their mean negative log-likelihood in nats, ``perplexity[i] = exp(nll[i])``,
    ``predictions[i]`` how many predictions the bin averages; ``window``, ``stride`` and
    ``windows`` say how the text was cut."""

    bins: list[tuple[int, int]]
    nll: list[float]
    perplexity: list[float]
    predictions: list[int]
    window: int
    stride: int
    windows: int

    def as_dict(self) -> dict:
        return {"bins": [list(b) for b in self.bins], "nll": self.nll, "perplexity": self.perplexity,
                "predictions": self.predictions, "window": self.window, "stride": self.stride,
                "windows": self.windows}


def loss_by_position(model, ids: Sequence[int], window: int, stride: int | None = None) -> PositionCurve:
    """Mean loss against position in the window, in bins that double: positions 1, 2-3, 4-7, ...,
    up to ``window - 1`` (the last bin ends at the window's last prediction). Each bin averages
    every window's predictions at those positions."""
    nll = token_nll(model, ids, window, stride)  # (n_windows, W - 1); column j: position j + 1
    last = nll.shape[1]
    bins, means, counts = [], [], []
    first = 1
    while first <= last:
        end = min(2 * first - 1, last)
        block = nll[:, first - 1:end]
        bins.append((first, end))
        means.append(float(block.mean()))
        counts.append(block.numel())
        first = 2 * first
    starts = window_starts(len(ids), window, stride)
    return PositionCurve(bins, means, [math.exp(m) for m in means], counts, window,
                         window if stride is None else stride, len(starts))


# --- an int8 KV cache, simulated --------------------------------------------------------------


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) quantised to int8 and back with one symmetric scale per vector of D numbers:
    a KV cache stored in int8 with a scale per token and head (what vLLM's ``kv_cache_dtype`` int8
    and fp8 modes keep, at a finer grain than a scale per layer)."""
    shape = x.shape
    return fake_quantize(x.reshape(-1, shape[-1]).float(), 8, "channel").reshape(shape).to(x.dtype)


def int8_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention that reads its keys and values as an int8 KV cache would hold them (one scale per
    token and head, :func:`_int8_rows`), then SDPA. Every key and value is rounded, the new
    tokens' as well: an engine that attends from its cache (vLLM V1 does, prefill included) reads
    them all back from int8."""
    return sdpa_attention(q, _int8_rows(k), _int8_rows(v), causal)


def with_int8_kv_cache(model):
    """A view of ``model`` that shares its weights but attends through :func:`int8_kv_attention`
    (a shallow copy whose attention is replaced; ``model`` itself is unchanged)."""
    view = copy.copy(model)
    view.attention = int8_kv_attention
    return view
