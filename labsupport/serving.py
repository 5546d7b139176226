"""One request in two phases, costed on a roofline: the arithmetic behind the phase explainer.

A request is served in two phases. *Prefill* runs the whole prompt through the model in one
pass and produces the first token; *decode* then produces one token per step. Each phase runs
two kinds of kernel with very different arithmetic intensity, and each is costed here as the
roofline does it: a kernel's time is the larger of its arithmetic time (FLOPs / peak FLOP/s)
and its memory time (bytes / bandwidth), and a phase's time is the sum of its kernels' times.
Nothing is measured.

* **The weight matmuls** (every linear layer: the attention projections, the feed-forward
  network, the output head): for each token, a multiply and an add per weight (2 FLOPs for
  every parameter), the weights read once per pass, and the new tokens' keys and values written to the
  cache.
* **Attention** (scores and the weighted sum of values): ``costs.prefill_attention_flops`` for a
  prompt (causal by default), ``4*L*context*d`` per sequence for a decode step; it reads each
  cached key and value once (the optimistic bound of chapter 07: K and V tiles shared through
  the L2 cache), and each new token's queries, and writes its output (``2*L*d`` values a token). Its intensity is about the grouped-query group size in decode (8 for the Llama
  3.1 70B), whatever the batch, because every sequence brings its own cache.

The functions take a model (a :class:`~labsupport.models.ModelConfig` or a name), a device (a
:class:`~labsupport.hardware.GPU`, possibly several cards as one, ``GPU.times(n)``; every figure
comes from :mod:`labsupport.hardware`), the prompt and output lengths in tokens and the batch
size. Each checks them once into a :class:`Setting` (frozen) and reads its answer from it; the
setting computes each figure in one place (the request latency and the throughput in
:func:`phases` are the ones :func:`request_latency` and :func:`throughput` return). The defaults are the setting of the explainer in the course's source material: Llama 3 70B
(bf16 weights) split over four A100 40GB cards, a 1,024-token prompt, 128 output tokens, batch 1. The
conventions (:class:`Conventions`, each an explicit option):

* **Roofline.** ``roofline="per-kernel"`` (default) as above. ``"merged"`` is the source's
  simplification: one point per phase, all FLOPs over all bytes, one ``max``. It hides that the
  weight matmuls alone reach the ridge at a batch near the ridge point whatever the context,
  while attention never does, and it makes decode reach the ridge far later than its matmuls do.
* **Attention FLOPs.** ``attention="causal"`` (default), ``"full"`` (no mask) or ``"none"`` (the
  source leaves attention arithmetic out; its memory traffic is still counted).
* **Parameters.** ``params="nominal"`` uses the size in the model's name (70e9 for the 70B), as
  the source does; ``"counted"`` uses :func:`labsupport.costs.param_count` (70.55e9).
* **Bytes.** Weights at ``weight_dtype_bytes`` per parameter and the cache at ``kv_dtype_bytes``
  per element (2 each, bf16; ``*_dtype_bytes`` is bytes per element, ``*_bytes`` a total).
  Activations are not counted.
* **The batch** arrives together: its prompts are prefilled in one pass (so every request waits
  for the whole batch's prefill), then decoded in lockstep.
* **Decode context.** The ``output`` decode steps see ``prompt, prompt + 1, ...,
  prompt + output - 1`` tokens of context. One step stands for all of them, priced at
  their mean context ``prompt + (output - 1)/2`` (``decode_context="midpoint"``: 1,087.5 tokens
  in the source setting); ``"start"`` and ``"end"`` cost it at the first or last step's context.
* **Request latency** is ``TTFT + output * ITL`` (``decode_steps="output"``), as the source
  counts it. Strictly the prefill pass already yields the first token, so only ``output - 1``
  decode steps follow; ``decode_steps="output-1"`` counts that way.
* **Throughput** is output tokens per second across the batch while decoding,
  ``batch / ITL`` (``throughput="decode"``). ``"request"`` spreads the prefill over the request
  as well: ``batch * output / request_latency``.
* **Memory.** The KV cache needed is its size at the end of the request,
  ``batch * (prompt + output)`` tokens; it fits when weights plus cache are within the cards'
  memory (activations, workspace and fragmentation are not counted).

The source quotes "6 TB/s" for its four cards, 1.5 TB/s each, a rounding of the datasheet's
1.555 TB/s; this module uses the datasheet figure from :mod:`labsupport.hardware`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from . import costs
from ._validate import positive_int, positive_number, renamed_parameters
from .hardware import GPU, as_gpu
from .models import ModelConfig, as_model

#: Sizes in the models' names, the parameter counts the source's arithmetic uses.
NOMINAL_PARAMS: dict[str, float] = {
    "llama-3.1-8b": 8e9,
    "llama-3.1-70b": 70e9,
    "llama-3.1-405b": 405e9,
}

#: The source explainer's setup.
SOURCE_MODEL = "llama-3.1-70b"
SOURCE_CARD = "A100 40GB"
SOURCE_CARD_COUNT = 4
SOURCE_PROMPT = 1024  # "1K" is 1,024 tokens
SOURCE_OUTPUT = 128
SOURCE_BATCH = 1

_CHOICES = {
    "roofline": ("per-kernel", "merged"),
    "attention": ("causal", "full", "none"),
    "params": ("nominal", "counted"),
    "decode_context": ("midpoint", "start", "end"),
    "decode_steps": ("output", "output-1"),
    "throughput": ("decode", "request"),
}


def _choice(name: str, value, accepted) -> str:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}; got {value!r}")
    return value


@dataclass(frozen=True)
class Conventions:
    """How the phase model counts. See the module docstring for what each choice means.

    The defaults are the course's (each kernel on its own roofline, causal attention counted);
    :data:`SOURCE` is the source explainer's (one merged point, attention arithmetic left out).
    """

    roofline: str = "per-kernel"
    attention: str = "causal"
    params: str = "nominal"
    decode_context: str = "midpoint"
    decode_steps: str = "output"
    throughput: str = "decode"
    weight_dtype_bytes: float = 2  # bytes per weight
    kv_dtype_bytes: float = 2  # bytes per cached element

    def __post_init__(self) -> None:
        for name, accepted in _CHOICES.items():
            _choice(name, getattr(self, name), accepted)
        positive_number("weight_dtype_bytes", self.weight_dtype_bytes)
        positive_number("kv_dtype_bytes", self.kv_dtype_bytes)

    # The names before the bytes naming rule, read-only, for code written against them.
    @property
    def weight_bytes(self) -> float:
        """Old name of :attr:`weight_dtype_bytes` (bytes per weight)."""
        return self.weight_dtype_bytes

    @property
    def kv_bytes(self) -> float:
        """Old name of :attr:`kv_dtype_bytes` (bytes per cached element)."""
        return self.kv_dtype_bytes

    @staticmethod
    def choices() -> dict[str, tuple[str, ...]]:
        """Accepted values of each string option, default first."""
        return dict(_CHOICES)


# Conventions(weight_bytes=..., kv_bytes=...), as written before the bytes naming rule, still works.
Conventions.__init__ = renamed_parameters(weight_bytes="weight_dtype_bytes", kv_bytes="kv_dtype_bytes")(
    Conventions.__init__
)


DEFAULT = Conventions()
SOURCE = Conventions(roofline="merged", attention="none")


def _conventions(conventions) -> Conventions:
    if conventions is None:
        return DEFAULT
    if not isinstance(conventions, Conventions):
        raise ValueError(
            f"conventions must be a labsupport.serving.Conventions, got {type(conventions).__name__}"
        )
    return conventions


def _gpu(gpu) -> GPU:
    """``None`` is the source's device (:func:`serving_gpu`); anything else goes to :func:`as_gpu`."""
    return serving_gpu() if gpu is None else as_gpu(gpu)


def serving_gpu(card: str = SOURCE_CARD, count: int = SOURCE_CARD_COUNT) -> GPU:
    """``count`` cards of type ``card`` (a :mod:`labsupport.hardware` name) treated as one device."""
    return as_gpu(card).times(positive_int("count", count))


def model_params(model, params: str = "nominal") -> float:
    """Parameter count under the ``params`` convention: ``"nominal"`` (70e9) or ``"counted"``."""
    cfg = as_model(model)
    _choice("params", params, _CHOICES["params"])
    if params == "counted":
        return float(costs.param_count(cfg))
    if cfg.name not in NOMINAL_PARAMS:
        raise ValueError(
            f"params='nominal' needs a published size and {cfg.name!r} has none "
            f"(nominal sizes: {', '.join(NOMINAL_PARAMS)}); use params='counted'"
        )
    return NOMINAL_PARAMS[cfg.name]


def _context(prompt: int, output: int, conv: Conventions) -> float:
    """:func:`decode_context` on lengths already checked."""
    if conv.decode_context == "start":
        return float(prompt)
    if conv.decode_context == "end":
        return float(prompt + output - 1)
    return prompt + (output - 1) / 2


def decode_context(prompt_tokens: int, output_tokens: int, conventions: Conventions | None = None) -> float:
    """Tokens of context per sequence at the decode step that stands for all of them.

    The steps see ``prompt`` up to ``prompt + output - 1`` tokens: ``"midpoint"`` (default) is their
    mean, ``"start"`` the first, ``"end"`` the last.
    """
    conv = _conventions(conventions)
    prompt = positive_int("prompt_tokens", prompt_tokens)
    return _context(prompt, positive_int("output_tokens", output_tokens), conv)


def decode_steps(output_tokens: int, conventions: Conventions | None = None) -> int:
    """Decode steps counted in a request: ``output`` (the source) or ``output - 1``."""
    conv = _conventions(conventions)
    o = positive_int("output_tokens", output_tokens)
    return o if conv.decode_steps == "output" else o - 1


# --- a point on the roofline ---------------------------------------------------------------------


class RooflineCost:
    """FLOPs and bytes costed on one device's roofline: what :class:`Kernel` and :class:`Phase` share.

    A subclass provides ``flops``, ``bytes``, ``peak_flops`` (FLOP/s) and ``hbm_bandwidth`` (bytes/s).
    """

    flops: float
    bytes: float
    peak_flops: float
    hbm_bandwidth: float

    @property
    def compute_time(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_time(self) -> float:
        return self.bytes / self.hbm_bandwidth

    @property
    def time(self) -> float:
        """Roofline time: the larger of the compute time and the memory time."""
        return max(self.compute_time, self.memory_time)

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte moved."""
        return self.flops / self.bytes

    @property
    def attained_flops(self) -> float:
        return self.flops / self.time

    @property
    def fraction_of_peak(self) -> float:
        return self.attained_flops / self.peak_flops

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time >= self.memory_time else "memory"


@dataclass(frozen=True)
class Kernel(RooflineCost):
    """One kind of kernel in a phase, placed on the roofline on its own."""

    name: str  # "weight matmuls" or "attention"
    flops: float
    bytes: float
    peak_flops: float
    hbm_bandwidth: float


@dataclass(frozen=True)
class Phase(RooflineCost):
    """One phase: its kernels, and its time under the ``roofline`` convention.

    ``"per-kernel"``: the sum of each kernel's own roofline time. ``"merged"``: one point for
    the phase, all its FLOPs over all its bytes (its :attr:`intensity` is that point's).
    """

    name: str
    kernels: tuple[Kernel, ...]
    roofline: str
    peak_flops: float
    hbm_bandwidth: float

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)

    @property
    def time(self) -> float:
        """Seconds: the sum of the kernels' roofline times, or the merged point's."""
        if self.roofline == "merged":
            return super().time
        return sum(k.time for k in self.kernels)

    @property
    def matmuls(self) -> Kernel:
        return self.kernels[0]

    @property
    def attention(self) -> Kernel:
        return self.kernels[1]

    @property
    def bound(self) -> str:
        """``"compute"``, ``"memory"``, or ``"mixed"`` when the kernels are bound differently."""
        if self.roofline == "merged":
            return super().bound
        bounds = {k.bound for k in self.kernels}
        return bounds.pop() if len(bounds) == 1 else "mixed"


def _ridge_count(ridge: float, fixed_bytes: float, flops_each: float, bytes_each: float) -> float:
    """Smallest ``x`` with ``x*flops_each / (fixed_bytes + x*bytes_each) >= ridge``; inf if none."""
    room = flops_each - ridge * bytes_each
    return math.inf if room <= 0 else ridge * fixed_bytes / room


# --- one setting, checked once ----------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting of the phase model, checked once: the model, the device, the lengths, the batch and
    the conventions. Every figure of the model is computed here, once; the module's functions take the
    same six arguments (as the labs and the book call them), build one ``Setting`` and read from it.

    ``model`` is a :class:`~labsupport.models.ModelConfig` or a name, ``gpu`` a
    :class:`~labsupport.hardware.GPU`, a name, or ``None`` for :func:`serving_gpu`, ``conventions``
    a :class:`Conventions` or ``None`` for :data:`DEFAULT`; after construction each field holds the
    checked value (a ``ModelConfig``, a ``GPU``, ints, a ``Conventions``).
    """

    model: ModelConfig | str = SOURCE_MODEL
    gpu: GPU | str | None = None
    prompt_tokens: int = SOURCE_PROMPT
    output_tokens: int = SOURCE_OUTPUT
    batch: int = SOURCE_BATCH
    conventions: Conventions | None = None

    def __post_init__(self) -> None:
        checked = {
            "model": as_model(self.model),
            "gpu": _gpu(self.gpu),
            "conventions": _conventions(self.conventions),
            "prompt_tokens": positive_int("prompt_tokens", self.prompt_tokens),
            "output_tokens": positive_int("output_tokens", self.output_tokens),
            "batch": positive_int("batch", self.batch),
        }
        for name, value in checked.items():  # frozen: set once, here
            object.__setattr__(self, name, value)

    # --- the model's sizes under the conventions

    @cached_property
    def params(self) -> float:
        """Parameters, per ``conventions.params``."""
        return model_params(self.model, self.conventions.params)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.conventions.weight_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return costs.kv_bytes_per_token(self.model, self.conventions.kv_dtype_bytes)

    @property
    def kv_cache_bytes(self) -> float:
        """KV cache the batch holds at its largest, after the last token: ``B * (P + O)`` tokens."""
        return float(self.batch * (self.prompt_tokens + self.output_tokens) * self.kv_bytes_per_token)

    @property
    def decode_context(self) -> float:
        return _context(self.prompt_tokens, self.output_tokens, self.conventions)

    def _query_and_output_bytes(self, tokens: int) -> float:
        """Attention reads each token's queries and writes its output, ``d`` values each per layer (in
        the weights' dtype). Under grouped-query attention these are ``g`` times the token's keys and
        values, so a prompt's attention is far less intense than its cached K and V alone suggest."""
        return 2.0 * self.model.n_layers * tokens * self.model.d_model * self.conventions.weight_dtype_bytes

    def _phase(self, name: str, kernels) -> Phase:
        gpu = self.gpu
        return Phase(
            name=name,
            kernels=tuple(
                Kernel(kname, float(flops), float(nbytes), gpu.peak_flops, gpu.hbm_bandwidth)
                for kname, flops, nbytes in kernels
            ),
            roofline=self.conventions.roofline,
            peak_flops=gpu.peak_flops,
            hbm_bandwidth=gpu.hbm_bandwidth,
        )

    # --- the two phases

    @cached_property
    def prefill(self) -> Phase:
        """See :func:`prefill`."""
        cfg, conv, n = self.model, self.conventions, self.params
        p, b = self.prompt_tokens, self.batch
        tokens = b * p
        cache = tokens * self.kv_bytes_per_token
        attention = 0.0
        if conv.attention != "none":
            attention = b * costs.prefill_attention_flops(cfg, p, causal=conv.attention == "causal")
        return self._phase("prefill", (
            ("weight matmuls", 2 * n * tokens, n * conv.weight_dtype_bytes + cache),
            ("attention", attention, cache + self._query_and_output_bytes(tokens)),
        ))

    @cached_property
    def decode(self) -> Phase:
        """One decode step; see :func:`decode_step`."""
        cfg, conv, n, b = self.model, self.conventions, self.params, self.batch
        context = self.decode_context
        per_token = self.kv_bytes_per_token
        attention = 0.0
        if conv.attention != "none":
            attention = b * 4 * cfg.n_layers * context * cfg.d_model
        return self._phase("decode", (
            ("weight matmuls", 2 * n * b, n * conv.weight_dtype_bytes + b * per_token),
            ("attention", attention, b * context * per_token + self._query_and_output_bytes(b)),
        ))

    # --- what a user sees

    @property
    def ttft(self) -> float:
        return self.prefill.time

    @property
    def itl(self) -> float:
        return self.decode.time

    @property
    def decode_steps(self) -> int:
        return self.output_tokens if self.conventions.decode_steps == "output" else self.output_tokens - 1

    @property
    def request_latency(self) -> float:
        return self.ttft + self.decode_steps * self.itl

    @property
    def throughput(self) -> float:
        if self.conventions.throughput == "decode":
            return self.batch / self.itl
        return self.batch * self.output_tokens / self.request_latency

    # --- where the roofline's ridge is reached

    def decode_ridge_batch(self) -> float:
        """See :func:`decode_ridge_batch` (the setting's batch plays no part)."""
        step = replace(self, batch=1).decode
        weights = self.weight_bytes
        if self.conventions.roofline == "per-kernel":
            m = step.matmuls
            return _ridge_count(self.gpu.ridge_point, weights, m.flops, m.bytes - weights)
        return _ridge_count(self.gpu.ridge_point, weights, step.flops, step.bytes - weights)

    def prefill_ridge_tokens(self) -> float:
        """See :func:`prefill_ridge_tokens` (the lengths and the batch play no part)."""
        return _ridge_count(self.gpu.ridge_point, self.weight_bytes, 2 * self.params, self.kv_bytes_per_token)

    def report(self) -> PhaseReport:
        """Everything the explainer shows for this setting (see :func:`phases`)."""
        return PhaseReport(
            model=self.model.name,
            gpu=self.gpu.name,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            batch=self.batch,
            conventions=self.conventions,
            prefill=self.prefill,
            decode=self.decode,
            ridge_point=self.gpu.ridge_point,
            peak_flops=self.gpu.peak_flops,
            hbm_bandwidth=self.gpu.hbm_bandwidth,
            ttft=self.ttft,
            itl=self.itl,
            request_latency=self.request_latency,
            throughput=self.throughput,
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            memory_bytes=self.gpu.memory_bytes,
        )


@dataclass(frozen=True)
class PhaseReport:
    """Everything the explainer shows for one setting."""

    model: str
    gpu: str
    prompt_tokens: int
    output_tokens: int
    batch: int
    conventions: Conventions
    prefill: Phase
    decode: Phase
    ridge_point: float  # FLOP per byte
    peak_flops: float
    hbm_bandwidth: float
    ttft: float  # s
    itl: float  # s
    request_latency: float  # s
    throughput: float  # output tokens/s across the batch
    weight_bytes: float
    kv_cache_bytes: float
    memory_bytes: float

    @property
    def free_bytes(self) -> float:
        """Memory left for the KV cache once the weights are loaded (negative if they do not fit)."""
        return self.memory_bytes - self.weight_bytes

    @property
    def fits(self) -> bool:
        """Whether weights plus the KV cache at its largest fit in the device's memory."""
        return self.weight_bytes + self.kv_cache_bytes <= self.memory_bytes

    @property
    def prefill_in_decode_steps(self) -> float:
        """TTFT expressed in decode steps."""
        return self.ttft / self.itl


# --- the functions the labs and the book call: each one setting, read once ---------------------


def weight_bytes(model, conventions: Conventions | None = None) -> float:
    """Bytes of weights: parameters (per ``conventions.params``) times ``weight_dtype_bytes``."""
    conv = _conventions(conventions)
    return model_params(model, conv.params) * conv.weight_dtype_bytes


def prefill(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> Phase:
    """The prefill of ``batch`` prompts in one pass: the weight matmuls, then attention.

    Matmuls: ``2*N*B*P`` FLOPs, the weights read once and the prompts' cache written. Attention:
    the prompts' attention FLOPs (per ``conventions.attention``), their cache read once.
    """
    return Setting(model, gpu, prompt_tokens, batch=batch, conventions=conventions).prefill


def decode_step(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> Phase:
    """One decode step for the batch, at :func:`decode_context` tokens of context per sequence.

    Matmuls: ``2*N*B`` FLOPs, the weights read once and ``B`` new tokens' cache written.
    Attention: ``4*L*context*d`` FLOPs per sequence (unless ``conventions.attention`` is
    ``"none"``), ``B`` caches of that context read.
    """
    return Setting(model, gpu, prompt_tokens, output_tokens, batch, conventions).decode


def time_to_first_token(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds to the first token: the roofline time of the batch's prefill (no queueing)."""
    return Setting(model, gpu, prompt_tokens, batch=batch, conventions=conventions).ttft


def inter_token_latency(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds between consecutive tokens: the roofline time of one decode step."""
    return Setting(model, gpu, prompt_tokens, output_tokens, batch, conventions).itl


def request_latency(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds from request to last token: ``TTFT + steps * ITL`` (see :func:`decode_steps`)."""
    return Setting(model, gpu, prompt_tokens, output_tokens, batch, conventions).request_latency


def throughput(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Output tokens per second across the batch: ``batch / ITL`` by default (see module docstring)."""
    return Setting(model, gpu, prompt_tokens, output_tokens, batch, conventions).throughput


def kv_cache_bytes(
    model,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """KV cache the batch holds at its largest, after the last token: ``B * (P + O)`` tokens."""
    return Setting(model, None, prompt_tokens, output_tokens, batch, conventions).kv_cache_bytes


def decode_ridge_batch(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    conventions: Conventions | None = None,
) -> float:
    """Batch at which decode reaches the ridge point; ``math.inf`` if never.

    Per kernel (the default), the weight matmuls: intensity ``2*N*B / (W + B*k)`` reaches the
    ridge ``R`` at ``B = R*W / (2*N - R*k)``, near ``R`` for bf16 weights, whatever the context.
    (Decode attention's intensity does not grow with the batch at all.) Merged, the whole step:
    every sequence adds its cache of ``c`` tokens to the bytes, so ``B = R*W / (f - R*b)`` with
    ``f`` the FLOPs and ``b`` the bytes each sequence adds, and never when ``f <= R*b``.
    """
    return Setting(model, gpu, prompt_tokens, output_tokens, conventions=conventions).decode_ridge_batch()


def prefill_ridge_tokens(model, gpu=None, conventions: Conventions | None = None) -> float:
    """Tokens per prefill pass at which prefill's weight matmuls reach the ridge point.

    Their intensity is ``2*N*T / (W + T*k)`` for ``T`` tokens in the pass (all prompts of the
    batch together): below ``T = R*W / (2*N - R*k)`` they are bandwidth-bound, and a batch of
    such prompts prefilled together runs faster per token. Attention is left aside.
    """
    return Setting(model, gpu, conventions=conventions).prefill_ridge_tokens()


def phases(
    model=SOURCE_MODEL,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> PhaseReport:
    """Cost both phases of a request; with no arguments, the source explainer's setting.

    ``gpu=None`` means :func:`serving_gpu` (four A100 40GB cards, datasheet figures).
    """
    return Setting(model, gpu, prompt_tokens, output_tokens, batch, conventions).report()
