"""The model families the course reads, and every weight of the course model, in two tables.

Adding a family (CONTRIBUTING.md, "Adding a model family") means adding one :class:`FamilySpec` to
:data:`FAMILIES`; a family with a weight the course model lacks also adds rows to :data:`WEIGHTS`
and the module to :mod:`labsupport.transformer`. Everything else reads these tables:

* :func:`labsupport.models.from_hf_config` and :func:`~labsupport.models.to_hf_config`: the
  ``model_type`` and ``architectures`` spellings, the defaults of a field a ``config.json`` leaves
  out, which biases a family has, q/k norms, the RMSNorm epsilon's default;
* :mod:`labsupport.checkpoints`: the Hugging Face and GGUF name of every weight, and whether
  llama.cpp's converter permuted a family's query and key rows (chapter 08);
* :mod:`labsupport.anatomy`: the component each weight is counted under (chapter 02);
* :mod:`labsupport.tensor_parallel`: how each weight is split over ranks (chapter 11).

``tests/test_families.py`` holds the tables to the code: the course model's parameters are exactly
:func:`weights` of its config (names and shapes), their sizes add up to
:func:`labsupport.costs.param_count`, and transformers names the same tensors for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# --- the families ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilySpec:
    """How one family's ``config.json`` and checkpoints differ from the plain Llama recipe.

    * ``model_type`` / ``architecture``: the ``config.json`` spellings (``"llama"``,
      ``"LlamaForCausalLM"``).
    * ``default_kv_heads`` / ``default_head_dim``: what transformers' configuration class of the
      family takes when the file leaves ``num_key_value_heads`` / ``head_dim`` out (``None``: as
      many KV heads as query heads, and ``hidden_size / num_attention_heads``).
    * ``bias``: which projections have biases. ``"attention_bias"``: the field switches q, k, v
      *and* o together (Llama, Qwen3); ``"qkv"``: q, k and v always, never o, the field unread
      (Qwen2); ``"none"``: never, and the field true is an error (Mistral).
    * ``qk_norm``: an RMSNorm over each query and key head before the rotation (Qwen3).
    * ``default_rms_norm_eps``: the configuration class's ``rms_norm_eps`` default.
    * ``gguf_architecture``: ``general.architecture`` in a GGUF file converted from this family by
      llama.cpp (Mistral is written as ``"llama"``).
    """

    model_type: str
    architecture: str
    default_kv_heads: int | None
    default_head_dim: int | None
    bias: str
    qk_norm: bool
    default_rms_norm_eps: float
    gguf_architecture: str


# Defaults from transformers' configuration classes (LlamaConfig, MistralConfig, Qwen2Config,
# Qwen3Config; read in transformers 5.24, the same since 4.51): MistralConfig.num_key_value_heads = 8,
# Qwen2Config's and Qwen3Config's 32, Qwen3Config.head_dim = 128, rms_norm_eps = 1e-6 in all four
# (the real checkpoints write their own: 1e-5 for Llama 3 and SmolLM2, 1e-6 for Qwen2 and Qwen3).
FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        FamilySpec("llama", "LlamaForCausalLM", None, None, "attention_bias", False, 1e-6, "llama"),
        FamilySpec("mistral", "MistralForCausalLM", 8, None, "none", False, 1e-6, "llama"),
        FamilySpec("qwen2", "Qwen2ForCausalLM", 32, None, "qkv", False, 1e-6, "qwen2"),
        FamilySpec("qwen3", "Qwen3ForCausalLM", 32, 128, "attention_bias", True, 1e-6, "qwen3"),
    )
}

# GGUF architectures the loader reads. llama.cpp's converter permutes the query and key rows of the
# architectures it runs with its interleaved ("normal") RoPE, ``llama`` among them, and leaves them
# in Hugging Face's order for the NeoX-style ones (``qwen2``, ``qwen3``): see
# labsupport.checkpoints.unpermute_qk and chapter 08.
GGUF_PERMUTED_QK = {"llama": True, "qwen2": False, "qwen3": False}


def family(model_type: str) -> FamilySpec:
    """The :class:`FamilySpec` of ``model_type``; ValueError naming the accepted ones otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; accepted: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of_architecture(architecture: str) -> FamilySpec | None:
    """The family whose ``architectures`` entry is ``architecture``, or None."""
    return next((spec for spec in FAMILIES.values() if spec.architecture == architecture), None)


def biases(spec: FamilySpec, attention_bias: bool) -> tuple[bool, bool]:
    """``(qkv_bias, o_bias)`` of a model of family ``spec`` whose config says ``attention_bias``."""
    if spec.bias == "qkv":
        return True, False
    if spec.bias == "none":
        if attention_bias:
            raise ValueError(f"attention_bias is true, but {spec.architecture}'s projections have no bias")
        return False, False
    return attention_bias, attention_bias


def family_for(cfg) -> FamilySpec:
    """The plainest family that has ``cfg``'s features (what :func:`labsupport.models.to_hf_config`
    writes): Qwen3 for q/k norms, Qwen2 for q/k/v biases without an output bias, Llama otherwise."""
    if cfg.qk_norm:
        spec = FAMILIES["qwen3"]
    elif cfg.qkv_bias and not cfg.o_bias:
        spec = FAMILIES["qwen2"]
    else:
        spec = FAMILIES["llama"]
    if biases(spec, cfg.qkv_bias) != (cfg.qkv_bias, cfg.o_bias):
        what = ("an output bias without q/k/v biases" if cfg.o_bias else "q/k/v biases without an output bias")
        raise ValueError(f"{cfg.name}: {what}{' and q/k norms' if cfg.qk_norm else ''} is in none of the families "
                         f"{', '.join(FAMILIES)} (labsupport.families.FAMILIES)")
    return spec


# --- the weights ----------------------------------------------------------------------------

COMPONENTS = ("embedding", "attention", "feed_forward", "norms", "output")  # labsupport.anatomy's
SPLITS = ("column", "row", "replicated", "vocab")  # labsupport.tensor_parallel's


@dataclass(frozen=True)
class Weight:
    """One tensor of the course model. Names of per-layer weights hold ``{i}``, the layer.

    * ``name``: the course model's (Meta's names: ``layers.{i}.attention.wq.weight``);
    * ``hf``: transformers' (``model.layers.{i}.self_attn.q_proj.weight``);
    * ``gguf``: llama.cpp's (``blk.{i}.attn_q.weight``);
    * ``component``: the part of :data:`COMPONENTS` it is counted under (chapter 02);
    * ``split``: how tensor parallelism splits it (chapter 11): ``column`` (rows: output
      features), ``row`` (columns: input features), ``replicated``, ``vocab`` (the output head);
    * ``shape(cfg)``: its shape; ``present(cfg)``: whether a model of ``cfg`` has it.
    """

    name: str
    hf: str
    gguf: str
    component: str
    split: str
    shape: Callable
    present: Callable = lambda cfg: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def tp_key(self) -> str:
        """The key of :func:`labsupport.tensor_parallel.shard_layer`'s dict: the module's name for a
        weight (``wq``, ``attention_norm``), ``b`` and its letter for a bias (``bq``, ``bo``)."""
        module = self.name.split(".")[-2]
        return "b" + module[-1] if self.name.endswith(".bias") else module


WEIGHTS: tuple[Weight, ...] = (
    Weight("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight", "embedding", "replicated",
           lambda c: (c.vocab_size, c.d_model)),
    Weight("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight",
           "norms", "replicated", lambda c: (c.d_model,)),
    Weight("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight",
           "attention", "column", lambda c: (c.q_width, c.d_model)),
    Weight("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias",
           "attention", "column", lambda c: (c.q_width,), lambda c: c.qkv_bias),
    Weight("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight",
           "attention", "column", lambda c: (c.kv_width, c.d_model)),
    Weight("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias",
           "attention", "column", lambda c: (c.kv_width,), lambda c: c.qkv_bias),
    Weight("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight",
           "attention", "column", lambda c: (c.kv_width, c.d_model)),
    Weight("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias",
           "attention", "column", lambda c: (c.kv_width,), lambda c: c.qkv_bias),
    Weight("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight",
           "attention", "row", lambda c: (c.d_model, c.q_width)),
    Weight("layers.{i}.attention.wo.bias", "model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias",
           "attention", "replicated", lambda c: (c.d_model,), lambda c: c.o_bias),
    Weight("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight",
           "blk.{i}.attn_q_norm.weight", "norms", "replicated", lambda c: (c.head_dim,), lambda c: c.qk_norm),
    Weight("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight",
           "blk.{i}.attn_k_norm.weight", "norms", "replicated", lambda c: (c.head_dim,), lambda c: c.qk_norm),
    Weight("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight",
           "norms", "replicated", lambda c: (c.d_model,)),
    Weight("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight",
           "feed_forward", "column", lambda c: (c.d_ff, c.d_model)),
    Weight("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight",
           "feed_forward", "column", lambda c: (c.d_ff, c.d_model)),
    Weight("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight",
           "feed_forward", "row", lambda c: (c.d_model, c.d_ff)),
    Weight("norm.weight", "model.norm.weight", "output_norm.weight", "norms", "replicated", lambda c: (c.d_model,)),
    Weight("output.weight", "lm_head.weight", "output.weight", "output", "vocab",
           lambda c: (c.vocab_size, c.d_model), lambda c: not c.tied_embeddings),
)


def weights(cfg) -> dict[str, tuple[Weight, tuple[int, ...]]]:
    """Every tensor a model of ``cfg`` holds: ``{course name: (its Weight row, shape)}``, per-layer
    rows expanded for each layer, in the course model's order."""
    out: dict[str, tuple[Weight, tuple[int, ...]]] = {}
    layer_rows = [w for w in WEIGHTS if w.per_layer and w.present(cfg)]
    for w in WEIGHTS:
        if w.per_layer:
            continue
        if w.name == "norm.weight":  # the layers come between the embedding and the final norm
            for i in range(cfg.n_layers):
                for row in layer_rows:
                    out[row.name.format(i=i)] = (row, tuple(row.shape(cfg)))
        if w.present(cfg):
            out[w.name] = (w, tuple(w.shape(cfg)))
    return out


def weight_count(cfg) -> int:
    """Parameters of ``cfg`` summed over :func:`weights` (equals :func:`labsupport.costs.param_count`)."""
    return sum(math.prod(shape) for _, shape in weights(cfg).values())


def component_of(name: str) -> str:
    """The component (:data:`COMPONENTS`) of a parameter named as the course model or transformers
    names it (``layers.3.attention.wq.weight``, ``model.layers.3.mlp.up_proj.weight``)."""
    key = _layerless(name)
    for w in WEIGHTS:
        if key in (w.name, w.hf):
            return w.component
    raise ValueError(f"parameter {name!r} is in no row of labsupport.families.WEIGHTS")


def _layerless(name: str) -> str:
    parts = name.split(".")
    return ".".join("{i}" if p.isdigit() else p for p in parts)


def split_keys(split: str, *, biases: bool = True) -> tuple[str, ...]:
    """:attr:`Weight.tp_key` of the per-layer tensors split as ``split`` (``"column"``: ``wq``, ``bq``,
    ``wk``...), in the table's order; ``biases=False`` leaves the biases out."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return tuple(w.tp_key for w in WEIGHTS if w.per_layer and w.split == split
                 and (biases or not w.name.endswith(".bias")))
