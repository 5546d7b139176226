"""Checks for the anatomy lab: the parameter count of a decoder, by component."""

from __future__ import annotations

import dataclasses
import numbers
import random
from collections.abc import Mapping

from ..anatomy import COMPONENTS, param_count_by_component
from ..models import ModelConfig, get_model
from .framework import Case, ForbiddenCall, graded

COUNT_RULE = (
    "with d = d_model, D = cfg.head_dim (never d_model // n_heads: Qwen3 gives it explicitly), H = n_heads, "
    "Hkv = n_kv_heads, L = n_layers: embedding = vocab_size*d; attention = L*(d*H*D + 2*d*Hkv*D + H*D*d, "
    "plus H*D + 2*Hkv*D if qkv_bias, plus d if o_bias); feed_forward = L*3*d*d_ff; norms = 2*d per layer + "
    "d for the final norm (+ 2*D per layer if qk_norm); output = vocab_size*d, or 0 if tied_embeddings "
    "(the shared table is counted once, under embedding)."
)


def _cases() -> list[ModelConfig]:
    rng = random.SystemRandom()
    return [
        get_model("tiny-2m"),  # tied
        get_model("llama-3.1-8b"),
        get_model("llama-3.1-70b"),
        get_model("mistral-7b-v0.1"),
        get_model("qwen2-7b"),  # q/k/v biases
        get_model("qwen3-8b"),  # q/k norms, head_dim given (equal to d / H here)
        get_model("qwen3-0.6b"),  # head_dim 128 on d / H = 64, tied, q/k norms
        # plain multi-head attention, untied, a head width wider than d / H, q/k/v biases
        ModelConfig("mha-wide-heads-test", 3, 96, 4, 4, 200, 500, head_dim=32, qkv_bias=True),
        # tied, every attention projection biased, a head width narrower than d / H
        ModelConfig("all-bias-test", 2, 160, 8, 2, 416, 777, tied_embeddings=True, head_dim=16,
                    qkv_bias=True, o_bias=True),
        # an output bias alone (in no family, but the spec counts each flag on its own)
        ModelConfig("o-bias-only-test", 2, 64, 4, 2, 96, 300, o_bias=True),
        # two shapes drawn afresh at every run, so a table of the answers above cannot pass
        *(_random_config(rng, i) for i in range(2)),
    ]


def _random_config(rng: random.Random, index: int) -> ModelConfig:
    """A decoder shape no one has seen: random sizes, a head width that differs from d / H, and
    random flags."""
    kv_heads = rng.randint(1, 4)
    heads = kv_heads * rng.randint(1, 4)
    d_model = heads * rng.randint(4, 40)
    head_dim = 2 * rng.randint(2, 40)
    if head_dim * heads == d_model:
        head_dim += 2
    return ModelConfig(
        f"random-shape-{index}", rng.randint(1, 9), d_model, heads, kv_heads, rng.randint(8, 999),
        rng.randint(256, 99_999), tied_embeddings=rng.random() < 0.5, head_dim=head_dim,
        qkv_bias=rng.random() < 0.5, o_bias=rng.random() < 0.5, qk_norm=rng.random() < 0.5)


def _mistakes(cfg: ModelConfig) -> dict[str, dict]:
    """What each planted mistake returns for ``cfg`` (the course's answer on a changed config, or
    with one component changed)."""
    count = param_count_by_component.__wrapped__
    right = count(cfg)
    d, V = cfg.d_model, cfg.vocab_size
    out = {
        "the key and value projections are sized from the query heads (n_heads) instead of n_kv_heads":
            count(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)),
        "the head width is taken as d_model // n_heads although the config gives head_dim":
            count(dataclasses.replace(cfg, head_dim=None)) if cfg.d_model % cfg.n_heads == 0 else None,
        "the tied output layer is counted again (a tied model stores one table)":
            right | {"output": V * d},
        "the output projection's bias is left out (o_bias is its own flag, whether or not qkv_bias is set)":
            count(dataclasses.replace(cfg, o_bias=False)),
        "the q/k/v (and output) biases are left out":
            count(dataclasses.replace(cfg, qkv_bias=False, o_bias=False)),
        "Qwen3's q/k norms (2 * head_dim per layer) are left out": count(dataclasses.replace(cfg, qk_norm=False)),
        "the final norm (d weights after the last layer) is left out": right | {"norms": right["norms"] - d},
        "the output layer of an untied model is left out": right | {"output": 0},
        "the shared table of a tied model is counted under output instead of embedding":
            right | {"embedding": 0, "output": V * d} if cfg.tied_embeddings else None,
        "the output projection is sized from d_model only (d*d instead of n_heads*head_dim*d)":
            right | {"attention": right["attention"] - cfg.n_layers * (cfg.n_heads * cfg.head_dim - d) * d},
    }
    return {k: v for k, v in out.items() if v is not None and v != right}


class _NoTorch:
    """While the learner's function runs, any torch function (building the model, numel) fails: the
    exercise is the formula. Building the model and summing ``numel()`` is the lab's cross-check."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", str(func))
                raise ForbiddenCall(
                    f"your function called torch (`{name}`). Count from the config's fields with integer "
                    f"arithmetic; building a model and summing numel() is the cross-check of section 2, "
                    f"not the formula."
                )

        self.mode = Mode()

    def __call__(self, fn):
        def run(*args, **kwargs):
            with self.mode:
                return fn(*args, **kwargs)

        run.__name__ = getattr(fn, "__name__", "your function")
        return run


@graded(points=10, bans=(param_count_by_component,))
def check_param_count_by_component(fn, checker):
    """``fn(cfg)`` must return ``{"embedding", "attention", "feed_forward", "norms", "output"}`` ->
    the exact number of parameters in each, for any :class:`ModelConfig`."""
    no_torch = _NoTorch()
    for cfg in _cases():
        case = Case(model=cfg.name, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                    n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size,
                    tied_embeddings=cfg.tied_embeddings, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                    qk_norm=cfg.qk_norm)
        got = checker.call(no_torch(fn), cfg, case=case)
        expected = param_count_by_component.__wrapped__(cfg)
        if not isinstance(got, Mapping):
            checker.fail(case, f"your function returned a {type(got).__name__}, expected a dict with the keys "
                               f"{', '.join(repr(k) for k in COMPONENTS)}.",
                         "return one dict: component name -> number of parameters.")
        keys = set(got)
        if keys != set(COMPONENTS):
            missing = [k for k in COMPONENTS if k not in keys]
            extra = sorted(str(k) for k in keys - set(COMPONENTS))
            checker.fail(case, "the dict's keys are wrong:"
                               + (f" missing {', '.join(repr(k) for k in missing)};" if missing else "")
                               + (f" unexpected {', '.join(repr(k) for k in extra)};" if extra else "")
                               + f" expected exactly {', '.join(repr(k) for k in COMPONENTS)}.",
                         "name the five components as the spec does (a tied output layer is 'output': 0).")
        for key in COMPONENTS:
            value = got[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                checker.fail(case, f"the count for {key!r} is a {type(value).__name__} ({value!r}), expected an int.",
                             "parameters are whole numbers: use integer arithmetic (// not /, no floats).")
        got = {k: int(got[k]) for k in COMPONENTS}
        if got == expected:
            continue
        wrong = [k for k in COMPONENTS if got[k] != expected[k]]
        problem = "wrong count for " + "; ".join(
            f"{k}: {got[k]:,} instead of {expected[k]:,} ({got[k] - expected[k]:+,})" for k in wrong) + "."
        matched = next((why for why, values in _mistakes(cfg).items() if values == got), None)
        if matched:
            problem += f"\nYour counts match what we get when {matched}."
        checker.fail(case, problem, COUNT_RULE)
