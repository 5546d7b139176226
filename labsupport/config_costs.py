"""What a model's ``config.json`` costs to serve, read from the file itself (chapter 02).

A serving engineer meets a model as a Hugging Face ``config.json`` and a module tree (``print(model)``),
not as a table of formulas. The two answers of lab 02's second and third exercises start there:

* :func:`params_from_config`: the parameters by component (:data:`labsupport.anatomy.COMPONENTS`)
  of a Llama, Mistral, Qwen2 or Qwen3 ``config.json`` (a dict), with each family's defaults for the
  fields the file leaves out, as :func:`labsupport.models.from_hf_config` reads them.
* :func:`decode_bytes_from_config`: the bytes one decode step reads: every weight it multiplies by
  once (a tied table, read in full as the output layer, included), one row of an untied input table
  per sequence (a lookup, not a matmul), and the keys and values of every cached token of every
  sequence. Activations are left out (a few KB per token). This is the count chapter 05's
  calibration divides measured steps by (``read_exact``), not the runbook's, which charges the whole
  input table.

Both go through :func:`labsupport.models.from_hf_config` (the one reader of a ``config.json``) and
the course's arithmetic (:func:`labsupport.anatomy.param_count_by_component`,
:func:`labsupport.costs.decode_step_bytes`, :func:`labsupport.phases.unread_embedding_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._answers import answer
from ._validate import positive_int, positive_number
from .anatomy import param_count_by_component
from .costs import decode_step_bytes
from .models import from_hf_config
from .phases import unread_embedding_bytes

__all__ = ["decode_bytes_from_config", "params_from_config"]


@answer
def params_from_config(config: Mapping) -> dict[str, int]:
    """The parameters of the model a ``config.json`` describes, by component (chapter 02):
    ``{"embedding", "attention", "feed_forward", "norms", "output"}`` -> an int each."""
    return param_count_by_component.__wrapped__(from_hf_config(config))


@answer
def decode_bytes_from_config(config: Mapping, batch: int, context_tokens: int, dtype_bytes: float = 2) -> int:
    """Bytes one decode step of ``batch`` sequences, each attending over ``context_tokens`` cached
    tokens, reads from memory (module docstring), weights and cache at ``dtype_bytes`` per element."""
    cfg = from_hf_config(config)
    batch = positive_int("batch", batch)
    context_tokens = positive_int("context_tokens", context_tokens, allow_zero=True)
    dtype_bytes = positive_number("dtype_bytes", dtype_bytes)
    read = decode_step_bytes.__wrapped__(cfg, batch, context_tokens, dtype_bytes, dtype_bytes).total
    total = read - unread_embedding_bytes(cfg, batch, dtype_bytes)
    return int(total) if total == int(total) else total
