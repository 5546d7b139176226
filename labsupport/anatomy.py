"""What is inside a decoder, counted: parameters by component, the FLOPs and bytes of one forward
step by component, and where a profiled step of the course model spends its time (chapter 02).

Conventions:

* Components of the parameter count (:data:`COMPONENTS`): ``embedding`` (the token table),
  ``attention`` (q, k, v and output projections with any biases), ``feed_forward`` (SwiGLU's gate,
  up and down matrices), ``norms`` (every RMSNorm weight vector: two per layer, the final one, and
  Qwen3's q/k norms) and ``output`` (the output layer; 0 when it is tied to the embedding table,
  whose one copy is counted under ``embedding``). They add up to
  :func:`labsupport.costs.param_count`.
* FLOPs count matrix multiplications only, ``2*m*k*n`` each (:mod:`labsupport.costs`); norms,
  rotations, softmax and residual adds are a few FLOPs per element and are left out. Attention
  scores and blending are counted causally: each query against the keys it may see.
* Bytes are what a step must read from memory: every weight it multiplies by (the embedding
  table only for the rows it looks up), the keys and values it attends to. Activations are left
  out (at decode they are a few KB per token).
* The course model computes logits for the last position only, so the output layer costs one
  row per sequence, in prefill as in decode.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import torch

from ._answers import answer
from ._validate import positive_int
from .costs import param_count
from .families import COMPONENTS, component_of
from .models import ModelConfig, as_model
from .transformer import Attention, FeedForward, RMSNorm, Transformer

# The parts of a forward step that the profile separates (:func:`profile_step`), in order.
STEP_PARTS = (
    "embedding",
    "norms",
    "q/k/v projections",
    "attention (rotate, cache, scores)",
    "output projection",
    "feed_forward",
    "output layer",
    "other",
)


@answer
def param_count_by_component(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of a Llama-style decoder by component (see :data:`COMPONENTS`): chapter 02.

    ``embedding = V*d``; ``attention = L*(d*H*D + 2*d*Hkv*D + H*D*d + q/k/v biases + output
    bias)``; ``feed_forward = L*3*d*d_ff``; ``norms = L*2*d + d (+ L*2*D with q/k norms)``;
    ``output = V*d``, or 0 when tied.
    """
    cfg = as_model(cfg)
    d, D, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
    attention = d * q + 2 * d * kv + q * d
    if cfg.qkv_bias:
        attention += q + 2 * kv
    if cfg.o_bias:
        attention += d
    norms = L * 2 * d + d + (L * 2 * D if cfg.qk_norm else 0)
    return {
        "embedding": cfg.vocab_size * d,
        "attention": L * attention,
        "feed_forward": L * 3 * d * cfg.d_ff,
        "norms": norms,
        "output": 0 if cfg.tied_embeddings else cfg.vocab_size * d,
    }


def _counts_by_component(module: torch.nn.Module) -> dict[str, int]:
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in module.named_parameters():  # a tied table is listed once
        # the component of each name, the course model's or transformers', from the one table of weights
        counts[component_of(name)] += p.numel()
    return counts


def model_param_counts(cfg) -> dict[str, int]:
    """``numel()`` of the course model's parameters by component, built on the meta device (no
    memory, so any shape works)."""
    return _counts_by_component(Transformer(as_model(cfg), device="meta"))


def hf_model(config: Mapping, device="meta"):
    """Hugging Face ``transformers`` building the architecture a ``config.json`` dict describes,
    on ``device`` (``"meta"``: shapes only, no memory, nothing downloaded)."""
    # transformers is imported here: it is a course dependency, not one of the package installed on Colab
    import transformers

    config = dict(config)
    family = config.pop("model_type", None)
    if family is None:
        raise ValueError("the config.json dict needs its model_type to be built by transformers")
    with torch.device(device):
        hf_config = transformers.AutoConfig.for_model(family, **config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def hf_param_counts(config: Mapping) -> dict[str, int]:
    """``numel()`` by component of the model transformers builds from ``config`` on the meta device."""
    return _counts_by_component(hf_model(config))


def moe_param_counts(cfg, n_experts: int, experts_per_token: int) -> dict[str, int]:
    """Total and active parameters of a mixture-of-experts decoder whose every feed-forward is
    ``n_experts`` SwiGLU experts of width ``cfg.d_ff`` with a router (``d * n_experts`` weights),
    ``experts_per_token`` of them used per token (Mixtral: 8 and 2). Returns ``{"total": ...,
    "active": ...}``; everything outside the experts is active for every token."""
    cfg = as_model(cfg)
    n_experts = positive_int("n_experts", n_experts)
    experts_per_token = positive_int("experts_per_token", experts_per_token)
    if experts_per_token > n_experts:
        raise ValueError(f"experts_per_token ({experts_per_token}) cannot exceed n_experts ({n_experts})")
    expert = 3 * cfg.d_model * cfg.d_ff
    shared = param_count(cfg) - cfg.n_layers * expert + cfg.n_layers * cfg.d_model * n_experts  # + routers
    return {"total": shared + cfg.n_layers * n_experts * expert,
            "active": shared + cfg.n_layers * experts_per_token * expert}


def moe_experts_read(n_experts: int, experts_per_token: int, batch: int) -> float:
    """Expected number of distinct experts a layer reads in one decode step of ``batch`` tokens,
    assuming each token picks ``experts_per_token`` of ``n_experts`` uniformly and independently:
    ``n * (1 - ((n - k) / n) ** batch)``. Real routers are not uniform; this is the assumption the
    book states beside the number."""
    n = positive_int("n_experts", n_experts)
    k = positive_int("experts_per_token", experts_per_token)
    b = positive_int("batch", batch)
    if k > n:
        raise ValueError(f"experts_per_token ({k}) cannot exceed n_experts ({n})")
    return n * (1 - ((n - k) / n) ** b)


def step_costs(cfg, batch: int, new_tokens: int, context: int = 0, dtype_bytes: float = 2) -> dict[str, dict]:
    """FLOPs and bytes read by one forward step of ``new_tokens`` per sequence after ``context``
    cached ones, by part (:data:`STEP_PARTS`, less ``"other"``): ``{part: {"flops": ..., "bytes":
    ...}}``. Prefill is ``context=0, new_tokens=P``; a decode step ``new_tokens=1``. See the module's
    conventions."""
    cfg = as_model(cfg)
    B = positive_int("batch", batch)
    S = positive_int("new_tokens", new_tokens)
    T0 = positive_int("context", context, allow_zero=True)
    d, D, L, V = cfg.d_model, cfg.head_dim, cfg.n_layers, cfg.vocab_size
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
    keys_seen = S * T0 + S * (S + 1) // 2  # query i (0-based) sees T0 + i + 1 keys
    qkv_weights = L * (d * (q + 2 * kv) + ((q + 2 * kv) if cfg.qkv_bias else 0))
    o_weights = L * (q * d + (d if cfg.o_bias else 0))
    norm_weights = L * 2 * d + d + (L * 2 * D if cfg.qk_norm else 0)
    ffn_weights = L * 3 * d * cfg.d_ff
    tokens = B * S
    return {
        "embedding": {"flops": 0.0, "bytes": float(tokens * d * dtype_bytes)},  # only the rows looked up
        "norms": {"flops": 0.0, "bytes": float(norm_weights * dtype_bytes)},
        "q/k/v projections": {"flops": float(2 * tokens * L * d * (q + 2 * kv)),
                              "bytes": float(qkv_weights * dtype_bytes)},
        "attention (rotate, cache, scores)": {
            "flops": float(4 * B * L * q * keys_seen),
            "bytes": float(2 * L * B * (T0 + S) * kv * dtype_bytes),  # the keys and values attended to
        },
        "output projection": {"flops": float(2 * tokens * L * q * d), "bytes": float(o_weights * dtype_bytes)},
        "feed_forward": {"flops": float(6 * tokens * L * d * cfg.d_ff), "bytes": float(ffn_weights * dtype_bytes)},
        "output layer": {"flops": float(2 * B * d * V), "bytes": float(V * d * dtype_bytes)},
    }


@contextlib.contextmanager
def _labelled(model: Transformer, sync):
    """Profiler ranges named after :data:`STEP_PARTS` around the model's modules, while active.

    The output layer is not a module (``x @ head.T`` after the final norm): its range opens when
    the final norm returns and is closed by the caller when the step returns (``close_output``)."""
    handles, stack, output = [], [], []

    def enter(label):
        def pre(module, args):
            sync()
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)
        return pre

    def leave(module, args, out):
        sync()
        stack.pop().__exit__(None, None, None)

    def label(module, name):
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))

    def open_output(module, args, out):
        rf = torch.profiler.record_function("output layer")
        rf.__enter__()
        output.append(rf)

    def close_output():
        sync()
        while output:
            output.pop().__exit__(None, None, None)

    label(model.tok_embeddings, "embedding")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            label(module, "norms")
        elif isinstance(module, Attention):
            label(module, "attention block")
            for proj in (module.wq, module.wk, module.wv):
                label(proj, "q/k/v projections")
            label(module.wo, "output projection")
        elif isinstance(module, FeedForward):
            label(module, "feed_forward")
    handles.append(model.norm.register_forward_hook(open_output))  # after the norm's own range closes
    try:
        yield close_output
    finally:
        close_output()
        for handle in handles:
            handle.remove()


def _totals(prof) -> dict[str, float]:
    """Seconds of every profiler range by name, summed over calls, and the norms inside attention."""
    totals: dict[str, float] = {}
    inner_norms = 0.0
    for event in prof.events():
        totals[event.name] = totals.get(event.name, 0.0) + event.cpu_time_total / 1e6
        if event.name == "norms" and any(p.name == "attention block" for p in _ancestors(event)):
            inner_norms += event.cpu_time_total / 1e6
    totals["norms inside attention"] = inner_norms
    return totals


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def profile_step(model: Transformer, phase: str, tokens: int, batch: int = 1, repeats: int = 3) -> dict:
    """Profile ``repeats`` prefills of ``tokens`` tokens (``phase="prefill"``) or decode steps after
    a ``tokens``-token prompt (``phase="decode"``) with ``torch.profiler``, each part of the step
    labelled (:data:`STEP_PARTS`). Returns ``{"seconds": {part: seconds per step}, "step_s": ...,
    "profiler": the profile, "device": ...}``. On a GPU every label boundary synchronises, so each
    part's time includes its kernels (and the step is a little slower than unprofiled).
    """
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a labsupport.transformer.Transformer, got {type(model).__name__}")
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    tokens = positive_int("tokens", tokens)
    batch = positive_int("batch", batch)
    repeats = positive_int("repeats", repeats)
    on_gpu = model.device.type == "cuda"

    def sync():
        if on_gpu:
            torch.cuda.synchronize(model.device)

    prompt = model.random_prompt(batch, tokens, seed=0)
    cache = model.new_cache(batch, tokens + repeats + 2)
    next_token = model.prefill(prompt, cache).argmax(-1, keepdim=True)  # warm-up; fills the cache
    if phase == "decode":
        model.decode_step(next_token, cache)  # warm-up of the decode path
    activities = [torch.profiler.ProfilerActivity.CPU]
    with _labelled(model, sync) as close_output, torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            with torch.profiler.record_function("step"):
                if phase == "prefill":
                    model.prefill(prompt, cache)
                else:
                    cache.length = tokens + 1  # every profiled step decodes at the same position
                    model.decode_step(next_token, cache)
                close_output()
    t = _totals(prof)
    attention = t.get("attention block", 0.0)
    qkv, o_proj = t.get("q/k/v projections", 0.0), t.get("output projection", 0.0)
    parts = {
        "embedding": t.get("embedding", 0.0),
        "norms": t.get("norms", 0.0),
        "q/k/v projections": qkv,
        "attention (rotate, cache, scores)": attention - qkv - o_proj - t["norms inside attention"],
        "output projection": o_proj,
        "feed_forward": t.get("feed_forward", 0.0),
        "output layer": t.get("output layer", 0.0),
    }
    step = t["step"]
    parts["other"] = max(step - sum(parts.values()), 0.0)
    return {
        "seconds": {k: v / repeats for k, v in parts.items()},
        "step_s": step / repeats,
        "profiler": prof,
        "device": "GPU" if on_gpu else "CPU",
    }


def time_step(model: Transformer, phase: str, tokens: int, batch: int = 1, repeats: int = 5) -> float:
    """Median seconds of one unprofiled step (as :func:`profile_step` runs it), to show the
    profiler's own overhead."""
    tokens, batch, repeats = (positive_int(n, v) for n, v in (("tokens", tokens), ("batch", batch),
                                                               ("repeats", repeats)))
    prompt = model.random_prompt(batch, tokens, seed=0)
    cache = model.new_cache(batch, tokens + 2)
    next_token = model.prefill(prompt, cache).argmax(-1, keepdim=True)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if phase == "prefill":
            model.prefill(prompt, cache)
        else:
            cache.length = tokens + 1
            model.decode_step(next_token, cache)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]
