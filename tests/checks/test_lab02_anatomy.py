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
