"""Model shapes the course computes with.

A :class:`ModelConfig` holds only the numbers that set cost: layers, widths, heads and
vocabulary, and the details in which real models differ (an explicit head width, biases on the
attention projections, q/k norms, the rotary base and scaling). The real shapes come from the
models' published ``config.json`` files on the Hugging Face Hub (meta-llama/Llama-3.1-8B, -70B,
-405B; mistralai/Mistral-7B-v0.1; Qwen/Qwen2-7B; Qwen/Qwen3-8B and Qwen3-0.6B): the ones stored
in :data:`HF_CONFIGS` are read by :func:`from_hf_config`, which reads any Llama, Mistral, Qwen2 or
Qwen3 ``config.json``. For the 70B and 405B only the shape is carried (their ``rope_scaling`` is
not stored here). The ``tiny-*`` presets are
small enough to run on a laptop CPU in seconds and keep the proportions that matter
(grouped-query attention, a SwiGLU feed-forward several times wider than the model).

``d_ff`` is the SwiGLU hidden width. The original recipe (Shazeer, "GLU Variants Improve
Transformer", 2020) takes 8/3 of ``d_model``, so that three matrices cost what a plain
feed-forward's two at 4x do; Llama 3.1 scales that up and rounds it (``ffn_dim_multiplier`` and
``multiple_of`` in Meta's code): 3.5x for the 8B and 70B, 3.25x for the 405B. The CPU presets use
3.5x (``tiny-2m``, ``small-63m``) and 8/3 (``tiny-20m``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

from . import families

# Llama 3's rotary base (Grattafiori et al., 2024): the default for ModelConfig.rope_theta, so the
# course presets rotate as Llama 3 does.
LLAMA3_ROPE_THETA = 500_000.0
# Llama 3's RMSNorm epsilon (its config.json's rms_norm_eps): the default for ModelConfig.rms_norm_eps,
# the value the course model always used.
DEFAULT_RMS_NORM_EPS = 1e-5


def _frozen(value):
    """``value`` made hashable: dicts become sorted tuples of items, lists tuples (recursively)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value):
    """The inverse of :func:`_frozen` for one level of items: nested item tuples become dicts."""
    if isinstance(value, tuple) and value and all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in value
    ):
        return {k: _thawed(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The cost-relevant shape of a Llama-style decoder.

    The first nine fields are positional, as they always were. The others describe how real models
    differ from the plain Llama recipe (chapter 02 explains each):

    * ``head_dim``: the width of one attention head. ``None`` (the default) means
      ``d_model // n_heads``, and then ``d_model`` must be divisible by ``n_heads``; Qwen3 and Gemma
      give it explicitly, and ``n_heads * head_dim`` need not equal ``d_model`` (Qwen3-0.6B: 16
      heads of 128 on a width of 1024). After construction ``head_dim`` is always an int. Note that
      ``dataclasses.replace(cfg, d_model=...)`` carries the old head width over: pass
      ``head_dim=None`` as well to recompute it.
    * ``qkv_bias``: the query, key and value projections have biases (Qwen2).
    * ``o_bias``: the attention's output projection has a bias too (Llama's ``attention_bias``
      switches q, k, v and o together).
    * ``qk_norm``: an RMSNorm of width ``head_dim`` on every query and key head before the rotation
      (Qwen3): two weight vectors of ``head_dim`` per layer.
    * ``rope_theta``: the rotary base (Llama 3: 500,000; Mistral 7B v0.1: 10,000; Qwen2/3:
      1,000,000).
    * ``rope_scaling``: Hugging Face's ``rope_scaling`` dict (Llama 3.1's ``"llama3"`` frequency
      scaling) or ``None``. Pass a dict; it is stored frozen (sorted items) so the config stays
      hashable, and ``cfg.rope_scaling`` gives a fresh dict back.
    * ``rms_norm_eps``: the epsilon inside every RMSNorm, ``x / sqrt(mean(x**2) + eps)`` (Llama 3
      and SmolLM2: 1e-5, the default; Qwen2 and Qwen3: 1e-6). It changes no shape or cost, but a
      trained model's logits move with it (a tiny Llama with 1e-6 computed with 1e-5 is off by
      about 4e-3).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    tied_embeddings: bool = False
    source: str = ""
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = LLAMA3_ROPE_THETA
    rope_scaling_items: tuple | None = None
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS

    def __init__(
        self,
        name: str,
        n_layers: int,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        d_ff: int,
        vocab_size: int,
        tied_embeddings: bool = False,
        source: str = "",
        head_dim: int | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rope_theta: float = LLAMA3_ROPE_THETA,
        rope_scaling: Mapping | None = None,
        rope_scaling_items: tuple | None = None,
        rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    ) -> None:
        if rope_scaling is not None and rope_scaling_items is not None:
            raise ValueError("ModelConfig: give rope_scaling (a dict) or rope_scaling_items, not both")
        if rope_scaling is not None:
            if not isinstance(rope_scaling, Mapping):
                raise ValueError(
                    f"ModelConfig.rope_scaling must be a dict (Hugging Face's rope_scaling) or None, "
                    f"got {type(rope_scaling).__name__}"
                )
            rope_scaling_items = _frozen(rope_scaling) if rope_scaling else None
        values = dict(
            name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
            d_ff=d_ff, vocab_size=vocab_size, tied_embeddings=tied_embeddings, source=source,
            head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, rope_theta=rope_theta,
            rope_scaling_items=rope_scaling_items, rms_norm_eps=rms_norm_eps,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                    f"when head_dim is not given; give head_dim explicitly for a head width that is not "
                    f"d_model / n_heads"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        value = self.head_dim
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"ModelConfig.head_dim must be a positive int or None, got {value!r}")
        if value % 2:
            raise ValueError(
                f"ModelConfig.head_dim ({value}) must be even: rotary embeddings rotate pairs of elements"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        for field in ("tied_embeddings", "qkv_bias", "o_bias", "qk_norm"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"ModelConfig.{field} must be True or False, got {getattr(self, field)!r}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ValueError(f"ModelConfig.rope_theta must be a number above 1, got {theta!r}")
        object.__setattr__(self, "rope_theta", float(theta))
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or not 0 < eps < 1:
            raise ValueError(f"ModelConfig.rms_norm_eps must be a number between 0 and 1 (1e-5, 1e-6), got {eps!r}")
        object.__setattr__(self, "rms_norm_eps", float(eps))
        items = self.rope_scaling_items
        if isinstance(items, Mapping):
            object.__setattr__(self, "rope_scaling_items", _frozen(items))
        elif items is not None and not isinstance(items, tuple):
            raise ValueError(f"ModelConfig.rope_scaling_items must be a tuple of items or None, got {items!r}")

    @property
    def rope_scaling(self) -> dict | None:
        """Hugging Face's ``rope_scaling`` dict (a fresh copy), or ``None`` for plain RoPE."""
        return None if self.rope_scaling_items is None else _thawed(self.rope_scaling_items)

    @property
    def q_width(self) -> int:
        """Width of all query heads together, ``n_heads * head_dim`` (``d_model`` in Llama)."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key (or value) heads together, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (1 means plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads


_LLAMA_SOURCE = "config.json of meta-llama/{} on the Hugging Face Hub"

MODELS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        ModelConfig(
            "llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, source=_LLAMA_SOURCE.format("Llama-3.1-70B")
        ),
        ModelConfig(
            "llama-3.1-405b",
            126,
            16384,
            128,
            8,
            53248,
            128256,
            source=_LLAMA_SOURCE.format("Llama-3.1-405B"),
        ),
        # Small shapes for CPU labs. Not real models: random weights, chosen so effects show up
        # within the sequence lengths a laptop can run in seconds.
        ModelConfig("tiny-2m", 2, 128, 4, 2, 448, 1024, tied_embeddings=True, source="course preset"),
        ModelConfig("tiny-20m", 4, 384, 6, 2, 1024, 4096, tied_embeddings=True, source="course preset"),
    )
}


# --- Hugging Face config.json -------------------------------------------------------------------

# The families :func:`from_hf_config` reads, by ``model_type``, with the ``architectures`` entry each
# one writes, and the defaults of transformers' configuration classes for a field the file leaves
# out: views of the one table, labsupport.families.FAMILIES, kept under their old names.
HF_ARCHITECTURES = {name: spec.architecture for name, spec in families.FAMILIES.items()}
HF_DEFAULT_KV_HEADS = {name: spec.default_kv_heads for name, spec in families.FAMILIES.items()
                       if spec.default_kv_heads is not None}
HF_DEFAULT_HEAD_DIM = {name: spec.default_head_dim for name, spec in families.FAMILIES.items()
                       if spec.default_head_dim is not None}
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _hf_int(config: Mapping, field: str, what: str) -> int:
    value = config[field]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"from_hf_config: {field} must be a positive int{what}, got {value!r}")
    return value


def _hf_bool(config: Mapping, field: str, default: bool) -> bool:
    value = config.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"from_hf_config: {field} must be true or false, got {value!r}")
    return value


def _hf_family(config: Mapping) -> str:
    """The config's family: ``model_type``, or the family of an ``architectures`` entry."""
    family = config.get("model_type")
    if family is None:
        architectures = config.get("architectures") or []
        found = [families.family_of_architecture(a) for a in architectures]
        family = next((spec.model_type for spec in found if spec is not None), None)
        if family is None:
            raise ValueError(
                f"from_hf_config: the config has no model_type (and its architectures {architectures!r} "
                f"are not among {', '.join(HF_ARCHITECTURES.values())}); add model_type, one of "
                f"{', '.join(HF_ARCHITECTURES)}"
            )
    if family not in families.FAMILIES:
        raise ValueError(
            f"from_hf_config: model_type {family!r} is not supported; accepted: {', '.join(families.FAMILIES)}"
        )
    return family


def _hf_rope(config: Mapping, family: str) -> tuple[float, Mapping | None]:
    """``rope_theta`` and ``rope_scaling`` (None for plain RoPE), from either spelling."""
    theta, scaling = config.get("rope_theta"), config.get("rope_scaling")
    parameters = config.get("rope_parameters")
    if parameters is not None:  # transformers 5 writes theta and the scaling in one dict
        if not isinstance(parameters, Mapping):
            raise ValueError(f"from_hf_config: rope_parameters must be a dict, got {parameters!r}")
        parameters = dict(parameters)
        theta = parameters.pop("rope_theta", theta)
        if parameters.get("rope_type", "default") != "default" and scaling is None:
            scaling = parameters
    if theta is None:
        raise ValueError(f"from_hf_config: the {family} config has no rope_theta (nor rope_parameters), which is required")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise ValueError(f"from_hf_config: rope_theta must be a number above 1, got {theta!r}")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"from_hf_config: rope_scaling must be a dict or null, got {scaling!r}")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def from_hf_config(config: Mapping, name: str | None = None, source: str = "") -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (parsed into a dict).

    Reads the Llama, Mistral, Qwen2 and Qwen3 spellings: ``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
    ``tie_word_embeddings`` (absent: false, as all four families default), ``head_dim``,
    ``rms_norm_eps`` (absent: the family's default, 1e-6), ``rope_theta`` and ``rope_scaling`` (or transformers 5's ``rope_parameters``, which holds
    both), and the biases: ``attention_bias`` in Llama and Qwen3 puts a bias on the q, k, v *and*
    output projections; Qwen2 always has q/k/v biases and no output bias; Mistral has none. Qwen3
    adds a per-head RMSNorm on queries and keys (``qk_norm``). ``sliding_window`` (Mistral 7B
    v0.1, some Qwen2) changes neither the parameters nor the per-token cache, and is not carried.

    A field the file leaves out takes the default of the family's configuration class in
    ``transformers``, which is what transformers and vLLM build: ``num_key_value_heads`` is then as
    many as the query heads for Llama but 8 for Mistral and 32 for Qwen2 and Qwen3, and ``head_dim``
    is ``hidden_size / num_attention_heads`` except for Qwen3 (128). An explicit null means as many
    as the query heads and ``hidden_size / num_attention_heads``.

    The family is ``model_type`` (or, when that is absent, the ``architectures`` entry), looked up
    in :data:`labsupport.families.FAMILIES`, which holds every per-family rule above. An unknown
    family, a missing or malformed field, ``mlp_bias`` true or an activation other than ``silu``
    (neither is a SwiGLU decoder this course models) is a ``ValueError`` naming the field.
    """
    if not isinstance(config, Mapping):
        raise ValueError(
            f"from_hf_config takes the config.json as a dict (json.load(open('config.json'))), "
            f"got {type(config).__name__}"
        )
    family = _hf_family(config)
    spec = families.FAMILIES[family]
    for field in _HF_REQUIRED:
        if config.get(field) is None:
            raise ValueError(f"from_hf_config: the {family} config has no {field}, which is required")
    n_layers = _hf_int(config, "num_hidden_layers", "")
    d_model = _hf_int(config, "hidden_size", "")
    n_heads = _hf_int(config, "num_attention_heads", "")
    d_ff = _hf_int(config, "intermediate_size", "")
    vocab = _hf_int(config, "vocab_size", "")
    # An absent field takes the default of the family's configuration class in transformers (what
    # transformers and vLLM build from the file); an explicit null means "as many as the query heads"
    # and "hidden_size / num_attention_heads".
    if "num_key_value_heads" not in config:
        n_kv = spec.default_kv_heads or n_heads
    elif config["num_key_value_heads"] is None:
        n_kv = n_heads
    else:
        n_kv = _hf_int(config, "num_key_value_heads", "")
    if "head_dim" not in config:
        head_dim = spec.default_head_dim
    else:
        head_dim = None if config["head_dim"] is None else _hf_int(config, "head_dim", " or null")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"from_hf_config: hidden_act is {act!r}; only 'silu' (a SwiGLU feed-forward) is modelled")
    if _hf_bool(config, "mlp_bias", False):
        raise ValueError("from_hf_config: mlp_bias is true; feed-forward biases are not modelled")
    # Llama, Qwen3: one switch for q, k, v and o; Qwen2: q/k/v biases always (attention_bias is not
    # read); Mistral: none (the spec's bias rule)
    try:
        qkv_bias, o_bias = families.biases(spec, _hf_bool(config, "attention_bias", False))
    except ValueError as exc:
        raise ValueError(f"from_hf_config: {exc}") from None
    eps = config.get("rms_norm_eps")
    eps = spec.default_rms_norm_eps if eps is None else eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"from_hf_config: rms_norm_eps must be a number between 0 and 1, got {eps!r}")

    theta, scaling = _hf_rope(config, family)
    if name is None:
        name = str(config.get("_name_or_path") or family)
    return ModelConfig(
        name, n_layers, d_model, n_heads, n_kv, d_ff, vocab,
        tied_embeddings=_hf_bool(config, "tie_word_embeddings", False),
        source=source or "a Hugging Face config.json",
        head_dim=head_dim, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=spec.qk_norm,
        rope_theta=float(theta), rope_scaling=scaling, rms_norm_eps=float(eps),
    )


def to_hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg``, so ``transformers`` can build the same
    architecture (``from_hf_config(to_hf_config(cfg))`` gives ``cfg`` back, name and source aside).

    The family is the plainest one that has ``cfg``'s features: ``qwen3`` when it has q/k norms,
    ``qwen2`` for q/k/v biases without an output bias, ``llama`` otherwise (``attention_bias`` when
    every projection has a bias). A config with an output bias but no q/k/v biases has no family.
    """
    cfg = as_model(cfg)
    spec = families.family_for(cfg)  # ValueError for biases no family has
    out = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    if spec.bias == "attention_bias":
        out["attention_bias"] = cfg.qkv_bias
    return out


# config.json of real models, as published on the Hugging Face Hub (the fields that set the shape and
# the position encoding; read from each repository's config.json, cited in HF_SOURCES).
HF_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    },
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "sliding_window": 4096, "rms_norm_eps": 1e-05, "max_position_embeddings": 32768,
    },
    "qwen2-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
        "attention_bias": False, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
        "attention_bias": False, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
    },
}
HF_SOURCES: dict[str, str] = {
    "llama-3.1-8b": "config.json of meta-llama/Llama-3.1-8B on the Hugging Face Hub",
    "mistral-7b-v0.1": "config.json of mistralai/Mistral-7B-v0.1 on the Hugging Face Hub",
    "qwen2-7b": "config.json of Qwen/Qwen2-7B on the Hugging Face Hub",
    "qwen3-8b": "config.json of Qwen/Qwen3-8B on the Hugging Face Hub",
    "qwen3-0.6b": "config.json of Qwen/Qwen3-0.6B on the Hugging Face Hub",
}


def hf_config(name: str) -> dict:
    """A copy of the published ``config.json`` dict of the real model ``name`` (see :data:`HF_CONFIGS`)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in HF_CONFIGS:
        raise ValueError(f"no stored config.json for {name!r}; stored: {', '.join(HF_CONFIGS)}")
    return copy.deepcopy(HF_CONFIGS[key])


def get_model(name: str) -> ModelConfig:
    """Return the :class:`ModelConfig` called ``name`` (case-insensitive)."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; accepted names: {', '.join(sorted(MODELS))}")
    return MODELS[key]


def as_model(model) -> ModelConfig:
    """The model shape ``model`` stands for: a :class:`ModelConfig` as it is, or a name for
    :func:`get_model`. Every function of the course that takes a model goes through this one."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        return get_model(model)
    raise ValueError(
        f"model must be a ModelConfig (for example labsupport.models.get_model('llama-3.1-8b')) or a model "
        f"name ({', '.join(sorted(MODELS))}), got {type(model).__name__}"
    )


def list_models() -> list[str]:
    """Names accepted by :func:`get_model`."""
    return sorted(MODELS)


# A CPU preset for decode measurements: about 250 MB of fp32 weights, several times a laptop's
# last-level cache, so a decode step streams its weights from main memory as a GPU streams them
# from HBM. Head width 128 and 4 query heads per KV head, as in Llama 3.
MODELS["small-63m"] = ModelConfig(
    "small-63m", 4, 1024, 8, 2, 3584, 8192, tied_embeddings=True, source="course preset"
)

# The real models whose config.json the package stores, read through the one reader. The Llama 3.1
# 8B entry replaces the positional one above: same shape, plus its rotary scaling.
for _name in HF_CONFIGS:
    MODELS[_name] = from_hf_config(HF_CONFIGS[_name], name=_name, source=HF_SOURCES[_name])
