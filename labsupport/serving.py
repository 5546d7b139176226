"""One request in two phases, costed on a roofline: the arithmetic behind the phase explainer.

A request is served in two phases. *Prefill* runs the whole prompt through the model in one
pass and produces the first token; *decode* then produces one token per step. Each phase is
costed here as the roofline does it: its time is the larger of its arithmetic time
(FLOPs / peak FLOP/s) and its memory time (bytes / bandwidth). Nothing is measured.

The functions take a model (a :class:`~labsupport.models.ModelConfig` or a name), a device (a
:class:`~labsupport.hardware.GPU`, possibly several cards as one, ``GPU.times(n)``), the prompt
and output lengths in tokens and the batch size. What they count, and the defaults, which
reproduce the explainer in the course's source material (Llama 3 70B in bf16 on four A100 40GB
cards, a 1,024-token prompt, 128 output tokens, batch 1: 114.9 ms to the first token, 23.4 ms
per token, 3.11 s per request, 43 tokens/s):

* **FLOPs.** Two per parameter per token (a multiply and an add per weight). Attention's own
  arithmetic is left out by default (``attention="none"``); ``"causal"`` or ``"full"`` adds
  ``labsupport.costs.prefill_attention_flops`` to prefill and ``4*L*context*d`` per sequence to a
  decode step.
* **Parameters.** ``params="nominal"`` uses the size in the model's name (70e9 for the 70B),
  as the source does; ``"counted"`` uses :func:`labsupport.costs.param_count` (70.55e9).
* **Bytes.** Weights at ``weight_dtype_bytes`` per parameter (2 for bf16), the cache at
  ``kv_dtype_bytes`` per element (``*_dtype_bytes`` is bytes per element, ``*_bytes`` a total). Prefill reads the weights
  once and writes the KV cache of every prompt token; a decode step reads the weights once
  and the KV cache of every sequence in the batch.
* **The batch** arrives together: its prompts are prefilled in one pass (so every request waits
  for the whole batch's prefill), then decoded in lockstep.
* **Decode context.** The ``output`` decode steps see ``prompt, prompt + 1, ...,
  prompt + output - 1`` tokens of context. One step is costed at the midpoint of that growing
  context, their mean ``prompt + (output - 1)/2`` (``decode_context="midpoint"``: 1,087.5 tokens
  in the source setting, which also gives its 182 GB of cache at 512 requests); ``"start"``
  and ``"end"`` cost it at the first step's or the last step's context instead.
* **Request latency** is ``TTFT + output * ITL`` (``decode_steps="output"``), as the source
  counts it. Strictly the prefill pass already yields the first token, so only ``output - 1``
  decode steps follow; ``decode_steps="output-1"`` counts that way (3.09 s instead of 3.11 s).
* **Throughput** is output tokens per second across the batch while decoding,
  ``batch / ITL`` (``throughput="decode"``, the source's 43 tok/s). ``"request"`` spreads the
  prefill over the request as well: ``batch * output / request_latency``.
* **The device.** :func:`serving_gpu` builds it. The source quotes 1.25 PFLOP/s (4 x 312 TFLOP/s
  dense bf16, computed as 1.248) against "6 TB/s" for four A100 40GB cards: 1.5 TB/s per card,
  a little under the datasheet's 1.555 TB/s. ``bandwidth="source"`` uses the source's figure for
  the cards it quotes; ``"datasheet"`` uses :mod:`labsupport.hardware`'s.
* **Memory.** The KV cache needed is its size at the end of the request,
  ``batch * (prompt + output)`` tokens; it fits when weights plus cache are within the cards'
  memory (activations, workspace and fragmentation are not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import costs
from ._validate import positive_int, positive_number, renamed_parameters
from .hardware import GPU, as_gpu
from .models import as_model

#: Sizes in the models' names, the parameter counts the source's arithmetic uses.
NOMINAL_PARAMS: dict[str, float] = {
    "llama-3.1-8b": 8e9,
    "llama-3.1-70b": 70e9,
    "llama-3.1-405b": 405e9,
}

#: Per-card bandwidth (bytes/s) where the source explainer quotes its own figure.
SOURCE_BANDWIDTH: dict[str, float] = {"A100 40GB": 1.5e12}

#: The source explainer's setup.
SOURCE_MODEL = "llama-3.1-70b"
SOURCE_CARD = "A100 40GB"
SOURCE_CARD_COUNT = 4
SOURCE_PROMPT = 1024  # "1K" is 1,024 tokens
SOURCE_OUTPUT = 128
SOURCE_BATCH = 1

_CHOICES = {
    "params": ("nominal", "counted"),
    "decode_context": ("midpoint", "start", "end"),
    "decode_steps": ("output", "output-1"),
    "throughput": ("decode", "request"),
    "attention": ("none", "causal", "full"),
}
BANDWIDTH_CHOICES = ("source", "datasheet")


def _choice(name: str, value, accepted) -> str:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}; got {value!r}")
    return value


@dataclass(frozen=True)
class Conventions:
    """How the phase model counts; the defaults reproduce the source explainer.

    See the module docstring for what each choice means.
    """

    params: str = "nominal"
    decode_context: str = "midpoint"
    decode_steps: str = "output"
    throughput: str = "decode"
    attention: str = "none"
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


SOURCE = Conventions()


def _conventions(conventions) -> Conventions:
    if conventions is None:
        return SOURCE
    if not isinstance(conventions, Conventions):
        raise ValueError(
            f"conventions must be a labsupport.serving.Conventions, got {type(conventions).__name__}"
        )
    return conventions


def _gpu(gpu) -> GPU:
    """``None`` is the source's device (:func:`serving_gpu`); anything else goes to :func:`as_gpu`."""
    return serving_gpu() if gpu is None else as_gpu(gpu)


def serving_gpu(card: str = SOURCE_CARD, count: int = SOURCE_CARD_COUNT, bandwidth: str = "source") -> GPU:
    """``count`` cards of type ``card`` treated as one device.

    ``bandwidth="source"`` uses the per-card bandwidth the source explainer quotes where it
    quotes one (:data:`SOURCE_BANDWIDTH`: 1.5 TB/s for the A100 40GB, so "6 TB/s" for four);
    every other card, and ``bandwidth="datasheet"``, use :mod:`labsupport.hardware`'s figure.
    """
    base = as_gpu(card)
    count = positive_int("count", count)
    _choice("bandwidth", bandwidth, BANDWIDTH_CHOICES)
    if bandwidth == "source" and base.name in SOURCE_BANDWIDTH:
        base = GPU(
            name=base.name,
            peak_flops=base.peak_flops,
            hbm_bandwidth=SOURCE_BANDWIDTH[base.name],
            memory_bytes=base.memory_bytes,
            source=base.source,
            notes=f"bandwidth {SOURCE_BANDWIDTH[base.name] / 1e12:g} TB/s as the source explainer rounds it "
            f"(datasheet {base.hbm_bandwidth / 1e12:g} TB/s)",
        )
    return base.times(count)


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


def _lengths(prompt_tokens, output_tokens, batch) -> tuple[int, int, int]:
    return (
        positive_int("prompt_tokens", prompt_tokens),
        positive_int("output_tokens", output_tokens),
        positive_int("batch", batch),
    )


def decode_context(prompt_tokens: int, output_tokens: int, conventions: Conventions | None = None) -> float:
    """Tokens of context per sequence at the decode step that stands for all of them.

    The steps see ``prompt`` up to ``prompt + output - 1`` tokens: ``"midpoint"`` (default) is their
    mean, ``"start"`` the first, ``"end"`` the last.
    """
    conv = _conventions(conventions)
    p, o, _ = _lengths(prompt_tokens, output_tokens, 1)
    if conv.decode_context == "start":
        return float(p)
    if conv.decode_context == "end":
        return float(p + o - 1)
    return p + (o - 1) / 2


@dataclass(frozen=True)
class Phase:
    """One phase placed on the roofline."""

    name: str
    flops: float
    bytes: float
    compute_time: float  # flops / peak
    memory_time: float  # bytes / bandwidth
    peak_flops: float

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
        """FLOP/s the phase reaches on the roofline: ``flops / time``."""
        return self.flops / self.time

    @property
    def fraction_of_peak(self) -> float:
        """Attained FLOP/s over the peak (1.0 when compute-bound)."""
        return self.attained_flops / self.peak_flops

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which floor sets the time."""
        return "compute" if self.compute_time >= self.memory_time else "memory"


def _phase(name: str, flops: float, nbytes: float, gpu: GPU) -> Phase:
    return Phase(
        name=name,
        flops=flops,
        bytes=nbytes,
        compute_time=flops / gpu.peak_flops,
        memory_time=nbytes / gpu.hbm_bandwidth,
        peak_flops=gpu.peak_flops,
    )


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
    """The prefill of ``batch`` prompts in one pass: ``2*N*B*P`` FLOPs, weights read once, cache written."""
    cfg, gpu, conv = as_model(model), _gpu(gpu), _conventions(conventions)
    p, _, b = _lengths(prompt_tokens, 1, batch)
    n = model_params(cfg, conv.params)
    tokens = b * p
    flops = 2 * n * tokens
    if conv.attention != "none":
        flops += b * costs.prefill_attention_flops(cfg, p, causal=conv.attention == "causal")
    nbytes = n * conv.weight_dtype_bytes + tokens * costs.kv_bytes_per_token(cfg, conv.kv_dtype_bytes)
    return _phase("prefill", flops, nbytes, gpu)


def decode_step(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> Phase:
    """One decode step for the batch, at :func:`decode_context` tokens of context per sequence.

    ``2*N*B`` FLOPs; the weights read once plus ``B`` caches of that context.
    """
    cfg, gpu, conv = as_model(model), _gpu(gpu), _conventions(conventions)
    p, o, b = _lengths(prompt_tokens, output_tokens, batch)
    n = model_params(cfg, conv.params)
    context = decode_context(p, o, conv)
    flops = 2 * n * b
    if conv.attention != "none":
        flops += b * 4 * cfg.n_layers * context * cfg.d_model
    nbytes = n * conv.weight_dtype_bytes + b * context * costs.kv_bytes_per_token(cfg, conv.kv_dtype_bytes)
    return _phase("decode", flops, nbytes, gpu)


def time_to_first_token(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds to the first token: the roofline time of the batch's prefill (no queueing)."""
    return prefill(model, gpu, prompt_tokens, batch, conventions).time


def inter_token_latency(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds between consecutive tokens: the roofline time of one decode step."""
    return decode_step(model, gpu, prompt_tokens, output_tokens, batch, conventions).time


def decode_steps(output_tokens: int, conventions: Conventions | None = None) -> int:
    """Decode steps counted in a request: ``output`` (the source) or ``output - 1``."""
    conv = _conventions(conventions)
    o = positive_int("output_tokens", output_tokens)
    return o if conv.decode_steps == "output" else o - 1


def request_latency(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Seconds from request to last token: ``TTFT + steps * ITL`` (see :func:`decode_steps`)."""
    conv = _conventions(conventions)
    ttft = time_to_first_token(model, gpu, prompt_tokens, batch, conv)
    itl = inter_token_latency(model, gpu, prompt_tokens, output_tokens, batch, conv)
    return ttft + decode_steps(output_tokens, conv) * itl


def throughput(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """Output tokens per second across the batch: ``batch / ITL`` by default (see module docstring)."""
    conv = _conventions(conventions)
    if conv.throughput == "decode":
        return batch / inter_token_latency(model, gpu, prompt_tokens, output_tokens, batch, conv)
    latency = request_latency(model, gpu, prompt_tokens, output_tokens, batch, conv)
    return batch * output_tokens / latency


def kv_cache_bytes(
    model,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> float:
    """KV cache the batch holds at its largest, after the last token: ``B * (P + O)`` tokens."""
    cfg, conv = as_model(model), _conventions(conventions)
    p, o, b = _lengths(prompt_tokens, output_tokens, batch)
    return float(b * (p + o) * costs.kv_bytes_per_token(cfg, conv.kv_dtype_bytes))


def decode_ridge_batch(
    model,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    conventions: Conventions | None = None,
) -> float:
    """Batch at which a decode step's intensity reaches the ridge point; ``math.inf`` if never.

    Intensity is ``2*N*B / (W + B*c*k)`` (``W`` weight bytes, ``c`` context, ``k`` cache bytes per
    token): it grows with ``B`` towards ``2*N / (c*k)``, so it reaches the ridge ``R`` at
    ``B = R*W / (2*N - R*c*k)`` when that limit lies above ``R``, and never otherwise. Attention
    FLOPs are not counted here whatever ``conventions.attention`` says.
    """
    cfg, gpu, conv = as_model(model), _gpu(gpu), _conventions(conventions)
    n = model_params(cfg, conv.params)
    per_sequence = decode_context(prompt_tokens, output_tokens, conv) * costs.kv_bytes_per_token(
        cfg, conv.kv_dtype_bytes
    )
    room = 2 * n - gpu.ridge_point * per_sequence
    if room <= 0:
        return math.inf
    return gpu.ridge_point * n * conv.weight_dtype_bytes / room


def prefill_ridge_tokens(model, gpu=None, conventions: Conventions | None = None) -> float:
    """Tokens per prefill pass at which prefill reaches the ridge point; ``math.inf`` if never.

    Prefill intensity is ``2*N*T / (W + T*k)`` for ``T`` tokens in the pass (all prompts of the
    batch together): below ``T = R*W / (2*N - R*k)`` prefill too is bandwidth-bound. Attention
    FLOPs are not counted here whatever ``conventions.attention`` says.
    """
    cfg, gpu, conv = as_model(model), _gpu(gpu), _conventions(conventions)
    n = model_params(cfg, conv.params)
    room = 2 * n - gpu.ridge_point * costs.kv_bytes_per_token(cfg, conv.kv_dtype_bytes)
    if room <= 0:
        return math.inf
    return gpu.ridge_point * n * conv.weight_dtype_bytes / room


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


def phases(
    model=SOURCE_MODEL,
    gpu=None,
    prompt_tokens: int = SOURCE_PROMPT,
    output_tokens: int = SOURCE_OUTPUT,
    batch: int = SOURCE_BATCH,
    conventions: Conventions | None = None,
) -> PhaseReport:
    """Cost both phases of a request; with no arguments, the source explainer's setting.

    ``gpu=None`` means :func:`serving_gpu` (four A100 40GB cards at the source's 6 TB/s).
    """
    cfg, gpu, conv = as_model(model), _gpu(gpu), _conventions(conventions)
    p, o, b = _lengths(prompt_tokens, output_tokens, batch)
    pre = prefill(cfg, gpu, p, b, conv)
    dec = decode_step(cfg, gpu, p, o, b, conv)
    ttft, itl = pre.time, dec.time
    latency = ttft + decode_steps(o, conv) * itl
    rate = b / itl if conv.throughput == "decode" else b * o / latency
    return PhaseReport(
        model=cfg.name,
        gpu=gpu.name,
        prompt_tokens=p,
        output_tokens=o,
        batch=b,
        conventions=conv,
        prefill=pre,
        decode=dec,
        ridge_point=gpu.ridge_point,
        peak_flops=gpu.peak_flops,
        hbm_bandwidth=gpu.hbm_bandwidth,
        ttft=ttft,
        itl=itl,
        request_latency=latency,
        throughput=rate,
        weight_bytes=weight_bytes(cfg, conv),
        kv_cache_bytes=kv_cache_bytes(cfg, p, o, b, conv),
        memory_bytes=gpu.memory_bytes,
    )
