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

# Tokenizers (chapter 01). Vocabulary sizes are the ``vocab_size`` of each model's config.json;
# Llama 3.1 8B's is in labsupport.models.

#: Llama 2's vocabulary (its config.json, ``vocab_size``).
LLAMA2_VOCAB_SIZE = Figure(
    32_000, "ids", "Llama 2's vocabulary (SentencePiece BPE)", "Llama 2 config.json (meta-llama/Llama-2-7b-hf)"
)

#: GPT-2's vocabulary (its config.json): 50,000 merges, 256 bytes and <|endoftext|>.
GPT2_VOCAB_SIZE = Figure(50_257, "ids", "GPT-2's byte-level BPE vocabulary", "GPT-2 config.json (openai-community/gpt2)")

#: Characters per token on a sample of English data, Llama 2's tokenizer (the Llama 3 report, section 3.2).
LLAMA2_ENGLISH_CHARS_PER_TOKEN = Figure(
    3.17,
    "characters per token",
    "Llama 2's tokenizer on a sample of English data",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)

#: The same for Llama 3's 128K tokenizer (100K tiktoken tokens plus 28K for other languages).
LLAMA3_ENGLISH_CHARS_PER_TOKEN = Figure(
    3.94,
    "characters per token",
    "Llama 3's tokenizer on a sample of English data",
    "Grattafiori et al., 'The Llama 3 Herd of Models', 2024, section 3.2",
)

#: Ids Llama 3 reserves for special tokens (<|begin_of_text|>, <|eot_id|>, ...), part of its 128,256.
LLAMA3_SPECIAL_TOKENS = Figure(
    256, "ids", "ids Llama 3 reserves for special tokens",
    "meta-llama/llama3, llama/tokenizer.py (num_reserved_special_tokens)",
)
