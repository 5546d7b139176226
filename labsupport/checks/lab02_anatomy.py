"""Checks for the anatomy lab: the parameter count of a decoder, by component."""

from __future__ import annotations

import copy
import dataclasses
import numbers
import random
from collections.abc import Mapping

from ..anatomy import COMPONENTS, param_count_by_component
from ..checkpoints import hf_names, rename_hf_weights
from ..config_costs import decode_bytes_from_config, params_from_config
from ..costs import decode_step_bytes, param_count
from ..models import (
    HF_ARCHITECTURES,
    HF_CONFIGS,
    ModelConfig,
    from_hf_config,
    get_model,
    hf_config,
    to_hf_config,
)
from .framework import Case, ForbiddenCall, graded

COUNT_RULE = (
    "count what the module trees of section 4 show, from the config's fields: each Linear holds in_features x "
    "out_features weights, plus out_features when it has a bias (qkv_bias: q, k and v; o_bias: the output "
    "projection); the key and value projections are n_kv_heads * head_dim wide, the query projection n_heads * "
    "head_dim (use cfg.head_dim, never d_model // n_heads); each RMSNorm holds its width (two per layer, the "
    "final one, and with qk_norm one of head_dim on queries and one on keys per layer); a tied output layer is "
    "the embedding table itself, counted once under embedding."
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


# --- a real config.json, read: parameters and a decode step's bytes -------------------------------------

CONFIG_RULE = (
    "read the shape from the config.json (num_hidden_layers, hidden_size, num_attention_heads, "
    "num_key_value_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings) and count every weight "
    "the module tree shows: each Linear is in_features x out_features, plus out_features when it has a bias; "
    "each RMSNorm its width. A field the file leaves out takes the default of the family's configuration class "
    "in transformers (transformers.AutoConfig.for_model(model_type)): Mistral has 8 KV heads, Qwen2 and Qwen3 "
    "32, Llama as many as its query heads; Qwen3's head_dim is 128, the others' hidden_size / "
    "num_attention_heads. Which projections have a bias and which norms exist differs by family: read the trees."
)
BYTES_RULE = (
    "a decode step reads every weight it multiplies by once (a tied table is read in full as the output layer), "
    "one row of an untied input embedding table per sequence (a lookup), and the keys and values of every cached "
    "token of every sequence: batch x context_tokens x 2 x layers x KV heads x head_dim, all at dtype_bytes."
)


def _family_config(family: str, rng: random.Random, index: int) -> dict:
    """A config.json no one has seen, of ``family``: random sizes, with fields left out at random so that
    the family's defaults decide them."""
    kv = rng.choice([1, 2, 4, 8])
    heads = kv * rng.randint(1, 4)
    width = heads * rng.choice([16, 24, 32])
    config = {
        "architectures": [HF_ARCHITECTURES[family]], "model_type": family, "hidden_act": "silu",
        "num_hidden_layers": rng.randint(1, 6), "hidden_size": width, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": rng.randint(16, 400), "vocab_size": rng.randint(300, 5000),
        "rope_theta": rng.choice([10000.0, 1e6]),
    }
    if rng.random() < 0.5:
        config["tie_word_embeddings"] = rng.random() < 0.5
    if family in ("llama", "qwen3") and rng.random() < 0.5:
        config["attention_bias"] = rng.random() < 0.5
    if rng.random() < 0.5:
        config["head_dim"] = 2 * rng.randint(4, 40)
    if family == "mistral" and rng.random() < 0.5 and heads % 8 == 0:
        del config["num_key_value_heads"]  # MistralConfig's default: 8
    if family == "qwen3" and "head_dim" not in config and rng.random() < 0.5:
        pass  # Qwen3Config's default head_dim: 128
    config["_case"] = f"random {family} config {index}"
    return config


def config_cases() -> list[tuple[str, dict]]:
    """(label, config.json dict): the real models', then ones whose derived values differ from the explicit
    ones, then fresh random ones."""
    cases = [(f"{name}'s config.json", hf_config(name)) for name in HF_CONFIGS]
    qwen06 = hf_config("qwen3-0.6b")
    no_head_dim = {k: v for k, v in qwen06.items() if k != "head_dim"}
    mistral = {k: v for k, v in hf_config("mistral-7b-v0.1").items() if k not in ("num_key_value_heads",)}
    cases += [
        ("Qwen3-0.6B without its head_dim field (Qwen3Config's default decides)", no_head_dim),
        ("Mistral 7B without num_key_value_heads (MistralConfig's default decides)", mistral),
        ("a Llama with attention_bias true (q, k, v and o biased), tie_word_embeddings left out",
         {**{k: v for k, v in hf_config("llama-3.1-8b").items() if k != "tie_word_embeddings"},
          "attention_bias": True, "num_hidden_layers": 2, "vocab_size": 1000}),
        ("a small Qwen2, tied, a head width wider than hidden_size / heads",
         {**hf_config("qwen2-7b"), "num_hidden_layers": 3, "hidden_size": 112, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 40, "intermediate_size": 300, "vocab_size": 999,
          "tie_word_embeddings": True}),
        ("a Qwen3 with attention_bias true", {**hf_config("qwen3-0.6b"), "num_hidden_layers": 2, "attention_bias": True,
                                              "vocab_size": 2000}),
    ]
    # Every family's grouped-query default (64 query heads: the default differs from the query heads for
    # each family but Llama), then files that leave several fields out at once.
    small = {"hidden_act": "silu", "rope_theta": 1e6, "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 64,
             "num_key_value_heads": 4, "intermediate_size": 700, "vocab_size": 3000, "tie_word_embeddings": False}
    for family, default in (("qwen2", "32"), ("qwen3", "32"), ("mistral", "8"), ("llama", "the query heads' 64")):
        config = {"architectures": [HF_ARCHITECTURES[family]], "model_type": family, **small, "head_dim": 32}
        del config["num_key_value_heads"]
        cases.append((f"a {family} config without num_key_value_heads (its class's default: {default})", config))
    several = {k: v for k, v in small.items() if k not in ("num_key_value_heads", "tie_word_embeddings")}
    cases += [
        ("a Qwen3 config without num_key_value_heads, head_dim, tie_word_embeddings or attention_bias",
         {"architectures": [HF_ARCHITECTURES["qwen3"]], "model_type": "qwen3", **several}),
        ("a Mistral config without num_key_value_heads, head_dim or tie_word_embeddings",
         {"architectures": [HF_ARCHITECTURES["mistral"]], "model_type": "mistral", **several}),
        ("a Qwen2 config without num_key_value_heads or tie_word_embeddings",
         {"architectures": [HF_ARCHITECTURES["qwen2"]], "model_type": "qwen2", **several}),
    ]
    rng = random.Random(random.SystemRandom().randrange(10**9))
    cases += [(c.pop("_case"), c) for c in (_family_config(f, rng, i) for i, f in enumerate(
        rng.sample(list(HF_ARCHITECTURES), 2)))]
    return cases


def _config_mistakes(config: dict) -> dict[str, dict]:
    """What each planted mistake counts for ``config``: the course's count of a config read wrongly."""
    count = param_count_by_component.__wrapped__
    cfg = from_hf_config(config)
    right = count(cfg)
    family = config.get("model_type")
    out = {}
    if "head_dim" in config and config["head_dim"] and cfg.d_model % cfg.n_heads == 0 and \
            cfg.head_dim != cfg.d_model // cfg.n_heads:
        out["the head width is taken as hidden_size / num_attention_heads although the file gives head_dim"] = \
            count(dataclasses.replace(cfg, head_dim=None))
    if "head_dim" not in config and family == "qwen3" and cfg.d_model % cfg.n_heads == 0:
        out["Qwen3's head width is taken as hidden_size / num_attention_heads; Qwen3Config's default head_dim is "
            "128 when the file leaves it out"] = count(dataclasses.replace(cfg, head_dim=None))
    if "num_key_value_heads" not in config and family != "llama":
        out[f"the KV heads are taken as num_attention_heads; {family}'s configuration class defaults "
            f"num_key_value_heads to {cfg.n_kv_heads} when the file leaves it out"] = \
            count(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads))
    out["the key and value projections are sized from the query heads (num_attention_heads) instead of "
        "num_key_value_heads"] = count(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads))
    if "tie_word_embeddings" not in config:
        out["a tie_word_embeddings left out of the file is read as true (these families default to false)"] = \
            right | {"output": 0}
    if family == "qwen2":
        out["Qwen2's q, k and v biases are left out (Qwen2 always has them; its config has no switch for them)"] = \
            count(dataclasses.replace(cfg, qkv_bias=False))
        out["Qwen2 is given an output-projection bias too (its o_proj has none)"] = \
            count(dataclasses.replace(cfg, o_bias=True))
    if cfg.o_bias:
        out["attention_bias puts a bias on the output projection too (o_proj), not only on q, k and v"] = \
            count(dataclasses.replace(cfg, o_bias=False))
    if cfg.qk_norm:
        out["Qwen3's q_norm and k_norm (head_dim weights each, per layer) are left out"] = \
            count(dataclasses.replace(cfg, qk_norm=False))
    if cfg.tied_embeddings:
        out["the tied output layer is counted again (a tied model stores one table)"] = right | {"output": right["embedding"]}
    out["the final norm (hidden_size weights after the last layer) is left out"] = right | {"norms": right["norms"] - cfg.d_model}
    return {k: v for k, v in out.items() if v != right}


@graded(points=6, bans=(params_from_config, param_count_by_component, from_hf_config))
def check_params_from_config(fn, checker):
    """``fn(config)`` (a ``config.json`` dict of a Llama, Mistral, Qwen2 or Qwen3 model) must return its
    parameters by component, with each family's defaults for the fields the file leaves out."""
    no_torch = _NoTorch()
    for label, config in config_cases():
        case = Case(config=label, **{k: config.get(k, "(absent)") for k in (
            "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "tie_word_embeddings", "attention_bias")})
        got = checker.call(no_torch(fn), copy.deepcopy(config), case=case)
        expected = params_from_config.__wrapped__(config)
        if not isinstance(got, Mapping) or set(got) != set(COMPONENTS):
            checker.fail(case, f"your function returned {got!r:.200}; expected a dict with exactly the keys "
                               f"{', '.join(repr(k) for k in COMPONENTS)}.", CONFIG_RULE)
        for key in COMPONENTS:
            if isinstance(got[key], bool) or not isinstance(got[key], numbers.Integral):
                checker.fail(case, f"the count for {key!r} is {got[key]!r}, expected an int.", CONFIG_RULE)
        got = {k: int(got[k]) for k in COMPONENTS}
        if got == expected:
            continue
        wrong = [k for k in COMPONENTS if got[k] != expected[k]]
        problem = "wrong count for " + "; ".join(
            f"{k}: {got[k]:,} instead of {expected[k]:,} ({got[k] - expected[k]:+,})" for k in wrong) + "."
        matched = [why for why, values in _config_mistakes(config).items() if values == got]
        if matched:
            problem += f"\nYour counts match what we get when {'; or when '.join(matched)}."
        checker.fail(case, problem, CONFIG_RULE)


def _bytes_cases(configs) -> list[tuple[str, dict, int, int, int]]:
    """(label, config, batch, context_tokens, dtype_bytes)."""
    out = []
    shapes = ((1, 0, 2), (8, 4096, 2), (3, 1000, 1), (64, 513, 4))
    for i, (label, config) in enumerate(configs):
        batch, context, dtype = shapes[i % len(shapes)]
        out.append((label, config, batch, context, dtype))
    return out


def _bytes_mistakes(config: dict, batch: int, context: int, dtype: int) -> dict[str, float]:
    cfg = from_hf_config(config)
    right = decode_bytes_from_config.__wrapped__(config, batch, context, dtype)
    params = param_count(cfg)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    table = cfg.vocab_size * cfg.d_model
    unread = 0 if cfg.tied_embeddings else max(cfg.vocab_size - batch, 0) * cfg.d_model
    out = {
        "the whole input embedding table is charged: a step looks up one row of it per sequence": right + unread * dtype,
        "the key and value cache is sized from the query heads instead of the KV heads":
            right + batch * context * 2 * cfg.n_layers * (cfg.n_heads - cfg.n_kv_heads) * cfg.head_dim * dtype,
        "the factor 2 for keys AND values is missing from the cache": right - batch * context * kv // 2 * dtype,
        "the cache of one sequence is counted, not of every sequence in the batch":
            right - (batch - 1) * context * kv * dtype,
        "the weights are read once per sequence, not once per step (a batch shares one read of every weight)":
            right + (batch - 1) * (params - unread) * dtype,
        "dtype_bytes is ignored (2 bytes per element assumed)": right / dtype * 2,
        "a tied model's table is charged one row per sequence; it is read in full as the output layer":
            right - table * dtype + min(batch, cfg.vocab_size) * cfg.d_model * dtype if cfg.tied_embeddings else right,
        "the head width is taken as hidden_size / num_attention_heads although the file gives head_dim":
            decode_bytes_from_config.__wrapped__({**config, "head_dim": None}, batch, context, dtype)
            if cfg.d_model % cfg.n_heads == 0 else right,
    }
    return {k: v for k, v in out.items() if v != right}


@graded(points=4, bans=(decode_bytes_from_config, params_from_config, param_count_by_component, from_hf_config,
                        decode_step_bytes))
def check_decode_bytes_from_config(fn, checker):
    """``fn(config, batch, context_tokens, dtype_bytes)`` must return the bytes one decode step reads: the
    weights it multiplies by, the input rows it looks up, and every sequence's keys and values."""
    no_torch = _NoTorch()
    for label, config, batch, context, dtype in _bytes_cases(config_cases()):
        case = Case(config=label, batch=batch, context_tokens=context, dtype_bytes=dtype)
        got = checker.call(no_torch(fn), copy.deepcopy(config), batch, context, dtype, case=case)
        expected = decode_bytes_from_config.__wrapped__(config, batch, context, dtype)
        checker.expect_number(got, float(expected), case=case, rel=1e-12, what="bytes read", hint=BYTES_RULE,
                              mistakes=_bytes_mistakes(config, batch, context, dtype))


# --- transformers' weight names to the course model's (exercise 5) -----------------------------------

HF_NAME_RULE = (
    "rename every tensor of the transformers state dict, tensors unchanged: model.embed_tokens -> tok_embeddings, "
    "model.layers.{i}.input_layernorm -> layers.{i}.attention_norm, self_attn.q_proj/k_proj/v_proj/o_proj -> "
    "attention.wq/wk/wv/wo (weights and biases), self_attn.q_norm/k_norm -> attention.q_norm/k_norm, "
    "post_attention_layernorm -> ffn_norm, mlp.gate_proj/up_proj/down_proj -> feed_forward.w1/w3/w2, model.norm -> "
    "norm, lm_head -> output (left out when the embeddings are tied: the output reuses tok_embeddings)."
)


def _hf_name_cases() -> list[tuple[str, ModelConfig]]:
    """Small models of each shape of state dict the four families produce."""
    return [
        ("Llama, tied embeddings", ModelConfig("tiny-llama-tied", 2, 64, 4, 2, 96, 160, tied_embeddings=True)),
        ("Llama, untied: lm_head is its own tensor", ModelConfig("tiny-llama", 2, 64, 4, 2, 96, 160)),
        ("Qwen2: q/k/v biases", ModelConfig("tiny-qwen2", 2, 64, 4, 2, 96, 160, tied_embeddings=True, qkv_bias=True)),
        ("Qwen3: q/k norms, head width 32 on d_model 64",
         ModelConfig("tiny-qwen3", 3, 64, 4, 2, 96, 160, head_dim=32, qk_norm=True)),
        ("Llama, 12 layers in bfloat16 (names and dtypes only)",
         ModelConfig("tiny-llama-12", 12, 32, 2, 1, 48, 64, tied_embeddings=True)),
    ]


def _tiny_hf_model(cfg: ModelConfig, seed: int):
    """A randomly initialised transformers model of ``cfg`` (its own architecture code), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{**to_hf_config(cfg), "initializer_range": 0.2})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: every one made distinct, so a swap shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    return model


def _which_hf_tensor(value, hf_state) -> str | None:
    """The name of the transformers tensor equal to ``value``, if any."""
    for name, tensor in hf_state.items():
        if tuple(tensor.shape) == tuple(getattr(value, "shape", ())) and bool((tensor == value).all()):
            return name
    return None


@graded(points=6, bans=(rename_hf_weights,))
def check_hf_weight_names(fn, checker):
    """``fn(hf_state, cfg)`` must return the course model's state dict: every tensor renamed, none
    changed, ``lm_head`` left out when tied; loaded into the course's ``Transformer``, it must give
    transformers' logits."""
    import torch

    from ..transformer import Transformer

    for n, (label, cfg) in enumerate(_hf_name_cases()):
        hf = _tiny_hf_model(cfg, seed=n)
        if "bfloat16" in label:  # a checkpoint as real ones ship: a conversion to float32 shows
            hf = hf.to(torch.bfloat16)
        hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        case = Case(model=label, tensors=len(hf_state))
        got = checker.call(fn, dict(hf_state), cfg, case=case)
        if not isinstance(got, Mapping):
            checker.fail(case, f"returned {type(got).__name__}, expected a dict {{course name: tensor}}.", HF_NAME_RULE)
        want = rename_hf_weights.__wrapped__(hf_state, cfg)
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if extra:
            hint = (" lm_head.weight has no place in a tied model: the output layer is tok_embeddings.weight."
                    if "output.weight" in extra and cfg.tied_embeddings else "")
            checker.fail(case, f"your dict has names the course model does not: {extra[:4]}.{hint}", HF_NAME_RULE)
        if missing:
            source = {v: k for k, v in hf_names(cfg).items()}
            checker.fail(case, f"your dict lacks {missing[:4]} (from transformers' "
                               f"{[source[m] for m in missing[:4]]}).", HF_NAME_RULE)
        for key, tensor in want.items():
            value = got[key]
            if isinstance(value, torch.Tensor) and value.dtype != tensor.dtype:
                checker.fail(case, f"{key} is {str(value.dtype).replace('torch.', '')}, transformers' tensor is "
                                   f"{str(tensor.dtype).replace('torch.', '')}: rename the tensors, do not convert "
                                   f"them (the loader chooses the dtype later).", HF_NAME_RULE)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(tensor.shape) \
                    or not bool((value == tensor).all()):
                held = _which_hf_tensor(value, hf_state) if isinstance(value, torch.Tensor) else None
                source = {v: k for k, v in hf_names(cfg).items()}[key]
                what = (f"holds transformers' {held}" if held else
                        f"holds a tensor of shape {tuple(value.shape)} equal to no tensor of the state dict"
                        if isinstance(value, torch.Tensor) else f"holds a {type(value).__name__}")
                checker.fail(case, f"{key} {what}; it should be {source}, unchanged (shape {tuple(tensor.shape)}).",
                             HF_NAME_RULE)
        if "bfloat16" in label:
            continue  # bf16 logits differ by rounding: the float32 cases compare them
        model = Transformer(cfg)
        model.load_state_dict(dict(got), strict=True, assign=True)
        prompt = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            ours = model.forward_no_cache(prompt)[0]
            theirs = hf(prompt).logits[0, -1].float()
        error = float((ours - theirs).abs().max())
        if error > 1e-3:
            checker.fail(case, f"the course model with your weights gives logits {error:.3g} away from transformers' "
                               f"(tolerance 1e-3).", HF_NAME_RULE)
