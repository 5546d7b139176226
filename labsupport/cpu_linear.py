"""Linear layers at the CPU's memory bandwidth: weights packed once, in oneDNN's layout (chapters 12-13).

Decode reads every weight once per step for a handful of rows, so on a CPU a step costs about the
weights' bytes over the memory's read bandwidth (chapter 13's bound). ``nn.Linear`` on a CPU does
not get there: a profile of SmolLM2-135M's decode (2026-12-06, AMD EPYC with AVX-512 BF16, torch
2.13, one thread, weights out of cache) measured ``F.linear`` reading fp32 weights at about 16 GB/s
for one row, and at 16 rows compute-bound at about 60 GFLOP/s; bf16 ``F.linear`` hands oneDNN a
plain weight that it re-lays out on every call (about 15 GB/s). The same products on weights
reordered **once** into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
call torch's own compiler makes when it freezes a CPU model) ran 2.2x (fp32) and 2.5x (bf16)
faster at one row and 2.5x and 1.5x at 16 rows, bf16 reaching about 34 GB/s from one core
(``bf16`` results are bit-identical to ``F.linear``'s; fp32 differ in the last bits, from the order
of the sums).

:func:`prepack` fuses a course model's projections (:meth:`labsupport.transformer.Transformer.fuse_projections`)
and replaces every linear layer of its blocks by a :class:`PackedLinear`, and its output head by
one (the model's ``packed_head``): every entry point (``generate``, the engine, the server) then
runs the packed products. The weights stay parameters (the parameter count is unchanged; the
``state_dict`` has the fused names, ``wqkv`` and ``w13``, and the head's weight again as
``packed_head.weight``, so code that reads ``layers[i].attention.wq`` needs an unpacked model);
the packed copies add the weights' size again in memory, never in the bytes a step reads. A packed
layer repacks its weight when it changed (``model.to(dtype)``, ``load_state_dict``, a
``copy.deepcopy``) and runs the plain product if the model leaves the CPU (``model.to("cuda")``);
an edit through ``weight.data`` is not seen. Only on a CPU, with torch built with oneDNN (``torch.backends.mkldnn.is_available()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import Transformer

__all__ = ["PackedLinear", "prepack", "is_packed", "available"]


def available() -> bool:
    """Whether this torch can pack weights for the CPU (built with oneDNN)."""
    return bool(torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` reordered once into oneDNN's layout (module
    docstring). ``weight`` and ``bias`` stay parameters (the same tensors as the layer's); ``x``
    must be in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear packs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self._pack()

    def _pack(self) -> None:
        """Reorder ``weight`` into oneDNN's layout, noting which weight it was (storage, dtype, version)."""
        w = self.weight
        self._packed_from = (w.data_ptr(), w.dtype, w._version)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)  # opaque blocked layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.device.type != "cpu":  # the model was moved off the CPU after packing: the plain product
            return F.linear(x, w, self.bias)
        if self.packed is None or self._packed_from != (w.data_ptr(), w.dtype, w._version):
            self._pack()  # model.to(dtype), load_state_dict or a copy since packing: pack the weight it has now
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __getstate__(self):
        """A copy (``copy.deepcopy``, pickling) leaves the packed tensor behind (oneDNN's opaque
        tensors cannot be copied); the copy packs its own weight at its first call."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "packed": None}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def prepack(model: Transformer) -> Transformer:
    """Fuse ``model``'s projections and pack every linear layer and the output head (module
    docstring); returns the model. A model already packed is returned as it is. Raises ValueError
    on a GPU, or where torch lacks oneDNN (say what to do)."""
    if not isinstance(model, Transformer):
        raise ValueError(f"prepack takes a labsupport.transformer.Transformer, got {type(model).__name__}")
    if model.device.type != "cpu":
        raise ValueError(f"prepack is for a model on the CPU (this one is on {model.device}); a GPU's "
                         f"matmuls need no packing")
    if not available():
        raise ValueError("this torch was built without oneDNN (torch.backends.mkldnn.is_available() is False): "
                         "leave the weights unpacked")
    if is_packed(model):
        return model
    model.fuse_projections()
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child.weight, child.bias))
    head = model.tok_embeddings.weight if model.output is None else model.output.weight  # (V, d)
    model.packed_head = PackedLinear(head)
    return model


def is_packed(model: Transformer) -> bool:
    """Whether :func:`prepack` has packed ``model``."""
    return getattr(model, "packed_head", None) is not None
