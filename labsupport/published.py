"""Published figures the book quotes that are not datasheet rows, each with its source.

GPU datasheet figures live in :mod:`labsupport.hardware`; model shapes in
:mod:`labsupport.models`. What is here was measured or stated by someone else, in a paper, and
the book quotes it beside the course's own numbers (chapter 07 explains the attention figures).
Chapter pages compute what they show from these values and the hardware table, never retype them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    what: str
    source: str


#: FlashAttention-2's forward pass uses about 35% of an H100's peak (FA3 paper's abstract).
FA2_H100_UTILISATION = Figure(
    0.35,
    "fraction of dense peak",
    "FlashAttention-2 forward pass on an H100 SXM5",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)

#: FlashAttention-3's best fp16 forward pass on an H100 SXM5.
FA3_H100_FP16_FLOPS = Figure(
    740e12,
    "FLOP/s",
    "FlashAttention-3 forward pass, fp16, H100 SXM5 (their best case)",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)

#: Throughput of the special-function units (MUFU: exp, log, ...) on an H100 SXM5.
H100_SPECIAL_FUNCTION_OPS = Figure(
    3.9e12,
    "operations/s",
    "special-function (MUFU) throughput of an H100 SXM5, exponentials included",
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision', 2024",
)
