"""labsupport.families: the tables agree with the course model, the counts and transformers."""

from __future__ import annotations

import pytest
import torch

from labsupport import families, tensor_parallel
from labsupport.costs import param_count
from labsupport.models import MODELS, ModelConfig, from_hf_config, to_hf_config
from labsupport.transformer import Transformer

FEATURES = [
    ModelConfig("plain", 2, 64, 4, 2, 96, 128),
    ModelConfig("biased-tied", 2, 64, 4, 2, 96, 128, tied_embeddings=True, qkv_bias=True, o_bias=True),
    ModelConfig("qwen2-like", 2, 64, 4, 2, 96, 128, qkv_bias=True),
    ModelConfig("qwen3-like", 3, 64, 4, 1, 96, 128, head_dim=32, qk_norm=True),
]


@pytest.mark.parametrize("cfg", FEATURES + [MODELS["qwen3-0.6b"], MODELS["llama-3.1-8b"]], ids=lambda c: c.name)
def test_the_course_model_holds_exactly_the_table_s_weights(cfg):
    model = Transformer(cfg, device="meta")
    got = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert got == {name: shape for name, (_, shape) in families.weights(cfg).items()}
    assert list(got) == list(families.weights(cfg))  # the same order, so state dicts read in order


def test_the_table_counts_what_costs_counts():
    for cfg in [*MODELS.values(), *FEATURES]:
        assert families.weight_count(cfg) == param_count(cfg), cfg.name


@pytest.mark.parametrize("family", list(families.FAMILIES))
def test_transformers_names_the_same_tensors(family):
    import transformers  # a course dependency (requirements.txt); imported here like labsupport.anatomy does

    cfg = {"llama": FEATURES[1], "mistral": FEATURES[0], "qwen2": FEATURES[2], "qwen3": FEATURES[3]}[family]
    hf_cfg = {**to_hf_config(cfg), "model_type": family, "architectures": [families.FAMILIES[family].architecture]}
    if family == "mistral":
        hf_cfg.pop("attention_bias", None)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg))
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ours = {row.hf.format(i=name.split(".")[1]) if row.per_layer else row.hf: shape
            for name, (row, shape) in families.weights(from_hf_config(hf_cfg)).items()}
    assert theirs == ours


def test_every_family_reads_back_through_from_hf_config():
    for spec in families.FAMILIES.values():
        cfg = from_hf_config({"model_type": spec.model_type, "num_hidden_layers": 2, "hidden_size": 128,
                              "num_attention_heads": 64, "intermediate_size": 96, "vocab_size": 128,
                              "rope_theta": 1e4})
        assert cfg.n_kv_heads == (spec.default_kv_heads or 64) and cfg.qk_norm == spec.qk_norm
        assert cfg.rms_norm_eps == spec.default_rms_norm_eps
        assert cfg.head_dim == (spec.default_head_dim or 2)


def test_tensor_parallel_splits_come_from_the_table():
    assert tensor_parallel.COLUMN_PARALLEL == ("wq", "wk", "wv", "w1", "w3")
    assert tensor_parallel.ROW_PARALLEL == ("wo", "w2")
    assert set(tensor_parallel.REPLICATED) == {"attention_norm", "ffn_norm", "q_norm", "k_norm", "bo"}
    cfg = FEATURES[1]
    shards = tensor_parallel.shard_layer.__wrapped__(Transformer(cfg).layers[0], 0, 2)
    split = {*tensor_parallel.COLUMN_PARALLEL, *tensor_parallel.ROW_PARALLEL, *tensor_parallel.REPLICATED,
             *families.split_keys("column")}
    assert set(shards) <= split and {"bq", "bk", "bv", "bo"} <= set(shards)


def test_unknown_names_and_splits_are_errors():
    with pytest.raises(ValueError, match="in no row"):
        families.component_of("model.layers.0.mlp.experts.3.w1.weight")
    with pytest.raises(ValueError, match="split must be one of"):
        families.split_keys("diagonal")
    with pytest.raises(ValueError, match="not supported"):
        families.family("gpt2")


def test_the_course_presets_keep_the_epsilon_they_always_had_and_the_model_reads_the_config_s():
    from labsupport.transformer import RMSNorm

    assert all(MODELS[name].rms_norm_eps == 1e-5 for name in ("tiny-2m", "tiny-20m", "small-63m", "llama-3.1-8b"))
    assert MODELS["qwen3-8b"].rms_norm_eps == 1e-6
    model = Transformer(ModelConfig(**{**{f: getattr(FEATURES[3], f) for f in (
        "name", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "head_dim", "qk_norm")},
        "rms_norm_eps": 3e-6}), device="meta")
    assert {m.eps for m in model.modules() if isinstance(m, RMSNorm)} == {3e-6}
    with pytest.raises(ValueError, match="rms_norm_eps must be a number between 0 and 1"):
        ModelConfig("bad", 2, 64, 4, 2, 96, 128, rms_norm_eps=0.0)
