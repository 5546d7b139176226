"""The parameter-count check passes the reference and rejects each planted mistake the issue names
(KV sized from query heads, head width from d_model / n_heads when explicit, tied output counted
twice, biases forgotten), the others it names, and the stub."""

from __future__ import annotations

import pytest
import torch

from labsupport import anatomy
from labsupport._answers import course_checks_its_answers, unguarded
from labsupport.checks import CheckFailed, check_param_count_by_component

reference = unguarded(anatomy.param_count_by_component)


def learner(cfg, *, kv_heads=None, head_dim=None, tied_twice=False, biases=True, o_bias=True, qk_norm=True,
            final_norm=True, floats=False):
    """A learner's version written from the spec, with switches that plant one mistake each."""
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    D = head_dim(cfg) if head_dim else cfg.head_dim
    hkv = kv_heads(cfg) if kv_heads else cfg.n_kv_heads
    q, kv = cfg.n_heads * D, hkv * D
    attention = d * q + 2 * d * kv + q * d
    if cfg.qkv_bias and biases:
        attention += q + 2 * kv
    if cfg.o_bias and biases and o_bias:
        attention += d
    norms = L * 2 * d + (d if final_norm else 0) + (L * 2 * D if cfg.qk_norm and qk_norm else 0)
    out = {
        "embedding": V * d,
        "attention": L * attention,
        "feed_forward": L * 3 * d * cfg.d_ff,
        "norms": norms,
        "output": V * d if (tied_twice or not cfg.tied_embeddings) else 0,
    }
    return {k: float(v) for k, v in out.items()} if floats else out


def test_reference_and_a_spec_version_pass(capsys):
    check_param_count_by_component(reference)
    check_param_count_by_component(learner)
    assert "PASSED check_param_count_by_component: 12 cases, 10/10 points" in capsys.readouterr().out


MUTATIONS = {
    # the four the issue names
    "KV from query heads": (lambda cfg: learner(cfg, kv_heads=lambda c: c.n_heads),
                            "sized from the query heads"),
    "head width from d_model / n_heads": (lambda cfg: learner(cfg, head_dim=lambda c: c.d_model // c.n_heads),
                                          "head width is taken as d_model // n_heads"),
    "tied output counted twice": (lambda cfg: learner(cfg, tied_twice=True), "tied output layer is counted again"),
    "biases forgotten": (lambda cfg: learner(cfg, biases=False), "biases are left out"),
    # and the others the check names
    "output bias forgotten": (lambda cfg: learner(cfg, o_bias=False), "output projection's bias is left out"),
    "q/k norms forgotten": (lambda cfg: learner(cfg, qk_norm=False), "q/k norms"),
    "final norm forgotten": (lambda cfg: learner(cfg, final_norm=False), "final norm"),
    "untied output left out": (lambda cfg: learner(cfg) | {"output": 0}, "output layer of an untied model"),
    "tied table under output": (
        lambda cfg: learner(cfg) | ({"embedding": 0, "output": cfg.vocab_size * cfg.d_model}
                                   if cfg.tied_embeddings else {}),
        "counted under output instead of embedding"),
    "o_proj as d*d": (lambda cfg: learner(cfg) | {"attention": learner(cfg)["attention"]
                                                 - cfg.n_layers * (cfg.n_heads * cfg.head_dim - cfg.d_model)
                                                 * cfg.d_model},
                      "sized from d_model only"),
    # an output bias counted only when the q/k/v biases are there (Llama's switch read as one flag)
    "output bias nested under qkv_bias": (
        lambda cfg: learner(cfg, o_bias=cfg.qkv_bias), "output projection's bias is left out"),
    # shapes of the answer
    "floats": (lambda cfg: learner(cfg, floats=True), "expected an int"),
    "a total, not a dict": (lambda cfg: sum(learner(cfg).values()), "expected a dict"),
    "a key renamed": (lambda cfg: {("ffn" if k == "feed_forward" else k): v for k, v in learner(cfg).items()},
                      "missing 'feed_forward'; unexpected 'ffn'"),
    "tied output omitted from the dict": (
        lambda cfg: {k: v for k, v in learner(cfg).items() if not (k == "output" and v == 0)}, "missing 'output'"),
    # the learner's own work: the formula, not the model
    "counts the model's numel": (
        lambda cfg: anatomy.model_param_counts(cfg), "called torch"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_rejected(name):
    fn, message = MUTATIONS[name]
    with pytest.raises(CheckFailed, match=message):
        check_param_count_by_component(fn)


def test_stub_is_not_done():
    def param_count_by_component(cfg):
        raise NotImplementedError("count the parameters by component")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError") as info:
        check_param_count_by_component(param_count_by_component)
    assert info.value.reason == "not done"


def test_the_course_answer_is_refused_to_a_learner():
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_param_count_by_component(anatomy.param_count_by_component)
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_param_count_by_component(lambda cfg: anatomy.param_count_by_component(cfg))


def test_a_wrong_count_names_the_component_and_the_difference():
    def off_by_one(cfg):
        return learner(cfg) | {"feed_forward": learner(cfg)["feed_forward"] + 1}

    with pytest.raises(CheckFailed, match=r"feed_forward: [\d,]+ instead of [\d,]+ \(\+1\)"):
        check_param_count_by_component(off_by_one)


def test_torch_is_allowed_again_after_the_check():
    with pytest.raises(CheckFailed):
        check_param_count_by_component(MUTATIONS["counts the model's numel"][0])
    assert torch.ones(2).sum().item() == 2


def test_a_table_of_the_fixed_answers_does_not_pass():
    """A learner who copies the expected counts from the failure messages into a table keyed by the
    case's name (or its fields) fails on the shapes drawn afresh at every run."""
    from labsupport.checks.lab02_anatomy import _cases

    table = {cfg.name: reference(cfg) for cfg in _cases() if not cfg.name.startswith("random-")}
    with pytest.raises(CheckFailed, match="random-shape"):
        check_param_count_by_component(lambda cfg: table[cfg.name])


def test_random_shapes_are_valid_and_vary():
    from labsupport.checks.lab02_anatomy import _cases

    drawn = [cfg for _ in range(20) for cfg in _cases() if cfg.name.startswith("random-")]
    assert len(drawn) == 40 and len({(c.d_model, c.head_dim, c.vocab_size) for c in drawn}) > 30
    assert all(c.head_dim * c.n_heads != c.d_model for c in drawn)


# --- check_params_from_config and check_decode_bytes_from_config (issue 22) -------------------------------------

KV_DEFAULT = {"mistral": 8, "qwen2": 32, "qwen3": 32}


def learner_from_config(config, *, derived_head_dim=False, qwen3_default=True, kv_default=True, tied_default=False,
                        qwen2_bias=True, qwen2_o_bias=False, llama_o_bias=True, qk_norms=True, tied_twice=False,
                        kv_from_heads=False, final_norm=True, kv_defaults=KV_DEFAULT):
    """A learner's reading of a config.json, written from the lab's spec and module trees; each switch plants
    one mistake."""
    family = config["model_type"]
    d, L, H, V = (config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    if "num_key_value_heads" in config and config["num_key_value_heads"] is not None:
        hkv = config["num_key_value_heads"]
    else:
        hkv = kv_defaults.get(family, H) if kv_default else H
    if kv_from_heads:
        hkv = H
    if config.get("head_dim") and not derived_head_dim:
        D = config["head_dim"]
    elif family == "qwen3" and qwen3_default and not derived_head_dim:
        D = 128
    else:
        D = d // H
    tied = config.get("tie_word_embeddings", tied_default)
    if family == "qwen2":
        qkv_bias, o_bias = qwen2_bias, qwen2_o_bias
    elif family == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = config.get("attention_bias", False)
        o_bias = qkv_bias and llama_o_bias
    attention = 2 * d * H * D + 2 * d * hkv * D + (H * D + 2 * hkv * D if qkv_bias else 0) + (d if o_bias else 0)
    norms = L * 2 * d + (d if final_norm else 0) + (L * 2 * D if family == "qwen3" and qk_norms else 0)
    return {"embedding": V * d, "attention": L * attention, "feed_forward": L * 3 * d * config["intermediate_size"],
            "norms": norms, "output": V * d if (tied_twice or not tied) else 0}


def learner_bytes(config, batch, context, dtype, *, whole_table=False, query_heads=False, no_factor_2=False,
                  one_cache=False, weights_per_sequence=False, fixed_dtype=False, tied_rows=False):
    parts = learner_from_config(config)
    family = config["model_type"]
    H, d = config["num_attention_heads"], config["hidden_size"]
    hkv = config.get("num_key_value_heads") or KV_DEFAULT.get(family, H)
    D = config.get("head_dim") or (128 if family == "qwen3" else d // H)
    tied = config.get("tie_word_embeddings", False)
    V = config["vocab_size"]
    rows = min(batch, V) * d
    weights = sum(parts.values())
    if not tied and not whole_table:
        weights -= parts["embedding"] - rows
    if tied and tied_rows:
        weights -= parts["embedding"] - rows
    if weights_per_sequence:
        weights *= batch
    kv = (1 if no_factor_2 else 2) * config["num_hidden_layers"] * (H if query_heads else hkv) * D
    cache = (1 if one_cache else batch) * context * kv
    size = 2 if fixed_dtype else dtype
    return (weights + cache) * size


def test_config_references_pass(capsys):
    from labsupport.checks import check_decode_bytes_from_config, check_params_from_config
    from labsupport.checks.framework import Checker
    from labsupport.config_costs import decode_bytes_from_config, params_from_config

    check_params_from_config(learner_from_config)
    check_decode_bytes_from_config(learner_bytes)
    out = capsys.readouterr().out
    assert "PASSED check_params_from_config" in out and "PASSED check_decode_bytes_from_config" in out
    # the course's answers are built on what the checks ban: run through the bodies unbanned
    check_params_from_config.__wrapped__(unguarded(params_from_config), Checker("check_params_from_config"))
    check_decode_bytes_from_config.__wrapped__(unguarded(decode_bytes_from_config),
                                               Checker("check_decode_bytes_from_config"))


def test_transformers_own_defaults_are_a_right_way_to_read_the_file(capsys):
    """A learner may let transformers' configuration class fill in the defaults, as vLLM does."""
    import transformers

    from labsupport.checks import check_params_from_config

    def through_autoconfig(config):
        c = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
        filled = {**config, "num_key_value_heads": c.num_key_value_heads,
                  "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                  "tie_word_embeddings": c.tie_word_embeddings}
        return learner_from_config(filled)

    check_params_from_config(through_autoconfig)
    assert "PASSED check_params_from_config" in capsys.readouterr().out


CONFIG_MUTANTS = {
    "head_dim derived though given": (dict(derived_head_dim=True), "although the file gives head_dim"),
    "Qwen3's default head_dim": (dict(qwen3_default=False), "Qwen3Config's default head_dim is 128"),
    "KV heads default": (dict(kv_default=False), "defaults num_key_value_heads to"),
    "tied by default": (dict(tied_default=True), "read as true"),
    "Qwen2 without biases": (dict(qwen2_bias=False), "Qwen2's q, k and v biases are left out"),
    "Qwen2 with an o bias": (dict(qwen2_o_bias=True), "output-projection bias too"),
    "attention_bias without o_proj": (dict(llama_o_bias=False), "on the output projection too"),
    "no q/k norms": (dict(qk_norms=False), "q_norm and k_norm"),
    "tied counted twice": (dict(tied_twice=True), "counted again"),
    "KV from query heads": (dict(kv_from_heads=True), "sized from the query heads"),
    "no final norm": (dict(final_norm=False), "final norm"),
}


def _one_default_at_a_time(config):
    """Fills in the family's default for the first field the file leaves out only (an if/elif), the plain
    reading (the query heads; hidden_size / num_attention_heads) for any other."""
    missing = [f for f in ("num_key_value_heads", "head_dim") if f not in config]
    plain = {"num_key_value_heads": config["num_attention_heads"],
             "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    return learner_from_config({**config, **{f: plain[f] for f in missing[1:]}})


CONFIG_FUNCTION_MUTANTS = {
    "only Mistral's KV default": (lambda c: learner_from_config(c, kv_defaults={"mistral": 8}),
                                  "qwen2's configuration class defaults num_key_value_heads to 32"),
    "one default at a time": (_one_default_at_a_time, "Qwen3Config's default head_dim is 128"),
}


@pytest.mark.parametrize("name", list(CONFIG_FUNCTION_MUTANTS))
def test_config_function_mutants_fail(name):
    from labsupport.checks import check_params_from_config

    fn, message = CONFIG_FUNCTION_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_params_from_config(fn)


def test_a_table_of_defaults_merged_under_the_file_passes(capsys):
    """Another correct reading: one dict of each family's defaults, the file's fields laid over it."""
    from labsupport.checks import check_params_from_config

    defaults = {"llama": {}, "mistral": {"num_key_value_heads": 8}, "qwen2": {"num_key_value_heads": 32},
                "qwen3": {"num_key_value_heads": 32, "head_dim": 128}}

    def merged(config):
        filled = {"tie_word_embeddings": False, **defaults[config["model_type"]],
                  **{k: v for k, v in config.items() if v is not None}}
        filled.setdefault("num_key_value_heads", filled["num_attention_heads"])
        filled.setdefault("head_dim", filled["hidden_size"] // filled["num_attention_heads"])
        return learner_from_config(filled)

    check_params_from_config(merged)
    assert "PASSED check_params_from_config" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(CONFIG_MUTANTS))
def test_config_mutants_fail(name):
    from labsupport.checks import check_params_from_config

    flags, message = CONFIG_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_params_from_config(lambda c: learner_from_config(c, **flags))


BYTES_MUTANTS = {
    "the whole input table": (dict(whole_table=True), "whole input embedding table is charged"),
    "cache from query heads": (dict(query_heads=True), "sized from the query heads"),
    "no factor 2": (dict(no_factor_2=True), "factor 2 for keys AND values"),
    "one sequence's cache": (dict(one_cache=True), "cache of one sequence"),
    "weights per sequence": (dict(weights_per_sequence=True), "once per sequence"),
    "dtype ignored": (dict(fixed_dtype=True), "dtype_bytes is ignored"),
    "a tied table looked up only": (dict(tied_rows=True), "read in full as the output layer"),
}


@pytest.mark.parametrize("name", list(BYTES_MUTANTS))
def test_bytes_mutants_fail(name):
    from labsupport.checks import check_decode_bytes_from_config

    flags, message = BYTES_MUTANTS[name]
    with pytest.raises(CheckFailed, match=message):
        check_decode_bytes_from_config(lambda c, b, n, t: learner_bytes(c, b, n, t, **flags))


def test_config_checks_refuse_the_stub_the_course_reader_and_a_built_model():
    from labsupport.checks import check_decode_bytes_from_config, check_params_from_config
    from labsupport.models import from_hf_config

    def stub(config):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_params_from_config(stub)
    with pytest.raises(CheckFailed, match="NotImplementedError"):
        check_decode_bytes_from_config(lambda c, b, n, t: stub(c))
    with course_checks_its_answers(False):
        with pytest.raises(CheckFailed, match="course's own answer"):
            check_params_from_config(lambda c: learner(from_hf_config(c)))
    with pytest.raises(CheckFailed, match="called torch"):
        check_params_from_config(lambda c: anatomy.hf_param_counts(c))


def test_the_random_configs_differ_between_runs_and_are_valid():
    from labsupport.checks.lab02_anatomy import config_cases
    from labsupport.models import from_hf_config

    drawn = [config for _ in range(10) for label, config in config_cases() if label.startswith("random")]
    assert len({str(sorted(c.items())) for c in drawn}) == len(drawn) == 20
    assert all(from_hf_config(c) for c in drawn)


# --- check_hf_weight_names ------------------------------------------------------------------------------

_HF_PARTS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "self_attn.q_norm": "attention.q_norm",
             "self_attn.k_norm": "attention.k_norm", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
             "mlp.down_proj": "feed_forward.w2"}
_HF_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}


def learner_rename(hf_state, cfg, keep_tied_head=False):
    out = {}
    for name, tensor in hf_state.items():
        if name in _HF_TOP:
            if keep_tied_head or not (name == "lm_head.weight" and cfg.tied_embeddings):
                out[_HF_TOP[name]] = tensor
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        out[f"layers.{layer}.{_HF_PARTS[module]}.{kind}"] = tensor
    return out


def _swapped(a, b):
    def rename(hf_state, cfg):
        out = learner_rename(hf_state, cfg)
        for key in [k for k in out if k.endswith(f"{a}.weight")]:
            other = key.replace(a, b)
            out[key], out[other] = out[other], out[key]
        return out
    return rename


def _layers_shifted(hf_state, cfg):
    out = {}
    for key, tensor in learner_rename(hf_state, cfg).items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            key = f"layers.{(int(i) + 1) % cfg.n_layers}.{rest}"
        out[key] = tensor
    return out


def _one_digit_layers(hf_state, cfg):  # a pattern that reads one digit: layers 10 and up are lost
    import re

    return {k: v for k, v in learner_rename(hf_state, cfg).items()
            if not k.startswith("layers.") or re.fullmatch(r"layers\.\d\..*", k)}


HF_NAME_MUTANTS = {
    "layers_10_and_up_lost": (_one_digit_layers, "your dict lacks ['layers.10."),
    "converted_to_float32": (lambda s, c: {k: v.float() for k, v in learner_rename(s, c).items()},
                             "is float32, transformers' tensor is bfloat16"),
    "gate_and_up_swapped": (_swapped("w1", "w3"), "holds transformers' model.layers.0.mlp.up_proj.weight"),
    "the_two_norms_swapped": (_swapped("attention_norm", "ffn_norm"), "post_attention_layernorm.weight"),
    "q_and_k_norms_swapped": (_swapped("q_norm", "k_norm"), "holds transformers' model.layers.0.self_attn.k_norm"),
    "a_tied_head_kept": (lambda s, c: learner_rename(s, c, keep_tied_head=True), "has no place in a tied model"),
    "an_untied_head_dropped": (lambda s, c: {k: v for k, v in learner_rename(s, c).items() if k != "output.weight"},
                               "lacks ['output.weight']"),
    "biases_dropped": (lambda s, c: {k: v for k, v in learner_rename(s, c).items() if not k.endswith(".bias")},
                       "lacks ['layers.0.attention.wk.bias'"),
    "weights_transposed": (lambda s, c: {k: v.T if v.ndim == 2 else v for k, v in learner_rename(s, c).items()},
                           "equal to no tensor of the state dict"),
    "layers_off_by_one": (_layers_shifted, "holds transformers' model.layers.1."),
    "converted_to_float64": (lambda s, c: {k: v.double() for k, v in learner_rename(s, c).items()},
                             "rename the tensors, do not convert them"),
}


def test_hf_weight_names_reference_passes(capsys):
    from labsupport.checks import check_hf_weight_names

    check_hf_weight_names(learner_rename)
    assert "PASSED check_hf_weight_names" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(HF_NAME_MUTANTS))
def test_hf_weight_names_mistakes_are_named(name):
    from labsupport.checks import check_hf_weight_names

    fn, message = HF_NAME_MUTANTS[name]
    with pytest.raises(CheckFailed) as info:
        check_hf_weight_names(fn)
    assert message in str(info.value)


def test_hf_weight_names_refuses_the_course_answer_and_the_stub():
    from labsupport.checkpoints import rename_hf_weights
    from labsupport.checks import check_hf_weight_names

    with pytest.raises(CheckFailed, match="the course's own answer"):
        check_hf_weight_names(lambda s, c: rename_hf_weights(s, c))

    def stub(hf_state, cfg):
        raise NotImplementedError("exercise")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_hf_weight_names(stub)


def test_the_loaders_renaming_is_the_table():
    """checkpoints.hf_state_dict and the exercise's answer read one table: every row's names."""
    from labsupport.checkpoints import hf_names
    from labsupport.models import ModelConfig

    cfg = ModelConfig("t", 2, 64, 4, 2, 96, 160, qkv_bias=True)
    names = hf_names(cfg)
    assert names["model.layers.1.mlp.gate_proj.weight"] == "layers.1.feed_forward.w1.weight"
    assert names["lm_head.weight"] == "output.weight" and names["model.layers.0.self_attn.q_proj.bias"].endswith("wq.bias")
