"""Model shapes the course computes with.

A :class:`ModelConfig` holds only the numbers that set cost: layers, widths, heads and
vocabulary. The real Llama 3.1 shapes come from the models' published ``config.json`` files
(meta-llama/Llama-3.1-8B, -70B, -405B on the Hugging Face Hub). The ``tiny-*`` presets are
small enough to run on a laptop CPU in seconds and keep the proportions that matter
(grouped-query attention, a SwiGLU feed-forward several times wider than the model).

``d_ff`` is the SwiGLU hidden width. The original recipe (Shazeer, "GLU Variants Improve
Transformer", 2020) takes 8/3 of ``d_model``, so that three matrices cost what a plain
feed-forward's two at 4x do; Llama 3.1 scales that up and rounds it (``ffn_dim_multiplier`` and
``multiple_of`` in Meta's code): 3.5x for the 8B and 70B, 3.25x for the 405B. The CPU presets use
3.5x (``tiny-2m``, ``small-63m``) and 8/3 (``tiny-20m``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The cost-relevant shape of a Llama-style decoder."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (1 means plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads


_LLAMA_SOURCE = "config.json of meta-llama/{} on the Hugging Face Hub"

MODELS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        ModelConfig(
            "llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, source=_LLAMA_SOURCE.format("Llama-3.1-8B")
        ),
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
