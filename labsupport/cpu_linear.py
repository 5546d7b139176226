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

Packing does not win everywhere: :func:`prepack` times one row both ways and, where the plain product is
faster (an Intel Xeon with AMX, float32), runs batch-1 rows on the plain weight (``plain_rows``).
``prepack(model, "int8")`` stores the layers as chapter 09's weight-only int8 instead
(:class:`Int8Linear`: a quarter of float32's bytes for decode steps of up to four rows).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import Transformer

__all__ = ["PackedLinear", "Int8Linear", "FORMATS", "prepack", "packed_format", "is_packed", "available", "can_pack",
           "step_weight_bytes", "plain_one_row_is_faster"]


def available() -> bool:
    """Whether this torch can pack weights for the CPU (built with oneDNN)."""
    return bool(torch.backends.mkldnn.is_available())


_PACKABLE: dict[torch.dtype, bool] = {}


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU (tried once per dtype). On an AMD EPYC with
    AVX2 only (2026-12-06) torch 2.13 refuses bfloat16 with "mkldnn_reorder_linear_weight: bf16 path
    needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"; there a
    :class:`PackedLinear` of bfloat16 runs the plain ``F.linear``."""
    if dtype not in _PACKABLE:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
            _PACKABLE[dtype] = True
        except RuntimeError:
            _PACKABLE[dtype] = False
    return _PACKABLE[dtype]


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` reordered once into oneDNN's layout (module
    docstring). ``weight`` and ``bias`` stay parameters (the same tensors as the layer's); ``x``
    must be in the weight's dtype."""

    plain_rows = 0  # products of at most this many rows run F.linear on the plain weight (prepack measures it)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear packs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self._pack()

    def _pack(self) -> None:
        """Reorder ``weight`` into oneDNN's layout, noting which weight it was (storage, dtype, version);
        None where oneDNN cannot pack its dtype on this CPU (:func:`can_pack`: the plain product runs)."""
        w = self.weight
        self._packed_from = (w.data_ptr(), w.dtype, w._version)
        with torch.no_grad():  # an opaque blocked layout
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) if can_pack(w.dtype) else None

    fuses_residual = True  # forward(x, residual=r) adds r inside oneDNN's kernel (labsupport.transformer._project)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``, plus ``residual`` (the shape of the output) when given. In float32
        oneDNN adds it as the product's post-op, as it writes the output: one pass, the same numbers as
        adding after. In bfloat16 the post-op would round once where the unpacked model rounds twice, so
        the sum is taken after, and the packed model stays bit for bit the plain one."""
        w = self.weight
        grads = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)  # oneDNN's ops have no backward
        if not grads and w.device.type == "cpu" and self._packed_from != (w.data_ptr(), w.dtype, w._version):
            self._pack()  # model.to(dtype), load_state_dict or a copy since packing: pack the weight it has now
        if grads or self.packed is None or w.device.type != "cpu" or x.numel() <= self.plain_rows * self.in_features:
            out = F.linear(x, w, self.bias)  # gradients, moved off the CPU, not packable, or a row F.linear does faster
            return out if residual is None else residual + out
        if residual is not None and x.dtype == torch.float32:  # the same numbers, in one pass
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if residual is None else residual + out

    def __getstate__(self):
        """A copy (``copy.deepcopy``, pickling) leaves the packed tensor behind (oneDNN's opaque
        tensors cannot be copied); the copy packs its own weight at its first call."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "packed": None, "_packed_from": None}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class Int8Linear(nn.Module):
    """``y = x @ (codes * scales).T + bias``: the weight stored as chapter 09's weight-only int8, int8
    ``codes`` and one symmetric scale per output channel (chapter 09's rounding and clamping with one group
    per row; the scales rounded to bfloat16 first, the dtype the kernel takes them in). ``x`` must be
    bfloat16.

    Decode rows (at most :attr:`GEMV_ROWS`) run torch's weight-only int8 kernel
    (``torch.ops.aten._weight_int8pack_mm``: each int8 weight read once and converted in registers, the
    scale applied to the float32 sum), so such a step reads one byte per weight. That kernel's time grows
    with the rows, in steps of four (measured on this course's 2-core Xeon, 2026-12-06, 3072x576 layers,
    40 of them in turn so their weights come from memory: 215, 274, 408 and 482 us for 1, 4, 5 and 8 rows,
    where oneDNN on the codes took 307-367 us at every count from 1 to 8; with the weights in cache 14 ms
    for 512 rows against oneDNN's 0.9 ms), so more rows (prompts, decode batches above :attr:`GEMV_ROWS`)
    run oneDNN's packed product on the weights dequantised once to bfloat16 (``codes * scales`` rounded
    to bfloat16: within 0.4% of each weight, rounding errors that average out over a row's sum; scaling
    the codes' product after it instead, exact weights but the output rounded twice, measured a worse
    perplexity, 33.617 against 33.543, on the bench's held-out text, 2026-12-06). Those steps read the
    bfloat16 copy, two bytes per weight, and the layer holds the codes, that copy and oneDNN's packed one:
    more memory than a bfloat16 model, fewer bytes per small decode step."""

    GEMV_ROWS = 4
    fuses_residual = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"Int8Linear quantises a 2-D weight on the CPU, got {tuple(weight.shape)} on "
                             f"{weight.device}: move the model to the CPU first (model.to('cpu'))")
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            w = weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).to(torch.bfloat16).float()  # (N,): exact in bfloat16
            scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: codes 0
            codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K), as chapter 09 rounds
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.to(torch.bfloat16))  # (N,)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        dense = (codes.float() * scales[:, None]).to(torch.bfloat16)  # (N, K), rounded once to bfloat16
        self.dense = PackedLinear(nn.Parameter(dense, requires_grad=False))  # rows > GEMV_ROWS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"Int8Linear computes with bfloat16 activations, got {x.dtype}: keep a model with "
                             f"int8 weights in bfloat16 (model.to(torch.bfloat16))")
        rows = x.numel() // self.in_features
        if rows > self.GEMV_ROWS:
            out = self.dense(x)  # (..., N): oneDNN on the dequantised weights
        else:
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, self.in_features), self.codes, self.scales)
            out = out.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else residual + out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only, bf16 scales"


FORMATS = ("onednn", "int8")


def prepack(model: Transformer, weights: str = "onednn", plain_rows: int | None = None) -> Transformer:
    """Fuse ``model``'s projections and pack every linear layer and the output head (module
    docstring); returns the model. ``weights="int8"`` stores them as :class:`Int8Linear` instead (a
    bfloat16 model only). ``plain_rows`` (oneDNN only): products of at most that many rows run the
    plain ``F.linear`` (0 or 1); None measures which one-row product is faster on this CPU
    (:func:`plain_one_row_is_faster`). A model already packed the same way is returned as it is.
    Raises ValueError on a GPU, where torch lacks oneDNN, or for a model packed the other way (say
    what to do)."""
    if weights not in FORMATS:
        raise ValueError(f"weights must be one of {FORMATS}, got {weights!r}")
    if plain_rows is not None and plain_rows not in (0, 1):
        raise ValueError(f"plain_rows must be 0, 1 or None (measure), got {plain_rows!r}")
    if not isinstance(model, Transformer):
        raise ValueError(f"prepack takes a labsupport.transformer.Transformer, got {type(model).__name__}")
    if model.device.type != "cpu":
        raise ValueError(f"prepack is for a model on the CPU (this one is on {model.device}); a GPU's "
                         f"matmuls need no packing")
    if not available():
        raise ValueError("this torch was built without oneDNN (torch.backends.mkldnn.is_available() is False): "
                         "leave the weights unpacked")
    if is_packed(model):
        if packed_format(model) != weights:
            raise ValueError(f"this model is already packed as {packed_format(model)!r}, not {weights!r}: load it "
                             f"again without prepack, then prepack(model, {weights!r})")
        if weights == "onednn" and plain_rows is not None:  # an explicit choice on a packed model: applied
            _set_plain_rows(model, plain_rows)
        return model
    if weights == "int8" and model.dtype != torch.bfloat16:
        raise ValueError(f"int8 weights compute with bfloat16 activations and this model is {model.dtype}: "
                         f"model.to(torch.bfloat16) first (the server: --dtype bfloat16 --prepack int8)")
    layer = PackedLinear if weights == "onednn" else Int8Linear
    model.fuse_projections()
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, layer(child.weight, child.bias))
    head = model.tok_embeddings.weight if model.output is None else model.output.weight  # (V, d)
    model.packed_head = layer(head)
    if weights == "onednn":
        if plain_rows is None:
            projections = [m for b in model.layers for m in b.modules() if isinstance(m, PackedLinear)]
            plain_rows = int(not can_pack(model.dtype) or plain_one_row_is_faster(projections))
        _set_plain_rows(model, plain_rows)
    return model


def _set_plain_rows(model: Transformer, plain_rows: int) -> None:
    """Every packed layer of ``model`` runs products of at most ``plain_rows`` rows on the plain weight."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.plain_rows = plain_rows


def plain_one_row_is_faster(layers: list[PackedLinear], repeats: int = 7) -> bool:
    """Whether ``F.linear`` on the plain weights beats oneDNN's packed product for one row on this CPU,
    timed as decode meets it: one pass over ``layers`` (every projection of every block, in order, as a
    decode step reads them), the medians of ``repeats`` passes each, taken in turn. Packing is not a
    win everywhere: on the course's AMD EPYC (AVX-512 BF16, 2026-12-06) a packed float32 row ran 2.2x
    faster, and on its Intel Xeon (AMX, 2026-12-06) 10-40% slower than ``F.linear`` in float32 while 4 rows
    and more ran faster packed. Where the plain row wins, :func:`prepack` sets every layer's
    ``plain_rows`` to 1: decode at batch 1 runs the plain product (float32 sums in another order: equal up
    to rounding)."""
    rows = {n: torch.randn(1, n, dtype=layers[0].weight.dtype) for n in {layer.in_features for layer in layers}}
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    for i in range(repeats + 1):
        for kind in ("plain", "packed"):
            t0 = time.perf_counter()
            for layer in layers:
                x = rows[layer.in_features]  # (1, K): one row
                if kind == "plain":
                    F.linear(x, layer.weight)
                else:
                    torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")
            if i:  # the first pass warms oneDNN's primitives
                times[kind].append(time.perf_counter() - t0)
    return statistics.median(times["plain"]) < 0.95 * statistics.median(times["packed"])


def step_weight_bytes(model: Transformer) -> int:
    """The bytes of weights one decode step reads: every parameter and buffer once (a tied embedding
    once, as the output head reads it), less, for int8 weights (:class:`Int8Linear`), the embedding
    table (a step reads one row of it; the head reads its int8 codes) and the bfloat16 copies of the
    codes kept for many rows."""
    int8 = isinstance(getattr(model, "packed_head", None), Int8Linear)
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if int8 and (".dense." in name or name.startswith("packed_head.dense")
                     or name in ("tok_embeddings.weight", "output.weight")):  # the head reads its codes
            continue
        total += t.numel() * t.element_size()
    return total


def packed_format(model: Transformer) -> str | None:
    """``"onednn"`` or ``"int8"``: how :func:`prepack` packed ``model``; None if it is not packed."""
    head = getattr(model, "packed_head", None)
    return None if head is None else ("int8" if isinstance(head, Int8Linear) else "onednn")


def is_packed(model: Transformer) -> bool:
    """Whether :func:`prepack` has packed ``model`` (either format)."""
    return getattr(model, "packed_head", None) is not None
